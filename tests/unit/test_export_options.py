"""Every option that reaches the exported draft, at a value other than its default, followed from the command line
to what vLLM 0.26 reads from the exported folder (eagle3/train/vllm_reads.py names the vLLM source of each field;
on a host with vLLM, test_vllm_contract.py checks that reading against vLLM's own parser).

The field's known silent failure: a draft whose config names other aux layers than its store was extracted at
(vLLM #50170: served on the default layers, acceptance 2.77 -> 1.04). A default-option run is the control: each
expected value differs from what the defaults give, so a value that silently fell back to its default fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3 import cli
from eagle3.train import vllm_reads

DEFAULTS = {
    "aux_layer_ids": [2, 4, 5],
    "num_aux_hidden_states": 3,
    "num_speculative_tokens": 3,
    "draft_vocab_size": 256,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 32,
    "dtype": "bfloat16",
    "fc_input_size": 384,
    "fc_norm": False,
    "norm_output": False,
}

# (layer ids at extraction, train options, what vLLM must read)
CASES = {
    "two aux layers, fp16, 2 TTT steps": (
        "1,3,8",
        ["--ttt-steps", "2", "--export-dtype", "float16", "--draft-vocab", "100"],
        {
            "aux_layer_ids": [1, 3],
            "num_aux_hidden_states": 2,
            "fc_input_size": 256,
            "num_speculative_tokens": 2,
            "dtype": "float16",
            "draft_vocab_size": 100,
        },
    ),
    "four aux layers, other heads, fp32, 4 TTT steps": (
        "1,3,5,6,8",
        [
            "--ttt-steps",
            "4",
            "--export-dtype",
            "float32",
            "--draft-heads",
            "8",
            "--draft-kv-heads",
            "2",
            "--draft-head-dim",
            "16",
            "--serve-tp",
            "1,2,4,8",
        ],
        {
            "aux_layer_ids": [1, 3, 5, 6],
            "num_aux_hidden_states": 4,
            "fc_input_size": 512,
            "num_speculative_tokens": 4,
            "dtype": "float32",
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 16,
        },
    ),
    "EAGLE-3.1 (fc_norm and norm_output)": ("", ["--eagle-3.1"], {"fc_norm": True, "norm_output": True}),
    "fc_norm alone, two aux layers": (
        "2,6,8",
        ["--fc-norm"],
        {"fc_norm": True, "aux_layer_ids": [2, 6], "num_aux_hidden_states": 2, "fc_input_size": 256},
    ),
    "norm_output alone": ("", ["--norm-output"], {"norm_output": True}),
    "the target's whole vocabulary (no vocabulary map)": ("", ["--draft-vocab", "100000"], {"draft_vocab_size": 1024}),
}
TORCH_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


@pytest.fixture(scope="module")
def store_at(tiny_kimi, small_data, tmp_path_factory):
    made = {}

    def make(ids: str) -> Path:
        if ids not in made:
            out = tmp_path_factory.mktemp("export") / f"store-{ids.replace(',', '-')}"
            argv = [
                "extract",
                "--model",
                str(tiny_kimi),
                "--data",
                str(small_data),
                "--out",
                str(out),
                "--max-samples",
                "8",
                "--max-len",
                "64",
                "--no-selfcheck",
            ] + (["--layer-ids", ids] if ids else [])
            assert cli.main(argv) == 0
            made[ids] = out
        return made[ids]

    return make


def _train(store: Path, out: Path, more: list[str]) -> Path:
    argv = [
        "train",
        "--store",
        str(store),
        "--out",
        str(out),
        "--steps",
        "1",
        "--batch",
        "4",
        "--draft-vocab",
        "256",
        "--checkpoint-minutes",
        "0",
    ] + more
    assert cli.main(argv) == 0
    return out / "draft"


def test_the_defaults_are_what_the_control_reads(store_at, tmp_path):
    draft = _train(store_at(""), tmp_path / "t", [])
    got = vllm_reads.reads(draft)
    assert {k: got[k] for k in DEFAULTS} == DEFAULTS
    assert vllm_reads.problems(draft) == []


@pytest.mark.parametrize("name", list(CASES))
def test_each_option_reaches_what_vllm_reads(store_at, tmp_path, name):
    ids, options, want = CASES[name]
    draft = _train(store_at(ids), tmp_path / "t", options)
    got = vllm_reads.reads(draft)
    assert {k: got[k] for k in want} == want
    assert all(want[k] != DEFAULTS[k] for k in want), "a case value equal to the default proves nothing"
    assert vllm_reads.problems(draft) == []
    shapes, full = vllm_reads.tensor_shapes(draft), {**DEFAULTS, **want}
    assert {dt for name, (_, dt) in shapes.items() if name not in ("d2t", "t2d")} == {TORCH_DTYPE[full["dtype"]]}
    assert shapes["fc.weight"][0] == (128, full["fc_input_size"])
    assert sorted(k for k in shapes if k.startswith("fc_norm.")) == (
        [f"fc_norm.{i}.weight" for i in range(full["num_aux_hidden_states"])] if full["fc_norm"] else []
    )
    assert ("d2t" in shapes) == (full["draft_vocab_size"] < got["vocab_size"])  # a map only for a smaller vocabulary
    assert shapes["lm_head.weight"][0] == (full["draft_vocab_size"], 128)


def test_problems_sees_a_config_that_names_other_layers_than_the_weights(store_at, tmp_path):
    """The checker itself: a config edited to 3 aux ids over a 2-aux draft, and one without its layer ids."""
    import json

    draft = _train(store_at("1,3,8"), tmp_path / "t", [])
    cfg = json.loads((draft / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [1, 3, 5]
    (draft / "config.json").write_text(json.dumps(cfg))
    assert any("aux layer ids but vLLM sizes fc for 2" in p for p in vllm_reads.problems(draft))
    del cfg["eagle_aux_hidden_state_layer_ids"]
    cfg["transformer_layer_config"].pop("num_aux_hidden_states")
    (draft / "config.json").write_text(json.dumps(cfg))
    found = vllm_reads.problems(draft)
    assert any("missing: vLLM would tap its default layers" in p for p in found), found
    assert any(p.startswith("fc.weight: the file has (128, 256), vLLM builds (128, 384)") for p in found), found


@pytest.mark.parametrize("name", list(CASES))
def test_vllm_s_own_parser_reads_what_vllm_reads_says(store_at, tmp_path, name):
    """Where vLLM is installed (the GPU host): vLLM 0.26's speculators config parser on the exported folder agrees
    with eagle3.train.vllm_reads, field by field. CPU CI has no vLLM: skipped there, with the reason."""
    import copy
    import json

    pytest.importorskip("vllm", reason="vLLM is not installed here; this runs on the GPU host")
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    ids, options, _ = CASES[name]
    draft = _train(store_at(ids), tmp_path / "t", options)
    raw = json.loads((draft / "config.json").read_text())
    pre = SpeculatorsConfig.extract_transformers_pre_trained_config(copy.deepcopy(raw))
    spec = SpeculatorsConfig.extract_vllm_speculative_config(copy.deepcopy(raw))
    r = vllm_reads.reads(draft)
    assert spec == {"method": r["method"], "num_speculative_tokens": r["num_speculative_tokens"]}
    assert pre["architectures"] == [r["architecture"]]
    assert pre["eagle_aux_hidden_state_layer_ids"] == r["aux_layer_ids"]
    assert pre["draft_vocab_size"] == r["draft_vocab_size"]
    assert pre.get("num_aux_hidden_states") == r["num_aux_hidden_states"]  # no eagle_config: this or 3
    assert pre.get("target_hidden_size", pre["hidden_size"]) == r["target_hidden_size"]
    for k in (
        "norm_before_residual",
        "norm_before_fc",
        "fc_norm",
        "norm_output",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "hidden_size",
    ):
        assert pre[k] == r[k], k


def test_problems_sees_a_vocabulary_map_of_another_size(store_at, tmp_path):
    from safetensors.torch import load_file, save_file

    draft = _train(store_at(""), tmp_path / "t", [])
    w = load_file(str(draft / "model.safetensors"))
    w["d2t"] = w["d2t"][:-1]
    save_file(w, str(draft / "model.safetensors"))
    assert vllm_reads.problems(draft) == ["d2t: the file has (255,), vLLM builds (256,)"]
