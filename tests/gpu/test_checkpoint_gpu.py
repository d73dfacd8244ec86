"""Checkpoints written in the background on CUDA (`--checkpoint-background`, on by default there; eagle3/train/
checkpoint.py Background): the snapshot is the host copies of the step it was taken at, though the next steps run on
the GPU while the thread writes it. tiny-kimi's store extracted on the CPU (hf backend), the draft trained on the
GPU; each write delayed 1 s; every checkpoint's weights and AdamW state equal, tensor for tensor, a copy of the
training tensors taken beside the snapshot (the CPU test compares against a synchronous run instead: two CUDA runs
need not agree bitwise). Seconds; in `pytest -m gpu`."""

import time

import pytest
import torch
from safetensors.torch import load_file

from eagle3.data import corpus
from eagle3.data.conversations import DataConfig
from eagle3.extract import extract
from eagle3.targets import presets, tiny
from eagle3.train import checkpoint
from eagle3.train.train import TrainConfig, train

pytestmark = pytest.mark.gpu
DEVICE = "cuda"  # the CPU runs the same with "cpu" (checkpoint_background on there by the config below)


def test_a_checkpoint_written_in_the_background_holds_its_step_s_state_on_cuda(tmp_path, monkeypatch):
    target = tiny.build_model(presets.from_name("tiny-kimi"), tmp_path / "tiny-kimi", seed=0)
    data = corpus.write_jsonl(tmp_path / "d.jsonl", corpus.generate(32, seed=7))
    extract.run(
        extract.ExtractConfig(
            model=str(target),
            out=str(tmp_path / "store"),
            data=DataConfig([str(data)], max_len=192),
            batch_size=8,
            shard_samples=8,
            writer_threads=0,
        ),
        progress=False,
    )
    taken, written = {}, []
    snapshot, write = checkpoint.snapshot, checkpoint.write

    def copying_snapshot(model, optimizer, state):
        snap = snapshot(model, optimizer, state)
        # beside it, copies of the training tensors themselves, at the same moment
        weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k in snap.weights}
        moments = {
            f"state.{i}.{n}": v.detach().cpu().clone()
            for i, st in optimizer.state_dict()["state"].items()
            for n, v in st.items()
            if isinstance(v, torch.Tensor)
        }
        taken[state["step"]] = (weights, moments)
        return snap

    def slow_write(out, step, snap, *a, **kw):
        time.sleep(1.0)
        written.append(step)
        return write(out, step, snap, *a, **kw)

    monkeypatch.setattr(checkpoint, "snapshot", copying_snapshot)
    monkeypatch.setattr(checkpoint, "write", slow_write)
    cfg = TrainConfig(
        store=str(tmp_path / "store"),
        out=str(tmp_path / "run"),
        device=DEVICE,
        draft_vocab_size=256,
        batch_samples=4,
        lr=3e-3,
        max_steps=6,
        checkpoint_every=2,
        keep_checkpoints=0,
        seed=0,
        checkpoint_background=True if DEVICE == "cpu" else None,
    )  # None: on by default on CUDA
    r = train(cfg, progress=False)
    assert r.steps == 6 and written == [2, 4, 6] and sorted(taken) == [2, 4, 6]
    for step, (weights, moments) in taken.items():
        folder = tmp_path / "run" / "checkpoints" / f"step-{step:07d}"
        model, opt = load_file(str(folder / "model.safetensors")), load_file(str(folder / "optimizer.safetensors"))
        assert model.keys() == weights.keys() and all(torch.equal(model[k], weights[k]) for k in weights), step
        assert all(torch.equal(opt[k], moments[k]) for k in moments), step


def test_ctrl_c_on_cuda_saves_the_finished_step_and_the_rerun_resumes_there(tmp_path):
    """`eagle3 train --device cuda` (background checkpoints on) stopped by SIGINT after step 2, before any timed
    checkpoint: it saves step 2 and exits 130; the rerun resumes at step 2 and follows the uninterrupted run's curve
    (within float noise: two CUDA runs need not agree bitwise)."""
    import json
    import os
    import subprocess
    import sys

    target = tiny.build_model(presets.from_name("tiny-kimi"), tmp_path / "tiny-kimi", seed=0)
    data = corpus.write_jsonl(tmp_path / "d.jsonl", corpus.generate(32, seed=7))
    extract.run(
        extract.ExtractConfig(
            model=str(target),
            out=str(tmp_path / "store"),
            data=DataConfig([str(data)], max_len=192),
            batch_size=8,
            shard_samples=8,
            writer_threads=0,
        ),
        progress=False,
    )

    def train_cmd(out, fault=None):
        env = {k: v for k, v in os.environ.items() if k != "EAGLE3_FAULT"}
        if fault:
            env["EAGLE3_FAULT"] = fault
        argv = [
            sys.executable,
            "-m",
            "eagle3.cli",
            "train",
            "--store",
            str(tmp_path / "store"),
            "--out",
            str(out),
            "--device",
            DEVICE,
            "--steps",
            "6",
            "--batch",
            "4",
            "--draft-vocab",
            "256",
        ]
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)

    def losses(out):
        return json.loads((out / "checkpoints" / "step-0000006" / "trainer_state.json").read_text())["losses"]

    whole = train_cmd(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    cut = train_cmd(tmp_path / "cut", fault="after_step:2:SIGINT")
    assert cut.returncode == 130, cut.stderr[-3000:]
    assert f"saved a checkpoint of step 2 in {tmp_path / 'cut'}" in cut.stderr.strip().splitlines()[-1]
    again = train_cmd(tmp_path / "cut")
    assert again.returncode == 0 and "resuming from step 2 of 6" in again.stderr, again.stderr[-3000:]
    assert losses(tmp_path / "cut") == pytest.approx(losses(tmp_path / "whole"), rel=1e-3)
