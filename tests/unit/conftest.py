"""Shared CPU fixtures: tiny targets and a small store, built once per session (seconds, not minutes)."""

from __future__ import annotations

import os
import signal

import pytest

from eagle3.data import corpus
from eagle3.data.conversations import DataConfig
from eagle3.targets import presets, tiny

# torch is imported where it is used: the pytest-xdist controller, which runs no test, would otherwise import it
# before it starts the workers (tests/unit/warm_workers.py), on the one core busy then.


def pytest_configure(config):
    """Under pytest-xdist each worker is a process of its own: one torch thread each, or the workers' OpenMP threads
    fight over the cores (a 7 s test took 59 s with 2 workers x 2 threads on 2 cores). Subprocesses the tests start
    inherit the same through OMP_NUM_THREADS. Tests run in this process: two threads. The controller: none set."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    elif not getattr(config.option, "numprocesses", None):
        import torch

        torch.set_num_threads(min(2, os.cpu_count() or 1))


# A draft of tiny-kimi's own attention width (4 heads of 32, 4 KV heads), loadable at TP 1, 2 and 4. The default
# pads a draft's heads to 16 so that it loads at TP 16: for tiny-kimi's hidden size of 128, four times the
# attention width. Tests whose subject is not the draft's shape (kill and resume, online runs) train this one.
NARROW_DRAFT = {"shape": {"num_attention_heads": 4, "num_key_value_heads": 4}, "serve_tps": (1, 2, 4)}
NARROW_DRAFT_ARGS = ["--draft-heads", "4", "--draft-kv-heads", "4", "--serve-tp", "1,2,4"]


def once_per_run(tmp_path_factory, name: str, build):
    """``build(folder) -> value`` run once per test run, however many pytest-xdist workers ask: the first to ask
    builds in a folder they share (under a file lock), the others wait for it and get the same folder and value
    (pickled). A session fixture is otherwise built once in each worker: the same tiny target, store and reference
    runs three times over on two cores. What it returns and what it writes are read-only to the tests."""
    import fcntl
    import pickle
    import shutil

    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "once-per-run"
    shared.mkdir(exist_ok=True)
    folder, done = shared / name, shared / f"{name}.pickle"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, a worker's crash included
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a build that raised in another worker
            folder.mkdir()
            value = build(folder)
            tmp = done.with_suffix(".tmp")
            tmp.write_bytes(pickle.dumps(value))
            os.replace(tmp, done)
        return pickle.loads(done.read_bytes())


@pytest.fixture(scope="session")
def tiny_kimi(tmp_path_factory):
    """tiny-kimi (DeepseekV3: MLA + MoE, 8 layers, hidden 128) with random weights and the BPE tokenizer."""
    return once_per_run(
        tmp_path_factory, "tiny-kimi", lambda d: tiny.build_model(presets.from_name("tiny-kimi"), d, seed=0)
    )


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return once_per_run(
        tmp_path_factory, "tiny-llama", lambda d: tiny.build_model(presets.from_name("tiny-llama"), d, seed=0)
    )


@pytest.fixture(scope="session")
def tokenizer(tiny_kimi):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_kimi)


@pytest.fixture(scope="session")
def small_data(tmp_path_factory):
    """48 bundled-style conversations in a JSONL file."""
    path = tmp_path_factory.mktemp("data") / "small.jsonl"
    return corpus.write_jsonl(path, corpus.generate(48, seed=7))


@pytest.fixture(scope="session")
def small_store(tiny_kimi, small_data, tmp_path_factory):
    """An hf-backend store of small_data on tiny-kimi, shards of 8 samples."""
    from eagle3.extract import extract

    def build(folder):
        cfg = extract.ExtractConfig(
            model=str(tiny_kimi),
            out=str(folder / "store"),
            data=DataConfig([str(small_data)], max_len=192),
            batch_size=8,
            shard_samples=8,
            writer_threads=0,
        )
        extract.run(cfg, progress=False)
        return folder / "store"

    return once_per_run(tmp_path_factory, "small-store", build)


TRAINED_RUN = dict(draft_vocab_size=256, batch_samples=4, lr=3e-3, seed=0, max_steps=12, checkpoint_every=4)


@pytest.fixture(scope="session")
def trained_run(small_store, tmp_path_factory):
    """A short training run on small_store (TRAINED_RUN: 12 steps, checkpoints every 4): (TrainResult, out folder)."""
    from eagle3.train.train import TrainConfig, train

    def build(out):
        return train(TrainConfig(store=str(small_store), out=str(out), **TRAINED_RUN), progress=False), out

    return once_per_run(tmp_path_factory, "trained-run", build)


@pytest.fixture(scope="session")
def trained_draft(trained_run):
    from pathlib import Path

    return Path(trained_run[0].draft)


@pytest.fixture(scope="session")
def reference_states(tiny_kimi):
    """prompt -> states of every id 0..8, [9, T, H] float32, from the layer-by-layer oracle (tests/unit/oracle.py),
    not from the hf backend: the fake vLLM's store is then compared with the hf backend's, not with itself."""
    from eagle3.extract.hf_backend import HFBackend

    from .oracle import layerwise_states

    backend = HFBackend(tiny_kimi, tuple(range(9)), compute_dtype="float32", out_dtype="float32")
    cache = {}

    def ref(ids):
        key = tuple(ids)
        if key not in cache:
            cache[key] = layerwise_states(backend.model, ids)
        return cache[key]

    ref.backend = backend
    return ref


@pytest.fixture(scope="session")
def reference_logits(reference_states):
    """prompt -> the next-token logits [V] float32 after it, remembered: the fake engine asks again for every prompt
    it prefills and every token it generates, and the tests share their prompts. Read-only to the callers."""
    import torch

    model, cache = reference_states.backend.model, {}

    @torch.inference_mode()
    def logits(ids):
        key = tuple(ids)
        if key not in cache:
            cache[key] = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        return cache[key]

    return logits


class RecordedStates:
    """A capture backend that gives each sample the states ``backend`` captured for it the first time it was asked,
    keyed by its token ids; every other attribute is the backend's. For tests that run the same samples through many
    runs (kill and resume): their subject is what is stored and trained, and the hf backend at batch 1 gives the same
    bits for the same ids every time (the bitwise comparisons of these tests relied on that already).
    ``record(samples)``: capture them now, so that children forked later start with them."""

    def __init__(self, backend):
        self.backend, self.asked, self._states = backend, 0, {}

    def record(self, samples) -> None:
        new = list({tuple(s.input_ids): s for s in samples if tuple(s.input_ids) not in self._states}.values())
        for s, states in zip(new, self.backend.capture(new) if new else []):
            self._states[tuple(s.input_ids)] = states

    def capture(self, samples):
        self.asked += len(samples)
        self.record(samples)
        return [self._states[tuple(s.input_ids)].clone() for s in samples]

    def __getattr__(self, name):
        return getattr(self.backend, name)


@pytest.fixture
def one_thread():
    """Bitwise comparisons across processes need the same float reduction order: one torch thread,
    as in forked children."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rewrite_shards(root, edit, rehash: bool = True) -> None:
    """Edit a store's shard files in place: ``edit(shard_no, tensors, metadata)`` changes the tensors; the file
    is rewritten in the store's byte layout and, with ``rehash``, the manifest gets its new checksum and size (so
    only value checks, not checksums, can see the change)."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    from eagle3.store.files import CHECKSUM, hasher
    from eagle3.store.format import safetensors_chunks

    root = Path(root)
    manifest = json.loads((root / "manifest.json").read_text())
    for n, entry in enumerate(manifest["shards"]):
        with safe_open(str(root / entry["file"]), framework="pt") as f:
            meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        if edit(n, tensors, meta) is False:
            continue
        data = b"".join(bytes(c) for c in safetensors_chunks(tensors, meta))
        (root / entry["file"]).write_bytes(data)
        if rehash:
            h = hasher(CHECKSUM)
            h.update(data)
            entry["checksum"], entry["bytes"] = f"{CHECKSUM}:{h.hexdigest()}", len(data)
    (root / "manifest.json").write_text(json.dumps(manifest))


def run_forked(fn) -> tuple[bool, int]:
    """Run fn() in a forked child (one torch thread: OpenMP does not survive fork with more).

    Returns (killed by SIGKILL, exit code). The child exits 0 if fn returns, 3 if it raises.
    """
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 0
        try:
            import torch

            torch.set_num_threads(1)
            fn()
        except BaseException:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return os.WTERMSIG(status) == signal.SIGKILL, -1
    return False, os.WEXITSTATUS(status)


COMMAND_PRELOAD = (
    "eagle3.cli",
    "eagle3.train.train",
    "eagle3.extract.extract",
    "eagle3.extract.regenerate",
    "speculators.models.eagle3",
)  # what run_command's children have imported before they start
_zygote = None


def _start_zygote() -> None:
    global _zygote
    if _zygote is None:
        from .zygote import Zygote

        _zygote = Zygote()


def pytest_collection_finish(session):
    """The zygote that forks run_command's children (tests/unit/zygote.py), forked from this process now: the test
    modules are imported and no test has started a thread."""
    _start_zygote()


def pytest_unconfigure(config):
    global _zygote
    if _zygote is not None:
        _zygote.close()
        _zygote = None


def _command_child(argv: list[str], env: dict, out_path: str, err_path: str) -> None:  # pragma: no cover - child
    """In a grandchild of the zygote: stdout and stderr to the given files, the environment given, then the command
    as `eagle3 ARGV` runs it; the process exits with its code (or dies of its signal)."""
    import io
    import logging
    import sys

    code = 3
    try:
        os.dup2(os.open(out_path, os.O_WRONLY), 1)
        os.dup2(os.open(err_path, os.O_WRONLY), 2)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
        for h in list(logging.root.handlers):  # pytest's log capture, on the test process's root when it forked
            if type(h).__module__.startswith("_pytest"):
                logging.root.removeHandler(h)
        for lg in [logging.root, *logging.root.manager.loggerDict.values()]:  # a handler made at import writes
            for h in getattr(lg, "handlers", []):  # to the test process's stderr: to ours instead
                if type(h) is logging.StreamHandler:
                    h.stream = sys.stderr
        for k in ("EAGLE3_FAULT", "EAGLE3_LOG_LEVEL"):
            os.environ.pop(k, None)
        os.environ.update(env)
        import torch

        torch.set_num_threads(1)  # beside the suite's other workers
        sys.argv = ["eagle3", *argv]
        from eagle3 import cli

        code = cli.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_command(argv, env: dict | None = None, timeout: float = 240):
    """``eagle3 ARGV`` as the command runs (``main()`` reading sys.argv, so it installs its SIGINT / SIGTERM
    handlers), in a grandchild of the zygote (tests/unit/zygote.py): a copy of this process forked when collection
    ended, before any test thread, with COMMAND_PRELOAD imported, so its children start with nothing half-held (a
    child forked from the test process itself hung on the tqdm lock another thread held at the fork). A fresh
    interpreter would spend ~9 s importing speculators each time.
    ``env``: variables set in the child (EAGLE3_FAULT: a kill point). Returns (an object with returncode, stdout
    and stderr as subprocess.run's, seconds); killed by a signal, the returncode is minus its number."""
    return start_command(argv, env).wait(timeout)


class Command:
    """A command started by start_command; ``wait(timeout)`` gives what run_command returns (killed at the timeout,
    then subprocess.TimeoutExpired)."""

    def __init__(self, argv, env: dict | None):
        import tempfile
        import time

        _start_zygote()  # made when collection ended; here only where that hook did not run
        self.argv, self._tmp = list(argv), tempfile.TemporaryDirectory()
        self.out, self.err = os.path.join(self._tmp.name, "out"), os.path.join(self._tmp.name, "err")
        for f in (self.out, self.err):
            open(f, "w").close()
        self.t0 = time.perf_counter()
        self.child = _zygote.start(
            _command_child, self.argv, dict(env or {}), self.out, self.err, preload=COMMAND_PRELOAD
        )

    def wait(self, timeout: float = 240):
        import subprocess
        import time
        import types

        try:
            self.child.join(timeout)
            if self.child.is_alive():
                self.child.kill()
                self.child.join()
                raise subprocess.TimeoutExpired(self.argv, timeout)
            with open(self.out) as f_out, open(self.err) as f_err:
                return types.SimpleNamespace(
                    returncode=self.child.exitcode, stdout=f_out.read(), stderr=f_err.read()
                ), time.perf_counter() - self.t0
        finally:
            self._tmp.cleanup()


def start_command(argv, env: dict | None = None) -> Command:
    """run_command's child, started and not waited for (commands that run side by side: DDP ranks)."""
    return Command(argv, env)


def hold_back_capture_consumer(monkeypatch):
    """Capturers made after this call keep every step handed to their consumer thread until the returned event
    is set: the copies stay "in flight" for as long as a test needs."""
    import threading

    from eagle3.extract.capture import Capturer

    gate = threading.Event()
    consume = Capturer._consume

    def held_back(self):
        gate.wait()
        consume(self)

    monkeypatch.setattr(Capturer, "_consume", held_back)
    return gate
