"""Readers, chat template, loss masks and the long-sample rule."""

import json

import pytest

from eagle3.data.conversations import (
    DataConfig,
    DataError,
    load_samples,
    parse_conversation,
    random_samples,
    render,
)


def _write(tmp_path, name, lines):
    p = tmp_path / name
    p.write_text("".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines))
    return p


def _assistant_text(tokenizer, s):
    return tokenizer.decode([t for t, m in zip(s.input_ids, s.loss_mask) if m])


def test_openai_and_sharegpt_give_the_same_sample(tmp_path, tokenizer):
    oa = _write(
        tmp_path,
        "oa.jsonl",
        [
            {
                "messages": [
                    {"role": "user", "content": "Count from 1 to 3."},
                    {"role": "assistant", "content": "1, 2, 3."},
                ]
            }
        ],
    )
    sg = _write(
        tmp_path,
        "sg.jsonl",
        [{"conversations": [{"from": "human", "value": "Count from 1 to 3."}, {"from": "gpt", "value": "1, 2, 3."}]}],
    )
    (a,), _ = load_samples(DataConfig([str(oa)]), tokenizer)
    (b,), _ = load_samples(DataConfig([str(sg)]), tokenizer)
    assert a.input_ids == b.input_ids and a.loss_mask == b.loss_mask
    assert a.sample_id == "oa.jsonl:1"


def test_loss_mask_covers_exactly_the_assistant_turns(tokenizer):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "content": "2 plus 3 is 5."},
        {"role": "user", "content": "Times 2?"},
        {"role": "assistant", "content": "5 times 2 is 10."},
    ]
    ids, mask = render(tokenizer, msgs)
    assert len(ids) == len(mask)
    masked = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    # the end-of-turn token is generated; the "\n" the template writes after it is not
    assert masked == "2 plus 3 is 5.<|im_end|>5 times 2 is 10.<|im_end|>"
    unmasked = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert "What is 2 plus 3?" in unmasked and "Be brief." in unmasked and "is 5" not in unmasked


@pytest.mark.parametrize("rule", ["truncate", "split", "drop", "error"])
def test_long_sample_rule(tmp_path, tokenizer, rule):
    long = {
        "messages": [
            {"role": "user", "content": "Count from 1 to 60."},
            {"role": "assistant", "content": ", ".join(map(str, range(1, 61)))},
        ]
    }
    short = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    p = _write(tmp_path, "d.jsonl", [short, long])
    cfg = DataConfig([str(p)], max_len=48, long_rule=rule, rejects_path=str(tmp_path / "rej.jsonl"))
    if rule == "error":
        with pytest.raises(DataError, match=r"d.jsonl:2: sample has \d+ tokens, more than max_len 48"):
            load_samples(cfg, tokenizer)
        return
    samples, rep = load_samples(cfg, tokenizer)
    full, _ = render(tokenizer, long["messages"])
    if rule == "truncate":
        assert [len(s) for s in samples][1] == 48 and rep.truncated == 1
        assert samples[1].input_ids == tuple(full[:48])
    elif rule == "split":
        parts = [s for s in samples if s.sample_id.startswith("d.jsonl:2#")]
        assert sum(len(s) for s in parts) == len(full) and all(len(s) <= 48 for s in parts)
        assert [t for p in parts for t in p.input_ids] == full
        assert rep.split_parts == len(parts)
    else:
        assert [s.sample_id for s in samples] == ["d.jsonl:1"] and rep.rejected["too_long"] == 1
        rej = [json.loads(x) for x in (tmp_path / "rej.jsonl").read_text().splitlines()]
        assert rej[0]["line"] == 2 and rej[0]["reason"] == "too_long"


def test_split_drops_a_last_window_of_one_token(tmp_path, tokenizer):
    """A one-token sample has no (token, next token) pair to train on: --long split keeps windows of 2+ tokens."""
    long = {
        "messages": [
            {"role": "user", "content": "Count from 1 to 60."},
            {"role": "assistant", "content": ", ".join(map(str, range(1, 61)))},
        ]
    }
    full, mask = render(tokenizer, long["messages"])
    m = next(m for m in range(24, len(full)) if len(full) % m == 1)  # the last window holds one token
    assert mask[-2] == 1  # the end-of-turn token; the template's "\n" after it is the last token
    samples, rep = load_samples(
        DataConfig([str(_write(tmp_path, "d.jsonl", [long]))], max_len=m, long_rule="split"), tokenizer
    )
    assert [t for s in samples for t in s.input_ids] == full[:-1] and min(len(s) for s in samples) >= 2
    assert rep.split_parts == len(samples) == len(full) // m
    assert not rep.rejected  # dropped by the length rule, not rejected as a window with no assistant token


def test_skip_policy_reports_bad_lines_and_keeps_good_ones(tmp_path, tokenizer):
    good = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    p = _write(tmp_path, "mixed.jsonl", [good, "{not json", "", {"messages": []}, good])
    rej = tmp_path / "rejects.jsonl"
    samples, rep = load_samples(DataConfig([str(p)], rejects_path=str(rej)), tokenizer)
    assert [s.sample_id for s in samples] == ["mixed.jsonl:1", "mixed.jsonl:5"]
    assert rep.blank_lines == 1 and dict(rep.rejected) == {"invalid_json": 1, "empty": 1}
    reasons = [(r["line"], r["reason"]) for r in map(json.loads, rej.read_text().splitlines())]
    assert reasons == [(2, "invalid_json"), (4, "empty")]
    with pytest.raises(DataError, match="mixed.jsonl:2: invalid JSON"):
        load_samples(DataConfig([str(p)], on_error="stop"), tokenizer)


def test_role_names_are_normalized():
    msgs = parse_conversation(
        json.dumps(
            {
                "conversations": [
                    {"from": "system", "value": "s"},
                    {"from": "human", "value": "u"},
                    {"from": "gpt", "value": "a"},
                ]
            }
        ),
        "f",
        1,
    )
    assert [m["role"] for m in msgs] == ["system", "user", "assistant"]


def test_random_samples_are_deterministic_and_sized():
    a = random_samples(3, [5, 7, 9], vocab_size=100, seed=1)
    assert [len(s) for s in a] == [5, 7, 9] and a == random_samples(3, [5, 7, 9], vocab_size=100, seed=1)
    assert all(8 <= t < 100 for s in a for t in s.input_ids)
