"""The trainer reads step s + 1's samples in a background thread while step s trains (eagle3/train/read_ahead.py):
on the H200 the Kimi-size trainer ran 3,352 tok/s alone against its steps' 18,685, reading between steps. Read ahead
must change nothing but the time: the same losses and weights bit for bit, the same error at the same step, the
same skipped samples; and the run says where its time went (TrainResult.phases)."""

import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from eagle3.store.folder import Store
from eagle3.train.read_ahead import ReadAhead
from eagle3.train.train import BadData, StoreSamples, train

from .test_train import _cfg as train_cfg


def _cfg(store, out, **kw):
    """test_train's configuration, in packs of up to 64 tokens, 5 steps."""
    return train_cfg(store, out, **{"max_steps": 5, "pack_tokens": 64, **kw})


def test_reading_ahead_trains_the_same_bits(small_store, tmp_path):
    on = train(_cfg(small_store, tmp_path / "on", max_steps=3), progress=False)
    off = train(_cfg(small_store, tmp_path / "off", max_steps=3, read_ahead=False), progress=False)
    assert on.losses == off.losses and on.tokens_seen == off.tokens_seen
    a, b = load_file(f"{on.draft}/model.safetensors"), load_file(f"{off.draft}/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _Gate(StoreSamples):
    """A store source that records which step's samples were asked for while which optimizer step ran."""

    def __init__(self, store, per_sample_s: float = 0.0):
        super().__init__(store, 0)
        self.asked, self.per_sample_s = [], per_sample_s
        self.second_step_asked = threading.Event()

    def get(self, i):
        time.sleep(self.per_sample_s)
        self.asked.append(i)
        if len(self.asked) > 4:  # a sample of the second step (batch 4)
            self.second_step_asked.set()
        return super().get(i)


def test_the_next_step_is_read_while_this_one_trains(small_store, tmp_path, monkeypatch):
    """The first optimizer step waits (up to 5 s) for the second step's samples to be asked for: they are, from the
    read-ahead thread, while it waits. Read in the loop between steps, they never would be."""
    src = _Gate(Store.open(small_store))
    seen, step = [], torch.optim.AdamW.step

    def gated(self, *a, **kw):
        if not seen:
            seen.append(src.second_step_asked.wait(5))
        return step(self, *a, **kw)

    monkeypatch.setattr(torch.optim.AdamW, "step", gated)
    train(_cfg(small_store, tmp_path / "t", max_steps=3), progress=False, source=src)
    assert seen == [True]


def test_the_run_says_where_its_time_went(small_store, tmp_path):
    """Reading that cannot hide behind a step (0.1 s a sample, read in the loop) is counted as reading, not as steps;
    the phases add up to the run's clock."""
    slow = _Gate(Store.open(small_store), per_sample_s=0.1)
    r = train(_cfg(small_store, tmp_path / "t", max_steps=3, read_ahead=False), progress=False, source=slow)
    p = r.phases
    assert set(p) == {"setup", "reading", "steps", "checkpoints"}
    assert p["reading"] >= 12 * 0.1 and p["steps"] < r.seconds - 1.0, p
    assert sum(p[k] for k in ("reading", "steps", "checkpoints")) == pytest.approx(r.seconds, abs=0.05)
    assert p["checkpoints"] > 0 and p["setup"] > 0
    assert any(line.startswith("time       ") and "reading" in line for line in r.lines())


def test_a_bad_sample_read_ahead_stops_at_its_own_step(small_store, tmp_path, monkeypatch):
    """A sample of step 3 that fails to read stops the run with its error after step 2 trained, as without read
    ahead: the error is raised where the step that needs it begins, not in the thread that read it."""
    calls = []
    get = StoreSamples.get

    def bad_at(self, i):
        calls.append(i)
        if len(calls) == 9:  # the first sample of step 3
            raise BadData(f"sample {i}: planted")
        return get(self, i)

    monkeypatch.setattr(StoreSamples, "get", bad_at)
    stepped, step = [], torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **kw: stepped.append(1) or step(self, *a, **kw))
    with pytest.raises(BadData, match="planted"):
        train(_cfg(small_store, tmp_path / "t"), progress=False)
    assert len(stepped) == 2 and not (tmp_path / "t" / "draft").exists()


class _SlowStart(StoreSamples):
    """A store source whose first step's samples (batch 4) take 0.25 s each to read."""

    def __init__(self, store):
        super().__init__(store, 0)
        self.reads = 0

    def get(self, i):
        self.reads += 1
        if self.reads <= 4:
            time.sleep(0.25)
        return super().get(i)


def test_the_sustained_rate_leaves_out_a_slow_start_and_the_final_checkpoint(small_store, tmp_path, monkeypatch):
    """TrainResult.timeline: each step's end (seconds since the first began, before any checkpoint) and its tokens;
    sustained_tokens_per_s(): the later half's tokens over the later half's time. A first step 1 s slow to read and a
    final checkpoint 1 s slow to write are in the run's rate, not in the sustained one (no comparison of the two
    rates: on a loaded machine the steps alone may take many seconds)."""
    from eagle3.train import checkpoint

    write = checkpoint.write
    monkeypatch.setattr(checkpoint, "write", lambda *a, **kw: time.sleep(1.0) or write(*a, **kw))
    r = train(_cfg(small_store, tmp_path / "t"), progress=False, source=_SlowStart(Store.open(small_store)))
    ends, tokens = [t for t, _ in r.timeline], [n for _, n in r.timeline]
    assert len(r.timeline) == r.steps == 5 and sum(tokens) == r.tokens_this_run, r.timeline
    assert ends[0] >= 1.0 and all(a < b for a, b in zip(ends, ends[1:])), ends
    assert ends[-1] <= r.seconds - 1.0, (ends, r.seconds)  # the last step ends before its checkpoint
    later = sum(tokens[2:]) / (ends[-1] - ends[1])  # steps 3-5 of 5: from step 2's end to step 5's
    assert r.sustained_tokens_per_s() == pytest.approx(later), (r.timeline, r.sustained_tokens_per_s())
    assert any(
        line.startswith("time ") and f"sustained {r.sustained_tokens_per_s():,.0f} tok/s" in line for line in r.lines()
    ), r.lines()


def test_a_step_out_of_order_gets_its_own_read_after_the_one_ahead_has_finished():
    """take(s) for another step than the one read ahead: that read finishes first (one reader at a time: a source is
    read by one thread, in order), then step s is read and handed over, never the other step's samples."""
    import threading
    import time

    active, overlaps, lock = [0], [], threading.Lock()

    def read(step):
        with lock:
            active[0] += 1
            overlaps.append(active[0] > 1)
        time.sleep(0.3 if step == 1 else 0.0)
        with lock:
            active[0] -= 1
        return f"samples of step {step}"

    ahead = ReadAhead(read)
    ahead.start(1)
    assert ahead.take(2) == "samples of step 2"
    assert overlaps == [False, False]
