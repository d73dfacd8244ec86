"""Ctrl-C and SIGTERM: Interrupted (the exception a command ends with), and Deferred, which holds a signal back until
a training step has finished, so the run can save that step before it ends. A second signal ends it at once."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; ``signum`` says which (the exit code is 128 + signum). ``saved``: the checkpoint the
    run wrote at the interrupt, where it wrote one."""

    def __init__(self, signum: int, saved: Path | None = None):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.saved = signum, saved


class Deferred:
    """Within it, the first SIGINT or SIGTERM only sets ``signum`` (and puts the handlers back as they were, so a
    second one acts at once); the loop asks ``signum`` between steps. Outside the main thread it defers nothing."""

    def __init__(self):
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    def _hold(self, signum, frame) -> None:
        self.signum = signum
        self._restore()
        log.warning(
            "%s: the step in progress finishes and a checkpoint of it is written (again to stop at once)",
            signal.Signals(signum).name,
        )

    def _restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._old = {}

    def __enter__(self) -> Deferred:
        if threading.current_thread() is threading.main_thread():
            self._old = {sig: signal.getsignal(sig) for sig in SIGNALS}
            for sig in SIGNALS:
                signal.signal(sig, self._hold)
        return self

    def __exit__(self, *exc) -> None:
        self._restore()
