"""Conversations (JSONL) -> samples {input_ids [T], loss_mask [T]} through the tokenizer's chat template.

Readers (schema.py): the OpenAI chat schema in full (tools, tool calls, tool turns, thinking, text parts, per-turn
weight) and ShareGPT with its function-call roles. Loss mask (masks.py): exactly what the target generates in an
assistant turn of weight 1 (thinking, text, tool-call markup, the end-of-turn token), none of the template's headers.
Exact duplicates are counted (``dedup`` drops them); what the template dropped of the data is counted too.

Long samples (more than ``max_len`` tokens), by ``long_rule``:
  truncate (default) keep the first max_len tokens;
  split    cut into consecutive windows of max_len tokens (ids ``file:line#k``); a window keeps the
           tokens before it only as what it attends to inside the window, i.e. nothing;
  drop     reject the sample (reason ``too_long``);
  error    stop with an error naming file and line.
Samples left with no assistant token are rejected (``no_assistant_tokens``). Bad lines are skipped and
written to the rejects file with the reason (``on_error="skip"``, the default) or stop the run (``"stop"``).
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.data import masks, schema, tool_ids
from eagle3.data.schema import ROLES, Conversation, DataError  # noqa: F401 - ROLES, DataError: the package's names

log = logging.getLogger(__name__)

LONG_RULES = ("truncate", "split", "drop", "error")
ON_ERROR = ("skip", "stop")


@dataclass(frozen=True)
class Sample:
    sample_id: str
    input_ids: tuple[int, ...]  # [T]
    loss_mask: tuple[int, ...]  # [T], 1 = assistant token

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class DataConfig:
    paths: list[str]
    max_len: int = 2048
    long_rule: str = "truncate"
    on_error: str = "skip"
    rejects_path: str | None = None
    max_samples: int | None = None
    dedup: bool = False  # drop exact duplicates (same messages, tools, weights); counted either way
    workers: int = 0  # processes tokenizing long conversations (tokenize_pool.py); 0: the CPUs', 1: none
    run_together: bool = False  # consecutive samples joined into samples of up to max_len tokens (run_together)

    def __post_init__(self):
        if self.long_rule not in LONG_RULES:
            raise ValueError(f"long_rule must be one of {LONG_RULES}, got {self.long_rule!r}")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {self.on_error!r}")
        if self.max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {self.max_len}")


@dataclass
class DataReport:
    lines: int = 0
    blank_lines: int = 0
    samples: int = 0
    tokens: int = 0
    assistant_tokens: int = 0
    truncated: int = 0
    split_parts: int = 0
    duplicates: int = 0  # lines equal to an earlier one (dropped with dedup)
    views: int = 0  # extra samples: turns the template renders differently once later turns follow
    unended: int = 0  # regenerated turns cut at max_tokens: learned without an end-of-turn token
    rejected: Counter = field(default_factory=Counter)
    template_dropped: Counter = field(default_factory=Counter)  # "role.field" -> turns whose data the template left out
    tool_ids: Counter = field(default_factory=Counter)  # "role.field" -> ids rewritten as the target writes them
    prompts_only: bool = False  # extract --regenerate: samples are prompts, the target writes the turns
    in_workers: int = 0  # conversations tokenized in worker processes (tokenize_pool.py)
    joined_from: int = 0  # with run_together: the samples before they were joined

    def add(self, counts: DataReport) -> None:
        """One conversation's counts (tokenize_conversation) added."""
        self.views, self.unended = self.views + counts.views, self.unended + counts.unended
        self.truncated, self.split_parts = self.truncated + counts.truncated, self.split_parts + counts.split_parts
        self.rejected.update(counts.rejected)
        self.template_dropped.update(counts.template_dropped)

    def summary(self) -> str:
        rej = ", ".join(f"{k}: {v}" for k, v in sorted(self.rejected.items())) or "none"
        if self.prompts_only:
            return (
                f"{self.lines} lines ({self.blank_lines} blank) -> {self.samples} prompts, {self.tokens} tokens "
                f"(the target writes each turn); duplicates {self.duplicates}; rejected: {rej}"
            )
        out = (
            f"{self.lines} lines ({self.blank_lines} blank) -> {self.samples} samples, {self.tokens} tokens "
            f"({self.assistant_tokens} assistant); truncated {self.truncated}, split parts {self.split_parts}; "
            f"duplicates {self.duplicates}; rejected: {rej}"
        )
        if self.joined_from:
            out += f"; {self.joined_from} samples run together into {self.samples} samples"
        if self.in_workers:
            out += f"; {self.in_workers} long conversations tokenized in worker processes"
        if self.views:
            out += f"; {self.views} turns learned from their own view (the template re-renders them later)"
        if self.unended:
            out += (
                f"; {self.unended} turns the target did not end (regenerated, cut at max_tokens): learned "
                "without the end-of-turn token the template closes them with"
            )
        if self.tool_ids:
            out += (
                "; tool-call ids written as the target writes them (functions.NAME:INDEX): "
                f"{self.tool_ids['assistant.tool_calls.id']} calls, {self.tool_ids['tool.tool_call_id']} results"
            )
        if self.template_dropped:
            out += (
                "; the chat template dropped "
                + ", ".join(f"{k} in {v} turns" for k, v in sorted(self.template_dropped.items()))
                + " (the data held them)"
            )
        return out


# ---------------------------------------------------------------------------------------- reading


def json_problem(text: str, e: json.JSONDecodeError) -> str:
    """Where a line's JSON breaks, in words. json's own column misleads on a line cut short: the newline puts
    the error at "line 2 column 1", and an unclosed string is reported where it starts."""
    end = len(text.rstrip("\r\n"))
    open_string = e.msg.startswith(("Unterminated string", "Invalid control character"))
    if open_string and (e.pos >= end or e.msg.startswith("Unterminated")):
        return (
            f"a string is still open where the line ends, column {end}: a closing quote is missing, or the line "
            "was cut short"
        )
    if e.pos >= end:
        return f"{e.msg}: the line ends at column {end} before the JSON does (cut short?)"
    return f"{e.msg} at column {e.colno} of {end}: ...{text[max(0, e.pos - 20) : e.pos + 1]!r} <- here"


def parse_line(text: str, path: str | Path, line: int, need_assistant: bool = True) -> Conversation:
    """One JSONL line -> Conversation, or DataError saying what is wrong (schema.parse's need_assistant)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(
            path,
            line,
            f"invalid JSON ({json_problem(text, e)})",
            "Each line must be one JSON object; fix or remove the line",
            "invalid_json",
        ) from None

    def err(problem, fix, reason):
        raise DataError(path, line, problem, fix, reason)

    return schema.parse(obj, err, need_assistant)


def parse_conversation(text: str, path: str | Path, line: int) -> list[dict]:
    """One JSONL line -> its messages as the chat template receives them."""
    return parse_line(text, path, line).messages


def read_conversations(
    path: str | Path, report: DataReport, need_assistant: bool = True
) -> Iterator[tuple[int, str | None, Any]]:
    """Yield (line number, raw text, messages or DataError) for each non-blank line (need_assistant: parse_line's)."""
    path = Path(path)
    if not path.exists():
        raise DataError(path, None, "file not found", "Check the path")
    if path.is_dir():
        raise DataError(path, None, "is a directory", "Pass JSONL files, not a folder")
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            report.lines += 1
            try:
                text = raw.decode("utf-8").lstrip("\ufeff")
            except UnicodeDecodeError as e:
                yield (
                    lineno,
                    None,
                    DataError(
                        path, lineno, f"not UTF-8 (byte {e.start})", "Re-encode the file as UTF-8", "bad_encoding"
                    ),
                )
                continue
            if not text.strip():
                report.blank_lines += 1
                continue
            try:
                yield lineno, text, parse_line(text, path, lineno, need_assistant)
            except DataError as e:
                yield lineno, text, e


# ----------------------------------------------------------------------------------- tokenizing


def check_tokenizer(tokenizer, where: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            where,
            None,
            "the tokenizer has no chat template",
            "Use the target's own tokenizer folder (tokenizer_config.json or chat_template.jinja "
            "must define chat_template)",
            "no_chat_template",
        )
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            where,
            None,
            "the tokenizer is not a fast (Rust) tokenizer; offsets are needed for the loss mask",
            "Provide tokenizer.json",
            "slow_tokenizer",
        )


def render(tokenizer, messages: list[dict] | Conversation, path: str | Path = "?", line: int = 0):
    """messages -> (input_ids, loss_mask) of the whole conversation (its first view)."""
    conv = messages if isinstance(messages, Conversation) else Conversation(messages, None, [1] * len(messages))
    return masks.encode(tokenizer, masks.views(tokenizer, conv, path, line)[0], masks.stop_ids(tokenizer))


def _cut(
    sample_id: str, ids: list[int], mask: list[int], cfg: DataConfig, report: DataReport, path: Path, line: int
) -> list[Sample]:
    if len(ids) <= cfg.max_len:
        return [Sample(sample_id, tuple(ids), tuple(mask))]
    if cfg.long_rule == "error":
        raise DataError(
            path,
            line,
            f"sample has {len(ids)} tokens, more than max_len {cfg.max_len}",
            "Raise --max-len or choose --long truncate/split/drop",
            "too_long",
        )
    if cfg.long_rule == "drop":
        raise DataError(
            path, line, f"sample has {len(ids)} tokens > max_len {cfg.max_len}", "Dropped by --long drop", "too_long"
        )
    if cfg.long_rule == "truncate":
        report.truncated += 1
        return [Sample(sample_id, tuple(ids[: cfg.max_len]), tuple(mask[: cfg.max_len]))]
    parts = []
    for k, start in enumerate(range(0, len(ids), cfg.max_len)):
        window = slice(start, start + cfg.max_len)
        if len(ids[window]) >= 2:
            parts.append(Sample(f"{sample_id}#{k}", tuple(ids[window]), tuple(mask[window])))
    report.split_parts += len(parts)
    return parts


def unique_conversations(
    cfg: DataConfig, report: DataReport, rejects: list[dict], need_assistant: bool = True
) -> Iterator[tuple[Path, int, str | None, Conversation]]:
    """(path, line, raw text, Conversation) for each line of cfg.paths, in file then line order: a line that does not
    parse is rejected (``reject``), a duplicate of an earlier line counted and, with cfg.dedup, dropped."""
    names = [Path(p).name for p in cfg.paths]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise DataError(
            sorted(dup)[0], None, "two input files share this name, so sample ids would collide", "Rename one of them"
        )
    seen = set()
    for path in map(Path, cfg.paths):
        for line, text, parsed in read_conversations(path, report, need_assistant):
            if isinstance(parsed, DataError):
                if cfg.on_error == "stop":
                    raise parsed
                reject(report, rejects, path, line, text, parsed)
                continue
            key = parsed.key()
            if key in seen:
                report.duplicates += 1
                if cfg.dedup:
                    continue
            seen.add(key)
            yield path, line, text, parsed


def reject(report: DataReport, rejects: list[dict], path: Path, line: int, text: str | None, e: DataError) -> None:
    """A line skipped: counted by its reason, kept for the rejects file."""
    report.rejected[e.reason] += 1
    rejects.append({"file": str(path), "line": line, "reason": e.reason, "error": str(e), "text": (text or "")[:200]})


def run_together(samples: list[Sample], max_len: int) -> list[Sample]:
    """Consecutive samples joined, each new sample taking the ones that follow while the whole fits in max_len
    tokens: a draft trained on them reads long histories of earlier conversations, as a long session's context
    holds earlier tasks. Ids ``FIRST+K``: the first sample's id and how many follow it."""
    out, group, size = [], [], 0

    def close():
        ids = tuple(t for s in group for t in s.input_ids)
        out.append(Sample(f"{group[0].sample_id}+{len(group) - 1}", ids, tuple(m for s in group for m in s.loss_mask)))

    for s in samples:
        if group and size + len(s) > max_len:
            close()
            group, size = [], 0
        group.append(s)
        size += len(s)
    if group:
        close()
    return out


def tokenize_conversation(tokenizer, stops: set[int], cfg: DataConfig, path: Path, line: int, text, parsed):
    """One conversation -> (its samples: each view's, cut by cfg's long rule, those with an assistant token; the
    counts it adds to the report). Raises DataError. Runs here or in a worker process (tokenize_pool.py)."""
    counts = DataReport()
    vs = masks.views(tokenizer, parsed, path, line)
    counts.views += len(vs) - 1
    counts.unended += sum(not e for v in vs for e in v.ended)
    counts.template_dropped.update(masks.dropped(parsed, vs))
    parts = []
    for v in vs:
        ids, mask = masks.encode(tokenizer, v, stops)
        sid = f"{path.name}:{line}" + ("" if v.end == len(parsed.messages) else f"@{v.end - 1}")
        parts += _cut(sid, ids, mask, cfg, counts, path, line)
    kept = [s for s in parts if any(s.loss_mask)]
    if not kept:
        raise DataError(path, line, "no assistant tokens left after the long-sample rule", "Raise --max-len",
                        "no_assistant_tokens")  # fmt: skip
    if len(kept) < len(parts):
        counts.rejected["no_assistant_tokens"] += len(parts) - len(kept)
    return kept, counts


def load_samples(cfg: DataConfig, tokenizer, tokenizer_where: str = "tokenizer") -> tuple[list[Sample], DataReport]:
    """All samples of cfg.paths, in file then line order; rejects written to cfg.rejects_path. Long conversations
    are tokenized in cfg.workers processes (tokenize_pool.py)."""
    from functools import partial

    from eagle3.data import tokenize_pool

    check_tokenizer(tokenizer, tokenizer_where)
    report, samples, rejects = DataReport(), [], []
    stops, id_style = masks.stop_ids(tokenizer), tool_ids.style(tokenizer)
    work = partial(tokenize_conversation, tokenizer, stops, cfg)
    workers = cfg.workers or tokenize_pool.default_workers()

    def conversations():
        for path, line, text, parsed in unique_conversations(cfg, report, rejects):
            report.tool_ids.update(tool_ids.as_target_writes(parsed.messages, id_style)[1])  # masks.chat rewrites them
            yield path, line, text, parsed

    for (path, line, text, _), got, remote in tokenize_pool.in_order(conversations(), work, workers):
        if isinstance(got, DataError):
            if cfg.on_error == "stop" or got.reason == "too_long" and cfg.long_rule == "error":
                raise got
            reject(report, rejects, path, line, text, got)
            continue
        kept, counts = got
        report.add(counts)
        report.in_workers += remote
        samples.extend(kept)
        if cfg.max_samples and len(samples) >= cfg.max_samples:
            samples = samples[: cfg.max_samples]
            break
    if cfg.run_together:
        report.joined_from, samples = len(samples), run_together(samples, cfg.max_len)
    report.samples = len(samples)
    report.tokens = sum(len(s) for s in samples)
    report.assistant_tokens = sum(sum(s.loss_mask) for s in samples)
    if cfg.rejects_path and rejects:
        write_rejects(cfg.rejects_path, rejects)
    if report.tool_ids:
        log.warning(
            "tool-call ids rewritten as the target writes them (functions.NAME:INDEX): %s", dict(report.tool_ids)
        )
    if report.template_dropped:
        log.warning("the chat template dropped what the data held: %s", dict(report.template_dropped))
    if rejects:
        log.warning(
            "skipped %d bad lines (%s)%s",
            len(rejects),
            dict(report.rejected),
            f"; see {cfg.rejects_path}" if cfg.rejects_path else "",
        )
    if not samples:
        if not rejects:
            raise DataError(
                ", ".join(cfg.paths),
                None,
                f"no conversations: {report.lines} lines, {report.blank_lines} blank",
                "Give JSONL files with one conversation per line",
            )
        where = f"; each rejected line and its reason: {cfg.rejects_path}" if cfg.rejects_path else ""
        raise DataError(
            ", ".join(cfg.paths), None, f"no usable samples ({report.summary()})", f"Check the input format{where}"
        )
    return samples, report


def write_rejects(path: str | Path, rejects: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "w") as f:
        for r in rejects:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


def random_samples(n: int, seq_len: int | list[int], vocab_size: int, seed: int = 0, low: int = 8) -> list[Sample]:
    """Token-id samples for targets without a tokenizer (GPU suite). loss_mask all ones."""
    import torch  # drawn by torch: millions of ids a benchmark warms with, in a fraction of a second

    g = torch.Generator().manual_seed(seed)
    lengths = seq_len if isinstance(seq_len, list) else [seq_len] * n
    return [
        Sample(f"rand:{seed}:{i}", tuple(torch.randint(low, vocab_size, (t,), generator=g).tolist()), (1,) * t)
        for i, t in enumerate(lengths[:n])
    ]
