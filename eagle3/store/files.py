"""Durable writes: temp name, fsync, rename, fsync the folder; every byte goes through write_chunks."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

from eagle3.store.format import StoreError


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_chunks(f, chunks: Sequence[memoryview]) -> None:
    """Every byte write of the store goes through here (tests replace it to simulate a full disk)."""
    for c in chunks:
        f.write(c)


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in 16 MiB chunks (what the manifest records at commit)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def atomic_write(path: Path, chunks: Sequence[memoryview | bytes], fsync: bool = True,
                 fault: Callable[[str], None] | None = None) -> tuple[str, int]:
    """Write to .tmp-NAME, fsync, rename over NAME, fsync the folder. Returns (sha256, bytes).

    On any error the temp file is removed and the destination is untouched.
    """
    tmp = path.with_name(f".tmp-{path.name}")
    h, n = hashlib.sha256(), 0
    views = [memoryview(c) for c in chunks]
    try:
        with open(tmp, "wb") as f:
            half = len(views) // 2
            write_chunks(f, views[:half])
            if fault:
                fault("mid_write")
            write_chunks(f, views[half:])
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        for v in views:
            h.update(v)
            n += v.nbytes
        if fault:
            fault("before_rename")
        os.replace(tmp, path)
        if fsync:
            _fsync_dir(path.parent)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise StoreError(
                f"disk full while writing {path} ({n} bytes so far). Free space or choose another output "
                f"folder; the store stays consistent at its last commit, and rerunning the same command resumes."
            ) from e
        raise
    return h.hexdigest(), n


def atomic_write_json(path: Path, obj: Any, fsync: bool = True, fault=None) -> None:
    atomic_write(path, [json.dumps(obj, indent=1).encode()], fsync=fsync, fault=fault)
