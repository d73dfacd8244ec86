"""`eagle3 doctor`: what is installed, what the GPUs are, and whether vLLM is one the adapter supports.

By default in about a second: versions from package metadata, whether each module the pipeline needs can be
found, and the devices (torch only). `--deep` also imports each of them (speculators alone takes seconds), which
is what scripts/setup-env runs (`--check-install`)."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import sys

from eagle3.extract import vllm_compat


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect() -> dict[str, str]:
    """Versions and devices, as strings; never imports vLLM."""
    import torch

    info = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": f"{torch.__version__} (cuda build: {torch.version.cuda or 'none'})",
        "transformers": _version("transformers") or "not installed",
        "speculators": _version("speculators") or "not installed",
        "safetensors": _version("safetensors") or "not installed",
        "tokenizers": _version("tokenizers") or "not installed",
        "compressed-tensors": _version("compressed-tensors") or "not installed (make-target --quantize int4 needs it)",
        "vllm": vllm_compat.support_verdict(vllm_compat.installed_version()),
    }
    for extra in ("torchvision", "torchaudio"):
        if _version(extra):
            info[extra] = _version(extra)
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["gpus"] = f"{len(names)}: " + ", ".join(names)
    else:
        info["gpus"] = "none (CPU only: hf backend; the GPU suite needs CUDA)"
    return info


CHECKS = [
    ("transformers.models.deepseek_v3", "DeepseekV3 (the Kimi family)"),
    ("transformers.models.llama", "Llama"),
    ("safetensors.torch", "safetensors"),
    ("tokenizers", "tokenizers"),
    ("speculators.models.eagle3", "speculators' EAGLE-3 model"),
    ("compressed_tensors.compressors.pack_quantized", "compressed-tensors' INT4 packer (Kimi-K2.5's experts)"),
]


def _exists(module: str) -> bool:
    """Whether ``module`` is installed, importing nothing (find_spec of a dotted name imports its parents)."""
    import importlib.util
    from pathlib import Path

    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not rest:
        return spec is not None
    path = Path(next(iter(spec.submodule_search_locations or [""]))).joinpath(*rest)
    return (path / "__init__.py").exists() or path.with_suffix(".py").exists()


def install_problems(deep: bool = True) -> list[str]:
    """Modules the pipeline needs; each failure is a sentence saying what to do. ``deep`` imports them, else
    only finds them (no import: fast)."""
    problems = []
    for module, what in CHECKS:
        try:
            if deep:
                importlib.import_module(module)
            elif not _exists(module):
                raise ModuleNotFoundError(f"no module named {module!r}")
        except Exception as e:  # noqa: BLE001 - reported, not swallowed
            problems.append(
                f"{what} does not {'import' if deep else 'exist'}: {type(e).__name__}: {e}. Re-run scripts/setup-env."
            )
    if not deep:
        return problems
    for extra in ("torchvision", "torchaudio"):
        if _version(extra):
            try:
                importlib.import_module(extra)
            except Exception as e:  # noqa: BLE001
                problems.append(
                    f"{extra} {_version(extra)} is installed but does not load beside torch "
                    f"({type(e).__name__}: {e}); `pip uninstall {extra}` (eagle3 does not use it)."
                )
    return problems


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--check-install" in argv:
        problems = install_problems()
        for p in problems:
            print(f"eagle3 install check: {p}", file=sys.stderr)
        return 1 if problems else 0
    deep = "--deep" in argv
    info = collect()
    info["imports"] = (
        "imported each module the pipeline needs"
        if deep
        else "found (not imported; `eagle3 doctor --deep` imports them, a few seconds)"
    )
    width = max(map(len, info))
    problems = install_problems(deep)
    for k, v in info.items():
        print(f"{k:<{width}}  {v}")
    for p in problems:
        print(f"PROBLEM  {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
