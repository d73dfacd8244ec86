"""Shard store: safetensors shards of many samples + manifest.json, the commit point.

    STORE/manifest.json          schema, target identity, layer ids, convention, dtype, hidden size,
                                 committed shards (file, sha256, bytes, sample ids, tokens)
    STORE/plan.json              every sample id the extraction intends to write (for verify)
    STORE/shards/shard-NNNNNN.safetensors
        input_ids  int32 [N]        N = tokens in the shard
        loss_mask  uint8 [N]
        offsets    int64 [S + 1]    sample s = rows offsets[s]:offsets[s+1]
        hidden_states dtype [N, n_layers, H]   layers in the manifest's layer_ids order (as vLLM's
                                    extract_hidden_states lays them out: a token's layers are adjacent)
        header metadata: sample_ids (JSON), layer_ids, convention, dtype, hidden_size, target_config_hash,
                         writer (who wrote it, e.g. "tp0 pid 1234" for the vLLM owner rank)

Writes go to a temp name, are fsynced, then renamed; the manifest is rewritten the same way after the
shard files it names are durable. A shard file that the manifest does not name is not part of the store:
opening the store deletes it, and a resumed run writes those samples again. Only safetensors and JSON
are ever read: nothing in a store is unpickled.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import queue
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from eagle3.layers import CONVENTION
from eagle3.recipe import PLAN  # plan.json: sample ids + the recorded extract options

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
SHARDS = "shards"
QUARANTINE = "quarantine"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int32: "I32",
              torch.int64: "I64", torch.uint8: "U8"}


class StoreError(RuntimeError):
    pass


class StoreMismatch(StoreError):
    """The store on disk was made for another target, layer set, dtype or hidden size."""


@dataclass(frozen=True)
class StoreSpec:
    """What every shard of a store must agree on."""

    target: dict[str, Any]          # name_or_path, config_hash, architecture, num_hidden_layers, vocab_size
    layer_ids: tuple[int, ...]
    hidden_size: int
    dtype: str = "bfloat16"
    convention: str = CONVENTION

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def mismatches(self, other: "StoreSpec") -> list[str]:
        out = []
        if self.target.get("config_hash") != other.target.get("config_hash"):
            out.append(f"target model: store has {self.target.get('name_or_path')} (config "
                       f"{self.target.get('config_hash')}), this run uses {other.target.get('name_or_path')} "
                       f"(config {other.target.get('config_hash')})")
        def norm(v):
            return tuple(v) if isinstance(v, (list, tuple)) else v

        for name in ("layer_ids", "hidden_size", "dtype", "convention"):
            a, b = getattr(self, name), getattr(other, name)
            if norm(a) != norm(b):
                out.append(f"{name}: store has {list(a) if isinstance(a, tuple) else a}, this run uses "
                           f"{list(b) if isinstance(b, tuple) else b}")
        return out

    def to_json(self) -> dict:
        d = asdict(self)
        d["layer_ids"] = list(self.layer_ids)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "StoreSpec":
        return cls(target=d["target"], layer_ids=tuple(d["layer_ids"]), hidden_size=int(d["hidden_size"]),
                   dtype=d["dtype"], convention=d["convention"])


@dataclass
class ShardInfo:
    file: str                 # relative to the store root
    sha256: str
    bytes: int
    num_samples: int
    num_tokens: int
    sample_ids: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------ file safety


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_chunks(f, chunks: Sequence[memoryview]) -> None:
    """Every byte write of the store goes through here (tests replace it to simulate a full disk)."""
    for c in chunks:
        f.write(c)


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in 16 MiB chunks (what the manifest records at commit)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def atomic_write(path: Path, chunks: Sequence[memoryview | bytes], fsync: bool = True,
                 fault: Callable[[str], None] | None = None) -> tuple[str, int]:
    """Write to .tmp-NAME, fsync, rename over NAME, fsync the folder. Returns (sha256, bytes).

    On any error the temp file is removed and the destination is untouched.
    """
    tmp = path.with_name(f".tmp-{path.name}")
    h, n = hashlib.sha256(), 0
    views = [memoryview(c) for c in chunks]
    try:
        with open(tmp, "wb") as f:
            half = len(views) // 2
            write_chunks(f, views[:half])
            if fault:
                fault("mid_write")
            write_chunks(f, views[half:])
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        for v in views:
            h.update(v)
            n += v.nbytes
        if fault:
            fault("before_rename")
        os.replace(tmp, path)
        if fsync:
            _fsync_dir(path.parent)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise StoreError(
                f"disk full while writing {path} ({n} bytes so far). Free space or choose another output "
                f"folder; the store stays consistent at its last commit, and rerunning the same command resumes."
            ) from e
        raise
    return h.hexdigest(), n


def atomic_write_json(path: Path, obj: Any, fsync: bool = True, fault=None) -> None:
    atomic_write(path, [json.dumps(obj, indent=1).encode()], fsync=fsync, fault=fault)


# ------------------------------------------------------------------------------- safetensors I/O


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
        "schema": str(SCHEMA_VERSION), "sample_ids": json.dumps(list(sample_ids)),
        "layer_ids": json.dumps(list(spec.layer_ids)), "convention": spec.convention, "dtype": spec.dtype,
        "hidden_size": str(spec.hidden_size), "target_config_hash": str(spec.target.get("config_hash")),
    }
    if writer:
        meta["writer"] = writer
    return meta


def shard_offsets(lengths: Sequence[int]) -> torch.Tensor:
    """Sample lengths -> offsets int64 [S + 1]; sample s is rows offsets[s]:offsets[s+1]."""
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(list(lengths), dtype=torch.int64).cumsum(0)
    return offsets


def shard_tensors(samples: Sequence[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]],
                  spec: StoreSpec) -> dict[str, torch.Tensor]:
    """samples of (sample_id, input_ids [T], loss_mask [T], states [n_layers, T, H]) -> shard tensors."""
    return {
        "input_ids": torch.cat([ids.to(torch.int32) for _, ids, _, _ in samples]),
        "loss_mask": torch.cat([m.to(torch.uint8) for _, _, m, _ in samples]),
        "offsets": shard_offsets([int(ids.shape[0]) for _, ids, _, _ in samples]),
        "hidden_states": torch.cat([torch.stack(list(st), dim=1).to(spec.torch_dtype) for _, _, _, st in samples]),
    }


def write_shard(root: Path, name: str, tensors: dict[str, torch.Tensor], spec: StoreSpec,
                sample_ids: Sequence[str], fsync: bool = True, fault=None, writer: str | None = None) -> ShardInfo:
    """One shard file from ready tensors (zero-copy views), atomically."""
    sha, nbytes = atomic_write(Path(root) / name, safetensors_chunks(tensors, shard_meta(spec, sample_ids, writer)),
                               fsync, fault)
    return ShardInfo(name, sha, nbytes, len(sample_ids), int(tensors["input_ids"].shape[0]), list(sample_ids))


SHARD_BYTES = 512 << 20


def shard_tokens(spec: StoreSpec, requested: int | None = None) -> int:
    """Tokens per shard: ``requested``, else ~512 MiB of states (Kimi-K2.5: 9,362 tokens)."""
    if requested:
        return requested
    per_token = len(spec.layer_ids) * spec.hidden_size * spec.torch_dtype.itemsize
    return max(256, SHARD_BYTES // per_token)


def shard_name(index: int) -> str:
    return f"{SHARDS}/shard-{index:06d}.safetensors"


def shard_index(name: str) -> int:
    return int(Path(name).stem.split("-")[1])


# ---------------------------------------------------------------------------------------- writer


class ShardWriter:
    """Groups samples into shards of about ``shard_tokens`` tokens and writes each atomically.

    ``take_done`` returns the ShardInfos of shards finished since the last call, in index order. With
    ``threads=0`` a shard is written inside ``add``; with threads > 0 in background threads, and ``add``
    only blocks when ``max_pending`` shards are queued. ``flush`` writes the rest, waits, and returns them.
    """

    def __init__(self, root: str | Path, spec: StoreSpec, start_index: int, shard_tokens: int = 1 << 18,
                 shard_samples: int | None = None, fsync: bool = True, threads: int = 0, max_pending: int = 4,
                 fault: Callable[[str], None] | None = None, writer_id: str | None = None):
        self.root, self.spec, self.next_index, self.writer_id = Path(root), spec, start_index, writer_id
        self.written: list[str] = []  # shard files this writer wrote, in completion order
        self.shard_tokens, self.shard_samples, self.fsync, self.fault = shard_tokens, shard_samples, fsync, fault
        (self.root / SHARDS).mkdir(parents=True, exist_ok=True)
        self._pending: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._pending_tokens = 0
        self._finished: dict[int, ShardInfo] = {}  # by shard index; released in index order
        self._release = start_index
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._queue: queue.Queue | None = None
        self._threads: list[threading.Thread] = []
        if threads > 0:
            self._queue = queue.Queue(maxsize=max_pending)
            for i in range(threads):
                t = threading.Thread(target=self._worker, name=f"eagle3-shard-{i}", daemon=True)
                t.start()
                self._threads.append(t)

    def add(self, sample_id: str, input_ids: torch.Tensor, loss_mask: torch.Tensor,
            states: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """states: [n_layers, T, H] (or a list of n_layers [T, H]) for this sample."""
        n_layers = len(states)
        if n_layers != len(self.spec.layer_ids):
            raise StoreError(f"sample {sample_id}: {n_layers} layers, store expects {len(self.spec.layer_ids)}")
        t = int(input_ids.shape[0])
        for k in range(n_layers):
            if tuple(states[k].shape) != (t, self.spec.hidden_size):
                raise StoreError(f"sample {sample_id}: layer {self.spec.layer_ids[k]} has shape "
                                 f"{tuple(states[k].shape)}, expected ({t}, {self.spec.hidden_size})")
        self._pending.append((sample_id, input_ids, loss_mask, states))
        self._pending_tokens += t
        if self._pending_tokens >= self.shard_tokens or (
            self.shard_samples and len(self._pending) >= self.shard_samples
        ):
            self._cut()

    def take_done(self) -> list[ShardInfo]:
        """Finished shards in index order (a shard waits for all lower-numbered ones)."""
        self._raise_if_failed()
        done = []
        with self._lock:
            while self._release in self._finished:
                done.append(self._finished.pop(self._release))
                self._release += 1
        return done

    def flush(self) -> list[ShardInfo]:
        if self._pending:
            self._cut()
        if self._queue is not None:
            self._queue.join()
        return self.take_done()

    def close(self) -> None:
        if self._queue is not None:
            for _ in self._threads:
                self._queue.put(None)
            for t in self._threads:
                t.join()
            self._queue = None

    def _cut(self) -> None:
        batch, self._pending, self._pending_tokens = self._pending, [], 0
        self.submit(lambda: (shard_tensors(batch, self.spec), [b[0] for b in batch]))

    def submit(self, build: Callable[[], tuple[dict, list[str]]], on_done: Callable[[], None] | None = None) -> None:
        """Queue one shard: build() -> (tensors, sample_ids) runs in the writer; on_done() after the write."""
        index = self.next_index
        self.next_index += 1
        if self._queue is None:
            self._write(shard_name(index), build, on_done)
        else:
            self._raise_if_failed()
            self._queue.put((shard_name(index), build, on_done))

    def _worker(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                self._error = e
            finally:
                self._queue.task_done()

    def _write(self, name: str, build, on_done=None) -> None:
        try:
            tensors, sample_ids = build()
            info = write_shard(self.root, name, tensors, self.spec, sample_ids, self.fsync, self.fault, self.writer_id)
        finally:
            if on_done is not None:
                on_done()
        with self._lock:
            self._finished[shard_index(name)] = info
            self.written.append(name)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error


# ----------------------------------------------------------------------------------------- store


class Store:
    """A store folder: its manifest, committed shards, and what is already done."""

    def __init__(self, root: Path, manifest: dict):
        self.root, self.manifest = root, manifest
        self.spec = StoreSpec.from_json(manifest["spec"])
        self.done_ids: set[str] = {sid for s in manifest["shards"] for sid in s["sample_ids"]}

    # -- opening
    @classmethod
    def open(cls, root: str | Path, spec: StoreSpec | None = None, create: bool = False,
             fsync: bool = True) -> "Store":
        """Open (or with ``create``, make) a store; remove uncommitted files; refuse a mismatched spec."""
        root = Path(root)
        path = root / MANIFEST
        if path.exists():
            manifest = read_manifest(root)
            store = cls(root, manifest)
            if spec is not None:
                diffs = store.spec.mismatches(spec)
                if diffs:
                    raise StoreMismatch(
                        f"{path} was written for a different setup: " + "; ".join(diffs)
                        + ". Use a new --out folder, or the same target, layer ids, dtype and hidden size."
                    )
            store._remove_uncommitted()
            return store
        if not create:
            raise StoreError(f"{root} is not a store (no {MANIFEST}); run `eagle3 extract` to make one")
        if spec is None:
            raise StoreError("creating a store needs its spec")
        _check_writable(root)
        leftovers = [p for p in (root / SHARDS).glob("*")] if (root / SHARDS).exists() else []
        for p in leftovers:
            p.unlink()
        manifest = {"schema_version": SCHEMA_VERSION, "spec": spec.to_json(), "shards": [],
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
        (root / SHARDS).mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, manifest, fsync=fsync)
        return cls(root, manifest)

    def _remove_uncommitted(self) -> None:
        committed = {s["file"] for s in self.manifest["shards"]}
        for p in sorted((self.root / SHARDS).glob("*")) if (self.root / SHARDS).exists() else []:
            rel = f"{SHARDS}/{p.name}"
            if rel not in committed:
                log.info("removing uncommitted %s (its samples will be extracted again)", rel)
                p.unlink()
        for p in self.root.glob(".tmp-*"):
            p.unlink()

    # -- state
    @property
    def shards(self) -> list[dict]:
        return self.manifest["shards"]

    @property
    def next_shard_index(self) -> int:
        used = [shard_index(s["file"]) for s in self.shards]
        return max(used) + 1 if used else 0

    @property
    def num_tokens(self) -> int:
        return sum(s["num_tokens"] for s in self.shards)

    # -- commit
    def commit(self, infos: Sequence[ShardInfo], fsync: bool = True, fault=None) -> None:
        """Add durable shards to the manifest (the commit point). Refuses duplicates and missing files."""
        if not infos:
            return
        new_ids: set[str] = set()
        for info in infos:
            p = self.root / info.file
            if not p.exists() or p.stat().st_size != info.bytes:
                raise StoreError(f"cannot commit {info.file}: file missing or of the wrong size")
            dup = (set(info.sample_ids) & self.done_ids) | (set(info.sample_ids) & new_ids)
            if dup or len(set(info.sample_ids)) != len(info.sample_ids):
                raise StoreError(f"cannot commit {info.file}: samples already in the store: {sorted(dup)[:5]}")
            new_ids |= set(info.sample_ids)
        manifest = dict(self.manifest, shards=self.shards + [asdict(i) for i in infos],
                        updated=time.strftime("%Y-%m-%dT%H:%M:%S"))
        if fault:
            fault("before_manifest")
        atomic_write_json(self.root / MANIFEST, manifest, fsync=fsync, fault=fault)
        self.manifest = manifest
        self.done_ids |= new_ids

    def write_plan(self, sample_ids: Sequence[str], fsync: bool = True, recipe: dict | None = None) -> None:
        """The sample ids this store will hold, and the extract options that made it (recipe.py)."""
        atomic_write_json(self.root / PLAN, {"sample_ids": list(sample_ids), "recipe": recipe}, fsync=fsync)

    def plan(self) -> list[str] | None:
        p = self.root / PLAN
        return json.loads(p.read_text())["sample_ids"] if p.exists() else None

    def drop_shards(self, files: set[str], fsync: bool = True) -> None:
        """Remove shards from the manifest (verify --fix); their samples become 'not done'."""
        manifest = dict(self.manifest, shards=[s for s in self.shards if s["file"] not in files])
        atomic_write_json(self.root / MANIFEST, manifest, fsync=fsync)
        self.manifest = manifest
        self.done_ids = {sid for s in manifest["shards"] for sid in s["sample_ids"]}

    # -- reading
    def iter_samples(self, layer_ids: Sequence[int] | None = None) -> Iterator[dict]:
        """Yield {sample_id, input_ids [T], loss_mask [T], states {id: [T, H]}} in commit order."""
        from safetensors import safe_open

        ids = list(layer_ids) if layer_ids is not None else list(self.spec.layer_ids)
        missing = set(ids) - set(self.spec.layer_ids)
        if missing:
            raise StoreMismatch(f"{self.root} has layers {list(self.spec.layer_ids)}, not {sorted(missing)}")
        for shard in self.shards:
            with safe_open(str(self.root / shard["file"]), framework="pt") as f:
                offsets = f.get_tensor("offsets").tolist()
                sample_ids = json.loads(f.metadata()["sample_ids"])
                input_ids, loss_mask = f.get_tensor("input_ids"), f.get_tensor("loss_mask")
                hs = f.get_slice("hidden_states")
                col = {i: self.spec.layer_ids.index(i) for i in ids}
                for s, sid in enumerate(sample_ids):
                    a, b = offsets[s], offsets[s + 1]
                    rows = hs[a:b]  # [T, n_layers, H]
                    yield {"sample_id": sid, "input_ids": input_ids[a:b], "loss_mask": loss_mask[a:b],
                           "states": {i: rows[:, col[i]] for i in ids}}


def read_manifest(root: str | Path) -> dict:
    path = Path(root) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise StoreError(f"{path} is not valid JSON ({e.msg}, line {e.lineno}); restore it or re-extract") from None
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise StoreError(f"{path} has schema_version {version!r}; this eagle3 reads {SCHEMA_VERSION}")
    for key in ("spec", "shards"):
        if key not in manifest:
            raise StoreError(f"{path} lacks {key!r}; it is not an eagle3 manifest")
    return manifest


def _check_writable(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / ".tmp-write-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise StoreError(f"output folder {root} is not writable ({e.strerror}); choose another --out") from None
