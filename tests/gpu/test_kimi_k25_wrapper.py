"""Kimi-K2.5's own class on one H200 (issue 39; opt-in with `-m kimi_depth`: 61 GB and 2-4 minutes per engine start).

Kimi-K2.5's config.json names KimiK25ForConditionalGeneration (vLLM 0.26 kimi_k25.py): a MoonViT vision tower and a
DeepseekV3 language model, to which its SupportsEagle3 methods hand the aux layers. Here: text_config = kimi-depth's
(61 layers, hidden 7168, Kimi's MLA, 8 experts top-8 + shared), a one-layer vision tower, config.json only,
load_format="dummy", no tokenizer (vLLM runs a multimodal model text-only without one): token-id prompts.
- The capture: ids (2, 30, 58, 61) from the wrapper's language model, distinct layers, the store verified.
- The final-state self-check on the engine's own head passes the id-61 state and fails a post-norm one (as the
  kimi-depth test).
- A draft trained on the store (a few steps) is served by vLLM with the wrapper as target: it loads and drafts;
  acceptance means nothing on dummy weights and is only reported.
Decoder-layer norms are set to 1 (VLLMBackend.unit_norms) as in test_kimi_depth, so the layers' updates show.
"""

from __future__ import annotations

import gc
import json
import time

import pytest
import torch

from eagle3.data.conversations import random_samples
from eagle3.extract import extract, selfcheck
from eagle3.serve import evaluate
from eagle3.store import verify
from eagle3.store.folder import Store
from eagle3.targets import presets, tiny
from eagle3.train import train, vllm_reads

from .conftest import MAX_BATCHED_TOKENS
from .test_extract_vllm import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.kimi_depth]
IDS = (2, 30, 58, 61)
BATCH = 16  # samples a capture step: 16 x 512 tokens, one engine step under MAX_BATCHED_TOKENS


def write_verifier_weights(folder, head_files, prefix: str = "language_model.") -> None:
    """The trainer reads the verifier's embedding, lm_head and final norm from its checkpoint; a config-only target
    has none. Written under the target's key names (Kimi-K2.5's language_model.*, DeepseekV3ForCausalLM's with no
    prefix; found by suffix): the engine's own final norm and lm_head (its dummy weights, from dump_head), and a
    seeded random embedding (vLLM serves the draft with the engine's). vLLM with load_format="dummy" reads none of
    it."""
    from safetensors.torch import load_file, save_file

    (path,) = head_files  # TP 1: one rank's file holds the whole head
    head = load_file(path)
    g = torch.Generator().manual_seed(0)
    embed = (torch.randn(head["lm_head"].shape, generator=g) * 0.02).bfloat16()
    save_file(
        {
            f"{prefix}model.embed_tokens.weight": embed,
            f"{prefix}lm_head.weight": head["lm_head"].bfloat16().contiguous(),
            f"{prefix}model.norm.weight": head["norm"].bfloat16().contiguous(),
        },
        str(folder / "model.safetensors"),
    )


def needs_gpu_memory(gb: float, what: str) -> None:
    """Skip, saying how much it needs, a test whose engine does not fit this GPU."""
    have = torch.cuda.get_device_properties(0).total_memory / 1e9
    if have < gb:
        pytest.skip(f"{what} needs a GPU of about {gb:.0f} GB; this one has {have:.0f} GB")


def engine_repeat(a, b) -> dict:
    """The same prompts asked of the engine twice: how many keep their greedy token and top-k set, and the largest
    logprob difference on the tokens both share (0 where the engine is deterministic)."""
    shared = [set(x.logprobs) & set(y.logprobs) for x, y in zip(a, b)]
    diff = max((abs(x.logprobs[t] - y.logprobs[t]) for x, y, s in zip(a, b, shared) for t in s), default=0.0)
    return {
        "prompts": len(a),
        "same_top1": sum(x.token == y.token for x, y in zip(a, b)),
        "same_topk": sum(set(x.logprobs) == set(y.logprobs) for x, y in zip(a, b)),
        "max_logprob_diff": diff,
    }


def engine_head_check(backend, folder, spec, first, out):
    """The final-state self-check on the engine's own head as extract's final_state_check runs it: ``first``
    captured in a batch of their own, their last id's states against the engine's top-k from the same forward pass;
    the post-norm form of those states is the control. Figures: the same states against a second run's logprobs,
    and the two runs' top-k compared (with 384 INT4 experts the engine did not repeat itself, and a check against a
    second run failed: results/2026-12-07-c92e791-h100-vllm0.26.0). Returns (check, control, head files, figures)."""
    last = spec.layer_ids[-1]
    cfg = extract.ExtractConfig(model=str(folder), out=str(out), backend="vllm", batch_size=len(first), selfcheck=0,
                                layer_ids=tuple(spec.layer_ids))  # fmt: skip
    stored, engine = extract.captured_with_engine_top(backend, spec, cfg, first, out / "again")
    right = selfcheck.last_states(stored, last)
    head_files = backend.dump_head(out)
    head = selfcheck.load_head_files(head_files, 1e-6)
    ok, bad = selfcheck.compare(head, right, engine), selfcheck.compare(head, head.normed(right).bfloat16(), engine)
    second = backend.top_logprobs(first, selfcheck.K)
    figures = {
        "selfcheck": {
            f"id {last}": ok.line(),
            "post-norm": bad.line(),
            f"id {last} against a second run's logprobs": selfcheck.compare(head, right, second).line(),
        },
        "per_prompt_shape_error": [round(p["shape_err"], 3) for p in ok.per_prompt],
        "engine_repeat": engine_repeat(engine, second),
    }
    return ok, bad, head_files, figures


def capture_and_selfcheck(prof, folder, ids, tmp_path, report, key: str, gpu_memory_utilization: float):
    """Start the engine on ``folder`` (dummy weights), capture 32 x 512 random-token samples at ``ids``, check the
    store and every state ([512, 7168] bf16, finite, layers distinct), and run the final-state self-check on the
    engine's own head (the last id's state passes, its post-norm form fails). Returns (store, head files)."""
    from eagle3.extract.vllm_backend import VLLMBackend

    spec = extract.store_spec(folder, ids, "bfloat16")
    t0 = time.perf_counter()
    backend = VLLMBackend(
        str(folder),
        spec,
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=4096,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        load_format="dummy",
        log_level="INFO",
        extra_engine_args={"enforce_eager": True},
    )  # compiled capture at this depth: test_kimi_depth;
    # eager saves the 67 s of torch.compile and 55 s of CUDA graphs this engine took (2026-12-04 run, init 145.7 s)
    report(f"{key}_engine_start_s", round(time.perf_counter() - t0, 1))
    report(f"{key}_capture", backend.strategy)
    report(f"{key}_unit_norms", backend.unit_norms())
    try:
        samples = random_samples(32, 512, prof.vocab_size, seed=81)
        store = tmp_path / "store"
        ex = extract.run(
            extract.ExtractConfig(
                model=str(folder), out=str(store), backend="vllm", batch_size=BATCH, selfcheck=0, layer_ids=ids
            ),
            samples=samples,
            backend=backend,
            progress=False,
        )
        report(f"{key}_extract", {"samples": ex.samples_written, "tokens_per_s": round(ex.tokens_per_s)})
        assert verify.verify(store).ok
        st = Store.open(store)
        assert tuple(st.spec.layer_ids) == ids
        got = {s["sample_id"]: s for s in st.iter_samples()}
        assert len(got) == 32
        for s in got.values():
            states = [s["states"][i] for i in ids]
            assert all(tuple(t.shape) == (512, 7168) and t.dtype == torch.bfloat16 for t in states)
            assert all(torch.isfinite(t).all() for t in states)
            assert all(rel_err(states[a], states[b]) > 1e-3 for a in range(4) for b in range(a + 1, 4)), s["sample_id"]
        ok, bad, head_files, figures = engine_head_check(backend, folder, spec, samples[:BATCH], tmp_path)
        for name, value in figures.items():
            report(f"{key}_{name}", value)
        assert ok.ok and not bad.ok, (ok.line(), bad.line())
    finally:
        backend.close()
    return store, head_files


def test_kimi_k25_class_at_full_expert_width_in_int4_captures_and_self_checks(tmp_path_factory, tmp_path, report):
    """Kimi-K2.5's class with its own text_config (384 routed experts of 2048, top-8) and quantization_config (INT4
    experts: vLLM's compressed-tensors WNA16 MoE kernels, as Kimi-K2.5 is served), 6 layers: ~56 GB of weights."""
    needs_gpu_memory(75, "Kimi-K2.5's class at 6 layers of 384 INT4 experts")
    prof = presets.from_name("kimi-k25-int4")
    folder = tiny.build_model(prof, tmp_path_factory.mktemp("kimi-k25-int4"), dtype="bfloat16")
    text = json.loads((folder / "config.json").read_text())["text_config"]
    assert text["n_routed_experts"] == 384 and text["quantization_config"]["format"] == "pack-quantized"
    capture_and_selfcheck(prof, folder, prof.layer_ids, tmp_path, report, "kimi_k25_int4", 0.9)


def test_kimi_k25_class_captures_self_checks_and_serves_a_draft(tmp_path_factory, tmp_path, report, gpu_out):
    needs_gpu_memory(100, "Kimi-K2.5's class at 61 layers (61 GiB of bf16 weights at 0.85 of the GPU)")
    prof = presets.from_name("kimi-k25-depth")
    folder = tiny.build_model(prof, tmp_path_factory.mktemp("kimi-k25-depth"), dtype="bfloat16")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg["text_config"]["num_hidden_layers"] == 61
    assert extract.store_spec(folder, None, "bfloat16").layer_ids == IDS
    store, head_files = capture_and_selfcheck(prof, folder, IDS, tmp_path, report, "kimi_k25", 0.85)

    write_verifier_weights(folder, head_files)
    tr = train.train(
        train.TrainConfig(
            store=str(store),
            out=str(tmp_path / "train"),
            device="cuda",
            batch_samples=4,
            max_steps=4,
            lr=1e-4,
            warmup_steps=1,
            draft_vocab_size=32000,
            ttt_steps=3,
        ),
        progress=False,
    )
    gc.collect()
    torch.cuda.empty_cache()  # the trainer's cached blocks: the serving engine wants 0.8 of the GPU
    draft = tmp_path / "train" / "draft"
    assert vllm_reads.problems(draft) == []
    assert vllm_reads.reads(draft)["aux_layer_ids"] == [2, 30, 58]
    prompts = [list(s.input_ids) for s in random_samples(16, 64, prof.vocab_size, seed=82)]
    rep = evaluate.run(
        evaluate.EvalConfig(
            target=str(folder),
            draft=str(draft),
            prompt_ids=prompts,
            out=str(tmp_path / "eval"),
            k=3,
            max_tokens=16,
            num_prompts=16,
            shifted=False,
            baseline=False,
            gpu_memory_utilization=0.8,
            load_format="dummy",
            max_model_len=4096,
        )
    )
    (gpu_out / "kimi_k25_eval.json").write_text((tmp_path / "eval" / "eval.json").read_text())
    report(
        "kimi_k25_served",
        {
            "engine_start_s": rep.engine_start_s,
            "drafts": rep.draft.drafts,
            "acceptance_length_dummy_weights": round(rep.draft.acceptance_length, 3),
            "drafter": {k: v for k, v in rep.drafter.items() if not k.startswith("rope_c")},
            "train_steps": tr.steps,
        },
    )
    assert rep.draft.drafts > 0 and len(rep.draft.per_position) == 3
