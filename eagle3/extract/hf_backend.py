"""Reference extraction with transformers: the CPU default and the oracle GPU tests compare vLLM against.

ids k < L come from ``output_hidden_states[k]`` (the input of decoder layer k). HF's index L is the
output *after* the final norm, so id L is taken from the final norm's input instead (a pre-hook):
the last layer's output before the norm, as vLLM captures it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from eagle3.data.conversations import Sample
from eagle3.targets.layers import validate_layer_ids

log = logging.getLogger(__name__)


def decoder_stack(model) -> torch.nn.Module:
    """The module holding ``layers`` and ``norm`` (LlamaModel, DeepseekV3Model, ...)."""
    for path in ("model", "model.language_model", "language_model.model"):
        m = model
        try:
            for part in path.split("."):
                m = getattr(m, part)
        except AttributeError:
            continue
        if hasattr(m, "layers") and hasattr(m, "norm"):
            return m
    raise TypeError(f"cannot find the decoder layers of {type(model).__name__}")


@torch.inference_mode()
def generate_turn(
    model, device, ids, seed: int, max_tokens: int, temperature: float, top_p: float, stops: set[int]
) -> list[int]:
    """transformers' generate after ``ids`` with its own seed (greedy at temperature 0): the new tokens, the
    end-of-turn token kept where the turn ended on one."""
    torch.manual_seed(seed)
    x = torch.tensor([list(ids)], device=device)
    sample = temperature > 0
    y = model.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=max_tokens,
        do_sample=sample,
        temperature=temperature if sample else None,
        top_p=top_p if sample else None,
        top_k=None,
        eos_token_id=sorted(stops),
        pad_token_id=sorted(stops)[0],
    )
    return y[0, len(ids) :].tolist()


def load_model(path: str | Path, dtype: str | None, device: str, trust_remote_code: bool = False):
    """transformers' model of a target folder, every parameter in ``dtype`` (None: the checkpoint's), in eval mode.
    An INT4 target's experts come out of compressed-tensors in their scales' dtype (bf16), so the cast is explicit."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=getattr(torch, dtype) if dtype else "auto", trust_remote_code=trust_remote_code
    )
    return model.to(device=device, dtype=getattr(torch, dtype) if dtype else None).eval()


class HFBackend:
    name = "hf"

    def __init__(
        self,
        model_path: str | Path,
        layer_ids: Sequence[int],
        device: str = "cpu",
        compute_dtype: str | None = None,
        out_dtype: str = "bfloat16",
        batch_size: int = 1,
        trust_remote_code: bool = False,
    ):
        self.model = load_model(model_path, compute_dtype, device, trust_remote_code)
        self.stack = decoder_stack(self.model)
        self.num_layers = len(self.stack.layers)
        self.layer_ids = validate_layer_ids(layer_ids, self.num_layers)
        self.device, self.out_dtype, self.batch_size = device, getattr(torch, out_dtype), batch_size
        self._prenorm: torch.Tensor | None = None
        self.stack.norm.register_forward_pre_hook(self._grab_prenorm)

    def _grab_prenorm(self, module, args):
        self._prenorm = args[0]

    @torch.inference_mode()
    def forward_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> states [B, n_layers, T, H] in the compute dtype (ids in self.layer_ids)."""
        out = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=None if attention_mask is None else attention_mask.to(self.device),
            output_hidden_states=True,
            use_cache=False,
        )
        hs = out.hidden_states  # L + 1 entries; [L] is post-norm
        states = [self._prenorm if i == self.num_layers else hs[i] for i in self.layer_ids]
        return torch.stack(states, dim=1)

    def capture(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """Per sample: states [n_layers, T, H] in the output dtype, on CPU."""
        out = []
        for start in range(0, len(samples), self.batch_size):
            chunk = samples[start : start + self.batch_size]
            longest = max(len(s) for s in chunk)
            ids = torch.zeros(len(chunk), longest, dtype=torch.long)
            mask = torch.zeros(len(chunk), longest, dtype=torch.long)
            for b, s in enumerate(chunk):  # right padding: causal attention keeps real positions exact
                ids[b, : len(s)] = torch.tensor(s.input_ids)
                mask[b, : len(s)] = 1
            states = self.forward_states(ids, mask if len(chunk) > 1 else None)
            for b, s in enumerate(chunk):
                out.append(states[b, :, : len(s)].to(self.out_dtype).cpu())
        return out

    def generate(self, prompts, gen, stops: set[int]) -> list[list[int]]:
        """`extract --regenerate`: each prompt's turn (one_pass.Prompt: ids, seed, max_tokens; gen: the sampling)."""
        return [
            generate_turn(self.model, self.device, p.ids, p.seed, p.max_tokens, gen.temperature, gen.top_p, stops)
            for p in prompts
        ]

    @torch.inference_mode()
    def top_logprobs(self, samples: Sequence[Sample], k: int):
        """The model's own next-token distribution after each sample: greedy token + top-k logprobs."""
        from eagle3.extract.selfcheck import EngineTop

        out = []
        for s in samples:
            logits = self.model(input_ids=torch.tensor([s.input_ids], device=self.device), use_cache=False).logits
            lp = torch.log_softmax(logits[0, -1].float(), -1)
            top = torch.topk(lp, k)
            out.append(EngineTop(int(lp.argmax()), dict(zip(top.indices.tolist(), top.values.tolist()))))
        return out

    def close(self) -> None:
        self.model = None
