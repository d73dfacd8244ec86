"""How many threads write a store's shards (no torch here: `eagle3 bench disk` checks its arguments first)."""

from __future__ import annotations


def writer_threads(fsync: bool) -> int:
    """The shard writer's threads on a vLLM engine's owner rank. Fsynced shards: 4, the disk's queue (the 118974b run:
    the store reached 0.98x of 4 fsynced writers). Page-cache shards: 8; a thread copies ~2.4 GB/s into the
    page cache, and 4 reached 9.7 GB/s = 169,000 tok/s at Kimi's 57,344 B a token, under the 175,000 of vLLM's
    own extract_hidden_states connector (H200 host, the ffdd6a0 run)."""
    return 4 if fsync else 8
