"""eval's pure parts: where speculative and plain greedy outputs diverge, and the target's margin there."""

import math

from eagle3.serve.evaluate import divergences


def test_divergence_is_located_with_the_plain_runs_margin():
    base = [[5, 6, 7], [1, 2, 3], [9, 9]]
    spec = [[5, 6, 7], [1, 4, 3], [9, 9, 9]]
    top2 = [[{5: -0.1, 8: -3.0}] * 3, [{1: -0.2, 2: -2.0}, {2: -0.50, 4: -0.51}, {3: -0.1, 0: -5.0}],
            [{9: -0.1, 1: -4.0}] * 2]
    got = divergences(spec, base, top2)
    assert [(d["prompt"], d["position"]) for d in got] == [(1, 1), (2, 2)]
    assert math.isclose(got[0]["margin"], 0.01) and math.isnan(got[1]["margin"])
