"""Sustained extraction throughput, with its baselines measured in the same run (pytest -m benchmark on the
GPU host). Each figure is the production loop over EAGLE3_BENCH_BATCHES (default 32) batches after a warm-up (a
step per MoE kernel config the loop can meet, then 2 batches), or more (up to 4x) until EAGLE3_BENCH_MIN_SECONDS
(default 15) have passed: the same prompts for every mode, the clock started once the page cache's dirty data is
on the disk (os.sync, not timed: an earlier figure's files would be written back during this one) and stopped only
when every file is closed (and, for the store, committed), so a writer's drain overlaps the next batch's prefill
as in a long run.

    plain          vLLM prefill, no capture (compiled, CUDA graphs, async scheduling as vLLM defaults to)
    plain_sync     the same without async scheduling, like every extract_hidden_states engine (ours, vllm_ehs)
    plain_auxout   direct's engine (the capture modes' own, no second start) with its capture detached: its model
                   returns the aux layers' states, nothing takes them (what vLLM's aux outputs and the capture
                   engine's settings cost, apart from the capture's callback and RPCs)
    vllm_ehs       vLLM's own extract_hidden_states + ExampleHiddenStatesConnector (every file closed)
    count          eagle3 aux capture, nothing copied out (the capture path's own overhead)
    host           eagle3 aux capture, states copied to pinned host memory and dropped (the null sink)
    host_slots8    the null sink with 8 steps in flight instead of 4 (information: does back-pressure cost?)
    count_direct, host_direct, store_direct
                   count, host and store with the direct capture, auto's (a plain engine whose model returns the
                   aux states: async scheduling kept); the acceptance is asserted on these where auto picks direct
    count_gil_direct  count_direct with a GilSampler in the worker (a thread waking every 2 ms: how late the
                   engine's threads get the GIL, in capture_timing's gil); against count_direct, what that costs.
                   The ffdd6a0 run ran it in every eagle3 mode and in no plain one; now only _gil sinks run it
                   (a sink's variants: eagle3.loop.loop_options)
    store          eagle3 aux capture into the shard store, fsynced and committed (extract.run's loop)
    store_nofsync  the same into the page cache
    store_fp8      the fsynced store with --state-dtype fp8 (quantized before the copy to the host)
    hooks_host     eagle3 hooks capture (eager mode) into the null sink
    hf             the transformers reference (bf16) on the same GPU: information only
    disk           what the store's writers can get from the disk: as many threads as the store writes with
                   (4 fsynced, 8 into the page cache) writing shard-sized files
    d2h            device-to-pinned-host copy bandwidth on one side stream (the null sink's limit)
The host has 63 GB of free disk and a 64x512 run of 32 batches is 60 GB of states (57,344 B/token): the store and
vllm_ehs modes delete their oldest committed (closed) files once their folder holds more than DISK_WINDOW bytes
(files not yet committed count too), from a thread the loop never waits for, as a trainer consuming a spool would.
A deleted page-cache file may never reach the disk (both non-fsync modes alike).
Every record's extra_info holds tokens_per_s; the last test computes the ratios, checks the acceptance targets
and the profile's baselines, and writes bench_summary.json. Each eagle3 figure also reports where its capture
time went (capture_timing: back-pressure wait, time in the capture, the copies' GPU time and bandwidth).
Each store figure reports the main loop's time per phase (loop_timing: submit split into expect/generate/collect,
commit, finish; the committer's manifest writes and the window's unlinks) and every figure the page cache's peak
dirty and writeback sizes (dirty_max_GB, writeback_max_GB) and its rate in each quarter of the batches with their
spread (bench_summary's spread_within_run: read ratios closer than that as equal).
The 118974b run on the H200 (mini-Kimi 64x512; results/2026-12-03-118974b-h200-vllm0.26.0/): d2h 55 GB/s, so the "13
GB/s
limit" read of the 3cf512b and e41ccad runs was wrong. In one run: plain 326,360; host 269,139 (0.82x) with the
copies issued by
the capture's consumer vs 230,510 (0.71x) issued by the forward (tests/gpu/probe_d2h_interference.py: a big
device-to-host copy delays the engine's small one behind it by ~the copy's time; chunks and stream priority do
not help); the fsynced store 31,186 tok/s committed in the loop (25.5 of 33.6 s in commit: 0.85x of the fsync
limit) vs 35,948 (0.98x) committed by a thread, now extract.run's BackgroundCommitter. Another run, same host:
store_nofsync 178,414 vs vllm_ehs 180,664 (0.99x; its commits were still in the loop, 1.6 s). The 90b2d70 run
(results/2026-12-03-90b2d70-h200-vllm0.26.0/): kimi-depth for the first time, fsynced store 7,392 vs plain 8,153
(0.907x,
8 batches); mini-Kimi count 0.845x and host 0.825x plain.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import math
import os
import queue
import shutil
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import pytest
import torch

from eagle3 import bench
from eagle3.data.conversations import random_samples
from eagle3.extract import extract, vllm_compat
from eagle3.extract.capture import COPY_CHUNK_BYTES
from eagle3.extract.vllm_backend import VLLMSession
from eagle3.store import bandwidth
from eagle3.store.committer import BackgroundCommitter
from eagle3.store.folder import Store
from eagle3.store.format import FP8, SHARD_BYTES, StoreSpec
from eagle3.store.threads import writer_threads
from tests.perf import loop

from . import jit_in_clock
from .conftest import MAX_BATCHED_TOKENS, MAX_MODEL_LEN

pytestmark = [pytest.mark.gpu, pytest.mark.benchmark]

ALL_SHAPES = [(16, 512), (64, 512), (8, 4096)]
PLAIN_MODES = ["plain", "plain_sync", "plain_auxout"]
EAGLE3_MODES = [
    "count",
    "host",
    "count_direct",
    "count_gil_direct",
    "host_direct",
    "host_whole_direct",
    "host_slots8",
    "store",
    "store_nofsync",
    "store_fp8",
    "store_direct",
    "store_nofsync_direct",
]
KNOWN_MODES = {"disk", "d2h", "vllm_ehs", "hooks_host", "hf", *PLAIN_MODES, *EAGLE3_MODES}


def _narrowed(var: str, known: list[str]) -> set[str] | None:
    """The names in environment variable VAR (None: unset, everything); a name not in ``known`` is an error: a typo
    would otherwise skip that figure without a word and cost a GPU run its measurement."""
    names = set(os.environ.get(var, "").split())
    unknown = sorted(names - set(known))
    if unknown:
        raise ValueError(f"{var}: {' '.join(unknown)} unknown (known: {' '.join(known)})")
    return names or None


# EAGLE3_BENCH_SHAPES="64x512" measures only those (mini-Kimi's targets are on 64x512; a shorter campaign)
_ONLY_SHAPES = _narrowed("EAGLE3_BENCH_SHAPES", [f"{b}x{t}" for b, t in ALL_SHAPES])
SHAPES = [(b, t) for b, t in ALL_SHAPES if not _ONLY_SHAPES or f"{b}x{t}" in _ONLY_SHAPES]
IDS = [f"{b}x{t}" for b, t in SHAPES]
BATCHES = int(os.environ.get("EAGLE3_BENCH_BATCHES", "32"))
# EAGLE3_BENCH_MODES="plain store disk" measures only those (kimi-depth: each engine takes 2-5 min to start)
MODES = _narrowed("EAGLE3_BENCH_MODES", sorted(KNOWN_MODES))
WARMUP = 2
# a figure whose BATCHES batches take less than MIN_SECONDS runs on, up to MAX_BATCHES (the same prompts, more of
# them): mini-Kimi's 32 batches of 64x512 took 4 s in the ffdd6a0 run, where a ratio of 0.877 against 0.90 sat within
# plain's own spread of 6.8%
MIN_SECONDS = float(os.environ.get("EAGLE3_BENCH_MIN_SECONDS", "15"))
MAX_BATCHES = 4 * BATCHES
DISK_WINDOW = 8 << 30  # at most this many bytes of states kept in an output folder during a run (_disk_window)
RESULTS: dict[str, float] = {}
SPREADS: dict[str, float | None] = {}  # figure -> spread of its quarters' rates (_quarters), in bench_summary
PEAKS: dict[str, dict] = {}  # figure -> the page cache's dirty_max_GB and writeback_max_GB while it ran (_PageCache)
CLOCKS: dict[str, list[str]] = {}  # figure -> [start, end] of its clock, wall HH:MM:SS (set against the engine log)
_PROMPTS: dict[tuple[int, int], list] = {}
_REPORT = {}


@pytest.fixture(autouse=True)
def _report_as_measured(report):
    """Each figure goes into report.json when measured: a campaign cut short still has what it measured."""
    _REPORT["put"] = report


def batches(target, b: int, t: int) -> list[list]:
    """WARMUP + MAX_BATCHES batches of b x t random prompts, the same for every mode (prefix caching is off)."""
    if (b, t) not in _PROMPTS:
        n = (WARMUP + MAX_BATCHES) * b
        flat = random_samples(n, t, target.profile.vocab_size, seed=1000 + b * 7 + t)
        _PROMPTS[(b, t)] = [flat[i : i + b] for i in range(0, n, b)]
    return _PROMPTS[(b, t)]


_WARM: dict[int, list[list]] = {}  # prompt length -> warm-up batches (warm_batches)


def moe_config_of(target):
    """vLLM's choice of Triton MoE kernel config by a step's token count, for the target's bf16 experts at its TP
    (fused_moe.try_get_optimal_moe_config, called as its TritonExperts calls it), or None where the target has no
    routed experts or that function is not there as called (then every step size is warmed: loop.warm_steps)."""
    c = target.profile.hf_config
    experts, inter, topk = c.get("n_routed_experts"), c.get("moe_intermediate_size"), c.get("num_experts_per_tok")
    if not (experts and inter and topk):
        return None
    n, h = inter // target.tp, target.profile.hidden_size

    def pick(m: int):  # w1 [E, 2N, H], w2 [E, H, N]; dtype None: bf16 weights and activations
        from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config

        return try_get_optimal_moe_config((experts, 2 * n, h), (experts, h, n), topk, None, m)

    try:
        pick(MAX_BATCHED_TOKENS)
    except Exception:  # noqa: BLE001 - another vLLM (or none): warm every size instead
        return None
    return pick


def warm_batches(target, t: int) -> list[list]:
    """A batch per step size of loop.warm_steps, one engine step each: one prompt of that many tokens
    (loop.warm_prompts), prompts of their own (no id shared with the timed batches, which a store session would
    refuse)."""
    if t not in _WARM:
        sizes = loop.warm_steps(loop.loop_step_tokens(t, MAX_BATCHED_TOKENS), moe_config_of(target))
        lengths = loop.warm_prompts(sizes, MAX_MODEL_LEN - 1)
        flat = iter(
            random_samples(
                sum(map(len, lengths)), [n for each in lengths for n in each], target.profile.vocab_size, seed=2000 + t
            )
        )
        _WARM[t] = [list(itertools.islice(flat, len(each))) for each in lengths]
    return _WARM[t]


def wanted(mode: str) -> None:
    if MODES is not None and mode not in MODES:
        pytest.skip(f"{mode} not in EAGLE3_BENCH_MODES={' '.join(sorted(MODES))}")


def _next_wall_second() -> None:
    """Sleep into the next wall-clock second (< 1 s): vLLM stamps its log, as a figure its clock, to the second."""
    now = time.time()
    time.sleep(math.floor(now) + 1 - now + 0.01)


def _wall() -> str:
    """HH:MM:SS of time.time(), as logging stamps vLLM's lines (time.strftime() reads C's time(), a coarse clock
    that can still be in the last second ms after time.time() has left it)."""
    return time.strftime("%H:%M:%S", time.localtime(time.time()))


def sustained(
    benchmark, target, key: str, run_batch, finish=lambda: None, start=lambda: None, lookahead=False, **extra
) -> int:
    """Warm up (a step per MoE kernel config the loop can meet, warm_batches, then WARMUP batches); write the page
    cache's dirty data to the disk (an earlier figure's files: the kernel would write them back during this one);
    then time the loop over BATCHES batches, or more up to MAX_BATCHES until MIN_SECONDS have passed, up to
    `finish` (files closed); record tokens/s. Returns the batches timed.
    ``lookahead``: run_batch(batch, ahead) gets the batches that may follow, as extract.run's session does (those
    the clock leaves unsubmitted are withdrawn by `finish`)."""
    b, t = (int(x) for x in key.split("/")[1].split("x"))
    bs = batches(target, b, t)
    warm = warm_batches(target, t)
    out = {}

    def each(i, end):
        return (bs[i], bs[i + 1 : min(end, i + extract.ANNOUNCE_BATCHES)]) if lookahead else (bs[i],)

    def loop():
        start()
        for batch in warm:  # one step per MoE kernel config the loop can meet: compiled before the clock
            run_batch(*((batch, ()) if lookahead else (batch,)))
        for i in range(WARMUP):
            run_batch(*each(i, WARMUP))
        finish()
        _next_wall_second()  # a warm-up compile is logged in an earlier second than the clock starts in
        start()
        t_sync = time.perf_counter()
        os.sync()
        out["sync_s"] = round(time.perf_counter() - t_sync, 2)
        written = _disk_bytes_written(tempfile.gettempdir())
        t0 = time.perf_counter()
        out["clock"] = [_wall()]  # wall time: set against the engine log's (a JIT warning's)
        ends = []
        for i in range(WARMUP, len(bs)):
            run_batch(*each(i, len(bs)))
            ends.append(time.perf_counter())
            if len(ends) >= BATCHES and ends[-1] - t0 >= MIN_SECONDS:
                break
        finish()
        out["seconds"] = time.perf_counter() - t0
        out["clock"].append(_wall())
        out["batches"] = len(ends)
        after = _disk_bytes_written(tempfile.gettempdir())
        out["disk"] = (
            {}
            if None in (written, after)
            else {
                "disk_written_GB": round((after - written) / 1e9, 2),
                "disk_write_GB_per_s": round((after - written) / 1e9 / out["seconds"], 2),
            }
        )
        out["quarters"] = _quarters(t0, ends, b * t)

    with _PageCache() as cache:
        benchmark.pedantic(loop, rounds=1, iterations=1)
    _next_wall_second()  # what runs next (another figure's warm-up) is logged in a later second than the clock ends
    n = out["batches"]
    extra = dict(
        extra,
        **cache.peaks,
        **out["quarters"],
        **out["disk"],
        sync_before_s=out["sync_s"],
        warm_step_tokens=[sum(len(s) for s in batch) for batch in warm],
        timed_clock=out["clock"],
    )
    tps = n * b * t / out["seconds"]
    RESULTS[key] = tps
    SPREADS[key] = out["quarters"]["spread"]
    PEAKS[key] = dict(cache.peaks)
    CLOCKS[key] = out["clock"]
    _REPORT["put"](
        f"sustained[{key}]", {"tokens_per_s": round(tps), "seconds": round(out["seconds"], 2), "batches": n, **extra}
    )
    free, total = torch.cuda.mem_get_info() if torch.cuda.is_available() else (0, 0)
    benchmark.extra_info.update(
        key=key,
        tokens_per_s=round(tps),
        profile=_profile(target),
        mode=key.split("/")[0],
        batches=n,
        seconds=round(out["seconds"], 2),
        gpus=target.tp,
        gpu_mem_used_gib=round((total - free) / 2**30, 1),
        vllm=_vllm_version(),
        **extra,
    )
    return n


def _disk_bytes_written(path: str, sys_block: str = "/sys/dev/block") -> int | None:
    """Bytes the disk holding PATH has written since boot (its block device's stat: the 7th field counts 512-byte
    sectors), or None where the device is not found (an overlay or network file system): beside a figure, what
    reached the disk while it ran, against the disk's limit measured apart."""
    dev = os.stat(path).st_dev
    try:
        with open(f"{sys_block}/{os.major(dev)}:{os.minor(dev)}/stat") as f:
            return int(f.read().split()[6]) * 512
    except (OSError, IndexError, ValueError):
        return None


def _quarters(t0: float, ends: list[float], tokens_per_batch: int) -> dict:
    """The loop's rate in each quarter of its batches (the last batch's drain, in finish, is in no quarter) and
    their spread, (max - min) / median: how far one figure may move within a run, to read ratios against."""
    n = len(ends)
    cuts = [round(n * q / 4) for q in range(5)]
    rates = []
    for a, b in zip(cuts, cuts[1:]):
        if b > a:
            start = t0 if a == 0 else ends[a - 1]
            rates.append(round((b - a) * tokens_per_batch / max(ends[b - 1] - start, 1e-9)))
    mid = sorted(rates)[len(rates) // 2] if rates else 0
    return {"quarters_tok_s": rates, "spread": round((max(rates) - min(rates)) / mid, 3) if mid else None}


class _PageCache:
    """The largest dirty and under-writeback page-cache sizes (GB, /proc/meminfo every 0.25 s) while a figure is
    measured: a page-cache mode whose files reach the kernel's dirty limits is written back to the disk, and an
    unlink of a file under writeback waits for it (the 90b2d70 run's suspect for store_nofsync's 0.37x vllm_ehs)."""

    def __init__(self, meminfo: str = "/proc/meminfo"):
        self.meminfo = meminfo

    def __enter__(self):
        self.peaks = {"dirty_max_GB": 0.0, "writeback_max_GB": 0.0}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def _sample(self):
        fields = {"Dirty:": "dirty_max_GB", "Writeback:": "writeback_max_GB"}
        while not self.stop.wait(0.25):
            with open(self.meminfo) as f:
                for line in f:
                    name, kb, *_ = line.split()
                    if name in fields:
                        key = fields[name]
                        self.peaks[key] = max(self.peaks[key], round(int(kb) * 1024 / 1e9, 2))


def _profile(target) -> str:
    name = torch.cuda.get_device_name(0).replace("NVIDIA ", "").split()[0].lower()
    return os.environ.get("EAGLE3_BENCH_PROFILE") or f"{name}-{target.profile.name}"


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


class _Window:
    """Committed (closed) files in order; a thread unlinks the oldest once FOLDER holds more than DISK_WINDOW
    bytes, as a trainer consuming a spool would from its own process: the timed loop never waits for an unlink
    (on ext4 an unlink of a file under writeback waits for the disk). The folder's bytes count files not yet
    committed, too (shards written or being written): vLLM's connector hands over its files as it opens them,
    our store its shards once committed, and counting only what was handed over let the store keep 4 GB more
    in the page cache than vllm_ehs, past the kernel's writeback threshold (the ffdd6a0 run: 21 GB dirty against
    9 GB). ``drain`` waits for the thread (before reading or removing the folder); ``unlink_s`` is its busy
    time; ``max_kept`` the folder's largest size seen after an unlink round."""

    def __init__(self, folder: str | Path, before_delete=lambda path: None):
        self.folder, self.before_delete = Path(folder), before_delete
        self.limit = _disk_window()  # bytes the folder may hold
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        threading.Thread(target=self._run, name="bench-window", daemon=True).start()
        self.clear()

    def clear(self) -> None:
        self.drain()
        self.files: deque[tuple[str, int]] = deque()
        self.kept, self.max_kept, self.unlink_s = 0, 0, 0.0  # bytes kept now and at most (after an unlink round)

    def add(self, files: list[tuple[str, int]]) -> None:
        """Files (path, bytes) handed over together: one look at the folder for all of them."""
        self.queue.put(files)

    def drain(self) -> None:
        self.queue.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def _run(self) -> None:
        while True:
            files = self.queue.get()
            try:
                self.files.extend(files)
                self.kept += sum(n for _, n in files)
                t0 = time.perf_counter()
                held = _folder_bytes(self.folder)
                while held > self.limit and len(self.files) > 1:
                    old, n = self.files.popleft()
                    self.before_delete(old)
                    os.unlink(old)
                    self.kept -= n
                    held -= n
                self.unlink_s += time.perf_counter() - t0
                self.max_kept = max(self.max_kept, held)
            except BaseException as e:  # noqa: BLE001 - raised by drain, in the test's thread
                self.error = e
            finally:
                self.queue.task_done()


def _dirty_background_bytes(vmstat: str = "/proc/vmstat") -> int | None:
    """The kernel's background writeback threshold (bytes): past it the flusher writes dirty pages to the disk."""
    try:
        with open(vmstat) as f:
            for line in f:
                name, value = line.split()
                if name == "nr_dirty_background_threshold":
                    return int(value) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        pass
    return None


def _disk_window(vmstat: str = "/proc/vmstat") -> int:
    """What a window keeps: DISK_WINDOW, or a third of the background writeback threshold if that is less. With 8
    GiB on the H200 (threshold ~12 GB) vllm_ehs peaked at 12.09 GB dirty and the page-cache store crossed it
    (the 0ccc20f run): once the oldest files are under writeback their unlinks wait on the disk and the folder grows
    (40 GB, 0.23x vllm_ehs). The page-cache figures measure the sinks, not which one tips the kernel first."""
    threshold = _dirty_background_bytes(vmstat)
    return DISK_WINDOW if threshold is None else min(DISK_WINDOW, threshold // 3)


def _folder_bytes(folder: Path) -> int:
    """Bytes of the files under folder (a file removed while counted counts nothing)."""
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


def _common_engine_args(target) -> dict:
    """The benchmark's own engines (plain, vllm_ehs): in the environment the capture's engines start in (spawned
    workers, the V1 runner, vLLM's sampler: vllm_compat.prepare_environment), else a forked worker of an engine
    started after the driver touched CUDA dies (the 0ccc20f run, kimi-depth's plain)."""
    vllm_compat.prepare_environment()
    return dict(
        model=str(target.path),
        dtype="bfloat16",
        enable_prefix_caching=False,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        skip_tokenizer_init=True,
        load_format=target.load_format,
        gpu_memory_utilization=0.14 if target.local else 0.85,
        jit_monitor_verbose=True,
        kernel_config={"enable_flashinfer_autotune": False},
        tensor_parallel_size=target.tp,
    )


class _Live:
    """The engines of this module. A local target (mini-Kimi) keeps each one for the session, side by side; a
    target that fills the GPU (kimi-depth, 61 GB; a real model) runs one engine at a time: asking for another
    shuts the others down first, eagle3's capture engines (the `engines` fixture) included."""

    def __init__(self, target, engines):
        self.target, self.engines, self.llms = target, engines, {}

    def llm(self, name: str, make):
        if name not in self.llms:
            self._only_one()
            t0 = time.perf_counter()
            self.llms[name] = make()
            # as the capture engines' engine_start_s (conftest): where a GPU run's time goes
            _REPORT["put"](f"engine_start_s[{name}]", round(time.perf_counter() - t0, 1))
        return self.llms[name]

    def backend(self, strategy: str):
        if strategy not in self.engines.cache:
            self._only_one()
        return self.engines.get(strategy)

    def _only_one(self):
        if self.target.local:
            return
        self.close()
        self.engines.close()

    def close(self):
        for llm, _ in self.llms.values():
            llm.llm_engine.engine_core.shutdown()
        self.llms.clear()


@pytest.fixture(scope="module")
def live(target, engines):
    lv = _Live(target, engines)
    yield lv
    lv.close()


def _plain_llm(target, async_scheduling: bool = True):
    import vllm

    return vllm.LLM(**_common_engine_args(target), async_scheduling=async_scheduling), None


def _ehs_llm(target, out):
    import vllm

    llm = vllm.LLM(
        **_common_engine_args(target),
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(target.profile.layer_ids)}},
        },
        kv_transfer_config={
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(out)},
        },
    )
    return llm, out


def _generate(llm, samples):
    from vllm import SamplingParams

    return llm.generate(
        [{"prompt_token_ids": list(s.input_ids)} for s in samples],
        SamplingParams(max_tokens=1, temperature=0.0, detokenize=False),
        use_tqdm=False,
    )


# The limits first: seconds each, and what the figures below are read against.
@pytest.mark.parametrize("fsync", [True, False], ids=["fsync", "page_cache"])
def test_disk_write_bandwidth(benchmark, target, tmp_path, fsync):
    """What the store's writers can get: as many threads as the store writes with (writer_threads: 4 fsynced, 8
    into the page cache) each writing shard-sized files (SHARD_BYTES, the store's default) in the store's
    chunking, fsynced or into the page cache; 4 files per thread (`eagle3 bench disk`)."""
    wanted("disk")
    written, writers = [], writer_threads(fsync)
    benchmark.pedantic(
        lambda: written.append(bandwidth.write_round(tmp_path, fsync, writers, 4, SHARD_BYTES)),
        rounds=2,
        warmup_rounds=1,
    )
    bps = written[-1] / benchmark.stats.stats.median
    name = "fsync" if fsync else "page_cache"
    RESULTS[f"disk_bytes_per_s[{name}]"] = bps
    _REPORT["put"](f"disk_GB_per_s[{name}]", round(bps / 1e9, 2))
    benchmark.extra_info.update(
        key=f"disk_{name}/{writers}x4x{SHARD_BYTES >> 20}MiB", bytes_per_s=round(bps), profile=_profile(target)
    )


def test_device_to_host_bandwidth(benchmark, target):
    """What the null sink can get: 1 GiB device-to-pinned-host copies on one side stream, as the capture copies
    (the limit of host mode: plain prefill x bytes per token must stay under it for host >= 0.9 x plain)."""
    wanted("d2h")
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()

    def run():
        with torch.cuda.stream(stream):
            for _ in range(4):
                dst.copy_(src, non_blocking=True)
        stream.synchronize()

    benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    bps = 4 * n / benchmark.stats.stats.median
    RESULTS["d2h_bytes_per_s"] = bps
    _REPORT["put"]("d2h_GB_per_s", round(bps / 1e9, 2))
    benchmark.extra_info.update(key="d2h/4x1GiB", bytes_per_s=round(bps), profile=_profile(target))


@pytest.mark.parametrize("mode", PLAIN_MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_plain_prefill(benchmark, target, shape, live, mode):
    """plain: vLLM's default engine, which schedules the next step while the GPU runs this one (async
    scheduling); plain_sync: the same without, as every extract_hidden_states engine runs (vLLM 0.26 refuses
    async scheduling for that method): count/plain_sync is what the aux engine costs beyond that; plain_auxout:
    direct's engine, no capture: count_direct/plain_auxout is what the capture's callback and RPCs cost."""
    wanted(mode)
    b, t = shape
    if mode == "plain_auxout":  # the direct capture's own engine (no second start), its capture detached
        backend = live.backend("direct")
        backend.attach(False)
        try:
            sustained(benchmark, target, f"{mode}/{b}x{t}", lambda batch: _generate(backend.llm, batch))
        finally:
            backend.attach(True)
        return
    plain_llm, _ = live.llm(mode, lambda: _plain_llm(target, async_scheduling=mode != "plain_sync"))
    sustained(benchmark, target, f"{mode}/{b}x{t}", lambda batch: _generate(plain_llm, batch))


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_vllm_extract_hidden_states(benchmark, target, shape, live, tmp_path_factory):
    wanted("vllm_ehs")
    llm, out = live.llm("vllm_ehs", lambda: _ehs_llm(target, tmp_path_factory.mktemp("ehs")))
    b, t = shape
    paths: list[str] = []
    file_bytes = t * target.profile.bytes_per_token  # hidden_states [t, 4, H] bf16 (+ a small header)
    window = _Window(out, before_delete=_wait_written)

    def start():
        window.clear()  # the previous pass's unlinks are done before its folder goes
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        paths.clear()

    def run_batch(batch):
        new = [o.kv_transfer_params["hidden_states_path"] for o in _generate(llm, batch)]
        paths.extend(new)
        window.add([(p, file_bytes) for p in new])

    def finish():
        for p in paths:
            _wait_written(p)

    sustained(
        benchmark, target, f"vllm_ehs/{b}x{t}", run_batch, finish, start, bytes_per_token=target.profile.bytes_per_token
    )
    window.drain()
    kept = [p for p, _ in window.files]
    assert kept and all(os.path.exists(p) for p in kept)
    _REPORT["put"](
        f"loop_timing[vllm_ehs/{b}x{t}]",
        {
            "unlink_s": round(window.unlink_s, 3),
            "window_max_GB": round(window.max_kept / 1e9, 3),
            "window_GB": round(window.limit / 1e9, 3),
        },
    )
    shutil.rmtree(out, ignore_errors=True)  # its last DISK_WINDOW bytes, dirty: not written back during the next figure


def _wait_written(path: str) -> None:
    """The connector holds an exclusive lock on PATH.lock until PATH is written."""
    if os.path.exists(path + ".lock"):
        with open(path + ".lock") as f:
            fcntl.flock(f, fcntl.LOCK_SH)


class _Loop:
    """eagle3's production loop (extract.run's): one session, submit per batch with a BackgroundCommitter
    committing behind it, finish; the clock stops once every shard is committed."""

    def __init__(self, backend, target, mode: str, root: Path):
        self.backend, self.target, self.root = backend, target, root
        self.opts = loop.loop_options(mode)
        self.session = self.store = self.committer = None
        self.window = _Window(root)
        # the main loop's time per phase; at finish the session's expect/generate/collect split of submit_s and
        # the committer's manifest writes and their time (its thread); unlink_s: the window's thread (see drain)
        self.timing = {"submit_s": 0.0, "commit_s": 0.0, "finish_s": 0.0}

    def start(self):
        self.window.clear()
        o = self.opts
        # writer threads: the production default for the store's fsync (store/writer.py: writer_threads)
        cfg = extract.ExtractConfig(model=str(self.target.path), out=str(self.root), writer_threads=0, fsync=o.fsync)
        if o.sink == "store":
            shutil.rmtree(self.root, ignore_errors=True)
            spec = self.backend.spec
            spec = StoreSpec(
                spec.target, spec.layer_ids, spec.hidden_size, FP8 if o.fp8 else "bfloat16", spec.convention
            )
            self.store = Store.open(self.root, spec, create=True, fsync=o.fsync)
            self.committer = BackgroundCommitter(self, fsync=o.fsync)
        self.session = VLLMSession(
            self.backend,
            self.store,
            cfg,
            mode=o.sink,
            slots=o.slots,
            copy_chunk_bytes=0 if o.whole_copies else COPY_CHUNK_BYTES,
            gil_sampler=o.gil,
        )
        self.timing = dict.fromkeys(self.timing, 0.0)

    def drain(self):  # after the clock: the window's unlinks (as a consumer would make them) are done
        self.window.drain()
        self.timing["unlink_s"] = self.window.unlink_s
        self.timing["window_max_GB"] = self.window.max_kept / 1e9
        self.timing["window_GB"] = self.window.limit / 1e9  # what it trims to (_disk_window)

    def run_batch(self, batch, ahead=()):
        t0 = time.perf_counter()
        infos = self.session.submit(batch, ahead)
        self.timing["submit_s"] += time.perf_counter() - t0
        self._commit(infos)

    def finish(self):
        t0 = time.perf_counter()
        infos = self.session.finish()
        self.timing["finish_s"] += time.perf_counter() - t0
        self._commit(infos)
        if self.committer is not None:
            t0 = time.perf_counter()
            self.committer.close()
            self.timing["commit_s"] += time.perf_counter() - t0
            self.timing.update({f"committer_{k}": v for k, v in self.committer.stats.items()})
        self.timing.update(self.session.phase_s)

    def _commit(self, infos):
        if self.store is None:
            return
        t0 = time.perf_counter()
        self.committer.commit(infos)
        self.timing["commit_s"] += time.perf_counter() - t0

    def commit(self, infos, fsync=True, fault=None):  # the committer's store: commit, then hand to the window
        self.store.commit(infos, fsync=fsync, fault=fault)
        self.window.add([(str(self.root / info.file), info.bytes) for info in infos])


@pytest.mark.parametrize("mode", EAGLE3_MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_eagle3_aux_capture(benchmark, target, live, tmp_path, shape, mode):
    wanted(mode)
    b, t = shape
    sink, strategy = bench.split_mode(mode)
    loop = _Loop(live.backend(strategy), target, sink, tmp_path / "store")
    bpt = target.profile.bytes_per_token // (2 if mode == "store_fp8" else 1)
    n = sustained(
        benchmark,
        target,
        f"{mode}/{b}x{t}",
        loop.run_batch,
        loop.finish,
        loop.start,
        lookahead=True,
        bytes_per_token=bpt,
    )
    loop.drain()
    _report_capture_timing(benchmark, f"{mode}/{b}x{t}", loop.session.capture_timing)
    _REPORT["put"](f"loop_timing[{mode}/{b}x{t}]", {k: round(v, 3) for k, v in loop.timing.items()})
    if loop.store is not None:
        assert len(loop.store.done_ids) == n * b
        shutil.rmtree(tmp_path / "store")  # up to DISK_WINDOW bytes: 15 such tests would fill the disk


def test_eagle3_hooks_capture(benchmark, target, live, tmp_path):
    wanted("hooks_host")
    loop = _Loop(live.backend("hooks"), target, "host", tmp_path)
    sustained(benchmark, target, "hooks_host/64x512", loop.run_batch, loop.finish, loop.start)
    _report_capture_timing(benchmark, "hooks_host/64x512", loop.session.capture_timing)


def _report_capture_timing(benchmark, key: str, timing: dict) -> None:
    """Where the timed loop's capture time went (the owner rank's CaptureStats): the forward blocked on copies
    behind (wait_s), its time in the capture (stage_s), the side stream's copy time and bandwidth (copy_s)."""
    if timing.get("copy_s"):
        timing = dict(timing, d2h_GB_per_s=round(timing["bytes_to_host"] / timing["copy_s"] / 1e9, 2))
    _REPORT["put"](f"capture_timing[{key}]", timing)
    benchmark.extra_info["capture_timing"] = timing


def test_hf_reference(benchmark, target):
    wanted("hf")
    if not target.local:
        pytest.skip("the hf reference does not fit this target on one device")
    from eagle3.extract.hf_backend import HFBackend

    hf = HFBackend(target.path, target.profile.layer_ids, device="cuda", compute_dtype="bfloat16", batch_size=16)
    sustained(benchmark, target, "hf/16x512", hf.capture)
    hf.model = None  # free the GPU copy for the tests that follow
    torch.cuda.empty_cache()


def test_ratios_acceptance_and_baseline(target, gpu_out, report):
    """Like with like: the fsynced store against the fsynced parallel-write bandwidth; the page-cache store
    against vllm_ehs, which does not fsync either. Issue 14's targets, checked on the 64x512 shape (mini-Kimi)
    or on every shape (kimi-depth: store with fsync >= 0.95 x plain), on the modes of the capture strategy that
    extraction uses by default (--capture auto)."""
    jit, blind = jit_in_clocks(os.environ.get("EAGLE3_ENGINE_LOG"), CLOCKS)
    summary, failures = acceptance(
        RESULTS,
        target.profile.name,
        target.profile.bytes_per_token,
        _profile(target),
        bench.load_baselines(),
        capture=vllm_compat.pick_strategy("auto"),
        peaks=PEAKS,
        jit=jit,
    )
    failures += blind
    summary["spread_within_run"] = dict(SPREADS)  # (max - min) / median of each figure's quarter rates
    summary["page_cache_peaks"] = dict(PEAKS)  # figure -> dirty_max_GB, writeback_max_GB while it ran
    (gpu_out / "bench_summary.json").write_text(json.dumps(summary, indent=1))
    report("bench_ratios", summary["ratios"])
    assert not summary["regressions"], summary["regressions"]
    assert not failures, "\n".join(failures)  # whole lines: a repr is cut short where a path is long


CAPTURES = {"aux": "", "direct": bench.DIRECT_SUFFIX}  # capture strategy -> the suffix of its modes


def jit_in_clocks(log: str | None, clocks: dict[str, list[str]]) -> tuple[dict | None, list[str]]:
    """(figure -> the kernels compiled inside its clock, why that cannot be seen) from the engines' log: the file
    this run's output goes to (EAGLE3_ENGINE_LOG: the step's log). (None, []) where none is given."""
    if not log:
        return None, []
    try:
        with open(log, errors="replace") as f:
            text = f.read()
    except FileNotFoundError:
        return None, [f"EAGLE3_ENGINE_LOG={log}: no such file"]
    quiet, engines = jit_in_clock.quiet_engines(text)
    if not engines:
        return None, [
            (f"EAGLE3_ENGINE_LOG={log} holds no engine's start: run pytest with -s, so the engines' output reaches it")
        ]
    blind = (
        [
            (
                f"EAGLE3_ENGINE_LOG={log}: {quiet} of {engines} engines ran without jit_monitor_verbose; vLLM logged "
                "only each one's first compile, so a later one inside a clock would not show"
            )
        ]
        if quiet
        else []
    )
    return jit_in_clock.hits(clocks, jit_in_clock.compiles(text)), blind


def acceptance(
    results: dict,
    profile_name: str,
    bpt: int,
    profile: str,
    baselines: dict,
    capture: str = "aux",
    peaks: dict | None = None,
    jit: dict | None = None,
) -> tuple[dict, list[str]]:
    """(summary with ratios and regressions, failed targets) from the measured figures (RESULTS' keys); a shape
    left out (EAGLE3_BENCH_SHAPES) has no ratios, and a target on it fails as not measured. The targets hold
    ``capture``'s modes (the strategy extraction uses by default); the summary's ``acceptance`` gives every
    strategy's failures, the others' as information. ``peaks`` (PEAKS) lets a page-cache figure's failure say
    whether the kernel wrote back while it ran. ``jit`` (jit_in_clocks): figure -> kernels compiled inside its
    clock; a target resting on such a figure fails (the 8ff3dae run's kimi-depth passed on a plain figure that did)."""
    summary = {
        "profile": profile,
        "vllm": _vllm_version(),
        "bytes_per_token": bpt,
        "batches": BATCHES,
        "modes": sorted(MODES) if MODES else "all",
        "tokens_per_s": dict(results),
    }
    disk = {k: results.get(f"disk_bytes_per_s[{k}]") for k in ("fsync", "page_cache")}
    summary["disk_GB_per_s"] = {k: v and round(v / 1e9, 2) for k, v in disk.items()}
    summary["d2h_GB_per_s"] = round(results.get("d2h_bytes_per_s", 0) / 1e9, 2)

    def over(a, b):  # None where either side was not measured (EAGLE3_BENCH_MODES)
        return a / b if a is not None and b else None

    ratios = {}
    for b, t in ALL_SHAPES:
        s = f"{b}x{t}"
        got = {k.split("/")[0]: v for k, v in results.items() if k.endswith(f"/{s}")}  # mode -> tok/s at s
        if not got:
            continue  # a shape not measured (EAGLE3_BENCH_SHAPES) has no ratios
        plain = got.get("plain")
        limit = {k: bench.disk_limit(plain, v, bpt) for k, v in disk.items()}
        d2h = results.get("d2h_bytes_per_s")
        ratios[s] = {
            "count/plain": over(got.get("count"), plain),
            "host/plain": over(got.get("host"), plain),
            "store/plain": over(got.get("store"), plain),
            "store/limit_fsync": over(got.get("store"), limit["fsync"]),
            "store_fp8/plain": over(got.get("store_fp8"), plain),
            "host_slots8/plain": over(got.get("host_slots8"), plain),  # information
            # information: the engine vLLM allows the capture (no async scheduling) against the same without capture
            "plain_sync/plain": over(got.get("plain_sync"), plain),
            "count/plain_sync": over(got.get("count"), got.get("plain_sync")),
            "host/plain_sync": over(got.get("host"), got.get("plain_sync")),
            # the direct capture (plain engine, async scheduling): asserted where auto picks it (_targets)
            "count_direct/plain": over(got.get("count_direct"), plain),
            "plain_auxout/plain": over(got.get("plain_auxout"), plain),  # information: vLLM's aux outputs
            "count_direct/plain_auxout": over(got.get("count_direct"), got.get("plain_auxout")),
            "count_gil_direct/count_direct": over(got.get("count_gil_direct"), got.get("count_direct")),  # the sampler
            "host_direct/plain": over(got.get("host_direct"), plain),
            "host_whole_direct/plain": over(got.get("host_whole_direct"), plain),  # a step's copies issued at once
            "store_direct/plain": over(got.get("store_direct"), plain),
            "store_direct/limit_fsync": over(got.get("store_direct"), limit["fsync"]),
            "store_nofsync/vllm_ehs": over(got.get("store_nofsync"), got.get("vllm_ehs")),
            "store_nofsync_direct/vllm_ehs": over(got.get("store_nofsync_direct"), got.get("vllm_ehs")),
            "vllm_ehs/plain": over(got.get("vllm_ehs"), plain),
            "host/limit_d2h": over(got.get("host"), d2h and plain and min(plain, d2h / bpt)),  # information
            "limit_tokens_per_s": {k: v and round(v) for k, v in limit.items()},
        }
    if "hf/16x512" in results and "16x512" in ratios:
        ratios["16x512"]["store/hf"] = over(results.get("store/16x512"), results["hf/16x512"])  # information only
    summary["ratios"] = ratios
    summary["regressions"] = [
        m
        for k, v in results.items()
        if "/" in k
        for m in [bench.regression(bench.Record("now", profile, k, v, {}), baselines, disk)]
        if m
    ]

    summary["jit_in_clock"] = "not checked" if jit is None else jit
    by_capture = {
        c: _targets(ratios, results, profile_name, bpt, sfx, peaks or {}, jit or {}) for c, sfx in CAPTURES.items()
    }
    summary["acceptance"] = {"capture": capture, **by_capture}
    return summary, by_capture[capture]


def _writeback(store: dict | None, ehs: dict | None) -> str:
    """Why a page-cache store figure may be low: the kernel wrote back while it ran (the 0ccc20f and 9f3c587 runs: the
    store's folder outgrew the background threshold, and its unlinks then waited on the disk). "" if it did not."""
    if not store or not store["writeback_max_GB"]:
        return ""
    other = f"; vllm_ehs {ehs['writeback_max_GB']:.2f} and {ehs['dirty_max_GB']:.2f} GB" if ehs else ""
    return (
        f": the kernel wrote back up to {store['writeback_max_GB']:.2f} GB while it ran (dirty up to "
        f"{store['dirty_max_GB']:.2f} GB{other}): past the background writeback threshold the figure measures "
        "the disk and the unlinks that wait on it, not the sink"
    )


def _targets(ratios: dict, results: dict, profile_name: str, bpt: int, sfx: str, peaks: dict, jit: dict) -> list[str]:
    """Issue 14's targets on the modes of one capture strategy (``sfx``: "" aux, "_direct"): what they miss."""
    failures: list[str] = []
    label = " (--capture direct)" if sfx else ""

    def need(shape, name, least, what, why=""):
        r = ratios[shape]
        if r[name] is None:
            failures.append(f"{what}: not measured ({name}; EAGLE3_BENCH_MODES)")
            return
        if r[name] < least:
            failures.append(f"{what} {r[name]:.2f}x (< {least}){why}")
        for mode in name.replace("limit_fsync", "plain").split("/"):  # the figures the ratio reads
            for t, kernel, constexprs in jit.get(f"{mode}/{shape}", []):
                config = f" {constexprs}" if constexprs else ""
                failures.append(
                    f"{what}: {mode}/{shape} compiled {kernel} at {t}{config} inside its clock: not a "
                    "sustained figure (the warm-up missed its config)"
                )

    if profile_name == "kimi-depth":
        for s in ratios:
            need(s, f"store{sfx}/plain", 0.95, f"kimi-depth {s}: fsynced store{label} / plain prefill")
        return failures
    if "64x512" not in ratios:
        return ["mini-Kimi's targets: 64x512 not measured (EAGLE3_BENCH_SHAPES)"]
    r = ratios["64x512"]
    d2h, plain = results.get("d2h_bytes_per_s"), results.get("plain/64x512")
    why = ""
    if r["host/limit_d2h"] is not None and d2h / bpt < 0.90 * plain:  # host, plain and d2h all measured
        why = (
            f": unreachable on this host, whose device-to-host copies ({d2h / 1e9:.1f} GB/s) carry "
            f"{d2h / bpt:,.0f} tok/s = {d2h / bpt / plain:.2f}x plain; "
            f"host/limit_d2h {r['host/limit_d2h']:.2f}x"
        )
    elif not sfx and r["count/plain"] is not None and r["count/plain"] < 0.90:  # the engine, before any copy
        why = f": the capture's engine with nothing copied (count) reaches {r['count/plain']:.2f}x plain"
        if r["plain_sync/plain"] is not None:
            why += (
                f"; plain without async scheduling (which vLLM 0.26 refuses extract_hidden_states engines) "
                f"{r['plain_sync/plain']:.2f}x; host/plain_sync {r['host/plain_sync']:.2f}x"
            )
        if r["host_direct/plain"] is not None:
            why += f"; with --capture direct (a plain engine) host reaches {r['host_direct/plain']:.2f}x"
    elif sfx and r["count_direct/plain"] is not None and r["host_direct/plain"] is not None:
        why = f": count{label} reaches {r['count_direct/plain']:.2f}x plain"
        if r["plain_auxout/plain"] is not None:
            why += (
                f"; the engine alone, its model returning the aux states (plain_auxout), "
                f"{r['plain_auxout/plain']:.2f}x; count_direct/plain_auxout {r['count_direct/plain_auxout']:.2f}x"
            )
        if r["host_whole_direct/plain"] is not None:
            why += f"; with a step's copies issued at once host reaches {r['host_whole_direct/plain']:.2f}x"
    need("64x512", f"host{sfx}/plain", 0.90, f"null sink{label} / plain prefill", why)
    need(
        "64x512",
        f"store{sfx}/limit_fsync",
        0.90,
        f"fsynced store{label} / min(prefill, parallel fsync bandwidth / bytes per token)",
    )
    need(
        "64x512",
        f"store_nofsync{sfx}/vllm_ehs",
        1.0,
        f"page-cache store{label} / vLLM's extract_hidden_states",
        _writeback(peaks.get(f"store_nofsync{sfx}/64x512"), peaks.get("vllm_ehs/64x512")),
    )
    return failures
