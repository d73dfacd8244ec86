"""How far a store is: samples committed against the plan, and the message that refuses training on a partial
store. JSON only (no torch): the CLI's preflight reads it in well under a second."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3.store.recipe import PLAN

MANIFEST = "manifest.json"  # as eagle3/store/format.py names it (format.py imports torch)


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


def stored(root: str | Path, counted: tuple[int, int | None] | None = None) -> str:
    """'N of M samples' (M '?' without a plan): what the resume and interrupt lines say of a store."""
    done, planned = counted or counts(root)
    return f"{done} of {planned if planned is not None else '?'} samples"


def incomplete_message(root: str | Path, counted: tuple[int, int | None] | None = None) -> str | None:
    """Why training on ``root`` is refused (fewer samples than its plan names), or None when it is complete.
    ``counted``: ``counts(root)`` when the caller has it already."""
    done, planned = counted or counts(root)
    if planned is None or done >= planned:
        return None
    return (
        f"{root} holds {done} of the {planned} samples its plan names ({planned - done} missing): its extraction "
        f"stopped or is still running. Complete it with `eagle3 extract --resume {root}`, or train on what is "
        "there with --allow-incomplete"
    )
