"""`eagle3 verify STORE`: check every shard against the manifest and every sample's states.

Findings (kind: what it means):
  missing_file, size_mismatch, checksum_mismatch   the file is not the one committed
  bad_header        not a readable safetensors file, or tensors/metadata missing
  bad_dtype, bad_shape, bad_offsets               tensors disagree with the manifest or each other
  ids_mismatch      the shard's sample ids differ from the manifest's
  layer_ids_mismatch  the shard's layer ids/convention differ from the manifest's
  nonfinite         NaN or Inf in a sample's states
  zero_layer        a sample's layer is all zeros (never written)
  duplicate_layers  two layers of a sample are identical (the signature of the reply[0] bug)
  repeated_sample   a sample id in more than one place
  missing_sample    a planned sample id that no shard holds
  uncommitted_file  a shard file the manifest does not name (removed on the next extract)
The report also says whether the store is complete against its plan, and names a process writing it now.
``--fix`` moves shards with findings to STORE/quarantine/ and drops them from the manifest, so
`eagle3 extract --resume STORE` redoes exactly those samples. The report ends with the command that repairs it.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle3.store import lock as store_lock
from eagle3.store.files import checksum_matches, recorded_checksum
from eagle3.store.finite import all_finite
from eagle3.store.folder import Store, read_manifest
from eagle3.store.format import QUARANTINE, SHARDS, ST_STATE_DTYPES, read_states


@dataclass
class Finding:
    kind: str
    shard: str | None
    sample: str | None
    detail: str

    def __str__(self) -> str:
        where = " ".join(x for x in (self.shard, self.sample and f"sample {self.sample}") if x)
        return f"{self.kind:<18} {where}: {self.detail}"


@dataclass
class VerifyReport:
    store: str
    shards: int = 0
    samples: int = 0
    tokens: int = 0
    findings: list[Finding] = field(default_factory=list)
    planned: int | None = None  # samples the plan names (None: no plan)
    held: int = 0  # of those, samples some shard holds
    writer: str | None = None  # 'pid N (...)' of a process writing the store now

    def status_lines(self) -> list[str]:
        """complete / incomplete against the plan, and the writer, if one is at work."""
        out = []
        if self.planned is not None:
            missing = self.planned - self.held
            out.append(
                f"complete   {self.held} of {self.planned} planned samples"
                if not missing
                else f"incomplete {self.held} of {self.planned} planned samples ({missing} missing): "
                f"`eagle3 extract --resume {self.store}` completes it"
            )
        if self.writer:
            out.append(f"writing    being written by {self.writer}: what is read now may change")
        return out

    @property
    def ok(self) -> bool:
        return not self.findings

    def kinds(self) -> Counter:
        return Counter(f.kind for f in self.findings)

    def lines(self, per_kind: int = 20) -> list[str]:
        """A head line with exact counts, then up to ``per_kind`` findings of each kind and how many more."""
        head = f"{self.store}: {self.shards} shards, {self.samples} samples, {self.tokens} tokens: "
        head += "OK" if self.ok else f"{len(self.findings)} findings " + json.dumps(dict(self.kinds()))
        out, shown = [head], Counter()
        for f in self.findings:
            shown[f.kind] += 1
            if shown[f.kind] <= per_kind:
                out.append(str(f))
        out += [f"{'':<18} ... and {n - per_kind} more {kind}" for kind, n in self.kinds().items() if n > per_kind]
        return out + self.status_lines()


def _check_shard(store: Store, shard: dict, rep: VerifyReport, deep: bool) -> None:
    from safetensors import safe_open

    name, path, spec = shard["file"], store.root / shard["file"], store.spec

    def bad(kind, detail, sample=None):
        rep.findings.append(Finding(kind, name, sample, detail))

    if not path.exists():
        return bad("missing_file", "file is gone")
    if path.stat().st_size != shard["bytes"]:
        return bad("size_mismatch", f"{path.stat().st_size} bytes, manifest says {shard['bytes']}")
    if deep and not checksum_matches(path, shard):
        return bad("checksum_mismatch", f"content differs from what was committed ({recorded_checksum(shard)})")
    try:
        f = safe_open(str(path), framework="pt")
        meta, keys = f.metadata() or {}, set(f.keys())
    except Exception as e:  # noqa: BLE001 - any parse failure is the finding
        return bad("bad_header", f"{type(e).__name__}: {e}")
    need = {"input_ids", "loss_mask", "offsets", "hidden_states"}
    if need - keys or "sample_ids" not in meta:
        return bad("bad_header", f"missing {sorted(need - keys) or ['sample_ids metadata']}")
    if json.loads(meta.get("layer_ids", "null")) != list(spec.layer_ids) or meta.get("convention") != spec.convention:
        bad("layer_ids_mismatch", f"shard has {meta.get('layer_ids')} / {meta.get('convention')!r}")
    sample_ids = json.loads(meta["sample_ids"])
    if sample_ids != shard["sample_ids"]:
        bad("ids_mismatch", f"header holds {len(sample_ids)} ids that differ from the manifest's")
    offsets = f.get_tensor("offsets").tolist()
    n_tok = f.get_slice("input_ids").get_shape()[0]
    if (
        len(offsets) != len(sample_ids) + 1
        or offsets[0] != 0
        or offsets[-1] != n_tok
        or any(b <= a for a, b in zip(offsets, offsets[1:]))
    ):
        return bad("bad_offsets", f"offsets {offsets[:4]}... do not cut {n_tok} tokens into {len(sample_ids)} samples")
    if f.get_slice("loss_mask").get_shape() != [n_tok]:
        bad("bad_shape", f"loss_mask shape {f.get_slice('loss_mask').get_shape()}, expected [{n_tok}]")
    sl = f.get_slice("hidden_states")
    want = [n_tok, len(spec.layer_ids), spec.hidden_size]
    if sl.get_shape() != want:
        return bad("bad_shape", f"hidden_states shape {sl.get_shape()}, expected {want}")
    if ST_STATE_DTYPES.get(sl.get_dtype()) != spec.dtype:
        return bad("bad_dtype", f"hidden_states is {sl.get_dtype()}, manifest says {spec.dtype}")
    if spec.fp8:
        if "scales" not in keys:
            return bad("bad_header", "an fp8 shard without its scales tensor")
        sc = f.get_slice("scales")
        if sc.get_shape() != want[:2] or sc.get_dtype() != "F32":
            return bad("bad_shape", f"scales {sc.get_dtype()} {sc.get_shape()}, expected F32 {want[:2]}")
    rep.shards += 1
    rep.tokens += n_tok
    if not deep:
        rep.samples += len(sample_ids)
        return
    hs = read_states(f, spec)  # [N, n_layers, H]
    for s, sid in enumerate(sample_ids):
        a, b = offsets[s], offsets[s + 1]
        rows = [hs[a:b, k] for k in range(len(spec.layer_ids))]
        for i, r in zip(spec.layer_ids, rows):
            if not all_finite(r):
                bad("nonfinite", f"layer {i} has {int((~torch.isfinite(r)).sum())} NaN/Inf values", sid)
            if not r.any():
                bad("zero_layer", f"layer {i} is all zeros", sid)
        for x in range(len(rows)):
            for y in range(x + 1, len(rows)):
                if torch.equal(rows[x], rows[y]):
                    bad(
                        "duplicate_layers",
                        f"layers {spec.layer_ids[x]} and {spec.layer_ids[y]} are identical "
                        "(one layer stored twice: the reply[0] bug?)",
                        sid,
                    )
        rep.samples += 1


def verify(root: str | Path, deep: bool = True) -> VerifyReport:
    from eagle3.preflight import store_folder

    root = store_folder(root)
    store = Store(root, read_manifest(root))  # not Store.open: verify must not delete anything
    rep, seen = VerifyReport(str(root)), Counter()
    for shard in store.shards:
        _check_shard(store, shard, rep, deep)
        seen.update(shard["sample_ids"])
    for sid, n in seen.items():
        if n > 1:
            rep.findings.append(Finding("repeated_sample", None, sid, f"stored {n} times"))
    plan = store.plan()
    rep.writer = store_lock.being_written(root)
    if plan is not None:
        rep.planned, rep.held = len(set(plan)), len(set(plan) & set(seen))
        for sid in plan:
            if sid not in seen:
                rep.findings.append(Finding("missing_sample", None, sid, "planned but in no shard"))
    committed = {s["file"] for s in store.shards}
    for p in sorted((root / SHARDS).glob("*")) if (root / SHARDS).exists() else []:
        if f"{SHARDS}/{p.name}" not in committed and store_lock.is_own_shard_name(p.name):  # a user's file: theirs
            rep.findings.append(Finding("uncommitted_file", f"{SHARDS}/{p.name}", None, "not in the manifest"))
    return rep


def fix(root: str | Path, rep: VerifyReport) -> list[str]:
    """Quarantine shards with findings (and uncommitted files); returns the moved files."""
    root = Path(root)
    held = store_lock.WriteLock(root, "verify --fix")  # it rewrites the manifest: no other writer meanwhile
    try:
        return _fix_locked(root, rep)
    finally:
        held.release()


def _fix_locked(root: Path, rep: VerifyReport) -> list[str]:
    store = Store(root, read_manifest(root))
    bad = {f.shard for f in rep.findings if f.shard}
    if any(f.kind == "repeated_sample" for f in rep.findings):
        first: dict[str, str] = {}
        for s in store.shards:  # keep each sample's first shard, quarantine later copies
            for sid in s["sample_ids"]:
                if sid in first:
                    bad.add(s["file"])
                first.setdefault(sid, s["file"])
    qdir = root / QUARANTINE
    qdir.mkdir(exist_ok=True)
    moved = []
    for name in sorted(bad):
        p = root / name
        if p.exists():
            os.replace(p, qdir / p.name)
            moved.append(name)
    store.drop_shards(bad)
    return moved


def repair_lines(root: str | Path, rep: VerifyReport, fixed: bool) -> list[str]:
    """What to run next: after ``rep`` (and after --fix when ``fixed``), the one command that repairs the store."""
    from eagle3.store import recipe

    if rep.ok:
        return []
    root = Path(root)
    resume = (
        f"eagle3 extract --resume {root}"
        if recipe.load(root) is not None
        else f"your original `eagle3 extract ... --out {root}` command (this store did not record it)"
    )
    store = Store(root, read_manifest(root))
    plan = store.plan() or []
    missing = sum(1 for sid in plan if sid not in store.done_ids)
    if fixed:
        return [f"now {missing} planned samples are missing; repair: {resume}"]
    bad = {f.shard for f in rep.findings if f.shard} | (
        {"?"} if any(f.kind == "repeated_sample" for f in rep.findings) else set()
    )
    if bad:
        held = sum(len(s["sample_ids"]) for s in store.shards if s["file"] in bad)
        return [
            f"repair: eagle3 verify {root} --fix (quarantines {len(bad - {'?'})} shard(s) holding {held} samples), "
            f"then {resume} (extracts them and the {missing} missing)"
        ]
    return [f"repair: {resume} (extracts the {missing} missing samples)"]
