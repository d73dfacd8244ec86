"""The trainer: loss goes down, checkpoints vLLM can load, vocab mapping, resume, refusals."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3 import faults
from eagle3.store.format import StoreMismatch
from eagle3.targets import tiny
from eagle3.targets.presets import from_name
from eagle3.train import checkpoint
from eagle3.train.draft import DraftShape, check_vllm_loadable, draft_vocab
from eagle3.train.train import TrainConfig, train

from .conftest import NARROW_DRAFT, run_forked


def _cfg(store, out, **kw):
    # the narrow draft and one TTT step: these runs' subject is the trainer's bookkeeping (resume, checkpoints, the
    # schedule, reading); a test about the TTT steps or the draft's shape asks for them
    base = dict(store=str(store), out=str(out), draft_vocab_size=256, batch_samples=4, lr=3e-3, seed=0, ttt_steps=1)
    return TrainConfig(**{**base, **NARROW_DRAFT, **kw})


@pytest.fixture(scope="module")
def trained(trained_run):
    return trained_run


def test_loss_decreases_on_a_fixed_seed(trained):
    result, _ = trained
    assert result.steps == 12 and len(result.losses) == 12
    assert sum(result.losses[-3:]) / 3 < 0.8 * sum(result.losses[:3]) / 3, result.losses
    assert all(torch.isfinite(torch.tensor(result.losses)))


def test_saved_draft_is_what_vllm_speculators_loader_requires(trained, tiny_kimi):
    result, _ = trained
    cfg = json.loads(open(f"{result.draft}/config.json").read())
    assert check_vllm_loadable(cfg) == []
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(tiny_kimi.resolve())
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["hidden_size"] == 128 and layer["vocab_size"] == 1024
    assert not any(k in layer for k in ("kv_lora_rank", "n_routed_experts", "q_lora_rank"))
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and cfg["norm_before_residual"] is False
    weights = load_file(f"{result.draft}/model.safetensors")
    assert weights["fc.weight"].shape == (128, 3 * 128)
    assert weights["d2t"].shape == (256,) and weights["lm_head.weight"].shape == (256, 128)
    assert "verifier_lm_head.weight" not in weights
    # the serving dtype, and no second copy of the target's embedding (vLLM shares the target's)
    assert "embed_tokens.weight" not in weights
    assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.bfloat16}
    ckpt = load_file(f"{result.out}/checkpoints/step-0000012/model.safetensors")
    assert "embed_tokens.weight" not in ckpt and ckpt["fc.weight"].dtype == torch.float32
    torch.testing.assert_close(weights["fc.weight"], ckpt["fc.weight"].to(torch.bfloat16), atol=0, rtol=0)


def test_draft_vocab_mapping_selects_the_verifier_rows_it_claims(trained, tiny_kimi):
    result, _ = trained
    w = load_file(f"{result.draft}/model.safetensors")
    target = load_file(str(tiny_kimi / "model.safetensors"))
    targets = torch.arange(256) + w["d2t"]
    assert torch.equal(targets, torch.nonzero(w["t2d"]).flatten())
    torch.testing.assert_close(
        w["lm_head.weight"], target["lm_head.weight"][targets].to(torch.bfloat16), atol=0, rtol=0
    )


def test_draft_vocab_keeps_the_most_frequent_tokens_in_ascending_order():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    t2d, d2t = draft_vocab(counts, 3)
    assert t2d.tolist() == [False, False, True, True, False, True]
    assert (torch.arange(3) + d2t).tolist() == [2, 3, 5]
    with pytest.raises(ValueError):
        draft_vocab(counts, 7)
    t2d, _ = draft_vocab(torch.tensor([2, 7, 0, 7, 7]), 2)  # a tie across the cut goes to the smaller ids
    assert torch.nonzero(t2d).flatten().tolist() == [1, 3]


def test_speculators_from_training_args_cannot_take_a_deepseek_verifier(tiny_kimi):
    """Why the draft config is built here: copying the DeepseekV3 verifier config gives a layer type
    neither speculators' draft nor vLLM's loader has."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import AutoConfig

    with pytest.raises(KeyError, match="deepseek_v3"):
        Eagle3DraftModel.from_training_args(
            AutoConfig.from_pretrained(tiny_kimi),
            verifier_name_or_path=str(tiny_kimi),
            draft_vocab_size=256,
            norm_before_residual=False,
            ttt_steps=3,
            target_layer_ids=[2, 4, 5],
        )
    shape = DraftShape.for_target(json.loads((tiny_kimi / "config.json").read_text()))
    assert shape.llama_config().model_type == "llama"


def _train_with_fault(cfg, point, k):
    os.environ["EAGLE3_FAULT"] = f"{point}:{k}"  # runs in the forked child only
    train(cfg, progress=False)


def test_killed_training_resumes_with_the_same_loss_curve(small_store, tmp_path, one_thread):
    ref = train(_cfg(small_store, tmp_path / "ref", max_steps=6, checkpoint_every=2), progress=False).losses
    cfg = _cfg(small_store, tmp_path / "killed", max_steps=6, checkpoint_every=2)
    # kill -9 after step 3 (checkpoint 2 exists), then again while checkpoint 4 is being written
    for point, k in [("after_step", 3), ("mid_checkpoint", 1)]:
        killed, _ = run_forked(lambda point=point, k=k: _train_with_fault(cfg, point, k))
        assert killed, point
        assert checkpoint.latest(tmp_path / "killed").name == "step-0000002"
    resumed = train(cfg, progress=False)
    assert resumed.losses == ref


def test_trainer_refuses_a_store_from_another_target(small_store, tmp_path):
    other = tiny.build_model(
        from_name("tiny-kimi"), tmp_path / "other", seed=0, with_tokenizer=False, overrides={"num_hidden_layers": 9}
    )
    with pytest.raises(StoreMismatch, match="Train against the target the store came from"):
        train(_cfg(small_store, tmp_path / "o", max_steps=1, target=str(other)), progress=False)


def test_fault_points_are_off_unless_asked(monkeypatch):
    monkeypatch.delenv("EAGLE3_FAULT", raising=False)
    assert faults.from_env() is None


def test_ttt_step_loss_decay_and_warmup_reach_the_run(small_store, tmp_path):
    """Options at non-default values change what is trained: the step-loss decay weighs later TTT steps, warm-up
    ramps the learning rate linearly before the cosine."""
    from eagle3.train.train import _lr_lambda

    base = train(_cfg(small_store, tmp_path / "a", max_steps=1, ttt_steps=3), progress=False).losses
    decayed = train(
        _cfg(small_store, tmp_path / "b", max_steps=1, ttt_steps=3, ttt_step_loss_decay=0.5), progress=False
    ).losses
    assert decayed[0] < base[0]  # steps 1 and 2 weighed 0.5 and 0.25 instead of 1
    lr = _lr_lambda(TrainConfig(store="", out="", warmup_steps=4), total=20)
    assert [lr(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0] and lr(19) < 0.2


def test_each_step_runs_at_the_schedule_s_rate_for_that_step(small_store, tmp_path, monkeypatch):
    """The optimizer's step s uses lr x schedule(s): warm-up's first step at lr / warmup_steps, not a step late."""
    from eagle3.train.train import _lr_lambda

    used, step = [], torch.optim.AdamW.step

    def spy(self, *a, **kw):
        used.append(self.param_groups[0]["lr"])
        return step(self, *a, **kw)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    cfg = _cfg(small_store, tmp_path / "a", max_steps=6, warmup_steps=3, lr=1e-3)
    train(cfg, progress=False)
    lr = _lr_lambda(cfg, total=6)
    assert used == pytest.approx([1e-3 * lr(s) for s in range(6)], rel=1e-12)
    assert used[:3] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3])


def test_the_optimizer_is_fused_adamw_on_cuda_and_torch_s_default_elsewhere():
    """On CUDA the trainer steps AdamW's fused kernel (one pass over weights, gradients and both moments: at Kimi-K2.5's
    0.99 B-parameter draft the multi-tensor default makes several); on the CPU the path is unchanged. The trainer
    benchmark measures the two beside each other (tests/gpu/test_bench_train.py)."""
    from eagle3.train.train import make_optimizer, optimizer_kwargs

    assert optimizer_kwargs("cuda") == {"fused": True}
    assert optimizer_kwargs("cuda", "foreach") == {"foreach": True}
    assert optimizer_kwargs("cpu") == {}
    with pytest.raises(ValueError, match="fused or foreach"):
        optimizer_kwargs("cuda", "loop")
    w = torch.nn.Parameter(torch.ones(3))
    opt = make_optimizer([w], lr=0.1, betas=(0.9, 0.95), weight_decay=0.0)
    g = opt.param_groups[0]
    assert isinstance(opt, torch.optim.AdamW) and not g["fused"] and g["foreach"] is None and g["lr"] == 0.1
    assert g["betas"] == (0.9, 0.95)


def test_the_draft_is_built_on_the_device_it_trains_on(small_store, monkeypatch):
    """Not on the CPU and then copied: at Kimi-K2.5's size the CPU's initialization took 39 s (two cores), most of it
    for the target's embedding that load_verifier_weights overwrites. (meta stands in for a GPU here.)"""
    from speculators.models.eagle3 import Eagle3DraftModel

    from eagle3.store.folder import Store
    from eagle3.train import train as train_mod

    where = []

    class Built(Exception):
        pass

    def init(self, *a, **kw):
        where.append(torch.get_default_device().type)
        raise Built

    monkeypatch.setattr(Eagle3DraftModel, "__init__", init)
    store = Store.open(small_store)
    for device in ("meta", "cpu"):
        cfg = _cfg(small_store, "unused", device=device)
        shape, tcfg, target = train_mod.draft_shape(cfg, store)
        with pytest.raises(Built):
            train_mod.build_draft(cfg, store, train_mod.StoreSamples(store), shape, tcfg, target)
    assert where == ["meta", "cpu"]


@pytest.mark.parametrize("n,world,batch", [(6, 1, 6), (6, 4, 4), (9, 2, 8), (8, 1, 8), (20, 2, 8)])
def test_a_store_smaller_than_one_batch_trains_with_a_batch_every_process_can_split(n, world, batch, tmp_path):
    from eagle3.train.train import fit_batch

    notes = []
    cfg = fit_batch(_cfg(tmp_path, tmp_path / "o", batch_samples=8), n, world, notes)
    assert cfg.batch_samples == batch and cfg.batch_samples % world == 0
    assert bool(notes) == (batch != 8)
    with pytest.raises(StoreMismatch, match="holds 3 samples, fewer than the 4 training processes"):
        fit_batch(_cfg(tmp_path, tmp_path / "o"), 3, 4, [])


def test_a_checkpoint_restores_the_random_generators(small_store, tmp_path):
    """The interrupt's checkpoint holds the RNG of its step: what the run draws next is what it would have drawn."""
    torch.manual_seed(123)
    saved = checkpoint.rng_state()
    ahead = torch.rand(4)
    torch.manual_seed(999)
    checkpoint.set_rng_state(saved)
    assert torch.equal(torch.rand(4), ahead)
    r = train(_cfg(small_store, tmp_path / "r", max_steps=2, checkpoint_every=1), progress=False)
    state = json.loads((Path(r.out) / "checkpoints" / "step-0000001" / "trainer_state.json").read_text())
    assert state["rng"]["cpu"] and isinstance(state["rng"]["cuda"], list)
