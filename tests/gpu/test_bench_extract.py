"""Extraction throughput with its baselines measured in the same run (pytest -m benchmark on the GPU host).

    plain      vLLM prefill of the same batch, no capture (compiled, CUDA graphs, vLLM defaults)
    vllm_ehs   vLLM's own extract_hidden_states method + ExampleHiddenStatesConnector (files written)
    count      eagle3 aux capture, nothing copied out (the capture path's own overhead)
    host       eagle3 aux capture, states copied to pinned host memory and dropped (the null sink)
    store      eagle3 aux capture into the shard store on local disk, fsynced and committed
    store_nofsync  the same without fsync (page cache, as vllm_ehs writes)
    hooks_host eagle3 hooks capture (eager mode) into the null sink
    hf         the transformers reference (bf16) on the same GPU
    disk       sequential write bandwidth of the output filesystem, with fsync and into the page cache
Every record's extra_info holds tokens_per_s; the last test computes the ratios, checks the acceptance
targets and the profile baseline, and writes bench_summary.json.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from eagle3 import bench
from eagle3.data.conversations import random_samples
from eagle3.extract import extract
from eagle3.extract.vllm_backend import VLLMSession
from eagle3.store.folder import Store

pytestmark = [pytest.mark.gpu, pytest.mark.benchmark]

SHAPES = [(16, 512), (64, 512), (8, 4096)]
IDS = [f"{b}x{t}" for b, t in SHAPES]
RESULTS: dict[str, float] = {}
_seed = [1000]


def _prompts(b: int, t: int, vocab: int):
    _seed[0] += 1  # new tokens every round: nothing can be served from a cache
    return random_samples(b, t, vocab, seed=_seed[0])


def _record(benchmark, target, key: str, tokens: int, **extra):
    median = benchmark.stats.stats.median
    free, total = torch.cuda.mem_get_info()
    tps = tokens / median
    RESULTS[key] = tps
    benchmark.extra_info.update(
        key=key, tokens_per_s=round(tps), profile=_profile(target), mode=key.split("/")[0],
        gpu_mem_used_gib=round((total - free) / 2**30, 1), vllm=_vllm_version(), **extra)


def _profile(target) -> str:
    name = torch.cuda.get_device_name(0).replace("NVIDIA ", "").split()[0].lower()
    return os.environ.get("EAGLE3_BENCH_PROFILE") or f"{name}-{target.profile.name}"


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


def _common_engine_args(target) -> dict:
    return dict(model=str(target.path), dtype="bfloat16", enable_prefix_caching=False, max_model_len=8192,
                max_num_batched_tokens=16384, skip_tokenizer_init=True, gpu_memory_utilization=0.14,
                kernel_config={"enable_flashinfer_autotune": False}, tensor_parallel_size=target.tp)


@pytest.fixture(scope="module")
def plain_llm(target):
    import vllm

    llm = vllm.LLM(**_common_engine_args(target))
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def ehs_llm(target, tmp_path_factory):
    import vllm

    out = tmp_path_factory.mktemp("ehs")
    llm = vllm.LLM(**_common_engine_args(target), speculative_config={
        "method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(target.profile.layer_ids)}}},
        kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                            "kv_connector_extra_config": {"shared_storage_path": str(out)}})
    yield llm, out
    llm.llm_engine.engine_core.shutdown()


def _generate(llm, samples):
    from vllm import SamplingParams

    return llm.generate([{"prompt_token_ids": list(s.input_ids)} for s in samples],
                        SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_plain_prefill(benchmark, target, plain_llm, shape):
    b, t = shape
    benchmark.pedantic(lambda s: _generate(plain_llm, s), setup=lambda: ((_prompts(b, t, target.profile.vocab_size),), {}),
                       rounds=3, warmup_rounds=1)
    _record(benchmark, target, f"plain/{b}x{t}", b * t)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_vllm_extract_hidden_states(benchmark, target, ehs_llm, shape):
    llm, out = ehs_llm
    b, t = shape

    def run(samples):
        outputs = _generate(llm, samples)
        paths = [o.kv_transfer_params["hidden_states_path"] for o in outputs]
        for p in paths:  # the connector holds an exclusive lock on PATH.lock until the file is written
            if os.path.exists(p + ".lock"):
                with open(p + ".lock") as f:
                    fcntl.flock(f, fcntl.LOCK_SH)
        assert all(os.path.exists(p) for p in paths)

    def setup():
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        return (_prompts(b, t, target.profile.vocab_size),), {}

    benchmark.pedantic(run, setup=setup, rounds=3, warmup_rounds=1)
    _record(benchmark, target, f"vllm_ehs/{b}x{t}", b * t, bytes_per_token=target.profile.bytes_per_token)


def _session_round(backend, target, samples, mode: str, root: Path | None):
    store, fsync = None, mode != "store_nofsync"
    mode = "store" if mode.startswith("store") else mode
    cfg = extract.ExtractConfig(model=str(target.path), out=str(root or "-"), writer_threads=4, fsync=fsync)
    if mode == "store":
        shutil.rmtree(root, ignore_errors=True)
        store = Store.open(root, backend.spec, create=True, fsync=fsync)
    session = VLLMSession(backend, store, cfg, mode=mode)
    infos = session.submit(samples)
    infos += session.finish()
    if store is not None:
        store.commit(infos, fsync=fsync)
        assert len(store.done_ids) == len(samples)


@pytest.mark.parametrize("mode", ["count", "host", "store", "store_nofsync"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_eagle3_aux_capture(benchmark, target, engines, tmp_path, shape, mode):
    backend = engines.get("aux")
    b, t = shape
    benchmark.pedantic(lambda s: _session_round(backend, target, s, mode, tmp_path / "store"),
                       setup=lambda: ((_prompts(b, t, target.profile.vocab_size),), {}), rounds=3, warmup_rounds=1)
    _record(benchmark, target, f"{mode}/{b}x{t}", b * t, bytes_per_token=target.profile.bytes_per_token)


def test_eagle3_hooks_capture(benchmark, target, engines):
    backend = engines.get("hooks")
    b, t = 64, 512
    benchmark.pedantic(lambda s: _session_round(backend, target, s, "host", None),
                       setup=lambda: ((_prompts(b, t, target.profile.vocab_size),), {}), rounds=3, warmup_rounds=1)
    _record(benchmark, target, f"hooks_host/{b}x{t}", b * t)


def test_hf_reference(benchmark, target):
    if not target.local:
        pytest.skip("the hf reference does not fit this target on one device")
    from eagle3.extract.hf_backend import HFBackend

    hf = HFBackend(target.path, target.profile.layer_ids, device="cuda", compute_dtype="bfloat16", batch_size=16)
    b, t = 16, 512
    benchmark.pedantic(lambda s: hf.capture(s), setup=lambda: ((_prompts(b, t, target.profile.vocab_size),), {}),
                       rounds=2, warmup_rounds=1)
    _record(benchmark, target, f"hf/{b}x{t}", b * t)
    hf.model = None  # free the GPU copy for the tests that follow
    torch.cuda.empty_cache()


@pytest.mark.parametrize("fsync", [True, False], ids=["fsync", "page_cache"])
def test_disk_write_bandwidth(benchmark, target, tmp_path, fsync):
    """Sequential write of 4 GiB in 64 MiB chunks: fsynced (what durable shards get) and into the page
    cache (what a writer that does not fsync, like vLLM's example connector, gets)."""
    chunk = os.urandom(1 << 20) * 64
    path = tmp_path / "bw.bin"

    def write():
        with open(path, "wb") as f:
            for _ in range(64):
                f.write(chunk)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        path.unlink()

    benchmark.pedantic(write, rounds=2, warmup_rounds=1)
    bps = (64 << 26) / benchmark.stats.stats.median
    name = "fsync" if fsync else "page_cache"
    RESULTS[f"disk_bytes_per_s[{name}]"] = bps
    benchmark.extra_info.update(key=f"disk_{name}/4GiB", bytes_per_s=round(bps), profile=_profile(target))


def test_ratios_acceptance_and_baseline(target, gpu_out, report):
    """Like is compared with like: the fsynced store against the fsynced disk bandwidth; the page-cache
    store against the page-cache bandwidth and against vllm_ehs, which does not fsync either."""
    bpt = target.profile.bytes_per_token
    disk = {k: RESULTS[f"disk_bytes_per_s[{k}]"] for k in ("fsync", "page_cache")}
    summary = {"profile": _profile(target), "vllm": _vllm_version(), "bytes_per_token": bpt,
               "disk_GB_per_s": {k: round(v / 1e9, 2) for k, v in disk.items()}, "tokens_per_s": dict(RESULTS)}
    ratios, failures = {}, []
    for b, t in SHAPES:
        s = f"{b}x{t}"
        plain = RESULTS[f"plain/{s}"]
        limit = {k: min(plain, v / bpt) for k, v in disk.items()}
        ratios[s] = {
            "count/plain": RESULTS[f"count/{s}"] / plain, "host/plain": RESULTS[f"host/{s}"] / plain,
            "store/limit_fsync": RESULTS[f"store/{s}"] / limit["fsync"],
            "store_nofsync/limit_page_cache": RESULTS[f"store_nofsync/{s}"] / limit["page_cache"],
            "store_nofsync/vllm_ehs": RESULTS[f"store_nofsync/{s}"] / RESULTS[f"vllm_ehs/{s}"],
            "vllm_ehs/plain": RESULTS[f"vllm_ehs/{s}"] / plain,
            "limit_tokens_per_s": {k: round(v) for k, v in limit.items()},
        }
    if "hf/16x512" in RESULTS:
        ratios["16x512"]["store/hf"] = RESULTS["store/16x512"] / RESULTS["hf/16x512"]
    summary["ratios"] = ratios
    baselines = bench.load_baselines()
    regressions = [m for k, v in RESULTS.items() if "/" in k
                   for m in [bench.regression(bench.Record("now", _profile(target), k, v, {}), baselines)] if m]
    summary["regressions"] = regressions
    (gpu_out / "bench_summary.json").write_text(json.dumps(summary, indent=1))
    report("bench_ratios", ratios)
    r = ratios["64x512"]
    if r["host/plain"] < 0.90:
        failures.append(f"null sink {r['host/plain']:.2f}x plain prefill (< 0.90)")
    if r["store/limit_fsync"] < 0.90:
        failures.append(f"fsynced store {r['store/limit_fsync']:.2f}x min(prefill, fsync bandwidth/bytes) (< 0.90)")
    if r["store_nofsync/limit_page_cache"] < 0.90:
        failures.append(f"page-cache store {r['store_nofsync/limit_page_cache']:.2f}x its limit (< 0.90)")
    if r["store_nofsync/vllm_ehs"] <= 1.0:
        failures.append(f"page-cache store {r['store_nofsync/vllm_ehs']:.2f}x vLLM's extract_hidden_states (<= 1)")
    if ratios["16x512"].get("store/hf", 10) < 10:
        failures.append(f"store {ratios['16x512']['store/hf']:.1f}x the hf reference (< 10)")
    assert not regressions, regressions
    assert not failures, failures
