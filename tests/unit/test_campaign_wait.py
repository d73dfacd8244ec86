"""The GPU campaign's poll (tests/gpu/wait.sh): it must not sit out its limit where nothing runs.

The 288d049 run: the host that ran the campaign was taken back between two polls; the next poll landed on a fresh host
with no campaign and waited its whole 560 s, which spent a third of the session's device time on nothing."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

WAIT = Path(__file__).resolve().parents[1] / "gpu" / "wait.sh"


def _wait(tmp_path, campaign: Path, limit: int = 30):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    t0 = time.monotonic()
    out = subprocess.run(
        ["bash", str(WAIT), str(limit)],
        capture_output=True,
        text=True,
        timeout=limit + 30,
        env=dict(env, CAMPAIGN=str(campaign), WAIT_GRACE="2", WAIT_POLL="0.2"),
        cwd=tmp_path,
        check=False,
    )  # looks every 0.2 s, a campaign 2 s to appear (the GPU host: 2 s, 5 s)
    return out, time.monotonic() - t0


def test_a_fresh_host_without_the_campaign_is_said_at_once(tmp_path):
    out, seconds = _wait(tmp_path, tmp_path / "campaign")
    assert seconds < 10, f"waited {seconds:.0f}s on a host with no campaign"
    assert out.returncode == 3, out
    assert "no campaign on this host" in out.stdout and "start it again" in out.stdout, out.stdout


def test_a_campaign_that_died_without_finishing_ends_the_wait(tmp_path):
    c = tmp_path / "campaign"
    c.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (c / "pid").write_text(f"{dead.pid}\n")
    (c / "steps.txt").write_text("bench started 05:00:00 limit=620s\n")
    out, seconds = _wait(tmp_path, c)
    assert seconds < 15, f"waited {seconds:.0f}s for a campaign that is not running"
    assert out.returncode == 0, out
    assert "finished: no (the campaign is not running)" in out.stdout, out.stdout
    assert "bench started 05:00:00" in out.stdout, out.stdout


def test_a_running_campaign_is_waited_for_until_it_writes_done(tmp_path):
    c = tmp_path / "campaign"
    c.mkdir()
    live = subprocess.Popen(["bash", "-c", f"sleep 2; echo DONE > {c}/DONE"])
    (c / "pid").write_text(f"{live.pid}\n")
    try:
        out, seconds = _wait(tmp_path, c)
    finally:
        live.kill()
    assert 2 <= seconds < 10, f"returned after {seconds:.1f}s: the campaign wrote DONE after 2 s"
    assert "finished: yes" in out.stdout, out.stdout


@pytest.mark.parametrize("step", ["onlinekd", "inproc"])
def test_the_online_steps_figures_and_stack_dumps_come_back(tmp_path, step):
    """A finished campaign's online step: its report.json shown and copied to $OUT as STEP-report.json, and its stack
    dumps (online-stacks-TRAINER.txt, written beside the report) in $OUT/campaign.tgz."""
    import tarfile

    c, out = tmp_path / "campaign", tmp_path / "out"
    (c / step).mkdir(parents=True)
    out.mkdir()
    (c / "DONE").write_text("DONE\n")
    (c / step / "report.json").write_text('{"online_kd_seconds": {"engine": "in-process"}}')
    (c / step / "online-stacks-flex.txt").write_text("--- stacks at 20 s\n")
    res = subprocess.run(
        ["bash", str(WAIT), "5"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=dict(os.environ, CAMPAIGN=str(c), OUT=str(out), WAIT_GRACE="1"),
        check=False,
    )
    assert f"== {step}/report.json" in res.stdout and '"engine": "in-process"' in res.stdout, res.stdout
    assert (out / f"{step}-report.json").read_text() == (c / step / "report.json").read_text()
    with tarfile.open(out / "campaign.tgz") as tar:
        assert f"campaign/{step}/online-stacks-flex.txt" in tar.getnames()


def test_a_campaign_started_a_moment_before_the_poll_is_waited_for(tmp_path):
    """`campaign.sh ... & wait.sh 420` in one command: the poll may look before campaign.sh has made its folder."""
    c = tmp_path / "campaign"
    late = subprocess.Popen(["bash", "-c", f"sleep 1; mkdir {c}; echo $$ > {c}/pid; sleep 1; echo DONE > {c}/DONE"])
    try:
        out, _ = _wait(tmp_path, c)
    finally:
        late.kill()
    assert out.returncode == 0 and "finished: yes" in out.stdout, out


def test_a_campaign_still_running_at_the_limit_ends_the_wait_there(tmp_path):
    """The lease's call has its own limit (600 s): the poll must come back at its own, with what ran so far."""
    c = tmp_path / "campaign"
    c.mkdir()
    live = subprocess.Popen(["sleep", "60"])
    (c / "pid").write_text(f"{live.pid}\n")
    try:
        out, seconds = _wait(tmp_path, c, limit=1)
    finally:
        live.kill()
    assert 1 <= seconds < 8, f"returned after {seconds:.1f}s with a limit of 1 s"
    assert "waited 1s; finished: no" in out.stdout, out.stdout


PASSED = Path(__file__).resolve().parents[1] / "gpu" / "passed.sh"


def test_a_step_s_tests_count_as_passed_only_when_each_passed(tmp_path):
    """tests/gpu/passed.sh LOG FILE, which the campaign's onlinekd step asks before it trains with the varlen attention:
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
    the same campaign's benchtrain step measured them at 8k, one sample a sequence each: varlen only where its CUDA
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
