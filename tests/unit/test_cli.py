"""The `eagle3` command line: doctor, and the demo chain at a small size."""

import json
import subprocess
import sys

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
    assert "imports       found (not imported" in out.stdout, out.stdout
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
