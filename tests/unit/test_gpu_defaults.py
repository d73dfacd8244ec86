"""The defaults a command takes from the machine it runs on (eagle3/machine.py): on a GPU node `train` trains on
CUDA in bf16-mixed with the varlen attention and 8k-token packs, and `extract` uses vLLM where it is installed; on a
machine without a GPU both behave as before. CUDA and vLLM are mocked here; the summary names what was chosen."""

import subprocess
import sys

import pytest

from eagle3 import cli, machine
from eagle3.train import train as train_mod

from .test_compile_options import _train_args


@pytest.mark.parametrize(
    "cuda, given, want",
    [
        (True, {}, ("cuda", "bf16-mixed", "varlen", 8192)),
        (False, {}, ("cpu", "fp32", "sdpa", 0)),
        (True, {"device": "cpu"}, ("cpu", "fp32", "sdpa", 0)),
        (True, {"precision": "fp32"}, ("cuda", "fp32", "sdpa", 8192)),  # flash attention takes bf16, not fp32
        (True, {"attn": "flex", "pack_tokens": 0}, ("cuda", "bf16-mixed", "flex", 0)),
        (False, {"device": "cuda:1", "pack_tokens": 4096}, ("cuda:1", "bf16-mixed", "varlen", 4096)),
    ],
)
def test_auto_options_follow_the_machine_and_given_ones_are_kept(cuda, given, want):
    opts = dict({"device": "auto", "precision": "auto", "attn": "auto", "pack_tokens": None}, **given)
    got = machine.train_choice(**opts, compile=False, cuda=lambda: cuda)
    assert (got.device, got.precision, got.attn, got.pack_tokens) == want


@pytest.mark.parametrize("cuda", [True, False], ids=["gpu-node", "no-gpu"])
def test_train_as_typed_gets_the_machine_s_defaults(small_store, tmp_path, monkeypatch, cuda):
    from eagle3 import preflight

    got = {}

    def train_stub(cfg, **kw):
        got["cfg"] = cfg
        raise SystemExit(0)

    monkeypatch.setattr(machine, "has_cuda", lambda: cuda)
    monkeypatch.setattr(preflight, "cuda_available", lambda command: None)
    monkeypatch.setattr(train_mod, "train", train_stub)
    with pytest.raises(SystemExit):
        cli.main(_train_args(small_store, tmp_path / "run"))
    cfg = got["cfg"]
    want = ("cuda", "bf16-mixed", "varlen", 8192) if cuda else ("cpu", "fp32", "sdpa", 0)
    assert (cfg.device, cfg.precision, cfg.attn_impl, cfg.pack_tokens) == want
    assert cfg.dtype == "float32" and train_mod.mixed_precision(cfg) == cuda  # weights stay float32


@pytest.mark.parametrize(
    "vllm, cuda, want, said",
    [
        (True, True, "vllm", "vLLM and a CUDA GPU are here"),
        (True, False, "hf", "no CUDA GPU here"),
        (False, True, "hf", "vLLM is not installed here"),
    ],
)
def test_extract_picks_vllm_where_it_and_cuda_are_here_and_says_which(vllm, cuda, want, said):
    backend, why = machine.extract_backend("auto", cuda=lambda: cuda, vllm=lambda: vllm)
    assert backend == want and said in why and f"backend {want}" in why
    assert machine.extract_backend("hf", cuda=lambda: True, vllm=lambda: True)[0] == "hf"  # a given one is kept


def test_extract_as_typed_says_its_backend_before_anything_else(tiny_kimi, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(machine, "has_vllm", lambda: False)  # as on a machine without vLLM, wherever this runs
    data = tmp_path / "a.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    code = cli.main(["extract", "--model", str(tiny_kimi), "--data", str(data), "--out", str(tmp_path / "s"),
                     "--max-samples", "1", "--no-selfcheck"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0 and err.splitlines()[0].startswith("extract: backend hf (vLLM is not installed here"), err


def test_the_summary_names_device_precision_attention_and_compile(trained_run):
    result, _ = trained_run
    assert result.setup == "device cpu, precision float32, attention sdpa (eager), one sample a forward"
    assert f"setup      {result.setup}" in result.lines()
    choice = machine.TrainChoice("cuda", "bf16-mixed", "varlen", 8192, True)
    assert choice.line() == "device cuda, precision bf16-mixed, attention varlen (compiled), packs of 8,192 tokens"


def test_the_cpu_default_needs_no_torch_to_know_there_is_no_gpu():
    code = (
        "import sys; from eagle3 import machine; machine.DRIVER_PATHS = ('/nonexistent/nvidia0',); "
        "print(machine.has_cuda(), 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.stdout.split() == ["False", "False"], done.stderr[-2000:]
