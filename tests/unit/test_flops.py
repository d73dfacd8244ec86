"""The draft's training FLOPs formula (tests/perf/flops.py), checked against torch's own count of the model:
speculators' Eagle3DraftModel, forward + backward, at small shapes and non-default options. A part counted at the
wrong multiple (a frozen lm_head given a weight gradient, fc an input gradient, attention without the TTT steps'
growing KV cache) changes the count."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from eagle3.train.draft import DraftShape, speculators_config
from tests.perf import flops


def _count(shape: DraftShape, n_aux: int, draft_vocab: int, ttt: int, seq: int) -> dict:
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel

    cfg = speculators_config(
        shape,
        list(range(2, 2 + n_aux)),
        draft_vocab,
        ttt,
        "/nonexistent",
        ["LlamaForCausalLM"],
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    m = Eagle3DraftModel(cfg).float()
    for p in m.parameters():  # the verifier's weights are NaN until loaded: any values do for a count
        if p.isnan().any():
            p.data.normal_()
    t2d = torch.zeros(shape.vocab_size, dtype=torch.bool)
    t2d[:draft_vocab] = True
    m.load_vocab_mappings(t2d, torch.zeros(draft_vocab, dtype=torch.long))
    h = shape.hidden_size
    inputs = dict(
        input_ids=torch.randint(0, shape.vocab_size, (1, seq)),
        hidden_states=torch.randn(1, seq, n_aux * h),
        verifier_last_hidden_states=torch.randn(1, seq, h),
        loss_mask=torch.ones(1, seq, dtype=torch.bool),
        position_ids=torch.arange(1, seq + 1)[None],
        document_ids=torch.zeros(1, seq, dtype=torch.long),
    )
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:  # math: attention as matmuls
        _, loss, _ = m(**inputs, ttt_steps=ttt, loss_config=resolve_loss_config("kl_div", "eager"))
        loss.backward()
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    rotary = ttt * 2 * (shape.head_dim // 2) * seq  # the rotary embedding's inv_freq x positions, a bmm a step
    return {"mm": counts.get("aten.mm", 0), "attention": counts.get("aten.bmm", 0) - rotary}


@pytest.mark.parametrize("n_aux,draft_vocab,ttt,seq", [(3, 256, 3, 32), (2, 200, 2, 24), (4, 512, 4, 16)])
def test_the_formula_is_torch_s_count_of_the_model(n_aux, draft_vocab, ttt, seq):
    shape = DraftShape(64, 512, 4, 2, 16, 128)
    got = _count(shape, n_aux, draft_vocab, ttt, seq)
    assert got["mm"] == sum(flops.linear_flops(shape, n_aux, draft_vocab, ttt).values()) * seq
    assert got["attention"] == flops.dense_attention_flops(shape, ttt, seq) * seq


def test_the_useful_attention_is_the_causal_share_of_the_dense_count():
    shape = DraftShape(64, 512, 4, 2, 16, 128)
    seq, ttt = 32, 3
    useful, dense = flops.attention_flops(shape, ttt, seq), flops.dense_attention_flops(shape, ttt, seq)
    keys_useful = sum((seq + 1) / 2 + s for s in range(ttt))  # causal on step 0's keys + one key per earlier step
    assert useful / dense == pytest.approx(keys_useful / sum((s + 1) * seq for s in range(ttt)))


def test_kimi_k25_s_draft_costs_about_16_gflop_a_token_at_8k():
    shape = flops.kimi_k25_draft()
    assert (shape.hidden_size, shape.num_attention_heads * shape.head_dim, shape.intermediate_size) == (
        7168,
        8192,
        18432,
    )
    per_token = flops.train_flops_per_token(shape, 3, 32000, 3, 8192)
    assert 15.5e9 < per_token < 16.5e9  # 14.66 GFLOP of matmuls + 1.21 of attention at 8k
    assert flops.mfu(21_811, per_token) == pytest.approx(0.35, abs=0.001)


@pytest.mark.parametrize("q_lora", [24, None])
def test_the_mla_formula_is_torch_s_count_of_the_mla_draft(q_lora):
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel

    from eagle3.train import mla_draft

    shape = DraftShape(64, 512, 4, 2, 16, 128)
    mla = mla_draft.MLAShape(64, 4, q_lora, 32, 16, 8, 12, 96)
    n_aux, draft_vocab, ttt, seq = 3, 256, 3, 20
    cfg = speculators_config(
        shape, [2, 3, 4], draft_vocab, ttt, "/nonexistent", ["DeepseekV3ForCausalLM"], attn_implementation="sdpa"
    )
    torch.manual_seed(0)
    m = Eagle3DraftModel(cfg).float()
    mla_draft.install(m, mla)
    for p in m.parameters():
        if p.isnan().any():
            p.data.normal_()
    t2d = torch.zeros(512, dtype=torch.bool)
    t2d[:draft_vocab] = True
    m.load_vocab_mappings(t2d, torch.zeros(draft_vocab, dtype=torch.long))
    inputs = dict(
        input_ids=torch.randint(0, 512, (1, seq)),
        hidden_states=torch.randn(1, seq, n_aux * 64),
        verifier_last_hidden_states=torch.randn(1, seq, 64),
        loss_mask=torch.ones(1, seq, dtype=torch.bool),
        position_ids=torch.arange(1, seq + 1)[None],
        document_ids=torch.zeros(1, seq, dtype=torch.long),
    )
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        _, loss, _ = m(**inputs, ttt_steps=ttt, loss_config=resolve_loss_config("kl_div", "eager"))
        loss.backward()
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    rotary = ttt * 2 * (shape.head_dim // 2) * seq  # speculators' own (Llama) rotary, still computed, unused by MLA
    assert counts["aten.mm"] == sum(flops.mla_linear_flops(mla, n_aux, draft_vocab, ttt).values()) * seq
    assert counts["aten.bmm"] - rotary == flops.mla_attention_flops(mla, ttt, seq, dense=True) * seq
