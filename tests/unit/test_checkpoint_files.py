"""Every file of a checkpoint is checked before it is resumed from: one truncated by a byte, or changed in place
(same size), makes the checkpoint torn, and the one before it is taken. Each of the checkpoint's files in turn."""

from __future__ import annotations

import shutil

import pytest

from eagle3.train import checkpoint


@pytest.mark.parametrize("damage", ["truncated by one byte", "one byte changed"])
@pytest.mark.parametrize("name", checkpoint.CKPT_FILES + (checkpoint.FILES,))
def test_a_damaged_file_makes_the_checkpoint_torn(trained_run, tmp_path, name, damage):
    _, out = trained_run
    copy = tmp_path / "run"
    shutil.copytree(out / "checkpoints", copy / "checkpoints")
    newest = checkpoint.latest(copy)
    assert newest.name == "step-0000012" and checkpoint.complete(newest)
    path = newest / name
    data = bytearray(path.read_bytes())
    if damage == "truncated by one byte":
        data = data[:-1]
    else:
        i = len(data) // 2  # inside a tensor's bytes, or inside a JSON value
        data[i] = ord("7") if data[i] != ord("7") else ord("3")
    path.write_bytes(bytes(data))
    assert not checkpoint.complete(newest)
    assert checkpoint.latest(copy).name == "step-0000008"


def test_the_record_names_every_file_with_its_size_and_checksum(trained_run):
    import json

    _, out = trained_run
    ckpt = checkpoint.latest(out)
    rec = json.loads((ckpt / checkpoint.FILES).read_text())
    assert set(rec) == set(checkpoint.CKPT_FILES)
    for name, entry in rec.items():
        assert entry["bytes"] == (ckpt / name).stat().st_size and entry["checksum"].startswith("xxh3_128:")


@pytest.mark.parametrize("name", checkpoint.CKPT_FILES)
def test_a_record_that_leaves_a_file_out_makes_the_checkpoint_torn(trained_run, tmp_path, name):
    """files.json must name every file the checkpoint holds: one that leaves a file out vouches for less than the
    checkpoint that is resumed from."""
    import json

    _, out = trained_run
    copy = tmp_path / "run"
    shutil.copytree(out / "checkpoints", copy / "checkpoints")
    newest = checkpoint.latest(copy)
    rec = json.loads((newest / checkpoint.FILES).read_text())
    del rec[name]
    (newest / checkpoint.FILES).write_text(json.dumps(rec))
    assert not checkpoint.complete(newest) and not checkpoint.sizes_match(newest)
    assert checkpoint.latest(copy).name == "step-0000008"
