"""The GPU suite's kept engines (tests/gpu/conftest.py) on a pretend 80 GiB card, on the CPU: an engine starts only
where vLLM would let it (its share of the card free), so the suite makes room by closing kept engines, oldest first
and never the one a test is using, and a test that does not use them starts with them closed."""

import json
from types import SimpleNamespace

import pytest

from eagle3.extract import vllm_backend
from eagle3.targets import presets
from tests.gpu import conftest as gpu

CARD_GIB = 80.0
BEYOND_SHARE_GIB = 6.0  # what an engine holds beyond its share (context, graphs, workspace)


class Card:
    def __init__(self):
        self.used, self.started = 0.0, []

    def free(self) -> float:
        return CARD_GIB - self.used


@pytest.fixture
def card(monkeypatch):
    card = Card()

    class Engine:
        def __init__(self, path, spec, capture="hooks", gpu_memory_utilization=0.9, **kw):
            if card.free() < gpu_memory_utilization * CARD_GIB:  # vLLM's start-up check
                raise ValueError(f"free {card.free()} GiB is less than {gpu_memory_utilization} of the card")
            self.gib = gpu_memory_utilization * CARD_GIB + BEYOND_SHARE_GIB
            card.used += self.gib
            card.started.append(capture)
            self.start_seconds = 0.0

        def close(self):
            card.used -= self.gib
            self.gib = 0.0

    monkeypatch.setattr(vllm_backend, "VLLMBackend", Engine)
    monkeypatch.setattr(gpu.Engines, "free_gib", staticmethod(card.free))
    monkeypatch.setattr(gpu.Engines, "card_gib", staticmethod(lambda: CARD_GIB))
    return card


@pytest.fixture
def engines(tmp_path, card):
    prof = presets.from_name("mini-kimi")
    cfg = {"architectures": [prof.architecture], **prof.hf_config}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return gpu.Engines(gpu.TargetUnderTest(tmp_path, prof, 1, local=True), lambda key, value: None)


def test_a_fourth_kept_engine_starts_after_the_oldest_is_closed(engines, card):
    for strategy in ("hooks", "aux", "direct", "decode"):
        engines.get(strategy)
    assert card.started == ["hooks", "aux", "direct", "decode"]
    assert list(engines.cache) == ["aux", "direct", "decode"]
    assert card.used == pytest.approx(3 * (gpu.ENGINE_SHARE * CARD_GIB + BEYOND_SHARE_GIB))


def test_room_for_a_test_s_own_engine_keeps_the_engine_it_uses(engines, card):
    for strategy in ("hooks", "aux", "direct"):
        engines.get(strategy)
    engines.make_room(engines.engine_gib(0.2), keep="hooks")
    assert list(engines.cache) == ["hooks", "direct"]  # aux, the oldest but hooks, was enough
    assert card.free() >= engines.engine_gib(0.2)
    engines.make_room(CARD_GIB, keep="direct")  # more than the card: all but the one in use
    assert list(engines.cache) == ["direct"]


def test_a_test_that_does_not_use_them_starts_with_the_kept_engines_closed(engines, card, monkeypatch):
    monkeypatch.setattr(gpu, "KEPT_ENGINES", [engines])
    for strategy in ("hooks", "direct"):
        engines.get(strategy)
    gpu.pytest_runtest_setup(SimpleNamespace(fixturenames=["target", "engines", "tmp_path"]))
    assert list(engines.cache) == ["hooks", "direct"]
    gpu.pytest_runtest_setup(SimpleNamespace(fixturenames=["tmp_path", "report"]))
    assert engines.cache == {} and card.used == 0.0
