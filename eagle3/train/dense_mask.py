"""The sdpa draft's dense attention mask, built by broadcasting: what flex_attention.create_mask returns, without its
vmap over the mask function (Python-heavy; a fifth of a training step on the CPU at small sizes)."""

from __future__ import annotations

import torch


def create_mask(mask_mod, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int, device="cuda") -> torch.Tensor:  # noqa: N803
    """``mask_mod(b, h, q, kv)`` evaluated once over broadcast index grids: bool [B or 1, H or 1, Q_LEN, KV_LEN].
    The mask functions speculators combines (causal, document, diagonal, sliding window) are elementwise."""
    b, h = B or 1, H or 1
    grid = [torch.arange(n, device=device).view([n if i == d else 1 for i in range(4)]) for d, n in
            enumerate((b, h, Q_LEN, KV_LEN))]  # fmt: skip
    return mask_mod(*grid).expand(b, h, Q_LEN, KV_LEN).contiguous()


def install(model) -> None:
    """speculators' Eagle3DraftModel (sdpa) builds its mask with create_mask above."""
    model._create_mask_fn = create_mask  # noqa: SLF001 - speculators builds the mask through it
