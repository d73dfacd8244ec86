"""How long a Python thread of this process waits to run again: a thread that sleeps a short interval over and over
and records how late it wakes. Late wakes are time spent waiting for the GIL (another thread held it, up to
sys.getswitchinterval() at a time) or for a core. In a vLLM worker at TP 1 the engine's scheduler and model runner
share the process, and the GIL, with the capture's consumer and the shard writers: if those hold it, every step's
Python waits, and the sampler sees the same waits."""

from __future__ import annotations

import threading
import time

OVER_MS = (1, 5, 20)  # the share of wakes later than each of these, in ms


class GilSampler:
    def __init__(self, interval_s: float = 0.002):
        self.interval = interval_s
        self.samples, self.late_s, self.max_s = 0, 0.0, 0.0
        self.over = dict.fromkeys(OVER_MS, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eagle3-gil-sampler", daemon=True)

    def start(self) -> GilSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(self.interval)
            late = max(0.0, time.perf_counter() - t0 - self.interval)
            self.samples += 1
            self.late_s += late
            self.max_s = max(self.max_s, late)
            for ms in OVER_MS:
                self.over[ms] += late * 1e3 > ms

    def summary(self) -> dict:
        """{"samples", "late_ms_mean", "late_ms_max", "late_over_ms": {"1": share, "5": share, "20": share}}"""
        n = self.samples
        return {
            "samples": n,
            "late_ms_mean": round(self.late_s / n * 1e3, 3) if n else None,
            "late_ms_max": round(self.max_s * 1e3, 2),
            "late_over_ms": {str(ms): round(k / n, 4) if n else None for ms, k in self.over.items()},
        }
