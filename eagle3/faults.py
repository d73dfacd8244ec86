"""Kill points for fault-injection tests: ``EAGLE3_FAULT=point:k`` SIGKILLs the process at the k-th time
``point`` is reached; ``point:k:SIGINT`` (or any signal name) sends that signal instead, as Ctrl-C or a scheduler
would. Points: after_batch, mid_write, before_rename, before_manifest, after_commit, after_step, mid_checkpoint.
Unset (production): ``from_env()`` returns None and nothing is checked.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import Callable


def killer(point: str, k: int, sig: int = signal.SIGKILL) -> Callable[[str], None]:
    seen: Counter = Counter()

    def hit(name: str) -> None:
        seen[name] += 1
        if name == point and seen[name] == k:
            os.kill(os.getpid(), sig)

    return hit


def from_env() -> Callable[[str], None] | None:
    spec = os.environ.get("EAGLE3_FAULT")
    if not spec:
        return None
    point, _, rest = spec.partition(":")
    k, _, sig = rest.partition(":")
    return killer(point, int(k or 1), getattr(signal, sig) if sig else signal.SIGKILL)
