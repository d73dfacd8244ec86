"""The `vllm serve` command that serves a published draft beside its target: printed at the end of `train` and
written into the draft folder's README.md."""

from __future__ import annotations

import json
import shlex


def vllm_serve_argv(target: str, draft: str, tp: int, k: int, trust_remote_code: bool) -> list[str]:
    """``vllm serve`` for ``target`` at tensor-parallel size ``tp`` with the EAGLE-3 draft proposing ``k`` tokens."""
    spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": k}
    argv = ["vllm", "serve", target, "--tensor-parallel-size", str(tp)]
    if trust_remote_code:
        argv.append("--trust-remote-code")  # the target's config names custom code (auto_map)
    return argv + ["--speculative-config", json.dumps(spec)]


def readme(argv: list[str]) -> str:
    return (
        "# EAGLE-3 draft\n\nTrained by eagle3. Serve it beside its target with vLLM:\n\n"
        f"```bash\n{shlex.join(argv)}\n```\n"
    )
