"""Train an EAGLE-3 draft (speculators' Eagle3DraftModel) on a shard store.

Per sample (speculators' shift, speculators/models/eagle3/data.py shift_batch): input_ids[1:], aux
states[:-1] (concatenated in ascending layer order, [T-1, n_aux*H]), last-layer states[1:] -> the target's
distribution through its final norm and lm_head (KL loss), loss mask[1:], positions 1..T-1. So row i pairs
token x[i+1] with the aux states of token i, as vLLM's drafter does (llm_base_proposer: input_ids[:n-1] =
target_token_ids[1:], hidden_states = target_hidden_states; its positions are one lower, which RoPE, being
relative, does not see). At training-time-test step j the loss compares row i's logits with the target of
row i+j (metrics.align_for_step). In packed rows the first ``ttt_steps - 1`` targets of every sample after the
first are masked, so no step compares a sample's logits with the next sample's targets.

One optimizer step = ``batch_samples`` samples (the global batch, split over ranks under torchrun/DDP);
the loss is the mean over those samples, so 1 and N processes follow the same curve.

Nothing silent: each shard's checksum is checked the first time it is read, every sample's states are
checked finite, a non-finite loss or gradient norm stops the run (no optimizer step, nothing written).
Checkpoints every ``checkpoint_minutes`` of work (and/or ``checkpoint_every`` steps), the newest
``keep_checkpoints`` kept; a rerun of the same command resumes from the newest complete one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import shlex
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from eagle3 import faults, interrupt, ownership, preflight
from eagle3.machine import TrainChoice
from eagle3.store.files import checksum_matches
from eagle3.store.finite import all_finite, nonfinite_layers
from eagle3.store.folder import Store
from eagle3.store.format import FP8, StoreError, StoreMismatch, read_states
from eagle3.targets.layers import aux_ids
from eagle3.targets.presets import config_hash, read_model_config
from eagle3.train import checkpoint, compile_watch, serve_line
from eagle3.train.draft import SERVE_TPS, DraftShape, check_servable, draft_vocab, speculators_config
from eagle3.train.shard_checks import ShardChecks

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    store: str
    out: str
    target: str | None = None  # verifier folder; default: the store's target
    draft_vocab_size: int = 32000  # clamped to the target vocabulary
    ttt_steps: int = 3
    ttt_step_loss_decay: float = 1.0
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 0
    epochs: int = 1
    max_steps: int | None = None
    batch_samples: int = 8  # global batch (samples per optimizer step)
    pack_tokens: int = 0  # >0: pack a rank's samples into sequences of up to this many
    # tokens (one forward each; loss is then a token mean per pack)
    max_grad_norm: float = 1.0
    seed: int = 0
    checkpoint_every: int = 0  # steps; 0 = by time only
    checkpoint_minutes: float = 10.0  # minutes of work between checkpoints; 0 = by steps only
    keep_checkpoints: int = 3  # newest complete checkpoints kept (0 = all)
    checkpoint_background: bool | None = None  # write checkpoints in a thread while training goes on (the final one
    # not: it is published); None: on CUDA (checkpoint.Background)
    on_bad_sample: str = "stop"  # stop | skip (skipped samples are counted and reported)
    serve_tps: tuple[int, ...] | None = None  # TP sizes the exported draft must load at in vLLM (None: SERVE_TPS;
    # for an MLA draft those of them its target's heads split over)
    export_dtype: str = "bfloat16"  # dtype of the published draft
    device: str = "cpu"
    dtype: str = "float32"  # training dtype of the draft and its inputs
    precision: str = "auto"  # auto: bf16-mixed on CUDA (fp32 weights and optimizer, bf16 matmuls under
    # autocast) when dtype is float32, fp32 on the CPU; or fp32 | bf16-mixed
    loss: str = "kl_div"
    loss_impl: str = "auto"  # chunked (train/chunked_loss.py) | eager | fused (Triton, GPU);
    # auto: chunked on CUDA (no float32 [T, V] kept per TTT step), eager on CPU
    attn_impl: str = "sdpa"  # sdpa (speculators' dense mask) | varlen (train/ttt_attention.py: no
    # mask) | flex (speculators' block mask): `train --attn`
    compile: bool = False
    resume: bool = True
    speculative_tokens: int | None = None  # written to the config; default ttt_steps
    shape: dict = field(default_factory=dict)  # DraftShape overrides
    draft_arch: str = "llama"  # llama (speculators' layer) | mla (DeepSeek MLA: Eagle3DeepseekV3ForCausalLM)
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm on each aux state before fc
    norm_output: bool = False  # EAGLE-3.1: the post-norm state feeds the next draft step
    allow_incomplete: bool = False  # train on a store that holds fewer samples than its plan names
    read_ahead: bool = True  # read step s + 1's samples while step s trains (train/read_ahead.py)
    restart_hint: str = "--no-resume starts over"  # what the resume warning tells the user (demo: its own way)


def checkpoint_background(cfg: TrainConfig) -> bool:
    """Whether cfg's checkpoints are written in a thread while training goes on: as set, else on CUDA (at Kimi-K2.5's
    draft size a checkpoint is 12 GB, 22-24 s with its export on an H200; the GPU idle meanwhile)."""
    return cfg.device.startswith("cuda") if cfg.checkpoint_background is None else cfg.checkpoint_background


class BadData(StoreError):
    """A stored sample the trainer must not learn from (checksum mismatch, NaN/Inf states)."""


class TrainingDiverged(RuntimeError):
    """A non-finite loss or gradient: the run stops before the optimizer step, nothing is written."""


@dataclass
class TrainResult:
    out: str
    draft: str
    steps: int
    samples_seen: int
    tokens_seen: int
    seconds: float
    losses: list[float]
    accept: dict[str, float]
    resumed_from: int = 0
    skipped: dict[str, str] = field(default_factory=dict)  # sample id -> why (on_bad_sample="skip")
    tokens_this_run: int = 0
    notes: list[str] = field(default_factory=list)  # what the run decided that the user should know
    phases: dict[str, float] = field(default_factory=dict)  # seconds: setup (before the first step; not in
    # ``seconds``), reading (the steps waited for their samples), steps, checkpoints (saved and published)
    timeline: list[tuple[float, int]] = field(default_factory=list)  # per step of this run: (seconds from the first
    # step's start to this step's end, before any checkpoint; tokens the step trained, every rank's)
    started_at: float = 0.0  # time.perf_counter() when the first step began (to line the timeline up with other clocks)
    setup: str = ""  # device, precision, attention, compile, packing
    serve: str = ""  # the `vllm serve` command for the published draft ("" until the last step published it)

    @property
    def tokens_per_s(self) -> float:
        """Tokens trained in this process's run per second (0 when a rerun found the work done)."""
        return self.tokens_this_run / self.seconds if self.seconds > 0 else 0.0

    def later_steps(self, after: float = 0.5) -> tuple[int, float, float] | None:
        """The steps past the first ``after`` of this run's: (k, from, to), the steps timeline[k:] (k = floor(n x after)
        >= 1), from the end of step k to the end of the last in the timeline's seconds (add started_at for
        time.perf_counter()'s clock); None where the run has no step past k."""
        k = max(1, int(len(self.timeline) * after))
        if len(self.timeline) <= k:
            return None
        return k, self.timeline[k - 1][0], self.timeline[-1][0]

    def sustained_tokens_per_s(self, after: float = 0.5) -> float:
        """Tokens a second over the steps past the first ``after`` of this run's (later_steps): no first-step warm-up,
        no setup, no final checkpoint. The whole run's rate where it has one step."""
        later = self.later_steps(after)
        if later is None:
            return self.tokens_per_s
        k, a, b = later
        return sum(t for _, t in self.timeline[k:]) / (b - a) if b > a else 0.0

    def lines(self) -> list[str]:
        a, b = (self.losses[0], self.losses[-1]) if self.losses else (float("nan"),) * 2
        acc = ", ".join(f"{k} {v:.3f}" for k, v in self.accept.items())
        run = (
            f"already trained: nothing to do (checkpoint at step {self.resumed_from})"
            if self.resumed_from == self.steps
            else f"{self.tokens_this_run} tokens in {self.seconds:.1f} s = {self.tokens_per_s:,.0f} tok/s"
            + (f" (resumed from step {self.resumed_from})" if self.resumed_from else "")
        )
        lines = [
            f"draft      {self.draft}",
            f"setup      {self.setup}",
            f"steps      {self.steps} ({self.samples_seen} samples, {self.tokens_seen} tokens); this run: {run}",
            f"loss       {a:.4f} -> {b:.4f}",
            f"accuracy   {acc}",
        ]
        if self.phases:
            lines.append(
                "time       "
                + ", ".join(f"{k} {v:.1f} s" for k, v in self.phases.items())
                + " (reading: what the steps waited for their samples)"
                + (
                    f"; sustained {self.sustained_tokens_per_s():,.0f} tok/s (the later half of the steps)"
                    if len(self.timeline) > 1
                    else ""
                )
            )
        lines += [f"note       {n}" for n in self.notes]
        if self.serve:
            lines.append(f"serve      {self.serve}")
        if self.skipped:
            lines.append(
                f"skipped    {len(self.skipped)} bad samples, e.g. "
                + "; ".join(f"{k}: {v}" for k, v in list(self.skipped.items())[:3])
            )
        return lines


FIX = (
    "run `eagle3 verify --fix {store}` (it quarantines bad shards), then rerun the same `eagle3 extract` "
    "command to redo them; or train with --on-bad-sample skip to leave them out"
)


class StoreSamples:
    """Random access to a store's samples: (input_ids [T], loss_mask [T], aux [T, n_aux*H], last [T, H]).

    Trust nothing read back: a shard's checksum (xxh3_128) is checked against the manifest before any of its samples
    is read (about 12 GB/s of hashing per core, once per shard per run; ahead of the reader where check_ahead was
    called, train/shard_checks.py), and every sample's states are checked finite. A bad one raises BadData naming
    store, shard, sample and the fix."""

    def __init__(self, store: Store, seed: int = 0, index_shards: bool = True):
        """``index_shards=False``: start with an empty index (the online spool fills it as shards arrive)."""
        from safetensors import safe_open

        self.store, self.ids, self.seed = store, list(store.spec.layer_ids), seed
        self.index: list[tuple[str, int, int, str]] = []
        self.entry = {s["file"]: s for s in store.shards}  # shard file -> its manifest entry (the checksum)
        self.checks = ShardChecks(lambda file: checksum_matches(self.store.root / file, self.entry[file]))
        for shard in store.shards if index_shards else ():
            with safe_open(str(store.root / shard["file"]), framework="pt") as f:
                off = f.get_tensor("offsets").tolist()
                sids = json.loads(f.metadata()["sample_ids"])
            self.index += [(shard["file"], off[s], off[s + 1], sid) for s, sid in enumerate(sids)]

    def __len__(self) -> int:
        return len(self.index)

    # -- the sample-source interface train() uses (the online spool implements the same, online.py)
    def batch(self, step: int, steps_per_epoch: int, batch_samples: int) -> list[int]:
        """Indices of step ``step``'s global batch: epoch e's permutation (seed + e), in slices of batch_samples."""
        epoch, k = divmod(step, steps_per_epoch)
        return self.epoch_order(epoch)[k * batch_samples : (k + 1) * batch_samples]

    def epoch_order(self, epoch: int) -> list[int]:
        return torch.randperm(len(self), generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def check_ahead(self, order: Iterable[int]) -> None:
        """Check the checksums of the shards of samples ``order`` (the order they will be read) in a background
        thread, each shard where its first sample comes; get() waits for a shard's check begun there."""

        def first_reads() -> Iterator[str]:
            seen: set[str] = set()
            for i in order:
                file = self.index[i][0]
                if file not in seen:
                    seen.add(file)
                    yield file
                    if len(seen) == len(self.entry):
                        return

        self.checks.ahead(first_reads())

    def sample_id(self, i: int) -> str:
        return self.index[i][3]

    def resumed(self, state: dict) -> None:
        """Training resumes from a checkpoint with ``state``."""

    def wants_checkpoint(self) -> bool:
        return False

    def progress(self) -> dict[str, str]:
        """Extra fields for the progress bar (the online spool shows the extraction side)."""
        return {}

    def close(self) -> None:
        self.checks.close()

    def _bad(self, file: str, sid: str | None, what: str) -> BadData:
        where = f"store {self.store.root}, shard {file}" + (f", sample {sid}" if sid else "")
        return BadData(
            f"{where}: {what}. Training stopped before learning from it: " + FIX.format(store=self.store.root)
        )

    def verify_shard(self, file: str) -> None:
        if not self.checks.matches(file):
            raise self._bad(file, None, "its checksum differs from the manifest's (the file changed after commit)")

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token is a training target (loss-masked positions)."""
        from safetensors import safe_open

        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for shard in self.store.shards:
            with safe_open(str(self.store.root / shard["file"]), framework="pt") as f:
                ids, mask = f.get_tensor("input_ids").long(), f.get_tensor("loss_mask").bool()
            counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
        return counts

    def get(self, i: int) -> dict:
        from safetensors import safe_open

        file, a, b, sid = self.index[i]
        self.verify_shard(file)
        with safe_open(str(self.store.root / file), framework="pt") as f:
            hs = read_states(f, self.store.spec, a, b)  # [T, n_layers, H]; aux layers first, the last id last
            x = {
                "sample_id": sid,
                "shard": file,
                "input_ids": f.get_slice("input_ids")[a:b].long(),
                "loss_mask": f.get_slice("loss_mask")[a:b].bool(),
                "aux": hs[:, :-1].reshape(hs.shape[0], -1),
                "last": hs[:, -1],
            }
        if not all_finite(hs):
            layers, n = nonfinite_layers(hs)
            raise self._bad(file, sid, f"{n} NaN/Inf values in the states of layer ids {[self.ids[k] for k in layers]}")
        return x


def model_inputs(xs: list[dict], device: str, dtype: torch.dtype, guard: int = 0) -> dict:
    """pack_inputs on the host, then to_device."""
    return to_device(pack_inputs(xs, guard), device, dtype)


FLEX_BLOCK = 128  # flex attention's block: speculators' mask for TTT steps covers whole blocks of it


def pack_multiple(attn_impl: str) -> int:
    """Rows a pack is padded to a multiple of: FLEX_BLOCK for flex attention, whose per-TTT-step mask
    (speculators' extend_mask_for_draft_tokens, BlockMask.from_kv_blocks) is made for whole blocks and which torch's
    flex_attention refuses for a shorter sequence; 1 for the others."""
    return FLEX_BLOCK if attn_impl == "flex" else 1


def attention_implementation(attn_impl: str) -> str:
    """The draft config's attn_implementation (a name in transformers' registry) for ``--attn``."""
    from eagle3.train import ttt_attention

    return {"sdpa": "sdpa", "varlen": ttt_attention.NAME, "flex": "simple_flex_attention"}[attn_impl]


def sample_rows(pack: dict) -> int:
    """The samples' rows of a pack (pack_inputs), its padding left out: a pad row has position 0, a sample's 1..T-1."""
    return int(pack["position_ids"].count_nonzero())


def pack_inputs(xs: list[dict], guard: int = 0, pin: bool = False, multiple: int = 1) -> dict:
    """Samples shifted as speculators expects (input_ids[1:], aux[:-1], last[1:], loss_mask[1:],
    positions 1..T-1), packed into one sequence of batch dim 1 with a document id per sample.

    Packed rows: at TTT step j speculators compares row r's logits with the target of row r + j, masked by the
    target's loss mask. So the first ``guard`` = ttt_steps - 1 targets of every sample after the first get loss
    mask 0: no step compares one sample's logits with the next one's targets (at the price of those few targets;
    chat samples start with non-assistant tokens, so usually nothing is lost).

    Each sample's rows are copied once, into tensors allocated whole first: pinned where ``pin`` (host_empty), so
    the copy to the GPU needs no second one (concatenating, then pinning, copied the states twice, the first time
    into freshly faulted pages: tests/unit/test_pack.py).

    ``multiple`` (pack_multiple): rows padded after the samples up to a multiple of it, as a document of their own
    (no sample's row attends to them) with loss mask 0 (no loss reads them as targets), zero states and position 0."""
    real = sum(x["input_ids"].shape[0] - 1 for x in xs)
    n = -(-real // multiple) * multiple
    first = xs[0]

    def empty(like: torch.Tensor) -> torch.Tensor:  # [1, n, *like's row shape], like's dtype (the store's)
        return host_empty((1, n, *like.shape[1:]), like.dtype, pin)

    out = {
        "input_ids": empty(first["input_ids"]),
        "hidden_states": empty(first["aux"]),
        "verifier_last_hidden_states": empty(first["last"]),
        "loss_mask": empty(first["loss_mask"]),
        "position_ids": host_empty((1, n), torch.long, pin),
        "document_ids": host_empty((1, n), torch.long, pin),
    }
    at = 0
    for d, x in enumerate(xs):
        t = x["input_ids"].shape[0] - 1
        out["input_ids"][0, at : at + t].copy_(x["input_ids"][1:])
        out["hidden_states"][0, at : at + t].copy_(x["aux"][:-1])
        out["verifier_last_hidden_states"][0, at : at + t].copy_(x["last"][1:])
        mask = out["loss_mask"][0, at : at + t]
        mask.copy_(x["loss_mask"][1:])
        if d > 0:
            mask[:guard] = False
        torch.arange(1, t + 1, out=out["position_ids"][0, at : at + t])
        out["document_ids"][0, at : at + t].fill_(d)
        at += t
    if n > real:
        for k, v in out.items():
            v[0, real:] = len(xs) if k == "document_ids" else 0
    return out


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialized host tensor; where ``pin``, page-locked from torch's caching host allocator (its blocks are
    reused once the copies from them are done: no page faults after the first steps)."""
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


def to_device(inputs: dict, device: str, dtype: torch.dtype) -> dict:
    """pack_inputs' tensors on ``device``, the states cast to the training dtype there (asynchronous copies from
    pinned host memory)."""
    out = {k: v.to(device, non_blocking=v.is_pinned()) for k, v in inputs.items()}
    for k in ("hidden_states", "verifier_last_hidden_states"):
        out[k] = out[k].to(dtype)
    return out


def reads_from(
    samples: StoreSamples, step: int, steps_per_epoch: int, batch_samples: int, rank: int, world: int, epochs: int = 2
) -> Iterator[int]:
    """The sample indices this rank reads from step ``step`` on, in order, to the end of ``epochs`` epochs
    (StoreSamples.batch, each epoch's permutation drawn once)."""
    first, k0 = divmod(step, steps_per_epoch)
    for epoch in range(first, first + epochs):
        order = samples.epoch_order(epoch)
        for k in range(k0 if epoch == first else 0, steps_per_epoch):
            yield from order[k * batch_samples : (k + 1) * batch_samples][rank::world]


def micro_batches(
    samples: StoreSamples, indices: list[int], pack_tokens: int, skipped: dict[str, str] | None = None
) -> list[list[dict]]:
    """One sample per forward, or packs of up to pack_tokens tokens. With ``skipped`` (on_bad_sample="skip"),
    bad samples are left out and recorded there instead of stopping the run."""
    xs = []
    for i in indices:
        try:
            xs.append(samples.get(i))
        except BadData as e:
            if skipped is None:
                raise
            skipped[samples.sample_id(i)] = str(e).split(". Training stopped")[0]
    if pack_tokens <= 0:
        return [[x] for x in xs]
    return [[xs[i] for i in group] for group in pack_groups([x["input_ids"].shape[0] for x in xs], pack_tokens)]


def pack_groups(lengths: list[int], pack_tokens: int) -> list[list[int]]:
    """Greedy packing in order: indices into ``lengths``, a pack closed before its tokens would pass pack_tokens (a
    longer item alone in its pack). A prefix of ``lengths`` packs as the whole does, up to its last, open pack."""
    packs, cur, n = [], [], 0
    for i, t in enumerate(lengths):
        if cur and n + t > pack_tokens:
            packs.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += t
    return packs + ([cur] if cur else [])


def read_packs(
    samples: StoreSamples,
    indices: list[int],
    pack_tokens: int,
    guard: int,
    pin: bool,
    skipped: dict[str, str] | None = None,
    multiple: int = 1,
) -> list[tuple[list[str], dict]]:
    """The samples ``indices`` as a training step takes them (the reader thread's work, train/read_ahead.py): read
    and checked, packed (padded to a multiple of ``multiple`` rows), pinned where ``pin``. (sample ids, host
    inputs) a pack."""
    return [
        ([x["sample_id"] for x in p], pack_inputs(p, guard, pin, multiple))
        for p in micro_batches(samples, indices, pack_tokens, skipped)
    ]


def _dist():
    """(torch.distributed, rank, world) where training is data-parallel; (None, 0, 1) otherwise, a world of one
    included: vLLM's engine in this process (train --online --engine-in-process) initializes one, NCCL on a GPU,
    which has no CPU all_reduce."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist, dist.get_rank(), dist.get_world_size()
    return None, 0, 1


def init_distributed(device: str) -> None:
    """Under torchrun (WORLD_SIZE > 1): gloo on CPU, nccl on CUDA."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def draft_shape(cfg: TrainConfig, store: Store) -> tuple[DraftShape, dict, str]:
    """The draft's shape for the store's target (+ cfg.shape overrides), checked servable at cfg.serve_tps
    before anything is read or written. Returns (shape, target config, target path)."""
    target = cfg.target or store.spec.target["name_or_path"]
    tcfg = read_model_config(target)
    if config_hash(tcfg) != store.spec.target.get("config_hash"):
        raise StoreMismatch(
            f"store {store.root} was extracted from {store.spec.target.get('name_or_path')} (config "
            f"{store.spec.target.get('config_hash')}), but --target {target} has config {config_hash(tcfg)}. "
            "Train against the target the store came from."
        )
    shape = DraftShape.for_target(tcfg)
    if cfg.shape:
        shape = DraftShape(**dict(asdict(shape), **cfg.shape))
    if shape.hidden_size != store.spec.hidden_size:
        raise StoreMismatch(f"store hidden size {store.spec.hidden_size} != target hidden size {shape.hidden_size}")
    check_servable(shape, cfg.serve_tps or SERVE_TPS)
    return shape, tcfg, str(target)


def build_draft(cfg: TrainConfig, store: Store, samples: StoreSamples, shape: DraftShape, tcfg: dict, target: str):
    from speculators.models.eagle3 import Eagle3DraftModel

    from eagle3.train import dense_mask, ttt_attention

    n_draft = min(cfg.draft_vocab_size, shape.vocab_size)
    t2d, d2t = draft_vocab(samples.token_counts(shape.vocab_size), n_draft)
    varlen = cfg.attn_impl == "varlen"
    if varlen:
        ttt_attention.register()
    attn = attention_implementation(cfg.attn_impl)
    config = speculators_config(
        shape,
        aux_ids(store.spec.layer_ids),
        n_draft,
        cfg.speculative_tokens or cfg.ttt_steps,
        target,
        list(tcfg.get("architectures") or []),
        attn_implementation=attn,
        fc_norm=cfg.fc_norm,
        norm_output=cfg.norm_output,
    )
    torch.manual_seed(cfg.seed)
    # built where it trains: on the CPU, initializing Kimi-K2.5's draft (2.4 B parameters with the target's embedding,
    # which load_verifier_weights then overwrites) took 39 s on two cores; on a GPU, well under one
    with torch.device(cfg.device) if cfg.device != "cpu" else contextlib.nullcontext():
        model = Eagle3DraftModel(config)
    if varlen:
        ttt_attention.install(model)
    elif attn == "sdpa":
        dense_mask.install(model)
    if cfg.draft_arch == "mla":
        from eagle3.train import mla_draft

        mla = mla_draft.MLAShape.for_target(tcfg)
        mla.check_servable(mla_draft.serve_tps(mla, cfg.serve_tps))
        mla_draft.install(model, mla, attn)
    elif cfg.draft_arch != "llama":
        raise ValueError(f"draft_arch {cfg.draft_arch!r}: use llama or mla")
    if n_draft < shape.vocab_size:
        model.load_vocab_mappings(t2d, d2t)
    model.load_verifier_weights()
    return model.to(cfg.device, getattr(torch, cfg.dtype))


PRECISIONS = ("auto", "fp32", "bf16-mixed")


def mixed_precision(cfg: TrainConfig) -> bool:
    """Whether the forward runs under bf16 autocast (weights, gradients and optimizer state stay in cfg.dtype)."""
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"precision {cfg.precision!r}: use one of {', '.join(PRECISIONS)}")
    if cfg.precision == "auto":
        return cfg.device.startswith("cuda") and cfg.dtype == "float32"
    return cfg.precision == "bf16-mixed"


def _lr_lambda(cfg: TrainConfig, total: int):
    def f(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


_clock = time.monotonic  # tests replace it to simulate long runs


OPTIMIZER_IMPLS = ("auto", "fused", "foreach")


def optimizer_kwargs(device_type: str, impl: str = "auto") -> dict:
    """AdamW's implementation: fused on CUDA by default (one kernel over weights, gradients and both moments; the
    multi-tensor default makes several passes over the draft's float32 state, 16 B a parameter), torch's default
    elsewhere (the CPU path unchanged)."""
    if impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"optimizer implementation {impl!r}: use auto, fused or foreach")
    if impl == "auto":
        return {"fused": True} if device_type == "cuda" else {}
    return {impl: True}


def make_optimizer(
    params, lr: float, betas=(0.9, 0.999), weight_decay: float = 0.0, device_type: str = "cpu", impl: str = "auto"
) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        params, lr=lr, betas=betas, weight_decay=weight_decay, **optimizer_kwargs(device_type, impl)
    )


@dataclass
class Run:
    """A training run between its steps: what build() made and resume() restored."""

    cfg: TrainConfig
    samples: StoreSamples  # or online.py's spool: the samples and their order
    model: torch.nn.Module
    ddp: torch.nn.Module  # the model, wrapped for DDP under torchrun
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    lr_at: Callable[[int], float]  # the schedule's factor at a step
    loss_config: object
    state: dict  # step, losses, samples_seen, tokens_seen, config, skipped: what a checkpoint holds
    out: Path
    total: int  # steps in the run
    steps_per_epoch: int
    notes: list[str]  # said to the user at the start and in the summary
    dist: object  # torch.distributed under torchrun, else None
    rank: int
    world: int
    target: str = ""  # the target's folder, as the store or --target names it
    custom_code: bool = False  # the target's config names custom code (auto_map): vLLM needs --trust-remote-code
    resumed_from: int = 0
    accept_sums: dict[str, float] = field(default_factory=dict)  # speculators' acceptance counts, this run
    serve: list[str] = field(default_factory=list)  # `vllm serve`'s argv for the published draft

    @property
    def skipped(self) -> dict | None:
        return self.state["skipped"] if self.cfg.on_bad_sample == "skip" else None


def train(cfg: TrainConfig, progress: bool = True, source=None) -> TrainResult:
    """Train on the store cfg.store; ``source`` (online.py's spool) replaces the store's samples and order."""
    entered = time.perf_counter()
    refuse_early(cfg)
    run = build(cfg, source)
    resume(run)
    return run_steps(run, progress, entered)


def refuse_early(cfg: TrainConfig) -> None:
    """What is refused before anything is read: an option out of range, no CUDA, an --out that is not train's."""
    if cfg.on_bad_sample not in ("stop", "skip"):
        raise ValueError(f"on_bad_sample must be stop or skip, got {cfg.on_bad_sample!r}")
    preflight.train_attention(cfg.attn_impl, cfg.compile, cfg.device)
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise StoreError(
            f"--device {cfg.device}: torch {torch.__version__} sees no CUDA device here; "
            "train with --device cpu or on a GPU host"
        )
    ownership.check(cfg.out, "train")  # a new, empty or train folder (claimed before its first write, in build)
    checkpoint.refuse_foreign_draft_files(Path(cfg.out))


def build(cfg: TrainConfig, source=None) -> Run:
    """The store, the ranks, the samples, the draft with its optimizer and schedule; OUT claimed."""
    from eagle3.train import chunked_loss

    notes = [] if source is not None else _check_store_is_whole(cfg)
    if cfg.compile and not torch.cuda.is_available():
        notes.append("--compile: speculators compiles the draft's forward only where CUDA is; this run is eager")
    store = Store.open(cfg.store)
    shape, tcfg, target = draft_shape(cfg, store)
    init_distributed(cfg.device)
    dist, rank, world = _dist()
    if cfg.batch_samples % world:
        raise ValueError(f"batch_samples {cfg.batch_samples} must be divisible by the {world} processes")
    if store.spec.dtype not in ("bfloat16", "float16", "float32", FP8):
        raise StoreMismatch(f"store dtype {store.spec.dtype} is not a float type the trainer reads")
    samples = source if source is not None else StoreSamples(store, cfg.seed)
    if len(samples) == 0:
        raise StoreMismatch(f"store {cfg.store} has no samples")
    cfg = fit_batch(cfg, len(samples), world, notes)
    model = build_draft(cfg, store, samples, shape, tcfg, target)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, cfg.lr, cfg.betas, cfg.weight_decay, cfg.device.split(":")[0])
    steps_per_epoch = len(samples) // cfg.batch_samples
    total = min(cfg.max_steps or 10**12, steps_per_epoch * cfg.epochs)
    if cfg.max_steps and cfg.max_steps > total:
        notes.append(
            f"--steps {cfg.max_steps}: stopping at {total} steps: --epochs {cfg.epochs} over {len(samples)} "
            f"samples in batches of {cfg.batch_samples} is {total} steps (raise --epochs for more)"
        )
    for n in notes:
        if rank == 0:
            log.warning("%s", n)
    state = {"step": 0, "losses": [], "samples_seen": 0, "tokens_seen": 0, "config": asdict(cfg), "skipped": {}}
    return Run(
        cfg, samples, model, model, params, optimizer, _lr_lambda(cfg, total),
        chunked_loss.loss_config(cfg.loss, cfg.loss_impl, cfg.device), state, ownership.claim(cfg.out, "train"),
        total, steps_per_epoch, notes, dist, rank, world, target, "auto_map" in tcfg,
    )  # fmt: skip


def resume(run: Run) -> None:
    """From the newest whole checkpoint in OUT (unless --no-resume); then the model wrapped for DDP."""
    ckpt = checkpoint.latest(run.out) if run.cfg.resume else None
    if ckpt is not None:
        run.state = checkpoint.load(ckpt, run.model, run.optimizer)
        run.state.setdefault("skipped", {})
        run.resumed_from = run.state["step"]
        run.samples.resumed(run.state)
        if run.rank == 0:
            log.warning("resuming from step %d of %d (%s); %s", run.resumed_from, run.total, ckpt, run.cfg.restart_hint)
    if run.world > 1:
        from torch.nn.parallel import DistributedDataParallel

        cuda = run.cfg.device.startswith("cuda")
        run.ddp = DistributedDataParallel(run.model, device_ids=[torch.cuda.current_device()] if cuda else None)
    run.model.train()


def read_step(run: Run, step: int) -> tuple[list[tuple[list[str], dict]], dict | None]:
    """This rank's part of step ``step``: (sample ids, host inputs) per pack, and the samples it skipped."""
    cfg = run.cfg
    mine = run.samples.batch(step, run.steps_per_epoch, cfg.batch_samples)[run.rank :: run.world]
    bad: dict | None = {} if run.skipped is not None else None
    guard, pin = max(0, cfg.ttt_steps - 1), cfg.device.startswith("cuda")
    return read_packs(run.samples, mine, cfg.pack_tokens, guard, pin, bad, pack_multiple(cfg.attn_impl)), bad


def run_steps(run: Run, progress: bool, entered: float) -> TrainResult:
    """The steps from the run's current one to its last: read ahead, train, checkpoint; a signal ends the run
    after the step in progress, checkpointed."""
    from tqdm import tqdm

    from eagle3.train.read_ahead import ReadAhead

    cfg, state = run.cfg, run.state
    # the shards' checksums hashed in a background thread, in the order this run reads them (the reader waits only
    # for a shard it reaches first); stopped with the run
    run.samples.check_ahead(reads_from(run.samples, state["step"], run.steps_per_epoch, cfg.batch_samples, run.rank,
                                       run.world))  # fmt: skip
    ahead = ReadAhead(functools.partial(read_step, run), cfg.read_ahead)
    autocast = functools.partial(
        torch.autocast, device_type=cfg.device.split(":")[0], dtype=torch.bfloat16, enabled=mixed_precision(cfg)
    )
    t0 = time.perf_counter()
    clock = StepClock(t0, {"setup": t0 - entered, "reading": 0.0, "steps": 0.0, "checkpoints": 0.0})
    saver = Checkpointer(run, faults.from_env(), checkpoint.Background() if checkpoint_background(cfg) else None)
    bar = tqdm(total=run.total, initial=state["step"], disable=not progress or run.rank != 0, desc="train", unit="step")
    watch = compile_watch.RecompileLimitHits()  # dynamo giving up on a function of a compiled run: said in the notes
    with (
        bar,
        watch,
        contextlib.closing(run.samples.checks),
        saver.background or contextlib.nullcontext(),
        torch.compiler.set_stance("default" if cfg.compile else "force_eager"),
        interrupt.Deferred() as stop,
    ):
        while state["step"] < run.total:
            began = time.perf_counter()
            packs, bad = ahead.take(state["step"])
            if bad:
                run.skipped.update(bad)
            if state["step"] + 1 < run.total:
                ahead.start(state["step"] + 1)
            read_s = time.perf_counter() - began
            tokens = train_step(run, packs, autocast)
            bar.update(1)
            bar.set_postfix(loss=f"{state['losses'][-1]:.4f}", **run.samples.progress())
            if saver.fault:
                saver.fault("after_step")
            halt = _any_rank(stop.signum is not None, run.dist, cfg.device)  # Ctrl-C / SIGTERM: this step saved
            saving = time.perf_counter()
            clock.timeline.append((saving - t0, tokens))
            path = saver.after_step(halt)
            if halt and state["step"] < run.total:
                raise interrupt.Interrupted(stop.signum or signal.SIGINT, saved=path)
            clock.add(began, read_s, saving, tokens)
    return finish(run, watch, clock)


def forward_backward(run: Run, packs: list, autocast, sums: torch.Tensor) -> tuple[list, list]:
    """Each pack's forward and backward; its loss and acceptance counts left on the device (read once a step).
    ``sums[1]`` gains the packs' sample rows."""
    from eagle3.train import ttt_attention

    cfg, world = run.cfg, run.world
    losses: list[torch.Tensor] = []
    accepts: list[tuple[str, torch.Tensor]] = []
    for j, (pack_ids, host) in enumerate(packs):
        inputs = to_device(host, cfg.device, getattr(torch, cfg.dtype))
        if cfg.attn_impl == "varlen":  # the packed samples' boundaries, read on the host
            inputs.update(ttt_attention.forward_kwargs(host["document_ids"], cfg.device))
        sync = j == len(packs) - 1 or world == 1
        ctx = run.ddp.no_sync() if world > 1 and not sync else contextlib.nullcontext()
        weight = len(pack_ids)  # a pack's loss is a mean over its samples' tokens; weigh it by samples
        with ctx:
            with autocast():
                _, loss, metrics = run.ddp(
                    **inputs,
                    ttt_steps=cfg.ttt_steps,
                    ttt_step_loss_decay=cfg.ttt_step_loss_decay,
                    loss_config=run.loss_config,
                )
            (loss * weight * world / cfg.batch_samples).backward()
        losses.append(loss.detach())
        sums[1] += sample_rows(host)  # the samples' rows, not flex's padding
        accepts += [
            (name, torch.as_tensor(v, device=loss.device).detach())
            for name, v in metrics.items()
            if name.startswith("full_acc_")
        ]
    return losses, accepts


def train_step(run: Run, packs: list, autocast) -> int:
    """One optimizer step over this rank's packs: forward and backward, one read of the device, the finiteness
    checks, the update. Returns the step's tokens over all ranks."""
    cfg, state, step = run.cfg, run.state, run.state["step"]
    sums = torch.zeros(2, dtype=torch.float64)  # this rank's [sample-weighted loss, tokens]; summed over ranks
    losses, accepts = forward_backward(run, packs, autocast, sums)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.params, cfg.max_grad_norm)
    # the step's one read of the device: its packs' losses, the gradient norm, the acceptance counts
    # (float64: the float32 losses exactly, as float() read them, and counts past 2**24)
    read = torch.stack([t.double().reshape(()) for t in losses + [grad_norm] + [v for _, v in accepts]]).tolist()
    for (pack_ids, _), value in zip(packs, read):
        if not math.isfinite(value):  # the gradients of that loss are not finite either: no step taken
            raise TrainingDiverged(
                f"step {step + 1}: the loss is {value} on samples {pack_ids}; stopped before the optimizer step, "
                "nothing written. Lower --lr, or check those samples with `eagle3 verify`."
            )
        sums[0] += value * len(pack_ids)  # weighed by samples, as the backward's loss was
    for (name, _), value in zip(accepts, read[len(packs) + 1 :]):
        run.accept_sums[name] = run.accept_sums.get(name, 0.0) + value
    if not math.isfinite(read[len(packs)]):
        ids = [sid for pack_ids, _ in packs for sid in pack_ids]
        raise TrainingDiverged(
            f"step {step + 1}: the gradient norm is {read[len(packs)]} (samples {ids}); stopped before the "
            "optimizer step, nothing written. Lower --lr, or check those samples with `eagle3 verify`."
        )
    for group in run.optimizer.param_groups:
        group["lr"] = cfg.lr * run.lr_at(step)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    if run.dist is not None:
        run.dist.all_reduce(sums)  # every rank's tokens: ranks' samples differ in length
    state["losses"].append(float(sums[0]) / cfg.batch_samples)
    state["step"] = step + 1
    state["samples_seen"] += cfg.batch_samples
    state["tokens_seen"] = state.get("tokens_seen", 0) + int(sums[1])
    return int(sums[1])


@dataclass
class Checkpointer:
    """When and how a step is checkpointed: every N steps or minutes, when the spool asks, at a signal and at the
    end; in the background where it can, the last one (and the draft's export) in the training thread."""

    run: Run
    fault: Callable[[str], None] | None
    background: checkpoint.Background | None
    last_save: float = field(default_factory=lambda: _clock())

    def due(self) -> bool:
        cfg, step = self.run.cfg, self.run.state["step"]
        return bool(
            (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
            or (cfg.checkpoint_minutes and _clock() - self.last_save >= 60 * cfg.checkpoint_minutes)
            or self.run.samples.wants_checkpoint()
        )

    def after_step(self, halt: bool) -> Path | None:
        """The checkpoint of the step just taken, if one is due (rank 0 writes); its path where written here."""
        run, cfg = self.run, self.run.cfg
        last = run.state["step"] == run.total
        if last:
            run.state["accept"] = _acceptance(run.accept_sums)
        due, path = self.due(), None
        if run.rank == 0 and (last or due or halt):
            if self.background is not None:
                self.background.wait()  # the checkpoint in flight written first: one snapshot held at a time
            snap = checkpoint.snapshot(run.model, run.optimizer, run.state)  # host copies, before the next step
            self.last_save = _clock()
            save = functools.partial(_save, run.out, run.state["step"], snap, self.fault, cfg.keep_checkpoints)
            if self.background is not None and not last and not halt:
                self.background.submit(save)
            else:
                path = save()
                if last:
                    run.serve = serve_argv(run)
                    checkpoint.publish(path, run.out, cfg.export_dtype, cfg.serve_tps, serve_line.readme(run.serve))
        if run.dist is not None:
            run.dist.barrier()
        return path


@dataclass
class StepClock:
    """Where the run's time went (seconds by phase) and each step's end with its tokens."""

    t0: float
    phases: dict[str, float]
    timeline: list[tuple[float, int]] = field(default_factory=list)
    tokens: int = 0  # trained in this run (a resumed run's earlier steps not counted)

    def add(self, began: float, read_s: float, saving: float, tokens: int) -> None:
        self.phases["reading"] += read_s
        self.phases["checkpoints"] += time.perf_counter() - saving
        self.phases["steps"] += saving - began - read_s
        self.tokens += tokens


def serve_argv(run: Run) -> list[str]:
    """`vllm serve` for this run's draft: the target at the largest --serve-tp (1 where none was named)."""
    cfg = run.cfg
    tp = max(cfg.serve_tps) if cfg.serve_tps else 1
    k = cfg.speculative_tokens or cfg.ttt_steps
    draft = str((run.out / "draft").resolve())
    return serve_line.vllm_serve_argv(run.target, draft, tp, k, run.custom_code)


def setup_line(cfg: TrainConfig) -> str:
    precision = "bf16-mixed" if mixed_precision(cfg) else cfg.dtype
    return TrainChoice(cfg.device, precision, cfg.attn_impl, cfg.pack_tokens, cfg.compile).line()


def finish(run: Run, watch, clock: StepClock) -> TrainResult:
    for n in watch.notes():
        run.notes.append(n)
        if run.rank == 0:
            log.warning("%s", n)
    state = run.state
    return TrainResult(
        str(run.out), str(run.out / "draft"), state["step"], state["samples_seen"], state["tokens_seen"],
        time.perf_counter() - clock.t0, state["losses"], state.get("accept", {}), run.resumed_from,
        dict(state["skipped"]), clock.tokens, run.notes, {k: round(v, 3) for k, v in clock.phases.items()},
        clock.timeline, clock.t0, setup_line(run.cfg), shlex.join(run.serve) if run.serve else "",
    )  # fmt: skip


def fit_batch(cfg: TrainConfig, n: int, world: int, notes: list[str]) -> TrainConfig:
    """cfg, its batch cut to the ``n`` samples there are (a multiple of the ``world`` processes) where they are fewer
    than one batch, said in ``notes``."""
    if n >= cfg.batch_samples:
        return cfg
    batch = n - n % world
    if batch == 0:
        raise StoreMismatch(
            f"store {cfg.store} holds {n} samples, fewer than the {world} training processes; extract "
            "more samples, or train with fewer processes"
        )
    notes.append(
        f"--batch {cfg.batch_samples}: the store holds {n} samples, so each step trains on {batch} (as --batch {batch})"
    )
    return replace(cfg, batch_samples=batch)


def _any_rank(flag: bool, dist, device: str) -> bool:
    """Whether ``flag`` is set on any rank (every rank gets the same answer, so all stop at the same step)."""
    if dist is None:
        return flag
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t)
    return bool(t.item())


def _save(out: Path, step: int, snap, fault, keep: int) -> Path:
    """A checkpoint written, then the older ones rotated out (in the background thread, or the training thread's)."""
    path = checkpoint.write(out, step, snap, fault)
    checkpoint.prune(out, keep)
    return path


def _check_store_is_whole(cfg: TrainConfig) -> list[str]:
    """Refuse a store another process writes now, or one with fewer samples than its plan names (unless
    cfg.allow_incomplete: then the note says on how many the run trains)."""
    from eagle3.store import lock as store_lock
    from eagle3.store import status

    try:
        store_lock.refuse_if_busy(cfg.store, "train")
    except store_lock.StoreBusy as e:
        raise StoreError(str(e)) from None
    done, planned = counted = status.counts(cfg.store)
    why = status.incomplete_message(cfg.store, counted)
    if why and not cfg.allow_incomplete:
        raise StoreError(why)
    return [f"training on {done} of the {planned} planned samples (--allow-incomplete)"] if why else []


def _acceptance(sums: dict[str, float]) -> dict[str, float]:
    """speculators' full_acc_<step>_sum / _total -> accuracy per TTT step, over this run's steps."""
    out = {}
    for name in sorted(sums):
        if name.endswith("_sum") and sums.get(name[: -len("_sum")] + "_total"):
            out[name[: -len("_sum")]] = sums[name] / sums[name[: -len("_sum")] + "_total"]
    return out
