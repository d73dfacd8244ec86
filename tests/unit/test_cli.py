"""The `eagle3` command line: doctor, and the demo chain at a small size."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3 import cli, doctor
from eagle3.extract import vllm_compat


def test_doctor_prints_versions_and_finds_no_problem(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    for key in ("python", "torch", "transformers", "speculators", "vllm", "gpus"):
        assert any(line.startswith(key) for line in out.splitlines()), out
    assert "PROBLEM" not in out


def test_doctor_is_quick_it_imports_no_model_code_unless_deep(capsys):
    """Issue 17: doctor took 8-10 s (speculators and transformers' models imported for the checks)."""
    code = (
        "import sys, time; t = time.perf_counter(); from eagle3 import cli; rc = cli.main(['doctor']); "
        "print(rc, 'speculators' in sys.modules, 'transformers.models.deepseek_v3' in sys.modules, "
        "round(time.perf_counter() - t, 2), file=sys.stderr)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    rc, spec, ds, seconds = out.stderr.split()[-4:]
    assert (rc, spec, ds) == ("0", "False", "False"), out.stderr
    assert re.search(r"^imports +found \(not imported", out.stdout, re.M), out.stdout
    print(f"doctor: {seconds} s")
    assert cli.main(["doctor", "--deep"]) == 0
    assert "imported each module" in capsys.readouterr().out


def test_importing_eagle3_does_not_import_vllm_or_initialize_cuda():
    code = (
        "import sys, eagle3, eagle3.cli, eagle3.extract.extract, eagle3.extract.rpc, eagle3.extract.vllm_compat, "
        "eagle3.doctor;"
        "import torch; print('vllm' in sys.modules, torch.cuda.is_initialized())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_vllm_support_verdicts():
    assert "not installed" in vllm_compat.support_verdict(None)
    assert "NOT supported" in vllm_compat.support_verdict("0.11.1")
    assert "tested" in vllm_compat.support_verdict("0.26.0")
    assert "not tested here" in vllm_compat.support_verdict("0.27.0rc1+cu130")
    assert vllm_compat.parse_version("0.16.0rc2.dev5+g1") == (0, 16, 0)


def test_install_problems_name_what_to_do(monkeypatch):
    assert doctor.install_problems() == [] and doctor.install_problems(deep=False) == []
    monkeypatch.setattr(doctor, "CHECKS", doctor.CHECKS + [("eagle3_no_such_module", "a missing module")])
    for deep in (True, False):
        (problem,) = doctor.install_problems(deep)
        assert problem.startswith("a missing module does not") and problem.endswith("Re-run scripts/setup-env."), (
            problem
        )


def test_demo_chain_small(tmp_path, capsys):
    code = cli.main(["demo", "--out", str(tmp_path), "--samples", "24", "--steps", "4", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "draft config loadable by vLLM" in out and "loss " in out and "tok/s" in out
    cfg = json.loads((tmp_path / "train" / "draft" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"


def test_train_online_extracts_with_extract_s_own_options_and_config_builder(tmp_path):
    """The options both commands take (cli.ENGINE_ARGS), at non-default values, build the same ExtractConfig fields
    through `extract` and through `train --online`; only what online owns differs (its spool, device, rejects)."""
    shared = ["--data", "a.jsonl", "b.jsonl", "--backend", "vllm", "--layer-ids", "2,4,5,8", "--max-len", "300"]
    shared += ["--tp", "2", "--gpu-mem", "0.4", "--state-dtype", "fp8"]
    p = cli.build_parser()
    ex = cli._extract_config(p.parse_args(["extract", "--model", "T", "--out", "S", *shared]))
    a = p.parse_args(["train", "--online", "--target", "T", "--out", str(tmp_path / "run"), "--engine-in-process",
                      *shared])  # fmt: skip
    on = cli._online_extract_config(a, str(tmp_path / "run" / "spool"))
    same = ("model", "backend", "layer_ids", "dtype", "tp", "capture", "selfcheck")
    assert {k: getattr(on, k) for k in same} == {k: getattr(ex, k) for k in same}
    assert (ex.layer_ids, ex.dtype, ex.tp, ex.data.max_len) == ((2, 4, 5, 8), "float8_e4m3fn", 2, 300)
    assert on.data.paths == ex.data.paths == ["a.jsonl", "b.jsonl"] and on.data.max_len == 300
    assert on.vllm_kwargs == {"gpu_memory_utilization": 0.4, "in_process": True}
    assert ex.vllm_kwargs == {"gpu_memory_utilization": 0.4}
    assert on.data.rejects_path == str(tmp_path / "run" / "rejects.jsonl") and on.recipe is None
    defaults = p.parse_args(["train", "--online", "--target", "T", "--out", "o", "--data", "a.jsonl"])
    assert defaults.gpu_mem == 0.5 and p.parse_args(["extract"]).gpu_mem == 0.85  # the engine's share differs


def test_eval_takes_the_tensor_parallel_size_of_its_engine():
    a = cli.build_parser().parse_args(["eval", "--target", "T", "--draft", "D", "--out", "o", "--tp", "8"])
    assert cli._eval_config(a).tp == 8


def test_eval_at_several_k_serves_each_in_an_engine_and_a_folder_of_its_own(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    from eagle3.serve import evaluate

    seen = []

    def run(cfg):  # the engine's run, stood in for: which k, into which folder
        seen.append((cfg.k, cfg.out))
        Path(cfg.out).mkdir(parents=True)
        return SimpleNamespace(draft=SimpleNamespace(acceptance_length=1 + cfg.k / 2, acceptance_se=0.01))

    monkeypatch.setattr(evaluate, "run", run)
    p = cli.build_parser()
    out = tmp_path / "e"
    assert cli.cmd_eval(p.parse_args(["eval", "--target", "T", "--draft", "D", "--out", str(out), "--k", "3,5,4"])) == 0
    assert seen == [(k, str(out / f"k{k}")) for k in (3, 5, 4)]
    said = capsys.readouterr().out
    assert "k 3: acceptance length 2.500" in said and "k 5: acceptance length 3.500" in said
    assert (out / "eval.md").read_text().count("acceptance length") == 3
    assert cli._eval_config(p.parse_args(["eval", "--target", "T", "--draft", "D", "--out", "o", "--k", "4"])).k == 4
    with pytest.raises(SystemExit):
        p.parse_args(["eval", "--target", "T", "--draft", "D", "--out", "o", "--k", "3,0"])
