"""The trainer checks each shard's checksum once per run; a background thread does it ahead of the reader, in the
order the run first reads the shards (eagle3/train/shard_checks.py). On CPU a Kimi-shaped step's read was 37 %
checksum; hashed in the reader's path it limits the reader against a compiled trainer. Ahead or not, every shard is
checked once, a bad one stops training where it is read, and nothing else changes."""

import json
import shutil
import threading
import time
from collections import Counter

import pytest

from eagle3.store.folder import Store
from eagle3.train import shard_checks
from eagle3.train import train as train_mod
from eagle3.train.train import BadData, StoreSamples, reads_from, train

from .test_read_ahead import _cfg


@pytest.fixture
def checks(monkeypatch):
    """Every checksum check: (file, thread name), in order; gate[file] (an Event) holds the background thread
    before it checks that file, and held[file] is set once it waits there."""
    seen, gate, held, real = [], {}, {}, train_mod.checksum_matches

    def recorded(path, entry):
        name = threading.current_thread().name
        if name == shard_checks.NAME and entry["file"] in gate:
            held.setdefault(entry["file"], threading.Event()).set()
            assert gate[entry["file"]].wait(10)
        seen.append((entry["file"], name))
        return real(path, entry)

    monkeypatch.setattr(train_mod, "checksum_matches", recorded)
    return seen, gate, held


def _first_files(samples, order):
    out = []
    for i in order:
        f = samples.index[i][0]
        if f not in out:
            out.append(f)
    return out


def test_shards_are_checked_ahead_in_the_order_first_read_and_never_again(small_store, checks):
    seen, _, _ = checks
    samples = StoreSamples(Store.open(small_store))
    order = list(reversed(range(len(samples))))  # the last shard first
    files = _first_files(samples, order)
    assert len(files) >= 3
    samples.check_ahead(order)
    samples.checks.join(10)
    assert seen == [(f, shard_checks.NAME) for f in files]
    for i in range(len(samples)):
        samples.get(i)
    assert len(seen) == len(files)  # the reader trusted the checks made ahead


def test_the_reader_checks_a_shard_the_thread_has_not_reached_and_the_thread_skips_it(small_store, checks):
    seen, gate, held = checks
    samples = StoreSamples(Store.open(small_store))
    order = list(range(len(samples)))
    files = _first_files(samples, order)
    gate[files[0]] = threading.Event()  # the thread waits at the first shard
    samples.check_ahead(order)
    last = next(i for i in order if samples.index[i][0] == files[-1])
    samples.get(last)  # read now: checked here, in this thread
    assert seen == [(files[-1], threading.current_thread().name)]
    gate[files[0]].set()
    samples.checks.join(10)
    assert Counter(f for f, _ in seen) == Counter(files)  # each once
    assert {f for f, who in seen if who == shard_checks.NAME} == set(files[:-1])


def test_a_bad_shard_checked_ahead_stops_the_read_of_its_samples_only(small_store, tmp_path, checks):
    store = tmp_path / "store"
    shutil.copytree(small_store, store)
    bad = json.loads((store / "manifest.json").read_text())["shards"][1]["file"]
    data = bytearray((store / bad).read_bytes())
    data[-100] ^= 0x40
    (store / bad).write_bytes(bytes(data))
    samples = StoreSamples(Store.open(store))
    samples.check_ahead(range(len(samples)))
    samples.checks.join(10)
    good = next(i for i in range(len(samples)) if samples.index[i][0] != bad)
    assert samples.get(good)["sample_id"] == samples.sample_id(good)
    inside = next(i for i in range(len(samples)) if samples.index[i][0] == bad)
    for _ in range(2):  # every read of the shard raises, not only the first
        with pytest.raises(BadData, match="checksum differs") as e:
            samples.get(inside)
        assert bad in str(e.value)


def test_train_checks_its_shards_ahead_in_the_order_it_reads_them(small_store, tmp_path, checks, monkeypatch):
    """Each shard checked once, by the background thread, in the order of this run's reads (epochs 0 and 1 of 4
    samples a step). The reader's first read waits for the thread to finish, so no shard is the reader's."""
    seen, _, _ = checks
    get = StoreSamples.get

    def after_the_checks(self, i):
        self.checks.join(10)
        return get(self, i)

    monkeypatch.setattr(StoreSamples, "get", after_the_checks)
    r = train(_cfg(small_store, tmp_path / "t", max_steps=3), progress=False)
    assert r.steps == 3
    samples = StoreSamples(Store.open(small_store))
    steps_per_epoch = len(samples) // 4
    files = _first_files(samples, reads_from(samples, 0, steps_per_epoch, 4, 0, 1))
    assert seen == [(f, shard_checks.NAME) for f in files]


def test_reads_from_is_this_ranks_part_of_each_step_from_a_step_on(small_store):
    samples = StoreSamples(Store.open(small_store), seed=3)
    per_epoch = len(samples) // 4
    want = [i for s in range(per_epoch + 1, 3 * per_epoch) for i in samples.batch(s, per_epoch, 4)[1::2]]
    assert list(reads_from(samples, per_epoch + 1, per_epoch, 4, 1, 2, epochs=2)) == want


def test_the_reader_waits_for_a_shard_the_thread_is_checking(small_store, checks):
    seen, gate, held = checks
    samples = StoreSamples(Store.open(small_store))
    order = list(range(len(samples)))
    first = samples.index[0][0]
    gate[first] = threading.Event()  # the thread has claimed the first shard and holds inside its check
    samples.check_ahead(order)
    got, errors = [], []

    def read():
        try:
            got.append(samples.get(0)["sample_id"])
        except BaseException as e:  # noqa: BLE001 - shown by the assert below
            errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(0.5)
    assert reader.is_alive() and not got  # waiting for the thread's check, not checking it again
    gate[first].set()
    reader.join(10)
    assert not errors and got == [samples.sample_id(0)]
    samples.checks.join(10)
    assert Counter(f for f, _ in seen)[first] == 1 and (first, shard_checks.NAME) in seen


def test_a_closed_source_stops_its_checks_between_shards(small_store, checks):
    """train() closes the checks with the run: a short run over a large store does not go on hashing the rest of
    it. The thread finishes the shard it is hashing and starts no other."""
    seen, gate, held = checks
    samples = StoreSamples(Store.open(small_store))
    order = list(range(len(samples)))
    files = _first_files(samples, order)
    gate[files[0]] = threading.Event()
    samples.check_ahead(order)
    for _ in range(1000):  # until the thread holds inside the first shard's check
        if files[0] in held:
            break
        time.sleep(0.01)
    samples.close()
    gate[files[0]].set()
    samples.checks.join(10)
    assert not samples.checks.thread.is_alive() and seen == [(files[0], shard_checks.NAME)]


def test_a_mismatch_is_checked_again_at_the_next_read_and_a_check_s_error_is_raised_where_it_is_needed():
    """Only a match is kept: a shard that did not match (restored since, or read while still being copied) is
    hashed again when next read; a check that failed (the file unreadable) raises its own error to the reader."""
    answers = {"a": [False, True]}
    calls = []

    def check(file):
        calls.append(file)
        if file == "gone":
            raise OSError(2, "No such file or directory", file)
        return answers[file].pop(0)

    checks = shard_checks.ShardChecks(check)
    assert checks.matches("a") is False and checks.matches("a") is True and checks.matches("a") is True
    assert calls == ["a", "a"]
    with pytest.raises(OSError, match="No such file"):
        checks.matches("gone")
