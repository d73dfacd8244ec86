"""A DeepseekV3 target with its routed experts in INT4, as Kimi-K2.5 ships and vLLM serves them.

Kimi-K2.5's scheme (its config.json ``quantization_config``): compressed-tensors ``pack-quantized``, int4 weights,
symmetric, one scale per 32 inputs, round to nearest; attention, shared experts, the dense MLP and lm_head kept
(its ``ignore`` list). The numbers come from compressed-tensors itself (its scale rule and packer), so the files
are what vLLM's WNA16 MoE kernels and transformers read. Per expert and projection, for a weight [N, K]:
``weight_packed`` int32 [N, K/8], ``weight_scale`` bf16 [N, K/32], ``weight_shape`` [2].
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from eagle3 import ownership
from eagle3.preflight import UsageError, compressed_tensors_installed
from eagle3.targets.presets import KIMI_K25_QUANT

GROUP = 32
KIMI_IGNORE = KIMI_K25_QUANT["ignore"]
NOT_LINEAR = (".embed_tokens.weight", ".mlp.gate.weight")  # embeddings and the router: no Linear in either engine


def scheme():
    """Kimi-K2.5's weight scheme as compressed-tensors' QuantizationScheme."""
    compressed_tensors_installed("an INT4 target")
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP)
    return QuantizationScheme(targets=["Linear"], weights=args)


def quantization_config() -> dict:
    """config.json's ``quantization_config``: compressed-tensors' own serialisation of Kimi-K2.5's scheme."""
    from compressed_tensors.quantization import QuantizationConfig

    cfg = QuantizationConfig(config_groups={"group_0": scheme()}, format="pack-quantized", ignore=KIMI_IGNORE,
                             quantization_status="compressed")  # fmt: skip
    return json.loads(cfg.model_dump_json())


def is_quantized(name: str, shape: tuple[int, ...], ignore: list[str] = KIMI_IGNORE) -> bool:
    """Whether checkpoint tensor ``name`` is a Linear weight that the scheme quantizes: 2-D, not an embedding or
    the router, and not matched (compressed-tensors' own rule) by the ``ignore`` list."""
    compressed_tensors_installed("an INT4 target")
    from compressed_tensors.utils.match import match_name

    if len(shape) != 2 or not name.endswith(".weight") or name.endswith(NOT_LINEAR):
        return False
    return not any(match_name(name[: -len(".weight")], rule) for rule in ignore)


def quantize_weight(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """{weight_packed, weight_scale, weight_shape} of one [N, K] weight; the scale rounded to bf16 before use, so the
    stored scale is the one the integers were rounded with."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    sch = scheme()
    n, k = w.shape
    groups = w.float().reshape(n, k // GROUP, GROUP)
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), sch.weights)
    state = {"weight": w.float(), "weight_scale": scale.to(torch.bfloat16).float(), "weight_zero_point": zero}
    packed = PackedQuantizationCompressor.compress(state, sch)
    packed["weight_scale"] = packed["weight_scale"].to(torch.bfloat16)
    return packed


def quantize_target(src: str | Path, out: str | Path, device: str = "cpu") -> dict:
    """``src`` (a bf16/fp32 DeepseekV3 target folder) written to ``out`` as Kimi-K2.5's checkpoint is: the routed
    experts INT4, the rest bf16; returns {quantized, kept} tensor counts. A failure leaves no folder it began."""
    with ownership.claimed(out, "target") as out:
        return quantize_files(Path(src), out, device)


def quantize_files(src: Path, out: Path, device: str = "cpu") -> dict:
    """quantize_target's work into a claimed ``out`` (``out`` may be ``src``: each file is read whole first);
    ``device`` does the arithmetic (a GPU for Kimi-sized experts)."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    if not text.get("n_routed_experts"):
        raise UsageError(f"{src}: no routed experts to quantize (--quantize int4 is Kimi-K2.5's scheme for a "
                         f"DeepseekV3 target's experts)")  # fmt: skip
    if "quantization_config" in text or "quantization_config" in cfg:
        raise UsageError(f"{src} is quantized already; give the bf16 target")
    if int(text["moe_intermediate_size"]) % GROUP or int(text["hidden_size"]) % GROUP:
        raise UsageError(f"{src}: expert sizes must be multiples of the group size {GROUP}")
    counts = {"quantized": 0, "kept": 0}
    names: dict[str, str] = {}
    for f in sorted(src.iterdir()):
        if f.suffix == ".safetensors":
            tensors = {}
            for name, w in load_file(f).items():
                if is_quantized(name, tuple(w.shape)):
                    packed = quantize_weight(w.to(device))
                    tensors.update({name[: -len("weight")] + k: v.cpu() for k, v in packed.items()})
                    counts["quantized"] += 1
                else:
                    tensors[name] = w.to(torch.bfloat16) if w.is_floating_point() else w
                    counts["kept"] += 1
            names.update(dict.fromkeys(tensors, f.name))
            save_file(tensors, out / f.name, metadata={"format": "pt"})
        elif f.is_file() and f.name not in ("config.json", ownership.MARK) and src != out:
            shutil.copy2(f, out / f.name)
    index = out / "model.safetensors.index.json"
    if index.exists():
        index.write_text(json.dumps({**json.loads(index.read_text()), "weight_map": names}, indent=2))
    text.update(quantization_config=quantization_config(), dtype="bfloat16")
    text.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return counts
