"""The whole chain on a target with something to learn, served by vLLM (pytest -m e2e on the GPU host).

Target: learnable-llama (8 layers, hidden 256) trained here on the project's templated dialogues, whose
assistant turns follow from the user turns by fixed rules. Extract with vLLM, train the EAGLE-3 draft,
serve it with speculative_config method eagle3 and k = 3 on held-out prompts.

Threshold: a draft that learned nothing is accepted ~never (acceptance length ~1.0); the answers are
mostly copies, counts and sums of tokens in the prompt, so a draft that follows the target should get
well over one of its three tokens accepted per step. We require 1.8, and the same draft fed the layers
one above its training ids (the classic convention bug) must lose at least 0.2 of that.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest

from eagle3 import corpus, extract, learnable, train
from eagle3.data import DataConfig

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

MIN_ACCEPTANCE_LENGTH = 1.8
MIN_SHIFT_LOSS = 0.2


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
                           "tokens_per_s": round(ex.tokens_per_s)})

    tr = train.train(train.TrainConfig(store=str(store), out=str(tmp_path / "draft"), device="cuda",
                                       batch_samples=32, pack_tokens=4096, epochs=4, lr=3e-3, warmup_steps=20,
                                       draft_vocab_size=512, ttt_steps=3), progress=False)
    report("e2e_train", {"steps": tr.steps, "loss_first": tr.losses[0], "loss_last": tr.losses[-1],
                         "tokens_per_s": round(tr.tokens_per_s), "accuracy": tr.accept})

    out = tmp_path / "eval"
    cmd = [sys.executable, "-m", "eagle3.cli", "eval", "--target", str(target), "--draft", tr.draft,
           "--out", str(out), "--k", "3", "--max-tokens", "64", "--num-prompts", "64", "--gpu-mem", "0.2"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    (gpu_out / "e2e_eval.log").write_text(run.stdout + run.stderr[-20000:])
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((out / "eval.json").read_text())
    shutil.copy(out / "eval.json", gpu_out / "e2e_eval.json")
    shutil.copy(out / "eval.md", gpu_out / "e2e_eval.md")
    report("e2e_seconds", round(time.perf_counter() - t0, 1))
    draft, shifted = result["draft"], result["shifted"]
    assert draft["drafts"] > 0
    assert draft["acceptance_length"] >= MIN_ACCEPTANCE_LENGTH, draft
    assert shifted["acceptance_length"] <= draft["acceptance_length"] - MIN_SHIFT_LOSS, (draft, shifted)
