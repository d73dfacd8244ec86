"""The EAGLE-3 draft: its speculators config for a target, and the draft vocabulary (d2t / t2d).

vLLM 0.26 serves speculators-format EAGLE-3 drafts whose ``transformer_layer_config.model_type`` is
"llama" or "qwen3". speculators' ``from_training_args`` copies the verifier's config as the layer
config, which for a DeepseekV3 (Kimi) verifier gives model_type "deepseek_v3" with MLA/MoE fields that
neither speculators' draft nor vLLM's loader accept. So the draft's decoder layer is a Llama layer sized
from the target's hidden size and vocabulary, built here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

# Keys vLLM's speculators loader reads from the draft's config.json (validate_speculators_config).
VLLM_REQUIRED = ("speculators_model_type", "speculators_config", "transformer_layer_config")


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

    @classmethod
    def for_target(cls, target_config: dict) -> "DraftShape":
        text = target_config.get("text_config") or target_config
        hidden = int(text["hidden_size"])
        head_dim = 128 if hidden >= 1024 else max(16, hidden // 4)
        heads = max(1, hidden // head_dim)
        kv = max(1, heads // 4) if heads % 4 == 0 else heads
        inter = int(text.get("intermediate_size") or 4 * hidden)
        rope = text.get("rope_theta") or (text.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        return cls(hidden, int(text["vocab_size"]), heads, kv, head_dim, inter,
                   float(text.get("rms_norm_eps", 1e-6)), int(text.get("max_position_embeddings", 4096)),
                   float(rope))

    def llama_config(self, attn_implementation: str = "sdpa"):
        from transformers import LlamaConfig

        cfg = LlamaConfig(
            hidden_size=self.hidden_size, vocab_size=self.vocab_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, intermediate_size=self.intermediate_size, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings, rope_theta=self.rope_theta,
            hidden_act="silu", attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        )
        cfg._attn_implementation = attn_implementation
        return cfg


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


def speculators_config(shape: DraftShape, aux_layer_ids: Sequence[int], draft_vocab_size: int,
                       speculative_tokens: int, verifier_path: str, verifier_architectures: list[str],
                       norm_before_residual: bool = False, attn_implementation: str = "sdpa"):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    return Eagle3SpeculatorConfig(
        transformer_layer_config=shape.llama_config(attn_implementation),
        draft_vocab_size=draft_vocab_size,
        norm_before_residual=norm_before_residual,
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
