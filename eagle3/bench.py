"""Throughput records, baselines per hardware profile, regression checks, `eagle3 bench report`.

A record is one pytest-benchmark entry whose extra_info holds: key ("mode/BxT"), mode, batch, seq_len,
tokens_per_s, profile (hardware profile name), and optionally bytes_per_s, gpu_mem_gib, vllm.
Baselines (eagle3/bundled/baselines/*.json) give tokens/s per key for a hardware profile and the
margin below which a run counts as a regression.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from eagle3 import ownership

BASELINES = Path(__file__).parent / "bundled" / "baselines"


@dataclass
class Record:
    run: str  # when (pytest-benchmark datetime)
    profile: str  # hardware profile
    key: str  # mode/BxT
    tokens_per_s: float
    extra: dict


def load_baselines(folder: str | Path | None = None) -> dict[str, dict]:
    folder = Path(folder) if folder else BASELINES
    return {json.loads(p.read_text())["profile"]: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def regression(record: Record, baselines: dict[str, dict], disks: dict[str, float] | None = None) -> str | None:
    """A message when the record is more than the profile's margin below its baseline, else None. A disk-bound
    figure (disk_of) is read at ``disks``, its run's disk bandwidth ({"fsync" | "page_cache": bytes/s}): where
    that is below the baseline's own (its ``disk_bytes_per_s``), the baseline scales down with it. A slower disk
    is the host's, not a regression; a faster one leaves the baseline as it is."""
    base = baselines.get(record.profile)
    if not base or record.key not in base["tokens_per_s"]:
        return None
    want = base["tokens_per_s"][record.key]
    kind = disk_of(record.key.split("/")[0])
    now, then = (disks or {}).get(kind), base.get("disk_bytes_per_s", {}).get(kind)
    scaled = ""
    if now and then and now < then:
        want *= now / then
        scaled = f" scaled to this run's {kind} bandwidth ({now / 1e9:.2f} of {then / 1e9:.2f} GB/s)"
    floor = want * (1 - base.get("margin", 0.1))
    if record.tokens_per_s < floor:
        return (
            f"{record.profile} {record.key}: {record.tokens_per_s:,.0f} tok/s is below the baseline "
            f"{want:,.0f}{scaled} minus {base.get('margin', 0.1):.0%} ({floor:,.0f})"
        )
    return None


def _files(paths: Iterable[str | Path]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        out += sorted([*p.rglob("*.json"), *p.rglob("*.json.gz")]) if p.is_dir() else [p]
    return out


def read_json(path: Path):
    """A JSON file, or a gzipped one (results/ keeps pytest-benchmark JSON as FILE.json.gz)."""
    import gzip

    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if path.name.endswith(".gz") else raw)


def _entries(paths: Iterable[str | Path]) -> Iterator[tuple[str, dict]]:
    """(run, extra_info) of every pytest-benchmark entry in the files (folders: every JSON or JSON.gz below
    them)."""
    for f in _files(paths):
        try:
            data = read_json(f)
        except (OSError, ValueError):
            continue
        for b in data.get("benchmarks", []) if isinstance(data, dict) else []:
            yield data.get("datetime", f.stem), b.get("extra_info") or {}


def load_history(paths: Iterable[str | Path]) -> list[Record]:
    records = [
        Record(run, info.get("profile", "?"), info["key"], float(info["tokens_per_s"]), info)
        for run, info in _entries(paths)
        if "tokens_per_s" in info and "key" in info
    ]
    return sorted(records, key=lambda r: (r.run, r.profile, r.key))


# A mode measured through --capture direct is named MODE_direct: the same sink as MODE (measured through aux).
DIRECT_SUFFIX = "_direct"


def split_mode(mode: str) -> tuple[str, str]:
    """(sink, capture strategy) of a benchmark mode: "store_nofsync_direct" -> ("store_nofsync", "direct")."""
    return (mode.removesuffix(DIRECT_SUFFIX), "direct") if mode.endswith(DIRECT_SUFFIX) else (mode, "aux")


# which of the run's disk figures bounds a mode: the fsynced stores by fsynced parallel writes, the writers that
# leave their data in the page cache (ours without fsync, vLLM's extract_hidden_states connector) by page-cache writes
DISK_OF_MODE = {"store_nofsync": "page_cache", "vllm_ehs": "page_cache"}


def disk_of(mode: str) -> str | None:
    sink = split_mode(mode)[0]
    return DISK_OF_MODE.get(sink, "fsync" if sink.startswith("store") else None)


def disk_limit(plain: float | None, disk_bytes_per_s: float | None, bytes_per_token: float) -> float | None:
    """Tokens/s a disk-bound mode can reach: plain prefill's, or what the disk writes at bytes_per_token a token
    (None when either was not measured)."""
    return min(plain, disk_bytes_per_s / bytes_per_token) if plain and disk_bytes_per_s else None


def load_disks(paths: Iterable[str | Path]) -> dict[tuple[str, str], dict[str, float]]:
    """(run, profile) -> {"fsync" | "page_cache": bytes/s} from the runs' disk benchmarks (key disk_KIND/...)."""
    disks: dict[tuple[str, str], dict[str, float]] = {}
    for run, info in _entries(paths):
        key = str(info.get("key", ""))
        if key.startswith("disk_") and "bytes_per_s" in info:
            disks.setdefault((run, info.get("profile", "?")), {})[key[5:].split("/")[0]] = float(info["bytes_per_s"])
    return disks


def plain_rates(records: list[Record]) -> dict[tuple[str, str, str], float]:
    """(run, profile, shape) -> plain prefill's tokens/s: what every figure of that run and shape is read against."""
    return {(r.run, r.profile, r.key.split("/")[1]): r.tokens_per_s for r in records if r.key.startswith("plain/")}


def limits(records: list[Record], disks: dict[tuple[str, str], dict[str, float]]) -> dict[tuple, tuple]:
    """(run, profile, key) -> (limit tok/s, disk kind, disk bytes/s, bytes per token) for each disk-bound record
    whose run measured plain prefill of its shape and that disk."""
    plain = plain_rates(records)
    out = {}
    for r in records:
        mode, _, shape = r.key.partition("/")
        kind, bpt = disk_of(mode), r.extra.get("bytes_per_token")
        disk = disks.get((r.run, r.profile), {}).get(kind) if kind else None
        limit = disk_limit(plain.get((r.run, r.profile, shape)), disk, bpt) if bpt else None
        if limit:
            out[(r.run, r.profile, r.key)] = (limit, kind, disk, bpt)
    return out


def limit_lines(records: list[Record], lim: dict[tuple, tuple]) -> list[str]:
    if not lim:
        return []
    out = [
        "",
        "Disk-bound modes against their limit, min(plain prefill, the same run's disk bandwidth / bytes a token):",
    ]
    for r in records:
        if (r.run, r.profile, r.key) in lim:
            limit, kind, disk, bpt = lim[(r.run, r.profile, r.key)]
            by_disk = f"{kind.replace('_', ' ')} {disk / 1e9:.2f} GB/s / {bpt:,.0f} B a token"
            why = by_disk if disk / bpt <= limit else f"plain prefill; {by_disk} = {disk / bpt:,.0f}"
            out.append(
                f"- {r.run} {r.profile} {r.key}: {r.tokens_per_s:,.0f} tok/s = {r.tokens_per_s / limit:.2f}x "
                f"of {limit:,.0f} ({why})"
            )
    return out


def report(
    history: Iterable[str | Path], out: str | Path, baselines_dir: str | Path | None = None
) -> tuple[Path, Path]:
    """Markdown table, the trend plot (throughput.png, trends) and the latest run's bars (throughput-latest.png)."""
    from eagle3.preflight import UsageError

    records = load_history(history)  # before matplotlib (a second to import): an empty history is refused at once
    if not records:
        raise UsageError(
            f"no benchmark records with tokens_per_s in {', '.join(map(str, history))}: give the JSON "
            "that `pytest -m benchmark --benchmark-json=FILE` wrote on the GPU host"
        )
    import matplotlib

    matplotlib.use("Agg")  # no display: before pyplot is imported (by trends and bars)
    baselines = load_baselines(baselines_dir)
    out = ownership.claim(out, "bench")
    lines = [
        "# eagle3 extraction throughput",
        "",
        "| run | profile | key | tokens/s | per GPU | vs plain prefill | vs baseline | regression "
        "| spread in its run |",
        "|---|---|---|---:|---:|---:|---:|---|---:|",
    ]
    plain = plain_rates(records)
    disks = load_disks(history)
    for r in records:
        shape = r.key.split("/")[1] if "/" in r.key else ""
        p = plain.get((r.run, r.profile, shape))
        base = baselines.get(r.profile, {}).get("tokens_per_s", {}).get(r.key)
        reg = regression(r, baselines, disks.get((r.run, r.profile)))
        vs_plain = f"{r.tokens_per_s / p:.2f}x" if p else "-"
        vs_base = f"{r.tokens_per_s / base:.2f}x" if base else "-"
        # (max - min) / median of the figure's rate per quarter of its batches (GPU benchmark)
        spread = f"{r.extra['spread']:.1%}" if r.extra.get("spread") is not None else "-"
        lines.append(
            f"| {r.run} | {r.profile} | {r.key} | {r.tokens_per_s:,.0f} | {per_gpu(r):,.0f} | {vs_plain} | "
            f"{vs_base} | {'YES: ' + reg if reg else 'no'} | {spread} |"
        )
    lines += cluster_lines(records, baselines)
    lines += train_lines(records)
    lines += limit_lines(records, limits(records, disks))
    where = baselines_dir or BASELINES
    if not baselines:
        lines += [
            "",
            f"**No baselines found in {where}**: regressions cannot be flagged (a `pip install .` without "
            "the package data? `--baselines FOLDER` names another folder).",
        ]
    lines += [
        f"No baseline for profile `{p}` in {where}." for p in sorted({r.profile for r in records} - set(baselines))
    ]
    md = out / "throughput.md"
    md.write_text("\n".join(lines) + "\n")

    png = out / "throughput.png"
    if extraction(records):
        trends(records, baselines, png)
        bars(records, out / "throughput-latest.png", disks, baselines)
    if trainer(records):
        training_figure(records, out / "training.png")
    return md, png


# a benchmark mode's sink in the README's words (a mode is a sink, its variants, and _direct for the direct capture)
SINK_WORDS = {
    "plain": "plain prefill",
    "plain_sync": "plain prefill, synchronous scheduling",
    "vllm_ehs": "vLLM's extract_hidden_states",
    "count": "capture, nothing copied",
    "host": "capture to host memory",
    "store": "fsynced store",
    "store_nofsync": "page-cache store",
    "store_fp8": "fp8 store",
    "disk": "disk alone",
    "hf": "hf reference backend",
}
VARIANT_WORDS = {
    "slots8": "8 steps in flight",
    "whole": "whole copies",
    "gil": "GIL sampled",
    "fp8": "fp8",
    "auxout": "aux outputs",
    "forward": "copies issued in the forward",
    "bgcommit": "commits in a thread",
}


def mode_label(mode: str) -> str:
    """A mode as the README names it: "store_nofsync_direct" -> "page-cache store (direct capture)"."""
    sink, strategy = split_mode(mode)
    if sink.startswith("hooks_"):
        return mode_label(sink.removeprefix("hooks_")) + " (hooks capture)"
    words = SINK_WORDS.get(sink)
    if words is None:
        base, *variants = sink.split("_")
        words = ", ".join([SINK_WORDS.get(base, base)] + [VARIANT_WORDS.get(v, v) for v in variants])
    return words + (" (direct capture)" if strategy == "direct" else "")


def palette(n: int) -> list[str]:
    """n colors told apart: tab10's, then tab20's lighter ones (never a color beside its own lighter twin first)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    if n > 20:
        return [to_hex(plt.get_cmap("hsv", n + 1)(i)) for i in range(n)]
    tab20 = [to_hex(c) for c in plt.get_cmap("tab20").colors]
    return (tab20[0::2] + tab20[1::2])[:n]


def extraction(records: list[Record]) -> list[Record]:
    """The extraction benchmark's records (mode/BxT), not the trainer's."""
    return [r for r in records if "/" in r.key and not r.key.startswith(TRAIN_PREFIX)]


def _save(fig, path, described: list | None) -> None:
    """The figure written at 110 dpi and closed; where ``described`` is a list, its titles and labels added to it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    if described is not None:
        described += describe(fig)
    plt.close(fig)


def describe(fig) -> list[dict]:
    """What a figure shows a reader, per panel: its title, its legend's labels, the labels of what it draws
    (lines and bars), and whether a dashed line is drawn."""
    out = []
    for ax in fig.axes:
        legend = ax.get_legend()
        drawn = [a.get_label() for a in list(ax.lines) + list(ax.containers) + list(ax.collections)]
        out.append(
            {
                "title": ax.get_title(),
                "legend": [t.get_text() for t in legend.get_texts()] if legend else [],
                "drawn": [d for d in drawn if d and not d.startswith("_")],
                "dashed": any(line.get_linestyle() == "--" for line in ax.lines),
            }
        )
    return out


def trends(
    records: list[Record], baselines: dict[str, dict], path: Path, described: list | None = None
) -> list[tuple[str, str, str]]:
    """Extraction tokens/s over runs: a panel per (profile, shape), a line per mode in a color of its own that it
    keeps in every panel, each baseline dashed in its line's color, the legend beside the axes. Returns the lines
    drawn as (panel "profile shape", key, color); ``described`` gets describe(figure)."""
    import matplotlib.pyplot as plt

    keyed = extraction(records)
    modes = sorted({r.key.split("/")[0] for r in keyed}, key=lambda m: (m != "plain", m))
    color = dict(zip(modes, palette(len(modes))))
    panels = sorted({(r.profile, r.key.split("/")[1]) for r in keyed})
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.6 * max(1, len(panels))), squeeze=False)
    drawn = []
    for ax, (prof, shape) in zip(axes[:, 0], panels):
        rs = [r for r in keyed if r.profile == prof and r.key.endswith("/" + shape)]
        runs = sorted({r.run for r in records if r.profile == prof})
        for mode in [m for m in modes if any(r.key == f"{m}/{shape}" for r in rs)]:
            key = f"{mode}/{shape}"
            pts = [(runs.index(r.run), r.tokens_per_s) for r in rs if r.key == key]
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", color=color[mode], label=mode_label(mode))
            drawn.append((f"{prof} {shape}", key, color[mode]))
            base = baselines.get(prof, {}).get("tokens_per_s", {}).get(key)
            if base:
                ax.axhline(base, linestyle="--", color=color[mode], alpha=0.6)
        dashed = " (dashed: its baseline)" if any(line.get_linestyle() == "--" for line in ax.lines) else ""
        ax.set_title(f"{prof} {shape}: extraction tokens/s per run{dashed}", fontsize=10)
        ax.set_xticks(range(len(runs)))
        ax.set_xticklabels([r[:16] for r in runs], rotation=15, fontsize=7)
        ax.set_ylabel("tokens/s")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    _save(fig, path, described)
    return drawn


TRAIN_PREFIX = "train_"  # a training figure's key: train_DRAFT_PRECISION/SEQ (tests/gpu/test_bench_train.py)


def train_lines(records: list[Record]) -> list[str]:
    """The training figures: tok/s per GPU, MFU (model FLOPs / 989 TFLOPS, tests/perf/flops.py), peak memory; the
    store reader's against the fastest training figure of its run at the same sequence length (the goal: 2x)."""
    rows = [r for r in records if r.key.startswith(TRAIN_PREFIX)]
    if not rows:
        return []
    return ["", "Training (per GPU; MFU against the H200's dense bf16 peak):"] + [
        _reader_line(r, rows)
        if r.key.startswith(READER_KEY + "/")
        else f"- {r.run} {r.profile} {r.key}: {per_gpu(r):,.0f} tok/s per GPU, MFU {r.extra.get('mfu', 0):.1%}, "
        f"peak {r.extra.get('peak_gib', '?')} GiB"
        for r in rows
    ]


READER_KEY = TRAIN_PREFIX + "reader"


def _reader_line(r: Record, rows: list[Record]) -> str:
    seq = r.key.split("/")[1]
    same = [
        t
        for t in rows
        if t.run == r.run
        and t.profile == r.profile
        and t.key.endswith(f"/{seq}")
        and not t.key.startswith(READER_KEY + "/")
    ]
    head = (
        f"- {r.run} {r.profile} {r.key}: the store reader, as training steps read: {r.tokens_per_s:,.0f} tok/s "
        f"({r.extra.get('gb_per_s', '?')} GB/s; the samples alone {r.extra.get('samples_tok_per_s', 0):,.0f}"
        + (
            f"; checksums in the reader's path {r.extra['checks_inline_tok_per_s']:,.0f}"
            if "checks_inline_tok_per_s" in r.extra
            else ""
        )
        + ")"
    )
    if not same:
        return head + f"; no {seq}-token training figure in its run to set it against"
    need = max(same, key=per_gpu)
    ratio = r.tokens_per_s / per_gpu(need)
    return (
        head + f"; {ratio:.2f}x the fastest training figure of its run at {int(seq):,} tokens ({need.key}, "
        f"{per_gpu(need):,.0f} tok/s; goal 2x: {'met' if ratio >= 2 else 'missed'})"
    )


def trainer(records: list[Record]) -> list[Record]:
    """The trainer benchmark's records (the store reader's left out)."""
    return [r for r in records if r.key.startswith(TRAIN_PREFIX) and not r.key.startswith(READER_KEY)]


def train_label(r: Record) -> str:
    """A trainer figure as the README names it: "llama, varlen attention, compiled, 8k tokens"."""
    e = r.extra
    parts = [str(e.get("draft", "llama")), f"{e.get('attn', 'sdpa')} attention", str(e.get("precision", ""))]
    parts.append("compiled" if e.get("compiled") else "eager")
    seq = e.get("seq", r.key.split("/")[-1])
    return ", ".join(p for p in parts if p) + (f", {int(seq) // 1024}k tokens" if str(seq).isdigit() else "")


def training_figure(records: list[Record], path: Path, described: list | None = None) -> list[str]:
    """The newest run of each profile's trainer figures: tokens/s per GPU and MFU, one bar each, named in words.
    Returns the bars' names."""
    import matplotlib.pyplot as plt

    rows = trainer(records)
    profiles = sorted({r.profile for r in rows})
    fig, axes = plt.subplots(len(profiles), 2, figsize=(14, 0.5 + 0.45 * len(rows)), squeeze=False)
    names: list[str] = []
    for (left, right), prof in zip(axes, profiles):
        latest = max(r.run for r in rows if r.profile == prof)
        rs = sorted((r for r in rows if r.profile == prof and r.run == latest), key=lambda r: r.key)
        labels = [train_label(r) for r in rs]
        colors = palette(len(rs))
        left.barh(labels, [per_gpu(r) for r in rs], color=colors)
        left.set_title(f"{prof}, run {latest}: trainer tokens/s per GPU")
        mfu = [100 * float(r.extra.get("mfu") or 0) for r in rs]
        right.barh(labels, mfu, color=colors)
        right.set_title(f"{prof}, run {latest}: trainer MFU (%)")
        right.set_yticklabels([])
        for ax in (left, right):
            ax.grid(True, axis="x", alpha=0.3)
        names += labels
    _save(fig, path, described)
    return names


def per_gpu(r: Record) -> float:
    return r.tokens_per_s / max(1, int(r.extra.get("gpus", 1) or 1))


CLUSTER = "8xrtx6000-kimi-k2.5"  # the cluster's baseline: Kimi-K2.5 extraction on 8 GPUs


def cluster_figure(baselines: dict[str, dict]) -> tuple[float, int] | None:
    """The cluster's Kimi-K2.5 extraction: (tok/s on all its GPUs, GPUs), or None without that baseline."""
    base = baselines.get(CLUSTER, {}).get("tokens_per_s", {}).get("store/extract")
    return (base, int(baselines[CLUSTER].get("gpus", 8))) if base else None


def is_depth_store(r: Record) -> bool:
    """A store figure at Kimi's compute per token (kimi-depth): the one to set beside the cluster's."""
    return "kimi-depth" in r.profile and split_mode(r.key.split("/")[0])[0] == "store"


def cluster_lines(records: list[Record], baselines: dict[str, dict]) -> list[str]:
    """kimi-depth (Kimi's compute per token on one GPU) per GPU beside the cluster's figure per GPU."""
    fig = cluster_figure(baselines)
    depth = [r for r in records if is_depth_store(r)]
    if not fig or not depth:
        return []
    base, gpus = fig
    out = [
        "",
        f"Kimi's compute per token, per GPU, against the cluster's {base:,} tok/s on {gpus} GPUs "
        f"({base / gpus:,.0f} per GPU):",
    ]
    for r in depth:
        out.append(
            f"- {r.run} {r.profile} {r.key}: {per_gpu(r):,.0f} tok/s per GPU = {per_gpu(r) / (base / gpus):.1f}x"
        )
    return out


def bars(
    records: list[Record],
    path: Path,
    disks: dict | None = None,
    cluster: dict | None = None,
    described: list | None = None,
) -> list[str]:
    """One figure a person can read from one run: the newest run of each profile, a bar per mode for each
    shape, each labelled with its ratio to plain prefill of the same shape, and a disk-bound mode's bar with its
    limit (a black tick and the ratio to it; ``disks`` as load_disks returns). With ``cluster`` (baselines
    holding the cluster's figure), kimi-depth's panel draws the cluster's tok/s per GPU as a dashed line and
    labels each store bar with its multiple of it. Returns the labels drawn ("profile key ratio")."""
    import matplotlib.pyplot as plt

    lim = limits(records, disks or {})
    fig_cluster = cluster_figure(cluster or {})
    per_gpu_cluster = fig_cluster[0] / fig_cluster[1] if fig_cluster else None
    records = extraction(records)
    profiles = sorted({r.profile for r in records})
    labels: list[str] = []
    fig, axes = plt.subplots(len(profiles), 1, figsize=(12, 4.5 * len(profiles)), squeeze=False)
    for ax, prof in zip(axes[:, 0], profiles):
        latest = max(r.run for r in records if r.profile == prof)
        rs = [r for r in records if r.profile == prof and r.run == latest]
        shapes = sorted({r.key.split("/")[1] for r in rs})
        modes = sorted({r.key.split("/")[0] for r in rs}, key=lambda m: (m != "plain", m))
        width = 0.8 / max(1, len(modes))
        colors = palette(len(modes))
        for i, mode in enumerate(modes):
            named = False  # the legend names a mode at its first bar, whichever shape that is
            for j, shape in enumerate(shapes):
                r = next((x for x in rs if x.key == f"{mode}/{shape}"), None)
                if r is None:
                    continue
                plain = next((x.tokens_per_s for x in rs if x.key == f"plain/{shape}"), None)
                x = j + (i - (len(modes) - 1) / 2) * width
                ax.bar(x, r.tokens_per_s, width, color=colors[i], label=None if named else mode_label(mode))
                named = True
                if plain:
                    text = f"{r.tokens_per_s / plain:.2f}x"
                    top = r.tokens_per_s
                    if (r.run, r.profile, r.key) in lim:
                        limit = lim[(r.run, r.profile, r.key)][0]
                        ax.hlines(limit, x - width / 2, x + width / 2, colors="black", linewidth=2)
                        text += f"; {r.tokens_per_s / limit:.2f}x of limit"
                        top = max(top, limit)
                    if per_gpu_cluster and is_depth_store(r):
                        text += f"; {per_gpu(r) / per_gpu_cluster:.1f}x cluster/GPU"
                    ax.annotate(text, (x, top), ha="center", va="bottom", fontsize=7, rotation=90)
                    labels.append(f"{prof} {r.key} {text}")
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes)
        limited = [lim[k][0] for k in ((r.run, r.profile, r.key) for r in rs) if k in lim]
        beside_cluster = bool(per_gpu_cluster) and any(is_depth_store(r) for r in rs)
        # room for the labels, longer where they carry a limit or the cluster's multiple
        ax.set_ylim(
            0, (1.6 if limited or beside_cluster else 1.15) * max([r.tokens_per_s for r in rs] + limited, default=1)
        )
        if limited:
            ax.hlines([], 0, 0, colors="black", linewidth=2, label="limit: min(plain, disk B/s / B a token)")
        if beside_cluster:
            base, gpus = fig_cluster
            ax.axhline(
                per_gpu_cluster,
                color="black",
                linestyle="--",
                linewidth=1,
                label=f"cluster: {per_gpu_cluster:,.0f} tok/s per GPU ({base:,} on {gpus} GPUs)",
            )
        ax.set_ylabel("tokens/s (sustained)")
        ax.set_title(f"{prof}, run {latest}: extraction tokens/s per mode, labelled with the ratio to plain prefill")
        legend = ax.legend(fontsize=7, ncol=4, loc="upper left")
        labels += [f"{prof} legend {t.get_text()}" for t in legend.get_texts()]
        ax.grid(True, axis="y", alpha=0.3)
    _save(fig, path, described)
    return labels


def update_baselines(history: Iterable[str | Path], folder: str | Path, margin: float = 0.15) -> list[Path]:
    """Write each profile's newest run into FOLDER/<profile>.json as its baseline (kept: hardware, model,
    margin and keys the run did not measure). Returns the files written."""
    history = list(history)
    records = load_history(history)
    disks = load_disks(history)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = {json.loads(p.read_text())["profile"]: p for p in sorted(folder.glob("*.json"))}  # any file name
    written = []
    for prof in sorted({r.profile for r in records}):
        latest = max(r.run for r in records if r.profile == prof)
        path = files.get(prof, folder / f"{prof}.json")
        base = json.loads(path.read_text()) if path.exists() else {"profile": prof, "margin": margin}
        base.setdefault("tokens_per_s", {}).update(
            {r.key: round(r.tokens_per_s) for r in records if r.profile == prof and r.run == latest}
        )
        # the disks the run measured, which its disk-bound figures are read at (regression); a kind it did not
        # measure no longer matches the figures just written
        measured = disks.get((latest, prof), {})
        kinds = {disk_of(r.key.split("/")[0]) for r in records if r.profile == prof and r.run == latest}
        held = {k: v for k, v in base.get("disk_bytes_per_s", {}).items() if k not in kinds}
        held.update({k: round(v) for k, v in measured.items()})
        base.pop("disk_bytes_per_s", None)
        if held:
            base["disk_bytes_per_s"] = held
        base["source"] = f"eagle3 bench report --update-baselines, run {latest}"
        path.write_text(json.dumps(base, indent=1) + "\n")
        written.append(path)
    return written
