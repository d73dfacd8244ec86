"""The `vllm serve` line `train` prints for its draft and writes into OUT/draft/README.md (train/serve_line.py)."""

import json
import shlex
from pathlib import Path

import pytest

from eagle3.train import serve_line


def test_training_ends_with_the_serve_line_and_writes_it_beside_the_draft(trained_run):
    result, out = trained_run
    argv = shlex.split(result.serve)
    draft = Path(out, "draft").resolve()
    assert argv[:2] == ["vllm", "serve"] and Path(argv[2]).is_dir() and (Path(argv[2]) / "config.json").is_file()
    assert argv[argv.index("--tensor-parallel-size") + 1] == "1" and "--trust-remote-code" not in argv
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}
    assert (draft / "config.json").is_file() and result.serve in (draft / "README.md").read_text()
    assert f"serve      {result.serve}" in result.lines()


def test_a_target_with_custom_code_is_served_with_trust_remote_code_at_the_tp_asked():
    argv = serve_line.vllm_serve_argv("/m/Kimi-K2.5", "/r/draft", 8, 4, True)
    assert argv[:6] == ["vllm", "serve", "/m/Kimi-K2.5", "--tensor-parallel-size", "8", "--trust-remote-code"]
    assert json.loads(argv[-1])["num_speculative_tokens"] == 4 and argv[-2] == "--speculative-config"
    assert shlex.split(shlex.join(argv)) == argv  # the printed line is one the shell gives back as is


def test_vllm_s_own_parser_reads_the_serve_line_as_eagle3_meant_it():
    """Where vLLM is installed (a GPU host): its `vllm serve` argument parser, not ours, reads the line."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = serve_line.vllm_serve_argv("/m/Kimi-K2.5", "/r/draft", 8, 3, True)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[2:])
    assert (args.model_tag, args.tensor_parallel_size, args.trust_remote_code) == ("/m/Kimi-K2.5", 8, True)
    spec = args.speculative_config
    spec = json.loads(spec) if isinstance(spec, str) else spec
    assert spec == {"method": "eagle3", "model": "/r/draft", "num_speculative_tokens": 3}


def test_the_serve_line_takes_the_largest_serve_tp_the_ttt_steps_and_the_target_s_custom_code(tmp_path):
    from types import SimpleNamespace

    from eagle3.train.train import serve_argv

    cfg = SimpleNamespace(serve_tps=(4, 8, 2), speculative_tokens=None, ttt_steps=5)
    run = SimpleNamespace(cfg=cfg, out=tmp_path, target="/m/T", custom_code=True)
    argv = serve_argv(run)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "8" and "--trust-remote-code" in argv
    assert json.loads(argv[-1]) == {"method": "eagle3", "model": str(tmp_path / "draft"), "num_speculative_tokens": 5}
    cfg.speculative_tokens, run.custom_code = 2, False
    argv = serve_argv(run)
    assert json.loads(argv[-1])["num_speculative_tokens"] == 2 and "--trust-remote-code" not in argv
