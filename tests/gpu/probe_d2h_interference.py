"""Does a big device-to-host copy on a side stream delay the engine's small output copy?

A stand-alone probe (torch only, no vLLM; ~30 s on an H200): `python3 tests/gpu/probe_d2h_interference.py`.
Each "step" is compute on the default stream (matmuls, ~step_ms) followed by a small non-blocking D2H copy of
"sampled tokens" on another stream that the host waits for before the next step, as vLLM's runner does
(async_output_copy_stream). Beside it, the capture's copy of the step's states (bytes_per_step, pinned host
memory, its own stream) is issued whole or in chunks. If whole copies cost ~copy time per step and chunked ones
do not, the small copy queues behind the big one in the copy engine. Prints one JSON line per variant.

Then the capture itself (eagle3.extract.capture.Capturer, host mode: the null sink's code) in the same synthetic
engine, with async scheduling (step N+1 is launched before the host waits for step N's tokens) and a batch
boundary every 3 steps (LLM.generate returns once every step's tokens are on the host): no capture, a step's
copies issued at once (copy_chunk_bytes 0), and in chunks with at most two queued (the default and 16 MiB).
`ms_per_step` over no capture's is what the capture costs the engine (64x512 on the H200, the 6e3f68b run: host 0.90x
count with copies issued at once).
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time

import torch


def _step_compute(a: torch.Tensor, mats: int) -> torch.Tensor:
    """A step's compute on the default stream: ``mats`` chained bf16 matmuls (~1 ms each for 8192^2)."""
    x = a
    for _ in range(mats):
        x = torch.mm(a, x) * 1e-3
    return x


def uva_view(host: torch.Tensor) -> torch.Tensor:
    """A CUDA int32 tensor over ``host``'s pinned memory (unified addressing: cudaHostAlloc'd memory is mapped at
    the same address), so a kernel on the SMs writes it over PCIe: no copy engine, no queue shared with the
    engine's copies."""

    class Interface:
        def __init__(self):
            self.__cuda_array_interface__ = {
                "shape": (host.nbytes // 4,),
                "typestr": "<i4",
                "data": (host.data_ptr(), False),
                "version": 3,
            }

    return torch.as_tensor(Interface(), device="cuda")


def run(
    steps: int,
    mats: int,
    copy_bytes: int,
    chunk: int | None,
    host: torch.Tensor,
    priority: int = 0,
    consumer: bool = False,
    launches: int = 0,
    uva: torch.Tensor | None = None,
) -> dict:
    """``consumer``: a thread waits for each copy (event.synchronize), as the capture's consumer does;
    ``launches``: tiny kernels per step, so the step needs the GIL (a thread holding it would show);
    ``uva``: copy with an elementwise kernel into uva_view(host) instead of the copy engine."""
    dev = torch.device("cuda")
    small = torch.zeros(16, device=dev)
    waits: queue.Queue = queue.Queue()

    def consume():
        while (e := waits.get()) is not None:
            e.synchronize()

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    state = torch.empty(copy_bytes // 2, device=dev, dtype=torch.bfloat16)
    out_stream, cap_stream = torch.cuda.Stream(), torch.cuda.Stream(priority=priority)
    tokens_host = torch.empty(1024, dtype=torch.int64, pin_memory=True)
    copy_ms = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        x = _step_compute(a, mats)
        for _ in range(launches):
            small.add_(1)
        state[: x.numel()].copy_(x.flatten()[: state.numel()])  # the step's states, written by the forward
        tokens = x[0, :1024].to(torch.int64)
        if copy_bytes:
            cap_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(cap_stream):
                b, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                b.record()
                n = state.numel()
                step = n if chunk is None else chunk // 2
                for s in range(0, n, step):
                    if uva is None:
                        host[s : s + step].copy_(state[s : s + step], non_blocking=True)
                    else:  # bf16 pairs as int32, multiplied by 1: a kernel on the SMs
                        torch.mul(state[s : s + step].view(torch.int32), 1, out=uva[s // 2 : (s + step) // 2])
                e.record()
                state.record_stream(cap_stream)
            copy_ms.append((b, e))
            if consumer:
                waits.put(e)
        out_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(out_stream):
            tokens_host.copy_(tokens, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        done.synchronize()  # the scheduler needs the sampled tokens before the next step
    waits.put(None)
    thread.join()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    copy_s = sum(b.elapsed_time(e) for b, e in copy_ms) / 1e3
    return {
        "chunk_MB": chunk and chunk >> 20,
        "copy_MB_per_step": copy_bytes >> 20,
        "steps": steps,
        "ms_per_step": round(seconds / steps * 1e3, 2),
        "copy_ms_per_step": round(copy_s / steps * 1e3, 2),
        "priority": priority,
        "consumer": consumer,
        "launches": launches,
        "uva_kernel": uva is not None,
    }


def run_capture(steps: int, mats: int, chunk_bytes: int | None, tokens: int = 16384, batch: int = 3) -> dict:
    """The synthetic engine above, async: the capture's host mode stages each step's four layers and its consumer
    copies them (``chunk_bytes`` None: no capture)."""
    from eagle3.extract.capture import Capturer, StepLayout

    dev = torch.device("cuda")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    layers = [torch.randn(tokens, 7168, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    cap = None
    if chunk_bytes is not None:
        cap = Capturer(4, 7168, torch.bfloat16, slots=4)
        cap.start("host", copy_chunk_bytes=chunk_bytes)
    layout = StepLayout(["r0"], [0, tokens], [0], [None])
    out_stream = torch.cuda.Stream()
    tokens_host = torch.empty(1024, dtype=torch.int64, pin_memory=True)
    pending: list = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        x = _step_compute(a, mats)
        if cap is not None:
            with torch.inference_mode():
                cap.on_step(layers, layout)
        out_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(out_stream):
            tokens_host.copy_(x[0, :1024].to(torch.int64), non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        pending.append(done)
        while len(pending) > 1 or (pending and i % batch == batch - 1):  # async: wait for the step before
            pending.pop(0).synchronize()
    if cap is not None:
        cap.drain()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    copy_ms = cap.stats.copy_s / steps * 1e3 if cap is not None else 0.0
    if cap is not None:
        cap.close()
    return {
        "capture_chunk_MB": None if chunk_bytes is None else chunk_bytes / (1 << 20),
        "steps": steps,
        "ms_per_step": round(seconds / steps * 1e3, 2),
        "copy_ms_per_step": round(copy_ms, 2),
    }


def main() -> None:
    steps, mats = 40, int(sys.argv[1]) if len(sys.argv) > 1 else 40
    copy_bytes = 16384 * 4 * 7168 * 2  # one 16,384-token step of mini-Kimi's four layers, bf16 (0.94 GB)
    host = torch.empty(copy_bytes // 2, dtype=torch.bfloat16, pin_memory=True)
    run(5, mats, copy_bytes, None, host)  # warm-up
    for copy, chunk, prio in [
        (0, None, 0),
        (copy_bytes, None, 0),
        (copy_bytes, 256 << 20, 0),
        (copy_bytes, 64 << 20, 0),
        (copy_bytes, 16 << 20, 0),
        (copy_bytes, 4 << 20, 0),
        (copy_bytes, None, -1),
        (0, None, 0),
    ]:
        print(json.dumps(run(steps, mats, copy, chunk, host, prio)), flush=True)
    try:  # the copy as a kernel writing mapped host memory: does it leave the engine's small copy alone?
        alias = uva_view(host)
        run(3, mats, copy_bytes, None, host, uva=alias)
        for chunk in (None, 64 << 20):
            print(json.dumps(run(steps, mats, copy_bytes, chunk, host, uva=alias)), flush=True)
        probe = torch.arange(1024, device="cuda", dtype=torch.int32)
        torch.mul(probe, 1, out=alias[:1024])
        torch.cuda.synchronize()
        print(
            json.dumps({"uva_kernel_wrote_host": bool(torch.equal(host.view(torch.int32)[:1024].cpu(), probe.cpu()))}),
            flush=True,
        )
    except Exception as e:  # noqa: BLE001 - a probe: say why the variant could not run
        print(json.dumps({"uva_kernel": f"{type(e).__name__}: {e}"}), flush=True)
    for copy, consumer in [(0, False), (copy_bytes, False), (copy_bytes, True), (0, False)]:  # the GIL question
        print(json.dumps(run(steps, mats // 2, copy, None, host, consumer=consumer, launches=3000)), flush=True)
    from eagle3.extract.capture import COPY_CHUNK_BYTES

    run_capture(6, mats, 0)  # warm-up
    for chunk in [None, 0, COPY_CHUNK_BYTES, 16 << 20, 0, None]:
        print(json.dumps(run_capture(steps, mats, chunk)), flush=True)


if __name__ == "__main__":
    main()
