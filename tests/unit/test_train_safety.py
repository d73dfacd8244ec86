"""Nothing silent in training (issue 13): bad stored data stops the run (or is skipped and counted when asked),
a non-finite loss stops it before the optimizer step, checkpoints are on by default and a kill -9 resumes to
the same loss curve, the newest complete checkpoint wins and a torn one is skipped."""

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3 import cli
from eagle3.train import checkpoint
from eagle3.train import train as train_mod
from eagle3.train.train import BadData, TrainConfig, TrainingDiverged, train

from .conftest import NARROW_DRAFT_ARGS, TRAINED_RUN, rewrite_shards, run_forked
from .test_train import _cfg


def _rewrite_sample(
    store, shard_no: int, sample_no: int, value: float, rehash: bool, layer: int = 0, row: int = 0
) -> str:
    """Put ``value`` into one sample's states (one row of one layer: by default layer 0, the first row); re-hash the
    shard in the manifest or not. Returns the sample id."""
    sid = []

    def edit(n, t, meta):
        if n != shard_no:
            return False
        t["hidden_states"][t["offsets"][sample_no] + row, layer, :] = value
        sid.append(json.loads(meta["sample_ids"])[sample_no])

    rewrite_shards(store, edit, rehash)
    return sid[0]


@pytest.fixture
def store_copy(small_store, tmp_path):
    out = tmp_path / "store"
    shutil.copytree(small_store, out)
    return out


def _cli_train(store, out, *extra):
    return cli.main(
        [
            "train",
            "--store",
            str(store),
            "--out",
            str(out),
            "--draft-vocab",
            "256",
            "--batch",
            "4",
            "--epochs",
            "1",
            *NARROW_DRAFT_ARGS,
            *extra,
        ]
    )


def test_a_nan_in_one_sample_stops_training_naming_it_and_writes_no_draft(store_copy, tmp_path, capsys):
    sid = _rewrite_sample(store_copy, 2, 1, float("nan"), rehash=True)  # verify --quick would pass
    code = _cli_train(store_copy, tmp_path / "t")
    err = capsys.readouterr().err
    assert code == 2, err
    assert "NaN/Inf" in err and sid in err and "shards/shard-000002" in err and str(store_copy) in err
    assert "eagle3 verify --fix" in err
    assert not (tmp_path / "t" / "draft").exists()


def test_flipped_bytes_stop_training_with_the_checksum(store_copy, tmp_path, capsys):
    path = store_copy / json.loads((store_copy / "manifest.json").read_text())["shards"][1]["file"]
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x40  # a bit in the last sample's states: the file still parses
    path.write_bytes(bytes(data))
    code = _cli_train(store_copy, tmp_path / "t")
    err = capsys.readouterr().err
    assert code == 2 and "checksum differs" in err and "shards/shard-000001" in err, err
    assert not (tmp_path / "t" / "draft").exists()


@pytest.mark.parametrize("layer,row", [(0, 0), (-1, 1)])  # the first aux layer; the last layer, a loss target
def test_bad_samples_can_be_skipped_and_are_counted(store_copy, tmp_path, layer, row):
    sid = _rewrite_sample(store_copy, 0, 0, float("inf"), rehash=True, layer=layer, row=row)
    result = train(_cfg(store_copy, tmp_path / "t", epochs=1, on_bad_sample="skip"), progress=False)
    assert list(result.skipped) == [sid] and "NaN/Inf" in result.skipped[sid]
    assert any(line.startswith("skipped    1 bad samples") for line in result.lines())
    w = load_file(f"{result.draft}/model.safetensors")
    assert all(torch.isfinite(t).all() for t in w.values() if t.is_floating_point())


def test_a_diverging_run_stops_at_the_non_finite_loss_before_the_step(small_store, tmp_path):
    """lr 1e30: step 1 blows the weights up, step 2's loss is NaN. The run names the step and its samples and
    stops before the optimizer step; what was checkpointed before is finite and nothing is published."""
    with pytest.raises(TrainingDiverged, match=r"step 2: the loss is nan on samples \['small.jsonl:\d+'\]"):
        train(_cfg(small_store, tmp_path / "t", lr=1e30, max_steps=4, checkpoint_every=1), progress=False)
    assert not (tmp_path / "t" / "draft").exists()
    ckpts = list((tmp_path / "t" / "checkpoints").glob("step-*"))
    assert [p.name for p in ckpts] == ["step-0000001"]


def test_publish_refuses_nonfinite_weights(trained_run, tmp_path):
    result, out = trained_run
    ckpt = tmp_path / "ckpt"
    shutil.copytree(out / "checkpoints" / "step-0000012", ckpt)
    w = load_file(str(ckpt / "model.safetensors"))
    w["fc.weight"][0, 0] = float("nan")
    from safetensors.torch import save_file

    save_file(w, str(ckpt / "model.safetensors"))
    with pytest.raises(checkpoint.NonFiniteWeights, match="fc.weight"):
        checkpoint.publish(ckpt, tmp_path / "o")
    assert not (tmp_path / "o" / "draft").exists()


class FakeClock:
    """Four minutes of work per optimizer step: the default (every 10 minutes) checkpoints every 3rd step."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 120.0  # read twice per step (check + after a save)
        return self.t


def _default_train_killed(cfg, k):
    train_mod._clock = FakeClock()
    os.environ["EAGLE3_FAULT"] = f"after_step:{k}"
    train(cfg, progress=False)


def test_default_options_checkpoint_by_time_and_a_kill_resumes_to_the_same_curve(
    small_store, tmp_path, one_thread, monkeypatch, caplog
):
    cfg = _cfg(small_store, tmp_path / "killed", max_steps=8)  # no checkpoint option given
    assert (cfg.checkpoint_every, cfg.checkpoint_minutes, cfg.resume) == (0, 10.0, True)
    monkeypatch.setattr(train_mod, "_clock", FakeClock())
    ref = train(_cfg(small_store, tmp_path / "ref", max_steps=8), progress=False).losses
    killed, _ = run_forked(lambda: _default_train_killed(cfg, 7))
    assert killed
    saved = sorted(p.name for p in (tmp_path / "killed" / "checkpoints").glob("step-*"))
    assert saved and saved[-1] < "step-0000007", saved
    monkeypatch.setattr(train_mod, "_clock", FakeClock())
    with caplog.at_level(logging.WARNING, logger="eagle3.train.train"):
        resumed = train(cfg, progress=False)
    n = int(saved[-1].split("-")[1])
    assert f"resuming from step {n} of 8" in caplog.text
    assert resumed.resumed_from == n and resumed.losses == ref
    # the rate is this run's: tokens of steps n+1..8 over this run's time, not every token since step 1
    assert 0 < resumed.tokens_this_run < resumed.tokens_seen
    assert resumed.tokens_per_s == pytest.approx(resumed.tokens_this_run / resumed.seconds)


def test_resume_takes_the_newest_complete_checkpoint_and_skips_a_torn_one(small_store, tmp_path, one_thread):
    ref = train(_cfg(small_store, tmp_path / "ref", max_steps=7), progress=False).losses
    out = tmp_path / "t"
    killed, _ = run_forked(
        lambda: (
            os.environ.__setitem__("EAGLE3_FAULT", "after_step:7"),
            train(_cfg(small_store, out, max_steps=7, checkpoint_every=2, keep_checkpoints=0), progress=False),
        )
    )
    assert killed
    ckpts = sorted((out / "checkpoints").glob("step-*"))
    assert [p.name for p in ckpts] == ["step-0000002", "step-0000004", "step-0000006"]
    m = ckpts[-1] / "model.safetensors"
    m.write_bytes(m.read_bytes()[:-64])  # torn: shorter than its header says
    assert checkpoint.latest(out) == ckpts[1]
    resumed = train(_cfg(small_store, out, max_steps=7, checkpoint_every=2, keep_checkpoints=0), progress=False)
    assert resumed.resumed_from == 4 and resumed.losses == ref


def test_only_the_newest_checkpoints_are_kept(small_store, tmp_path):
    out = tmp_path / "t"
    train(_cfg(small_store, out, max_steps=6, checkpoint_every=1, keep_checkpoints=2), progress=False)
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-0000005", "step-0000006"]


def test_a_checkpoint_is_hashed_once_when_saved_not_again_at_each_rotation(small_store, tmp_path, monkeypatch):
    """Rotating checkpoints (keep_checkpoints) hashed every file of every kept checkpoint again at each save: at
    Kimi-K2.5's draft size 12 GB a checkpoint, 36-48 GB read at every save (keep 3). A save hashes its own files
    (files.json); rotation checks the others' files by size; a resume (latest) still checks every checksum."""
    from eagle3.store import files

    hashed = []
    real = files.file_checksum

    def counting(path, *a, **kw):
        hashed.append(str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(files, "file_checksum", counting)
    out = tmp_path / "t"
    train(_cfg(small_store, out, max_steps=6, checkpoint_every=1, keep_checkpoints=2), progress=False)
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-0000005", "step-0000006"]
    ckpt_hashes = [h for h in hashed if "/checkpoints/" in h]
    assert len(ckpt_hashes) == 6 * len(checkpoint.CKPT_FILES), ckpt_hashes  # each save's files, once
    # a newer checkpoint cut short is not counted as one of the kept: the older stays
    newest = out / "checkpoints" / "step-0000006" / "optimizer.safetensors"
    newest.write_bytes(newest.read_bytes()[:-8])
    checkpoint.prune(out, 1)
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-0000005", "step-0000006"]
    assert checkpoint.latest(out).name == "step-0000005"


def test_a_checkpoint_s_files_are_fsynced_once_when_saved_not_again_at_each_save(small_store, tmp_path, monkeypatch):
    """After each rename every file of every kept checkpoint was fsynced again (the rename needs only the folder's):
    clean files, so cheap, but an open and fsync per file per save. Each file now once, while still .tmp-step-N,
    and the checkpoints folder after each rename (what makes the rename itself durable)."""
    real, synced = os.fsync, []

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "t"
    train(_cfg(small_store, out, max_steps=4, checkpoint_every=1, keep_checkpoints=3), progress=False)
    root = out / "checkpoints"
    files = [p for p in synced if p.startswith(str(root) + "/") and Path(p).parent != root]
    per_save = [p for p in files if "/.tmp-step-" in p]
    assert len(set(per_save)) == len(per_save)  # each once
    for step in (2, 3, 4):  # the kept ones: every file of each was fsynced before its rename
        names = {p.name for p in (root / f"step-{step:07d}").iterdir()}
        assert names == {Path(p).name for p in per_save if f"/.tmp-step-{step:07d}/" in p}, step
    assert files == per_save, sorted(set(files) - set(per_save))  # nothing fsynced again under its final name
    assert synced.count(str(root)) >= 4  # the folder, after each rename


def test_a_rerun_of_a_finished_run_says_so(trained_run, small_store):
    result, out = trained_run
    again = train(TrainConfig(store=str(small_store), out=str(out), **TRAINED_RUN), progress=False)
    text = "\n".join(again.lines())
    assert "already trained: nothing to do" in text and "tok/s" not in text
    assert again.accept == result.accept and again.accept


def test_bad_data_error_is_a_store_error_for_the_cli():
    from eagle3.store.format import StoreError

    assert issubclass(BadData, StoreError)


def test_the_step_s_one_read_gives_each_pack_its_loss_and_acceptance(small_store, tmp_path, monkeypatch):
    """A step reads its packs' losses, the gradient norm and the acceptance counts from the device in one go
    (train.py: a read per pack held the host until that pack's work was done). Each pack's values must land where
    they did: the step's loss is its packs' losses weighted by their samples, the run's acceptance the summed counts
    of every pack, as the draft returned them (recorded here, pack by pack, for 3 steps of 2 packs or more)."""
    losses, accepts, sizes = [], [], []
    real_build, real_read = train_mod.build_draft, train_mod.read_packs

    def recording_build(*a, **k):
        model = real_build(*a, **k)
        forward = model.forward

        def recorded(**kw):
            out = forward(**kw)
            losses.append(float(out[1].detach()))
            accepts.append({k: float(v) for k, v in out[2].items() if k.startswith("full_acc_")})
            return out

        model.forward = recorded
        return model

    def recording_read(*a, **k):
        packs = real_read(*a, **k)
        sizes.append([len(ids) for ids, _ in packs])  # steps are read in order (the read-ahead: one at a time)
        return packs

    monkeypatch.setattr(train_mod, "build_draft", recording_build)
    monkeypatch.setattr(train_mod, "read_packs", recording_read)
    cfg = _cfg(small_store, tmp_path / "t", max_steps=3, batch_samples=8, pack_tokens=256, ttt_steps=3)
    result = train(cfg, progress=False)  # three TTT steps: an acceptance count each
    assert len(sizes) == 3 and all(len(s) >= 2 for s in sizes), sizes  # else the test shows nothing
    at = 0
    for step, packs in enumerate(sizes):
        mine = losses[at : at + len(packs)]
        at += len(packs)
        assert result.losses[step] == pytest.approx(sum(x * n for x, n in zip(mine, packs)) / 8, rel=1e-12), step
    assert at == len(losses)
    sums: dict[str, float] = {}
    for acc in accepts:
        for name, v in acc.items():
            sums[name] = sums.get(name, 0.0) + v
    assert sums and result.accept == pytest.approx(train_mod._acceptance(sums), rel=1e-12), (result.accept, sums)
