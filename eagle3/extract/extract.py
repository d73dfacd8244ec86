"""Extraction: samples -> a backend (hf or vllm) -> shard store, resumable at shard granularity.

Rerunning the same command after a crash continues: the store's manifest says which samples are
committed; files it does not name are removed when the store opens, and their samples are redone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3 import faults
from eagle3.data.conversations import DataConfig, Sample, load_samples
from eagle3.extract.local_session import LocalSession
from eagle3.extract.timeline import rate_past_first
from eagle3.store import lock as store_lock
from eagle3.store import status as store_status
from eagle3.store.committer import BackgroundCommitter
from eagle3.store.folder import Store, claim, read_manifest
from eagle3.store.format import MANIFEST, StoreError, StoreSpec
from eagle3.targets.layers import default_layer_ids, validate_layer_ids
from eagle3.targets.presets import config_hash, read_model_config

if TYPE_CHECKING:
    from eagle3.extract.one_pass import Generation

log = logging.getLogger(__name__)
# batches announced to the engine's workers in one RPC at most (vLLM): the submit of the first, the next ones' ride
# on it (VLLMSession also caps the tokens); their shards are collected, and committed, together
ANNOUNCE_BATCHES = 8


@dataclass
class ExtractConfig:
    model: str  # target folder (config.json, weights, tokenizer)
    out: str  # store folder
    data: DataConfig | None = None  # conversations; or pass samples to run()
    backend: str = "hf"  # hf | vllm
    layer_ids: tuple[int, ...] | None = None  # default (2, L//2, L-3, L)
    batch_size: int = 8  # samples per backend call
    dtype: str = "bfloat16"  # dtype of stored states: bfloat16 | float16 | float32 | float8_e4m3fn
    device: str = "cpu"  # hf backend
    compute_dtype: str | None = None  # hf backend; None = the checkpoint's dtype
    shard_tokens: int | None = None  # default: about 512 MiB of states per shard
    shard_samples: int | None = None
    writer_threads: int = 1
    fsync: bool = True
    tp: int = 1  # vllm backend
    capture: str = "auto"  # vllm backend: auto (direct, else aux, else hooks) | hooks | aux | direct
    vllm_kwargs: dict = field(default_factory=dict)
    selfcheck: int = 4  # prompts for the final-state self-check before storing (0 = skip)
    trust_remote_code: bool = False  # the target's tokenizer or model runs code from its folder (auto_map)
    recipe: dict | None = None  # the CLI options, recorded for `extract --resume` (recipe.py)
    regenerate: Generation | None = None  # the target writes each last assistant turn, captured in the same
    # pass (one_pass.py); None: the data's turns
    fault: Callable[[str], None] | None = None  # tests: kill points


@dataclass
class ExtractSummary:
    store: str
    samples_total: int
    samples_done_before: int
    samples_written: int
    tokens_written: int
    seconds: float
    bytes_written: int
    data_report: str = ""
    selfcheck: str = ""
    recomputed_rows: int = 0  # vLLM: prompt rows computed again after a preemption (captured once each)
    generation: str = ""  # --regenerate: tokens generated, how the turns ended, rows computed twice
    # each batch as its submit returned and its commit was queued: (perf_counter, tokens), as online.py's commits
    batches: list[tuple[float, int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_written / self.seconds if self.seconds > 0 else 0.0

    def sustained_tokens_per_s(self) -> float:
        """The batches after the first over the time from the first's end to the last's: no first prefill's warm-up,
        no final flush, the window online.OnlineResult.sustained_tokens_per_s takes of the extraction beside a
        trainer. tokens_per_s where fewer than two batches ran."""
        rate = rate_past_first(self.batches)
        return self.tokens_per_s if rate is None else rate

    def lines(self) -> list[str]:
        return (
            [
                f"store      {self.store}",
                f"samples    {self.samples_written} written now, {self.samples_done_before} already there, "
                f"{self.samples_total} planned",
                f"tokens     {self.tokens_written} in {self.seconds:.1f} s = {self.tokens_per_s:,.0f} tok/s",
                f"bytes      {self.bytes_written / 2**20:,.1f} MiB"
                + (
                    f" = {_rate(self.bytes_written / self.seconds)} (`eagle3 bench disk` says what the disk can take)"
                    if self.seconds
                    else ""
                ),
            ]
            + ([f"generated  {self.generation}"] if self.generation else [])
            + ([f"data       {self.data_report}"] if self.data_report else [])
            + ([f"check      {self.selfcheck}"] if self.selfcheck else [])
        )


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:,.2f} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:,.1f} MB/s"


def store_spec(model: str | Path, layer_ids: Sequence[int] | None, dtype: str) -> StoreSpec:
    cfg = read_model_config(model)
    text = cfg.get("text_config") or cfg
    num_layers = int(text["num_hidden_layers"])
    ids = validate_layer_ids(layer_ids, num_layers) if layer_ids else default_layer_ids(num_layers)
    target = {
        "name_or_path": str(Path(model).resolve()),
        "config_hash": config_hash(cfg),
        "architecture": (cfg.get("architectures") or ["?"])[0],
        "num_hidden_layers": num_layers,
        "vocab_size": int(text["vocab_size"]),
    }
    return StoreSpec(target=target, layer_ids=ids, hidden_size=int(text["hidden_size"]), dtype=dtype)


def make_backend(cfg: ExtractConfig, spec: StoreSpec):
    if cfg.backend == "hf":
        from eagle3.extract.hf_backend import HFBackend

        return HFBackend(
            cfg.model,
            spec.layer_ids,
            device=cfg.device,
            compute_dtype=cfg.compute_dtype,
            out_dtype="bfloat16" if spec.fp8 else cfg.dtype,
            trust_remote_code=cfg.trust_remote_code,
        )  # fp8: quantized by the shard writer
    if cfg.backend == "vllm":
        from eagle3.extract.vllm_backend import VLLMBackend

        kw = dict(cfg.vllm_kwargs)
        if cfg.trust_remote_code:
            kw["extra_engine_args"] = {"trust_remote_code": True, **(kw.get("extra_engine_args") or {})}
        if cfg.regenerate is not None:  # one pass: the last token's row from the prefix cache's tail (one_pass.py)
            kw["extra_engine_args"] = {"enable_prefix_caching": True, **(kw.get("extra_engine_args") or {})}
            if cfg.data is not None and not kw.get("max_model_len"):
                kw["max_model_len"] = cfg.data.max_len + 1  # the tail request: a sample's tokens and one more
        return VLLMBackend(cfg.model, spec, tp=cfg.tp, capture=cfg.capture, **kw)
    raise ValueError(f"unknown backend {cfg.backend!r}: use hf or vllm")


def load_dataset(cfg: ExtractConfig):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    return load_samples(cfg.data, tokenizer, tokenizer_where=f"{cfg.model} (tokenizer)")


def run(
    cfg: ExtractConfig, samples: Sequence[Sample] | None = None, backend=None, progress: bool = True
) -> ExtractSummary:
    """Extract every sample not yet in the store at cfg.out. ``backend`` may be passed in to reuse an engine."""
    fault = cfg.fault or faults.from_env()
    report = ""
    claim(cfg.out)  # before anything (rejects.jsonl) is written into it: a new, empty or store folder
    if (Path(cfg.out) / MANIFEST).exists():
        store_lock.refuse_if_busy(cfg.out, "extract")
        said = resume_line(cfg.out)
        if said:
            log.warning("%s", said)
    if samples is None:
        if cfg.data is None:
            raise ValueError("give conversations (cfg.data) or samples")
        if cfg.data.rejects_path is None:
            cfg.data.rejects_path = str(Path(cfg.out) / "rejects.jsonl")
        if cfg.regenerate is not None:
            from transformers import AutoTokenizer

            from eagle3.extract import one_pass

            samples, rep = one_pass.load_prompts(
                cfg.data,
                AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code),
                cfg.regenerate,
            )
        else:
            samples, rep = load_dataset(cfg)
        report = rep.summary()
        log.info("data: %s", report)
    spec = store_spec(cfg.model, cfg.layer_ids, cfg.dtype)
    if cfg.backend == "vllm" and backend is None:
        from eagle3.preflight import vllm_installed

        vllm_installed("extract --backend vllm")  # before the store folder is made
    store = Store.open(cfg.out, spec, create=True, fsync=cfg.fsync, lock=True)
    try:
        return _run_locked(cfg, samples, backend, progress, store, spec, fault, report)
    finally:
        store.release()


def resume_line(root: str | Path) -> str | None:
    """'resuming: N of M samples already stored in ROOT' for a store with samples, else None (JSON only)."""
    counted = store_status.counts(root)
    return f"resuming: {store_status.stored(root, counted)} already stored in {root}" if counted[0] else None


def _run_locked(
    cfg: ExtractConfig, samples, backend, progress: bool, store: Store, spec: StoreSpec, fault, report: str
) -> ExtractSummary:
    ids = [s.sample_id for s in samples]
    if len(set(ids)) != len(ids):
        raise ValueError("sample ids repeat; each sample needs its own id")
    plan = store.plan()
    if plan is not None and plan != ids:
        raise StoreError(
            f"{cfg.out} was planned for a different sample list ({len(plan)} samples, this run "
            f"{len(ids)}); use a new --out folder or the same data and options"
        )
    if plan is None:
        store.write_plan(ids, fsync=cfg.fsync, recipe=cfg.recipe)
    done_before = len(store.done_ids)
    todo = [s for s in samples if s.sample_id not in store.done_ids]
    own_backend = backend is None
    backend = backend or make_backend(cfg, spec)
    check_line = ""
    if cfg.selfcheck and todo:
        try:
            check = todo[: cfg.selfcheck]  # --regenerate: the prompts (the check needs no generated turn)
            check_line = require_final_state(
                backend, store, cfg, [s.as_sample() if hasattr(s, "as_sample") else s for s in check]
            )
        except BaseException:
            if own_backend:
                backend.close()
            raise
    if cfg.regenerate is not None:
        return _run_one_pass(
            cfg, samples, todo, done_before, backend, own_backend, progress, store, fault, report, check_line
        )
    t0 = time.perf_counter()
    written_tokens = written_bytes = 0
    bar = _progress(progress, total=sum(len(s) for s in todo), unit="tok", desc=f"extract ({cfg.backend})")
    committer = BackgroundCommitter(store, fsync=cfg.fsync, fault=fault)  # overlaps the next batch
    session = None
    timeline: list[tuple[float, int]] = []
    try:
        session = open_session(backend, store, cfg, fault)
        batches = [todo[start : start + cfg.batch_size] for start in range(0, len(todo), cfg.batch_size)]
        for i, batch in enumerate(batches):
            infos = session.submit(batch, ahead=batches[i + 1 : i + ANNOUNCE_BATCHES])
            committer.commit(infos)
            timeline.append((time.perf_counter(), sum(len(s) for s in batch)))
            written_tokens += sum(i.num_tokens for i in infos)
            written_bytes += sum(i.bytes for i in infos)
            bar.update(timeline[-1][1])
        infos = session.finish()
        committer.commit(infos)
        committer.close()
        recomputed = getattr(session, "recomputed", 0)
        written_tokens += sum(i.num_tokens for i in infos)
        written_bytes += sum(i.bytes for i in infos)
    finally:
        if session is not None:
            session.close()  # a failing or interrupted loop: its writer threads end before the process may
        committer.close(raise_errors=False)  # a failing loop: what was queued is committed, its error stands
        bar.close()
        if own_backend:
            backend.close()
    missing = set(ids) - store.done_ids
    if missing:
        raise StoreError(f"{len(missing)} samples were not written (e.g. {sorted(missing)[:3]})")
    return ExtractSummary(
        str(cfg.out),
        len(samples),
        done_before,
        len(todo),
        written_tokens,
        time.perf_counter() - t0,
        written_bytes,
        report,
        check_line,
        recomputed,
        batches=timeline,
    )


def _run_one_pass(
    cfg: ExtractConfig,
    prompts,
    todo,
    done_before: int,
    backend,
    own_backend: bool,
    progress: bool,
    store: Store,
    fault,
    report: str,
    check_line: str,
) -> ExtractSummary:
    """--regenerate: batches of prompts generated and captured in one pass (one_pass.py), committed as they come."""
    from transformers import AutoTokenizer

    from eagle3.data import masks
    from eagle3.extract import one_pass

    stops = masks.stop_ids(AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code))
    t0 = time.perf_counter()
    bar = _progress(progress, total=len(todo), unit="sample", desc=f"extract --regenerate ({cfg.backend})")
    committer = BackgroundCommitter(store, fsync=cfg.fsync, fault=fault)
    session = None
    try:
        session = one_pass.open_session(backend, store, cfg, cfg.regenerate, stops, fault)
        batches = [todo[start : start + cfg.batch_size] for start in range(0, len(todo), cfg.batch_size)]
        tokens, nbytes, stats = one_pass.run_batches(session, batches, committer, bar)
        committer.close()
    finally:
        if session is not None:
            session.close()
        committer.close(raise_errors=False)
        bar.close()
        if own_backend:
            backend.close()
    missing = {p.sample_id for p in prompts} - store.done_ids
    if missing:
        raise StoreError(f"{len(missing)} samples were not written (e.g. {sorted(missing)[:3]})")
    return ExtractSummary(
        str(cfg.out),
        len(prompts),
        done_before,
        len(todo),
        tokens,
        time.perf_counter() - t0,
        nbytes,
        report,
        check_line,
        stats.recomputed,
        stats.line(),
    )


def require_final_state(backend, store: Store, cfg: ExtractConfig, samples: Sequence[Sample]) -> str:
    """final_state_check, and SelfCheckFailed (nothing stored yet) when it fails. Returns its line."""
    result = final_state_check(backend, store, cfg, samples)
    log.info("%s", result.line())
    if not result.ok:
        from eagle3.extract.selfcheck import SelfCheckFailed

        raise SelfCheckFailed(
            f"{result.line()}. The captured id-{store.spec.layer_ids[-1]} states do not reproduce the engine's own "
            "next token through its final norm and lm_head: they are not the last layer's output before the norm "
            "(a post-norm state, another layer, or misaligned rows). Nothing was stored. Check the layer ids "
            "and the vLLM version (`eagle3 doctor`); --no-selfcheck skips this check."
        )
    return result.line()


def final_state_check(backend, store: Store, cfg: ExtractConfig, samples: Sequence[Sample]):
    """Extract ``samples`` through the production path into a scratch store (STORE/.selfcheck), read their
    last-token id-L states back and compare them, through the target's final norm and lm_head, with the
    engine's own next-token logprobs for the same prompts. The scratch store is removed afterwards."""
    import shutil

    from eagle3.extract import selfcheck

    scratch = Path(cfg.out) / ".selfcheck"
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        stored, engine = captured_with_engine_top(backend, store.spec, cfg, samples, scratch)
        states = selfcheck.last_states(stored, store.spec.layer_ids[-1])
        return selfcheck.compare(selfcheck.head_for(cfg.model, backend, scratch), states, engine)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def captured_with_engine_top(backend, spec: StoreSpec, cfg: ExtractConfig, samples: Sequence[Sample], scratch):
    """``samples`` captured through the production path into a scratch store at ``scratch``: (the stored samples, in
    ``samples``' order; the engine's top-K next tokens after each). vLLM's top-K come from the capture's own forward
    pass (an engine need not repeat itself); the hf backend, deterministic, is asked again."""
    from contextlib import nullcontext
    from dataclasses import replace

    from eagle3.extract import selfcheck

    tmp = Store.open(scratch, spec, create=True, fsync=False)
    tcfg = replace(cfg, fsync=False, fault=None, out=str(scratch))
    same_pass = getattr(backend, "top_logprobs_of_capture", None)
    with same_pass(selfcheck.K) if same_pass else nullcontext() as tops:
        session = open_session(backend, tmp, tcfg, None)
        try:
            tmp.commit(session.submit(samples), fsync=False)
            tmp.commit(session.finish(), fsync=False)
        finally:
            session.close()
    by_id = {s["sample_id"]: s for s in tmp.iter_samples()}
    stored = [by_id[s.sample_id] for s in samples]
    if tops is None:
        return stored, backend.top_logprobs(samples, selfcheck.K)
    if len(tops) != len(samples):
        raise StoreError(f"the self-check's capture returned the engine's top-k for {len(tops)} of {len(samples)} "
                         "prompts: it ran them in more than one prefill or dropped some")  # fmt: skip
    return stored, tops


def check_store(root: str | Path, model: str | Path, backend: str = "hf", samples: int = 8, device: str = "cpu"):
    """`verify --semantic`: the final-state self-check on stored samples. The target (hf on CPU/GPU, or a vLLM
    engine) produces its next-token logprobs after each stored prompt; the stored last-token id-L state, through
    the target's final norm and lm_head, must reproduce them. Returns a selfcheck.SelfCheckResult."""
    import itertools
    import tempfile

    from eagle3.extract import selfcheck

    store = Store(Path(root), read_manifest(root))
    got = list(itertools.islice(store.iter_samples(), samples))
    if not got:
        raise selfcheck.SelfCheckFailed(f"{root} holds no samples to check")
    prompts = [Sample(s["sample_id"], tuple(s["input_ids"].tolist()), tuple(s["loss_mask"].tolist())) for s in got]
    engine = make_backend(ExtractConfig(model=str(model), out=str(root), backend=backend, device=device), store.spec)
    try:
        tops = engine.top_logprobs(prompts, selfcheck.K)
        with tempfile.TemporaryDirectory() as tmp:
            head = selfcheck.head_for(model, engine, tmp)
    finally:
        engine.close()
    return selfcheck.compare(head, selfcheck.last_states(got, store.spec.layer_ids[-1]), tops)


def open_session(
    backend, store: Store, cfg: ExtractConfig, fault=None, seal_each_batch: bool = False, wait_for_shards: bool = True
):
    """The backend's writing session into ``store``: vLLM's ranks write shards themselves; the hf backend's
    states come back here and go to a ShardWriter. ``submit(batch)`` returns the shards finished so far;
    with ``seal_each_batch`` it cuts the open shard and waits for it: every sample of the batch is in them. With
    ``wait_for_shards=False`` as well it does not wait for their write: a later submit, ``settle()`` (which waits)
    or finish reports them. ``close()`` ends a session that did not finish: its writer threads end."""
    if hasattr(backend, "open_session"):
        return backend.open_session(store, cfg, fault, seal_each_batch=seal_each_batch, wait_for_shards=wait_for_shards)
    return LocalSession(backend, store, cfg, fault, seal_each_batch, wait_for_shards)


def _progress(enabled: bool, **kw):
    from tqdm import tqdm

    return tqdm(disable=not enabled, dynamic_ncols=True, **kw)
