"""Suite-wide switches: GPU selection, benchmark opt-in, Hypothesis profiles, target options.

- Tests marked ``gpu`` are skipped (with the reason) on ordinary runs. Selecting them with ``-m gpu`` on
  a machine without CUDA is a usage error, not a green run of skips.
- Tests marked ``benchmark``, ``e2e`` or ``kimi_depth`` (long GPU runs; kimi_depth alone needs 61 GB and a
  2-4 minute engine start) run only when the ``-m`` expression names them.
- Hypothesis: profile ``ci`` (derandomized, used when CI=true) and ``dev`` (fewer examples).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=60,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if _ci else "dev"))


@pytest.hookimpl(optionalhook=True)  # xdist's hook: pytest -p no:xdist runs without it
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker more than the cores on a small machine. Many tests wait on a child process or a clock
    (kill -9 and resume, signals, the step runner's poll), which leaves a core idle."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores + 1 if cores <= 4 else cores


_warm_server = None


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """``-n N``: the N workers forked from one interpreter that has imported the heavy libraries once
    (tests/unit/warm_workers.py), not N interpreters importing them side by side."""
    global _warm_server
    tx = getattr(config.option, "tx", None) or []
    if os.environ.get("EAGLE3_COLD_WORKERS"):  # each worker its own interpreter, as xdist starts them
        return
    if os.environ.get("PYTEST_XDIST_WORKER") or not tx or any(t != "popen" for t in tx) or os.name != "posix":
        return
    from tests.unit import warm_workers

    config.option.tx, _warm_server = warm_workers.start(len(tx))


def pytest_unconfigure(config):
    global _warm_server
    if _warm_server is not None:
        from tests.unit import warm_workers

        warm_workers.stop(_warm_server)
        _warm_server = None


def pytest_addoption(parser):
    g = parser.getgroup("eagle3")
    g.addoption(
        "--target-model",
        default=None,
        help="GPU suite: path to a real target (e.g. Kimi-K2.5); default builds mini-Kimi locally. Write "
        "--target-model=PATH: pytest takes a folder after a space for a test path",
    )
    g.addoption(
        "--target-profile",
        default=None,
        help="GPU suite: target profile name (kimi-k2.5, mini-kimi, ...); default from --target-model",
    )
    g.addoption(
        "--target-quantize",
        choices=["int4"],
        default=None,
        help="GPU suite: the built target with its routed experts in INT4 as Kimi-K2.5's are (make-target --quantize)",
    )
    g.addoption("--tp", type=int, default=1, help="GPU suite: tensor-parallel size")
    g.addoption(
        "--gpu-out",
        default=None,
        help="GPU suite: folder for logs, reports and benchmark JSON. Write --gpu-out=DIR: pytest takes a folder "
        "after a space for a test path",
    )


def _mentions(markexpr: str, name: str) -> bool:
    return name in (markexpr or "")


def _selects_positively(markexpr: str, name: str) -> bool:
    expr = (markexpr or "").replace("(", " ").replace(")", " ")
    return name in expr.split() and f"not {name}" not in " ".join(expr.split())


CPU_TEST_TIMEOUT_S = 300


def run_last(items: list) -> list:
    """The tests of modules that set RUN_LAST = True moved after every other, in their order: a vLLM engine started in
    the test process (tests/gpu/test_online_in_process.py) may keep part of its GPU memory after it closes (vLLM
    freezes the process's heap at its start), which an engine started later in the same run would not find."""
    return sorted(items, key=lambda i: bool(getattr(getattr(i, "module", None), "RUN_LAST", False)))


def pytest_collection_modifyitems(config, items):
    markexpr = config.getoption("-m") or ""
    if config.pluginmanager.hasplugin("timeout"):
        for item in items:
            if "gpu" not in item.keywords and item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(CPU_TEST_TIMEOUT_S))
    for opt_in in ("benchmark", "e2e", "kimi_depth"):
        if not _mentions(markexpr, opt_in):
            dropped = [i for i in items if opt_in in i.keywords]
            if dropped:
                config.hook.pytest_deselected(items=dropped)
                items[:] = [i for i in items if opt_in not in i.keywords]

    items[:] = run_last(items)
    gpu_items = [i for i in items if "gpu" in i.keywords]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    if _selects_positively(markexpr, "gpu") and not config.option.collectonly:
        raise pytest.UsageError(
            f"-m {markexpr!r} selects {len(gpu_items)} GPU tests but this machine has no CUDA device "
            f"(torch {torch.__version__}, cuda available: False). Run them on the GPU host; "
            "see tests/gpu/README.md."
        )
    skip = pytest.mark.skip(reason="needs a CUDA GPU and vLLM: run `pytest -m gpu` on the GPU host")
    for item in gpu_items:
        item.add_marker(skip)
