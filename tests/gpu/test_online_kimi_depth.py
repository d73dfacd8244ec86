"""Online training at Kimi-K2.5's depth on one H200 (issue 42; opt-in with `-m kimi_depth`: 61 GB of dummy weights).

kimi-depth (DeepseekV3, 61 layers, hidden 7168, Kimi's MLA and MoE widths; config only, load_format="dummy",
decoder norms set to 1 as in test_kimi_depth) in an eager engine with 0.55 of the GPU, and in the same process the
trainer at Kimi-K2.5's draft size (hidden 7168, 64 x 128 heads, MLP 18432, draft vocabulary 32000, 3 TTT steps,
bf16-mixed) with the rest. The same N_SAMPLES samples of 512 tokens, three ways, in one run:
- extraction alone into a store written as the spool is, without fsync (tok/s), training alone on that store
  (tok/s, one epoch), reading each step's samples one step ahead (the default) and, as a control, between steps,
- online: the same training fed through a spool a quarter of the store's size as the engine extracts.
Each training run's time by phase (TrainResult.phases: setup, reading, steps, checkpoints).
Reported: the three rates, online against min(extract alone, train alone) (issue 42's goal: >= 0.8), the side that
waits (the spool's waits), peak GPU memory of the trainer, and the rate were the engine and the training steps to take
turns on the GPU (taking_turns: what one shared GPU allows without overlap, and online against it; under sustained,
the same from the sustained rates). Each rate twice:
over the whole run, and sustained (training alone over its later half of steps, TrainResult.timeline; online, the
pipeline once training began, OnlineResult.sustained_tokens_per_s). Asserted: the online run trains every sample
once in the same steps as the offline one, with finite losses (dummy weights: the losses mean nothing else).
The trainers: EAGLE3_ONLINE_ATTN's, one or several ("varlen,flex"): each trains alone and online beside the same
engine and the same extraction alone (one engine start for all; the read-ahead control with the first only), so
their figures compare within one run. tests/gpu/pick_trainer.py names the fastest that a benchtrain step showed
working, for EAGLE3_ONLINE_ATTN.
Run on an H200 at c5ebd37 (results/2026-12-05-c5ebd37-h200-vllm0.26.0: PASSED, online 0.666 of min(alone), training
alone at 3,352 tok/s against its steps' 18,685 in the trainer benchmark; no phases nor read-ahead then); at 6c7a0aa,
compiled flex, sustained 0.709; at 09b8a53 with the engine in the test's process (EAGLE3_ONLINE_ENGINE=in-process),
sustained 0.736 (compiled flex) and 0.788 (eager varlen); at f57edc4 (overlapped, unfsynced spool writes, background
checkpoints, the compile-lock gate) 0.993 and 1.063, the control 0.903 and 0.860 (results/2026-12-06-f57edc4-h200-
vllm0.26.0). Its code runs on CPU against the fake vLLM in
tests/unit/test_e2e_rehearsal.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch

from eagle3.data.conversations import random_samples
from eagle3.extract import extract
from eagle3.preflight import ATTENTIONS
from eagle3.targets import presets, tiny
from eagle3.train import online
from eagle3.train.train import TrainConfig, train
from tests.perf import gpu_window

from .conftest import MAX_BATCHED_TOKENS
from .stacks import PeriodicStacks
from .test_kimi_k25_wrapper import write_verifier_weights

pytestmark = [pytest.mark.gpu, pytest.mark.kimi_depth]
N_SAMPLES, SEQ = 512, 512  # 262,144 tokens; the store ~15 GB (4 x 7168 bf16 a token)
ONLINE_GOAL = 0.8
TRAINERS = {
    name: {"attn_impl": name, "compile": name == "flex"}  # TrainConfig's fields for each `train --attn` (flex
    for name in ATTENTIONS
}  # trains only compiled)
TRAINERS["varlen-compiled"] = {"attn_impl": "varlen", "compile": True}  # `train --attn varlen --compile`


def trainers_from_env() -> tuple:
    """EAGLE3_ONLINE_ATTN="varlen,flex" (or space-separated): the trainers compared, in that order; sdpa unset.
    flex: speculators' flex attention, compiled; varlen-compiled: the mask-free varlen attention, compiled."""
    names = tuple(n for n in re.split(r"[\s,]+", os.environ.get("EAGLE3_ONLINE_ATTN", "sdpa")) if n)
    unknown = [n for n in names if n not in TRAINERS]
    if unknown or not names or len(set(names)) < len(names):
        raise ValueError(
            f"EAGLE3_ONLINE_ATTN={os.environ.get('EAGLE3_ONLINE_ATTN')!r}: name each trainer once, of "
            f"{', '.join(TRAINERS)}"
        )
    return names


ATTNS = trainers_from_env()
ENGINES = ("process", "in-process")  # vLLM's engine core in a process of its own (vLLM's default), or in this one


def engine_from_env() -> str:
    """EAGLE3_ONLINE_ENGINE: where the engine runs, beside the trainer (`train --online --engine-in-process`);
    process unset."""
    engine = os.environ.get("EAGLE3_ONLINE_ENGINE", "process").strip()
    if engine not in ENGINES:
        raise ValueError(f"EAGLE3_ONLINE_ENGINE={engine!r}: one of {', '.join(ENGINES)}")
    return engine


ENGINE = engine_from_env()
CONTROL = os.environ.get("EAGLE3_ONLINE_CONTROL", "1") != "0"  # 0: no read-ahead control run (a short GPU run)
AGAIN = os.environ.get("EAGLE3_ONLINE_AGAIN", "1") != "0"  # 0: no second extraction alone (a short GPU run)


def window_from_env() -> tuple | None:
    """EAGLE3_ONLINE_PROFILE="AFTER:SECONDS": each online run's GPU kernels by stream over that window of it
    (tests/perf/gpu_window.py; CUPTI slows the run it records: not for the run whose rates are judged); unset: none."""
    value = os.environ.get("EAGLE3_ONLINE_PROFILE", "").strip()
    if not value:
        return None
    try:
        after, seconds = (float(x) for x in value.split(":"))
        assert after >= 0 and seconds > 0
    except (ValueError, AssertionError):
        raise ValueError(
            f"EAGLE3_ONLINE_PROFILE={value!r}: AFTER:SECONDS, the window's start from the online run's "
            "start and its length, e.g. 25:4"
        ) from None
    return after, seconds


WINDOW = window_from_env()


def test_online_at_kimi_depth_against_extract_alone_and_train_alone(tmp_path_factory, tmp_path, report, gpu_out):
    prof = presets.from_name("kimi-depth")
    folder = tiny.build_model(prof, tmp_path_factory.mktemp("kimi-depth"), dtype="bfloat16")
    summaries = online_beside_the_engine(folder, prof, tmp_path, report, stacks_dir=gpu_out)
    for summary in summaries.values():
        assert summary["same_steps_and_samples"] and summary["losses_finite"], summary
        assert summary["spool"]["peak"] <= summary["spool"]["capacity"], summary


def _fresh(trainer: dict) -> None:
    """Before a compiled run: dynamo's caches emptied. The draft's forward is one code object for every draft built
    in this process; each run's 3 TTT steps add their graphs to it, and a third run would pass dynamo's recompile
    limit (8) and train eagerly (flex attention unfused)."""
    if trainer["compile"]:
        torch._dynamo.reset()


def warm(ex, samples, backend, out) -> None:
    """After _fresh, with the engine in this process: one extraction batch of the online run's shape, so that vLLM's
    own torch.compile'd helpers (grouped_topk, dynamic=True), whose code dynamo's reset emptied too, compile again
    here and not in the producer thread beside the trainer (train/compile_gate.py; in `train --online` they compile
    while the engine starts)."""
    extract.run(dataclasses.replace(ex, out=str(out)), samples=samples, backend=backend, progress=False)
    shutil.rmtree(out)


def _gone(folder) -> None:
    """A training run's folder, once its result is taken: at the Kimi-size draft its final checkpoint (float32 weights
    and AdamW state) and export are ~14 GB, and the host's disk (64 GB) holds the 15 GB store and a few of them."""
    shutil.rmtree(folder)


def online_beside_the_engine(
    folder,
    prof,
    tmp_path,
    report,
    n_samples: int = N_SAMPLES,
    seq: int = SEQ,
    device: str = "cuda",
    draft_vocab: int = 32000,
    batch_samples: int = 16,
    pack_tokens: int = 8192,
    extract_batch: int = 32,
    attns: tuple = ATTNS,
    engine: str = ENGINE,
    control: bool = CONTROL,
    gpu_mem: float = 0.55,
    again: bool = AGAIN,
    window: tuple | None = WINDOW,
    stacks_dir=None,
    stacks_every: float = 30.0,
    draft: dict | None = None,
) -> dict:
    """Extract alone, then for each trainer of ``attns`` train alone and online, on one engine (dummy weights, unit
    decoder norms, the verifier's head written from the engine's own): {trainer: its summary (the three rates, the
    waits, the trainer's peak memory)}, reported as each comes (online_kd_summary). again: the extraction alone once
    more after the online runs (online_kd_extraction_twice: the spread of the goal's denominator). window: (after,
    seconds) of each online run profiled by stream (the summary's gpu_window). stacks_dir: every thread's stack each
    stacks_every seconds of each online run, to stacks_dir/online-stacks-TRAINER.txt. draft: TrainConfig options
    that replace the draft's (a small draft on the CPU). On CPU with the fake vLLM and tiny-kimi in
    tests/unit/test_e2e_rehearsal.py."""
    from eagle3.extract.vllm_backend import VLLMBackend

    spec = extract.store_spec(folder, None, "bfloat16")
    t0 = time.perf_counter()
    backend = VLLMBackend(
        str(folder),
        spec,
        gpu_memory_utilization=gpu_mem,
        max_model_len=4096,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        load_format="dummy",
        log_level="INFO",
        extra_engine_args={"enforce_eager": True},
        in_process=engine == "in-process",
    )
    shared = {"engine": engine, "engine_start": round(time.perf_counter() - t0, 1)}
    samples = random_samples(n_samples, seq, prof.vocab_size, seed=91)
    tokens = n_samples * seq
    cuda = device == "cuda"
    summaries: dict[str, dict] = {}
    reported = {"trainers": {}}

    def report_seconds():  # as each run ends: a step cut short by its limit keeps what was timed
        report("online_kd_seconds", dict(shared, **reported))

    def cfg(trainer, store, out, read_ahead=True):
        return TrainConfig(
            store=str(store),
            out=str(out),
            device=device,
            batch_samples=batch_samples,
            pack_tokens=pack_tokens,
            epochs=1,
            lr=1e-4,
            warmup_steps=1,
            draft_vocab_size=draft_vocab,
            seed=0,
            checkpoint_minutes=0,
            read_ahead=read_ahead,
            **{"ttt_steps": 3, **trainer, **(draft or {})},
        )

    try:
        backend.unit_norms()
        write_verifier_weights(folder, backend.dump_head(tmp_path), prefix="")
        # extract alone writes as the spool does, without fsync: the online extraction's own work, alone (an fsynced
        # store ran at 0.97x plain prefill at kimi-depth; the spool is never fsynced, train/online.py Spool)
        ex = extract.ExtractConfig(
            model=str(folder),
            out=str(tmp_path / "store"),
            backend="vllm",
            batch_size=extract_batch,
            selfcheck=0,
            fsync=False,
        )
        t0 = time.perf_counter()
        alone = extract.run(ex, samples=samples, backend=backend, progress=False)
        shared["extract_alone"] = round(time.perf_counter() - t0, 1)
        # its rate over the window the online run's sustained figure takes of the extraction (first batch left out)
        extract_sustained = round(alone.sustained_tokens_per_s())
        report_seconds()
        store_bytes = sum(p.stat().st_size for p in (tmp_path / "store" / "shards").iterdir())
        capacity = store_bytes // 4
        for i, name in enumerate(attns):
            trainer, runs = TRAINERS[name], tmp_path / name
            seconds = reported["trainers"][name] = dict(shared)
            between = None
            if i == 0 and control:  # the read-ahead's control, once, first: a fresh host's first compiled run
                # compiles cold (~90 s at Kimi's size, the 2026-12-05 H200 run), the runs after it from inductor's
                # warm cache, the timed train-alone run then as the online one
                _fresh(trainer)
                t0 = time.perf_counter()
                between = train(cfg(trainer, tmp_path / "store", runs / "between", read_ahead=False), progress=False)
                seconds["train_alone_reading_between_steps"] = round(time.perf_counter() - t0, 1)
                _gone(runs / "between")
                report_seconds()
            base = torch.cuda.memory_allocated() if cuda else 0  # an engine in this process: its weights and cache
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            _fresh(trainer)
            t0 = time.perf_counter()
            off = train(cfg(trainer, tmp_path / "store", runs / "offline"), progress=False)
            seconds["train_alone"] = round(time.perf_counter() - t0, 1)
            peak_train = (torch.cuda.max_memory_allocated() if cuda else 0) - base
            _gone(runs / "offline")
            report_seconds()
            _fresh(trainer)
            if engine == "in-process" and trainer["compile"]:
                warm(ex, samples[:extract_batch], backend, tmp_path / "warm")
            profiled = gpu_window.Window(*window, cuda=cuda) if window else None
            dumps = (
                PeriodicStacks(Path(stacks_dir) / f"online-stacks-{name}.txt", every=stacks_every)
                if stacks_dir
                else contextlib.nullcontext()
            )
            t0 = time.perf_counter()
            # a slow or stuck online run says where each thread is
            with profiled or contextlib.nullcontext(), dumps:
                on = online.run(
                    cfg(trainer, runs / "spool", runs / "online"),
                    ex,
                    samples,
                    capacity,
                    backend=backend,
                    extract_batch=extract_batch,
                    progress=False,
                )
            seconds["online"] = round(time.perf_counter() - t0, 1)
            _gone(runs)
            report_seconds()
            summaries[name] = summarize(
                name, seconds, tokens, off, between, on, peak_train, capacity, n_samples, extract_sustained
            )
            if profiled:
                summaries[name]["gpu_window"] = {
                    "after_s": window[0],
                    "seconds": window[1],
                    "streams_busy": profiled.summary,
                    "error": profiled.error,
                }
            report("online_kd_summary", summaries)
        if again:  # the denominator's run-to-run spread, measured after the online runs (the host as they found it)
            shutil.rmtree(tmp_path / "store")
            t0 = time.perf_counter()
            again_run = extract.run(ex, samples=samples, backend=backend, progress=False)
            reported["extract_alone_again"] = round(time.perf_counter() - t0, 1)
            report_seconds()
            report(
                "online_kd_extraction_twice",
                extraction_twice(
                    shared["extract_alone"],
                    reported["extract_alone_again"],
                    tokens,
                    summaries,
                    [extract_sustained, round(again_run.sustained_tokens_per_s())],
                ),
            )
    finally:
        backend.close()
    return summaries


def summarize(
    name: str,
    seconds: dict,
    tokens: int,
    off,
    between,
    on,
    peak_train: int,
    capacity: int,
    n_samples: int,
    extract_sustained: float,
) -> dict:
    """One trainer's figures: its runs (TrainResult alone, alone reading between steps or None, OnlineResult) against
    the extraction alone (its whole run; and extract_sustained, its rate without its first batch)."""
    rate = {k: round(tokens / max(v, 0.05)) for k, v in seconds.items() if k not in ("engine", "engine_start")}
    ratio = rate["online"] / min(rate["extract_alone"], rate["train_alone"])
    # One GPU, shared: were the engine and the trainer's steps to take turns on it (no kernel of one overlapping the
    # other's), online could reach tokens / (extraction's seconds + the steps' seconds). Against min(alone) that is
    # T / (E + T) where the extraction (E tok/s) is the slower: the 0.8 goal needs the steps >= 4x the extraction,
    # or the two overlapping on the GPU. online_vs_it > 1: they did overlap.
    steps_s = off.phases["steps"]
    turns = round(tokens / (seconds["extract_alone"] + steps_s))
    taking_turns = {
        "tok_per_s": turns,
        "train_steps_tok_per_s": round(tokens / steps_s),
        "online_vs_it": round(rate["online"] / turns, 3),
        "it_vs_min_alone": round(turns / min(rate["extract_alone"], rate["train_alone"]), 3),
    }
    # Sustained (the issue's word): training alone over its later half of steps (no setup, no first-step warm-up or
    # compile, no final checkpoint and export, which a 262k-token run cannot amortize); online, the pipeline once
    # training began (OnlineResult.sustained_tokens_per_s: no head start taken while the draft was built, no stall
    # behind a compiling first step); the extraction alone as above (its engine already started)
    steady = {
        "extract_alone": rate["extract_alone"],
        "train_alone": round(off.sustained_tokens_per_s()),
        "online": round(on.sustained_tokens_per_s()),
    }
    e, t = steady["extract_alone"], steady["train_alone"]
    steady_ratio = steady["online"] / min(e, t)
    committed = round(on.committed_tokens_per_s())  # the control, as the other rates: whole tokens a second
    # the taking-turns ceiling from the sustained rates: a first compiled run's steps hold the host's cold compile
    turns_steady = e * t / (e + t)
    runs = {"train_alone": off, "online": on.train} | (
        {"train_alone_reading_between_steps": between} if between else {}
    )
    return {
        "attn": name,
        "trainer": TRAINERS[name],
        "engine": seconds["engine"],
        "seconds": seconds,
        "tok_per_s": rate,
        "online_vs_min_alone": round(ratio, 3),
        "goal_0.8_met": ratio >= ONLINE_GOAL,
        "taking_turns": taking_turns,
        "sustained": {
            "tok_per_s": steady,
            "online_vs_min_alone": round(steady_ratio, 3),
            "goal_0.8_met": steady_ratio >= ONLINE_GOAL,
            # the control (OnlineResult.committed_tokens_per_s): the extraction's commits over the
            # trainer's later half, which no state the spool held before it can inflate; 0 where the
            # extraction had ended before that half began
            "committed_in_later_half": {"tok_per_s": committed, "vs_min_alone": round(committed / min(e, t), 3)},
            # against the extraction alone over the window the online figure takes of it (no first
            # batch's warm-up: ExtractSummary.sustained_tokens_per_s); read the goal off the lower
            "against_the_extraction_s_sustained_rate": {
                "extract_alone": extract_sustained,
                "online_vs_min_alone": round(steady["online"] / min(extract_sustained, t), 3),
                "committed_vs_min_alone": round(committed / min(extract_sustained, t), 3),
            },
            "taking_turns": {
                "tok_per_s": round(turns_steady),
                "vs_min_alone": round(turns_steady / min(e, t), 3),
                "online_vs_it": round(steady["online"] / turns_steady, 3),
            },
        },
        "lines": on.lines(),
        "waits_s": {
            "extraction_for_room": round(on.producer_wait_s, 1),
            "training_for_states": round(on.trainer_wait_s, 1),
            "extraction_behind_compiles": round(on.compile_wait_s, 1),
        },
        "compiles_gated": on.compiles,  # the engine in this process: the trainer's compiles it waited for
        "engine_phases_s": {k: round(v, 1) for k, v in on.engine_phases.items()},  # the producer's calls
        "phases_s": {k: r.phases for k, r in runs.items()},
        "notes": {k: r.notes for k, r in runs.items() if r.notes},  # a recompile limit reached, among others
        "read_ahead_same_losses": off.losses == between.losses if between else None,
        "trainer_peak_gib": round(peak_train / 2**30, 1),
        "spool": {"capacity": capacity, "peak": on.peak_bytes},
        "same_steps_and_samples": on.train.steps == off.steps
        and on.train.samples_seen == off.samples_seen == n_samples,
        "steps": on.train.steps,
        "losses_finite": all(math.isfinite(x) for x in off.losses + on.train.losses),
    }


def extraction_twice(first_s: float, again_s: float, tokens: int, summaries: dict, sustained: list) -> dict:
    """The extraction alone, timed before the trainers and again after them: both rates, their spread (the difference
    over the faster), each one's rate without its first batch (sustained: ExtractSummary.sustained_tokens_per_s), and
    each trainer's sustained online rate against min(the slower or the faster extraction, its training alone): the
    goal's ratio as the spread moves it."""
    rates = [round(tokens / max(s, 0.05)) for s in (first_s, again_s)]
    out = {
        "seconds": [first_s, again_s],
        "tok_per_s": rates,
        "spread": round(abs(rates[0] - rates[1]) / max(rates), 3),
        "sustained_tok_per_s": sustained,
        "sustained_online_vs_min_alone": {},
    }
    for name, got in summaries.items():
        steady = got["sustained"]["tok_per_s"]
        out["sustained_online_vs_min_alone"][name] = {
            which: round(steady["online"] / min(rate, steady["train_alone"]), 3)
            for which, rate in (("slower", min(rates)), ("faster", max(rates)))
        }
    return out
