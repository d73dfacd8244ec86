"""The mission's path on one GPU (issue 11): a draft trained on a DeepseekV3 (MLA + MoE) target's states is served
by vLLM with that target. mini-Kimi (real random weights, Kimi's layer shapes) -> production extraction ->
training -> vLLM `speculative_config={"method": "eagle3"}` with k = 3.

No acceptance threshold: with random weights the target's next token carries little that a draft can learn.
What must hold: vLLM loads the bf16, embedding-free export; the drafter shares the target's embedding; the
RoPE vLLM applies to the draft is the one it was trained with; greedy outputs equal the target's alone wherever
the target is decided. Measured on the H200 (the 18bea75 run): only 25% of 32 random-token prompts gave identical
32-token outputs with acceptance 0 (no draft token accepted, so the draft cannot have changed them): verifying
k+1 tokens at once runs the target's MLA and MoE kernels at another shape than one token per step, and a
random-weight target's top logits are often within bf16 noise of each other. So a divergence must start at a
near-tie of the target's own plain run (top-1 minus top-2 log-prob <= evaluate.NEAR_TIE), or where the target itself,
in the verification forward, chose the speculative token (evaluate.unexplained, the rule test_draft_acceptance
applies): on an H100 (2026-12-05, vLLM 0.26.0) 31 of 32 outputs diverged, two at plain margins of 0.625 and 0.75
nats where the verification forward had a near-tie of its own (0.0, 0.094) and chose the token itself, as a MoE's
expert-routing near-tie flipped at another batch shape does; the H200 runs saw margins of at most 0.0625. A token
the target did not choose there fails. The divergences judged are the speculative run's repeat's (the one with the
verification's top-2 at every token, evaluate.judged_divergences): at eb52e7a on an H100 the repeat had differed from
the timed run at a prompt whose timed divergence (plain margin 0.125) then had no top-2 to tell, and failed.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors import safe_open

from eagle3.data.conversations import random_samples
from eagle3.extract import extract
from eagle3.serve import evaluate
from eagle3.train import train
from eagle3.train.draft import DraftShape, export_bytes, speculators_config

pytestmark = pytest.mark.gpu


def test_a_draft_trained_on_mini_kimi_is_served_with_it(target, engines, tmp_path, gpu_out, report):
    t0 = time.perf_counter()
    prof = target.profile
    samples = random_samples(320, 256, prof.vocab_size, seed=51)
    store = tmp_path / "store"
    ex = extract.run(
        extract.ExtractConfig(model=str(target.path), out=str(store), backend="vllm", batch_size=64, tp=target.tp),
        samples=samples,
        backend=engines.get("hooks"),
        progress=False,
    )
    report(
        "deepseek_draft_extract",
        {"samples": ex.samples_written, "tokens_per_s": round(ex.tokens_per_s), "selfcheck": ex.selfcheck},
    )
    tr = train.train(
        train.TrainConfig(
            store=str(store),
            out=str(tmp_path / "train"),
            device="cuda",
            batch_samples=16,
            epochs=2,
            lr=1e-3,
            warmup_steps=5,
            draft_vocab_size=16000,
            ttt_steps=3,
        ),
        progress=False,
    )
    report(
        "deepseek_draft_train",
        {
            "steps": tr.steps,
            "loss": [round(tr.losses[0], 4), round(tr.losses[-1], 4)],
            "tokens_per_s": round(tr.tokens_per_s),
            "accuracy": tr.accept,
        },
    )
    draft_cfg = json.loads((tmp_path / "train" / "draft" / "config.json").read_text())
    shape = DraftShape.from_layer_config(draft_cfg["transformer_layer_config"])
    with safe_open(str(tmp_path / "train" / "draft" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        data_bytes = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in names)
        dtypes = {str(f.get_tensor(k).dtype) for k in names if f.get_tensor(k).is_floating_point()}
    assert "embed_tokens.weight" not in names and dtypes == {"torch.bfloat16"}
    assert data_bytes == export_bytes(shape, n_aux=3, draft_vocab_size=16000)
    size = (tmp_path / "train" / "draft" / "model.safetensors").stat().st_size

    if not target.local:
        engines.close()  # a real target fills the GPUs: the eval engines need them
    prompts = [list(s.input_ids) for s in random_samples(32, 64, prof.vocab_size, seed=52)]
    rep = evaluate.run(
        evaluate.EvalConfig(
            target=str(target.path),
            draft=str(tmp_path / "train" / "draft"),
            prompt_ids=prompts,
            out=str(tmp_path / "eval"),
            k=3,
            max_tokens=32,
            num_prompts=32,
            shifted=False,
            gpu_memory_utilization=0.2,
            tp=target.tp,
        )
    )
    (gpu_out / "deepseek_draft_eval.json").write_text(
        json.dumps(json.loads((tmp_path / "eval" / "eval.json").read_text()), indent=1)
    )
    d = rep.draft
    summary = (
        f"mini-Kimi + EAGLE-3 draft served by vLLM: k=3, acceptance length {d.acceptance_length:.3f}, per "
        f"position {', '.join(f'{p:.3f}' for p in d.per_position)}, {d.drafts} drafts; greedy outputs identical "
        f"{rep.outputs_identical:.0%}; draft {size / 2**20:.1f} MiB on disk (bf16, no embedding); engine start "
        f"{rep.engine_start_s} s with the draft vs {rep.baseline_start_s} s without"
    )
    report("deepseek_draft_summary", summary)
    report("deepseek_draft_drafter", {k: v for k, v in rep.drafter.items() if not k.startswith("rope_c")})
    report("deepseek_draft_seconds", round(time.perf_counter() - t0, 1))
    report("deepseek_draft_divergences", rep.divergences)
    assert d.drafts > 0 and len(d.per_position) == 3
    assert not evaluate.unexplained(rep.divergences), (summary, rep.divergences)
    assert rep.drafter["shares_embedding"] and rep.drafter["dtype"] == "bfloat16", rep.drafter
    # the RoPE vLLM applies to the draft is the one speculators trained it with
    import copy

    from speculators.models.eagle3.model_definitions import model_classes
    from speculators.models.utils import flatten_rope_parameters

    # exactly how Eagle3DraftModel.__init__ builds its rotary (speculators/models/eagle3/core.py, ROTARY EMBEDDINGS)
    layer_cfg = speculators_config(shape, [2, 4, 5], 16000, 3, str(target.path), ["x"]).transformer_layer_config
    rcfg = copy.copy(flatten_rope_parameters(layer_cfg))
    rcfg.hidden_size *= 2
    rotary = model_classes["llama"].rotary_emb_class(rcfg)
    pos = torch.tensor([list(evaluate.ROPE_PROBE)])
    cos, sin = rotary(torch.zeros(1, pos.shape[1], 2 * shape.hidden_size), pos)
    half = shape.head_dim // 2
    served_cos, served_sin = torch.tensor(rep.drafter["rope_cos"]), torch.tensor(rep.drafter["rope_sin"])
    assert rep.drafter["rope_base"] == shape.rope_theta == prof.hf_config["rope_theta"]
    torch.testing.assert_close(served_cos, cos[0, :, :half].float(), atol=1e-2, rtol=0)  # vLLM keeps them in bf16
    torch.testing.assert_close(served_sin, sin[0, :, :half].float(), atol=1e-2, rtol=0)
