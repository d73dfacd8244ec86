"""Model FLOPs of training the EAGLE-3 draft, per token, from its shape: what MFU is measured against.

speculators' Eagle3DraftModel (speculators/models/eagle3/core.py), per token of a sequence of T tokens, S TTT steps:
  fc        [n_aux*H -> H] once; its input (the target's states) needs no gradient: forward + weight gradient = 2x
  targets   the verifier's lm_head rows of the draft vocabulary [H -> V_d], under no_grad: forward only = 1x
  per step  the decoder layer on concat(embedding, hidden) [2H]: q [2H -> A], k, v [2H -> KV], o [A -> H],
            MLP gate, up [H -> I], down [I -> H]: forward + input and weight gradients = 3x;
            the draft's lm_head [H -> V_d], frozen (requires_grad False): forward + input gradient = 2x;
            attention: step s attends over the T positions of step 0 causally plus its own key from each earlier step
            (speculators' KV cache grows by T a step): useful work per query at position t is (t + 1) + s keys, for
            scores and values 2 * 2 * A FLOPs each, 3x with the backward.
A = heads * head_dim, KV = kv_heads * head_dim, I = intermediate size, a matmul [m -> n] costs 2 * m * n a token.
Norms, RoPE, the loss and the embedding lookup are left out (under 1 % at Kimi's size).
Kimi-K2.5's draft (H 7168, A 8192, KV 1024, I 18432, n_aux 3, V_d 32000, S 3) at T = 8192: see kimi_k25_draft().
"""

from __future__ import annotations

from eagle3.train.draft import DraftShape

H200_BF16_DENSE_FLOPS = 989e12  # NVIDIA H200 SXM, dense bf16 tensor-core peak, FLOP/s


def _train_parts(h: int, n_aux: int, draft_vocab: int, ttt_steps: int, layer_params: int) -> dict[str, int]:
    """By part, for a layer whose matmuls hold ``layer_params`` weights (2 FLOPs each a token)."""
    head = 2 * h * draft_vocab
    return {
        "fc": 2 * (2 * n_aux * h * h),
        "layer": 3 * ttt_steps * 2 * layer_params,
        "lm_head": 2 * ttt_steps * head,
        "targets": head,
    }


def _attention(per_key: int, ttt_steps: int, seq_len: int, dense: bool) -> float:
    """3 x (forward + backward) x ``per_key`` FLOPs for each key a query meets: the useful (causal) mean over a
    sequence of seq_len, or ``dense``: every key of the cache, masked or not (step s has (s + 1) * seq_len)."""
    keys = sum((s + 1) * seq_len if dense else (seq_len + 1) / 2 + s for s in range(ttt_steps))
    return 3 * per_key * keys


def linear_flops(shape: DraftShape, n_aux: int, draft_vocab: int, ttt_steps: int) -> dict[str, int]:
    """Matmul FLOPs per token of one training step (forward + backward), by part."""
    h, a, kv, i = (
        shape.hidden_size,
        shape.num_attention_heads * shape.head_dim,
        shape.num_key_value_heads * shape.head_dim,
        shape.intermediate_size,
    )
    return _train_parts(h, n_aux, draft_vocab, ttt_steps, 2 * h * a + 2 * (2 * h * kv) + a * h + 3 * h * i)


def attention_flops(shape: DraftShape, ttt_steps: int, seq_len: int) -> float:
    """Useful (causal) attention FLOPs per token of one training step, averaged over a sequence of seq_len: scores
    and values, 2 * heads * head_dim each a key."""
    return _attention(4 * shape.num_attention_heads * shape.head_dim, ttt_steps, seq_len, dense=False)


def dense_attention_flops(shape: DraftShape, ttt_steps: int, seq_len: int) -> float:
    """Attention FLOPs per token that a dense masked kernel computes. The useful share is attention_flops / this."""
    return _attention(4 * shape.num_attention_heads * shape.head_dim, ttt_steps, seq_len, dense=True)


def train_flops_per_token(shape: DraftShape, n_aux: int, draft_vocab: int, ttt_steps: int, seq_len: int) -> float:
    return sum(linear_flops(shape, n_aux, draft_vocab, ttt_steps).values()) + attention_flops(shape, ttt_steps, seq_len)


def mfu(tokens_per_s: float, flops_per_token: float, peak: float = H200_BF16_DENSE_FLOPS) -> float:
    return tokens_per_s * flops_per_token / peak


def kimi_k25_draft() -> DraftShape:
    """The draft eagle3 trains for Kimi-K2.5 (DraftShape.for_target of its text config)."""
    from eagle3.targets.presets import KIMI_K25_TEXT

    return DraftShape.for_target(KIMI_K25_TEXT)


def mla_linear_flops(shape, n_aux: int, draft_vocab: int, ttt_steps: int) -> dict[str, int]:
    """The MLA draft (train/mla_draft.py, an MLAShape): matmul FLOPs a token of a training step, by part; its layer's
    matmuls as MLAShape.layer_matmul_params counts them."""
    return _train_parts(shape.hidden_size, n_aux, draft_vocab, ttt_steps, shape.layer_matmul_params())


def mla_attention_flops(shape, ttt_steps: int, seq_len: int, dense: bool = False) -> float:
    """MLA attention FLOPs a token: scores over nope + rope dims, values over v dims."""
    per_key = 2 * shape.num_attention_heads * (shape.qk_nope_head_dim + shape.qk_rope_head_dim + shape.v_head_dim)
    return _attention(per_key, ttt_steps, seq_len, dense)
