"""Long agentic sessions in Kimi's format (data/kimi_traffic.py: agentic, long_conversations), the data the long-
context draft trains on: their length as the template renders them, Kimi's call ids over the whole session, and
one sample each through load_samples at --max-len 32k: nothing cut, every assistant turn learned, nothing else."""

import dataclasses
import json
import random
import re

import pytest

from eagle3.data import kimi_traffic
from eagle3.data.conversations import DataConfig, load_samples
from eagle3.targets import learnable, tiny


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


def test_the_long_context_target_stretches_its_positions_as_kimi_does_and_trains_on_long_sessions(tmp_path):
    """`make-target --arch deepseek-long`: the learnable DeepseekV3 with Kimi-K2.5's YaRN form (type, original 4k
    context, betas, mscale keys) over 32k positions, trained on 16k-token windows of its traffic with long agentic
    sessions among it; its draft carries the same YaRN (tests/unit/test_draft_rope.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    from eagle3.targets.presets import KIMI_K25_TEXT
    from eagle3.train.draft import DraftShape

    long, short = learnable.ARCHES["deepseek-long"], learnable.ARCHES["deepseek"]
    cfg, kimi = long.hf_config, KIMI_K25_TEXT["rope_scaling"]
    assert cfg["max_position_embeddings"] == 32768 and long.seq_len == 16384 and long.chat_format == "kimi"
    assert cfg["rope_scaling"] == dict(kimi, factor=8.0)  # 4k x 8 = 32k, as Kimi's 4k x 64 = 256k
    same = {k: v for k, v in cfg.items() if k not in ("max_position_embeddings", "rope_scaling")}
    assert same == {k: v for k, v in short.hf_config.items() if k != "max_position_embeddings"}
    rope = DraftShape.for_target(cfg).llama_config().rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 8.0, 4096)
    convs = learnable.conversations("deepseek-long", 64, seed=1)
    agentic = [c for c in convs if c["traffic"] == "agentic"]
    assert len(agentic) == 8 and {c["traffic"] for c in convs} == {"chat", "thinking", "tool", "agentic"}
    assert learnable.conversations("deepseek", 64, seed=1) == kimi_traffic.generate(64, seed=1)  # unchanged
    tiny.build_model(long, tmp_path / "t", seed=0)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "t", dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[5] * 8]), position_ids=torch.tensor([[30000 + i for i in range(8)]]))
    assert torch.isfinite(logits.logits).all()


def test_the_long_target_s_held_out_prompts_are_short_and_its_long_sessions_come_as_context(kimi_tokenizer):
    """deepseek-long's held-out prompts are its short traffic (the "short" column of the long-context table), the same
    as deepseek's; its long sessions reach a long prompt through the context before it."""
    short = learnable.eval_prompts(kimi_tokenizer, 24, arch="deepseek-long")
    assert short == learnable.eval_prompts(kimi_tokenizer, 24, arch="deepseek")
    assert max(len(ids) for _, ids in short) < 1500
    pool = learnable.conversations("deepseek-long", 256, learnable.HELD_OUT_SEED + 1)
    assert sum(c.get("tools") is not None and len(c["messages"]) > 40 for c in pool) >= 16  # sessions in the context
    long = learnable.eval_prompts(kimi_tokenizer, 4, arch="deepseek-long", context_tokens=8192)
    assert all(len(ids) == 8192 and ids[-len(s) :] == s for (_, ids), (_, s) in zip(long, short))


@pytest.mark.parametrize(
    "options",
    [dict(long_rule="split"), dict(long_rule="drop"), dict(long_rule="truncate", max_samples=7)],
    ids=["split", "drop", "max-samples"],
)
def test_long_conversations_are_tokenized_in_worker_processes_as_they_would_be_here(kimi_tokenizer, tmp_path, options):
    """A long session's loss mask renders the template once per assistant turn, up to it (its length squared: 1.9 s
    for a 15k-token session on one core), so conversations of many messages go to worker processes. The samples,
    their order and the report equal those of the load done here: short lines and sessions interleaved, a bad line,
    sessions cut at a small max_len (split: each part a sample; drop: rejected there), a load stopped at max_samples."""
    r = random.Random(11)
    lines = []
    for i, c in enumerate(kimi_traffic.generate(6, seed=3)):
        lines.append(json.dumps(c))
        if i % 2:
            lines.append(json.dumps(kimi_traffic.agentic(r, 9)))  # 9 tasks: more than 32 messages
    lines.insert(3, '{"messages": "not a list"}')
    data = tmp_path / "mixed.jsonl"
    data.write_text("\n".join(lines) + "\n")
    cfg = DataConfig([str(data)], max_len=1536, **options)
    here, here_report = load_samples(dataclasses.replace(cfg, workers=1), kimi_tokenizer)
    pooled, pooled_report = load_samples(dataclasses.replace(cfg, workers=2), kimi_tokenizer)
    assert pooled == here and len(here) == options.get("max_samples", len(here))
    in_workers = {"split": 3, "drop": 0, "truncate": 2}[options["long_rule"]]  # drop: each session too long there
    assert (here_report.in_workers, pooled_report.in_workers) == (0, in_workers)
    if "max_samples" in options:  # the lines read ahead for the workers are counted as read
        assert here_report.lines == 8 and pooled_report.lines == 10
        pooled_report = dataclasses.replace(pooled_report, lines=8, tool_ids=here_report.tool_ids)
    assert dataclasses.replace(pooled_report, in_workers=0) == here_report
    assert here_report.rejected == {"wrong_schema": 1, **({"too_long": 3} if options["long_rule"] == "drop" else {})}
    assert (here_report.split_parts > 0) == (options["long_rule"] == "split")


def test_extract_s_data_flags_reach_the_load_and_the_data_line_says_so(tmp_path, tiny_llama, capsys):
    """`extract --data-workers 2`: the two chats of 40 messages are tokenized in worker processes (the data line
    says so) and the store holds what `--data-workers 1` stores. `--run-together`: the three in one sample."""
    from eagle3 import cli
    from eagle3.store.folder import Store

    def chat(n, k):
        turns = [({"role": "user", "content": f"Count {k} to {i}."}, {"role": "assistant", "content": f"{k}, {i}."})
                 for i in range(n)]  # fmt: skip
        return {"messages": [m for pair in turns for m in pair]}

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in (chat(20, 1), chat(2, 2), chat(20, 3))))
    stores = {}
    for workers in (1, 2):
        stores[workers] = tmp_path / f"s{workers}"
        argv = ["extract", "--model", str(tiny_llama), "--data", str(data), "--out", str(stores[workers])]
        assert cli.main([*argv, "--data-workers", str(workers), "--max-len", "1024"]) == 0
        said = capsys.readouterr().out
        assert ("2 long conversations tokenized in worker processes" in said) == (workers == 2), said
    got = [{s["sample_id"]: s["input_ids"].tolist() for s in Store.open(stores[w]).iter_samples()} for w in (1, 2)]
    assert got[0] == got[1] and len(got[0]) == 3
    argv[-1] = str(tmp_path / "joined")
    assert cli.main([*argv, "--run-together", "--max-len", "100000"]) == 0
    assert "3 samples run together into 1 samples" in capsys.readouterr().out
    (joined,) = Store.open(tmp_path / "joined").iter_samples()
    assert joined["input_ids"].tolist() == [t for k in ("chats.jsonl:1", "chats.jsonl:2", "chats.jsonl:3")
                                            for t in got[0][k]]  # fmt: skip


@pytest.mark.parametrize("max_len", [1024, 4096])
def test_run_together_joins_consecutive_samples_into_windows_of_up_to_max_len_whole(kimi_tokenizer, tmp_path, max_len):
    """--run-together: consecutive samples joined into one, as a long session's history holds earlier tasks and as
    the long prompts are built, each window as long as max_len allows without cutting a sample; every token and its
    mask kept once, in order; a window's id names its first sample and how many follow it."""
    r = random.Random(4)
    convs = kimi_traffic.generate(20, seed=9) + [kimi_traffic.agentic(r, 9)]
    data = tmp_path / "traffic.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in convs))
    alone, _ = load_samples(DataConfig([str(data)], max_len=max_len), kimi_tokenizer)
    joined, report = load_samples(DataConfig([str(data)], max_len=max_len, run_together=True), kimi_tokenizer)
    flat = [(t, m) for s in alone for t, m in zip(s.input_ids, s.loss_mask)]
    assert [(t, m) for s in joined for t, m in zip(s.input_ids, s.loss_mask)] == flat
    assert all(len(s) <= max_len for s in joined) and len(joined) < len(alone)
    start = 0
    for w in joined:  # each window took the samples that follow its first while they fit
        first, _, more = w.sample_id.rpartition("+")
        k = [s.sample_id for s in alone].index(first, start)
        assert sum(len(s) for s in alone[k : k + int(more) + 1]) == len(w)
        nxt = alone[k + int(more) + 1 : k + int(more) + 2]
        assert not nxt or len(w) + len(nxt[0]) > max_len
        start = k + int(more) + 1
    assert start == len(alone) and report.samples == len(joined)
    assert f"run together into {len(joined)} samples" in report.summary()


def test_the_long_target_s_stream_renders_its_sessions_in_workers_as_it_would_here(kimi_tokenizer, monkeypatch):
    """make-target's token stream: deepseek-long's sessions (one in eight conversations) rendered in worker
    processes, the stream equal to the one rendered here."""
    import torch

    from eagle3.data import tokenize_pool

    remote, real = [], tokenize_pool.in_order

    def spy(items, work, workers):
        for item, got, far in real(items, work, workers):
            remote.append(far)
            yield item, got, far

    monkeypatch.setattr(tokenize_pool, "in_order", spy)
    here = learnable.token_stream(kimi_tokenizer, 16, 3, arch="deepseek-long", workers=1)
    assert remote == [False] * 16
    remote.clear()
    pooled = learnable.token_stream(kimi_tokenizer, 16, 3, arch="deepseek-long", workers=2)
    assert remote == [i % 8 == 7 for i in range(16)] and torch.equal(pooled, here) and len(here) > 4000
