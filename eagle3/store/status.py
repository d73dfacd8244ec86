"""How far a store is: samples committed against the plan, and the message that refuses training on a partial
store. JSON only (no torch): the CLI's preflight reads it in well under a second."""

from __future__ import annotations

import json
from pathlib import Path

MANIFEST, PLAN = "manifest.json", "plan.json"  # as eagle3/store/format.py and recipe.py name them


def counts(root: str | Path) -> tuple[int, int | None]:
    """(samples committed, samples planned); planned is None for a store without a plan (made through the API
    before plans existed). (0, None) when ``root`` is no store yet."""
    root = Path(root)
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return 0, None
    done = {sid for s in manifest.get("shards", []) for sid in s.get("sample_ids", [])}
    try:
        planned = set(json.loads((root / PLAN).read_text())["sample_ids"])
    except (OSError, ValueError, KeyError, TypeError):
        return len(done), None
    return len(done & planned), len(planned)


def incomplete_message(root: str | Path) -> str | None:
    """Why training on ``root`` is refused (fewer samples than its plan names), or None when it is complete."""
    done, planned = counts(root)
    if planned is None or done >= planned:
        return None
    return (f"{root} holds {done} of the {planned} samples its plan names ({planned - done} missing): its extraction "
            f"stopped or is still running. Complete it with `eagle3 extract --resume {root}`, or train on what is "
            "there with --allow-incomplete")
