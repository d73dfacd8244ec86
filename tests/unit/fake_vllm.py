"""A stand-in for the parts of vLLM that eagle3's vLLM backend touches, for CPU tests.

It has exactly the surface vllm_compat relies on (tests/unit/test_vllm_contract.py checks the real
vLLM has the same): LLM(**engine args) with collective_rpc / generate, workers mixing in the
worker extension, a V1-style model runner (input_batch.req_ids / num_reqs / num_computed_tokens_cpu,
query_start_loc.np, requests[id].prompt_token_ids, drafter.propose; for the direct strategy
model_config.hf_config, speculative_config, load_model -> _setup_eagle3_aux_hidden_state_outputs and a
_model_forward returning (hidden, aux) once use_aux_hidden_state_outputs is set, as vLLM's V1 runner does),
decoder layers returning (hidden, residual), and parallel_state. Steps are scheduled with chunked prefill under
a token budget; the "forward" replays the states of a reference model, split as hidden + residual. With
``preempt`` > 0 it preempts running requests mid-prefill as vLLM does when the KV cache is full: the request
leaves the batch and the runner, its computed tokens are reset to 0, and it is recomputed later under the same
id (again in chunks). ``preemptions`` counts them.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import sys
import types
from contextlib import contextmanager

import numpy as np
import torch

from eagle3.extract.vllm_compat import WORKER_EXTENSION

_CURRENT = {"tp_rank": 0, "tp_size": 1}


@dataclasses.dataclass
class EngineArgs:
    model: str = ""
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    enable_prefix_caching: bool | None = None
    async_scheduling: bool | None = None
    worker_extension_cls: str = ""
    gpu_memory_utilization: float = 0.9
    load_format: str = "auto"
    skip_tokenizer_init: bool = False
    disable_log_stats: bool = False
    kernel_config: dict | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool = False
    speculative_config: dict | None = None
    hf_overrides: dict | None = None


class SpeculativeConfig:
    def uses_extract_hidden_states(self):  # presence is what the adapter checks
        return True


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    detokenize: bool = True
    logprobs: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list | None = None
    skip_reading_prefix_cache: bool | None = None
    skip_special_tokens: bool = True


class FakeRMSNorm(torch.nn.Module):
    """A norm's weight, as vLLM's RMSNorm holds it (eagle3_unit_norms finds norms by this class name)."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((hidden,), 1e-3))  # the dummy loader's scale


class _Layer(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = FakeRMSNorm(hidden), FakeRMSNorm(hidden)

    def forward(self, positions, hidden, residual):
        return self.next_out  # (hidden, residual) set by the engine for this step


class _Model(torch.nn.Module):
    """The decoder layers the capture hooks, and the final norm and lm_head that eagle3_dump_head writes out (the
    states themselves are the reference's: the weights do not compute them)."""

    def __init__(self, n_layers, hidden, vocab):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([_Layer(hidden) for _ in range(n_layers)])
        self.model.norm = FakeRMSNorm(hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        self.config = types.SimpleNamespace(hidden_size=hidden)
        self.aux_hidden_state_layers: tuple[int, ...] = ()

    def set_aux_hidden_state_layers(self, layers):  # vLLM's SupportsEagle3
        self.aux_hidden_state_layers = tuple(layers)


class _Buffer:
    def __init__(self, n):
        self.np = np.zeros(n, dtype=np.int32)


class _InputBatch:
    def __init__(self):
        self._req_ids: list[str] = []
        self.num_computed_tokens_cpu = np.zeros(1024, dtype=np.int32)

    @property
    def req_ids(self):
        return self._req_ids

    @property
    def num_reqs(self):
        return len(self._req_ids)


class _Drafter:
    def propose(
        self, num_speculative_tokens, sampled_token_ids, target_hidden_states, common_attn_metadata, slot_mappings=None
    ):
        raise AssertionError("the extension must replace propose")


class _Runner:
    """vLLM's V1 GPUModelRunner, as far as the capture reads it. ``install`` also registers this class as
    vllm.v1.worker.gpu_model_runner.GPUModelRunner, which the worker extension's import wraps (direct)."""

    def __init__(self, model, hf_config, speculative_config):
        self.model = model
        self.model_config = types.SimpleNamespace(hf_config=hf_config)
        self.speculative_config = speculative_config
        self.use_aux_hidden_state_outputs = speculative_config is not None  # extract_hidden_states sets it
        self.input_batch = _InputBatch()
        self.query_start_loc = _Buffer(1025)
        self.requests: dict[str, types.SimpleNamespace] = {}
        self.drafter = _Drafter() if speculative_config is not None else None

    def get_model(self):
        return self.model

    def load_model(self):
        self._setup_eagle3_aux_hidden_state_outputs()

    def _setup_eagle3_aux_hidden_state_outputs(self):
        if not self.use_aux_hidden_state_outputs:
            return
        layers = self.speculative_config["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
        self.model.set_aux_hidden_state_layers(tuple(layers))

    def _model_forward(self, input_ids=None, positions=None, **kwargs):
        """The step's rows of every layer id, [L + 1, n_tok + pad, H] (``self.step_rows``, set by the engine), through
        the decoder layers (each returns (hidden, residual); hooks on them see it): the last hidden state, and with
        aux outputs on, each aux layer's (padded, as CUDA graphs pad)."""
        rows = self.step_rows
        for i, layer in enumerate(self.model.model.layers):
            residual = rows[i + 1] * 0.5  # hidden + residual == state exactly in floating point
            layer.next_out = (rows[i + 1] - residual, residual)
            layer(None, None, None)
        if not self.use_aux_hidden_state_outputs:
            return rows[-1]
        return rows[-1], [rows[i] for i in self.model.aux_hidden_state_layers]


def _wire_objects(value, where: str) -> int:
    """Python objects in an RPC argument; anything msgpack cannot carry as it is (a tensor, an array) is refused."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return 1
    if isinstance(value, (list, tuple)):
        return 1 + sum(_wire_objects(v, where) for v in value)
    if isinstance(value, dict):
        return 1 + sum(_wire_objects(k, where) + _wire_objects(v, where) for k, v in value.items())
    raise TypeError(f"{where}: an RPC argument of type {type(value).__name__} (send plain values or bytes)")


class FakeLLM:
    """``reference(prompt) -> [L + 1, T, H]`` gives every layer id's states for a prompt."""

    reference = None
    token_budget = 96  # tokens per step (chunked prefill)
    prefix_caching = False  # when True, repeated prompt prefixes are not recomputed (the trap)
    encode_replies = False  # return tensors in replies engine-encoded, as vLLM 0.26 does
    preempt = 0.0  # chance per step that one partly computed request is preempted
    last = None
    instances: list[FakeLLM] = []  # the engines of the current test (shutdown_all)

    def __init__(self, **kw):
        from eagle3.extract.vllm_worker import CaptureExtension

        assert kw.get("worker_extension_cls", WORKER_EXTENSION) == WORKER_EXTENSION  # or none: regenerate's engine
        self.kw = kw
        self.multiprocessing = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")  # as the engine read it at its start
        self.tp = kw.get("tensor_parallel_size", 1)
        self.aux = kw.get("speculative_config") is not None
        n_layers = FakeLLM.n_layers
        worker_cls = type("Worker", (CaptureExtension,), {})
        self.workers = []
        for rank in range(self.tp):
            w = worker_cls()
            w.rank = rank
            w.model_runner = self.runner_cls(
                _Model(n_layers, FakeLLM.hidden, FakeLLM.vocab),
                types.SimpleNamespace(**(kw.get("hf_overrides") or {})),
                kw.get("speculative_config"),
            )
            w.model_runner.load_model()
            w.model_runner.max_num_tokens = self.token_budget  # the V1 runner's: the scheduler's token budget
            w.model_runner.dtype = torch.float32  # the model's (the reference's states)
            self.workers.append(w)
        self.counter = 0
        self.preemptions = 0
        self.rpc_log: list[tuple[str, int]] = []
        self.seen_prefixes: set[tuple[int, ...]] = set()
        self.cached: set[tuple[int, ...]] = set()  # _serve's prefix cache: whole blocks of tokens computed
        self.rng = random.Random(0)
        FakeLLM.last = self
        FakeLLM.instances.append(self)

    @property
    def llm_engine(self):
        """What VLLMBackend.close() calls: ``llm_engine.engine_core.shutdown()``. vLLM's ends the worker processes,
        and with them each capture's consumer thread and shard buffers; in this one process the threads would live
        on, each holding its capturer's buffers (up to 12 x 512 MiB reserved): one test process passed 24 GB of
        address space that way and its next fork failed with ENOMEM. Here shutdown ends the consumer threads."""
        return types.SimpleNamespace(engine_core=types.SimpleNamespace(shutdown=self.shutdown))

    def shutdown(self) -> None:
        """As vLLM's ends its worker processes: each capture's thread ends and its buffers are let go (reserved, not
        touched: GBs of address space that a later fork in the same test process must be able to commit)."""
        for w in self.workers:
            cap = (getattr(w, "_e3", None) or {}).get("capturer")
            if cap is not None:
                if cap.thread.is_alive():
                    cap.close()
                cap.shard_buffers.clear()
                cap.pool.free.clear()

    @contextmanager
    def _as(self, rank):
        _CURRENT.update(tp_rank=rank, tp_size=self.tp)
        try:
            yield
        finally:
            _CURRENT.update(tp_rank=0, tp_size=1)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        """Each call's arguments cross a wire, as in vLLM (msgpack to the engine core, pickle to the TP workers):
        only msgpack-native values pass; ``rpc_log`` keeps (method, Python objects in the arguments), the count
        that serialization and the worker's unpacking cost grow with."""
        self.rpc_log.append((method, _wire_objects((args, kwargs or {}), method)))
        args, kwargs = pickle.loads(pickle.dumps((args, kwargs)))
        out = []
        for rank, w in enumerate(self.workers):
            with self._as(rank):
                r = getattr(w, method)(*args, **(kwargs or {}))
            if self.encode_replies and isinstance(r, list):
                r = [
                    [str(t.dtype).removeprefix("torch."), list(t.shape), 1] if isinstance(t, torch.Tensor) else t
                    for t in r
                ]
            out.append(r)
        return out

    def generate(self, prompts, params, use_tqdm=False):
        """Prefill (max_tokens=1). Returns vLLM-shaped outputs; with logprobs=k, the top-k of the reference
        model's next-token distribution ({token: object with .logprob}, as vLLM's Logprob). An engine with prefix
        caching on (extract --regenerate's) generates: ``_serve``."""
        if self.kw.get("enable_prefix_caching") and not getattr(params, "logprobs", None):
            return self._serve(prompts, params if isinstance(params, list) else [params] * len(prompts))
        assert params.max_tokens == 1
        outputs = []
        for p in prompts:
            ids = list(p["prompt_token_ids"])
            lp = torch.log_softmax(FakeLLM.reference_logits(ids).float(), -1)
            top = torch.topk(lp, params.logprobs or 1)
            logprobs = [{int(t): types.SimpleNamespace(logprob=float(v)) for t, v in zip(top.indices, top.values)}]
            outputs.append(
                types.SimpleNamespace(
                    outputs=[
                        types.SimpleNamespace(
                            token_ids=[int(lp.argmax())], logprobs=logprobs if params.logprobs else None
                        )
                    ]
                )
            )
        self._prefill(prompts)
        return outputs

    def _prefill(self, prompts):
        reqs = []
        for p in prompts:
            ids = list(p["prompt_token_ids"])
            rid = str(self.counter)
            self.counter += 1
            skip = 0
            if self.prefix_caching:  # a block-aligned shared prefix of 16 tokens is served from cache
                key = tuple(ids[:16])
                if len(ids) > 16 and key in self.seen_prefixes:
                    skip = 16
                self.seen_prefixes.add(key)
            reqs.append([rid, ids, skip, FakeLLM.reference(ids)])
        waiting, finished = list(reqs), []
        while waiting or finished:
            started = [r for r in waiting if 0 < r[2] < len(r[1])]
            if started and self.rng.random() < self.preempt:
                victim = self.rng.choice(started)  # KV cache full: drop its blocks, recompute from token 0
                victim[2] = 0
                waiting.remove(victim)
                waiting.append(victim)
                for w in self.workers:
                    w.model_runner.requests.pop(victim[0], None)
                self.preemptions += 1
            budget, step = self.token_budget, []
            # async scheduling: the step after a request's last prompt chunk was scheduled before that chunk's
            # output was seen, so it carries a decode row of the finished request (computed = prompt length;
            # its states are NaN here: a capture that kept it would fail every comparison)
            for r in finished:
                nan = torch.full((r[3].shape[0], len(r[1]) + 1, r[3].shape[2]), float("nan"))
                step.append(([r[0], r[1], len(r[1]), nan], 1))
                budget -= 1
            for r in waiting:
                if budget <= 0:
                    break
                n = min(budget, len(r[1]) - r[2], self.rng.randint(1, self.token_budget))
                step.append((r, n))
                budget -= n
            self._run_step(step)
            for r, n in step:
                if r[2] < len(r[1]):
                    r[2] += n
            done = [r for r in waiting if r[2] >= len(r[1])]
            finished = done if self.kw.get("async_scheduling") else []
            waiting = [r for r in waiting if r[2] < len(r[1])]

    BLOCK = 16  # the KV cache's block: the prefix cache holds whole blocks of tokens computed before

    def _serve(self, prompts, params):
        """Generation as vLLM runs it: each request's turn drawn from the reference logits (greedy, or sampled with
        its seed) up to a stop token or max_tokens; then steps under the token budget: prompt chunks (past the
        prefix cache's whole blocks unless skip_reading_prefix_cache), then a decode row a step forwarding the
        token sampled before (the last one sampled is never forwarded). With async scheduling a request's last
        step is followed by one more row of it, NaN here: whatever keeps it must let a later row win. Worker-side
        request ids are "<id>-<8 characters>", as vLLM 0.26's."""
        reqs, outputs = [], []
        for p, sp in zip(prompts, params):
            ids = list(p["prompt_token_ids"])
            g = torch.Generator().manual_seed(sp.seed or 0)
            out = []
            while len(out) < sp.max_tokens:
                logits = FakeLLM.reference_logits(ids + out).float()
                tok = (
                    int(logits.argmax())
                    if not sp.temperature
                    else int(torch.multinomial(torch.softmax(logits / sp.temperature, -1), 1, generator=g))
                )
                out.append(tok)
                if tok in (sp.stop_token_ids or ()):
                    break
            rid = str(self.counter)
            self.counter += 1
            final = ids + out
            skip = 0
            if not sp.skip_reading_prefix_cache:
                skip = max((k for k in range(0, len(ids), self.BLOCK) if tuple(ids[:k]) in self.cached), default=0)
            # rows it forwards: the prompt, then every generated token but the last
            # [internal id, prompt, computed, states of the final tokens, rows it forwards, prompt length, final]
            reqs.append(
                [
                    f"{rid}-{self.rng.getrandbits(32):08x}",
                    ids,
                    skip,
                    FakeLLM.reference(final),
                    len(final) - 1,
                    len(ids),
                    final,
                ]
            )
            outputs.append(types.SimpleNamespace(request_id=rid, outputs=[types.SimpleNamespace(token_ids=out)]))
        waiting, after = list(reqs), []
        while waiting or after:
            budget, step = self.token_budget, []
            for r in after:  # async scheduling's extra row of a request that just ended
                nan = torch.full((r[3].shape[0], r[4] + 1, r[3].shape[2]), float("nan"))
                step.append(([r[0], r[1], r[4], nan], 1))
                budget -= 1
            for r in waiting:
                if budget <= 0:
                    break
                n = 1 if r[2] >= r[5] else min(budget, r[5] - r[2], self.rng.randint(1, self.token_budget))
                step.append((r, n))
                budget -= n
            self._run_step(step)
            live = {id(r) for r in waiting}
            for r, n in step:
                if id(r) in live:
                    r[2] += n
                    for k in range(self.BLOCK, r[2] + 1, self.BLOCK):
                        self.cached.add(tuple(r[6][:k]))
            done = [r for r in waiting if r[2] >= r[4]]
            after = done if self.kw.get("async_scheduling") else []
            waiting = [r for r in waiting if r[2] < r[4]]
        return outputs

    @torch.inference_mode()
    def _run_step(self, step):
        """Like vLLM, the forward (and so the capture) runs under inference mode."""
        starts = [0]
        for _, n in step:
            starts.append(starts[-1] + n)
        # rows of every layer id 0..L for this step: [L + 1, n_tok, H]
        rows = torch.cat([r[3][:, r[2] : r[2] + n] for r, n in step], dim=1)
        for rank, w in enumerate(self.workers):
            runner = w.model_runner
            runner.input_batch._req_ids = [r[0] for r, _ in step]
            runner.input_batch.num_computed_tokens_cpu[: len(step)] = [r[2] for r, _ in step]
            runner.query_start_loc.np[: len(starts)] = starts
            for r, _ in step:
                runner.requests.setdefault(r[0], types.SimpleNamespace(prompt_token_ids=r[1]))
            with self._as(rank):
                # each step runs the model through the runner's _model_forward, as vLLM's execute_model does (the
                # decoder layers, and any hooks on them, inside; with aux outputs on, (hidden, aux) back); vLLM
                # pads steps, so captures must use the first n rows
                runner.step_rows = torch.cat([rows, torch.zeros(rows.shape[0], 2, rows.shape[2])], dim=1)
                out = runner._model_forward(input_ids=None, positions=None)
                if self.aux:  # extract_hidden_states: the drafter gets the step's aux states
                    runner.drafter.propose(
                        num_speculative_tokens=1,
                        sampled_token_ids=torch.zeros(len(step), 1),
                        target_hidden_states=[h[: starts[-1]] for h in out[1]],
                        common_attn_metadata=None,
                    )


def install(monkeypatch, n_layers: int, hidden: int, reference, reference_logits, vocab: int = 1024) -> type[FakeLLM]:
    """Put fake `vllm` modules in sys.modules for the duration of a test. ``reference(prompt)`` gives the states
    of every layer id [L + 1, T, H]; ``reference_logits(prompt)`` the next-token logits [V] after the prompt."""
    shutdown_all()  # an earlier test's engines that nothing closed
    FakeLLM.instances = []  # this test's engines, for shutdown_all
    FakeLLM.n_layers, FakeLLM.hidden, FakeLLM.reference = n_layers, hidden, staticmethod(reference)
    FakeLLM.vocab = vocab
    FakeLLM.reference_logits = staticmethod(reference_logits)
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams, vllm.__version__ = FakeLLM, SamplingParams, "0.26.0"
    envs = types.ModuleType("vllm.envs")  # vLLM's environment cache: how often it was dropped
    envs.dropped = 0
    envs.environment_variables = {"VLLM_ENABLE_V1_MULTIPROCESSING": None}

    def disable_envs_cache():
        envs.dropped += 1

    envs.disable_envs_cache = disable_envs_cache
    vllm.envs = envs
    engine = types.ModuleType("vllm.engine")
    arg_utils = types.ModuleType("vllm.engine.arg_utils")
    arg_utils.EngineArgs = EngineArgs
    config = types.ModuleType("vllm.config")
    speculative = types.ModuleType("vllm.config.speculative")
    speculative.SpeculativeConfig = SpeculativeConfig
    distributed = types.ModuleType("vllm.distributed")
    ps = types.ModuleType("vllm.distributed.parallel_state")
    ps.get_tensor_model_parallel_rank = lambda: _CURRENT["tp_rank"]
    ps.get_tensor_model_parallel_world_size = lambda: _CURRENT["tp_size"]
    ps.get_pp_group = lambda: types.SimpleNamespace(is_last_rank=True, world_size=1)
    distributed.parallel_state = ps
    # a fresh runner class per test: the worker extension's import-time wrapper (install_direct_capture) is
    # applied to it below, as it is to vLLM's in a worker process before the model loads
    runner_cls = type("GPUModelRunner", (_Runner,), {})
    FakeLLM.runner_cls = runner_cls
    runner_mod = types.ModuleType("vllm.v1.worker.gpu_model_runner")
    runner_mod.GPUModelRunner = runner_cls
    v1, worker = types.ModuleType("vllm.v1"), types.ModuleType("vllm.v1.worker")
    mods = {
        "vllm": vllm,
        "vllm.envs": envs,
        "vllm.engine": engine,
        "vllm.engine.arg_utils": arg_utils,
        "vllm.config": config,
        "vllm.config.speculative": speculative,
        "vllm.distributed": distributed,
        "vllm.distributed.parallel_state": ps,
        "vllm.v1": v1,
        "vllm.v1.worker": worker,
        "vllm.v1.worker.gpu_model_runner": runner_mod,
    }
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    from eagle3.extract import vllm_compat

    assert vllm_compat.install_direct_capture() and runner_cls._eagle3_direct_patched
    monkeypatch.setattr("eagle3.extract.vllm_compat.installed_version", lambda: "0.26.0")
    return FakeLLM


def shutdown_all() -> None:
    """End every fake engine of the test (one a test forgot to close too): a fixture's teardown calls this."""
    for llm in FakeLLM.instances:
        llm.shutdown()
    FakeLLM.instances.clear()
