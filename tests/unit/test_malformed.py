"""Every malformed input in tests/unit/data/malformed/ gets its expected error, naming file and line,
and under the default skip policy lands in the rejects file with its reason."""

import json
import re
from pathlib import Path

import pytest

from eagle3.data.conversations import DataConfig, DataError, load_samples

HERE = Path(__file__).parent / "data" / "malformed"
EXPECTED = json.loads((HERE / "expected.json").read_text())


def _cfg(path, **kw):
    long_rule = "error" if "long_error" in path.name else "truncate"
    return DataConfig([str(path)], max_len=64, long_rule=long_rule, **kw)


def test_corpus_has_at_least_50_cases():
    assert len(EXPECTED) >= 50
    assert sorted(EXPECTED) == sorted(p.name for p in HERE.glob("*.jsonl"))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_malformed_input_is_reported_precisely(name, tokenizer, tmp_path):
    exp, path = EXPECTED[name], HERE / name
    with pytest.raises(DataError) as err:
        load_samples(_cfg(path, on_error="stop"), tokenizer)
    e = err.value
    assert e.reason == exp["reason"] and e.line == exp["line"] and e.path == str(path)
    assert str(e).startswith(f"{path}:{exp['line']}: ")
    assert re.search(exp["match"], str(e)), str(e)
    assert e.fix and e.fix in str(e)  # says what to do
    if exp["reason"] == "too_long":
        return  # --long error stops by design, whatever the skip policy
    rejects = tmp_path / "rejects.jsonl"
    skip_cfg = _cfg(path, on_error="skip", rejects_path=str(rejects))
    if name == "error_on_line_3.jsonl":
        samples, rep = load_samples(skip_cfg, tokenizer)
        assert [s.sample_id for s in samples] == [f"{name}:1"] and rep.blank_lines == 1
    else:
        with pytest.raises(DataError, match="no usable samples"):
            load_samples(skip_cfg, tokenizer)
    rows = [json.loads(x) for x in rejects.read_text().splitlines()]
    assert [(r["line"], r["reason"]) for r in rows] == [(exp["line"], exp["reason"])]
