"""Golden data for the trainer's inputs (issue 16): every stored state encodes its own (sample, token, layer), so
any shift, swap, interleave, cast or offset error is a wrong number in what the model receives and in what the
loss compares, at every training-time-test step, packed or not.

The alignment asserted is EAGLE-3's as speculators 0.9.0 trains it and vLLM 0.26 serves it:
- speculators/models/eagle3/data.py shift_batch: input_ids[1:], hidden_states[:-1],
  verifier_last_hidden_states[1:], loss_mask[1:], position_ids[1:] -> row i pairs token x[i+1] with the aux
  states of token i, and its target is the distribution after token i+1.
- vllm/v1/spec_decode/llm_base_proposer.py (set_inputs_first_pass): input_ids[:n-1] = target_token_ids[1:],
  hidden_states = target_hidden_states: the same pairing at serving time.
- speculators/models/eagle3/metrics.py align_for_step: at TTT step j, logits[:, :-j] against targets[:, j:]
  with loss_mask[:, j:] -> row i is compared with the target of row i + j (the state of token i + j + 1).
- the aux states are concatenated in ascending layer-id order, the order vLLM hands them to the drafter.
"""

import pytest
import torch

from eagle3.extract import extract
from eagle3.store.folder import Store
from eagle3.store.writer import ShardWriter
from eagle3.train.train import StoreSamples, TrainConfig, micro_batches, model_inputs, train

from .conftest import NARROW_DRAFT

IDS = (2, 4, 5, 8)  # tiny-kimi: aux 2, 4, 5; last 8
H = 128
LENGTHS = [9, 5, 12, 7, 6, 11, 8, 10]


def golden(s: int, t: int, layer: int) -> torch.Tensor:
    """[H] state of (sample s, token t, layer id): coordinates in the first three values, then a pattern that
    makes every state's direction differ (so a norm + lm_head of it is distinct too). Exact in bf16."""
    v = torch.zeros(H)
    v[0], v[1], v[2] = s, t, layer
    k = torch.arange(3, H)
    v[3:] = ((k * (7 * s + 3 * t + layer + 1)) % 17 - 8) / 8
    return v


def token(s: int, t: int) -> int:
    return 5 + (37 * s + 11 * t) % 1000


def mask(s: int, t: int) -> int:
    """Loss mask of token t of sample s: mostly 1, and 1 on the first token of most samples (as windows of
    --long split can start inside an assistant turn), 0 where (s + t) % 4 == 0."""
    return int((s + t) % 4 != 0)


@pytest.fixture(scope="module")
def golden_store(tiny_kimi, tmp_path_factory):
    """8 samples of 5-12 tokens in shards of 3."""

    def make(dtype):
        root = tmp_path_factory.mktemp(f"golden-{dtype}")
        spec = extract.store_spec(tiny_kimi, IDS, dtype)
        store = Store.open(root, spec, create=True, fsync=False)
        writer = ShardWriter(root, spec, 0, shard_samples=3, fsync=False)
        for s, n in enumerate(LENGTHS):
            states = torch.stack([torch.stack([golden(s, t, lid) for t in range(n)]) for lid in IDS])
            writer.add(
                f"s{s}",
                torch.tensor([token(s, t) for t in range(n)]),
                torch.tensor([mask(s, t) for t in range(n)], dtype=torch.uint8),
                states,
            )
        store.commit(writer.flush(), fsync=False)
        return root

    return make


def _coords(row: torch.Tensor) -> tuple[int, int, int]:
    return int(row[0]), int(row[1]), int(row[2])


@pytest.mark.parametrize(
    "store_dtype,train_dtype", [("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16")]
)
@pytest.mark.parametrize("pack_tokens,guard", [(0, 0), (40, 2), (40, 3)])
def test_what_the_model_receives(golden_store, store_dtype, train_dtype, pack_tokens, guard):
    samples = StoreSamples(Store.open(golden_store(store_dtype)))
    order = [5, 0, 3, 7, 1]
    packs = micro_batches(samples, order, pack_tokens)
    assert [len(p) for p in packs] == ([1] * 5 if pack_tokens == 0 else [4, 1])
    seen = []
    for pack in packs:
        x = model_inputs(pack, "cpu", getattr(torch, train_dtype), guard)
        assert x["hidden_states"].dtype == getattr(torch, train_dtype)
        assert x["verifier_last_hidden_states"].dtype == getattr(torch, train_dtype)
        n = x["input_ids"].shape[1]
        assert n == sum(LENGTHS[int(p["sample_id"][1:])] - 1 for p in pack)
        aux = x["hidden_states"][0].float().reshape(n, 3, H)
        last = x["verifier_last_hidden_states"][0].float()
        doc, pos, ids, lm = (x[k][0].tolist() for k in ("document_ids", "position_ids", "input_ids", "loss_mask"))
        d_prev = None
        for r in range(n):
            s, i, _ = _coords(aux[r, 0])
            assert s == int(pack[doc[r]]["sample_id"][1:])
            assert [_coords(aux[r, k]) for k in range(3)] == [(s, i, lid) for lid in IDS[:3]]  # order, same token
            assert _coords(last[r]) == (s, i + 1, IDS[-1])  # the target comes from the next token's last layer
            assert ids[r] == token(s, i + 1) and pos[r] == i + 1
            assert lm[r] == (0 if doc[r] > 0 and i < guard else mask(s, i + 1))
            torch.testing.assert_close(aux[r, 1], golden(s, i, IDS[1]), atol=0, rtol=0)
            if doc[r] != d_prev:
                assert i == 0
                d_prev = doc[r]
            seen.append((s, i))
    assert sorted(seen) == sorted((s, i) for s in order for i in range(LENGTHS[s] - 1))


class Spy:
    """Records what speculators' loss compares at each TTT step (through align_for_step, as it does)."""

    def __init__(self, monkeypatch):
        from speculators.models.eagle3 import core, metrics

        self.calls, self.models, real_metrics = [], [], metrics.compute_metrics
        real_forward = core.Eagle3DraftModel.forward

        def compute_metrics(logits, targets, loss_mask, prev_correct, ttt_step, *a, **kw):
            _, s_targets, s_mask, _ = metrics.align_for_step(logits, targets, loss_mask, prev_correct, ttt_step)
            self.calls[-1]["steps"].append((ttt_step, s_targets.detach().clone(), s_mask.clone()))
            return real_metrics(logits, targets, loss_mask, prev_correct, ttt_step, *a, **kw)

        def forward(model, **kw):
            self.models.append(model)
            self.calls.append({"hidden": kw["hidden_states"].detach().clone(), "steps": []})
            return real_forward(model, **kw)

        monkeypatch.setattr(core, "compute_metrics", compute_metrics)
        monkeypatch.setattr(core.Eagle3DraftModel, "forward", forward)


@pytest.mark.parametrize("ttt_steps", [1, 3, 4])
@pytest.mark.parametrize("pack_tokens", [0, 40])
def test_what_the_loss_compares_at_every_ttt_step(golden_store, tmp_path, monkeypatch, ttt_steps, pack_tokens):
    spy = Spy(monkeypatch)
    train(
        TrainConfig(
            store=str(golden_store("float32")),
            out=str(tmp_path / "t"),
            draft_vocab_size=256,
            batch_samples=8,
            max_steps=1,
            ttt_steps=ttt_steps,
            pack_tokens=pack_tokens,
            lr=1e-3,
        ),
        progress=False,
    )
    model = spy.models[0]
    head = lambda v: model.verifier_lm_head(model.verifier_norm(v))  # noqa: E731 - the targets' function
    compared = expected = 0
    assert len(spy.calls) == 8 if pack_tokens == 0 else 2 <= len(spy.calls) < 8
    for call in spy.calls:
        hidden = call["hidden"][0]
        docs = list(dict.fromkeys(int(v) for v in hidden[:, 0]))  # samples in row order
        for d, s in enumerate(docs):  # targets inside the sample, minus the guarded first ones of later samples
            g = ttt_steps - 1 if d > 0 else 0
            expected += sum(
                mask(s, i + j + 1) for j in range(ttt_steps) for i in range(LENGTHS[s] - 1 - j) if i + j >= g
            )
        assert [j for j, _, _ in call["steps"]] == list(range(ttt_steps))
        for j, s_targets, s_mask in call["steps"]:
            for r in torch.nonzero(s_mask[0]).flatten().tolist():
                s, i, _ = _coords(hidden[r])
                assert i + j + 1 < LENGTHS[s], f"step {j}: row ({s}, {i}) compared with a target past its sample"
                assert mask(s, i + j + 1) == 1, f"step {j}: row ({s}, {i}) compared with a masked target"
                with torch.no_grad():
                    want = head(golden(s, i + j + 1, IDS[-1]))
                torch.testing.assert_close(s_targets[0, r], want, atol=1e-5, rtol=1e-5)
                compared += 1
    # every row whose target exists inside its own sample is compared, at every step (guarded ones excepted)
    assert compared == expected > 0


def test_the_draft_vocabulary_counts_only_loss_masked_targets(golden_store):
    """The draft keeps the most frequent *targets*: a token counts where its loss mask is 1, never where it is 0
    (prompt tokens the draft is never trained to predict)."""
    counts = StoreSamples(Store.open(golden_store("float32"))).token_counts(1024)
    want = torch.zeros(1024, dtype=torch.int64)
    for s, n in enumerate(LENGTHS):
        for t in range(n):
            want[token(s, t)] += mask(s, t)
    assert torch.equal(counts, want)
    assert sum(1 - mask(s, t) for s, n in enumerate(LENGTHS) for t in range(n)) > 0  # masked tokens exist


def test_samples_that_fill_a_pack_exactly_share_it(golden_store):
    """--pack-tokens N packs samples up to N tokens inclusive: 9 + 12 tokens make one pack of 21, not of 20."""
    samples = StoreSamples(Store.open(golden_store("float32")))
    assert [[p["sample_id"] for p in pack] for pack in micro_batches(samples, [0, 2, 1], 21)] == [["s0", "s2"], ["s1"]]
    assert [len(pack) for pack in micro_batches(samples, [0, 2, 1], 20)] == [1, 2]


@pytest.fixture(scope="module")
def even_store(tiny_kimi, tmp_path_factory):
    """8 samples of 10 tokens, every target in the loss, random states: packed or not, each sample's token-mean
    loss weighs the same."""
    root = tmp_path_factory.mktemp("even")
    spec = extract.store_spec(tiny_kimi, IDS, "float32")
    store = Store.open(root, spec, create=True, fsync=False)
    writer = ShardWriter(root, spec, 0, shard_samples=4, fsync=False)
    g = torch.Generator().manual_seed(3)
    for s in range(8):
        writer.add(
            f"s{s}",
            torch.randint(5, 1000, (10,), generator=g),
            torch.ones(10, dtype=torch.uint8),
            torch.randn(len(IDS), 10, H, generator=g),
        )
    store.commit(writer.flush(), fsync=False)
    return root


def test_packing_leaves_the_loss_of_a_batch_as_it_is(even_store, tmp_path):
    """A pack's loss is a mean over its tokens, weighed by its samples. Over samples of one length with every
    target in the loss (one TTT step: no guard), a batch's loss is then the same packed as one sample a forward
    (each sample attends to its own rows only), and so is the step it takes."""

    def run(pack_tokens, out):
        return train(
            TrainConfig(
                store=str(even_store),
                out=str(tmp_path / out),
                draft_vocab_size=256,
                batch_samples=8,
                epochs=2,
                ttt_steps=1,
                pack_tokens=pack_tokens,
                lr=1e-3,
                seed=0,
            ),
            progress=False,
        ).losses

    one, packed = run(0, "one"), run(40, "packed")  # packs of 4 samples: 36 rows each after the shift
    assert packed == pytest.approx(one, rel=1e-4), (one, packed)
    assert one[1] != pytest.approx(one[0], rel=1e-4)  # the second step sees the first one's update


def test_every_epoch_takes_every_sample_once_in_its_own_order(golden_store):
    """Epoch e is a permutation of the store (seed + e): no sample twice or missed in an epoch, and the next epoch
    shuffles again rather than replaying the first one's order."""
    samples = StoreSamples(Store.open(golden_store("float32")), seed=5)
    epochs = [[i for k in range(2) for i in samples.batch(2 * e + k, 2, 4)] for e in range(3)]
    assert all(sorted(order) == list(range(8)) for order in epochs)
    assert len({tuple(order) for order in epochs}) == 3
    assert samples.batch(0, 2, 4) == StoreSamples(Store.open(golden_store("float32")), seed=5).batch(0, 2, 4)


@pytest.mark.parametrize("store_dtype", ["float32", "bfloat16"])
def test_the_trainer_reads_states_at_the_store_s_precision_not_float16(tiny_kimi, tmp_path, store_dtype):
    """Real states pass 65504 (float16's largest: Inf there) and fall below its precision; the golden data above is
    exact in float16. Here every value is exact in the store's dtype and lost in float16: a reader that casts to
    float16 anywhere on the way to the model's inputs changes them."""
    spec = extract.store_spec(tiny_kimi, IDS, store_dtype)
    store = Store.open(tmp_path, spec, create=True, fsync=False)
    writer = ShardWriter(tmp_path, spec, 0, shard_samples=2, fsync=False)
    dtype = getattr(torch, store_dtype)
    extremes = torch.tensor(
        [1e5, -3e5, 2.0**-30, 1e30, 70000.0, -(2.0**-25)]
        if store_dtype == "bfloat16"
        else [1e5, -3e5, 2.0**-30, 1e30, 1 + 2.0**-20, 65519.0]
    )
    assert torch.isinf(extremes.half()).any() and not torch.equal(extremes.half().float(), extremes.to(dtype).float())
    written = {}
    for s in range(2):
        states = torch.randn(len(IDS), 6, H) * 10
        states[:, :, : len(extremes)] = extremes * (s + 1)
        states = states.to(dtype)
        written[f"s{s}"] = states
        writer.add(f"s{s}", torch.arange(6), torch.ones(6, dtype=torch.uint8), states)
    store.commit(writer.flush(), fsync=False)
    samples = StoreSamples(Store.open(tmp_path))
    for i in range(len(samples)):
        x = samples.get(i)
        want = written[x["sample_id"]].float()  # [n_layers, T, H]
        assert torch.equal(x["aux"].float(), want[:-1].permute(1, 0, 2).reshape(6, -1))
        assert torch.equal(x["last"].float(), want[-1])
        inputs = model_inputs([x], "cpu", torch.float32)
        assert torch.equal(inputs["hidden_states"][0], want[:-1].permute(1, 0, 2).reshape(6, -1)[:-1])
        assert torch.equal(inputs["verifier_last_hidden_states"][0], want[-1][1:])


def test_bf16_mixed_precision_keeps_float32_weights_and_follows_the_fp32_curve(small_store, tmp_path, monkeypatch):
    """precision bf16-mixed (the CUDA default): matmuls in bf16 under autocast, weights, gradients and AdamW's state
    in float32. Run here on the CPU's autocast: the curve follows fp32's within bf16's error, differs from it (the
    autocast is on), and the weights the optimizer steps are float32. precision auto on the CPU is fp32, bit for bit."""
    from eagle3.train import train as train_mod

    seen = {}
    real = torch.optim.AdamW

    class Watch(real):
        def step(self, *a, **k):
            seen["dtypes"] = {p.dtype for g in self.param_groups for p in g["params"]}
            seen["state"] = {v.dtype for s in self.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim}
            return super().step(*a, **k)

    monkeypatch.setattr(train_mod.torch.optim, "AdamW", Watch)

    def run(precision, out):
        return train(
            TrainConfig(
                store=str(small_store),
                out=str(tmp_path / out),
                draft_vocab_size=256,
                batch_samples=4,
                max_steps=3,
                lr=3e-3,
                seed=0,
                precision=precision,
                ttt_steps=1,  # the subject is the precision, not the TTT steps
                **NARROW_DRAFT,
            ),
            progress=False,
        ).losses

    fp32, auto, mixed = run("fp32", "a"), run("auto", "b"), run("bf16-mixed", "c")
    assert auto == fp32
    assert mixed == pytest.approx(fp32, rel=0.05) and mixed != fp32
    assert seen["dtypes"] == {torch.float32} and seen["state"] <= {torch.float32}
    assert train_mod.mixed_precision(TrainConfig(store="s", out="o", device="cuda"))  # the CUDA default
    assert not train_mod.mixed_precision(TrainConfig(store="s", out="o", device="cuda", dtype="bfloat16"))
