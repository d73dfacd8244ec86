"""--trust-remote-code: a target whose tokenizer is code in its own folder (tokenizer_config.json's auto_map, as
Kimi-K2.5's is). Without the flag every command that loads it refuses up front, naming the file and the flag; with
it the code runs (here a tokenizer class that marks itself) and the chain works."""

import json
import shutil
import uuid

import pytest

from eagle3 import cli

CUSTOM = """import os

from transformers import PreTrainedTokenizerFast


class MarkedTokenizerFast(PreTrainedTokenizerFast):
    loaded_from_the_folder = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if os.environ.get("EAGLE3_TEST_MARK"):  # the test sees that the folder's code ran, and in which command
            open(os.environ["EAGLE3_TEST_MARK"], "a").close()
"""


@pytest.fixture
def custom_target(tiny_kimi, tmp_path):
    target = tmp_path / f"target-{uuid.uuid4().hex[:12]}"  # transformers keeps a copy of its code by folder name
    shutil.copytree(tiny_kimi, target)
    (target / "tokenization_marked.py").write_text(CUSTOM)
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class="MarkedTokenizerFast",
               auto_map={"AutoTokenizer": [None, "tokenization_marked.MarkedTokenizerFast"]})  # fmt: skip
    (target / "tokenizer_config.json").write_text(json.dumps(cfg))
    data = tmp_path / "a.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    return target, data


def test_transformers_itself_runs_the_folder_s_code_only_when_trusted(custom_target):
    from transformers import AutoTokenizer

    target, _ = custom_target
    assert AutoTokenizer.from_pretrained(target, trust_remote_code=True).loaded_from_the_folder
    try:  # untrusted, transformers falls back to its own class (or refuses): the folder's code never runs
        untrusted = AutoTokenizer.from_pretrained(target, trust_remote_code=False)
    except ValueError:
        return
    assert not getattr(untrusted, "loaded_from_the_folder", False)


@pytest.mark.parametrize("command", ["show-mask", "extract", "regenerate", "train --online"])
def test_each_command_refuses_custom_code_without_the_flag_naming_file_and_flag(custom_target, tmp_path, capsys,
                                                                                 command):  # fmt: skip
    target, data = custom_target
    argv = {
        "show-mask": ["show-mask", "--model", str(target), "--data", str(data)],
        "extract": ["extract", "--model", str(target), "--data", str(data), "--out", str(tmp_path / "s")],
        "regenerate": ["regenerate", "--target", str(target), "--data", str(data), "--out", str(tmp_path / "r.jsonl")],
        "train --online": ["train", "--online", "--target", str(target), "--data", str(data),
                           "--out", str(tmp_path / "o")],
    }[command]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "tokenizer_config.json" in err and "--trust-remote-code" in err, err
    assert not (tmp_path / "s").exists() and not (tmp_path / "r.jsonl").exists() and not (tmp_path / "o").exists()


def test_with_the_flag_the_chain_runs_the_folder_s_code_and_a_resume_keeps_it(custom_target, tmp_path, monkeypatch):
    target, data = custom_target
    mark = tmp_path / "code-ran"
    monkeypatch.setenv("EAGLE3_TEST_MARK", str(mark))
    assert cli.main(["show-mask", "--model", str(target), "--data", str(data), "--trust-remote-code"]) == 0
    assert mark.exists()
    mark.unlink()
    out = tmp_path / "store"
    argv = ["extract", "--model", str(target), "--data", str(data), "--out", str(out), "--trust-remote-code"]
    assert cli.main([*argv, "--no-selfcheck"]) == 0 and mark.exists()
    recorded = json.loads((out / "plan.json").read_text())
    assert json.dumps(recorded).count('"trust_remote_code": true') == 1, recorded
    assert cli.main(["extract", "--resume", str(out)]) == 0  # the recorded flag comes back with the resume
