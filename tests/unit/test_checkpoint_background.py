"""Checkpoints written in a thread while training goes on (TrainConfig.checkpoint_background; `train
--checkpoint-background`; on by default on CUDA only).

At Kimi-K2.5's draft size a checkpoint is 12 GB (float32 weights and AdamW state): 22-24 s to copy, write, hash and
fsync on the H200 (results/2026-12-05-09b8a53-h200-vllm0.26.0, the final checkpoint with its export), every 10
minutes by default, the GPU idle meanwhile. In the background the training thread takes only the snapshot (the host
copies), between optimizer steps; the thread writes it as a synchronous save would, one save in flight at most.
Each test delays the thread's write, so the steps after a checkpoint run while it is written."""

import json
import os
import time

import pytest
import torch
from safetensors.torch import load_file

from eagle3 import cli
from eagle3.train import checkpoint
from eagle3.train.train import TrainConfig, TrainingDiverged, checkpoint_background, train

from .conftest import run_forked
from .test_train import _cfg


def _held_writes(monkeypatch, hold) -> list[tuple[float, float, int]]:
    """checkpoint.write held by ``hold(step, start)`` before it writes; returns the list of each write's (start, end,
    step). Asserts that no snapshot is taken while a write runs (a snapshot, 12 GB at Kimi-K2.5's draft size, is
    held until it is written: one at a time), so no two writes run at once either."""
    real, spans, active = checkpoint.write, [], []
    take = checkpoint.snapshot

    def snapshot(*a, **kw):
        assert not active, f"a snapshot taken while step {active}'s checkpoint is written"
        return take(*a, **kw)

    monkeypatch.setattr(checkpoint, "snapshot", snapshot)

    def held(out, step, snap, *a, **kw):
        assert not active, f"step {step}'s checkpoint written while step {active}'s still is"
        active.append(step)
        t0 = time.perf_counter()
        try:
            hold(step, t0)
            path = real(out, step, snap, *a, **kw)
        finally:
            active.remove(step)
        spans.append((t0, time.perf_counter(), step))
        return path

    monkeypatch.setattr(checkpoint, "write", held)
    return spans


def _slow_writes(monkeypatch, seconds: float) -> list[tuple[float, float, int]]:
    """checkpoint.write delayed by ``seconds`` (_held_writes)."""
    return _held_writes(monkeypatch, lambda step, t0: time.sleep(seconds))


def _writes_waiting_for_a_step(monkeypatch, last: int, timeout: float = 30.0) -> list[tuple[float, float, int]]:
    """checkpoint.write held, for each step before ``last``, until a training step has ended after it began (or
    ``timeout`` s, which only a write that blocks training reaches): events, not a sleep a slow machine outlasts."""
    import threading

    from eagle3.train.train import StoreSamples

    ended, cond = [], threading.Condition()
    progress = StoreSamples.progress

    def counted(self):  # called once a step, after the step's optimizer update
        with cond:
            ended.append(time.perf_counter())
            cond.notify_all()
        return progress(self)

    def hold(step, t0):
        if step < last:
            with cond:
                cond.wait_for(lambda: any(e > t0 for e in ended), timeout)

    monkeypatch.setattr(StoreSamples, "progress", counted)
    return _held_writes(monkeypatch, hold)


def test_a_checkpoint_is_written_while_the_next_steps_train(small_store, tmp_path, monkeypatch):
    """At 962a6d4 this slept 1 s in the write and expected a step to end meanwhile: on a loaded two-core machine a
    step took longer. The write now waits for a step to end (the bug, a write that blocks training, times out)."""
    spans = _writes_waiting_for_a_step(monkeypatch, last=6)
    r = train(
        _cfg(small_store, tmp_path / "bg", max_steps=6, checkpoint_every=2, checkpoint_background=True), progress=False
    )
    ends = [r.started_at + t for t, _ in r.timeline]
    during = [(step, sum(a < e < b for e in ends)) for a, b, step in spans]
    assert [s for s, _ in during] == [2, 4, 6], spans
    assert all(n >= 1 for s, n in during if s < 6), during  # steps ended while steps 2's and 4's were written
    assert during[-1][1] == 0  # the last one's: written before the run returns, nothing after it
    saved = sorted(p.name for p in (tmp_path / "bg" / "checkpoints").glob("step-*"))
    assert saved == ["step-0000002", "step-0000004", "step-0000006"], saved
    assert all(checkpoint.complete(tmp_path / "bg" / "checkpoints" / s) for s in saved)
    assert (tmp_path / "bg" / "draft" / "model.safetensors").is_file()


def test_a_checkpoint_written_in_the_background_holds_its_step_s_state(small_store, tmp_path, monkeypatch, one_thread):
    """The snapshot is a copy: on the CPU `.cpu()` returns the training tensors themselves, which the next steps
    change in place while the thread writes. Each checkpoint equals, tensor for tensor, a synchronous run's."""
    kw = dict(max_steps=6, checkpoint_every=2, keep_checkpoints=0)
    train(_cfg(small_store, tmp_path / "sync", checkpoint_background=False, **kw), progress=False)
    _slow_writes(monkeypatch, 0.5)
    train(_cfg(small_store, tmp_path / "bg", checkpoint_background=True, **kw), progress=False)
    for step in ("step-0000002", "step-0000004", "step-0000006"):
        a, b = tmp_path / "sync" / "checkpoints" / step, tmp_path / "bg" / "checkpoints" / step
        for f in ("model.safetensors", "optimizer.safetensors"):
            x, y = load_file(str(a / f)), load_file(str(b / f))
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), (step, f)
        x, y = (json.loads((c / "trainer_state.json").read_text()) for c in (a, b))
        assert x["config"].pop("out").endswith("sync") and y["config"].pop("out").endswith("bg")
        assert (x["config"].pop("checkpoint_background"), y["config"].pop("checkpoint_background")) == (False, True)
        assert x == y, step
        assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())


def test_a_kill_during_a_background_write_resumes_to_the_uninterrupted_run(small_store, tmp_path, one_thread):
    ref = train(_cfg(small_store, tmp_path / "ref", max_steps=7), progress=False).losses
    cfg = _cfg(
        small_store, tmp_path / "t", max_steps=7, checkpoint_every=2, keep_checkpoints=0, checkpoint_background=True
    )

    def killed_run():
        os.environ["EAGLE3_FAULT"] = "mid_checkpoint:2"  # in the thread writing step 4's checkpoint
        train(cfg, progress=False)

    killed, _ = run_forked(killed_run)
    assert killed
    assert checkpoint.latest(tmp_path / "t").name == "step-0000002"
    resumed = train(cfg, progress=False)
    assert resumed.resumed_from == 2 and resumed.losses == ref


def test_a_failed_background_write_stops_the_run_with_its_error(small_store, tmp_path, monkeypatch):
    real, calls = checkpoint.write, []

    def full_disk(out, step, snap, *a, **kw):
        calls.append(step)
        if step == 4:
            raise OSError(28, "No space left on device")
        return real(out, step, snap, *a, **kw)

    monkeypatch.setattr(checkpoint, "write", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        train(
            _cfg(small_store, tmp_path / "t", max_steps=8, checkpoint_every=2, checkpoint_background=True),
            progress=False,
        )
    assert 4 in calls and 8 not in calls  # raised at the next checkpoint (step 6's), before another write
    assert not (tmp_path / "t" / "draft").exists()
    assert checkpoint.latest(tmp_path / "t").name == "step-0000002"


def test_a_run_that_stops_waits_for_its_checkpoint_being_written(small_store, tmp_path, monkeypatch):
    """lr 1e30: step 2's loss is NaN; the run stops while step 1's checkpoint is still written (delayed 1 s). It
    waits for it: what was checkpointed before the divergence is there, whole."""
    _slow_writes(monkeypatch, 1.0)
    with pytest.raises(TrainingDiverged, match="step 2: the loss is nan"):
        train(
            _cfg(small_store, tmp_path / "t", lr=1e30, max_steps=4, checkpoint_every=1, checkpoint_background=True),
            progress=False,
        )
    assert [p.name for p in (tmp_path / "t" / "checkpoints").glob("step-*")] == ["step-0000001"]
    assert checkpoint.complete(tmp_path / "t" / "checkpoints" / "step-0000001")


@pytest.mark.parametrize(
    "device,given,want",
    [("cpu", None, False), ("cuda", None, True), ("cuda:1", None, True), ("cuda", False, False), ("cpu", True, True)],
)
def test_checkpoints_are_written_in_the_background_by_default_on_cuda_only(device, given, want):
    assert checkpoint_background(TrainConfig(store="s", out="o", device=device, checkpoint_background=given)) is want


@pytest.mark.parametrize(
    "flag,want",
    [
        ([], None),
        (["--checkpoint-background", "on"], True),
        (["--checkpoint-background", "off"], False),
        (["--checkpoint-background", "auto"], None),
    ],
)
def test_cli_checkpoint_background(flag, want):
    a = cli.build_parser().parse_args(["train", "--store", "s", "--out", "o", *flag])
    assert cli._train_config(a).checkpoint_background is want


def test_when_the_loop_fails_while_a_background_write_fails_the_loop_s_error_is_raised_and_the_write_s_logged(
    small_store, tmp_path, monkeypatch, caplog
):
    """lr 1e30: step 2 diverges while step 1's checkpoint fails to write (a full disk): the user sees why training
    stopped (the loop's error), with the write's beside it in the log, not one in place of the other."""
    import logging

    def full_disk(out, step, snap, *a, **kw):
        time.sleep(0.5)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "write", full_disk)
    with caplog.at_level(logging.ERROR), pytest.raises(TrainingDiverged, match="step 2: the loss is nan"):
        train(
            _cfg(small_store, tmp_path / "t", lr=1e30, max_steps=4, checkpoint_every=1, checkpoint_background=True),
            progress=False,
        )
    assert (
        "the checkpoint written in the background failed too: OSError: [Errno 28] No space left on device"
        in caplog.text
    ), caplog.text
