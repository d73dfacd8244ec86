"""Which benchmark figures had a kernel compiled inside their clock (run after a benchmark step).

    python3 tests/gpu/jit_in_clock.py STEP.log REPORT.json

vLLM's JIT monitor logs, from the engine's process, "Triton kernel JIT compilation during inference: NAME" with
the wall time; each figure's report entry (sustained[KEY]) holds its clock's wall times (timed_clock, HH:MM:SS).
A compile inside a clock costs ~1.4 s of it (the 6b3715c run: kimi-depth's fsynced store, 0.936x plain). Prints a line
per figure and exits 1 where any figure had one. Without jit_monitor_verbose vLLM logs only each engine's first
compile (warning_once), and the check says so; with it, every compile and its constexprs (shown for a hit).
The benchmark's acceptance test applies the same check itself (test_bench_extract.jit_in_clocks, the log named by
EAGLE3_ENGINE_LOG): a bar resting on a figure with a compile in its clock fails there.
"""

from __future__ import annotations

import json
import re
import sys

# (EngineCore pid=3977) WARNING 12-04 03:33:06 [jit_monitor.py:135] Triton kernel JIT compilation during inference:
# fused_moe_kernel. This causes a latency spike; ...
# verbose: "... inference: fused_moe_kernel (constexprs={BLOCK_SIZE_M=128, ...}; signature={...}; ...). This ..."
JIT = re.compile(
    r"(\d\d:\d\d:\d\d) \[jit_monitor\.py:\d+\] .*JIT compilation during inference: ([\w.]+)"
    r"(?: \(constexprs=(\{.*?\});)?"
)
# an engine's start (the LLM's own log line, not pytest's capture of it): INFO 12-04 04:30:47 [api_utils.py:273]
# non-default args: {..., 'jit_monitor_verbose': True, ...}
ENGINE = re.compile(r"\d\d:\d\d:\d\d \[api_utils\.py:\d+\] non-default args: (.*)")


def compiles(log_text: str) -> list[tuple[str, str, str]]:
    """(HH:MM:SS, kernel, its constexprs where logged verbose, else "") of each JIT warning, in order."""
    return [(m.group(1), m.group(2).rstrip("."), m.group(3) or "") for m in JIT.finditer(log_text)]


def quiet_engines(log_text: str) -> tuple[int, int]:
    """(engines started without jit_monitor_verbose, engines started): a quiet one logs only its first compile."""
    starts = ENGINE.findall(log_text)
    return sum("'jit_monitor_verbose': True" not in a for a in starts), len(starts)


def inside(t: str, start: str, end: str) -> bool:
    """t within [start, end] (HH:MM:SS strings; a clock across midnight wraps)."""
    return start <= t <= end if start <= end else t >= start or t <= end


def hits(clocks: dict[str, list[str]], jits: list[tuple[str, str, str]]) -> dict[str, list[tuple[str, str, str]]]:
    """figure key -> the compiles inside its clock ([start, end], HH:MM:SS)."""
    return {key: [(t, k, c) for t, k, c in jits if inside(t, *clock)] for key, clock in clocks.items()}


def figures(report: dict, jits: list[tuple[str, str, str]]) -> dict[str, list[tuple[str, str, str]]]:
    """figure key -> the compiles inside its clock, for each figure whose report gives its clock."""
    clocks = {}
    for name, entry in report.items():
        clock = entry.get("timed_clock") if name.startswith("sustained[") and isinstance(entry, dict) else None
        if clock and len(clock) == 2:
            clocks[name[len("sustained[") : -1]] = clock
    return hits(clocks, jits)


def main(argv: list[str]) -> int:
    log, report = argv
    with open(log, errors="replace") as f:
        text = f.read()
    jits = compiles(text)
    with open(report) as f:
        found = figures(json.load(f), jits)
    for key, hits in found.items():
        said = ", ".join(f"{k} at {t}" + (f" {c}" if c else "") for t, k, c in hits)
        print(f"{key}: {'JIT INSIDE ITS CLOCK: ' + said if hits else 'no JIT inside its clock'}")
    quiet, engines = quiet_engines(text)
    if quiet:
        print(
            f"CAUTION: vLLM logged only each engine's first compile (jit_monitor_verbose off in {quiet} of "
            f"{engines} engines): a later one inside a clock would not show"
        )
    print(f"{len(jits)} JIT warning(s) in {log}; {len(found)} figure(s) with a clock in {report}")
    return 1 if any(found.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
