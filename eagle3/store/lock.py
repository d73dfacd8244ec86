"""One writer per store, and what a store folder may hold. Standard library only: the CLI's preflight reads it in
well under a second.

The writer holds an exclusive ``flock`` on STORE/lock.json for as long as it writes; the kernel releases it when the
process ends, however it ends (kill -9 included), so a stale lock never blocks a rerun. The file holds the
holder's pid and command line, for the message that refuses a second writer or a reader of a store being written.

``foreign_files`` is what protects a user's files: a folder may become a store only if every name in it is one the
store itself writes; anything else refuses the extraction, and cleaning up touches only the store's own names.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

LOCK = "lock.json"  # JSON like every file of a store but its shards

# Names a store writes at its top level (files or folders) and in shards/ (see eagle3/store/format.py, files.py)
OWN_TOP = frozenset({"manifest.json", "plan.json", "rejects.jsonl", "shards", "quarantine", ".selfcheck", LOCK,
                     "online.json"})  # online.json: an online spool's run stamp (eagle3/train/online.py)
OWN_TOP_PATTERN = re.compile(r"\.tmp-.*")  # atomic_write's temp files, the write probe
OWN_SHARD = re.compile(r"(\.tmp-)?shard-\d{6,}\.safetensors")


class StoreBusy(RuntimeError):
    """Another process writes this store."""


def is_own_shard_name(name: str) -> bool:
    return OWN_SHARD.fullmatch(name) is not None


def foreign_files(root: str | Path) -> list[Path]:
    """Paths in ``root`` (and its shards/) that the store does not write: a user's files."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = [p for p in sorted(root.iterdir()) if p.name not in OWN_TOP and not OWN_TOP_PATTERN.fullmatch(p.name)]
    shards = root / "shards"
    if shards.is_dir() and not shards.is_symlink():
        out += [p for p in sorted(shards.iterdir()) if not is_own_shard_name(p.name)]
    elif shards.exists():
        out.append(shards)
    return out


def foreign_files_message(root: str | Path) -> str | None:
    """Why ``root`` (not a store yet) may not become one, or None when it may."""
    foreign = foreign_files(root)
    if not foreign:
        return None
    names = ", ".join(str(p.relative_to(root)) for p in foreign[:5]) + (f" and {len(foreign) - 5} more"
                                                                         if len(foreign) > 5 else "")
    return (f"{root} is not a store and holds files that are not a store's ({names}); nothing was written. "
            "Give an empty or new --out folder")


def holder(root: str | Path) -> str:
    """'pid N (command)' of the process that wrote STORE/lock.json last (the holder, while it is held)."""
    try:
        info = json.loads((Path(root) / LOCK).read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info.get("pid"):
        return "another process (its pid was not recorded yet)"
    return f"pid {info['pid']} ({info.get('command', '?')}, since {info.get('since', '?')})"


def being_written(root: str | Path) -> str | None:
    """The holder ('pid N (...)') when a process holds the store's write lock now, else None. Holds no lock after."""
    with no_writer(root) as alone:
        return None if alone else holder(root)


@contextmanager
def no_writer(root: str | Path) -> Iterator[bool]:
    """True, holding a shared lock on the store (no writer can start meanwhile), when no process holds its write
    lock; False when one does (this process included: a second descriptor conflicts with the writer's)."""
    try:
        fd = os.open(Path(root) / LOCK, os.O_RDONLY)
    except OSError:
        yield True  # never locked (a store made before the lock existed, or read-only media)
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing the descriptor drops the shared lock it took


def _command_line() -> str:
    """This process's command line as the shell showed it (/proc, where there is one), at most 300 characters."""
    try:
        words = Path("/proc/self/cmdline").read_bytes().decode(errors="replace").rstrip("\0").split("\0")
    except OSError:
        words = [sys.executable, *sys.argv]
    text = " ".join(words)
    return text if len(text) <= 300 else text[:297] + "..."


def _busy(root: str | Path, who: str, what: str) -> StoreBusy:
    return StoreBusy(f"{root} is being written by {who}; one process writes a store at a time. Wait for it to "
                     f"finish (or stop it), then {what} again")


def refuse_if_busy(root: str | Path, what: str) -> None:
    """StoreBusy when a process writes the store at ``root`` now; ``what``: the user's command, for the message."""
    who = being_written(root)
    if who:
        raise _busy(root, who, what)


class WriteLock:
    """The exclusive write lock of the store at ``root`` (the folder must exist). ``release()`` or process death
    frees it."""

    def __init__(self, root: str | Path, what: str = "run the command"):
        self.root = Path(root)
        self.fd: int | None = None
        fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _busy(self.root, holder(self.root), what) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "command": _command_line(),
                                 "since": time.strftime("%Y-%m-%dT%H:%M:%S")}).encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # the lock goes with the descriptor; the file (pid of the last writer) stays
            self.fd = None

    def __del__(self):
        self.release()
