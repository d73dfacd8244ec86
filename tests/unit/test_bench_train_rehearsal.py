"""tests/gpu/test_bench_train.py's code run on CPU at a small draft shape, so a GPU run spends its time measuring, not
finding a wrong name: every row of the table, the longest-sequence search against sizes that run out of memory, the
profile where the MFU goal is missed, the MLA rows, the report's JSON and the compiled row. The figures mean nothing
here (CPU, a 64-wide draft); what is checked is that each is made and lands where `bench report` reads it."""

import pytest
import torch

from eagle3 import bench
from eagle3.train import mla_draft
from eagle3.train.draft import DraftShape
from tests.gpu import test_bench_train as gb

SMALL = gb.Bench(
    DraftShape(64, 512, 4, 2, 16, 128),
    mla_draft.MLAShape(64, 4, 24, 32, 16, 8, 12, 96),
    device="cpu",
    draft_vocab=256,
    seqs=(32, 64, 128),
    longest_cap=512,
    longest_step=16,
    compiled=(("varlen", 1), ("sdpa", 1), ("sdpa", "run")),
    run_steps=4,
    measure_steps=(1, 1),  # the figures mean nothing here: a step to warm up, one to time
)  # the compiled rows' code (speculators compiles only where CUDA is; a compile that fails on the GPU is that row's
# error, not a lost table)


def _out_of_memory_past(monkeypatch, limit: int) -> list[int]:
    """Steps of more than ``limit`` tokens run out of memory, as they would on the GPU; the sizes tried, in order."""
    real, tried = gb._measure, []

    def measure(b, model, opt, seq, *a, **kw):
        tried.append(seq)
        if seq > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (rehearsal: {seq} > {limit} tokens)")
        return real(b, model, opt, seq, *a, **kw)

    monkeypatch.setattr(gb, "_measure", measure)
    return tried


def test_the_training_benchmark_runs_its_whole_table(monkeypatch, tmp_path):
    """Every row, in the order the goals need them, each trained as the trainer does: speculators 0.9 compiles
    Eagle3DraftModel.forward itself wherever CUDA is (conditional_torch_compile), and the trainer runs it under
    torch.compiler.set_stance("force_eager") unless TrainConfig.compile. So the table, the profile, the MLA rows and
    the longest-sequence search step under the trainer's stance, the compiled rows under "default"
    (TrainConfig(compile=True)). The H200 run at 22765c4 measured its table compiled, as nothing set the stance."""
    import contextlib

    stances = []

    def set_stance(stance, **kw):
        stances.append(stance)
        return contextlib.nullcontext()

    monkeypatch.setattr(torch.compiler, "set_stance", set_stance)
    resets = []  # dynamo's caches cleared before each compiled row: no row inherits another's recompiles (8 at most
    # for a function: three rows of three TTT steps each reached it at c5ebd37, and the third ran unfused)
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(len(stances)))
    limit, longest = 200, 192  # the long size (128) fits, 256 does not: bisected to a multiple of 16
    tried = _out_of_memory_past(monkeypatch, limit)
    got = {}
    gb.run_bench(SMALL, got.__setitem__, tmp_path)
    calls = [SMALL.run_steps if k == "run" else 3 for _, k in SMALL.compiled]  # _steps calls of a compiled row: its
    # compile's two steps, _measure's warm-up, timing; a run row's one a step
    n, first = sum(calls), stances.index("default")  # the compiled rows: one block, then the eager searches
    eager = stances[:first] + stances[first + n :]
    assert set(stances[first : first + n]) == {"default"} and set(eager) == {"force_eager"}, stances
    assert stances[:first] and stances[first + n :], stances  # the table before them, the searches after
    assert resets == [first + sum(calls[:i]) for i in range(len(calls))], (resets, first)
    order = list(got)
    assert (
        order.index("bench_train_varlen_mla")
        < order.index("bench_train_compiled")
        < order.index("bench_train_longest_seq")
    ), order  # a step cut short by its limit loses the open-ended searches first
    rows = got["bench_train_kimi_draft"]
    assert [(r["seq"], r["precision"], r["loss"], r["optimizer"]) for r in rows] == [
        (32, "bf16-mixed", "auto", "auto"),
        (64, "bf16-mixed", "auto", "auto"),
        (128, "bf16-mixed", "auto", "auto"),
        (64, "fp32", "auto", "auto"),
        (128, "bf16-mixed", "eager", "auto"),
        (64, "bf16-mixed", "auto", "foreach"),
    ]
    assert (
        list(got).index("bench_train_profile_8k")
        < list(got).index("bench_train_kimi_mla_draft")
        < list(got).index("bench_train_longest_seq")
    )  # what the goals need first; the open-ended search after them
    for r in rows:
        assert ("out_of_memory" in r) == (r["seq"] > limit), r
        assert "out_of_memory" in r or (r["tok_per_s"] > 0 and 0 <= r["mfu"] < 1 and "gflop_per_token" in r), r
    assert got["bench_train_longest_seq"] == longest, tried
    goals = got["bench_train_goals"]
    assert goals["longest"] == longest and goals["32k_goal_met"] == (longest >= 128)
    assert not goals["mfu_goal_0.35_met"]  # a CPU at 64 wide: the profile's branch runs
    assert (tmp_path / "profile_8k.txt").read_text().strip()
    assert sum(got["bench_train_profile_8k"].values()) == pytest.approx(1.0, abs=0.02)
    mla = got["bench_train_kimi_mla_draft"]
    assert [(r["draft"], r["seq"]) for r in mla] == [("mla", 32), ("mla", 64)] and all(r["tok_per_s"] > 0 for r in mla)
    # the rows that ran, as `bench report --history` reads them
    records = [r for r in bench.load_history([tmp_path / "benchmark.json"]) if "compiled" not in r.key]
    keys = sorted(r.key for r in records)
    assert keys == sorted(
        f"train_{d}_{p}{'_eager' if e else ''}/{s}"
        for d, s, p, e in [
            ("llama", 32, "bf16-mixed", 0),
            ("llama", 64, "bf16-mixed", 0),
            ("llama", 64, "fp32", 0),
            ("llama", 64, "bf16-mixed_foreach", 0),
            ("mla", 32, "bf16-mixed", 0),
            ("mla", 64, "bf16-mixed", 0),
        ]
        + [("llama", 128, "bf16-mixed", 0), ("llama", 128, "bf16-mixed", 1)]
        + [("llama", s, "bf16-mixed_varlen", 0) for s in SMALL.seqs]
        + [("mla", s, "bf16-mixed_varlen", 0) for s in SMALL.seqs[:2]]
    )
    assert len(bench.train_lines(records)) == 2 + len(keys)
    # the mask-free attention's rows and profile, then the MLA draft with it, before the open-ended searches
    varlen = got["bench_train_varlen"]
    assert [(r["seq"], r["attn"]) for r in varlen] == [(s, "varlen") for s in SMALL.seqs]
    assert all(r["tok_per_s"] > 0 for r in varlen) and goals["longest_varlen"] == longest
    order = list(got)
    assert order.index("bench_train_varlen_mla") < order.index("bench_train_longest_seq"), order
    assert (tmp_path / "profile_8k_varlen.txt").read_text().strip() and "mfu_8k_varlen" in goals
    assert [(r["draft"], r["seq"], r["attn"]) for r in got["bench_train_varlen_mla"]] == [
        ("mla", s, "varlen") for s in SMALL.seqs[:2]
    ]
    varlen_c, sdpa, run = got["bench_train_compiled"]  # the varlen one first: its inputs carry the samples' boundaries
    for row, attn in ((varlen_c, "varlen"), (sdpa, "sdpa")):
        assert (row["attn"], row["seq"]) == (attn, 64) and "error" not in row and row["tok_per_s"] > 0, row
    # a training run's packs: every step another length, several documents each, none past the goal's size (64)
    assert "error" not in run and run["seq"] == "run" and len(run["pack_tokens"]) == SMALL.run_steps, run
    assert len(set(run["pack_tokens"])) > 1 and all(48 < t <= 64 for t in run["pack_tokens"]), run
    assert min(run["documents"]) >= 3 and run["tok_per_s"] > 0 and 0 <= run["mfu"] < 1, run
    assert run["recompile_limit_hits"] == [] and len(run["graphs_after_each_step"]) == SMALL.run_steps, run
    keys = {r.key for r in bench.load_history([tmp_path / "benchmark.json"])}
    assert {
        "train_llama_bf16-mixed_compiled/64",
        "train_llama_bf16-mixed_varlen_compiled/64",
        "train_llama_bf16-mixed_compiled/run",
    } <= keys, keys


def test_a_short_run_measures_only_the_parts_it_names(monkeypatch, tmp_path):
    """EAGLE3_BENCH_TRAIN_PARTS="varlen,compiled": the varlen rows and the compiled rows, no table, MLA rows nor
    searches (a GPU run with minutes left measures what it still lacks); an unknown part is refused by name."""
    import dataclasses

    monkeypatch.setenv("EAGLE3_BENCH_TRAIN_PARTS", "varlen, compiled")
    parts = gb.parts_from_env()
    assert parts == ("varlen", "compiled")
    got = {}
    gb.run_bench(dataclasses.replace(SMALL, parts=parts), got.__setitem__, tmp_path)
    assert [k for k in got if k != "bench_train_goals"] == [
        "bench_train_varlen",
        "bench_train_profile_8k_varlen",
        "bench_train_varlen_mla",
        "bench_train_compiled",
    ], got
    assert len(got["bench_train_compiled"]) == len(SMALL.compiled) and "mfu_8k_varlen" in got["bench_train_goals"]
    keys = {r.key for r in bench.load_history([tmp_path / "benchmark.json"])}
    assert "train_llama_bf16-mixed_varlen/64" in keys and "train_llama_bf16-mixed/64" not in keys, keys
    monkeypatch.setenv("EAGLE3_BENCH_TRAIN_PARTS", "varlen,longst")
    with pytest.raises(ValueError, match="longst.*table, mla, varlen, compiled, longest"):
        gb.parts_from_env()
    monkeypatch.setenv("EAGLE3_BENCH_TRAIN_PARTS", "compiled,longest")
    with pytest.raises(ValueError, match="name table and varlen with it"):
        gb.parts_from_env()


def test_the_history_names_the_card_it_ran_on(monkeypatch, tmp_path):
    """The rows' profile in GPU_OUT/benchmark.json names the card (an H100 run's rows said h200)."""
    assert gb.card("NVIDIA H100 80GB HBM3") == "h100" and gb.card("NVIDIA H200") == "h200"
    assert gb.card("NVIDIA GeForce RTX 4090") == "nvidia-geforce-rtx-4090"
    monkeypatch.setattr(gb.torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    gb._write_history(tmp_path, [{"draft": "llama", "seq": 64, "precision": "bf16-mixed", "tok_per_s": 5.0}], "cuda")
    assert {r.profile for r in bench.load_history([tmp_path / "benchmark.json"])} == {"h100-kimi-k2.5-draft"}
    gb._write_history(tmp_path, [{"draft": "llama", "seq": 64, "precision": "bf16-mixed", "tok_per_s": 5.0}], "cpu")
    assert {r.profile for r in bench.load_history([tmp_path / "benchmark.json"])} == {"cpu-kimi-k2.5-draft"}


@pytest.mark.parametrize("limit,longest", [(200, 192), (100, 96), (1000, 512), (127, 112), (60, None)])
def test_the_longest_sequence_is_searched_from_what_the_table_found(limit, longest):
    """Long fits: doubled to the cap, then bisected; long does not fit: bisected between the goal's size and long; the
    goal's size does not fit: no search."""
    asked = []

    def fits(seq):
        asked.append(seq)
        return seq <= limit

    rows = [{"seq": s} if s <= limit else {"seq": s, "out_of_memory": True} for s in SMALL.seqs]
    assert gb.longest_trainable(fits, rows, SMALL) == longest
    assert all(a % SMALL.longest_step == 0 and a <= SMALL.longest_cap for a in asked), asked
    assert len(set(asked)) == len(asked), asked  # no size tried twice


def test_a_flex_row_trains_speculators_flex_attention():
    """The GPU's compiled flex rows build a model that attends with flex attention (a block mask), the others sdpa.
    (Not trained here: flex attention has no backward on the CPU.)"""
    assert gb._model(SMALL, attn="flex")._attn_impl == "simple_flex_attention"
    assert gb._model(SMALL)._attn_impl == "sdpa"
    assert gb._model(SMALL, attn="varlen")._attn_impl == "eagle3_varlen"


def test_the_reader_benchmark_reads_back_every_token(tmp_path):
    got = gb.reader_rate(tmp_path / "store", 3, 40, hidden=64)
    assert got["tokens"] == 120 and got["seconds"] > 0 and got["bytes_per_token"] == 4 * 64 * 2


def test_the_reader_s_row_reaches_bench_report_beside_the_table(monkeypatch, tmp_path):
    """The reader's figures, written with the table's rows to GPU_OUT/benchmark.json (as every _write_history does),
    come out of `bench report` set against the same run's training figure at its step length."""
    got = gb.reader_rate(tmp_path / "store", 4, 40, hidden=64, step_tokens=80)
    monkeypatch.setattr(gb, "READER", [gb.reader_row(got)])
    gb._write_history(tmp_path, [{"draft": "llama", "seq": 80, "precision": "bf16-mixed", "tok_per_s": 10, "mfu": 0.1}])
    md = bench.report([tmp_path / "benchmark.json"], tmp_path / "r")[0].read_text()
    line = next(x for x in md.splitlines() if "train_reader/80:" in x)
    assert f"as training steps read: {round(160 / got['step_seconds']):,} tok/s" in line, line
    assert f"checksums in the reader's path {round(160 / got['step_seconds_checks_inline']):,}" in line, line
    assert "the fastest training figure of its run at 80 tokens (train_llama_bf16-mixed/80, 10 tok/s" in line, line


def test_the_reader_benchmark_times_the_steps_as_the_trainer_reads_them(monkeypatch, tmp_path):
    """The figure set against the trainer's need is a step's read as train() makes it (train.read_packs: read,
    checked, packed, pinned on CUDA), every sample once in packs of step_tokens; reading the samples alone left out
    the packing, which is most of the copying."""
    from eagle3.train import train as train_mod

    calls, real = [], train_mod.read_packs

    def read_packs(samples, indices, pack_tokens, guard, pin, skipped=None):
        calls.append((list(indices), pack_tokens, guard, pin))
        return real(samples, indices, pack_tokens, guard, pin, skipped)

    ahead, check_ahead = [], train_mod.StoreSamples.check_ahead

    def recorded(self, order):
        ahead.append((len(calls), list(order)))
        return check_ahead(self, order)

    monkeypatch.setattr(train_mod, "read_packs", read_packs)
    monkeypatch.setattr(train_mod.StoreSamples, "check_ahead", recorded)
    got = gb.reader_rate(tmp_path / "store", 6, 40, hidden=64, step_tokens=80)
    # twice, every sample once a pass: the checksums in the reader's path, then hashed ahead as train() does
    assert [sorted(i for c in part for i in c[0]) for part in (calls[:3], calls[3:])] == [list(range(6))] * 2
    assert {c[1:] for c in calls} == {(80, 2, False)} and ahead == [(3, list(range(6)))]
    assert got["step_tokens"] == 80 and got["steps"] == 3 and got["step_seconds"] > 0, got
    assert got["step_seconds_checks_inline"] > 0 and gb.reader_row(got)["checks_inline_tok_per_s"] > 0
