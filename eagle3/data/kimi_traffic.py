"""Conversations shaped like Kimi-K2.5's traffic, written for this project: plain chat, thinking, and tool use.

Every answer follows from the prompt by fixed rules (corpus.py's topics), so a small target learns them and a draft
can learn to predict that target:
  chat      corpus.py's dialogues (1-3 topics, several turns);
  thinking  one question; ``reasoning_content`` restates it and works it out, then the answer;
  tool      the ``tools`` list, a question, an assistant turn that calls a tool (``tool_calls``, Kimi's ids
            ``functions.NAME:0``), the tool's reply (a ``tool`` turn, its JSON a function of the arguments), and the
            answer read off the reply.
Each line carries ``"traffic"`` (chat / thinking / tool), which the evaluation groups prompts by.
"""

from __future__ import annotations

import json
import random
import zlib

from eagle3.data import corpus

TRAFFIC = ("chat", "thinking", "tool")
WEATHER = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy"]
CITIES = ["Paris", "Tokyo", "Lima", "Cairo", "Oslo", "Delhi", "Quito", "Seoul", "Dakar", "Perth", "Austin", "Bergen"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "required": ["a", "b"],
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "day_after",
            "description": "The weekday n days after a weekday",
            "parameters": {
                "type": "object",
                "required": ["day", "n"],
                "properties": {"day": {"type": "string"}, "n": {"type": "integer"}},
            },
        },
    },
]


def _weather(city: str) -> dict:
    h = zlib.crc32(city.encode())
    return {"city": city, "weather": WEATHER[h % len(WEATHER)], "celsius": h % 35 - 5}


def _tool_use(r: random.Random) -> tuple[str, str, dict, dict, str]:
    """(question, tool name, arguments, reply, answer)."""
    kind = r.randrange(3)
    if kind == 0:
        city = r.choice(CITIES)
        w = _weather(city)
        return (
            f"What is the weather in {city} right now?",
            "get_weather",
            {"city": city},
            w,
            f"It is {w['weather']} in {city}, {w['celsius']} degrees Celsius.",
        )
    if kind == 1:
        a, b = r.randint(100, 999), r.randint(100, 999)
        return (
            f"Use the calculator to add {a} and {b}.",
            "add",
            {"a": a, "b": b},
            {"sum": a + b},
            f"{a} plus {b} is {a + b}.",
        )
    day, n = r.choice(corpus.DAYS), r.randint(1, 30)
    got = corpus.DAYS[(corpus.DAYS.index(day) + n) % 7]
    return (
        f"Which weekday is {n} days after {day}?",
        "day_after",
        {"day": day, "n": n},
        {"day": got},
        f"{n} days after {day} is {got}.",
    )


def chat(r: random.Random) -> dict:
    return dict(corpus.conversation(r), traffic="chat")


def thinking(r: random.Random) -> dict:
    question, answer = r.choice(corpus.TOPICS)(r)[0]
    reasoning = f"The user asks: {question} Working it out: {answer} So I answer that."
    return {
        "traffic": "thinking",
        "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "reasoning_content": reasoning, "content": answer},
        ],
    }


def _call_and_reply(name: str, args: dict, reply: dict, k: int) -> list[dict]:
    """An assistant turn calling tool ``name`` (Kimi's id ``functions.NAME:K``, K counting the conversation's calls)
    and the tool's reply to it."""
    call_id = f"functions.{name}:{k}"
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps(reply)},
    ]


def tool(r: random.Random) -> dict:
    question, name, args, reply, answer = _tool_use(r)
    return {
        "traffic": "tool",
        "tools": TOOLS,
        "messages": [{"role": "user", "content": question}]
        + _call_and_reply(name, args, reply, 0)
        + [{"role": "assistant", "content": answer}],
    }


def task(r: random.Random, calls: int, thinking: bool, first: int = 0) -> list[dict]:
    """One agentic task: a user asks ``calls`` questions at once; the assistant calls a tool for each (the
    conversation's calls ``first``, ``first`` + 1, ...), reads the replies and answers them all. With ``thinking``,
    each assistant turn carries its reasoning."""
    uses = [_tool_use(r) for _ in range(calls)]
    msgs: list[dict] = [{"role": "user", "content": " ".join(u[0] for u in uses)}]
    for i, (question, name, args, reply, _) in enumerate(uses):
        turns = _call_and_reply(name, args, reply, first + i)
        if thinking:
            turns[0]["reasoning_content"] = f"The user asks: {question} I call {name} with {json.dumps(args)}."
        msgs += turns
    answer = {"role": "assistant", "content": " ".join(u[4] for u in uses)}
    if thinking:
        answer["reasoning_content"] = "Reading the replies: " + " ".join(json.dumps(u[3]) for u in uses)
    return msgs + [answer]


def agentic(r: random.Random, tasks: int) -> dict:
    """A long agentic session: ``tasks`` tasks (1-4 tool calls each), a chat exchange between some, thinking in the
    last task only (Kimi's template drops the thinking of turns before the last user message, so an earlier turn
    keeps its rendering and the whole session is one sample). Call ids ``functions.NAME:K``, K counting the
    session's calls."""
    msgs: list[dict] = []
    calls = 0
    for t in range(tasks):
        if t and r.random() < 0.3:
            msgs += corpus.conversation(r)["messages"][:2]
        n = r.randint(1, 4)
        msgs += task(r, n, thinking=t == tasks - 1, first=calls)
        calls += n
    return {"traffic": "agentic", "tools": TOOLS, "messages": msgs}


def long_conversations(tokenizer, n: int, tokens: int, seed: int = 0) -> list[dict]:
    """``n`` agentic sessions of at least ``tokens`` tokens each as the tokenizer's chat template renders them
    (tasks added until they reach it)."""
    r, out = random.Random(seed), []
    for _ in range(n):
        tasks = max(1, tokens // 250)  # a task renders to ~100-300 tokens in Kimi's format
        while True:
            conv = agentic(random.Random(r.random()), tasks)
            text = tokenizer.apply_chat_template(conv["messages"], tools=conv["tools"], tokenize=False)
            got = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            if got >= tokens:
                break
            tasks = int(tasks * tokens / got) + 1
        out.append(conv)
    return out


def generate(n: int, seed: int = 0) -> list[dict]:
    """n conversations, the three kinds in turn (chat, thinking, tool, chat, ...)."""
    r = random.Random(seed)
    make = (chat, thinking, tool)
    return [make[i % 3](r) for i in range(n)]


def prompts(conversations: list[dict]) -> list[tuple[str, list[dict], list | None]]:
    """(traffic, messages before an assistant turn, tools) per conversation: chat and thinking up to their last
    assistant turn; tool conversations alternately up to the call and up to the answer after the reply; one with
    no assistant turn whole."""
    out = []
    for k, c in enumerate(conversations):
        msgs = c["messages"]
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"] or [len(msgs)]
        at = turns[-1] if c.get("traffic") != "tool" or k % 2 else turns[0]
        out.append((c.get("traffic", "chat"), msgs[:at], c.get("tools")))
    return out


def prompt_ids(tokenizer, conversations: list[dict]) -> list[tuple[str, list[int]]]:
    """(traffic, token ids) of each prompt of ``prompts``, rendered with the tokenizer's chat template and its
    generation prompt."""
    out = []
    for traffic, msgs, tools in prompts(conversations):
        text = tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
        out.append((traffic, tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out
