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
    assert "--tool-call-parser" not in argv  # the tiny target's ChatML has no tool-call tokens
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}
    assert (draft / "config.json").is_file() and result.serve in (draft / "README.md").read_text()
    assert f"serve      {result.serve}" in result.lines()


def test_a_target_with_custom_code_is_served_with_trust_remote_code_at_the_tp_asked():
    argv = serve_line.vllm_serve_argv("/m/Kimi-K2.5", "/r/draft", 8, 4, True)
    assert argv[:6] == ["vllm", "serve", "/m/Kimi-K2.5", "--tensor-parallel-size", "8", "--trust-remote-code"]
    assert json.loads(argv[-1])["num_speculative_tokens"] == 4 and argv[-2] == "--speculative-config"
    assert shlex.split(shlex.join(argv)) == argv  # the printed line is one the shell gives back as is


def _tokenizer_config(folder: Path, tokens: list[str]) -> str:
    folder.mkdir()
    added = {str(1000 + i): {"content": t, "special": True} for i, t in enumerate(tokens)}
    (folder / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))
    return str(folder)


def test_a_target_in_kimi_s_format_is_served_with_its_tool_call_and_reasoning_parsers(tmp_path):
    """As Kimi-K2.5 is served: without a tool parser vLLM refuses every request that carries tools (HTTP 400,
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser')."""
    from eagle3.targets import kimi_format

    kimi = _tokenizer_config(tmp_path / "kimi", kimi_format.SPECIAL_TOKENS)
    argv = serve_line.vllm_serve_argv(kimi, "/r/draft", 8, 3, False)
    assert argv[argv.index("--tool-call-parser") + 1] == "kimi_k2" and "--enable-auto-tool-choice" in argv
    assert argv[argv.index("--reasoning-parser") + 1] == "kimi_k2" and argv[-2] == "--speculative-config"
    think_only = _tokenizer_config(tmp_path / "think", kimi_format.THINK + kimi_format.ROLE_TOKENS)
    for target in (think_only, str(tmp_path / "missing"), "moonshotai/Kimi-K2.5"):
        assert "--tool-call-parser" not in serve_line.vllm_serve_argv(target, "/r/draft", 8, 3, False), target


def test_vllm_s_own_parser_reads_the_serve_line_as_eagle3_meant_it(tmp_path):
    """Where vLLM is installed (a GPU host): its `vllm serve` argument parser, not ours, reads the line."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from eagle3.targets import kimi_format

    kimi = _tokenizer_config(tmp_path / "Kimi-K2.5", kimi_format.SPECIAL_TOKENS)
    argv = serve_line.vllm_serve_argv(kimi, "/r/draft", 8, 3, True)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[2:])
    assert (args.model_tag, args.tensor_parallel_size, args.trust_remote_code) == (kimi, 8, True)
    assert (args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser) == (True, "kimi_k2", "kimi_k2")
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
