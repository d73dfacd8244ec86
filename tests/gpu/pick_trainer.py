"""tests/gpu/pick_trainer.py REPORT VARLEN_PASSED: the trainer configuration an online step trains with.

REPORT is a benchtrain step's report.json (tests/gpu/test_bench_train.py); VARLEN_PASSED is 1 where that
step passed the varlen attention's CUDA tests (tests/gpu/passed.sh). Prints one of
  sdpa     speculators' attention, eager (the trainer's default; also where the report is missing or unreadable)
  varlen   the mask-free TTT attention, eager (only where its CUDA tests passed)
  flex     flex attention compiled (TrainConfig compile=True; only where the compiled run of varying packs trained
           without an error and without a function other than speculators' compute_metrics reaching dynamo's
           recompile limit: the draft's forward past it runs flex attention unfused)
whichever trained fastest at 8k tokens, one sample a sequence (the rows measured alike), then the figures it chose from.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Functions that may reach the recompile limit and run eagerly after it at a small cost: speculators' accuracies
# (metrics.py; the 6c7a0aa run on an H200 reached it there, the run's rate 0.95x the fixed-length 8k row)
EAGER_OK = ("'compute_metrics'",)


def candidates(report: dict, varlen_passed: bool) -> dict[str, float]:
    """tok/s at 8k of each configuration the report shows working."""
    eager = report.get("bench_train_kimi_draft") or []
    out = {"sdpa": eager[1].get("tok_per_s", 0) if len(eager) > 1 else 0}
    eight = next((r for r in report.get("bench_train_varlen") or [] if r.get("seq") == 8192), {})
    if varlen_passed and eight.get("tok_per_s"):
        out["varlen"] = eight["tok_per_s"]
    compiled = [r for r in report.get("bench_train_compiled") or [] if r.get("attn") == "flex"]
    flex = next((r for r in compiled if r.get("seq") == 8192), {})
    run = next((r for r in compiled if r.get("seq") == "run"), None)  # _compiled_run_row's key: .../run
    limits = [h for h in (run or {}).get("recompile_limit_hits") or [] if not any(ok in h for ok in EAGER_OK)]
    if flex.get("tok_per_s") and run and "error" not in run and not limits:
        out["flex"] = flex["tok_per_s"]
    return out


def main(argv: list[str]) -> int:
    path, varlen_passed = Path(argv[1]), argv[2] == "1"
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):  # none, or cut short by the step's time limit mid-write
        report = {}
    got = candidates(report, varlen_passed)
    best = max(got, key=got.get)
    print(best, json.dumps(got))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
