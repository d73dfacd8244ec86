"""`eagle3 verify` finds each planted corruption class; --fix quarantines and a resume repairs."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagle3 import cli
from eagle3.data.conversations import DataConfig
from eagle3.extract import extract
from eagle3.store import verify
from eagle3.store.files import atomic_write
from eagle3.store.format import safetensors_chunks


@pytest.fixture
def store(small_store, tmp_path):
    out = tmp_path / "store"
    shutil.copytree(small_store, out)
    return out


def _manifest(root):
    return json.loads((root / "manifest.json").read_text())


def _save_manifest(root, m):
    (root / "manifest.json").write_text(json.dumps(m))


def _rewrite(root, i, mutate, meta_mutate=None):
    """Rewrite shard i with mutate(tensors) and re-commit its checksum, as a buggy writer would have."""
    m = _manifest(root)
    path = root / m["shards"][i]["file"]
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    mutate(tensors)
    if meta_mutate:
        meta_mutate(meta)
    sha, n = atomic_write(path, safetensors_chunks(tensors, meta))
    m["shards"][i].update(checksum=sha, bytes=n)
    _save_manifest(root, m)


def _first_sample_rows(root, i=0):
    m = _manifest(root)
    with safe_open(str(root / m["shards"][i]["file"]), framework="pt") as f:
        off = f.get_tensor("offsets").tolist()
    return slice(off[0], off[1])


def _flip_byte(root):
    p = root / _manifest(root)["shards"][1]["file"]
    b = bytearray(p.read_bytes())
    b[-10] ^= 0xFF
    p.write_bytes(bytes(b))


def _truncate(root):
    p = root / _manifest(root)["shards"][1]["file"]
    p.write_bytes(p.read_bytes()[:-100])


def _delete(root):
    (root / _manifest(root)["shards"][1]["file"]).unlink()


def _garbage_header(root):
    m = _manifest(root)
    p = root / m["shards"][1]["file"]
    raw = b"\xff" * 64 + p.read_bytes()[64:]
    sha, n = atomic_write(p, [raw])
    m["shards"][1].update(checksum=sha, bytes=n)
    _save_manifest(root, m)


def _nan(root):
    rows = _first_sample_rows(root)
    _rewrite(root, 0, lambda t: t["hidden_states"][rows, 1].__setitem__((0, 3), float("nan")))


def _inf(root):
    rows = _first_sample_rows(root)
    _rewrite(root, 0, lambda t: t["hidden_states"][rows, 2].__setitem__((1, 1), float("inf")))


def _zero_layer(root):
    rows = _first_sample_rows(root)
    _rewrite(root, 0, lambda t: t["hidden_states"][rows, 2].zero_())


def _duplicate_layer(root):
    """What the reply[0] bug leaves: one layer's states stored under two ids."""
    rows = _first_sample_rows(root)
    _rewrite(root, 0, lambda t: t["hidden_states"][rows, 1].copy_(t["hidden_states"][rows, 0]))


def _wrong_ids(root):
    _rewrite(
        root,
        0,
        lambda t: None,
        lambda meta: meta.__setitem__("sample_ids", json.dumps(["x"] + json.loads(meta["sample_ids"])[1:])),
    )


def _wrong_layer_ids(root):
    _rewrite(root, 0, lambda t: None, lambda meta: meta.__setitem__("layer_ids", "[1, 4, 5, 8]"))


def _bad_offsets(root):
    _rewrite(root, 0, lambda t: t["offsets"].__setitem__(1, 10**6))


def _bad_dtype(root):
    def f(t):
        t["hidden_states"] = t["hidden_states"].float()

    _rewrite(root, 0, f)


def _bad_shape(root):
    def f(t):
        t["hidden_states"] = t["hidden_states"][:, :, :64].contiguous()

    _rewrite(root, 0, f)


def _repeat_sample(root):
    m = _manifest(root)
    m["shards"][2]["sample_ids"][0] = m["shards"][1]["sample_ids"][0]
    _save_manifest(root, m)


def _missing_sample(root):
    m = _manifest(root)
    dropped = m["shards"].pop(3)
    (root / dropped["file"]).unlink()
    _save_manifest(root, m)


def _stray_file(root):
    (root / "shards" / "shard-000999.safetensors").write_bytes(b"partial")


PLANTS = {
    "checksum_mismatch": _flip_byte,
    "size_mismatch": _truncate,
    "missing_file": _delete,
    "bad_header": _garbage_header,
    "nonfinite": _nan,
    "zero_layer": _zero_layer,
    "duplicate_layers": _duplicate_layer,
    "ids_mismatch": _wrong_ids,
    "layer_ids_mismatch": _wrong_layer_ids,
    "bad_offsets": _bad_offsets,
    "bad_dtype": _bad_dtype,
    "bad_shape": _bad_shape,
    "repeated_sample": _repeat_sample,
    "missing_sample": _missing_sample,
    "uncommitted_file": _stray_file,
}


def test_clean_store_verifies(small_store):
    rep = verify.verify(small_store)
    assert rep.ok and rep.samples == 48 and rep.shards == 6


@pytest.mark.parametrize("kind", sorted(PLANTS))
def test_each_corruption_class_is_found(store, kind):
    PLANTS[kind](store)
    rep = verify.verify(store)
    assert not rep.ok
    assert kind in rep.kinds(), rep.lines()


@pytest.mark.parametrize("edit", ["past_the_end", "short_of_the_end", "empty_sample"])
def test_offsets_that_do_not_cut_the_shard_into_its_samples_are_found(store, edit):
    """Offsets must run from 0 to the shard's token count, rising strictly: a last sample cut short (rows nobody
    reads) or an empty sample is as wrong as an offset past the end."""

    def f(t):
        o = t["offsets"]
        if edit == "past_the_end":
            o[1] = 10**6
        elif edit == "short_of_the_end":
            o[-1] -= 1
        else:
            o[2] = o[1]

    _rewrite(store, 0, f)
    assert set(verify.verify(store).kinds()) == {"bad_offsets"}


def test_fix_keeps_a_repeated_sample_s_first_shard_and_quarantines_the_later_one(store):
    _repeat_sample(store)  # shard 2 claims a sample of shard 1
    m = _manifest(store)
    first, later = m["shards"][1]["file"], m["shards"][2]["file"]
    assert verify.fix(store, verify.verify(store)) == [later]
    assert first in {s["file"] for s in _manifest(store)["shards"]} and (store / first).exists()


def test_infinity_is_found_too(store):
    _inf(store)
    assert set(verify.verify(store).kinds()) == {"nonfinite"}


def test_fix_quarantines_and_a_resume_redoes_exactly_those_samples(store, tiny_kimi, small_data, capsys):
    reference = {
        s["sample_id"]: s["states"][4].clone()
        for s in __import__("eagle3.store.folder", fromlist=["Store"]).Store.open(store).iter_samples()
    }
    _duplicate_layer(store)
    _flip_byte(store)
    assert cli.main(["verify", str(store), "--fix"]) == 1
    out = capsys.readouterr().out
    assert "duplicate_layers" in out and "quarantined 2 shard(s)" in out
    assert len(list((store / "quarantine").iterdir())) == 2
    summary = extract.run(
        extract.ExtractConfig(
            model=str(tiny_kimi),
            out=str(store),
            shard_samples=8,
            data=DataConfig([str(small_data)], max_len=192),
            writer_threads=0,
        ),
        progress=False,
    )
    assert summary.samples_written == 16
    assert cli.main(["verify", str(store)]) == 0
    from eagle3.store.folder import Store

    again = {s["sample_id"]: s["states"][4] for s in Store.open(store).iter_samples()}
    assert again.keys() == reference.keys()
    for sid, t in reference.items():
        assert torch.equal(again[sid], t), sid


def _drop_shards(root, n):
    """The first n shards lost: files gone and out of the manifest."""
    m = _manifest(root)
    for shard in m["shards"][:n]:
        (root / shard["file"]).unlink()
    m["shards"] = m["shards"][n:]
    _save_manifest(root, m)


def test_verify_counts_exactly_and_ends_with_the_command_that_repairs(tiny_kimi, small_data, tmp_path, capsys):
    """Issue 17: after damage, verify's head counts every missing sample (it printed 50 lines and '51 findings'
    for 64), shows at most 20 lines per kind, and ends with the one command that repairs; that command, run as
    printed, restores the store with the options it was made with (non-default here)."""
    import shlex

    out = tmp_path / "s"
    made = [
        "extract",
        "--model",
        str(tiny_kimi),
        "--data",
        str(small_data),
        "--out",
        str(out),
        "--max-len",
        "160",
        "--shard-samples",
        "4",
        "--batch-size",
        "4",
        "--no-selfcheck",
    ]
    assert cli.main(made) == 0
    capsys.readouterr()
    from eagle3.store.folder import Store

    reference = {s["sample_id"]: s["states"][8].clone() for s in Store.open(out).iter_samples()}
    _drop_shards(out, 6)  # 24 samples in no shard
    _flip_byte(out)  # and one damaged shard of 4
    assert cli.main(["verify", str(out)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert '25 findings {"checksum_mismatch": 1, "missing_sample": 24}' in lines[0]
    assert sum("missing_sample" in x and "planned" in x for x in lines) == 20
    assert any("... and 4 more missing_sample" in x for x in lines)
    assert lines[-1] == (
        f"repair: eagle3 verify {out} --fix (quarantines 1 shard(s) holding 4 samples), then "
        f"eagle3 extract --resume {out} (extracts them and the 24 missing)"
    )
    assert cli.main(["verify", str(out), "--fix"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == f"now 28 planned samples are missing; repair: eagle3 extract --resume {out}"
    command = shlex.split(lines[-1].split("repair: ")[1])
    assert cli.main(command[1:]) == 0
    assert "resuming: eagle3 extract --model" in capsys.readouterr().err
    assert cli.main(["verify", str(out)]) == 0
    again = {s["sample_id"]: s for s in Store.open(out).iter_samples()}
    assert again.keys() == reference.keys()
    assert all(torch.equal(again[k]["states"][8], t) for k, t in reference.items())
    assert max(len(s["input_ids"]) for s in again.values()) <= 160  # the recorded --max-len
    assert max(len(s["sample_ids"]) for s in _manifest(out)["shards"]) == 4  # the recorded --shard-samples


def test_resume_refuses_what_would_change_the_store_and_stores_without_a_record(small_store, tiny_kimi, capsys):
    assert cli.main(["extract", "--resume", str(small_store)]) == 2
    assert "did not record the command" in capsys.readouterr().err
    assert cli.main(["extract", "--out", str(small_store)]) == 2
    assert "extract needs --model, --data" in capsys.readouterr().err


def test_resume_allows_runtime_options_only(tiny_kimi, small_data, tmp_path, capsys):
    out = tmp_path / "s"
    assert (
        cli.main(
            [
                "extract",
                "--model",
                str(tiny_kimi),
                "--data",
                str(small_data),
                "--out",
                str(out),
                "--max-samples",
                "6",
                "--no-selfcheck",
            ]
        )
        == 0
    )
    assert cli.main(["extract", "--resume", str(out), "--max-len", "64"]) == 2
    assert "--max-len would change what is stored" in capsys.readouterr().err
    assert cli.main(["extract", "--resume", str(out), "--batch-size", "2"]) == 0  # nothing left: a no-op
    assert "6 already there" in capsys.readouterr().out


def test_resume_takes_the_recorded_options_and_the_runtime_ones_given_now(tiny_kimi, small_data, tmp_path, capsys):
    out = tmp_path / "s"
    assert (
        cli.main(
            [
                "extract",
                "--model",
                str(tiny_kimi),
                "--data",
                str(small_data),
                "--out",
                str(out),
                "--max-samples",
                "6",
                "--no-selfcheck",
                "--batch-size",
                "3",
                "--layer-ids",
                "1,4,5,8",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert cli.main(["extract", "--resume", str(out), "--batch-size", "2"]) == 0
    resumed = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("resuming: "))
    assert "--batch-size 2" in resumed and "--layer-ids 1,4,5,8" in resumed and "--max-samples 6" in resumed
    assert cli.main(["extract", "--resume", str(out), "--out", str(tmp_path / "other")]) == 2
    assert "give one of them" in capsys.readouterr().err and not (tmp_path / "other").exists()


def test_shards_are_checksummed_with_xxh3_and_stores_that_recorded_sha256_still_verify(store):
    """Issue 14: sha256 (~1.3 GB/s a core) was the writers' bottleneck; xxh3_128 (~12 GB/s, GIL released) is
    what a shard records now. A store written before records a bare "sha256" per shard: still checked."""
    import hashlib

    m = _manifest(store)
    assert all(s["checksum"].startswith("xxh3_128:") and "sha256" not in s for s in m["shards"])
    for s in m["shards"]:
        del s["checksum"]
        s["sha256"] = hashlib.sha256((store / s["file"]).read_bytes()).hexdigest()
    _save_manifest(store, m)
    assert verify.verify(store).ok
    _flip_byte(store)
    assert set(verify.verify(store).kinds()) == {"checksum_mismatch"}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_stores_of_every_state_dtype_verify(tiny_kimi, small_data, tmp_path, dtype):
    """verify reads the dtype name from the format's own table (bf16 and fp8 are covered elsewhere)."""
    out = tmp_path / "s"
    extract.run(
        extract.ExtractConfig(
            model=str(tiny_kimi),
            out=str(out),
            dtype=dtype,
            selfcheck=0,
            writer_threads=0,
            data=DataConfig([str(small_data)], max_len=96, max_samples=6),
        ),
        progress=False,
    )
    rep = verify.verify(out)
    assert rep.ok and rep.samples == 6, rep.lines()
