"""The user's path on one GPU, as typed: the CLI in subprocesses with its defaults, only paths and data given.

make-target --arch deepseek; extract (auto: vLLM); train (auto: CUDA, bf16-mixed, varlen, 8k packs), which prints
the `vllm serve` line; that line started as the real OpenAI server (a port added); eval --server against it; then,
the server stopped, eval offline on the same held-out prompts. Both acceptance lengths at k = 3 must be >= 2.5 and
agree within three standard errors of their difference. The data: the learnable target's own Kimi-style traffic
(its training text and held-out conversations) written as JSONL, as a user brings theirs. ~12 min on an H200.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from eagle3.data import corpus
from eagle3.targets import learnable

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

BAR = 2.5  # acceptance length at k = 3 (the goal for the learnable DeepseekV3 target)
N_TRAIN, N_HELD_OUT = 4096, 256


def _eagle3(*argv: str, timeout: int = 1800) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "eagle3.cli", *argv], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"eagle3 {' '.join(argv)}: exit {done.returncode}\n{done.stderr[-4000:]}"
    return done.stdout + done.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, server: subprocess.Popen, seconds: float = 900) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert server.poll() is None, f"vllm serve exited {server.returncode}"
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"vllm serve not healthy after {seconds} s")


def _acceptance(folder: Path) -> tuple[float, float]:
    """(acceptance length, its standard error) from an eval folder (offline: draft; server: run)."""
    rep = json.loads((folder / "eval.json").read_text())
    run = rep.get("run") or rep["draft"]
    return run["acceptance_length"], run["acceptance_se"]


def test_the_cli_chain_as_typed_serves_a_draft_that_vllm_accepts(tmp_path, report, gpu_out):
    target, store, run = tmp_path / "target", tmp_path / "store", tmp_path / "run"
    _eagle3("make-target", "--arch", "deepseek", "--out", str(target))
    train_data, held_out = tmp_path / "train.jsonl", tmp_path / "held-out.jsonl"
    corpus.write_jsonl(train_data, learnable.conversations("deepseek", N_TRAIN, seed=learnable.TRAIN_SEED))
    corpus.write_jsonl(held_out, learnable.conversations("deepseek", N_HELD_OUT, seed=learnable.HELD_OUT_SEED))
    said = _eagle3("extract", "--model", str(target), "--data", str(train_data), "--out", str(store))
    assert "extract: backend vllm" in said, said[-2000:]
    trained = _eagle3("train", "--store", str(store), "--out", str(run))
    setup = next(line for line in trained.splitlines() if line.startswith("setup "))
    assert "device cuda, precision bf16-mixed, attention varlen" in setup, setup
    serve = next(line for line in trained.splitlines() if line.startswith("serve "))[len("serve ") :].strip()
    assert serve in (run / "draft" / "README.md").read_text()
    report("user_path_serve_line", serve)

    port = _free_port()
    argv = shlex.split(serve) + ["--port", str(port), "--gpu-memory-utilization", "0.5"]
    log = gpu_out / "vllm-serve.log"  # kept: what the server said of any request it refused
    with open(log, "w") as sink:
        server = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, server)
        except (AssertionError, TimeoutError) as e:
            raise AssertionError(f"{e}\n{log.read_text()[-4000:]}") from None
        _eagle3("eval", "--server", url, "--prompts", str(held_out), "--out", str(tmp_path / "eval-server"),
                "--num-prompts", str(N_HELD_OUT))  # fmt: skip
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=120)
    _eagle3("eval", "--target", str(target), "--draft", str(run / "draft"), "--prompts", str(held_out),
            "--out", str(tmp_path / "eval-offline"), "--num-prompts", str(N_HELD_OUT), "--no-shifted",
            "--no-baseline")  # fmt: skip
    (a, sa), (b, sb) = _acceptance(tmp_path / "eval-server"), _acceptance(tmp_path / "eval-offline")
    for name in ("eval-server", "eval-offline"):  # per-position acceptance, tok/s, loops: kept with the run
        shutil.copy(tmp_path / name / "eval.json", gpu_out / f"user_path_{name}.json")
    report("user_path_acceptance", {"server": [a, sa], "offline": [b, sb]})
    assert a >= BAR and b >= BAR, (a, b)
    assert abs(a - b) <= 3 * math.hypot(sa, sb), (a, sa, b, sb)
