"""What a conversation teaches the draft (`eagle3 show-mask`): the rendered sample with its trained tokens marked, and
per sample the trained and untrained tokens counted by the role of the turn they fall in.

A token's role is the turn whose rendering holds it: turn j spans from the end of ``chat(turns before j)`` to the end
of ``chat(turns through j)``; what the template writes before the first turn (its default system prompt, the tools
list) is "template". The samples are those `eagle3 extract` makes (masks.py), before any --max-len rule.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.data import masks
from eagle3.data.conversations import DataReport, read_conversations
from eagle3.data.schema import DataError

TRAINED = ("\x1b[1;32m", "\x1b[0m")  # bold green on a terminal
BRACKETS = ("[[", "]]")  # elsewhere


@dataclass
class MaskedSample:
    sample_id: str
    line: int
    text: str
    input_ids: list[int]
    loss_mask: list[int]
    offsets: list[tuple[int, int]]  # each token's characters in text
    roles: list[str]  # each token's turn role ("template" before the first turn)
    counts: dict[str, Counter] = field(default_factory=dict)  # {"trained": role -> n, "untrained": role -> n}

    def __post_init__(self):
        self.counts = {"trained": Counter(), "untrained": Counter()}
        for m, role in zip(self.loss_mask, self.roles):
            self.counts["trained" if m else "untrained"][role] += 1

    def summary(self) -> str:
        def part(kind: str) -> str:
            c = self.counts[kind]
            return f"{kind} {sum(c.values())} (" + (", ".join(f"{r} {n}" for r, n in sorted(c.items())) or "none") + ")"

        return f"{self.sample_id}: {len(self.input_ids)} tokens; {part('trained')}; {part('untrained')}"

    def marked(self, color: bool) -> str:
        """The text with each trained run of tokens between TRAINED (color) or BRACKETS marks."""
        start, end = TRAINED if color else BRACKETS
        out, at, inside = [], 0, False
        for (a, _), m in zip(self.offsets, self.loss_mask):
            if bool(m) != inside:  # a run starts or ends at this token's first character
                a = max(a, at)
                out += [self.text[at:a], start if m else end]
                at, inside = a, bool(m)
        return "".join(out + [self.text[at:], end if inside else ""])

    def to_json(self) -> dict:
        return {
            "sample_id": self.sample_id,
            "line": self.line,
            "tokens": len(self.input_ids),
            "trained": dict(self.counts["trained"]),
            "untrained": dict(self.counts["untrained"]),
            "input_ids": self.input_ids,
            "loss_mask": self.loss_mask,
            "roles": self.roles,
            "text": self.text,
        }


def turn_roles(tokenizer, messages: list[dict], tools, view: masks.View, offsets) -> list[str]:
    """Each token's role: the turn whose rendering holds its first character."""
    bounds = []  # (first character, role) of each turn whose rendering this view's text starts with
    for j in range(view.end):
        before = masks.chat(tokenizer, messages[:j], tools)
        if view.text.startswith(before):
            bounds.append((len(before), messages[j]["role"]))
    roles = []
    for a, _ in offsets:
        role = "template"
        for first, r in bounds:
            if first <= a:
                role = r
        roles.append(role)
    return roles


def samples(tokenizer, path: str | Path, line: int | None = None) -> Iterator[MaskedSample | DataError]:
    """The samples of ``path`` (only line ``line`` where given) as extraction makes them; a bad line as its error."""
    path, stops, found = Path(path), masks.stop_ids(tokenizer), False
    for n, _, conv in read_conversations(path, DataReport()):
        if line is not None and n != line:
            continue
        found = True
        if isinstance(conv, DataError):
            yield conv
            continue
        try:
            vs = masks.views(tokenizer, conv, path, n)
        except DataError as e:
            yield e
            continue
        for v in vs:
            ids, mask, offsets = masks.encode_with_offsets(tokenizer, v, stops)
            sid = f"{path.name}:{n}" + ("" if v.end == len(conv.messages) else f"@{v.end - 1}")
            yield MaskedSample(
                sid, n, v.text, ids, mask, offsets, turn_roles(tokenizer, conv.messages, conv.tools, v, offsets)
            )
    if line is not None and not found:
        raise DataError(
            path,
            line,
            "no such line (or it is blank)",
            "Give the number of a line that holds a conversation (the first line is 1)",
        )
