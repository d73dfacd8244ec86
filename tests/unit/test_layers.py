"""Layer ids follow vLLM's EAGLE-3 convention (DESIGN.md)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eagle3.targets.layers import (
    LayerIdError,
    aux_ids,
    default_layer_ids,
    hook_layer_index,
    validate_layer_ids,
)
from eagle3.targets.presets import PRESETS, from_name


def test_kimi_default_ids():
    assert default_layer_ids(61) == (2, 30, 58, 61)
    assert from_name("kimi-k2.5").layer_ids == (2, 30, 58, 61)
    assert aux_ids((2, 30, 58, 61)) == (2, 30, 58)


def test_hook_on_layer_i_yields_id_i_plus_1():
    assert hook_layer_index(61) == 60  # the last layer's output, before the final norm
    assert hook_layer_index(2) == 1
    with pytest.raises(LayerIdError):
        hook_layer_index(0)


@given(st.integers(7, 200))
def test_defaults_are_valid_for_any_deep_enough_target(n):
    ids = default_layer_ids(n)
    assert len(set(ids)) == 4 and ids[-1] == n and list(ids) == sorted(ids)


@pytest.mark.parametrize(
    "ids,msg",
    [
        ((2, 2, 8), "repeat"),
        ((2, 9), "out of range"),
        ((-1, 8), "out of range"),
        ((5, 2, 8), "ascend"),
        ((2, 4), "last layer id"),
        ((8,), "at least one aux"),
    ],
)
def test_bad_layer_ids_are_refused_with_the_reason(ids, msg):
    with pytest.raises(LayerIdError, match=msg):
        validate_layer_ids(ids, 8)


def test_too_shallow_target_has_no_distinct_defaults():
    with pytest.raises(LayerIdError, match="L >= 7"):
        default_layer_ids(5)


def test_presets_are_data_with_consistent_shapes():
    mini = from_name("mini-kimi")
    assert (mini.hidden_size, mini.hf_config["kv_lora_rank"], mini.hf_config["q_lora_rank"]) == (7168, 512, 1536)
    assert mini.hf_config["qk_rope_head_dim"] == 64 and mini.layer_ids == (2, 4, 5, 8)
    assert from_name("kimi-k2.5").bytes_per_token == 4 * 7168 * 2  # 57 KiB per token
    for p in PRESETS.values():
        if p.hf_config:
            text = p.hf_config.get("text_config") or p.hf_config  # Kimi-K2.5's wrapper: the text model's shapes
            assert text["hidden_size"] == p.hidden_size
            assert text["num_hidden_layers"] == p.num_hidden_layers
    depth = from_name("kimi-depth")
    assert depth.layer_ids == (2, 30, 58, 61) and depth.build == "config" and not from_name("kimi-k2.5").buildable
    kimi = from_name("kimi-k2.5").hf_config
    for k in (
        "hidden_size",
        "num_hidden_layers",
        "vocab_size",
        "kv_lora_rank",
        "q_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
        "num_attention_heads",
        "intermediate_size",
        "moe_intermediate_size",
    ):
        assert depth.hf_config[k] == kimi[k], k
    assert (depth.hf_config["n_routed_experts"], depth.hf_config["num_experts_per_tok"]) == (8, 8)
    with pytest.raises(KeyError, match="known"):
        from_name("nope")
