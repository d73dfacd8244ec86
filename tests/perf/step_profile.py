"""Where a training step's time goes (issue 42: where a goal is missed, the profile that shows what limits it).

``profile(step, n)`` runs ``step()`` n times under torch.profiler and returns each operator's self time on the
device that ran it (CUDA kernels' time on a GPU, CPU time otherwise); ``shares`` sums them by kind of work, and
``table`` is the top of the list, as the benchmark writes it next to its figures.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable

import torch

# kind of work <- operator or kernel name (first match wins; lower case). Kernel names on a GPU (cutlass, sm90_xmma,
# flash_fwd...) and aten operators on the CPU both land in their kind.
KINDS = (
    ("attention", r"flash|sdpa|scaled_dot_product|attention|fmha"),
    ("loss", r"softmax|kl_div|log_softmax|cross_entropy|_chunked_kl|logsumexp"),
    ("optimizer", r"adam|_foreach|multi_tensor|clip_grad"),
    ("matmul", r"gemm|matmul|\bmm\b|aten::mm|addmm|bmm|linear|cutlass|xmma|cublas|nvjet"),
    ("communication", r"nccl|all_reduce|allreduce"),
    ("copy / cast", r"copy|_to_copy|cast|memcpy|memset|fill"),
)


def kind(name: str) -> str:
    low = name.lower()
    for k, pattern in KINDS:
        if re.search(pattern, low):
            return k
    return "elementwise / other"


def profile(step: Callable[[], None], n: int = 1) -> list[tuple[str, float]]:
    """[(name, self microseconds)] over n calls of step, largest first: CUDA time where the step ran kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=acts) as prof:
        for _ in range(n):
            step()
        if cuda:
            torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0.0) if cuda else e.self_cpu_time_total
        if t > 0:
            totals[e.key] += float(t)
    return sorted(totals.items(), key=lambda kv: -kv[1])


def shares(rows: list[tuple[str, float]]) -> dict[str, float]:
    """Fraction of the profiled time per kind of work (sums to 1)."""
    total = sum(t for _, t in rows) or 1.0
    out: dict[str, float] = defaultdict(float)
    for name, t in rows:
        out[kind(name)] += t / total
    return {k: round(v, 4) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def table(rows: list[tuple[str, float]], top: int = 25) -> str:
    total = sum(t for _, t in rows) or 1.0
    lines = [f"{'self ms':>10} {'share':>6}  {'kind':<20} name"]
    for name, t in rows[:top]:
        lines.append(f"{t / 1e3:>10.2f} {t / total:>6.1%}  {kind(name):<20} {name[:100]}")
    return "\n".join(lines)
