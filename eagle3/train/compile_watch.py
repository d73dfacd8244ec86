"""Where torch.compile gives up during a compiled run (TrainConfig.compile): dynamo's warning that a function reached
its recompile limit (torch._dynamo.config.recompile_limit, 8). Past it, that function runs eagerly for the rest of the
process: slower, and flex attention then unfused, its scores whole in memory (at 32k tokens, 768 GiB asked for).
dynamo says so once in its log; the run's summary (TrainResult.notes) says it too, with what it costs."""

from __future__ import annotations

import logging

DYNAMO = "torch._dynamo"


class RecompileLimitHits(logging.Handler):
    """A context: dynamo's recompile-limit warnings logged while it is open, one line each ("function: ..." as dynamo
    names it)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "hit config.recompile_limit" in text or "hit config.cache_size_limit" in text:  # older torch: the latter
            lines = text.splitlines()
            self.messages.append(lines[1].strip() if len(lines) > 1 else lines[0])

    def __enter__(self) -> RecompileLimitHits:
        logging.getLogger(DYNAMO).addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger(DYNAMO).removeHandler(self)

    def notes(self) -> list[str]:
        """What the run's summary says: each function once."""
        if not self.messages:
            return []
        where = "; ".join(dict.fromkeys(self.messages))
        return [
            (
                f"--compile: torch.compile reached its recompile limit ({where}); from then on that code ran "
                "eagerly, slower (flex attention unfused: its scores whole in memory). Train with fewer distinct "
                "sequence lengths (packs of --pack-tokens), or without --compile"
            )
        ]
