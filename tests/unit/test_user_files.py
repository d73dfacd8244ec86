"""The user's files: no command removes, replaces or writes over a file it did not create.

Each writing command is pointed at a folder of random user files and folders, named with every name the project
itself writes (and some others), with random contents: it refuses with exit 2, naming what it found, and every user
file is byte-identical after. A command writes beside a user's files only into a new folder of its own."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st

from eagle3 import cli, ownership

# names eagle3 writes somewhere (stores, runs, drafts, checkpoints, reports, targets, temp files), and a few of the
# user's
NAMES = [
    ".tmp-mywork",
    ".tmp-manifest.json",
    ".tmp-draft",
    ".tmp-step-0000001",
    "lock.json",
    "plan.json",
    "manifest.json",
    "rejects.jsonl",
    "online.json",
    "shards",
    "quarantine",
    ".selfcheck",
    "draft",
    ".old-draft",
    "checkpoints",
    "step-0000004",
    "spool",
    "model",
    "store",
    "train",
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "eagle3_target.json",
    ".eagle3-build",
    "eval.json",
    "eval.md",
    "throughput.md",
    "throughput.png",
    "shard-000000.safetensors",
    ownership.MARK,
    "notes.txt",
    "README.txt",
    "data.jsonl",
]
CONTENTS = st.one_of(
    st.binary(max_size=48),
    st.text(max_size=32).map(str.encode),
    st.sampled_from(
        [
            b"",
            b"{}",
            b"[]",
            b"null",
            b'{"kind": "store"}',
            b'{"kind": "demo"}',
            b'{"pid": 1}',
            b'{"schema_version": 1, "spec": {}, "shards": []}',
            b'{"sample_ids": ["a:1"], "recipe": null}',
        ]
    ),
)
LEAF = st.tuples(st.just("file"), CONTENTS)
TREE = st.dictionaries(
    st.sampled_from(NAMES),
    st.one_of(LEAF, st.tuples(st.just("dir"), st.dictionaries(st.sampled_from(NAMES), LEAF, max_size=3))),
    min_size=1,
    max_size=5,
)

# each writing command with its --out as {out} (a folder; regenerate's is a file: {out_file})
COMMANDS = {
    "extract": "extract --model {model} --data {data} --out {out}",
    "train": "train --store {store} --out {out}",
    "train --online --spool": "train --online --target {model} --data {data} --out {tmp}/new-run --spool {out}",
    "eval": "eval --target {model} --draft {model} --out {out}",
    "bench report": "bench report --history {history} --out {out}",
    "make-target": "make-target --out {out}",
    "demo": "demo --out {out}",
    "regenerate": "regenerate --target {model} --data {data} --out {out_file}",
}
KIND = {
    "extract": "store",
    "train --online --spool": "store",
    "bench report": "bench",
    "make-target": "target",
    "regenerate": None,
    **{c: c for c in ("train", "eval", "demo")},
}


def plant(root: Path, tree: dict) -> None:
    root.mkdir(parents=True)
    for name, (kind, value) in tree.items():
        if kind == "file":
            (root / name).write_bytes(value)
        else:
            plant(root / name, value)


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def world(tiny_kimi, small_data, small_store, tmp_path_factory):
    history = tmp_path_factory.mktemp("history") / "bench.json"
    history.write_text(json.dumps({"benchmarks": []}))
    return {"model": str(tiny_kimi), "data": str(small_data), "store": str(small_store), "history": str(history)}


@pytest.mark.parametrize("command", list(COMMANDS))
@settings(max_examples=40, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=TREE, pick=st.integers(0, 1000), sidecar=st.booleans())
def test_a_command_pointed_at_a_user_s_folder_refuses_and_touches_nothing(
    world, tmp_path, capsys, command, tree, pick, sidecar
):
    with tempfile.TemporaryDirectory(dir=tmp_path) as scratch:
        user = Path(scratch) / "mine"
        plant(user, tree)
        kind = KIND[command]
        assume(kind is None or ownership.owner(user) != kind)  # a marker of its own kind: the command's folder
        names = sorted(tree)
        # regenerate's --out is a file, written with FILE.regen.json beside it: a user's entry, or a new name whose
        # sidecar name is a user's file
        out_file = user / names[pick % len(names)]
        if sidecar:
            out_file = user / f"new-{pick}.jsonl"
            (user / f"new-{pick}.jsonl.regen.json").write_bytes(
                tree.get(names[0], ("file", b"{}"))[1] if tree[names[0]][0] == "file" else b"[]"
            )
        before = snapshot(user)
        note(f"tree {tree}")
        argv = COMMANDS[command].format(**world, out=user, out_file=out_file, tmp=scratch)
        code = cli.main(argv.split())
        err = capsys.readouterr().err
        assert code == 2, (argv, err)
        assert snapshot(user) == before, argv
        if command == "regenerate":
            assert str(out_file) in err, err  # the file, or its sidecar FILE.regen.json
        else:
            found = ownership.owner(user)
            assert any(f"holds {n}" in err or f" {n}," in err or f" {n})" in err or f" {n}/" in err for n in names) or (
                found and ownership.KINDS[found] in err
            ), err
        shutil.rmtree(Path(scratch) / "new-run", ignore_errors=True)


@pytest.mark.parametrize(
    "command,other", [(c, o) for c in COMMANDS for o in ("store", "train", "demo") if KIND[c] not in (None, o)]
)
def test_a_folder_another_command_made_is_refused_naming_what_it_holds(world, tmp_path, capsys, command, other):
    """A marker of another kind: e.g. `train --out STORE` writes no checkpoint into an extraction's store."""
    folder = ownership.claim(tmp_path / "theirs", other)
    (folder / "manifest.json").write_text("{}")
    before = snapshot(folder)
    argv = COMMANDS[command].format(**world, out=folder, out_file=folder / "x", tmp=tmp_path)
    assert cli.main(argv.split()) == 2
    err = capsys.readouterr().err
    assert f"holds {ownership.KINDS[other]}, not {ownership.KINDS[KIND[command]]}" in err, err
    assert snapshot(folder) == before


class Boom(Exception):
    pass


@pytest.mark.parametrize("before", ["new", "empty", "earlier run"])
def test_a_failed_command_leaves_its_out_folder_as_it_found_it(tmp_path, before):
    """ownership.claimed: a folder this run made is removed, an empty one is emptied back, a folder of the same kind
    from an earlier run (a rerun) keeps what it held."""
    out = tmp_path / "parent" / "out"
    if before != "new":
        out.mkdir(parents=True)
    if before == "earlier run":
        with ownership.claimed(out, "eval"):
            (out / "eval.json").write_text("{}")
    with pytest.raises(Boom), ownership.claimed(out, "eval") as folder:
        (folder / "half-written.json").write_text("{")
        (folder / "sub").mkdir()
        raise Boom
    if before == "new":
        assert not out.exists()
    elif before == "empty":
        assert out.is_dir() and list(out.iterdir()) == []
    else:
        assert (out / "eval.json").read_text() == "{}" and ownership.owner(out) == "eval"


def test_two_ranks_claiming_one_new_folder_both_take_it(tmp_path, monkeypatch):
    """torchrun's ranks claim one --out at once: a marker the other rank writes between this one's read of the marker
    and its look at the folder is the other rank's claim of the same kind, not a user's file (test_ddp saw rank 0
    refused: "is not empty and eagle3 did not make it (it holds .eagle3-out.json)")."""
    out = tmp_path / "two"
    out.mkdir()
    read = ownership.owner

    def read_then_the_other_rank_claims(folder):
        found = read(folder)
        if not (out / ownership.MARK).exists():
            ownership.write_new(out / ownership.MARK, json.dumps({"kind": "train", "created": "now"}).encode())
        return found

    monkeypatch.setattr(ownership, "owner", read_then_the_other_rank_claims)
    assert ownership.claim(out, "train") == out
    monkeypatch.undo()
    assert ownership.owner(out) == "train" and sorted(p.name for p in out.iterdir()) == [ownership.MARK]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(ownership.UsageError, match=r"did not make it \(it holds notes.txt\)"):
        ownership.claim(tmp_path / "mine", "train")  # a user's file is still refused
