"""The GPU tables of issues 72 and 73 (tests/gpu/test_long_acceptance.py, tests/gpu/test_int4_acceptance.py) run on
the CPU with every stage stood in for: the target's training, its quantization, extraction, the trainer and vLLM's
evaluation. Each configuration is built for real (ExtractConfig, TrainConfig, EvalConfig refuse a keyword they lack),
and the stand-in figures are chosen so that each verdict and assertion is decided here, so a GPU run measures instead
of finding a wrong key."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from eagle3.extract import extract
from eagle3.serve import evaluate
from eagle3.targets import int4, learnable
from eagle3.train import train
from tests.gpu import test_int4_acceptance as int4_table
from tests.gpu import test_long_acceptance as long_table

from .test_e2e_rehearsal import Reported


def run_of(acc: float, se: float = 0.01) -> evaluate.SpecRun:
    """A SpecRun of acceptance length ``acc`` (k = 3) whose error is about ``se``."""
    n = round(0.6 / se**2)  # the error of a length that is 1 + 0/3 accepted, about 0.6/sqrt(n)
    first = (acc - 1) / 3
    return evaluate.SpecRun(acc, [first] * 3, n, 3 * n, round((acc - 1) * n), n, 1.0)


@pytest.fixture
def stand_ins(monkeypatch, tmp_path):
    """Every stage recorded and stood in for; ``figures(cfg)`` decides each evaluation's acceptance length."""
    calls = {"make": [], "quantize": [], "extract": [], "extract_backend": [], "engines": [], "train": [], "eval": []}
    state = {"figures": lambda cfg: (3.0, {})}

    def make_target(out, **kw):
        calls["make"].append((str(out), kw))
        return {"final_loss": 1.0, "first_loss": 7.0, "steps": kw["steps"], "arch": kw["arch"]}

    def quantize_target(src, out, device="cpu"):
        calls["quantize"].append((str(src), str(out), device))
        return {"quantized": 168, "kept": 113}

    def extract_run(cfg, progress=True, **kw):
        assert isinstance(cfg, extract.ExtractConfig)
        calls["extract"].append(cfg)
        calls["extract_backend"].append(kw.get("backend"))
        return types.SimpleNamespace(samples_written=10, tokens_written=1000, selfcheck="PASS", seconds=1.0,
                                     data_report="10 samples")  # fmt: skip

    def train_train(cfg, progress=True, source=None):
        assert isinstance(cfg, train.TrainConfig)
        calls["train"].append(cfg)
        return types.SimpleNamespace(draft=f"{cfg.out}/draft")

    def evaluate_run(cfg):
        assert isinstance(cfg, evaluate.EvalConfig)
        calls["eval"].append(cfg)
        short, longs = state["figures"](cfg)
        (tmp_path / cfg.out).mkdir(parents=True, exist_ok=True)
        (tmp_path / cfg.out / "eval.json").write_text("{}")
        traffic = {t: run_of(short) for t in ("chat", "thinking", "tool")}
        return evaluate.EvalReport({}, [2, 4, 5], run_of(short), per_traffic=traffic,
                                   long={str(n): run_of(a) for n, a in longs.items()})  # fmt: skip

    monkeypatch.setattr(learnable, "make_target", make_target)
    monkeypatch.setattr(int4, "quantize_target", quantize_target)

    def make_backend(cfg, spec):  # an engine passed to extract.run: its kwargs and whether it was closed
        engine = types.SimpleNamespace(kwargs=dict(cfg.vllm_kwargs), closed=False)
        engine.close = lambda: setattr(engine, "closed", True)
        calls["engines"].append(engine)
        return engine

    monkeypatch.setattr(extract, "run", extract_run)
    monkeypatch.setattr(extract, "make_backend", make_backend)
    monkeypatch.setattr(extract, "store_spec", lambda model, ids, dtype: (model, ids, dtype))
    monkeypatch.setattr(train, "train", train_train)
    monkeypatch.setattr(evaluate, "run", evaluate_run)
    return calls, state


@pytest.mark.parametrize("gain", [0.5, 0.0])
def test_the_int4_table_trains_on_each_form_serves_on_each_and_states_its_verdict(stand_ins, tmp_path, gain):
    calls, state = stand_ins

    def figures(cfg):  # an INT4-trained draft served on the INT4 target gains ``gain``; seeds differ by 0.02
        trained_int4, served_int4 = "train-int4" in cfg.draft, cfg.target.endswith("int4")
        seed = 0.02 if cfg.draft.removesuffix("/draft").endswith("-1") else 0.0
        return 3.0 + seed + (gain if trained_int4 and served_int4 else 0.0), {}

    state["figures"] = figures
    reported = Reported()
    gpu_out = tmp_path / "gpu-out"
    gpu_out.mkdir()
    int4_table.test_a_draft_trained_on_either_form_is_served_on_either(tmp_path, gpu_out, reported)
    assert [kw["arch"] for _, kw in calls["make"]] == ["deepseek"] and len(calls["quantize"]) == 1
    assert [c.model for c in calls["extract"]] == [str(tmp_path / "bf16"), str(tmp_path / "int4")]
    assert len(calls["train"]) == 4 and len(calls["eval"]) == 8
    table = reported["int4_table"]
    assert set(table["cells"]) == {f"{t} states, served {s}" for t in ("bf16", "int4") for s in ("bf16", "int4")}
    cell = table["cells"]["int4 states, served int4"]
    assert cell["seeds"] == [3.0 + gain, 3.02 + gain] and set(cell["per_traffic"]) == {"chat", "thinking", "tool"}
    assert table["verdict"] == ("matters" if gain else "does not matter at this scale")
    assert len(list(gpu_out.glob("int4_eval_*.json"))) == 8


@pytest.mark.parametrize("kept", [True, False])
def test_the_long_table_serves_every_length_in_one_engine_and_the_control_decides(stand_ins, tmp_path, kept):
    """Drafts trained on the mix keep 3.0 at every length (short 3.0); short-only ones fall to 2.0 at 16k. With the
    mix no better (``kept`` False) the control's assertion fails. The two tests share one target and its stores."""
    calls, state = stand_ins

    def figures(cfg):
        mixed = "-mix-" in cfg.draft and kept
        seed = 0.02 if cfg.draft.removesuffix("/draft").endswith("-1") else 0.0
        return 3.0 + seed, {n: 3.0 + seed if mixed else 3.0 + seed - n / 16384 for n in cfg.long_context}

    state["figures"] = figures
    reported = Reported()
    gpu_out = tmp_path / "gpu-out"
    gpu_out.mkdir()
    setup = long_table.build(tmp_path, reported)
    llama = lambda: long_table.test_llama_3_1_trained_on_long_windows_beats_short_only_at_16k_by_three_spreads(  # noqa: E731
        setup, gpu_out, reported
    )
    if not kept:
        with pytest.raises(AssertionError) as failed:
            llama()
        assert "gain > SPREAD_FACTOR" in str(failed.traceback[-1].statement)  # the control, not another check
        return
    llama()
    long_table.test_mla_3_1_trained_on_long_windows_learns_and_states_its_verdict(setup, gpu_out, reported)
    assert [kw["arch"] for _, kw in calls["make"]] == ["deepseek-long"]
    assert [(c.data.max_len, c.data.run_together) for c in calls["extract"]] == [(512, False), (16384, True)]
    (engine,) = calls["engines"]  # one engine for both stores, long enough for the longest, closed after
    assert calls["extract_backend"] == [engine, engine] and engine.kwargs["max_model_len"] >= 16384 and engine.closed
    assert len(calls["train"]) == 6 and all(c.pack_tokens == 16384 for c in calls["train"])
    assert [c.batch_samples for c in calls["train"]] == [32, 2, 32, 2, 32, 2]  # short, mix in turn
    assert [c.draft_arch for c in calls["train"]] == ["llama"] * 4 + ["mla"] * 2
    assert [Path(c.store).name for c in calls["train"]] == ["store-short", "store-mix"] * 3
    assert all(c.long_context == (4096, 8192, 16384) and c.long_prompts for c in calls["eval"])
    assert {c.target for c in calls["eval"]} == {str(tmp_path / "target")}  # one target for both variants
    table = reported["long_table"]
    assert len(table) == 6 and table["llama + 3.1, short, seed 0"]["16k"][0] == 2.0
    assert set(reported["long_seconds"]) == set(table) and all(set(t) == {"train", "serve"} for t in
                                                                reported["long_seconds"].values())  # fmt: skip
    for variant in ("llama + 3.1", "mla + 3.1"):
        v = reported[f"long_verdict[{variant}]"]
        assert v["kept_4k"] == 1.0 and v["kept_16k"] == 1.0 and v["gain_16k_vs_short_only"] == 1.0, v
        assert v["goal_met"] and v["short_spread"] == reported["long_verdict[llama + 3.1]"]["short_spread"], v
    assert len(list(gpu_out.glob("long_eval_*.json"))) == 6


def test_the_long_table_s_mla_test_alone_states_no_goal_without_a_measured_spread(stand_ins, tmp_path):
    calls, state = stand_ins
    state["figures"] = lambda cfg: (3.0, {n: 3.0 - ("-short-" in cfg.draft) * n / 16384 for n in cfg.long_context})
    reported = Reported()
    gpu_out = tmp_path / "gpu-out"
    gpu_out.mkdir()
    long_table.test_mla_3_1_trained_on_long_windows_learns_and_states_its_verdict(
        long_table.build(tmp_path, reported), gpu_out, reported
    )
    v = reported["long_verdict[mla + 3.1]"]
    assert v["goal_met"] is None and v["short_spread"] is None and v["kept_16k"] == 1.0, v
    assert [c.draft_arch for c in calls["train"]] == ["mla", "mla"]
