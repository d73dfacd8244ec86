"""collective_rpc replies, normalized in exactly one place.

Reply shapes that real vLLM versions produce (W = world size, r_k = what rank k's method returned):

    executor.collective_rpc(m)                        -> [r_0, ..., r_{W-1}]
    executor.collective_rpc(m, unique_reply_rank=k)   -> [r_k]   vLLM <= 0.11.0
                                                      -> r_k     vLLM >= 0.11.1
    LLM.collective_rpc(m)    (0.26: no unique_reply_rank) -> [r_0, ..., r_{W-1}]

A tensor inside r_k may arrive engine-encoded (msgpack) as ``[dtype: str, shape: list[int], data]``
instead of as a Tensor. ``data`` holds the bytes only for small tensors; for large ones it is an index
into side buffers the reply no longer has. Hidden states must not travel this way (DESIGN.md).

The caller states what it expects (:class:`Expect`); anything else raises :class:`ReplyError` naming
what arrived. Nothing is ever indexed blindly: the ``reply[0]`` that kept only the first layer when
vLLM 0.11.1 stopped wrapping unique replies is exactly what this module refuses to guess.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Expect", "LayerStack", "Record", "ReplyError", "describe", "normalize_reply", "check_consistent"]

_TORCH_DTYPES = {
    name: getattr(torch, name)
    for name in ("bfloat16", "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")
}


class ReplyError(ValueError):
    """A collective_rpc reply that is not what the caller expected."""


@dataclass(frozen=True)
class LayerStack:
    """One rank's result is a list of ``num_layers`` tensors, each of ``shape`` (None = any size)."""

    num_layers: int
    shape: tuple[int | None, ...] | None = None
    dtype: torch.dtype | None = None

    def what(self) -> str:
        shape = "" if self.shape is None else "[" + ", ".join("*" if s is None else str(s) for s in self.shape) + "]"
        dtype = "" if self.dtype is None else " " + _dtype_name(self.dtype)
        return f"list of {self.num_layers} layer tensors{(' ' + shape) if shape else ''}{dtype}"


@dataclass(frozen=True)
class Record:
    """One rank's result is a dict holding at least ``keys`` (small metadata, never tensors)."""

    keys: frozenset[str] = frozenset()

    def what(self) -> str:
        return "dict with keys " + (", ".join(sorted(self.keys)) if self.keys else "(any)")


@dataclass(frozen=True)
class Expect:
    """What the caller of collective_rpc expects back.

    world_size:        number of workers that ran the method.
    item:              what one rank returns.
    reply_rank:        the rank whose result is wanted; None returns every rank's result.
    unique_reply_rank: True when the call itself passed ``unique_reply_rank=reply_rank``.
    others_may_be_none: ranks other than reply_rank are allowed to return None.
    """

    world_size: int
    item: LayerStack | Record
    reply_rank: int | None = None
    unique_reply_rank: bool = False
    others_may_be_none: bool = False

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.reply_rank is not None and not 0 <= self.reply_rank < self.world_size:
            raise ValueError(f"reply_rank {self.reply_rank} outside world of size {self.world_size}")
        if self.unique_reply_rank and self.reply_rank is None:
            raise ValueError("unique_reply_rank=True needs reply_rank")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe(x: Any, depth: int = 0) -> str:
    """Structure of a reply, every element of short lists shown: ``list[2]<Tensor[4, 8] bfloat16, None>``."""
    if isinstance(x, torch.Tensor):
        return f"Tensor[{', '.join(map(str, x.shape))}] {_dtype_name(x.dtype)}"
    if _is_encoded_tensor(x):
        return f"engine-encoded tensor [{x[0]!r}, {list(x[1])}, {type(x[2]).__name__}]"
    if isinstance(x, dict):
        return "dict{" + ", ".join(sorted(map(str, x))) + "}"
    if isinstance(x, (list, tuple)):
        if depth >= 3:
            return f"{type(x).__name__}[{len(x)}]<...>"
        inner = [describe(e, depth + 1) for e in x[:4]]
        more = f", ... {len(x) - 4} more" if len(x) > 4 else ""
        return f"{type(x).__name__}[{len(x)}]<" + ", ".join(inner) + more + ">"
    if x is None:
        return "None"
    return type(x).__name__


def _is_encoded_tensor(x: Any) -> bool:
    return (
        isinstance(x, (list, tuple))
        and len(x) == 3
        and isinstance(x[0], str)
        and x[0] in _TORCH_DTYPES
        and isinstance(x[1], (list, tuple))
        and all(isinstance(d, int) for d in x[1])
    )


def _decode_tensor(x: Sequence[Any], where: str) -> torch.Tensor:
    """Rebuild a tensor from vLLM's msgpack encoding when its bytes are inline; refuse otherwise."""
    dtype_name, shape, data = x
    dtype = _TORCH_DTYPES[dtype_name]
    if hasattr(data, "code") and isinstance(getattr(data, "data", None), (bytes, bytearray, memoryview)):
        data = data.data  # a msgpack extension (inline raw view) decoded without vLLM's ext_hook
    if isinstance(data, (bytes, bytearray, memoryview)):
        itemsize = torch.empty((), dtype=dtype).element_size()
        want = math.prod(shape) * itemsize
        got = memoryview(data).nbytes
        if got != want:
            raise ReplyError(
                f"{where}: engine-encoded tensor {dtype_name}{list(shape)} carries {got} bytes, needs {want}"
            )
        if want == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(tuple(shape))
    raise ReplyError(
        f"{where}: a tensor {dtype_name}{list(shape)} arrived engine-encoded and its bytes are not in the "
        f"reply (data is {type(data).__name__}). Tensors do not survive collective_rpc replies: have the "
        "worker write them to the store and return only metadata (paths, counts, shapes, checksums)."
    )


def _as_layer_stack(result: Any, spec: LayerStack, where: str) -> list[torch.Tensor]:
    if not isinstance(result, (list, tuple)) or _is_encoded_tensor(result):
        raise ReplyError(f"{where}: expected {spec.what()}, got {describe(result)}")
    if len(result) != spec.num_layers:
        raise ReplyError(f"{where}: expected {spec.what()}, got {len(result)} entries: {describe(result)}")
    layers = []
    for i, t in enumerate(result):
        if _is_encoded_tensor(t):
            t = _decode_tensor(t, f"{where} layer {i}")
        if not isinstance(t, torch.Tensor):
            raise ReplyError(f"{where}: layer {i} is {describe(t)}, expected a tensor ({spec.what()})")
        if spec.shape is not None and (
            t.dim() != len(spec.shape) or any(s is not None and s != d for s, d in zip(spec.shape, t.shape))
        ):
            raise ReplyError(f"{where}: layer {i} is {describe(t)}, expected {spec.what()}")
        if spec.dtype is not None and t.dtype != spec.dtype:
            raise ReplyError(f"{where}: layer {i} is {describe(t)}, expected {spec.what()}")
        layers.append(t)
    return layers


def _as_record(result: Any, spec: Record, where: str) -> dict:
    if not isinstance(result, dict):
        raise ReplyError(f"{where}: expected {spec.what()}, got {describe(result)}")
    missing = spec.keys - result.keys()
    if missing:
        raise ReplyError(f"{where}: record lacks {sorted(missing)}; got {describe(result)}")
    return result


def _conform(result: Any, expect: Expect, where: str) -> Any:
    if isinstance(expect.item, LayerStack):
        return _as_layer_stack(result, expect.item, where)
    return _as_record(result, expect.item, where)


def _conforms(result: Any, expect: Expect) -> bool:
    try:
        _conform(result, expect, "")
    except ReplyError:
        return False
    return True


def normalize_reply(reply: Any, expect: Expect) -> Any:
    """Validate a collective_rpc reply against ``expect`` and unwrap it.

    Returns every rank's result (a list of length world_size) when ``expect.reply_rank`` is None,
    else the chosen rank's result. Layer lists come back complete, in order, with the same objects.
    """
    item = expect.item.what()
    if expect.unique_reply_rank:
        # Raw value (>= 0.11.1) or a 1-element list around it (<= 0.11.0). The expected item tells
        # them apart: a wrapped layer list is a list holding a list, a raw one a list of tensors.
        raw_ok = _conforms(reply, expect)
        wrapped_ok = isinstance(reply, (list, tuple)) and len(reply) == 1 and _conforms(reply[0], expect)
        where = f"reply of rank {expect.reply_rank} (unique_reply_rank)"
        if raw_ok and wrapped_ok:
            raise ReplyError(f"{where}: {describe(reply)} reads both as the value and as a 1-element wrapper")
        if raw_ok:
            return _conform(reply, expect, where)
        if wrapped_ok:
            return _conform(reply[0], expect, where)
        raise ReplyError(f"{where}: expected {item} or a 1-element list around it, got {describe(reply)}")

    where = f"collective_rpc reply (world size {expect.world_size})"
    if not isinstance(reply, (list, tuple)) or _is_encoded_tensor(reply):
        raise ReplyError(f"{where}: expected a list with one {item} per rank, got {describe(reply)}")
    if len(reply) != expect.world_size:
        hint = ""
        if _conforms(reply, expect):
            hint = " (this is one rank's result: was unique_reply_rank passed?)"
        raise ReplyError(
            f"{where}: expected {expect.world_size} per-rank entries of {item}, got {len(reply)}: "
            f"{describe(reply)}{hint}"
        )
    results = []
    for rank, r in enumerate(reply):
        if r is None and expect.others_may_be_none and rank != expect.reply_rank:
            results.append(None)
            continue
        results.append(_conform(r, expect, f"{where}, rank {rank}"))
    return results if expect.reply_rank is None else results[expect.reply_rank]


def check_consistent(records: Sequence[dict | None], keys: Sequence[str], what: str = "ranks") -> None:
    """Every non-None record agrees on ``keys``; a disagreement names each rank's value."""
    present = [(rank, r) for rank, r in enumerate(records) if r is not None]
    if not present:
        raise ReplyError(f"no {what} returned a record")
    for key in keys:
        values = {rank: r.get(key) for rank, r in present}
        if len({repr(v) for v in values.values()}) > 1:
            table = ", ".join(f"rank {rank}: {v!r}" for rank, v in values.items())
            raise ReplyError(f"{what} disagree on {key!r}: {table}")
