"""The KL loss over the draft vocabulary, in chunks of positions (TrainConfig.loss_impl "chunked").

speculators' eager kl_div_loss keeps, per TTT step, a float32 log-softmax of the draft's logits and a float32 softmax
of the target's for its backward pass: 2 x T x V x 4 bytes (Kimi-K2.5's draft, V = 32,000, T = 32k tokens: 8 GiB a
step, 24 GiB for three). This computes the same per-position KL(p || q), p = softmax(targets), q = softmax(logits),
chunk by chunk, and keeps only the logits and targets it was given (already alive in the step); its backward pass
recomputes each chunk's softmaxes: d KL / d logits = q - p (p sums to 1), times the upstream gradient per position.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK = 4096  # positions a chunk: float32 temporaries of 4096 x V x 4 bytes (V = 32,000: 0.5 GiB)


class _ChunkedKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        # logits, targets [B, T, V] (any float dtype); returns [B, T] float32
        out = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
        for s in range(0, logits.shape[1], chunk):
            log_q = torch.log_softmax(logits[:, s : s + chunk].float(), dim=-1)
            log_p = torch.log_softmax(targets[:, s : s + chunk].float(), dim=-1)
            out[:, s : s + chunk] = (log_p.exp() * (log_p - log_q)).sum(-1)
        ctx.save_for_backward(logits, targets)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, targets = ctx.saved_tensors
        out = torch.empty_like(logits)
        for s in range(0, logits.shape[1], ctx.chunk):
            q = torch.softmax(logits[:, s : s + ctx.chunk].float(), dim=-1)
            p = torch.softmax(targets[:, s : s + ctx.chunk].float(), dim=-1)
            out[:, s : s + ctx.chunk] = (grad[:, s : s + ctx.chunk, None].float() * (q - p)).to(logits.dtype)
        return out, None, None


def kl_div_chunked(logits: torch.Tensor, targets: torch.Tensor, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Per-position KL(softmax(targets) || softmax(logits)): [B, T] float32, as speculators' kl_div_loss."""
    return _ChunkedKL.apply(logits, targets.detach(), chunk)


def chunked_kl_div_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss_fn speculators' loss config takes (its compound_loss masks, decays and averages it)."""
    return kl_div_chunked(logits, targets)


def loss_config(loss: str, impl: str, device: str = "cpu") -> dict:
    """speculators' {name: (loss_fn, weight)} for TrainConfig.loss / loss_impl: eager and fused are speculators';
    chunked is the KL above (loss kl_div only); auto is chunked on CUDA, eager elsewhere."""
    from speculators.losses import resolve_loss_config

    if impl == "auto":
        impl = "chunked" if device.startswith("cuda") and loss == "kl_div" else "eager"
    if impl == "chunked":
        if loss != "kl_div":
            raise ValueError(f"loss_impl chunked computes the kl_div loss; for loss {loss!r} use eager or fused")
        return {"kl_div": (chunked_kl_div_loss, 1.0)}
    if impl not in ("eager", "fused"):
        raise ValueError(f"loss_impl {impl!r}: use auto, chunked, eager or fused")
    return resolve_loss_config(loss, impl)
