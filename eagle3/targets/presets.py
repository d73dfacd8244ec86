"""Target profiles: data describing a target and what the suite asserts about it.

A profile names the architecture and layer shapes; for the small ones it also carries the full HF
config used to build a model with random weights (tiny.py). ``from_name`` picks a preset.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import Any

from eagle3.targets.layers import default_layer_ids, validate_layer_ids

# Kimi-K2.5's decoder layer shapes (its text model is DeepseekV3): MLA and MoE dimensions.
KIMI_MLA = dict(
    num_attention_heads=64,
    num_key_value_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
)
_DEEPSEEK_COMMON = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    hidden_act="silu",
    attention_bias=False,
    rms_norm_eps=1e-6,
    rope_theta=50000.0,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    norm_topk_prob=True,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    num_nextn_predict_layers=0,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)


@dataclass(frozen=True)
class TargetProfile:
    name: str
    architecture: str  # HF architecture, e.g. DeepseekV3ForCausalLM
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    seq_len: int = 512  # tokens per sample the GPU suite uses
    dtype: str = "bfloat16"  # dtype of captured states
    layer_ids: tuple[int, ...] = ()
    hf_config: dict[str, Any] = field(default_factory=dict)  # the target's (text) config.json
    build: str = "random"  # random: built here with random weights (tiny.build_model);
    # config: config.json only, served with vLLM's load_format="dummy";
    # none: a real target, described here, never built
    chat_format: str = "chatml"  # the built tokenizer's chat template: chatml, or kimi (targets/kimi_format.py)

    def __post_init__(self):
        ids = self.layer_ids or default_layer_ids(self.num_hidden_layers)
        object.__setattr__(self, "layer_ids", validate_layer_ids(ids, self.num_hidden_layers))

    @property
    def buildable(self) -> bool:
        return bool(self.hf_config) and self.build != "none"

    @property
    def bytes_per_token(self) -> int:
        """Bytes of captured states per token: layers x hidden x dtype size."""
        return len(self.layer_ids) * self.hidden_size * (4 if self.dtype == "float32" else 2)

    def with_(self, **kw) -> TargetProfile:
        return replace(self, **kw)


def _deepseek(
    name, hidden, layers, vocab, experts, topk, moe_inter, inter, mla, max_pos=4096, extra=None, **kw
) -> TargetProfile:
    cfg = dict(
        _DEEPSEEK_COMMON,
        hidden_size=hidden,
        num_hidden_layers=layers,
        vocab_size=vocab,
        n_routed_experts=experts,
        num_experts_per_tok=topk,
        n_shared_experts=1,
        moe_intermediate_size=moe_inter,
        intermediate_size=inter,
        max_position_embeddings=max_pos,
        routed_scaling_factor=2.827,
        **mla,
        **(extra or {}),
    )
    return TargetProfile(name, "DeepseekV3ForCausalLM", hidden, layers, vocab, hf_config=cfg, **kw)


# Kimi-K2.5's text model (its config.json text_config, DeepseekV3): 61 layers (first dense), 384 routed experts
# of 2048, top-8 + 1 shared, 256k context by DeepSeek-YaRN (x64 from 4k) with rope_theta 50000.
KIMI_K25_TEXT = dict(
    _DEEPSEEK_COMMON,
    hidden_size=7168,
    num_hidden_layers=61,
    vocab_size=163840,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    n_routed_experts=384,
    num_experts_per_tok=8,
    n_shared_experts=1,
    routed_scaling_factor=2.827,
    rms_norm_eps=1e-5,
    max_position_embeddings=262144,
    bos_token_id=163584,
    eos_token_id=163585,
    rope_scaling=dict(
        type="yarn",
        factor=64.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    **KIMI_MLA,
)


# Kimi-K2.5's quantization_config (in its text_config): routed experts int4, group 32, symmetric, pack-quantized;
# attention, shared experts, the dense MLP and lm_head kept (the ignore list). targets/int4.py writes it.
KIMI_K25_QUANT = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "group_size": 32, "symmetric": True, "strategy": "group"},
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
}


def _kimi_k25_class(name: str, text: dict, **kw) -> TargetProfile:
    """Kimi-K2.5's own class (vLLM 0.26 kimi_k25.py: a MoonViT vision tower and the DeepseekV3 language model, which
    it hands the aux layers to) around ``text``, a one-layer vision tower. config.json only, served with
    load_format="dummy" and no tokenizer (text-only: token-id prompts)."""
    vision = dict(model_type="kimi_k25_vision", patch_size=14, num_hidden_layers=1, hidden_size=256,
                  num_attention_heads=4, intermediate_size=512, merge_kernel_size=[2, 2])  # fmt: skip
    cfg = dict(
        architectures=["KimiK25ForConditionalGeneration"],
        model_type="kimi_k25",
        media_placeholder_token_id=163605,
        vision_config=vision,
        text_config=dict(text, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3"),
    )
    return TargetProfile(name, "KimiK25ForConditionalGeneration", 7168, int(text["num_hidden_layers"]), 163840,
                         build="config", hf_config=cfg, **kw)  # fmt: skip


PRESETS: dict[str, TargetProfile] = {
    # The production target: states are asserted, never built here. 4 x [512, 7168] bf16 per sample.
    "kimi-k2.5": TargetProfile(
        "kimi-k2.5", "DeepseekV3ForCausalLM", 7168, 61, 163840, hf_config=KIMI_K25_TEXT, build="none"
    ),
    # Kimi-K2.5's compute per token on one GPU: its exact layer shapes at full depth (61 layers, hidden 7168, Kimi's
    # MLA, first layer dense 18432), MoE cut to 8 routed experts of 2048 all active (top-8, as Kimi routes 8) + 1
    # shared, vocab 163840. About 35B parameters: config.json only, served with load_format="dummy" (61 GB).
    "kimi-depth": _deepseek(
        "kimi-depth",
        7168,
        61,
        163840,
        experts=8,
        topk=8,
        moe_inter=2048,
        inter=18432,
        mla=KIMI_MLA,
        max_pos=16384,
        build="config",
    ),
    # Same layer shapes as Kimi-K2.5 (hidden 7168, Kimi's MLA dims), 8 layers and 8 experts: one GPU.
    "mini-kimi": _deepseek(
        "mini-kimi",
        7168,
        8,
        32768,
        experts=8,
        topk=2,
        moe_inter=512,
        inter=2048,
        mla=dict(KIMI_MLA, num_attention_heads=16, num_key_value_heads=16),
        max_pos=16384,
    ),
    # CPU default: the Kimi family at toy size (vocab set by the bundled tokenizer).
    "tiny-kimi": _deepseek(
        "tiny-kimi",
        128,
        8,
        1024,
        experts=8,
        topk=2,
        moe_inter=64,
        inter=256,
        mla=dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=64,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
        ),
        seq_len=256,
        dtype="bfloat16",
    ),
    "tiny-llama": TargetProfile(
        "tiny-llama",
        "LlamaForCausalLM",
        128,
        8,
        1024,
        seq_len=256,
        hf_config=dict(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            hidden_size=128,
            intermediate_size=344,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=1024,
            max_position_embeddings=2048,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=1,
            hidden_act="silu",
        ),
    ),
}
# Kimi-K2.5's class around kimi-depth (61 layers, 8 experts): 61 GB of bf16 weights.
PRESETS["kimi-k25-depth"] = _kimi_k25_class("kimi-k25-depth", PRESETS["kimi-depth"].hf_config)
# Kimi-K2.5's class at its full expert width and quantization: its own text_config (384 routed experts of 2048, top-8)
# and quantization_config, 6 layers (the first dense; ~9.5 GB of int4 experts a layer, ~56 GB in all): the WNA16
# MoE kernels Kimi-K2.5 runs, on one GPU.
PRESETS["kimi-k25-int4"] = _kimi_k25_class(
    "kimi-k25-int4",
    dict(KIMI_K25_TEXT, num_hidden_layers=6, quantization_config=KIMI_K25_QUANT),
    layer_ids=(2, 3, 4, 6),  # (2, L//2, L-3, L) repeats an id below 7 layers
)


def from_name(name: str) -> TargetProfile:
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown target profile {name!r}; known: {', '.join(PRESETS)}") from None


def profile_from_config(config: dict[str, Any], name: str = "custom") -> TargetProfile:
    """A profile for a model folder's config.json (multimodal configs: their text_config)."""
    text = config.get("text_config") or config
    arch = (config.get("architectures") or text.get("architectures") or ["unknown"])[0]
    return TargetProfile(name, arch, int(text["hidden_size"]), int(text["num_hidden_layers"]), int(text["vocab_size"]))


def read_model_config(model) -> dict:
    """A target folder's config.json (the one place targets' configs are read)."""
    from pathlib import Path

    path = Path(model) / "config.json"
    if not path.exists():
        from eagle3.preflight import UsageError

        raise UsageError(f"{path} not found: --model must be a model folder with config.json")
    return json.loads(path.read_text())


def config_hash(config: dict[str, Any]) -> str:
    """Identity of a target for stores: sha256 of its config without bookkeeping keys, 16 hex digits."""
    skip = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_attn_implementation", "architectures"}
    text = config.get("text_config") or config
    canon = json.dumps({k: v for k, v in sorted(text.items()) if k not in skip}, sort_keys=True, default=str)
    return hashlib.sha256(canon.encode()).hexdigest()[:16]
