"""Writing shards: one shard file from ready tensors, or a ShardWriter that groups samples into shards
of about shard_tokens tokens and writes them in background threads."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from eagle3.store.files import atomic_write
from eagle3.store.format import (
    SHARDS,
    ShardInfo,
    StoreError,
    StoreSpec,
    safetensors_chunks,
    shard_index,
    shard_meta,
    shard_name,
    shard_tensors,
)

log = logging.getLogger(__name__)


def write_shard(
    root: Path,
    name: str,
    tensors: dict[str, torch.Tensor],
    spec: StoreSpec,
    sample_ids: Sequence[str],
    fsync: bool = True,
    fault=None,
    writer: str | None = None,
) -> ShardInfo:
    """One shard file from ready tensors (zero-copy views), atomically; its rename reaches the disk with the commit
    that names it (Store.commit fsyncs the shards folder once: a folder fsync in each writer thread forced a journal
    commit that waited on the other writers' data)."""
    sha, nbytes = atomic_write(
        Path(root) / name,
        safetensors_chunks(tensors, shard_meta(spec, sample_ids, writer)),
        fsync,
        fault,
        sync_dir=False,
    )
    return ShardInfo(name, sha, nbytes, len(sample_ids), int(tensors["input_ids"].shape[0]), list(sample_ids))


class ShardWriter:
    """Groups samples into shards of about ``shard_tokens`` tokens and writes each atomically.

    ``take_done`` returns the ShardInfos of shards finished since the last call, in index order. With
    ``threads=0`` a shard is written inside ``add``; with threads > 0 in background threads, and ``add``
    only blocks when ``max_pending`` shards are queued. ``flush`` writes the rest, waits, and returns them.
    """

    def __init__(
        self,
        root: str | Path,
        spec: StoreSpec,
        start_index: int,
        shard_tokens: int = 1 << 18,
        shard_samples: int | None = None,
        fsync: bool = True,
        threads: int = 0,
        max_pending: int = 4,
        fault: Callable[[str], None] | None = None,
        writer_id: str | None = None,
    ):
        self.root, self.spec, self.next_index, self.writer_id = Path(root), spec, start_index, writer_id
        self.threads = threads  # shards written at once (0: inside add/submit)
        self.written: list[str] = []  # shard files this writer wrote, in completion order
        self.shard_tokens, self.shard_samples, self.fsync, self.fault = shard_tokens, shard_samples, fsync, fault
        (self.root / SHARDS).mkdir(parents=True, exist_ok=True)
        self._pending: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._pending_tokens = 0
        self._finished: dict[int, ShardInfo] = {}  # by shard index; released in index order
        self._release = start_index
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a submit's put into the queue has returned
        self._submitting = 0  # submits between taking the queue and their put returning (close waits for them)
        self._error: BaseException | None = None
        self._queue: queue.Queue | None = None
        self._threads: list[threading.Thread] = []
        if threads > 0:
            self._queue = queue.Queue(maxsize=max_pending)
            for i in range(threads):
                t = threading.Thread(target=self._worker, args=(self._queue,), name=f"eagle3-shard-{i}", daemon=True)
                t.start()
                self._threads.append(t)

    def add(
        self,
        sample_id: str,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        states: torch.Tensor | Sequence[torch.Tensor],
    ) -> None:
        """states: [n_layers, T, H] (or a list of n_layers [T, H]) for this sample."""
        n_layers = len(states)
        if n_layers != len(self.spec.layer_ids):
            raise StoreError(f"sample {sample_id}: {n_layers} layers, store expects {len(self.spec.layer_ids)}")
        t = int(input_ids.shape[0])
        for k in range(n_layers):
            if tuple(states[k].shape) != (t, self.spec.hidden_size):
                raise StoreError(
                    f"sample {sample_id}: layer {self.spec.layer_ids[k]} has shape "
                    f"{tuple(states[k].shape)}, expected ({t}, {self.spec.hidden_size})"
                )
        self._pending.append((sample_id, input_ids, loss_mask, states))
        self._pending_tokens += t
        if self._pending_tokens >= self.shard_tokens or (
            self.shard_samples and len(self._pending) >= self.shard_samples
        ):
            self._cut()

    def take_done(self) -> list[ShardInfo]:
        """Finished shards in index order (a shard waits for all lower-numbered ones)."""
        self._raise_if_failed()
        done = []
        with self._lock:
            while self._release in self._finished:
                done.append(self._finished.pop(self._release))
                self._release += 1
        return done

    def seal(self) -> list[ShardInfo]:
        """The open shard cut and queued (written now without threads); the shards finished so far."""
        if self._pending:
            self._cut()
        return self.take_done()

    def flush(self) -> list[ShardInfo]:
        """The open shard cut, every queued shard written: the shards not yet taken."""
        done = self.seal()
        if self._queue is not None:
            self._queue.join()
        return done + self.take_done()

    def close(self) -> None:
        """End the writer's threads once every shard queued has been written. A submit from another thread after
        this begins writes its shard itself; one already putting into the queue finishes first (a shard put behind
        the threads' stop would never be written)."""
        with self._lock:
            q, self._queue = self._queue, None
            while self._submitting:
                self._idle.wait()
        if q is not None:
            for _ in self._threads:
                q.put(None)
            for t in self._threads:
                t.join()

    def _cut(self) -> None:
        batch, self._pending, self._pending_tokens = self._pending, [], 0
        self.submit(lambda: (shard_tensors(batch, self.spec), [b[0] for b in batch]))

    def submit(self, build: Callable[[], tuple[dict, list[str]]], on_done: Callable[[], None] | None = None) -> None:
        """Queue one shard: build() -> (tensors, sample_ids) runs in the writer; on_done() after the write."""
        with self._lock:  # the capture's consumer thread and the forward both hand over shards
            index = self.next_index
            self.next_index += 1
            q = self._queue
            if q is not None:
                self._submitting += 1
        if q is None:
            self._write(shard_name(index), build, on_done)
            return
        try:
            self._raise_if_failed()
            q.put((shard_name(index), build, on_done))
        finally:
            with self._lock:
                self._submitting -= 1
                self._idle.notify_all()

    def _worker(self, q: queue.Queue) -> None:
        while True:
            item = q.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                self._error = e
            finally:
                q.task_done()

    def _write(self, name: str, build, on_done=None) -> None:
        try:
            tensors, sample_ids = build()
            info = write_shard(self.root, name, tensors, self.spec, sample_ids, self.fsync, self.fault, self.writer_id)
        finally:
            if on_done is not None:
                on_done()
        with self._lock:
            self._finished[shard_index(name)] = info
            self.written.append(name)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error
