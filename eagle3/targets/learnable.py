"""Small targets with something to learn: a Llama on the project's templated dialogues (ChatML), or a DeepseekV3
(MLA + MoE, as Kimi-K2.5) on Kimi-style traffic (data/kimi_traffic.py: chat, thinking, tool use) in Kimi-K2's chat
format (targets/kimi_format.py).

Its assistant turns follow from the user turns by fixed rules (counting, arithmetic, spelling,
calendars), so once trained the target's next token is predictable from context, and a draft that
learned the target predicts it too; an untrained or mis-wired draft does not. `eagle3 make-target`
builds it (a minute on a GPU; the CPU works for a few steps in tests).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from eagle3 import ownership
from eagle3.data import corpus
from eagle3.targets import int4, tiny
from eagle3.targets.learnable_profiles import (  # noqa: F401 - the profiles, also read from here
    ARCHES,
    LEARNABLE,
    LEARNABLE_DEEPSEEK,
    LEARNABLE_DEEPSEEK_LONG,
    experts_to_quantize,
)

log = logging.getLogger(__name__)

LONG_CONTEXT = 4096  # tokens of a long-context prompt (issue 41: drafts compared at >= 4k tokens of context)
TRAIN_SEED, HELD_OUT_SEED = 100, 999  # conversation seeds: training text vs evaluation prompts
# Held-out prompts to serve a draft on when two drafts' acceptance is compared against a bar of 0.05: 64 prompts
# (~9 answer tokens each) give a standard error of ~0.05 on each acceptance, the size of the bar itself; 1024 give
# ~0.013 each, ~0.018 on a difference of two.
EVAL_PROMPTS = 1024


def conversations(arch: str, n: int, seed: int, sessions: bool = True) -> list[dict]:
    """The learnable target's text: templated dialogues (llama), Kimi-style traffic (deepseek), with one in eight a
    long agentic session of 10-60 tasks (~2k-15k tokens) for deepseek-long (``sessions`` False: its short traffic)."""
    from eagle3.data import kimi_traffic

    if ARCHES[arch].chat_format != "kimi":
        return corpus.generate(n, seed=seed)
    convs = kimi_traffic.generate(n, seed=seed)
    if arch == "deepseek-long" and sessions:
        r = random.Random(seed + 1)
        convs = [kimi_traffic.agentic(r, r.randint(10, 60)) if i % 8 == 7 else c for i, c in enumerate(convs)]
    return convs


def rendered(tokenizer, conversation: dict) -> list[int]:
    """A whole conversation rendered with the chat template: its token ids."""
    text = tokenizer.apply_chat_template(conversation["messages"], tools=conversation.get("tools"), tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def token_stream(tokenizer, n_conversations: int, seed: int, arch: str = "llama", workers: int = 0) -> torch.Tensor:
    """All conversations rendered with the chat template, concatenated: [N] token ids. Long sessions are rendered
    in ``workers`` processes (tokenize_pool.py; 0: the CPUs')."""
    from functools import partial

    from eagle3.data import tokenize_pool

    convs = ((c,) for c in conversations(arch, n_conversations, seed))
    workers = workers or tokenize_pool.default_workers()
    ids: list[int] = []
    for _, got, _ in tokenize_pool.in_order(convs, partial(rendered, tokenizer), workers):
        ids += got
    return torch.tensor(ids, dtype=torch.long)


def windows(arch: str, seq_len: int | None = None, batch: int | None = None) -> tuple[int, int]:
    """(window length, windows a step) make_target trains on: the profile's seq_len, 16,384 tokens a step."""
    seq_len = seq_len or ARCHES[arch].seq_len
    return seq_len, batch or max(1, 64 * 256 // seq_len)


CPU_LIMIT_S = 20 * 60  # longer than this on the CPU is refused: make the target on a GPU
ESTIMATE_AFTER = 3  # steps timed, after the first, before the whole run's time is estimated


class TooSlow(RuntimeError):
    pass


def _check_time(device: str, steps: int, per_step: float, cpu_limit_s: float, bar) -> None:
    """Say how long the run will take; on the CPU refuse one over ``cpu_limit_s``."""
    total = per_step * steps
    bar.write(f"make-target: about {total / 60:.1f} min on {device} ({per_step:.2f} s a step, {steps} steps)")
    if device == "cpu" and total > cpu_limit_s:
        raise TooSlow(
            f"make-target on the CPU would take about {total / 60:.0f} min ({per_step:.1f} s a step x {steps} steps; "
            f"the limit is {cpu_limit_s / 60:.0f} min): run it on a GPU, or give fewer --steps"
        )


def make_target(
    out: str | Path,
    steps: int = 1500,
    batch: int | None = None,
    seq_len: int | None = None,
    lr: float = 2e-3,
    device: str | None = None,
    seed: int = 0,
    n_conversations: int = 30000,
    arch: str = "llama",
    progress: bool = False,
    cpu_limit_s: float = CPU_LIMIT_S,
    quantize: str | None = None,
) -> dict:
    """Build, train and save the learnable target (``arch``: llama or deepseek) in ``out``; returns {final_loss,
    first_loss, steps, seconds, tokens, arch}. Windows of the profile's seq_len (llama 256, deepseek 4608), as many a
    step as fit in 16,384 tokens (deepseek: 3, 13,824 tokens), unless given. On the CPU a run estimated (from its
    first steps) to take more than ``cpu_limit_s`` is refused, and the folder it began is removed. ``quantize``
    "int4": the routed experts saved as Kimi-K2.5's are (targets/int4.py)."""
    if arch not in ARCHES:
        raise ValueError(f"arch {arch!r}: use {' or '.join(ARCHES)}")
    if quantize not in (None, "int4"):
        raise ValueError(f"quantize {quantize!r}: use int4")
    if quantize:
        experts_to_quantize(arch)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    seq_len, batch = windows(arch, seq_len, batch)
    with ownership.claimed(out, "target") as out:  # a refusal or a failure leaves no folder it began
        info = _train_and_save(out, steps, batch, seq_len, lr, device, seed, n_conversations, arch, progress,
                               cpu_limit_s)  # fmt: skip
        if quantize:
            info.update(int4.quantize_files(out, out, device), quantize=quantize)
        (out / "eagle3_target.json").write_text(json.dumps(info, indent=1))
    return info


def _train_and_save(out: Path, steps, batch, seq_len, lr, device, seed, n_conversations, arch, progress, cpu_limit_s):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tiny.build_model(ARCHES[arch], out, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(device).train()
    stream = token_stream(tokenizer, n_conversations, TRAIN_SEED, arch)
    n_windows = (len(stream) - 1) // seq_len
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    t0, losses = time.perf_counter(), []
    bar = tqdm(total=steps, desc=f"target ({device})", unit="step", disable=not progress)
    for step in range(steps):
        if step == 1:  # the first step warms up (CUDA context, kernel choice): the estimate leaves it out
            t1 = time.perf_counter()
        if step == ESTIMATE_AFTER + 1:
            _check_time(device, steps, (time.perf_counter() - t1) / ESTIMATE_AFTER, cpu_limit_s, bar)
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        starts = torch.randint(0, n_windows, (batch,), generator=g) * seq_len
        x = torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()]).to(device)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
            logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        bar.update(1)
        if step % 20 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    model.eval().to("cpu").save_pretrained(out)
    info = {
        "final_loss": sum(losses[-20:]) / len(losses[-20:]),
        "first_loss": losses[0],
        "steps": steps,
        "seconds": round(time.perf_counter() - t0, 1),
        "tokens": steps * batch * seq_len,
        "arch": arch,
        "seq_len": seq_len,
        "batch": batch,
        "profile": ARCHES[arch].name,
    }
    return info


def eval_prompts(
    tokenizer, n: int, seed: int = HELD_OUT_SEED, arch: str = "llama", context_tokens: int = 0
) -> list[tuple[str, list[int]]]:
    """Held-out prompts, (traffic type, token ids): each conversation up to its last assistant turn (a tool
    conversation alternately up to its call), with the generation prompt; short traffic only (deepseek-long's long
    sessions come in as context). With ``context_tokens``: each prompt
    after other held-out conversations (seed + 1) as the training stream runs them together, ``context_tokens``
    tokens in all (the earliest conversation cut from the left, as a training window starts mid-stream); prompt i's
    context starts at conversation 7i of that pool, so contexts differ."""
    from eagle3.data import kimi_traffic

    rows = kimi_traffic.prompt_ids(tokenizer, conversations(arch, n, seed, sessions=False))  # short prompts
    if not context_tokens:
        return rows
    pool = [rendered(tokenizer, c) for c in conversations(arch, 256, seed + 1)]
    out = []
    for i, (traffic, ids) in enumerate(rows):
        context: list[int] = []
        j = 7 * i
        while len(context) + len(ids) < context_tokens:
            context = pool[j % len(pool)] + context
            j += 1
        out.append((traffic, context[len(context) + len(ids) - context_tokens :] + ids))
    return out
