"""Tool-call ids as Kimi writes them: OpenAI ids (call_...) rendered through Kimi-K2's template become
functions.NAME:INDEX (INDEX counting the conversation's calls from 0), the results that answer them follow, and the
tokens equal those of the same conversation written in Kimi's own id form. The calls parse back as vLLM's kimi_k2
parser reads them (regenerate.parse_turn, its rule; tests/gpu/test_kimi_tool_parser.py runs vLLM's own)."""

import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle3.data import kimi_traffic, masks, tool_ids
from eagle3.data.conversations import DataConfig, load_samples
from eagle3.extract.regenerate import parse_turn
from eagle3.targets import tiny

TOOLS = kimi_traffic.TOOLS


def _call(cid, name, args):
    return {
        **({"id": cid} if cid is not None else {}),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


def agentic(ids: list[str | None], result_ids: list[str | None] | None = None) -> dict:
    """Two calling turns (two calls, then one), each answered, then a reply; the calls' ids are ``ids``."""
    a, b, c = ids
    ra, rb, rc = result_ids if result_ids is not None else ids
    return {
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "Weather in Oslo and 2+3?"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "Two tools.",
                "tool_calls": [_call(a, "get_weather", {"city": "Oslo"}), _call(b, "add", {"a": 2, "b": 3})],
            },
            {"role": "tool", **({"tool_call_id": ra} if ra else {}), "content": '{"weather": "foggy"}'},
            {"role": "tool", **({"tool_call_id": rb} if rb else {}), "content": "5"},
            {
                "role": "assistant",
                "content": "And the day after Monday?",
                "tool_calls": [_call(c, "day_after", {"day": "Mon", "n": 1})],
            },
            {"role": "tool", **({"tool_call_id": rc} if rc else {}), "content": "Tuesday"},
            {"role": "assistant", "content": "Foggy, 5, Tuesday."},
        ],
    }


KIMI_IDS = ["functions.get_weather:0", "functions.add:1", "functions.day_after:2"]


@pytest.fixture(scope="module")
def kimi_tok(tmp_path_factory):
    return tiny.build_tokenizer(tmp_path_factory.mktemp("kimi-tok"), 1024, chat_format="kimi")


def _load(tmp_path, tok, lines):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return load_samples(DataConfig([str(p)], max_len=4096), tok)


@pytest.mark.parametrize(
    "given_ids,result_ids",
    [
        (["call_1", "call_2", "call_3"], None),  # OpenAI's ids, each result naming its call
        (["call_0", "call_1", "call_0"], None),  # ids reused across turns, as some exports write them
        ([None, None, None], [None, None, None]),  # no ids at all (ShareGPT): results answer in order
        (["call_a", "call_b", "call_c"], ["call_b", "call_a", "call_c"]),  # results in another order than the calls
    ],
)
def test_openai_ids_render_as_kimi_writes_them(tmp_path, kimi_tok, caplog, given_ids, result_ids):
    """At 962a6d4 an id "call_1" rendered as <|tool_call_begin|>call_1<|tool_call_argument_begin|>: tokens Kimi never
    writes, the name nowhere, and the log said the template had dropped the calls."""
    with caplog.at_level(logging.WARNING):
        samples, report = _load(tmp_path, kimi_tok, [agentic(given_ids, result_ids)])
    expected = agentic(KIMI_IDS)
    if result_ids is not None and result_ids[0] == "call_b":  # the results answer add, then get_weather
        expected = agentic(KIMI_IDS, [KIMI_IDS[1], KIMI_IDS[0], KIMI_IDS[2]])
    (ref, *_), ref_report = _load(tmp_path, kimi_tok, [expected])
    assert samples[0].input_ids == ref.input_ids and samples[0].loss_mask == ref.loss_mask
    text = kimi_tok.decode(ref.input_ids)
    for cid in KIMI_IDS:
        assert f"<|tool_call_begin|>{cid}<|tool_call_argument_begin|>" in text
    rendered = kimi_tok.decode(samples[0].input_ids)
    assert not [g for g in given_ids if g and (f">{g}<" in rendered or f"Return of {g}\n" in rendered)], rendered
    assert report.template_dropped == {} and ref_report.template_dropped == {} and ref_report.tool_ids == {}
    assert report.tool_ids == {"assistant.tool_calls.id": 3, "tool.tool_call_id": 3}
    assert (
        "tool-call ids written as the target writes them (functions.NAME:INDEX): 3 calls, 3 results" in report.summary()
    )
    assert "dropped" not in caplog.text and "tool-call ids rewritten" in caplog.text


def test_the_calls_parse_back_by_name_arguments_and_id(kimi_tok):
    conv = agentic(["call_1", "call_2", "call_3"])
    msgs = conv["messages"]
    for turn, ids in ((1, KIMI_IDS[:2]), (4, KIMI_IDS[2:])):
        head = masks.chat(kimi_tok, msgs[:turn], conv["tools"], gen=True)
        text = masks.chat(kimi_tok, msgs[: turn + 1], conv["tools"])[len(head) :].removesuffix("<|im_end|>")
        parsed = parse_turn(text, kimi=True)
        assert [c["id"] for c in parsed["tool_calls"]] == ids
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed["tool_calls"]] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msgs[turn]["tool_calls"]
        ]


def test_kimi_form_ids_are_kept_and_other_templates_get_the_data_s_ids(tmp_path, kimi_tok, tokenizer):
    kept = agentic(["functions.get_weather:7", "functions.add:8", "functions.day_after:9"])
    (s,), report = _load(tmp_path, kimi_tok, [kept])
    assert report.tool_ids == {}
    assert "<|tool_call_begin|>functions.add:8<|tool_call_argument_begin|>" in kimi_tok.decode(s.input_ids)
    msgs = agentic(["call_1", "call_2", "call_3"])["messages"]
    assert tool_ids.style(tokenizer) is None  # tiny-kimi's ChatML template
    assert tool_ids.as_target_writes(msgs, tool_ids.style(tokenizer)) == (msgs, {})


def test_a_kimi_form_id_of_another_name_is_rewritten(kimi_tok):
    msgs = agentic(["functions.add:0", "call_2", "call_3"])["messages"]
    out, changed = tool_ids.as_target_writes(msgs, tool_ids.KIMI_K2)
    assert [c["id"] for c in out[1]["tool_calls"]] == KIMI_IDS[:2]
    assert out[2]["tool_call_id"] == KIMI_IDS[0] and changed["assistant.tool_calls.id"] == 3


IDS = st.one_of(
    st.none(),
    st.sampled_from(["call_0", "call_1", "call_x", "toolu_01", "7"]),
    st.builds(lambda n, i: f"functions.{n}:{i}", st.sampled_from(["get_weather", "add", "other"]), st.integers(0, 9)),
)


@settings(max_examples=60, deadline=None)
@given(
    turns=st.lists(
        st.lists(st.tuples(IDS, st.sampled_from(["get_weather", "add", "day_after"])), min_size=1, max_size=3),
        min_size=1,
        max_size=3,
    ),
    answer_by_id=st.booleans(),
)
def test_every_call_gets_a_kimi_id_of_its_name_and_every_result_the_id_of_its_call(turns, answer_by_id):
    msgs, answered = [{"role": "user", "content": "q"}], []
    for calls in turns:
        ids = [cid for cid, _ in calls]
        unique = len({i for i in ids if i is not None}) == len([i for i in ids if i is not None])
        msgs.append({"role": "assistant", "content": "", "tool_calls": [_call(c, n, {}) for c, n in calls]})
        for j, (cid, _) in enumerate(calls):
            by_id = answer_by_id and cid is not None and unique
            msgs.append({"role": "tool", **({"tool_call_id": cid} if by_id else {}), "content": f"r{j}"})
            answered.append((len(msgs) - 1, len(msgs) - 2 - j, j))
    out, _ = tool_ids.as_target_writes(msgs, tool_ids.KIMI_K2)
    for m in out:
        for c in m.get("tool_calls") or []:
            mk = tool_ids.KIMI_ID.fullmatch(c["id"])
            assert mk and mk["name"] == c["function"]["name"], c
    for at, call_turn, j in answered:
        assert out[at]["tool_call_id"] == out[call_turn]["tool_calls"][j]["id"]
    assert out[0] == msgs[0]
