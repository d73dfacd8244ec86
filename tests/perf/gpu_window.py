"""How the GPU's time went over a window of wall time (issue 42: an online run's profile, where its goal is missed).

``Window(after_s, seconds)``, started beside a run, records every CUDA kernel this process launches (torch.profiler,
CUPTI: all threads and streams) from after_s to after_s + seconds after its start; ``stop()`` returns
``streams_busy`` of that trace: per CUDA stream, its kernels' busy time and share of the window, and over all streams
the busy time, the idle share and the overlap (time two or more streams ran kernels at once). With the engine in this
process (`train --online --engine-in-process`) the trace holds both sides; with the engine in its own process, only
the trainer's.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections import defaultdict

US = 1e-6  # the chrome trace's timestamps and durations are microseconds


def union_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of [start, end) intervals in microseconds."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total * US


def streams_busy(trace: dict, top: int = 3) -> dict:
    """A chrome trace's kernels (events of cat "kernel", args.stream) summed: {"span_s": first start to last end,
    "busy_s": union over streams, "idle_share", "overlap_s": sum of the streams' busy time less the union (for two
    streams, the time both ran), "streams": {id: {"kernels", "busy_s", "share" of the span, "top": the names with the
    most kernel time}}}."""
    by_stream: dict[str, list[tuple[float, float]]] = defaultdict(list)
    names: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") != "kernel":
            continue
        stream = str(e.get("args", {}).get("stream", "?"))
        start, dur = float(e["ts"]), float(e.get("dur", 0))
        by_stream[stream].append((start, start + dur))
        names[stream][e.get("name", "?")] += dur * US
    every = [iv for ivs in by_stream.values() for iv in ivs]
    if not every:
        return {"span_s": 0.0, "busy_s": 0.0, "idle_share": None, "overlap_s": 0.0, "streams": {}}
    span = (max(b for _, b in every) - min(a for a, _ in every)) * US
    busy = union_s(every)
    own = {stream: union_s(ivs) for stream, ivs in by_stream.items()}
    streams = {}
    for stream in sorted(own, key=lambda k: -own[k]):
        streams[stream] = {
            "kernels": len(by_stream[stream]),
            "busy_s": round(own[stream], 6),
            "share": round(own[stream] / span, 3) if span else 0,
            "top": [n[:80] for n, _ in sorted(names[stream].items(), key=lambda kv: -kv[1])[:top]],
        }
    overlap = sum(s["busy_s"] for s in streams.values()) - busy
    return {
        "span_s": round(span, 6),
        "busy_s": round(busy, 6),
        "idle_share": round(1 - busy / span, 3) if span else 0,
        "overlap_s": round(max(overlap, 0.0), 6),
        "streams": streams,
    }


class Window:
    """torch.profiler over [after_s, after_s + seconds) from start(), in a thread of its own; stop() ends it (early if
    the run ended first: then only what was recorded, or None where the window had not opened). ``with Window(...)``
    starts and stops it around a run."""

    def __init__(self, after_s: float, seconds: float, cuda: bool = True):
        self.after_s, self.seconds, self.cuda = after_s, seconds, cuda
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-window", daemon=True)
        self.summary: dict | None = None
        self.error: str | None = None

    def start(self) -> Window:
        self._thread.start()
        return self

    def _run(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        if self._stop.wait(self.after_s):
            return
        try:
            with profile(activities=[ProfilerActivity.CUDA if self.cuda else ProfilerActivity.CPU]) as prof:
                self._stop.wait(self.seconds)
            fd, path = tempfile.mkstemp(suffix=".json")
            os.close(fd)
            try:
                prof.export_chrome_trace(path)
                with open(path) as f:
                    self.summary = streams_busy(json.load(f))
            finally:
                os.unlink(path)
        except Exception as e:  # a measurement aid: a failure is reported, never the run's
            self.error = f"{type(e).__name__}: {e}"

    def stop(self) -> dict | None:
        self._stop.set()
        self._thread.join()
        return self.summary

    def __enter__(self) -> Window:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
