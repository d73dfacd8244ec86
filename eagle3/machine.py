"""What this machine has (a CUDA GPU, vLLM) and the defaults that follow from it: a command typed on a GPU node runs
as the project measured best there; the same command on a machine without a GPU runs on its CPU."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

DRIVER_PATHS = ("/dev/nvidia0", "/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")
PACK_TOKENS_CUDA = 8192  # tokens a training pack holds on a GPU (the trainer benchmark's 8k rows)


def has_driver() -> bool:
    """A GPU driver's device files: without them there is no GPU, known without importing torch."""
    return any(os.path.exists(p) for p in DRIVER_PATHS)


def has_cuda() -> bool:
    """A CUDA device torch can use; without a GPU driver, answered without importing torch."""
    if not has_driver():
        return False
    import torch

    return torch.cuda.is_available()


def has_vllm() -> bool:
    if "vllm" in sys.modules:  # imported already (a module put in its place has no spec to find)
        return True
    return importlib.util.find_spec("vllm") is not None


@dataclass(frozen=True)
class TrainChoice:
    device: str
    precision: str  # fp32 | bf16-mixed
    attn: str  # sdpa | varlen | flex
    pack_tokens: int  # 0: one sample a forward
    compile: bool

    def line(self) -> str:
        packs = f"packs of {self.pack_tokens:,} tokens" if self.pack_tokens else "one sample a forward"
        how = "compiled" if self.compile else "eager"
        return f"device {self.device}, precision {self.precision}, attention {self.attn} ({how}), {packs}"


def train_choice(
    device: str,
    precision: str,
    attn: str,
    pack_tokens: int | None,
    compile: bool,
    cuda: Callable[[], bool] | None = None,
) -> TrainChoice:
    """`train`'s "auto" options resolved: CUDA where there is one; there bf16-mixed, the mask-free varlen attention
    (flash attention takes bf16) and 8k-token packs; on the CPU fp32, sdpa and one sample a forward."""
    if device == "auto":
        device = "cuda" if (cuda or has_cuda)() else "cpu"
    gpu = device.startswith("cuda")
    if precision == "auto":
        precision = "bf16-mixed" if gpu else "fp32"
    if attn == "auto":
        attn = "varlen" if gpu and precision == "bf16-mixed" else "sdpa"
    if pack_tokens is None:
        pack_tokens = PACK_TOKENS_CUDA if gpu else 0
    return TrainChoice(device, precision, attn, pack_tokens, compile)


def extract_backend(
    requested: str, cuda: Callable[[], bool] | None = None, vllm: Callable[[], bool] | None = None
) -> tuple[str, str]:
    """(backend, why): "auto" is vllm where vLLM and a CUDA GPU are both here, else the hf reference."""
    if requested != "auto":
        return requested, f"backend {requested}"
    cuda, vllm = cuda or has_cuda, vllm or has_vllm
    if not vllm():
        return "hf", "backend hf (vLLM is not installed here; --backend vllm on a GPU node with vLLM)"
    if not cuda():
        return "hf", "backend hf (no CUDA GPU here; --backend vllm on a GPU node)"
    return "vllm", "backend vllm (vLLM and a CUDA GPU are here)"
