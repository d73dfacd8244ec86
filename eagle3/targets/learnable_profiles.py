"""The learnable targets' profiles (no torch: the CLI reads them to refuse bad options before any model code).
`learnable` trains them."""

from __future__ import annotations

from eagle3.preflight import UsageError
from eagle3.targets.presets import KIMI_K25_TEXT, TargetProfile

LEARNABLE = TargetProfile(
    "learnable-llama",
    "LlamaForCausalLM",
    256,
    8,
    1024,
    seq_len=256,
    hf_config=dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1024,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        hidden_act="silu",
    ),
)
# Kimi-K2.5's architecture at a size one GPU trains in minutes: MLA with Kimi's latent sizes (kv_lora_rank 512 and
# qk_rope_head_dim 64, what vLLM's MLA backends are built for; nope 128, v 128), the first layer dense, then MoE with
# 8 routed experts top-2 (sigmoid scores, noaux_tc) + 1 shared expert. About 28M parameters.
LEARNABLE_DEEPSEEK = TargetProfile(
    "learnable-deepseek",
    "DeepseekV3ForCausalLM",
    256,
    8,
    1024,
    hf_config=dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        hidden_size=256,
        num_hidden_layers=8,
        vocab_size=1024,
        intermediate_size=688,
        moe_intermediate_size=256,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=1.0,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        norm_topk_prob=True,
        n_group=1,
        topk_group=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=384,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
        attention_bias=False,
        num_nextn_predict_layers=0,
        tie_word_embeddings=False,
    ),
    chat_format="kimi",
    seq_len=4608,  # trained on windows of 4608 tokens (several conversations run together):
    # the long-context prompts (LONG_CONTEXT, 4096 tokens) and their answers sit at positions it learned. A target
    # trained on shorter windows than its prompts never learns the positions they reach, and drafts served on them
    # accept less for it
)
# The same target for long context: Kimi-K2.5's YaRN form (from a 4k original context; x8 here for 32k positions, as
# Kimi's x64 for 256k), trained on 16k-token windows of its traffic with long agentic sessions among it.
LEARNABLE_DEEPSEEK_LONG = TargetProfile(
    "learnable-deepseek-long",
    "DeepseekV3ForCausalLM",
    256,
    8,
    1024,
    hf_config=dict(
        LEARNABLE_DEEPSEEK.hf_config,
        max_position_embeddings=32768,
        rope_scaling=dict(KIMI_K25_TEXT["rope_scaling"], factor=8.0),
    ),
    chat_format="kimi",
    seq_len=16384,
)
ARCHES = {"llama": LEARNABLE, "deepseek": LEARNABLE_DEEPSEEK, "deepseek-long": LEARNABLE_DEEPSEEK_LONG}


def has_routed_experts(arch: str) -> bool:
    return bool(ARCHES[arch].hf_config.get("n_routed_experts"))


def experts_to_quantize(arch: str) -> None:
    """--quantize int4 on a target without routed experts: refused (the CLI's before any import of torch)."""
    if not has_routed_experts(arch):
        with_experts = " or ".join(a for a in ARCHES if has_routed_experts(a))
        raise UsageError(f"--quantize int4 quantizes routed experts, as Kimi-K2.5's are; --arch {arch} has none: "
                         f"use --arch {with_experts}")  # fmt: skip
