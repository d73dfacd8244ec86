"""Commits in a thread: the manifest's fsync overlaps the next batch's prefill instead of idling the GPU.

On ext4 (data=ordered) fsyncing the small manifest waits for the writers' dirty shard data, so a commit in the
extraction loop stalled the engine between batches: on the H200 (session 6, mini-Kimi 64x512, 60 GB) the loop
spent 25.5 of 33.6 s committing and the fsynced store reached 0.85x of its disk limit; committed by a thread,
0.98x. Shards are committed in the order they were handed over, each after the previous one; a failed commit
is raised by the next ``commit`` or by ``close``, and nothing after it is committed (a rerun redoes those
samples: files the manifest does not name are removed when the store opens).
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Sequence

from eagle3.store.folder import Store
from eagle3.store.format import ShardInfo


class BackgroundCommitter:
    """``commit(infos)`` queues (blocking while ``depth`` commits are pending); ``close()`` waits for all."""

    def __init__(self, store: Store, fsync: bool = True, fault: Callable[[str], None] | None = None,
                 depth: int = 2):
        self.store, self.fsync, self.fault = store, fsync, fault
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
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

    def _run(self) -> None:
        while (infos := self._queue.get()) is not None:
            if self._error is not None:
                continue  # after a failure nothing more is committed: the order of the manifest holds
            try:
                self.store.commit(infos, fsync=self.fsync, fault=self.fault)
                if self.fault:
                    self.fault("after_commit")
            except BaseException as e:  # noqa: BLE001 - raised in the loop's thread
                self._error = e
