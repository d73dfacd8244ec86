"""Commits in a thread: the manifest's fsync overlaps the next batch's prefill instead of idling the GPU.

On ext4 (data=ordered) fsyncing the small manifest waits for the writers' dirty shard data, so a commit in the
extraction loop stalled the engine between batches. With a thread two commits deep the loop still waited on a
slower disk, so the loop never waits now: batches handed over while a commit runs are committed together by the next
manifest write (one fsync for all of them). Shards are committed in the order they were handed over; a failed
commit is raised by the next ``commit`` or by ``close``, and nothing after it is committed (a rerun redoes those
samples: files the manifest does not name are removed when the store opens).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence

from eagle3.store.folder import Store
from eagle3.store.format import ShardInfo


class BackgroundCommitter:
    """``commit(infos)`` queues and returns; ``close()`` waits for all. ``stats``: manifest writes (``commits``),
    batches handed over (``batches``) and seconds spent committing (``commit_s``, in the thread)."""

    def __init__(self, store: Store, fsync: bool = True, fault: Callable[[str], None] | None = None):
        self.store, self.fsync, self.fault = store, fsync, fault
        self._queue: queue.Queue = queue.Queue()  # shard lists, small: the writers bound the data in flight
        self._error: BaseException | None = None
        self.stats = {"commits": 0, "batches": 0, "commit_s": 0.0}
        self._thread = threading.Thread(target=self._run, name="eagle3-commit", daemon=True)
        self._thread.start()

    def commit(self, infos: Sequence[ShardInfo]) -> None:
        self._raise_if_failed()
        if infos:
            self._queue.put(list(infos))

    def close(self, raise_errors: bool = True) -> None:
        """Wait for every queued commit; ``raise_errors=False`` when the loop is failing already."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if raise_errors:
            self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _take(self) -> tuple[list[ShardInfo], int, bool]:
        """Block for one batch, then take every batch queued meanwhile: (their shards in order, batches, closed)."""
        items = [self._queue.get()]
        while items[-1] is not None:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        closed = items[-1] is None
        batches = [b for b in items if b is not None]
        return [info for b in batches for info in b], len(batches), closed

    def _run(self) -> None:
        closed = False
        while not closed:
            infos, batches, closed = self._take()
            if self._error is not None or not infos:
                continue  # after a failure nothing more is committed: the order of the manifest holds
            t0 = time.perf_counter()
            try:
                self.store.commit(infos, fsync=self.fsync, fault=self.fault)
                if self.fault:
                    self.fault("after_commit")
            except BaseException as e:  # noqa: BLE001 - raised in the loop's thread
                self._error = e
            self.stats["commits"] += 1
            self.stats["batches"] += batches
            self.stats["commit_s"] += time.perf_counter() - t0
