"""The trainer at Kimi-K2.5's draft size on one H200 (issue 42; `pytest -m benchmark -k bench_train`).

From synthetic states (no target): speculators' Eagle3DraftModel at the shape eagle3 trains for Kimi-K2.5 (H 7168,
64 x 128 heads, 8 KV heads, MLP 18432, 3 aux layers, draft vocabulary 32000, 3 TTT steps), one packed sequence of
T tokens a step, the trainer's AdamW (fused on CUDA) and precision (bf16-mixed: float32 weights and optimizer, bf16
matmuls).
- tok/s sustained (steps after two of warm-up) at T = 2k, 8k, 32k; MFU = tok/s x FLOPs a token (tests/perf/flops.py)
  / 989 TFLOPS; peak memory; the trainer's loss (chunked on CUDA). fp32 at 8k beside it (the ratio in the same run),
  and speculators' eager loss at 32k (what the chunked loss saves in peak memory), and torch's multi-tensor AdamW at 8k
  (what the fused one saves).
- The longest T one H200 trains: doubled from 32k until a step runs out of memory (128k at most), then bisected.
- The store reader: StoreSamples over a store of Kimi-shaped states (4 x 7168 bf16 a token) written here, GB/s
  and tok/s against what the trainer consumes at 8k: the samples alone, and as the trainer's steps read them
  (train.read_packs: packed into 8k sequences and pinned, the reader thread's whole work).
Goals (issue 42): >= 35 % MFU at 8k; >= 32k tokens trainable; the reader >= 2x the trainer. Reported, asserted
only where a measurement fails outright (a step that does not run). Where the 8k MFU misses its goal, a profile of
two steps (GPU_OUT/profile_8k.txt; time by kind of work in the report: tests/perf/step_profile.py). Every row runs
as the trainer does: speculators 0.9 compiles Eagle3DraftModel.forward itself wherever CUDA is, and the trainer
runs it eagerly (torch.compiler.set_stance "force_eager") unless TrainConfig.compile. Last, compiled as
TrainConfig(compile=True) runs it (with its compile time), as the issue asks: measured with and without: flex attention
(a block mask instead of sdpa's dense one; fused only when compiled) over a training run's packs (ten steps, each pack
another length and 3-15 samples: whether the recompiles stop once dynamo marks the length dynamic, or reach the limit,
where a frame runs eagerly), then at 8k the mask-free varlen attention and flex, then flex at 32k and sdpa at 8k,
each from dynamo's caches cleared (no recompile limit reached through an earlier row).
Then the same draft with the mask-free TTT attention (`--attn varlen`, eagle3/train/ttt_attention.py: flash attention
within each sample plus each TTT step's own key, no [T, (s + 1) T] mask) at 2k, 8k and 32k, its longest sequence and,
where its 8k MFU misses 35 %, its profile (profile_8k_varlen.txt); on an H100 at 0ba8398
(results/2026-12-05-0ba8398-h100-vllm0.26.0) 36.1 % MFU at 8k eager, 46.3 % compiled.
EAGLE3_BENCH_TRAIN_PARTS="varlen,compiled" (parts_from_env) measures only those parts, for a GPU run with minutes left.
Order: the reader (seconds), the table, the profile, the MLA rows, the varlen rows (llama, profile, MLA), the
compiled rows, the longest-sequence searches (sdpa, varlen; to 128k at most).
Rows are reported as they are measured; a size that runs out of memory is a row saying so. The rows also go to
GPU_OUT/benchmark.json for `eagle3 bench report` (tok/s per GPU, MFU, peak memory). Its code runs on CPU at a small
shape in tests/unit/test_bench_train_rehearsal.py. On an H200 at c5ebd37 (results/2026-12-05-c5ebd37-h200-vllm0.26.0)
every row ran in 333 s: 8k eager 30.0 % MFU, compiled with flex attention 48.8 %; 32k at 105.7 GiB, longest 36,864;
the reader at 25,212 tok/s, bound then by torch.isfinite on bf16 (eagle3/store/finite.py since).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch

from tests.perf import flops

from .conftest import failure

pytestmark = [pytest.mark.gpu, pytest.mark.benchmark]
N_AUX, DRAFT_VOCAB, TTT = 3, 32000, 3


@dataclass(frozen=True)
class Bench:
    """What the benchmark measures on: the Kimi-K2.5 draft on CUDA here; a small draft on CPU in
    tests/unit/test_bench_train_rehearsal.py, which runs this file's code before a GPU run does."""

    shape: object  # a DraftShape: the llama draft
    mla: object  # an MLAShape: the MLA draft (the same hidden size and vocabulary)
    device: str = "cuda"
    draft_vocab: int = DRAFT_VOCAB
    seqs: tuple = (2048, 8192, 32768)  # short, the goal's (8k), long (32k): tokens a packed sequence
    longest_cap: int = 131072  # the longest-sequence search stops here (a probe at 128k: ~3 steps of ~10 s)
    longest_step: int = 4096  # and resolves to a multiple of this
    compiled: tuple = (("flex", "run"), ("varlen", 1), ("flex", 1), ("flex", 2), ("sdpa", 1))  # the compiled rows:
    # attention, index into seqs or "run" (a training run's packs, _compiled_run_row); the least known first (the run
    # row never ran; varlen compiled at 0ba8398 on an H100: 46.3 % MFU at 8k; sdpa at c5ebd37: 35.1 %)
    run_steps: int = 10  # the compiled run row's steps (its packs)
    measure_steps: tuple = (2, 5)  # a row's warm-up steps, then its timed ones
    parts: tuple = ()  # run_bench's parts to measure (PARTS); () all of them


PARTS = ("table", "mla", "varlen", "compiled", "longest")  # run_bench's parts, in its order


def parts_from_env() -> tuple:
    """EAGLE3_BENCH_TRAIN_PARTS="varlen,compiled": only those parts (a GPU run with minutes left measures what it
    still lacks); unset, all of them."""
    import os

    names = tuple(p.strip() for p in os.environ.get("EAGLE3_BENCH_TRAIN_PARTS", "").split(",") if p.strip())
    unknown = [p for p in names if p not in PARTS]
    if unknown:
        raise ValueError(f"EAGLE3_BENCH_TRAIN_PARTS names {', '.join(unknown)}: the parts are {', '.join(PARTS)}")
    if "longest" in names and not {"table", "varlen"} <= set(names):
        raise ValueError(
            "EAGLE3_BENCH_TRAIN_PARTS: longest searches from the table's and the varlen rows; name "
            "table and varlen with it"
        )
    return names


def kimi() -> Bench:
    from eagle3.targets.presets import KIMI_K25_TEXT
    from eagle3.train import mla_draft

    return Bench(flops.kimi_k25_draft(), mla_draft.MLAShape.for_target(KIMI_K25_TEXT), parts=parts_from_env())


def _model(b: Bench, mla=None, attn: str = "sdpa"):
    """The Kimi-size draft (llama, or with the MLA layer), attending with ``attn`` (`train --attn`)."""
    from speculators.models.eagle3 import Eagle3DraftModel

    from eagle3.train import ttt_attention
    from eagle3.train.draft import speculators_config
    from eagle3.train.train import attention_implementation

    ttt_attention.register()
    cfg = speculators_config(
        b.shape,
        [2, 30, 58],
        b.draft_vocab,
        TTT,
        "/nonexistent",
        ["DeepseekV3ForCausalLM"],
        attn_implementation=attention_implementation(attn),
    )
    torch.manual_seed(0)
    with torch.device(b.device):
        m = Eagle3DraftModel(cfg)
    if attn == "varlen":
        ttt_attention.install(m)
    if mla is not None:
        from eagle3.train import mla_draft

        mla_draft.install(m, mla, attention_implementation(attn))
    for p in m.parameters():
        if p.isnan().any():  # the verifier's weights, unloaded: any values do for a speed test
            p.data.normal_(0, 0.02)
    t2d = torch.zeros(b.shape.vocab_size, dtype=torch.bool)
    t2d[: b.draft_vocab] = True
    m.load_vocab_mappings(t2d.to(b.device), torch.zeros(b.draft_vocab, dtype=torch.long, device=b.device))
    return m.float().train()


def _inputs(b: Bench, seq: int, attn: str = "sdpa", lengths: list[int] | None = None):
    """One packed sequence of seq tokens: one sample (the attention's worst case: causal over all of it), or samples
    of ``lengths`` (summing to seq) with their document ids and positions as pack_inputs makes them; for flex, padded
    as the trainer pads (train.pack_multiple: whole 128-token blocks, a document of zero states no loss reads)."""
    from eagle3.train import ttt_attention
    from eagle3.train.train import pack_multiple

    h, device = b.shape.hidden_size, b.device
    g = torch.Generator(device=device).manual_seed(1)
    lengths = lengths or [seq]
    pad = -seq % pack_multiple(attn)
    rows = seq + pad
    docs = torch.repeat_interleave(torch.arange(len(lengths) + 1), torch.tensor(lengths + [pad]))[None]
    extra = ttt_attention.forward_kwargs(docs, device) if attn == "varlen" else {}
    real = (torch.arange(rows) < seq)[None, :, None].to(device)  # the pad's states zero
    return dict(
        extra,
        input_ids=torch.randint(0, b.draft_vocab, (1, rows), device=device, generator=g),
        hidden_states=torch.randn(1, rows, N_AUX * h, device=device, generator=g, dtype=torch.bfloat16).float() * real,
        verifier_last_hidden_states=torch.randn(1, rows, h, device=device, generator=g, dtype=torch.bfloat16).float()
        * real,
        loss_mask=real[..., 0].clone(),
        position_ids=torch.cat([torch.arange(1, n + 1) for n in lengths] + [torch.zeros(pad, dtype=torch.long)])[
            None
        ].to(device),
        document_ids=docs.to(device),
    )


def _sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def _steps(model, opt, inputs, n: int, amp: bool, loss_impl: str = "auto", compiled: bool = False) -> float:
    """Seconds a training step, as the trainer steps: speculators compiles Eagle3DraftModel.forward wherever CUDA is
    (conditional_torch_compile), and the trainer runs it eagerly (torch.compiler.set_stance "force_eager") unless
    TrainConfig.compile, which the compiled rows measure."""
    from eagle3.train.chunked_loss import loss_config as make_loss_config

    device = inputs["input_ids"].device.type
    loss_config = make_loss_config("kl_div", loss_impl, device)  # the trainer's: chunked on CUDA
    _sync(device)
    t0 = time.perf_counter()
    with torch.compiler.set_stance("default" if compiled else "force_eager"):
        for _ in range(n):
            with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
                _, loss, _ = model(**inputs, ttt_steps=TTT, loss_config=loss_config)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        _sync(device)
    return (time.perf_counter() - t0) / n


def _row(seq: int, amp: bool, mla, loss_impl: str, optimizer: str = "auto", attn: str = "sdpa") -> dict:
    return {
        "draft": "mla" if mla is not None else "llama",
        "seq": seq,
        "precision": "bf16-mixed" if amp else "fp32",
        "loss": loss_impl,
        "optimizer": optimizer,
        **({"attn": attn} if attn != "sdpa" else {}),
    }


def _optimizer(b: Bench, model, impl: str = "auto"):
    """The trainer's AdamW (train.make_optimizer: fused on CUDA), or another implementation for a comparison row."""
    from eagle3.train.train import make_optimizer

    return make_optimizer([p for p in model.parameters() if p.requires_grad], 1e-4, device_type=b.device, impl=impl)


def _measure(
    b: Bench,
    model,
    opt,
    seq: int,
    amp: bool,
    steps: int | None = None,
    mla=None,
    loss_impl: str = "auto",
    optimizer: str = "auto",
    compiled: bool = False,
    attn: str = "sdpa",
) -> dict:
    """One row: b.measure_steps' warm-up steps, then its timed steps (or ``steps`` of them)."""
    warm, timed = b.measure_steps
    inputs = _inputs(b, seq, attn)
    if b.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    _steps(model, opt, inputs, warm, amp, loss_impl, compiled)  # warm-up: allocator, kernels
    sec = _steps(model, opt, inputs, timed if steps is None else steps, amp, loss_impl, compiled)
    per_token = (
        flops.train_flops_per_token(b.shape, N_AUX, b.draft_vocab, TTT, seq)
        if mla is None
        else (
            sum(flops.mla_linear_flops(mla, N_AUX, b.draft_vocab, TTT).values())
            + flops.mla_attention_flops(mla, TTT, seq)
        )
    )
    return dict(
        _row(seq, amp, mla, loss_impl, optimizer, attn),
        s_per_step=round(sec, 4),
        tok_per_s=round(seq / sec),
        gflop_per_token=round(per_token / 1e9, 2),
        mfu=round(flops.mfu(seq / sec, per_token), 4),
        peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1) if b.device == "cuda" else None,
    )


def _tried(
    b: Bench,
    model,
    opt,
    seq: int,
    amp: bool,
    steps: int | None = None,
    mla=None,
    loss_impl: str = "auto",
    optimizer: str = "auto",
    attn: str = "sdpa",
) -> dict:
    """_measure's row, or {seq, out_of_memory} where a step does not fit: one size that does not fit loses no other."""
    try:
        return _measure(b, model, opt, seq, amp, steps, mla, loss_impl, optimizer, attn=attn)
    except torch.OutOfMemoryError:
        opt.zero_grad(set_to_none=True)
        return dict(_row(seq, amp, mla, loss_impl, optimizer, attn), out_of_memory=True)
    finally:
        torch.cuda.empty_cache()  # a no-op where CUDA never ran


def _longest(fits, lo: int, hi: int, step: int = 4096) -> int:
    """The longest length in [lo, hi) (multiples of step) that fits(length), given fits(lo) and not fits(hi)."""
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def longest_trainable(fits, rows: list[dict], b: Bench) -> int | None:
    """Where the long size fits: doubled while it fits (to longest_cap at most), then bisected to longest_step; else
    bisected between the goal's size and the long one; None where the goal's size does not fit."""
    _, mid, long = b.seqs
    if "out_of_memory" in rows[1]:
        return None
    if "out_of_memory" in rows[2]:
        return _longest(fits, mid, long, b.longest_step)
    lo, hi = long, 2 * long
    while hi <= b.longest_cap and fits(hi):
        lo, hi = hi, hi * 2
    return lo if hi > b.longest_cap else _longest(fits, lo, hi, b.longest_step)


def test_bench_train_store_reader_against_the_trainer(tmp_path, report, gpu_out):
    """The reader's rate over Kimi-shaped states, against the trainer's need at 8k (bench_train_kimi_draft): the
    samples alone, and read as training steps (as_training_steps: packed into 8k sequences, pinned; the figure the
    goal compares, since the reader thread does all of it). The store was just written, so it reads from the page
    cache: the reader's own cost, not the disk's. First in the file: it takes seconds, and the table after it runs as
    long as its step allows."""
    got = reader_rate(tmp_path / "store", 64, 2048)
    row = reader_row(got)
    report(
        "bench_train_reader",
        {
            "tokens": got["tokens"],
            "tok_per_s": row["samples_tok_per_s"],
            "gb_per_s": round(got["tokens"] / got["seconds"] * got["bytes_per_token"] / 1e9, 2),
            "as_training_steps": {
                "tok_per_s": row["tok_per_s"],
                "step_tokens": row["seq"],
                "pinned": got["pinned"],
                "gb_per_s": row["gb_per_s"],
                "checks_inline_tok_per_s": row["checks_inline_tok_per_s"],
            },
        },
    )
    READER[:] = [row]  # beside the table's rows in GPU_OUT/benchmark.json: `bench report` sets it against them
    _write_history(gpu_out, [])
    assert got["tokens"] == 64 * 2048 and got["steps"] == 16


READER: list[dict] = []  # the reader's row for `bench report` (bench.train_lines), once measured


def reader_row(got: dict) -> dict:
    """reader_rate's figures as the history row `bench report` reads (history.train_history: train_reader/SEQ)."""
    steps = got["tokens"] / got["step_seconds"]
    return {
        "reader": True,
        "seq": got["step_tokens"],
        "tok_per_s": round(steps),
        "gb_per_s": round(steps * got["bytes_per_token"] / 1e9, 2),
        "samples_tok_per_s": round(got["tokens"] / got["seconds"]),
        "checks_inline_tok_per_s": round(got["tokens"] / got["step_seconds_checks_inline"]),
    }


def test_bench_train_kimi_draft(report, gpu_out):
    run_bench(kimi(), report, gpu_out)


def run_bench(b: Bench, report, gpu_out) -> None:
    """In the order the goals need them, each reported as it is measured (a GPU run that ends mid-way keeps what was
    measured): the table; the 8k profile where the MFU goal is missed; the MLA rows; the same with the mask-free
    varlen attention; the compiled rows (minutes of compiling); last the open-ended longest-sequence searches (sdpa,
    varlen). Only b.parts where named (PARTS). One draft on the GPU at a time (each 0.99 B parameters with float32
    weights, gradients and AdamW state: ~16 GB)."""
    short, mid, long = b.seqs
    wanted = set(b.parts or PARTS)
    rows, mla_rows, varlen, compiled, goals = [], [], [], [], {}
    if "table" in wanted:
        rows, goals = table_rows(b, report, gpu_out)
    if "mla" in wanted:
        mla_model = _model(b, mla=b.mla)
        mla_opt = _optimizer(b, mla_model)
        mla_rows = [_tried(b, mla_model, mla_opt, seq, amp=True, mla=b.mla) for seq in (short, mid)]
        report("bench_train_kimi_mla_draft", mla_rows)
        _write_history(gpu_out, rows + mla_rows, b.device)
        mla_model = mla_opt = None
        torch.cuda.empty_cache()
    if "varlen" in wanted:
        varlen, goals = varlen_rows(b, report, gpu_out, goals)
        _write_history(gpu_out, rows + mla_rows + varlen, b.device)
    # then the compiled rows (minutes of compiling; whether a training run stays under the recompile limit decides
    # what the online step trains with), in b.compiled's order: flex attention (speculators'
    # default: a block mask, not sdpa's dense [T, T x steps] one; fused only compiled) over a training run's packs;
    # the varlen attention at 8k beside its eager row; flex at 8k and 32k; sdpa at 8k
    for attn, k in b.compiled if "compiled" in wanted else ():
        compiled.append(_compiled_run_row(b, attn) if k == "run" else _compiled_row(b, b.seqs[k], attn))
        report("bench_train_compiled", compiled)
        _write_history(gpu_out, rows + mla_rows + varlen + compiled, b.device)
    # last, the open-ended longest-sequence searches (the 32k goal's own row is in the table above)
    for attn, table, key in (
        (("sdpa", rows, "longest"), ("varlen", varlen, "longest_varlen")) if "longest" in wanted else ()
    ):
        longest = longest_search(b, attn, table)
        if attn == "sdpa":
            report("bench_train_longest_seq", longest)
            goals = dict(goals, **{"32k_goal_met": (longest or 0) >= long})
        goals = dict(goals, **{key: longest})
        report("bench_train_goals", goals)


def table_rows(b: Bench, report, gpu_out) -> tuple[list[dict], dict]:
    """The llama draft's table (2k, 8k, 32k bf16-mixed; fp32 at 8k; speculators' eager loss at 32k; torch's
    multi-tensor AdamW at 8k), the MFU goal, and the 8k profile where it is missed: (rows, goals)."""
    short, mid, long = b.seqs
    model = _model(b)
    opt = _optimizer(b, model)
    rows = []
    for seq, amp, loss in (
        (short, True, "auto"),
        (mid, True, "auto"),
        (long, True, "auto"),
        (mid, False, "auto"),
        (long, True, "eager"),
    ):  # the last: speculators' eager loss, for its peak memory
        rows.append(_tried(b, model, opt, seq, amp, loss_impl=loss))
        report("bench_train_kimi_draft", rows)
    # the multi-tensor AdamW (torch's default) beside the trainer's fused one, at the goal's size
    foreach = _optimizer(b, model, "foreach")
    rows.append(_tried(b, model, foreach, mid, True, optimizer="foreach"))
    report("bench_train_kimi_draft", rows)
    foreach = None
    assert all(r.get("tok_per_s", 1) > 0 for r in rows) and "out_of_memory" not in rows[1], rows  # 8k must train
    eight = rows[1]
    goals = {"mfu_8k": eight["mfu"], "mfu_goal_0.35_met": eight["mfu"] >= 0.35}
    report("bench_train_goals", goals)
    if eight["mfu"] < 0.35:  # the goal missed: where an 8k step's time goes (GPU_OUT/profile_8k.txt)
        _profile(b, model, opt, "sdpa", gpu_out / "profile_8k.txt", report, "bench_train_profile_8k")
    del model, opt
    torch.cuda.empty_cache()
    return rows, goals


def _profile(b: Bench, model, opt, attn: str, path, report, key: str) -> None:
    """Two steps at the goal's size, profiled: the table by kernel in ``path``, the shares by kind of work reported."""
    from tests.perf import step_profile

    inputs = _inputs(b, b.seqs[1], attn)
    prof = step_profile.profile(lambda: _steps(model, opt, inputs, 1, True), 2)
    path.write_text(step_profile.table(prof, top=40) + "\n")
    report(key, step_profile.shares(prof))


def varlen_rows(b: Bench, report, gpu_out, goals: dict) -> tuple[list[dict], dict]:
    """The llama draft with the mask-free TTT attention (TrainConfig.attn_impl "varlen"), eager: the table's sizes
    and, where its 8k MFU misses 35 %, its profile (GPU_OUT/profile_8k_varlen.txt); then the MLA draft with it at 2k
    and 8k. Returns the rows and the goals with the varlen figure."""
    model = _model(b, attn="varlen")
    opt = _optimizer(b, model)
    rows = []
    for seq in b.seqs:
        rows.append(_tried(b, model, opt, seq, True, attn="varlen"))
        report("bench_train_varlen", rows)
    eight = rows[1]
    goals = dict(goals, mfu_8k_varlen=eight.get("mfu"), **{"mfu_goal_0.35_met_varlen": eight.get("mfu", 0) >= 0.35})
    report("bench_train_goals", goals)
    if "out_of_memory" not in eight and eight["mfu"] < 0.35:
        _profile(b, model, opt, "varlen", gpu_out / "profile_8k_varlen.txt", report, "bench_train_profile_8k_varlen")
    del model, opt
    torch.cuda.empty_cache()
    model = _model(b, mla=b.mla, attn="varlen")  # the MLA draft with it, at the short and the goal's size
    opt = _optimizer(b, model)
    mla_rows = [_tried(b, model, opt, seq, True, mla=b.mla, attn="varlen") for seq in b.seqs[:2]]
    report("bench_train_varlen_mla", mla_rows)
    del model, opt
    torch.cuda.empty_cache()
    return rows + mla_rows, goals


def longest_search(b: Bench, attn: str, rows: list[dict]) -> int | None:
    """The longest sequence the llama draft trains with ``attn`` (longest_trainable from its table's rows; each size
    tried with two warm-up steps and one more, as AdamW's state appears at the first step)."""
    model = _model(b, attn=attn)
    opt = _optimizer(b, model)

    def fits(seq):
        return "out_of_memory" not in _tried(b, model, opt, seq, True, steps=1, attn=attn)

    try:
        return longest_trainable(fits, [r for r in rows if r.get("draft", "llama") == "llama"], b)
    finally:
        model = opt = None  # the memory back before the next search
        torch.cuda.empty_cache()


def card(name: str) -> str:
    """A CUDA device's name as a profile's first word: "NVIDIA H100 80GB HBM3" -> h100; else the name, dashed."""
    import re

    short = re.search(r"\b([ABHL]\d{2,3})\b", name)
    return short.group(1).lower() if short else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _write_history(gpu_out, rows: list[dict], device: str | None = None) -> None:
    """The rows that ran, as pytest-benchmark JSON: `eagle3 bench report --history GPU_OUT/benchmark.json`; the
    profile names the card (h100-kimi-k2.5-draft)."""
    import json

    from tests.perf.history import train_history

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    where = card(torch.cuda.get_device_name()) if device.startswith("cuda") else device
    (gpu_out / "benchmark.json").write_text(
        json.dumps(train_history(READER + rows, time.strftime("%Y-%m-%dT%H:%M"), f"{where}-kimi-k2.5-draft"))
    )


def _compiled_row(b: Bench, seq: int, attn: str = "sdpa") -> dict:
    """The llama draft compiled as TrainConfig(compile=True) runs it (speculators' own torch.compile of its forward:
    the TTT loop and the loss inside it), beside the eager rows: its tok/s and MFU, peak memory, and the compile's
    own seconds (the two warm-up steps). An error is the row."""
    torch._dynamo.reset()  # no recompiles inherited from an earlier row (8 at most for a function; 3 TTT steps a row)
    model = _model(b, attn=attn)
    opt = _optimizer(b, model)
    t0 = time.perf_counter()
    try:
        _steps(model, opt, _inputs(b, seq, attn), 2, True, compiled=True)
        warm = time.perf_counter() - t0
        row = _measure(b, model, opt, seq, True, compiled=True, attn=attn)
        return dict(row, attn=attn, compiled=True, compile_warmup_s=round(warm, 1))
    except Exception as e:  # noqa: BLE001 - reported (running out of memory too): whether compile pays is the question
        return {
            "seq": seq,
            "attn": attn,
            "compiled": True,
            "error": failure(e),
            "seconds": round(time.perf_counter() - t0, 1),
        }
    finally:
        model = opt = None  # the memory back before the next search
        torch.cuda.empty_cache()


def run_packs(b: Bench, n: int, seed: int = 0) -> list[list[int]]:
    """n packs as a training run makes them (train.pack_groups, micro_batches' packing: samples in order, a pack closed
    before it would pass the goal's size): sample lengths drawn from 1/16 to 1/4 of it, so each pack's length and
    documents differ. A pack holds at most 16 of them, so 16 n + 1 lengths close n packs."""
    from eagle3.train.train import pack_groups

    mid = b.seqs[1]
    g = torch.Generator().manual_seed(seed)
    lengths = [int(torch.randint(mid // 16, mid // 4 + 1, (1,), generator=g)) for _ in range(16 * n + 1)]
    return [[lengths[i] for i in group] for group in pack_groups(lengths, mid)[:n]]


def _compiled_run_row(b: Bench, attn: str) -> dict:
    """compile=True over a training run's packs (run_packs: every step another length, 3-15 documents), not one shape
    repeated: whether dynamo's recompiles stop once it marks the length dynamic (from the second length on) or reach
    the recompile limit (c5ebd37's compiled rows reached it, sharing one cache), and the rate over the later half of
    the steps, where the compiles are done. MFU from each pack's own attention (its documents', causal within each)."""
    from torch._dynamo.utils import counters

    from eagle3.train.compile_watch import RecompileLimitHits

    torch._dynamo.reset()
    with RecompileLimitHits() as hits:  # the trainer's own watch (TrainResult.notes)
        model = _model(b, attn=attn)
        opt = _optimizer(b, model)
        steps = b.run_steps
        packs = run_packs(b, steps)
        row = dict(_row("run", True, None, "auto", attn=attn), attn=attn, compiled=True)  # bench report's key: .../run
        if b.device == "cuda":
            torch.cuda.reset_peak_memory_stats()  # this row's peak, not an earlier row's
        t0, graphs, times = time.perf_counter(), [], []
        try:
            for lengths in packs:
                times.append(_steps(model, opt, _inputs(b, sum(lengths), attn, lengths), 1, True, compiled=True))
                graphs.append(counters["stats"]["unique_graphs"])
            later = range(steps // 2, steps)
            tokens = sum(sum(packs[i]) for i in later)
            rate = tokens / sum(times[i] for i in later)
            linear = sum(flops.linear_flops(b.shape, N_AUX, b.draft_vocab, TTT).values())
            attention = sum(n * flops.attention_flops(b.shape, TTT, n) for i in later for n in packs[i]) / tokens
            return dict(
                row,
                pack_tokens=[sum(p) for p in packs],
                documents=[len(p) for p in packs],
                s_per_step=[round(t, 3) for t in times],
                graphs_after_each_step=graphs,
                recompile_limit_hits=hits.messages,
                tok_per_s=round(rate),
                mfu=round(flops.mfu(rate, linear + attention), 4),
                seconds=round(time.perf_counter() - t0, 1),
                peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1) if b.device == "cuda" else None,
            )
        except Exception as e:  # noqa: BLE001 - reported as the row, as _compiled_row's
            return dict(
                row,
                error=failure(e),
                steps_done=len(times),
                recompile_limit_hits=hits.messages,
                seconds=round(time.perf_counter() - t0, 1),
            )
        finally:
            del model, opt
            torch.cuda.empty_cache()


def reader_rate(root, n: int, seq: int, hidden: int = 7168, step_tokens: int = 8192) -> dict:
    """Write n samples of seq tokens of 4 x hidden bf16 states, then read them back through the trainer's
    StoreSamples (checksums and finiteness checked as in training): the samples alone (seconds), and as the
    trainer's steps take them (step_seconds: train.read_packs, packs of step_tokens, pinned where CUDA is, the guard
    of 3 TTT steps, the checksums hashed ahead as train() does), beside it with the checksums hashed in the reader's
    path (step_seconds_checks_inline), each from a fresh StoreSamples (the shards' checksums again)."""
    from eagle3.store.folder import Store
    from eagle3.store.format import StoreSpec
    from eagle3.store.writer import ShardWriter
    from eagle3.train import train as train_mod

    spec = StoreSpec(
        target={"name_or_path": "synthetic", "num_hidden_layers": 61, "vocab_size": 163840},
        layer_ids=(2, 30, 58, 61),
        hidden_size=hidden,
        dtype="bfloat16",
    )
    store = Store.open(root, spec, create=True)
    writer = ShardWriter(root, spec, 0, shard_tokens=1 << 15)
    g = torch.Generator().manual_seed(0)
    for i in range(n):  # states [layers, T, H]
        writer.add(
            f"s{i}",
            torch.randint(0, 163840, (seq,), generator=g),
            torch.ones(seq, dtype=torch.uint8),
            torch.randn(4, seq, hidden, generator=g).bfloat16(),
        )
    store.commit(writer.flush())
    writer.close()
    samples = train_mod.StoreSamples(Store.open(root), 0)
    t0 = time.perf_counter()
    tokens = sum(samples.get(i)["input_ids"].shape[0] for i in range(len(samples)))
    seconds = time.perf_counter() - t0
    per_step = max(1, step_tokens // seq)
    pin = torch.cuda.is_available()

    def as_steps(ahead: bool) -> tuple[float, int]:
        samples = train_mod.StoreSamples(Store.open(root), 0)
        t0, steps = time.perf_counter(), 0
        if ahead:  # as train() does: the shards' checksums in a background thread, in the order of the reads
            samples.check_ahead(range(n))
        for k in range(0, n, per_step):  # each step's packs dropped before the next (pinned blocks reused)
            train_mod.read_packs(samples, list(range(k, min(n, k + per_step))), step_tokens, TTT - 1, pin)
            steps += 1
        return time.perf_counter() - t0, steps

    inline_seconds, _ = as_steps(False)
    step_seconds, steps = as_steps(True)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "bytes_per_token": 4 * hidden * 2,
        "steps": steps,
        "step_tokens": step_tokens,
        "step_seconds": step_seconds,
        "pinned": pin,
        "step_seconds_checks_inline": inline_seconds,
    }
