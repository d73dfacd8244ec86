"""`eagle3 regenerate`: the target writes the assistant turns; thinking and tool calls kept as structured fields;
kill -9 anywhere and the same command completes the file with no line lost or written twice; never overwrites."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle3 import cli
from eagle3.data import kimi_traffic
from eagle3.extract import regenerate
from eagle3.extract.regenerate import RegenConfig, RegenError, parse_turn
from eagle3.targets import tiny

from .conftest import run_command

KIMI_CALL = (
    "<think>Look it up.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>'
)


def test_the_target_s_kimi_text_becomes_structured_fields():
    got = parse_turn(KIMI_CALL, kimi=True)
    assert got == {
        "role": "assistant",
        "reasoning_content": "Look it up.",
        "content": "",
        "tool_calls": [
            {
                "id": "functions.get_weather:0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    }
    assert parse_turn("<think></think>Foggy.", kimi=True) == {"role": "assistant", "content": "Foggy."}
    assert parse_turn("<think>x</think>Foggy.", kimi=False)["content"] == "<think>x</think>Foggy."


def test_a_turn_cut_inside_its_thinking_keeps_the_thinking_as_thinking():
    """max_tokens reached before </think>: the text so far is the reasoning (the template writes <think>...; as
    content it would render after an empty <think></think>, which the target never wrote)."""
    assert parse_turn("<think>Let me th", kimi=True) == {
        "role": "assistant",
        "reasoning_content": "Let me th",
        "content": "",
    }


TEXT = st.text(st.sampled_from("abc XYZ019 .,:;!?_-\n{}\"'日本"), max_size=24)
NAMES = st.text(st.sampled_from("abcxyz_-.0123"), min_size=1, max_size=12).filter(lambda n: n[0].isalpha())


@st.composite
def assistant_turns(draw):
    """An assistant message as the target's chat template renders it: thinking (or none), text, 0-3 tool calls with
    names that may hold dots (an MCP server's "server.tool") and Kimi's ids functions.NAME:I."""
    m = {"role": "assistant", "content": draw(TEXT)}
    reasoning = draw(TEXT)
    if reasoning:
        m["reasoning_content"] = reasoning
    calls = draw(st.lists(st.tuples(NAMES, st.dictionaries(st.sampled_from("abq"), st.integers(-9, 99))), max_size=3))
    if calls:
        m["tool_calls"] = [
            {"id": f"functions.{n}:{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a) in enumerate(calls)
        ]
    return m


@settings(max_examples=60, deadline=None)
@given(turn=assistant_turns())
def test_a_turn_the_template_renders_parses_back_to_itself(kimi_tokenizer, turn):
    """What the target writes in Kimi-K2's format (the template's rendering of a turn) parses back to the same
    thinking, text and calls: regenerate's structured fields lose nothing and add nothing, so the data re-renders to
    the target's words and a call equal to the data's is seen as equal (vLLM's kimi_k2 parser takes the name as the id
    before ":", less "functions.": a dotted name stays whole)."""
    from eagle3.data import masks

    msgs = [{"role": "user", "content": "q"}, turn]
    text = masks.chat(kimi_tokenizer, msgs)[len(masks.chat(kimi_tokenizer, msgs[:1], gen=True)) :]
    assert text.endswith("<|im_end|>")
    assert parse_turn(text[: -len("<|im_end|>")], kimi=True) == turn


@pytest.fixture(scope="module")
def kimi_target(tmp_path_factory):
    """A config + Kimi-format tokenizer folder (the generator is scripted, so no weights are read)."""
    out = tmp_path_factory.mktemp("kimi-target")
    tiny.build_tokenizer(out, 1024, chat_format="kimi")
    return out


@pytest.fixture(scope="module")
def kimi_tokenizer(kimi_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(kimi_target)


class Scripted:
    """A generator that answers each prompt with the next scripted text (its ids, then the end token)."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.prompts = tok, list(texts), []

    def __call__(self, prompts, seeds, cfg, stops):
        self.prompts += [self.tok.decode(p) for p in prompts]
        return [
            self.tok(self.texts.pop(0), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            for _ in prompts
        ]


def _data(tmp_path, lines):
    p = tmp_path / "in.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return p


def test_each_turn_is_written_on_the_regenerated_history_and_a_same_call_keeps_the_tool_reply(
    tmp_path, kimi_target, kimi_tokenizer
):
    tok = kimi_tokenizer
    conv = next(c for c in kimi_traffic.generate(3, seed=5) if c["traffic"] == "tool")
    call = conv["messages"][1]["tool_calls"][0]
    conv["messages"][1]["tool_calls"][0] = dict(call, id="call_7")  # the data's own id; its reply answers it
    conv["messages"][2]["tool_call_id"] = "call_7"
    args = call["function"]["arguments"]
    said = (
        "<think>Need the tool.</think><|tool_calls_section_begin|><|tool_call_begin|>functions."
        f"{call['function']['name']}:0<|tool_call_argument_begin|>{args}<|tool_call_end|><|tool_calls_section_end|>"
    )
    gen = Scripted(tok, [said, "<think>Read it.</think>Done."])
    cfg = RegenConfig(target=str(kimi_target), data=str(_data(tmp_path, [conv])), out=str(tmp_path / "out.jsonl"))
    s = regenerate.run(cfg, generator=gen)
    (row,) = [json.loads(x) for x in Path(cfg.out).read_text().splitlines()]
    m = row["messages"]
    assert m[1]["reasoning_content"] == "Need the tool." and m[1]["tool_calls"][0]["id"] == "call_7"
    assert m[2] == conv["messages"][2] and m[3] == {
        "role": "assistant",
        "reasoning_content": "Read it.",
        "content": "Done.",
    }
    assert row["regenerated"] == {
        "line": 1,
        "turns": [1, 3],
        "tokens": row["regenerated"]["tokens"],
        "finish": ["stop", "stop"],
        "cut_after": None,
    }
    assert row["tools"] == conv["tools"] and row["traffic"] == "tool"
    assert "Need the tool." in gen.prompts[1]  # the second turn saw the regenerated first
    assert s.written == 1 and s.cut == 0
    # the file reads back as data: the mask learns the regenerated thinking and call
    from eagle3.data.conversations import DataConfig, load_samples

    (sample,), rep = load_samples(DataConfig([cfg.out]), tok)
    assert "Need the tool." in tok.decode([t for t, k in zip(sample.input_ids, sample.loss_mask) if k])
    assert not rep.rejected


def test_another_call_ends_the_conversation_and_last_mode_writes_only_the_last_turn(
    tmp_path, kimi_target, kimi_tokenizer
):
    tok = kimi_tokenizer
    conv = next(c for c in kimi_traffic.generate(3, seed=5) if c["traffic"] == "tool")
    other = KIMI_CALL  # get_weather for Oslo, which the data did not ask
    cfg = RegenConfig(target=str(kimi_target), data=str(_data(tmp_path, [conv])), out=str(tmp_path / "a.jsonl"))
    regenerate.run(cfg, generator=Scripted(tok, [other.replace("Oslo", "Nowhere")]))
    row = json.loads(Path(cfg.out).read_text())
    assert row["regenerated"]["cut_after"] == 1 and len(row["messages"]) == 2
    chat = kimi_traffic.generate(1, seed=9)[0]
    cfg = RegenConfig(
        target=str(kimi_target), data=str(_data(tmp_path, [chat])), out=str(tmp_path / "b.jsonl"), mode="last"
    )
    regenerate.run(cfg, generator=Scripted(tok, ["Fine."]))
    row = json.loads(Path(cfg.out).read_text())
    turns = [i for i, m in enumerate(chat["messages"]) if m["role"] == "assistant"]
    assert row["regenerated"]["turns"] == turns[-1:] and row["messages"][turns[-1]]["content"] == "Fine."
    assert [m for i, m in enumerate(row["messages"]) if i != turns[-1]] == [
        dict(m, weight=0) if i in turns else m for i, m in enumerate(chat["messages"]) if i != turns[-1]
    ]


def _learned(tok, path):
    """The text of each sample's loss-masked tokens, as extract learns the file."""
    from eagle3.data.conversations import DataConfig, load_samples

    samples, _ = load_samples(DataConfig([str(path)]), tok)
    return [tok.decode([t for t, k in zip(s.input_ids, s.loss_mask) if k]) for s in samples]


def test_a_turn_of_weight_0_stays_out_of_the_loss_after_regeneration(tmp_path, kimi_target, kimi_tokenizer):
    """A turn the data keeps out of the loss (weight 0) is not regenerated, and the output says weight 0 again: a
    line without it would put the data's excluded words back into the loss."""
    tok = kimi_tokenizer
    chat = kimi_traffic.generate(1, seed=0)[0]  # five assistant turns
    turns = [i for i, m in enumerate(chat["messages"]) if m["role"] == "assistant"]
    chat["messages"][turns[1]] = dict(chat["messages"][turns[1]], content="EXCLUDED words", weight=0)
    cfg = RegenConfig(target=str(kimi_target), data=str(_data(tmp_path, [chat])), out=str(tmp_path / "o.jsonl"))
    regenerate.run(cfg, generator=Scripted(tok, [f"Said {k}." for k in range(len(turns) - 1)]))
    row = json.loads(Path(cfg.out).read_text())
    assert row["regenerated"]["turns"] == [i for i in turns if i != turns[1]]
    assert row["messages"][turns[1]] == {"role": "assistant", "content": "EXCLUDED words", "weight": 0}
    (learned,) = _learned(tok, cfg.out)
    assert "EXCLUDED" not in learned and all(f"Said {k}." in learned for k in range(len(turns) - 1))


def test_last_mode_keeps_the_datas_earlier_turns_as_context_only(tmp_path, kimi_target, kimi_tokenizer):
    """--mode last: the earlier assistant turns are the data's words, not the target's, so they are written with
    weight 0 and extract learns only what the target wrote (as extract --regenerate stores it in one pass)."""
    tok = kimi_tokenizer
    chat = kimi_traffic.generate(1, seed=0)[0]
    turns = [i for i, m in enumerate(chat["messages"]) if m["role"] == "assistant"]
    cfg = RegenConfig(
        target=str(kimi_target), data=str(_data(tmp_path, [chat])), out=str(tmp_path / "o.jsonl"), mode="last"
    )
    regenerate.run(cfg, generator=Scripted(tok, ["Only mine."]))
    row = json.loads(Path(cfg.out).read_text())
    assert [row["messages"][i].get("weight", 1) for i in turns] == [0] * (len(turns) - 1) + [1]
    (learned,) = _learned(tok, cfg.out)
    assert learned == "<think></think>Only mine.<|im_end|>"  # the target's turn as the template closes it, alone


def test_a_turn_cut_inside_a_character_keeps_only_the_whole_characters(tmp_path, kimi_target, kimi_tokenizer):
    """max_tokens can end a turn inside a character's bytes (a byte-level tokenizer: CJK text, emoji). Decoded, the
    partial bytes are U+FFFD, which re-encodes to other tokens than the target's: the turn keeps its whole
    characters only, and the record counts the tokens kept, so extract learns exactly tokens the target wrote."""
    tok = kimi_tokenizer
    ids = tok("<think></think>Fine 日本", add_special_tokens=False)["input_ids"][:-1]  # 本's last byte not written
    assert tok.decode(ids).endswith("\ufffd") and not tok.decode(ids[:-2]).endswith("\ufffd")

    def cut(prompts, seeds, cfg, stops):
        return [list(ids) for _ in prompts]

    chat = kimi_traffic.generate(3, seed=2)[0]  # one assistant turn
    cfg = RegenConfig(
        target=str(kimi_target), data=str(_data(tmp_path, [chat])), out=str(tmp_path / "o.jsonl"), max_tokens=len(ids)
    )
    regenerate.run(cfg, generator=cut)
    row = json.loads(Path(cfg.out).read_text())
    (i,) = row["regenerated"]["turns"]
    assert row["messages"][i]["content"] == "Fine 日"
    assert row["regenerated"]["finish"] == ["length"] and row["regenerated"]["tokens"] == [len(ids) - 2]
    (learned,) = _learned(tok, cfg.out)
    assert learned == "<think></think>Fine 日"  # no end-of-turn token (cut), no U+FFFD's bytes


def test_blank_lines_and_duplicates_are_counted(tmp_path, kimi_target, kimi_tokenizer):
    """Every input line is accounted for: a blank line is counted, and a duplicate of an earlier line is counted
    (and regenerated: sampled, its turns differ; `extract --dedup` drops equal results)."""
    tok = kimi_tokenizer
    a, b = kimi_traffic.generate(3, seed=2)[:2]
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps(a) + "\n\n" + json.dumps(a) + "\n" + json.dumps(b) + "\n   \n")
    cfg = RegenConfig(target=str(kimi_target), data=str(data), out=str(tmp_path / "o.jsonl"), mode="last")
    s = regenerate.run(cfg, generator=Scripted(tok, ["One.", "Two.", "Three."]))
    assert (s.written, s.blank_lines, s.duplicates, s.skipped) == (3, 2, 1, 0)
    assert "2 blank lines" in s.line() and "1 duplicate of an earlier line" in s.line(), s.line()


def test_never_overwrites_and_refuses_other_settings(tmp_path, kimi_target):
    data = _data(tmp_path, kimi_traffic.generate(2, seed=1))
    mine = tmp_path / "notes.jsonl"
    mine.write_text("my own file\n")
    argv = ["regenerate", "--target", str(kimi_target), "--data", str(data)]
    assert cli.main(argv + ["--out", str(mine)]) == 2
    assert mine.read_text() == "my own file\n" and not (tmp_path / "notes.jsonl.regen.json").exists()
    cfg = RegenConfig(target=str(kimi_target), data=str(data), out=str(tmp_path / "o.jsonl"))
    regenerate.open_output(cfg)
    with pytest.raises(RegenError, match="temperature differ"):
        regenerate.check_output(RegenConfig(target=str(kimi_target), data=str(data), out=cfg.out, temperature=0.7))
    assert regenerate.check_output(cfg) is True  # the same settings resume


def _cli(args, env=None):
    """The command as it runs (conftest.run_command: a child forked from this process, killed for real by a fault)."""
    return run_command(args, env, timeout=300)[0]


LINES = [
    {"messages": [{"role": "user", "content": f"Count from {i} to {i + 3}."}, {"role": "assistant", "content": "x"}]}
    for i in range(5)
]


@pytest.fixture(scope="module")
def regen_args(tiny_llama, tmp_path_factory):
    """The input (line 3 broken JSON, line 4 blank), the command's arguments (sampled: temperature 0.9, seed 4), and
    the file an uninterrupted run writes."""
    tmp = tmp_path_factory.mktemp("regen")
    data = tmp / "in.jsonl"
    data.write_text(
        json.dumps(LINES[0])
        + "\n"
        + json.dumps(LINES[1])
        + "\n{broken\n\n"
        + "".join(json.dumps(x) + "\n" for x in LINES[2:])
    )
    args = [
        "regenerate",
        "--target",
        str(tiny_llama),
        "--data",
        str(data),
        "--temperature",
        "0.9",
        "--seed",
        "4",
        "--max-tokens",
        "12",
    ]
    whole = _cli(args + ["--out", str(tmp / "whole.jsonl")])
    assert whole.returncode == 0, whole.stderr
    assert "regenerated 5 conversations" in whole.stdout and "skipped 1 bad line," in whole.stdout, whole.stdout
    assert "1 blank line" in whole.stdout, whole.stdout
    return args, (tmp / "whole.jsonl").read_text()


@pytest.mark.parametrize("fault", ["mid_line:3", "after_line:2"])
def test_kill_9_then_the_same_command_completes_the_file_with_no_line_lost_or_twice(tmp_path, regen_args, fault):
    """hf backend on tiny-llama, sampled (each line's seed is its own, so a resumed run draws what an uninterrupted one
    does): killed mid-line (a torn line) or between lines, then rerun."""
    args, whole = regen_args
    args = args + [
        "--batch-size",
        "2",
    ]  # the uninterrupted run took them in one batch: the output does not depend on it
    killed = _cli(args + ["--out", str(tmp_path / "cut.jsonl")], env={"EAGLE3_FAULT": fault})
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-2000:])
    again = _cli(args + ["--out", str(tmp_path / "cut.jsonl")])
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "cut.jsonl").read_text() == whole
    rows = [json.loads(x) for x in whole.splitlines()]
    assert [r["regenerated"]["line"] for r in rows] == [1, 2, 5, 6, 7]
    assert all(r["messages"][1]["content"] != "x" for r in rows)


def test_the_vllm_backend_batches_conversations_with_a_seed_and_the_end_tokens_per_request(
    tmp_path, kimi_target, kimi_tokenizer, monkeypatch
):
    """No GPU here: a stand-in for vllm.LLM records what the backend asks. One generate per turn round over the batch,
    each request with its line's seed, the target's end-of-turn tokens as stops, the sampling settings."""
    import sys
    import types

    tok = kimi_tokenizer
    calls = []

    engines, shut = [], []

    class LLM:
        def __init__(self, **kw):
            self.kw = kw
            engines.append(kw)
            self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(shutdown=lambda: shut.append(1)))

        def generate(self, prompts, params, use_tqdm=False):
            calls.append((len(prompts), [p.kw for p in params]))
            ids = tok("<think></think>Fine.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=ids)]) for _ in prompts]

    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams))
    chats = [c for c in kimi_traffic.generate(9, seed=2) if c["traffic"] == "chat"]  # 3 chats of 1-6 turns
    cfg = RegenConfig(
        target=str(kimi_target),
        data=str(_data(tmp_path, chats)),
        out=str(tmp_path / "o.jsonl"),
        backend="vllm",
        temperature=0.6,
        top_p=0.9,
        max_tokens=40,
        seed=3,
        gpu_memory_utilization=0.3,
    )
    s = regenerate.run(cfg)
    assert engines[0]["gpu_memory_utilization"] == 0.3 and shut == [1]  # its share, and freed at the end
    turns = [sum(m["role"] == "assistant" for m in c["messages"]) for c in chats]
    assert [n for n, _ in calls] == [sum(t > r for t in turns) for r in range(max(turns))]  # a call per round
    first = calls[0][1]
    assert [p["seed"] for p in first] == [3 * regenerate.SEED_STRIDE + n for n in (1, 2, 3)]
    assert {(p["temperature"], p["top_p"], p["max_tokens"]) for p in first} == {(0.6, 0.9, 40)}
    assert all(tok.eos_token_id in p["stop_token_ids"] for p in first)
    assert s.written == 3 and s.tokens == sum(turns) * len(
        tok("<think></think>Fine.", add_special_tokens=False)["input_ids"]
    ) + sum(turns)


# -- round three of what the suite missed (issue 70) -----------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    a=st.tuples(st.integers(1, 10**8), st.integers(0, 255)),
    b=st.tuples(st.integers(1, 10**8), st.integers(0, 255)),
)
def test_every_line_and_turn_draws_its_own_seed(seed, a, b):
    """At 962a6d4 line 7920's first turn drew line 1's second turn's seed (line + 7919 k): two conversations of a long
    file sampled alike. Turn 0 keeps seed * 1000003 + line (extract --regenerate draws it too)."""
    from eagle3.extract.regenerate import turn_seed

    assert turn_seed(seed, a[0], 0) == seed * 1_000_003 + a[0]
    assert turn_seed(seed, 1, 1) != turn_seed(seed, 7920, 0)
    assert (turn_seed(seed, *a) == turn_seed(seed, *b)) == (a == b)


def test_max_samples_counts_the_conversations_written_across_a_resume(tmp_path, kimi_target, kimi_tokenizer):
    """--max-samples is the conversations OUT holds. At 962a6d4 a resumed run counted from the last input line written,
    so the blank and bad lines before it were taken for conversations: 3 written of 5."""
    one = [
        {"messages": [{"role": "user", "content": f"Q{i}?"}, {"role": "assistant", "content": "x"}]} for i in range(8)
    ]
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps(one[0]) + "\n\n{broken\n" + "".join(json.dumps(x) + "\n" for x in one[1:]))
    cfg = RegenConfig(
        target=str(kimi_target), data=str(data), out=str(tmp_path / "out.jsonl"), max_samples=5, batch_size=1
    )

    class Stop(Exception):
        pass

    written = []

    def stop_after_two(point):
        if point == "after_line":
            written.append(1)
            if len(written) == 2:
                raise Stop

    with pytest.raises(Stop):
        regenerate.run(cfg, Scripted(kimi_tokenizer, ["a"] * 8), fault=stop_after_two)
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2  # lines 1 and 4
    regenerate.run(cfg, Scripted(kimi_tokenizer, ["a"] * 8))
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["regenerated"]["line"] for r in rows] == [1, 4, 5, 6, 7]


def test_a_turn_ends_on_any_of_the_target_s_end_of_turn_ids(tmp_path, kimi_tokenizer):
    """generation_config.json may list several end-of-turn ids, none of them the tokenizer's eos: a turn that ends on
    any of them is ended ("stop", its end token learned); one that stops on another token was cut ("length")."""
    target = tmp_path / "t"
    kimi_tokenizer.save_pretrained(target)
    a, b = kimi_tokenizer.convert_tokens_to_ids(["[EOS]", "<|im_user|>"])
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [a, b]}))
    data = _data(
        tmp_path,
        [
            {"messages": [{"role": "user", "content": f"Q{i}?"}, {"role": "assistant", "content": "x"}]}
            for i in range(3)
        ],
    )
    words = kimi_tokenizer("Fine.", add_special_tokens=False)["input_ids"]

    def ends(prompts, seeds, cfg, stops):
        assert {a, b, kimi_tokenizer.eos_token_id} <= stops
        return [words + [a], words + [b], words]

    cfg = RegenConfig(target=str(target), data=str(data), out=str(tmp_path / "o.jsonl"), batch_size=3)
    regenerate.run(cfg, ends)
    rows = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [r["regenerated"]["finish"] for r in rows] == [["stop"], ["stop"], ["length"]]
    assert [r["messages"][1]["content"] for r in rows] == ["Fine."] * 3


@settings(max_examples=80, deadline=None)
@given(text=st.text(st.sampled_from("ab é日𝄞😀"), min_size=1, max_size=12))
def test_a_cut_inside_a_character_of_any_utf8_length_keeps_exactly_the_whole_characters(kimi_tokenizer, text):
    """Cut after every token of a text of 1-, 2-, 3- and 4-byte characters: what is kept decodes to the longest prefix
    of whole characters the tokens hold, never a U+FFFD, never a whole character less."""
    from eagle3.extract.regenerate import whole_characters

    tok = kimi_tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for k in range(1, len(ids) + 1):
        kept = tok.decode(whole_characters(ids[:k], tok))
        raw = tok.decode(ids[:k])
        assert "\ufffd" not in kept and text.startswith(kept), (text, k)
        assert kept == raw.split("\ufffd")[0], (text, k, raw)
