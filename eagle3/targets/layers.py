"""Layer ids: which residual-stream states are captured, in vLLM's EAGLE-3 convention.

    id k  (0 <= k < L) = the residual stream entering decoder layer k (= HF output_hidden_states[k])
    id L               = the last decoder layer's output, before the final norm

A decoder layer i that returns ``(hidden, residual)`` (vLLM's DeepSeek and Llama layers) yields id
``i + 1`` as ``hidden + residual``. vLLM hands aux states to the drafter in ascending layer order, so ids
are strictly ascending; the last id is L (the training target comes from it).
"""

from __future__ import annotations

from collections.abc import Sequence

CONVENTION = "vllm-eagle3/v1: id k = input of decoder layer k; id L = last layer output before final norm"


class LayerIdError(ValueError):
    pass


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """(2, L//2, L-3, L): vLLM's default aux layers plus the last. Kimi-K2.5 (L=61): (2, 30, 58, 61)."""
    ids = (2, num_layers // 2, num_layers - 3, num_layers)
    validate_layer_ids(ids, num_layers)
    return ids


def validate_layer_ids(ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
    ids = tuple(int(i) for i in ids)
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise LayerIdError(
            f"layer id{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} out of range: a target "
            f"with {num_layers} layers has ids 0..{num_layers} (id {num_layers} = its last layer's "
            f"output); the default is {list(default_layer_ids(num_layers)) if num_layers >= 7 else 'n/a'}"
        )
    if len(ids) < 2:
        raise LayerIdError(f"need at least one aux layer id plus the last ({num_layers}); got {list(ids)}")
    if len(set(ids)) != len(ids):
        raise LayerIdError(
            f"layer ids {list(ids)} repeat an id; for a {num_layers}-layer target choose distinct ids, "
            f"e.g. the default (2, L//2, L-3, L) needs L >= 7"
        )
    if list(ids) != sorted(ids):
        raise LayerIdError(f"layer ids {list(ids)} must ascend: vLLM feeds aux states to the drafter in layer order")
    if ids[-1] != num_layers:
        raise LayerIdError(
            f"the last layer id must be {num_layers} (the last layer's output, source of the training "
            f"targets); got {list(ids)}"
        )
    return ids


def hook_layer_index(layer_id: int) -> int:
    """Decoder layer whose output (hidden + residual) is state ``layer_id``."""
    if layer_id < 1:
        raise LayerIdError("id 0 (the embeddings) is not captured by layer-output hooks; use ids >= 1")
    return layer_id - 1


def aux_ids(ids: Sequence[int]) -> tuple[int, ...]:
    """The ids the draft consumes (all but the last)."""
    return tuple(ids[:-1])
