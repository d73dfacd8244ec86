"""vLLM 0.26's YaRN RoPE tables (model_executor/layers/rotary_embedding/yarn_scaling_rope.py and common.py), written
out here so the CPU suite can compare the draft's training RoPE with what vLLM serves it with."""

import math

import torch


def _correction_dim(rot: float, dim: int, base: float, orig: int) -> float:
    return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))


def cos_sin(positions: torch.Tensor, dim: int, base: float, factor: float, orig: int, beta_fast=32, beta_slow=1):
    """(cos, sin) [P, dim / 2] at ``positions``, as YaRNScalingRotaryEmbedding's cache holds them."""
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    low = max(math.floor(_correction_dim(beta_fast, dim, base, orig)), 0)
    high = min(math.ceil(_correction_dim(beta_slow, dim, base, orig)), dim - 1)
    ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) if high != low else 0.001)
    extrapolate = 1 - torch.clamp(ramp, 0, 1)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    mscale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos() * mscale, freqs.sin() * mscale
