"""ExtractSummary.sustained_tokens_per_s: the extraction alone's rate over the window that
online.OnlineResult.sustained_tokens_per_s takes of the extraction beside a trainer (each batch's end, the first
batch's warm-up left out), so that issue 42's online figure is set against a like one
(tests/gpu/test_online_kimi_depth)."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle3.data.conversations import DataConfig
from eagle3.extract import extract
from eagle3.extract.hf_backend import HFBackend

IDS = (2, 4, 5, 8)


@pytest.fixture(scope="module")
def backend(tiny_kimi):
    return HFBackend(tiny_kimi, IDS, out_dtype="bfloat16")


def _cfg(tiny_kimi, small_data, out, samples):
    return extract.ExtractConfig(
        model=str(tiny_kimi),
        out=str(out),
        batch_size=4,
        shard_samples=2,
        writer_threads=0,
        selfcheck=0,
        fsync=False,
        data=DataConfig([str(small_data)], max_len=64, max_samples=samples),
    )


def test_the_sustained_rate_leaves_out_the_first_batch_s_warm_up(tiny_kimi, small_data, backend, tmp_path, monkeypatch):
    """Three batches of 4, the first 0.6 s slower (a first prefill's warm-up): one (end time, tokens) a batch, in
    order, summing to the tokens written; the sustained rate is the later two batches' tokens over the time from
    the first's end to the last's, well above the whole run's rate."""
    capture, calls = HFBackend.capture, []

    def slow_first(self, batch):
        calls.append(len(batch))
        if len(calls) == 1:
            time.sleep(0.6)
        return capture(self, batch)

    monkeypatch.setattr(HFBackend, "capture", slow_first)
    got = extract.run(_cfg(tiny_kimi, small_data, tmp_path / "s", 12), backend=backend, progress=False)
    times, tokens = [t for t, _ in got.batches], [n for _, n in got.batches]
    assert len(got.batches) == 3 and times == sorted(times) and sum(tokens) == got.tokens_written, got.batches
    assert all(n > 0 for n in tokens), got.batches
    want = (tokens[1] + tokens[2]) / (times[2] - times[0])
    assert got.sustained_tokens_per_s() == pytest.approx(want)
    assert got.sustained_tokens_per_s() > 1.5 * got.tokens_per_s, (got.sustained_tokens_per_s(), got.tokens_per_s)


def test_one_batch_has_no_window_and_gives_the_whole_run_s_rate(tiny_kimi, small_data, backend, tmp_path):
    got = extract.run(_cfg(tiny_kimi, small_data, tmp_path / "s", 4), backend=backend, progress=False)
    assert len(got.batches) == 1 and got.sustained_tokens_per_s() == got.tokens_per_s > 0, got


@settings(max_examples=100, deadline=None)
@given(
    points=st.lists(st.tuples(st.floats(0, 100, allow_nan=False), st.integers(0, 10**6)), max_size=6).map(
        lambda ps: sorted(ps)
    ),
    less=st.floats(0, 50, allow_nan=False),
)
def test_rate_past_first_is_its_definition_and_none_where_it_has_none(points, less):
    """The tokens of the points after the first over the span from the first to the last less the waits; None with
    fewer than two points, no span, or no time left once the waits are taken out."""
    from eagle3.extract.timeline import rate_past_first

    got = rate_past_first(points, less)
    if len(points) < 2 or points[-1][0] <= points[0][0] or points[-1][0] - points[0][0] - less <= 0:
        assert got is None
    else:
        assert got == pytest.approx(sum(n for _, n in points[1:]) / (points[-1][0] - points[0][0] - less))
