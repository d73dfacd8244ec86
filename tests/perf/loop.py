"""The extraction benchmark's loop (tests/gpu/test_bench_extract.py): the options a benchmark sink names, the step
sizes a loop's batches make, and the warm-up batches that meet each kernel config before the clock starts."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class LoopOptions:
    """How the benchmark's production loop runs a sink (tests/gpu/test_bench_extract._Loop)."""

    sink: str  # count | host | store: the capture's mode
    fsync: bool = True  # store_nofsync: the shards stay in the page cache
    fp8: bool = False  # store_fp8: --state-dtype fp8
    slots: int = 4  # host_slots8: steps in flight (staged on the device, pinned on the host)
    whole_copies: bool = False  # host_whole: a step's copies issued at once (no 64 MiB chunks)
    gil: bool = False  # _gil: the worker runs a GilSampler (a thread waking every 2 ms) and reports it


# a sink is its capture mode and then variants, each once: "store_nofsync_gil"
_VARIANTS = {
    "nofsync": ("fsync", False, "store"),
    "fp8": ("fp8", True, "store"),
    "slots8": ("slots", 8, None),
    "whole": ("whole_copies", True, None),
    "gil": ("gil", True, None),
}


def loop_options(sink: str) -> LoopOptions:
    """The loop's options named by a sink (a mode less its _direct suffix, see split_mode)."""
    mode, *variants = sink.split("_")
    fields = {}
    for v in variants:
        field, value, only = _VARIANTS.get(v, (None, None, None))
        if field is None or field in fields or (only and only != mode):
            break
        fields[field] = value
    else:
        if mode in ("count", "host", "store"):
            return LoopOptions(mode, **fields)
    raise ValueError(
        f"benchmark sink {sink!r}: a capture mode (count, host, store) and variants, each once, from "
        f"{', '.join(f'{v} ({only} only)' if only else v for v, (_, _, only) in _VARIANTS.items())}"
    )


def loop_step_tokens(seq_len: int, max_batched_tokens: int) -> list[int]:
    """Token counts a step of the benchmark's loop can hold: whole prompts of seq_len tokens, as many as the
    engine's max_num_batched_tokens takes (one chunk of that budget where a prompt is longer)."""
    return [seq_len * k for k in range(1, max_batched_tokens // seq_len + 1)] or [max_batched_tokens]


def warm_steps(step_tokens: Iterable[int], config_of: Callable[[int], object] | None) -> list[int]:
    """The smallest step size (tokens) of each distinct kernel config ``config_of`` picks among ``step_tokens``;
    every size where config_of is None. vLLM compiles its Triton MoE kernel once per config, which it picks by a
    step's token count (the nearest key of a tuned grid: 2,048 and 3,072 tokens share one config, 512 and 4,096
    another), about 1.4 s at the first step that meets one. On the H200, kimi-depth's figures met one inside
    their timed loop in the ffdd6a0, 8ec8ff9 and 6b3715c runs (that quarter 14-20% slow: the 6b3715c run's fsynced
    store 0.936x plain,
    against 0.99x in its other quarters); a warm-up of one step per config takes it out of the clock."""
    sizes = sorted(set(step_tokens))
    if config_of is None:
        return sizes
    seen: dict[str, int] = {}
    for m in sizes:
        seen.setdefault(json.dumps(config_of(m), sort_keys=True, default=str), m)
    return sorted(seen.values())


def warm_prompts(step_tokens: Iterable[int], max_prompt: int) -> list[list[int]]:
    """Prompt lengths (tokens) of a warm batch per step size: one prompt where it fits max_prompt (the engine's
    longest prompt), which the engine cannot split across steps as it splits a batch of short prompts by what
    has reached it; else the fewest prompts that hold the step, within a token of each other."""
    out = []
    for m in step_tokens:
        n = -(-m // max_prompt)
        out.append([m // n + (i >= n - m % n) for i in range(n)])
    return out
