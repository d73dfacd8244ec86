"""Bad input and hostile conditions end in an error a person can act on, with nothing half-written."""

import errno
import json
import shutil

import pytest

from eagle3 import cli
from eagle3.data.conversations import DataConfig, DataError, load_samples
from eagle3.extract import extract
from eagle3.store import files as store_mod
from eagle3.store import verify
from eagle3.store.folder import Store
from eagle3.store.format import StoreError, StoreMismatch


def _extract_cfg(model, data, out, **kw):
    return extract.ExtractConfig(
        model=str(model),
        out=str(out),
        data=DataConfig([str(data)], max_len=128),
        batch_size=4,
        shard_samples=4,
        writer_threads=0,
        **kw,
    )


@pytest.mark.parametrize(
    "setup,match",
    [
        (lambda p: p, "file not found"),
        (lambda p: (p.mkdir(), p)[1], "is a directory"),
        (lambda p: (p.write_text(""), p)[1], "no conversations: 0 lines, 0 blank. Give JSONL files"),
        (lambda p: (p.write_text("\n\n  \n"), p)[1], "no conversations: 3 lines, 3 blank"),
    ],
)
def test_file_level_problems(tmp_path, tokenizer, setup, match):
    path = setup(tmp_path / "in.jsonl")
    with pytest.raises(DataError, match=match):
        load_samples(DataConfig([str(path)]), tokenizer)


def test_an_empty_file_does_not_point_to_a_rejects_file_that_is_not_there(tmp_path, tiny_kimi, capsys):
    """Issue 17: extract on an empty file said the rejected lines were in a rejects file it never wrote."""
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    code = cli.main(["extract", "--model", str(tiny_kimi), "--data", str(data), "--out", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert code == 2 and "the file is empty" in err and "rejects" not in err, err
    assert not (tmp_path / "s" / "rejects.jsonl").exists()


def test_when_every_line_is_rejected_the_message_names_the_rejects_file(tmp_path, tiny_kimi, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "Hi?"}\n')
    code = cli.main(["extract", "--model", str(tiny_kimi), "--data", str(data), "--out", str(tmp_path / "s")])
    err = capsys.readouterr().err
    rejects = tmp_path / "s" / "rejects.jsonl"
    assert code == 2 and f"each rejected line and its reason: {rejects}" in err, err
    assert json.loads(rejects.read_text())["reason"] == "invalid_json"


def test_two_inputs_with_one_name_would_collide(tmp_path, tokenizer, small_data):
    (tmp_path / "a").mkdir()
    shutil.copy(small_data, tmp_path / "a" / small_data.name)
    with pytest.raises(DataError, match="share this name"):
        load_samples(DataConfig([str(small_data), str(tmp_path / "a" / small_data.name)]), tokenizer)


def test_tokenizer_without_chat_template(tmp_path, tokenizer, small_data):
    tokenizer.save_pretrained(tmp_path / "tok")
    from transformers import AutoTokenizer

    bare = AutoTokenizer.from_pretrained(tmp_path / "tok")
    bare.chat_template = None
    with pytest.raises(DataError, match="tokenizer has no chat template.*chat_template"):
        load_samples(DataConfig([str(small_data)]), bare, tokenizer_where=str(tmp_path / "tok"))


@pytest.mark.parametrize(
    "ids,msg", [("2,4,4,8", "repeat"), ("2,4,9", "out of range"), ("2,4,5", "last layer id must be 8")]
)
def test_cli_refuses_bad_layer_ids_before_writing(tiny_kimi, small_data, tmp_path, capsys, ids, msg):
    out = tmp_path / "s"
    code = cli.main(
        ["extract", "--model", str(tiny_kimi), "--data", str(small_data), "--out", str(out), "--layer-ids", ids]
    )
    assert code == 2
    assert msg in capsys.readouterr().err
    assert not (out / "manifest.json").exists()


def test_disk_full_mid_extraction_then_resume_completes(tiny_kimi, small_data, tmp_path, monkeypatch):
    out = tmp_path / "s"
    calls = {"n": 0}
    real = store_mod.write_chunks

    def fill_up(f, chunks):
        calls["n"] += ".selfcheck" not in f.name  # the disk fills during the real run, after the self-check
        if calls["n"] > 9:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(f, chunks)

    monkeypatch.setattr(store_mod, "write_chunks", fill_up)
    with pytest.raises(StoreError, match="disk full"):
        extract.run(_extract_cfg(tiny_kimi, small_data, out), progress=False)
    assert not list(out.rglob(".tmp-*"))
    committed = Store.open(out).done_ids
    assert 0 < len(committed) < 48
    monkeypatch.setattr(store_mod, "write_chunks", real)
    summary = extract.run(_extract_cfg(tiny_kimi, small_data, out), progress=False)
    assert summary.samples_done_before == len(committed) and summary.samples_total == 48
    assert verify.verify(out).ok


def test_resume_with_other_options_is_refused(tiny_kimi, small_data, small_store, tmp_path):
    out = tmp_path / "s"
    shutil.copytree(small_store, out)
    with pytest.raises(StoreMismatch, match="layer_ids"):
        extract.run(_extract_cfg(tiny_kimi, small_data, out, layer_ids=(1, 4, 5, 8)), progress=False)
    with pytest.raises(StoreError, match="different sample list"):
        extract.run(
            extract.ExtractConfig(
                model=str(tiny_kimi), out=str(out), data=DataConfig([str(small_data)], max_len=128, max_samples=10)
            ),
            progress=False,
        )
    other = tmp_path / "other.jsonl"  # as many samples, under other ids
    shutil.copy(small_data, other)
    with pytest.raises(StoreError, match="different sample list"):
        extract.run(
            extract.ExtractConfig(model=str(tiny_kimi), out=str(out), data=DataConfig([str(other)], max_len=192)),
            progress=False,
        )


def test_a_backend_that_returns_fewer_states_than_samples_fails_the_run(tiny_kimi, small_data, tmp_path, monkeypatch):
    """A capture that silently loses a sample (fewer states than prompts) cannot end in a store that says done."""
    from eagle3.extract.hf_backend import HFBackend

    real = HFBackend.capture
    monkeypatch.setattr(HFBackend, "capture", lambda self, batch: real(self, batch)[:-1])
    with pytest.raises(StoreError, match=r"12 samples were not written"):
        extract.run(_extract_cfg(tiny_kimi, small_data, tmp_path / "s", selfcheck=0), progress=False)


def test_trainer_refuses_hidden_size_mismatch(small_store, tmp_path):
    from eagle3.train.train import TrainConfig, train

    out = tmp_path / "s"
    shutil.copytree(small_store, out)
    m = json.loads((out / "manifest.json").read_text())
    m["spec"]["hidden_size"] = 64
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreMismatch, match="hidden size 64 != target hidden size 128"):
        train(TrainConfig(store=str(out), out=str(tmp_path / "t"), max_steps=1, batch_samples=4), progress=False)


def test_store_files_are_never_unpickled(small_store):
    """Only safetensors and JSON live in a store."""
    suffixes = {p.suffix for p in small_store.rglob("*") if p.is_file()}
    assert suffixes <= {".json", ".safetensors", ".jsonl"}
