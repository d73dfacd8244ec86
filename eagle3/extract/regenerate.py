"""`eagle3 regenerate`: the target writes the assistant turns itself (drafts learn best from the target's own outputs).

In: JSONL conversations (data/schema.py). Out: the same conversations, OpenAI schema, with assistant turns written by
the target, in input order, one output line per input line.
- mode "all" (default): every assistant turn of weight 1, in order, each conditioned on the regenerated history:
  what the target says in that conversation. "last": only the last assistant turn; the earlier ones as the data has
  them but written with ``weight: 0`` (context only: not the target's words, so extract learns only the target's turn,
  as `extract --regenerate` does). A turn of weight 0 is never regenerated and keeps its ``weight: 0``.
- A regenerated turn that calls other tools than the data's (another name or other arguments) ends the conversation
  there: the data's tool reply answers a different call (``regenerated.cut_after``).
- Thinking and tool calls are kept as structured fields (``reasoning_content``, ``tool_calls``), parsed from the
  target's text in Kimi-K2's format (<think>, the tool-call section tokens; ids ``functions.NAME:I`` as vLLM's
  kimi_k2 parser reads them) where the tokenizer has those tokens; otherwise the text up to the end-of-turn token is
  the content.
- A turn cut at max_tokens is marked ``finish: "length"`` in the line's ``regenerated`` record; extract learns it
  without the end-of-turn token the chat template closes it with (data/masks.py).
- Sampling: temperature (0 = greedy), top_p, max_tokens; line n samples with seed ``seed * 1_000_003 + n``, so a
  resumed run draws what an uninterrupted one would.
- Resumable and never overwriting: each output line is appended and fsynced with its input line number; a rerun of
  the same command keeps every complete line, drops a torn last one and continues after the last line written. The
  settings are in OUT.regen.json; an OUT that another command or another program wrote is refused, untouched.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3 import ownership
from eagle3.data import masks, schema
from eagle3.data.conversations import DataReport, read_conversations
from eagle3.data.schema import DataError
from eagle3.preflight import UsageError
from eagle3.targets import kimi_format

log = logging.getLogger(__name__)

MODES = ("all", "last")
SEED_STRIDE = 1_000_003


TURN_SHIFT = (
    40  # turn k's seeds lie k * 2**40 above turn 0's: apart for any file under 2**40 - seed * SEED_STRIDE lines
)


def turn_seed(seed: int, line: int, k: int = 0) -> int:
    """The seed of input line ``line``'s k-th regenerated turn (extract --regenerate draws turn 0 with it too): its
    own for every (line, turn) of a run."""
    return seed * SEED_STRIDE + line + (k << TURN_SHIFT)


@dataclass
class RegenConfig:
    target: str
    data: str
    out: str
    backend: str = "hf"
    device: str = "cpu"
    tp: int = 1
    mode: str = "all"
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 512
    seed: int = 0
    max_samples: int | None = None
    batch_size: int = 64  # conversations an engine call serves (one call per turn round)
    gpu_memory_utilization: float = 0.85  # vllm backend: its engine's share of each GPU
    max_model_len: int | None = None  # vllm backend: None = the target's
    trust_remote_code: bool = False  # the target's tokenizer or model runs code from its folder (auto_map)

    def settings(self) -> dict:
        """What decides the output (recorded; a resume must match it): not where or how fast it runs."""
        d = asdict(self)
        for k in ("device", "tp", "out", "batch_size", "gpu_memory_utilization", "max_model_len", "trust_remote_code"):
            d.pop(k)
        d["target"], d["data"] = str(Path(self.target).resolve()), str(Path(self.data).resolve())
        return d


class RegenError(UsageError):
    """OUT cannot be written or resumed as asked (nothing touched)."""


# --------------------------------------------------------------------------------------------- the target's text


def parse_turn(text: str, kimi: bool) -> dict:
    """The target's generated text (end token removed) -> an assistant message with structured fields."""
    msg: dict = {"role": "assistant"}
    if not kimi:
        msg["content"] = text
        return msg
    think_open, think_close = kimi_format.THINK
    rest = text
    if rest.startswith(think_open):  # no </think>: cut at max_tokens inside the thinking, which is all it wrote
        reasoning, _, rest = rest[len(think_open) :].partition(think_close)
        if reasoning:
            msg["reasoning_content"] = reasoning
    begin, end, call, arg, call_end = (
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    )
    if begin in rest:
        rest, section = rest.split(begin, 1)
        section = section.split(end, 1)[0]
        calls = []
        for m in re.finditer(
            re.escape(call) + r"(.*?)" + re.escape(arg) + r"(.*?)(?:" + re.escape(call_end) + r"|$)", section, re.S
        ):
            call_id, args = m.group(1).strip(), m.group(2)
            name = call_id.split(":")[0].removeprefix("functions.")  # functions.NAME:I -> NAME, as vLLM's kimi_k2
            # parser (vllm/parser/kimi_k2.py): a dotted name ("server.tool") stays whole
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
        msg["tool_calls"] = calls
    msg["content"] = rest
    return msg


def _same_calls(a: list[dict] | None, b: list[dict] | None) -> bool:
    def key(calls):
        out = []
        for c in calls or []:
            args = c["function"]["arguments"]
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except json.JSONDecodeError:
                pass
            out.append((c["function"]["name"], json.dumps(args, sort_keys=True)))
        return out

    return key(a) == key(b)


# --------------------------------------------------------------------------------------------- the output file


def _sidecar(out: Path) -> Path:
    return out.with_name(out.name + ".regen.json")


def check_output(cfg: RegenConfig) -> bool:
    """May OUT be written (new) or resumed (same settings)? True when resuming. Reads JSON only, writes nothing."""
    out, side = Path(cfg.out), _sidecar(Path(cfg.out))
    if side.exists():
        try:
            recorded = json.loads(side.read_text())
        except json.JSONDecodeError as e:
            raise RegenError(f"{side} is not valid JSON ({e.msg}); restore it, or give a new --out") from None
        except UnicodeDecodeError:
            raise RegenError(f"{side} is not text; restore it, or give a new --out") from None
        if not isinstance(recorded, dict):
            raise RegenError(
                f"--out {out}: {side} is not the settings eagle3 regenerate writes; it is left untouched: "
                "give a new --out"
            )
        if recorded != cfg.settings():
            diff = sorted(k for k in set(recorded) | set(cfg.settings()) if recorded.get(k) != cfg.settings().get(k))
            raise RegenError(
                f"--out {out} was regenerated with other settings ({', '.join(diff)} differ); rerun "
                f"that command to resume it, or give a new --out"
            )
        return True
    if out.exists():
        raise RegenError(
            f"--out {out} exists and was not written by eagle3 regenerate (no {side.name}); it is "
            f"left untouched: give a new --out"
        )
    return False


def open_output(cfg: RegenConfig) -> tuple[int, int]:
    """Check OUT and make it ready to append; returns (the last input line already written, the conversations OUT
    holds): (0, 0) for none. A torn last line (kill -9 mid-write) is cut off."""
    out, side = Path(cfg.out), _sidecar(Path(cfg.out))
    if not check_output(cfg):
        out.parent.mkdir(parents=True, exist_ok=True)
        ownership.write_new(side, json.dumps(cfg.settings(), indent=1).encode())  # a temp name no user file has
        out.touch()
        return 0, 0
    if not out.exists():
        out.touch()
        return 0, 0
    data = out.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        log.warning("%s: dropping a torn last line (%d bytes) left by an interrupted run", out, len(data) - keep)
        with open(out, "r+b") as f:
            f.truncate(keep)
            os.fsync(f.fileno())
    rows = data[:keep].splitlines()
    return max((json.loads(raw)["regenerated"]["line"] for raw in rows), default=0), len(rows)


# --------------------------------------------------------------------------------------------- generators


class HFGenerator:
    """transformers generate, one prompt at a time (each with its own seed)."""

    def __init__(self, target: str, device: str, trust_remote_code: bool = False):
        from eagle3.extract.hf_backend import load_model

        self.device = device
        self.model = load_model(target, "float32", device, trust_remote_code)

    def __call__(self, prompts: list[list[int]], seeds: list[int], cfg: RegenConfig, stops: set[int]):
        from eagle3.extract.hf_backend import generate_turn

        return [
            generate_turn(self.model, self.device, ids, seed, cfg.max_tokens, cfg.temperature, cfg.top_p, stops)
            for ids, seed in zip(prompts, seeds)
        ]


class VLLMGenerator:
    """vLLM's LLM.generate over a batch, a seed per request (TP as for extract)."""

    def __init__(
        self,
        target: str,
        tp: int,
        gpu_memory_utilization: float = 0.85,
        max_model_len: int | None = None,
        trust_remote_code: bool = False,
    ):
        import vllm

        from eagle3.extract.vllm_compat import prepare_environment

        prepare_environment()
        self.vllm = vllm
        self.llm = vllm.LLM(
            model=target,
            tensor_parallel_size=tp,
            dtype="bfloat16",
            enable_prefix_caching=True,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            trust_remote_code=trust_remote_code,
        )

    def close(self) -> None:
        """The engine's GPU memory back (a process that starts another engine next needs it)."""
        from eagle3.extract.vllm_compat import shutdown_engine

        llm, self.llm = self.llm, None
        if llm is not None:
            shutdown_engine(llm)

    def __call__(self, prompts: list[list[int]], seeds: list[int], cfg: RegenConfig, stops: set[int]):
        params = [
            self.vllm.SamplingParams(
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                max_tokens=cfg.max_tokens,
                seed=s,
                stop_token_ids=sorted(stops),
                skip_special_tokens=False,
                detokenize=False,
            )
            for s in seeds
        ]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


# --------------------------------------------------------------------------------------------- the loop


@dataclass
class RegenSummary:
    lines: int = 0  # input lines read this run (after the resumed ones)
    written: int = 0
    skipped: int = 0  # bad input lines (schema errors)
    blank_lines: int = 0
    duplicates: int = 0  # lines equal to an earlier line of the file (regenerated too)
    resumed_after: int = 0  # input lines already in OUT
    tokens: int = 0  # generated this run
    cut: int = 0  # conversations ended early: a regenerated tool call differed from the data's
    seconds: float = 0.0

    def line(self) -> str:
        rate = self.tokens / self.seconds if self.seconds else 0.0
        return (
            f"regenerated {self.written} conversations ({self.tokens:,} tokens, {rate:,.0f} tok/s)"
            + (f" after the {self.resumed_after} lines already written" if self.resumed_after else "")
            + f"; skipped {_n(self.skipped, 'bad line')}, {_n(self.blank_lines, 'blank line')}; "
            + f"{_n(self.duplicates, 'duplicate')} of an earlier line (regenerated each); "
            + f"{self.cut} cut at a differing tool call"
        )


def _n(k: int, what: str) -> str:
    return f"{k} {what}" + ("" if k == 1 else "s")


def _read(cfg: RegenConfig, done: int, summary: RegenSummary):
    """(input line number, Conversation) for each line after ``done``; bad lines skipped with a warning, counted; blank
    lines and duplicates of earlier lines (the resumed ones included) counted."""
    report, seen, resumed_blanks = DataReport(), set(), 0
    for n, _, conv in read_conversations(cfg.data, report):
        if n <= done:
            resumed_blanks = report.blank_lines  # the blank lines before line n
            if not isinstance(conv, DataError):
                seen.add(conv.key())
            continue
        summary.lines += 1
        summary.blank_lines = report.blank_lines - resumed_blanks
        if isinstance(conv, DataError):
            log.warning("%s; skipped", conv)
            summary.skipped += 1
            continue
        if conv.key() in seen:
            summary.duplicates += 1
        seen.add(conv.key())
        yield n, conv
    summary.blank_lines = report.blank_lines - resumed_blanks  # those after the last line too


def run(
    cfg: RegenConfig,
    generator: Callable | None = None,
    fault: Callable[[str], None] | None = None,
    progress_every_s: float = 10.0,
) -> RegenSummary:
    """Regenerate cfg.data into cfg.out, ``batch_size`` conversations an engine call (one call per turn round)."""
    from transformers import AutoTokenizer

    if cfg.mode not in MODES:
        raise RegenError(f"mode {cfg.mode!r}: use {' or '.join(MODES)}")
    done, held = open_output(cfg)
    tok = AutoTokenizer.from_pretrained(cfg.target, trust_remote_code=cfg.trust_remote_code)
    kimi = all(t in tok.get_vocab() for t in kimi_format.TOOL_TOKENS + kimi_format.THINK)
    stops = masks.stop_ids(tok)
    gen = generator or (
        HFGenerator(cfg.target, cfg.device, cfg.trust_remote_code)
        if cfg.backend == "hf"
        else VLLMGenerator(cfg.target, cfg.tp, cfg.gpu_memory_utilization, cfg.max_model_len, cfg.trust_remote_code)
    )
    try:
        return _regenerate(cfg, gen, tok, kimi, stops, done, held, fault, progress_every_s)
    finally:
        if generator is None and hasattr(gen, "close"):
            gen.close()


def _regenerate(
    cfg: RegenConfig, gen, tok, kimi: bool, stops: set[int], done: int, held: int, fault, progress_every_s: float
) -> RegenSummary:
    """Regenerate the input lines after line ``done``; OUT holds ``held`` conversations already (--max-samples
    counts them, not the blank or bad lines before ``done``)."""
    summary = RegenSummary(resumed_after=done)
    if done:
        log.info("resuming: input lines 1-%d already regenerated in %s", done, cfg.out)
    t0 = last_report = time.perf_counter()
    left = cfg.max_samples - held if cfg.max_samples else None
    batch: list = []
    with open(cfg.out, "ab") as out:

        def flush():
            nonlocal last_report
            for (_, conv), line in zip(batch, regenerate_batch(batch, cfg, tok, gen, stops, kimi, summary)):
                record = dict(
                    conv.extra,
                    messages=line["messages"],
                    **({"tools": conv.tools} if conv.tools else {}),
                    regenerated=line["regenerated"],
                )
                _append(out, (json.dumps(record, ensure_ascii=False) + "\n").encode(), fault)
                summary.written += 1
            batch.clear()
            now = time.perf_counter()
            if now - last_report >= progress_every_s:
                last_report = now
                log.info(
                    "regenerate: %d conversations, %s tokens, %.0f tok/s",
                    summary.written,
                    f"{summary.tokens:,}",
                    summary.tokens / (now - t0),
                )

        for item in _read(cfg, done, summary):
            if left is not None and summary.written + len(batch) >= left:
                break
            batch.append(item)
            if len(batch) == cfg.batch_size:
                flush()
        if batch:
            flush()
    summary.seconds = time.perf_counter() - t0
    return summary


def _append(out, data: bytes, fault) -> None:
    """One output line, fsynced (kill points: mid_line leaves a torn line, after_line a whole one)."""
    half = len(data) // 2
    out.write(data[:half])
    out.flush()
    if fault:
        fault("mid_line")
    out.write(data[half:])
    out.flush()
    os.fsync(out.fileno())
    if fault:
        fault("after_line")


def regenerate_batch(
    items: list[tuple[int, schema.Conversation]],
    cfg: RegenConfig,
    tok,
    gen,
    stops: set[int],
    kimi: bool,
    summary: RegenSummary,
) -> list[dict]:
    """Each conversation's turns in order; round r generates turn r of every conversation that has one, in one call."""
    state = []
    for n, conv in items:
        turns = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant" and conv.weights[i]]
        turns = turns[-1:] if cfg.mode == "last" else turns
        state.append(
            {
                "n": n,
                "conv": conv,
                "msgs": context_only(conv, turns),
                "turns": turns,
                "k": 0,
                "done": [],
                "tokens": [],
                "finish": [],
                "cut": None,
            }
        )
    while True:
        active = [st for st in state if st["cut"] is None and st["k"] < len(st["turns"])]
        if not active:
            break
        prompts, seeds = [], []
        for st in active:
            i = st["turns"][st["k"]]
            prompts.append(
                tok(masks.chat(tok, st["msgs"][:i], st["conv"].tools, gen=True), add_special_tokens=False)["input_ids"]
            )
            seeds.append(turn_seed(cfg.seed, st["n"], st["k"]))
        for st, ids in zip(active, gen(prompts, seeds, cfg, stops)):
            _take(st, ids, tok, stops, kimi, summary)
    return [
        {
            "messages": st["msgs"],
            "regenerated": {
                "line": st["n"],
                "turns": st["done"],
                "tokens": st["tokens"],
                "finish": st["finish"],
                "cut_after": st["cut"],
            },
        }
        for st in state
    ]


def context_only(conv: schema.Conversation, turns: list[int]) -> list[dict]:
    """The conversation's messages as written out, before any turn is regenerated: ``weight: 0`` on every turn the
    data keeps out of the loss, and on every assistant turn before the first of ``turns`` (mode last: the data's
    words, not the target's; extract learns only what the target wrote)."""
    first = turns[0] if turns else len(conv.messages)
    return [
        dict(m, weight=0) if not w or (m["role"] == "assistant" and i < first) else dict(m)
        for i, (m, w) in enumerate(zip(conv.messages, conv.weights))
    ]


def whole_characters(ids: list[int], tok) -> list[int]:
    """A turn cut by max_tokens, less the tokens of a character it cut inside (a byte-level tokenizer writes a CJK
    character or an emoji in up to 4 byte tokens). Decoded, those bytes are U+FFFD, which re-encodes to tokens the
    target never wrote. At most 3 tokens go (a character has at most 4 bytes); a text that still ends in U+FFFD after
    that wrote the character itself, and is kept whole."""
    for drop in range(min(3, len(ids)) + 1):
        head = ids[: len(ids) - drop]
        if not tok.decode(head).endswith("\ufffd"):
            return head
    return ids


def _take(st: dict, ids: list[int], tok, stops: set[int], kimi: bool, summary: RegenSummary) -> None:
    """Put the generated turn into the conversation; a call other than the data's (or a turn cut off by max_tokens
    before a tool reply) ends it there."""
    i = st["turns"][st["k"]]
    st["k"] += 1
    summary.tokens += len(ids)
    ended = bool(ids) and ids[-1] in stops
    kept = ids if ended else whole_characters(ids, tok)
    new = parse_turn(tok.decode(kept[:-1] if ended else kept, skip_special_tokens=not kimi), kimi)
    msgs, old = st["msgs"], st["msgs"][i]
    msgs[i] = new
    st["done"].append(i)
    st["tokens"].append(len(kept))
    st["finish"].append("stop" if ended else "length")
    follows_tool = i + 1 < len(msgs) and msgs[i + 1]["role"] == "tool"
    same = _same_calls(old.get("tool_calls"), new.get("tool_calls"))
    if same and old.get("tool_calls"):  # the data's tool replies answer the data's ids
        for c, o in zip(new["tool_calls"], old["tool_calls"]):
            if "id" in o:
                c["id"] = o["id"]
    if not same or (not ended and follows_tool):
        st["cut"] = i
        del msgs[i + 1 :]
        summary.cut += 1
