"""Training as two DDP ranks (2 CPU processes, gloo) follows the 1-process loss curve for the same global batch.

The ranks are `eagle3 train` started as torchrun starts its ranks: the same command line, with RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (what eagle3's trainer reads). They are forked by the
suite's zygote (conftest.start_command, tests/unit/zygote.py), which has imported speculators: two fresh interpreters
under torchrun spent ~15 s of CPU importing it. The multi-GPU (NCCL) version of this runs on a multi-GPU host."""

import json
import socket

import pytest

from eagle3.train.train import TrainConfig, train

from .conftest import NARROW_DRAFT, NARROW_DRAFT_ARGS, start_command


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_ddp_matches_one_process(small_store, tmp_path, one_thread):
    steps, batch = 4, 8
    argv = [
        "train",
        "--store",
        str(small_store),
        "--out",
        str(tmp_path / "two"),
        "--draft-vocab",
        "256",
        "--batch",
        str(batch),
        "--lr",
        "3e-3",
        "--steps",
        str(steps),
        "--ttt-steps",
        "1",
        *NARROW_DRAFT_ARGS,
    ]  # the narrow draft, one TTT step: the subject is the ranks' sums
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    ranks = [start_command(argv, dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(2)]
    one = train(
        TrainConfig(
            store=str(small_store),
            out=str(tmp_path / "one"),
            draft_vocab_size=256,
            batch_samples=batch,
            lr=3e-3,
            max_steps=steps,
            ttt_steps=1,
            **NARROW_DRAFT,
        ),
        progress=False,
    )  # beside the ranks
    single = one.losses
    for r, done in enumerate(rank.wait(300)[0] for rank in ranks):
        assert done.returncode == 0, (r, done.stdout[-2000:] + done.stderr[-4000:])
    ckpt = tmp_path / "two" / "checkpoints" / f"step-{steps:07d}" / "trainer_state.json"
    state = json.loads(ckpt.read_text())
    double = state["losses"]
    assert len(double) == steps
    assert (state["samples_seen"], state["tokens_seen"]) == (one.samples_seen, one.tokens_seen)  # both ranks'
    # all-reduced gradients sum in another order than one process's accumulation: float noise only
    assert double == pytest.approx(single, rel=1e-4), (single, double)


def test_a_world_of_one_initialized_by_someone_else_trains_without_collectives(small_store, tmp_path, monkeypatch):
    """vLLM's engine in this process (train --online --engine-in-process) initializes torch.distributed with a world
    of one (NCCL on a GPU: it has no CPU all_reduce). The trainer is then not data-parallel: it must neither wrap DDP
    nor call a collective, and trains as it does alone."""
    import torch.distributed as dist

    alone = train(
        TrainConfig(
            store=str(small_store),
            out=str(tmp_path / "alone"),
            draft_vocab_size=256,
            batch_samples=4,
            lr=3e-3,
            max_steps=2,
        ),
        progress=False,
    )
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:

        def refuse(*a, **k):
            raise RuntimeError("a collective in a world of one (vLLM's NCCL group has no CPU all_reduce)")

        for name in ("all_reduce", "barrier", "broadcast"):
            monkeypatch.setattr(dist, name, refuse)
        beside = train(
            TrainConfig(
                store=str(small_store),
                out=str(tmp_path / "beside"),
                draft_vocab_size=256,
                batch_samples=4,
                lr=3e-3,
                max_steps=2,
            ),
            progress=False,
        )
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()
    assert beside.losses == alone.losses and beside.tokens_seen == alone.tokens_seen
