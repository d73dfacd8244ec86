"""The hf backend's writing session: states computed in this process go to a ShardWriter (extract.open_session;
`extract --regenerate`'s hf path writes through it too)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from eagle3.data.conversations import Sample
from eagle3.store.format import shard_tokens

if TYPE_CHECKING:
    from eagle3.store.folder import Store


class LocalSession:
    """In-process capture (hf backend): states come back here and go to a ShardWriter. ``cfg``: the ExtractConfig
    (shard_tokens, shard_samples, fsync, writer_threads)."""

    def __init__(self, backend, store: Store, cfg, fault, seal_each_batch: bool = False, wait_for_shards: bool = True):
        from eagle3.store.writer import ShardWriter

        self.backend, self.fault, self.seal_each_batch = backend, fault, seal_each_batch
        self.wait_for_shards = wait_for_shards  # with seal_each_batch (extract.open_session)
        self.writer = ShardWriter(
            store.root,
            store.spec,
            store.next_shard_index,
            shard_tokens(store.spec, cfg.shard_tokens),
            cfg.shard_samples,
            cfg.fsync,
            threads=cfg.writer_threads,
            fault=fault,
        )

    def submit(self, batch: Sequence[Sample], ahead: Sequence[Sequence[Sample]] = ()):
        """``ahead`` (the batches that come next) is the vLLM session's to announce; here nothing needs it."""
        states = self.backend.capture(batch)
        if self.fault:
            self.fault("after_batch")
        for s, st in zip(batch, states):
            self.writer.add(s.sample_id, torch.tensor(s.input_ids), torch.tensor(s.loss_mask), st)
        if not self.seal_each_batch:
            return self.writer.take_done()
        return self.writer.flush() if self.wait_for_shards else self.writer.seal()

    def settle(self):
        """Every shard not yet reported, once written; the session goes on."""
        return self.writer.flush()

    def finish(self):
        try:
            return self.writer.flush()
        finally:
            self.writer.close()

    def close(self) -> None:
        """End the writer's threads (after the shard each is writing) without sealing the open shard: a loop that
        failed or was interrupted. A thread left running as the interpreter exits aborted it ("terminate called
        without an active exception", exit -6, seen after Ctrl-C). Again, or after finish: nothing more happens."""
        self.writer.close()
