"""kill -9 during extraction at seeded-random points; a rerun of the same command must produce the
same store as an uninterrupted run: every sample exactly once, same ids, tokens and states."""

import os
import random

import pytest
import torch

from eagle3 import faults
from eagle3.data.conversations import DataConfig
from eagle3.extract import extract
from eagle3.extract.hf_backend import HFBackend
from eagle3.store import verify
from eagle3.store.folder import Store

from .conftest import RecordedStates, run_forked

POINTS = ["after_batch", "mid_write", "before_rename", "before_manifest", "after_commit"]
N_KILLS = 24


@pytest.fixture(scope="module")
def setup(tiny_kimi, small_data, tmp_path_factory):
    torch.set_num_threads(1)  # same reduction order in parent and forked children
    # each sample's states captured once, by the reference run: the forked runs start with them
    backend = RecordedStates(HFBackend(tiny_kimi, (2, 4, 5, 8), out_dtype="bfloat16"))
    root = tmp_path_factory.mktemp("faults")

    def cfg(out, fault=None):
        return extract.ExtractConfig(
            model=str(tiny_kimi),
            out=str(out),
            batch_size=4,
            shard_samples=3,
            writer_threads=0,
            fault=fault,
            selfcheck=0,  # storage only here
            data=DataConfig([str(small_data)], max_len=96, max_samples=12),
        )

    counts = {}

    def count(point):
        counts[point] = counts.get(point, 0) + 1

    extract.run(cfg(root / "reference", fault=count), backend=backend, progress=False)
    yield cfg, backend, root, counts
    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


def _contents(path):
    return [
        (
            s["sample_id"],
            s["input_ids"].tolist(),
            s["loss_mask"].tolist(),
            {k: v.clone() for k, v in s["states"].items()},
        )
        for s in Store.open(path).iter_samples()
    ]


def test_kill_points_cover_every_stage(setup):
    _, _, _, counts = setup
    assert set(POINTS) <= set(counts), counts


def _plan(counts) -> list[list[tuple[str, int]]]:
    """N_KILLS runs, each its kill points, every fourth run killed twice (a seeded draw: the same in every part)."""
    rng = random.Random(1234)
    plan = [(p, rng.randint(1, counts[p])) for p in (POINTS * 5)[:N_KILLS]]
    return [[(point, k)] + ([(rng.choice(POINTS), 1)] if n % 4 == 0 else []) for n, (point, k) in enumerate(plan)]


PARTS = 4  # the runs in four tests, which the suite's workers share


@pytest.mark.parametrize("part", range(PARTS))
def test_killed_extractions_resume_to_the_uninterrupted_result(setup, part):
    cfg, backend, root, counts = setup
    reference = _contents(root / "reference")
    runs = list(enumerate(_plan(counts)))[part::PARTS]
    survived = 0
    for n, kills in runs:
        out = root / f"killed-{n}"
        point, k = kills[0]
        for p, kk in kills:
            killed, code = run_forked(
                lambda out=out, p=p, kk=kk: extract.run(cfg(out, faults.killer(p, kk)), backend=backend, progress=False)
            )
            assert killed or code == 0, (p, kk, code)
        extract.run(cfg(out), backend=backend, progress=False)
        got = _contents(out)
        assert [g[0] for g in got] == [r[0] for r in reference], (point, k)
        for g, r in zip(got, reference):
            assert g[1] == r[1] and g[2] == r[2]
            for layer in r[3]:
                assert torch.equal(g[3][layer], r[3][layer]), (point, k, g[0], layer)
        assert verify.verify(out).ok
        survived += 1
    assert survived == len(runs) == N_KILLS // PARTS
