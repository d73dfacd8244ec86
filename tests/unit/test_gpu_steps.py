"""The GPU step runner and its poll (tests/gpu/steps, tests/gpu/wait-steps), run on the CPU: steps in order under
their limits, and a poll that does not sit out its limit where nothing runs (a host that was replaced between two
polls has no RESULTS folder)."""

import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[1] / "gpu"
STEPS, WAIT = GPU / "steps", GPU / "wait-steps"


def _wait(tmp_path, results: Path, limit: int = 30, copy: Path | None = None):
    t0 = time.monotonic()
    out = subprocess.run(
        ["bash", str(WAIT), str(results), str(limit)] + ([str(copy)] if copy else []),
        capture_output=True,
        text=True,
        timeout=limit + 30,
        env=dict(os.environ, WAIT_GRACE="2", WAIT_POLL="0.2"),
        cwd=tmp_path,
        check=False,
    )  # looks every 0.2 s, the folder 2 s to appear (on a GPU host: 2 s, 5 s)
    return out, time.monotonic() - t0


def _steps(tmp_path, *args, timeout=60):
    smi = tmp_path / "bin" / "nvidia-smi"  # no GPU: the settle step sees 0 MiB used
    smi.parent.mkdir(exist_ok=True)
    smi.write_text("#!/bin/sh\necho 0\n")
    smi.chmod(0o755)
    env = dict(os.environ, PATH=f"{smi.parent}:{os.environ['PATH']}")
    return subprocess.run(
        ["bash", str(STEPS), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def test_steps_run_in_order_each_with_its_log_its_folder_and_its_ending(tmp_path):
    r = tmp_path / "results"
    done = _steps(tmp_path, r, "first", 'echo one > "$STEP_OUT/x"; echo hello', "second:5", "exit 7")
    assert done.returncode == 0, done.stderr
    lines = (r / "steps.txt").read_text().splitlines()
    ends = [line for line in lines if " rc=" in line]
    assert [e.split(" seconds=")[0] for e in ends] == ["first rc=0", "second rc=7"], lines
    assert any(line.startswith("second started") and "limit=5s" in line for line in lines), lines
    assert (r / "first.log").read_text() == "hello\n" and (r / "first" / "x").read_text() == "one\n"
    assert (r / "DONE").exists()


def test_a_step_past_its_limit_is_interrupted_and_the_next_one_runs(tmp_path):
    r = tmp_path / "results"
    t0 = time.monotonic()
    done = _steps(tmp_path, r, "slow:1", "trap 'echo interrupted; exit 130' INT; sleep 30 & wait", "next", "true")
    assert done.returncode == 0 and time.monotonic() - t0 < 20
    ends = [line.split(" seconds=")[0] for line in (r / "steps.txt").read_text().splitlines() if " rc=" in line]
    assert ends == ["slow rc=124", "next rc=0"], ends  # timeout(1): 124, stopped at the limit
    assert "interrupted" in (r / "slow.log").read_text()


def test_steps_given_a_name_without_its_command_are_refused(tmp_path):
    done = _steps(tmp_path, tmp_path / "results", "first", "true", "second")
    assert done.returncode == 2 and "usage" in done.stderr and not (tmp_path / "results").exists()


def test_a_fresh_host_without_the_steps_is_said_at_once(tmp_path):
    out, seconds = _wait(tmp_path, tmp_path / "results")
    assert seconds < 10, f"waited {seconds:.0f}s on a host with no steps"
    assert out.returncode == 3, out
    assert "no steps on this host" in out.stdout and "start them" in out.stdout, out.stdout


def test_steps_that_died_without_finishing_end_the_wait(tmp_path):
    r = tmp_path / "results"
    r.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (r / "pid").write_text(f"{dead.pid}\n")
    (r / "steps.txt").write_text("bench started 05:00:00 limit=620s\n")
    out, seconds = _wait(tmp_path, r)
    assert seconds < 15, f"waited {seconds:.0f}s for steps that are not running"
    assert out.returncode == 0, out
    assert "finished: no (the steps are not running)" in out.stdout, out.stdout
    assert "bench started 05:00:00" in out.stdout, out.stdout


def test_running_steps_are_waited_for_until_they_write_done(tmp_path):
    r = tmp_path / "results"
    r.mkdir()
    live = subprocess.Popen(["bash", "-c", f"sleep 2; echo DONE > {r}/DONE"])
    (r / "pid").write_text(f"{live.pid}\n")
    try:
        out, seconds = _wait(tmp_path, r)
    finally:
        live.kill()
    assert 2 <= seconds < 10, f"returned after {seconds:.1f}s: the steps wrote DONE after 2 s"
    assert "finished: yes" in out.stdout, out.stdout


@pytest.mark.parametrize("step", ["onlinekd", "inproc"])
def test_a_step_s_figures_and_stack_dumps_come_back(tmp_path, step):
    """A finished step's report.json shown and copied as STEP-report.json, and its other files (stack dumps written
    beside the report) in results.tgz."""
    r, copy = tmp_path / "results", tmp_path / "copy"
    (r / step).mkdir(parents=True)
    (r / "DONE").write_text("DONE\n")
    (r / step / "report.json").write_text('{"online_kd_seconds": {"engine": "in-process"}}')
    (r / step / "online-stacks-flex.txt").write_text("--- stacks at 20 s\n")
    out, _ = _wait(tmp_path, r, limit=5, copy=copy)
    assert f"== {step}/report.json" in out.stdout and '"engine": "in-process"' in out.stdout, out.stdout
    assert (copy / f"{step}-report.json").read_text() == (r / step / "report.json").read_text()
    with tarfile.open(copy / "results.tgz") as tar:
        assert f"results/{step}/online-stacks-flex.txt" in tar.getnames()


def test_steps_started_a_moment_before_the_poll_are_waited_for(tmp_path):
    """`steps ... & wait-steps RESULTS 420` in one command: the poll may look before the folder exists."""
    r = tmp_path / "results"
    late = subprocess.Popen(["bash", "-c", f"sleep 1; mkdir {r}; echo $$ > {r}/pid; sleep 1; echo DONE > {r}/DONE"])
    try:
        out, _ = _wait(tmp_path, r)
    finally:
        late.kill()
    assert out.returncode == 0 and "finished: yes" in out.stdout, out


def test_steps_still_running_at_the_limit_end_the_wait_there(tmp_path):
    """A poll called with its own time limit must come back at SECONDS, with what ran so far."""
    r = tmp_path / "results"
    r.mkdir()
    live = subprocess.Popen(["sleep", "60"])
    (r / "pid").write_text(f"{live.pid}\n")
    try:
        out, seconds = _wait(tmp_path, r, limit=1)
    finally:
        live.kill()
    assert 1 <= seconds < 8, f"returned after {seconds:.1f}s with a limit of 1 s"
    assert "waited 1s; finished: no" in out.stdout, out.stdout


PASSED = Path(__file__).resolve().parents[1] / "gpu" / "passed.sh"


def test_a_step_s_tests_count_as_passed_only_when_each_passed(tmp_path):
    """tests/gpu/passed.sh LOG FILE, which an online step asks before it trains with the varlen attention:
    yes when the step log's summary (pytest -rA) has FILE's tests PASSED and none FAILED or in ERROR; no for a log
    that is missing, has none of FILE's tests, or has one of them failed."""
    f = "tests/gpu/test_ttt_attention_gpu.py"
    ok = f"PASSED {f}::test_a[1]\nPASSED {f}::test_b\nFAILED tests/gpu/test_bench_train.py::test_c - boom\n"
    logs = {
        "all passed": (ok, 0),
        "one failed": (ok + f"FAILED {f}::test_a[3] - AssertionError\n", 1),
        "one in error": (ok + f"ERROR {f}::test_b - RuntimeError\n", 1),
        "none of them ran": (f"PASSED tests/gpu/test_bench_train.py::test_d\n{f}::test_a PASSED\n", 1),
    }
    for name, (text, want) in logs.items():
        (tmp_path / "step.log").write_text(text)
        got = subprocess.run(["bash", str(PASSED), str(tmp_path / "step.log"), f], check=False).returncode
        assert got == want, name
    assert subprocess.run(["bash", str(PASSED), str(tmp_path / "missing.log"), f], check=False).returncode == 1


PICK = Path(__file__).resolve().parents[1] / "gpu" / "pick_trainer.py"


def _bench_report(sdpa=18685, varlen=None, flex=None, run=None) -> dict:
    """The benchtrain step's report.json as test_bench_train writes it: the eager table (8k second), the varlen rows,
    the compiled rows (flex at 8k, then the run row)."""
    eager = [{"seq": 2048, "tok_per_s": 21131}, {"seq": 8192, "tok_per_s": sdpa}, {"seq": 32768, "tok_per_s": 8831}]
    out = {"bench_train_kimi_draft": eager}
    if varlen is not None:
        out["bench_train_varlen"] = [
            {"seq": 2048, "attn": "varlen", "tok_per_s": 1},
            {"seq": 8192, "attn": "varlen", **varlen},
        ]
    compiled = [{"seq": 8192, "attn": "varlen", "compiled": True, "tok_per_s": 99999}]  # not a candidate: not in a run
    if flex is not None:
        compiled.append({"seq": 8192, "attn": "flex", "compiled": True, **flex})
    if run is not None:  # the run row's keys as _compiled_run_row writes them (its seq "run")
        from tests.gpu import test_bench_train as gb

        compiled.append(dict(gb._row("run", True, None, "auto", attn="flex"), attn="flex", compiled=True, **run))
    out["bench_train_compiled"] = compiled
    return out


@pytest.mark.parametrize(
    "case,varlen_passed,want",
    [
        ({}, True, "sdpa"),  # only the eager table ran
        ({"varlen": {"tok_per_s": 24000}}, True, "varlen"),
        ({"varlen": {"tok_per_s": 24000}}, False, "sdpa"),  # its CUDA tests did not pass
        ({"varlen": {"tok_per_s": 15000}}, True, "sdpa"),  # slower than sdpa
        ({"varlen": {"out_of_memory": True}}, True, "sdpa"),
        (
            {
                "varlen": {"tok_per_s": 24000},
                "flex": {"tok_per_s": 30403},
                "run": {"tok_per_s": 33000, "recompile_limit_hits": []},
            },
            True,
            "flex",
        ),
        (
            {
                "flex": {"tok_per_s": 30403},
                "run": {"tok_per_s": 33000, "recompile_limit_hits": ["function: 'forward'"]},
            },
            True,
            "sdpa",
        ),  # a run reached the recompile limit
        ({"flex": {"tok_per_s": 30403}, "run": {"error": "OutOfMemoryError: ..."}}, True, "sdpa"),
        ({"flex": {"tok_per_s": 30403}}, True, "sdpa"),  # no run row: not shown in a run
        (
            {
                "varlen": {"tok_per_s": 24000},
                "flex": {"tok_per_s": 21000},
                "run": {"tok_per_s": 33000, "recompile_limit_hits": []},
            },
            True,
            "varlen",
        ),  # compiled, yet slower at 8k
    ],
)
def test_the_online_step_trains_with_the_fastest_configuration_the_benchmark_showed_working(
    tmp_path, case, varlen_passed, want
):
    """tests/gpu/pick_trainer.py REPORT VARLEN_PASSED: the onlinekd step's trainer (sdpa, varlen or flex compiled) as
    the benchtrain step before it measured them at 8k, one sample a sequence each: varlen only where its CUDA
    tests passed, flex compiled only where its run of varying packs trained without error or a recompile limit
    reached; sdpa where the report is missing or cut short."""
    import json

    (tmp_path / "report.json").write_text(json.dumps(_bench_report(**case)))
    got = subprocess.run(
        [sys.executable, str(PICK), str(tmp_path / "report.json"), "1" if varlen_passed else "0"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert got.stdout.split()[0] == want, (got.stdout, got.stderr)
    (tmp_path / "cut.json").write_text(json.dumps(_bench_report(**case))[:-9])  # a write cut short
    for name in ("none.json", "cut.json"):
        got = subprocess.run(
            [sys.executable, str(PICK), str(tmp_path / name), "1"], capture_output=True, text=True, check=True
        )
        assert got.stdout.split()[0] == "sdpa", (name, got.stderr)


def test_the_online_step_does_not_pick_flex_where_its_run_row_failed_on_the_gpu():
    """The eb52e7a run's own benchtrain report (an H100): compiled flex measured 30,580 tok/s at 8k, fixed-length,
    but its row over a training run's packs failed (the block-mask error, since padded away): not picked."""
    import json

    report = json.loads(
        (
            Path(__file__).resolve().parents[2] / "results/2026-12-05-eb52e7a-h100-vllm0.26.0/benchtrain-report.json"
        ).read_text()
    )
    from tests.gpu import pick_trainer

    assert "error" in next(r for r in report["bench_train_compiled"] if r["seq"] == "run")
    assert "flex" not in pick_trainer.candidates(report, True)
    rows = [
        {k: v for k, v in r.items() if k != "error"} if r["seq"] == "run" else r for r in report["bench_train_compiled"]
    ]
    ok = dict(report, bench_train_compiled=rows)
    assert pick_trainer.candidates(ok, True)["flex"] == 30580  # the same rows, the run row without its error


def test_the_online_step_picks_flex_where_only_the_metrics_reached_the_recompile_limit():
    """The 6c7a0aa run's own benchtrain report (an H200): the compiled flex run over a training run's packs trained,
    but dynamo's recompile limit was reached in speculators' compute_metrics (the accuracies, eager after it; the
    run's rate 0.95x the fixed-length row), not in the draft's forward, where flex attention would fall back unfused:
    flex (30,944 tok/s at 8k) is picked over varlen (24,400). A limit reached anywhere else still rules it out."""
    import json

    from tests.gpu import pick_trainer

    report = json.loads(
        (
            Path(__file__).resolve().parents[2] / "results/2026-12-05-6c7a0aa-h200-vllm0.26.0/benchtrain-report.json"
        ).read_text()
    )
    run = next(r for r in report["bench_train_compiled"] if r["seq"] == "run")
    assert ["compute_metrics" in h for h in run["recompile_limit_hits"]] == [True]
    assert pick_trainer.candidates(report, True) == {"sdpa": 0, "varlen": 24400, "flex": 30944}
    got = subprocess.run(
        [
            sys.executable,
            str(PICK),
            str(
                Path(__file__).resolve().parents[2] / "results/"
                "2026-12-05-6c7a0aa-h200-vllm0.26.0/benchtrain-report.json"
            ),
            "1",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert got.stdout.split()[0] == "flex", got
    forward = [
        dict(r, recompile_limit_hits=r["recompile_limit_hits"] + ["function: 'forward' (.../eagle3/core.py:1)"])
        if r["seq"] == "run"
        else r
        for r in report["bench_train_compiled"]
    ]
    assert "flex" not in pick_trainer.candidates(dict(report, bench_train_compiled=forward), True)


def test_the_gpu_suite_runs_the_engine_in_the_test_process_last():
    """`pytest -m gpu`: tests/gpu/test_online_in_process.py (its engine in the test process, which may keep GPU memory
    after it closes) after every other test of the run; the others in their own order."""
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/gpu"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    ids = [line for line in listed.stdout.splitlines() if "::" in line]
    assert len(ids) > 10 and "test_online_in_process.py" in ids[-1], listed.stdout[-2000:] + listed.stderr[-2000:]
    files = [i.split("::")[0] for i in ids[:-1]]
    assert files == sorted(files) and "test_online_in_process.py" not in " ".join(files), files  # pytest's order
