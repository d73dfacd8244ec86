"""Step s + 1's samples read and packed in a background thread while step s trains.

Reading a step (the store's mmap'd shards, the finiteness check, packing into one sequence) is CPU work the GPU
need not wait for. One thread reads one step ahead, the steps in order, so a source is read as in the loop: the
same samples in the same order, by one thread at a time. What reading raised is raised where the step that needs
it begins (take), as if read there. The thread is a daemon: a run that stops early leaves no reader behind (it
may be waiting on an online spool that never fills)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class ReadAhead:
    def __init__(self, read: Callable[[int], Any], enabled: bool = True):
        self.read, self.enabled = read, enabled
        self.pending: tuple[int, threading.Thread, dict] | None = None

    def start(self, step: int) -> None:
        """Begin reading ``step`` (disabled: nothing; take reads it then)."""
        if not self.enabled:
            return
        box: dict = {}

        def run() -> None:
            try:
                box["value"] = self.read(step)
            except BaseException as e:  # noqa: BLE001 - handed to take(), raised in the trainer's thread
                box["error"] = e

        t = threading.Thread(target=run, daemon=True, name=f"eagle3-read-step-{step}")
        t.start()
        self.pending = (step, t, box)

    def take(self, step: int) -> Any:
        """Step ``step``'s read: the one begun ahead, or read now."""
        if self.pending is not None and self.pending[0] != step:
            self.pending[1].join()  # another step's read (not the loop's order): never two readers at once
            self.pending = None
        if self.pending is None:
            return self.read(step)
        _, t, box = self.pending
        self.pending = None
        t.join()
        if "error" in box:
            raise box["error"]
        return box["value"]
