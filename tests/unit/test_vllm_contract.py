"""Contract: every vLLM attribute and signature eagle3.extract.vllm_compat relies on, checked against the
installed vLLM. Runs wherever vLLM imports (the GPU host; CPU CI has no vLLM and skips this module)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here; the contract runs on the GPU host")

from eagle3.extract import vllm_compat  # noqa: E402
from eagle3.extract.rpc import Expect, LayerStack, ReplyError, normalize_reply  # noqa: E402


def _src(obj) -> str:
    return inspect.getsource(obj)


def test_version_is_supported():
    assert vllm_compat.parse_version(vllm.__version__)[:2] >= vllm_compat.SUPPORTED_MIN


@pytest.mark.parametrize("strategy", vllm_compat.STRATEGIES)
def test_engine_args_accept_what_the_adapter_passes(strategy):
    from vllm.engine.arg_utils import EngineArgs

    kw = vllm_compat.engine_kwargs(
        "m", strategy=strategy, layer_ids=(2, 4, 5, 8), max_model_len=4096, max_num_batched_tokens=8192, max_num_seqs=64
    )
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(kw) <= fields
    assert {"kernel_config", "async_scheduling", "enable_prefix_caching", "worker_extension_cls"} <= set(kw)


def test_the_fake_engine_s_sampling_parameters_are_vllm_s():
    """tests/unit/fake_vllm.py's SamplingParams: every field it has (what eagle3 passes) is one of vLLM's."""
    from tests.unit import fake_vllm

    fake = {f.name for f in dataclasses.fields(fake_vllm.SamplingParams)}
    assert fake <= set(vllm.SamplingParams.__struct_fields__), fake - set(vllm.SamplingParams.__struct_fields__)


def test_llm_collective_rpc_signature():
    params = inspect.signature(vllm.LLM.collective_rpc).parameters
    assert list(params)[:5] == ["self", "method", "timeout", "args", "kwargs"]
    assert "unique_reply_rank" not in params  # the LLM-level API returns one entry per worker


def test_aux_capture_path_exists():
    from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert vllm_compat.supports_aux_capture()
    params = inspect.signature(ExtractHiddenStatesProposer.propose).parameters
    assert {"sampled_token_ids", "target_hidden_states"} <= set(params)
    src = _src(GPUModelRunner)
    assert "uses_extract_hidden_states" in src and "target_hidden_states=target_hidden_states" in src
    assert "self.drafter = ExtractHiddenStatesProposer" in src


def test_direct_capture_wraps_the_runner_when_the_worker_extension_is_imported():
    """direct: vLLM resolves the worker extension before it builds the runner; importing it wraps the V1 runner's
    aux setup (called by load_model) and _model_forward (called by execute_model only: dummy, profile and CUDA
    graph capture runs call the model itself, so they never reach the capture); the runner unpacks (hidden, aux)."""
    import importlib

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    import eagle3.extract.vllm_worker as worker

    importlib.reload(worker)  # the import-time wrap, whatever imported it first
    assert GPUModelRunner._eagle3_direct_patched
    raw = inspect.getsource(inspect.getmodule(GPUModelRunner))
    load = raw[raw.index("    def load_model(") :]
    load = load[: load.index("\n    def ", 10)]
    assert "self._setup_eagle3_aux_hidden_state_outputs()" in load
    assert raw.count("self._model_forward(") == 1  # execute_model's
    dummy = raw[raw.index("    def _dummy_run(") :]
    dummy = dummy[: dummy.index("\n    def ", 10)]
    assert "self._model_forward(" not in dummy and "self.model(" in dummy
    assert "hidden_states, aux_hidden_states = model_output" in raw
    init = _src(GPUModelRunner.__init__)  # what the wrapped setup reads
    for attr in ("self.use_aux_hidden_state_outputs = False", "self.model_config", "self.speculative_config"):
        assert attr in init, attr


def test_runner_exposes_the_batch_layout():
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    init = _src(GPUModelRunner.__init__)
    for attr in ("self.input_batch", "self.query_start_loc", "self.requests"):
        assert attr in init or attr in _src(GPUModelRunner), attr
    assert isinstance(inspect.getattr_static(InputBatch, "req_ids"), property)
    assert "num_computed_tokens_cpu" in _src(InputBatch.__init__)
    assert isinstance(inspect.getattr_static(InputBatch, "num_reqs"), property)
    assert "prompt_token_ids" in {f.name for f in dataclasses.fields(CachedRequestState)}
    # the layout is written before the forward: positions = num_computed + arange over query_start_loc
    prep = _src(GPUModelRunner._prepare_inputs)
    assert "num_computed_tokens_cpu[req_indices]" in prep and "self.query_start_loc.np[1 : num_reqs + 1]" in prep


def test_worker_and_parallel_state():
    from vllm.distributed import parallel_state as ps
    from vllm.v1.worker.gpu_worker import Worker

    assert callable(Worker.get_model)
    for fn in ("get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size", "get_pp_group"):
        assert callable(getattr(ps, fn))


def test_deepseek_layers_return_hidden_and_residual():
    from vllm.model_executor.models import deepseek_v2

    layer_src = _src(deepseek_v2.DeepseekV2DecoderLayer.forward)
    assert "return hidden_states, residual" in layer_src
    model_src = _src(deepseek_v2.DeepseekV2Model.forward)
    assert "aux_hidden_state = hidden_states + residual" in model_src
    assert "self.end_layer in self.aux_hidden_state_layers" in model_src  # id L = last output before norm


def test_v1_runner_is_forced_for_extraction(monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    vllm_compat.prepare_environment("INFO")
    import os

    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0" and os.environ["EAGLE3_LOG_LEVEL"] == "INFO"


def test_the_flashinfer_sampler_switch_is_one_vllm_reads():
    """prepare_environment turns FlashInfer's sampler off by this name; a renamed variable would be ignored."""
    from vllm import envs
    from vllm.v1.sample.ops import topk_topp_sampler

    assert "VLLM_USE_FLASHINFER_SAMPLER" in envs.environment_variables
    assert "envs.VLLM_USE_FLASHINFER_SAMPLER" in _src(topk_topp_sampler.flashinfer_sampler_supported)


def test_the_in_process_switch_is_one_the_llm_engine_reads_and_its_cache_can_be_dropped(monkeypatch):
    """engine_in_process sets VLLM_ENABLE_V1_MULTIPROCESSING=0 and drops vLLM's environment cache: the variable is
    vLLM's, the LLM's engine reads it, and with the cache on a later change would go unseen until dropped."""
    from vllm import envs
    from vllm.v1.engine import llm_engine

    assert vllm_compat.MULTIPROCESSING in envs.environment_variables
    assert "envs.VLLM_ENABLE_V1_MULTIPROCESSING" in _src(llm_engine.LLMEngine.from_engine_args)
    monkeypatch.delenv(vllm_compat.MULTIPROCESSING, raising=False)
    envs.enable_envs_cache()  # as an engine core of this process does once it starts
    assert envs.VLLM_ENABLE_V1_MULTIPROCESSING is True
    restore = vllm_compat.engine_in_process()
    try:
        assert envs.VLLM_ENABLE_V1_MULTIPROCESSING is False
    finally:
        restore()
    assert envs.VLLM_ENABLE_V1_MULTIPROCESSING is True


def test_engine_encoded_tensors_are_what_the_normalizer_expects():
    """Encode with vLLM's own msgpack encoder, decode untyped (as utility replies are): small tensors
    arrive inline and are rebuilt; large ones arrive as an index into buffers the reply lost."""
    import msgspec
    from vllm.v1.serial_utils import MsgpackEncoder

    small = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    big = torch.zeros(256, 1024, dtype=torch.bfloat16)
    enc = MsgpackEncoder()
    bufs = enc.encode([[small]])
    decoded = msgspec.msgpack.decode(bufs[0])
    got = normalize_reply(decoded, Expect(1, LayerStack(1, (2, 3), torch.float32)))
    assert torch.equal(got[0][0], small)
    bufs = enc.encode([[big]])
    with pytest.raises(ReplyError, match="engine-encoded"):
        normalize_reply(msgspec.msgpack.decode(bufs[0]), Expect(1, LayerStack(1, (256, 1024), torch.bfloat16)))


def test_what_the_one_pass_extraction_relies_on():
    """extract --regenerate (one_pass.py): SamplingParams' skip_reading_prefix_cache (the first request computes every
    prompt row; the tail request reads the cache), the internal request id "<id>-<8 characters>" the worker sees
    (decode_capture.external_id), and RequestOutput.request_id as the caller's id."""
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.output_processor import RequestState

    from eagle3.extract.decode_capture import SUFFIX

    assert vllm.SamplingParams(max_tokens=1, skip_reading_prefix_cache=True).skip_reading_prefix_cache is True
    src = _src(InputProcessor.assign_request_id)
    assert f'f"{{request.external_req_id}}-{{random_uuid():.{SUFFIX}}}"' in src
    assert "request_id=external_req_id" in _src(RequestState)
