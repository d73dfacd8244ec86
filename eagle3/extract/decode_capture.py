"""Rows of generated tokens (`extract --regenerate`): every row a request computes, kept by position until the
driver says which sample it belongs to. Independent of vLLM (tests drive it with synthetic steps).

A generating request computes its prompt's rows at prefill (possibly in chunks), then one row a decode step: the
row of the token sampled in the step before. The token sampled last is never fed back, so its row comes from a
second request over the sample's final tokens, which with prefix caching computes only the tail past the cached
blocks. ``take`` merges the requests a sample names by position, a later step's row over an earlier one (a
preempted request computes its rows again; the second request recomputes the tail): every position of the sample
must be covered once at least, and rows past its end (an async step after the request ended) are dropped.

Host copies: on CUDA each step's rows [n_tok, n_layers, H] are copied on a side stream into pinned memory, the
step's event recorded; ``take`` waits for the events of the rows it returns. Elsewhere (the CPU tests) a clone.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eagle3.extract.capture import CaptureError, StepLayout

SUFFIX = 8  # vLLM 0.26 runs a request under "<id>-<8 random characters>" (InputProcessor.assign_request_id)


def external_id(req_id: str, names: set[str]) -> str | None:
    """The caller's request id that vLLM's internal ``req_id`` stands for, if it is one of ``names``."""
    if req_id in names:
        return req_id
    head, _, tail = req_id.rpartition("-")
    return head if head in names and len(tail) == SUFFIX else None


@dataclass
class _Chunk:
    start: int  # the position of its first row in the request's tokens
    rows: torch.Tensor  # [n, n_layers, H] on the host
    event: object = None  # a CUDA event the copy recorded (None: already there)


class RowCollector:
    """Per request: the rows its steps computed, on the host. ``keep=False`` (a TP rank that does not write):
    only counted."""

    def __init__(self, keep: bool = True):
        self.keep = keep
        self.chunks: dict[str, list[_Chunk]] = defaultdict(list)
        self.rows = 0  # rows seen (every rank: the driver checks that the ranks agree)
        self.steps = 0
        self.errors: list[str] = []
        self._stream = None

    def on_step(self, layers: Sequence[torch.Tensor], layout: StepLayout) -> None:
        """layers: [n_layers] x [>= n_tok, H] (the step's captured layers, rows in layout order)."""
        n = layout.num_tokens
        self.steps += 1
        self.rows += n
        if not self.keep or n == 0:
            return
        rows, event = self._to_host(torch.stack([t[:n] for t in layers], dim=1))  # [n, n_layers, H]
        for i, rid in enumerate(layout.req_ids):
            a, b = layout.starts[i], layout.starts[i + 1]
            if b > a:
                self.chunks[rid].append(_Chunk(int(layout.computed[i]), rows[a:b], event))

    def add_error(self, message: str) -> None:
        """A problem inside the forward (reported by the next eagle3_regen_write), as Capturer.add_error."""
        self.errors.append(message)

    def _to_host(self, stacked: torch.Tensor):
        if stacked.device.type != "cuda":
            return stacked.detach().clone(), None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=stacked.device)
        self._stream.wait_stream(torch.cuda.current_stream(stacked.device))
        with torch.cuda.stream(self._stream):
            host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
            host.copy_(stacked, non_blocking=True)
            stacked.record_stream(self._stream)
            event = torch.cuda.Event()
            event.record(self._stream)
        return host, event

    def take(self, sample_id: str, names: Sequence[str], length: int) -> torch.Tensor:
        """The rows of positions 0..length-1 of the requests ``names`` (in the order they ran): [length, n_layers,
        H]. The requests' rows are released. CaptureError when a position has no row."""
        wanted = set(names)
        found: dict[str, list[str]] = defaultdict(list)
        for rid in list(self.chunks):
            ext = external_id(rid, wanted)
            if ext is not None:
                found[ext].append(rid)
        chunks = [c for name in names for rid in found.get(name, []) for c in self.chunks.pop(rid)]
        if not chunks:
            raise CaptureError(f"sample {sample_id}: no rows were computed for its requests {list(names)}")
        first = chunks[0].rows
        out = torch.empty((length,) + tuple(first.shape[1:]), dtype=first.dtype)
        seen = torch.zeros(length, dtype=torch.bool)
        for c in chunks:  # in the order the steps ran: a later row over an earlier one
            if c.event is not None:
                c.event.synchronize()
            end = min(c.start + len(c.rows), length)
            if end > c.start:
                out[c.start : end] = c.rows[: end - c.start]
                seen[c.start : end] = True
        if not bool(seen.all()):
            missing = (~seen).nonzero().flatten().tolist()
            raise CaptureError(
                f"sample {sample_id}: no row for {len(missing)} of its {length} positions (first "
                f"{missing[:5]}); its requests {list(names)} computed {sum(len(c.rows) for c in chunks)}"
                " rows (prefix caching on the first request? it must skip reading the cache)"
            )
        return out

    def drop(self) -> int:
        """Forget every request's rows (a session's end); returns how many requests had rows nobody took."""
        n = len(self.chunks)
        self.chunks.clear()
        return n
