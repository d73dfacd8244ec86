"""Long conversations tokenized in worker processes, results in the input's order.

A conversation's loss mask renders the chat template once for each assistant turn, up to that turn (masks.views):
the cost grows with the square of its length (docs/data.md). Conversations of more than LONG_MESSAGES messages go
to a pool of processes, started at the first one; the rest are tokenized here, where a pool would cost more than it
saves. The workers come from a fork server
(a clean process that imported transformers once), not from this process, whose threads (an engine's, torch's)
a fork would copy in an unknown state.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from eagle3.data.schema import DataError

LONG_MESSAGES = 32  # more messages than this: tokenized in a worker process
MAX_WORKERS = 16

_work: Callable | None = None  # a worker's own tokenizing function (set by _start)


def default_workers() -> int:
    """The CPUs this process may use, less one for the reader here, at most MAX_WORKERS."""
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0)) - 1))


def is_long(item: tuple) -> bool:
    """An item whose last element, a Conversation or a conversation's dict, has more than LONG_MESSAGES messages."""
    last = item[-1]
    return len(last["messages"] if isinstance(last, dict) else last.messages) > LONG_MESSAGES


def in_order(items: Iterable[tuple], work: Callable, workers: int) -> Iterator[tuple[tuple, object, bool]]:
    """(item, work(*item) or the DataError it raised, whether a worker did it) for each item, in order; long ones
    (is_long) in workers. ``work`` must pickle (a functools.partial of a module-level function, a picklable
    tokenizer among its arguments)."""
    pool, queue = None, deque()
    try:
        for item in items:
            if workers > 1 and is_long(item):
                pool = pool or _pool(work, workers)
                queue.append((item, pool.submit(_remote, item), True))
            else:
                queue.append((item, _outcome(work, item), False))
            while queue and not _pending(queue[0][1]):
                yield _ready(queue.popleft())
            if len(queue) > 8 * workers:  # a bounded look-ahead: results wait for the slowest long one
                yield _ready(queue.popleft())
        while queue:
            yield _ready(queue.popleft())
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _outcome(work: Callable, item: tuple):
    try:
        return work(*item)
    except DataError as e:
        return e


def _pending(result) -> bool:
    return isinstance(result, Future) and not result.done()


def _ready(entry: tuple) -> tuple[tuple, object, bool]:
    item, result, remote = entry
    if not isinstance(result, Future):
        return item, result, remote
    try:
        return item, result.result(), remote
    except BrokenProcessPool as e:
        raise RuntimeError(
            "a worker process tokenizing long conversations died. A script that loads data (extract, load_samples) "
            "must run its top level under `if __name__ == '__main__':`, since each worker imports the script; "
            "or tokenize here: --data-workers 1 (DataConfig.workers=1)"
        ) from e


def _pool(work: Callable, workers: int) -> ProcessPoolExecutor:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_preload(work))
    return ProcessPoolExecutor(workers, mp_context=ctx, initializer=_start, initargs=(pickle.dumps(work),))


def _preload(work: Callable) -> list[str]:
    """What every worker needs, imported once in the fork server: the work's function's module, its arguments' types'
    (a tokenizer's class: 2.5 s a worker to unpickle it cold) and the chat template's renderer."""
    modules = {getattr(work, "func", work).__module__, "transformers.utils.chat_template_utils"}
    modules |= {type(a).__module__ for a in getattr(work, "args", ())}
    return sorted(modules - {"builtins"})


def _start(work: bytes) -> None:
    global _work
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread a worker: the pool is the parallelism
    _work = pickle.loads(work)


def _remote(item: tuple):
    return _outcome(_work, item)
