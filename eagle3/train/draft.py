"""The EAGLE-3 draft: its speculators config for a target, and the draft vocabulary (d2t / t2d).

vLLM 0.26 serves speculators-format EAGLE-3 drafts whose ``transformer_layer_config.model_type`` is
"llama" or "qwen3". speculators' ``from_training_args`` copies the verifier's config as the layer
config, which for a DeepseekV3 (Kimi) verifier gives model_type "deepseek_v3" with MLA/MoE fields that
neither speculators' draft nor vLLM's loader accept. So the draft's decoder layer is a Llama layer sized
from the target's hidden size and vocabulary, built here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Keys vLLM's speculators loader reads from the draft's config.json (validate_speculators_config).
VLLM_REQUIRED = ("speculators_model_type", "speculators_config", "transformer_layer_config")


# Tensor-parallel sizes a draft must load at unless told otherwise: vLLM runs the EAGLE-3 draft at the
# target's TP, and Kimi-K2.5 is served at 8 (16 on smaller GPUs).
SERVE_TPS = (1, 2, 4, 8, 16)
KV_HEADS = 8  # divides or is divided by every power-of-two TP up to 64 (SpecForge's DeepSeek-V3 draft uses 8)


class DraftShapeError(ValueError):
    """A draft shape vLLM would refuse at a tensor-parallel size."""


def _yarn(rs: dict) -> dict:
    """DraftShape's YaRN fields from a rope_scaling / rope_parameters dict (none unless YaRN with a factor > 1)."""
    if (rs.get("rope_type") or rs.get("type")) not in ("yarn", "deepseek_yarn") or float(rs.get("factor", 1)) <= 1:
        return {}
    return {
        "rope_factor": float(rs["factor"]),
        "rope_original_max": int(rs["original_max_position_embeddings"]),
        "rope_beta_fast": float(rs.get("beta_fast", 32)),
        "rope_beta_slow": float(rs.get("beta_slow", 1)),
    }


def _round_up(x: int, k: int) -> int:
    return -(-x // k) * k


@dataclass(frozen=True)
class DraftShape:
    """Size of the one-layer Llama-style draft, derived from the target unless given."""

    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    num_layers: int = 1
    rope_factor: float = 1.0  # the target's YaRN (1: plain RoPE): factor over its original context
    rope_original_max: int = 0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0

    @classmethod
    def for_target(cls, target_config: dict) -> DraftShape:
        """head_dim 128/64/32 by hidden size; heads = hidden / head_dim rounded up to a multiple of 16 and 8 KV
        heads, so every TP in SERVE_TPS divides them; intermediate rounded up to a multiple of 16.
        Kimi-K2.5 (hidden 7168): 64 heads x 128 (attention width 8192), 8 KV heads, intermediate 18432.

        RoPE: the target's theta and YaRN (factor, original context, betas; Kimi: x64 from 4k), so the draft's
        positions stretch as the target's do; plain where the target has no YaRN. max_position_embeddings is the
        target's: vLLM caps the draft's context at it."""
        text = target_config.get("text_config") or target_config
        hidden = int(text["hidden_size"])
        head_dim = 128 if hidden >= 2048 else 64 if hidden >= 512 else 32
        heads = _round_up(-(-hidden // head_dim), max(SERVE_TPS))
        inter = _round_up(int(text.get("intermediate_size") or 4 * hidden), max(SERVE_TPS))
        rope = text.get("rope_theta") or (text.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        return cls(
            hidden,
            int(text["vocab_size"]),
            heads,
            KV_HEADS,
            head_dim,
            inter,
            float(text.get("rms_norm_eps", 1e-6)),
            int(text.get("max_position_embeddings", 4096)),
            float(rope),
            **_yarn(text.get("rope_scaling") or text.get("rope_parameters") or {}),
        )

    @classmethod
    def from_layer_config(cls, layer: dict) -> DraftShape:
        """The shape a draft's exported transformer_layer_config describes."""
        rope = (layer.get("rope_parameters") or {}).get("rope_theta") or layer.get("rope_theta") or 10000.0
        return cls(
            int(layer["hidden_size"]),
            int(layer["vocab_size"]),
            int(layer["num_attention_heads"]),
            int(layer.get("num_key_value_heads") or layer["num_attention_heads"]),
            int(layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"]),
            int(layer["intermediate_size"]),
            float(layer.get("rms_norm_eps", 1e-6)),
            int(layer.get("max_position_embeddings", 4096)),
            float(rope),
            int(layer.get("num_hidden_layers", 1)),
            **_yarn(layer.get("rope_parameters") or {}),
        )

    def rope_parameters(self) -> dict:
        """As a Llama config carries them. DeepSeek's mscale keys stay out: vLLM's "yarn" ignores them and scales
        cos and sin by 0.1 ln(factor) + 1, as transformers does without them (with them, by 1.0)."""
        if self.rope_factor <= 1:
            return {"rope_type": "default", "rope_theta": self.rope_theta}
        return {"rope_type": "yarn", "rope_theta": self.rope_theta, "factor": self.rope_factor,
                "original_max_position_embeddings": self.rope_original_max, "beta_fast": self.rope_beta_fast,
                "beta_slow": self.rope_beta_slow}  # fmt: skip

    def llama_config(self, attn_implementation: str = "sdpa"):
        from transformers import LlamaConfig

        cfg = LlamaConfig(
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=self.rope_parameters(),
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=False,
        )
        cfg._attn_implementation = attn_implementation
        return cfg


def tp_problems(shape: DraftShape, tp: int) -> list[str]:
    """Why vLLM 0.26 would refuse this draft at tensor-parallel size ``tp`` (empty = it loads).

    Its rules: model_executor/models/llama.py LlamaAttention (attention heads % tp == 0; KV heads % tp == 0
    when tp <= KV heads, else tp % KV heads == 0) and layers/linear.py (MLP intermediate size % tp == 0)."""
    out = []
    heads, kv = shape.num_attention_heads, shape.num_key_value_heads
    if heads % tp:
        out.append(f"{heads} attention heads at TP {tp}: vLLM needs heads % tp == 0")
    if kv >= tp and kv % tp:
        out.append(
            f"{kv} KV heads at TP {tp}: vLLM needs kv_heads % tp == 0 when tp <= kv_heads (else tp % kv_heads == 0)"
        )
    elif kv < tp and tp % kv:
        out.append(
            f"{kv} KV heads at TP {tp}: vLLM needs tp % kv_heads == 0 when tp > kv_heads (else kv_heads % tp == 0)"
        )
    if shape.intermediate_size % tp:
        out.append(
            f"intermediate size {shape.intermediate_size} at TP {tp}: vLLM splits the MLP evenly "
            "(intermediate_size % tp == 0)"
        )
    return out


def check_servable(shape: DraftShape, tps) -> None:
    """Raise DraftShapeError naming every rule vLLM would break at any of ``tps``."""
    problems = [p for tp in tps for p in tp_problems(shape, int(tp))]
    if problems:
        raise DraftShapeError(
            "vLLM runs the EAGLE-3 draft at the target's tensor-parallel size and would refuse this draft: "
            + "; ".join(problems)
            + ". Leave the draft shape to eagle3 (8 KV heads, heads a multiple of 16) or "
            "choose --draft-heads/--draft-kv-heads that fit, or a --serve-tp the draft need not run at."
        )


def export_bytes(shape: DraftShape, n_aux: int, draft_vocab_size: int, dtype_bytes: int = 2) -> int:
    """Bytes of the exported model.safetensors tensors: fc, one Llama layer (its q/k/v take the 2H concat of
    embedding and fc output), final norm, lm_head [draft_vocab, H], d2t int64, t2d bool. No embedding."""
    h, q, kv = shape.hidden_size, shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    params = (
        n_aux * h * h
        + 2 * h * (q + 2 * kv)
        + q * h
        + 3 * h * shape.intermediate_size
        + 3 * h
        + h
        + draft_vocab_size * h
    )
    mapping = 8 * draft_vocab_size + shape.vocab_size if draft_vocab_size < shape.vocab_size else 0
    return dtype_bytes * params + mapping


def draft_vocab(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Most frequent tokens -> (t2d bool [V], d2t int64 [N]) in EAGLE-3's offset convention.

    Draft index i is the i-th selected target id in ascending order (speculators selects lm_head rows
    with ``lm_head[t2d]``, which keeps ascending order); ``target_id = i + d2t[i]``. Ties in frequency go
    to the smaller token id.
    """
    vocab = token_counts.numel()
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"draft vocab size {draft_vocab_size} must be in [1, {vocab}]")
    order = sorted(range(vocab), key=lambda t: (-int(token_counts[t]), t))
    selected = torch.tensor(sorted(order[:draft_vocab_size]), dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[selected] = True
    d2t = selected - torch.arange(draft_vocab_size, dtype=torch.long)
    return t2d, d2t


def speculators_config(
    shape: DraftShape,
    aux_layer_ids: Sequence[int],
    draft_vocab_size: int,
    speculative_tokens: int,
    verifier_path: str,
    verifier_architectures: list[str],
    norm_before_residual: bool = False,
    attn_implementation: str = "sdpa",
    fc_norm: bool = False,
    norm_output: bool = False,
):
    """EAGLE-3.1's toggles (against attention drift on long contexts), read by vLLM 0.26 (llama_eagle3.py):
    ``fc_norm`` an RMSNorm on each aux state before the fusion layer fc; ``norm_output`` the post-norm state (not
    the pre-norm residual sum) fed to the next draft step."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    layer = shape.llama_config(attn_implementation)
    # vLLM 0.26 sizes the drafter's fc for 3 aux states unless the layer config says otherwise
    # (llama_eagle3.py:176-182; eagle3/train/vllm_reads.py): say it always
    layer.num_aux_hidden_states = len(aux_layer_ids)
    return Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=draft_vocab_size,
        norm_before_residual=norm_before_residual,
        fc_norm=fc_norm,
        norm_output=norm_output,
        target_hidden_size=shape.hidden_size,
        eagle_aux_hidden_state_layer_ids=list(aux_layer_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=speculative_tokens)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier_path, architectures=verifier_architectures),
        ),
    )


def check_vllm_loadable(config: dict) -> list[str]:
    """What vLLM 0.26's speculators loader would reject in a draft config.json (empty = loadable)."""
    problems = [f"missing {k}" for k in VLLM_REQUIRED if k not in config]
    if problems:
        return problems
    if config["speculators_model_type"] != "eagle3":
        problems.append(f"speculators_model_type is {config['speculators_model_type']!r}, not 'eagle3'")
    spec = config["speculators_config"]
    try:
        if int(spec["proposal_methods"][0]["speculative_tokens"]) < 1:
            problems.append("speculative_tokens < 1")
    except (KeyError, IndexError, TypeError, ValueError):
        problems.append("speculators_config.proposal_methods[0].speculative_tokens missing")
    if not (spec.get("verifier") or {}).get("name_or_path"):
        problems.append("speculators_config.verifier.name_or_path missing")
    layer = config["transformer_layer_config"]
    if not isinstance(layer, dict):
        problems.append("transformer_layer_config is not a dict")
    elif layer.get("model_type", "llama") not in ("llama", "qwen3"):
        problems.append(f"transformer_layer_config.model_type {layer.get('model_type')!r} is not llama/qwen3")
    if "norm_before_residual" not in config:
        problems.append("norm_before_residual missing (vLLM would assume True)")
    if not config.get("eagle_aux_hidden_state_layer_ids"):
        problems.append("eagle_aux_hidden_state_layer_ids missing (vLLM would use its defaults)")
    return problems
