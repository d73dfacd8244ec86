"""Benchmark history -> regression checks and the Markdown + PNG report."""

import contextlib
import json
import os
import sys
import types
from pathlib import Path

import pytest

from eagle3 import bench, cli
from tests.perf import history, loop


def _history(tmp_path, run, values, profile="h200-mini-kimi"):
    data = {
        "datetime": run,
        "benchmarks": [
            {"name": k, "stats": {"median": 1.0}, "extra_info": {"key": k, "tokens_per_s": v, "profile": profile}}
            for k, v in values.items()
        ],
    }
    p = tmp_path / f"{run}.json"
    p.write_text(json.dumps(data))
    return p


def test_bundled_baselines_have_both_profiles():
    b = bench.load_baselines()
    assert b["8xrtx6000-kimi-k2.5"]["tokens_per_s"]["store/extract"] == 2280
    assert b["h200-mini-kimi"]["tokens_per_s"]["plain/64x512"] > 200_000  # updated from each acceptance run


# The bundled baselines move with every acceptance run (--update-baselines). Tests that replay an old run against
# the baseline of its day read a frozen copy: the 8ec8ff9 run's h200-mini-kimi (fsync 1.88 GB/s beside its figures).
FROZEN_BASELINE = Path(__file__).parent / "data" / "baselines-2026-12-04-8ec8ff9"


def test_regression_fires_only_below_the_margin():
    base = bench.load_baselines()
    ok = bench.Record("r", "8xrtx6000-kimi-k2.5", "store/extract", 2100.0, {})
    bad = bench.Record("r", "8xrtx6000-kimi-k2.5", "store/extract", 2000.0, {})
    assert bench.regression(ok, base) is None
    assert "below the baseline 2,280" in bench.regression(bad, base)
    assert bench.regression(bench.Record("r", "unknown", "x/1x1", 1.0, {}), base) is None


def test_a_disk_bound_figure_is_read_at_its_own_run_s_disk_bandwidth(tmp_path):
    """The 6b3715c run: the fsynced store reached 25,836 tok/s, 1.06x its limit at that host's fsync bandwidth (1.39
    GB/s), and was flagged as a regression against the 8ec8ff9 run's 33,136, measured at 1.88 GB/s. A slower disk is
    the host's: the baseline scales down with the bandwidth the same run measured. A faster disk, a figure that
    is not disk-bound, or a run without a disk figure keep the baseline as it is."""
    base = bench.load_baselines(FROZEN_BASELINE)
    mk = base["h200-mini-kimi"]
    assert mk["disk_bytes_per_s"]["fsync"] == 1876157240  # the 8ec8ff9 run's, beside the figures measured on it
    slow = {"fsync": 1393067797.0, "page_cache": 21566674429.0}  # the 6b3715c run's host
    store = bench.Record("r", "h200-mini-kimi", "store_direct/64x512", 25836.0, {})
    assert bench.regression(store, base, slow) is None
    assert "below the baseline 33,136 minus 15%" in bench.regression(store, base)  # no disk figure: as it was
    assert "below the baseline 33,136 minus" in bench.regression(store, base, {"fsync": 3e9})  # faster: as it was
    half = bench.regression(
        bench.Record("r", "h200-mini-kimi", "store_direct/64x512", 13000.0, {}),
        base,
        {"fsync": mk["disk_bytes_per_s"]["fsync"] / 2},
    )
    assert half == (
        "h200-mini-kimi store_direct/64x512: 13,000 tok/s is below the baseline 16,568 scaled to this "
        "run's fsync bandwidth (0.94 of 1.88 GB/s) minus 15% (14,083)"
    )
    host = bench.Record("r", "h200-mini-kimi", "host_direct/64x512", 200000.0, {})  # no disk in its path
    assert "below the baseline 267,099" in bench.regression(host, base, {"fsync": 1e8, "page_cache": 1e8})
    # the report reads each record at its own run's disks
    data = {
        "datetime": "2026-12-04T03:26",
        "benchmarks": [
            {"name": k, "stats": {"median": 1.0}, "extra_info": dict(info, profile="h200-mini-kimi")}
            for k, info in {
                "store_direct/64x512": {"key": "store_direct/64x512", "tokens_per_s": 25836},
                "disk": {"key": "disk_fsync/4x4x512MiB", "bytes_per_s": slow["fsync"]},
            }.items()
        ],
    }
    (tmp_path / "h.json").write_text(json.dumps(data))
    md, _ = bench.report([tmp_path / "h.json"], tmp_path / "r", baselines_dir=FROZEN_BASELINE)
    assert "| store_direct/64x512 | 25,836 | 25,836 | - | 0.78x | no |" in md.read_text()


def test_updated_baselines_keep_the_disk_bandwidth_their_figures_were_measured_at(tmp_path):
    run = {
        "datetime": "2026-12-04T03:26",
        "benchmarks": [
            {"name": k, "stats": {"median": 1.0}, "extra_info": {"profile": "h200-mini-kimi", "key": k, **info}}
            for k, info in {
                "store_direct/64x512": {"tokens_per_s": 25836},
                "plain/64x512": {"tokens_per_s": 278097},
                "disk_fsync/4x4x512MiB": {"bytes_per_s": 1393067797.0},
            }.items()
        ],
    }
    (tmp_path / "h.json").write_text(json.dumps(run))
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "m.json").write_text((FROZEN_BASELINE / "h200-mini-kimi.json").read_text())
    bench.update_baselines(iter([tmp_path / "h.json"]), folder)  # an iterator: read twice, records and disks
    new = json.loads((folder / "m.json").read_text())
    assert new["tokens_per_s"]["store_direct/64x512"] == 25836
    # fsync from this run; page_cache from the 8ec8ff9 run, whose page-cache figures this run did not replace
    assert new["disk_bytes_per_s"] == {"fsync": 1393067797, "page_cache": 22581163748}
    run["benchmarks"] = [b for b in run["benchmarks"] if not b["name"].startswith("disk")]
    run["benchmarks"].append(
        {
            "name": "n",
            "stats": {"median": 1.0},
            "extra_info": {"profile": "h200-mini-kimi", "key": "store_nofsync_direct/64x512", "tokens_per_s": 240000},
        }
    )
    run["datetime"] = "2026-12-05T00:00"
    (tmp_path / "h.json").write_text(json.dumps(run))
    bench.update_baselines([tmp_path / "h.json"], folder)
    # new fsync and page-cache figures without a disk measured beside them: neither bandwidth matches them now
    assert "disk_bytes_per_s" not in json.loads((folder / "m.json").read_text())


def test_report_writes_a_table_and_a_plot(tmp_path):
    _history(tmp_path, "2026-12-01T10:00", {"plain/64x512": 300000, "store/64x512": 280000})
    _history(tmp_path, "2026-12-02T10:00", {"plain/64x512": 310000, "store/64x512": 150000})
    assert cli.main(["bench", "report", "--history", str(tmp_path), "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "throughput.md").read_text()
    assert "| 2026-12-02T10:00 | h200-mini-kimi | store/64x512 | 150,000 | 150,000 | 0.48x | - | no |" in md
    vs = 310000 / bench.load_baselines()["h200-mini-kimi"]["tokens_per_s"]["plain/64x512"]
    assert f"| 2026-12-02T10:00 | h200-mini-kimi | plain/64x512 | 310,000 | 310,000 | 1.00x | {vs:.2f}x | no |" in md
    png = (tmp_path / "rep" / "throughput.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_report_gives_each_figure_s_spread_within_its_run(tmp_path):
    """A ratio moves by the figures' own noise: the GPU benchmark records each figure's rate per quarter of its
    batches and their spread, (max - min) / median; the table shows it beside the ratio."""
    data = {
        "datetime": "2026-12-04T10:00",
        "benchmarks": [
            {
                "name": "p",
                "extra_info": {
                    "key": "plain/64x512",
                    "tokens_per_s": 300000,
                    "profile": "h200-mini-kimi",
                    "quarters_tok_s": [290000, 300000, 310000, 300000],
                    "spread": 0.067,
                },
            },
            {"name": "h", "extra_info": {"key": "host/64x512", "tokens_per_s": 270000, "profile": "h200-mini-kimi"}},
        ],
    }
    (tmp_path / "b.json").write_text(json.dumps(data))
    md = bench.report([tmp_path / "b.json"], tmp_path / "r")[0].read_text()
    assert "| vs baseline | regression | spread in its run |" in md
    vs = 300000 / bench.load_baselines()["h200-mini-kimi"]["tokens_per_s"]["plain/64x512"]
    assert f"| plain/64x512 | 300,000 | 300,000 | 1.00x | {vs:.2f}x | no | 6.7% |" in md
    assert "| host/64x512 | 270,000 | 270,000 | 0.90x | - | no | - |" in md  # recorded before quarters existed


def test_the_trainer_s_figures_reach_the_report_per_gpu_with_their_mfu(tmp_path):
    """tests/gpu/test_bench_train.py's rows, written as train_history writes them on the GPU host (a row that ran
    out of memory has no rate and is left out); in the report: tokens/s, per GPU, MFU and peak memory."""
    rows = [
        {"draft": "llama", "seq": 8192, "precision": "bf16-mixed", "tok_per_s": 40000, "mfu": 0.41, "peak_gib": 61.5},
        {"draft": "llama", "seq": 32768, "precision": "bf16-mixed", "out_of_memory": True},
        {"draft": "mla", "seq": 8192, "precision": "bf16-mixed", "tok_per_s": 30000, "mfu": 0.33, "peak_gib": 55.0},
        {
            "draft": "llama",
            "seq": 8192,
            "precision": "bf16-mixed",
            "loss": "eager",
            "tok_per_s": 38000,
            "mfu": 0.39,
            "peak_gib": 70.0,
        },
        {
            "draft": "llama",
            "seq": 8192,
            "precision": "bf16-mixed",
            "loss": "auto",
            "attn": "flex",
            "compiled": True,
            "tok_per_s": 50000,
            "mfu": 0.51,
            "peak_gib": 40.0,
        },
        {
            "draft": "llama",
            "seq": 8192,
            "precision": "bf16-mixed",
            "attn": "sdpa",
            "compiled": True,
            "tok_per_s": 44000,
            "mfu": 0.45,
            "peak_gib": 60.0,
        },
    ]
    (tmp_path / "benchmark.json").write_text(
        json.dumps(history.train_history(rows, "2026-12-05T10:00", "h200-kimi-draft", gpus=2))
    )
    md = bench.report([tmp_path / "benchmark.json"], tmp_path / "r")[0].read_text()
    assert "| h200-kimi-draft | train_llama_bf16-mixed/8192 | 40,000 | 20,000 | - | - | no | - |" in md
    assert "train_mla_bf16-mixed/8192: 15,000 tok/s per GPU, MFU 33.0%, peak 55.0 GiB" in md
    assert "train_llama_bf16-mixed_eager/8192: 19,000 tok/s per GPU, MFU 39.0%, peak 70.0 GiB" in md  # its own key
    assert "train_llama_bf16-mixed_flex_compiled/8192: 25,000 tok/s per GPU, MFU 51.0%, peak 40.0 GiB" in md
    assert "train_llama_bf16-mixed_compiled/8192: 22,000 tok/s per GPU, MFU 45.0%" in md
    assert "32768" not in md


def test_the_store_reader_reaches_the_report_against_the_fastest_training_figure_of_its_run(tmp_path):
    """The trainer benchmark's reader (read as training steps: tok/s, GB/s) beside the training rows: its ratio to the
    fastest 8k training figure of the same run, the need it must meet twice over (issue 42). Another run's rows do
    not count."""
    rows = [
        {"draft": "llama", "seq": 8192, "precision": "bf16-mixed", "tok_per_s": 18685, "mfu": 0.30},
        {
            "draft": "llama",
            "seq": 8192,
            "precision": "bf16-mixed",
            "attn": "flex",
            "compiled": True,
            "tok_per_s": 30403,
            "mfu": 0.488,
        },
        {"draft": "llama", "seq": 2048, "precision": "bf16-mixed", "tok_per_s": 90000, "mfu": 0.32},  # not 8k
        {"reader": True, "seq": 8192, "tok_per_s": 76012, "gb_per_s": 4.36, "samples_tok_per_s": 150000},
    ]
    other = [{"draft": "llama", "seq": 8192, "precision": "bf16-mixed", "tok_per_s": 99999, "mfu": 0.9}]
    (tmp_path / "a.json").write_text(json.dumps(history.train_history(rows, "2026-12-06T10:00", "h200-kimi-draft")))
    (tmp_path / "b.json").write_text(json.dumps(history.train_history(other, "2026-12-06T11:00", "h200-kimi-draft")))
    md = bench.report([tmp_path / "a.json", tmp_path / "b.json"], tmp_path / "r")[0].read_text()
    assert (
        "train_reader/8192: the store reader, as training steps read: 76,012 tok/s (4.36 GB/s; the samples alone "
        "150,000); 2.50x the fastest training figure of its run at 8,192 tokens "
        "(train_llama_bf16-mixed_flex_compiled/8192, 30,403 tok/s; goal 2x: met)"
    ) in md, md
    assert "train_reader/8192: 76,012 tok/s per GPU, MFU" not in md


def test_report_without_records_says_so(tmp_path):
    with pytest.raises(ValueError, match="no benchmark records"):
        bench.report([tmp_path], tmp_path / "out")


def test_report_says_when_no_baseline_applies(tmp_path):
    _history(tmp_path, "2026-12-01T10:00", {"plain/64x512": 300000}, profile="h100-unknown")
    (tmp_path / "empty").mkdir()
    assert (
        cli.main(
            ["bench", "report", "--history", str(tmp_path / "2026-12-01T10:00.json"), "--out", str(tmp_path / "a")]
        )
        == 0
    )
    assert "No baseline for profile `h100-unknown`" in (tmp_path / "a" / "throughput.md").read_text()
    assert (
        cli.main(
            [
                "bench",
                "report",
                "--history",
                str(tmp_path / "2026-12-01T10:00.json"),
                "--out",
                str(tmp_path / "b"),
                "--baselines",
                str(tmp_path / "empty"),
            ]
        )
        == 0
    )
    assert "**No baselines found in" in (tmp_path / "b" / "throughput.md").read_text()


def test_a_non_editable_install_carries_the_baselines_and_the_bundled_data(tmp_path):
    """Issue 17: `pip install .` left eagle3/bundled/baselines/*.json out, so `bench report` flagged nothing."""
    import shutil
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    repo = Path(bench.__file__).resolve().parents[1]
    src = tmp_path / "src"  # a clean copy: a build/ folder left in the checkout would hide a missing pattern
    shutil.copytree(repo / "eagle3", src / "eagle3", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(repo / name, src / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "wheel"),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "wheel").glob("eagle3-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    bundled = {str(p.relative_to(repo)) for p in (repo / "eagle3" / "bundled").rglob("*") if p.is_file()}
    assert bundled and bundled <= names, sorted(bundled - names)
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    code = "from eagle3 import bench; print(bench.BASELINES); print(sorted(bench.load_baselines()))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"},
    )
    where, profiles = out.stdout.splitlines()
    assert where.startswith(str(tmp_path / "site")), out.stderr
    assert eval(profiles) == sorted(bench.load_baselines()) and len(eval(profiles)) >= 2


def test_the_latest_run_as_bars_per_gpu_beside_the_cluster_and_updated_baselines(tmp_path, monkeypatch):
    """Issue 14's report: a PNG of one run (bars per mode, labelled with the ratio to plain), kimi-depth per GPU
    beside the cluster's 2,280 tok/s on 8 GPUs, and --update-baselines writing the newest run per profile."""
    import shutil

    def hist(run, values, profile, gpus=1):
        data = {
            "datetime": run,
            "benchmarks": [
                {
                    "name": k,
                    "stats": {"median": 1.0},
                    "extra_info": {"key": k, "tokens_per_s": v, "profile": profile, "gpus": gpus},
                }
                for k, v in values.items()
            ],
        }
        p = tmp_path / "h" / f"{run}-{profile}.json"
        p.parent.mkdir(exist_ok=True)
        p.write_text(json.dumps(data))

    hist("2026-12-01T10:00", {"plain/16x512": 8000, "store/16x512": 7000}, "h200-kimi-depth")
    hist("2026-12-02T10:00", {"plain/64x512": 8000, "store_direct/64x512": 7900}, "h200-kimi-depth")
    hist(
        "2026-12-03T10:00",
        {"plain/16x512": 8000, "store/16x512": 7800, "plain/64x512": 8100, "hooks_host/64x512": 6000},
        "h200-kimi-depth",
    )
    hist("2026-12-03T11:00", {"store/extract": 2400}, "8xrtx6000-kimi-k2.5", gpus=8)
    base = tmp_path / "base"
    shutil.copytree(bench.BASELINES, base)
    drawn, bars = [], bench.bars
    monkeypatch.setattr(bench, "bars", lambda *a, **k: drawn.extend(bars(*a, **k)) or drawn)
    assert (
        cli.main(
            [
                "bench",
                "report",
                "--history",
                str(tmp_path / "h"),
                "--out",
                str(tmp_path / "r"),
                "--baselines",
                str(base),
                "--update-baselines",
            ]
        )
        == 0
    )
    md = (tmp_path / "r" / "throughput.md").read_text()
    assert "| 2026-12-03T10:00 | h200-kimi-depth | store/16x512 | 7,800 | 7,800 | 0.97x |" in md
    assert "| 2026-12-03T11:00 | 8xrtx6000-kimi-k2.5 | store/extract | 2,400 | 300 | - | 1.05x | no |" in md
    assert "against the cluster's 2,280 tok/s on 8 GPUs (285 per GPU)" in md
    assert "- 2026-12-03T10:00 h200-kimi-depth store/16x512: 7,800 tok/s per GPU = 27.4x" in md
    assert "- 2026-12-02T10:00 h200-kimi-depth store_direct/64x512: 7,900 tok/s per GPU = 27.7x" in md  # either capture
    png = tmp_path / "r" / "throughput-latest.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert any("cluster/GPU" in x for x in drawn)  # the report's PNG sets kimi-depth beside the cluster
    monkeypatch.undo()
    labels = bench.bars(bench.load_history([tmp_path / "h"]), tmp_path / "b.png")
    assert [x for x in labels if x.startswith("h200")] == [
        "h200-kimi-depth plain/16x512 1.00x",
        "h200-kimi-depth plain/64x512 1.00x",
        "h200-kimi-depth hooks_host/64x512 0.74x",
        "h200-kimi-depth store/16x512 0.97x",
        "h200-kimi-depth legend plain prefill",
        "h200-kimi-depth legend capture to host memory (hooks capture)",
        "h200-kimi-depth legend fsynced store",
    ]  # the newest run; a mode measured at one shape only is named
    # with the cluster's figure, the kimi-depth panel draws its per-GPU line and puts a store bar beside it
    labels = bench.bars(bench.load_history([tmp_path / "h"]), tmp_path / "c.png", cluster=bench.load_baselines())
    depth = [x for x in labels if x.startswith("h200-kimi-depth")]
    assert "h200-kimi-depth store/16x512 0.97x; 27.4x cluster/GPU" in depth, depth
    assert "h200-kimi-depth hooks_host/64x512 0.74x" in depth  # not a store: no cluster figure
    assert "h200-kimi-depth legend cluster: 285 tok/s per GPU (2,280 on 8 GPUs)" in depth, depth
    assert not [x for x in labels if "cluster" in x and not x.startswith("h200-kimi-depth")]
    new = json.loads((base / "h200-kimi-depth.json").read_text())
    bundled = json.loads((bench.BASELINES / "h200-kimi-depth.json").read_text())
    newest = {"plain/16x512": 8000, "store/16x512": 7800, "plain/64x512": 8100, "hooks_host/64x512": 6000}
    assert new["tokens_per_s"] == {**bundled["tokens_per_s"], **newest}  # the newest run over the bundled one
    assert new["hardware"] == bundled["hardware"] and new["model"] == bundled["model"]  # kept
    assert sorted(p.name for p in base.iterdir()) == [
        "cluster-kimi-k2.5.json",
        "h200-kimi-depth.json",
        "h200-mini-kimi.json",
    ]  # one file per profile
    cluster = json.loads((base / "cluster-kimi-k2.5.json").read_text())
    assert cluster["tokens_per_s"] == {"store/extract": 2400} and cluster["margin"] == 0.1 and "hardware" in cluster
    assert json.loads((base / "h200-mini-kimi.json").read_text()) == json.loads(
        (bench.BASELINES / "h200-mini-kimi.json").read_text()
    )  # other profiles untouched


def test_the_report_sets_each_disk_bound_mode_against_its_disk_limit(tmp_path):
    """The 90b2d70 run's H200 run (results/, its pytest-benchmark JSON): the fsynced store reads 0.06x plain, yet it
    wrote
    at 0.83x of what the disk's fsynced writes allow; the page-cache writers against the page cache. Limit =
    min(plain, disk bytes/s of the same run / the mode's bytes per token), as issue 14's acceptance reads them."""
    run = Path(__file__).parents[2] / "results/2026-12-03-90b2d70-h200-vllm0.26.0/benchmark.json.gz"
    md, _ = bench.report([run], tmp_path / "r")
    text = md.read_text()
    assert (
        "- 2026-12-03T06:54:02.341252+00:00 h200-mini-kimi store/64x512: 18,119 tok/s = 0.83x of 21,833 "
        "(fsync 1.25 GB/s / 57,344 B a token)"
    ) in text
    assert (
        "- 2026-12-03T06:54:02.341252+00:00 h200-mini-kimi store_nofsync/64x512: 48,424 tok/s = 0.23x of "
        "206,769 (page cache 11.86 GB/s / 57,344 B a token)"
    ) in text
    assert "h200-mini-kimi vllm_ehs/64x512: 131,610 tok/s = 0.64x of 206,769 (page cache" in text
    assert "host/64x512: 236,587 tok/s = " not in text  # no disk bounds a null sink
    both = bench.report([run, run.with_name("benchkd-benchmark.json.gz")], tmp_path / "kd")[0].read_text()
    assert (
        "h200-kimi-depth store/64x512: 7,392 tok/s = 0.91x of 8,153 (plain prefill; fsync 1.25 GB/s / 57,344 B "
        "a token = 21,731)"
    ) in both  # at Kimi's depth prefill binds, not the disk; each run's own disk figure
    assert "h200-mini-kimi store/64x512: 18,119 tok/s = 0.83x of 21,833 (fsync" in both
    labels = bench.bars(bench.load_history([run]), tmp_path / "b.png", bench.load_disks([run]))
    assert "h200-mini-kimi store/64x512 0.06x; 0.83x of limit" in labels
    assert (
        "h200-mini-kimi host/64x512 0.82x" in labels
        and "h200-mini-kimi legend limit: min(plain, disk B/s / B a token)" in labels
    )
    fp8 = bench.read_json(run)
    fp8["benchmarks"] = [b for b in fp8["benchmarks"] if b["extra_info"]["key"] != "store/64x512"]
    fp8["benchmarks"].append(
        {
            "name": "fp8",
            "extra_info": {
                "key": "store_fp8/64x512",
                "tokens_per_s": 40000,
                "profile": "h200-mini-kimi",
                "bytes_per_token": 28672,
            },
        }
    )
    (tmp_path / "fp8.json").write_text(json.dumps(fp8))
    md, _ = bench.report([tmp_path / "fp8.json"], tmp_path / "f")
    assert "store_fp8/64x512: 40,000 tok/s = 0.92x of 43,666 (fsync 1.25 GB/s / 28,672 B a token)" in md.read_text()


def test_each_mode_is_set_against_the_disk_it_writes_to_whatever_its_capture():
    """store_nofsync_direct writes into the page cache like store_nofsync: set against the fsynced disk, its limit
    would be ~10x too low and its ratio flattering."""
    modes = [
        "store",
        "store_direct",
        "store_fp8",
        "store_nofsync",
        "store_nofsync_direct",
        "vllm_ehs",
        "host_direct",
        "count",
        "plain",
    ]
    assert [bench.disk_of(m) for m in modes] == [
        "fsync",
        "fsync",
        "fsync",
        "page_cache",
        "page_cache",
        "page_cache",
        None,
        None,
        None,
    ]
    # the GPU benchmark starts each mode's engine by this split (tests/gpu/test_bench_extract.test_eagle3_aux_capture)
    assert [bench.split_mode(m) for m in ("store_nofsync_direct", "host_whole_direct", "count", "host_slots8")] == [
        ("store_nofsync", "direct"),
        ("host_whole", "direct"),
        ("count", "aux"),
        ("host_slots8", "aux"),
    ]


def test_the_trend_plot_has_a_panel_per_profile_and_shape_and_one_color_per_mode(tmp_path):
    """Every H200 run in results/ on one log-scale axis per profile gave 30 lines in 10 repeating colors (count and
    plain at 16x512 the same blue) under a legend that hid them. A panel per (profile, shape); a mode keeps its
    color in every panel and no two modes share one; the legend beside the axes."""
    results = Path(__file__).parents[2] / "results"
    records = bench.load_history([results])
    drawn = bench.trends(records, bench.load_baselines(), tmp_path / "t.png")
    panels = {}
    for panel, key, color in drawn:
        panels.setdefault(panel, []).append((key, color))
    assert "h200-mini-kimi 64x512" in panels and "h200-kimi-depth 64x512" in panels
    assert set(panels) == {f"{r.profile} {r.key.split('/')[1]}" for r in bench.extraction(records)}
    color_of = {}
    for panel, lines in panels.items():
        assert all(key.endswith("/" + panel.split()[1]) for key, _ in lines), panel
        for key, color in lines:
            color_of.setdefault(key.split("/")[0], set()).add(color)
    assert all(len(c) == 1 for c in color_of.values()), color_of  # one color per mode, in every panel
    firsts = [next(iter(c)) for c in color_of.values()]
    assert len(set(firsts)) == len(firsts)  # no two modes alike
    assert (tmp_path / "t.png").stat().st_size > 10_000


def _measured(run: str) -> dict:
    """The figures an H200 run measured (results/RUN/bench_summary.json), by key."""
    path = Path(__file__).parents[2] / f"results/{run}/bench_summary.json"
    return json.loads(path.read_text())["tokens_per_s"]


def test_the_gpu_benchmark_s_acceptance_on_the_3cf512b_h200_figures(tmp_path, monkeypatch):
    """The GPU benchmark's acceptance (issue 14's targets, tests/gpu/test_bench_extract.acceptance) replayed on CPU
    with the figures the H200 measured in the 3cf512b run (results/2026-12-03-3cf512b-h200-vllm0.26.0/): it fails
    exactly on the
    null sink and the page-cache store, as it did there; a mode left out (EAGLE3_BENCH_MODES) is 'not measured',
    not a KeyError; kimi-depth's target applies to every shape."""
    from tests.gpu import test_bench_extract as gb

    measured = _measured("2026-12-03-3cf512b-h200-vllm0.26.0")
    monkeypatch.setattr(gb, "_vllm_version", lambda: "0.26.0")
    summary, failures = gb.acceptance(measured, "mini-kimi", 57344, "h200-mini-kimi", {})
    assert failures == [
        "null sink / plain prefill 0.72x (< 0.9)",
        "page-cache store / vLLM's extract_hidden_states 0.89x (< 1.0)",
    ]
    r = summary["ratios"]["64x512"]
    assert round(r["store/limit_fsync"], 3) == 0.904 and r["limit_tokens_per_s"]["fsync"] == 36432
    _, failures = gb.acceptance(
        {k: v for k, v in measured.items() if not k.startswith("vllm_ehs/")}, "mini-kimi", 57344, "h200-mini-kimi", {}
    )
    assert "page-cache store / vLLM's extract_hidden_states: not measured (store_nofsync/vllm_ehs; " in failures[-1]
    fast_disk = dict(measured, **{"disk_bytes_per_s[fsync]": 1e12})  # the limit is then prefill, not the disk
    _, failures = gb.acceptance(fast_disk, "mini-kimi", 57344, "h200-mini-kimi", {})
    assert "fsynced store / min(prefill, parallel fsync bandwidth / bytes per token) 0.10x (< 0.9)" in failures
    _, failures = gb.acceptance(measured, "kimi-depth", 57344, "h200-kimi-depth", {})
    assert len(failures) == 3 and all("fsynced store / plain prefill 0.1" in f for f in failures)  # every shape


def test_the_gpu_benchmark_s_acceptance_with_one_shape(monkeypatch):
    """EAGLE3_BENCH_SHAPES=64x512 (a shorter campaign): the other shapes have no ratios; mini-Kimi's targets still
    apply; kimi-depth's cover the shapes measured; a run without 64x512 fails mini-Kimi as not measured."""
    from tests.gpu import test_bench_extract as gb

    measured = _measured("2026-12-03-3cf512b-h200-vllm0.26.0")
    monkeypatch.setattr(gb, "_vllm_version", lambda: "0.26.0")
    one = {k: v for k, v in measured.items() if "/" not in k or k.endswith("/64x512")}
    summary, failures = gb.acceptance(one, "mini-kimi", 57344, "h200-mini-kimi", {})
    assert sorted(summary["ratios"]) == ["64x512"] and len(failures) == 2
    _, failures = gb.acceptance(one, "kimi-depth", 57344, "h200-kimi-depth", {})
    assert len(failures) == 1 and failures[0].startswith("kimi-depth 64x512: fsynced store / plain prefill 0.1")
    other = {k: v for k, v in measured.items() if not k.endswith("/64x512")}
    _, failures = gb.acceptance(other, "mini-kimi", 57344, "h200-mini-kimi", {})
    assert failures == ["mini-Kimi's targets: 64x512 not measured (EAGLE3_BENCH_SHAPES)"]


def test_a_mode_or_shape_the_benchmark_does_not_know_stops_it_at_collection(monkeypatch):
    """A typo in EAGLE3_BENCH_MODES or EAGLE3_BENCH_SHAPES skipped that figure without a word (a GPU run's measurement
    lost, found out only when the acceptance said "not measured"): now the module refuses it, naming what it knows."""
    import importlib

    from tests.gpu import test_bench_extract as gb

    try:
        monkeypatch.setenv("EAGLE3_BENCH_MODES", "plain host_fwd store")
        with pytest.raises(ValueError, match=r"EAGLE3_BENCH_MODES: host_fwd unknown \(known: .*host_slots8"):
            importlib.reload(gb)
        monkeypatch.setenv("EAGLE3_BENCH_MODES", "plain count_direct")
        monkeypatch.setenv("EAGLE3_BENCH_SHAPES", "64x512 64x500")
        with pytest.raises(ValueError, match=r"EAGLE3_BENCH_SHAPES: 64x500 unknown \(known: 16x512 64x512 8x4096\)"):
            importlib.reload(gb)
        monkeypatch.setenv("EAGLE3_BENCH_SHAPES", "64x512")
        assert importlib.reload(gb).MODES == {"plain", "count_direct"}
    finally:
        monkeypatch.delenv("EAGLE3_BENCH_MODES", raising=False)
        monkeypatch.delenv("EAGLE3_BENCH_SHAPES", raising=False)
        importlib.reload(gb)


def test_the_benchmark_modes_and_shapes_the_gpu_readme_names_are_ones_the_benchmark_knows():
    """What a reader copies from tests/gpu/README.md runs; and every mode the benchmark knows is one it can run."""
    import re

    from tests.gpu import test_bench_extract as gb

    gpu = Path(__file__).parents[1] / "gpu"
    text = (gpu / "README.md").read_text()
    modes = re.findall(r'EAGLE3_BENCH(?:KD)?_MODES="([^"]+)"', text)
    shapes = re.findall(r"EAGLE3_BENCH_SHAPES=([\dx]+)", text)
    assert shapes, text
    assert {m for line in modes for m in line.split()} - gb.KNOWN_MODES == set()
    assert set(shapes) <= {f"{b}x{t}" for b, t in gb.ALL_SHAPES}
    asked = set(re.findall(r'wanted\("(\w+)"\)', (gpu / "test_bench_extract.py").read_text()))
    assert asked and asked | set(gb.PLAIN_MODES) | set(gb.EAGLE3_MODES) == gb.KNOWN_MODES  # no mode unreachable


def test_a_null_sink_below_target_says_when_the_device_to_host_copies_cannot_carry_it(monkeypatch):
    """host >= 0.90 x plain needs plain x 57,344 B/token across PCIe: when the measured d2h bandwidth cannot carry
    0.90 x plain, the failure says so, with the host's ratio to that limit; when it can, the failure is plain."""
    from tests.gpu import test_bench_extract as gb

    measured = _measured("2026-12-03-3cf512b-h200-vllm0.26.0")
    monkeypatch.setattr(gb, "_vllm_version", lambda: "0.26.0")
    slow = dict(measured, d2h_bytes_per_s=13.2e9)  # 230,190 tok/s = 0.72x plain 319,051
    _, failures = gb.acceptance(slow, "mini-kimi", 57344, "h200-mini-kimi", {})
    assert failures[0] == (
        "null sink / plain prefill 0.72x (< 0.9): unreachable on this host, whose device-to-host "
        "copies (13.2 GB/s) carry 230,190 tok/s = 0.72x plain; host/limit_d2h 1.00x"
    )
    fast = dict(measured, d2h_bytes_per_s=50e9)
    _, failures = gb.acceptance(fast, "mini-kimi", 57344, "h200-mini-kimi", {})
    assert failures[0] == "null sink / plain prefill 0.72x (< 0.9)"
    no_host = {k: v for k, v in slow.items() if not k.startswith("host/")}  # d2h and plain measured, host not
    _, failures = gb.acceptance(no_host, "mini-kimi", 57344, "h200-mini-kimi", {})
    assert failures[0] == "null sink / plain prefill: not measured (host/plain; EAGLE3_BENCH_MODES)"


def test_the_benchmark_s_shapes_are_all_of_them_unless_narrowed(monkeypatch):
    """EAGLE3_BENCH_SHAPES unset: every shape in ALL_SHAPES; set: only those named, in ALL_SHAPES' order."""
    import importlib

    from tests.gpu import test_bench_extract as gb

    try:
        monkeypatch.delenv("EAGLE3_BENCH_SHAPES", raising=False)
        assert importlib.reload(gb).SHAPES == gb.ALL_SHAPES == [(16, 512), (64, 512), (8, 4096)]
        monkeypatch.setenv("EAGLE3_BENCH_SHAPES", "64x512 8x4096")
        assert importlib.reload(gb).SHAPES == [(64, 512), (8, 4096)] and gb.IDS == ["64x512", "8x4096"]
    finally:
        monkeypatch.delenv("EAGLE3_BENCH_SHAPES", raising=False)
        importlib.reload(gb)


def test_a_null_sink_below_target_says_when_the_capture_engine_itself_is_below(monkeypatch):
    """The 90b2d70 run on the H200: host 0.82x plain, count (the same engine, nothing copied) 0.85x: the failure says
    the
    engine is the limit, and how plain fares without async scheduling (what vLLM allows that engine) if measured."""
    from tests.gpu import test_bench_extract as gb

    measured = _measured("2026-12-03-90b2d70-h200-vllm0.26.0")
    monkeypatch.setattr(gb, "_vllm_version", lambda: "0.26.0")
    _, failures = gb.acceptance(measured, "mini-kimi", 57344, "h200-mini-kimi", {})
    assert failures[0] == (
        "null sink / plain prefill 0.82x (< 0.9): the capture's engine with nothing copied (count) reaches 0.85x plain"
    )
    with_sync = dict(measured, **{"plain_sync/64x512": 250000.0})
    summary, failures = gb.acceptance(with_sync, "mini-kimi", 57344, "h200-mini-kimi", {})
    assert failures[0].endswith(
        "reaches 0.85x plain; plain without async scheduling (which vLLM 0.26 refuses "
        "extract_hidden_states engines) 0.87x; host/plain_sync 0.95x"
    )
    assert round(summary["ratios"]["64x512"]["count/plain_sync"], 3) == 0.970
    fine = dict(measured, **{"count/64x512": 0.95 * measured["plain/64x512"]})  # the engine is not the limit
    _, failures = gb.acceptance(fine, "mini-kimi", 57344, "h200-mini-kimi", {})
    assert failures[0] == "null sink / plain prefill 0.82x (< 0.9)"
    direct = dict(measured, **{"host_direct/64x512": 0.93 * measured["plain/64x512"]})
    _, failures = gb.acceptance(direct, "mini-kimi", 57344, "h200-mini-kimi", {})
    assert failures[0].endswith("reaches 0.85x plain; with --capture direct (a plain engine) host reaches 0.93x")


def test_the_targets_hold_the_capture_extraction_uses_by_default_and_the_other_is_information(monkeypatch):
    """The 6e3f68b run measured --capture direct (count_direct, host_direct, store_direct) beside the 90b2d70 run's
    aux figures:
    the targets apply to the strategy extraction runs by default; the summary gives both strategies' verdicts, so
    one run says whether switching the default would meet them. Direct's null-sink failure names its own count
    and, if measured, the same with a step's copies issued at once."""
    from tests.gpu import test_bench_extract as gb

    measured = _measured("2026-12-03-90b2d70-h200-vllm0.26.0")
    monkeypatch.setattr(gb, "_vllm_version", lambda: "0.26.0")
    plain, ehs = measured["plain/64x512"], measured["vllm_ehs/64x512"]
    limit = min(plain, measured["disk_bytes_per_s[fsync]"] / 57344)
    direct = dict(
        measured,
        **{
            "count_direct/64x512": 0.95 * plain,
            "host_direct/64x512": 0.92 * plain,
            "store_direct/64x512": 0.93 * limit,
            "store_nofsync_direct/64x512": 1.05 * ehs,
        },
    )
    summary, failures = gb.acceptance(direct, "mini-kimi", 57344, "h200-mini-kimi", {}, capture="direct")
    assert failures == [] and summary["acceptance"]["direct"] == [] and summary["acceptance"]["capture"] == "direct"
    summary, aux_failures = gb.acceptance(direct, "mini-kimi", 57344, "h200-mini-kimi", {})
    assert aux_failures == summary["acceptance"]["aux"] and aux_failures[0].startswith(
        "null sink / plain prefill 0.82x"
    )
    assert summary["acceptance"]["direct"] == []
    slow = dict(direct, **{"host_direct/64x512": 0.81 * plain, "host_whole_direct/64x512": 0.80 * plain})
    _, failures = gb.acceptance(slow, "mini-kimi", 57344, "h200-mini-kimi", {}, capture="direct")
    assert failures == [
        (
            "null sink (--capture direct) / plain prefill 0.81x (< 0.9): count (--capture direct) "
            "reaches 0.95x plain; with a step's copies issued at once host reaches 0.80x"
        )
    ]
    no_nofsync = {k: v for k, v in direct.items() if k != "store_nofsync_direct/64x512"}
    _, failures = gb.acceptance(no_nofsync, "mini-kimi", 57344, "h200-mini-kimi", {}, capture="direct")
    assert failures == [
        (
            "page-cache store (--capture direct) / vLLM's extract_hidden_states: not measured "
            "(store_nofsync_direct/vllm_ehs; EAGLE3_BENCH_MODES)"
        )
    ]
    kd = {"plain/64x512": 8000.0, "store/64x512": 7300.0, "store_direct/64x512": 7800.0}
    _, failures = gb.acceptance(kd, "kimi-depth", 57344, "h200-kimi-depth", {}, capture="direct")
    assert failures == []
    _, failures = gb.acceptance(kd, "kimi-depth", 57344, "h200-kimi-depth", {})
    assert failures == ["kimi-depth 64x512: fsynced store / plain prefill 0.91x (< 0.95)"]


def test_direct_s_null_sink_failure_splits_its_engine_s_cost_from_the_capture_s(monkeypatch):
    """The 0ccc20f run: count_direct 0.90x plain, host_direct 0.84x; generate() 7% slower than plain's and each batch's
    RPC 4.6 ms. plain_auxout (direct's engine, its model returning the aux layers' states, no capture attached)
    says how much of that is vLLM's aux outputs: the failure names it and count_direct / plain_auxout."""
    from tests.gpu import test_bench_extract as gb

    measured = json.loads(
        (Path(__file__).parents[2] / "results/2026-12-03-0ccc20f-h200-vllm0.26.0/bench_summary.json").read_text()
    )["tokens_per_s"]
    monkeypatch.setattr(gb, "_vllm_version", lambda: "0.26.0")
    _, failures = gb.acceptance(measured, "mini-kimi", 57344, "h200-mini-kimi", {}, capture="direct")
    assert failures[0] == (
        "null sink (--capture direct) / plain prefill 0.84x (< 0.9): count (--capture direct) reaches 0.90x plain"
    )
    auxout = dict(measured, **{"plain_auxout/64x512": 0.93 * measured["plain/64x512"]})
    summary, failures = gb.acceptance(auxout, "mini-kimi", 57344, "h200-mini-kimi", {}, capture="direct")
    assert failures[0].endswith(
        "reaches 0.90x plain; the engine alone, its model returning the aux states "
        "(plain_auxout), 0.93x; count_direct/plain_auxout 0.96x"
    )
    assert round(summary["ratios"]["64x512"]["plain_auxout/plain"], 2) == 0.93


@pytest.mark.parametrize("fails", [False, True])
def test_plain_auxout_measures_the_direct_engine_with_its_capture_detached(monkeypatch, fails):
    """The capture modes' own direct engine (no second start: ~130 s of a GPU run at mini-Kimi), its model returning
    the aux states, nothing taking them while the figure runs; attached again afterwards, also when it fails."""
    from tests.gpu import test_bench_extract as gb

    states, used = [], []

    class Backend:
        llm = object()
        attached = True

        def attach(self, on):
            self.attached = on
            states.append(on)

    backend = Backend()

    def sustained(benchmark, target, key, run_batch, *a, **k):
        used.append((key, backend.attached))
        run_batch(["sample"])
        if fails:
            raise RuntimeError("engine died")

    monkeypatch.setattr(gb, "sustained", sustained)
    monkeypatch.setattr(gb, "_generate", lambda llm, batch: used.append(llm))
    monkeypatch.setattr(gb, "MODES", None)
    live = types.SimpleNamespace(
        backend=lambda strategy: backend if strategy == "direct" else None,
        llm=lambda *a: pytest.fail("plain_auxout started an engine of its own"),
    )
    with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
        gb.test_plain_prefill(None, None, (64, 512), live, "plain_auxout")
    assert used == [("plain_auxout/64x512", False), Backend.llm] and states == [False, True]
    assert "plain_auxout" in gb.PLAIN_MODES


def test_the_benchmark_reports_its_rate_per_quarter_and_their_spread():
    from tests.gpu import test_bench_extract as gb

    ends = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0]  # 8 batches of 100 tokens: the last quarter at half speed
    got = gb._quarters(0.0, ends, 100)
    assert got == {"quarters_tok_s": [100, 100, 100, 50], "spread": 0.5}
    assert gb._quarters(0.0, [2.0], 100) == {"quarters_tok_s": [50], "spread": 0.0}


def test_a_sink_names_how_the_benchmark_loop_runs_it():
    """The ffdd6a0 run: every eagle3 mode ran the GIL sampler (a thread of the worker waking every 2 ms) and no plain
    mode did, so the capture's figures paid for their own instrument. Only a _gil sink samples the GIL now
    (count_gil_direct against count_direct is its cost); a misspelt variant is refused, not run as the default."""
    o = loop.loop_options
    assert o("count") == loop.LoopOptions("count", fsync=True, fp8=False, slots=4, whole_copies=False, gil=False)
    assert o("count_gil") == loop.LoopOptions("count", gil=True)
    assert o("store_nofsync") == loop.LoopOptions("store", fsync=False)
    assert o("store_fp8") == loop.LoopOptions("store", fp8=True)
    assert o("host_slots8") == loop.LoopOptions("host", slots=8)
    assert o("host_whole") == loop.LoopOptions("host", whole_copies=True)
    assert o("store_nofsync_gil") == loop.LoopOptions("store", fsync=False, gil=True)
    for bad in ("host_wole", "hots", "host_nofsync", "count_fp8", "store_gil_gil", ""):
        with pytest.raises(ValueError, match="sink"):
            o(bad)


@pytest.mark.parametrize("make", ["_plain_llm", "_ehs_llm"])
def test_the_benchmark_s_own_engines_start_in_the_capture_engines_environment(monkeypatch, tmp_path, make):
    """The 0ccc20f run: kimi-depth's plain engine, the benchmark's first, forked its worker after the driver had touched
    CUDA and died ("Cannot re-initialize CUDA in forked subprocess"); the capture's engines start spawned
    (vllm_compat.prepare_environment). plain and vllm_ehs are read against them: the same environment, the same
    model runner."""
    from tests.gpu import test_bench_extract as gb

    for k in ("VLLM_WORKER_MULTIPROC_METHOD", "VLLM_USE_V2_MODEL_RUNNER", "VLLM_USE_FLASHINFER_SAMPLER"):
        monkeypatch.setenv(k, "")  # recorded as it was: the test leaves the process's environment as it found it
        monkeypatch.delenv(k)
    seen = {}

    class LLM:
        def __init__(self, **kw):
            seen.update({k: os.environ.get(k) for k in ("VLLM_WORKER_MULTIPROC_METHOD", "VLLM_USE_V2_MODEL_RUNNER")})

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM))
    target = types.SimpleNamespace(
        path=tmp_path, load_format="dummy", local=True, tp=1, profile=types.SimpleNamespace(layer_ids=(2, 4, 5, 8))
    )
    getattr(gb, make)(target, *([tmp_path / "out"] if make == "_ehs_llm" else []))
    assert seen == {"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "VLLM_USE_V2_MODEL_RUNNER": "0"}


def test_the_gpu_benchmark_reads_its_fsynced_store_against_the_baseline_at_its_own_disk(monkeypatch):
    """The 6b3715c run's mini-Kimi run, replayed (results/2026-12-04-6b3715c-h200-vllm0.26.0/): every target met, yet
    the run
    failed on a "regression" of the fsynced store, 25,836 tok/s at 1.39 GB/s against the bundled 33,136 measured
    at 1.88 GB/s. The GPU test hands the run's disk figures to the regression check."""
    from tests.gpu import test_bench_extract as gb

    measured = _measured("2026-12-04-6b3715c-h200-vllm0.26.0")
    monkeypatch.setattr(gb, "_vllm_version", lambda: "0.26.0")
    summary, failures = gb.acceptance(
        measured, "mini-kimi", 57344, "h200-mini-kimi", bench.load_baselines(FROZEN_BASELINE), capture="direct"
    )
    assert failures == [] and summary["regressions"] == []
    no_disk = {k: v for k, v in measured.items() if not k.startswith("disk_")}
    summary, _ = gb.acceptance(
        no_disk, "mini-kimi", 57344, "h200-mini-kimi", bench.load_baselines(FROZEN_BASELINE), capture="direct"
    )
    assert summary["regressions"] == [
        ("h200-mini-kimi store_direct/64x512: 25,836 tok/s is below the baseline 33,136 minus 15% (28,166)")
    ]


# vLLM 0.26's tuned Triton MoE configs for kimi-depth's and mini-Kimi's experts on the H200 (fused_moe/configs/
# E=8,N=2048,device_name=NVIDIA_H200.json, the keys a prefill step can be nearest to), as (BLOCK_SIZE_M,
# BLOCK_SIZE_N, GROUP_SIZE_M): vLLM takes the key nearest a step's token count
H200_E8_N2048 = {
    256: (128, 256, 32),
    512: (128, 256, 32),
    1024: (128, 256, 32),
    1536: (128, 256, 32),
    2048: (128, 256, 64),
    3072: (128, 256, 64),
    4096: (128, 256, 32),
}


def _nearest(grid):
    return lambda m: grid[min(grid, key=lambda k: abs(k - m))]


def test_a_warm_step_per_moe_kernel_config_the_benchmark_loop_can_meet():
    """The 6b3715c run: kimi-depth's fsynced store read 0.936x plain (< 0.95), its first quarter 16% slow and the
    others 0.99x; the engine compiled a Triton MoE kernel in that quarter ("JIT compilation during inference:
    fused_moe_kernel"), for a config of steps of 2,048-3,584 tokens that no warm-up step had met. The warm-up now
    runs one step of each config the loop's step sizes pick, before the clock."""
    steps = loop.loop_step_tokens(512, 16384)
    assert steps == [512 * k for k in range(1, 33)]
    assert loop.loop_step_tokens(4096, 16384) == [4096, 8192, 12288, 16384]
    assert loop.loop_step_tokens(32768, 16384) == [16384]  # a longer prompt: chunks of the budget
    pick = _nearest(H200_E8_N2048)
    warm = loop.warm_steps(steps, pick)
    assert warm == [512, 2048]  # the smallest step of each config
    assert {pick(m) for m in warm} == {pick(m) for m in steps}
    assert loop.warm_steps([4096, 8192], pick) == [4096]
    assert loop.warm_steps(steps, None) == steps  # vLLM's choice unknown: every size


def test_a_warm_step_is_one_prompt_so_the_engine_cannot_split_it():
    """The 8ff3dae run: kimi-depth's plain engine still compiled fused_moe_kernel 1 s into its clock (quarters 6,830
    then ~8,030 tok/s), after a warm batch of 4 prompts of 512 tokens meant to make one 2,048-token step. The
    engine schedules what has reached it: the timed loop's 16-prompt batches ran as 1,024 + 7,168, 512 + 7,680,
    2,048 + 6,144 tokens (the store's capture_timing), so 4 prompts need not make one step of 2,048. One prompt
    of 2,048 tokens does (it fits the step budget); a step longer than the engine's longest prompt takes the
    fewest prompts that hold it, within a token of each other."""
    assert loop.warm_prompts([512, 2048], 8191) == [[512], [2048]]
    assert loop.warm_prompts([16384], 8191) == [[5461, 5461, 5462]]
    assert loop.warm_prompts([8191, 8192], 8191) == [[8191], [4096, 4096]]
    for m in range(1, 40):
        parts = loop.warm_prompts([m], 7)[0]
        assert sum(parts) == m and max(parts) <= 7 and max(parts) - min(parts) <= 1 and len(parts) == -(-m // 7)


def test_the_benchmark_asks_vllm_for_the_moe_config_of_the_target_s_experts_at_its_tp(monkeypatch):
    """As vLLM's TritonExperts asks (w1 [E, 2N, H], w2 [E, H, N], N the expert width at the target's TP, bf16):
    another shape reads another tuned file and warms the wrong configs. No experts, or no such function: None
    (loop.warm_steps then warms every size)."""
    from tests.gpu import test_bench_extract as gb

    asked = []

    def try_get_optimal_moe_config(w1, w2, topk, dtype, m):
        asked.append((w1, w2, topk, dtype, m))
        return _nearest(H200_E8_N2048)(m)

    name = "vllm.model_executor.layers.fused_moe.fused_moe"
    for i in range(1, 5):
        monkeypatch.setitem(sys.modules, ".".join(name.split(".")[:i]), types.ModuleType("parent"))
    monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(try_get_optimal_moe_config=try_get_optimal_moe_config))
    hf = {"n_routed_experts": 384, "moe_intermediate_size": 2048, "num_experts_per_tok": 8}
    target = types.SimpleNamespace(tp=8, profile=types.SimpleNamespace(hf_config=hf, hidden_size=7168))
    pick = gb.moe_config_of(target)
    assert pick(2048) == (128, 256, 64)
    assert asked[-1] == ((384, 512, 7168), (384, 7168, 256), 8, None, 2048)
    dense = types.SimpleNamespace(
        tp=1, profile=types.SimpleNamespace(hf_config={"intermediate_size": 11008}, hidden_size=4096)
    )
    assert gb.moe_config_of(dense) is None
    monkeypatch.setitem(sys.modules, name, types.SimpleNamespace())  # a vLLM without it
    assert gb.moe_config_of(target) is None


def _sustained_on_cpu(monkeypatch, gb, **knobs):
    """gb.sustained without a GPU: the benchmark module's figures emptied, its knobs (BATCHES, ...) set, vLLM's version
    and the GPU's name stubbed. Returns a pytest-benchmark stand-in that runs the loop once."""
    for name in ("_WARM", "_PROMPTS", "RESULTS", "SPREADS", "PEAKS", "CLOCKS"):
        monkeypatch.setattr(gb, name, {})
    for name, v in knobs.items():
        monkeypatch.setattr(gb, name, v)
    monkeypatch.setattr(gb, "_vllm_version", lambda: "0.26.0")
    monkeypatch.setattr(gb, "_profile", lambda target: "h200-kimi-depth")
    return types.SimpleNamespace(pedantic=lambda fn, rounds, iterations: fn(), extra_info={})


def test_the_benchmark_runs_its_warm_steps_before_the_clock_with_prompts_of_their_own(monkeypatch):
    from tests.gpu import test_bench_extract as gb

    benchmark = _sustained_on_cpu(monkeypatch, gb, MAX_BATCHES=3, BATCHES=3, MIN_SECONDS=0.0)
    monkeypatch.setattr(gb, "moe_config_of", lambda target: _nearest(H200_E8_N2048))
    reported = {}
    monkeypatch.setitem(gb._REPORT, "put", reported.__setitem__)
    target = types.SimpleNamespace(tp=1, profile=types.SimpleNamespace(vocab_size=1000))
    events, ids = [], {"warm": set(), "timed": set()}
    clock = []

    prompts = []  # each batch's prompt lengths

    def run_batch(batch, ahead=()):
        events.append(("run", sum(len(s) for s in batch), len(ahead)))
        ids["timed" if clock else "warm"].update(s.sample_id for s in batch)
        prompts.append([len(s) for s in batch])

    def start():
        events.append("start")
        if "finish" in events:
            clock.append(True)  # the second start: the timed session

    n = gb.sustained(
        benchmark, target, "store_direct/16x512", run_batch, lambda: events.append("finish"), start, lookahead=True
    )
    assert n == 3
    assert events == [
        "start",
        ("run", 512, 0),
        ("run", 2048, 0),
        ("run", 8192, 1),
        ("run", 8192, 0),
        "finish",
        "start",
        ("run", 8192, 2),
        ("run", 8192, 1),
        ("run", 8192, 0),
        "finish",
    ]
    assert prompts[:3] == [[512], [2048], [512] * 16]  # one prompt a warm step: the engine cannot split it
    assert len(ids["warm"]) == 1 + 1 + 32 and not ids["warm"] & ids["timed"]
    figure = reported["sustained[store_direct/16x512]"]
    assert figure["warm_step_tokens"] == [512, 2048] and len(figure["timed_clock"]) == 2


def test_the_jit_check_says_when_vllm_logged_only_each_engine_s_first_compile(tmp_path, capsys):
    """vLLM's JIT monitor logs a compile with warning_once unless jit_monitor_verbose is on: each engine's first
    only. The 8ff3dae run's kimi-depth log (results/2026-12-04-8ff3dae-h200-vllm0.26.0/) had one per engine: plain's
    1 s into
    its clock, the store's 4 s before its own; a second compile in the store's clock would not have shown, and
    "no JIT inside its clock" would have been read as proof. The check now says when it cannot see a later one."""
    import gzip

    from tests.gpu import jit_in_clock as jc

    run = Path(__file__).parents[2] / "results/2026-12-04-8ff3dae-h200-vllm0.26.0"
    log = tmp_path / "benchkd.log"
    log.write_bytes(gzip.decompress((run / "benchkd.log.gz").read_bytes()))
    report = run / "benchkd-report.json"
    assert jc.main([str(log), str(report)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "plain/16x512: JIT INSIDE ITS CLOCK: fused_moe_kernel at 04:34:06",
        "store_direct/16x512: no JIT inside its clock",
        (
            "CAUTION: vLLM logged only each engine's first compile (jit_monitor_verbose off in 2 of 2 engines): "
            "a later "
            "one inside a clock would not show"
        ),
        f"2 JIT warning(s) in {log}; 2 figure(s) with a clock in {report}",
    ]


def test_the_jit_check_names_the_config_of_each_kernel_compiled_in_a_clock(tmp_path, capsys):
    """With jit_monitor_verbose, vLLM logs every compile with its constexprs (vllm/utils/jit_monitor.py,
    _format_verbose_triton_compile_details): the check gives each hit's MoE block sizes, which say what the
    warm-up missed."""
    from tests.gpu import jit_in_clock as jc

    args = (
        "INFO 12-04 05:00:00 [api_utils.py:273] non-default args: {'skip_tokenizer_init': True, "
        "'jit_monitor_verbose': True, 'max_num_batched_tokens': 16384}\n"
    )
    hit = (
        "(EngineCore pid=7) WARNING 12-04 {t} [jit_monitor.py:131] Triton kernel JIT compilation during "
        "inference: fused_moe_kernel (constexprs={{BLOCK_SIZE_M=128, GROUP_SIZE_M={g}, top_k=8}}; "
        "signature={{EM='i32'}}; extra_compile_info={{}}; key='k'). This causes a latency spike; consider "
        "extending warmup to cover this shape/config.\n"
    )
    log = tmp_path / "bench.log"
    log.write_text(args + hit.format(t="05:00:03", g=64) + hit.format(t="05:00:09", g=16))
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"sustained[plain/16x512]": {"timed_clock": ["05:00:05", "05:00:40"]}}))
    assert jc.compiles(log.read_text()) == [
        ("05:00:03", "fused_moe_kernel", "{BLOCK_SIZE_M=128, GROUP_SIZE_M=64, top_k=8}"),
        ("05:00:09", "fused_moe_kernel", "{BLOCK_SIZE_M=128, GROUP_SIZE_M=16, top_k=8}"),
    ]
    assert jc.main([str(log), str(report)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        (
            "plain/16x512: JIT INSIDE ITS CLOCK: fused_moe_kernel at 05:00:09 {BLOCK_SIZE_M=128, GROUP_SIZE_M=16, "
            "top_k=8}"
        ),
        f"2 JIT warning(s) in {log}; 1 figure(s) with a clock in {report}",
    ]


def test_a_page_cache_store_below_target_says_when_the_kernel_wrote_back_during_its_figure(monkeypatch):
    """The 0ccc20f and 9f3c587 runs: the page-cache store fell to 0.23x / 0.27x vllm_ehs once its folder outgrew the
    kernel's
    background writeback threshold, which vllm_ehs stayed under; the failure gave only the ratio, and the cause
    had to be dug out of the report. It now gives both figures' writeback and dirty peaks. Replayed on session
    15's run 1 (capture direct, results/2026-12-04-9f3c587-h200-vllm0.26.0/): the only target it missed."""
    from tests.gpu import test_bench_extract as gb

    measured = _measured("2026-12-04-9f3c587-h200-vllm0.26.0")
    report = json.loads(
        (Path(__file__).parents[2] / "results/2026-12-04-9f3c587-h200-vllm0.26.0/bench-report.json").read_text()
    )
    peaks = {
        k[len("sustained[") : -1]: {f: v[f] for f in ("dirty_max_GB", "writeback_max_GB")}
        for k, v in report.items()
        if k.startswith("sustained[")
    }
    monkeypatch.setattr(gb, "_vllm_version", lambda: "0.26.0")
    plain = "page-cache store (--capture direct) / vLLM's extract_hidden_states 0.27x (< 1.0)"
    _, failures = gb.acceptance(measured, "mini-kimi", 57344, "h200-mini-kimi", {}, capture="direct", peaks=peaks)
    assert failures == [
        plain + ": the kernel wrote back up to 2.03 GB while it ran (dirty up to 20.32 GB; vllm_ehs "
        "0.00 and 7.10 GB): past the background writeback threshold the figure measures the disk "
        "and the unlinks that wait on it, not the sink"
    ]
    calm = dict(peaks, **{"store_nofsync_direct/64x512": {"dirty_max_GB": 3.0, "writeback_max_GB": 0.0}})
    for p in (calm, None):  # no writeback during the figure, or no peaks recorded: the ratio alone
        _, failures = gb.acceptance(measured, "mini-kimi", 57344, "h200-mini-kimi", {}, capture="direct", peaks=p)
        assert failures == [plain]


def test_the_campaign_names_each_figure_that_had_a_kernel_compiled_inside_its_clock(tmp_path, capsys):
    """The 6b3715c run's kimi-depth log (results/2026-12-04-6b3715c-h200-vllm0.26.0/benchkd.log.gz): plain's engine
    compiled
    fused_moe_kernel at 03:29:42, in its warm-up; the store's at 03:33:06, in its first timed quarter. That run's
    report had no clock times yet; the ones here are where its two figures ran."""
    import gzip

    from tests.gpu import jit_in_clock as jc

    run = Path(__file__).parents[2] / "results/2026-12-04-6b3715c-h200-vllm0.26.0"
    log = tmp_path / "benchkd.log"
    log.write_bytes(gzip.decompress((run / "benchkd.log.gz").read_bytes()))
    assert jc.compiles(log.read_text()) == [("03:29:42", "fused_moe_kernel", ""), ("03:33:06", "fused_moe_kernel", "")]
    report = json.loads((run / "benchkd-report.json").read_text())
    report["sustained[plain/16x512]"]["timed_clock"] = ["03:29:44", "03:30:16"]
    report["sustained[store_direct/16x512]"]["timed_clock"] = ["03:33:04", "03:33:39"]
    (tmp_path / "report.json").write_text(json.dumps(report))
    assert jc.main([str(log), str(tmp_path / "report.json")]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "plain/16x512: no JIT inside its clock",
        "store_direct/16x512: JIT INSIDE ITS CLOCK: fused_moe_kernel at 03:33:06",
        (
            "CAUTION: vLLM logged only each engine's first compile (jit_monitor_verbose off in 2 of 2 engines): "
            "a later "
            "one inside a clock would not show"
        ),
        f"2 JIT warning(s) in {log}; 2 figure(s) with a clock in {tmp_path / 'report.json'}",
    ]
    report["sustained[store_direct/16x512]"]["timed_clock"] = ["03:33:07", "03:33:39"]  # warmed before the clock
    (tmp_path / "report.json").write_text(json.dumps(report))
    assert jc.main([str(log), str(tmp_path / "report.json")]) == 0
    assert jc.inside("00:00:05", "23:59:50", "00:00:20") and not jc.inside("12:00:00", "23:59:50", "00:00:20")


def test_a_bar_whose_figure_compiled_a_kernel_inside_its_clock_fails_the_acceptance(monkeypatch):
    """The 8ff3dae run's kimi-depth store read 1.014x plain, a pass, because plain compiled fused_moe_kernel 1 s into
    its
    clock; only a person reading jit_in_clock.txt saw it. The acceptance now takes each figure's compiles inside
    its clock: a bar resting on such a figure fails, naming the figure, kernel, time and block sizes; a figure no bar
    reads is only reported. Replayed on the 6b3715c run's mini-Kimi figures, which met every direct bar."""
    from tests.gpu import test_bench_extract as gb

    measured = _measured("2026-12-04-6b3715c-h200-vllm0.26.0")
    monkeypatch.setattr(gb, "_vllm_version", lambda: "0.26.0")
    clean = {k: [] for k in measured if "/" in k}  # every figure: no compile inside its clock
    summary, failures = gb.acceptance(measured, "mini-kimi", 57344, "h200-mini-kimi", {}, capture="direct", jit=clean)
    assert failures == [] and summary["jit_in_clock"] == clean
    hit = [("05:46:06", "fused_moe_kernel", "{GROUP_SIZE_M=64}")]
    host, fsync, cache = (
        "null sink (--capture direct) / plain prefill",
        "fsynced store (--capture direct) / min(",
        "page-cache store (--capture direct) / vLLM's",
    )
    for figure, bars in [
        ("plain/64x512", {host, fsync}),
        ("host_direct/64x512", {host}),
        ("store_direct/64x512", {fsync}),
        ("vllm_ehs/64x512", {cache}),
        ("store_nofsync_direct/64x512", {cache}),
    ]:
        _, failures = gb.acceptance(
            measured, "mini-kimi", 57344, "h200-mini-kimi", {}, capture="direct", jit=dict(clean, **{figure: hit})
        )
        assert all(
            f"{figure} compiled fused_moe_kernel at 05:46:06 {{GROUP_SIZE_M=64}} inside its "
            "clock: not a sustained figure" in f
            for f in failures
        ), (figure, failures)
        assert {b for b in (host, fsync, cache) for f in failures if f.startswith(b)} == bars, (figure, failures)
    summary, failures = gb.acceptance(
        measured,
        "mini-kimi",
        57344,
        "h200-mini-kimi",
        {},
        capture="direct",
        jit=dict(clean, **{"count_direct/64x512": hit}),
    )
    assert failures == [] and summary["jit_in_clock"]["count_direct/64x512"] == hit  # no bar reads count_direct
    kd = {"plain/16x512": 8177.0, "store_direct/16x512": 8100.0}
    _, failures = gb.acceptance(
        kd,
        "kimi-depth",
        57344,
        "h200-kimi-depth",
        {},
        capture="direct",
        jit={"plain/16x512": hit, "store_direct/16x512": []},
    )
    assert len(failures) == 1 and failures[0].startswith(
        "kimi-depth 16x512: fsynced store (--capture direct) / plain prefill: plain/16x512 compiled"
    ), failures
    summary, failures = gb.acceptance(kd, "kimi-depth", 57344, "h200-kimi-depth", {}, capture="direct")
    assert failures == [] and summary["jit_in_clock"] == "not checked"  # no engine log given (jit=None)


def test_the_acceptance_reads_the_engines_log_it_is_given(tmp_path):
    """EAGLE3_ENGINE_LOG (the step's log): the figures' compiles inside their clocks, from
    the 288d049 run's kimi-depth log, where plain's two compiles came 3 s before its clock; a log without any engine's
    start (pytest run without -s: the engines' output went elsewhere) or with an engine that logged only its first
    compile cannot show a compile, and says so as a failure."""
    import gzip

    from tests.gpu import test_bench_extract as gb

    run = Path(__file__).parents[2] / "results/2026-12-04-288d049-h200-vllm0.26.0"
    log = tmp_path / "benchkd.log"
    log.write_bytes(gzip.decompress((run / "benchkd.log.gz").read_bytes()))
    clocks = {"plain/16x512": ["05:46:03", "05:46:35"]}
    assert gb.jit_in_clocks(str(log), clocks) == ({"plain/16x512": []}, [])
    hits, problems = gb.jit_in_clocks(str(log), {"plain/16x512": ["05:46:00", "05:46:35"]})
    assert [(t, k) for t, k, _ in hits["plain/16x512"]] == [("05:46:00", "fused_moe_kernel")] * 2 and not problems
    assert "GROUP_SIZE_M=64" in hits["plain/16x512"][0][2]
    assert gb.jit_in_clocks(None, clocks) == (None, [])
    empty = tmp_path / "empty.log"
    empty.write_text("tests/gpu/test_bench_extract.py::test_plain_prefill[16x512-plain] PASSED\n")
    assert gb.jit_in_clocks(str(empty), clocks)[1] == [
        f"EAGLE3_ENGINE_LOG={empty} holds no engine's start: run pytest with -s, so the engines' output reaches it"
    ]
    quiet = tmp_path / "quiet.log"
    quiet.write_bytes(gzip.decompress((run.parent / "2026-12-04-8ff3dae-h200-vllm0.26.0/benchkd.log.gz").read_bytes()))
    assert gb.jit_in_clocks(str(quiet), clocks)[1] == [
        (
            f"EAGLE3_ENGINE_LOG={quiet}: 2 of 2 engines ran without jit_monitor_verbose; vLLM logged only each one's "
            "first compile, so a later one inside a clock would not show"
        )
    ]
    missing = tmp_path / "nowhere.log"
    assert gb.jit_in_clocks(str(missing), clocks)[1] == [f"EAGLE3_ENGINE_LOG={missing}: no such file"]


def test_the_clock_starts_and_ends_a_wall_second_apart_from_what_runs_around_it(monkeypatch):
    """vLLM stamps its log to the second, as the figure's clock is: a warm-up compile in the clock's first second,
    or the next figure's in its last, would read as inside it. The clock starts in a later second than the warm-up's
    last step ended, and sustained returns in a later second than the clock ended."""
    import time as _time

    from tests.gpu import jit_in_clock as jc
    from tests.gpu import test_bench_extract as gb

    benchmark = _sustained_on_cpu(monkeypatch, gb, MAX_BATCHES=2, BATCHES=2, MIN_SECONDS=0.0, WARMUP=1)
    monkeypatch.setattr(gb, "moe_config_of", lambda target: None)
    monkeypatch.setitem(gb._REPORT, "put", lambda k, v: None)
    target = types.SimpleNamespace(tp=1, profile=types.SimpleNamespace(vocab_size=1000))
    ends = []

    for _ in range(2):
        ends.clear()
        gb.sustained(benchmark, target, "plain/2x16", lambda batch: ends.append(_time.time()))
        after = _time.strftime("%H:%M:%S", _time.localtime(_time.time()))
        start, end = gb.CLOCKS["plain/2x16"]
        warm_end = _time.strftime("%H:%M:%S", _time.localtime(ends[-3]))  # the last warm-up batch (2 timed)
        # what the JIT check asks (jit_in_clock.inside, which wraps at midnight)
        assert not jc.inside(warm_end, start, end) and not jc.inside(after, start, end), (warm_end, start, end, after)


def test_the_benchmark_s_acceptance_test_fails_on_a_compile_in_a_clock_or_a_log_that_cannot_show_one(
    tmp_path, monkeypatch
):
    """The GPU acceptance test itself (test_ratios_acceptance_and_baseline), on the 6b3715c run's mini-Kimi figures that
    met every bar: the engines' log it is given (EAGLE3_ENGINE_LOG) decides. A compile inside plain's clock fails
    it; so does a log whose engines logged only their first compile; a clean log passes, the check in
    bench_summary.json."""
    from eagle3.extract import vllm_compat
    from tests.gpu import test_bench_extract as gb

    monkeypatch.setattr(gb, "RESULTS", _measured("2026-12-04-6b3715c-h200-vllm0.26.0"))
    monkeypatch.setattr(
        gb, "CLOCKS", {"plain/64x512": ["05:00:05", "05:00:40"], "host_direct/64x512": ["05:02:05", "05:02:40"]}
    )
    for name in ("SPREADS", "PEAKS"):
        monkeypatch.setattr(gb, name, {})
    monkeypatch.setattr(gb, "_vllm_version", lambda: "0.26.0")
    monkeypatch.setattr(gb, "_profile", lambda target: "h200-mini-kimi")
    monkeypatch.setattr(vllm_compat, "pick_strategy", lambda requested: "direct")
    monkeypatch.setattr(bench, "load_baselines", dict)
    target = types.SimpleNamespace(profile=types.SimpleNamespace(name="mini-kimi", bytes_per_token=57344))
    engine = (
        "INFO 12-04 05:00:00 [api_utils.py:273] non-default args: {'skip_tokenizer_init': True, "
        "'jit_monitor_verbose': %s}\n"
    )
    jit = (
        "(EngineCore pid=7) WARNING 12-04 %s [jit_monitor.py:132] Triton kernel JIT compilation during inference: "
        "fused_moe_kernel (constexprs={GROUP_SIZE_M=32}; signature={}; key='k'). This causes a latency spike\n"
    )
    log = tmp_path / "bench.log"
    monkeypatch.setenv("EAGLE3_ENGINE_LOG", str(log))
    for text, said in [
        (engine % True + jit % "05:00:07", "plain/64x512 compiled fused_moe_kernel at 05:00:07"),
        (engine % False + jit % "05:00:01", "1 of 1 engines ran without jit_monitor_verbose"),
    ]:
        log.write_text(text)
        with pytest.raises(AssertionError, match=said):
            gb.test_ratios_acceptance_and_baseline(target, tmp_path, lambda *a: None)
    log.write_text(engine % True + jit % "05:00:01")
    gb.test_ratios_acceptance_and_baseline(target, tmp_path, lambda *a: None)
    summary = json.loads((tmp_path / "bench_summary.json").read_text())
    assert summary["jit_in_clock"] == {"plain/64x512": [], "host_direct/64x512": []}


def test_each_picture_answers_one_question_titled_and_named_in_the_readme_s_words(tmp_path):
    """The bundled runs' history (results/) and a trainer run: the extraction history, the latest extraction run and
    the trainer each in a figure of their own; every title says what its panel shows (no trainer panel titled as
    extraction, "dashed" only where a dashed line is), every legend names a drawn line or bar in words (no
    internal mode names), and the colors of one figure are told apart."""
    records = bench.load_history([Path(__file__).parents[2] / "results"])
    rows = [
        {"draft": "llama", "seq": 8192, "precision": "bf16-mixed", "attn": "varlen", "tok_per_s": 24400, "mfu": 0.392},
        {"draft": "llama", "seq": 8192, "precision": "bf16-mixed", "attn": "flex", "compiled": True,
         "tok_per_s": 30944, "mfu": 0.497},
    ]  # fmt: skip
    (tmp_path / "train.json").write_text(json.dumps(history.train_history(rows, "2026-12-05T10:00", "h200-draft")))
    records += bench.load_history([tmp_path / "train.json"])
    hist, latest, train = [], [], []
    bench.trends(records, bench.load_baselines(), tmp_path / "t.png", hist)
    bench.bars(records, tmp_path / "b.png", described=latest)
    names = bench.training_figure(records, tmp_path / "tr.png", train)
    modes = {r.key.split("/")[0] for r in bench.extraction(records)}
    words = {bench.mode_label(m) for m in modes}
    assert not words & modes and all("_" not in w.replace("extract_hidden_states", "") for w in words), words
    for panel in hist:
        assert "extraction tokens/s per run" in panel["title"] and ("dashed" in panel["title"]) == panel["dashed"]
        assert panel["legend"] and set(panel["legend"]) <= words and panel["legend"] == panel["drawn"], panel
    assert any(p["dashed"] for p in hist)
    bare = []
    bench.trends(records, {}, tmp_path / "t2.png", bare)  # no baselines: no dashed line, and no title that says one
    assert bare and not any(p["dashed"] or "dashed" in p["title"] for p in bare)
    for panel in latest:
        assert "extraction tokens/s per mode" in panel["title"]
        named = [label for label in panel["legend"] if not label.startswith(("limit", "cluster"))]
        assert named and set(named) <= words and set(panel["legend"]) <= set(panel["drawn"]), panel
    assert {p["title"].split(": ")[1] for p in train} == {"trainer tokens/s per GPU", "trainer MFU (%)"}
    ours = [p["title"].split(": ")[1] for p in train if p["title"].startswith("h200-draft,")]
    assert ours == ["trainer tokens/s per GPU", "trainer MFU (%)"]
    assert {"llama, flex attention, bf16-mixed, compiled, 8k tokens",
            "llama, varlen attention, bf16-mixed, eager, 8k tokens"} <= set(names)  # fmt: skip
    assert not any("extraction" in p["title"] for p in train)
    assert len(set(bench.palette(20))) == 20 and len(set(bench.palette(10))) == 10
