"""fp8 states (issue 14): e4m3 with a float32 scale per (token, layer), as speculators' FP8 hidden-states
connector stores them: half the bytes of bf16. The format, its error against bf16, and that verify, the reader,
the trainer, `--resume` and the vLLM capture path (fake vLLM, TP 2) all understand it."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from eagle3 import cli
from eagle3.data.conversations import DataConfig
from eagle3.extract import extract
from eagle3.store import verify
from eagle3.store.folder import Store
from eagle3.store.format import FP8, FP8_MAX, dequantize, quantize_fp8
from eagle3.train.train import TrainConfig, train

from . import fake_vllm
from .conftest import NARROW_DRAFT

IDS = (2, 4, 5, 8)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 6), hidden=st.sampled_from([8, 64, 7168]), log_scale=st.floats(-12, 12), seed=st.integers(0, 99)
)
def test_each_row_keeps_its_shape_to_e4m3_precision_at_any_magnitude(rows, hidden, log_scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 3, hidden, generator=g) * (2.0**log_scale)
    q, scale = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and tuple(scale.shape) == (rows, 3)
    assert torch.allclose(q.float().abs().amax(-1), torch.full((rows, 3), FP8_MAX))  # each row uses the full range
    back = dequantize(q, scale)
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of a normal value; Gaussian rows lose about 2-3 % in L2
    for r in range(rows):
        for k in range(3):
            assert rel(back[r, k], x[r, k]) < 0.045
    assert torch.equal(dequantize(*quantize_fp8(torch.zeros(2, 3, hidden))), torch.zeros(2, 3, hidden))


@pytest.fixture(scope="module")
def stores(tiny_kimi, small_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for name, dtype in (("bf16", "bfloat16"), ("fp8", FP8)):
        extract.run(
            extract.ExtractConfig(
                model=str(tiny_kimi),
                out=str(root / name),
                dtype=dtype,
                layer_ids=IDS,
                data=DataConfig([str(small_data)], max_len=128),
                batch_size=8,
                shard_samples=8,
                writer_threads=0,
            ),
            progress=False,
        )
        out[name] = root / name
    return out


def test_an_fp8_store_is_half_the_bytes_and_within_e4m3_error_of_bf16(stores):
    bf, f8 = Store.open(stores["bf16"]), Store.open(stores["fp8"])
    assert f8.spec.dtype == FP8 and f8.spec.bytes_per_token == 4 * 128 * 1 + 4 * 4  # scales: float32 per layer
    assert bf.spec.bytes_per_token == 4 * 128 * 2
    for shard in f8.shards:
        with safe_open(str(f8.root / shard["file"]), framework="pt") as f:
            assert f.get_slice("hidden_states").get_dtype() == "F8_E4M3" and f.get_slice("scales").get_dtype() == "F32"
    state_bytes = {}
    for name, store in (("bf16", bf), ("fp8", f8)):
        state_bytes[name] = sum(
            (
                lambda f: sum(
                    f.get_slice(k).get_shape()[0]
                    * f.get_slice(k).get_shape()[1]
                    * (f.get_slice(k).get_shape()[2] if k == "hidden_states" else 1)
                    * {"BF16": 2, "F8_E4M3": 1, "F32": 4}[f.get_slice(k).get_dtype()]
                    for k in ("hidden_states", "scales")
                    if k in f.keys()
                )
            )(safe_open(str(store.root / s["file"]), framework="pt"))
            for s in store.shards
        )
    assert state_bytes["fp8"] / state_bytes["bf16"] == pytest.approx((128 + 4) / 256)  # 7168 hidden: 0.5003
    ref = {s["sample_id"]: s for s in bf.iter_samples()}
    errs = []
    for s in f8.iter_samples():
        r = ref[s["sample_id"]]
        assert torch.equal(s["input_ids"], r["input_ids"]) and torch.equal(s["loss_mask"], r["loss_mask"])
        for i in IDS:
            assert s["states"][i].dtype == torch.float32
            errs.append(rel(s["states"][i], r["states"][i]))
    print(f"fp8 vs bf16 states: mean relative L2 error {sum(errs) / len(errs):.4f}, worst {max(errs):.4f}")
    assert max(errs) < 0.045 and sum(errs) / len(errs) < 0.035
    assert verify.verify(stores["fp8"]).ok


def test_verify_finds_nan_codes_and_a_missing_scales_tensor_in_fp8_shards(stores, tmp_path):
    import shutil

    from tests.unit.conftest import rewrite_shards

    nan = shutil.copytree(stores["fp8"], tmp_path / "nan")

    def plant_nan(n, t, meta):
        if n == 0:
            t["hidden_states"].view(torch.uint8)[3, 1, 5] = 0x7F  # e4m3fn's NaN

    rewrite_shards(nan, plant_nan)
    assert set(verify.verify(nan).kinds()) == {"nonfinite"}
    gone = shutil.copytree(stores["fp8"], tmp_path / "gone")

    def drop_scales(n, t, meta):
        if n == 1:
            del t["scales"]

    rewrite_shards(gone, drop_scales)
    assert set(verify.verify(gone).kinds()) == {"bad_header"}


def test_the_trainer_reads_fp8_and_follows_the_bf16_curve(stores, tmp_path):
    def fit(name):
        return train(
            TrainConfig(
                store=str(stores[name]),
                out=str(tmp_path / name),
                batch_samples=8,
                epochs=1,  # a reader without the scales parts the curves from the first step
                seed=1,
                draft_vocab_size=256,
                checkpoint_minutes=0,
                lr=3e-3,
                ttt_steps=1,  # the subject is the states read, not the TTT steps
                **NARROW_DRAFT,
            ),
            progress=False,
        )

    bf, f8 = fit("bf16"), fit("fp8")
    gap = max(abs(a - b) / b for a, b in zip(f8.losses, bf.losses))
    print(f"fp8 vs bf16 training: loss {f8.losses[-1]:.4f} vs {bf.losses[-1]:.4f}, largest step gap {gap:.4f}")
    assert f8.steps == bf.steps and gap < 0.05


def _install_fake(monkeypatch, reference_states, reference_logits):
    """The fake vLLM replaying the layer-by-layer oracle on tiny-kimi (float32 states)."""
    fake_vllm.install(
        monkeypatch, n_layers=8, hidden=128, reference=reference_states, reference_logits=reference_logits
    )


@pytest.mark.parametrize("capture", ["aux", "direct"])
def test_fp8_through_the_vllm_capture_path_and_resume(
    tiny_kimi, small_data, tmp_path, monkeypatch, stores, capsys, capture, reference_states, reference_logits
):
    """The fake vLLM at TP 2 (aux capture, and direct: the default): the worker quantizes on the device side; the
    owner writes e4m3 + scales. Its states equal the hf fp8 store's within one e4m3 step (the fake replays float32
    states, the hf path quantizes its bf16 output). Then the CLI's --state-dtype fp8 is recorded and kept by
    --resume."""
    _install_fake(monkeypatch, reference_states, reference_logits)
    out = tmp_path / "v"
    extract.run(
        extract.ExtractConfig(
            model=str(tiny_kimi),
            out=str(out),
            backend="vllm",
            capture=capture,
            tp=2,
            dtype=FP8,
            layer_ids=IDS,
            selfcheck=0,
            batch_size=8,
            data=DataConfig([str(small_data)], max_len=128, max_samples=16),
        ),
        progress=False,
    )
    assert verify.verify(out).ok
    hf = {s["sample_id"]: s for s in Store.open(stores["fp8"]).iter_samples()}
    for s in Store.open(out).iter_samples():
        for i in IDS:
            assert rel(s["states"][i], hf[s["sample_id"]]["states"][i]) < 0.05, (s["sample_id"], i)

    cli_out = tmp_path / "c"
    assert (
        cli.main(
            [
                "extract",
                "--model",
                str(tiny_kimi),
                "--data",
                str(small_data),
                "--out",
                str(cli_out),
                "--max-samples",
                "6",
                "--no-selfcheck",
                "--state-dtype",
                "fp8",
            ]
        )
        == 0
    )
    assert json.loads((cli_out / "plan.json").read_text())["recipe"]["state_dtype"] == "fp8"
    assert Store.open(cli_out).spec.dtype == FP8
    assert cli.main(["extract", "--resume", str(cli_out)]) == 0  # the recorded dtype: the store's spec agrees
    capsys.readouterr()


def test_one_engine_stores_bf16_then_fp8_then_bf16(
    tiny_kimi, small_data, tmp_path, monkeypatch, reference_states, reference_logits
):
    """The store decides the dtype, per session: the worker's pinned shard buffers, kept across sessions, are
    reused only for their own dtype."""
    from eagle3.extract.vllm_backend import VLLMBackend

    _install_fake(monkeypatch, reference_states, reference_logits)
    backend = VLLMBackend(str(tiny_kimi), extract.store_spec(tiny_kimi, IDS, "bfloat16"), capture="hooks")
    data = DataConfig([str(small_data)], max_len=96, max_samples=8)
    for n, dtype in enumerate(("bfloat16", FP8, "bfloat16")):
        out = tmp_path / f"s{n}"
        extract.run(
            extract.ExtractConfig(
                model=str(tiny_kimi), out=str(out), backend="vllm", dtype=dtype, layer_ids=IDS, selfcheck=0, data=data
            ),
            backend=backend,
            progress=False,
        )
        assert verify.verify(out).ok and Store.open(out).spec.dtype == dtype
        with safe_open(str(next((out / "shards").iterdir())), framework="pt") as f:
            assert f.get_slice("hidden_states").get_dtype() == {"bfloat16": "BF16", FP8: "F8_E4M3"}[dtype]
    backend.close()


def test_the_e2e_gpu_test_s_fp8_figures_on_cpu_stores(stores):
    """tests/gpu/test_draft_acceptance.py reports fp8's bytes and error with this helper: checked here first."""
    from tests.gpu.test_draft_acceptance import fp8_figures

    got = fp8_figures(stores["bf16"], stores["fp8"], n=16)
    assert got["compared"] == 16 * len(IDS)
    assert got["bytes_ratio_expected"] == round((4 * 128 + 16 + 5) / (4 * 128 * 2 + 5), 4)
    assert abs(got["bytes_ratio"] - got["bytes_ratio_expected"]) < 0.005  # shard headers are the rest
    assert 0.01 < got["rel_err_mean"] <= got["rel_err_max"] < 0.045
