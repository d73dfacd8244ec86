"""pack_inputs: a step's samples packed into one sequence on the host, as the trainer's reader thread does.

On CUDA the pack goes to pinned memory for the copy to the GPU. Its states are ~57 KB a Kimi-shaped token, so each copy
of them is most of the reading's cost: concatenating into fresh memory and then pinning that copied them twice, the
first time into pages the kernel had to fault in (on 2 cores, 35,000 tok/s for the concatenation, against ~137,000
into memory already mapped). Here: the values against the plain concatenation, and the states copied once."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from eagle3.train import train as train_mod
from eagle3.train.train import pack_inputs

H, N_AUX = 8, 3


def _sample(s: int, n: int, dtype: torch.dtype) -> dict:
    """Sample s of n tokens: states that encode (sample, token, layer), as the store's reader returns them."""
    t = torch.arange(n, dtype=torch.float32)
    hs = torch.stack([s * 1000 + t * 10 + k for k in range(N_AUX + 1)], 1)[:, :, None].expand(n, N_AUX + 1, H)
    hs = (hs + torch.arange(H) / 8).to(dtype)  # [T, layers, H]
    return {
        "sample_id": f"s{s}",
        "input_ids": 7 + s * 100 + torch.arange(n),
        "loss_mask": (torch.arange(n) + s) % 3 > 0,
        "aux": hs[:, :-1].reshape(n, -1),
        "last": hs[:, -1],
    }


def _reference(xs: list[dict], guard: int) -> dict:
    """The packing written out as concatenations: the pairing speculators expects (input_ids[1:], aux[:-1], last[1:],
    loss_mask[1:], positions 1..T-1), a document id a sample, the first ``guard`` targets of every later sample
    masked."""

    def cat(f):
        return torch.cat([f(d, x) for d, x in enumerate(xs)])[None]

    def mask(d, x):
        m = x["loss_mask"][1:].clone()
        m[: guard if d else 0] = False
        return m

    n = [x["input_ids"].shape[0] - 1 for x in xs]
    return {
        "input_ids": cat(lambda d, x: x["input_ids"][1:]),
        "hidden_states": cat(lambda d, x: x["aux"][:-1]),
        "verifier_last_hidden_states": cat(lambda d, x: x["last"][1:]),
        "loss_mask": cat(mask),
        "position_ids": cat(lambda d, x: torch.arange(1, n[d] + 1)),
        "document_ids": cat(lambda d, x: torch.full((n[d],), d, dtype=torch.long)),
    }


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    guard=st.integers(0, 4),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
)
def test_a_pack_holds_what_the_concatenation_holds(lengths, guard, dtype):
    """Every key, dtype and value: samples of 1 token (nothing to pair) and guards longer than a sample included."""
    xs = [_sample(s, n, dtype) for s, n in enumerate(lengths)]
    got, want = pack_inputs(xs, guard), _reference(xs, guard)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


class _BytesWritten(TorchDispatchMode):
    """Bytes that ops other than views and allocations write into floating tensors (the states)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        skip = func.is_view or func.overloadpacket in (torch.ops.aten.empty, torch.ops.aten.empty_strided)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not skip and isinstance(t, torch.Tensor) and t.is_floating_point():
                self.bytes += t.numel() * t.element_size()
        return out


@pytest.mark.parametrize("pin", [False, True])
def test_a_pack_copies_each_state_once_pinned_or_not(monkeypatch, pin):
    """Where the trainer pins (CUDA), the states go straight into pinned memory: one copy of them, as unpinned. This
    CPU build of torch has no pinned memory, so pinned requests are recorded and served unpinned, and Tensor.pin_memory
    (the copy a pinning after the concatenation makes) is a clone."""
    asked = []

    def host_empty(shape, dtype, pin):
        asked.append(pin)
        return torch.empty(shape, dtype=dtype)

    monkeypatch.setattr(train_mod, "host_empty", host_empty)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **kw: self.clone())
    xs = [_sample(s, 64, torch.bfloat16) for s in range(4)]
    states = sum((x["aux"].shape[0] - 1) * (x["aux"].shape[1] + x["last"].shape[1]) * 2 for x in xs)
    with _BytesWritten() as counted:
        got = pack_inputs(xs, 2, pin=pin)
    assert asked and set(asked) == {pin}  # every tensor of the pack allocated as asked
    assert counted.bytes == states, (counted.bytes, states)
    assert torch.equal(got["hidden_states"], _reference(xs, 2)["hidden_states"])
