"""Per-step capture inside a vLLM worker, independent of vLLM: from the GPU straight into shard buffers.

A forward step covers several requests, each a contiguous row range of the step's tokens, possibly a
chunk of a longer prompt (chunked prefill). For each step the worker passes the captured layers
([n_layers] x [>= n_tok, H] on the GPU) and the step's layout. Per step:

  1. stack the layers into [n_tok, n_layers, H] on the compute stream (a device copy, so vLLM may
     overwrite its buffers - CUDA-graph outputs - in the next step);
  2. on a side stream, copy each request's rows straight into its reserved rows of a pinned shard
     buffer (a request is matched to its announced sample, by token ids, the first time it is seen);
  3. a consumer thread waits for the copies; a shard whose rows have all arrived and that is full (or
     flushed) goes to the ShardWriter, which writes it from the pinned buffer and hands it back.

No host memcpy, no per-request allocation. Modes: "store" (the above), "host" (copy to a pinned buffer
and drop: the null sink of the benchmarks), "count" (nothing copied). A request whose first rows never
arrive (prefix caching skipped them) or that matches no announced sample is reported as an error.

Preemption: vLLM may preempt a request mid-prefill (KV cache full), reset its computed tokens to 0 and
recompute it later under the same request id. Each placement keeps a watermark of the rows already copied:
recomputed rows below it are not copied or counted again, so a shard is handed to the writer only when
every one of its rows has arrived once; rows that would skip past the watermark are an error.
"""

from __future__ import annotations

import logging
import math
import queue
import sys
import threading
import time
import traceback
from collections import Counter, defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from eagle3.extract.gil import GilSampler
from eagle3.store.format import quantize_fp8, shard_offsets

log = logging.getLogger(__name__)

# The consumer copies a step's states to the host in chunks of at most this many bytes, with at most
# COPY_CHUNKS_QUEUED of them queued on the side stream at a time: a small device-to-host copy of the engine's own
# (the step's sampled tokens, which the engine waits for) queues behind what is queued in the copy engine, and a
# whole step is 0.94 GB at 64x512 (17 ms at 54 GB/s) against ~1.2 ms for 64 MiB. 0: a step's copies issued at once.
COPY_CHUNK_BYTES = 64 << 20
COPY_CHUNKS_QUEUED = 2


class CaptureError(RuntimeError):
    pass


@dataclass
class StepLayout:
    """Requests of one forward step, in row order."""

    req_ids: list[str]
    starts: list[int]  # [n_req + 1] row offsets (query_start_loc)
    computed: list[int]  # [n_req] tokens of each request computed before this step
    prompts: list[Sequence[int] | None]  # prompt token ids

    @property
    def num_tokens(self) -> int:
        return self.starts[-1]

    @property
    def prompt_tokens(self) -> int:
        """The step's rows of prompt tokens. With async scheduling (direct) a step may also carry a decode row of a
        request whose prompt ended in the step before; counted as prompt, such rows hid as many skipped prompt
        tokens from the session's token check."""
        rows = 0
        for i, prompt in enumerate(self.prompts):
            n = self.starts[i + 1] - self.starts[i]
            rows += n if prompt is None else max(0, min(n, len(prompt) - self.computed[i]))
        return rows


@dataclass
class Announced:
    sample_id: str
    input_ids: torch.Tensor  # [T] int32
    loss_mask: torch.Tensor  # [T] uint8


def pack_announcement(samples) -> tuple[list[str], list[int], bytes, bytes]:
    """A batch's announcement as the RPC carries it: sample ids, lengths, every input id as int32 bytes and every
    loss-mask value as uint8 bytes, in sample order. A few objects a sample: sent as two Python ints a token, a
    64x512 batch cost 6.3 ms to build, pickle and unpack into tensors while the engine idled; packed, 1.6 ms
    (measured on a 2-core CPU machine, 2026-12-03; 4 ms of the 6.3 were the worker's torch.tensor of each list)."""
    lengths = [len(s.input_ids) for s in samples]
    n = sum(lengths)
    ids = np.fromiter(chain.from_iterable(s.input_ids for s in samples), dtype=np.int32, count=n)
    masks = np.fromiter(chain.from_iterable(s.loss_mask for s in samples), dtype=np.uint8, count=n)
    return [s.sample_id for s in samples], lengths, ids.tobytes(), masks.tobytes()


def unpack_announcement(sample_ids: Sequence[str], lengths: Sequence[int], ids: bytes, masks: bytes) -> list[Announced]:
    """pack_announcement's inverse, in the worker: views of two tensors (int32 [sum T], uint8 [sum T])."""
    n = sum(lengths)
    if len(sample_ids) != len(lengths) or len(ids) != 4 * n or len(masks) != n:
        raise CaptureError(
            f"a malformed announcement: {len(sample_ids)} ids, {len(lengths)} lengths of {n} tokens, "
            f"{len(ids)} bytes of input ids (expected {4 * n}), {len(masks)} of loss masks"
        )
    id_views = (
        torch.frombuffer(bytearray(ids), dtype=torch.int32).split(list(lengths))
        if n
        else [torch.zeros(0, dtype=torch.int32)] * len(lengths)
    )
    mask_views = (
        torch.frombuffer(bytearray(masks), dtype=torch.uint8).split(list(lengths))
        if n
        else [torch.zeros(0, dtype=torch.uint8)] * len(lengths)
    )
    return [Announced(sid, i, m) for sid, i, m in zip(sample_ids, id_views, mask_views)]


@dataclass
class ShardBuffer:
    """Pinned rows for one shard: tokens, loss mask, states [cap, n_layers, H]."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    states: torch.Tensor
    scales: torch.Tensor | None = None  # fp8 stores: float32 [cap, n_layers]
    used: int = 0
    samples: list[tuple[str, int]] = field(default_factory=list)  # (sample_id, length) in row order
    missing: int = 0  # rows reserved but not yet arrived on the host
    sealed: bool = False  # no more requests will be placed here
    queued: bool = False  # handed to the writer

    @property
    def capacity(self) -> int:
        return self.states.shape[0]


@dataclass
class Placement:
    """Where a request's prompt rows go, and how many (from row 0) have been copied so far."""

    buf: ShardBuffer
    row: int  # first row in buf
    length: int  # prompt tokens
    filled: int = 0  # watermark: rows [0, filled) are copied (or in flight)


def _prompt_key(ids) -> bytes:
    """An announced sample's key, and a request's: its token ids as int32 bytes (a memcpy; a tuple of ints cost the
    announce RPC ~0.7 ms and the forward ~1.5 ms a 64x512 batch on a 2-core CPU, while the engine waited)."""
    return np.asarray(ids, dtype=np.int32).tobytes()


class ShardFiller:
    """Reserves rows for requests in pinned shard buffers and hands complete shards to a ShardWriter."""

    def __init__(
        self,
        writer,
        n_layers: int,
        hidden: int,
        dtype: torch.dtype,
        capacity: int,
        pin: bool,
        free: list[ShardBuffer] | None = None,
        max_buffers: int | None = None,
    ):
        self.writer, self.n_layers, self.hidden, self.dtype = writer, n_layers, hidden, dtype
        self.capacity, self.pin = capacity, pin
        self.free: list[ShardBuffer] = free if free is not None else []  # pinned buffers, reused
        # buffers of another dtype (an earlier session's) are let go: kept, they would count against max_buffers
        self.free[:] = [b for b in self.free if b.states.dtype == dtype]
        self.open: ShardBuffer | None = None
        self.where: dict[str, Placement] = {}  # request id -> its rows
        self.recomputed = 0  # rows seen again after a preemption (not copied twice)
        self.done: set[str] = set()  # requests whose prompt rows are all placed, or that failed (cleared per batch)
        self.expected: dict[bytes, deque[Announced]] = defaultdict(deque)
        self.lock = threading.Lock()
        self.released = threading.Condition(self.lock)
        # pinned buffers at most (back-pressure beyond): one in each writer thread, and 4 more queued or filling
        # (with 8 page-cache writers a limit of 8 left the capture waiting while every buffer was being written)
        if max_buffers is None:
            max_buffers = max(8, getattr(writer, "threads", 0) + 4)
        self.max_buffers, self.allocated, self.in_writer = max_buffers, len(self.free), 0
        self.pinned_late = 0  # buffers pinned when a request needed one (in the forward), not by pin_all
        self.errors: list[str] = []
        self.completed = 0

    def announce(self, samples: Sequence[Announced]) -> None:
        for s in samples:
            self.expected[_prompt_key(s.input_ids)].append(s)

    def withdraw(self, sample_ids: Sequence[str]) -> None:
        """Forget announced samples that will not be generated."""
        gone = set(sample_ids)
        for key in list(self.expected):
            kept = deque(s for s in self.expected[key] if s.sample_id not in gone)
            if kept:
                self.expected[key] = kept
            else:
                del self.expected[key]

    def outstanding(self) -> list[str]:
        return [s.sample_id for q in self.expected.values() for s in q]

    def _buffer(self, rows: int) -> ShardBuffer:
        """A free buffer; at the limit, wait for the writer to hand one back (back-pressure on the GPU) -
        but only while some buffer is in the writer, since open shards may need future steps to fill."""
        with self.lock:
            while True:
                for i, b in enumerate(self.free):
                    if b.capacity >= rows and b.states.dtype == self.dtype:
                        b = self.free.pop(i)
                        b.used, b.samples, b.missing, b.sealed, b.queued = 0, [], 0, False, False
                        return b
                if self.allocated < self.max_buffers or self.in_writer == 0:
                    break
                self.released.wait(timeout=60)
            self.allocated += 1
        self.pinned_late += 1
        return self._new(max(rows, self.capacity))

    def _new(self, cap: int) -> ShardBuffer:
        scales = (
            torch.empty(cap, self.n_layers, dtype=torch.float32, pin_memory=self.pin)
            if self.dtype == torch.float8_e4m3fn
            else None
        )
        return ShardBuffer(
            torch.empty(cap, dtype=torch.int32),
            torch.empty(cap, dtype=torch.uint8),
            torch.empty(cap, self.n_layers, self.hidden, dtype=self.dtype, pin_memory=self.pin),
            scales,
        )

    def pin_all(self) -> None:
        """Pin now every buffer the filler may hold (max_buffers of ``capacity`` rows), so the forward pins none
        (but for a sample longer than a shard)."""
        with self.lock:
            n, self.allocated = self.max_buffers - self.allocated, max(self.allocated, self.max_buffers)
        for _ in range(n):
            b = self._new(self.capacity)
            with self.lock:
                self.free.append(b)

    def reserve(self, req: str, prompt: Sequence[int], computed: int) -> Placement | None:
        """First sight of a request: its sample and rows. None (and an error) if it cannot be placed."""
        if computed != 0:
            self.errors.append(
                f"request {req}: first captured rows start at token {computed}, not 0 - the engine "
                "skipped computing a prefix (prefix caching must be off for extraction)"
            )
            return None
        key, t = _prompt_key(prompt), len(prompt)
        q = self.expected.get(key)
        if not q:
            self.errors.append(f"request {req}: its prompt ({t} tokens) matches no announced sample")
            return None
        sample = q.popleft()
        if not q:
            del self.expected[key]
        if self.open is None or self.open.used + t > self.open.capacity:
            self.seal()
            self.open = self._buffer(t)
        b = self.open
        row = b.used
        b.input_ids[row : row + t] = sample.input_ids
        b.loss_mask[row : row + t] = sample.loss_mask
        b.samples.append((sample.sample_id, t))
        with self.lock:
            b.used += t
            b.missing += t
        self.where[req] = Placement(b, row, t)
        return self.where[req]

    def seal(self) -> None:
        if self.open is not None:
            b, self.open = self.open, None
            with self.lock:
                b.sealed = True
            self._maybe_write(b)

    def arrived(self, b: ShardBuffer, rows: int) -> None:
        with self.lock:
            b.missing -= rows
        self._maybe_write(b)

    def _maybe_write(self, b: ShardBuffer) -> None:
        with self.lock:
            ready = b.sealed and b.missing == 0 and b.used > 0 and not b.queued
            if ready:
                b.queued = True
                self.in_writer += 1
                self.completed += len(b.samples)  # under the lock: the consumer and the forward both get here
        if not ready:
            return

        def build(b=b):
            offsets = shard_offsets([n for _, n in b.samples])
            tensors = {
                "input_ids": b.input_ids[: b.used],
                "loss_mask": b.loss_mask[: b.used],
                "offsets": offsets,
                "hidden_states": b.states[: b.used],
            }
            if b.scales is not None:
                tensors["scales"] = b.scales[: b.used]
            return tensors, [sid for sid, _ in b.samples]

        def release(b=b):
            with self.lock:
                self.free.append(b)
                self.in_writer -= 1
                self.released.notify_all()

        self.writer.submit(build, release)


def copy_chunks(
    copies: list[tuple[torch.Tensor, torch.Tensor]], limit: int
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``copies`` ((dst, src) pairs of equal shapes, rows along dim 0) cut into groups of at most ``limit`` bytes
    of source, in order, rows whole (a row over the limit goes alone); ``limit`` 0: one group, the pairs as given."""
    if not limit:
        return [list(copies)] if copies else []
    groups: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    group: list[tuple[torch.Tensor, torch.Tensor]] = []
    room = limit
    for dst, src in copies:
        rows = src.shape[0]
        row_bytes = src[0].numel() * src.element_size() if rows else 0
        at = 0
        while at < rows:
            n = min(rows - at, max(0, room) // row_bytes if row_bytes else rows - at)
            if n == 0 and not group:
                n = 1  # a row larger than the limit: alone
            if n == 0:  # the group is full
                groups.append(group)
                group, room = [], limit
                continue
            group.append((dst[at : at + n], src[at : at + n]))
            room -= n * row_bytes
            at += n
    if group:
        groups.append(group)
    return groups


class PinnedPool:
    """Reusable page-locked host buffers, at most ``slots`` in use (back-pressure on the GPU side).

    ``get`` returns (buffer, view): views made under torch.inference_mode (where vLLM runs the forward)
    do not remember their base, so the buffer itself is what goes back with ``put``."""

    def __init__(self, slots: int, pin: bool):
        self.free: list[torch.Tensor] = []  # 1-D buffers
        self.slots = slots
        self.sem = threading.Semaphore(slots)
        self.pin, self.lock = pin, threading.Lock()
        self.allocations = 0  # buffers pinned so far (each one: ~0.1-0.3 s a GiB; in the forward, unless by fill)

    def _pin(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """A new buffer of at least n elements (a power of two: few distinct sizes to reuse), counted."""
        self.allocations += 1
        return torch.empty(1 << max(20, (n - 1).bit_length()), dtype=dtype, pin_memory=self.pin)

    def fill(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Pin now (not in the forward) a free buffer for every slot that fits ``shape`` (the largest step)."""
        n = math.prod(shape)
        with self.lock:
            have = sum(1 for t in self.free if t.dtype == dtype and t.numel() >= n)
        for _ in range(self.slots - have):
            buf = self._pin(n, dtype)
            with self.lock:
                self.free.append(buf)

    def get(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The smallest free buffer that fits (a small step taking the large one made the next large step pin)."""
        self.sem.acquire()
        n = math.prod(shape)
        with self.lock:
            fits = [i for i, t in enumerate(self.free) if t.dtype == dtype and t.numel() >= n]
            buf = self.free.pop(min(fits, key=lambda i: self.free[i].numel())) if fits else None
        if buf is None:
            buf = self._pin(n, dtype)
        return buf, buf[:n].view(shape)

    def put(self, buf: torch.Tensor) -> None:
        with self.lock:
            self.free.append(buf)
        self.sem.release()


@dataclass
class CaptureStats:
    """Counts, and where a step's time goes (seconds, summed over the session's steps): ``wait_s`` the forward
    blocked on a free slot or pinned buffer (the host copies are behind: back-pressure), ``stage_s`` the forward
    spent in the capture (waits included), ``copy_s`` the side stream spent copying to the host (GPU time, CUDA
    events; 0 on CPU): bytes_to_host / copy_s is the device-to-host bandwidth the copies got."""

    steps: int = 0
    tokens: int = 0
    bytes_to_host: int = 0
    wait_s: float = 0.0
    stage_s: float = 0.0
    copy_s: float = 0.0
    pinned_allocs: int = 0  # buffers the session pinned in the forward (host: PinnedPool's; store: shard buffers)
    step_tokens: Counter = field(default_factory=Counter)  # tokens in a step -> steps of that size
    gil: GilSampler | None = None  # a session's GIL sampler, if it asked for one

    def timing(self) -> dict:
        """``step_tokens``: the 8 commonest step sizes, e.g. {"16384": 64, "64": 32}: a batch's prompts in full
        token-budget steps, and any further steps the engine ran for it; ``gil``: GilSampler.summary()."""
        timing = {
            "steps": self.steps,
            "bytes_to_host": self.bytes_to_host,
            "wait_s": round(self.wait_s, 4),
            "stage_s": round(self.stage_s, 4),
            "copy_s": round(self.copy_s, 4),
            "pinned_allocs": self.pinned_allocs,
            "step_tokens": {str(n): k for n, k in self.step_tokens.most_common(8)},
        }
        if self.gil is not None:
            timing["gil"] = self.gil.summary()
        return timing


def _settled(begun, done) -> float:
    """Seconds between two events on a stream, once the later one is reached."""
    done.synchronize()
    return begun.elapsed_time(done) / 1e3


class Capturer:
    """Device side + consumer thread. ``on_step`` is called from the forward (hooks) or the drafter."""

    MODES = ("store", "host", "count")

    def __init__(self, n_layers: int, hidden: int, dtype: torch.dtype, slots: int = 4):
        self.n_layers, self.hidden, self.dtype = n_layers, hidden, dtype
        self.cuda = torch.cuda.is_available()
        self.stats = CaptureStats()
        self.mode, self.filler = "count", None
        self.shard_buffers: list[ShardBuffer] = []  # kept across sessions: pinning memory is slow
        self.pool = PinnedPool(slots, pin=self.cuda)
        # steps handed to the consumer and not yet on the host: each holds its staged copy on the device
        self.in_flight = threading.Semaphore(slots)
        self.stream = torch.cuda.Stream() if self.cuda else None
        self.device = torch.cuda.current_device() if self.cuda else None  # the consumer thread issues copies here
        self.queue: queue.Queue = queue.Queue()
        self.errors: list[str] = []
        self.errors_lock = threading.Lock()  # the consumer reports while a collect may be taking them
        self.copy_chunk_bytes = COPY_CHUNK_BYTES
        self.thread = threading.Thread(target=self._consume, name="eagle3-capture", daemon=True)
        self.thread.start()

    def start(
        self,
        mode: str,
        writer=None,
        shard_tokens: int = 8192,
        dtype: torch.dtype | None = None,
        copy_chunk_bytes: int = COPY_CHUNK_BYTES,
        gil_sampler: bool = False,
        max_step_tokens: int | None = None,
        step_dtype: torch.dtype | None = None,
    ) -> None:
        """Begin a session in ``mode`` storing states as ``dtype`` (default: as before), copying to the host in
        chunks of ``copy_chunk_bytes`` (0: a step's copies at once), with a GilSampler if asked (benchmarks: how
        long this process's threads wait for the GIL); ``stop`` (or another start) ends it. Host mode pins its
        buffers here, one a slot for a step of ``max_step_tokens`` (the engine's token budget) of the model's
        ``step_dtype`` (what it copies unless fp8), not in the forward."""
        if mode not in self.MODES:
            raise ValueError(f"capture mode {mode!r} not in {self.MODES}")
        if mode == "store" and writer is None:
            raise ValueError("store mode needs a writer")
        self.drain()
        self._stop_gil()
        self.dtype = dtype or self.dtype
        self.mode, self.stats, self.errors = mode, CaptureStats(), []
        self.copy_chunk_bytes = copy_chunk_bytes
        if gil_sampler:
            self.stats.gil = GilSampler().start()
        self.filler = None
        if mode == "store":
            self.filler = ShardFiller(
                writer, self.n_layers, self.hidden, self.dtype, shard_tokens, self.cuda, free=self.shard_buffers
            )
            self.filler.pin_all()
        if mode == "host" and max_step_tokens:
            fp8 = self.dtype == torch.float8_e4m3fn  # quantized on the device: e4m3 states and float32 scales
            states = self.dtype if fp8 else step_dtype or self.dtype
            self.pool.fill((max_step_tokens, self.n_layers, self.hidden), states)
            if fp8:
                self.pool.fill((max_step_tokens, self.n_layers), torch.float32)

    def stop(self) -> None:
        self.drain()
        self._stop_gil()
        self.mode, self.filler = "count", None

    def _stop_gil(self) -> None:
        """Stop the session's sampler (its figures stay in stats); again: nothing more happens."""
        if self.stats.gil is not None:
            self.stats.gil.stop()

    def on_step(self, layers: Sequence[torch.Tensor], layout: StepLayout) -> None:
        n = layout.num_tokens
        self.stats.steps += 1
        self.stats.tokens += layout.prompt_tokens  # the session checks these against its batches' prompt tokens
        self.stats.step_tokens[n] += 1
        if self.mode == "count" or n == 0:
            return
        for t in layers:
            if t.shape[0] < n:
                raise CaptureError(
                    f"captured {t.shape[0]} rows but the step has {n} tokens (sequence-parallel "
                    "shards? use --capture aux)"
                )
        t0 = time.perf_counter()
        self.in_flight.acquire()  # released by the consumer once the step's copies are on the host
        self.stats.wait_s += time.perf_counter() - t0
        try:
            self._stage_and_copy(layers, layout, n)
        except BaseException:
            self.in_flight.release()
            raise
        finally:
            self.stats.stage_s += time.perf_counter() - t0

    def _stage_and_copy(self, layers: Sequence[torch.Tensor], layout: StepLayout, n: int) -> None:
        staged = torch.stack([t[:n] for t in layers], dim=1)  # [n, n_layers, H], compute stream
        scales = None
        if self.dtype == torch.float8_e4m3fn:  # quantized on the device: half the bytes cross to the host
            staged, scales = quantize_fp8(staged)  # [n, n_layers, H] e4m3, [n, n_layers] float32
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host destination, device source)
        arrivals: list[tuple[ShardBuffer, int]] = []
        host = []
        if self.mode == "host":
            for src in (staged,) if scales is None else (staged, scales):
                t0, pinned = time.perf_counter(), self.pool.allocations
                buf, view = self.pool.get(tuple(src.shape), src.dtype)
                self.stats.wait_s += time.perf_counter() - t0
                self.stats.pinned_allocs += self.pool.allocations - pinned
                host.append(buf)
                copies.append((view, src))
        else:
            f = self.filler
            pinned = f.pinned_late
            for i, req in enumerate(layout.req_ids):
                a, b, c = layout.starts[i], layout.starts[i + 1], layout.computed[i]
                if b == a:
                    continue
                prompt = layout.prompts[i]
                if prompt is not None and c >= len(prompt):
                    # rows past the prompt (decode): never captured; with async scheduling such a step may come
                    # after the batch's collect forgot the request
                    continue
                if req in f.done:
                    continue  # all its prompt rows placed, or it failed: nothing more to capture
                place = f.where.get(req) or f.reserve(req, prompt or (), c)
                if place is None:
                    f.done.add(req)
                    continue
                if c > place.filled:
                    f.errors.append(
                        f"request {req}: rows {place.filled}..{c} were never computed (the engine "
                        "skipped them: prefix caching must be off for extraction)"
                    )
                    del f.where[req]
                    f.done.add(req)
                    continue
                end = min(c + (b - a), place.length)  # tokens beyond the prompt (decode) are not captured
                start = max(c, place.filled)  # rows below the watermark: recomputed after preemption
                f.recomputed += max(0, min(end, place.filled) - c)
                if end > start:
                    copies.append(
                        (place.buf.states[place.row + start : place.row + end], staged[a + start - c : a + end - c])
                    )
                    if scales is not None:
                        copies.append(
                            (place.buf.scales[place.row + start : place.row + end], scales[a + start - c : a + end - c])
                        )
                    arrivals.append((place.buf, end - start))
                    place.filled = end
                if place.filled >= place.length:
                    del f.where[req]
                    f.done.add(req)
            self.stats.pinned_allocs += f.pinned_late - pinned
        ready = None
        if staged.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream())  # the stage is computed
        self.stats.bytes_to_host += staged.numel() * staged.element_size() + (
            0 if scales is None else scales.numel() * scales.element_size()
        )
        # The consumer issues the copies once the stage is computed, not the forward now: a device-to-host copy
        # issued here would sit ahead of the engine's own small copies of this step (sampled-token counts, on
        # other streams), which its next step waits for, in the copy engine's queue, and the engine would lose the
        # copies' time.
        sources = [t for t in (staged, scales) if t is not None]
        self.queue.put((ready, sources, copies, arrivals, host))

    def _issue(self, ready, sources: list, copies: list) -> float:
        """Copy the step's rows to the host on the side stream, a chunk at a time with at most COPY_CHUNKS_QUEUED
        queued (see COPY_CHUNK_BYTES); returns when they are all on the host, with the GPU seconds they took."""
        chunks = copy_chunks(copies, self.copy_chunk_bytes)
        if ready is None:  # CPU
            for group in chunks:
                for dst, src in group:
                    dst.copy_(src)
            return 0.0
        ready.synchronize()  # the engine has issued this step's own copies by now
        queued: deque = deque()  # (begun, done) timing events of the chunks on the side stream
        spent = 0.0
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            for src in sources:
                src.record_stream(self.stream)  # freed by the caller, still read by the side stream
            for group in chunks:
                if len(queued) >= COPY_CHUNKS_QUEUED:
                    spent += _settled(*queued.popleft())
                begun = torch.cuda.Event(enable_timing=True)
                begun.record(self.stream)
                for dst, src in group:
                    dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event(enable_timing=True)
                done.record(self.stream)
                queued.append((begun, done))
        while queued:
            spent += _settled(*queued.popleft())
        return spent

    def _consume(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                ready, sources, copies, arrivals, host = item
                item = ()  # not None (released below), and holding no tensor
                with torch.inference_mode():  # the buffers and views were made under it (in the forward)
                    self.stats.copy_s += self._issue(ready, sources, copies)
                sources = copies = None  # the staged rows (their use by the side stream is recorded) may be freed
                for buf in host:
                    self.pool.put(buf)
                for buf, rows in arrivals:
                    self.filler.arrived(buf, rows)
            except Exception as e:  # noqa: BLE001 - reported through errors
                self.add_error(f"{type(e).__name__}: {e}")
            finally:
                if item is not None:
                    self.in_flight.release()
                self.queue.task_done()

    def drain(self) -> None:
        """Wait until every step handed over so far is on the host (and complete shards are queued)."""
        self.queue.join()

    def add_error(self, message: str) -> None:
        with self.errors_lock:
            self.errors.append(message)

    def take_errors(self) -> list[str]:
        with self.errors_lock:
            errors, self.errors = self.errors, []
        errors += self.filler.errors if self.filler else []
        if self.filler:
            self.filler.errors = []
        return errors

    def close(self, timeout: float = 60.0) -> None:
        """Stop the copy thread once it has handled every step handed over; after ``timeout`` seconds, say where it
        is stuck (its stack) and return without it."""
        self._stop_gil()
        self.queue.put(None)
        self.thread.join(timeout=timeout)
        if self.thread.is_alive():
            frame = sys._current_frames().get(self.thread.ident)  # noqa: SLF001 - the stuck thread's stack
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)"
            log.warning("capture: the copy thread did not stop within %.1f s; left running, at:\n%s", timeout, stack)
