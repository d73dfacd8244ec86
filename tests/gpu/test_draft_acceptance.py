"""The whole chain on a target with something to learn, served by vLLM (pytest -m e2e on the GPU host).

Target: learnable-llama (8 layers, hidden 256) trained here on the project's templated dialogues, whose
assistant turns follow from the user turns by fixed rules. Extract with vLLM, train EAGLE-3 drafts, serve each
with speculative_config method eagle3 and k = 3 on held-out prompts.

- Threshold: a draft that learned nothing is accepted ~never (acceptance length ~1.0); the answers are mostly
  copies, counts and sums of prompt tokens, so a draft that follows the target gets well over one of its three
  tokens accepted per step. We require 1.8.
- Run-to-run spread: the same draft trained with two seeds, in the same run.
- Control (training misalignment): a draft trained on states shifted by one position (each position sees the
  next token's aux states, a leak the served draft never gets). Its drop must be >= 3x the spread.
- The layer-id convention control (the same draft fed the layers one above its training ids) is reported but
  not asserted: on this small target adjacent layers differ too little (3.74 vs 3.79 in the first campaign).
- Speedup is reported with both engines eager; on a 8-layer, hidden-256 target the draft costs about as much as
  the target, so the figure says nothing about a large target.
"""

from __future__ import annotations

import shutil
import time

import pytest

from eagle3.data import corpus
from eagle3.data.conversations import DataConfig
from eagle3.extract import extract
from eagle3.serve import evaluate
from eagle3.targets import learnable
from eagle3.train import train

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

MIN_ACCEPTANCE_LENGTH = 1.8
SPREAD_FACTOR = 3.0
MIN_SPREAD = 0.02  # a floor, so two seeds that happen to agree closely do not make the control trivial


def misaligned_copy(store, out):
    """The store with every sample's aux states moved one position earlier: row t holds token t+1's aux states."""
    from tests.unit.conftest import rewrite_shards

    def shift(n, t, meta):
        hs, off = t["hidden_states"], t["offsets"].tolist()
        for a, b in zip(off, off[1:]):
            hs[a : b - 1, :-1] = hs[a + 1 : b, :-1].clone()

    shutil.copytree(store, out)
    rewrite_shards(out, shift)
    return out


def test_trained_draft_is_served_by_vllm_and_predicts_the_target(tmp_path, gpu_out, report):
    t0 = time.perf_counter()
    target = tmp_path / "target"
    info = learnable.make_target(target, steps=1500)
    report("e2e_target", info)
    assert info["final_loss"] < 0.6 * info["first_loss"]

    data = corpus.write_jsonl(tmp_path / "train.jsonl", corpus.generate(6000, seed=7))
    store = tmp_path / "store"
    ex = extract.run(extract.ExtractConfig(
        model=str(target), out=str(store), backend="vllm", batch_size=512, shard_tokens=1 << 16,
        data=DataConfig([str(data)], max_len=512),
        vllm_kwargs={"gpu_memory_utilization": 0.12, "max_model_len": 2048}), progress=False)
    report("e2e_extract", {"samples": ex.samples_written, "tokens": ex.tokens_written,
                           "tokens_per_s": round(ex.tokens_per_s), "selfcheck": ex.selfcheck})

    def fit(name, store_path, seed):
        tr = train.train(train.TrainConfig(store=str(store_path), out=str(tmp_path / name), device="cuda",
                                           batch_samples=32, pack_tokens=4096, epochs=3, lr=3e-3, warmup_steps=20,
                                           draft_vocab_size=512, ttt_steps=3, seed=seed), progress=False)
        report(f"e2e_train[{name}]", {"steps": tr.steps, "loss_first": tr.losses[0], "loss_last": tr.losses[-1],
                                      "tokens_per_s": round(tr.tokens_per_s), "accuracy": tr.accept})
        return tr.draft

    drafts = {"seed0": fit("seed0", store, 0), "seed1": fit("seed1", store, 1),
              "misaligned": fit("misaligned", misaligned_copy(store, tmp_path / "store-misaligned"), 0)}
    runs = {}
    for name, draft in drafts.items():
        first = name == "seed0"
        runs[name] = evaluate.run(evaluate.EvalConfig(
            target=str(target), draft=draft, out=str(tmp_path / f"eval-{name}"), k=3, max_tokens=64, num_prompts=64,
            gpu_memory_utilization=0.2, shifted=first, baseline=first))
        shutil.copy(tmp_path / f"eval-{name}" / "eval.json", gpu_out / f"e2e_eval_{name}.json")
    acc = {k: r.draft.acceptance_length for k, r in runs.items()}
    spread = abs(acc["seed0"] - acc["seed1"])
    base = (acc["seed0"] + acc["seed1"]) / 2
    s0 = runs["seed0"]
    summary = {"acceptance": {k: round(v, 3) for k, v in acc.items()},
               "per_position_seed0": [round(p, 3) for p in s0.draft.per_position],
               "spread_two_seeds": round(spread, 3), "misaligned_drop": round(base - acc["misaligned"], 3),
               "layer_ids_plus_one": round(s0.shifted.acceptance_length, 3),
               "outputs_identical": s0.outputs_identical,
               "speedup_eager_both": round(s0.draft.tokens_per_s / s0.baseline_tokens_per_s, 2),
               "seconds": round(time.perf_counter() - t0, 1)}
    report("e2e_summary", summary)
    assert s0.draft.drafts > 0 and s0.outputs_identical == 1.0, summary
    assert min(acc["seed0"], acc["seed1"]) >= MIN_ACCEPTANCE_LENGTH, summary
    assert base - acc["misaligned"] >= SPREAD_FACTOR * max(spread, MIN_SPREAD), summary
