"""The INT4 target (`eagle3 make-target --quantize int4`): the learnable DeepseekV3 target with its routed experts
quantized as Kimi-K2.5's are, in compressed-tensors' own format, read by transformers and by every config reader."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
from safetensors.torch import load_file

from eagle3 import cli
from eagle3.targets import int4, learnable, tiny

pytest.importorskip("compressed_tensors")

ROUTED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(bf16 source folder, its INT4 form) of the untrained deepseek profile: 7 MoE layers x 8 experts x 3."""
    src = tmp_path_factory.mktemp("bf16") / "target"
    tiny.build_model(learnable.ARCHES["deepseek"], src, seed=3)
    out = tmp_path_factory.mktemp("int4") / "target"
    counts = int4.quantize_target(src, out)
    return src, out, counts


def test_exactly_the_routed_experts_are_quantized_the_rest_is_kept_in_bf16(pair):
    src, out, counts = pair
    before, after = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    routed = {k for k in before if ROUTED.fullmatch(k)}
    assert len(routed) == 7 * 8 * 3 and counts == {"quantized": len(routed), "kept": len(before) - len(routed)}
    for name in routed:
        base = name[: -len("weight")]
        n, k = before[name].shape
        assert name not in after
        assert after[base + "weight_packed"].dtype == torch.int32 and after[base + "weight_packed"].shape == (n, k // 8)
        assert after[base + "weight_scale"].dtype == torch.bfloat16 and after[base + "weight_scale"].shape == (
            n,
            k // 32,
        )
        assert after[base + "weight_shape"].tolist() == [n, k]
    kept = set(before) - routed  # attention, shared experts, the dense MLP of layer 0, router, norms, embeddings, head
    assert any("shared_experts" in k for k in kept) and any("layers.0.mlp.gate_proj" in k for k in kept)
    for name in kept:
        assert torch.equal(after[name], before[name].to(torch.bfloat16)), name
    assert len(after) == len(kept) + 3 * len(routed)


def test_the_config_carries_kimi_k25_s_quantization_config_and_every_reader_takes_it(pair):
    from eagle3.extract import extract
    from eagle3.targets import presets
    from eagle3.train.draft import DraftShape

    QUANT = presets.KIMI_K25_QUANT  # Kimi-K2.5's own fields

    src, out, _ = pair
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization_config"]
    assert {k: q[k] for k in ("quant_method", "format", "ignore")} == {
        k: QUANT[k] for k in ("quant_method", "format", "ignore")
    }
    group = q["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and q["quantization_status"] == "compressed"
    assert {k: group["weights"][k] for k in QUANT["config_groups"]["group_0"]["weights"]} == QUANT["config_groups"][
        "group_0"
    ]["weights"]
    assert group["input_activations"] is None and cfg["dtype"] == "bfloat16"
    spec = extract.store_spec(out, None, "bfloat16")
    assert spec.layer_ids == (2, 4, 5, 8) and spec.hidden_size == 256
    # a store records which numeric form it was taken from
    assert spec.target["config_hash"] != extract.store_spec(src, None, "bfloat16").target["config_hash"]
    assert presets.profile_from_config(cfg).hidden_size == 256
    assert DraftShape.for_target(cfg).hidden_size == 256


def test_transformers_reads_it_as_the_dequantized_model_within_half_a_step_of_the_source(pair):
    """transformers (with compressed-tensors) decompresses the experts into its fused [E, 2I, H] / [E, H, I]
    parameters in bf16, as vLLM's kernels dequantize them; the hf backend's loader casts them to float32. Each weight
    is round-to-nearest of the source on its group's stored scale, an integer step in [-8, 7]."""
    from eagle3.extract.hf_backend import load_model

    src, out, _ = pair
    before, after = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    model = load_model(out, "float32", "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    for layer in (1, 7):
        experts = model.model.layers[layer].mlp.experts
        for e in (0, 5):
            base = f"model.layers.{layer}.mlp.experts.{e}."
            inter = before[base + "gate_proj.weight"].shape[0]
            got = {
                "gate_proj": experts.gate_up_proj[e, :inter],
                "up_proj": experts.gate_up_proj[e, inter:],
                "down_proj": experts.down_proj[e],
            }
            for proj, w in got.items():
                w, source = w.detach(), before[base + proj + ".weight"].float()
                scale = after[base + proj + ".weight_scale"].float().repeat_interleave(32, dim=1)
                steps = (w / scale).round()
                assert steps.max() <= 7 and steps.min() >= -8, (layer, e, proj)
                assert torch.equal((steps * scale).bfloat16().float(), w), (layer, e, proj)  # bf16(step x scale)
                # half a step and the bf16 rounding of step x scale (2^-8 of |w|); at the clamp (+max is 7.5 steps,
                # stored as 7) also the scale's own bf16 rounding, up to 7.5 x 2^-8 steps
                err, bf16 = (w - source).abs(), w.abs() * 2**-8 + 1e-9
                assert (err <= scale * (0.5 + 7.5 * 2**-8) + bf16).all(), (layer, e, proj)
                inside = steps.abs() < 7
                assert (err[inside] <= scale[inside] * 0.5 + bf16[inside]).all(), (layer, e, proj)
                assert not torch.equal(w, source)


def test_the_hf_backend_extracts_from_it_and_the_final_state_self_check_passes(pair, small_data, tmp_path, capsys):
    """The INT4 target's states are its own: the self-check (final norm + lm_head on the last state reproduce the
    model's next token) passes on them, and they differ from the bf16 source's."""
    from eagle3.store.folder import Store

    src, out, _ = pair
    stores = {}
    for name, model in (("int4", out), ("bf16", src)):
        stores[name] = tmp_path / name
        argv = ["extract", "--model", str(model), "--data", str(small_data), "--out", str(stores[name]),
                "--backend", "hf", "--max-samples", "4", "--max-len", "64"]  # fmt: skip
        assert cli.main(argv) == 0
        said = capsys.readouterr().out
        assert "final-state self-check PASS" in said, said
    a, b = (Store.open(stores[n]) for n in ("int4", "bf16"))
    assert a.spec.target["config_hash"] != b.spec.target["config_hash"]
    sa, sb = next(a.iter_samples()), next(b.iter_samples())
    assert sa["sample_id"] == sb["sample_id"] and torch.equal(sa["input_ids"], sb["input_ids"])
    for i in (2, 4, 5, 8):  # every stored id follows layer 1, the first MoE layer: near, not equal
        a_, b_ = sa["states"][i].float(), sb["states"][i].float()
        rel = float((a_ - b_).norm() / b_.norm())
        assert 0 < rel < 0.1, (i, rel)


def test_make_target_quantize_from_writes_the_int4_form_of_a_trained_target(pair, tmp_path, capsys):
    src, _, _ = pair
    out = tmp_path / "t4"
    assert cli.main(["make-target", "--quantize", "int4", "--from", str(src), "--out", str(out)]) == 0
    assert "168 routed expert weights in INT4" in capsys.readouterr().out
    assert (out / "tokenizer.json").exists() and "quantization_config" in json.loads((out / "config.json").read_text())


def test_make_target_trains_then_writes_the_int4_form(tmp_path):
    out = tmp_path / "t"
    info = learnable.make_target(
        out, steps=2, batch=1, seq_len=32, n_conversations=8, device="cpu", arch="deepseek", quantize="int4"
    )
    assert info["quantize"] == "int4" and info["quantized"] == 7 * 8 * 3
    assert json.loads((out / "eagle3_target.json").read_text())["quantize"] == "int4"
    names = load_file(out / "model.safetensors")
    assert "model.layers.3.mlp.experts.6.down_proj.weight_packed" in names
    assert "model.layers.3.mlp.experts.6.down_proj.weight" not in names


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--arch", "llama", "--quantize", "int4"], "--arch llama has none"),
        (["--from", "SRC"], "add --quantize int4"),
        (["--quantize", "int4", "--from", "NOPE"], "nope: no such folder"),
    ],
)
def test_make_target_quantize_refuses_in_under_a_second_and_writes_nothing(pair, tmp_path, capsys, argv, says):
    src, _, _ = pair
    argv = [str(src) if a == "SRC" else str(tmp_path / "nope") if a == "NOPE" else a for a in argv]
    t0 = time.perf_counter()
    assert cli.main(["make-target", *argv, "--out", str(tmp_path / "out")]) == 2
    assert time.perf_counter() - t0 < 1.0
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_quantized_target_is_not_quantized_again_and_the_folder_begun_is_removed(pair, tmp_path, capsys):
    _, q, _ = pair
    assert cli.main(["make-target", "--quantize", "int4", "--from", str(q), "--out", str(tmp_path / "again")]) == 2
    assert "quantized already" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()


def test_kimi_k25_s_class_at_full_expert_width_reads_as_kimi_k25(tmp_path):
    """The GPU suite's kimi-k25-int4 profile: Kimi-K2.5's own class, text_config (384 experts of 2048, top-8) and
    quantization_config, 6 layers. Its config parses as compressed-tensors' own, and the readers take it."""
    from compressed_tensors.quantization import QuantizationConfig

    from eagle3.extract import extract
    from eagle3.targets import presets
    from eagle3.train.draft import DraftShape, check_servable

    prof = presets.from_name("kimi-k25-int4")
    folder = tiny.build_model(prof, tmp_path / "k", dtype="bfloat16")
    cfg = json.loads((folder / "config.json").read_text())
    text = cfg["text_config"]
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
    kimi = {k: v for k, v in presets.KIMI_K25_TEXT.items() if k != "num_hidden_layers"}
    assert {k: text[k] for k in kimi} == kimi and text["num_hidden_layers"] == 6
    parsed = QuantizationConfig.model_validate(text["quantization_config"])
    assert parsed.format == "pack-quantized" and parsed.ignore == int4.KIMI_IGNORE
    assert parsed.config_groups["group_0"].weights.group_size == 32
    spec = extract.store_spec(folder, prof.layer_ids, "bfloat16")
    assert spec.layer_ids == (2, 3, 4, 6) and spec.hidden_size == 7168 and spec.bytes_per_token == 4 * 7168 * 2
    shape = DraftShape.for_target(cfg)
    assert shape.hidden_size == 7168
    check_servable(shape, (1, 8))


def test_the_cli_refuses_int4_for_exactly_the_arches_whose_profile_has_no_routed_experts(tmp_path, monkeypatch, capsys):
    """The CLI refuses --quantize int4 before any model code runs, from the profiles' own fact (routed experts in
    their config), not from a list of names: a new arch without experts is refused there too, and every arch with
    experts passes the check (make_target, stood in for here, is reached); the refusal names those arches."""
    from eagle3.targets import learnable_profiles

    reached = []
    info = {"steps": 0, "seconds": 0, "first_loss": 0.0, "final_loss": 0.0}
    monkeypatch.setattr(learnable, "make_target", lambda out, **kw: reached.append(kw["arch"]) or info)
    monkeypatch.setitem(learnable_profiles.ARCHES, "dense-test", learnable_profiles.LEARNABLE)
    monkeypatch.setitem(learnable_profiles.ARCHES, "moe-test", learnable_profiles.LEARNABLE_DEEPSEEK)
    for arch, prof in learnable_profiles.ARCHES.items():
        code = cli.main(["make-target", "--arch", arch, "--quantize", "int4", "--out", str(tmp_path / arch)])
        has_experts = bool(prof.hf_config.get("n_routed_experts"))
        assert (code, arch in reached) == ((0, True) if has_experts else (2, False)), (arch, capsys.readouterr())
    assert reached == ["deepseek", "deepseek-long", "moe-test"]
    assert "--arch dense-test has none: use --arch deepseek or deepseek-long or moe-test" in capsys.readouterr().err
