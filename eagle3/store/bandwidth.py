"""What a disk can take from the store: its write pattern (parallel writers, shard-sized files written in 64 MiB
pieces), fsynced or into the page cache, timed. `eagle3 bench disk` and the GPU benchmark's disk limit run this.

A store's rate is bounded by min(prefill, bytes/s / bytes a token): at Kimi-K2.5's 57,344 B a token (4 layers x
7168 x bf16) a disk taking 1.25 GB/s fsynced holds a store to 21,800 tok/s.
"""

from __future__ import annotations

import itertools
import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3.store.format import SHARD_BYTES

PIECE = 64 << 20  # bytes a write() call: what the shard writer hands the file system at most


@dataclass
class DiskFigure:
    fsync: bool
    round_bytes: int  # written (and removed) in each round
    seconds: list[float]  # each timed round

    @property
    def bytes_per_s(self) -> float:
        return self.round_bytes / statistics.median(self.seconds)


def write_round(
    folder: str | Path, fsync: bool, writers: int = 4, files: int = 4, file_bytes: int = SHARD_BYTES
) -> int:
    """``writers`` threads each write ``files`` files of ``file_bytes`` (a whole number of MiB) into folder, each
    fsynced or not, closed and removed. Returns the bytes written; a writer's error is raised, no file is left."""
    if file_bytes <= 0 or file_bytes % (1 << 20):
        raise ValueError(f"file_bytes {file_bytes}: a positive whole number of MiB")
    piece = os.urandom(1 << 20) * (min(PIECE, file_bytes) >> 20)
    pieces = file_bytes // len(piece)
    errors: list[BaseException] = []

    def writer(k: int) -> None:
        for n in range(files):
            path = Path(folder) / f".eagle3-disk-{os.getpid()}-{k}-{n}.bin"
            try:
                with open(path, "wb") as f:
                    f.writelines(itertools.repeat(piece, pieces))  # the same bytes each time: no copy
                    f.flush()
                    if fsync:
                        os.fsync(f.fileno())
            except BaseException as e:  # noqa: BLE001 - raised by the caller's thread
                errors.append(e)
                return
            finally:
                path.unlink(missing_ok=True)

    threads = [threading.Thread(target=writer, args=(k,), name=f"eagle3-disk-{k}") for k in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return writers * files * pieces * len(piece)


def measure(
    folder: str | Path,
    fsync: bool,
    writers: int = 4,
    files: int = 4,
    file_bytes: int = SHARD_BYTES,
    rounds: int = 2,
    warmup: int = 1,
) -> DiskFigure:
    """``warmup`` untimed rounds, then ``rounds`` timed ones; bytes_per_s uses their median."""
    for _ in range(warmup):
        write_round(folder, fsync, writers, files, file_bytes)
    seconds, written = [], 0
    for _ in range(rounds):
        t0 = time.perf_counter()
        written = write_round(folder, fsync, writers, files, file_bytes)
        seconds.append(time.perf_counter() - t0)
    return DiskFigure(fsync, written, seconds)
