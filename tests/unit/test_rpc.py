"""eagle3.extract.rpc: every reply shape real vLLM versions produce, and the ones they must not be confused with."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from eagle3.extract.rpc import (
    Expect,
    LayerStack,
    Record,
    ReplyError,
    check_consistent,
    describe,
    normalize_reply,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@st.composite
def layer_replies(draw):
    """A world, a reply rank, and every rank's list of layer tensors (distinct objects)."""
    world = draw(st.integers(1, 8))
    rank = draw(st.integers(0, world - 1))
    n_layers = draw(st.integers(1, 6))
    tokens = draw(st.integers(1, 9))
    hidden = draw(st.integers(1, 12))
    dtype = draw(st.sampled_from(DTYPES))
    per_rank = [
        [torch.full((tokens, hidden), float(r * 10 + i), dtype=dtype) for i in range(n_layers)] for r in range(world)
    ]
    spec = LayerStack(n_layers, (tokens, hidden), dtype)
    return world, rank, spec, per_rank


def _same_objects(got, want):
    assert len(got) == len(want)
    assert all(a is b for a, b in zip(got, want))


@given(layer_replies())
def test_executor_list_per_rank_is_lossless(case):
    world, rank, spec, per_rank = case
    got = normalize_reply(per_rank, Expect(world, spec))
    assert len(got) == world
    for g, w in zip(got, per_rank):
        _same_objects(g, w)
    _same_objects(normalize_reply(per_rank, Expect(world, spec, reply_rank=rank)), per_rank[rank])


@given(layer_replies(), st.booleans())
def test_unique_reply_rank_raw_and_wrapped_give_the_same_layers(case, wrapped):
    world, rank, spec, per_rank = case
    reply = [per_rank[rank]] if wrapped else per_rank[rank]  # <= 0.11.0 wraps, >= 0.11.1 does not
    got = normalize_reply(reply, Expect(world, spec, reply_rank=rank, unique_reply_rank=True))
    _same_objects(got, per_rank[rank])
    assert [float(t[0, 0]) for t in got] == [float(rank * 10 + i) for i in range(spec.num_layers)]


@given(layer_replies())
def test_llm_collective_rpc_list_with_silent_ranks(case):
    """LLM.collective_rpc (0.26) returns one entry per worker; only the owner returns layers."""
    world, rank, spec, per_rank = case
    reply = [per_rank[r] if r == rank else None for r in range(world)]
    got = normalize_reply(reply, Expect(world, spec, reply_rank=rank, others_may_be_none=True))
    _same_objects(got, per_rank[rank])
    if world > 1:
        with pytest.raises(ReplyError, match="rank"):
            normalize_reply(reply, Expect(world, spec, reply_rank=rank))
    silent_owner = [None] * world  # the rank whose layers are wanted sent none: never a None result
    with pytest.raises(ReplyError, match=f"rank {rank}"):
        normalize_reply(silent_owner, Expect(world, spec, reply_rank=rank, others_may_be_none=True))


@given(layer_replies(), st.data())
def test_wrong_shape_dtype_or_count_is_rejected(case, data):
    world, rank, spec, per_rank = case
    layers = list(per_rank[rank])
    i = data.draw(st.integers(0, len(layers) - 1))
    mutation = data.draw(st.sampled_from(["shape", "dtype", "drop", "duplicate", "not_tensor"]))
    if mutation == "shape":
        layers[i] = torch.zeros(spec.shape[0] + 1, spec.shape[1], dtype=spec.dtype)
    elif mutation == "dtype":
        layers[i] = layers[i].to(torch.float64)
    elif mutation == "drop":
        del layers[i]
    elif mutation == "duplicate":
        layers.insert(i, layers[i])
    else:
        layers[i] = layers[i].tolist()
    expect = Expect(world, spec, reply_rank=rank, unique_reply_rank=True)
    with pytest.raises(ReplyError):
        normalize_reply(layers, expect)
    with pytest.raises(ReplyError):
        normalize_reply([layers], expect)


@given(layer_replies())
def test_indexing_a_raw_reply_with_0_fails_exactly_as_the_normalizer_reports(case):
    world, rank, spec, per_rank = case
    raw = per_rank[rank]  # what vLLM >= 0.11.1 returns for unique_reply_rank
    expect = Expect(world, spec, reply_rank=rank, unique_reply_rank=True)
    wrong = raw[0]  # the old code's blind unwrap: a bare tensor, never a list of layers
    with pytest.raises(ReplyError) as err:
        normalize_reply(wrong, expect)
    assert str(err.value) == (
        f"reply of rank {rank} (unique_reply_rank): expected {spec.what()} or a 1-element list around it, "
        f"got {describe(wrong)}"
    )


def test_unique_reply_rank_reply_indexed_with_0_keeps_only_the_first_layer():
    """Regression: `collective_rpc(..., unique_reply_rank=0)[0]` on vLLM >= 0.11.1 kept layer 0 of 4."""
    layers = [torch.randn(512, 64, dtype=torch.bfloat16) for _ in range(4)]
    spec = LayerStack(4, (512, 64), torch.bfloat16)
    expect = Expect(8, spec, reply_rank=0, unique_reply_rank=True)
    buggy = layers[0]  # what the generator stored: one [512, 64] tensor instead of four
    assert buggy.shape == (512, 64)  # plausible-looking, which is why it went unnoticed
    with pytest.raises(
        ReplyError, match=r"expected list of 4 layer tensors \[512, 64\] bfloat16 .*got Tensor\[512, 64\]"
    ):
        normalize_reply(buggy, expect)
    assert normalize_reply(layers, expect) == layers


def test_single_layer_raw_and_wrapped_are_not_confused():
    t = torch.zeros(3, 4)
    spec = LayerStack(1, (3, 4))
    e = Expect(2, spec, reply_rank=1, unique_reply_rank=True)
    assert normalize_reply([t], e)[0] is t
    assert normalize_reply([[t]], e)[0] is t
    with pytest.raises(ReplyError):
        normalize_reply(t, e)


def test_per_rank_list_of_wrong_length_names_the_likely_cause():
    layers = [torch.zeros(2, 2) for _ in range(4)]
    with pytest.raises(ReplyError, match="was unique_reply_rank passed"):
        normalize_reply(layers[:2], Expect(8, LayerStack(2, (2, 2))))


def test_engine_encoded_tensor_with_inline_bytes_is_decoded():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    encoded = ["float32", [2, 3], t.numpy().tobytes()]
    got = normalize_reply(
        [encoded], Expect(1, LayerStack(1, (2, 3), torch.float32), reply_rank=0, unique_reply_rank=True)
    )
    assert torch.equal(got[0], t)


@pytest.mark.parametrize("data", [1, "AAAA", None])
def test_engine_encoded_tensor_without_bytes_is_refused_with_advice(data):
    """vLLM 0.26's LLM.collective_rpc returned 4 x [8192, 7168] bf16 as encoded triples, not tensors."""
    reply = [[["bfloat16", [8192, 7168], data] for _ in range(4)]]
    with pytest.raises(ReplyError, match="engine-encoded.*write them to the store"):
        normalize_reply(reply, Expect(1, LayerStack(4, (8192, 7168), torch.bfloat16)))


def test_engine_encoded_tensor_with_short_bytes_is_refused():
    with pytest.raises(ReplyError, match="carries 4 bytes, needs 24"):
        normalize_reply([[["float32", [2, 3], b"\0" * 4]]], Expect(1, LayerStack(1)))


def test_records_and_consistency_across_ranks():
    recs = [{"rank": r, "n_tokens": 1024, "layer_ids": [2, 30, 58, 61]} for r in range(4)]
    got = normalize_reply(recs, Expect(4, Record(frozenset({"rank", "n_tokens"}))))
    assert got == recs
    check_consistent(got, ["n_tokens", "layer_ids"])
    recs[2]["n_tokens"] = 1023
    with pytest.raises(ReplyError, match="rank 2: 1023"):
        check_consistent(recs, ["n_tokens"])
    with pytest.raises(ReplyError, match="lacks"):
        normalize_reply([{"rank": 0}], Expect(1, Record(frozenset({"rank", "n_tokens"}))))
    assert normalize_reply({"a": 1}, Expect(2, Record(), reply_rank=1, unique_reply_rank=True)) == {"a": 1}
    assert normalize_reply([{"a": 1}], Expect(2, Record(), reply_rank=1, unique_reply_rank=True)) == {"a": 1}


def test_describe_shows_nesting_seen_on_vllm_026():
    reply = [[["bfloat16", [8192, 7168], 1]] * 4]
    assert describe(reply) == (
        "list[1]<list[4]<engine-encoded tensor ['bfloat16', [8192, 7168], int], "
        "engine-encoded tensor ['bfloat16', [8192, 7168], int], engine-encoded tensor ['bfloat16', [8192, 7168], "
        "int], engine-encoded tensor ['bfloat16', [8192, 7168], int]>>"
    )


def test_expect_rejects_impossible_requests():
    with pytest.raises(ValueError):
        Expect(0, Record())
    with pytest.raises(ValueError):
        Expect(2, Record(), reply_rank=2)
    with pytest.raises(ValueError):
        Expect(2, Record(), unique_reply_rank=True)


def test_msgpack_extension_payload_is_read():
    class Ext:  # msgspec.msgpack.Ext as an untyped decode returns it
        code, data = 3, torch.ones(2, dtype=torch.float16).numpy().tobytes()

    got = normalize_reply([[["float16", [2], Ext()]]], Expect(1, LayerStack(1, (2,), torch.float16)))
    assert torch.equal(got[0][0], torch.ones(2, dtype=torch.float16))
