"""The learnable DeepseekV3 target (`eagle3 make-target --arch deepseek`) and Kimi-K2.5's own config.json.

Kimi-K2.5 is not DeepseekV3ForCausalLM: its config.json names KimiK25ForConditionalGeneration, with the
DeepseekV3 language model in ``text_config``, a ``vision_config``, and its routed experts as INT4
(compressed-tensors, a ``quantization_config``). Every reader of a target's config must take it as it is."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from eagle3 import cli
from eagle3.targets import learnable, presets


@pytest.fixture(scope="module")
def deepseek_target(tmp_path_factory):
    out = tmp_path_factory.mktemp("learnable-deepseek")
    info = learnable.make_target(
        out, steps=6, batch=2, seq_len=64, n_conversations=40, device="cpu", arch="deepseek", lr=3e-3
    )
    return out, info


def test_the_deepseek_target_is_kimi_s_architecture_at_a_trainable_size(deepseek_target):
    out, info = deepseek_target
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["model_type"] == "deepseek_v3"
    # MLA in Kimi's latent layout (what vLLM's MLA backends are built for), MoE top-2 of 8 + a shared expert, the
    # first layer dense
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]) == (
        512,
        64,
        128,
        128,
    )
    assert cfg["q_lora_rank"] and cfg["n_routed_experts"] == 8 and cfg["num_experts_per_tok"] == 2
    assert cfg["n_shared_experts"] == 1 and cfg["first_k_dense_replace"] == 1
    assert info["arch"] == "deepseek" and info["steps"] == 6
    assert math.isfinite(info["first_loss"]) and math.isfinite(info["final_loss"])
    assert info["final_loss"] < info["first_loss"]  # 6 steps at lr 3e-3 from ln(1024) = 6.93


def test_the_deepseek_target_extracts_and_a_draft_trains_on_it(deepseek_target, small_data, tmp_path, capsys):
    """The chain on the trained DeepseekV3 target (hf backend): the default ids, the final-state self-check on its
    MLA/MoE layers, a verified store, a draft exported as vLLM reads it."""
    from eagle3.store import verify
    from eagle3.train import vllm_reads

    out, _ = deepseek_target
    store = tmp_path / "store"
    assert (
        cli.main(
            [
                "extract",
                "--model",
                str(out),
                "--data",
                str(small_data),
                "--out",
                str(store),
                "--max-samples",
                "8",
                "--max-len",
                "64",
            ]
        )
        == 0
    )
    said = capsys.readouterr().out
    assert "final-state self-check PASS" in said, said
    assert verify.verify(store).ok
    assert (
        cli.main(
            [
                "train",
                "--store",
                str(store),
                "--out",
                str(tmp_path / "t"),
                "--steps",
                "1",
                "--batch",
                "4",
                "--draft-vocab",
                "128",
            ]
        )
        == 0
    )
    got = vllm_reads.reads(tmp_path / "t" / "draft")
    assert got["aux_layer_ids"] == [2, 4, 5] and got["num_aux_hidden_states"] == 3 and got["target_hidden_size"] == 256
    assert vllm_reads.problems(tmp_path / "t" / "draft") == []


def test_make_target_takes_the_arch_and_refuses_another():
    p = cli.build_parser()
    assert p.parse_args(["make-target", "--out", "x", "--arch", "deepseek"]).arch == "deepseek"
    assert p.parse_args(["make-target", "--out", "x"]).arch == "llama"
    with pytest.raises(SystemExit):
        p.parse_args(["make-target", "--out", "x", "--arch", "mamba"])
    with pytest.raises(ValueError, match="use llama or deepseek"):
        learnable.make_target("unused", arch="mamba")


# Kimi-K2.5's published config.json, as vLLM 0.26's KimiK25Config reads it (the text model's shapes as in
# eagle3.targets.presets.KIMI_K25_TEXT), with its INT4 experts' quantization_config at the top or in text_config.
QUANT = presets.KIMI_K25_QUANT


def kimi_k25_config(quant_in_text: bool) -> dict:
    text = dict(presets.KIMI_K25_TEXT)
    cfg = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": {
            "model_type": "kimi_k25_vision",
            "hidden_size": 1152,
            "num_hidden_layers": 27,
            "patch_size": 14,
        },
        "media_placeholder_token_id": 163605,
        "torch_dtype": "bfloat16",
    }
    if quant_in_text:
        text["quantization_config"] = QUANT
    else:
        cfg["quantization_config"] = QUANT
    return cfg


@pytest.mark.parametrize("quant_in_text", [False, True])
def test_every_config_reader_takes_kimi_k25_s_config_as_it_is(tmp_path, small_data, capsys, quant_in_text):
    from eagle3.extract import extract
    from eagle3.train.draft import DraftShape, check_servable

    folder = tmp_path / "Kimi-K2.5"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(kimi_k25_config(quant_in_text)))
    (folder / "tokenizer_config.json").write_text("{}")
    prof = presets.profile_from_config(json.loads((folder / "config.json").read_text()))
    assert (prof.architecture, prof.hidden_size, prof.num_hidden_layers, prof.vocab_size) == (
        "KimiK25ForConditionalGeneration",
        7168,
        61,
        163840,
    )
    assert prof.layer_ids == (2, 30, 58, 61)
    spec = extract.store_spec(folder, None, "bfloat16")
    assert spec.layer_ids == (2, 30, 58, 61) and spec.hidden_size == 7168 and spec.bytes_per_token == 57344
    assert spec.target["architecture"] == "KimiK25ForConditionalGeneration" and spec.target["vocab_size"] == 163840
    shape = DraftShape.for_target(json.loads((folder / "config.json").read_text()))
    assert (
        shape.hidden_size,
        shape.num_attention_heads,
        shape.num_key_value_heads,
        shape.head_dim,
        shape.intermediate_size,
    ) == (7168, 64, 8, 128, 18432)
    check_servable(shape, (8,))
    # the identity a store records is the text model's: the wrapper's vision tower and bookkeeping do not enter it
    plain = {"architectures": ["DeepseekV3ForCausalLM"], **kimi_k25_config(True)["text_config"]}
    assert presets.config_hash(kimi_k25_config(True)) == presets.config_hash({"text_config": plain})
    # the command line reads it too: --layer-ids checked against its 61 layers, before anything is made
    code = cli.main(
        [
            "extract",
            "--model",
            str(folder),
            "--data",
            str(small_data),
            "--out",
            str(tmp_path / "s"),
            "--backend",
            "vllm",
            "--layer-ids",
            "2,30,58,62",
        ]
    )
    assert code == 2 and "a target with 61 layers has ids 0..61" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_held_out_prompts_are_kimi_traffic_for_deepseek_and_unchanged_for_llama(deepseek_target, tokenizer):
    """The deepseek target's held-out prompts come in three traffic types, each ending at Kimi's generation prompt
    (a tool conversation alternately before its call and after the tool's reply); the llama target's are its
    dialogues up to the last assistant turn, as before."""
    from transformers import AutoTokenizer

    from eagle3.data import corpus

    out, _ = deepseek_target
    tok = AutoTokenizer.from_pretrained(out)
    rows = learnable.eval_prompts(tok, 12, arch="deepseek")
    assert [t for t, _ in rows] == ["chat", "thinking", "tool"] * 4
    gen = tok.encode("<|im_assistant|>assistant<|im_middle|>", add_special_tokens=False)
    assert all(ids[-len(gen) :] == gen for _, ids in rows)
    tool_turns = [tok.decode(ids).count("## Return of") for t, ids in rows if t == "tool"]
    assert tool_turns == [0, 1, 0, 1]
    old = []
    for c in corpus.generate(5, seed=learnable.HELD_OUT_SEED):
        last = max(i for i, m in enumerate(c["messages"]) if m["role"] == "assistant")
        old.append(
            tokenizer(
                tokenizer.apply_chat_template(c["messages"][:last], tokenize=False, add_generation_prompt=True),
                add_special_tokens=False,
            )["input_ids"]
        )
    assert [ids for _, ids in learnable.eval_prompts(tokenizer, 5)] == old


def test_the_deepseek_target_trains_at_every_position_its_traffic_reaches(deepseek_target):
    """A target trained on shorter windows than its conversations never learns the positions their answers are at
    (the 103a15f run: tool prompts of ~420-490 tokens on a target of 256-token windows accepted 1.60 against chat's
    3.57). The deepseek target's windows hold the longest conversation of its traffic whole, and make_target uses
    them."""
    from transformers import AutoTokenizer

    from eagle3.data import kimi_traffic

    out, info = deepseek_target
    tok = AutoTokenizer.from_pretrained(out)
    longest = max(
        len(
            tok(tok.apply_chat_template(c["messages"], tools=c.get("tools"), tokenize=False), add_special_tokens=False)[
                "input_ids"
            ]
        )
        for c in kimi_traffic.generate(300, seed=4)
    )
    assert longest <= learnable.LEARNABLE_DEEPSEEK.seq_len, longest
    assert learnable.LEARNABLE.seq_len == 256  # the Llama's dialogues are short: unchanged
    assert info["seq_len"] == 64  # the fixture's own, given
    assert learnable.windows("deepseek") == (4608, 3) and learnable.windows("llama") == (256, 64)  # make_target's


def test_long_context_prompts_put_earlier_conversations_before_the_held_out_prompt(deepseek_target):
    """Issue 41's prompts with 4k tokens of context: each held-out prompt after other held-out conversations as the
    target's training stream runs them together (rendered whole, the first cut from the left as a training window may
    start mid-conversation), ``context_tokens`` in all; the prompt itself unchanged at the end, the contexts differing
    between prompts, the prompt and a 64-token answer inside the target's training windows (it learned those
    positions) and its max_position_embeddings."""
    from transformers import AutoTokenizer

    out, _ = deepseek_target
    tok = AutoTokenizer.from_pretrained(out)
    short = learnable.eval_prompts(tok, 6, arch="deepseek")
    long = learnable.eval_prompts(tok, 6, arch="deepseek", context_tokens=learnable.LONG_CONTEXT)
    assert [t for t, _ in long] == [t for t, _ in short]
    contexts = []
    for (_, s_ids), (_, l_ids) in zip(short, long):
        assert l_ids[-len(s_ids) :] == s_ids
        context = l_ids[: -len(s_ids)]
        assert len(l_ids) == learnable.LONG_CONTEXT == 4096 and len(context) > 3000
        assert (
            len(l_ids) + 64
            <= learnable.LEARNABLE_DEEPSEEK.seq_len
            <= learnable.LEARNABLE_DEEPSEEK.hf_config["max_position_embeddings"]
        )
        contexts.append(context)
    assert len({tuple(c[:64]) for c in contexts}) == len(contexts)
    whole = tok.decode(long[0][1])
    assert whole.count("<|im_end|>") > 10  # conversations, not one cut
    assert learnable.eval_prompts(tok, 6, arch="deepseek", context_tokens=0) == short
    from eagle3.serve import evaluate

    cfg = evaluate.EvalConfig(target=str(out), draft=str(out), num_prompts=6, context_tokens=learnable.LONG_CONTEXT)
    prompts, groups = evaluate.load_prompts(cfg, tok)
    assert prompts == [ids for _, ids in long] and groups == {"chat": [0, 3], "thinking": [1, 4], "tool": [2, 5]}
    assert cfg.max_model_len >= learnable.LONG_CONTEXT + cfg.max_tokens  # the engine takes them


def test_long_prompts_are_served_by_the_short_prompts_engine_and_counted_apart(deepseek_target, monkeypatch):
    """Issue 41's long-context figures without an engine start of their own (~45-70 s each on the H200, one per draft):
    ``long_prompts`` serves that many held-out prompts after each ``long_context`` length of tokens in the same engine,
    after the short ones. A stand-in engine accepts every draft token on prompts of the first length, one of three on
    the second's and none on the others: each figure counts only its own prompts' drafts; the engine was started
    once, long enough for the longest."""
    import sys
    import types

    from transformers import AutoTokenizer

    from eagle3.serve import evaluate

    from .test_evaluate import CountingEngine

    out, _ = deepseek_target
    k, long_context = 3, (1024, 2100)  # non-default lengths: the option reaches the prompts
    made, served = [], []

    class LLM(CountingEngine):
        def __init__(self, **kw):
            made.append(kw)
            self.c = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0] * k}
            self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(shutdown=lambda: None))

        def collective_rpc(self, method, args=()):
            return [{key: None for key in evaluate.DRAFTER_KEYS}]

        def generate(self, prompts, params, use_tqdm=False):
            for p in prompts:
                n = len(p["prompt_token_ids"])
                assert n <= made[-1]["max_model_len"] - params["max_tokens"]
                served.append(n)
                accepted = {long_context[0]: k, long_context[1]: 1}.get(n, 0)  # a draft's accepted tokens
                self.c = {
                    "drafts": self.c["drafts"] + 4,
                    "draft_tokens": self.c["draft_tokens"] + 4 * k,
                    "accepted": self.c["accepted"] + 4 * accepted,
                    "per_pos": [x + (4 if p < accepted else 0) for p, x in enumerate(self.c["per_pos"])],
                }
            return [
                types.SimpleNamespace(
                    outputs=[types.SimpleNamespace(token_ids=[5] * params["max_tokens"], logprobs=None)]
                )
                for _ in prompts
            ]

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=lambda **kw: kw))
    draft = out / "draft"
    draft.mkdir(exist_ok=True)
    (draft / "config.json").write_text('{"eagle_aux_hidden_state_layer_ids": [1, 4, 6]}')
    cfg = evaluate.EvalConfig(
        target=str(out),
        draft=str(draft),
        out=str(out / "eval"),
        k=k,
        max_tokens=8,
        num_prompts=6,
        long_prompts=3,
        long_context=long_context,
        shifted=False,
        baseline=False,
    )
    assert cfg.max_model_len == 2100 + 8  # the longest prompt and its answer
    r = evaluate.run(cfg)
    assert len(made) == 1 and made[0]["max_model_len"] == 2108
    tok = AutoTokenizer.from_pretrained(out)
    short = [len(ids) for _, ids in learnable.eval_prompts(tok, 6, arch="deepseek")]
    warm = min(8, len(short))  # the engine's warm-up: its first 8 prompts
    assert sorted(served[warm:-6]) == sorted(short)  # short, then each length in turn
    assert served[-6:] == [1024] * 3 + [2100] * 3
    assert r.draft.acceptance_length == 1.0 and r.draft.drafts == 6 * 4
    assert r.long["1024"].acceptance_length == 1.0 + k and r.long["1024"].drafts == 3 * 4
    assert r.long["2100"].acceptance_length == 2.0 and r.long["2100"].per_position == [1.0, 0.0, 0.0]
    assert set(r.long_per_traffic["2100"]) == {"chat", "thinking", "tool"}
    assert any("3 prompts of 2100 tokens" in line for line in r.lines())
    assert json.loads((out / "eval" / "eval.json").read_text())["long"]["1024"]["drafts"] == 12
    # the default context is the learnable targets' LONG_CONTEXT, and the engine's length grows for it
    assert evaluate.EvalConfig(target="t", draft="d", long_prompts=1).max_model_len == learnable.LONG_CONTEXT + 128
    with pytest.raises(ValueError, match="long_prompts"):  # prompts from a file carry their own context
        evaluate.EvalConfig(target="t", draft="d", prompts="p.jsonl", long_prompts=4)
    argv = ["eval", "--target", "t", "--draft", "d", "--out", "o", "--long-prompts", "5", "--long-context", "2000"]
    got = cli._eval_config(cli.build_parser().parse_args(argv))
    assert (got.long_prompts, got.long_context) == (5, (2000,))
    got = cli._eval_config(cli.build_parser().parse_args(argv[:-1] + ["4096,8192,16384"]))
    assert got.long_context == (4096, 8192, 16384) and got.max_model_len == 16384 + 128


def test_make_target_on_the_cpu_says_how_long_and_refuses_what_would_take_too_long(tmp_path, capsys, monkeypatch):
    """The deepseek target on two cores ran 14.5 min without a word: now a bar shows the device and the steps, the
    time is estimated from the first steps (here one) and said; over the CPU limit the run is refused and the
    folder it began removed."""
    monkeypatch.setattr(learnable, "ESTIMATE_AFTER", 1)
    with pytest.raises(
        learnable.TooSlow, match="on the CPU would take about .* run it on a GPU, or give fewer --steps"
    ):
        learnable.make_target(tmp_path / "t", steps=10**6, device="cpu", n_conversations=50, batch=1, seq_len=16,
                              progress=True)  # fmt: skip
    assert not (tmp_path / "t").exists()
    err = capsys.readouterr()
    assert "make-target: about" in err.out and "target (cpu)" in err.err


def test_make_target_s_estimate_leaves_out_the_first_step_s_warm_up(tmp_path, monkeypatch):
    """On an H100 the first step (CUDA context, kernel choice) made the estimate 25.8 min for a run of 2 min: the
    time a step is taken from the steps after the first. Here the first step sleeps 2 s, the others take ms."""
    real, said = torch.nn.functional.cross_entropy, []

    def first_slow(*a, **k):
        if not getattr(first_slow, "slept", False):
            first_slow.slept = True
            time.sleep(2.0)
        return real(*a, **k)

    monkeypatch.setattr(torch.nn.functional, "cross_entropy", first_slow)
    monkeypatch.setattr(learnable, "_check_time", lambda device, steps, per_step, *_: said.append(per_step))
    learnable.make_target(tmp_path / "t", steps=6, device="cpu", n_conversations=50, batch=1, seq_len=16)
    assert first_slow.slept and len(said) == 1 and said[0] < 0.5, said
