"""An engine in the trainer's process and torch.compile, kept apart (`train --online --engine-in-process --compile`).

While dynamo and AOTAutograd trace a graph, torch.fx marks the whole process as tracing and patches
torch.nn.Module.__call__ for every thread. vLLM's forward, run by the producer thread at that moment, then goes
through the tracer and fails in its first torch.compile'd helper ("Detected that you are using FX to symbolically
trace a dynamo-optimized function": the trainer's first compiled step beside kimi-depth's engine on an H200,
2026-12-05, at 08e9a75). The gate: the producer holds it while the engine runs a batch; a compile takes it first
(dynamo's start and end callbacks, which also wrap AOTAutograd's lazy backward compile), so a compile waits for the
batch in flight and the next batch waits for the compile. The producer's waits behind a compile are kept as
(from, to), like its waits for room in the spool.

A compile in the producer's own thread (a vLLM helper compiled mid-run; vLLM compiles them while it starts, and
dynamic=True keeps them from recompiling) re-enters the gate. Were the trainer to start a compile at that moment, it
would hold dynamo's callback lock while waiting for the gate: it gives up after ``timeout`` seconds with an error
that says so, rather than hang.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

GATE_TIMEOUT_S = 600.0


class CompileGate:
    def __init__(self, timeout: float = GATE_TIMEOUT_S):
        self._lock = threading.RLock()
        self.timeout = timeout
        self.waits: list[tuple[float, float]] = []  # the producer's, behind a compile: (perf_counter from, to)
        self.compiles = 0  # compiles that took the gate (dynamo frames and lazy backward graphs)
        self._mine = threading.local()  # compiles this thread holds the gate for (an _end after a failed _start: none)

    @contextmanager
    def engine(self):
        """Around one engine batch (the producer's thread)."""
        if not self._lock.acquire(blocking=False):
            t0 = time.perf_counter()
            self._lock.acquire()
            self.waits.append((t0, time.perf_counter()))
        try:
            yield
        finally:
            self._lock.release()

    def _start(self, args=None) -> None:
        if not self._lock.acquire(timeout=self.timeout):
            raise RuntimeError(f"a torch.compile waited {self.timeout:.0f} s for the engine's batch in flight "
                               "(--engine-in-process): the engine is itself compiling or stuck; run without "
                               "--compile, or with the engine in its own process")
        self.compiles += 1
        self._mine.n = getattr(self._mine, "n", 0) + 1

    def _end(self, args=None) -> None:
        # dynamo runs the end callbacks even where a start callback raised (its try/finally): release only what
        # this thread took, or the release raises there and dynamo's pending count stays up, the gate off for good
        if getattr(self._mine, "n", 0) > 0:
            self._mine.n -= 1
            self._lock.release()

    @property
    def waited_s(self) -> float:
        return sum(b - a for a, b in self.waits)

    def install(self) -> "CompileGate":
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)
        return self

    def remove(self) -> None:
        from torch._dynamo.callback import callback_handler

        for remove, cb in ((callback_handler.remove_start_callback, self._start),
                           (callback_handler.remove_end_callback, self._end)):
            try:
                remove(cb)
            except ValueError:  # never installed, or torch._dynamo.reset() cleared them
                pass
