"""The OpenAI chat schema in full (and ShareGPT's function-call roles) through three chat templates, with golden loss
masks: the mask is exactly what the target generates in an assistant turn (thinking, text, tool-call markup, the
end-of-turn token), never a template header nor what the template writes after the end token."""

import json

import pytest

from eagle3 import cli
from eagle3.data import kimi_traffic
from eagle3.data.conversations import DataConfig, load_samples
from eagle3.targets import tiny

LLAMA3_TEMPLATE = (  # Llama-3's layout, written here: headers, "\n\n", <|eot_id|> ends a turn; tools are not rendered
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CALL = {
    "id": "functions.get_weather:0",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": CALL["id"], "content": '{"weather": "foggy"}'},
    {"role": "assistant", "content": "Foggy in Oslo."},
]


@pytest.fixture(scope="module")
def kimi_tok(tmp_path_factory):
    return tiny.build_tokenizer(tmp_path_factory.mktemp("kimi-tok"), 1024, chat_format="kimi")


@pytest.fixture(scope="module")
def llama3_tok(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("llama3-tok")
    tiny.build_tokenizer(out, 1024)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_special_tokens(
        {
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"],
        }
    )
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


def _load(tmp_path, tok, lines, **kw):
    p = tmp_path / "d.jsonl"
    p.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return load_samples(DataConfig([str(p)], **kw), tok)


def _split(tok, s):
    on = tok.decode([t for t, m in zip(s.input_ids, s.loss_mask) if m])
    off = tok.decode([t for t, m in zip(s.input_ids, s.loss_mask) if not m])
    return on, off


# ------------------------------------------------------------------------------------- golden masks, three templates


def test_golden_mask_chatml(tmp_path, tokenizer):
    (s,), _ = _load(
        tmp_path,
        tokenizer,
        [
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi?"},
                    {"role": "assistant", "content": "Hello."},
                ]
            }
        ],
    )
    on, off = _split(tokenizer, s)
    assert on == "Hello.<|im_end|>"
    assert (
        off == "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"
        "<|im_start|>assistant\n\n"
    )


def test_golden_mask_kimi_with_thinking_and_tool_calls(tmp_path, kimi_tok):
    msgs = [dict(m) for m in TOOL_CHAT]
    msgs[3]["reasoning_content"] = "Read the reply."
    (s,), rep = _load(tmp_path, kimi_tok, [{"tools": kimi_traffic.TOOLS[:1], "messages": msgs}])
    on, off = _split(kimi_tok, s)
    assert on == (
        "<think></think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        "<think>Read the reply.</think>Foggy in Oslo.<|im_end|>"
    )
    assert off == (
        "<|im_system|>tool_declare<|im_middle|>" + json.dumps(kimi_traffic.TOOLS[:1]) + "<|im_end|>"
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather in Oslo?<|im_end|><|im_assistant|>assistant<|im_middle|>"
        '<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n{"weather": "foggy"}<|im_end|>'
        "<|im_assistant|>assistant<|im_middle|>"
    )
    assert not rep.template_dropped and rep.views == 0


def test_golden_mask_llama3(tmp_path, llama3_tok):
    (s,), rep = _load(
        tmp_path,
        llama3_tok,
        [
            {
                "messages": [
                    {"role": "user", "content": "Hi?"},
                    {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "Bye?"},
                    {"role": "assistant", "content": "Bye."},
                ]
            }
        ],
    )
    on, off = _split(llama3_tok, s)
    assert on == "Hello.<|eot_id|>Bye.<|eot_id|>"
    assert off == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n<|start_header_id|>user<|end_header_id|>\n\nBye?"
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_a_template_that_drops_tools_and_calls_is_reported(tmp_path, llama3_tok):
    """Llama-3's layout here renders neither the tools list nor tool calls: the messages reach it unchanged, and the
    report says what the data held that the template left out."""
    _, rep = _load(tmp_path, llama3_tok, [{"tools": kimi_traffic.TOOLS[:1], "messages": TOOL_CHAT}])
    assert rep.template_dropped == {"tools": 1, "assistant.tool_calls": 1}
    assert "the chat template dropped assistant.tool_calls in 1 turns, tools in 1 turns" in rep.summary()


# --------------------------------------------------------------------------------------------- the schema, case by case


def test_text_parts_give_the_same_sample_as_a_string(tmp_path, tokenizer):
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Count "}, {"type": "text", "text": "to 3."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "1, 2, 3."}]},
    ]
    flat = [{"role": "user", "content": "Count to 3."}, {"role": "assistant", "content": "1, 2, 3."}]
    (a, b), _ = _load(tmp_path, tokenizer, [{"messages": parts}, {"messages": flat}])
    assert a.input_ids == b.input_ids and a.loss_mask == b.loss_mask


def test_developer_and_tool_turns_reach_the_template_outside_the_mask(tmp_path, tokenizer):
    msgs = [{"role": "developer", "content": "Use tools."}] + TOOL_CHAT
    (s,), rep = _load(tmp_path, tokenizer, [{"messages": msgs}])
    on, off = _split(tokenizer, s)
    assert "<|im_start|>developer\nUse tools.<|im_end|>" in off and "<|im_start|>tool\n" in off
    assert on == "<|im_end|>Foggy in Oslo.<|im_end|>"  # ChatML renders no calls: the call turn is its end token
    assert rep.template_dropped == {"assistant.tool_calls": 1}


def test_reasoning_is_in_the_mask_and_vllm_s_name_for_it_is_read(tmp_path, kimi_tok):
    a = {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4.", "reasoning_content": "Two and two."},
        ]
    }
    b = {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4.", "reasoning": "Two and two."},
        ]
    }
    (x, y), _ = _load(tmp_path, kimi_tok, [a, b])
    assert x.input_ids == y.input_ids and _split(kimi_tok, x)[0] == "<think>Two and two.</think>4.<|im_end|>"


def test_weight_zero_keeps_a_turn_as_context_only(tmp_path, tokenizer):
    msgs = [
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello.", "weight": 0},
        {"role": "user", "content": "Bye?"},
        {"role": "assistant", "content": "Bye.", "weight": 1},
    ]
    (s,), _ = _load(tmp_path, tokenizer, [{"messages": msgs}])
    on, off = _split(tokenizer, s)
    assert on == "Bye.<|im_end|>" and "Hello.<|im_end|>" in off


def test_sharegpt_function_call_roles_are_the_openai_tool_turns(tmp_path, kimi_tok):
    sg = {
        "tools": json.dumps(kimi_traffic.TOOLS[:1]),
        "conversations": [
            {"from": "human", "value": "Weather in Oslo?"},
            {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": '{"city": "Oslo"}'})},
            {"from": "observation", "value": '{"weather": "foggy"}'},
            {"from": "gpt", "value": "Foggy in Oslo."},
        ],
    }
    oa = [dict(m) for m in TOOL_CHAT]
    oa[1] = dict(oa[1], content="", tool_calls=[{k: v for k, v in CALL.items() if k != "id"}])
    oa[2] = {"role": "tool", "content": '{"weather": "foggy"}'}
    (a, b), rep = _load(tmp_path, kimi_tok, [sg, {"tools": kimi_traffic.TOOLS[:1], "messages": oa}])
    assert a.input_ids == b.input_ids and a.loss_mask == b.loss_mask
    assert "functions.get_weather:0" in kimi_tok.decode(a.input_ids)  # the template's own id for an id-less call


def test_an_assistant_first_chat_masks_no_bos_nor_header(tmp_path, tokenizer):
    (s,), _ = _load(tmp_path, tokenizer, [{"messages": [{"role": "assistant", "content": "Hello, how can I help?"}]}])
    on, off = _split(tokenizer, s)
    assert on == "Hello, how can I help?<|im_end|>"
    assert off == "<|bos|><|im_start|>assistant\n\n"


def test_a_turn_the_template_rerenders_later_is_learned_from_its_own_view(tmp_path, kimi_tok):
    """Kimi's thinking template drops the thinking of turns before the last user message: turn 1's thinking is
    learned from the conversation through turn 1, turn 3 from the whole (two samples)."""
    msgs = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4.", "reasoning_content": "Two."},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6.", "reasoning_content": "Three."},
    ]
    samples, rep = _load(tmp_path, kimi_tok, [{"messages": msgs}])
    assert [s.sample_id for s in samples] == ["d.jsonl:1", "d.jsonl:1@1"]
    assert [_split(kimi_tok, s)[0] for s in samples] == [
        "<think>Three.</think>6.<|im_end|>",
        "<think>Two.</think>4.<|im_end|>",
    ]
    assert "<think></think>4." in kimi_tok.decode(samples[0].input_ids)  # the history as the target saw it
    assert rep.views == 1 and not rep.template_dropped


def test_duplicates_and_blank_lines_are_counted_and_dedup_drops_duplicates(tmp_path, tokenizer):
    c = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    other = {"messages": [{"role": "user", "content": "Bye?"}, {"role": "assistant", "content": "Bye."}]}
    lines = [c, "", c, "   ", other, c]
    kept, rep = _load(tmp_path, tokenizer, lines)
    assert len(kept) == 4 and rep.duplicates == 2 and rep.blank_lines == 2
    assert "6 lines (2 blank)" in rep.summary() and "duplicates 2" in rep.summary()
    kept, rep = _load(tmp_path, tokenizer, lines, dedup=True)
    assert [s.sample_id for s in kept] == ["d.jsonl:1", "d.jsonl:5"] and rep.duplicates == 2


def test_extract_dedup_flag_and_the_data_line(tmp_path, tiny_llama, capsys):
    c = {"messages": [{"role": "user", "content": "Count to 3."}, {"role": "assistant", "content": "1, 2, 3."}]}
    data = tmp_path / "d.jsonl"
    data.write_text((json.dumps(c) + "\n") * 3 + "\n")
    assert (
        cli.main(["extract", "--model", str(tiny_llama), "--data", str(data), "--out", str(tmp_path / "s"), "--dedup"])
        == 0
    )
    said = capsys.readouterr().out
    assert "4 lines (1 blank) -> 1 samples" in said and "duplicates 2" in said, said


def test_kimi_traffic_renders_through_the_kimi_template_with_its_masks(tmp_path, kimi_tok):
    lines = kimi_traffic.generate(30, seed=3)
    samples, rep = _load(tmp_path, kimi_tok, lines, max_len=1024)
    assert len(samples) == 30 and not rep.rejected and not rep.template_dropped and rep.views == 0
    think, call = kimi_tok.convert_tokens_to_ids(["<think>", "<|tool_calls_section_begin|>"])
    for c, s in zip(lines, samples):
        on = [t for t, m in zip(s.input_ids, s.loss_mask) if m]
        turns = sum(m["role"] == "assistant" for m in c["messages"])
        assert on.count(kimi_tok.eos_token_id) == turns and on.count(think) == turns  # every turn, its end included
        assert (call in on) == (c["traffic"] == "tool") and (
            call not in [t for t, m in zip(s.input_ids, s.loss_mask) if not m]
        )
        if c["traffic"] == "thinking":
            assert c["messages"][-1]["reasoning_content"] in kimi_tok.decode(on)


# ------------------------------------------------------------------------ turns the target did not end (regenerate)


def _regenerated(messages, turns, finish):
    """A line as `eagle3 regenerate` writes it: the messages and its record of the turns it wrote."""
    return {
        "messages": messages,
        "regenerated": {"line": 1, "turns": turns, "tokens": [100] * len(turns), "finish": finish, "cut_after": None},
    }


@pytest.mark.parametrize("finish,on", [("length", "Hello."), ("stop", "Hello.<|im_end|>")])
def test_a_turn_the_target_did_not_end_learns_no_end_of_turn(tmp_path, tokenizer, finish, on):
    """regenerate's turn cut at max_tokens: the template closes it with an end-of-turn token the target never
    generated there; a draft trained on it would learn to end turns where the target goes on."""
    line = _regenerated([{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}], [1], [finish])
    (s,), rep = _load(tmp_path, tokenizer, [line])
    assert _split(tokenizer, s)[0] == on
    assert rep.unended == (finish == "length")
    assert ("1 turns the target did not end" in rep.summary()) == (finish == "length"), rep.summary()


def test_of_several_regenerated_turns_only_the_cut_one_loses_its_end_token(tmp_path, llama3_tok, kimi_tok):
    msgs = [
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye?"},
        {"role": "assistant", "content": "Bye."},
    ]
    (s,), _ = _load(tmp_path, llama3_tok, [_regenerated(msgs, [1, 3], ["length", "stop"])])
    assert _split(llama3_tok, s)[0] == "Hello.Bye.<|eot_id|>"
    msgs = [dict(m) for m in TOOL_CHAT]
    (s,), _ = _load(
        tmp_path, kimi_tok, [{"tools": kimi_traffic.TOOLS[:1], **_regenerated(msgs, [1, 3], ["stop", "length"])}]
    )
    assert _split(kimi_tok, s)[0].endswith("<|tool_calls_section_end|><|im_end|><think></think>Foggy in Oslo.")


def test_a_turn_cut_inside_its_thinking_learns_only_what_the_target_wrote(tmp_path, kimi_tok):
    """Kimi's template closes a cut thinking block with </think> and the turn with <|im_end|>; the target wrote
    neither. regenerate's record has the turn's token count: the mask stops there."""
    wrote = "<think>Let me think about wh"
    n = len(kimi_tok(wrote, add_special_tokens=False)["input_ids"])
    msgs = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": wrote.removeprefix("<think>")},
    ]
    line = _regenerated(msgs, [1], ["length"])
    line["regenerated"]["tokens"] = [n]
    (s,), _ = _load(tmp_path, kimi_tok, [line])
    assert _split(kimi_tok, s)[0] == wrote
    assert kimi_tok.decode(s.input_ids).endswith(wrote + "</think><|im_end|>")


@pytest.mark.parametrize(
    "record,problem",
    [
        ({"turns": [0], "finish": ["length"]}, "turn 0 is a user turn"),
        ({"turns": [1], "finish": ["length", "stop"]}, "1 turns but 2 finish"),
        ({"turns": [1], "finish": ["eos"]}, "finish 'eos'"),
        ({"turns": [7], "finish": ["stop"]}, "turn 7 is past the last of 2"),
        ({"turns": "1", "finish": ["stop"]}, "turns and finish must be lists"),
        ({"turns": [1], "finish": ["length"], "tokens": [-3]}, "token count -3"),
    ],
)
def test_a_malformed_regenerate_record_is_refused_with_the_reason(tmp_path, tokenizer, record, problem):
    line = {
        "messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}],
        "regenerated": record,
    }
    good = _regenerated(line["messages"], [1], ["stop"])
    kept, rep = _load(tmp_path, tokenizer, [line, good], rejects_path=str(tmp_path / "rejects.jsonl"))
    assert [s.sample_id for s in kept] == ["d.jsonl:2"] and rep.rejected["bad_regenerated"] == 1
    said = json.loads((tmp_path / "rejects.jsonl").read_text().splitlines()[0])["error"]
    assert said.startswith("d.jsonl:1: ".replace("d.jsonl", str(tmp_path / "d.jsonl"))) and problem in said, said


# -- round three of what the suite missed (issue 70) -----------------------------------------------------------------
@pytest.mark.parametrize("form", ["object", "string"])
def test_tool_call_arguments_render_as_the_template_renders_them_in_either_form(tmp_path, kimi_tok, form):
    """Arguments as a JSON object or as a string: the sample's tokens are the template's own rendering of the line as
    given (an object through its tojson, non-ASCII kept; a string verbatim), the mask on the call."""
    args = {"city": "Zürich", "days": [1, 2], "units": {"t": "C"}}
    call = {
        "id": "functions.get_weather:0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": args if form == "object" else json.dumps(args)},
    }
    msgs = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "mild"},
        {"role": "assistant", "content": "Mild."},
    ]
    (s,), rep = _load(tmp_path, kimi_tok, [{"tools": kimi_traffic.TOOLS[:1], "messages": msgs}])
    own = kimi_tok.apply_chat_template(msgs, tools=kimi_traffic.TOOLS[:1], tokenize=False)
    assert kimi_tok.decode(s.input_ids) == own
    on, _ = _split(kimi_tok, s)
    shown = json.dumps(args, ensure_ascii=False) if form == "object" else json.dumps(args)
    assert f"<|tool_call_argument_begin|>{shown}<|tool_call_end|>" in on
    assert rep.template_dropped == {}


def test_the_legacy_function_role_is_a_tool_s_reply_never_trained(tmp_path, kimi_tok):
    msgs = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "function", "name": "get_weather", "content": "RAINY-IN-OSLO"},
        {"role": "assistant", "content": "Rain."},
    ]
    (s,), _ = _load(tmp_path, kimi_tok, [{"tools": kimi_traffic.TOOLS[:1], "messages": msgs}])
    on, off = _split(kimi_tok, s)
    assert "RAINY-IN-OSLO" in off and "RAINY-IN-OSLO" not in on
    assert "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nRAINY-IN-OSLO<|im_end|>" in off
    assert on.endswith("<think></think>Rain.<|im_end|>")


def test_kimi_keeps_the_thinking_of_every_turn_after_the_last_user_message_and_drops_it_before(tmp_path, kimi_tok):
    """An agentic turn (thinking, a call, the tool's reply, thinking, the answer) keeps both thinkings in one sample:
    both follow the last user message. A turn before a later user message is rendered without its thinking in the
    whole conversation, so it is learned from its own view (@1), thinking included."""
    agentic = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "THINK-ONE", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": CALL["id"], "content": "foggy"},
        {"role": "assistant", "content": "Foggy.", "reasoning_content": "THINK-TWO"},
    ]
    (s,), rep = _load(tmp_path, kimi_tok, [{"tools": kimi_traffic.TOOLS[:1], "messages": agentic}])
    on, _ = _split(kimi_tok, s)
    assert "<think>THINK-ONE</think>" in on and "<think>THINK-TWO</think>" in on and rep.views == 0
    later = agentic + [
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": "Rain.", "reasoning_content": "THINK-THREE"},
    ]
    whole, own = _load(tmp_path, kimi_tok, [{"tools": kimi_traffic.TOOLS[:1], "messages": later}])[0]
    assert [x.sample_id for x in (whole, own)] == ["d.jsonl:1", "d.jsonl:1@3"]
    text = kimi_tok.decode(whole.input_ids)
    assert "THINK-ONE" not in text and "THINK-TWO" not in text and "<think>THINK-THREE</think>" in text
    assert (
        "<think>THINK-ONE</think>" in _split(kimi_tok, own)[0]
        and "<think>THINK-TWO</think>" in _split(kimi_tok, own)[0]
    )


def test_a_template_that_writes_a_call_s_name_but_not_its_arguments_is_reported(tmp_path, tokenizer):
    """The data line says what the template left out: here each call's arguments (its name is written)."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
        "{% for c in m.get('tool_calls') or [] %}call {{ c['function']['name'] }}{% endfor %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    _, rep = _load(tmp_path, tok, [{"tools": kimi_traffic.TOOLS[:1], "messages": TOOL_CHAT}])
    assert rep.template_dropped == {"assistant.tool_calls": 1}  # the tools list: its name is in the text
