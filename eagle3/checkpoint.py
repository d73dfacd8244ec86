"""Training checkpoints: the draft in speculators format + optimizer and trainer state. No pickles.

    OUT/checkpoints/step-0000010/config.json, model.safetensors   the draft as vLLM serves it
                                optimizer.safetensors, optimizer.json  AdamW state tensors, param groups
                                trainer_state.json                 step, loss history, config
    OUT/draft/                  the latest draft, published atomically

A checkpoint is written into .tmp-step-N, fsynced, then renamed: a folder named step-N is complete.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)

CKPT_DIR = "checkpoints"


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def optimizer_to_files(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = optimizer.state_dict()
    tensors = {}
    for idx, st in sd["state"].items():
        for name, value in st.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors[f"state.{idx}.{name}"] = t.detach().cpu().contiguous()
    return tensors, {"param_groups": sd["param_groups"]}


def optimizer_from_files(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for key, t in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = t
    return {"state": state, "param_groups": meta["param_groups"]}


def save(out: Path, step: int, model, optimizer, trainer_state: dict,
         fault: Callable[[str], None] | None = None) -> Path:
    root = Path(out) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"step-{step:07d}", root / f".tmp-step-{step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    if fault:
        fault("mid_checkpoint")
    tensors, meta = optimizer_to_files(optimizer)
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    (tmp / "optimizer.json").write_text(json.dumps(meta))
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_tree(root)
    return final


def latest(out: Path) -> Path | None:
    root = Path(out) / CKPT_DIR
    if not root.exists():
        return None
    for p in root.glob(".tmp-step-*"):
        shutil.rmtree(p, ignore_errors=True)  # an interrupted save
    done = sorted(p for p in root.glob("step-*") if (p / "trainer_state.json").exists())
    return done[-1] if done else None


def load(path: Path, model, optimizer) -> dict:
    """Restore model weights and optimizer state from a checkpoint folder; returns trainer_state."""
    weights = load_file(str(path / "model.safetensors"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    allowed_missing = {"verifier_lm_head.weight", "verifier_norm.weight"}
    if unexpected or set(missing) - allowed_missing:
        raise RuntimeError(f"{path}: checkpoint does not match the draft (missing {missing}, unexpected {unexpected})")
    meta = json.loads((path / "optimizer.json").read_text())
    optimizer.load_state_dict(optimizer_from_files(load_file(str(path / "optimizer.safetensors")), meta))
    return json.loads((path / "trainer_state.json").read_text())


def publish(ckpt: Path, out: Path) -> Path:
    """Copy the servable files (config.json, model.safetensors) to OUT/draft atomically."""
    dest, tmp = Path(out) / "draft", Path(out) / ".tmp-draft"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(ckpt / name, tmp / name)
    _fsync_tree(tmp)
    old = Path(out) / ".old-draft"
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.replace(dest, old)
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest
