"""The `eagle3` command: doctor, extract, train, demo, show-mask, verify, eval, bench report, bench disk."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path

from eagle3.interrupt import Interrupted
from eagle3.preflight import ATTENTIONS
from eagle3.targets import learnable_profiles

log = logging.getLogger("eagle3")


def _layer_ids(text: str | None):
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layer-ids wants comma-separated integers, got {text!r}") from None


def _number(kind, low: float | None = None, strict: bool = True, high: float | None = None, what: str = ""):
    """An argparse type: ``kind`` (int or float) in range; the message names the value and the range."""

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        finite = kind is int or math.isfinite(v)
        below = low is not None and (v <= low if strict else v < low)
        if not finite or below or (high is not None and v > high):
            raise argparse.ArgumentTypeError(f"{text} is not {what}")
        return v

    return parse


POSITIVE = _number(int, 0, what="a positive integer")
NON_NEGATIVE = _number(int, 0, strict=False, what="a non-negative integer")
POSITIVE_FLOAT = _number(float, 0, what="a positive finite number")
NON_NEGATIVE_FLOAT = _number(float, 0, strict=False, what="a non-negative finite number")
FRACTION = _number(float, 0, high=1, what="a fraction in (0, 1]")


def _max_len(text: str) -> int:
    v = POSITIVE(text)
    if v < 2:
        raise argparse.ArgumentTypeError(f"{text} is below 2: a sample needs two tokens to predict one")
    return v


def _setup_logging(verbosity: int, models: bool = True) -> None:
    """``models=False``: a command that runs no model (bench): speculators and transformers stay unimported."""
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    os.environ.setdefault("EAGLE3_LOG_LEVEL", logging.getLevelName(level))  # read by vLLM workers
    if not models:
        return
    try:  # speculators logs through loguru at INFO; keep it at our level
        from loguru import logger

        logger.remove()
        logger.add(sys.stderr, level="INFO" if verbosity > 0 else "ERROR")
    except ImportError:
        pass
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def _add_trust(p) -> None:
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let the target's tokenizer and model run the code in its folder (its config's auto_map; Kimi-K2.5 "
        "needs it); only for a folder you trust",
    )


def _add_engine_args(p, gpu_mem: float) -> None:
    """What extracts and what it captures: `extract`'s options, and `train --online`'s for its extraction."""
    p.add_argument("--data", nargs="+", help="JSONL conversations (OpenAI messages or ShareGPT)")
    p.add_argument(
        "--backend",
        choices=["auto", "hf", "vllm"],
        default="auto",
        help="hf: transformers reference (CPU or one GPU); vllm: production engine; auto: vllm where vLLM and a "
        "CUDA GPU are here, else hf (said at the start)",
    )
    p.add_argument("--layer-ids", type=_layer_ids, default=None, help="e.g. 2,30,58,61; default (2, L//2, L-3, L)")
    p.add_argument(
        "--max-len", type=_max_len, default=2048, help="tokens per sample; longer ones follow --long (--online: cut)"
    )
    p.add_argument("--tp", type=POSITIVE, default=1, help="vllm backend tensor parallel size")
    p.add_argument("--gpu-mem", type=FRACTION, default=gpu_mem, help="vllm backend: the engine's share of the GPU")
    _add_trust(p)
    p.add_argument(
        "--state-dtype",
        choices=["bfloat16", "fp8"],
        default="bfloat16",
        help="stored states: bfloat16, or fp8 (e4m3 with a float32 scale per token and layer: half the "
        "bytes, about 3%% relative error)",
    )


# _add_engine_args's options, which train --online shares with extract
ENGINE_ARGS = ("data", "backend", "layer_ids", "max_len", "tp", "gpu_mem", "trust_remote_code", "state_dtype")


def _add_extract_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="target model folder (config.json, weights, tokenizer)")
    p.add_argument("--out", help="store folder (created; rerun the same command, or --resume OUT, to continue)")
    p.add_argument(
        "--resume",
        metavar="STORE",
        default=None,
        help="continue STORE with the target, data and options it recorded (instead of --model, --data "
        "and --out; --batch-size, --device, --tp, --gpu-mem and --no-fsync may still be given)",
    )
    _add_engine_args(p, gpu_mem=0.85)
    p.add_argument("--batch-size", type=POSITIVE, default=64, help="samples per engine call")
    p.add_argument(
        "--long",
        dest="long_rule",
        choices=["truncate", "split", "drop", "error"],
        default="truncate",
        help="samples over --max-len: keep the start, cut into windows, reject, or stop",
    )
    p.add_argument(
        "--on-error",
        choices=["skip", "stop"],
        default="skip",
        help="bad input lines: skip and write them to STORE/rejects.jsonl (default), or stop",
    )
    p.add_argument("--max-samples", type=POSITIVE, default=None, help="stop after this many samples (default: all)")
    p.add_argument(
        "--dedup",
        action="store_true",
        help="drop conversations equal to an earlier one (they are counted in the data line either way)",
    )
    p.add_argument(
        "--run-together",
        action="store_true",
        help="join consecutive samples into samples of up to --max-len tokens, none cut: a draft that reads long "
        "histories of earlier conversations, as long sessions hold",
    )
    p.add_argument(
        "--data-workers",
        type=POSITIVE,
        default=None,
        help="processes that tokenize long conversations (a long one's loss mask costs its length squared); "
        "default: the CPUs less one, at most 16; 1: none",
    )
    p.add_argument(
        "--shard-samples",
        type=POSITIVE,
        default=None,
        help="hf backend: also cut a shard after this many samples (the vllm backend cuts by tokens)",
    )
    p.add_argument("--shard-tokens", type=POSITIVE, default=None, help="tokens per shard (default: ~512 MiB of states)")
    p.add_argument("--device", default="cpu", help="hf backend device")
    p.add_argument(
        "--capture",
        choices=["auto", "hooks", "aux", "direct"],
        default="auto",
        help="vllm capture strategy (auto: direct where vLLM's runner can be wrapped, else aux, "
        "else hooks; see eagle3/extract/vllm_compat.py)",
    )
    p.add_argument("--no-fsync", action="store_true", help="skip fsync (faster; a crash may lose recent shards)")
    p.add_argument(
        "--selfcheck-prompts",
        type=NON_NEGATIVE,
        default=4,
        help="prompts of the final-state self-check run before anything is stored (default 4)",
    )
    p.add_argument(
        "--no-selfcheck",
        action="store_true",
        help="skip the final-state self-check (final norm + lm_head on the captured last state must "
        "reproduce the engine's own next token)",
    )
    r = p.add_argument_group(
        "--regenerate: the target writes each conversation's last assistant turn (or the turn "
        "after a prompt-only conversation), its states captured in the same pass"
    )
    r.add_argument(
        "--regenerate",
        action="store_true",
        help="store prompt + the target's own turn, the loss on the turn only (vllm: one engine pass, "
        "no second prefill; see eagle3/extract/one_pass.py)",
    )
    r.add_argument("--temperature", type=NON_NEGATIVE_FLOAT, default=0.0, help="0 = greedy")
    r.add_argument("--top-p", type=FRACTION, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    r.add_argument(
        "--max-tokens",
        type=POSITIVE,
        default=512,
        help="tokens a turn may run to (less where the sample would pass --max-len)",
    )
    r.add_argument("--seed", type=NON_NEGATIVE, default=0, help="line n draws with seed*1000003 + n (as regenerate)")


def _state_dtype(name: str) -> str:
    return "float8_e4m3fn" if name == "fp8" else name


def _extract_defaults() -> dict:
    p = argparse.ArgumentParser()
    _add_extract_args(p)
    return vars(p.parse_args([]))


def _extract_config(a):
    from eagle3.data.conversations import DataConfig
    from eagle3.extract.extract import ExtractConfig
    from eagle3.extract.one_pass import Generation
    from eagle3.store import recipe

    return ExtractConfig(
        model=a.model,
        out=a.out,
        backend=a.backend,
        layer_ids=a.layer_ids,
        batch_size=a.batch_size,
        data=DataConfig(
            a.data,
            max_len=a.max_len,
            long_rule=a.long_rule,
            on_error=a.on_error,
            max_samples=a.max_samples,
            dedup=a.dedup,
            workers=a.data_workers or 0,
            run_together=a.run_together,
        ),
        shard_samples=a.shard_samples,
        shard_tokens=a.shard_tokens,
        device=a.device,
        tp=a.tp,
        capture=a.capture,
        fsync=not a.no_fsync,
        vllm_kwargs={"gpu_memory_utilization": a.gpu_mem},
        selfcheck=0 if a.no_selfcheck else a.selfcheck_prompts,
        trust_remote_code=a.trust_remote_code,
        recipe=recipe.from_args(a),
        dtype=_state_dtype(a.state_dtype),
        regenerate=Generation(a.temperature, a.top_p, a.max_tokens, a.seed) if a.regenerate else None,
    )


def _int_list(option: str):
    """argparse type: comma-separated integers >= 1, e.g. 1,2,4,8."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(x) for x in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{option} wants comma-separated integers, got {text!r}") from None
        for v in values:
            if v < 1:
                raise argparse.ArgumentTypeError(f"{v} is not a positive integer (in {text!r})")
        return values

    return parse


_tp_list = _int_list("--serve-tp")


def _add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default=None, help="shard store made by `eagle3 extract` (not with --online)")
    p.add_argument("--out", required=True, help="checkpoints and the final draft (OUT/draft)")
    p.add_argument(
        "--target", default=None, help="target folder (default: the one the store came from; --online: required)"
    )
    o = p.add_argument_group("online training: extraction streams into training through a bounded spool")
    o.add_argument(
        "--online",
        action="store_true",
        help="extract --data with --target while training, through a spool of --spool-mb (no store)",
    )
    o.add_argument("--spool", default=None, help="--online: spool folder (default OUT/spool; local disk or /dev/shm)")
    o.add_argument("--spool-mb", type=POSITIVE_FLOAT, default=8192, help="--online: the spool's capacity in MiB")
    o.add_argument("--extract-batch", type=POSITIVE, default=16, help="--online: samples per extraction call and shard")
    o.add_argument("--extract-device", default=None, help="--online, hf backend: device (default: --device)")
    _add_engine_args(o, gpu_mem=0.5)  # extract's options; the trainer uses the GPU's rest
    o.add_argument(
        "--engine-in-process",
        action="store_true",
        help="--online, vllm backend: the engine in this process, not in one of its own (one CUDA context "
        "with the trainer, so their kernels may overlap on the GPU; a --compile'd trainer's compiles "
        "pause the engine: docs/online.md)",
    )
    p.add_argument(
        "--steps", type=POSITIVE, default=None, help="stop after this many optimizer steps (default: epochs)"
    )
    p.add_argument("--epochs", type=POSITIVE, default=1, help="passes over the store (default 1)")
    p.add_argument("--batch", type=POSITIVE, default=8, help="global batch in samples (default 8)")
    p.add_argument("--lr", type=POSITIVE_FLOAT, default=1e-3, help="peak learning rate, cosine to 10%% (default 1e-3)")
    p.add_argument("--ttt-steps", type=POSITIVE, default=3, help="training-time-test steps (default 3)")
    p.add_argument(
        "--pack-tokens",
        type=NON_NEGATIVE,
        default=None,
        help="pack samples into rows of up to this many tokens; 0: one sample per forward (default: 8192 on CUDA, "
        "0 on the CPU)",
    )
    p.add_argument("--draft-vocab", type=POSITIVE, default=32000, help="draft vocabulary size (default 32000)")
    p.add_argument("--device", default="auto", help="cpu, cuda or cuda:N; auto: cuda where there is one, else cpu")
    p.add_argument(
        "--draft-arch",
        choices=["llama", "mla"],
        default="llama",
        help="llama: speculators' layer (Eagle3LlamaForCausalLM); mla: DeepSeek's latent attention + a dense "
        "MLP (Eagle3DeepseekV3ForCausalLM), for DeepseekV3 / Kimi targets",
    )
    p.add_argument(
        "--eagle-3.1",
        dest="eagle31",
        action="store_true",
        help="EAGLE-3.1: --fc-norm and --norm-output (vLLM 0.26 serves both)",
    )
    p.add_argument("--fc-norm", action="store_true", help="an RMSNorm on each aux state before the fusion layer")
    p.add_argument("--norm-output", action="store_true", help="the post-norm state feeds the next draft step")
    p.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16-mixed"],
        default="auto",
        help="bf16-mixed: bf16 matmuls under autocast, float32 weights and optimizer; auto: bf16-mixed on CUDA, "
        "fp32 on the CPU",
    )
    p.add_argument(
        "--attn",
        choices=("auto", *ATTENTIONS),
        default="auto",
        help="the draft's training attention (auto: varlen on CUDA in bf16-mixed, else sdpa): sdpa over "
        "speculators' dense mask; varlen: "
        "flash attention within each packed sample plus each TTT step's own key, no mask (the same "
        "loss and gradients; on CUDA in bf16); flex: speculators' flex attention, a block mask (CUDA, "
        "with --compile)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the draft's forward (speculators compiles it where CUDA is; without this flag "
        "it runs eagerly): minutes of compiling at the first steps and at new sequence lengths, then "
        "faster steps (docs/performance.md)",
    )
    p.add_argument(
        "--export-dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="dtype of the published draft OUT/draft (default bfloat16, what vLLM serves in)",
    )
    p.add_argument(
        "--serve-tp",
        type=_tp_list,
        default=None,
        help="tensor-parallel sizes the draft must load at in vLLM, e.g. 8 (default 1,2,4,8,16); "
        "checked before training and again at export",
    )
    p.add_argument(
        "--draft-heads", type=POSITIVE, default=None, help="draft attention heads (default: from the target)"
    )
    p.add_argument("--draft-kv-heads", type=POSITIVE, default=None, help="draft KV heads (default 8)")
    p.add_argument(
        "--draft-head-dim", type=POSITIVE, default=None, help="draft head dim (default 128/64/32 by hidden size)"
    )
    p.add_argument(
        "--checkpoint-every", type=NON_NEGATIVE, default=0, help="also checkpoint every N steps (default 0: off)"
    )
    p.add_argument(
        "--checkpoint-minutes",
        type=NON_NEGATIVE_FLOAT,
        default=10.0,
        help="checkpoint every this many minutes of work (default 10; 0: off)",
    )
    p.add_argument(
        "--keep-checkpoints", type=NON_NEGATIVE, default=3, help="newest checkpoints kept (default 3; 0: all)"
    )
    p.add_argument(
        "--checkpoint-background",
        choices=["auto", "on", "off"],
        default="auto",
        help="write each checkpoint but the last in a thread while training goes on (auto: on CUDA, where "
        "a Kimi-K2.5 draft's checkpoint is 12 GB)",
    )
    p.add_argument(
        "--on-bad-sample",
        choices=["stop", "skip"],
        default="stop",
        help="a stored sample with a checksum mismatch or NaN/Inf: stop (default) or skip and count it",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--no-resume", action="store_true", help="start over instead of resuming from OUT/checkpoints")
    p.add_argument(
        "--allow-incomplete",
        action="store_true",
        help="train on a store that holds fewer samples than its plan names (an extraction that stopped); "
        "by default that is refused, naming the command that completes it",
    )


def _train_config(a):
    from eagle3.train.train import TrainConfig

    shape = {
        k: v
        for k, v in (
            ("num_attention_heads", a.draft_heads),
            ("num_key_value_heads", a.draft_kv_heads),
            ("head_dim", a.draft_head_dim),
        )
        if v is not None
    }
    store = (a.spool or str(Path(a.out) / "spool")) if a.online else a.store
    return TrainConfig(
        store=store,
        out=a.out,
        target=a.target,
        max_steps=a.steps,
        epochs=a.epochs,
        batch_samples=a.batch,
        lr=a.lr,
        ttt_steps=a.ttt_steps,
        pack_tokens=a.pack_tokens,
        draft_vocab_size=a.draft_vocab,
        device=a.device,
        precision=a.precision,
        fc_norm=a.fc_norm or a.eagle31,
        norm_output=a.norm_output or a.eagle31,
        draft_arch=a.draft_arch,
        export_dtype=a.export_dtype,
        attn_impl=a.attn,
        compile=a.compile,
        serve_tps=a.serve_tp or None,
        shape=shape,
        checkpoint_every=a.checkpoint_every,
        checkpoint_minutes=a.checkpoint_minutes,
        keep_checkpoints=a.keep_checkpoints,
        checkpoint_background={"auto": None, "on": True, "off": False}[a.checkpoint_background],
        on_bad_sample=a.on_bad_sample,
        seed=a.seed,
        resume=not a.no_resume,
        allow_incomplete=a.allow_incomplete,
    )


def _online_extract_config(a, spool: str):
    """train --online's extraction: extract's config builder over its options (_add_engine_args) and extract's
    defaults for the rest; rejected lines go to OUT/rejects.jsonl, nothing is recorded for `extract --resume`."""
    from dataclasses import replace

    shared = {k: getattr(a, k) for k in ENGINE_ARGS}
    own = {"model": a.target, "out": spool, "device": a.extract_device or a.device, "batch_size": a.extract_batch}
    ex = _extract_config(argparse.Namespace(**{**_extract_defaults(), **shared, **own}))
    in_process = {"in_process": True} if a.engine_in_process else {}
    rejects = str(Path(a.out) / "rejects.jsonl")
    return replace(ex, data=replace(ex.data, rejects_path=rejects), vllm_kwargs={**ex.vllm_kwargs, **in_process},
                   recipe=None)  # fmt: skip


def cmd_train_online(a):
    from eagle3 import ownership
    from eagle3.extract import extract
    from eagle3.train import online

    cfg = _train_config(a)
    ownership.claim(a.out, "train")  # before rejects.jsonl is written into it
    ex = _online_extract_config(a, cfg.store)
    samples, report = extract.load_dataset(ex)
    print(f"data       {report.summary()}")
    return online.run(cfg, ex, samples, int(a.spool_mb * 2**20), extract_batch=a.extract_batch)


def cmd_demo(a) -> int:
    """The whole chain on the tiny Kimi-family model and the bundled conversations, on CPU."""
    from eagle3 import ownership
    from eagle3.data import corpus
    from eagle3.data.conversations import DataConfig
    from eagle3.extract import extract
    from eagle3.targets import presets, tiny
    from eagle3.train import train
    from eagle3.train.draft import check_vllm_loadable

    out = ownership.claim(a.out, "demo")
    t0 = time.perf_counter()
    profile = presets.from_name(a.model)
    print(
        f"[1/3] building {profile.name} ({profile.architecture}, {profile.num_hidden_layers} layers, "
        f"hidden {profile.hidden_size}, random weights) in {out / 'model'}",
        flush=True,
    )
    model = tiny.build_model(profile, out / "model", seed=a.seed)
    print(f"[2/3] extracting layers {list(profile.layer_ids)} of {corpus.BUNDLED.name} -> {out / 'store'}", flush=True)
    ecfg = extract.ExtractConfig(
        model=str(model),
        out=str(out / "store"),
        batch_size=16,
        data=DataConfig([str(corpus.BUNDLED)], max_len=a.max_len, max_samples=a.samples),
        shard_samples=64,
    )
    es = extract.run(ecfg, progress=not a.quiet)
    print(f"[3/3] training the EAGLE-3 draft -> {out / 'train'}", flush=True)
    tcfg = train.TrainConfig(
        store=str(out / "store"),
        out=str(out / "train"),
        draft_vocab_size=512,
        batch_samples=8,
        epochs=a.epochs,
        max_steps=a.steps,
        lr=3e-3,
        seed=a.seed,
        checkpoint_every=25,
        restart_hint=f"remove {out} to start over",
    )
    tr = train.train(tcfg, progress=not a.quiet)
    draft_cfg = json.loads((Path(tr.draft) / "config.json").read_text())
    problems = check_vllm_loadable(draft_cfg)
    print("\n== eagle3 demo summary ==")
    for line in es.lines() + tr.lines():
        print(line)
    print(f"loss curve {' '.join(f'{x:.3f}' for x in tr.losses[:: max(1, len(tr.losses) // 8)])}")
    print(f"vllm check {'draft config loadable by vLLM speculators loader' if not problems else problems}")
    print(f"wall time  {time.perf_counter() - t0:.1f} s")
    return 1 if problems else 0


def cmd_show_mask(a) -> int:
    """Each sample of --data: the counts line, then the rendered text with its trained tokens marked (or JSON)."""
    from transformers import AutoTokenizer

    from eagle3.data import mask_view
    from eagle3.data.conversations import check_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(a.model, trust_remote_code=a.trust_remote_code)
    check_tokenizer(tokenizer, f"{a.model} (tokenizer)")
    color = a.color == "always" or a.color == "auto" and sys.stdout.isatty()
    bad = 0
    for s in mask_view.samples(tokenizer, a.data, a.line):
        if isinstance(s, Exception):
            bad += 1
            print(f"skipped    {s}", file=sys.stderr)
        elif a.json:
            print(json.dumps(s.to_json(), ensure_ascii=False))
        else:
            print(f"== {s.summary()}\n{s.marked(color)}\n")
    return 1 if bad else 0


def cmd_verify(a) -> int:
    from eagle3.store import verify

    rep = verify.verify(a.store, deep=not a.quick)
    for line in rep.lines():
        print(line)
    fixed = a.fix and not rep.ok
    if fixed:
        moved = verify.fix(a.store, rep)
        print(f"quarantined {len(moved)} shard(s) to {Path(a.store) / 'quarantine'}")
    for line in verify.repair_lines(a.store, rep, fixed):
        print(line)
    ok = rep.ok
    if a.semantic:
        from eagle3.extract.extract import check_store
        from eagle3.store.folder import read_manifest

        model = a.model or read_manifest(a.store)["spec"]["target"]["name_or_path"]
        result = check_store(a.store, model, a.backend, a.semantic_samples, a.device)
        print(result.line())
        ok = ok and result.ok
    return 0 if ok else 1


def cmd_eval_server(a) -> int:
    from eagle3 import ownership
    from eagle3.serve import server_eval

    with open(a.prompts) as f:
        conversations = [json.loads(line) for line, _ in zip(f, range(a.num_prompts))]
    try:
        with ownership.claimed(a.out, "eval") as out:  # nothing measured: no folder left behind
            report = server_eval.measure(a.server, conversations, a.max_tokens, a.served_model)
            (out / "eval.md").write_text("\n".join(report.lines()) + "\n")
            (out / "eval.json").write_text(json.dumps(dataclasses.asdict(report), indent=1))
    except server_eval.ServerError as e:
        where = f"{a.prompts} line {e.index + 1}: " if e.index is not None else ""
        print(f"eagle3 eval: {where}{e}", file=sys.stderr)
        return 1
    print("\n".join(report.lines()))
    return 0


def cmd_eval_each_k(a) -> int:
    """`eval --k 3,4,5`: an engine and a report for each k, in EVAL/kK, then the acceptance at each."""
    from dataclasses import replace

    from eagle3 import ownership
    from eagle3.serve import evaluate

    out, cfg, lines = ownership.claim(a.out, "eval"), _eval_config(a), []
    for k in a.k:
        report = evaluate.run(replace(cfg, k=k, out=str(out / f"k{k}")))
        d = report.draft
        lines.append(f"k {k}: acceptance length {d.acceptance_length:.3f} +- {d.acceptance_se:.3f} ({out / f'k{k}'})")
    print("\n".join(lines))
    (out / "eval.md").write_text("\n".join(lines) + "\n")
    return 0


def cmd_eval(a) -> int:
    from eagle3.serve import evaluate

    if a.server:
        return cmd_eval_server(a)
    if len(a.k) > 1:
        return cmd_eval_each_k(a)
    report = evaluate.run(_eval_config(a))
    for line in report.lines():
        print(line)
    return 0


def cmd_make_target(a) -> int:
    from eagle3.targets import learnable

    if a.source:
        from eagle3.targets import int4

        counts = int4.quantize_target(a.source, a.out)
        print(f"target     {a.out}: {a.source} with {counts['quantized']} routed expert weights in INT4, "
              f"{counts['kept']} tensors in bf16")  # fmt: skip
        return 0
    try:
        info = learnable.make_target(
            a.out, steps=a.steps, device=a.device, arch=a.arch, progress=True, quantize=a.quantize
        )
    except learnable.TooSlow as e:
        return _fail(a, e)
    prof = learnable.ARCHES[a.arch]
    print(
        f"target     {a.out} ({prof.name}: {prof.architecture}, hidden {prof.hidden_size}, {prof.num_hidden_layers} "
        f"layers) trained {info['steps']} steps in {info['seconds']} s; loss {info['first_loss']:.3f} -> "
        f"{info['final_loss']:.3f}" + (f"; routed experts in {a.quantize.upper()}" if a.quantize else "")
    )
    return 0


def _regen_config(a):
    from eagle3.extract.regenerate import RegenConfig

    return RegenConfig(
        target=a.target,
        data=a.data,
        out=a.out,
        backend=a.backend,
        device=a.device,
        tp=a.tp,
        mode=a.mode,
        temperature=a.temperature,
        top_p=a.top_p,
        max_tokens=a.max_tokens,
        seed=a.seed,
        max_samples=a.max_samples,
        batch_size=a.batch_size,
        trust_remote_code=a.trust_remote_code,
    )


def _eval_config(a):
    from eagle3.serve import evaluate

    return evaluate.EvalConfig(
        target=a.target,
        draft=a.draft,
        prompts=a.prompts,
        out=a.out,
        k=a.k[0],
        max_tokens=a.max_tokens,
        num_prompts=a.num_prompts,
        gpu_memory_utilization=a.gpu_mem,
        tp=a.tp,
        trust_remote_code=a.trust_remote_code,
        shifted=not a.no_shifted,
        baseline=not a.no_baseline,
        cuda_graphs=a.cuda_graphs,
        long_prompts=a.long_prompts,
        long_context=a.long_context,
    )


def cmd_regenerate(a) -> int:
    from eagle3 import faults
    from eagle3.extract import regenerate

    cfg = _regen_config(a)
    summary = regenerate.run(cfg, fault=faults.from_env())
    print(f"{summary.line()}\nout        {cfg.out} (settings: {cfg.out}.regen.json)")
    return 0


def cmd_bench_report(a) -> int:
    from eagle3 import bench

    md, png = bench.report(a.history, a.out, baselines_dir=a.baselines)
    print(f"wrote {md}, {png} and {png.with_name('throughput-latest.png')}")
    if a.update_baselines:
        for path in bench.update_baselines(a.history, a.baselines or bench.BASELINES):
            print(f"baseline   {path}")
    return 0


def cmd_bench_disk(a) -> int:
    from eagle3.preflight import UsageError
    from eagle3.store import bandwidth
    from eagle3.store.threads import writer_threads

    for fsync, name, what in ((True, "fsync", "a store"), (False, "page cache", "a --no-fsync store")):
        writers = a.writers or writer_threads(fsync)  # default: as many as the store writes with
        print(
            f"disk       {a.dir}: {writers} writers x {a.files} files x {a.file_mb} MiB a round (the store's "
            f"writes, {name}), {a.rounds} timed rounds after a warm-up"
        )
        try:
            fig = bandwidth.measure(a.dir, fsync, writers, a.files, a.file_mb << 20, a.rounds)
        except OSError as e:
            raise UsageError(
                f"writing test files into {a.dir}: {e}. Free space there, or give a smaller --file-mb "
                "or fewer --writers"
            ) from e
        bps = fig.bytes_per_s
        print(
            f"{name:10s} {bps / 1e9:,.2f} GB/s = {bps / a.bytes_per_token:,.0f} tok/s at {a.bytes_per_token:,} B a "
            f"token: the most {what} can write here, however fast the GPUs"
        )
    return 0


class _Help(argparse.HelpFormatter):
    """Every option's help ends with its default unless the text already states it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" not in text and action.default not in (None, False, argparse.SUPPRESS) and action.option_strings:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagle3", description="EAGLE-3 drafts for large targets with vLLM", formatter_class=_Help
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v info, -vv debug (workers too)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    doc = sub.add_parser(
        "doctor",
        formatter_class=_Help,
        help="versions, GPUs, and whether the installed vLLM is supported (about a second)",
    )
    doc.add_argument("--deep", action="store_true", help="also import every module the pipeline needs (seconds)")
    _add_extract_args(
        sub.add_parser("extract", formatter_class=_Help, help="capture target hidden states into a shard store")
    )
    _add_train_args(
        sub.add_parser("train", formatter_class=_Help, help="train an EAGLE-3 draft on a store (torchrun for DDP)")
    )
    d = sub.add_parser(
        "demo", formatter_class=_Help, help="tiny Kimi-family model + bundled data: extract and train on CPU"
    )
    d.add_argument("--out", default="runs/demo", help="folder for the model, store and draft")
    d.add_argument("--model", default="tiny-kimi", help="a buildable preset: tiny-kimi or tiny-llama")
    d.add_argument("--samples", type=POSITIVE, default=None, help="bundled conversations used (default: all 300)")
    d.add_argument("--max-len", type=_max_len, default=256, help="tokens per sample")
    d.add_argument("--epochs", type=POSITIVE, default=3, help="training passes over the store")
    d.add_argument("--steps", type=POSITIVE, default=None, help="stop training after this many steps (default: epochs)")
    d.add_argument("--seed", type=int, default=0, help="seed of the model's weights and of training")
    d.add_argument("--quiet", action="store_true", help="no progress bars")
    sm = sub.add_parser(
        "show-mask",
        formatter_class=_Help,
        help="a conversation file as the target renders it, the tokens the draft trains on marked",
    )
    sm.add_argument("--model", required=True, help="target folder (its tokenizer and chat template)")
    _add_trust(sm)
    sm.add_argument("--data", required=True, help="JSONL conversations")
    sm.add_argument("--line", type=POSITIVE, default=None, help="only this line of --data (the first is 1)")
    sm.add_argument(
        "--json",
        action="store_true",
        help="one JSON object a sample: ids, mask, each token's turn role, counts (for scripts)",
    )
    sm.add_argument(
        "--color",
        choices=["auto", "always", "never"],
        default="auto",
        help="trained tokens in colour on a terminal (auto), else between [[ and ]]",
    )
    v = sub.add_parser(
        "verify", formatter_class=_Help, help="check a store: checksums, shapes, NaN/zero/duplicate layers, ids"
    )
    v.add_argument("store", help="store folder made by `eagle3 extract`")
    v.add_argument("--fix", action="store_true", help="quarantine bad shards so a resumed extract redoes them")
    v.add_argument("--quick", action="store_true", help="skip checksums and per-sample value checks")
    v.add_argument(
        "--semantic",
        action="store_true",
        help="also run the final-state self-check on stored samples (needs --model): the target's final "
        "norm + lm_head on each stored last state must reproduce the target's own next-token logprobs",
    )
    v.add_argument("--model", default=None, help="target folder for --semantic (default: the one the store names)")
    v.add_argument("--backend", choices=["hf", "vllm"], default="hf", help="what runs the target for --semantic")
    v.add_argument("--device", default="cpu", help="hf backend device for --semantic (default cpu)")
    v.add_argument(
        "--semantic-samples", type=POSITIVE, default=8, help="stored samples checked by --semantic (default 8)"
    )
    e = sub.add_parser(
        "eval", formatter_class=_Help, help="serve target + draft in vLLM; acceptance length and speedup"
    )
    e.add_argument("--target", help="target model folder (not with --server)")
    e.add_argument("--draft", help="draft folder (OUT/draft of `eagle3 train`; not with --server)")
    e.add_argument(
        "--server",
        metavar="URL",
        default=None,
        help="measure a running OpenAI-compatible vLLM server instead (e.g. http://localhost:8000): --prompts "
        "through its chat completions, acceptance from its /metrics counters before and after each prompt",
    )
    e.add_argument("--served-model", default=None, help="--server: the model name to ask for (default: its first)")
    e.add_argument("--tp", type=POSITIVE, default=1, help="tensor-parallel size of the engine eval starts")
    _add_trust(e)
    e.add_argument(
        "--prompts",
        default=None,
        help="JSONL conversations, prompted up to their last assistant turn (default: the learnable "
        "target's held-out prompts)",
    )
    e.add_argument("--out", required=True, help="folder for eval.json and eval.md")
    e.add_argument(
        "--k",
        type=_int_list("--k"),
        default=(3,),
        help="draft tokens per step (num_speculative_tokens); several (3,4,5): an engine and a report for each, "
        "in EVAL/k3, EVAL/k4, ... and the acceptance at each said together",
    )
    e.add_argument("--max-tokens", type=POSITIVE, default=128, help="tokens generated per prompt")
    e.add_argument("--num-prompts", type=POSITIVE, default=64, help="prompts evaluated")
    e.add_argument("--gpu-mem", type=FRACTION, default=0.3, help="vLLM gpu_memory_utilization")
    e.add_argument("--no-shifted", action="store_true", help="skip the layer-ids-shifted-by-one run")
    e.add_argument("--no-baseline", action="store_true", help="skip the target-only run")
    e.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="serve as production does (torch.compile and CUDA graphs); default eager",
    )
    e.add_argument(
        "--long-prompts",
        type=NON_NEGATIVE,
        default=0,
        help="then, in the same engine, this many of a learnable target's held-out prompts, each made "
        "--long-context tokens long by earlier conversations before it (acceptance reported apart)",
    )
    e.add_argument(
        "--long-context",
        type=_int_list("--long-context"),
        default=(4096,),
        help="tokens of a long prompt in all: earlier conversations, then the held-out prompt; several "
        "(4096,8192,16384): --long-prompts prompts at each length, in the same engine",
    )
    m = sub.add_parser(
        "make-target",
        formatter_class=_Help,
        help="train a learnable tiny target, Llama or DeepseekV3 (a minute or a few on a GPU)",
    )
    m.add_argument(
        "--arch",
        choices=list(learnable_profiles.ARCHES),
        default="llama",
        help="llama (hidden 256, 8 layers) or deepseek (DeepseekV3: Kimi's MLA latent sizes, MoE 8 experts "
        "top-2 + 1 shared, first layer dense; hidden 256, 8 layers); deepseek-long: the same with Kimi's YaRN "
        "over 32k positions, trained on 16k-token windows with long agentic sessions",
    )
    m.add_argument("--out", required=True, help="folder for the trained target")
    m.add_argument("--steps", type=POSITIVE, default=1500, help="training steps of the target")
    m.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    m.add_argument(
        "--quantize",
        choices=["int4"],
        default=None,
        help="int4: the routed experts written as Kimi-K2.5 ships them (compressed-tensors pack-quantized, group 32, "
        "symmetric; attention, shared experts and the dense MLP in bf16), served by vLLM's WNA16 MoE kernels",
    )
    m.add_argument(
        "--from",
        dest="source",
        default=None,
        metavar="TARGET",
        help="with --quantize: quantize this trained target (a make-target folder) instead of training one, so "
        "both numeric forms hold the same weights",
    )
    g = sub.add_parser(
        "regenerate",
        formatter_class=_Help,
        help="the target writes the assistant turns itself (resumable; never overwrites)",
    )
    g.add_argument("--target", required=True, help="the target model folder (its tokenizer and chat template)")
    _add_trust(g)
    g.add_argument("--data", required=True, help="JSONL conversations")
    g.add_argument("--out", required=True, help="JSONL to write; rerun the same command to resume it")
    g.add_argument("--backend", choices=["hf", "vllm"], default="hf", help="hf: transformers; vllm: the engine")
    g.add_argument("--device", default="cpu", help="hf backend device")
    g.add_argument("--tp", type=POSITIVE, default=1, help="vllm backend tensor parallel size")
    g.add_argument(
        "--mode",
        choices=["all", "last"],
        default="all",
        help="all: every assistant turn, each on the regenerated history; last: the last turn only, the "
        "earlier ones written with weight 0 (the data's words: context, not learned)",
    )
    g.add_argument("--temperature", type=NON_NEGATIVE_FLOAT, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=FRACTION, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    g.add_argument("--max-tokens", type=POSITIVE, default=512, help="tokens a turn may run to")
    g.add_argument("--seed", type=NON_NEGATIVE, default=0, help="line n samples with seed*1000003 + n")
    g.add_argument("--max-samples", type=POSITIVE, default=None, help="stop after this many conversations")
    g.add_argument(
        "--batch-size",
        type=POSITIVE,
        default=64,
        help="conversations an engine call serves (a killed run redoes at most one batch)",
    )
    b = sub.add_parser("bench", formatter_class=_Help, help="benchmark reports")
    bsub = b.add_subparsers(dest="bench_cmd", required=True)
    r = bsub.add_parser(
        "report", formatter_class=_Help, help="Markdown table + PNG plot from pytest-benchmark JSON history"
    )
    r.add_argument("--history", nargs="+", required=True, help="benchmark JSON files or folders")
    r.add_argument("--out", required=True, help="folder for throughput.md and the PNG")
    r.add_argument("--baselines", default=None, help="folder of per-profile baseline JSON (default: bundled)")
    r.add_argument(
        "--update-baselines",
        action="store_true",
        help="write each profile's newest run into the baselines folder (--baselines, else the bundled one)",
    )
    d = bsub.add_parser(
        "disk",
        formatter_class=_Help,
        help="what a disk can take from the store: its parallel writes timed, fsynced and not",
    )
    d.add_argument("--dir", required=True, help="a folder on the disk the store will use (test files are removed)")
    d.add_argument(
        "--writers",
        type=POSITIVE,
        default=None,
        help="parallel writers (default: the store's own, 4 fsynced and 8 into the page cache)",
    )
    d.add_argument("--files", type=POSITIVE, default=4, help="files each writer writes a round")
    d.add_argument("--file-mb", type=POSITIVE, default=512, help="MiB a file (the store's shard size)")
    d.add_argument("--rounds", type=POSITIVE, default=2, help="timed rounds (their median counts), after one warm-up")
    d.add_argument(
        "--bytes-per-token",
        type=POSITIVE,
        default=57344,
        help="a stored token's bytes: layers x hidden x 2 (bf16), half with --state-dtype fp8; Kimi-K2.5: 4 x 7168 x 2",
    )
    return parser


# the kind of folder each command's --out is (eagle3/ownership.py); extract's is a store (store/checks.py)
OUT_KIND = {"train": "train", "eval": "eval", "make-target": "target", "demo": "demo", "bench report": "bench"}


def preflight(a) -> None:
    """Argument and environment checks that need no model, torch or vLLM: under a second, nothing created."""
    from eagle3 import machine, ownership
    from eagle3 import preflight as pf
    from eagle3.store import checks

    kind = OUT_KIND.get(f"bench {a.bench_cmd}" if a.cmd == "bench" else a.cmd)
    if kind:  # first: a user's folder is named even where the command could not run here anyway
        ownership.check(a.out, kind)
    if a.cmd == "train" and a.online and a.spool:
        ownership.check(a.spool, "store", "--spool")
    if a.cmd == "extract":
        if a.resume:
            from eagle3.store import recipe

            defaults = _extract_defaults()
            recipe.resume(a, defaults)
            print(f"resuming: {recipe.command(a.out, recipe.from_args(a), defaults)}", file=sys.stderr)
        a.backend, why = machine.extract_backend(a.backend)
        print(f"extract: {why}", file=sys.stderr)
        missing = [f"--{k}" for k in ("model", "data", "out") if not getattr(a, k)]
        if missing:
            raise pf.UsageError(f"extract needs {', '.join(missing)} (or --resume STORE to continue a store)")
        folder = pf.model_folder(
            a.model, tokenizer=True, weights=a.backend == "hf", trust_remote_code=a.trust_remote_code
        )
        pf.data_files(a.data)
        checks.output_store(a.out, "extract")
        if a.layer_ids:
            from eagle3.targets.layers import validate_layer_ids
            from eagle3.targets.presets import read_model_config

            cfg = read_model_config(folder)
            validate_layer_ids(a.layer_ids, int((cfg.get("text_config") or cfg)["num_hidden_layers"]))
        if a.regenerate and a.backend == "vllm" and a.capture == "aux":
            raise pf.UsageError(
                "extract --regenerate --capture aux: the aux capture runs as a drafter, which sees no "
                "decode step's states; use --capture direct or hooks (or auto)"
            )
        if a.backend == "vllm":
            pf.vllm_installed("extract --backend vllm")
            pf.cuda_available("extract --backend vllm")
        elif a.device.startswith("cuda"):
            pf.cuda_available(f"extract --device {a.device}")
    elif a.cmd == "regenerate":
        from eagle3.extract import regenerate

        pf.model_folder(a.target, tokenizer=True, weights=a.backend == "hf", trust_remote_code=a.trust_remote_code)
        pf.data_files([a.data])
        regenerate.check_output(_regen_config(a))
        if a.backend == "vllm":
            pf.vllm_installed("regenerate --backend vllm")
            pf.cuda_available("regenerate --backend vllm")
        elif a.device.startswith("cuda"):
            pf.cuda_available(f"regenerate --device {a.device}")
    elif a.cmd == "train":
        choice = machine.train_choice(a.device, a.precision, a.attn, a.pack_tokens, a.compile)
        a.device, a.precision, a.attn, a.pack_tokens = choice.device, choice.precision, choice.attn, choice.pack_tokens
        if a.online:
            a.backend, why = machine.extract_backend(a.backend)
            print(f"train --online: extraction {why}", file=sys.stderr)
            missing = [f for f, v in (("--target", a.target), ("--data", a.data)) if not v]
            if missing or a.store:
                raise pf.UsageError(
                    f"train --online extracts as it trains: it needs {' and '.join(missing)}"
                    if missing
                    else "train --online makes no use of --store (it reads a spool)"
                )
            pf.model_folder(
                a.target,
                weights=a.backend == "hf",
                tokenizer=True,
                what="--target",
                trust_remote_code=a.trust_remote_code,
            )
            pf.data_files(a.data)
            if a.backend == "vllm":
                pf.vllm_installed("train --online --backend vllm")
            elif a.engine_in_process:
                raise pf.UsageError(
                    "--engine-in-process places vLLM's engine: it needs --backend vllm (the hf "
                    "backend always extracts in this process)"
                )
        elif a.engine_in_process:
            raise pf.UsageError("--engine-in-process is for train --online --backend vllm")
        elif not a.store:
            raise pf.UsageError("train needs --store STORE (made by `eagle3 extract`), or --online --target T --data D")
        else:
            pf.store_folder(a.store)
            checks.store_trainable(a.store, a.allow_incomplete)
        if a.target:
            pf.model_folder(a.target, weights=True, what="--target")
        pf.train_attention(a.attn, a.compile, a.device)
        if a.device.startswith("cuda"):
            pf.cuda_available(f"train --device {a.device}")
    elif a.cmd == "make-target":
        _preflight_make_target(a)
    elif a.cmd == "show-mask":
        pf.model_folder(a.model, tokenizer=True, trust_remote_code=a.trust_remote_code)
        pf.data_files([a.data])
    elif a.cmd == "verify":
        pf.store_folder(a.store)
        if a.fix:
            checks.store_not_busy(a.store, "verify --fix")
    elif a.cmd == "demo":
        checks.output_store(Path(a.out) / "store", "demo")
    elif a.cmd == "eval" and a.server:
        if not a.prompts:
            raise pf.UsageError("eval --server sends --prompts (JSONL conversations) to the server: give --prompts")
        if a.target or a.draft:
            raise pf.UsageError(
                "eval --server measures the server's own target and draft: leave --target and --draft out"
            )
        pf.data_files([a.prompts])
    elif a.cmd == "eval":
        missing = [f for f, v in (("--target", a.target), ("--draft", a.draft)) if not v]
        if missing:
            raise pf.UsageError(f"eval needs {' and '.join(missing)} (or --server URL to measure a running server)")
        if a.long_prompts and a.prompts:
            raise pf.UsageError(
                f"--long-prompts makes long-context prompts from a learnable target's (make-target) "
                f"held-out conversations; with --prompts {a.prompts}, put the context in the file's "
                "conversations and leave --long-prompts out"
            )
        pf.vllm_installed("eval")
        pf.model_folder(a.target, weights=True, tokenizer=True, what="--target", trust_remote_code=a.trust_remote_code)
        pf.model_folder(a.draft, weights=True, what="--draft")
        pf.cuda_available("eval")
    elif a.cmd == "bench" and a.bench_cmd == "disk":
        from eagle3.store.threads import writer_threads

        writers = max(writer_threads(True), writer_threads(False)) if a.writers is None else a.writers  # the most
        pf.disk_test_folder(a.dir, writers, a.files, a.file_mb, a.rounds, a.bytes_per_token)
    elif a.cmd == "bench":
        missing = [h for h in a.history if not Path(h).exists()]
        if missing:
            raise pf.UsageError(
                f"--history {' '.join(missing)}: no such file or folder; give the benchmark JSON "
                "written by pytest --benchmark-json, or a folder of them"
            )


def _preflight_make_target(a) -> None:
    from eagle3 import preflight as pf

    if a.source and not a.quantize:
        raise pf.UsageError("--from TARGET is the target --quantize quantizes: add --quantize int4")
    if a.quantize and not a.source:
        learnable_profiles.experts_to_quantize(a.arch)
    if a.source:
        pf.model_folder(a.source, weights=True, tokenizer=True, what="--from")
    if a.quantize:
        pf.compressed_tensors_installed("make-target --quantize int4")


def _fail(a, e: Exception) -> int:
    if a.verbose >= 2:
        raise e
    print(f"eagle3 {a.cmd}: error: {e}", file=sys.stderr)
    return 2


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


def interrupted_line(a, e: BaseException | None = None) -> str:
    """The one line a SIGINT/SIGTERM ends a command with: what is safe, and how to continue. JSON only."""
    from eagle3.store import status

    if a.cmd == "extract" and a.out:
        return f"interrupted: {status.stored(a.out)} stored in {a.out}; rerun the same command to resume"
    if a.cmd in ("train", "demo"):
        saved = getattr(e, "saved", None)
        if saved is not None:
            return (
                f"interrupted: saved a checkpoint of step {int(saved.name.split('-')[1])} in {saved.parent.parent} "
                "(the step in progress finished first); rerun the same command to resume from it"
            )
        root = Path(a.out) / ("train" if a.cmd == "demo" else "")
        steps = (
            sorted(int(p.name.split("-")[1]) for p in (root / "checkpoints").glob("step-*"))
            if (root / "checkpoints").is_dir()
            else []
        )
        if steps:
            return (
                f"interrupted: the newest checkpoint in {root} is at step {steps[-1]}; rerun the same command to "
                "resume from it"
            )
        return (
            f"interrupted before training's first step finished: nothing to resume in {root}; rerun the same "
            "command to start"
        )
    return "interrupted; nothing was left half-written: rerun the same command"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None:  # the command itself (not a test calling main): SIGTERM ends it like Ctrl-C, in one line
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _raise_interrupted)
    try:
        return _main(args)
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while the line is written changes nothing
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(interrupted_line(args, e), file=sys.stderr, flush=True)
        return 128 + signum


def _main(args) -> int:
    from eagle3.data.conversations import DataError
    from eagle3.preflight import UsageError
    from eagle3.store.lock import StoreBusy
    from eagle3.targets.layers import LayerIdError

    try:
        preflight(args)
    except (UsageError, LayerIdError, DataError, StoreBusy) as e:
        return _fail(args, e)
    _setup_logging(args.verbose, models=args.cmd != "bench")
    if args.cmd == "doctor":
        from eagle3 import doctor

        return doctor.main(["--deep"] if args.deep else [])
    if args.cmd == "bench":  # needs no torch: its refusals come in well under a second
        try:
            return cmd_bench_disk(args) if args.bench_cmd == "disk" else cmd_bench_report(args)
        except UsageError as e:
            return _fail(args, e)
    from eagle3.extract.selfcheck import SelfCheckFailed
    from eagle3.store.format import StoreError
    from eagle3.train.checkpoint import NonFiniteWeights
    from eagle3.train.draft import DraftShapeError
    from eagle3.train.train import TrainingDiverged

    try:
        if args.cmd == "extract":
            from eagle3.extract import extract

            summary = extract.run(_extract_config(args))
            print("\n".join(summary.lines()))
            return 0
        if args.cmd == "train" and args.online:
            result = cmd_train_online(args)
            print("\n".join(result.lines()))
            return 0
        if args.cmd == "train":
            from eagle3.train import train

            result = train.train(_train_config(args))
            print("\n".join(result.lines()))
            return 0
        if args.cmd == "demo":
            return cmd_demo(args)
        if args.cmd == "verify":
            return cmd_verify(args)
        if args.cmd == "show-mask":
            return cmd_show_mask(args)
        if args.cmd == "eval":
            return cmd_eval(args)
        if args.cmd == "make-target":
            return cmd_make_target(args)
        if args.cmd == "regenerate":
            return cmd_regenerate(args)
    except (
        DataError,
        StoreError,
        LayerIdError,
        DraftShapeError,
        TrainingDiverged,
        NonFiniteWeights,
        UsageError,
        SelfCheckFailed,
        StoreBusy,
    ) as e:
        return _fail(args, e)
    return 2


if __name__ == "__main__":
    sys.exit(main())
