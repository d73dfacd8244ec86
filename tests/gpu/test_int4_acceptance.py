"""Does the target's numeric form matter to its draft? (pytest -m e2e on the GPU host, ~11 min on an H100.)

Kimi-K2.5 is served with its routed experts in INT4. The learnable DeepseekV3 target is trained here once; its INT4
form (make-target --quantize int4: the same weights, experts packed as Kimi's are) is served by vLLM's WNA16 MoE
kernels. Drafts are trained on the states of each form (seeds 0 and 1) and served on each form at k = 3:

    | draft trained on states of | served on the bf16 target | served on the INT4 target |

The run-to-run spread is that of the two seeds (test_draft_acceptance.seed_spread), per cell. Reported as measured,
per traffic type; asserted only what holds either way: every draft learned (>= the e2e bar), and the verdict is
stated — "matters" where the INT4-trained draft beats the bf16-trained one on the INT4 target by more than three
spreads, else "does not matter at this scale".
"""

from __future__ import annotations

import shutil

import pytest

from eagle3.data import corpus
from eagle3.data.conversations import DataConfig
from eagle3.extract import extract
from eagle3.serve import evaluate
from eagle3.targets import int4, learnable
from eagle3.train import train

from .test_draft_acceptance import E2E_TRAIN, MIN_ACCEPTANCE_LENGTH, MIN_SPREAD, SPREAD_FACTOR, VLLM_KW, seed_spread

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

N_TRAIN = 3000  # conversations of Kimi-style traffic, as test_draft_acceptance's deepseek chain
FORMS = ("bf16", "int4")
SEEDS = (0, 1)
N_PROMPTS = 512  # held-out prompts an evaluation (8 of them: each draft on each form)


def _fit(store, out, seed):
    cfg = train.TrainConfig(store=str(store), out=str(out), seed=seed, **E2E_TRAIN)
    return train.train(cfg, progress=False).draft


def _serve(target, draft, out):
    cfg = evaluate.EvalConfig(target=str(target), draft=draft, out=str(out), k=3, max_tokens=64,
                              num_prompts=N_PROMPTS, gpu_memory_utilization=0.2, shifted=False,
                              baseline=False)  # fmt: skip
    return evaluate.run(cfg)


def test_a_draft_trained_on_either_form_is_served_on_either(tmp_path, gpu_out, report):
    targets = {"bf16": tmp_path / "bf16"}
    report("int4_target_train", learnable.make_target(targets["bf16"], steps=1500, arch="deepseek"))
    targets["int4"] = tmp_path / "int4"
    report("int4_target_quantize", int4.quantize_target(targets["bf16"], targets["int4"], device="cuda"))
    data = tmp_path / "train.jsonl"
    corpus.write_jsonl(data, learnable.conversations("deepseek", N_TRAIN, seed=7))
    drafts = {}
    for form in FORMS:
        store = tmp_path / f"store-{form}"
        ex = extract.run(extract.ExtractConfig(model=str(targets[form]), out=str(store), backend="vllm",
                                               batch_size=512, shard_tokens=1 << 16,
                                               data=DataConfig([str(data)], max_len=512), vllm_kwargs=VLLM_KW),
                         progress=False)  # fmt: skip
        report(f"int4_extract[{form}]", {"tokens": ex.tokens_written, "selfcheck": ex.selfcheck})
        for seed in SEEDS:
            drafts[form, seed] = _fit(store, tmp_path / f"train-{form}-{seed}", seed)
    runs = {}
    for seed in SEEDS:  # seed 0's four cells first: a whole table at one seed if the run is cut short
        for trained in FORMS:
            for served in FORMS:
                name = f"{trained}-on-{served}-seed{seed}"
                runs[trained, served, seed] = _serve(targets[served], drafts[trained, seed], tmp_path / name)
                shutil.copy(tmp_path / name / "eval.json", gpu_out / f"int4_eval_{name}.json")
    table = {}
    for trained in FORMS:
        for served in FORMS:
            a, b = (runs[trained, served, s].draft for s in SEEDS)
            table[f"{trained} states, served {served}"] = {
                "acceptance": round((a.acceptance_length + b.acceptance_length) / 2, 3),
                "seeds": [round(a.acceptance_length, 3), round(b.acceptance_length, 3)],
                "spread": round(seed_spread(a, b), 3),
                "per_traffic": {
                    t: [round(runs[trained, served, s].per_traffic[t].acceptance_length, 3) for s in SEEDS]
                    for t in runs[trained, served, 0].per_traffic
                },  # fmt: skip
            }
    on_int4 = {t: table[f"{t} states, served int4"] for t in FORMS}
    gain = on_int4["int4"]["acceptance"] - on_int4["bf16"]["acceptance"]
    spread = max(on_int4["int4"]["spread"], on_int4["bf16"]["spread"], MIN_SPREAD)
    verdict = "matters" if gain > SPREAD_FACTOR * spread else "does not matter at this scale"
    report("int4_table", {"cells": table, "gain_on_int4": round(gain, 3), "spread": spread, "verdict": verdict})
    for cell, row in table.items():
        assert min(row["seeds"]) >= MIN_ACCEPTANCE_LENGTH, (cell, table)
