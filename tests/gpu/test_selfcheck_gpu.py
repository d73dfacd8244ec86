"""The final-state self-check against vLLM's own logprobs on mini-Kimi's real random weights (issue 12): the
captured id-L state passes; a post-norm state, the state of layer L-1 and another prompt's state fail."""

from __future__ import annotations

import pytest
import torch

from eagle3.data.conversations import random_samples
from eagle3.extract import extract, selfcheck

pytestmark = pytest.mark.gpu


def test_selfcheck_passes_the_captured_state_and_fails_wrong_ones(target, engines, tmp_path, report):
    if not target.local:
        pytest.skip("the L-1 control uses the hf reference on the same weights")
    from eagle3.extract.hf_backend import HFBackend

    L = target.profile.num_hidden_layers
    samples = random_samples(16, [512, 37, 200, 129, 64, 300, 90, 411] * 2, target.profile.vocab_size, seed=81)
    backend = engines.get("hooks")
    cfg = extract.ExtractConfig(
        model=str(target.path), out=str(tmp_path / "s"), backend="vllm", batch_size=16, selfcheck=0
    )
    got, engine = extract.captured_with_engine_top(backend, backend.spec, cfg, samples, tmp_path / "s")  # as extract
    right = selfcheck.last_states(got, L)
    head = selfcheck.load_head(target.path)
    ref = HFBackend(target.path, (L - 1, L), device="cuda", compute_dtype="float32", out_dtype="float32")
    prev = torch.stack([st[0, -1] for st in ref.capture(samples)])
    ref.close()
    post = head.normed(right).bfloat16()
    results = {
        "right": selfcheck.compare(head, right, engine),
        "post-norm": selfcheck.compare(head, post, engine),
        "layer L-1 (hf)": selfcheck.compare(head, prev, engine),
        "other prompt": selfcheck.compare(head, right.roll(1, 0), engine),
    }
    report("selfcheck_mini_kimi", {k: v.line() for k, v in results.items()})
    assert results["right"].ok, results["right"].line()
    for name in ("post-norm", "layer L-1 (hf)", "other prompt"):
        assert not results[name].ok, (name, results[name].line())
