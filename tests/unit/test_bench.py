"""Benchmark history -> regression checks and the Markdown + PNG report."""

import json

import pytest

from eagle3 import bench, cli


def _history(tmp_path, run, values, profile="h200-mini-kimi"):
    data = {"datetime": run, "benchmarks": [
        {"name": k, "stats": {"median": 1.0}, "extra_info": {"key": k, "tokens_per_s": v, "profile": profile}}
        for k, v in values.items()]}
    p = tmp_path / f"{run}.json"
    p.write_text(json.dumps(data))
    return p


def test_bundled_baselines_have_both_profiles():
    b = bench.load_baselines()
    assert b["8xrtx6000-kimi-k2.5"]["tokens_per_s"]["store/extract"] == 2280
    assert b["h200-mini-kimi"]["tokens_per_s"]["plain/64x512"] == 261665


def test_regression_fires_only_below_the_margin():
    base = bench.load_baselines()
    ok = bench.Record("r", "8xrtx6000-kimi-k2.5", "store/extract", 2100.0, {})
    bad = bench.Record("r", "8xrtx6000-kimi-k2.5", "store/extract", 2000.0, {})
    assert bench.regression(ok, base) is None
    assert "below the baseline 2,280" in bench.regression(bad, base)
    assert bench.regression(bench.Record("r", "unknown", "x/1x1", 1.0, {}), base) is None


def test_report_writes_a_table_and_a_plot(tmp_path):
    _history(tmp_path, "2026-12-01T10:00", {"plain/64x512": 300000, "store/64x512": 280000})
    _history(tmp_path, "2026-12-02T10:00", {"plain/64x512": 310000, "store/64x512": 150000})
    assert cli.main(["bench", "report", "--history", str(tmp_path), "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "throughput.md").read_text()
    assert "| 2026-12-02T10:00 | h200-mini-kimi | store/64x512 | 150,000 | 0.48x | - | no |" in md
    assert "| 2026-12-02T10:00 | h200-mini-kimi | plain/64x512 | 310,000 | 1.00x | 1.18x | no |" in md
    png = (tmp_path / "rep" / "throughput.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_report_without_records_says_so(tmp_path):
    with pytest.raises(ValueError, match="no benchmark records"):
        bench.report([tmp_path], tmp_path / "out")
