"""The CLI's preflight checks of store folders: who writes them, how complete they are, whether a folder may
become one. Standard library only (lock.py, status.py): well under a second, nothing created."""

from __future__ import annotations

from pathlib import Path

from eagle3.preflight import UsageError
from eagle3.store import lock, status


def output_store(path: str | Path, command: str) -> None:
    """An --out folder a store may be written into: a store no other process writes, or a folder that holds
    nothing but a store's own files (an empty or new one)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"--out {p}: is a file; give a new folder for the store")
    if (p / status.MANIFEST).is_file():
        store_not_busy(p, command)
        return
    why = lock.foreign_files_message(p)
    if why:
        raise UsageError(why)


def store_not_busy(path: str | Path, command: str) -> None:
    try:
        lock.refuse_if_busy(path, command)
    except lock.StoreBusy as e:
        raise UsageError(str(e)) from None


def store_trainable(path: str | Path, allow_incomplete: bool) -> None:
    """A store no process writes now, holding every sample its plan names (or --allow-incomplete)."""
    store_not_busy(path, "train")
    why = status.incomplete_message(path)
    if why and not allow_incomplete:
        raise UsageError(why)
