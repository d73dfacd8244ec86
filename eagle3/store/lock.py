"""One writer per store, and what a store folder may hold. Standard library only: the CLI's preflight reads it in
well under a second.

The writer holds an exclusive ``flock`` on STORE/lock.json for as long as it writes; the kernel releases it when the
process ends, however it ends (kill -9 included), so a stale lock never blocks a rerun. The file holds the
holder's pid and command line, for the message that refuses a second writer or a reader of a store being written.

A folder becomes a store only where eagle3/ownership.py allows it (new, empty, or marked as a store); inside a store,
cleaning up touches only the names the store itself writes (OWN_TOP, OWN_SHARD, their temp files).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK = "lock.json"  # JSON like every file of a store but its shards

# Names a store writes at its top level (files or folders) and in shards/ (see eagle3/store/format.py, files.py)
OWN_TOP = frozenset(
    {"manifest.json", "plan.json", "rejects.jsonl", "shards", "quarantine", ".selfcheck", LOCK, "online.json"}
)  # online.json: an online spool's run stamp (eagle3/train/online.py)
OWN_SHARD = re.compile(r"(\.tmp-)?shard-\d{6,}\.safetensors")


class StoreBusy(RuntimeError):
    """Another process writes this store."""


def is_own_shard_name(name: str) -> bool:
    return OWN_SHARD.fullmatch(name) is not None


def is_own_temp_name(name: str) -> bool:
    """A temp file the store writes at its top level: atomic_write's .tmp-NAME of a NAME in OWN_TOP, the write probe."""
    return name.startswith(".tmp-") and (name[5:] in OWN_TOP or name == ".tmp-write-probe")


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
    return StoreBusy(
        f"{root} is being written by {who}; one process writes a store at a time. Wait for it to "
        f"finish (or stop it), then {what} again"
    )


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
        os.write(
            fd,
            json.dumps(
                {"pid": os.getpid(), "command": _command_line(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
            ).encode(),
        )
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # the lock goes with the descriptor; the file (pid of the last writer) stays
            self.fd = None

    def __del__(self):
        self.release()
