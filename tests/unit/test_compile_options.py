"""`eagle3 train --compile --attn flex`: the configuration that met issue 42's MFU goal on the H200 (compiled flex
attention, 48.8 % at 8k), reachable from the command line; the combinations that cannot train refused at once, before
a model is built; and a compiled run that reaches dynamo's recompile limit says so in its summary."""

import time

import pytest
import torch

from eagle3 import cli
from eagle3.train import chunked_loss
from eagle3.train import train as train_mod
from eagle3.train.train import TrainConfig, train


def _train_args(store, out, *extra):
    return ["train", "--store", str(store), "--out", str(out), "--draft-vocab", "256", "--batch", "4", *extra]


@pytest.mark.parametrize(
    "extra,words",
    [
        (["--attn", "flex"], ["flex attention has no backward on the CPU", "--attn sdpa", "--device cuda"]),
        (["--attn", "flex", "--device", "cuda"], ["runs fused only compiled", "--compile"]),
    ],
)
def test_a_flex_run_that_cannot_train_is_refused_at_once(small_store, tmp_path, capsys, extra, words):
    t0 = time.perf_counter()
    code = cli.main(_train_args(small_store, tmp_path / "run", *extra))
    err = capsys.readouterr().err
    assert code == 2 and time.perf_counter() - t0 < 1.0, err
    assert all(w in err for w in words), err
    assert not (tmp_path / "run").exists()  # nothing written


def test_train_called_from_python_refuses_flex_attention_on_the_cpu_too(small_store, tmp_path):
    from eagle3.preflight import UsageError

    with pytest.raises(UsageError, match="no backward on the CPU"):
        train(TrainConfig(store=str(small_store), out=str(tmp_path / "run"), attn_impl="flex", compile=True))
    assert not (tmp_path / "run").exists()


def test_the_command_line_reaches_compiled_flex_attention(monkeypatch, small_store, tmp_path):
    """--attn flex --compile --device cuda is TrainConfig(attn_impl="flex", compile=True): the
    configuration is what train() receives (this host has no CUDA to run it)."""
    from eagle3 import preflight

    got = {}

    def train_stub(cfg, **kw):
        got["cfg"] = cfg
        raise SystemExit(0)  # what train() was given is the question, not its run

    monkeypatch.setattr(preflight, "cuda_available", lambda command: None)
    monkeypatch.setattr(train_mod, "train", train_stub)
    with pytest.raises(SystemExit):
        cli.main(_train_args(small_store, tmp_path / "run", "--attn", "flex", "--compile", "--device", "cuda"))
    cfg = got["cfg"]
    assert (cfg.attn_impl, cfg.compile, cfg.device) == ("flex", True, "cuda")


def _compiled_loss(monkeypatch):
    """The loss compiled for each sequence length (dynamic=False): a stand-in for speculators' forward, which
    torch.compile wraps only where CUDA is. Under TrainConfig.compile the trainer's stance lets it compile; without, it
    runs eagerly."""
    real = chunked_loss.loss_config

    def loss_config(loss, impl, device="cpu"):
        return {
            k: (torch.compile(fn, backend="eager", dynamic=False), w) for k, (fn, w) in real(loss, impl, device).items()
        }

    monkeypatch.setattr(chunked_loss, "loss_config", loss_config)


@pytest.mark.parametrize("compiled", [True, False])
def test_a_compiled_run_that_reaches_the_recompile_limit_says_so(monkeypatch, small_store, tmp_path, compiled):
    """Samples of different lengths, one a forward, a limit of 1: the second length reaches it. The summary's notes
    name it (what it costs, what to do); an eager run compiles nothing and has no such note."""
    _compiled_loss(monkeypatch)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False):
        result = train(
            TrainConfig(
                store=str(small_store),
                out=str(tmp_path / "run"),
                draft_vocab_size=256,
                batch_samples=4,
                max_steps=2,
                checkpoint_minutes=0,
                compile=compiled,
            ),
            progress=False,
        )
    torch._dynamo.reset()
    limit = [n for n in result.notes if "recompile limit" in n]
    assert bool(limit) == compiled, result.notes
    assert not limit or ("ran eagerly" in limit[0] and "without --compile" in limit[0]), limit
    assert all(f"note       {n}" in result.lines() for n in limit), result.lines()


def test_the_watch_names_a_function_that_reaches_the_recompile_limit():
    """RecompileLimitHits against dynamo's own warning (this torch's wording): a function recompiled for each of 4
    constants past a limit of 2 is named; under the limit, nothing is."""
    from eagle3.train.compile_watch import RecompileLimitHits

    def shift(x, k):
        return x + k

    for limit, named in ((2, True), (8, False)):
        torch._dynamo.reset()
        with (
            RecompileLimitHits() as hits,
            torch._dynamo.config.patch(recompile_limit=limit, automatic_dynamic_shapes=False),
        ):
            f = torch.compile(shift, backend="eager", dynamic=False)
            for k in range(4):
                assert float(f(torch.zeros(1), k)) == k
        assert bool(hits.messages) == named and all("shift" in m for m in hits.messages), hits.messages
        assert bool(hits.notes()) == named


def test_the_watch_reads_either_wording_names_each_function_once_and_leaves_dynamo_s_log_as_it_was():
    """Older torch says cache_size_limit where this one says recompile_limit; a function that hits it again is named
    once; leaving the watch takes its handler off dynamo's logger (the next run starts with no hits)."""
    import logging

    from eagle3.train.compile_watch import DYNAMO, RecompileLimitHits

    log = logging.getLogger(DYNAMO)
    before = list(log.handlers)
    with RecompileLimitHits() as hits:
        for wording in ("recompile_limit", "cache_size_limit", "recompile_limit"):
            log.warning("torch._dynamo hit config.%s (8)\n   function: 'shift' (x.py:3)\n   last reason: k", wording)
        log.warning("an unrelated warning")
    assert hits.messages == ["function: 'shift' (x.py:3)"] * 3
    (note,) = hits.notes()
    assert note.count("function: 'shift'") == 1
    assert log.handlers == before


@pytest.mark.parametrize("attn", ["sdpa", "varlen", "flex"])
def test_each_attention_keeps_its_command_line_name_to_the_trainer_and_only_the_draft_config_renames_it(
    small_store, tmp_path, monkeypatch, attn
):
    """`--attn NAME` is TrainConfig(attn_impl=NAME); transformers' registry name appears only in the draft's
    config (train.attention_implementation); any other name is refused with the choices."""
    from eagle3 import preflight
    from eagle3.preflight import UsageError

    got = {}

    def train_stub(cfg, **kw):
        got["cfg"] = cfg
        raise SystemExit(0)

    monkeypatch.setattr(preflight, "cuda_available", lambda command: None)
    monkeypatch.setattr(train_mod, "train", train_stub)
    with pytest.raises(SystemExit):
        cli.main(_train_args(small_store, tmp_path / "run", "--attn", attn, "--compile", "--device", "cuda"))
    assert got["cfg"].attn_impl == attn
    want = {"sdpa": "sdpa", "varlen": "eagle3_varlen", "flex": "simple_flex_attention"}[attn]
    assert train_mod.attention_implementation(attn) == want
    with pytest.raises(UsageError, match="use one of sdpa, varlen, flex"):
        preflight.train_attention(want if attn != "sdpa" else "dense", True, "cuda")
