"""tests/perf/gpu_window.py: the GPU's time over a window of an online run, by CUDA stream, from a chrome trace (the
profile where the online goal is missed). Golden traces whose busy, idle and overlapping time are known by
construction; the window's thread on the CPU (no kernels there: its timing and its early end)."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.perf import gpu_window


def kernel(stream, ts, dur, name="k"):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_two_streams_overlapping_one_second_in_a_four_second_span():
    # stream 7: [0, 2) s and [3, 4) s; stream 13: [1.5, 2.5) s, two kernels overlapping each other in it
    trace = {
        "traceEvents": [
            kernel(7, 0, 2e6, "gemm"),
            kernel(7, 3e6, 1e6, "gemm"),
            kernel(13, 1.5e6, 1e6, "moe"),
            kernel(13, 1.6e6, 0.4e6, "copy"),
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9e6},  # not a kernel: not counted
            {"ph": "i", "cat": "kernel", "name": "marker", "ts": 5e6},
        ]
    }
    got = gpu_window.streams_busy(trace)
    assert got["span_s"] == 4.0 and got["busy_s"] == 3.5 and got["idle_share"] == 0.125, got
    assert got["overlap_s"] == 0.5, got  # [1.5, 2) s: both streams
    assert list(got["streams"]) == ["7", "13"], got  # the busiest first
    assert got["streams"]["7"] == {"kernels": 2, "busy_s": 3.0, "share": 0.75, "top": ["gemm"]}, got
    assert got["streams"]["13"] == {"kernels": 2, "busy_s": 1.0, "share": 0.25, "top": ["moe", "copy"]}, got


def test_no_kernels_no_figures():
    got = gpu_window.streams_busy({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]})
    assert got == {"span_s": 0.0, "busy_s": 0.0, "idle_share": None, "overlap_s": 0.0, "streams": {}}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1000), st.integers(1, 300)), min_size=1, max_size=30))
def test_busy_time_is_what_a_microsecond_grid_counts(kernels):
    """Against the count of busy microseconds on a grid: the union over streams, each stream's own, the overlap (the
    stream-microseconds beyond one per busy microsecond)."""
    trace = {"traceEvents": [kernel(s, ts, dur) for s, ts, dur in kernels]}
    got = gpu_window.streams_busy(trace)
    grid: dict[int, set] = {}
    for s, ts, dur in kernels:
        for t in range(ts, ts + dur):
            grid.setdefault(t, set()).add(s)
    assert got["busy_s"] == pytest.approx(len(grid) * 1e-6, abs=1e-9)
    for s in {k[0] for k in kernels}:
        assert got["streams"][str(s)]["busy_s"] == pytest.approx(sum(s in v for v in grid.values()) * 1e-6, abs=1e-9)
    assert got["overlap_s"] == pytest.approx(sum(len(v) - 1 for v in grid.values()) * 1e-6, abs=1e-9)
    span = max(ts + dur for _, ts, dur in kernels) - min(ts for _, ts, _ in kernels)
    assert got["span_s"] == pytest.approx(span * 1e-6)
    # to 3 decimals; a share on a rounding half (1 - 426/800 = 0.4675) goes either way in the seconds' floats
    assert abs(got["idle_share"] - (1 - len(grid) / span)) <= 0.0005 + 1e-9, (got["idle_share"], len(grid), span)


def test_a_window_opens_after_its_delay_and_closes_after_its_length():
    w = gpu_window.Window(0.05, 0.2, cuda=False).start()
    # no stop() asked: it closes by itself. Waited for, not timed: a cold process first imports torch.profiler (~1 s)
    w._thread.join(30)
    assert not w._thread.is_alive() and w.error is None, w.error
    got = w.stop()
    assert got is not None and got["streams"] == {}, got  # the CPU: a trace without kernels


def test_a_run_ending_before_the_window_opens_leaves_no_summary_and_no_wait():
    w = gpu_window.Window(30, 30, cuda=False).start()
    t0 = time.perf_counter()
    assert w.stop() is None and w.error is None
    assert time.perf_counter() - t0 < 1.0


def test_a_run_ending_inside_the_window_ends_it_early_with_what_was_recorded():
    w = gpu_window.Window(0.0, 60, cuda=False).start()
    time.sleep(0.3)
    t0 = time.perf_counter()
    got = w.stop()
    assert time.perf_counter() - t0 < 5 and got is not None and w.error is None, (got, w.error)
