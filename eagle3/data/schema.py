"""One JSONL line -> a Conversation: the OpenAI chat schema in full, or ShareGPT with its function-call roles.

OpenAI ``{"messages": [...], "tools": [...]}``. A turn has ``role``: system, developer, user, assistant, tool (the
legacy ``function`` role, with its ``name``, is read as a tool turn); ``content``: a string, a list of
``{"type": "text", "text": ...}`` parts (joined with ""; other parts are refused: extraction is text-only), or
null on an assistant turn that calls tools. Assistant turns may carry ``tool_calls`` (``{"id", "type":
"function", "function": {"name", "arguments"}}``) and ``reasoning_content`` (thinking; vLLM's ``reasoning`` is
read as the same); tool turns ``tool_call_id``. ``weight`` on a turn: 1 (default) or 0 = not in the loss.

A line `eagle3 regenerate` wrote also has ``regenerated``: ``turns`` (the message indexes it wrote) and ``finish``
(each "stop", or "length": cut at max_tokens). A turn cut at max_tokens is learned without its end-of-turn token, which
the template writes but the target never generated there (data/masks.py).

ShareGPT ``{"conversations": [{"from", "value"}], "tools": "[...]"}``: system, human, gpt; ``function_call``
(the value a JSON call ``{"name", "arguments"}`` or a list of them: an assistant turn with tool_calls),
``observation`` (the tool's reply: a tool turn).

The messages reach the target's chat template as OpenAI messages; nothing else in them is changed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

ROLES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "system": "system",
    "developer": "developer",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "function_call": "assistant",
}
NON_TEXT_PARTS = ("image_url", "input_image", "image", "input_audio", "audio", "file", "video", "video_url")


class DataError(ValueError):
    """Bad input: names the file, the line, what is wrong and what to do."""

    def __init__(self, path, line: int | None, problem: str, fix: str, reason: str = "invalid"):
        where = f"{path}:{line}" if line else str(path)
        super().__init__(f"{where}: {problem}. {fix}")
        self.path, self.line, self.problem, self.fix, self.reason = str(path), line, problem, fix, reason

    def __reduce__(self):  # a worker process's error comes back whole (tokenize_pool.py)
        return DataError, (self.path, self.line, self.problem, self.fix, self.reason)


@dataclass
class Conversation:
    messages: list[dict]  # OpenAI messages, as the chat template receives them
    tools: list[dict] | None = None  # the top-level tools list, handed to the template
    weights: list[int] = field(default_factory=list)  # per message: 1 = in the loss (assistant turns), 0 = not
    extra: dict = field(default_factory=dict)  # the line's other top-level keys (e.g. "traffic"), kept for rewriters

    def key(self) -> str:
        """Identity for duplicate counting: the messages and tools as the template gets them."""
        return json.dumps(
            [self.messages, self.tools, self.weights, sorted(self.unended())], sort_keys=True, ensure_ascii=False
        )

    def unended(self) -> dict[int, int | None]:
        """The turns the target did not end (regenerate's record: finish "length"): message index -> the tokens it
        wrote in that turn (None where the record does not say)."""
        r = self.extra.get("regenerated") or {}
        turns, tokens = r.get("turns", ()), r.get("tokens") or [None] * len(r.get("turns", ()))
        return {i: n for i, f, n in zip(turns, r.get("finish", ()), tokens) if f == "length"}


FINISH = ("stop", "length")  # how a regenerated turn ended: its end-of-turn token, or max_tokens


def _check_regenerated(record, messages: list[dict], err) -> None:
    """regenerate's record of the turns it wrote: turns[j] an assistant message, finish[j] how it ended, tokens[j]
    (optional) how many tokens the target wrote in it."""
    fix = (
        'Keep the "regenerated" record as `eagle3 regenerate` wrote it ({"turns": [message index, ...], "finish": '
        '["stop" or "length", ...]}), or remove it'
    )
    turns, finish = (record.get("turns"), record.get("finish")) if isinstance(record, dict) else (None, None)
    if not isinstance(turns, list) or not isinstance(finish, list):
        err("the regenerated record's turns and finish must be lists", fix, "bad_regenerated")
    if len(turns) != len(finish):
        err(f"the regenerated record has {len(turns)} turns but {len(finish)} finish values", fix, "bad_regenerated")
    tokens = record.get("tokens")
    if tokens is not None and (not isinstance(tokens, list) or len(tokens) != len(turns)):
        err(f"the regenerated record's tokens is not a list of {len(turns)} counts", fix, "bad_regenerated")
    for n in tokens or ():
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            err(f"the regenerated record has token count {n!r}; counts are whole numbers >= 0", fix, "bad_regenerated")
    for i, f in zip(turns, finish):
        if f not in FINISH:
            err(f"the regenerated record has finish {f!r}; it is one of {FINISH}", fix, "bad_regenerated")
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(messages):
            err(
                f"the regenerated record's turn {i!r} is past the last of {len(messages)} messages",
                fix,
                "bad_regenerated",
            )
        if messages[i]["role"] != "assistant":
            err(
                f"the regenerated record's turn {i} is a {messages[i]['role']} turn, not an assistant turn",
                fix,
                "bad_regenerated",
            )


def _text(content, k: int, role: str, err) -> str | None:
    """A turn's content -> its text (None stays None)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        err(
            f"turn {k} content is {type(content).__name__}, not a string or a list of text parts",
            'Write "content": "..." or [{"type": "text", "text": "..."}]',
            "wrong_schema",
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(part, str):
            texts.append(part)
        elif kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in NON_TEXT_PARTS or isinstance(kind, str) and kind != "text":
            err(
                f"turn {k} ({role}) content part {j} is {kind!r}: extraction is text-only",
                "Remove the line, or keep only its text parts",
                "non_text_content",
            )
        else:
            err(
                f"turn {k} content part {j} is not a text part ({json.dumps(part)[:60]})",
                'Write each part as {"type": "text", "text": "..."}',
                "wrong_schema",
            )
    return "".join(texts)


def _tool_calls(calls, k: int, err) -> list[dict]:
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls:
        err(
            f"turn {k} tool_calls is {type(calls).__name__ if calls != [] else 'an empty list'}, not a list of calls",
            'Write "tool_calls": [{"id", "type": "function", "function": {"name", "arguments"}}] or leave it out',
            "bad_tool_call",
        )
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function", c) if isinstance(c, dict) else None  # ShareGPT writes {"name", "arguments"} bare
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            err(
                f"turn {k} tool call {j} has no function name",
                'Write {"function": {"name": ..., "arguments": ...}}',
                "bad_tool_call",
            )
        args = fn.get("arguments", {})
        if not isinstance(args, (str, dict)):
            err(
                f"turn {k} tool call {j} ({name}) arguments are {type(args).__name__}, not a JSON string or object",
                'Write "arguments": "{\\"city\\": \\"Paris\\"}" or an object',
                "bad_tool_call",
            )
        call = {"type": "function", "function": {"name": name, "arguments": args}}
        if isinstance(c, dict) and c.get("id") is not None:
            call["id"] = str(c["id"])
        out.append(call)
    return out


def _tools(tools, err) -> list[dict] | None:
    if tools is None:
        return None
    if isinstance(tools, str):  # ShareGPT writes the tools as a JSON string
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as e:
            err(f'"tools" is a string that is not JSON ({e.msg})', "Write tools as a JSON list", "wrong_schema")
        if tools is None:
            return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        err(
            f'"tools" is {type(tools).__name__}, not a list of tool objects',
            'Write "tools": [{"type": "function", "function": {"name", "description", "parameters"}}]',
            "wrong_schema",
        )
    # a bare function schema ({"name", "parameters"}) is wrapped as OpenAI writes it
    return [t if "function" in t else {"type": "function", "function": t} for t in tools] or None


def parse(obj, err, need_assistant: bool = True) -> Conversation:
    """A decoded JSONL line -> Conversation; ``err(problem, fix, reason)`` raises. ``need_assistant=False``: a
    conversation with no assistant turn to learn is a prompt (`extract --regenerate`: the target writes the turn)."""
    if not isinstance(obj, dict):
        err(
            f"expected a JSON object, got {type(obj).__name__}",
            'Write {"messages": [...]} or {"conversations": [...]}',
            "wrong_schema",
        )
    if "messages" in obj and "conversations" in obj:
        err('has both "messages" and "conversations"', "Keep one of them", "wrong_schema")
    if "messages" in obj:
        turns, role_key, text_key = obj["messages"], "role", "content"
    elif "conversations" in obj:
        turns, role_key, text_key = obj["conversations"], "from", "value"
    else:
        err(
            f'no "messages" or "conversations" key (keys: {sorted(obj)[:8]})',
            'Use OpenAI {"messages": [{"role", "content"}]} or ShareGPT {"conversations": [{"from", "value"}]}',
            "wrong_schema",
        )
    if not isinstance(turns, list):
        err(f"the turn list is {type(turns).__name__}, not a list", "Make it a JSON array of turns", "wrong_schema")
    if not turns:
        err("empty conversation", "Remove the line or add turns", "empty")
    tools = _tools(obj.get("tools"), err)
    messages, weights, open_calls = [], [], {}
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            err(
                f"turn {k} is {type(turn).__name__}, not an object",
                f'Write each turn as {{"{role_key}": ..., "{text_key}": ...}}',
                "wrong_schema",
            )
        raw_role = turn.get(role_key)
        if role_key not in turn or text_key not in turn and not turn.get("tool_calls"):
            err(
                f'turn {k} lacks "{role_key}" or "{text_key}" (keys: {sorted(turn)})',
                f'Give every turn "{role_key}" and "{text_key}"',
                "wrong_schema",
            )
        if not isinstance(raw_role, str) or raw_role.lower() not in ROLES:
            err(f"turn {k} has unknown role {raw_role!r}", f"Use one of {sorted(ROLES)}", "unknown_role")
        raw_role, role = raw_role.lower(), ROLES[raw_role.lower()]
        weight = turn.get("weight", 1)
        if weight not in (0, 1) or isinstance(weight, bool):
            err(
                f"turn {k} weight is {weight!r}",
                "Use weight 1 (in the loss) or 0 (context only): the loss mask is binary",
                "bad_weight",
            )
        m: dict = {"role": role}
        if raw_role == "function_call":  # ShareGPT: the value is the call itself
            try:
                calls = json.loads(turn[text_key]) if isinstance(turn[text_key], str) else turn[text_key]
            except json.JSONDecodeError as e:
                err(
                    f"turn {k} (function_call) value is not JSON ({e.msg})",
                    'Write the call as {"name": ..., "arguments": {...}}',
                    "bad_tool_call",
                )
            m["content"], m["tool_calls"] = "", _tool_calls(calls, k, err)
        else:
            content = _text(turn.get(text_key), k, raw_role, err)
            if content is None and not (role == "assistant" and turn.get("tool_calls")):
                err(
                    f"turn {k} content is NoneType (null), and it calls no tools",
                    "Make the content a string",
                    "wrong_schema",
                )
            m["content"] = content
            if role == "assistant":
                if turn.get("tool_calls") is not None:
                    m["tool_calls"] = _tool_calls(turn["tool_calls"], k, err)
                reasoning = turn.get("reasoning_content", turn.get("reasoning"))
                if reasoning is not None:
                    if not isinstance(reasoning, str):
                        err(
                            f"turn {k} reasoning_content is {type(reasoning).__name__}, not a string",
                            "Write the thinking as a string",
                            "wrong_schema",
                        )
                    m["reasoning_content"] = reasoning
            elif turn.get("tool_calls"):
                err(
                    f"turn {k} ({raw_role}) has tool_calls; only assistant turns call tools",
                    "Move the calls to an assistant turn",
                    "bad_tool_call",
                )
        if role == "tool":
            call_id = turn.get("tool_call_id")
            if raw_role == "function" and not turn.get("name"):
                err(
                    f"turn {k} (function) has no name",
                    'Give the legacy function turn its "name", or write a "tool" turn with "tool_call_id"',
                    "wrong_schema",
                )
            if not open_calls:
                err(
                    f"turn {k} ({raw_role}) answers no tool call: no assistant turn before it calls a tool",
                    "Put the assistant turn with tool_calls before the tool's reply",
                    "orphan_tool_turn",
                )
            if call_id is not None:
                if str(call_id) not in open_calls:
                    err(
                        f"turn {k} answers tool_call_id {call_id!r}, which no earlier tool call has (ids: "
                        f"{sorted(open_calls)[:6]})",
                        "Use the id of the call it answers",
                        "orphan_tool_turn",
                    )
                m["tool_call_id"] = str(call_id)
            for key in ("name",):
                if turn.get(key) is not None:
                    m[key] = turn[key]
        if role == "assistant" and m.get("tool_calls"):
            open_calls = {c.get("id", f"#{j}"): c for j, c in enumerate(m["tool_calls"])}
        messages.append(m)
        weights.append(int(weight))
    learnable = [
        i
        for i, m in enumerate(messages)
        if m["role"] == "assistant"
        and weights[i]
        and ((m["content"] or "").strip() or m.get("tool_calls") or (m.get("reasoning_content") or "").strip())
    ]
    if not learnable and need_assistant:
        held = any(m["role"] == "assistant" for m in messages)
        err(
            "no assistant turn with text, thinking or tool calls"
            + (" and weight 1" if held else "")
            + " (nothing to learn from)",
            "Add an assistant reply or remove the line",
            "no_assistant",
        )
    if obj.get("regenerated") is not None:
        _check_regenerated(obj["regenerated"], messages, err)
    extra = {k: v for k, v in obj.items() if k not in ("messages", "conversations", "tools")}
    return Conversation(messages, tools, weights, extra)
