"""The CLI's preflight checks of store folders: who writes them, how complete they are, whether a folder may
become one. Standard library only (lock.py, status.py): well under a second, nothing created."""

from __future__ import annotations

from pathlib import Path

from eagle3 import ownership
from eagle3.preflight import UsageError
from eagle3.store import lock, status


def output_store(path: str | Path, command: str) -> None:
    """An --out folder a store may be written into: a new or empty folder, or a store (ownership.py) no other
    process writes."""
    ownership.check(path, "store")
    if (Path(path) / status.MANIFEST).is_file():
        store_not_busy(path, command)


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
