"""Every thread's Python stack written to a file at a fixed period, for long GPU tests: a slow or stuck run says
where it is. A Python thread takes each dump under the GIL (sys._current_frames), so every frame it reads is
whole. faulthandler.dump_traceback_later reads other threads' frames without the GIL: on the H200 (the 73a4e94 run)
it crashed the online test twice with SIGSEGV in the middle of a dump, while the main thread trained (a known
CPython crash: python/cpython#131580, #116008, #140815)."""

from __future__ import annotations

import sys
import threading
import time
import traceback
from pathlib import Path


class PeriodicStacks:
    """``with PeriodicStacks(path, every=120):`` appends a dump of every thread to PATH each ``every`` seconds."""

    def __init__(self, path: str | Path, every: float = 120.0):
        self.path, self.every = Path(path), every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eagle3-stacks", daemon=True)

    def __enter__(self) -> PeriodicStacks:  # noqa: PYI034 - typing.Self needs Python 3.11; 3.10 is supported
        self._t0 = time.perf_counter()
        self.path.write_text("")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.dump()

    def dump(self) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        lines = [f"--- stacks at {time.perf_counter() - self._t0:.0f} s\n"]
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue  # this thread
            lines.append(f"Thread {names.get(ident, '?')} ({ident:#x}), most recent call last:\n")
            lines.extend(traceback.format_stack(frame))
            lines.append("\n")
        with self.path.open("a") as f:
            f.writelines(lines)
