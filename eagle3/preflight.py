"""Checks that run before any work: everyday mistakes become one message naming the fix, in well under a
second, with nothing created. Importing this module imports neither torch, transformers nor vLLM."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3 import machine


class UsageError(ValueError):
    """The command cannot run as given; the message says what to change."""


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "tiktoken.model")


def custom_code(folder: Path) -> list[str]:
    """The files of a model folder whose auto_map names code in the folder (transformers runs it only when trusted)."""
    found = []
    for name in ("config.json", "tokenizer_config.json"):
        try:
            if json.loads((folder / name).read_text()).get("auto_map"):
                found.append(name)
        except (OSError, ValueError, AttributeError):
            continue
    return found


def model_folder(
    path: str | Path,
    *,
    weights: bool = False,
    tokenizer: bool = False,
    what: str = "--model",
    trust_remote_code: bool | None = None,
) -> Path:
    """A target folder: config.json always; weights and tokenizer files when the caller needs them; where the
    command takes --trust-remote-code (``trust_remote_code`` not None), custom code refused unless trusted."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{what} {p}: no such folder. Give the target's folder (config.json, weights, tokenizer)")
    if not p.is_dir():
        raise UsageError(f"{what} {p}: is a file; give the folder that holds config.json")
    cfg = p / "config.json"
    if not cfg.is_file():
        raise UsageError(f"{what} {p}: no config.json in it; is this the model folder (not a parent or a shard)?")
    try:
        json.loads(cfg.read_text())
    except ValueError as e:
        raise UsageError(f"{cfg}: not valid JSON ({e}); restore the file from the model's release") from None
    if weights and not any((p / f).exists() for f in WEIGHT_FILES) and not list(p.glob("*.safetensors")):
        raise UsageError(
            f"{what} {p}: no weights (*.safetensors) in it. The hf backend needs the weights; "
            "download them, or use --backend vllm with the engine's own loader"
        )
    if tokenizer and not any((p / f).exists() for f in TOKENIZER_FILES):
        raise UsageError(
            f"{what} {p}: no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}) in it; conversations "
            "are turned into tokens with the target's tokenizer and chat template"
        )
    code = custom_code(p) if trust_remote_code is False else []
    if code:
        raise UsageError(
            f"{what} {p}: its {' and '.join(code)} name code in the folder (auto_map), which runs only with "
            "--trust-remote-code: add it if you trust that folder"
        )
    return p


def vllm_installed(command: str) -> None:
    if not machine.has_vllm():
        raise UsageError(
            f"{command} needs vLLM, which is not installed here (pip install 'eagle3[gpu]' on a GPU "
            "host; `eagle3 doctor` shows what is installed)"
        )


def compressed_tensors_installed(command: str) -> None:
    import importlib.util

    if importlib.util.find_spec("compressed_tensors") is None:
        raise UsageError(
            f"{command} needs compressed-tensors, which is not installed here: pip install compressed-tensors==0.17.0 "
            "(the version vLLM 0.26 pins; vLLM installs it)"
        )


def cuda_available(command: str) -> None:
    if not machine.has_driver():
        raise UsageError(
            f"{command} needs a CUDA GPU and this machine has no GPU driver (no /dev/nvidia*); run it "
            "on a GPU host (`eagle3 doctor` lists the GPUs)"
        )
    import torch  # a driver is there: ask torch (seconds)

    if not torch.cuda.is_available():
        raise UsageError(
            f"{command} needs a CUDA GPU and torch {torch.__version__} sees none here; "
            "run it on a GPU host (`eagle3 doctor` lists the GPUs)"
        )


ATTENTIONS = ("sdpa", "varlen", "flex")  # train --attn, TrainConfig.attn_impl: one name from the command line on


def train_attention(attn: str, compile: bool, device: str) -> None:
    """`train --attn flex` where it can train: on CUDA (torch has no flex attention backward on the CPU) and compiled
    (unfused, flex attention computes each query's scores whole: hundreds of GiB at 32k tokens)."""
    if attn not in ATTENTIONS:
        raise UsageError(f"--attn {attn}: use one of {', '.join(ATTENTIONS)}")
    if attn != "flex":
        return
    if not device.startswith("cuda"):
        raise UsageError(
            "--attn flex: flex attention has no backward on the CPU (torch), so it cannot train there; "
            "use --attn sdpa or varlen, or --device cuda"
        )
    if not compile:
        raise UsageError(
            "--attn flex runs fused only compiled: without --compile it computes every query's scores "
            "whole (768 GiB asked for at 32k tokens); add --compile, or use --attn sdpa or varlen"
        )


def store_folder(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{p}: no such store folder; `eagle3 extract --out {p} ...` makes one")
    if not (p / "manifest.json").is_file():
        raise UsageError(f"{p} is not a store (no manifest.json): give the folder `eagle3 extract --out` wrote")
    return p


def disk_test_folder(
    path: str | Path, writers: int, files: int, file_mb: int, rounds: int, bytes_per_token: int
) -> Path:
    """`bench disk`: a writable folder with room for every writer's file at once, and positive sizes."""
    import os
    import shutil

    for name, v in (
        ("--writers", writers),
        ("--files", files),
        ("--file-mb", file_mb),
        ("--rounds", rounds),
        ("--bytes-per-token", bytes_per_token),
    ):
        if v < 1:
            raise UsageError(f"{name} {v}: give a positive number")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"--dir {p}: is a file; give a folder on the disk the store will use")
    if not p.is_dir():
        raise UsageError(f"--dir {p}: no such folder; give an existing folder on the disk the store will use")
    if not os.access(p, os.W_OK):
        raise UsageError(f"--dir {p}: not writable by this user; give a folder you can write to")
    need, free = writers * (file_mb << 20), shutil.disk_usage(p).free  # each writer holds one file at a time
    if need > free:
        raise UsageError(
            f"--dir {p}: {writers} writers x {file_mb} MiB need {need / 2**30:.1f} GiB at once and "
            f"{free / 2**30:.1f} GiB are free; give a smaller --file-mb or fewer --writers"
        )
    return p


def data_files(paths) -> None:
    """Every --data path an existing file (what load_samples reads later, after seconds of imports)."""
    for path in paths or ():
        p = Path(path)
        if not p.exists():
            raise UsageError(f"--data {p}: file not found; give JSONL conversations (one JSON object a line)")
        if p.is_dir():
            raise UsageError(f"--data {p}: is a directory; give the JSONL files in it (--data {p}/*.jsonl)")
        if blank(p):
            raise UsageError(
                f"--data {p}: the file is empty (no line holds a conversation); give JSONL conversations, "
                "one JSON object a line"
            )


def blank(path: Path) -> bool:
    """Whether a file holds nothing but white space (read until its first other byte)."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            if chunk.strip():
                return False
    return True
