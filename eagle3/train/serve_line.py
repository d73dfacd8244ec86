"""The `vllm serve` command that serves a published draft beside its target: printed at the end of `train` and
written into the draft folder's README.md."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from eagle3.targets.kimi_format import TOOL_TOKENS

KIMI_PARSERS = ["--enable-auto-tool-choice", "--tool-call-parser", "kimi_k2", "--reasoning-parser", "kimi_k2"]


def parsers(target: str) -> list[str]:
    """vLLM's Kimi-K2 parsers where the target's tokenizer is in Kimi's format (as Kimi-K2.5 is served): without a
    tool parser vLLM refuses every chat request that carries tools. None for a target that is not a local folder."""
    config = Path(target) / "tokenizer_config.json"
    return KIMI_PARSERS if config.is_file() and TOOL_TOKENS[0] in config.read_text() else []  # Kimi's section start


def vllm_serve_argv(target: str, draft: str, tp: int, k: int, trust_remote_code: bool) -> list[str]:
    """``vllm serve`` for ``target`` at tensor-parallel size ``tp`` with the EAGLE-3 draft proposing ``k`` tokens."""
    spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": k}
    argv = ["vllm", "serve", target, "--tensor-parallel-size", str(tp)]
    if trust_remote_code:
        argv.append("--trust-remote-code")  # the target's config names custom code (auto_map)
    return argv + parsers(target) + ["--speculative-config", json.dumps(spec)]


def readme(argv: list[str]) -> str:
    return (
        "# EAGLE-3 draft\n\nTrained by eagle3. Serve it beside its target with vLLM:\n\n"
        f"```bash\n{shlex.join(argv)}\n```\n"
    )
