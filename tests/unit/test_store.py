"""Shard store: round trips, atomic writes, commit rules, and refusing a store of another setup."""

import errno
import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from eagle3.store import files as store_mod
from eagle3.store.folder import Store
from eagle3.store.format import ShardInfo, StoreError, StoreMismatch, StoreSpec, safetensors_chunks
from eagle3.store.writer import ShardWriter

SPEC = StoreSpec(target={"name_or_path": "t", "config_hash": "abc"}, layer_ids=(2, 4, 5, 8), hidden_size=6)


def _sample(i, t):
    g = torch.Generator().manual_seed(i)
    return (
        f"s{i}",
        torch.randint(0, 100, (t,), generator=g),
        torch.randint(0, 2, (t,), generator=g),
        torch.randn(4, t, 6, generator=g).to(torch.bfloat16),
    )


@settings(max_examples=30)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=25),
    shard_tokens=st.integers(1, 120),
    shard_samples=st.one_of(st.none(), st.integers(1, 6)),
    threads=st.sampled_from([0, 2]),
)
def test_round_trip_over_lengths_and_shard_boundaries(tmp_path_factory, lengths, shard_tokens, shard_samples, threads):
    root = tmp_path_factory.mktemp("rt")
    store = Store.open(root, SPEC, create=True, fsync=False)
    w = ShardWriter(
        root,
        SPEC,
        store.next_shard_index,
        shard_tokens=shard_tokens,
        shard_samples=shard_samples,
        fsync=False,
        threads=threads,
    )
    samples = [_sample(i, t) for i, t in enumerate(lengths)]
    for s in samples:
        w.add(*s)
        store.commit(w.take_done(), fsync=False)
    store.commit(w.flush(), fsync=False)
    w.close()
    back = list(Store.open(root).iter_samples())
    assert [b["sample_id"] for b in back] == [s[0] for s in samples]
    for (_sid, ids, mask, states), b in zip(samples, back):
        assert torch.equal(b["input_ids"], ids.to(torch.int32)) and torch.equal(b["loss_mask"], mask.to(torch.uint8))
        for k, layer_id in enumerate(SPEC.layer_ids):
            assert torch.equal(b["states"][layer_id], states[k])
    assert sum(s["num_tokens"] for s in store.shards) == sum(lengths)


def test_our_safetensors_bytes_read_back_with_the_safetensors_library(tmp_path):
    tensors = {
        "a": torch.randn(3, 5).to(torch.bfloat16),
        "b": torch.arange(7, dtype=torch.int32),
        "c": torch.zeros(0, 4),
        "d": torch.tensor([1, 0, 1], dtype=torch.uint8),
    }
    p = tmp_path / "x.safetensors"
    store_mod.atomic_write(p, safetensors_chunks(tensors, {"k": "v"}))
    back = load_file(str(p))
    for k, t in tensors.items():
        assert torch.equal(back[k], t) and back[k].dtype == t.dtype
    # the data starts 8-byte aligned (the header padded with spaces), as the safetensors writer does: a reader may
    # map tensors in place
    header = p.read_bytes()[8 : 8 + int.from_bytes(p.read_bytes()[:8], "little")]
    body = header.rstrip(b" ")
    assert (8 + len(header)) % 8 == 0 and body.endswith(b"}") and len(header) - len(body) < 8


def test_a_commit_refuses_a_sample_twice_in_its_own_shards_and_a_file_of_another_size(tmp_path):
    """Nothing reaches the manifest from a commit that would hold a sample twice (two of its shards share it) or
    name a file whose size is not the one written (truncated after the write)."""
    store = Store.open(tmp_path, SPEC, create=True, fsync=False)
    w = ShardWriter(tmp_path, SPEC, 0, shard_samples=1, fsync=False)
    for i in (1, 1, 2):  # sample s1 written twice, in two shards
        w.add(*_sample(i, 5))
    infos = w.take_done()
    twice, single = infos[:2], infos[2:]
    with pytest.raises(StoreError, match=r"already in the store: \['s1'\]"):
        store.commit(twice, fsync=False)
    short = tmp_path / single[0].file
    short.write_bytes(short.read_bytes()[:-8])
    with pytest.raises(StoreError, match="wrong size"):
        store.commit(single, fsync=False)
    assert Store.open(tmp_path).shards == [] and store.done_ids == set()


def test_samples_read_back_with_a_chosen_set_of_layers(tmp_path):
    store = Store.open(tmp_path, SPEC, create=True, fsync=False)
    w = ShardWriter(tmp_path, SPEC, 0, shard_samples=2, fsync=False)
    for i in range(3):
        w.add(*_sample(i, 4 + i))
    store.commit(w.flush(), fsync=False)
    full = list(store.iter_samples())
    some = list(store.iter_samples([8, 4]))  # the last layer first, and not every layer
    assert [s["sample_id"] for s in some] == ["s0", "s1", "s2"]
    for a, b in zip(full, some):
        assert list(b["states"]) == [8, 4]
        assert all(torch.equal(b["states"][i], a["states"][i]) for i in (8, 4))
    with pytest.raises(StoreMismatch, match=r"not \[3\]"):
        next(store.iter_samples([3]))


def test_commit_refuses_duplicates_and_uncommitted_files_are_removed(tmp_path):
    store = Store.open(tmp_path, SPEC, create=True)
    w = ShardWriter(tmp_path, SPEC, 0, shard_samples=1)
    w.add(*_sample(1, 5))
    info = w.take_done()
    store.commit(info)
    with pytest.raises(StoreError, match="already in the store"):
        store.commit(info)
    w.add(*_sample(2, 5))
    orphan = w.take_done()  # written, never committed (as after a crash)
    assert (tmp_path / orphan[0].file).exists()
    (tmp_path / ".tmp-manifest.json").write_text("{partial")
    reopened = Store.open(tmp_path, SPEC)
    assert not (tmp_path / orphan[0].file).exists() and not (tmp_path / ".tmp-manifest.json").exists()
    assert reopened.done_ids == {"s1"} and reopened.next_shard_index == 1


def test_a_reader_leaves_the_written_uncommitted_shards_of_a_store_being_written(tmp_path):
    """A shard is written, then committed: in between it is in no manifest. A reader's open (the trainer's, of the
    spool an online run's producer writes in the same process; `eagle3 train` on a store `extract` still writes)
    removed it as a crash's leftover, and the writer's commit then failed ('file missing'): the online run beside
    the fake vLLM engine, once its batches no longer waited for their shards' write. Only an open where no process
    holds the store's write lock cleans."""
    writer = Store.open(tmp_path, SPEC, create=True, lock=True)
    w = ShardWriter(tmp_path, SPEC, 0, shard_samples=1)
    w.add(*_sample(1, 5))
    written = w.take_done()
    reader = Store.open(tmp_path, SPEC)
    assert (tmp_path / written[0].file).exists() and reader.done_ids == set()
    writer.commit(written)
    writer.release()
    w.add(*_sample(2, 5))
    orphan = w.take_done()  # written, never committed, its writer gone: a crash's leftover
    Store.open(tmp_path, SPEC)
    assert not (tmp_path / orphan[0].file).exists() and (tmp_path / written[0].file).exists()


@pytest.mark.parametrize(
    "change,msg",
    [
        (dict(target={"name_or_path": "other", "config_hash": "zzz"}), "target model"),
        (dict(layer_ids=(2, 4, 6, 8)), "layer_ids"),
        (dict(hidden_size=7), "hidden_size"),
        (dict(dtype="float16"), "dtype"),
    ],
)
def test_store_of_another_setup_is_refused(tmp_path, change, msg):
    Store.open(tmp_path, SPEC, create=True)
    other = StoreSpec(**{**SPEC.__dict__, **change})
    with pytest.raises(StoreMismatch, match=msg):
        Store.open(tmp_path, other)


def test_disk_full_leaves_nothing_half_written(tmp_path, monkeypatch):
    store = Store.open(tmp_path, SPEC, create=True)
    w = ShardWriter(tmp_path, SPEC, 0, shard_samples=1)
    w.add(*_sample(1, 5))
    store.commit(w.take_done())
    before = (tmp_path / "manifest.json").read_bytes()

    def full(f, chunks):
        f.write(b"abc")  # a few bytes land, then the device is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_mod, "write_chunks", full)
    with pytest.raises(StoreError, match="disk full while writing .*rerunning the same command resumes"):
        w.add(*_sample(2, 5))
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == ["shard-000000.safetensors"]
    assert not list(tmp_path.rglob(".tmp-*"))
    with pytest.raises(StoreError, match="disk full"):
        store_mod.atomic_write_json(tmp_path / "manifest.json", {"x": 1})
    assert (tmp_path / "manifest.json").read_bytes() == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere; covered by the probe-failure test below")
def test_unwritable_output_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    with pytest.raises(StoreError, match="not writable"):
        Store.open(ro / "store", SPEC, create=True)


def test_unwritable_output_folder_reported_before_any_work(tmp_path, monkeypatch):
    real = type(tmp_path).write_bytes

    def deny(self, data):
        if self.name == ".tmp-write-probe":
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(self, data)

    monkeypatch.setattr(type(tmp_path), "write_bytes", deny)
    with pytest.raises(StoreError, match="output folder .* is not writable .*choose another --out"):
        Store.open(tmp_path / "s", SPEC, create=True)
    assert not (tmp_path / "s" / "manifest.json").exists()


def test_manifest_problems_are_explained(tmp_path):
    Store.open(tmp_path, SPEC, create=True)
    m = json.loads((tmp_path / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps(dict(m, schema_version=99)))
    with pytest.raises(StoreError, match="schema_version 99"):
        Store.open(tmp_path)
    (tmp_path / "manifest.json").write_text("{oops")
    with pytest.raises(StoreError, match="not valid JSON"):
        Store.open(tmp_path)
    with pytest.raises(StoreError, match="not a store"):
        Store.open(tmp_path / "nothing")


def test_shard_renames_reach_the_disk_once_per_commit_before_the_manifest_names_them(tmp_path, monkeypatch):
    """A writer thread fsyncs its shard's data but not the shards folder: that fsync forces a journal commit that
    waits on the other writers' data (ext4, data=ordered). The commit fsyncs the folder once, before the manifest
    that names the shards is renamed into place, so a crash never leaves a manifest naming a shard that is gone."""
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        events.append(("fsync-dir" if os.path.isdir(path) else "fsync", os.path.basename(path)))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", os.path.basename(dst)))
        real_replace(src, dst)

    store = Store.open(tmp_path, SPEC, create=True)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    w = ShardWriter(tmp_path, SPEC, 0, shard_samples=1, threads=2)
    for i in range(3):
        w.add(*_sample(i, 5))
    infos = w.flush()
    w.close()
    names = sorted(os.path.basename(i.file) for i in infos)
    assert len(names) == 3
    for n in names:  # each shard's data is on the disk before its name appears
        assert events.index(("fsync", f".tmp-{n}")) < events.index(("rename", n))
    assert not [e for e in events if e[0] == "fsync-dir"], "a writer thread fsynced the shards folder"
    events.clear()
    store.commit(infos)
    assert events.count(("fsync-dir", "shards")) == 1
    assert events.index(("fsync-dir", "shards")) < events.index(("rename", "manifest.json"))
    assert events[-1] == ("fsync-dir", tmp_path.name)  # and the manifest's own rename


def _shard_entries(obj) -> int:
    """Shard entries (dicts with sample_ids) anywhere inside a JSON-able object."""
    if isinstance(obj, dict):
        return ("sample_ids" in obj) + sum(_shard_entries(v) for v in obj.values())
    return sum(_shard_entries(v) for v in obj) if isinstance(obj, list) else 0


def test_a_commit_encodes_its_own_shards_not_the_whole_manifest(tmp_path, monkeypatch):
    """The manifest names every committed shard; a commit rewrites it. Encoded whole with json.dumps(indent=1), a
    commit at 1M samples (16,000 shards of 64) took 0.42-0.74 s on this project's CPU machine, holding the GIL
    the extraction loop and the writer threads need: work per batch that grew with the store. A commit encodes
    only its new shards; the file it writes is still the whole manifest, equal to the store's, before and after
    shards are dropped (verify --fix, the online spool)."""
    store = Store.open(tmp_path, SPEC, create=True, fsync=False)

    def infos(first, n):
        out = []
        for i in range(first, first + n):
            f = f"shards/shard-{i:06d}.safetensors"
            (tmp_path / f).write_bytes(b"x" * (i % 7 + 1))
            out.append(ShardInfo(f, "xxh3_128:0", i % 7 + 1, 2, 10, [f"s{i}a", f"s{i}b"]))
        return out

    store.commit(infos(0, 300), fsync=False)
    encoded = []
    real = json.dumps

    def counting(obj, *a, **kw):
        encoded.append(_shard_entries(obj))
        return real(obj, *a, **kw)

    monkeypatch.setattr(json, "dumps", counting)
    store.commit(infos(300, 2), fsync=False)
    assert sum(encoded) == 2, f"a commit of 2 shards encoded {sum(encoded)} on a store of 300"
    monkeypatch.setattr(json, "dumps", real)
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    assert on_disk == store.manifest and len(on_disk["shards"]) == 302
    store.drop_shards({"shards/shard-000007.safetensors", "shards/shard-000301.safetensors"}, fsync=False)
    store.commit(infos(302, 1), fsync=False)
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    assert on_disk == store.manifest and len(on_disk["shards"]) == 301
    reopened = Store.open(tmp_path, SPEC)  # a resumed run: its first commit encodes the shards read back
    assert reopened.manifest == store.manifest and reopened.done_ids == store.done_ids
    assert "s7a" not in reopened.done_ids and "s302b" in reopened.done_ids
    reopened.commit(infos(303, 1), fsync=False)
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    assert on_disk == reopened.manifest and [s["file"] for s in on_disk["shards"]][-3:] == [
        f"shards/shard-{i:06d}.safetensors" for i in (300, 302, 303)
    ]


def test_a_sample_with_the_wrong_layers_or_rows_is_refused_naming_it(tmp_path):
    w = ShardWriter(tmp_path, SPEC, 0, fsync=False)
    sid, ids, mask, states = _sample(1, 5)
    with pytest.raises(StoreError, match="sample s1: 3 layers, store expects 4"):
        w.add(sid, ids, mask, states[:3])
    with pytest.raises(StoreError, match=r"sample s1: layer 2 has shape \(6, 6\), expected \(5, 6\)"):
        w.add(sid, ids, mask, torch.cat([states, states[:, :1]], dim=1))
    assert w.flush() == []


def test_shards_finished_out_of_order_are_handed_over_in_index_order(tmp_path, monkeypatch):
    """Two writer threads: shard 1 finishes while shard 0 is still being written; take_done holds it back until
    shard 0 is done, so a commit never names a later shard before an earlier one."""
    import threading
    import time

    from eagle3.store import writer as writer_mod

    gate, real = threading.Event(), writer_mod.write_shard

    def slow_first(root, name, *a, **kw):
        if name.endswith("000000.safetensors"):
            gate.wait(10)
        return real(root, name, *a, **kw)

    monkeypatch.setattr(writer_mod, "write_shard", slow_first)
    w = ShardWriter(tmp_path, SPEC, 0, shard_samples=1, fsync=False, threads=2)
    w.add(*_sample(0, 4))
    w.add(*_sample(1, 4))
    deadline = time.monotonic() + 10
    while not w.written and time.monotonic() < deadline:  # shard 1 written, shard 0 held
        time.sleep(0.01)
    assert w.written == ["shards/shard-000001.safetensors"] and w.take_done() == []
    gate.set()
    assert [i.file for i in w.flush()] == ["shards/shard-000000.safetensors", "shards/shard-000001.safetensors"]
    w.close()


def test_a_shard_that_fails_to_build_still_hands_its_buffer_back(tmp_path):
    """The capture's buffer goes back to the pool (on_done) whether its shard was written or not: a failed write
    must not leave the capture waiting for a buffer forever."""
    w = ShardWriter(tmp_path, SPEC, 0, fsync=False)
    released = []

    def build():
        raise OSError("no space left")

    with pytest.raises(OSError, match="no space left"):
        w.submit(build, lambda: released.append(True))
    assert released == [True]


def _build(i, gate=None):
    """A shard of sample i for ShardWriter.submit; its build waits for ``gate`` first, where given."""
    from eagle3.store.format import shard_tensors

    def make():
        if gate is not None:
            gate.wait(10)
        s = _sample(i, 5)
        return shard_tensors([s], SPEC), [s[0]]

    return make


def _writer_busy_and_full(tmp_path, gate):
    """One writer thread held in shard 0's build (until ``gate``) and shard 1 in the queue's one slot."""
    import time

    w = ShardWriter(tmp_path, SPEC, 0, fsync=False, threads=1, max_pending=1)
    w.submit(_build(0, gate))
    while w._queue.qsize():  # noqa: SLF001 - the thread has taken shard 0 and waits in its build
        time.sleep(0.001)
    w.submit(_build(1))
    return w


def _all_returned_and_written(w, threads):
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "close() or a submit never returned"
    assert sorted(w.written) == [f"shards/shard-00000{i}.safetensors" for i in range(3)], w.written


def test_a_shard_submitted_while_the_writer_closes_is_written_not_lost(tmp_path):
    """The capture's consumer thread hands shards to the writer; a close() from another thread must not end the
    writer's threads ahead of a shard submitted after it began (the put landed in a queue no thread read: the shard
    lost, and a put into the full queue blocked for good). Here close() waits to enqueue its stop when shard 2 is
    submitted."""
    import threading
    import time

    gate = threading.Event()
    w = _writer_busy_and_full(tmp_path, gate)
    closer = threading.Thread(target=w.close)
    closer.start()
    time.sleep(0.2)  # close() is now waiting for room for its stop (or, fixed, has taken the queue away)
    submitter = threading.Thread(target=lambda: w.submit(_build(2)))
    submitter.start()
    time.sleep(0.2)
    gate.set()
    _all_returned_and_written(w, (closer, submitter))
    assert sorted(i.file for i in w.take_done()) == sorted(w.written)


def test_close_waits_for_a_submit_already_putting_its_shard(tmp_path):
    """A submit that took the queue before close() began, and is slow to put its shard (held here), is waited for:
    the threads' stop goes in behind it. Stopped first, the threads end and the shard lands in a queue no thread
    reads."""
    import threading
    import time

    gate, let_put = threading.Event(), threading.Event()
    w = _writer_busy_and_full(tmp_path, gate)
    q = w._queue  # noqa: SLF001
    put = q.put

    def held_put(item, *a, **kw):
        if item is not None and item[0].endswith("000002.safetensors"):
            let_put.wait(10)
        return put(item, *a, **kw)

    q.put = held_put
    submitter = threading.Thread(target=lambda: w.submit(_build(2)))
    submitter.start()
    time.sleep(0.2)  # the submit of shard 2 has taken the queue and is held in its put
    closer = threading.Thread(target=w.close)
    closer.start()
    time.sleep(0.2)
    gate.set()  # shard 0 written, shard 1 taken: room for whatever comes next
    time.sleep(0.3)
    let_put.set()
    _all_returned_and_written(w, (closer, submitter))


def test_how_far_a_store_is_counts_only_planned_samples_and_says_when_there_is_no_plan(tmp_path):
    """status.py (JSON only): a store without a plan (made through the API) is "N of ?", every stored sample counted,
    and never refused as incomplete; with a plan, samples it does not name are not counted toward it."""
    import json

    from eagle3.store import status

    (tmp_path / "manifest.json").write_text(
        json.dumps({"shards": [{"sample_ids": ["a:1", "a:2"]}, {"sample_ids": ["a:3", "stray:9"]}]})
    )
    assert status.counts(tmp_path) == (4, None) and status.stored(tmp_path) == "4 of ? samples"
    assert status.incomplete_message(tmp_path) is None
    (tmp_path / "plan.json").write_text(json.dumps({"sample_ids": ["a:1", "a:2", "a:3", "a:4"]}))
    assert status.counts(tmp_path) == (3, 4) and status.stored(tmp_path) == "3 of 4 samples"
    assert "holds 3 of the 4 samples its plan names (1 missing)" in status.incomplete_message(tmp_path)
    (tmp_path / "plan.json").write_text(json.dumps({"sample_ids": ["a:1", "a:2", "a:3"]}))
    assert status.counts(tmp_path) == (3, 3) and status.incomplete_message(tmp_path) is None


@pytest.mark.parametrize("seal", [False, True])
def test_a_session_that_seals_each_batch_hands_back_the_batch_s_own_shard(tmp_path, seal):
    """The online spool's sessions (seal_each_batch): each submit cuts the open shard and returns it, every sample of
    the batch in it, however large a shard may grow; an offline session keeps filling the open shard."""
    from types import SimpleNamespace

    from eagle3.data.conversations import Sample
    from eagle3.extract.local_session import LocalSession

    spec = StoreSpec(target={"name_or_path": "t"}, layer_ids=(1, 2), hidden_size=4, dtype="float32")
    store = Store.open(tmp_path / "s", spec, create=True, fsync=False)

    class States:  # [2 layers, T, 4] per sample: the backend's answer
        def capture(self, batch):
            return [torch.full((2, len(s), 4), float(k)) for k, s in enumerate(batch)]

    cfg = SimpleNamespace(shard_tokens=10**6, shard_samples=None, fsync=False, writer_threads=0)
    session = LocalSession(States(), store, cfg, None, seal_each_batch=seal)
    for b in range(2):
        batch = [Sample(f"b{b}:{i}", (1, 2, 3), (0, 1, 1)) for i in range(3)]
        infos = session.submit(batch)
        assert [list(i.sample_ids) for i in infos] == ([[s.sample_id for s in batch]] if seal else [])
    assert [list(i.sample_ids) for i in session.finish()] == (
        [] if seal else [[f"b{b}:{i}" for b in range(2) for i in range(3)]]
    )
