"""A Conversation -> token ids and a loss mask on exactly what the target generates in its assistant turns.

The target generates, after the template's generation prompt, the turn's thinking, text, tool-call markup and the
end-of-turn token. So a turn's span starts where ``chat(turns before it, add_generation_prompt=True)`` ends and
ends at the last end-of-turn token inside ``chat(turns through it)``; the template's headers and whatever it
writes after the end token (ChatML's "\\n") stay out. A turn the target did not end (regenerate's turn cut at
max_tokens: Conversation.unended) ends before that end token, and after the tokens the target wrote where the record
counts them (Kimi's template closes a thinking block cut short with </think>): the template wrote those, not the
target.

Views. A template may render an earlier turn differently once later turns follow (Kimi-K2's thinking template
drops the thinking of turns before the last user message). The target generated that turn with the history it
had then, so such a turn is learned from its own view: the conversation rendered through that turn. The whole
conversation is one view; each turn it renders differently adds one (sample id ``file:line@k``, k the turn).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from eagle3.data import tool_ids
from eagle3.data.schema import Conversation, DataError


@dataclass
class View:
    end: int  # messages[:end] rendered
    text: str
    spans: list[tuple[int, int]]  # character spans of the assistant turns learned in this view
    turns: list[int]  # their message indexes
    ended: list[bool]  # per span: the target ended the turn (its end-of-turn token is learned)
    written: list[int | None]  # per span not ended: the tokens the target wrote in it (None: not recorded)


def chat(tokenizer, messages: list[dict], tools=None, gen: bool = False) -> str:
    """The template's text for ``messages`` (empty allowed: the generation prompt alone), as
    ``apply_chat_template(tokenize=False)`` writes it, tool-call ids as the target writes them (tool_ids.py)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    messages, _ = tool_ids.as_target_writes(messages, tool_ids.style(tokenizer))  # Kimi's ids for Kimi's template
    rendered, _ = render_jinja_template(
        conversations=[messages],
        tools=tools,
        chat_template=tokenizer.get_chat_template(),
        add_generation_prompt=gen,
        **tokenizer.special_tokens_map,
    )
    return rendered[0]


def stop_ids(tokenizer) -> set[int]:
    """End-of-turn token ids: the tokenizer's eos, and generation_config.json's eos_token_id beside it."""
    import json

    ids = {tokenizer.eos_token_id} - {None}
    gen = Path(str(getattr(tokenizer, "name_or_path", "") or "")) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos]) - {None}
    return ids


def views(tokenizer, conv: Conversation, path="?", line: int = 0) -> list[View]:
    msgs, tools = conv.messages, conv.tools
    learn = [i for i, m in enumerate(msgs) if m["role"] == "assistant" and conv.weights[i]]
    turn_span = {}
    for i in learn:
        before, through = chat(tokenizer, msgs[:i], tools, gen=True), chat(tokenizer, msgs[: i + 1], tools)
        if not through.startswith(before):
            raise DataError(
                path,
                line,
                f"the chat template's rendering of turns 0..{i} does not start with its "
                f"generation prompt for turn {i}, so the assistant's span cannot be located",
                "Use a template whose generation prompt is what precedes an assistant turn's content",
                "template_not_prefix",
            )
        turn_span[i] = (before, through)
    out, left, end, unended = [], list(learn), len(msgs), conv.unended()
    while left:
        text = chat(tokenizer, msgs[:end], tools)
        # always progresses: a view that ends at a turn renders that turn as its own generation did
        here = [i for i in left if i < end and text.startswith(turn_span[i][1])]
        if here:
            out.append(
                View(
                    end,
                    text,
                    [(len(turn_span[i][0]), len(turn_span[i][1])) for i in here],
                    here,
                    [i not in unended for i in here],
                    [unended.get(i) for i in here],
                )
            )
            left = [i for i in left if i not in here]
        if left:
            end = left[-1] + 1
    return out


def encode(tokenizer, view: View, stops: set[int]) -> tuple[list[int], list[int]]:
    """View -> (input_ids [T], loss_mask [T]) (encode_with_offsets)."""
    ids, mask, _ = encode_with_offsets(tokenizer, view, stops)
    return ids, mask


def encode_with_offsets(tokenizer, view: View, stops: set[int]) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """View -> (input_ids [T], loss_mask [T], each token's characters in view.text [T]): the mask 1 on tokens starting
    inside a span, up to the span's last end token (for a turn the target did not end: up to the token before it, and
    at most the tokens it wrote)."""
    enc = tokenizer(view.text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    mask = [0] * len(ids)
    for (s, e), ended, written in zip(view.spans, view.ended, view.written):
        inside = [t for t, (a, _) in enumerate(offsets) if s <= a < e]
        ends = [t for t in inside if ids[t] in stops]
        last = (ends[-1] - (not ended)) if ends else (inside[-1] if inside else -1)
        if not ended and written is not None and inside:
            last = min(last, inside[0] + written - 1)
        for t in inside:
            if t <= last:
                mask[t] = 1
    return ids, mask, offsets


def dropped(conv: Conversation, vs: list[View]) -> Counter:
    """What the data held that the template did not write where the target reads or generates it:
    ``{"assistant.reasoning_content": n, "tool.content": n, "tools": n, ...}``."""
    out = Counter()
    full = next((v.text for v in vs if v.end == len(conv.messages)), None) or (vs[0].text if vs else "")
    where = {}
    for v in vs:
        for i, (s, e) in zip(v.turns, v.spans):
            where[i] = v.text[s:e]
    for i, m in enumerate(conv.messages):
        text = where.get(i, full)
        for name in ("content", "reasoning_content"):
            value = m.get(name)
            if isinstance(value, str) and value.strip() and value.strip() not in text:
                out[f"{m['role']}.{name}"] += 1
        for c in m.get("tool_calls") or []:
            fn = c["function"]
            if fn["name"] not in text or isinstance(fn["arguments"], str) and fn["arguments"].strip() not in text:
                out[f"{m['role']}.tool_calls"] += 1
    for t in conv.tools or []:
        if t.get("function", {}).get("name", "") not in full:
            out["tools"] += 1
    return out
