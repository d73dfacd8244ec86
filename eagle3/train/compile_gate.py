"""An engine in the trainer's process and torch.compile, kept apart (`train --online --engine-in-process --compile`).

While dynamo and AOTAutograd trace a graph, torch.fx marks the whole process as tracing and patches
torch.nn.Module.__call__ for every thread. vLLM's forward, run by the producer thread at that moment, then goes
through the tracer and fails in its first torch.compile'd helper ("Detected that you are using FX to symbolically
trace a dynamo-optimized function").

The gate is dynamo's own compile lock (torch._dynamo.convert_frame.compile_lock, a re-entrant lock that every frame's
compile holds from its tracing to its compiled code): the producer holds it while the engine runs a batch, so a
compile waits for the batch in flight and the next batch waits for the compile. A compile in the producer's own
thread (a vLLM helper compiled mid-run) re-enters it. AOTAutograd's backward graphs, compiled lazily at the first
backward and outside that lock by default, compile with their forward while the gate is installed
(torch._functorch.config.force_non_lazy_backward_lowering). Dynamo's start callback only counts the compiles (and
any backward compiled lazily all the same, `lazy`: not kept apart from the engine). Nothing waits inside dynamo's
callbacks: a lock taken there is taken while dynamo holds its compile lock and its callback lock, and a batch that
needed a compile of its own would deadlock with the compile waiting for it (tests/unit/test_compile_gate.py). The
producer's waits behind a compile are kept as (from, to), like its waits for room in the spool.
"""

from __future__ import annotations

import time
from contextlib import contextmanager


class CompileGate:
    def __init__(self):
        import torch
        from torch._dynamo import convert_frame

        lock = getattr(convert_frame, "compile_lock", None)
        if lock is None:
            raise RuntimeError(
                f"torch {torch.__version__}: dynamo has no compile lock to keep the engine's batches "
                "and the trainer's compiles apart; train without --compile beside the engine, or with "
                "the engine in its own process (no --engine-in-process)"
            )
        self._lock = lock
        self.waits: list[tuple[float, float]] = []  # the producer's, behind a compile: (perf_counter from, to)
        # compiles dynamo started while the gate was installed (frames: backward graphs compile with their forward),
        # and of them backward graphs compiled lazily all the same (not kept apart from the engine)
        self.compiles = 0
        self.lazy = 0
        self._lowering: bool | None = None  # force_non_lazy_backward_lowering as it was before install

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
        self.compiles += 1
        trigger = getattr(args, "callback_trigger", None)
        if getattr(trigger, "name", "") == "LAZY_BACKWARD":
            self.lazy += 1

    @property
    def waited_s(self) -> float:
        return sum(b - a for a, b in self.waits)

    def install(self) -> CompileGate:
        import torch._functorch.config as functorch_config
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(self._start)
        if self._lowering is None:
            self._lowering = functorch_config.force_non_lazy_backward_lowering
            functorch_config.force_non_lazy_backward_lowering = True
        return self

    def remove(self) -> None:
        import torch._functorch.config as functorch_config
        from torch._dynamo.callback import callback_handler

        try:
            callback_handler.remove_start_callback(self._start)
        except ValueError:  # never installed, or torch._dynamo.reset() cleared it
            pass
        if self._lowering is not None:
            functorch_config.force_non_lazy_backward_lowering = self._lowering
            self._lowering = None
