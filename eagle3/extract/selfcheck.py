"""The final-state self-check: on any target, with no reference model, is the captured id-L state the last
layer's output before the final norm?

Apply the target's final norm and lm_head (read from its checkpoint: only those two tensors) to the state of
a prompt's last token, and compare with the next-token distribution the engine itself produced for the same
prompt (vLLM: ``max_tokens=1, logprobs=k``). A post-norm state (normed twice here), the state of layer L-1 or
another sample's state gives other logits.

Measures, per prompt (means over prompts are reported):
  shape    relative L2 error between our and the engine's logprobs over the engine's top-k, each centered
           (differences between the top tokens: no normalizer, no logit scale)     (decides: <= MAX_SHAPE_ERR)
  recall   fraction of the engine's top-k tokens among our top-2k                  (decides: >= MIN_RECALL)
  top1     our argmax equals the engine's greedy token
  rank     mean percentile of the engine's top-k tokens in our full ordering  (1.0 = at the top, 0.5 = chance):
           still informative when logits are nearly flat (dummy weights), where bf16 ties reorder the top-k
  lp_err   mean absolute logprob difference over the engine's top-k
Measured on the tiny targets (tests/unit/test_selfcheck.py): right state (bf16) shape 0.005-0.007; post-norm
0.73-0.90, layer L-1 1.19-1.41, another prompt's state 3.1-3.9. The engine's bf16 logits add about
|logit| x 2^-9 / (top-k spread) (~0.01 for a trained model), hence the 0.25 bound.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)

K = 20  # vLLM's default max_logprobs
MIN_RECALL = 0.5
MAX_SHAPE_ERR = 0.25

NORM_NAMES = ("model.norm.weight", "language_model.model.norm.weight", "model.language_model.norm.weight")
HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight")
EMBED_NAMES = ("model.embed_tokens.weight", "language_model.model.embed_tokens.weight")


class SelfCheckFailed(RuntimeError):
    pass


@dataclass
class FinalHead:
    norm: torch.Tensor  # [H] float32
    eps: float
    lm_head: torch.Tensor  # [V, H]
    source: str

    def normed(self, states: torch.Tensor) -> torch.Tensor:
        """states [N, H] (any float dtype) -> the final norm's output [N, H] float32 (also a self-check's control:
        a post-norm state must fail)."""
        h = states.float()
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """states [N, H] (any float dtype) -> logits [N, V] float32: RMSNorm in float32, then lm_head."""
        return self.normed(states) @ self.lm_head.float().T


def _weight_files(folder: Path) -> dict[str, Path]:
    """tensor name -> file, from model.safetensors.index.json or every *.safetensors in the folder."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.exists():
        return {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: f for k in h.keys()})
    return out


def load_head(model: str | Path) -> FinalHead:
    """The final norm and lm_head of a target folder: only those tensors are read (for Kimi-K2.5 one shard
    slice of ~2.3 GB, not the 1T checkpoint)."""
    from safetensors import safe_open

    from eagle3.targets.presets import read_model_config

    folder = Path(model)
    cfg = read_model_config(folder)
    text = cfg.get("text_config") or cfg
    files = _weight_files(folder)
    if not files:
        raise SelfCheckFailed(
            f"{folder} has no weights: the self-check needs the final norm and lm_head "
            "(for a dummy-weight engine, take them from the engine: VLLMBackend.dump_head)"
        )

    def get(names):
        for n in names:
            if n in files:
                with safe_open(str(files[n]), framework="pt") as h:
                    return h.get_tensor(n)
        return None

    norm = get(NORM_NAMES)
    head = get(HEAD_NAMES)
    if head is None and text.get("tie_word_embeddings", cfg.get("tie_word_embeddings")):
        head = get(EMBED_NAMES)
    if norm is None or head is None:
        raise SelfCheckFailed(
            f"{folder}: cannot find the final norm ({NORM_NAMES[0]}) or lm_head ({HEAD_NAMES[0]}) in its weights"
        )
    return FinalHead(norm.float(), float(text.get("rms_norm_eps", 1e-6)), head, f"checkpoint {folder}")


def load_head_files(paths: Sequence[str | Path], eps: float) -> FinalHead:
    """Head shards dumped by the engine's ranks (eagle3_dump_head): norm + lm_head rows [start, end) each."""
    from safetensors import safe_open

    parts, norm = [], None
    for p in paths:
        with safe_open(str(p), framework="pt") as h:
            start = int(h.metadata()["vocab_start"])
            parts.append((start, h.get_tensor("lm_head")))
            norm = h.get_tensor("norm")
    parts.sort(key=lambda x: x[0])
    head = torch.cat([t for _, t in parts])
    return FinalHead(norm.float(), eps, head, f"engine ({len(parts)} rank file(s))")


def head_for(model: str | Path, backend, scratch: str | Path) -> FinalHead:
    """The target's checkpoint head, or, for a target without weights (load_format="dummy"), the slices the
    engine's ranks dump into ``scratch``."""
    try:
        return load_head(model)
    except SelfCheckFailed:
        if not hasattr(backend, "dump_head"):
            raise
    from eagle3.targets.presets import read_model_config

    cfg = read_model_config(model)
    eps = float((cfg.get("text_config") or cfg).get("rms_norm_eps", 1e-6))
    return load_head_files(backend.dump_head(scratch), eps)


@dataclass
class EngineTop:
    """What the engine produced after a prompt: its greedy token and top-k logprobs {token: logprob}."""

    token: int
    logprobs: dict[int, float]


@dataclass
class SelfCheckResult:
    n: int
    recall: float
    top1: float
    rank: float
    lp_err: float
    k: int
    head: str
    per_prompt: list[dict] = field(default_factory=list)

    shape_err: float = 0.0

    @property
    def ok(self) -> bool:
        return self.recall >= MIN_RECALL and self.shape_err <= MAX_SHAPE_ERR

    def line(self) -> str:
        return (
            f"final-state self-check {'PASS' if self.ok else 'FAIL'}: {self.n} prompts, top-{self.k} logprob "
            f"shape error {self.shape_err:.4f} (pass <= {MAX_SHAPE_ERR}), recall@{2 * self.k} {self.recall:.3f} "
            f"(pass >= {MIN_RECALL}), top-1 agreement {self.top1:.3f}, rank percentile {self.rank:.4f}, "
            f"logprob error {self.lp_err:.4f}; head from {self.head}"
        )


def compare(head: FinalHead, states: torch.Tensor, engine: Sequence[EngineTop], k: int = K) -> SelfCheckResult:
    """states [N, H]: each prompt's last-token id-L state; engine: what the engine produced for those prompts."""
    logits = head.logits(states)
    vocab = min(logits.shape[1], head.lm_head.shape[0])
    logits = logits[:, :vocab]
    per = []
    for row, top in zip(logits, engine):
        theirs = sorted(top.logprobs, key=lambda t: -top.logprobs[t])[:k]
        ours = set(torch.topk(row, min(2 * k, vocab)).indices.tolist())
        order = torch.argsort(row, descending=True)
        rank_of = torch.empty(vocab, dtype=torch.long)
        rank_of[order] = torch.arange(vocab)
        pct = [1.0 - float(rank_of[t]) / max(1, vocab - 1) for t in theirs if t < vocab]
        lp = torch.log_softmax(row, -1)
        err = [abs(float(lp[t]) - top.logprobs[t]) for t in theirs if t < vocab]
        a = torch.tensor([float(lp[t]) for t in theirs if t < vocab], dtype=torch.float64)
        b = torch.tensor([top.logprobs[t] for t in theirs if t < vocab], dtype=torch.float64)
        a, b = a - a.mean(), b - b.mean()  # differences between the top-k: no normalizer, no scale
        shape_err = float((a - b).norm() / b.norm().clamp_min(1e-12))
        per.append(
            {
                "recall": sum(t in ours for t in theirs) / max(1, len(theirs)),
                "top1": float(int(row.argmax()) == top.token),
                "rank": sum(pct) / max(1, len(pct)),
                "lp_err": sum(err) / max(1, len(err)),
                "shape_err": shape_err,
            }
        )
    n = len(per)

    def mean(key):
        return sum(p[key] for p in per) / max(1, n)

    return SelfCheckResult(
        n, mean("recall"), mean("top1"), mean("rank"), mean("lp_err"), k, head.source, per, mean("shape_err")
    )


def last_states(samples: Sequence[dict], layer_id: int) -> torch.Tensor:
    """Stored samples ({states: {id: [T, H]}}) -> [N, H]: each one's last-token state of ``layer_id``."""
    return torch.stack([s["states"][layer_id][-1] for s in samples])
