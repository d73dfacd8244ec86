"""The trainer benchmark's rows as pytest-benchmark JSON, so `eagle3 bench report` draws them beside the
extraction's (tests/gpu/test_bench_train.py writes them)."""

from __future__ import annotations

from eagle3.bench import READER_KEY, TRAIN_PREFIX


def train_history(rows: list[dict], run: str, profile: str, gpus: int = 1) -> dict:
    """The trainer benchmark's rows ({draft, seq, precision, tok_per_s, mfu, peak_gib, ...}; a row that ran out of
    memory has no tok_per_s) as pytest-benchmark JSON, so `bench report` shows them beside the extraction's:
    tokens/s of all ``gpus`` and per GPU, MFU and peak memory in their own lines."""

    def key(r):  # what differs from the trainer's default in the key: train_llama_bf16-mixed_eager/32768,
        # train_llama_bf16-mixed_flex_compiled/8192, train_llama_bf16-mixed_foreach/8192 (the optimizer); the store
        # reader's row (read as training steps of seq tokens): train_reader/8192
        if r.get("reader"):
            return f"{READER_KEY}/{r['seq']}"
        loss = f"_{r['loss']}" if r.get("loss", "auto") != "auto" else ""
        attn = f"_{r['attn']}" if r.get("attn", "sdpa") != "sdpa" else ""
        opt = f"_{r['optimizer']}" if r.get("optimizer", "auto") != "auto" else ""
        return (
            f"{TRAIN_PREFIX}{r['draft']}_{r['precision']}{loss}{attn}{opt}"
            f"{'_compiled' if r.get('compiled') else ''}/{r['seq']}"
        )

    return {
        "datetime": run,
        "benchmarks": [
            {"name": key(r), "extra_info": dict(r, key=key(r), tokens_per_s=r["tok_per_s"], profile=profile, gpus=gpus)}
            for r in rows
            if r.get("tok_per_s")
        ],
    }
