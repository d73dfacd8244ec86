"""EAGLE-3's training attention without a dense mask (``--attn varlen``; the Llama-layer and MLA drafts).

At TTT step s (0-based) speculators' draft attends, for the query at packed position i, to
- the step-0 keys of i's own sample up to i (causal within the sample: the packed samples do not see each other),
- and i's own key from each later step j = 1..s (one key per step: the "diagonal" of speculators' mask).
Its sdpa path expresses this as a dense mask over all (s + 1) x T keys: the kernel then computes every key of the
cache, four times the useful work at 8k tokens. Here the two parts are computed apart and merged exactly:
- the causal part by flash attention over the samples (varlen: cu_seqlens) -> output O_A and its log-sum-exp L_A;
- each diagonal key's score q_i . k_j[i] and value v_j[i], elementwise: s scores per query;
- merged by their log-sum-exps: o = (e^{L_A} O_A + sum_j e^{s_j} v_j) / (e^{L_A} + sum_j e^{s_j}), L = log(...).
Backward is exact too: the flash backward, given the merged output o and the merged L (not its own), computes the
full softmax's gradient for the causal keys (P = e^{S - L}, D = rowsum(dO * o)); the diagonal keys' gradients are
elementwise. No [T, (s + 1) T] tensor exists at any point, so no mask is built (install()).

Kernels: on CUDA aten's flash attention over the packed samples (bf16/fp16, as under the trainer's autocast); on
the CPU aten's CPU flash attention, sample by sample (the tests: the same merge, a real kernel's backward).
Shapes: query [1, H, T, D]; key [1, KV, (s + 1) T, D], value [1, KV, (s + 1) T, Dv <= D] (speculators' cache after
step s; the MLA draft's values are narrower than its keys: padded with zeros for the flash kernels); H = g x KV (GQA:
query head h reads key head h // g, as transformers' repeat_kv)."""

from __future__ import annotations

import torch

NAME = "eagle3_varlen"  # the attention function's name in transformers' registry (the config's attn_implementation)
KWARG = "eagle3_cu_seqlens"  # the forward keyword the packed samples' boundaries travel by: int32 [n_samples + 1]
LONGEST = "eagle3_longest"  # and the longest sample's length (an int: no device sync to read it)


def register() -> None:
    """Make NAME an attention implementation transformers' layers can use (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)


def install(model) -> None:
    """speculators' Eagle3DraftModel with this attention: no dense mask built (the samples' boundaries come with
    each forward as KWARG, forward_kwargs())."""
    model._create_mask_fn = lambda *args, **kwargs: None  # noqa: SLF001 - speculators builds the mask through it


def forward_kwargs(document_ids: torch.Tensor, device: str | torch.device | None = None) -> dict:
    """{KWARG: cu_seqlens on ``device``, LONGEST: int} from a pack's document ids [1, T] (each sample's rows
    contiguous, ids 0, 1, ...; read on the host)."""
    ids = document_ids.reshape(-1).cpu()
    counts = torch.bincount(ids, minlength=int(ids.max()) + 1 if ids.numel() else 0)
    cu = torch.zeros(counts.numel() + 1, dtype=torch.int32)
    cu[1:] = counts.cumsum(0)
    return {KWARG: cu.to(device or document_ids.device, non_blocking=True), LONGEST: int(counts.max())}


def attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function contract: returns (output [1, T, H, D], None)."""
    cu = kwargs.get(KWARG)
    if cu is None:
        raise ValueError(
            f"attention {NAME!r} needs the packed samples' boundaries: pass {KWARG}=cu_seqlens to the "
            "draft's forward (ttt_attention.forward_kwargs(document_ids))"
        )
    if dropout:
        raise ValueError(f"attention {NAME!r} has no dropout")
    if query.shape[0] != 1:
        raise ValueError(f"attention {NAME!r} takes one packed sequence (batch 1), got batch {query.shape[0]}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    kind = query.device.type
    if torch.is_autocast_enabled(kind):  # as autocast casts sdpa's inputs: the drafts' rotary leaves q, k in float32
        low = torch.get_autocast_dtype(kind)
        query, key, value = query.to(low), key.to(low), value.to(low)
    out = TTTAttention.apply(query, key, value, cu, float(scale), kwargs.get(LONGEST))
    return out.transpose(1, 2).contiguous(), None


class TTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, scale, longest=None):
        t = q.shape[2]
        if k.shape[2] % t:
            raise ValueError(f"keys {k.shape[2]} are not a whole number of TTT steps of {t} queries")
        pad = q.shape[-1] - v.shape[-1]  # the MLA draft: values of 128 under keys of 192 (flash takes one size)
        if pad < 0:
            raise ValueError(f"values of {v.shape[-1]} wider than keys of {q.shape[-1]}")
        o_a, lse_a, aux = _causal_forward(q, k[:, :, :t], _pad(v[:, :, :t], pad), cu, scale, longest)
        o_a = o_a[..., : v.shape[-1]]  # [1, H, T, Dv]; lse_a [1, H, T] float32
        o, lse = _merge(q, k, v, t, o_a, lse_a, scale)
        ctx.save_for_backward(q, k, v, cu, o, lse, *aux)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, d_o):
        q, k, v, cu, o, lse, *aux = ctx.saved_tensors
        scale, t = ctx.scale, q.shape[2]
        d_o = d_o.contiguous()
        pad = q.shape[-1] - v.shape[-1]
        dq, dk0, dv0 = _causal_backward(
            _pad(d_o, pad), q, k[:, :, :t], _pad(v[:, :, :t], pad), _pad(o, pad), lse, cu, scale, aux
        )
        dq, dk0, dv0 = dq.float(), dk0.float(), dv0[..., : v.shape[-1]].float()
        dks, dvs = [dk0], [dv0]
        g = q.shape[1] // k.shape[1]
        dof, qf = d_o.float(), q.float()
        big_d = (dof * o.float()).sum(-1)  # [1, H, T]: rowsum(dO * o), the softmax's backward term
        for j in range(1, k.shape[2] // t):
            kj, vj = _heads(k[:, :, j * t : (j + 1) * t], g).float(), _heads(v[:, :, j * t : (j + 1) * t], g).float()
            p = torch.exp((qf * kj).sum(-1) * scale - lse)  # [1, H, T]: the merged softmax's weight of key j
            d_s = p * ((dof * vj).sum(-1) - big_d)
            dq = dq + d_s[..., None] * kj * scale
            dks.append(_group_sum(d_s[..., None] * qf * scale, g))
            dvs.append(_group_sum(p[..., None] * dof, g))
        return dq.to(q.dtype), torch.cat(dks, 2).to(k.dtype), torch.cat(dvs, 2).to(v.dtype), None, None, None


def _pad(x: torch.Tensor, n: int) -> torch.Tensor:
    """x with n zero columns after its last dimension's (a zero value column adds nothing to the output, and the
    softmax's backward term rowsum(dO * o) is unchanged by zeros in both)."""
    return torch.nn.functional.pad(x, (0, n)) if n else x


def _heads(x: torch.Tensor, g: int) -> torch.Tensor:
    """[1, KV, T, D] -> [1, KV * g, T, D]: key head h // g for query head h."""
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def _group_sum(x: torch.Tensor, g: int) -> torch.Tensor:
    """[1, KV * g, T, D] -> [1, KV, T, D]: the gradient of _heads."""
    return x if g == 1 else x.unflatten(1, (-1, g)).sum(2)


def _merge(q, k, v, t: int, o_a, lse_a, scale: float):
    """The causal part (o_a, lse_a) and each later step's diagonal key merged by log-sum-exp: (o in q's dtype, lse
    float32 [1, H, T])."""
    g = q.shape[1] // k.shape[1]
    qf = q.float()
    scores, values = [lse_a], [None]
    for j in range(1, k.shape[2] // t):
        scores.append((qf * _heads(k[:, :, j * t : (j + 1) * t], g).float()).sum(-1) * scale)
        values.append(_heads(v[:, :, j * t : (j + 1) * t], g))
    lse = torch.logsumexp(torch.stack(scores), 0)
    o = torch.exp(lse_a - lse)[..., None] * o_a.float()
    for s_j, v_j in zip(scores[1:], values[1:]):
        o = o + torch.exp(s_j - lse)[..., None] * v_j.float()
    return o.to(q.dtype), lse


def _causal_forward(q, k, v, cu, scale, longest=None):
    """Causal attention within each packed sample: (o [1, H, T, D] in q's dtype, lse [1, H, T] float32, what the
    backward needs)."""
    if q.is_cuda:
        return _flash_forward(q, k, v, cu, scale, longest)
    g = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[:, :, a:b].contiguous(),
            _heads(k[:, :, a:b], g).contiguous(),
            _heads(v[:, :, a:b], g).contiguous(),
            0.0,
            True,
            scale=scale,
        )
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2).float(), ()


def _causal_backward(d_o, q, k, v, o, lse, cu, scale, aux):
    """The causal part's gradients given the MERGED output and log-sum-exp (so they are the full softmax's)."""
    if q.is_cuda:
        return _flash_backward(d_o, q, k, v, o, lse, cu, scale, aux)
    g = q.shape[1] // k.shape[1]
    dqs, dks, dvs = [], [], []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d_o[:, :, a:b].contiguous(),
            q[:, :, a:b].contiguous(),
            _heads(k[:, :, a:b], g).contiguous(),
            _heads(v[:, :, a:b], g).contiguous(),
            o[:, :, a:b].contiguous(),
            lse[:, :, a:b].contiguous(),
            0.0,
            True,
            scale=scale,
        )
        dqs.append(dq)
        dks.append(_group_sum(dk, g))
        dvs.append(_group_sum(dv, g))
    return torch.cat(dqs, 2), torch.cat(dks, 2), torch.cat(dvs, 2)


def _thd(x: torch.Tensor) -> torch.Tensor:
    """[1, heads, T, D] -> [T, heads, D] contiguous: flash's packed (varlen) layout."""
    return x[0].transpose(0, 1).contiguous()


def _flash_forward(q, k, v, cu, scale, longest=None):
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"attention {NAME!r} on CUDA runs flash attention, which takes bf16 or fp16, not {q.dtype}: "
            "train with --precision bf16-mixed (the CUDA default), or --attn sdpa"
        )
    cu = cu.to(device=q.device, dtype=torch.int32)
    longest = longest or int((cu[1:] - cu[:-1]).max())
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        _thd(q), _thd(k), _thd(v), cu, cu, longest, longest, 0.0, True, False, scale=scale
    )
    h, t = q.shape[1], q.shape[2]
    if tuple(lse.shape) != (h, t):
        raise RuntimeError(
            f"flash attention's log-sum-exp came back {tuple(lse.shape)}, not (heads, tokens) = "
            f"{(h, t)}: this torch's varlen layout differs; train with --attn sdpa"
        )
    return out.transpose(0, 1)[None], lse[None].float(), (rng, unused, cu, torch.tensor(longest))


def _flash_backward(d_o, q, k, v, o, lse, cu, scale, aux):
    rng, unused, cu, longest = aux
    longest = int(longest)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        _thd(d_o),
        _thd(q),
        _thd(k),
        _thd(v),
        _thd(o),
        lse[0].contiguous(),
        cu,
        cu,
        longest,
        longest,
        0.0,
        True,
        rng,
        unused,
        scale=scale,
    )
    return dq.transpose(0, 1)[None], dk.transpose(0, 1)[None], dv.transpose(0, 1)[None]
