"""The engine in the trainer's process (`train --online --engine-in-process`) on a real vLLM, at a size one H100 holds.

mini-Kimi (8 layers at Kimi's widths, dummy weights, 0.3 of the GPU) extracted alone and online beside the Kimi-size
draft's trainer (varlen, eager), through tests/gpu/test_online_kimi_depth.py's measurement with the engine in the test's
process. Asserted: vLLM's engine core ran in this process (its in-process client, no engine process), the producer
drove it on a stream of its own of higher priority than the default, the trainer trained in vLLM's world of one
without taking it for data-parallel training, and the online run trained every sample once in the same steps as the
offline one, with finite losses, the spool within its capacity, and the GPU's kernels over a window of the online run
(tests/perf/gpu_window.py) came on two streams at least (the engine's and the trainer's, in one CUDA context). The rates
are reported, not judged: at this depth the extraction is far faster than the trainer (issue 42's goal is the
kimi-depth test's, on an H200). EAGLE3_INPROC_TRAINER=flex trains compiled (flex attention) beside the engine: its
compiles then take the compile gate (train/compile_gate.py), asserted.
Run on an H100 at 021b20c (results/2026-12-05-021b20c-h100-vllm0.26.0): PASSED in 198 s (engine start 57 s); at
ae2b160 with its window: PASSED. With EAGLE3_INPROC_TRAINER=flex at 16df9d6: cut at its time limit ~78 s
into the online run's first compiled step (results/2026-12-05-16df9d6-h100-vllm0.26.0); at 7d2de6a: PASSED in 318 s,
23 compiles gated (results/2026-12-05-7d2de6a-h100-vllm0.26.0).
"""

from __future__ import annotations

import os

import pytest

from eagle3.extract import vllm_backend
from eagle3.targets import presets, tiny
from eagle3.train import online

from .test_online_kimi_depth import TRAINERS, online_beside_the_engine

pytestmark = [pytest.mark.gpu]
RUN_LAST = True  # after every other test of the run (conftest.run_last): this engine lives in the test process
TRAINER = os.environ.get("EAGLE3_INPROC_TRAINER", "varlen")  # flex: compiled beside the engine (compile_gate.py)
WINDOW = (1.5, 5.0)  # seconds into the online run (its draft built in ~1 s; extraction ~6 s at 021b20c): both sides


def test_online_with_the_engine_in_the_trainer_s_process(tmp_path_factory, tmp_path, report, monkeypatch, gpu_out):
    prof = presets.from_name("mini-kimi")
    folder = tiny.build_model(prof, tmp_path_factory.mktemp("mini-kimi"), dtype="bfloat16")
    engines, streams = [], []
    compiled = TRAINERS[TRAINER]["compile"]
    init, pick = vllm_backend.VLLMBackend.__init__, online.engine_stream

    def started(self, *a, **kw):
        init(self, *a, **kw)
        engines.append(type(self.llm.llm_engine.engine_core).__name__)

    def stream(backend):
        s = pick(backend)
        streams.append(None if s is None else s.priority)
        return s

    monkeypatch.setattr(vllm_backend.VLLMBackend, "__init__", started)
    monkeypatch.setattr(online, "engine_stream", stream)
    summaries = online_beside_the_engine(
        folder,
        prof,
        tmp_path,
        report,
        n_samples=256,
        seq=512,
        extract_batch=16,
        attns=(TRAINER,),
        engine="in-process",
        control=False,
        gpu_mem=0.3,
        again=False,
        window=None if compiled else WINDOW,
        stacks_dir=gpu_out,
        stacks_every=20,
    )
    summary = summaries[TRAINER]
    window = summary.get("gpu_window")
    report("in_process", {"engine_core": engines, "stream_priorities": streams, "gpu_window": window})
    if not compiled:  # (a compiled trainer's window would hold its first step's compile, the engine waiting)
        # one CUDA context: the window's trace holds the engine's kernels (on the producer's stream) beside the
        # trainer's
        busy = window["streams_busy"]
        assert window["error"] is None and busy is not None and len(busy["streams"]) >= 2, window
    assert engines == ["InprocClient"], engines
    assert len(streams) == 1 and streams[0] is not None and streams[0] < 0, streams
    assert summary["engine"] == "in-process" and summary["same_steps_and_samples"] and summary["losses_finite"], summary
    assert summary["spool"]["peak"] <= summary["spool"]["capacity"], summary
    # a compiled trainer: its compiles took the gate (vLLM's forward never ran while one was traced); eager: none did
    assert (summary["compiles_gated"] > 0) is summary["trainer"]["compile"], summary
