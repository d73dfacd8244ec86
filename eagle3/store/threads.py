"""How many threads write a store's shards (no torch here: `eagle3 bench disk` checks its arguments first)."""

from __future__ import annotations


def writer_threads(fsync: bool) -> int:
    """The shard writer's threads on a vLLM engine's owner rank. Fsynced shards: 4, what the disk's queue takes.
    Page-cache shards: 8, since one thread copies only ~2.4 GB/s into the page cache."""
    return 4 if fsync else 8
