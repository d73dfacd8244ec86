"""The store format: what a store folder and a shard file hold (see eagle3/store/__init__.py), the
spec every shard of a store shares, and how samples become one shard's tensors and header."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3.targets.layers import CONVENTION

SCHEMA_VERSION = 1


MANIFEST = "manifest.json"


SHARDS = "shards"


QUARANTINE = "quarantine"


FP8 = "float8_e4m3fn"  # states as e4m3 with a float32 scale per (token, layer), as speculators' FP8 connector
FP8_MAX = 448.0  # the largest finite e4m3fn value


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, FP8: torch.float8_e4m3fn}


_ST_DTYPES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.uint8: "U8",
    torch.float8_e4m3fn: "F8_E4M3",
}


ST_STATE_DTYPES = {_ST_DTYPES[t]: name for name, t in _DTYPES.items()}  # safetensors dtype -> store dtype name


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] -> (e4m3 [..., H], scale float32 [...]): each row scaled so its largest |value| is FP8_MAX.
    An all-zero row gets scale 0 (and dequantizes to zeros)."""
    amax = x.abs().amax(-1).float()
    scale = amax / FP8_MAX
    q = (x.float() / scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scale


def dequantize(states: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored states [..., H] (+ scales [...] for an fp8 store) -> ``dtype``."""
    if scales is None:
        return states.to(dtype)
    return (states.float() * scales.float().unsqueeze(-1)).to(dtype)


def read_states(f, spec: StoreSpec, a: int | None = None, b: int | None = None) -> torch.Tensor:
    """Rows a:b of an open shard's hidden_states [T, n_layers, H]: as stored, or for an fp8 store dequantized
    with its scales to float32. The one place a reader undoes the store's encoding."""
    rows = f.get_slice("hidden_states")[a:b]
    return dequantize(rows, f.get_slice("scales")[a:b]) if spec.fp8 else rows


class StoreError(RuntimeError):
    pass


class ManifestUnreadable(StoreError):
    """The manifest is not JSON (empty, cut short, other bytes): what a power loss may leave of one never fsynced."""


class StoreMismatch(StoreError):
    """The store on disk was made for another target, layer set, dtype or hidden size."""


@dataclass(frozen=True)
class StoreSpec:
    """What every shard of a store must agree on."""

    target: dict[str, Any]  # name_or_path, config_hash, architecture, num_hidden_layers, vocab_size
    layer_ids: tuple[int, ...]
    hidden_size: int
    dtype: str = "bfloat16"
    convention: str = CONVENTION

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def fp8(self) -> bool:
        return self.dtype == FP8

    @property
    def bytes_per_token(self) -> int:
        """Bytes of states one token adds to a shard: layers x hidden x dtype size (+ a float32 scale per layer
        in an fp8 store)."""
        layers = len(self.layer_ids)
        return layers * self.hidden_size * self.torch_dtype.itemsize + (4 * layers if self.fp8 else 0)

    def mismatches(self, other: StoreSpec) -> list[str]:
        out = []
        if self.target.get("config_hash") != other.target.get("config_hash"):
            out.append(
                f"target model: store has {self.target.get('name_or_path')} (config "
                f"{self.target.get('config_hash')}), this run uses {other.target.get('name_or_path')} "
                f"(config {other.target.get('config_hash')})"
            )

        def norm(v):
            return tuple(v) if isinstance(v, (list, tuple)) else v

        for name in ("layer_ids", "hidden_size", "dtype", "convention"):
            a, b = getattr(self, name), getattr(other, name)
            if norm(a) != norm(b):
                out.append(
                    f"{name}: store has {list(a) if isinstance(a, tuple) else a}, this run uses "
                    f"{list(b) if isinstance(b, tuple) else b}"
                )
        return out

    def to_json(self) -> dict:
        d = asdict(self)
        d["layer_ids"] = list(self.layer_ids)
        return d

    @classmethod
    def from_json(cls, d: dict) -> StoreSpec:
        return cls(
            target=d["target"],
            layer_ids=tuple(d["layer_ids"]),
            hidden_size=int(d["hidden_size"]),
            dtype=d["dtype"],
            convention=d["convention"],
        )


@dataclass
class ShardInfo:
    file: str  # relative to the store root
    checksum: str  # "xxh3_128:HEX" (or "sha256:HEX"): files.CHECKSUM at write time
    bytes: int
    num_samples: int
    num_tokens: int
    sample_ids: list[str] = field(default_factory=list)


def safetensors_chunks(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> list[memoryview]:
    """The safetensors byte layout as zero-copy views: u64 header size, JSON header, raw tensor bytes."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset, views = 0, []
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        views.append(memoryview(t.view(torch.uint8).reshape(-1).numpy()) if nbytes else memoryview(b""))
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return [memoryview(len(raw).to_bytes(8, "little")), memoryview(raw), *views]


def shard_meta(spec: StoreSpec, sample_ids: Sequence[str], writer: str | None = None) -> dict[str, str]:
    meta = {
        "schema": str(SCHEMA_VERSION),
        "sample_ids": json.dumps(list(sample_ids)),
        "layer_ids": json.dumps(list(spec.layer_ids)),
        "convention": spec.convention,
        "dtype": spec.dtype,
        "hidden_size": str(spec.hidden_size),
        "target_config_hash": str(spec.target.get("config_hash")),
    }
    if writer:
        meta["writer"] = writer
    return meta


def shard_offsets(lengths: Sequence[int]) -> torch.Tensor:
    """Sample lengths -> offsets int64 [S + 1]; sample s is rows offsets[s]:offsets[s+1]."""
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(list(lengths), dtype=torch.int64).cumsum(0)
    return offsets


def shard_tensors(
    samples: Sequence[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]], spec: StoreSpec
) -> dict[str, torch.Tensor]:
    """samples of (sample_id, input_ids [T], loss_mask [T], states [n_layers, T, H]) -> shard tensors.
    An fp8 store gets hidden_states e4m3 [N, n_layers, H] and scales float32 [N, n_layers]."""
    out = {
        "input_ids": torch.cat([ids.to(torch.int32) for _, ids, _, _ in samples]),
        "loss_mask": torch.cat([m.to(torch.uint8) for _, _, m, _ in samples]),
        "offsets": shard_offsets([int(ids.shape[0]) for _, ids, _, _ in samples]),
    }
    states = torch.cat([torch.stack(list(st), dim=1) for _, _, _, st in samples])
    if spec.fp8:
        out["hidden_states"], out["scales"] = quantize_fp8(states)
    else:
        out["hidden_states"] = states.to(spec.torch_dtype)
    return out


SHARD_BYTES = 512 << 20


def shard_tokens(spec: StoreSpec, requested: int | None = None) -> int:
    """Tokens per shard: ``requested``, else ~512 MiB of states (Kimi-K2.5: 9,362 tokens)."""
    if requested:
        return requested
    return max(256, SHARD_BYTES // spec.bytes_per_token)


def shard_name(index: int) -> str:
    return f"{SHARDS}/shard-{index:06d}.safetensors"


def shard_index(name: str) -> int:
    return int(Path(name).stem.split("-")[1])
