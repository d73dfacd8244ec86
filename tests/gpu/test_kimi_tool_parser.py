"""vLLM's own kimi_k2 tool parser reads back the calls eagle3 renders from OpenAI-schema data: name, arguments and id
(functions.NAME:INDEX). It needs vLLM, which lives on the GPU host; no GPU work is done."""

import json

import pytest

from eagle3.data import masks
from eagle3.targets import tiny

from ..unit.test_tool_ids import KIMI_IDS, agentic

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def kimi_tok(tmp_path_factory):
    return tiny.build_tokenizer(tmp_path_factory.mktemp("kimi-tok"), 1024, chat_format="kimi")


def test_vllm_s_kimi_k2_parser_reads_the_rendered_calls_back(kimi_tok):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.kimi_k2_tool_parser import KimiK2ToolParser

    conv = agentic(["call_1", "call_2", "call_3"])
    msgs = conv["messages"]
    request = ChatCompletionRequest(model="target", messages=[{"role": "user", "content": "q"}], tools=conv["tools"])
    for turn, ids in ((1, KIMI_IDS[:2]), (4, KIMI_IDS[2:])):
        head = masks.chat(kimi_tok, msgs[:turn], conv["tools"], gen=True)
        text = masks.chat(kimi_tok, msgs[: turn + 1], conv["tools"])[len(head) :].removesuffix("<|im_end|>")
        info = KimiK2ToolParser(kimi_tok).extract_tool_calls(text, request)
        assert info.tools_called, text
        got = [(c.id, c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]
        want = [
            (i, c["function"]["name"], json.loads(c["function"]["arguments"]))
            for i, c in zip(ids, msgs[turn]["tool_calls"])
        ]
        assert got == want, text
    # the data's own ids as they were rendered before (eagle3 at 962a6d4): vLLM reads no call from them
    raw = (
        "<think></think><|tool_calls_section_begin|><|tool_call_begin|>call_1<|tool_call_argument_begin|>"
        '{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>'
    )
    info = KimiK2ToolParser(kimi_tok).extract_tool_calls(raw, request)
    assert not [c for c in info.tool_calls if c.function.name == "get_weather"], info
