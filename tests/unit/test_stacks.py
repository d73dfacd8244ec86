"""The GPU tests' periodic stack dumps (tests/gpu/stacks.py): taken by a Python thread holding the GIL."""

import re
import threading
import time

from tests.gpu.stacks import PeriodicStacks

HEADER = re.compile(r"^--- stacks at ", re.MULTILINE)  # a dump's first line (traceback source lines are indented)


def _busy_in_a_marked_function(path, dumps: int, limit_s: float = 20.0) -> None:
    """Busy (holding the GIL most of the time, as training's Python does) until PATH holds ``dumps`` dumps."""
    end = time.perf_counter() + limit_s
    while time.perf_counter() < end and len(HEADER.findall(path.read_text())) < dumps:
        sum(range(1000))


def test_every_thread_s_whole_stack_is_written_each_period_and_nothing_after_the_end(tmp_path):
    """The online test dumped stacks with faulthandler.dump_traceback_later, which reads other threads' frames
    without the GIL: twice on the H200 (the 73a4e94 run) the process died of SIGSEGV in the middle of a dump, the file
    cut inside the main thread's stack (a line number of 32640 in a torch file read from a frame being changed),
    and faulthandler printed nothing, being the one that crashed. These dumps are whole: each names every thread
    and the main thread's stack down to its caller."""
    path = tmp_path / "stacks.txt"
    other = threading.Event()
    t = threading.Thread(target=other.wait, name="eagle3-waiting-thread", daemon=True)
    t.start()
    with PeriodicStacks(path, every=0.05):
        _busy_in_a_marked_function(path, dumps=4)
    size = path.stat().st_size
    time.sleep(0.2)
    other.set()
    text = path.read_text()
    assert path.stat().st_size == size, "dumps went on after the end"
    dumps = HEADER.split(text)[1:]
    assert len(dumps) >= 4, text[:500]
    for dump in dumps[1:3]:  # the first may come before the function starts; the last, after it returned
        assert "eagle3-waiting-thread" in dump and "MainThread" in dump
        main = dump[dump.index("MainThread") :]
        assert "_busy_in_a_marked_function" in main
        # the caller too: the whole chain, not the top frame alone
        assert "test_every_thread_s_whole_stack_is_written_each_period_and_nothing_after_the_end" in main
