"""Rates over a timeline of (time.perf_counter(), tokens) points, one a batch or a commit, each point's tokens done
by its time."""

from __future__ import annotations

from collections.abc import Sequence


def rate_past_first(points: Sequence[tuple[float, int]], less: float = 0.0) -> float | None:
    """Tokens a second of the points after the first, over the seconds from the first to the last less ``less`` (time
    in that span that is not the work's: waits). None where fewer than two points or no time is left."""
    if len(points) < 2:
        return None
    seconds = points[-1][0] - points[0][0] - less
    if points[-1][0] <= points[0][0] or seconds <= 0:
        return None
    return sum(n for _, n in points[1:]) / seconds
