"""Online training (issue 15): extraction streams into training through a bounded spool; no full store on disk.

At Kimi-K2.5's size a stored token costs 57,344 bytes (4 layers x 7168 x bf16): 6B tokens stored offline are
about 344 TB. Online, an extraction backend (hf on CPU, vLLM on GPU) writes shards into a *spool*: a store
folder (same format, checksums and layer-id contract as offline) with a capacity in bytes. The producer waits
while the spool's committed bytes plus the batch it is about to submit would pass the capacity; the trainer
reads the shards in order and frees each shard once it has read all of it.

Order: the producer extracts the samples in exactly the order the offline trainer draws them from a store of
the same samples (epoch e: torch.randperm(n, seed + e), sliced into global batches), so an online run follows
the offline run's loss curve on the same samples. Position p of the training sequence holds the sample
``plan[p]``; the spool's sample id is "<p>|<sample id>" (a sample appears once per epoch).

Resume (kill -9 anywhere, rerun the same command): training restarts from its newest complete checkpoint,
which records how many positions it has learned from (samples_seen). Spool shards below that are freed; the
run of shards that continues it without a gap is kept; everything after is extracted again (extracted but not
yet learned from in a checkpoint: re-extracted, never trained twice into the model, never lost). The spool is
never fsynced (Spool); what a power loss takes of it is found at the resume and extracted again.

One GPU: the vLLM engine and the trainer share it; the engine takes ``gpu_memory_utilization`` of the memory
(default 0.5 here), the trainer what is left. Several GPUs and nodes (not written yet): extraction ranks write
shards into a spool on shared or local storage and the trainer ranks consume them; the spool's manifest is the
only coordination, so producers on some GPUs and a DDP trainer on others need a spool per trainer rank (shards
assigned round-robin), each with its own capacity.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle3 import ownership
from eagle3.data.conversations import Sample
from eagle3.extract.timeline import rate_past_first
from eagle3.preflight import UsageError
from eagle3.store.files import checksum_matches
from eagle3.store.folder import Store, claim
from eagle3.store.format import SHARDS, StoreError, StoreSpec
from eagle3.train import checkpoint
from eagle3.train.compile_gate import CompileGate
from eagle3.train.train import StoreSamples, TrainConfig, TrainResult, train

log = logging.getLogger(__name__)

SHARD_MARGIN = 64 << 10  # bytes: a shard's safetensors header (tensor table + sample ids) is far below this


def position_id(pos: int, sample_id: str) -> str:
    return f"{pos:010d}|{sample_id}"


def position_of(spool_id: str) -> int:
    return int(spool_id.split("|", 1)[0])


def training_order(n: int, batch_samples: int, epochs: int, seed: int, max_steps: int | None = None) -> list[int]:
    """The data index at each training position, as the offline trainer draws a store of the same n samples
    (StoreSamples.batch): epoch e's permutation with seed + e, cut into global batches, the rest dropped."""
    steps_per_epoch = n // batch_samples
    total = min(max_steps or 10**12, steps_per_epoch * epochs)
    out: list[int] = []
    for epoch in range((total + steps_per_epoch - 1) // steps_per_epoch):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        k = min(steps_per_epoch, total - epoch * steps_per_epoch)
        out += order[: k * batch_samples]
    return out


def sample_bytes(tokens: int, spec: StoreSpec) -> int:
    """Bytes one sample of ``tokens`` adds to a shard (states (+ fp8 scales), input_ids int32, loss_mask uint8,
    one offset)."""
    return tokens * (spec.bytes_per_token + 5) + 8


class SpoolClosed(RuntimeError):
    pass


class Spool:
    """A store folder used as a bounded queue of shards holding consecutive training positions.

    Accounting (bytes): ``committed`` = the committed shards' files, ``reserved`` = estimates of the samples
    submitted to the backend and not yet committed. The producer submits only when committed + reserved + the
    batch's estimate <= capacity. ``peak`` is the largest committed + reserved seen, ``peak_files`` the largest
    sum of the shards folder's file sizes measured right after each commit and free."""

    def __init__(self, root: str | Path, spec: StoreSpec, capacity: int, fresh: bool = False):
        """``fresh``: start empty whatever the folder holds (a run stamp a power loss left unreadable)."""
        # never fsynced (its shards, their folder, its manifest): a cache of states the target makes again. Each
        # fsync held a thread of the pipeline for the disk: a shard freed with its manifest fsynced took 98-185 ms
        # on this project's CPU machine beside a shard being written, against 18 ms without. What a power loss takes
        # is found here when the run resumes (an unreadable manifest: Store.open(cache=True); a shard gone, cut
        # short or with other bytes: _untrusted) and extracted again.
        self.store = Store.open(root, spec, create=True, fsync=False, lock=True, cache=True)
        self.capacity = capacity
        self.cond = threading.Condition()
        self.entries: dict[int, tuple[str, int, int, str]] = {}  # position -> (file, row a, row b, spool id)
        self.unread: dict[str, set[int]] = {}  # file -> positions not read yet
        self.committed = self.reserved = self.peak = self.peak_files = 0
        self.shards = 0  # shards committed in this run
        self.failed: BaseException | None = None
        self.closed = self.producer_waiting = self.done = False
        self.waiting_for = 0
        self.producer_wait_s = self.consumer_wait_s = 0.0
        self.producer_waits: list[tuple[float, float]] = []  # (perf_counter from, to) of each wait for room
        bad = {s["file"] for s in self.store.shards} if fresh else self._untrusted()
        if bad:
            self.store.drop_shards(bad, fsync=False)
            for file in bad:
                (self.store.root / file).unlink(missing_ok=True)
        for shard in self.store.shards:
            self._index(shard)
        self.committed = sum(s["bytes"] for s in self.store.shards)

    def _untrusted(self) -> set[str]:
        """The listed shards whose file is gone, of another size or fails its checksum (what a power loss left of
        writes never flushed; the checksums are read once, at a resume: at most the capacity's bytes)."""
        bad = set()
        for shard in self.store.shards:
            p = self.store.root / shard["file"]
            if not p.is_file() or p.stat().st_size != shard["bytes"] or not checksum_matches(p, shard):
                log.warning(
                    "spool %s: %s is not as committed (a power loss took writes never flushed); its samples "
                    "are extracted again",
                    self.store.root,
                    shard["file"],
                )
                bad.add(shard["file"])
        return bad

    # -- accounting
    def files_bytes(self) -> int:
        """The shards folder's file sizes summed. The extraction renames and frees files meanwhile: a file listed
        and gone before its size is read makes the listing stale, so it is taken again (a rename may have put the
        same bytes under a name the stale listing lacks)."""
        folder = self.store.root / SHARDS
        for _ in range(100):
            try:
                return sum(e.stat().st_size for e in os.scandir(folder) if e.is_file())
            except FileNotFoundError:
                if not folder.exists():
                    return 0
        raise StoreError(f"spool {self.store.root}: its shards folder changed under 100 listings in a row")

    def _measure(self) -> None:
        self.peak = max(self.peak, self.committed + self.reserved)
        self.peak_files = max(self.peak_files, self.files_bytes())

    def _index(self, shard: dict) -> None:
        from safetensors import safe_open

        with safe_open(str(self.store.root / shard["file"]), framework="pt") as f:
            off = f.get_tensor("offsets").tolist()
        for s, sid in enumerate(shard["sample_ids"]):
            self.entries[position_of(sid)] = (shard["file"], off[s], off[s + 1], sid)
        self.unread[shard["file"]] = {position_of(sid) for sid in shard["sample_ids"]}

    def _no_room(self, nbytes: int) -> bool:
        """``nbytes`` more would pass the capacity (what the producer waits on; read under the lock)."""
        return self.committed + self.reserved + nbytes > self.capacity

    def has_room(self, nbytes: int) -> bool:
        """``nbytes`` more fit now (reserve would not wait; only the producer adds, so it stays true)."""
        with self.cond:
            return not self._no_room(nbytes)

    # -- producer side
    def reserve(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more fit under the capacity, then count them as reserved."""
        t0 = time.perf_counter()
        with self.cond:
            self.producer_waiting, self.waiting_for, waited = True, nbytes, False
            while self._no_room(nbytes) and not self.closed:
                waited = True
                self.cond.notify_all()
                self.cond.wait(0.5)
            self.producer_waiting = False
            if self.closed:
                raise SpoolClosed("the trainer stopped")
            self.reserved += nbytes
            self._measure()
        t1 = time.perf_counter()
        self.producer_wait_s += t1 - t0
        if waited:
            self.producer_waits.append((t0, t1))

    def waited(self, t0: float, t1: float) -> None:
        """The producer waited from t0 to t1 for another reason that room decides (its shards in flight, settled
        before a wait for room)."""
        self.producer_wait_s += t1 - t0
        self.producer_waits.append((t0, t1))

    def commit(self, infos, released: int) -> None:
        """Commit finished shards; ``released`` bytes of reservation end with them."""
        with self.cond:
            self.store.commit(infos, fsync=False)
            for info in infos:
                self._index({"file": info.file, "sample_ids": info.sample_ids})
                self.committed += info.bytes
            self.shards += len(infos)
            self.reserved = max(0, self.reserved - released)
            if self.committed + self.reserved > self.capacity:
                raise StoreError(
                    f"spool {self.store.root}: {self.committed + self.reserved} bytes committed and "
                    f"reserved, over its capacity {self.capacity} (a shard larger than estimated)"
                )
            self._measure()
            self.cond.notify_all()

    def finished(self) -> None:
        with self.cond:
            self.done = True
            self.cond.notify_all()

    def fail(self, e: BaseException) -> None:
        with self.cond:
            self.failed = e
            self.cond.notify_all()

    # -- consumer side
    def wait_for(self, pos: int) -> tuple[str, int, int, str]:
        t0 = time.perf_counter()
        with self.cond:
            while pos not in self.entries:
                if self.failed is not None:
                    raise StoreError(
                        f"the extraction feeding spool {self.store.root} failed: "
                        f"{type(self.failed).__name__}: {self.failed}"
                    ) from self.failed
                if self.done:
                    raise StoreError(f"spool {self.store.root}: the extraction finished without position {pos}")
                if self.producer_waiting and self._no_room(self.waiting_for):
                    # the producer waits for room, which only reading frees, and the reader waits for a position
                    # only the producer's next commit brings: nothing will ever move. (Room freed while the
                    # producer sleeps leaves producer_waiting set until it wakes: that one moves.)
                    raise StoreError(
                        f"spool {self.store.root} has no room for the next extraction batch ({self.committed:,} "
                        f"committed + {self.reserved:,} reserved + {self.waiting_for:,} asked > {self.capacity:,} "
                        f"bytes) and the trainer waits for position {pos}, which no committed shard holds: a bug, "
                        f"not a setting "
                        f"(positions held: {min(self.entries, default=None)}..{max(self.entries, default=None)})"
                    )
                self.cond.wait(0.5)
        self.consumer_wait_s += time.perf_counter() - t0
        return self.entries[pos]

    def read(self, pos: int) -> None:
        """Position ``pos`` was read; a shard all of whose positions were read is freed."""
        with self.cond:
            file = self.entries[pos][0]
            left = self.unread.get(file)
            if left is None:
                return
            left.discard(pos)
            if not left:
                self._free({file})

    def _free(self, files: set[str]) -> None:
        gone = [s for s in self.store.shards if s["file"] in files]
        self.store.drop_shards(files, fsync=False)
        for s in gone:
            (self.store.root / s["file"]).unlink(missing_ok=True)
            self.committed -= s["bytes"]
            self.unread.pop(s["file"], None)
            for sid in s["sample_ids"]:
                self.entries.pop(position_of(sid), None)
        self._measure()
        self.cond.notify_all()

    def keep_from(self, start: int) -> int:
        """Resume at position ``start``: keep the shards that continue it without a gap, free the others.
        Returns the first position the producer must extract."""
        with self.cond:
            nxt = start
            while nxt in self.entries and self.entries[nxt][0] in self.unread:
                nxt += 1
            keep = {self.entries[p][0] for p in range(start, nxt)}
            # a kept shard may begin below start (positions learned already): its other rows stay readable
            drop = {s["file"] for s in self.store.shards if s["file"] not in keep}
            if drop:
                self._free(drop)
            for file in keep:
                self.unread[file] = {p for p in self.unread[file] if p >= start}
            return nxt

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class SpoolSamples(StoreSamples):
    """train()'s sample source for online training: position p is read from the spool when it arrives."""

    def __init__(self, spool: Spool, data: Sequence[Sample], plan: list[int], producer: Producer, seed: int):
        super().__init__(spool.store, seed, index_shards=False)
        self.spool, self.data, self.plan, self.producer = spool, list(data), plan, producer
        self.index = {}  # position -> (file, a, b, spool id), filled as shards arrive
        self.entry = {}  # filled as shards are read: a shard freed on resume may give its file name to a new one

    def __len__(self) -> int:
        return len(self.data)

    def batch(self, step: int, steps_per_epoch: int, batch_samples: int) -> list[int]:
        self.producer.start_once(step * batch_samples)
        return list(range(step * batch_samples, (step + 1) * batch_samples))

    def sample_id(self, i: int) -> str:
        return position_id(i, self.data[self.plan[i]].sample_id)

    def check_ahead(self, order) -> None:
        """Nothing ahead: a spool's shards are checked as they are read (they arrive while training runs)."""

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """From the tokenized samples (the ids and masks a store would hold), before any state exists."""
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for s in self.data:
            ids, mask = torch.tensor(s.input_ids), torch.tensor(s.loss_mask).bool()
            counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
        return counts

    def get(self, i: int) -> dict:
        entry = self.spool.wait_for(i)
        self.index[i] = entry
        if entry[0] not in self.entry:
            self.entry[entry[0]] = next(s for s in self.spool.store.shards if s["file"] == entry[0])
        try:
            x = super().get(i)
        finally:
            self.spool.read(i)
            self.index.pop(i, None)
        if x["sample_id"] != self.sample_id(i):
            raise StoreError(f"spool position {i} holds {x['sample_id']}, expected {self.sample_id(i)}")
        return x

    def resumed(self, state: dict) -> None:
        self.producer.start_once(state["samples_seen"])

    def progress(self) -> dict[str, str]:
        """Both sides, live: the extraction's tok/s, the spool's fill, and who waited for whom."""
        p, sp = self.producer, self.spool
        elapsed = time.perf_counter() - p.t0 if p.t0 else 0.0
        return {
            "extract": f"{p.tokens / elapsed:,.0f} tok/s" if elapsed else "-",
            "spool": f"{(sp.committed + sp.reserved) / 2**20:,.0f}/{sp.capacity / 2**20:,.0f} MiB",
            "waits": f"extract {sp.producer_wait_s:.0f}s train {sp.consumer_wait_s:.0f}s",
        }


ENGINE_STREAM_PRIORITY = -1  # CUDA's: negative is higher than the default 0


def engine_stream(backend):
    """The CUDA stream the producer thread drives an engine in this process on (`--engine-in-process`: vLLM's forward
    runs in the thread that calls generate, on that thread's current stream), or None (an engine in a process of its
    own, or no CUDA). Not the trainer's stream, so their kernels may run at once; of a higher priority, so the GPU
    schedules the engine's blocks first and the trainer's fill the SMs it leaves idle: on one GPU the extraction is
    the slower side at Kimi's size (docs/online.md), and the trainer keeps up in the gaps."""
    if not getattr(backend, "in_process", False) or not torch.cuda.is_available():
        return None
    return torch.cuda.Stream(priority=ENGINE_STREAM_PRIORITY)


class Producer:
    """The extraction side: a thread that extracts plan[p] for p = start... into the spool, batch by batch."""

    def __init__(self, spool: Spool, data: Sequence[Sample], plan: list[int], backend, extract_cfg, batch: int):
        self.spool, self.data, self.plan, self.backend, self.cfg, self.batch = (
            spool,
            data,
            plan,
            backend,
            extract_cfg,
            batch,
        )
        self.stream = engine_stream(backend)
        # an engine in this process: its batches and the trainer's compiles kept apart (train/compile_gate.py)
        self.gate = CompileGate() if self.stream is not None else None
        self.thread: threading.Thread | None = None
        self.seconds = self.t0 = 0.0
        # per extraction batch: (time.perf_counter() when its submit returned, tokens); its shards are committed then
        # or by a later submit
        self.commits: list[tuple[float, int]] = []
        self.engine_phases: dict[str, float] = {}  # the vLLM session's seconds per phase (VLLMSession.phase_s)

    @property
    def tokens(self) -> int:
        """Tokens extracted so far in this run."""
        return sum(n for _, n in self.commits)

    def start_once(self, start: int) -> None:
        if self.thread is None:
            first = self.spool.keep_from(start)
            self.thread = threading.Thread(target=self._run, args=(first,), daemon=True, name="eagle3-producer")
            self.thread.start()

    def _run(self, first: int) -> None:
        from eagle3 import faults
        from eagle3.extract.extract import open_session

        spec = self.spool.store.spec
        t0 = self.t0 = time.perf_counter()
        session = None
        try:
            if self.stream is not None:  # an engine in this process runs its forward in this thread
                torch.cuda.synchronize()  # what other threads did to the engine (its norms, an extraction) done first
                torch.cuda.set_stream(self.stream)  # this thread's own (vLLM's stream bookkeeping follows it)
            # each batch sealed into shards of its own, whose write (and fsync) the next batch's prefill overlaps:
            # a submit reports the shards written by then (tests/unit/test_vllm_backend.py, still_written)
            session = open_session(
                self.backend,
                self.spool.store,
                self.cfg,
                self.cfg.fault or faults.from_env(),
                seal_each_batch=True,
                wait_for_shards=False,
            )
            pending: list[int] = []  # estimates of submitted samples, in order
            for a in range(first, len(self.plan), self.batch):
                batch = [self._sample(p) for p in range(a, min(a + self.batch, len(self.plan)))]
                est = [sample_bytes(len(s), spec) for s in batch]
                need = sum(est) + SHARD_MARGIN
                if pending and not self.spool.has_room(need):
                    # before waiting for room: the batches in flight committed, since the trainer may need them to
                    # free any (a step's samples spanning batches); counted as the start of that wait
                    t0 = time.perf_counter()
                    self.spool.commit(*self._released(session.settle(), pending))
                    self.spool.waited(t0, time.perf_counter())
                self.spool.reserve(need)
                pending += est[:-1] + [est[-1] + SHARD_MARGIN]
                with self._engine():
                    infos = session.submit(batch)
                self.spool.commit(*self._released(infos, pending))
                self.commits.append((time.perf_counter(), sum(len(s) for s in batch)))
            with self._engine():
                infos = session.finish()
            self.spool.commit(*self._released(infos, pending))
            self.engine_phases = dict(getattr(session, "phase_s", {}))
            self.spool.finished()
        except SpoolClosed:
            return
        except BaseException as e:  # noqa: BLE001 - handed to the trainer, which raises it
            log.error("online extraction failed: %s: %s", type(e).__name__, e)
            self.spool.fail(e)
        finally:
            if session is not None:  # the trainer stopped or failed first: the engine's writers end with this run
                session.close()
            self.seconds = time.perf_counter() - t0

    def _engine(self):
        return self.gate.engine() if self.gate is not None else contextlib.nullcontext()

    @staticmethod
    def _released(infos, pending: list[int]) -> tuple[list, int]:
        """(infos, the reservation they end): the estimates of their samples, taken from the front of pending."""
        n = sum(i.num_samples for i in infos)
        released = sum(pending[:n])
        del pending[:n]
        return infos, released

    def _sample(self, pos: int) -> Sample:
        s = self.data[self.plan[pos]]
        return Sample(position_id(pos, s.sample_id), s.input_ids, s.loss_mask)

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()


@dataclass
class OnlineResult:
    train: TrainResult
    spool: str
    capacity: int
    peak_bytes: int  # committed + reserved, from the spool's accounting
    peak_files_bytes: int  # the shards folder, measured on the file system
    extracted_tokens: int
    shards: int  # shards committed to the spool in this run (one per extraction batch)
    extract_seconds: float
    producer_wait_s: float  # the extraction waited for room in the spool (training limits)
    trainer_wait_s: float  # training waited for states (extraction limits)
    selfcheck: str = ""
    commits: list[tuple[float, int]] = field(default_factory=list)  # the extraction's: (perf_counter, tokens) a batch
    producer_waits: list[tuple[float, float]] = field(default_factory=list)  # its waits for room: (from, to)
    compile_waits: list[tuple[float, float]] = field(default_factory=list)  # an engine in this process: the
    compiles: int = 0  # extraction's waits behind the trainer's compiles (train/compile_gate.py), and how many
    # the vLLM session's seconds: expect_s, generate_s (the prefills), collect_s (sealing each batch), settle_s
    # (its shards in flight written, before a wait for room)
    engine_phases: dict[str, float] = field(default_factory=dict)

    @property
    def compile_wait_s(self) -> float:
        return sum(b - a for a, b in self.compile_waits)

    def sustained_tokens_per_s(self) -> float:
        """The pipeline's rate once training has begun: the lower of
        - the extraction's, over its commits from the first after the trainer's first step began to the last, less
          its waits for room in that time (a stall behind a first step that compiles is not its rate; where training
          limits, the trainer's figure is the lower anyway), and
        - the trainer's over its later half of steps (TrainResult.sustained_tokens_per_s).
        Where extraction is the slower side the trainer's figure overstates it by a head start taken while the draft
        was built (states it found waiting); where training is, the extraction's does (it catches up in bursts as
        room frees, then stops while the trainer still works through the spool). Each is the lower where its side
        limits. The trainer's alone where fewer than two commits came after its start."""
        trainer = self.train.sustained_tokens_per_s()
        after = [(t, n) for t, n in self.commits if t >= self.train.started_at]
        a, b = (after[0][0], after[-1][0]) if after else (0.0, 0.0)
        waits = sum(max(0.0, min(b, to) - max(a, fro)) for fro, to in self.producer_waits + self.compile_waits)
        rate = rate_past_first(after, less=waits)
        return trainer if rate is None else min(trainer, rate)

    def committed_tokens_per_s(self) -> float:
        """A control on sustained_tokens_per_s: the extraction's commits over the trainer's later half of steps
        (TrainResult.sustained_tokens_per_s's window), from the first commit in it to the last, its waits for room
        counted. The trainer's figure over that window may count states the spool held at its start (a short run
        against its spool); the commits cannot. 0.0 where fewer than two commits fall in the window (the extraction
        ended before it: the spool held the rest of the plan)."""
        later = self.train.later_steps()
        if later is None:
            return 0.0
        t0 = self.train.started_at  # the timeline's clock starts there; the commits' is perf_counter's
        rate = rate_past_first([(t, n) for t, n in self.commits if t0 + later[1] < t <= t0 + later[2]])
        return 0.0 if rate is None else rate

    def lines(self) -> list[str]:
        ex = self.extracted_tokens / self.extract_seconds if self.extract_seconds else 0.0
        limit = "training" if self.producer_wait_s > self.trainer_wait_s else "extraction"
        return (
            self.train.lines()
            + ([f"check      {self.selfcheck}"] if self.selfcheck else [])
            + [
                f"online     extracted {self.extracted_tokens:,} tokens this run at {ex:,.0f} tok/s "
                f"into {self.shards:,} "
                f"shards; spool {self.spool} "
                f"peak {self.peak_bytes / 2**20:,.1f} MiB (files {self.peak_files_bytes / 2**20:,.1f} MiB) of "
                f"{self.capacity / 2**20:,.1f} MiB; sustained {self.sustained_tokens_per_s():,.0f} tok/s once training "
                f"began (committed over the trainer's later half: {self.committed_tokens_per_s():,.0f} tok/s)",
                f"limits     {limit}: extraction waited {self.producer_wait_s:.1f} s for room, training waited "
                f"{self.trainer_wait_s:.1f} s for states",
            ]
            + (
                [
                    f"compile    the engine in this process waited {self.compile_wait_s:.1f} s "
                    f"behind {self.compiles} compiles of the trainer"
                ]
                if self.compiles
                else []
            )
            + (
                [
                    "engine     "
                    + ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in self.engine_phases.items())
                    + " (the producer's calls: prefills, sealing each batch, settling before a wait for room)"
                ]
                if self.engine_phases
                else []
            )
        )


def run(
    cfg: TrainConfig,
    extract_cfg,
    samples: Sequence[Sample],
    capacity: int,
    backend=None,
    extract_batch: int = 16,
    progress: bool = True,
) -> OnlineResult:
    """Train cfg (cfg.store is the spool folder) on ``samples`` extracted by extract_cfg's backend as training
    goes, through a spool of ``capacity`` bytes. ``backend`` may be passed in to reuse an engine."""
    from eagle3.extract.extract import make_backend, require_final_state, store_spec

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            "train --online runs as one process for now (one engine, one trainer); under torchrun "
            "each rank would extract everything. Run it without torchrun, or extract then train with DDP"
        )
    if len(samples) < cfg.batch_samples:
        raise UsageError(
            f"--data holds {len(samples)} samples, fewer than one batch (--batch {cfg.batch_samples}); "
            f"give --batch {len(samples)} or fewer, or more data"
        )
    spec = store_spec(extract_cfg.model, extract_cfg.layer_ids, extract_cfg.dtype)
    longest = max(len(s) for s in samples)
    need = 2 * (extract_batch * sample_bytes(longest, spec) + SHARD_MARGIN)
    if capacity < need:
        raise ValueError(
            f"a spool of {capacity:,} bytes (--spool-mb) cannot hold two extraction batches of {extract_batch} samples "
            f"of up to {longest} tokens ({need:,} bytes); give at least that, or a smaller --extract-batch"
        )
    # one shard per extraction batch, sealed before the next batch is submitted (and written while it runs, on the
    # vLLM path): no shard is left open between batches, so the trainer never waits on one that needs the next
    # batch's room to finish
    extract_cfg = dataclasses.replace(
        extract_cfg, out=str(cfg.store), shard_samples=extract_batch, writer_threads=0, fsync=False
    )  # the spool's shards, as the spool: never fsynced (Spool)
    ownership.claim(cfg.out, "train")  # before the spool (OUT/spool by default) is made in it
    claim(cfg.store)  # the spool: a store's folder, before its run stamp is written in it
    fresh = _check_same_run(Path(cfg.store), samples, cfg)
    spool = Spool(cfg.store, spec, capacity, fresh=fresh)
    plan = training_order(len(samples), cfg.batch_samples, cfg.epochs, cfg.seed, cfg.max_steps)
    own = backend is None
    backend = backend or make_backend(extract_cfg, spec)
    producer = Producer(spool, samples, plan, backend, extract_cfg, extract_batch)
    check = ""
    try:
        if extract_cfg.selfcheck:  # the offline extraction's first-batch check, before anything is trained
            check = require_final_state(backend, spool.store, extract_cfg, list(samples[: extract_cfg.selfcheck]))
        if producer.gate is not None:  # before the producer's first batch, which it holds the gate for
            producer.gate.install()
        if not (cfg.resume and checkpoint.latest(Path(cfg.out)) is not None):
            producer.start_once(0)  # a fresh run extracts while the trainer builds its draft (a resumed one starts
            # where its checkpoint says, at the trainer's first batch)
        result = train(cfg, progress=progress, source=SpoolSamples(spool, samples, plan, producer, cfg.seed))
    finally:
        if producer.gate is not None:
            producer.gate.remove()
        spool.close()
        producer.join()
        spool.store.release()
        if own:
            backend.close()
    if spool.failed is not None:
        raise spool.failed
    out = OnlineResult(
        result,
        str(spool.store.root),
        capacity,
        spool.peak,
        spool.peak_files,
        producer.tokens,
        spool.shards,
        producer.seconds,
        spool.producer_wait_s,
        spool.consumer_wait_s,
        check,
        producer.commits,
        spool.producer_waits,
        producer.gate.waits if producer.gate else [],
        producer.gate.compiles if producer.gate else 0,
        producer.engine_phases,
    )
    if result.samples_seen >= len(plan):
        shutil.rmtree(spool.store.root / SHARDS, ignore_errors=True)  # everything was learned from
    return out


def _check_same_run(spool: Path, samples: Sequence[Sample], cfg: TrainConfig) -> bool:
    """A spool continues only the run that made it: same samples, batch, epochs and seed. True where its stamp is
    unreadable (never fsynced, as the spool: a power loss's), which no run can be told from: the spool starts
    empty."""
    stamp = {
        "samples": [s.sample_id for s in samples],
        "batch": cfg.batch_samples,
        "epochs": cfg.epochs,
        "seed": cfg.seed,
        "max_steps": cfg.max_steps,
    }
    path = spool / "online.json"
    if path.exists():
        try:
            was = json.loads(path.read_text())
        except ValueError:  # not JSON, or not text
            log.warning(
                "spool %s: its run stamp %s is unreadable (a power loss's): the spool starts empty", spool, path.name
            )
            path.write_text(json.dumps(stamp))
            return True
        if was != stamp:
            raise StoreError(
                f"spool {spool} belongs to another online run (other samples, batch, epochs or seed); "
                "use a new --out, or the same data and options"
            )
        return False
    spool.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stamp))
    return False
