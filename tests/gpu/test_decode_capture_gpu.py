"""The decode-step capture's copies to the host on CUDA (eagle3/extract/decode_capture.py): each step's rows are copied
on a side stream into pinned memory, and `take` must wait for every chunk's copy before it reads it. Here the copies
are held behind a long queue of work on the compute stream, and `take` runs at once: a read that does not wait sees
the pinned buffers before the rows arrive. CPU tests cannot see this (the CPU path clones). Seconds."""

import pytest
import torch

from eagle3.extract.capture import StepLayout
from eagle3.extract.decode_capture import RowCollector

pytestmark = pytest.mark.gpu


def test_take_reads_every_chunk_only_after_its_copy_to_the_host_has_finished():
    layers, hidden, steps, rows = 4, 7168, 6, 512  # Kimi's width; six steps of 512 rows (~176 MiB of bf16 each)
    busy = torch.randn(8192, 8192, device="cuda")
    collector = RowCollector()
    for s in range(steps):
        for _ in range(20):  # ~0.1-0.2 s of matmuls queued before the step's rows exist
            busy = torch.tanh(busy @ busy * 1e-4)
        marks = busy[0, 0] * 0  # 0, computed after the queue: the rows depend on it
        step = [
            torch.full((rows, hidden), float(s * 10 + k), device="cuda", dtype=torch.bfloat16) + marks
            for k in range(layers)
        ]
        collector.on_step(step, StepLayout(["r-abcdefgh"], [0, rows], [s * rows], [None]))
    got = collector.take("sample", ["r"], steps * rows)  # at once: the copies are still queued behind the matmuls
    want = torch.tensor([[float(s * 10 + k) for k in range(layers)] for s in range(steps)]).to(torch.bfloat16)
    assert torch.equal(got[:, :, 0].reshape(steps, rows, layers)[:, 0], want)
    assert torch.equal(got, want.repeat_interleave(rows, dim=0)[:, :, None].expand(-1, -1, hidden))
