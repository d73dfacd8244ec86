"""GPU suite fixtures: the target under test, one vLLM engine per capture strategy per session, the hf
reference on the same weights, and a folder for reports.

Here (one H200) the target is mini-Kimi, built with real random weights (DeepseekV3, hidden 7168, Kimi's
MLA dims, 8 layers, 8 experts). On the cluster the same tests run against the real model:
    pytest -m gpu --target-model=/path/to/Kimi-K2.5 --tp 8
with expected shapes taken from the target's profile (config.json), never hard-coded.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from eagle3.extract import extract
from eagle3.store.folder import Store
from eagle3.targets import presets, tiny
from eagle3.targets.presets import TargetProfile

MAX_BATCHED_TOKENS = 16384  # every engine of the suite and its benchmarks: the most tokens one engine step holds
MAX_MODEL_LEN = 8192  # the capture engines' and the benchmark's: a prompt and its one sampled token
ENGINE_SHARE = 0.2  # of the card, each kept engine of a target built here
START_MARGIN_GIB = 2.0  # free beyond an engine's share when it starts: the memory vLLM's start-up check does not see


def failure(e: BaseException) -> str:
    """A measurement's error as its row reports it (the test fails, or reports, after the other rows are measured)."""
    return f"{type(e).__name__}: {str(e)[:300]}"


def pytest_runtest_logreport(report):
    """A failure's reason in the log as it happens (a poll reads the log; pytest prints failures only at
    the end of a run, which a time limit may never reach)."""
    if report.failed:
        tail = "\n".join(report.longreprtext.splitlines()[-25:])
        print(f"\nFAILED-NOW {report.nodeid} ({report.when}):\n{tail}\n", file=sys.__stderr__, flush=True)


@dataclass
class TargetUnderTest:
    path: Path
    profile: TargetProfile
    tp: int
    local: bool  # built here: small enough for the hf reference and several engines at once
    load_format: str = "auto"  # "dummy": a config-only profile (kimi-depth: Kimi's layer shapes, 61 GB)


@pytest.fixture(scope="session")
def gpu_out(request, tmp_path_factory) -> Path:
    """Where logs, reports and benchmark JSON go (--gpu-out, else a temp folder)."""
    path = request.config.getoption("--gpu-out") or os.environ.get("EAGLE3_GPU_OUT")
    out = Path(path) if path else tmp_path_factory.mktemp("gpu-out")
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="session")
def report(gpu_out):
    """Numbers the suite measured, written to gpu_out/report.json as they arrive."""
    data: dict = {}

    def put(key, value):
        data[key] = value
        (gpu_out / "report.json").write_text(json.dumps(data, indent=1, default=str))

    return put


@pytest.fixture(scope="session")
def target(request, tmp_path_factory, report) -> TargetUnderTest:
    path = request.config.getoption("--target-model")
    tp = request.config.getoption("--tp")
    name = request.config.getoption("--target-profile")
    if path:
        cfg = json.loads((Path(path) / "config.json").read_text())
        profile = presets.from_name(name) if name else presets.profile_from_config(cfg, Path(path).name)
        return TargetUnderTest(Path(path), profile, tp, local=False)
    profile = presets.from_name(name or "mini-kimi")
    if profile.build == "config":  # no weights to build: vLLM fills them (dummy); no hf reference, one engine at a time
        folder = tiny.build_model(profile, tmp_path_factory.mktemp(profile.name), dtype="bfloat16")
        return TargetUnderTest(folder, profile, tp, local=False, load_format="dummy")
    t0 = time.perf_counter()
    folder = tiny.build_model(
        profile, tmp_path_factory.mktemp(profile.name), seed=0, dtype="bfloat16", device="cuda", fixed_routing=True
    )
    if request.config.getoption("--target-quantize"):  # the same weights, routed experts in INT4 (Kimi's scheme)
        from eagle3.targets import int4

        counts = int4.quantize_target(folder, folder.parent / f"{folder.name}-int4", device="cuda")
        folder = folder.parent / f"{folder.name}-int4"
        report("target_int4", counts)
    report("target_build_s", round(time.perf_counter() - t0, 1))
    return TargetUnderTest(folder, profile, tp, local=True)


class Engines:
    """One VLLMBackend per capture strategy, started on first use and kept for the session."""

    def __init__(self, target: TargetUnderTest, report):
        self.target, self.report, self.cache = target, report, {}
        self.spec = extract.store_spec(target.path, target.profile.layer_ids, "bfloat16")

    def get(self, strategy: str):
        from eagle3.extract.vllm_backend import VLLMBackend

        if strategy not in self.cache:
            if not self.target.local:  # a real target fills the GPUs: one engine at a time
                self.close()
            self.make_room(self.engine_gib(ENGINE_SHARE))
            self.cache[strategy] = VLLMBackend(
                str(self.target.path),
                self.spec,
                tp=self.target.tp,
                capture=strategy,
                gpu_memory_utilization=ENGINE_SHARE if self.target.local else 0.85,
                max_model_len=MAX_MODEL_LEN,
                max_num_batched_tokens=MAX_BATCHED_TOKENS,
                log_level="INFO",
                load_format=self.target.load_format,
                extra_engine_args={"jit_monitor_verbose": True},
            )  # every compile after warm-up logged, not the first
            self.report(f"engine_start_s[{strategy}]", round(self.cache[strategy].start_seconds, 1))
        return self.cache[strategy]

    def engine_gib(self, share: float) -> float:
        """GiB an engine of `share` of the card must find free when it starts (vLLM refuses to start otherwise)."""
        return share * self.card_gib() + START_MARGIN_GIB

    def make_room(self, gib: float, keep: str | None = None) -> None:
        """Close kept engines, oldest first and never `keep`, until `gib` GiB of the card are free."""
        for strategy in [s for s in self.cache if s != keep]:
            if self.free_gib() >= gib:
                return
            self.cache.pop(strategy).close()

    @staticmethod
    def free_gib() -> float:
        import torch

        return torch.cuda.mem_get_info()[0] / 2**30

    @staticmethod
    def card_gib() -> float:
        import torch

        return torch.cuda.mem_get_info()[1] / 2**30

    def close(self):
        for b in self.cache.values():
            b.close()
        self.cache.clear()


KEPT_ENGINES: list[Engines] = []  # the session's Engines once a test asked for them


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test that does not use the suite's kept engines starts with them closed, before its module's fixtures: it
    starts engines of its own or trains at Kimi's width, and the kept ones (a fifth of the card each) would leave it
    too little."""
    if "engines" not in getattr(item, "fixturenames", ()):
        for e in KEPT_ENGINES:
            e.close()


@pytest.fixture(scope="session")
def engines(target, report):
    e = Engines(target, report)
    KEPT_ENGINES.append(e)
    yield e
    e.close()
    KEPT_ENGINES.remove(e)


@pytest.fixture(scope="session")
def hf_reference(target):
    """transformers on the same weights, computing in float32: the oracle for vLLM's bf16 states."""
    if not target.local:
        pytest.skip(f"{target.profile.name} does not fit the hf reference on one device")
    from eagle3.extract.hf_backend import HFBackend

    return HFBackend(
        target.path, target.profile.layer_ids, device="cuda", compute_dtype="float32", out_dtype="float32", batch_size=1
    )


def extract_with(backend, target: TargetUnderTest, samples, out: Path, batch_size: int = 8, **kw) -> dict:
    """Run the production extraction path into a store; return {sample_id: sample} read back."""
    cfg = extract.ExtractConfig(
        model=str(target.path),
        out=str(out),
        backend="vllm",
        batch_size=batch_size,
        shard_samples=kw.pop("shard_samples", 8),
        **kw,
    )
    extract.run(cfg, samples=samples, backend=backend, progress=False)
    return {s["sample_id"]: s for s in Store.open(out).iter_samples()}
