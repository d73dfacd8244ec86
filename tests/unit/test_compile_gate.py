"""train/compile_gate.py: an engine in the trainer's process and the trainer's torch.compile kept apart, with
dynamo's own compile callbacks (the 2026-12-05 H200 run: vLLM's forward in the producer thread failed while the
trainer's first compiled step was being traced). A compile here uses a backend that records when it ran, and an
"engine batch" is the producer thread inside gate.engine()."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from eagle3.train.compile_gate import CompileGate

from .test_vllm_backend import fake  # noqa: F401 - a fixture


@pytest.fixture
def gate():
    torch._dynamo.reset()
    g = CompileGate().install()
    yield g
    g.remove()
    torch._dynamo.reset()


def compiled(log, seconds=0.0):
    """A fresh function compiled with a backend that logs (start, end) of the compile and sleeps ``seconds`` in it."""

    def backend(gm, inputs):
        t0 = time.perf_counter()
        time.sleep(seconds)
        log.append((t0, time.perf_counter()))
        return gm.forward

    def f(x):
        return x * 2 + 1

    return torch.compile(f, backend=backend)


def test_a_compile_waits_for_the_engine_batch_in_flight(gate):
    log, inside, released = [], threading.Event(), []

    def batch():
        with gate.engine():
            inside.set()
            time.sleep(0.4)
            released.append(time.perf_counter())

    t = threading.Thread(target=batch)
    t.start()
    inside.wait()
    compiled(log)(torch.ones(3))
    t.join()
    assert len(log) == 1 and log[0][0] >= released[0], (log, released)  # traced only once the batch was done
    assert gate.compiles == 1 and gate.waits == []


def test_an_engine_batch_waits_for_a_compile_and_the_wait_is_kept(gate):
    log, started = [], []
    fn = compiled(log, seconds=0.5)
    t = threading.Thread(target=fn, args=(torch.ones(3),))
    t.start()
    while not gate._lock._is_owned() and t.is_alive() and not log:  # noqa: SLF001 - the compile holds it
        if gate.compiles:
            break
        time.sleep(0.005)
    with gate.engine():
        started.append(time.perf_counter())
    t.join()
    assert log and started[0] >= log[0][1], (log, started)  # the batch began after the compile had ended
    ((a, b),) = gate.waits
    assert b - a >= 0.2 and gate.waited_s == pytest.approx(b - a), gate.waits


def test_a_compile_in_the_engine_s_own_thread_goes_through(gate):
    """vLLM compiling a helper inside a batch (the producer holds the gate): it re-enters, no wait, no deadlock."""
    log, done = [], []

    def batch():
        with gate.engine():
            compiled(log)(torch.ones(2))
            done.append(1)

    t = threading.Thread(target=batch)
    t.start()
    t.join(10)
    assert done == [1] and len(log) == 1 and gate.compiles == 1 and gate.waits == []


def test_the_engine_s_batch_compiling_while_a_trainer_s_compile_waits_does_not_deadlock(gate):
    """The producer's batch needs a compile of its own (a vLLM helper compiled afresh) while the trainer's compile
    waits for that batch. An earlier gate, a lock of its own taken in dynamo's start callback, deadlocked here: the
    waiting compile held dynamo's compile lock and its callback lock, the batch's compile needed them (the CPU CI
    run at add4cd8 hung 300 s in the online test whose helper dynamo's reset had emptied). Both compiles go through,
    the trainer's after the batch."""
    log, order, inside = [], [], threading.Event()

    def batch():
        with gate.engine():
            inside.set()
            time.sleep(0.5)  # the trainer's compile is waiting by now
            compiled(log)(torch.ones(2))  # a compile of the batch's own
            order.append("batch")

    t = threading.Thread(target=batch, daemon=True)
    t.start()
    inside.wait()
    trainer = threading.Thread(target=lambda: (compiled(log)(torch.ones(3)), order.append("trainer")), daemon=True)
    trainer.start()
    t.join(20)
    trainer.join(20)
    assert order == ["batch", "trainer"] and len(log) == 2, (order, log)


def test_removed_the_gate_takes_no_part_and_a_reset_before_removal_is_harmless():
    import torch._functorch.config as functorch_config
    from torch._dynamo.callback import callback_handler

    torch._dynamo.reset()
    before, lowering = len(callback_handler.start_callbacks), functorch_config.force_non_lazy_backward_lowering
    g = CompileGate().install()
    assert len(callback_handler.start_callbacks) == before + 1 and functorch_config.force_non_lazy_backward_lowering
    g.remove()
    assert len(callback_handler.start_callbacks) == before
    assert functorch_config.force_non_lazy_backward_lowering == lowering  # as it was
    compiled([])(torch.ones(2))
    assert g.compiles == 0
    g2 = CompileGate().install()
    torch._dynamo.reset()  # clears every callback
    g2.remove()  # no error
    assert functorch_config.force_non_lazy_backward_lowering == lowering
    torch._dynamo.reset()


def test_a_backward_graph_compiles_with_its_forward_inside_the_gate(gate):
    """AOTAutograd compiles a backward graph lazily, at the first backward and outside dynamo's compile lock (in
    autograd's thread on a GPU): it would trace beside an engine batch. With the gate installed it compiles with its
    forward, inside the lock: the backward waits for nothing, and no compile starts lazily."""
    lowered = []

    def backend(gm, inputs):  # AOTAutograd's, its backward compiler logging when it runs
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified

        def bw(g, ins):
            lowered.append(gate._lock._is_owned())  # noqa: SLF001 - by this thread, inside the compile
            return make_boxed_func(g.forward)

        return aot_module_simplified(gm, inputs, fw_compiler=lambda g, ins: make_boxed_func(g.forward), bw_compiler=bw)

    fn = torch.compile(lambda x: (x.sin() * 3).sum(), backend=backend)
    x = torch.ones(4, requires_grad=True)
    out = fn(x)
    assert lowered == [True], lowered  # compiled with the forward, in the compile lock
    out.backward()
    assert lowered == [True] and gate.lazy == 0 and gate.compiles == 1, (lowered, gate.lazy, gate.compiles)


def test_the_extraction_s_waits_behind_compiles_are_not_its_rate():
    """OnlineResult.sustained_tokens_per_s: the extraction's commits once training began, less its waits for room
    and its waits behind the trainer's compiles (compile_waits), as golden numbers; the lines name the compiles."""
    from eagle3.train.online import OnlineResult
    from eagle3.train.train import TrainResult

    # the trainer: started at t=10, its later half at 10,000 tok/s (far faster than the extraction)
    train = TrainResult(
        "o",
        "d",
        4,
        64,
        40_000,
        4.0,
        [1.0] * 4,
        {},
        timeline=[(1, 10_000), (2, 10_000), (3, 10_000), (4, 10_000)],
        started_at=10.0,
    )
    commits = [(11.0, 1000), (13.0, 1000), (15.0, 1000), (17.0, 1000)]  # 3,000 tokens after the first in 6 s
    plain = OnlineResult(train, "s", 1, 0, 0, 4000, 4, 7.0, 0.0, 0.0, commits=commits)
    assert plain.sustained_tokens_per_s() == pytest.approx(500.0)
    waited = OnlineResult(
        train,
        "s",
        1,
        0,
        0,
        4000,
        4,
        7.0,
        0.0,
        0.0,
        commits=commits,
        producer_waits=[(11.0, 12.0)],
        compile_waits=[(13.0, 15.0), (20.0, 30.0)],
        compiles=2,
    )
    assert waited.sustained_tokens_per_s() == pytest.approx(3000 / 3)  # 6 s less 1 s for room, 2 s behind compiles
    assert any(line.startswith("compile ") and "waited 12.0 s behind 2 compiles" in line for line in waited.lines())
    assert not any(line.startswith("compile ") for line in plain.lines())


def test_a_compile_in_the_trainer_s_thread_no_longer_breaks_the_engine_s_forward(
    fake,
    tiny_kimi,
    tmp_path,
    monkeypatch,
):
    """The 08e9a75 H200 failure on the CPU: online.run with an engine in this process (the fake vLLM), whose every
    prefill, like vLLM's forward, keeps calling a torch.compile'd helper for 0.2 s and fails as torch 2.11's dynamo
    does where any thread FX-traces (torch 2.13 no longer raises there, so the fake checks the flag itself); the
    trainer compiles a 20-layer module (aot_eager: AOTAutograd's tracing, its forward and backward graphs) before it
    trains, while the producer extracts. With the gate the producer's waits behind the compile are kept; without it
    no compile is counted and no wait kept (tests/MUTATIONS.md). The fake's raise cannot fire here even without the
    gate: under torch 2.13 on the CPU a prefill's helper call waits on dynamo's compile lock through the trainer's
    whole forward compile, its FX trace included, and aot_eager's backward traces nothing later."""
    import torch.fx._symbolic_trace as fx_trace

    from eagle3.data.conversations import random_samples
    from eagle3.train import online

    from . import fake_vllm
    from .test_vllm_backend import _online_engine, _train_online

    torch._dynamo.reset()
    helper = torch.compile(lambda x: torch.topk(x.softmax(-1), 2).values, dynamic=True, backend="eager")
    helper(torch.randn(4, 8))  # compiled before the run, as vLLM's helpers are while the engine starts
    generate, extracting, compiled = fake_vllm.FakeLLM.generate, threading.Event(), threading.Event()

    def forward(self, *a, **k):
        extracting.set()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.2 and not compiled.is_set():  # the prefills after the compile: no need
            if fx_trace._is_fx_tracing_flag:  # noqa: SLF001 - set for every thread while any traces
                raise RuntimeError("Detected that you are using FX to symbolically trace a dynamo-optimized function")
            helper(torch.randn(4, 8))
        return generate(self, *a, **k)

    class Deep(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(20))

        def forward(self, x):
            for layer in self.layers:
                for _ in range(8):  # a graph long enough to trace for a while (~1,000 nodes, ~0.5 s in FX tracing)
                    x = torch.nn.functional.gelu(x) * 1.01 + x.sin()
                x = layer(x)
            return x

    real_train = online.train

    def compiles_then_trains(cfg, **kw):  # the trainer's first compiled step, then the (eager, CPU) training
        assert extracting.wait(30)  # as on the H200: the engine at work when the trainer's first step compiles
        torch.compile(Deep(), backend="aot_eager")(torch.randn(4, 16, requires_grad=True)).sum().backward()
        compiled.set()
        return real_train(cfg, **kw)

    monkeypatch.setattr(fake_vllm.FakeLLM, "generate", forward)
    monkeypatch.setattr(online, "train", compiles_then_trains)
    monkeypatch.setattr(online, "engine_stream", lambda b: "the producer's stream")  # the engine in this process
    monkeypatch.setattr(online.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(online.torch.cuda, "set_stream", lambda st: None)
    samples = random_samples(32, [40, 7, 64, 33] * 8, vocab_size=1024, seed=5)
    ex, backend = _online_engine(tiny_kimi, tmp_path)
    try:
        res = _train_online(ex, backend, samples, tmp_path, extract_batch=2)
    finally:
        torch._dynamo.reset()
    assert res.train.samples_seen == 32
    assert res.compiles >= 1 and res.compile_waits, (res.compiles, res.compile_waits)  # the module (its backward
    # graph compiled with it, in the gate); the producer was extracting when the trainer compiled, and waited
