"""`eagle3 show-mask`: the rendered conversation with the trained tokens marked, the counts by role, JSON for scripts;
the samples and masks are exactly those extraction makes."""

import json

import pytest

from eagle3 import cli
from eagle3.data.conversations import DataConfig, load_samples
from eagle3.targets import tiny

from .test_tool_ids import agentic

WEATHER = {
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Use the tool.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "foggy"},
        {"role": "assistant", "content": "Foggy in Oslo."},
    ],
}


@pytest.fixture(scope="module")
def kimi_model(tmp_path_factory, tiny_kimi):
    """A Kimi-format tokenizer beside a config: what show-mask reads of a target."""
    out = tmp_path_factory.mktemp("kimi-model")
    tiny.build_tokenizer(out, 1024, chat_format="kimi")
    (out / "config.json").write_text((tiny_kimi / "config.json").read_text())
    return out


@pytest.fixture
def data(tmp_path):
    p = tmp_path / "d.jsonl"
    two_views = {
        "messages": [
            {"role": "user", "content": "A?"},
            {"role": "assistant", "content": "a", "reasoning_content": "think A"},
            {"role": "user", "content": "B?"},
            {"role": "assistant", "content": "b"},
        ]
    }
    p.write_text(
        "\n".join(
            json.dumps(x)
            for x in (WEATHER, {"messages": [{"role": "user"}]}, agentic(["call_1", "call_2", "call_3"]), two_views)
        )
        + "\n"
    )
    return p


def test_the_trained_spans_are_marked_and_counted_by_role(kimi_model, data, capsys):
    assert cli.main(["show-mask", "--model", str(kimi_model), "--data", str(data), "--line", "1"]) == 0
    out = capsys.readouterr().out
    head, text = out.split("\n", 1)
    assert head == (
        "== d.jsonl:1: 178 tokens; trained 37 (assistant 37); untrained 141 (assistant 10, template 92, "
        "tool 30, user 9)"
    ), head
    assert text.strip().endswith(
        "<|im_user|>user<|im_middle|>Weather in Oslo?<|im_end|><|im_assistant|>assistant<|im_middle|>[[<think>Use the "
        "tool.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>]]'
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nfoggy<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>[[<think></think>Foggy in Oslo.<|im_end|>]]"
    ), text
    assert text.startswith("<|im_system|>tool_declare<|im_middle|>")


def test_json_holds_extraction_s_own_samples_and_every_token_s_role(kimi_model, data, capsys):
    from transformers import AutoTokenizer

    assert cli.main(["show-mask", "--model", str(kimi_model), "--data", str(data), "--json"]) == 1  # line 2 is bad
    captured = capsys.readouterr()
    shown = [json.loads(x) for x in captured.out.splitlines()]
    assert "d.jsonl:2" in captured.err and "skipped" in captured.err
    made, _ = load_samples(DataConfig([str(data)], max_len=10**6), AutoTokenizer.from_pretrained(kimi_model))
    assert [(s["sample_id"], s["input_ids"], s["loss_mask"]) for s in shown] == [
        (m.sample_id, list(m.input_ids), list(m.loss_mask)) for m in made
    ]
    for s in shown:
        assert len(s["roles"]) == s["tokens"] == sum(s["trained"].values()) + sum(s["untrained"].values())
        assert set(s["trained"]) == {"assistant"}  # only the assistant's own tokens are trained
        first_user = s["roles"].index("user")
        assert set(s["roles"][:first_user]) == {"template"}  # the tools list and the default system prompt
    assert [s["sample_id"] for s in shown[-2:]] == ["d.jsonl:4", "d.jsonl:4@1"]  # Kimi drops earlier thinking
    agent = shown[-3]
    assert agent["untrained"]["tool"] > 0 and agent["trained"]["assistant"] == sum(agent["loss_mask"])


def test_colour_on_request_and_a_missing_line_is_refused(kimi_model, data, capsys):
    assert (
        cli.main(["show-mask", "--model", str(kimi_model), "--data", str(data), "--line", "1", "--color", "always"])
        == 0
    )
    out = capsys.readouterr().out
    assert "\x1b[1;32m<think>Use the tool." in out and "[[" not in out
    assert cli.main(["show-mask", "--model", str(kimi_model), "--data", str(data), "--line", "9"]) == 2
    assert "d.jsonl:9: no such line" in capsys.readouterr().err
