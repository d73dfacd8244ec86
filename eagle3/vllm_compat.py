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
from dataclasses import dataclass
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
