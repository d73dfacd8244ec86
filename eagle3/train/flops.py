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


def linear_flops(shape: DraftShape, n_aux: int, draft_vocab: int, ttt_steps: int) -> dict[str, int]:
    """Matmul FLOPs per token of one training step (forward + backward), by part."""
    h, a, kv, i = shape.hidden_size, shape.num_attention_heads * shape.head_dim, \
        shape.num_key_value_heads * shape.head_dim, shape.intermediate_size
    layer = 2 * (2 * h * a + 2 * (2 * h * kv) + a * h + 3 * h * i)
    head = 2 * h * draft_vocab
    return {"fc": 2 * (2 * n_aux * h * h), "layer": 3 * ttt_steps * layer, "lm_head": 2 * ttt_steps * head,
            "targets": head}


def attention_flops(shape: DraftShape, ttt_steps: int, seq_len: int) -> float:
    """Useful (causal) attention FLOPs per token of one training step, averaged over a sequence of seq_len."""
    a = shape.num_attention_heads * shape.head_dim
    keys = sum((seq_len + 1) / 2 + s for s in range(ttt_steps))  # mean keys a query attends to, summed over steps
    return 3 * 2 * 2 * a * keys


def dense_attention_flops(shape: DraftShape, ttt_steps: int, seq_len: int) -> float:
    """Attention FLOPs per token that a dense masked kernel computes (every key of the cache, masked or not): step s
    has (s + 1) * seq_len keys. The useful share is attention_flops / this."""
    a = shape.num_attention_heads * shape.head_dim
    return 3 * 2 * 2 * a * sum((s + 1) * seq_len for s in range(ttt_steps))


def train_flops_per_token(shape: DraftShape, n_aux: int, draft_vocab: int, ttt_steps: int, seq_len: int) -> float:
    return sum(linear_flops(shape, n_aux, draft_vocab, ttt_steps).values()) + attention_flops(shape, ttt_steps, seq_len)


def mfu(tokens_per_s: float, flops_per_token: float, peak: float = H200_BF16_DENSE_FLOPS) -> float:
    return tokens_per_s * flops_per_token / peak


def kimi_k25_draft() -> DraftShape:
    """The draft eagle3 trains for Kimi-K2.5 (DraftShape.for_target of its text config)."""
    from eagle3.targets.presets import KIMI_K25_TEXT

    return DraftShape.for_target(KIMI_K25_TEXT)


def mla_linear_flops(shape, n_aux: int, draft_vocab: int, ttt_steps: int) -> dict[str, int]:
    """The MLA draft (train/mla_draft.py, an MLAShape): matmul FLOPs a token of a training step, by part. Its layer
    per step: q_a [2H -> q_lora] + q_b [q_lora -> heads * (nope + rope)] (or q [2H -> heads * (nope + rope)]),
    kv_a [2H -> kv_lora + rope], kv_b [kv_lora -> heads * (nope + v)], o [heads * v -> H], MLP 3 x [H <-> I]."""
    h, nh = shape.hidden_size, shape.num_attention_heads
    qk = shape.qk_nope_head_dim + shape.qk_rope_head_dim
    q = 2 * h * shape.q_lora_rank + shape.q_lora_rank * nh * qk if shape.q_lora_rank else 2 * h * nh * qk
    kv = 2 * h * (shape.kv_lora_rank + shape.qk_rope_head_dim) + \
        shape.kv_lora_rank * nh * (shape.qk_nope_head_dim + shape.v_head_dim)
    layer = 2 * (q + kv + nh * shape.v_head_dim * h + 3 * h * shape.intermediate_size)
    head = 2 * h * draft_vocab
    return {"fc": 2 * (2 * n_aux * h * h), "layer": 3 * ttt_steps * layer, "lm_head": 2 * ttt_steps * head,
            "targets": head}


def mla_attention_flops(shape, ttt_steps: int, seq_len: int, dense: bool = False) -> float:
    """MLA attention FLOPs a token (scores over nope + rope dims, values over v dims); ``dense``: what a dense masked
    kernel computes, else the useful causal share."""
    per_key = 2 * shape.num_attention_heads * (shape.qk_nope_head_dim + shape.qk_rope_head_dim + shape.v_head_dim)
    keys = sum((s + 1) * seq_len if dense else (seq_len + 1) / 2 + s for s in range(ttt_steps))
    return 3 * per_key * keys
