"""`eagle3 extract --regenerate`: the target writes each conversation's last assistant turn, and the states of the
prompt and of what it wrote are stored, in one engine pass: no second prefill of regenerated data.

- The prompt: a conversation's messages up to its last assistant turn of weight 1 (the turn the target writes;
  messages after it are dropped), or all of them when it has none (a prompt-only dataset), through the target's
  chat template with its generation prompt. The same prompt `regenerate --mode last` builds, and the same seed
  (regenerate.turn_seed), so the two draw the same turn.
- The sample: the prompt's tokens and the generated ones, up to and including the end-of-turn token (or cut at
  --max-tokens, or where the sample reaches --max-len). Its loss mask covers exactly the generated tokens: what the
  target wrote (thinking, text, tool-call markup, the end token); the prompt's earlier assistant turns are the
  data's words, context only.
- vLLM: the prompt's rows come from prefill (read past the prefix cache, so every row is computed), the generated
  tokens' rows from the decode steps (decode_capture.RowCollector). The last token sampled is never fed back; a
  second request over the sample's final tokens, which the prefix cache answers but for its last block, gives that
  row: at most a block of tokens computed again per sample (``recomputed`` in the summary).
- hf (the CPU reference): transformers generates, then the final tokens are captured by a forward of their own.

Resumable like every extraction: a rerun skips the samples the store holds; a line's seed does not depend on the
run, so a resumed run stores what an uninterrupted one would (greedy; sampled on the same backend and host).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from eagle3.data import masks
from eagle3.data.conversations import DataConfig, DataReport, Sample, write_rejects
from eagle3.data.schema import DataError
from eagle3.extract.local_session import LocalSession
from eagle3.store.format import ShardInfo, StoreError, shard_tokens

log = logging.getLogger(__name__)

# a regenerated sample's id: FILE:LINE~regen, never the data's own FILE:LINE, so a rerun with or without
# --regenerate into the other's store is refused (its plan holds other ids) instead of mixing the two
ID_SUFFIX = "~regen"


@dataclass(frozen=True)
class Generation:
    """What the target's turns are drawn with (recorded in the store's recipe)."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    max_tokens: int = 512  # tokens a turn may run to (less where the sample would pass max_len)
    seed: int = 0


@dataclass(frozen=True)
class Prompt:
    sample_id: str
    ids: tuple[int, ...]
    seed: int
    max_tokens: int  # min(Generation.max_tokens, max_len - len(ids))

    def __len__(self) -> int:
        return len(self.ids)

    def as_sample(self) -> Sample:
        """The prompt alone as a sample (the final-state self-check's input)."""
        return Sample(self.sample_id, self.ids, (0,) * (len(self.ids) - 1) + (1,))


@dataclass
class Written:
    """A batch's outcome: its shards, its samples (prompt + generated) and why each turn ended."""

    shards: list[ShardInfo]
    samples: list[Sample]
    finish: list[str]  # "stop" (an end-of-turn token) or "length" (max_tokens / max_len)
    recomputed: int = 0  # rows computed twice (vLLM: the second request's tail)


def load_prompts(cfg: DataConfig, tokenizer, gen: Generation) -> tuple[list[Prompt], DataReport]:
    """Each conversation's prompt (module docstring), in file then line order; bad lines and prompts of max_len
    tokens or more are rejected (counted, and written to cfg.rejects_path with the reason)."""
    from eagle3.data.conversations import check_tokenizer, reject, unique_conversations
    from eagle3.extract.regenerate import turn_seed

    check_tokenizer(tokenizer, "tokenizer")
    report, prompts, rejects = DataReport(prompts_only=True), [], []
    for path, line, text, parsed in unique_conversations(cfg, report, rejects, need_assistant=False):
        msgs = parsed.messages
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant" and parsed.weights[i]]
        head = msgs[: turns[-1]] if turns else msgs
        ids = tokenizer(masks.chat(tokenizer, head, parsed.tools, gen=True), add_special_tokens=False)["input_ids"]
        if len(ids) >= cfg.max_len:
            e = DataError(
                path,
                line,
                f"the prompt has {len(ids)} tokens, no room under max_len {cfg.max_len} for the target's turn",
                "Raise --max-len",
                "too_long",
            )
            if cfg.on_error == "stop":
                raise e
            reject(report, rejects, path, line, text, e)
            continue
        prompts.append(
            Prompt(
                f"{path.name}:{line}{ID_SUFFIX}",
                tuple(ids),
                turn_seed(gen.seed, line),
                min(gen.max_tokens, cfg.max_len - len(ids)),
            )
        )
        if cfg.max_samples and len(prompts) >= cfg.max_samples:
            break
    report.samples, report.tokens = len(prompts), sum(len(p) for p in prompts)
    if cfg.rejects_path and rejects:
        write_rejects(cfg.rejects_path, rejects)
    if not prompts:
        raise DataError(
            ", ".join(cfg.paths),
            None,
            f"no usable prompts ({report.summary()})",
            "Give JSONL conversations whose prompts fit under --max-len",
        )
    return prompts, report


def sample_of(p: Prompt, generated: Sequence[int], stops: set[int]) -> tuple[Sample, str]:
    """The stored sample: prompt + generated tokens, the loss mask on the generated ones; and how the turn ended."""
    gen = list(generated)[: p.max_tokens]
    finish = "stop" if gen and gen[-1] in stops else "length"
    return Sample(p.sample_id, p.ids + tuple(gen), (0,) * len(p.ids) + (1,) * len(gen)), finish


def sampling_params(vllm, p: Prompt, gen: Generation, stops: set[int]):
    """The first request: the turn, every prompt row computed (the prefix cache not read)."""
    return vllm.SamplingParams(
        temperature=gen.temperature,
        top_p=gen.top_p,
        max_tokens=p.max_tokens,
        seed=p.seed,
        stop_token_ids=sorted(stops),
        detokenize=False,
        skip_reading_prefix_cache=True,
    )


class LocalOnePass:
    """hf backend: transformers generates each turn with its own seed, then the final tokens are captured and
    written as any hf extraction's (local_session.LocalSession, each batch sealed in its shards)."""

    def __init__(self, backend, store, cfg, gen: Generation, stops: set[int], fault=None):
        self.backend, self.gen, self.stops = backend, gen, stops
        self.capture = LocalSession(backend, store, cfg, fault, seal_each_batch=True)

    def submit(self, batch: Sequence[Prompt]) -> Written:
        generated = self.backend.generate(batch, self.gen, self.stops)
        pairs = [sample_of(p, g, self.stops) for p, g in zip(batch, generated)]
        samples = [s for s, _ in pairs]
        return Written(self.capture.submit(samples), samples, [f for _, f in pairs])

    def close(self) -> None:
        self.capture.close()


REGEN_KEYS = frozenset({"rank", "owner", "steps", "rows", "shards", "errors"})


class VLLMOnePass:
    """vLLM backend: generation and capture in one engine (module docstring)."""

    def __init__(self, backend, store, cfg, gen: Generation, stops: set[int], fault=None):
        from eagle3.store.threads import writer_threads

        self.backend, self.gen, self.stops, self.fault = backend, gen, stops, fault
        self.rows = 0
        backend.call(
            "eagle3_regen_open",
            {
                "root": str(store.root),
                "spec": store.spec.to_json(),
                "start_index": store.next_shard_index,
                "shard_tokens": shard_tokens(store.spec, cfg.shard_tokens),
                "fsync": cfg.fsync,
                "writer_threads": max(writer_threads(cfg.fsync), cfg.writer_threads),
            },
            keys=frozenset({"rank", "owner"}),
        )

    def submit(self, batch: Sequence[Prompt]) -> Written:
        from eagle3.extract.rpc import check_consistent

        vllm, llm = self.backend.vllm, self.backend.llm
        first = llm.generate(
            [{"prompt_token_ids": list(p.ids)} for p in batch],
            [sampling_params(vllm, p, self.gen, self.stops) for p in batch],
            use_tqdm=False,
        )
        pairs = [sample_of(p, o.outputs[0].token_ids, self.stops) for p, o in zip(batch, first)]
        samples = [s for s, _ in pairs]
        # the last token's row: its sample's final tokens again, all but the last block read from the prefix cache
        tail = llm.generate(
            [{"prompt_token_ids": list(s.input_ids)} for s in samples],
            vllm.SamplingParams(max_tokens=1, temperature=0.0, detokenize=False),
            use_tqdm=False,
        )
        records = self.backend.call(
            "eagle3_regen_write",
            [
                (
                    s.sample_id,
                    [a.request_id, b.request_id],
                    np.asarray(s.input_ids, dtype=np.int32).tobytes(),
                    np.asarray(s.loss_mask, dtype=np.uint8).tobytes(),
                )
                for s, a, b in zip(samples, first, tail)
            ],
            keys=REGEN_KEYS,
        )
        errors = [f"rank {r['rank']}: {e}" for r in records for e in r["errors"]]
        if errors:
            raise StoreError("capture failed: " + "; ".join(errors[:5]))
        check_consistent(records, ["steps", "rows"])  # every rank ran the same steps over the same rows
        rows = records[0]["rows"] - self.rows
        self.rows = records[0]["rows"]
        need = sum(len(s) for s in samples)
        if rows < need:
            raise StoreError(f"the engine computed {rows} rows for samples of {need} tokens: some were skipped")
        owner = next(r for r in records if r["owner"])
        if self.fault:
            self.fault("after_batch")
        # rows beyond the samples' own: the second requests' tails, and an async step after a request ended
        return Written([ShardInfo(**i) for i in owner["shards"]], samples, [f for _, f in pairs], rows - need)

    def close(self) -> None:
        self.backend.call("eagle3_regen_close", keys=frozenset({"rank", "unclaimed"}))


@dataclass
class OnePassStats:
    generated_tokens: int = 0
    finish: dict = field(default_factory=dict)
    recomputed: int = 0

    def line(self) -> str:
        ends = ", ".join(f"{k} {v}" for k, v in sorted(self.finish.items()))
        return f"{self.generated_tokens:,} tokens generated ({ends}); {self.recomputed:,} rows computed twice"


def run_batches(session, batches: Sequence[Sequence[Prompt]], committer, bar) -> tuple[int, int, OnePassStats]:
    """Each batch generated, captured and committed; returns (tokens, bytes) written and the generation's stats."""
    tokens = nbytes = 0
    stats = OnePassStats()
    t0 = time.perf_counter()
    for batch in batches:
        w = session.submit(batch)
        committer.commit(w.shards)
        tokens += sum(i.num_tokens for i in w.shards)
        nbytes += sum(i.bytes for i in w.shards)
        gen = sum(sum(s.loss_mask) for s in w.samples)
        stats.generated_tokens += gen
        stats.recomputed += w.recomputed
        for f in w.finish:
            stats.finish[f] = stats.finish.get(f, 0) + 1
        bar.update(len(batch))
        log.info(
            "extract --regenerate: %d samples, %s tokens generated, %.0f tok/s stored",
            bar.n,
            f"{stats.generated_tokens:,}",
            tokens / max(time.perf_counter() - t0, 1e-9),
        )
    return tokens, nbytes, stats


def open_session(backend, store, cfg, gen: Generation, stops: set[int], fault=None):
    if getattr(backend, "name", "") == "vllm":
        if backend.strategy == "aux":
            raise StoreError(
                "extract --regenerate needs the direct or hooks capture (--capture direct or hooks): "
                "the aux capture runs as a drafter, which sees no decode step's states"
            )
        return VLLMOnePass(backend, store, cfg, gen, stops, fault)
    return LocalOnePass(backend, store, cfg, gen, stops, fault)
