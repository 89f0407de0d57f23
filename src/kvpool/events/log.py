"""Collecting KV events where the manager changes what it caches, cheaply.

The storage manager and the radix tree call the log where a full block's page enters the tree
(a commit, a fetch from the remote tier), moves to another level, or leaves the tree (a drop,
its block losing its reuse, a duplicate replaced); the log appends one small tuple per page and
turns nothing into wire events on the engine's thread. `flush()` (once per engine step) hands the
step's records to the publisher's thread as one batch, which merges runs (a committed chain of
blocks is one `BlockStored`) and encodes them.

A page changing level is a `BlockRemoved` from the old medium and a `BlockStored` on the new
one, so a subscriber's view per medium is a set it adds to and removes from, and equals the
manager's own (`cached_blocks`). Partial blocks are not announced (a router hashes full blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvpool.config import CacheTier
from kvpool.records import Block, Page

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"
MEDIUM_EXTERNAL = "EXTERNAL"  # the shared remote tier
MEDIA = {CacheTier.GPU: MEDIUM_GPU, CacheTier.HOST: MEDIUM_CPU, CacheTier.DISK: MEDIUM_DISK}

# Records: ("S", key, parent key or None, data, scope key, layer group, level) for a store,
# ("R", key, layer group, level) for a removal, ("C",) for everything cleared, and
# ("X", key, parent key or None, data, scope key, layer group) for a value written to the
# remote tier.
Record = tuple[Any, ...]


class KVEventLog:
    """The engine thread's side: records, handed over per step."""

    def __init__(
        self,
        tokens_per_block: int,
        publish: Callable[[list[Record]], None],
        max_pending: int = 65_536,
    ) -> None:
        self._tpb = tokens_per_block
        self._publish = publish
        self._max_pending = max_pending
        self.pending: list[Record] = []
        self.num_batches = 0  # handed to the publisher so far (the next batch's sequence number)

    def stored(self, block: Block, layer_group: int, level: int) -> None:
        if block.num_tokens == self._tpb:
            parent = block.parent
            parent_key = None if parent is None or parent.parent is None else parent.key
            self.pending.append(
                ("S", block.key, parent_key, block.data, block.scope, layer_group, level)
            )
            if len(self.pending) >= self._max_pending:
                self.flush()

    def removed(self, block: Block, layer_group: int, level: int) -> None:
        if block.num_tokens == self._tpb:
            self.pending.append(("R", block.key, layer_group, level))

    def moved(self, pages: Iterable[Page], source_level: int, level: int) -> None:
        """Pages that changed level (the tree's copies among them are announced)."""
        tpb, pending = self._tpb, self.pending
        for page in pages:
            block = page.block
            if block is not None and block.num_tokens == tpb:
                group = page.layer_group
                parent = block.parent
                parent_key = None if parent is None or parent.parent is None else parent.key
                pending.append(("R", block.key, group, source_level))
                pending.append(("S", block.key, parent_key, block.data, block.scope, group, level))
        if len(pending) >= self._max_pending:
            self.flush()

    def written_remote(
        self, blocks: Sequence[tuple[bytes, bytes | None, bytes, bytes, int]]
    ) -> None:
        """Values (key, parent key, data, scope key, layer group) queued for the remote tier."""
        self.pending += [("X", *block) for block in blocks]

    def cleared(self) -> None:
        self.pending.append(("C",))

    def flush(self) -> None:
        """Publish what the step recorded as one batch (nothing when it recorded nothing)."""
        if self.pending:
            records, self.pending = self.pending, []
            self.num_batches += 1
            self._publish(records)


__all__ = [
    "MEDIA",
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "MEDIUM_EXTERNAL",
    "MEDIUM_GPU",
    "KVEventLog",
    "Record",
]
