"""Which folders a command may write into: a new one, an empty one, or one it made itself.

A folder a command makes holds a marker, MARK, written before anything else; a rerun recognises its folder by the
marker, never by the names of the files in it. A non-empty folder without the command's marker is the user's: it is
refused before anything is written, so no command removes, replaces or writes over a file it did not create.
Standard library only: the CLI's preflight calls it in well under a second.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from eagle3.preflight import UsageError

MARK = ".eagle3-out.json"  # {"kind": one of KINDS, "created": ISO time}
TEMP_MARK = f".tmp-{MARK}."  # write_new's temp names of it

KINDS = {  # what a folder of each kind is, for messages
    "store": "a shard store (eagle3 extract, or train --online's spool)",
    "train": "a training run (eagle3 train)",
    "eval": "an evaluation (eagle3 eval)",
    "bench": "a benchmark report (eagle3 bench report)",
    "target": "a learnable target (eagle3 make-target)",
    "demo": "a demo run (eagle3 demo)",
}


def owner(folder: str | Path) -> str | None:
    """The kind recorded in ``folder``'s marker; None where there is no valid one."""
    try:
        kind = json.loads((Path(folder) / MARK).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if kind in KINDS else None


def _entries(folder: Path) -> list[str]:
    """What ``folder`` holds ("name/" for a folder), a marker being written (write_new's temp file) left out."""
    return sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir() if not p.name.startswith(TEMP_MARK))


def refusal(folder: str | Path, kind: str, option: str = "--out") -> str | None:
    """Why ``folder`` may not be written as ``kind``, or None: it does not exist, is empty, or is marked ``kind``."""
    p = Path(folder)
    if not p.exists():
        return None
    if not p.is_dir():
        return f"{option} {p}: is a file; give a new folder"
    # listed before the marker is read: a marker another rank writes in between is then not taken for a user's file
    entries = _entries(p)
    found = owner(p)
    if found == kind:
        return None
    if found is not None:
        return (
            f"{option} {p} holds {KINDS[found]}, not {KINDS[kind]}; nothing was written. Give a new or empty "
            f"{option} folder"
        )
    if not entries:
        return None
    names = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    return (
        f"{option} {p} is not empty and eagle3 did not make it (it holds {names}); nothing was written, "
        f"nothing removed. Give a new or empty {option} folder"
    )


def check(folder: str | Path, kind: str, option: str = "--out") -> None:
    """UsageError where ``folder`` may not be written as ``kind`` (refusal)."""
    why = refusal(folder, kind, option)
    if why:
        raise UsageError(why)


def claim(folder: str | Path, kind: str, option: str = "--out") -> Path:
    """Make ``folder`` ``kind``'s: checked (UsageError), created, and marked before anything else is written."""
    p = Path(folder)
    check(p, kind, option)
    p.mkdir(parents=True, exist_ok=True)
    if owner(p) != kind:
        write_new(p / MARK, json.dumps({"kind": kind, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}).encode())
    return p


@contextmanager
def claimed(folder: str | Path, kind: str, option: str = "--out") -> Iterator[Path]:
    """claim ``folder``; where the block raises, put it back as it was: removed where this made it, emptied where it
    was empty. A folder of ``kind`` from an earlier run is left as it is (a rerun resumes or rewrites it)."""
    p = Path(folder)
    before = "new" if not p.exists() else "empty" if p.is_dir() and not any(p.iterdir()) else "kept"
    p = claim(p, kind, option)
    try:
        yield p
    except BaseException:
        if before == "new":
            shutil.rmtree(p, ignore_errors=True)
        elif before == "empty":
            for child in p.iterdir():
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        raise


def write_new(path: Path, data: bytes) -> None:
    """``data`` at ``path`` through a temp file of a name no one else has (mkstemp), renamed into place."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
