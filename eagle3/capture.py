"""Per-step capture inside a vLLM worker, independent of vLLM: copy out, reassemble, hand to the writer.

A forward step covers several requests, each a contiguous row range of the step's tokens, possibly a
chunk of a longer prompt (chunked prefill). For each step the worker passes the captured layers
([n_layers] x [>= n_tok, H] on the GPU) and the step's layout. The device side stacks them into one
tensor (a device-to-device copy on the compute stream, so the next step may overwrite vLLM's buffers)
and starts a device-to-host copy into a pinned buffer on a side stream. A consumer thread waits for
that copy, scatters rows into per-request buffers, and when a request's prompt is complete matches it to
an announced sample (by its token ids) and gives it to the sink (a ShardWriter, or nothing for
benchmarks). A request whose first rows never arrive (prefix caching skipped them) is reported.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

log = logging.getLogger(__name__)


class CaptureError(RuntimeError):
    pass


@dataclass
class StepLayout:
    """Requests of one forward step, in row order."""

    req_ids: list[str]
    starts: list[int]       # [n_req + 1] row offsets (query_start_loc)
    computed: list[int]     # [n_req] tokens of each request computed before this step
    prompt_lens: list[int]  # [n_req]
    prompts: list[Sequence[int] | None]  # prompt token ids, for requests seen for the first time

    @property
    def num_tokens(self) -> int:
        return self.starts[-1]


@dataclass
class Announced:
    sample_id: str
    input_ids: torch.Tensor   # [T] int
    loss_mask: torch.Tensor   # [T]


class Assembler:
    """Host side: step rows -> complete requests -> announced samples -> sink(sample_id, ids, mask, states)."""

    def __init__(self, n_layers: int, hidden: int, dtype: torch.dtype, sink: Callable | None):
        self.n_layers, self.hidden, self.dtype, self.sink = n_layers, hidden, dtype, sink
        self.expected: dict[tuple[int, ...], deque[Announced]] = defaultdict(deque)
        self.partial: dict[str, tuple[torch.Tensor, list[int], tuple[int, ...]]] = {}  # req -> (buf, filled, key)
        self.errors: list[str] = []
        self.completed = 0
        self.tokens = 0

    def announce(self, samples: Sequence[Announced]) -> None:
        for s in samples:
            self.expected[tuple(int(t) for t in s.input_ids.tolist())].append(s)

    def outstanding(self) -> list[str]:
        return [s.sample_id for q in self.expected.values() for s in q]

    def add_step(self, layout: StepLayout, rows: torch.Tensor) -> None:
        """rows: [n_layers, >= n_tok, H] on the host for this step."""
        for i, req in enumerate(layout.req_ids):
            a, b, c = layout.starts[i], layout.starts[i + 1], layout.computed[i]
            if b == a:
                continue
            if req not in self.partial:
                prompt = layout.prompts[i]
                if prompt is None:
                    self.errors.append(f"request {req}: no prompt token ids")
                    continue
                key = tuple(int(t) for t in prompt)
                buf = torch.empty(self.n_layers, len(key), self.hidden, dtype=self.dtype)
                self.partial[req] = (buf, [0], key)
                if c != 0:
                    self.errors.append(
                        f"request {req}: first captured rows start at token {c}, not 0 - the engine skipped "
                        "computing a prefix (prefix caching must be off for extraction)")
            buf, filled, key = self.partial[req]
            end = min(c + (b - a), len(key))  # decode steps beyond the prompt are not captured
            if end > c:
                buf[:, c:end] = rows[:, a : a + (end - c)]
                filled[0] += end - c
                self.tokens += end - c
            if filled[0] >= len(key):
                del self.partial[req]
                self._complete(req, key, buf)

    def _complete(self, req: str, key: tuple[int, ...], states: torch.Tensor) -> None:
        queue_ = self.expected.get(key)
        if not queue_:
            self.errors.append(f"request {req}: its prompt ({len(key)} tokens) matches no announced sample")
            return
        s = queue_.popleft()
        if not queue_:
            del self.expected[key]
        self.completed += 1
        if self.sink is not None:
            self.sink(s.sample_id, s.input_ids, s.loss_mask, states)


class PinnedPool:
    """Reusable page-locked host buffers, at most ``slots`` in use (back-pressure on the GPU side)."""

    def __init__(self, slots: int, pin: bool):
        self.free: list[torch.Tensor] = []
        self.sem = threading.Semaphore(slots)
        self.pin, self.lock = pin, threading.Lock()

    def get(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        self.sem.acquire()
        n = 1
        for d in shape:
            n *= d
        with self.lock:
            for i, t in enumerate(self.free):
                if t.dtype == dtype and t.numel() >= n:
                    return self.free.pop(i)[:n].view(shape)
        size = max(n, 1 << 20)
        return torch.empty(size, dtype=dtype, pin_memory=self.pin)[:n].view(shape)

    def put(self, t: torch.Tensor) -> None:
        base = t._base if t._base is not None else t
        with self.lock:
            self.free.append(base.view(-1) if base.dim() != 1 else base)
        self.sem.release()


@dataclass
class CaptureStats:
    steps: int = 0
    tokens: int = 0
    bytes_to_host: int = 0


class Capturer:
    """Device side + consumer thread. ``on_step`` is called from the forward (hooks) or the drafter."""

    MODES = ("store", "host", "count")  # assemble + sink | copy to host and drop | count tokens only

    def __init__(self, n_layers: int, hidden: int, dtype: torch.dtype, sink: Callable | None,
                 mode: str = "store", slots: int = 4):
        if mode not in self.MODES:
            raise ValueError(f"capture mode {mode!r} not in {self.MODES}")
        self.assembler = Assembler(n_layers, hidden, dtype, sink)
        self.mode, self.stats = mode, CaptureStats()
        self.cuda = torch.cuda.is_available()
        self.pool = PinnedPool(slots, pin=self.cuda)
        self.stream = torch.cuda.Stream() if self.cuda else None
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._consume, name="eagle3-assemble", daemon=True)
        self.thread.start()

    def on_step(self, layers: Sequence[torch.Tensor], layout: StepLayout) -> None:
        n = layout.num_tokens
        self.stats.steps += 1
        self.stats.tokens += n
        if self.mode == "count" or n == 0:
            return
        for t in layers:
            if t.shape[0] < n:
                raise CaptureError(f"captured {t.shape[0]} rows but the step has {n} tokens (sequence-parallel "
                                   "shards? use --capture aux)")
        staged = torch.stack([t[:n] for t in layers])  # [n_layers, n, H] device copy, compute stream
        host = self.pool.get(tuple(staged.shape), staged.dtype)
        event = None
        if staged.is_cuda:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                host.copy_(staged, non_blocking=True)
                staged.record_stream(self.stream)
                event = torch.cuda.Event()
                event.record(self.stream)
        else:
            host.copy_(staged)
        self.stats.bytes_to_host += host.numel() * host.element_size()
        self.queue.put((layout, host, event))

    def _consume(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                layout, host, event = item
                if event is not None:
                    event.synchronize()
                try:
                    if self.mode == "store":
                        self.assembler.add_step(layout, host)
                except Exception as e:  # noqa: BLE001 - reported through errors
                    self.assembler.errors.append(f"{type(e).__name__}: {e}")
                finally:
                    self.pool.put(host)
            finally:
                self.queue.task_done()

    def drain(self) -> None:
        """Wait until every step handed over so far has been assembled."""
        self.queue.join()

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=60)
