"""Tool-call ids as the target writes them.

Kimi-K2's chat template writes a call's id where the call begins (``<|tool_call_begin|>ID<|tool_call_argument_begin|>``)
and in its result's header (``## Return of ID``); Kimi writes ids as ``functions.NAME:INDEX``, INDEX counting the
conversation's calls from 0, and vLLM's kimi_k2 parser reads the call's name back from that id (the part before ":",
less "functions.") and drops a call whose id has no ":INDEX". An OpenAI id (``call_...``) would teach the draft tokens
the target never writes and hide the name, so for such a template each call's id, and the tool_call_id of the result
that answers it, is rewritten; an id already in Kimi's form for that name is kept. Other templates get the data's ids.
"""

from __future__ import annotations

import re
from collections import Counter

KIMI_K2 = "kimi_k2"
KIMI_ID = re.compile(r"functions\.(?P<name>.+):(?P<index>\d+)")


def style(tokenizer) -> str | None:
    """KIMI_K2 where the tokenizer's chat template writes Kimi-K2's tool-call section, else None (ids as given)."""
    template = tokenizer.get_chat_template() if getattr(tokenizer, "chat_template", None) else ""
    return KIMI_K2 if "<|tool_call_begin|>" in template and "<|tool_call_argument_begin|>" in template else None


def as_target_writes(messages: list[dict], id_style: str | None) -> tuple[list[dict], Counter]:
    """``messages`` with each call's id and each result's tool_call_id as ``id_style`` writes them (new dicts where
    changed), and what changed: {"assistant.tool_calls.id": calls, "tool.tool_call_id": results}."""
    changed: Counter = Counter()
    if id_style != KIMI_K2:
        return messages, changed
    out, index = [], 0
    renamed: dict[str, str] = {}  # the last calling turn's ids: the data's -> Kimi's
    unanswered: list[str] = []  # its calls in order, for results that name no id (ShareGPT's observation turns)
    for m in messages:
        if m.get("tool_calls"):
            calls, renamed, unanswered = [], {}, []
            for c in m["tool_calls"]:
                name, old = c["function"]["name"], c.get("id")
                kept = old is not None and (mk := KIMI_ID.fullmatch(old)) is not None and mk["name"] == name
                new = old if kept else f"functions.{name}:{index}"
                if not kept:
                    changed["assistant.tool_calls.id"] += 1
                    calls.append(dict(c, id=new))
                else:
                    calls.append(c)
                if old is not None:
                    renamed[old] = new
                unanswered.append(new)
                index += 1
            m = dict(m, tool_calls=calls)
        elif m["role"] == "tool":
            old = m.get("tool_call_id")
            new = renamed.get(old, old) if old is not None else (unanswered[0] if unanswered else None)
            if new in unanswered:
                unanswered.remove(new)
            if new != old:
                changed["tool.tool_call_id"] += 1
                m = dict(m, tool_call_id=new)
        out.append(m)
    return out, changed
