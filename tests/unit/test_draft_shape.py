"""Draft shapes vLLM can serve where the target runs (issue 11): every TP size a target is served at,
RoPE that training and serving agree on, and the exporter's refusal of what vLLM would refuse.

vLLM 0.26 runs the EAGLE-3 draft at the target's tensor-parallel size. The rules checked below are
copied from its source: model_executor/models/llama.py LlamaAttention.__init__ (heads % tp == 0; KV
heads % tp == 0 when tp <= KV heads, else tp % KV heads == 0) and layers/linear.py
MergedColumnParallelLinear (intermediate_size divided by tp).
"""

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from eagle3.targets import presets
from eagle3.train.draft import SERVE_TPS, DraftShape, DraftShapeError, check_servable, tp_problems

TPS = (1, 2, 4, 8, 16)


def vllm_accepts(shape: DraftShape, tp: int) -> bool:
    """vLLM 0.26's assertions, written out independently of eagle3.train.draft."""
    if shape.num_attention_heads % tp:
        return False
    kv = shape.num_key_value_heads
    if kv >= tp and kv % tp:
        return False
    if kv < tp and tp % kv:
        return False
    return shape.intermediate_size % tp == 0


@given(hidden=st.integers(1, 256).map(lambda k: 64 * k), inter=st.integers(1, 4096).map(lambda k: 16 * k + 3))
def test_every_hidden_size_gets_a_draft_vllm_loads_at_every_tp(hidden, inter):
    shape = DraftShape.for_target({"hidden_size": hidden, "vocab_size": 1000, "intermediate_size": inter})
    for tp in TPS:
        assert vllm_accepts(shape, tp), (hidden, tp, shape)
        assert tp_problems(shape, tp) == []
    assert shape.head_dim in (32, 64, 128)
    # the attention width stays within 2x of the hidden size (no oversized draft)
    assert hidden <= shape.num_attention_heads * shape.head_dim <= 2 * hidden + 16 * shape.head_dim


@given(
    heads=st.one_of(st.sampled_from([8, 16, 32, 56, 64, 128]), st.integers(1, 128)),
    kv=st.one_of(st.sampled_from([1, 2, 4, 8, 14, 16]), st.integers(1, 64)),
    inter=st.one_of(st.sampled_from([18432, 688, 2050, 344]), st.integers(1, 40000)),
    tp=st.sampled_from(TPS + (32,)),
)
def test_tp_problems_is_exactly_vllms_rule(heads, kv, inter, tp):
    shape = DraftShape(
        hidden_size=heads * 64,
        vocab_size=100,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=64,
        intermediate_size=inter,
    )
    assert (tp_problems(shape, tp) == []) == vllm_accepts(shape, tp)


def test_the_kimi_k25_preset_exports_a_draft_that_loads_at_tp_8():
    cfg = presets.from_name("kimi-k2.5").hf_config
    shape = DraftShape.for_target(cfg)
    assert (shape.hidden_size, shape.head_dim, shape.num_attention_heads, shape.num_key_value_heads) == (
        7168,
        128,
        64,
        8,
    )
    assert shape.vocab_size == 163840 and shape.max_position_embeddings == 262144
    check_servable(shape, [8])
    check_servable(shape, SERVE_TPS)


def test_fourteen_kv_heads_are_refused_at_tp_8_naming_the_rule():
    shape = DraftShape(
        hidden_size=7168,
        vocab_size=163840,
        num_attention_heads=56,
        num_key_value_heads=14,
        head_dim=128,
        intermediate_size=18432,
    )
    assert tp_problems(shape, 2) == []
    with pytest.raises(DraftShapeError) as e:
        check_servable(shape, [8])
    msg = str(e.value)
    assert "14 KV heads" in msg and "TP 8" in msg and "kv_heads % tp == 0" in msg and "tp % kv_heads == 0" in msg
    assert "56 attention heads" not in msg  # 56 % 8 == 0: only the broken rule is named
    with pytest.raises(DraftShapeError, match="56 attention heads.*TP 16"):
        check_servable(shape, [16])


def test_the_draft_takes_the_targets_yarn_at_the_targets_length():
    """Kimi-K2.5 stretches its positions by YaRN (x64 from 4k); the draft's Llama layer carries the same YaRN
    (tests/unit/test_draft_rope.py: the tables equal vLLM's at long positions) and the target's length."""
    cfg = presets.from_name("kimi-k2.5").hf_config
    assert cfg["rope_scaling"]["type"] == "yarn"
    layer = DraftShape.for_target(cfg).llama_config().to_dict()
    rope = layer["rope_parameters"]
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 64.0, 4096)
    assert rope["rope_theta"] == 50000.0 and "mscale" not in rope and "mscale_all_dim" not in rope
    assert layer["max_position_embeddings"] == 262144


@pytest.mark.parametrize("yarn", [True, False], ids=["yarn", "plain"])
def test_speculators_rotary_is_the_rope_vllm_builds_from_the_export(yarn):
    """What speculators computes at training time equals the tables vLLM builds from the exported rope_parameters:
    YaRN (tests/unit/vllm_yarn_ref.py) for a target with YaRN, else plain inv_freq = theta^(-2i/d)."""
    from speculators.models.eagle3 import Eagle3DraftModel

    from eagle3.train.draft import speculators_config

    from .vllm_yarn_ref import cos_sin

    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024} if yarn else None
    target = dict(presets.from_name("tiny-kimi").hf_config, rope_theta=12345.0, rope_scaling=scaling)
    shape = DraftShape.for_target(target)
    config = speculators_config(shape, [2, 4, 5], 64, 3, "/nonexistent", ["DeepseekV3ForCausalLM"])
    model = Eagle3DraftModel(config)
    pos = torch.tensor([[0, 1, 7, 100, 3000]])
    cos, sin = model.rotary_emb(torch.zeros(1, 5, 2 * shape.hidden_size), pos)
    d = shape.head_dim
    want_cos, want_sin = cos_sin(pos[0], d, 12345.0, 4.0 if yarn else 1.0, 1024)
    # float32 angles at position 3000 carry ~1e-5 rounding; another theta or scaling is off by O(1)
    torch.testing.assert_close(cos[0].double(), torch.cat([want_cos, want_cos], -1).double(), atol=1e-4, rtol=0)
    torch.testing.assert_close(sin[0].double(), torch.cat([want_sin, want_sin], -1).double(), atol=1e-4, rtol=0)
    other = (pos[0, :, None].double() * (10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d))[None]).cos()
    assert (torch.cat([other, other], -1) - cos[0].double()).abs().max() > 0.1


def test_kimi_draft_size_on_disk_is_stated():
    """bf16, no embedding (vLLM shares the target's): the README's figure comes from this count."""
    from eagle3.train.draft import export_bytes

    shape = DraftShape.for_target(presets.from_name("kimi-k2.5").hf_config)
    n = export_bytes(shape, n_aux=3, draft_vocab_size=32000)
    h, q, kv, i = 7168, 64 * 128, 8 * 128, 18432
    params = 3 * h * h + 2 * h * (q + 2 * kv) + q * h + 3 * h * i + 4 * h + 32000 * h
    assert n == 2 * params + 8 * 32000 + 163840
    assert math.isclose(n / 1e9, 1.97, abs_tol=0.01)


def test_cli_refuses_a_shape_vllm_would_refuse_before_training(small_store, tmp_path, capsys):
    from eagle3 import cli

    out = tmp_path / "t"
    code = cli.main(
        [
            "train",
            "--store",
            str(small_store),
            "--out",
            str(out),
            "--steps",
            "1",
            "--batch",
            "4",
            "--serve-tp",
            "8",
            "--draft-kv-heads",
            "3",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "3 KV heads" in err and "TP 8" in err
    assert not out.exists() or not any(out.rglob("*.safetensors"))


def test_exported_config_json_passes_the_tp_check_and_is_bf16(trained_draft):
    cfg = json.loads((trained_draft / "config.json").read_text())
    layer = cfg["transformer_layer_config"]
    shape = DraftShape.from_layer_config(layer)
    check_servable(shape, SERVE_TPS)
    assert cfg.get("torch_dtype", cfg.get("dtype")) == "bfloat16"
