"""The one place that knows how vLLM versions differ. Importing this module does not import vLLM.

Everything eagle3 touches inside vLLM goes through here: engine arguments, collective_rpc's signature,
the worker's model runner and model, the decoder-layer list, the per-step batch layout and the
EAGLE-3 aux-hidden-state machinery. tests/unit/test_vllm_contract.py checks each attribute and
signature relied on wherever vLLM is importable.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import re
from typing import Any

SUPPORTED_MIN = (0, 16)
TESTED = ("0.26.0",)


def parse_version(v: str) -> tuple[int, ...]:
    """'0.16.0rc2.dev5+g1' -> (0, 16, 0): leading release numbers only."""
    out = []
    for part in v.split("+")[0].split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
        if m.end() != len(part):
            break
    return tuple(out)


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def support_verdict(version: str | None) -> str:
    """One line for `eagle3 doctor`: is this vLLM one the adapter supports?"""
    if version is None:
        return "not installed (needed only for `--backend vllm` and the GPU suite)"
    v = parse_version(version)
    if v[:2] < SUPPORTED_MIN:
        return f"{version}: NOT supported (the adapter needs >= {'.'.join(map(str, SUPPORTED_MIN))})"
    if version.split("+")[0] in TESTED:
        return f"{version}: supported, tested by the GPU suite"
    return f"{version}: supported range, not tested here (tested: {', '.join(TESTED)}); run the contract tests"


# ----------------------------------------------------------------------------- engine side (driver)

WORKER_EXTENSION = "eagle3.extract.vllm_worker.CaptureExtension"
# hooks: forward hooks on the decoder layers (eager mode); aux: vLLM's extract_hidden_states speculative method
# (compiled, CUDA graphs, but no async scheduling: vLLM 0.26 refuses it to that method); direct: the model's
# EAGLE-3 aux outputs in a plain engine (compiled, CUDA graphs, async scheduling; auto's choice where the runner
# can be wrapped, see DIRECT_KEY)
STRATEGIES = ("hooks", "aux", "direct")
# direct: the layer ids ride in the engine's hf config (hf_overrides, so they belong to that engine only); the
# worker extension's import wraps the V1 runner so that, when this key is set and no speculative method is, the
# model returns its aux layers' states and each step's go to the capture (patch_runner_for_direct_capture)
DIRECT_KEY = "eagle3_direct_capture_layer_ids"
DIRECT_WRAPS = ("_setup_eagle3_aux_hidden_state_outputs", "_model_forward")  # the V1 runner's methods direct wraps


def engine_fields() -> set[str]:
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}


def supports_aux_capture() -> bool:
    """vLLM's own aux-hidden-state path without a drafter: the extract_hidden_states method (>= 0.2x)."""
    try:
        from vllm.config.speculative import SpeculativeConfig
    except ImportError:
        return False
    return hasattr(SpeculativeConfig, "uses_extract_hidden_states")


def supports_direct_capture() -> bool:
    """The V1 runner has what patch_runner_for_direct_capture wraps (the engine then needs no speculative method)."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception:  # noqa: BLE001 - no vLLM, or one without the V1 runner
        return False
    return all(callable(getattr(GPUModelRunner, n, None)) for n in DIRECT_WRAPS)


def pick_strategy(requested: str) -> str:
    """auto: direct where the runner can be wrapped (a plain engine: async scheduling, which vLLM 0.26 refuses
    extract_hidden_states: the faster engine), else aux, else hooks."""
    if requested == "auto":
        if supports_direct_capture():
            return "direct"
        return "aux" if supports_aux_capture() else "hooks"
    if requested not in STRATEGIES:
        raise ValueError(f"capture strategy {requested!r}: use auto, {', '.join(STRATEGIES)}")
    if requested == "aux" and not supports_aux_capture():
        raise ValueError(f"vLLM {installed_version()} has no extract_hidden_states method: use --capture hooks")
    return requested


def prepare_environment(log_level: str | None = None) -> None:
    """Before an engine starts (workers inherit the environment):
    - the V1 GPU model runner, whose batch layout the capture reads (V2 is the default for some
      architectures from 0.2x on);
    - the log level for eagle3's logger inside worker processes (they start at vLLM's WARNING);
    - spawned workers: a forked worker dies with "Cannot re-initialize CUDA in forked subprocess" when the
      driver process touched CUDA first; spawn is always safe;
    - vLLM's own top-p/top-k sampler instead of FlashInfer's (unless the user chose): extraction samples one greedy
      token, which never uses either, but the engine warms FlashInfer's up at start, JIT-compiling it on a host
      without flashinfer's jit-cache wheel (a slow first engine start)."""
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if log_level:
        os.environ["EAGLE3_LOG_LEVEL"] = log_level


MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"


def engine_in_process():
    """Before LLM(): vLLM's engine core (and, at TP 1, its one worker) in this process instead of a process of its
    own. One CUDA context then holds the engine and whatever else this process runs on the GPU (the online trainer),
    so their kernels may overlap; two processes share a GPU by time slices. The engine core caches vLLM's environment
    once it starts (envs.enable_envs_cache), so the cache is dropped first, and the returned function, called once
    the engine is shut down, drops it again and puts the variable back: a later engine of this process reads it
    afresh. The engine in this process also initializes torch.distributed (a world of one)."""
    envs = _envs()
    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    before = os.environ.get(MULTIPROCESSING)
    os.environ[MULTIPROCESSING] = "0"

    def restore() -> None:
        if hasattr(envs, "disable_envs_cache"):
            envs.disable_envs_cache()
        if before is None:
            os.environ.pop(MULTIPROCESSING, None)
        else:
            os.environ[MULTIPROCESSING] = before

    return restore


def _envs():
    try:
        from vllm import envs
    except ImportError:  # a vLLM without the module (the CPU suite's fake has one)
        return None
    return envs


def engine_kwargs(
    model: str,
    *,
    strategy: str,
    layer_ids: tuple[int, ...],
    tp: int = 1,
    dtype: str = "bfloat16",
    gpu_memory_utilization: float = 0.85,
    max_model_len: int | None = None,
    load_format: str = "auto",
    skip_tokenizer_init: bool = True,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """LLM(**kwargs) for extraction. Prefix caching off: it skips computing shared prefixes, whose states
    would then be missing. Async scheduling off (but for direct): the capture reads the runner's batch layout
    of the step it is in, written before that step's forward in either case. Hooks need eager mode; the aux
    and direct paths keep torch.compile and CUDA graphs."""
    kw: dict[str, Any] = dict(
        model=model,
        tensor_parallel_size=tp,
        dtype=dtype,
        enable_prefix_caching=False,
        async_scheduling=False,
        worker_extension_cls=WORKER_EXTENSION,
        gpu_memory_utilization=gpu_memory_utilization,
        load_format=load_format,
        skip_tokenizer_init=skip_tokenizer_init,
        disable_log_stats=True,
        kernel_config={"enable_flashinfer_autotune": False},
    )
    if max_model_len:
        kw["max_model_len"] = max_model_len
    if max_num_batched_tokens:
        kw["max_num_batched_tokens"] = max_num_batched_tokens
    if max_num_seqs:
        kw["max_num_seqs"] = max_num_seqs
    if strategy == "hooks":
        kw["enforce_eager"] = True
    elif strategy == "aux":
        kw["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        }
    elif strategy == "direct":  # a plain engine: vLLM schedules the next step while the GPU runs this one
        kw["hf_overrides"] = {DIRECT_KEY: list(layer_ids)}
        kw["async_scheduling"] = True
    kw.update(extra or {})
    known = engine_fields()
    dropped = sorted(k for k in kw if k not in known and k != "model")
    for k in dropped:
        if k in ("kernel_config", "async_scheduling", "disable_log_stats"):
            kw.pop(k)  # optional tuning knobs that older versions lack
        else:
            raise ValueError(f"vLLM {installed_version()} EngineArgs has no {k!r}")
    return kw


def shutdown_engine(llm, best_effort: bool = True) -> None:
    """End an LLM's engine core and its workers: their GPU memory back to this process's next engine. best_effort:
    an error on the way out is ignored (closing after a failure); otherwise it is raised."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        if not best_effort:
            raise


def collective_rpc(llm, method: str, args: tuple = ()) -> Any:
    """LLM.collective_rpc: one reply per worker (0.26 has no unique_reply_rank at this level)."""
    return llm.collective_rpc(method, args=args)


# ---------------------------------------------------------------------------- worker side (inside vLLM)


def get_model(worker):
    return worker.get_model() if hasattr(worker, "get_model") else worker.model_runner.get_model()


def decoder_layers(model) -> Any:
    """The decoder layer list of a vLLM model (plain CausalLM or a multimodal wrapper like Kimi-K2.5)."""
    candidates = [("model",), ("language_model", "model"), ("model", "language_model", "model")]
    if hasattr(model, "get_language_model"):
        try:
            lm = model.get_language_model()
            if hasattr(lm, "model") and hasattr(lm.model, "layers"):
                return lm.model.layers
        except (AttributeError, NotImplementedError):
            pass
    for path in candidates:
        m = model
        try:
            for p in path:
                m = getattr(m, p)
            return m.layers
        except AttributeError:
            continue
    raise TypeError(f"cannot find decoder layers in {type(model).__name__}")


def final_head(model) -> tuple[Any, Any, int, int]:
    """(final norm weight [H], this rank's lm_head rows, first vocab id, end vocab id) of a vLLM model.
    ParallelLMHead pads the vocabulary and splits it by TP rank: shard_indices names the real rows."""
    lm = model.get_language_model() if hasattr(model, "get_language_model") else model
    norm = lm.model.norm.weight
    head = lm.lm_head
    idx = getattr(head, "shard_indices", None)
    if idx is not None:
        start, end = int(idx.org_vocab_start_index), int(idx.org_vocab_end_index)
    else:
        start, end = 0, int(getattr(head, "org_vocab_size", head.weight.shape[0]))
    return norm, head.weight, start, end


def final_norm_module(model) -> Any:
    """The module of the target's final norm (model.norm of the language model), or None."""
    lm = model.get_language_model() if hasattr(model, "get_language_model") else model
    return getattr(getattr(lm, "model", None), "norm", None)


def layer_state(output) -> Any:
    """A decoder layer's output as the residual stream: (hidden, residual) -> their sum."""
    if isinstance(output, tuple):
        hidden, residual = output[0], output[1] if len(output) > 1 else None
        return hidden if residual is None else hidden + residual
    return output


def parallel_info() -> dict[str, Any]:
    from vllm.distributed import parallel_state as ps

    return {
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "tp_size": ps.get_tensor_model_parallel_world_size(),
        "pp_last": ps.get_pp_group().is_last_rank,
        "pp_size": ps.get_pp_group().world_size,
    }


def step_layout(runner):
    """The current step's batch layout from the V1 GPU model runner."""
    from eagle3.extract.capture import StepLayout

    batch = runner.input_batch
    n = batch.num_reqs
    req_ids = list(batch.req_ids[:n])
    starts = runner.query_start_loc.np[: n + 1].tolist()
    computed = batch.num_computed_tokens_cpu[:n].tolist()
    prompts = [runner.requests[r].prompt_token_ids for r in req_ids]
    return StepLayout(req_ids, starts, computed, prompts)


def max_step_tokens(runner) -> int | None:
    """The most tokens one forward step computes (the V1 runner's max_num_tokens: the scheduler's token budget)."""
    n = getattr(runner, "max_num_tokens", None)
    return int(n) if n else None


def patch_runner_for_direct_capture(runner_cls) -> bool:
    """Wrap the V1 runner class (once) for the direct strategy: at load, a model whose hf config carries DIRECT_KEY
    in an engine without a speculative method returns its aux layers' states as EAGLE-3 targets do (the runner
    unpacks (hidden, aux) and, with no drafter, drops aux); each real step's ``_model_forward`` then hands them
    to ``runner._eagle3_direct`` (the capture's on_step, set by the worker extension) before returning.
    Dummy, profile and CUDA-graph capture runs call the model, not _model_forward: they are never captured."""
    if getattr(runner_cls, "_eagle3_direct_patched", False):
        return True
    setup, forward = (getattr(runner_cls, n, None) for n in DIRECT_WRAPS)
    if setup is None or forward is None:
        return False

    def setup_aux(self):
        layers = getattr(self.model_config.hf_config, DIRECT_KEY, None)
        if layers and self.speculative_config is None:
            if not callable(getattr(self.model, "set_aux_hidden_state_layers", None)):
                raise RuntimeError(
                    f"{type(self.model).__name__} has no EAGLE-3 aux outputs (set_aux_hidden_state_"
                    "layers): the direct capture cannot use it; use --capture hooks"
                )
            self.use_aux_hidden_state_outputs = True
            self._eagle3_direct_layers = [int(i) for i in layers]
            self.model.set_aux_hidden_state_layers(tuple(self._eagle3_direct_layers))
            return None
        return setup(self)

    def model_forward(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        on_aux = getattr(self, "_eagle3_direct", None)
        if on_aux is not None and isinstance(out, tuple):
            on_aux(list(out[1]))  # [n_layers] x [>= n_tok, H]: the step's aux states, before the next step's
        return out

    runner_cls._setup_eagle3_aux_hidden_state_outputs = setup_aux
    runner_cls._model_forward = model_forward
    runner_cls._eagle3_direct_patched = True
    return True


def install_direct_capture() -> bool:
    """Called when the worker extension is imported: in a vLLM worker that is before the runner loads the model."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception:  # noqa: BLE001 - no vLLM (CPU CI), or one without the V1 runner: direct is unavailable
        return False
    return patch_runner_for_direct_capture(GPUModelRunner)


def attach_direct_capture(runner, layer_ids, on_aux) -> None:
    """The worker extension's setup for the direct strategy: the runner must have loaded the model with the aux
    outputs (the engine was started with engine_kwargs(strategy="direct") and the patch was in place)."""
    got = getattr(runner, "_eagle3_direct_layers", None)
    if not getattr(runner, "use_aux_hidden_state_outputs", False) or got is None:
        raise RuntimeError(
            "the direct capture needs an engine started with engine_kwargs(strategy='direct') and "
            "eagle3's worker extension imported before the model loaded; this runner returns no aux "
            "states (use --capture aux)"
        )
    if list(got) != list(layer_ids):
        raise RuntimeError(
            f"the engine returns the states of layer ids {list(got)}, the capture wants "
            f"{list(layer_ids)}: start the engine with the capture's layer ids"
        )
    runner._eagle3_direct = on_aux


def patch_drafter(runner, on_aux) -> None:
    """With method extract_hidden_states the runner hands the drafter the aux states of each step:
    take them (on_aux(list of [n_tok, H])) instead of writing them into a hidden-state KV cache.
    Returns the sampled tokens as drafts, as ExtractHiddenStatesProposer.propose does."""
    drafter = runner.drafter

    def propose(*args, **kwargs):
        bound = inspect.signature(type(drafter).propose).bind(drafter, *args, **kwargs)
        on_aux(list(bound.arguments["target_hidden_states"]))
        return bound.arguments["sampled_token_ids"][:, :1]

    drafter.propose = propose


def drafter_facts(runner, target) -> dict:
    """The EAGLE-3 drafter a speculative engine loaded (vLLM 0.26: runner.drafter.model, an
    Eagle3LlamaForCausalLM): shared embedding / lm_head with the target, weight dtype, rotary module."""
    draft = runner.drafter.model
    lm = target.get_language_model() if hasattr(target, "get_language_model") else target
    return {
        "shares_embedding": draft.model.embed_tokens is lm.model.embed_tokens,
        "shares_lm_head": draft.lm_head is getattr(lm, "lm_head", None),
        "dtype": str(draft.model.fc.weight.dtype).removeprefix("torch."),
        "draft_class": type(draft).__name__,
        "rotary": draft.model.layers[0].self_attn.rotary_emb,
    }


def set_aux_layers(model, layer_ids) -> None:
    """Which target layers feed the EAGLE-3 drafter (read at every forward in eager mode)."""
    model.set_aux_hidden_state_layers(tuple(int(i) for i in layer_ids))
