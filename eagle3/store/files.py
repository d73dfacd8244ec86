"""Durable writes: temp name, fsync, rename, fsync the folder (a shard's folder: once per commit, folder.py); every
byte goes through write_chunks."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from eagle3.store.format import StoreError


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_chunks(f, chunks: Sequence[memoryview]) -> None:
    """Every byte write of the store goes through here (tests replace it to simulate a full disk)."""
    for c in chunks:
        f.write(c)


try:  # xxh3_128: about 12 GB/s per core and it releases the GIL; sha256 about 1.3 GB/s
    import xxhash  # noqa: F401

    CHECKSUM = "xxh3_128"
except ImportError:  # pragma: no cover - xxhash comes with datasets, which speculators needs
    CHECKSUM = "sha256"


def hasher(algo: str):
    if algo == "xxh3_128":
        try:
            import xxhash
        except ImportError:
            raise StoreError(
                "this store's shards are checksummed with xxh3_128 and the xxhash package is missing "
                "here: pip install xxhash"
            ) from None
        return xxhash.xxh3_128()
    if algo == "sha256":
        return hashlib.sha256()
    raise StoreError(f"unknown checksum algorithm {algo!r} (this eagle3 knows xxh3_128 and sha256)")


def file_checksum(path: Path, algo: str = CHECKSUM) -> str:
    """ "ALGO:HEX" of a file, read in 16 MiB chunks (what the manifest records at commit)."""
    h = hasher(algo)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return f"{algo}:{h.hexdigest()}"


def recorded_checksum(shard: dict) -> str:
    """A manifest entry's "ALGO:HEX" (older stores record a bare "sha256")."""
    return shard.get("checksum") or f"sha256:{shard['sha256']}"


def checksum_matches(path: Path, shard: dict) -> bool:
    recorded = recorded_checksum(shard)
    return file_checksum(path, recorded.split(":", 1)[0]) == recorded


def atomic_write(
    path: Path,
    chunks: Sequence[memoryview | bytes],
    fsync: bool = True,
    fault: Callable[[str], None] | None = None,
    sync_dir: bool = True,
) -> tuple[str, int]:
    """Write to .tmp-NAME, fsync, rename over NAME, fsync the folder (``sync_dir=False``: the caller does, once for
    many files, before anything names them). Returns ("ALGO:HEX" checksum, bytes).

    On any error the temp file is removed and the destination is untouched.
    """
    tmp = path.with_name(f".tmp-{path.name}")
    h, n = hasher(CHECKSUM), 0
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
        if fsync and sync_dir:
            fsync_dir(path.parent)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise StoreError(
                f"disk full while writing {path} ({n} bytes so far). Free space or choose another output "
                f"folder; the store stays consistent at its last commit, and rerunning the same command resumes."
            ) from e
        raise
    return f"{CHECKSUM}:{h.hexdigest()}", n


def atomic_write_json(path: Path, obj: Any, fsync: bool = True, fault=None) -> None:
    atomic_write(path, [json.dumps(obj, indent=1).encode()], fsync=fsync, fault=fault)
