"""A store's shard checksums checked ahead of the reader, in a background thread.

The trainer trusts no shard it has not checksummed this run (train.StoreSamples): a shard's whole file is hashed the
first time any of its samples is read. Done there, the hash (xxh3_128 reads and hashes the file: ~1.9 GB a shard of
32k Kimi-shaped tokens) sits in the reader's path, once per shard. Here one thread checks the shards in the order the
run will first read them, while the reader packs earlier steps (xxhash and file reads release the GIL). A shard the
reader reaches first it checks itself; one being checked it waits for. Each shard is checked once either way, and a
mismatch is raised where the reader needs that shard, as before: nothing changes but when the hashing happens."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

NAME = "eagle3-shard-checks"


class ShardChecks:
    def __init__(self, check: Callable[[str], bool]):
        """``check(file)``: True where the file's checksum matches its manifest entry."""
        self.check = check
        self.lock = threading.Lock()
        self.claims: dict[str, tuple[threading.Event, list]] = {}  # file -> (done, [result or exception])
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    def _claim(self, file: str) -> tuple[bool, threading.Event, list]:
        """(claimed here, done, box): the first to ask for a file checks it; the others wait on done."""
        with self.lock:
            if file in self.claims:
                return False, *self.claims[file]
            done, box = threading.Event(), []
            self.claims[file] = (done, box)
            return True, done, box

    def _check(self, file: str, done: threading.Event, box: list) -> None:
        try:
            box.append(self.check(file))
        except BaseException as e:  # noqa: BLE001 - raised where the reader needs the file (matches)
            box.append(e)
        if box[0] is not True:  # only a match is kept: a later read checks a bad or unreadable file again
            with self.lock:
                self.claims.pop(file, None)
        done.set()

    def matches(self, file: str) -> bool:
        """Whether ``file`` matches: checked now, or the result of the check begun ahead (waited for)."""
        mine, done, box = self._claim(file)
        if mine:
            self._check(file, done, box)
        done.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def ahead(self, files: Iterable[str]) -> None:
        """Check ``files`` (the first read of each, in order; repeats skipped) in one background thread. A daemon:
        a run that stops leaves it hashing at most one more file (close stops it between files)."""

        def run() -> None:
            for file in files:
                if self.stopped.is_set():
                    return
                mine, done, box = self._claim(file)
                if mine:
                    self._check(file, done, box)

        self.thread = threading.Thread(target=run, daemon=True, name=NAME)
        self.thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def close(self) -> None:
        self.stopped.set()
