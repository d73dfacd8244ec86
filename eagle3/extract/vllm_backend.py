"""Production extraction: a vLLM engine whose workers capture states during prefill (max_tokens=1)
and write them straight into the store. Only small records cross collective_rpc; every reply goes
through eagle3.extract.rpc.normalize_reply and is cross-checked across ranks.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from contextlib import contextmanager

from eagle3.data.conversations import Sample
from eagle3.extract import vllm_compat as compat
from eagle3.extract.capture import COPY_CHUNK_BYTES, pack_announcement
from eagle3.extract.rpc import Expect, Record, check_consistent, normalize_reply
from eagle3.store.folder import Store
from eagle3.store.format import ShardInfo, StoreError, StoreSpec, shard_tokens
from eagle3.store.threads import writer_threads

log = logging.getLogger(__name__)

SETUP_KEYS = frozenset({"rank", "tp_rank", "tp_size", "owner", "num_layers", "layer_ids", "strategy"})
COLLECT_KEYS = frozenset(
    {
        "rank",
        "owner",
        "steps",
        "tokens",
        "completed",
        "shards",
        "errors",
        "recomputed",
        "writer",
        "files_written",
        "timing",
    }
)


class VLLMBackend:
    name = "vllm"

    def __init__(
        self,
        model: str,
        spec: StoreSpec,
        tp: int = 1,
        capture: str = "auto",
        gpu_memory_utilization: float = 0.85,
        max_model_len: int | None = None,
        load_format: str = "auto",
        skip_tokenizer_init: bool = True,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
        extra_engine_args: dict | None = None,
        log_level: str | None = None,
        in_process: bool = False,
    ):
        """in_process: the engine core in this process (compat.engine_in_process), not in a process of its own."""
        import vllm

        self.spec = spec
        self.vllm = vllm
        self.strategy = compat.pick_strategy(capture)
        compat.prepare_environment(log_level or logging.getLevelName(logging.getLogger("eagle3").getEffectiveLevel()))
        kwargs = compat.engine_kwargs(
            str(model),
            strategy=self.strategy,
            layer_ids=spec.layer_ids,
            tp=tp,
            dtype="bfloat16" if spec.fp8 else spec.dtype,  # an fp8 store's states are quantized at capture
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            load_format=load_format,
            skip_tokenizer_init=skip_tokenizer_init,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            extra=extra_engine_args,
        )
        # an engine with prefix caching (extract --regenerate's): a prefill to capture must compute every row
        self.read_cache = {"skip_reading_prefix_cache": True} if kwargs.get("enable_prefix_caching") else {}
        self._keep_top: tuple[int, list | None] = (0, None)  # (k, list to fill): top_logprobs_of_capture
        self.in_process = in_process
        self._restore = compat.engine_in_process() if in_process else None
        t0 = time.perf_counter()
        try:
            self.llm = vllm.LLM(**kwargs)
        except BaseException:
            self._put_back()
            raise
        self.start_seconds = time.perf_counter() - t0
        records = self.call(
            "eagle3_setup",
            {
                "layer_ids": list(spec.layer_ids),
                "strategy": self.strategy,
                "log_level": os.environ.get("EAGLE3_LOG_LEVEL"),
            },
            keys=SETUP_KEYS,
        )
        check_consistent(records, ["num_layers", "layer_ids", "strategy", "tp_size"])
        owners = [r["rank"] for r in records if r["owner"]]
        if len(owners) != 1:
            raise StoreError(f"expected exactly one owner rank (TP rank 0 of the last stage), got {owners}")
        self.world = len(records)
        log.info(
            "vLLM engine up in %.1f s: %d worker(s), strategy %s, owner rank %d",
            self.start_seconds,
            self.world,
            self.strategy,
            owners[0],
        )

    def call(self, method: str, *args, keys: frozenset = frozenset()) -> list[dict]:
        """collective_rpc -> one validated record per rank."""
        reply = compat.collective_rpc(self.llm, method, args=args)
        world = getattr(self, "world", None) or (len(reply) if isinstance(reply, list) else 1)
        return normalize_reply(reply, Expect(world, Record(keys)))

    def generate_prefill(self, token_lists: Sequence[Sequence[int]]) -> None:
        """One prefill over the prompts (the capture takes their states); inside ``top_logprobs_of_capture`` it asks
        for the engine's top-k after each prompt as well."""
        from vllm import SamplingParams

        k, tops = self._keep_top
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, logprobs=k or None, **self.read_cache)
        outs = self.llm.generate([{"prompt_token_ids": list(t)} for t in token_lists], params, use_tqdm=False)
        if k:
            tops.extend(engine_tops(outs))

    @contextmanager
    def top_logprobs_of_capture(self, k: int):
        """While open, each capture's prefill also returns the engine's top-k next tokens after each prompt, from the
        same forward pass as the captured states: the list yielded fills with EngineTop, in the prompts' order. An
        engine need not repeat itself (Kimi-K2.5's INT4 MoE gave other top-k sets when asked twice), so a second
        run's logprobs are not those of the captured states."""
        self._keep_top = (k, [])
        try:
            yield self._keep_top[1]
        finally:
            self._keep_top = (0, None)

    def attach(self, on: bool) -> None:
        """The direct capture's callback on or off (benchmarks: the engine's cost without a capture taking states)."""
        self.call("eagle3_attach", bool(on), keys=frozenset({"rank", "attached"}))

    def top_logprobs(self, samples: Sequence[Sample], k: int):
        """The engine's own next-token distribution after each sample (max_tokens=1, logprobs=k)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=k, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": list(s.input_ids)} for s in samples], params, use_tqdm=False)
        return engine_tops(outs)

    def dump_head(self, folder) -> list[str]:
        """Each rank writes its slice of the final norm + lm_head (dummy-weight targets have no checkpoint)."""
        replies = self.call("eagle3_dump_head", str(folder), keys=frozenset({"rank", "file"}))
        return [r["file"] for r in replies if r["file"]]

    def unit_norms(self) -> int:
        """Dummy-weight targets: every decoder layer's RMSNorm weight set to 1 on every rank, the final norm left
        as it is (see eagle3_unit_norms); returns how many norms each rank set."""
        replies = self.call("eagle3_unit_norms", keys=frozenset({"norms"}))
        counts = {r["norms"] for r in replies}
        if len(counts) != 1 or 0 in counts:
            raise RuntimeError(f"ranks set {sorted(counts)} RMSNorm weights to 1; expected the same non-zero count")
        return counts.pop()

    def open_session(
        self,
        store: Store,
        cfg,
        fault=None,
        mode: str = "store",
        seal_each_batch: bool = False,
        wait_for_shards: bool = True,
    ) -> VLLMSession:
        return VLLMSession(self, store, cfg, mode, seal_each_batch, wait_for_shards=wait_for_shards)

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            compat.shutdown_engine(llm)
        self._put_back()

    def _put_back(self) -> None:
        restore, self._restore = getattr(self, "_restore", None), None
        if restore is not None:
            restore()


def engine_tops(outs) -> list:
    """vLLM's outputs of a max_tokens=1 request with logprobs -> EngineTop (greedy token, {token: logprob}) each."""
    from eagle3.extract.selfcheck import EngineTop

    return [
        EngineTop(
            int(o.outputs[0].token_ids[0]),
            {int(t): float(getattr(lp, "logprob", lp)) for t, lp in o.outputs[0].logprobs[0].items()},
        )
        for o in outs
    ]


def _some(ids: list[str]) -> str:
    return ", ".join(ids[:3]) + (f" ... ({len(ids)})" if len(ids) > 3 else "")


class VLLMSession:
    """One extraction run over an open store: announce, generate, collect, commit. A submit makes at most one RPC
    before its prefill: the collect of the batches generated since the last one, which carries this batch's
    announcement and that of the batches the caller says come next (``ahead``, up to ANNOUNCE_TOKENS tokens and
    ANNOUNCE_BYTES of states in all): their submits then make none (the engine idles during an RPC). Batches' shards,
    and their checks (tokens
    computed, samples captured), come with the next collect or finish; their copies overlap the next prefill. A
    prefill that fails loses the uncollected batches' shards with its own (uncommitted: a rerun redoes them).
    Batches announced ahead and never submitted are withdrawn by finish. With ``seal_each_batch`` a batch is
    announced, generated and sealed in its own submit (online training's spool reserves room per batch, and its
    trainer must not wait on a shard still open), which returns once every sample of it is in a written shard, or
    with ``wait_for_shards=False`` once they are in shards handed to the writer: those come with a later submit,
    settle or finish, and the next batch's prefill overlaps their write (and fsync)."""

    ANNOUNCE_TOKENS = 1 << 18  # tokens announced in one RPC at most (64x512 batches: 8; the worker keeps them)
    # and states (bytes) announced in one RPC at most: a group's shards are committed only at the collect after it,
    # so the store holds up to a group more than it has committed (a reader of the manifest cannot have them yet).
    # Larger groups let a page-cache store's folder pass the kernel's writeback threshold, and its rate collapses.
    ANNOUNCE_BYTES = 4 << 30

    def __init__(
        self,
        backend: VLLMBackend,
        store: Store | None,
        cfg,
        mode: str = "store",
        seal_each_batch: bool = False,
        slots: int = 4,
        copy_chunk_bytes: int = COPY_CHUNK_BYTES,
        gil_sampler: bool = False,
        wait_for_shards: bool = True,
    ):
        self.backend, self.mode, self.seal_each_batch = backend, mode, seal_each_batch
        self.wait_for_shards = wait_for_shards
        spec = store.spec if store is not None else backend.spec  # the store decides the states' dtype (fp8)
        self.announce_tokens = min(self.ANNOUNCE_TOKENS, self.ANNOUNCE_BYTES // spec.bytes_per_token)
        threads = max(writer_threads(getattr(cfg, "fsync", True)), getattr(cfg, "writer_threads", 0) or 0)
        open_cfg = {
            "mode": mode,
            "hidden_size": spec.hidden_size,
            "dtype": spec.dtype,
            "writer_threads": threads,
            "slots": slots,
            "copy_chunk_bytes": copy_chunk_bytes,
            "gil_sampler": gil_sampler,
        }
        if mode == "store":
            open_cfg.update(
                root=str(store.root),
                spec=store.spec.to_json(),
                start_index=store.next_shard_index,
                shard_tokens=shard_tokens(store.spec, cfg.shard_tokens),
                fsync=cfg.fsync,
            )
        backend.call("eagle3_open", open_cfg, keys=frozenset({"rank", "mode"}))
        self.tokens = 0  # prompt tokens the engine computed so far in this session
        self.recomputed = 0  # prompt rows the engine computed again after preempting their request
        self.capture_timing: dict = {}  # the owner's CaptureStats.timing() at the last collect (this session)
        # the driver's seconds per phase of submit (the engine idles during the RPCs: none in plain prefill);
        # expect_s: a separate announce (seal_each_batch only), collect_s: the collect and the announce it carries
        self.phase_s = {"expect_s": 0.0, "generate_s": 0.0, "collect_s": 0.0}
        self.pending_tokens: int | None = None  # prompt tokens of the submitted batches not yet collected
        self.announced: deque[list[str]] = deque()  # sample ids of batches announced ahead, not yet submitted
        self.finished = False  # the workers closed the session (finish); close() then has nothing to end

    def submit(self, batch: Sequence[Sample], ahead: Sequence[Sequence[Sample]] = ()) -> list[ShardInfo]:
        """The shards completed since the last collect (this batch's own, too, with seal_each_batch). ``ahead``:
        the batches the caller will submit next, in order (announced with this one while they fit)."""
        tokens = sum(len(s) for s in batch)
        if self.seal_each_batch:
            t0 = time.perf_counter()
            self.backend.call("eagle3_expect", *pack_announcement(batch), keys=frozenset({"rank", "announced"}))
            self.phase_s["expect_s"] += time.perf_counter() - t0
            self._generate(batch)
            t0 = time.perf_counter()
            infos = self._collect("eagle3_collect", tokens, False, True, None, None, self.wait_for_shards)
            self.phase_s["collect_s"] += time.perf_counter() - t0
            return infos
        infos: list[ShardInfo] = []
        ids = [s.sample_id for s in batch]
        if self.announced:
            want = self.announced.popleft()
            if want != ids:
                raise ValueError(
                    f"submitted a batch of samples {_some(ids)}, but the next batch announced ahead "
                    f"holds {_some(want)}: submit the batches passed as `ahead`, in their order"
                )
        else:
            group, room = [batch], self.announce_tokens - tokens
            for b in ahead:
                room -= sum(len(s) for s in b)
                if room < 0:
                    break
                group.append(b)
            t0 = time.perf_counter()
            infos = self._collect(
                "eagle3_collect",
                self.pending_tokens,
                False,
                False,
                list(pack_announcement([s for b in group for s in b])),
            )
            self.phase_s["collect_s"] += time.perf_counter() - t0
            self.pending_tokens = 0
            self.announced.extend([s.sample_id for s in b] for b in group[1:])
        self.pending_tokens = (self.pending_tokens or 0) + tokens
        self._generate(batch)
        return infos

    def _generate(self, batch: Sequence[Sample]) -> None:
        t0 = time.perf_counter()
        self.backend.generate_prefill([s.input_ids for s in batch])
        self.phase_s["generate_s"] += time.perf_counter() - t0

    def settle(self) -> list[ShardInfo]:
        """Sealed batches (seal_each_batch): every shard not yet reported, once written; the session goes on."""
        t0 = time.perf_counter()
        infos = self._collect("eagle3_collect", 0, False, True)
        self.phase_s["settle_s"] = self.phase_s.get("settle_s", 0.0) + time.perf_counter() - t0
        return infos

    def finish(self) -> list[ShardInfo]:
        """Every shard not yet reported; batches announced ahead and never submitted are withdrawn."""
        withdrawn = [sid for ids in self.announced for sid in ids]
        self.announced.clear()
        infos = self._collect("eagle3_close", self.pending_tokens, withdrawn)
        self.pending_tokens, self.finished = None, True
        return infos

    def close(self) -> None:
        """End the workers' session where finish did not (a loop that failed or was interrupted), so that the owner's
        writer threads end, and write nothing more, before the store is released. An error here is logged, not
        raised: the loop's error is the one the caller sees."""
        if self.finished:
            return
        try:
            self.backend.call("eagle3_end", keys=frozenset({"rank"}))
        except Exception as e:  # noqa: BLE001 - the engine may be what failed
            log.warning("could not end the engine's capture session: %s: %s", type(e).__name__, e)

    def _collect(self, method: str, expected_tokens: int | None, *args) -> list[ShardInfo]:
        records = self.backend.call(method, *args, keys=COLLECT_KEYS)
        errors = [f"rank {r['rank']}: {e}" for r in records for e in r["errors"]]
        if errors:
            raise StoreError("capture failed: " + "; ".join(errors[:5]))
        check_consistent(records, ["steps", "tokens"])  # every rank ran the same steps over the same tokens
        writers = [r["rank"] for r in records if r["writer"] or r["files_written"]]
        if writers != ([next(r["rank"] for r in records if r["owner"])] if self.mode == "store" else []):
            raise StoreError(
                f"ranks {writers} opened a shard writer or wrote shard files; only the owner rank "
                "(TP rank 0) may write: racing writers would overwrite each other's files"
            )
        tokens = records[0]["tokens"]
        if expected_tokens is not None and tokens - self.tokens < expected_tokens:
            raise StoreError(
                f"the engine computed {tokens - self.tokens} prompt tokens for batches of "
                f"{expected_tokens} since the last check: some were skipped (prefix caching?)"
            )
        self.tokens = tokens
        owner = next(r for r in records if r["owner"])
        if owner["recomputed"] > self.recomputed:
            log.info(
                "preemption: the engine recomputed %d prompt rows so far (captured once each)", owner["recomputed"]
            )
        self.recomputed = owner["recomputed"]
        self.capture_timing = owner["timing"]
        log.debug(
            "%s: %d shards from the owner, %d samples completed", method, len(owner["shards"]), owner["completed"]
        )
        return [ShardInfo(**s) for s in owner["shards"]]
