"""`eagle3 eval --server URL` against a local stand-in of a vLLM OpenAI server: its chat completions answer, and its
/metrics page holds vLLM's spec-decode counters in Prometheus' text format (two engines, counts from earlier
traffic). Acceptance comes from each prompt's counter deltas; looping outputs are counted apart."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eagle3 import cli
from eagle3.serve import server_eval

LOOP = "the cat sat on the mat and then " * 12
PROSE = (
    "Speculative decoding lets a small draft propose several tokens that the target checks in one forward pass; "
    "the accepted prefix is kept, the first rejected token is replaced by the target's own choice."
)


class FakeVLLM:
    """Counters per engine: [drafts, draft tokens, accepted, per position x3]; earlier traffic already counted."""

    def __init__(self, lag: int = 0):
        self.engines = {"0": [100, 300, 50, 30, 15, 5], "1": [40, 120, 90, 35, 30, 25]}
        self.calls, self.lag, self.pending = 0, lag, []  # lag: /metrics reads before a reply's counts show

    def metrics(self) -> str:
        if self.pending:
            self.pending[0][0] -= 1
            if self.pending[0][0] < 0:
                _, e, step = self.pending.pop(0)
                e[:] = [a + b for a, b in zip(e, step)]
        names = ["spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"]
        out = []
        for i, name in enumerate(names):
            out += [f"# HELP vllm:{name} x", f"# TYPE vllm:{name} counter"]
            for e, c in self.engines.items():
                out.append(f'vllm:{name}_total{{engine="{e}",model_name="kimi"}} {float(c[i])}')
                out.append(f'vllm:{name}_created{{engine="{e}",model_name="kimi"}} 1.7e9')
        for e, c in self.engines.items():
            for p in range(3):
                out.append(
                    f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="{e}",model_name="kimi",'
                    f'position="{p}"}} {float(c[3 + p])}'
                )
        return "\n".join(out) + "\n"

    def complete(self, body: dict) -> dict:
        looping = "repeat" in body["messages"][-1]["content"]
        e = self.engines[str(self.calls % 2)]  # the server spreads requests over its engines
        self.calls += 1
        # a normal prompt: 10 drafts, 20 of 30 accepted (9, 7, 4 by position); a loop: every draft token accepted
        step = [10, 30, 30, 10, 10, 10] if looping else [10, 30, 20, 9, 7, 4]
        if self.lag:
            self.pending.append([self.lag, e, step])
        else:
            e[:] = [a + b for a, b in zip(e, step)]
        text = LOOP if looping else PROSE
        return {"choices": [{"message": {"role": "assistant", "content": text}}], "usage": {"completion_tokens": 30}}


@pytest.fixture(params=[0, 1], ids=["counted-at-once", "counted-a-read-late"])
def server(request):
    fake = FakeVLLM(lag=request.param)

    class Handler(BaseHTTPRequestHandler):
        def _send(self, body: str, kind: str = "application/json"):
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/metrics":
                self._send(fake.metrics(), "text/plain")
            else:
                self._send(json.dumps({"data": [{"id": "kimi"}]}))

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if "refused" in body["messages"][-1]["content"]:  # vLLM's answer to a request it will not serve
                error = {"error": {"message": "the prompt is refused", "type": "BadRequestError", "code": 400}}
                data = json.dumps(error).encode()
                self.send_response(400)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self._send(json.dumps(fake.complete(body)))

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", fake
    httpd.shutdown()


def _conversations(n: int, loops: int) -> list[dict]:
    convs = []
    for i in range(n):
        ask = "please repeat yourself" if i < loops else f"question {i}"
        convs.append({"messages": [{"role": "user", "content": ask}, {"role": "assistant", "content": "old answer"}]})
    return convs


def test_acceptance_is_the_counters_deltas_over_this_run_with_loops_counted_apart(server):
    url, fake = server
    report = server_eval.measure(url, _conversations(5, 1), max_tokens=30)
    r = report.run
    assert (report.model, report.prompts, report.loops) == ("kimi", 5, 1)
    assert (r.drafts, r.draft_tokens, r.accepted) == (40, 120, 80)  # the 4 normal prompts, over both engines
    assert r.acceptance_length == pytest.approx(3.0) and r.per_position == pytest.approx([0.9, 0.7, 0.4])
    assert report.looped.acceptance_length == pytest.approx(4.0)  # the loop's perfect drafts, kept apart
    cumulative = 1 + sum(e[2] for e in fake.engines.values()) / sum(e[0] for e in fake.engines.values())
    assert abs(cumulative - r.acceptance_length) > 0.1  # the server's own average would have read otherwise
    assert r.tokens == 120 and r.seconds > 0


def test_the_server_gets_the_prompts_offline_eval_serves(server):
    """Each conversation up to its last assistant turn (kimi_traffic.prompts, as `eval --prompts`), the whole of one
    that has none, with its tools."""
    url, fake = server
    sent = []
    complete = fake.complete
    fake.complete = lambda body: sent.append(body) or complete(body)
    turns = [("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")]
    conv = {"messages": [{"role": r, "content": c} for r, c in turns], "tools": [{"type": "function"}]}
    server_eval.measure(url, [conv, {"messages": conv["messages"][:1]}], max_tokens=8)
    assert [b["messages"] for b in sent] == [conv["messages"][:3], conv["messages"][:1]]
    assert sent[0]["tools"] == conv["tools"] and "tools" not in sent[1] and sent[0]["temperature"] == 0


@pytest.mark.parametrize(
    "text, loop",
    [(LOOP, True), (PROSE, False), (PROSE + " " + PROSE, True), ("", False), ("ok " * 40, True)],
    ids=["loop", "prose", "prose-twice", "empty", "one-word"],
)
def test_an_output_is_a_loop_when_repeated_n_grams_cover_most_of_it(text, loop):
    assert server_eval.is_loop(text) == loop


def test_eval_server_writes_its_report_and_refuses_what_it_cannot_use(server, tmp_path, capsys):
    url, _ = server
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in _conversations(3, 0)))
    assert cli.main(["eval", "--server", url, "--prompts", str(data), "--out", str(tmp_path / "e")]) == 0
    saved = json.loads((tmp_path / "e" / "eval.json").read_text())
    assert saved["run"]["acceptance_length"] == pytest.approx(3.0) and saved["loops"] == 0
    assert "acceptance     3.000" in capsys.readouterr().out
    assert cli.main(["eval", "--server", url, "--out", str(tmp_path / "f")]) == 2
    assert "give --prompts" in capsys.readouterr().err
    assert (
        cli.main(["eval", "--server", url, "--prompts", str(data), "--target", "T", "--out", str(tmp_path / "g")]) == 2
    )
    assert cli.main(["eval", "--prompts", str(data), "--out", str(tmp_path / "h")]) == 2
    assert "eval needs --target and --draft" in capsys.readouterr().err


def test_a_request_the_server_refuses_is_named_with_the_server_s_message_and_leaves_nothing(server, tmp_path, capsys):
    """A 400 from the server names the prompt's line in --prompts and vLLM's own message, in one line, exit 1; the
    --out folder the run began is removed. A server that is not there is said so."""
    url, _ = server
    convs = _conversations(3, 0)
    convs[1]["messages"][0]["content"] = "this one is refused"
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in convs))
    out = tmp_path / "e"
    assert cli.main(["eval", "--server", url, "--prompts", str(data), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"{data} line 2" in err and "HTTP 400" in err and "the prompt is refused" in err, err
    assert "Traceback" not in err and not out.exists()
    with pytest.raises(server_eval.ServerError, match="cannot reach"):
        server_eval.measure("http://127.0.0.1:9", convs[:1], max_tokens=4, model="m", timeout=5)
