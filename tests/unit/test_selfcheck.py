"""The final-state self-check (issue 12) on the tiny targets with the hf backend: the right state passes, and a
post-norm state, the state of layer L-1 and another prompt's state fail. In production it runs on the first
prompts of `eagle3 extract` through the store and stops before anything is stored."""

import pytest
import torch

from eagle3.data.conversations import DataConfig, random_samples
from eagle3.extract import extract, selfcheck
from eagle3.extract.hf_backend import HFBackend

L = 8


@pytest.fixture(scope="module", params=["tiny_kimi", "tiny_llama"])
def case(request):
    folder = request.getfixturevalue(request.param)
    backend = HFBackend(folder, tuple(range(L + 1)), compute_dtype="float32", out_dtype="float32")
    samples = random_samples(12, [30, 7, 64, 12, 90, 41, 5, 77, 23, 50, 16, 60], 1024, seed=5)
    states = backend.capture(samples)  # per sample [L + 1, T, H]: ids 0..L, id L before the final norm
    with torch.inference_mode():
        post = [
            backend.model(input_ids=torch.tensor([s.input_ids]), output_hidden_states=True).hidden_states[L][0]
            for s in samples
        ]  # HF's index L: after the final norm
    return folder, backend, samples, states, post


def _last(states, layer):
    return torch.stack([st[layer, -1] for st in states])


def test_the_right_state_passes_and_wrong_ones_fail(case, record_property):
    folder, backend, samples, states, post = case
    head = selfcheck.load_head(folder)
    engine = backend.top_logprobs(samples, selfcheck.K)
    right = selfcheck.compare(head, _last(states, L), engine)
    wrong = {
        "post-norm": selfcheck.compare(head, torch.stack([p[-1] for p in post]), engine),
        "layer L-1": selfcheck.compare(head, _last(states, L - 1), engine),
        "other prompt": selfcheck.compare(head, _last(states, L).roll(1, 0), engine),
    }
    record_property("selfcheck", {"right": right.line(), **{k: v.line() for k, v in wrong.items()}})
    bf16 = selfcheck.compare(head, _last(states, L).bfloat16(), engine)  # as stored
    assert right.ok and bf16.ok and bf16.shape_err < 0.02 and right.top1 == 1.0, (right.line(), bf16.line())
    for name, r in wrong.items():
        assert not r.ok, (name, r.line())
        assert r.shape_err > 10 * bf16.shape_err + 0.25, (name, r.line())  # a margin, not a coin toss


def test_head_files_dumped_by_ranks_are_put_back_together(case, tmp_path):
    from safetensors.torch import save_file

    folder, *_ = case
    head = selfcheck.load_head(folder)
    v = head.lm_head.shape[0]
    for r, (a, b) in enumerate([(0, v // 3), (v // 3, v // 2), (v // 2, v)]):  # as TP ranks of a vocab split
        save_file(
            {"norm": head.norm, "lm_head": head.lm_head[a:b].contiguous()},
            str(tmp_path / f"head-tp{r}.safetensors"),
            metadata={"vocab_start": str(a), "vocab_end": str(b)},
        )
    again = selfcheck.load_head_files(sorted(tmp_path.glob("head-tp*.safetensors"), reverse=True), head.eps)
    assert torch.equal(again.lm_head, head.lm_head) and torch.equal(again.norm, head.norm)


def test_extract_runs_the_check_first_and_stops_before_storing_wrong_states(
    tiny_kimi, small_data, tmp_path, monkeypatch
):
    cfg = extract.ExtractConfig(
        model=str(tiny_kimi),
        out=str(tmp_path / "ok"),
        batch_size=8,
        shard_samples=8,
        data=DataConfig([str(small_data)], max_len=96, max_samples=12),
    )
    summary = extract.run(cfg, progress=False)
    assert summary.selfcheck.startswith("final-state self-check PASS: 4 prompts")
    assert not (tmp_path / "ok" / ".selfcheck").exists()

    from eagle3.extract import hf_backend

    real = hf_backend.HFBackend.forward_states

    def post_norm(self, input_ids, attention_mask=None):  # the classic bug: HF's hidden_states[L] is post-norm
        st = real(self, input_ids, attention_mask)
        return torch.cat([st[:, :-1], self.stack.norm(st[:, -1:])], dim=1)

    monkeypatch.setattr(hf_backend.HFBackend, "forward_states", post_norm)
    bad = tmp_path / "bad"
    with pytest.raises(selfcheck.SelfCheckFailed, match="FAIL.*not the last layer's output before the norm"):
        extract.run(
            extract.ExtractConfig(
                model=str(tiny_kimi),
                out=str(bad),
                batch_size=8,
                shard_samples=8,
                data=DataConfig([str(small_data)], max_len=96, max_samples=12),
            ),
            progress=False,
        )
    assert not list((bad / "shards").glob("*")) and not (bad / ".selfcheck").exists()


def test_verify_semantic_passes_a_good_store_and_fails_a_post_norm_one(small_store, tiny_kimi, tmp_path, capsys):
    import shutil

    from eagle3 import cli

    from .conftest import rewrite_shards

    assert cli.main(["verify", str(small_store), "--semantic", "--semantic-samples", "6"]) == 0
    assert "final-state self-check PASS: 6 prompts" in capsys.readouterr().out
    bad = tmp_path / "s"
    shutil.copytree(small_store, bad)  # rewrite every stored last layer as post-norm (sha re-hashed: verify is OK)
    head = selfcheck.load_head(tiny_kimi)

    def post_norm(n, t, meta):
        t["hidden_states"][:, -1] = head.normed(t["hidden_states"][:, -1]).bfloat16()

    rewrite_shards(bad, post_norm)
    assert cli.main(["verify", str(bad)]) == 0
    capsys.readouterr()
    assert cli.main(["verify", str(bad), "--semantic", "--model", str(tiny_kimi)]) == 1
    assert "final-state self-check FAIL" in capsys.readouterr().out


def test_recall_counts_the_engine_s_top_k_among_our_top_2k():
    """Recall is the share of the engine's top-k tokens found among our top 2k (bf16 ties may reorder a flat top):
    the engine's top 2 at our ranks 3 and 4 count, at rank 5 they do not."""
    head = selfcheck.FinalHead(torch.ones(8), 1e-6, torch.eye(8), "identity")
    state = torch.tensor([[8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0]])  # our order: 0, 1, 2, ...
    inside = selfcheck.compare(head, state, [selfcheck.EngineTop(2, {2: -1.0, 3: -1.5})], k=2)
    outside = selfcheck.compare(head, state, [selfcheck.EngineTop(3, {3: -1.0, 4: -1.5})], k=2)
    assert (inside.recall, outside.recall) == (1.0, 0.5)
    assert inside.top1 == 0.0 and inside.rank == pytest.approx(1 - 2.5 / 7)


def test_the_gpu_suite_s_engine_head_check_runs_whole_on_the_hf_backend(tiny_kimi, tmp_path):
    """test_kimi_k25_wrapper's check and its figures (the states against the capture's own logprobs and a second
    run's, the two runs compared, each prompt's shape error), here on a deterministic engine: the hf backend with its
    head dumped as a rank's file."""
    from safetensors.torch import save_file

    from tests.gpu.test_kimi_k25_wrapper import engine_head_check

    class DumpingBackend(HFBackend):
        def dump_head(self, folder):
            head = selfcheck.load_head(tiny_kimi)
            path = str(folder / "head-tp0.safetensors")
            save_file({"norm": head.norm, "lm_head": head.lm_head.contiguous()}, path, metadata={"vocab_start": "0"})
            return [path]

    ids = (2, 4, 5, L)
    backend = DumpingBackend(tiny_kimi, ids, compute_dtype="float32", out_dtype="bfloat16")
    spec = extract.store_spec(tiny_kimi, ids, "bfloat16")
    ok, bad, files, figures = engine_head_check(backend, tiny_kimi, spec, random_samples(4, 24, 1024, seed=6), tmp_path)
    lines = figures["selfcheck"]
    assert set(lines) == {f"id {L}", "post-norm", f"id {L} against a second run's logprobs"}
    assert ok.ok and not bad.ok, (ok.line(), bad.line())
    assert "PASS" in lines[f"id {L} against a second run's logprobs"] and len(files) == 1
    assert len(figures["per_prompt_shape_error"]) == 4 and max(figures["per_prompt_shape_error"]) <= 0.25
    assert figures["engine_repeat"] == {"prompts": 4, "same_top1": 4, "same_topk": 4, "max_logprob_diff": 0.0}
