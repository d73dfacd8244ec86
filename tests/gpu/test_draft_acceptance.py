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
- fp8 states (issue 14): the same samples stored as e4m3 + scales, a draft trained on them with seed 0: its
  acceptance within 0.05 of the bf16 seed-0 draft; bytes and the states' error against bf16 reported. The gap is
  judged only where the measurement decides it (evaluate.gap_verdict: an error of at most 0.025, or a gap past
  the bar by more than 2 errors). In the 8ec8ff9 run, on 64 prompts, 3.764 fp8 vs 3.821 bf16 missed the bar by 0.007
  with a
  standard error of 0.08 on the gap: undecided.
  Its own test since the 3cf512b run (`-k fp8` runs the shared chain + it); PASSED on the H200 in the e41ccad run:
  3.846 fp8
  vs 3.810 bf16, 0.509 of the bytes (results/2026-12-03-e41ccad-h200-vllm0.26.0/).
- EAGLE3_E2E_ARCH=deepseek runs the same chain on the learnable DeepseekV3 target (`make-target --arch deepseek`:
  Kimi's MLA latent sizes, MoE top-2 of 8 + shared) trained on Kimi-style traffic in Kimi-K2's chat format
  (data/kimi_traffic.py: chat, thinking, tool use); acceptance is reported per traffic type, and the goal of 2.5 on
  the chat prompts (issue 39) is reported beside the asserted bar.
- Greedy outputs with the draft equal the target's alone, except where the target's own top-1 margin is a near-tie
  (<= evaluate.NEAR_TIE nats) or where the target itself, in the verification forward, chose the speculative token
  (evaluate.unexplained, as in test_deepseek_draft): on the DeepseekV3 target (2026-12-04 run, H200, vLLM 0.26.0)
  13 of 1024 outputs diverged, 7 at plain-run margins of 0.19-1.75 nats, which bf16 logit noise cannot flip but a
  top-2-of-8 expert-routing near-tie at another batch shape can. A token the target did not choose there fails.
- Speedup is reported with both engines eager; on a 8-layer, hidden-256 target the draft costs about as much as
  the target, so the figure says nothing about a large target.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time

import pytest

from eagle3.data import corpus
from eagle3.data.conversations import DataConfig
from eagle3.extract import extract
from eagle3.serve import evaluate
from eagle3.store.format import FP8
from eagle3.targets import learnable
from eagle3.train import train

from .conftest import failure

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

MIN_ACCEPTANCE_LENGTH = 1.8
SPREAD_FACTOR = 3.0
MIN_SPREAD = 0.02  # a floor, so two seeds that happen to agree closely do not make the control trivial
FP8_MAX_GAP = 0.05  # issue 14: a draft trained on fp8 states within 0.05 acceptance of the bf16 one (same seed)
ARCH = os.environ.get("EAGLE3_E2E_ARCH", "llama")  # the learnable target's architecture: llama or deepseek
N_TRAIN = {"llama": 6000, "deepseek": 3000}[ARCH]  # conversations extracted: ~520k tokens (llama), ~680k (deepseek:
# a tool conversation's tools declaration alone is ~380 tokens)
# the e2e drafts' trainer options (this file's chain, test_int4_acceptance, test_long_acceptance)
E2E_TRAIN = dict(device="cuda", batch_samples=32, pack_tokens=4096, epochs=3, lr=3e-3, warmup_steps=20,
                 draft_vocab_size=512, ttt_steps=3)  # fmt: skip
CHAT_GOAL = 2.5  # issue 39's goal for the deepseek target's chat prompts (reported, not asserted)


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


VLLM_KW = {"gpu_memory_utilization": 0.12, "max_model_len": 2048}


@pytest.fixture(scope="module")
def learnable_target(tmp_path_factory, report):
    """The learnable target, trained here: (its folder's parent for the tests' files, the target folder). What the
    regenerate tests need, before (and without) the drafts' chain."""
    tmp = tmp_path_factory.mktemp("e2e")
    target = tmp / "target"
    info = learnable.make_target(target, steps=1500, arch=ARCH)
    report("e2e_target", info)
    assert info["final_loss"] < 0.6 * info["first_loss"]
    return tmp, target


@pytest.fixture(scope="module")
def chain(request, learnable_target, gpu_out, report):
    """What both tests share: the learnable target, its dialogues extracted with vLLM into a bf16 store, the seed-0
    draft trained on it and served. The layer-ids + 1 control and the no-draft baseline (one more engine, ~40 s on
    the H200) only where the test that reads them runs: `-k fp8` runs this and the fp8 test; the long-context prompts
    only where the variants' test runs."""
    selected = {item.originalname for item in request.session.items}
    controls = test_trained_draft_is_served_by_vllm_and_predicts_the_target.__name__ in selected
    # the variants' table has the seed-0 draft's long-context figure too: its engine serves those prompts as well
    long = (
        {"long_prompts": LONG_PROMPTS}
        if test_draft_variants_are_served_on_the_deepseek_target.__name__ in selected
        else {}
    )
    t0 = time.perf_counter()
    tmp, target = learnable_target
    data = tmp / "train.jsonl"
    corpus.write_jsonl(data, learnable.conversations(ARCH, N_TRAIN, seed=7))
    store = tmp / "store"
    ex = extract.run(
        extract.ExtractConfig(
            model=str(target),
            out=str(store),
            backend="vllm",
            batch_size=512,
            shard_tokens=1 << 16,
            data=DataConfig([str(data)], max_len=512),
            vllm_kwargs=VLLM_KW,
        ),
        progress=False,
    )
    report(
        "e2e_extract",
        {
            "samples": ex.samples_written,
            "tokens": ex.tokens_written,
            "tokens_per_s": round(ex.tokens_per_s),
            "selfcheck": ex.selfcheck,
        },
    )

    def fit(name, store_path, seed, **variant):
        tr = train.train(
            train.TrainConfig(store=str(store_path), out=str(tmp / name), seed=seed, **{**E2E_TRAIN, **variant}),
            progress=False,
        )
        report(
            f"e2e_train[{name}]",
            {
                "steps": tr.steps,
                "loss_first": tr.losses[0],
                "loss_last": tr.losses[-1],
                "tokens_per_s": round(tr.tokens_per_s),
                "accuracy": tr.accept,
            },
        )
        return tr.draft

    def serve(name, draft, first=False, **eval_kw):
        r = evaluate.run(
            evaluate.EvalConfig(
                **{
                    **dict(
                        target=str(target),
                        draft=draft,
                        out=str(tmp / f"eval-{name}"),
                        k=3,
                        max_tokens=64,
                        num_prompts=learnable.EVAL_PROMPTS,
                        gpu_memory_utilization=0.2,
                        shifted=first,
                        baseline=first,
                    ),
                    **eval_kw,
                }
            )
        )
        shutil.copy(tmp / f"eval-{name}" / "eval.json", gpu_out / f"e2e_eval_{name}.json")
        return r

    seed0_draft = fit("seed0", store, 0)
    seed0 = serve("seed0", seed0_draft, first=controls, **long)
    seed1: list = []

    def seed1_run():
        """The seed-1 draft, served (once, whichever test asks first): the run-to-run spread the draft test's
        control and the variants' table are read against."""
        if not seed1:
            seed1.append(serve("seed1", fit("seed1", store, 1)))
        return seed1[0]

    return {
        "tmp": tmp,
        "target": target,
        "data": data,
        "store": store,
        "fit": fit,
        "serve": serve,
        "seed0": seed0,
        "seed0_draft": seed0_draft,
        "seed1": seed1_run,
        "t0": t0,
    }


def seed_spread(a, b) -> float:
    """Two seeds' run-to-run spread (SpecRuns): their difference in acceptance length, or the measurement's own
    error on a difference of two, whichever is larger."""
    return max(abs(a.acceptance_length - b.acceptance_length), math.hypot(a.acceptance_se, b.acceptance_se))


def test_trained_draft_is_served_by_vllm_and_predicts_the_target(chain, report):
    fit, serve, store, tmp = chain["fit"], chain["serve"], chain["store"], chain["tmp"]
    runs = {
        "seed0": chain["seed0"],
        "seed1": chain["seed1"](),
        "misaligned": serve("misaligned", fit("misaligned", misaligned_copy(store, tmp / "store-misaligned"), 0)),
    }
    acc = {k: r.draft.acceptance_length for k, r in runs.items()}
    se = {k: r.draft.acceptance_se for k, r in runs.items()}
    spread = seed_spread(runs["seed0"].draft, runs["seed1"].draft)
    base = (acc["seed0"] + acc["seed1"]) / 2
    s0 = runs["seed0"]
    summary = {
        "acceptance": {k: round(v, 3) for k, v in acc.items()},
        "acceptance_se": {k: round(v, 4) for k, v in se.items()},
        "per_position_seed0": [round(p, 3) for p in s0.draft.per_position],
        "spread_two_seeds": round(spread, 3),
        "misaligned_drop": round(base - acc["misaligned"], 3),
        "layer_ids_plus_one": round(s0.shifted.acceptance_length, 3),
        "outputs_identical": s0.outputs_identical,
        "divergence_margins": sorted(round(x["margin"], 4) for x in s0.divergences),
        "divergences_target_chose_spec_token": sum(bool(x.get("spec_top1")) for x in s0.divergences),
        "eval_notes": s0.notes,
        "per_traffic": {
            k: {name: round(r.acceptance_length, 3) for name, r in runs[k].per_traffic.items()} for k in runs
        },
        "arch": ARCH,
        "speedup_eager_both": round(s0.draft.tokens_per_s / s0.baseline_tokens_per_s, 2),
        "seconds": round(time.perf_counter() - chain["t0"], 1),
    }
    if s0.per_traffic:
        summary["chat_goal_2.5_met"] = (
            min(runs[k].per_traffic["chat"].acceptance_length for k in ("seed0", "seed1")) >= CHAT_GOAL
        )
    report("e2e_summary", summary)
    assert s0.draft.drafts > 0 and s0.outputs_identical is not None, summary
    # a divergence is a near-tie of the plain run, or the target's own choice in the verification forward (bf16 MoE
    # routing / MLA at another batch shape); a token the target did not choose there is an acceptance error
    unexplained = evaluate.unexplained(s0.divergences)
    assert not unexplained, (summary, unexplained)
    assert min(acc["seed0"], acc["seed1"]) >= MIN_ACCEPTANCE_LENGTH, summary
    assert base - acc["misaligned"] >= SPREAD_FACTOR * max(spread, MIN_SPREAD), summary


REGEN_CONVERSATIONS = 96
REGEN_MIN_SAME = 0.5  # the learnable target's answers follow from the prompt by rules; greedy, it should give most


def _turn_key(m: dict) -> tuple:
    """An assistant turn as what it says: text, thinking, calls (name and parsed arguments; not the call ids)."""

    def args(text):
        try:
            return json.dumps(json.loads(text or "null"), sort_keys=True)
        except ValueError:
            return text  # the target's own malformed arguments: compared as written

    calls = [(c["function"]["name"], args(c["function"]["arguments"])) for c in m.get("tool_calls") or []]
    return (m.get("content") or "").strip(), (m.get("reasoning_content") or "").strip(), calls


def test_the_target_regenerates_held_out_conversations_with_vllm(learnable_target, report):
    """Issue 40 on the GPU: `regenerate --backend vllm`, mode last, greedy, on held-out conversations of the learnable
    target: every line written, in order; its last turns come back as the data's structured fields (deepseek: Kimi's
    <think> and tool-call section parsed into reasoning_content and tool_calls); and, since its answers follow from
    the prompt by rules, most regenerated turns say what the data's say (reported per traffic type)."""
    summary = regenerate_held_out(*learnable_target, REGEN_CONVERSATIONS)
    report("e2e_regenerate_vllm", summary)
    if ARCH == "deepseek":
        assert summary["turns_with_reasoning"] > 0, summary
    assert summary["same_as_data"] >= REGEN_MIN_SAME, summary


def regenerate_held_out(tmp, target, n: int, max_tokens: int = 384) -> dict:
    """`regenerate --backend vllm --mode last` (greedy) over n held-out conversations; every line back in order
    (asserted), and how many turns say what the data's say. On CPU with the fake vLLM in
    tests/unit/test_e2e_rehearsal.py."""
    from eagle3.extract import regenerate

    convs = learnable.conversations(ARCH, n, seed=learnable.HELD_OUT_SEED + 2)
    data = tmp / "regen-in.jsonl"
    corpus.write_jsonl(data, convs)
    out = tmp / "regen-out.jsonl"
    s = regenerate.run(
        regenerate.RegenConfig(
            target=str(target),
            data=str(data),
            out=str(out),
            backend="vllm",
            mode="last",
            temperature=0.0,
            max_tokens=max_tokens,
            gpu_memory_utilization=0.2,
            max_model_len=2048,
        )
    )
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert s.written == len(rows) == n and [r["regenerated"]["line"] for r in rows] == list(range(1, n + 1))
    same: dict[str, list[bool]] = {}
    for c, r in zip(convs, rows):
        (i,) = r["regenerated"]["turns"]
        same.setdefault(c.get("traffic", "chat"), []).append(_turn_key(r["messages"][i]) == _turn_key(c["messages"][i]))
    return {
        "line": s.line(),
        "tokens_per_s": round(s.tokens / s.seconds) if s.seconds else None,
        "same_as_data": round(sum(map(sum, same.values())) / n, 3),
        "same_per_traffic": {t: round(sum(v) / len(v), 3) for t, v in same.items()},
        "cut": s.cut,
        "finish": sorted({f for r in rows for f in r["regenerated"]["finish"]}),
        "turns_with_reasoning": sum(
            bool(r["messages"][r["regenerated"]["turns"][0]].get("reasoning_content")) for r in rows
        ),
    }


ONE_PASS_CONVERSATIONS = 256
ONE_PASS_REL_TOL = 0.04  # tests/gpu/test_extract_vllm.py's REL_TOL: per sample and layer, the suite's bf16 tolerance
ONE_PASS_ROW_FACTOR = 2.0  # a row of one pass within 0.04 of the fp32 truth, or no further than 2x a prefill's


def test_extract_regenerate_stores_in_one_pass_what_a_prefill_of_its_final_tokens_stores(learnable_target, report):
    """Issue 40 on the GPU: `extract --regenerate` (greedy, the last turn) generates and captures in one engine pass.
    Against a separate prefill extraction of the same final tokens, every sample's every layer id within the suite's
    bf16 tolerance (its metric: the relative L2 error of the sample's [T, H] states); and row by row, the last row
    included, one pass is as close to the fp32 truth (transformers in float32 on the same weights) as the prefill is,
    by kind of row: the prompt's (prefill), the generated ones (decode steps) and the last (the second request's tail).
    A row's neighbour is far (the control: a misaligned row is ~1). Per row against the prefill alone is no bar: in
    the first run (2026-12-05, H200, vLLM 0.26.0) the worst of ~59k rows was 0.095 while samples were within 0.04;
    decode steps run MLA's absorbed (latent) attention where prefill decompresses K and V, and an expert-routing
    near-tie of the MoE turns a small difference into a large one for a row; the fp32 reference measures how far each
    bf16 path is from the truth, in the same run. Beside it, the same conversations through `regenerate --mode last`
    then `extract`: stored tokens a second of generation + capture (engine starts apart), both measured here."""
    summary = one_pass_against_prefill(learnable_target[0], str(learnable_target[1]), ONE_PASS_CONVERSATIONS)
    report("e2e_extract_regenerate_one_pass", summary)
    assert summary["samples"] == summary["prefill_samples"] == ONE_PASS_CONVERSATIONS, summary
    assert summary["per_sample_rel_err_worst"] <= ONE_PASS_REL_TOL, summary
    assert summary["neighbour_row_rel_err_median_min"] > 3 * ONE_PASS_REL_TOL, summary
    for kind, r in summary["rows_vs_fp32"].items():
        assert r["one_pass"]["rows"] > 0, (kind, summary)  # 256 turns: every kind of row is there
        for stat in ("worst", "p99"):
            # a row within the suite's tolerance of the truth passes; past it, only as far as 2x the prefill's
            bar = ONE_PASS_ROW_FACTOR * max(r["prefill"][stat], ONE_PASS_REL_TOL / ONE_PASS_ROW_FACTOR)
            assert r["one_pass"][stat] <= bar, (kind, stat, r)


def _quantiles(errs) -> dict:
    """Per-row relative errors [n] -> median, p99, worst and how many rows (and how many past ONE_PASS_REL_TOL)."""
    import torch

    e = torch.as_tensor(errs, dtype=torch.float64)
    if not len(e):
        return {"rows": 0}
    return {
        "rows": len(e),
        "median": round(float(e.median()), 5),
        "p99": round(float(e.quantile(0.99)), 5),
        "worst": round(float(e.max()), 5),
        "past_tol": int((e > ONE_PASS_REL_TOL).sum()),
    }


def row_errors(stored: dict, prefill: dict, reference: dict, ids) -> dict:
    """Per sample id: stored/prefill {sample_id: Store sample}, reference {sample_id: [n_layers, T, H] float32}. The
    per-sample errors (the suite's metric), the per-row errors by kind of row (prompt, generated, last), each
    against the prefill and against the fp32 reference for both, and the neighbour control."""
    import torch

    def rel(a, b):  # rows [T, H] -> [T]
        return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)

    kinds = ("prompt", "generated", "last")
    vs_prefill = {k: [] for k in kinds}
    vs_ref = {k: {"one_pass": [], "prefill": []} for k in kinds}
    per_sample, closest_wrong = 0.0, float("inf")
    for sid, s in stored.items():
        mask = s["loss_mask"].bool()
        last = torch.zeros_like(mask)
        last[-1] = True
        which = {"prompt": ~mask, "generated": mask & ~last, "last": last}
        for j, i in enumerate(ids):
            a, b, r = s["states"][i].float(), prefill[sid]["states"][i].float(), reference[sid][j].float()
            per_sample = max(per_sample, float((a - b).norm() / b.norm().clamp_min(1e-12)))
            e_ab, e_ar, e_br = rel(a, b), rel(a, r), rel(b, r)
            for k in kinds:
                vs_prefill[k] += e_ab[which[k]].tolist()
                vs_ref[k]["one_pass"] += e_ar[which[k]].tolist()
                vs_ref[k]["prefill"] += e_br[which[k]].tolist()
            closest_wrong = min(closest_wrong, float(rel(a[1:], b[:-1]).median()))
    return {
        "per_sample_rel_err_worst": round(per_sample, 5),
        "rows_vs_prefill": {k: _quantiles(v) for k, v in vs_prefill.items()},
        "rows_vs_fp32": {k: {w: _quantiles(v) for w, v in d.items()} for k, d in vs_ref.items()},
        "neighbour_row_rel_err_median_min": round(closest_wrong, 4),
    }


def one_pass_against_prefill(
    tmp, target: str, n: int, max_tokens: int = 384, batch_size: int = 256, device: str = "cuda"
) -> dict:
    """extract --regenerate over n held-out conversations; a prefill extraction of its stored tokens; the fp32
    reference of them (transformers on ``device``); regenerate then extract of the same conversations: the errors
    (row_errors) and the rates. On CPU with the fake vLLM in tests/unit/test_e2e_rehearsal.py."""
    from eagle3.data.conversations import Sample
    from eagle3.extract import one_pass, regenerate
    from eagle3.extract.hf_backend import HFBackend
    from eagle3.store.folder import Store

    convs = learnable.conversations(ARCH, n, seed=learnable.HELD_OUT_SEED + 3)
    data = tmp / "onepass-in.jsonl"
    corpus.write_jsonl(data, convs)
    kw = {"gpu_memory_utilization": 0.2}
    gen = one_pass.Generation(max_tokens=max_tokens)
    one = extract.run(
        extract.ExtractConfig(
            model=target,
            out=str(tmp / "onepass"),
            backend="vllm",
            batch_size=batch_size,
            data=DataConfig([str(data)], max_len=2048),
            regenerate=gen,
            vllm_kwargs=kw,
        ),
        progress=False,
    )
    stored = {s["sample_id"]: s for s in Store.open(tmp / "onepass").iter_samples()}
    samples = [Sample(sid, tuple(s["input_ids"].tolist()), tuple(s["loss_mask"].tolist())) for sid, s in stored.items()]
    extract.run(
        extract.ExtractConfig(
            model=target,
            out=str(tmp / "onepass-prefill"),
            backend="vllm",
            batch_size=batch_size,
            vllm_kwargs=dict(kw, max_model_len=2049),
        ),
        samples=samples,
        progress=False,
    )
    prefill = {s["sample_id"]: s for s in Store.open(tmp / "onepass-prefill").iter_samples()}
    ids = Store.open(tmp / "onepass").spec.layer_ids
    hf = HFBackend(target, ids, device=device, compute_dtype="float32", out_dtype="float32")
    reference = {s.sample_id: r for s, r in zip(samples, hf.capture(samples))}
    hf.close()
    errors = row_errors(stored, prefill, reference, ids)
    # the two-step way, timed the same way: generation and capture, not the engines' starts
    regen = regenerate.run(
        regenerate.RegenConfig(
            target=target,
            data=str(data),
            out=str(tmp / "onepass-regen.jsonl"),
            backend="vllm",
            mode="last",
            max_tokens=gen.max_tokens,
            batch_size=batch_size,
            gpu_memory_utilization=0.2,
            max_model_len=2048,
        )
    )
    two = extract.run(
        extract.ExtractConfig(
            model=target,
            out=str(tmp / "onepass-two"),
            backend="vllm",
            batch_size=batch_size,
            data=DataConfig([str(tmp / "onepass-regen.jsonl")], max_len=2048),
            vllm_kwargs=dict(kw, max_model_len=2048),
        ),
        progress=False,
    )
    return {
        "samples": len(stored),
        "prefill_samples": len(prefill),
        "generation": one.generation,
        **errors,
        "one_pass_tok_per_s": round(one.tokens_per_s),
        "one_pass_seconds": round(one.seconds, 1),
        "regenerate_then_extract_tok_per_s": round(two.tokens_written / (regen.seconds + two.seconds)),
        "regenerate_seconds": round(regen.seconds, 1),
        "extract_seconds": round(two.seconds, 1),
        "two_step_tokens": two.tokens_written,
        "one_pass_tokens": one.tokens_written,
    }


LONG_PROMPTS = 128  # long-context prompts per variant (4,096 + 64 tokens each)
GRAPH_PROMPTS = 256  # short prompts served under CUDA graphs (the llama and mla drafts)
VARIANTS = {
    "llama + 3.1": dict(fc_norm=True, norm_output=True),
    "mla": dict(draft_arch="mla"),
    "mla + 3.1": dict(draft_arch="mla", fc_norm=True, norm_output=True),
}


@pytest.mark.skipif(
    ARCH != "deepseek",
    reason="the draft variants are compared on the DeepseekV3 target: run with EAGLE3_E2E_ARCH=deepseek",
)
def test_draft_variants_are_served_on_the_deepseek_target(chain, report):
    """Issue 41: the Llama-layer draft (the chain's seed 0), the MLA draft (Eagle3DeepseekV3ForCausalLM) and each with
    EAGLE-3.1's toggles, trained on the same store with seed 0 and served by vLLM at k=3: acceptance per variant and
    traffic type, beside the llama draft's two-seed spread (seed 1 trained and served here, or by the draft test, on
    the same prompts: a variant's difference from llama means something only beyond it), on the short held-out
    prompts and,
    by the same engine, on LONG_PROMPTS of them made 4,096 tokens long by earlier conversations (no engine start of
    their
    own: ~45-70 s each on the H200); the target trains on 4608-token windows,
    the drafts on single conversations of <= 512 tokens, so the long prompts ask how they hold up past that. Every
    engine here is eager; CUDA graphs: test_draft_variants_under_cuda_graphs. On the H200 at c5ebd37 (results/
    2026-12-05-c5ebd37-h200-vllm0.26.0) every figure of this table was measured (llama 3.358, llama + 3.1 3.809,
    mla 3.268, mla + 3.1 3.771 short; seed spread 0.017), in ~12 min; the step's limit then stopped the run in the
    CUDA-graph serving this test held at the time, before its asserts."""
    table: dict[str, dict] = {}
    errors: list[str] = []

    def attempt(name, what, fn):
        """fn(), or None with the error in the table: one variant that fails loses none of the others' figures."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - reported, and the test fails below
            table.setdefault(name, {})[f"{what}_error"] = failure(e)
            errors.append(f"{name} {what}")
            report("e2e_variants", table)
            return None

    def figures(name, r):
        """The short prompts' figures of an evaluation (acceptance, its error, per traffic type, the drafter vLLM
        loaded) and, where it served them, the long-context prompts' ("long_4k": the same engine)."""
        if r is None:
            return
        row = table.setdefault(name, {})
        at = str(learnable.LONG_CONTEXT)
        long, per_long = r.long.get(at), r.long_per_traffic.get(at, {})
        for what, run, per in (("short", r.draft, r.per_traffic), ("long_4k", long, per_long)):
            if run is not None:
                row.update({what: round(run.acceptance_length, 3), f"{what}_se": round(run.acceptance_se, 4)})
                row.update(
                    {f"{what}_{t}" if what != "short" else t: round(x.acceptance_length, 3) for t, x in per.items()}
                )
        row["drafter"] = r.drafter.get("draft_class")
        report("e2e_variants", table)  # as it goes

    drafts = {"llama": chain["seed0_draft"]}
    figures("llama", chain["seed0"])
    s1 = attempt("llama seed 1", "short", chain["seed1"])
    figures("llama seed 1", s1)
    if s1 is not None:
        table["spread_two_seeds"] = {"short": round(seed_spread(chain["seed0"].draft, s1.draft), 3)}
    for name, kw in VARIANTS.items():
        tag = name.replace(" + ", "-")
        drafts[name] = attempt(name, "train", lambda tag=tag, kw=kw: chain["fit"](tag, chain["store"], 0, **kw))
        if drafts[name]:
            r = attempt(
                name, "short", lambda tag=tag, d=drafts[name]: chain["serve"](tag, d, long_prompts=LONG_PROMPTS)
            )
            figures(name, r)
            if r is not None:  # the seed-spread test reads it
                chain.setdefault("variant_seed0", {})[name] = r
    chain["variant_drafts"] = drafts  # the CUDA-graph test serves two of them
    assert not errors, (errors, table)
    assert all(
        row.get(w, 0) > 1.0 or w not in row
        for n, row in table.items()
        if n != "spread_two_seeds"
        for w in ("short", "long_4k")
    ), table
    assert table["mla"]["drafter"] in ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM"), table


def test_draft_variants_seed_spread(chain, report):
    """Issue 41: each variant's own run-to-run spread. Seed 1 of llama + 3.1, mla and mla + 3.1, trained on the same
    store and served on the short prompts, beside seed 0: the variants test's, or trained and served here where that
    test did not run; the llama draft's from the chain. After the table (`-k variants` runs both, in this order), so a
    GPU run that ends here keeps the table; each spread is reported as it is measured."""
    seed0 = chain.get("variant_seed0", {})
    spreads: dict[str, dict] = {}
    errors: list[str] = []

    def put(name, runs):
        a = {s: r.draft for s, r in runs.items()}
        spreads[name] = {
            "seed0": round(a[0].acceptance_length, 3),
            "seed1": round(a[1].acceptance_length, 3),
            "spread": round(seed_spread(a[0], a[1]), 3),
        }
        report("e2e_variant_spreads", spreads)

    put("llama", {0: chain["seed0"], 1: chain["seed1"]()})
    for name, kw in VARIANTS.items():
        tag = name.replace(" + ", "-")
        try:
            first = seed0.get(name) or chain["serve"](tag, chain["fit"](tag, chain["store"], 0, **kw))
            put(
                name,
                {0: first, 1: chain["serve"](f"{tag}-seed1", chain["fit"](f"{tag}-seed1", chain["store"], 1, **kw))},
            )
        except Exception as e:  # noqa: BLE001 - reported; the test fails below, the other variants still measured
            spreads[name] = {"error": failure(e)}
            errors.append(name)
            report("e2e_variant_spreads", spreads)
    assert not errors, (errors, spreads)
    assert all(min(v["seed0"], v["seed1"]) >= MIN_ACCEPTANCE_LENGTH for v in spreads.values()), spreads


@pytest.mark.skipif(
    ARCH != "deepseek", reason="the MLA draft is served on the DeepseekV3 target: run with EAGLE3_E2E_ARCH=deepseek"
)
def test_draft_variants_under_cuda_graphs(chain, report):
    """The llama and mla drafts as production serves them: torch.compile and CUDA graphs (other attention-metadata
    paths than the eager engines' of the variants' table), GRAPH_PROMPTS short prompts, beside their eager figure on
    the same prompts' superset. The drafts: the variants test's, or trained here where it did not run."""
    drafts = chain.get("variant_drafts", {})
    rows: dict[str, dict] = {}
    errors: list[str] = []
    for name, kw in (("llama", {}), ("mla", VARIANTS["mla"])):
        try:
            draft = (
                chain["seed0_draft"]
                if name == "llama"
                else (drafts.get(name) or chain["fit"](name, chain["store"], 0, **kw))
            )
            r = chain["serve"](name + "-graphs", draft, cuda_graphs=True, num_prompts=GRAPH_PROMPTS)
            rows[name] = {
                "cuda_graphs": round(r.draft.acceptance_length, 3),
                "cuda_graphs_se": round(r.draft.acceptance_se, 4),
                "drafter": r.drafter.get("draft_class"),
            }
        except Exception as e:  # noqa: BLE001 - reported; the test fails below, the other draft still measured
            rows[name] = {"error": failure(e)}
            errors.append(name)
        report("e2e_variants_cuda_graphs", rows)
    assert not errors, (errors, rows)
    assert all(row["cuda_graphs"] >= MIN_ACCEPTANCE_LENGTH for row in rows.values()), rows


def test_fp8_states_train_a_draft_served_as_well_as_bf16(chain, report):
    """Issue 14: the same samples stored as e4m3 + a scale per token and layer, a seed-0 draft trained on them."""
    store8 = chain["tmp"] / "store-fp8"
    ex8 = extract.run(
        extract.ExtractConfig(
            model=str(chain["target"]),
            out=str(store8),
            backend="vllm",
            batch_size=512,
            shard_tokens=1 << 16,
            dtype=FP8,
            data=DataConfig([str(chain["data"])], max_len=512),
            vllm_kwargs=VLLM_KW,
        ),
        progress=False,
    )
    fp8 = fp8_figures(chain["store"], store8)
    report("e2e_fp8_states", dict(fp8, tokens_per_s=round(ex8.tokens_per_s), selfcheck=ex8.selfcheck))
    r8 = chain["serve"]("fp8", chain["fit"]("fp8", store8, 0))
    acc = {"seed0": chain["seed0"].draft.acceptance_length, "fp8": r8.draft.acceptance_length}
    verdict = evaluate.gap_verdict(chain["seed0"].draft, r8.draft, FP8_MAX_GAP)
    summary = {
        "acceptance": {k: round(v, 3) for k, v in acc.items()},
        "fp8_vs_bf16_same_seed": verdict,
        "fp8_states": fp8,
    }
    report("e2e_fp8_summary", summary)
    assert verdict["decided"], f"the measurement cannot decide a gap of {FP8_MAX_GAP}: raise EVAL_PROMPTS; {summary}"
    assert verdict["within"], summary
    assert abs(fp8["bytes_ratio"] - fp8["bytes_ratio_expected"]) < 0.005, summary  # half, plus ids/masks/scales


def fp8_figures(store, store8, n: int = 64) -> dict:
    """Bytes of the fp8 store's states against the bf16 one's, and the states' relative L2 error (fp8 vs bf16,
    per sample and layer) over the first n samples."""
    from eagle3.store.folder import Store

    bf, f8 = Store.open(store), Store.open(store8)
    ref = {}
    for s in bf.iter_samples():
        if len(ref) == n:
            break
        ref[s["sample_id"]] = s
    errs = []
    for s in f8.iter_samples():
        r = ref.get(s["sample_id"])
        if r is None:
            continue
        for i, t in s["states"].items():
            want = r["states"][i].float()
            errs.append(float((t.float() - want).norm() / want.norm().clamp_min(1e-30)))
    shards = lambda st: sum((st.root / sh["file"]).stat().st_size for sh in st.shards)  # noqa: E731
    per_token = lambda st: st.spec.bytes_per_token + 5  # noqa: E731 - states (+ scales), int32 id, uint8 mask
    return {
        "bytes_ratio": round(shards(f8) / shards(bf), 4),
        "bytes_ratio_expected": round(per_token(f8) / per_token(bf), 4),
        "rel_err_mean": round(sum(errs) / len(errs), 4),
        "rel_err_max": round(max(errs), 4),
        "compared": len(errs),
    }
