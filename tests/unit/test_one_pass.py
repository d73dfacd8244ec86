"""`extract --regenerate` (eagle3/extract/one_pass.py, decode_capture.py): the target writes the last assistant turn
and the states of prompt + turn are stored in the same pass. On CPU: the row collector on golden steps, the vLLM
path against the fake engine (tests/unit/fake_vllm.py: chunked prefill, decode steps, async scheduling's extra row,
vLLM 0.26's request-id suffixes, a prefix cache of whole blocks), the prompts, the hf path and its resume."""

import json

import numpy as np
import pytest
import torch

from eagle3.data import corpus, masks
from eagle3.data.conversations import DataConfig, DataError
from eagle3.extract import extract, one_pass, regenerate
from eagle3.extract.capture import CaptureError, StepLayout
from eagle3.extract.decode_capture import RowCollector, external_id
from eagle3.store.folder import Store
from eagle3.store.format import StoreError

from .test_vllm_backend import IDS, fake  # noqa: F401 - a fixture

L, H = 3, 4


def _state(sample: int, pos: int) -> torch.Tensor:
    """[L, H]: a row that says which sample, position and layer it is."""
    return torch.tensor([[sample * 1000 + pos * 10 + layer + h / 10 for h in range(H)] for layer in range(L)])


def _step(collector, parts):
    """parts: [(request id, sample, first position, rows)]: one forward step, rows in order."""
    rows, starts = [], [0]
    for _, sample, pos, n in parts:
        rows += [_state(sample, p) if sample >= 0 else torch.full((L, H), float("nan")) for p in range(pos, pos + n)]
        starts.append(starts[-1] + n)
    stacked = torch.stack(rows)  # [n_tok, L, H]
    layers = [torch.cat([stacked[:, k], torch.zeros(2, H)]) for k in range(L)]  # padded, as CUDA graphs pad
    collector.on_step(layers, StepLayout([p[0] for p in parts], starts, [p[2] for p in parts], [None] * len(parts)))


def _golden(sample: int, length: int) -> torch.Tensor:
    return torch.stack([_state(sample, p) for p in range(length)])


def test_rows_are_merged_by_position_a_later_step_over_an_earlier_one():
    """Sample 1: prompt of 5 in two chunks, decode rows 5..7, then async scheduling's extra row at 8 (NaN: the last
    token fed back after the request ended) and the tail request's rows 8..8 past a cached block; sample 2 preempted
    and recomputed. Every row lands at its own position; the tail's row wins over the NaN one."""
    c = RowCollector()
    _step(c, [("0-aaaaaaaa", 1, 0, 3), ("1-bbbbbbbb", 2, 0, 2)])
    _step(c, [("0-aaaaaaaa", 1, 3, 2), ("1-bbbbbbbb", 2, 2, 1)])
    _step(c, [("1-bbbbbbbb", 2, 0, 3)])  # preempted: computed again from position 0
    for pos in (5, 6, 7):
        _step(c, [("0-aaaaaaaa", 1, pos, 1), ("1-bbbbbbbb", 2, pos - 2, 1)])
    _step(c, [("0-aaaaaaaa", -1, 8, 1)])
    _step(c, [("2-cccccccc", 1, 8, 1)])  # the tail request: positions 0..7 read from the prefix cache
    got = c.take("s1", ["0", "2"], 9)
    assert got.shape == (9, L, H) and torch.equal(got, _golden(1, 9))
    assert torch.equal(c.take("s2", ["1"], 6), _golden(2, 6))
    assert c.chunks == {} and c.rows == 3 + 2 + 2 + 1 + 3 + 6 + 1 + 1


def test_rows_past_the_sample_are_dropped_and_a_missing_row_is_named():
    c = RowCollector()
    _step(c, [("7-aaaaaaaa", 3, 0, 4)])
    _step(c, [("7-aaaaaaaa", -1, 4, 1)])  # after the end: dropped
    assert torch.equal(c.take("s", ["7"], 4), _golden(3, 4))
    _step(c, [("8-aaaaaaaa", 3, 0, 2), ("9-aaaaaaaa", 3, 3, 1)])
    with pytest.raises(CaptureError, match=r"sample s: no row for 1 of its 4 positions \(first \[2\]\)"):
        c.take("s", ["8", "9"], 4)
    with pytest.raises(CaptureError, match="no rows were computed"):
        c.take("t", ["10"], 2)


def test_a_rank_that_does_not_write_only_counts():
    c = RowCollector(keep=False)
    _step(c, [("0-aaaaaaaa", 1, 0, 3)])
    assert c.rows == 3 and c.steps == 1 and c.chunks == {}


def test_vllm_internal_ids_map_to_the_callers():
    names = {"1", "12"}
    assert external_id("12-abcdef01", names) == "12" and external_id("1-abcdef01", names) == "1"
    assert external_id("12", names) == "12" and external_id("1-abc", names) is None
    assert external_id("3-abcdef01", names) is None


# ------------------------------------------------------------------------------------------ the prompts


CONVS = [
    {
        "messages": [
            {"role": "user", "content": "What is 2 plus 2?"},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And times 3?"},
            {"role": "assistant", "content": "12."},
        ]
    },
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]},
    {
        "messages": [
            {"role": "user", "content": "Count to 3."},
            {"role": "assistant", "content": "1, 2, 3."},
            {"role": "user", "content": "Again."},
            {"role": "assistant", "content": "1, 2, 3.", "weight": 0},
        ]
    },
    {"messages": [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}]},
    {
        "messages": [
            {"role": "user", "content": "What is 2 plus 2?"},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And times 3?"},
            {"role": "assistant", "content": "12."},
        ]
    },
]


def test_the_prompt_is_the_conversation_up_to_its_last_learned_turn(tokenizer, tmp_path):
    """The turn the target writes is the last assistant turn of weight 1 (regenerate --mode last's prompt), or the
    next turn of a prompt-only conversation; a prompt with no room under max_len is rejected with its reason."""
    data = corpus.write_jsonl(tmp_path / "c.jsonl", CONVS)
    gen = one_pass.Generation(max_tokens=64, seed=5)
    prompts, report = one_pass.load_prompts(
        DataConfig([str(data)], max_len=256, rejects_path=str(tmp_path / "r.jsonl")), tokenizer, gen
    )

    def enc(msgs):
        return tuple(tokenizer(masks.chat(tokenizer, msgs, None, gen=True), add_special_tokens=False)["input_ids"])

    m = [c["messages"] for c in CONVS]
    assert [p.sample_id for p in prompts] == [
        "c.jsonl:1~regen",
        "c.jsonl:2~regen",
        "c.jsonl:3~regen",
        "c.jsonl:5~regen",
    ]
    assert prompts[0].ids == enc(m[0][:3]) and prompts[1].ids == enc(m[1]) and prompts[2].ids == enc(m[2][:1])
    assert [p.seed for p in prompts] == [5 * regenerate.SEED_STRIDE + n for n in (1, 2, 3, 5)]
    assert all(p.max_tokens == min(64, 256 - len(p)) for p in prompts)
    assert report.duplicates == 1 and report.rejected == {"too_long": 1}
    assert json.loads((tmp_path / "r.jsonl").read_text())["line"] == 4


def test_the_sample_is_the_prompt_and_the_turn_with_the_loss_on_the_turn():
    p = one_pass.Prompt("x", (1, 2, 3), 0, 4)
    s, how = one_pass.sample_of(p, [7, 8, 9], {9})
    assert (s.input_ids, s.loss_mask, how) == ((1, 2, 3, 7, 8, 9), (0, 0, 0, 1, 1, 1), "stop")
    s, how = one_pass.sample_of(p, [7, 8, 5, 6, 4], {9})
    assert (s.input_ids, s.loss_mask, how) == ((1, 2, 3, 7, 8, 5, 6), (0, 0, 0, 1, 1, 1, 1), "length")


# ------------------------------------------------------------------------------------------ vLLM, one pass


def _regen_cfg(model, data, out, **kw):
    return extract.ExtractConfig(
        model=str(model),
        out=str(out),
        data=DataConfig([str(data)], max_len=160),
        batch_size=kw.pop("batch_size", 3),
        regenerate=kw.pop("gen", one_pass.Generation(max_tokens=12)),
        **kw,
    )


def _stored(out):
    return {s["sample_id"]: s for s in Store.open(out).iter_samples()}


def _reserved_bytes() -> int:
    """This process's address space (VmSize): what a fork must be able to commit under the kernel's overcommit
    heuristic, touched or not."""
    from pathlib import Path

    status = Path("/proc/self/status").read_text()
    return int(status.split("VmSize:")[1].split()[0]) * 1024


@pytest.mark.parametrize("capture,tp", [("direct", 1), ("hooks", 2)])
def test_one_pass_stores_every_row_of_the_final_tokens(
    fake,
    tiny_kimi,
    tmp_path,
    reference_states,
    capture,
    tp,
    monkeypatch,
):
    """With vLLM (the fake): every stored row of every layer id, the last one included, equals a prefill of the
    sample's final tokens; the ids are the prompt and the turn; the loss mask is exactly the turn. One turn ends on
    a stop token (its last row: the tail request's, over async scheduling's NaN row), the others at max_tokens."""
    data = corpus.write_jsonl(tmp_path / "c.jsonl", [c for c in CONVS if len(json.dumps(c)) < 400][:4])
    first = extract.run(
        _regen_cfg(tiny_kimi, data, tmp_path / "a", backend="vllm", capture="direct", selfcheck=0), progress=False
    )
    turns = {sid: s["input_ids"][s["loss_mask"].bool()].tolist() for sid, s in _stored(tmp_path / "a").items()}
    stop = turns["c.jsonl:1~regen"][4]  # a stop token the target draws 5th in line 1's turn
    monkeypatch.setattr(masks, "stop_ids", lambda tok: {stop})
    before = _reserved_bytes()
    s = extract.run(
        _regen_cfg(tiny_kimi, data, tmp_path / "b", backend="vllm", capture=capture, tp=tp, selfcheck=2), progress=False
    )
    # the engine shut down gives its buffers back, as vLLM's ends its workers: the self-check's prefill fills
    # store-mode shard buffers on every rank (3.4 GB reserved a rank here); kept, they added up in one test process
    # until a later test's fork failed with ENOMEM
    assert _reserved_bytes() - before < 2**30, (before, _reserved_bytes())
    got = _stored(tmp_path / "b")
    assert first.samples_written == s.samples_written == len(got) == 4
    for sid, sample in got.items():
        ids = sample["input_ids"].tolist()
        turn = sample["loss_mask"].bool()
        n_prompt = int((~turn).sum())
        assert turn[n_prompt:].all() and not turn[:n_prompt].any()
        want_turn = turns[sid][: turns[sid].index(stop) + 1] if stop in turns[sid] else turns[sid]
        assert ids[n_prompt:] == want_turn, sid
        ref = reference_states(ids)  # a prefill of the final tokens, float32; the tail request's rows come from a
        # forward one token longer, equal in float32 up to rounding: within one bf16 step here
        for layer in IDS:
            torch.testing.assert_close(
                sample["states"][layer].float(),
                ref[layer].bfloat16().float(),
                rtol=2**-7,
                atol=1e-5,
                msg=lambda m, sid=sid, layer=layer: f"{sid} id {layer}: {m}",
            )
    assert got["c.jsonl:1~regen"]["input_ids"].tolist()[-1] == stop
    stopped = sum(stop in t for t in turns.values())  # line 4 repeats line 1: the same greedy turn
    assert f"(length {4 - stopped}, stop {stopped})" in s.generation and s.generation.startswith(
        f"{sum(int(x['loss_mask'].sum()) for x in got.values()):,} tokens generated"
    )


def test_a_first_request_that_reads_the_prefix_cache_loses_rows_and_is_caught(
    fake,
    tiny_kimi,
    tmp_path,
    monkeypatch,
):
    """Prompts sharing their first block, one a batch: were the turn's request to read the cache, the second
    prompt's first rows would never be computed."""
    data = corpus.write_jsonl(
        tmp_path / "c.jsonl",
        [
            {
                "messages": [
                    {"role": "user", "content": f"Shared opening words of the prompt for every line here, then {k}"}
                ]
            }
            for k in range(3)
        ],
    )
    real = one_pass.sampling_params
    monkeypatch.setattr(
        one_pass,
        "sampling_params",
        lambda *a: __import__("dataclasses").replace(real(*a), skip_reading_prefix_cache=False),
    )
    with pytest.raises(StoreError, match="no row for"):
        extract.run(
            _regen_cfg(tiny_kimi, data, tmp_path / "s", backend="vllm", selfcheck=0, batch_size=1), progress=False
        )
    monkeypatch.setattr(one_pass, "sampling_params", real)
    s = extract.run(
        _regen_cfg(tiny_kimi, data, tmp_path / "t", backend="vllm", selfcheck=0, batch_size=1), progress=False
    )
    assert s.samples_written == 3


def test_the_aux_capture_is_refused_for_one_pass(fake, tiny_kimi, tmp_path):
    data = corpus.write_jsonl(tmp_path / "c.jsonl", CONVS[:1])
    with pytest.raises(StoreError, match="needs the direct or hooks capture"):
        extract.run(
            _regen_cfg(tiny_kimi, data, tmp_path / "s", backend="vllm", capture="aux", selfcheck=0), progress=False
        )


def test_the_turn_is_drawn_with_the_lines_seed(fake, tiny_kimi, tmp_path):
    data = corpus.write_jsonl(tmp_path / "c.jsonl", CONVS[:2])
    turns = []
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        extract.run(
            _regen_cfg(
                tiny_kimi,
                data,
                tmp_path / name,
                backend="vllm",
                selfcheck=0,
                gen=one_pass.Generation(temperature=1.0, max_tokens=12, seed=seed),
            ),
            progress=False,
        )
        turns.append({k: v["input_ids"].tolist() for k, v in _stored(tmp_path / name).items()})
    assert turns[0] == turns[1] and turns[0] != turns[2]


# ------------------------------------------------------------------------------------------ hf, and resume


def test_hf_one_pass_resumes_after_a_crash_as_an_uninterrupted_run(tiny_kimi, small_data, tmp_path):
    """hf (the CPU reference): a run that dies after its first batch is committed, rerun, stores what an
    uninterrupted run stores, each sample once, its states those of a capture of its final tokens."""
    from eagle3.extract.hf_backend import HFBackend

    def cfg(out, fault=None):
        return extract.ExtractConfig(
            model=str(tiny_kimi),
            out=str(out),
            batch_size=2,
            selfcheck=0,
            writer_threads=0,
            data=DataConfig([str(small_data)], max_len=512, max_samples=5),
            regenerate=one_pass.Generation(max_tokens=6),
            fault=fault,
        )

    whole = extract.run(cfg(tmp_path / "whole"), progress=False)
    calls = []

    def die(point):
        calls.append(point)
        if point == "after_batch" and calls.count(point) == 2:
            raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        extract.run(cfg(tmp_path / "cut", die), progress=False)
    assert 0 < len(_stored(tmp_path / "cut")) < 5
    again = extract.run(cfg(tmp_path / "cut"), progress=False)
    a, b = _stored(tmp_path / "whole"), _stored(tmp_path / "cut")
    assert whole.samples_written == 5 and again.samples_done_before + again.samples_written == 5
    assert sorted(a) == sorted(b) and len(a) == 5
    backend = HFBackend(tiny_kimi, Store.open(tmp_path / "whole").spec.layer_ids)
    for sid in a:
        assert torch.equal(a[sid]["input_ids"], b[sid]["input_ids"]) and a[sid]["loss_mask"].any()
        (ref,) = backend.capture([one_pass.Prompt(sid, tuple(a[sid]["input_ids"].tolist()), 0, 0).as_sample()])
        for k, layer in enumerate(Store.open(tmp_path / "whole").spec.layer_ids):
            assert torch.equal(a[sid]["states"][layer], ref[k]) and torch.equal(b[sid]["states"][layer], ref[k])


def test_a_store_of_the_datas_turns_is_not_continued_with_regenerated_ones(tiny_kimi, small_data, tmp_path):
    data = DataConfig([str(small_data)], max_len=512, max_samples=2)
    extract.run(
        extract.ExtractConfig(model=str(tiny_kimi), out=str(tmp_path / "s"), data=data, selfcheck=0), progress=False
    )
    with pytest.raises(StoreError, match="planned for a different sample list"):
        extract.run(
            extract.ExtractConfig(
                model=str(tiny_kimi),
                out=str(tmp_path / "s"),
                selfcheck=0,
                data=DataConfig([str(small_data)], max_len=512, max_samples=2),
                regenerate=one_pass.Generation(max_tokens=4),
            ),
            progress=False,
        )


def test_the_self_check_computes_every_row_on_an_engine_whose_cache_holds_its_prompts(fake, tiny_kimi, tmp_path):
    """The one-pass engine caches prefixes; the self-check's prefill (the regular capture) must not read them. Here
    one engine serves two runs: the second's self-check prompts are in the cache the first left."""
    data = corpus.write_jsonl(tmp_path / "c.jsonl", CONVS[:2])
    cfg = _regen_cfg(tiny_kimi, data, tmp_path / "a", backend="vllm", selfcheck=0)
    backend = extract.make_backend(cfg, extract.store_spec(cfg.model, cfg.layer_ids, cfg.dtype))
    try:
        extract.run(cfg, backend=backend, progress=False)
        s = extract.run(
            _regen_cfg(tiny_kimi, data, tmp_path / "b", backend="vllm", selfcheck=2), backend=backend, progress=False
        )
    finally:
        backend.close()
    assert "self-check PASS" in s.selfcheck and s.samples_written == 2


def test_the_command_line_regenerates_records_its_settings_and_resumes(tiny_kimi, small_data, tmp_path, capsys):
    """`eagle3 extract --regenerate` (hf): the generated line, the settings in the store's recipe, `--resume` with
    them; --capture aux with the vllm backend refused before any model loads."""
    from eagle3 import cli
    from eagle3.store import recipe

    out = tmp_path / "s"
    args = [
        "extract",
        "--model",
        str(tiny_kimi),
        "--data",
        str(small_data),
        "--out",
        str(out),
        "--regenerate",
        "--max-tokens",
        "5",
        "--temperature",
        "0.7",
        "--seed",
        "3",
        "--max-samples",
        "2",
        "--batch-size",
        "1",
        "--no-selfcheck",
        "--max-len",
        "512",
    ]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert "generated  " in printed and "tokens generated" in printed
    data_line = next(x for x in printed.splitlines() if x.startswith("data "))
    assert "-> 2 prompts, " in data_line and "assistant" not in data_line, data_line  # the target writes the turns
    rec = recipe.load(out)
    assert (rec["regenerate"], rec["temperature"], rec["max_tokens"], rec["seed"]) == (True, 0.7, 5, 3)
    assert all(
        s["sample_id"].endswith("~regen") and 0 < int(s["loss_mask"].sum()) <= 5 for s in Store.open(out).iter_samples()
    )
    assert cli.main(["extract", "--resume", str(out)]) == 0
    assert "0 written now, 2 already there" in capsys.readouterr().out
    assert (
        cli.main(
            [
                "extract",
                "--model",
                str(tiny_kimi),
                "--data",
                str(small_data),
                "--out",
                str(tmp_path / "x"),
                "--regenerate",
                "--backend",
                "vllm",
                "--capture",
                "aux",
            ]
        )
        == 2
    )
    assert "--capture direct or hooks" in capsys.readouterr().err and not (tmp_path / "x").exists()


@pytest.mark.parametrize("room", [-1, 0, 1, 2])
def test_a_prompt_at_the_edge_of_max_len_gets_the_room_left_or_is_rejected(tokenizer, tmp_path, room):
    """max_len = the prompt's tokens + room: one token of room or more, the turn may run to exactly that room (the
    sample then reaches max_len); none, the prompt is rejected (too_long), never asked for 0 or fewer tokens."""
    conv = {"messages": [{"role": "user", "content": "Say something long."}, {"role": "assistant", "content": "x"}]}
    data = corpus.write_jsonl(tmp_path / "c.jsonl", [conv])
    n = len(
        tokenizer(masks.chat(tokenizer, conv["messages"][:1], None, gen=True), add_special_tokens=False)["input_ids"]
    )
    cfg = DataConfig([str(data)], max_len=n + room, rejects_path=str(tmp_path / "r.jsonl"))
    if room >= 1:
        prompts, report = one_pass.load_prompts(cfg, tokenizer, one_pass.Generation(max_tokens=64))
        assert [len(p) for p in prompts] == [n] and prompts[0].max_tokens == room and report.rejected == {}
    else:
        with pytest.raises(DataError, match=r"no usable prompts .*rejected: too_long: 1"):
            one_pass.load_prompts(cfg, tokenizer, one_pass.Generation(max_tokens=64))
        assert "no room under max_len" in json.loads((tmp_path / "r.jsonl").read_text())["error"]


def test_the_engine_s_row_count_is_checked_batch_by_batch():
    """The ranks report rows counted since the session opened; each batch is judged on its own rows (the count's
    growth), so a later batch that skipped rows is caught even after an earlier one computed extra, and each batch's
    rows computed twice are its own. Two ranks, three batches; the third skips a row."""
    from types import SimpleNamespace

    from eagle3.extract.one_pass import Generation, Prompt, VLLMOnePass

    eos, calls, counted = 9, iter(range(10**6)), [0]
    extra = [3, 1, -1]  # rows past (or short of) each batch's own: the tails' recomputed rows, then one missing

    class LLM:
        def generate(self, prompts, params, use_tqdm=False):
            return [
                SimpleNamespace(request_id=f"r{next(calls)}", outputs=[SimpleNamespace(token_ids=[4, 5, eos])])
                for _ in prompts
            ]

    def call(method, args=None, keys=None):
        if method != "eagle3_regen_write":
            return [{"rank": r, "owner": r == 0} for r in (0, 1)]
        counted[0] += sum(len(np.frombuffer(ids, dtype=np.int32)) for _, _, ids, _ in args) + extra.pop(0)
        return [
            {"rank": r, "owner": r == 0, "steps": 7, "rows": counted[0], "shards": [], "errors": []} for r in (0, 1)
        ]

    backend = SimpleNamespace(vllm=SimpleNamespace(SamplingParams=lambda **kw: kw), llm=LLM(), call=call)
    from eagle3.store.format import StoreSpec

    spec = StoreSpec(target={"name_or_path": "t"}, layer_ids=(1, 2), hidden_size=4, dtype="bfloat16")
    store = SimpleNamespace(root="s", spec=spec, next_shard_index=0)
    session = VLLMOnePass(
        backend, store, SimpleNamespace(shard_tokens=None, fsync=False, writer_threads=0), Generation(), {eos}
    )
    batch = [Prompt(f"a:{i}", (1, 2), 0, 8) for i in range(4)]  # 4 samples of 5 tokens
    assert session.submit(batch).recomputed == 3
    assert session.submit(batch).recomputed == 1
    with pytest.raises(StoreError, match="the engine computed 19 rows for samples of 20 tokens"):
        session.submit(batch)
