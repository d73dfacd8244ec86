"""Everyday mistakes (issue 13): each gets a message naming the problem and the fix, exit code 2, no traceback,
and leaves nothing behind. One table: the command line, what the message must say."""

import json
import shutil
import subprocess
import sys
import time

import pytest

from eagle3 import cli


def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def folders(tmp_path, tiny_kimi, small_data, small_store):
    """A scratch world: a model without weights, one without a tokenizer, a non-store folder, empty history."""
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    for f in tiny_kimi.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, no_weights / f.name)
    no_tok = tmp_path / "no-tokenizer"
    no_tok.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_kimi / name, no_tok / name)
    (tmp_path / "not-a-store").mkdir()
    (tmp_path / "empty.json").write_text(json.dumps({"benchmarks": []}))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("the user's")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n  \n\n")
    partial = tmp_path / "partial"  # an extraction that stopped: its last shard never committed
    shutil.copytree(small_store, partial)
    m = json.loads((partial / "manifest.json").read_text())
    (partial / m["shards"].pop()["file"]).unlink()
    (partial / "manifest.json").write_text(json.dumps(m))
    return {
        "model": str(tiny_kimi),
        "data": str(small_data),
        "store": str(small_store),
        "tmp": tmp_path,
        "no_weights": str(no_weights),
        "no_tok": str(no_tok),
        "partial": str(partial),
    }


def _has_vllm():
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _has_cuda():
    import torch

    return torch.cuda.is_available()


MISTAKES = [
    # (name, argv with {placeholders}, message regex)
    (
        "model folder missing",
        "extract --model {tmp}/nope --data {data} --out {tmp}/out",
        r"--model .*/nope: no such folder",
    ),
    (
        "model without weights (hf)",
        "extract --model {no_weights} --data {data} --out {tmp}/out",
        r"no weights \(\*\.safetensors\).*--backend vllm",
    ),
    (
        "model without tokenizer",
        "extract --model {no_tok} --data {data} --out {tmp}/out",
        r"no tokenizer files.*chat template",
    ),
    ("model is a file", "extract --model {data} --data {data} --out {tmp}/out", r"is a file; give the folder"),
    (
        "layer id out of range",
        "extract --model {model} --data {data} --out {tmp}/out --layer-ids 99",
        r"layer id 99 out of range: a target with 8 layers has ids 0\.\.8",
    ),
    ("data file missing", "extract --model {model} --data {tmp}/nope.jsonl --out {tmp}/out", r"file not found"),
    ("verify on a missing store", "verify {tmp}/nope", r"no such store folder"),
    ("verify on a folder without manifest", "verify {tmp}/not-a-store", r"is not a store \(no manifest.json\)"),
    ("train on a missing store", "train --store {tmp}/nope --out {tmp}/out", r"no such store folder"),
    (
        "bench report, missing history",
        "bench report --history {tmp}/nope.json --out {tmp}/out",
        r"--history .*nope.json: no such file",
    ),
    (
        "bench report, empty history",
        "bench report --history {tmp}/empty.json --out {tmp}/out",
        r"no benchmark records.*--benchmark-json",
    ),
    (
        "extract into a folder of the user's files",
        "extract --model {model} --data {data} --out {tmp}/mine",
        r"not empty and eagle3 did not make it \(it holds notes.txt\).*new or empty --out folder",
    ),
    (
        "data given as a folder",
        "extract --model {model} --data {tmp} --out {tmp}/out",
        r"is a directory; give the JSONL",
    ),
    (
        "data file empty",
        "extract --model {model} --data {tmp}/empty.jsonl --out {tmp}/out",
        r"--data .*empty.jsonl: the file is empty",
    ),
    (
        "data file of blank lines",
        "regenerate --target {model} --data {tmp}/blank.jsonl --out {tmp}/out.jsonl",
        r"--data .*blank.jsonl: the file is empty",
    ),
    (
        "train on a store whose extraction stopped",
        "train --store {partial} --out {tmp}/out",
        r"holds 40 of the 48 samples its plan names \(8 missing\).*extract --resume.*--allow-incomplete",
    ),
    (
        "eval's long prompts with a prompts file",
        "eval --target {model} --draft {model} --out {tmp}/out --prompts {data} --long-prompts 8",
        r"--long-prompts makes .* held-out conversations.*put the context in the file",
    ),
]
if not _has_vllm():
    MISTAKES += [
        (
            "extract --backend vllm without vLLM",
            "extract --model {model} --data {data} --out {tmp}/out --backend vllm",
            r"needs vLLM, which is not installed",
        ),
        ("eval without vLLM", "eval --target {model} --draft {model} --out {tmp}/out", r"eval needs vLLM"),
    ]
if not _has_cuda():
    MISTAKES += [
        (
            "train --device cuda without CUDA",
            "train --store {store} --out {tmp}/out --device cuda",
            r"needs a CUDA GPU and (torch .* sees none|this machine has no GPU driver)",
        ),
        (
            "extract --device cuda without CUDA",
            "extract --model {model} --data {data} --out {tmp}/out --device cuda",
            r"needs a CUDA GPU",
        ),
    ]


@pytest.mark.parametrize("name,argv,pattern", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_everyday_mistake_gets_a_message_and_leaves_nothing(folders, capsys, name, argv, pattern):
    import re

    before = _tree(folders["tmp"])
    store_before = _tree(__import__("pathlib").Path(folders["store"]))
    code = cli.main(argv.format(**folders).split())
    out = capsys.readouterr()
    assert code == 2, (name, out.out, out.err)
    assert re.search(pattern, out.err), (name, out.err)
    assert "Traceback" not in out.err
    assert _tree(folders["tmp"]) == before, name
    assert _tree(__import__("pathlib").Path(folders["store"])) == store_before, name


def test_argument_mistakes_are_refused_in_under_a_second(tiny_kimi, small_data, tmp_path):
    """No torch, transformers or vLLM import before the arguments are checked."""
    cmd = [
        sys.executable,
        "-m",
        "eagle3.cli",
        "extract",
        "--model",
        str(tiny_kimi),
        "--data",
        str(small_data),
        "--out",
        str(tmp_path / "o"),
        "--layer-ids",
        "99",
    ]
    subprocess.run([sys.executable, "-c", "pass"], check=True)  # warm the interpreter's file cache
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    seconds = time.perf_counter() - t0
    assert done.returncode == 2 and "layer id 99 out of range" in done.stderr, done.stderr
    assert seconds < 1.0, seconds
    code = (
        "import sys, eagle3.cli, eagle3.preflight, eagle3.targets.layers, eagle3.data.conversations; "
        "print('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


@pytest.mark.skipif(_has_vllm(), reason="checks the message for a machine without vLLM")
def test_the_library_refuses_the_vllm_backend_without_vllm_before_making_the_store(tiny_kimi, small_data, tmp_path):
    from eagle3.data.conversations import DataConfig
    from eagle3.extract import extract
    from eagle3.preflight import UsageError

    cfg = extract.ExtractConfig(
        model=str(tiny_kimi),
        out=str(tmp_path / "out"),
        backend="vllm",
        data=DataConfig([str(small_data)], max_samples=4),
    )
    with pytest.raises(UsageError, match="needs vLLM"):
        extract.run(cfg, progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists() and not (tmp_path / "out" / "shards").exists()
