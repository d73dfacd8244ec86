"""Acceptance as operators measure it: a running OpenAI-compatible vLLM server, prompted through its chat
completions API, its speculative-decoding counters read from its Prometheus /metrics before and after each prompt.

The figures come from the counters' deltas over this run, not the server's cumulative average (other traffic before
it is left out), one prompt at a time so each prompt's counts are its own. A prompt whose output falls into a loop
(repeated n-grams over most of it) is counted apart: a loop is easy to draft and inflates acceptance."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

from eagle3.data import kimi_traffic
from eagle3.serve.evaluate import COUNTERS, PER_POSITION, SpecRun, no_counters, spec_run

SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")


def read_counters(text: str) -> dict:
    """The spec-decode counters of a /metrics page (Prometheus writes each as NAME_total), summed over engines:
    drafts, draft_tokens, accepted, per_pos."""
    out = no_counters()
    pos: dict[int, float] = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if not m or line.startswith("#"):
            continue
        name, labels, value = m.group(1).removesuffix("_total"), m.group(2) or "", float(m.group(3))
        if name in COUNTERS:
            out[COUNTERS[name]] += int(value)
        elif name == PER_POSITION:
            p = int(re.search(r'position="(\d+)"', labels).group(1))
            pos[p] = pos.get(p, 0) + value
    out["per_pos"] = [int(pos.get(p, 0)) for p in range(max(pos) + 1)] if pos else []
    return out


def repeated_share(text: str, n: int = 8) -> float:
    """The share of the output's words inside an n-gram of words that occurs more than once in it."""
    words = re.findall(r"\w+|[^\w\s]", text)
    if len(words) < 2 * n:
        return 0.0
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    counts = Counter(grams)
    covered = [False] * len(words)
    for i, g in enumerate(grams):
        if counts[g] > 1:
            covered[i : i + n] = [True] * n
    return sum(covered) / len(words)


def is_loop(text: str, share: float = 0.5) -> bool:
    return repeated_share(text) > share


@dataclass
class ServerReport:
    url: str
    model: str
    run: SpecRun  # the prompts whose outputs did not loop
    prompts: int
    loops: int  # prompts whose outputs looped, counted apart
    looped: SpecRun | None = None
    notes: list = field(default_factory=list)

    def lines(self) -> list[str]:
        r = self.run
        out = [
            f"server         {self.url} ({self.model}): {self.prompts} prompts, {self.loops} looped (counted apart)",
            f"acceptance     {r.acceptance_length:.3f} +- {r.acceptance_se:.3f} tokens a step "
            f"({r.accepted} of {r.draft_tokens} draft tokens in {r.drafts} drafts)",
            "per position   " + ", ".join(f"{p:.3f}" for p in r.per_position),
            f"throughput     {r.tokens / r.seconds if r.seconds else 0:,.1f} output tok/s, one prompt at a time",
        ]
        if self.looped is not None:
            out.append(f"looped         acceptance {self.looped.acceptance_length:.3f} on the looping outputs")
        return out + [f"note           {n}" for n in self.notes]


def _get(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


class ServerError(RuntimeError):
    """The server refused a prompt (``index``: its place in the conversations given) or could not be reached."""

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.index = index


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _refusal(e: urllib.error.HTTPError) -> str:
    """The server's own message from an error reply (vLLM: {"error": {"message": ...}}), else its text."""
    text = e.read().decode(errors="replace")
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:500] or e.reason


def settled_counters(base: str, timeout: float, tries: int = 40, pause: float = 0.05) -> dict:
    """The counters once two reads in a row agree: the engine may record a request's last steps just after the
    reply, and a late count would be taken for the next prompt's."""
    last = read_counters(_get(base + "/metrics", timeout))
    for _ in range(tries):
        time.sleep(pause)
        now = read_counters(_get(base + "/metrics", timeout))
        if now == last:
            return now
        last = now
    return last


def _sum(runs: list[tuple[dict, dict, int, float]]) -> SpecRun:
    """One SpecRun over several prompts' (counters before, after, output tokens, seconds)."""
    total = no_counters()
    for before, after, _, _ in runs:
        for k in ("drafts", "draft_tokens", "accepted"):
            total[k] += after[k] - before[k]
        per = [a - b for a, b in zip(after["per_pos"], before["per_pos"] or [0] * len(after["per_pos"]))]
        total["per_pos"] = [a + b for a, b in zip(total["per_pos"] or [0] * len(per), per)]
    return spec_run(no_counters(), total, sum(r[2] for r in runs), sum(r[3] for r in runs))


def measure(url: str, conversations: list[dict], max_tokens: int = 256, model: str | None = None,
            timeout: float = 600.0) -> ServerReport:  # fmt: skip
    """Each conversation's prompt through the server's chat completions (greedy), its counters' deltas its own."""
    base = url.rstrip("/")
    try:
        model = model or _first_model(base, timeout)
        read_counters(_get(base + "/metrics", timeout))
    except urllib.error.HTTPError as e:
        raise ServerError(f"{e.url} answered HTTP {e.code}: is {base} a vLLM server?") from None
    except urllib.error.URLError as e:
        raise ServerError(f"cannot reach {base} ({e.reason}): is `vllm serve` running there?") from None
    runs: list[tuple[dict, dict, int, float]] = []
    loops: list[tuple[dict, dict, int, float]] = []
    for k, (traffic, msgs, tools) in enumerate(kimi_traffic.prompts(conversations)):  # as `eval --prompts` offline
        body = {"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0}
        if tools:
            body["tools"] = tools
        before, t0 = read_counters(_get(base + "/metrics", timeout)), time.perf_counter()
        try:
            reply = _post(base + "/v1/chat/completions", body, timeout)
        except urllib.error.HTTPError as e:
            raise ServerError(f"{traffic} prompt: {base} answered HTTP {e.code}: {_refusal(e)}", k) from None
        seconds = time.perf_counter() - t0
        after = settled_counters(base, timeout)
        text = reply["choices"][0]["message"].get("content") or ""
        run = (before, after, int(reply.get("usage", {}).get("completion_tokens", 0)), seconds)
        (loops if is_loop(text) else runs).append(run)
    main = _sum(runs)
    notes = [] if main.drafts else ["no drafts counted: is the server running with a speculative config?"]
    return ServerReport(base, model, main, len(conversations), len(loops), _sum(loops) if loops else None, notes)


def _first_model(base: str, timeout: float) -> str:
    """The first model the server serves (GET /v1/models)."""
    return json.loads(_get(base + "/v1/models", timeout))["data"][0]["id"]
