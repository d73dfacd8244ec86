"""Tiny targets made locally: a BPE tokenizer with a chat template, and models with real random weights.

Nothing here touches a hub. ``build_tokenizer`` trains a byte-level BPE on project-written dialogues;
``build_model`` instantiates a profile's HF config with seeded random weights and saves safetensors.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from eagle3.data import corpus
from eagle3.targets import kimi_format
from eagle3.targets.presets import TargetProfile

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
# ChatML-style; BOS first. Assistant turns end with <|im_end|>, which the model learns to emit.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _texts(chat_format: str, seed: int) -> list[str]:
    """What the BPE is trained on: the dialogues' text, and for kimi the thinking, tool calls and replies too."""
    if chat_format == "chatml":
        return [m["content"] for c in corpus.generate(3000, seed=seed) for m in c["messages"]] + [
            "user",
            "assistant",
            "system",
            "\n",
        ]
    from eagle3.data import kimi_traffic

    out = [
        "user",
        "assistant",
        "system",
        "tool",
        "tool_declare",
        "## Return of ",
        "\n",
        kimi_format.DEFAULT_SYSTEM,
        json.dumps(kimi_traffic.TOOLS),
    ]
    for c in kimi_traffic.generate(3000, seed=seed):
        for m in c["messages"]:
            out += [m.get("content") or "", m.get("reasoning_content") or ""]
            out += [t["id"] + t["function"]["arguments"] for t in m.get("tool_calls", [])]
    return out


def build_tokenizer(out_dir: str | Path, vocab_size: int = 1024, seed: int = 1, chat_format: str = "chatml"):
    """Train a byte-level BPE on generated dialogues; save a fast tokenizer with the chat template (``chat_format``:
    chatml, or kimi: Kimi-K2's role, thinking and tool-call tokens and template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if chat_format not in ("chatml", "kimi"):
        raise ValueError(f"chat_format {chat_format!r}: use chatml or kimi")
    specials = SPECIAL_TOKENS if chat_format == "chatml" else kimi_format.SPECIAL_TOKENS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_texts(chat_format, seed), trainer=trainer)
    if chat_format == "chatml":
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<|bos|>",
            eos_token="<|im_end|>",
            pad_token="<|pad|>",
            additional_special_tokens=["<|im_start|>", "<|eos|>"],
        )
        fast.chat_template = CHAT_TEMPLATE
    else:
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, **kimi_format.tokenizer_kwargs())
        fast.chat_template = kimi_format.CHAT_TEMPLATE
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def fix_routing(model, topk: int) -> None:
    """DeepseekV3 MoE: make experts 0..topk-1 win every token's top-k selection.

    The selection uses sigmoid scores (in (0, 1)) plus e_score_correction_bias; a bias of +1 on the
    first topk experts decides it, while the routing weights still come from each token's own scores.
    Comparisons between engines then cannot be thrown off by near-ties that bf16 rounding flips to a
    different expert (a discontinuity, not an error of either engine).
    """
    import torch

    for layer in model.model.layers:
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        bias = getattr(gate, "e_score_correction_bias", None)
        if bias is not None:
            with torch.no_grad():
                bias.zero_()
                bias[:topk] = 1.0


def randomize_final_norm(model, seed: int) -> None:
    """Final-norm weights drawn from [0.5, 1.5] instead of HF's ones. With ones, norm(norm(h)) == norm(h), so a
    post-norm state could not be told from the pre-norm one by norm + lm_head (the final-state self-check)."""
    import torch

    norm = model.model.norm.weight
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        norm.copy_((0.5 + torch.rand(norm.shape, generator=g)).to(norm.dtype))


def build_model(
    profile: TargetProfile,
    out_dir: str | Path,
    seed: int = 0,
    dtype: str = "float32",
    with_tokenizer: bool = True,
    overrides: dict | None = None,
    device: str = "cpu",
    fixed_routing: bool = False,
) -> Path:
    """Write config.json + model.safetensors (+ tokenizer) for a buildable profile; returns out_dir.

    Idempotent: a folder that already holds this exact build (same profile, seed, dtype) is reused.
    ``device="cuda"`` initializes large models (mini-Kimi: 1.6 B parameters) in seconds.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not profile.buildable:
        raise ValueError(f"profile {profile.name!r} describes a real target; it cannot be built locally")
    out_dir = Path(out_dir)
    cfg = dict(profile.hf_config, **(overrides or {}))
    if profile.build == "config":  # no weights: vLLM serves it with load_format="dummy"
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(dict(cfg, torch_dtype=dtype), indent=1))
        return out_dir
    stamp = {
        "cfg": cfg,
        "seed": seed,
        "dtype": dtype,
        "tok": with_tokenizer,
        "routing": fixed_routing,
        "norm": "random",
    }
    if profile.chat_format != "chatml":
        stamp["chat_format"] = profile.chat_format
    stamp = json.dumps(stamp, sort_keys=True)
    if (out_dir / ".eagle3-build").exists() and (out_dir / ".eagle3-build").read_text() == stamp:
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    if with_tokenizer:
        tok = build_tokenizer(out_dir, vocab_size=cfg["vocab_size"], chat_format=profile.chat_format)
        cfg.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if k != "architectures"})
    config.architectures = cfg["architectures"]
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        if device.startswith("cuda"):
            torch.cuda.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    if fixed_routing:
        fix_routing(model, int(cfg.get("num_experts_per_tok", 0)))
    randomize_final_norm(model, seed)
    model.save_pretrained(out_dir)
    del model
    (out_dir / ".eagle3-build").write_text(stamp)
    log.info(
        "built %s (%s, %d layers, hidden %d) in %s",
        profile.name,
        profile.architecture,
        profile.num_hidden_layers,
        profile.hidden_size,
        out_dir,
    )
    return out_dir


def default_cache() -> Path:
    return Path(os.environ.get("EAGLE3_CACHE", Path.home() / ".cache" / "eagle3"))
