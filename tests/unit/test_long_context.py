"""Long agentic sessions in Kimi's format (data/kimi_traffic.py: agentic, long_conversations), the data the long-
context draft trains on: their length as the template renders them, Kimi's call ids over the whole session, and
one sample each through load_samples at --max-len 32k: nothing cut, every assistant turn learned, nothing else."""

import json
import random
import re

import pytest

from eagle3.data import kimi_traffic
from eagle3.data.conversations import DataConfig, load_samples
from eagle3.targets import tiny


@pytest.fixture(scope="module")
def kimi_tokenizer(tmp_path_factory):
    return tiny.build_tokenizer(tmp_path_factory.mktemp("kimi-tok"), 1024, chat_format="kimi")


def _rendered(tok, conv: dict) -> list[int]:
    text = tok.apply_chat_template(conv["messages"], tools=conv["tools"], tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("tokens", [4096, 16384])
def test_a_session_renders_to_at_least_its_length_and_not_far_past_it(kimi_tokenizer, tokens):
    (conv,) = kimi_traffic.long_conversations(kimi_tokenizer, 1, tokens, seed=tokens)
    assert tokens <= len(_rendered(kimi_tokenizer, conv)) < 1.5 * tokens
    assert conv["traffic"] == "agentic" and conv["tools"] == kimi_traffic.TOOLS
    assert kimi_traffic.long_conversations(kimi_tokenizer, 1, tokens, seed=tokens) == [conv]  # seeded


def test_call_ids_count_the_session_s_calls_and_each_reply_answers_the_call_before_it():
    conv = kimi_traffic.agentic(random.Random(3), tasks=6)
    msgs, ids, k = conv["messages"], [], 0
    for i, m in enumerate(msgs):
        for call in m.get("tool_calls", []):
            assert call["id"] == f"functions.{call['function']['name']}:{k}", call
            assert msgs[i + 1] == {"role": "tool", "tool_call_id": call["id"], "content": msgs[i + 1]["content"]}
            ids.append(call["id"])
            k += 1
    assert len(ids) >= 6 and len(set(ids)) == len(ids)
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    thinking = [i for i, m in enumerate(msgs) if m.get("reasoning_content")]
    assert thinking and min(thinking) > users[-1]  # thinking in the last task only


def test_a_16k_session_is_one_whole_sample_with_exactly_its_assistant_turns_learned(kimi_tokenizer, tmp_path):
    """At --max-len 32768 nothing is cut; every assistant turn (calls, answers, the last task's thinking and each
    turn's end token) is learned and nothing else: the learned tokens decode to the assistant turns' text."""
    convs = kimi_traffic.long_conversations(kimi_tokenizer, 1, 16384, seed=5)
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in convs))
    samples, report = load_samples(DataConfig([str(data)], max_len=32768, long_rule="error"), kimi_tokenizer)
    assert len(samples) == 1, report
    for s, conv in zip(samples, convs):
        assert list(s.input_ids) == _rendered(kimi_tokenizer, conv) and len(s) >= 16384
        learned = [t for t, m in zip(s.input_ids, s.loss_mask) if m]
        text = kimi_tokenizer.decode(learned)
        turns = [m for m in conv["messages"] if m["role"] == "assistant"]
        assert text.count("<|im_end|>") == len(turns)  # each turn's end, no other role's
        assert "<|im_user|>" not in text and "<|im_system|>" not in text and "## Return of" not in text
        calls = re.findall(r"functions\.\w+:\d+", text)
        assert calls == [c["id"] for m in turns for c in m.get("tool_calls", [])]
        answers = [m["content"] for m in turns if m["content"]]
        assert all(a in text for a in answers) and text.count("<think>") == len(turns)
        thoughts = [m["reasoning_content"] for m in turns if m.get("reasoning_content")]
        assert thoughts and all(f"<think>{r}</think>" in text for r in thoughts)  # the last task's, kept
