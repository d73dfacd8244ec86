"""`eagle3 eval`: serve target + EAGLE-3 draft in vLLM and measure what the draft is worth.

Reports acceptance length (1 + accepted draft tokens per verification step), per-position
acceptance, tokens/s with and without the draft, and whether greedy outputs are unchanged. With
``shifted`` it also feeds the same draft the target layers one above the ones it was trained on (the
classic off-by-one between layer-id conventions), switched at run time in eager mode.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from eagle3 import ownership
from eagle3.extract.rpc import Expect, Record, normalize_reply
from eagle3.extract.vllm_compat import WORKER_EXTENSION, prepare_environment, shutdown_engine

log = logging.getLogger(__name__)

ROPE_PROBE = (0, 1, 7, 100, 1000)  # positions whose draft cos/sin vLLM reports (eagle3_drafter_info)
DRAFTER_KEYS = frozenset({"shares_embedding", "shares_lm_head", "dtype", "rope_base", "rope_cos", "rope_sin"})


@dataclass
class EvalConfig:
    target: str
    draft: str
    prompts: str | None = None  # JSONL conversations; None = the learnable target's held-out prompts
    prompt_ids: list | None = None  # token-id prompts instead (targets without a tokenizer, random-token tests)
    out: str = "eval"
    k: int = 3
    max_tokens: int = 128
    num_prompts: int = 64
    shifted: bool = True
    baseline: bool = True
    gpu_memory_utilization: float = 0.3
    tp: int = 1
    trust_remote_code: bool = False  # the target's tokenizer or model runs code from its folder (auto_map)
    load_format: str = "auto"  # "dummy": a config-only target (no weights; acceptance means nothing there)
    max_model_len: int | None = None  # None: 2048, or room for the long-context prompts and their answers
    context_tokens: int = 0  # the learnable target's prompts made this many tokens long by earlier conversations before
    # them (0: none)
    cuda_graphs: bool = False  # serve as production does (torch.compile + CUDA graphs); eager by default
    long_prompts: int = 0  # then, in the same engine, this many of the learnable target's held-out prompts made
    long_context: int | tuple[int, ...] = 4096  # this many tokens long by earlier conversations, each length in turn
    # (learnable.LONG_CONTEXT): report.long[str(length)]

    def __post_init__(self):
        self.long_context = (self.long_context,) if isinstance(self.long_context, int) else tuple(self.long_context)
        if self.long_prompts and (self.prompts is not None or self.prompt_ids is not None):
            raise ValueError(
                "long_prompts makes long-context prompts from the learnable target's held-out "
                "conversations; prompts from a file or token ids carry their own context: put the long "
                "ones in a file of their own and evaluate it apart"
            )
        if self.max_model_len is None:
            self.max_model_len = max(
                2048,
                self.context_tokens + self.max_tokens,
                (max(self.long_context) + self.max_tokens) if self.long_prompts else 0,
            )


@dataclass
class SpecRun:
    acceptance_length: float
    per_position: list[float]
    drafts: int
    draft_tokens: int
    accepted: int
    tokens: int
    seconds: float
    acceptance_se: float = field(init=False)  # standard error of acceptance_length: the spread over drafts / sqrt(n)

    def __post_init__(self):
        # Chain drafts: per_position[p] * drafts = c_p, the drafts whose first p+1 tokens were all accepted, so a
        # draft that accepted x tokens counts in c_0..c_{x-1}: sum x = sum c_p and sum x^2 = sum (2p+1) c_p.
        n = self.drafts
        c = [f * n for f in self.per_position]
        s1, s2 = sum(c), sum((2 * p + 1) * cp for p, cp in enumerate(c))
        var = (s2 - s1 * s1 / n) / (n - 1) if n > 1 else math.nan
        self.acceptance_se = math.sqrt(max(var, 0.0) / n) if n > 1 else math.nan

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def gap_verdict(base: SpecRun, other: SpecRun, max_gap: float) -> dict:
    """``other``'s acceptance against ``base``'s: the gap, its standard error, and whether the measurement decides a
    bar of ``max_gap``: it resolves it (a gap of max_gap at least 2 standard errors from 0), or the gap is past it by
    more than 2 standard errors. Then whether the gap is within the bar."""
    gap = other.acceptance_length - base.acceptance_length
    se = math.hypot(base.acceptance_se, other.acceptance_se)
    resolved = se <= max_gap / 2
    return {
        "gap": round(gap, 4),
        "gap_se": round(se, 4),
        "resolved": resolved,
        "decided": resolved or abs(gap) - 2 * se > max_gap,
        "within": resolved and abs(gap) <= max_gap,
        "drafts": [base.drafts, other.drafts],
    }


@dataclass
class EvalReport:
    config: dict
    layer_ids: list[int]
    draft: SpecRun
    shifted: SpecRun | None = None
    shifted_layer_ids: list[int] = field(default_factory=list)
    baseline_tokens_per_s: float | None = None
    outputs_identical: float | None = None
    divergences: list = field(default_factory=list)  # per differing prompt: position and the target's margin there
    # (judged_divergences: the speculative repeat's, where there is one)
    spec_repeat_identical: float | None = None  # prompts whose speculative repeat equalled the timed run
    engine_start_s: float = 0.0  # target + draft, eager
    baseline_start_s: float = 0.0  # target alone, eager, same options
    drafter: dict = field(default_factory=dict)  # what vLLM loaded (eagle3_drafter_info)
    per_traffic: dict = field(default_factory=dict)  # traffic type (chat / thinking / tool) -> SpecRun of its prompts
    notes: list = field(default_factory=list)  # what the evaluation could not measure, and why
    long: dict = field(default_factory=dict)  # str(tokens) -> SpecRun of the long_prompts of that length, served
    # after the others by the same engine
    long_per_traffic: dict = field(default_factory=dict)  # str(tokens) -> traffic type -> SpecRun

    def lines(self) -> list[str]:
        d = self.draft
        out = [
            f"draft          acceptance length {d.acceptance_length:.3f} +- {d.acceptance_se:.3f} over "
            f"{d.drafts} drafts (k={self.config['k']}), per position "
            + ", ".join(f"{p:.3f}" for p in d.per_position)
            + f"; {d.tokens_per_s:,.0f} tok/s"
        ]
        out += [f"note           {n}" for n in self.notes]
        for name, r in self.per_traffic.items():
            out.append(
                f"  {name:<12} acceptance length {r.acceptance_length:.3f} +- {r.acceptance_se:.3f} over "
                f"{r.drafts} drafts"
            )
        for tokens, r in self.long.items():
            out.append(
                f"long prompts   acceptance length {r.acceptance_length:.3f} +- {r.acceptance_se:.3f} over "
                f"{r.drafts} drafts ({self.config['long_prompts']} prompts of {tokens} tokens: earlier "
                "conversations, then the prompt)"
            )
            out += [
                f"  {name:<12} acceptance length {x.acceptance_length:.3f} over {x.drafts} drafts"
                for name, x in self.long_per_traffic.get(tokens, {}).items()
            ]
        if self.shifted:
            s = self.shifted
            out.append(
                f"layers +1     acceptance length {s.acceptance_length:.3f} with ids {self.shifted_layer_ids} "
                f"instead of {self.layer_ids}"
            )
        if self.baseline_tokens_per_s:
            out.append(
                f"no draft       {self.baseline_tokens_per_s:,.0f} tok/s; speedup "
                f"{d.tokens_per_s / self.baseline_tokens_per_s:.2f}x; greedy outputs identical "
                f"{self.outputs_identical:.0%}"
            )
            if self.divergences:
                m = sorted(x["margin"] for x in self.divergences)
                out.append(
                    f"divergences    {len(m)} prompts; the target's top-1 margin where they start: min "
                    f"{m[0]:.4f}, median {m[len(m) // 2]:.4f}, max {m[-1]:.4f} nats"
                )
            if self.spec_repeat_identical is not None:
                out.append(
                    f"repeat         the speculative run again (judged above): outputs identical to the timed "
                    f"run {self.spec_repeat_identical:.0%}"
                )
        return out


# vLLM's spec-decode counters (vllm/v1/spec_decode/metrics.py) and the names they are kept under here
COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def no_counters() -> dict:
    return {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}


def spec_counters(llm) -> dict:
    """Sum vLLM's spec-decode counters over engines: drafts, draft tokens, accepted, accepted per position."""
    totals = no_counters()
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            totals[COUNTERS[m.name]] += int(m.value)
        elif m.name == PER_POSITION:
            vals = list(m.values)
            totals["per_pos"] = [a + b for a, b in zip(totals["per_pos"] or [0] * len(vals), vals)]
    return totals


def divergences(
    spec: list[list[int]], base: list[list[int]], base_top2: list[list[dict]], spec_top2: list[list[dict]] | None = None
) -> list[dict]:
    """Where speculative and plain greedy outputs first differ, and the target's own margin there (log-prob of
    its top token minus the runner-up, from the plain run). A margin within bf16 noise means a near-tie that
    the two computation paths (k+1 tokens verified at once vs one token per step) may break differently.

    ``spec_top2`` (the speculative run's own top-2 log-probs: the target's logits in the verification forward)
    tells the two causes of a larger margin apart: ``spec_top1`` true means the target itself, computed at the
    verification's batch shape, chose the speculative token (bf16 MLA/MoE numerics, e.g. an expert-routing near-tie
    flipped, not the draft); false means a token the target did not choose was emitted (an acceptance error)."""
    out = []
    for i, (a, b) in enumerate(zip(spec, base)):
        pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if pos is None and len(a) != len(b):
            pos = min(len(a), len(b))
        if pos is None:
            continue
        top = sorted(base_top2[i][pos].values(), reverse=True) if pos < len(base_top2[i]) else []
        d = {"prompt": i, "position": pos, "margin": top[0] - top[1] if len(top) > 1 else float("nan")}
        if spec_top2 is not None and pos < len(a) and pos < len(spec_top2[i]):
            lp = spec_top2[i][pos]
            ranked = sorted(lp, key=lp.get, reverse=True)
            d["spec_top1"] = bool(ranked) and ranked[0] == a[pos]
            d["spec_margin"] = lp[ranked[0]] - lp[ranked[1]] if len(ranked) > 1 else float("nan")
        out.append(d)
    return out


def judged_divergences(
    spec: list[list[int]],
    base: list[list[int]],
    base_top2: Callable[[], list[list[dict]]],
    repeat: tuple[list[list[int]], list[list[dict]]] | None,
) -> tuple[list[dict], float | None]:
    """The divergences to judge (unexplained) and the share of prompts whose speculative repeat equalled the timed
    run (None without a repeat). ``repeat``: the speculative run again, (tokens, its own top-2 at every token). Its
    divergences from the plain run are the ones judged: each has the verification forward's top-2 (spec_top1). The
    timed run's own may differ where the speculative path is not run-to-run deterministic (MoE routing near-ties at
    another batch composition); that spread is the share returned. Without a repeat, the timed run's divergences with
    the plain run's margins only. ``base_top2()``: the plain run's top-2 (another generate), asked only where needed."""
    tokens, top2 = repeat if repeat is not None else (spec, None)
    repeated = sum(a == b for a, b in zip(spec, repeat[0])) / len(spec) if repeat is not None else None
    if all(a == b for a, b in zip(tokens, base)):
        return [], repeated
    return divergences(tokens, base, base_top2(), top2), repeated


NEAR_TIE = 0.1  # nats: two bf16 computations of logits of magnitude ~7 differ by up to ~0.03 each


def unexplained(divs: list[dict], near_tie: float = NEAR_TIE) -> list[dict]:
    """The divergences (divergences()) neither computation's numerics explain: the plain run decided (top-1 margin
    over ``near_tie``) and the speculative token not the target's own top-1 in the verification forward (or that
    unknown: no speculative top-2, where the engine gave no repeat with log-probs). The rest are the target's own: a
    near-tie, or the target at the verification's batch shape choosing otherwise (an expert-routing near-tie flipped
    in a MoE: margins of 0.19-1.75 nats seen on the DeepseekV3 target on an H200, 0.625 and 0.75 on mini-Kimi on an
    H100)."""
    return [d for d in divs if not d["margin"] <= near_tie and not d.get("spec_top1")]


def _run(llm, prompts, max_tokens: int, before: dict | None = None, top2: list | None = None):
    """Greedy generation; with ``top2`` (a list), each output's per-token top-2 logprobs are appended to it."""
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, detokenize=False, logprobs=2 if top2 is not None else None
    )
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    if top2 is not None:
        top2 += [
            [{int(t): float(getattr(v, "logprob", v)) for t, v in step.items()} for step in o.outputs[0].logprobs]
            for o in outs
        ]
    if before is None:
        return tokens, seconds, None
    after = spec_counters(llm)
    return tokens, seconds, (spec_run(before, after, sum(map(len, tokens)), seconds), after)


def spec_run(before: dict, after: dict, tokens: int, seconds: float) -> SpecRun:
    """The SpecRun of what happened between two spec_counters readings."""
    d = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    per_pos = [a - b for a, b in zip(after["per_pos"], before["per_pos"] or [0] * len(after["per_pos"]))]
    drafts = max(d["drafts"], 1)
    return SpecRun(
        1 + d["accepted"] / drafts,
        [p / drafts for p in per_pos],
        d["drafts"],
        d["draft_tokens"],
        d["accepted"],
        tokens,
        seconds,
    )


def _run_by_traffic(llm, prompts, groups: dict, max_tokens: int, before: dict):
    """The spec run of every prompt, one generate per traffic type: (tokens in prompt order, overall SpecRun, counters
    after, {traffic: SpecRun})."""
    tokens: list = [None] * len(prompts)
    per, counters, seconds = {}, before, 0.0
    for name, idx in groups.items():
        got, sec, (per[name], counters) = _run(llm, [prompts[i] for i in idx], max_tokens, counters)
        seconds += sec
        for i, t in zip(idx, got):
            tokens[i] = t
    return tokens, spec_run(before, counters, sum(map(len, tokens)), seconds), counters, per


def load_prompts(cfg: EvalConfig, tokenizer) -> tuple[list[list[int]], dict[str, list[int]]]:
    """(prompts, {traffic type: prompt indexes}). Without cfg.prompts: the learnable target's held-out prompts (its
    arch from eagle3_target.json). A JSONL line's "traffic" names its type (default chat); a prompt is the
    conversation up to its last assistant turn."""
    from eagle3.data import kimi_traffic
    from eagle3.targets import learnable

    if cfg.prompts is None:
        made = Path(cfg.target) / "eagle3_target.json"
        arch = json.loads(made.read_text()).get("arch", "llama") if made.exists() else "llama"
        rows = learnable.eval_prompts(tokenizer, cfg.num_prompts, arch=arch, context_tokens=cfg.context_tokens)
    elif cfg.context_tokens:
        raise ValueError(
            "context_tokens makes long-context prompts from the learnable target's held-out "
            f"conversations; with prompts from {cfg.prompts}, put the context in the file"
        )
    else:
        with open(cfg.prompts) as f:
            rows = kimi_traffic.prompt_ids(tokenizer, [json.loads(line) for line, _ in zip(f, range(cfg.num_prompts))])
    groups: dict[str, list[int]] = {}
    for i, (traffic, _) in enumerate(rows):
        groups.setdefault(traffic, []).append(i)
    return [ids for _, ids in rows], groups


def run(cfg: EvalConfig) -> EvalReport:
    import vllm
    from transformers import AutoTokenizer

    ownership.claim(cfg.out, "eval")  # before the engine starts: a user's folder is refused in a second
    long: dict = {}  # str(tokens) -> (prompts, traffic groups)
    if cfg.prompt_ids is not None:
        prompts = [list(p) for p in cfg.prompt_ids[: cfg.num_prompts]]
        groups = {"chat": list(range(len(prompts)))}
    else:
        tokenizer = AutoTokenizer.from_pretrained(cfg.target, trust_remote_code=cfg.trust_remote_code)
        prompts, groups = load_prompts(cfg, tokenizer)
        for tokens in cfg.long_context if cfg.long_prompts else ():
            at = replace(cfg, num_prompts=cfg.long_prompts, context_tokens=tokens, long_prompts=0)
            long[str(tokens)] = load_prompts(at, tokenizer)
    prepare_environment()  # the V1 runner (V2 has no drafter) and spawned workers, as the capture's engines
    draft_cfg = json.loads((Path(cfg.draft) / "config.json").read_text())
    ids = list(draft_cfg["eagle_aux_hidden_state_layer_ids"])
    common = dict(
        model=cfg.target,
        dtype="bfloat16",
        enforce_eager=not cfg.cuda_graphs,
        max_model_len=cfg.max_model_len,
        tensor_parallel_size=cfg.tp,
        trust_remote_code=cfg.trust_remote_code,
        load_format=cfg.load_format,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        enable_prefix_caching=False,
        kernel_config={"enable_flashinfer_autotune": False},
    )
    t0 = time.perf_counter()
    llm = vllm.LLM(
        **common,
        disable_log_stats=False,
        worker_extension_cls=WORKER_EXTENSION,
        skip_tokenizer_init=cfg.prompt_ids is not None,
        speculative_config={"method": "eagle3", "model": cfg.draft, "num_speculative_tokens": cfg.k},
    )
    start = time.perf_counter() - t0
    drafter = normalize_reply(
        llm.collective_rpc("eagle3_drafter_info", args=(list(ROPE_PROBE),)),
        Expect(cfg.tp, Record(DRAFTER_KEYS), reply_rank=0),
    )
    _run(llm, prompts[:8], 16)  # warm-up: the first generate of an engine pays one-time costs
    spec_tokens, draft_run, counters, per = _run_by_traffic(llm, prompts, groups, cfg.max_tokens, spec_counters(llm))
    repeat, notes = None, []
    if cfg.baseline:  # the same run again, untimed, with the verification's own top-2: what explains a divergence
        try:
            got: list = []
            again, _, (_, counters) = _run(llm, prompts, cfg.max_tokens, counters, top2=got)
            repeat = (again, got)
        except Exception as e:  # noqa: BLE001 - an engine that returns no logprobs with a draft: say so, go on
            notes.append(
                f"the speculative run's top-2 log-probs are not available ({type(e).__name__}: {e}); "
                "divergences carry the plain run's margin only"
            )
            counters = spec_counters(llm)
    report = EvalReport(
        {k: v for k, v in asdict(cfg).items() if k != "prompt_ids"},
        ids,
        draft_run,
        engine_start_s=round(start, 1),
        drafter=drafter,
        per_traffic=per if len(per) > 1 else {},
        notes=notes,
    )
    for tokens, (rows, traffic) in long.items():  # the same engine: no start of its own for each length
        _, report.long[tokens], counters, per_long = _run_by_traffic(llm, rows, traffic, cfg.max_tokens, counters)
        report.long_per_traffic[tokens] = per_long if len(per_long) > 1 else {}
    if cfg.shifted:
        shifted = [i + 1 for i in ids]
        llm.collective_rpc("eagle3_set_aux_layers", args=(shifted,))
        _, _, (report.shifted, _) = _run(llm, prompts, cfg.max_tokens, counters)
        report.shifted_layer_ids = shifted
        llm.collective_rpc("eagle3_set_aux_layers", args=(ids,))
    shutdown_engine(llm, best_effort=False)
    del llm
    if cfg.baseline:
        t0 = time.perf_counter()
        base = vllm.LLM(**common, skip_tokenizer_init=cfg.prompt_ids is not None)
        report.baseline_start_s = round(time.perf_counter() - t0, 1)
        _run(base, prompts[:8], 16)
        base_tokens, seconds, _ = _run(base, prompts, cfg.max_tokens)
        report.baseline_tokens_per_s = sum(map(len, base_tokens)) / seconds
        report.outputs_identical = sum(a == b for a, b in zip(spec_tokens, base_tokens)) / len(prompts)

        def base_top2() -> list:  # the plain run again, timed apart, with margins
            top2: list = []
            _run(base, prompts, cfg.max_tokens, top2=top2)
            return top2

        report.divergences, report.spec_repeat_identical = judged_divergences(
            spec_tokens, base_tokens, base_top2, repeat
        )
        shutdown_engine(base, best_effort=False)
    out = Path(cfg.out)
    (out / "eval.json").write_text(json.dumps(asdict(report), indent=1))
    (out / "eval.md").write_text("# eagle3 eval\n\n" + "\n".join(f"- {x}" for x in report.lines()) + "\n")
    return report
