"""The GIL sampler (eagle3.extract.gil): a thread holding the GIL in pure Python shows as late wakes, measured
against the same sampler without it in the same test; the capture reports it for a session that asks."""

import sys
import threading
import time

import torch

from eagle3.extract.capture import Capturer
from eagle3.extract.gil import GilSampler


def _sample(seconds: float, busy: bool) -> dict:
    stop = threading.Event()

    def spin():  # pure Python: holds the GIL until the interpreter makes it switch
        x = 0
        while not stop.is_set():
            x += 1

    hog = threading.Thread(target=spin, daemon=True)
    sampler = GilSampler(interval_s=0.002).start()
    if busy:
        hog.start()
    time.sleep(seconds)
    stop.set()
    sampler.stop()
    if busy:
        hog.join()
    return sampler.summary()


def test_a_thread_holding_the_gil_shows_as_late_wakes_against_a_quiet_run():
    """The control runs in the same test: a quiet process's wakes against one with a pure-Python spinner, whose
    GIL the sampler gets back only when the interpreter forces a switch (every 20 ms here)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.02)
    try:
        quiet = _sample(0.4, busy=False)
        loaded = _sample(0.4, busy=True)
    finally:
        sys.setswitchinterval(old)
    assert quiet["samples"] > 20 and loaded["samples"] >= 5, (quiet, loaded)
    assert loaded["late_ms_mean"] > 5 and loaded["late_ms_mean"] > 5 * quiet["late_ms_mean"], (quiet, loaded)
    assert loaded["late_over_ms"]["5"] > 0.5 and loaded["late_ms_max"] >= loaded["late_ms_mean"], loaded
    assert set(quiet["late_over_ms"]) == {"1", "5", "20"}


def test_the_capture_reports_the_gil_for_a_session_that_asks_and_stops_its_sampler():
    cap = Capturer(2, 4, torch.float32)
    cap.start("count")
    assert "gil" not in cap.stats.timing()  # off by default: production pays nothing
    cap.start("count", gil_sampler=True)
    time.sleep(0.1)
    gil = cap.stats.timing()["gil"]
    assert gil["samples"] > 5 and gil["late_ms_mean"] is not None, gil
    sampler = cap.stats.gil
    cap.stop()
    assert not sampler._thread.is_alive()
    cap.close()
