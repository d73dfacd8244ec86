"""Training checkpoints: the draft in speculators format + optimizer and trainer state. No pickles.

    OUT/checkpoints/step-0000010/config.json, model.safetensors   the draft's weights in the training dtype
                                optimizer.safetensors, optimizer.json  AdamW state tensors, param groups
                                trainer_state.json                 step, loss history, config
                                files.json                         each file above: bytes and xxh3_128, written last
    OUT/draft/                  the servable draft: bf16, no embedding, published atomically

A checkpoint is written into .tmp-step-N, fsynced, then renamed: a folder named step-N is complete, and every
file in it is checked against files.json before it is resumed from (a truncated or changed file makes the
checkpoint torn: the one before it is used). A save is a snapshot (host copies, taken between optimizer steps) and
its write, which Background runs in a thread while training goes on (`--checkpoint-background`). Neither
checkpoints nor the draft hold the token embedding: it is the target's, frozen; training reloads it from the
target, and vLLM 0.26 shares the target's when the draft has none (llm_base_proposer._maybe_share_embeddings).
For Kimi-K2.5 that is 163840 x 7168 (2.3 GB in bf16) not written per checkpoint.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eagle3.store.files import fsync_dir

log = logging.getLogger(__name__)

CKPT_DIR = "checkpoints"
CKPT_FILES = ("config.json", "model.safetensors", "optimizer.safetensors", "optimizer.json", "trainer_state.json")
FILES = "files.json"  # {name: {"bytes": n, "checksum": "xxh3_128:..."}} of every file in CKPT_FILES
# Parameters that come from the target and are never saved: verifier_* (training targets only) and the embedding.
NOT_SAVED = ("verifier_lm_head.weight", "verifier_norm.weight", "embed_tokens.weight")
DRAFT_FILES = (
    "config.json",
    "model.safetensors",
    "README.md",
)  # what publish writes into OUT/draft, which it replaces whole


class NonFiniteWeights(RuntimeError):
    """A draft with NaN/Inf parameters: never published."""


def draft_tensors(model, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The draft's own tensors (floating ones cast to ``dtype``), without what NOT_SAVED names: host copies (on the
    CPU too, where ``.cpu()`` would hand back the training tensors themselves)."""
    out = {}
    for name, t in model.state_dict().items():
        if name in NOT_SAVED:
            continue
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.to("cpu", copy=True).contiguous()
    return out


def nonfinite_parameters(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    from eagle3.store.finite import all_finite

    return {
        k: int((~torch.isfinite(t)).sum()) for k, t in tensors.items() if t.is_floating_point() and not all_finite(t)
    }


def _fsync_tree(path: Path) -> None:
    """Every file under ``path``, then the folder itself."""
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(path)


def optimizer_to_files(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = optimizer.state_dict()
    tensors = {}
    for idx, st in sd["state"].items():
        for name, value in st.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors[f"state.{idx}.{name}"] = t.detach().to("cpu", copy=True).contiguous()  # a copy, as above
    return tensors, {"param_groups": sd["param_groups"]}


def optimizer_from_files(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for key, t in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = t
    return {"state": state, "param_groups": meta["param_groups"]}


@dataclass
class Snapshot:
    """A checkpoint's contents on the host, taken between optimizer steps: what the training thread does of a save
    (the copies from the device); write() does the rest, in another thread where training goes on meanwhile."""

    config: Any  # the draft's config (its save_pretrained writes config.json)
    weights: dict[str, torch.Tensor]  # draft_tensors
    optimizer: dict[str, torch.Tensor]  # optimizer_to_files
    optimizer_meta: dict
    state: dict  # the trainer's state, as JSON has it


def snapshot(model, optimizer, trainer_state: dict) -> Snapshot:
    tensors, meta = optimizer_to_files(optimizer)
    return Snapshot(
        copy.deepcopy(model.config),
        draft_tensors(model),
        tensors,
        copy.deepcopy(meta),
        json.loads(json.dumps(dict(trainer_state, rng=rng_state()))),
    )


def rng_state() -> dict[str, list[str]]:
    """torch's random generators (the CPU's, each CUDA device's) as base64, for trainer_state.json."""
    import base64

    def text(t: torch.Tensor) -> str:
        return base64.b64encode(t.numpy().tobytes()).decode()

    cuda = [text(t) for t in torch.cuda.get_rng_state_all()] if torch.cuda.is_initialized() else []
    return {"cpu": [text(torch.get_rng_state())], "cuda": cuda}


def set_rng_state(saved: dict | None) -> None:
    """Restore what rng_state() recorded (a checkpoint from before it recorded none: nothing)."""
    import base64

    def tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    if not saved:
        return
    torch.set_rng_state(tensor(saved["cpu"][0]))
    if saved.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensor(t) for t in saved["cuda"]])


def save(
    out: Path, step: int, model, optimizer, trainer_state: dict, fault: Callable[[str], None] | None = None
) -> Path:
    return write(out, step, snapshot(model, optimizer, trainer_state), fault)


def write(out: Path, step: int, snap: Snapshot, fault: Callable[[str], None] | None = None) -> Path:
    """Write ``snap`` as OUT/checkpoints/step-N: into .tmp-step-N, checksummed (files.json), fsynced, renamed."""
    root = Path(out) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"step-{step:07d}", root / f".tmp-step-{step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    snap.config.save_pretrained(tmp)
    save_file(snap.weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if fault:
        fault("mid_checkpoint")
    save_file(snap.optimizer, str(tmp / "optimizer.safetensors"))
    (tmp / "optimizer.json").write_text(json.dumps(snap.optimizer_meta))
    (tmp / "trainer_state.json").write_text(json.dumps(snap.state, indent=1))
    (tmp / FILES).write_text(json.dumps({f: _fingerprint(tmp / f) for f in CKPT_FILES}, indent=1))
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)  # the rename; the files were fsynced under .tmp-step-N
    return final


def _fingerprint(path: Path) -> dict:
    from eagle3.store.files import file_checksum

    return {"bytes": path.stat().st_size, "checksum": file_checksum(path)}


def complete(path: Path) -> bool:
    """Every file present, of the size and checksum files.json records (a torn, truncated or changed checkpoint
    is skipped, not resumed from). A checkpoint from before files.json: every file present and readable."""
    from safetensors import safe_open

    if not all((path / f).is_file() for f in CKPT_FILES):
        return False
    if (path / FILES).is_file():
        try:
            recorded = json.loads((path / FILES).read_text())
            return set(recorded) == set(CKPT_FILES) and all(
                (path / f).stat().st_size == recorded[f]["bytes"] and _fingerprint(path / f) == recorded[f]
                for f in CKPT_FILES
            )
        except (ValueError, KeyError, TypeError, OSError):
            return False
    try:
        for f in ("model.safetensors", "optimizer.safetensors"):
            with safe_open(str(path / f), framework="pt"):  # refuses a file shorter than its header says
                pass
        for f in ("optimizer.json", "trainer_state.json", "config.json"):
            json.loads((path / f).read_text())
    except Exception:  # noqa: BLE001 - any read failure means torn
        return False
    return True


def latest(out: Path) -> Path | None:
    """The newest complete checkpoint; torn ones are logged and skipped."""
    root = Path(out) / CKPT_DIR
    if not root.exists():
        return None
    for p in root.glob(".tmp-step-*"):
        shutil.rmtree(p, ignore_errors=True)  # an interrupted save
    for p in sorted(root.glob("step-*"), reverse=True):
        if complete(p):
            return p
        log.warning("skipping incomplete checkpoint %s", p)
    return None


def sizes_match(path: Path) -> bool:
    """Every file present at the size files.json records, no checksum read (rotation's check: re-reading every kept
    checkpoint at each save read 36-48 GB at Kimi-K2.5's draft size, keep 3); a checkpoint from before files.json:
    complete()."""
    if not (path / FILES).is_file():
        return complete(path)
    try:
        recorded = json.loads((path / FILES).read_text())
        return set(recorded) == set(CKPT_FILES) and all(
            (path / f).stat().st_size == recorded[f]["bytes"] for f in CKPT_FILES
        )
    except (ValueError, KeyError, TypeError, OSError):
        return False


def prune(out: Path, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints whose files are all there at their recorded sizes (keep <= 0: keep
    all). A save checksums its own files; the resume (latest) checks every checksum again."""
    if keep <= 0:
        return
    done = sorted(p for p in (Path(out) / CKPT_DIR).glob("step-*") if sizes_match(p))
    for p in done[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


class Background:
    """Checkpoints written in a thread while training goes on (TrainConfig.checkpoint_background), one at a time:
    submit() waits for the one in flight first. A write's error is raised in the training thread, at the next
    submit() or wait(). The thread is not a daemon: a process that ends waits for the checkpoint being written."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def submit(self, fn: Callable[[], Any]) -> None:
        self.wait()

        def run() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - raised in the training thread by wait()
                self.error = e

        self.thread = threading.Thread(target=run, name="eagle3-checkpoint")
        self.thread.start()

    def wait(self) -> None:
        """Until the checkpoint in flight is written; raises what its write raised."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            e, self.error = self.error, None
            raise e

    def __enter__(self) -> Background:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        """Leaving the training loop: the checkpoint in flight written first. Where the loop raised, that error
        stays the one raised (the write's is logged)."""
        try:
            self.wait()
        except BaseException as e:  # noqa: BLE001
            if exc is None:
                raise
            log.error("the checkpoint written in the background failed too: %s: %s", type(e).__name__, e)


def load(path: Path, model, optimizer) -> dict:
    """Restore model weights and optimizer state from a checkpoint folder; returns trainer_state."""
    weights = load_file(str(path / "model.safetensors"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - set(NOT_SAVED):
        raise RuntimeError(f"{path}: checkpoint does not match the draft (missing {missing}, unexpected {unexpected})")
    meta = json.loads((path / "optimizer.json").read_text())
    optimizer.load_state_dict(optimizer_from_files(load_file(str(path / "optimizer.safetensors")), meta))
    state = json.loads((path / "trainer_state.json").read_text())
    set_rng_state(state.pop("rng", None))
    return state


def refuse_foreign_draft_files(out: Path) -> None:
    """UsageError where OUT/draft holds a file publish does not write (DRAFT_FILES): publish replaces the folder
    whole, so such a file is named (train checks before its first step too), never deleted."""
    from eagle3.preflight import UsageError

    draft = Path(out) / "draft"
    foreign = sorted(p.name for p in draft.iterdir() if p.name not in DRAFT_FILES) if draft.is_dir() else []
    if draft.exists() and not draft.is_dir():
        foreign = [draft.name]
    if foreign:
        raise UsageError(
            f"{draft} holds {', '.join(foreign[:5])}, which eagle3 did not write there; the draft folder "
            "is replaced whole when training ends: move them out, or give another --out"
        )


def publish(ckpt: Path, out: Path, dtype: str = "bfloat16", serve_tps=(), readme: str | None = None) -> Path:
    """Write the servable draft to OUT/draft atomically: floating tensors in ``dtype`` (vLLM serves in the
    target's dtype; bf16 halves the bytes of a float32 checkpoint), config.json saying so. Refuses a draft with
    non-finite weights or one vLLM would refuse at any of ``serve_tps`` (None: the trainer's defaults, SERVE_TPS or
    for an MLA draft those its target's heads split over)."""
    from eagle3.train.draft import SERVE_TPS, DraftShape, check_servable

    config = json.loads((ckpt / "config.json").read_text())
    if config.get("eagle3_mla"):  # the MLA draft: vLLM loads it from an HF-style config (train/mla_draft.py)
        from eagle3.train import mla_draft

        shape = mla_draft.MLAShape(**config["eagle3_mla"])
        shape.check_servable(mla_draft.serve_tps(shape, serve_tps))
        config = mla_draft.hf_config(shape, config, dtype)
    else:
        check_servable(
            DraftShape.from_layer_config(config["transformer_layer_config"]),
            SERVE_TPS if serve_tps is None else serve_tps,
        )
    tensors = {
        k: (t.to(getattr(torch, dtype)) if t.is_floating_point() else t)
        for k, t in load_file(str(ckpt / "model.safetensors")).items()
    }
    bad = nonfinite_parameters(tensors)
    if bad:
        raise NonFiniteWeights(
            f"{ckpt}: the draft has non-finite weights ({sum(bad.values())} values in "
            f"{sorted(bad)[:4]}); not publishing it"
        )
    config["torch_dtype"] = dtype
    if "transformer_layer_config" in config:
        config["transformer_layer_config"]["torch_dtype"] = dtype
    dest, tmp = Path(out) / "draft", Path(out) / ".tmp-draft"
    refuse_foreign_draft_files(out)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    if readme:
        (tmp / "README.md").write_text(readme)
    from eagle3.train.draft import DraftShapeError
    from eagle3.train.vllm_reads import problems

    wrong = problems(tmp)
    if wrong:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DraftShapeError(f"{ckpt}: vLLM 0.26 would build another draft than these weights: {'; '.join(wrong)}")
    _fsync_tree(tmp)
    old = Path(out) / ".old-draft"
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.replace(dest, old)
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest
