"""The extract command a store records, so `eagle3 extract --resume STORE` continues it and `verify` can print
the one command that repairs it. Written into STORE/plan.json with the planned sample ids, on the first run.

Reads JSON only (no torch): `--resume` is resolved in the CLI's preflight, in well under a second.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from eagle3.preflight import UsageError

PLAN = "plan.json"  # sample ids + recipe; the store reads it as store.PLAN

# the extract options a store records (argparse dest names), in the order a command line shows them
KEYS = (
    "model",
    "data",
    "backend",
    "layer_ids",
    "batch_size",
    "max_len",
    "long_rule",
    "on_error",
    "max_samples",
    "dedup",
    "shard_samples",
    "shard_tokens",
    "device",
    "tp",
    "capture",
    "gpu_mem",
    "no_fsync",
    "selfcheck_prompts",
    "no_selfcheck",
    "state_dtype",
    "trust_remote_code",
    "regenerate",
    "temperature",
    "top_p",
    "max_tokens",
    "seed",
)
# options that may differ on resume (where and how fast it runs, not what is stored)
RUNTIME = frozenset({"batch_size", "device", "tp", "gpu_mem", "no_fsync"})


def from_args(a) -> dict:
    """The recorded form of parsed extract arguments: paths made absolute, tuples as lists."""
    rec = {k: getattr(a, k) for k in KEYS}
    rec["model"] = str(Path(a.model).resolve())
    rec["data"] = [str(Path(p).resolve()) for p in a.data]
    rec["layer_ids"] = list(a.layer_ids) if a.layer_ids else None
    return rec


def command(store: str | Path, rec: dict, defaults: dict) -> str:
    """The shell command that made ``store`` (options at their default are left out)."""
    parts = ["eagle3", "extract", "--model", rec["model"], "--data", *rec["data"], "--out", str(store)]
    for k in KEYS[2:]:
        v = rec.get(k, defaults.get(k))
        if v == defaults.get(k) or v is None or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        if v is True:
            parts.append(flag)
        else:
            parts += [flag, ",".join(map(str, v)) if isinstance(v, list) else str(v)]
    return shlex.join(parts)


def load(store: str | Path) -> dict | None:
    """The recipe recorded in STORE/plan.json; None when the store has none (made through the Python API, or
    before eagle3 recorded it). UsageError when STORE is not a store."""
    store = Path(store)
    if not (store / "manifest.json").exists():
        raise UsageError(
            f"--resume {store}: not a store (no manifest.json); give the folder `eagle3 extract --out` wrote"
        )
    path = store / PLAN
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text()).get("recipe")
    except json.JSONDecodeError as e:
        raise UsageError(
            f"{path} is not valid JSON ({e.msg}, line {e.lineno}); restore it, or rerun your original "
            f"extract command with --out {store}"
        ) from None


def resume(a, defaults: dict) -> None:
    """Fill parsed `extract --resume STORE` arguments in place from the store's recipe. Options that decide what
    is stored may not be given again; runtime ones (RUNTIME) given on the command line win."""
    store = Path(a.resume)
    rec = load(store)
    if rec is None:
        raise UsageError(
            f"--resume {store}: this store did not record the command that made it (made through "
            "the Python API, or by an older eagle3); rerun that command with the same data and options "
            f"and --out {store}"
        )
    if a.out is not None and Path(a.out).resolve() != store.resolve():
        raise UsageError(f"--resume {store} with --out {a.out}: give one of them")
    given = [k for k in KEYS if k not in RUNTIME and getattr(a, k) not in (None, defaults.get(k))]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise UsageError(
            f"--resume {store} continues with the data and options the store recorded; {flags} would "
            f"change what is stored. Use a new --out folder for another setup"
        )
    for k in KEYS:
        if k in RUNTIME and getattr(a, k) not in (None, defaults.get(k)):
            continue
        v = rec.get(k, defaults.get(k))
        setattr(a, k, tuple(v) if k == "layer_ids" and v else v)
    a.out = str(store)
