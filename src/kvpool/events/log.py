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
from kvpool.records import Block, LostBlock, Page

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"
MEDIUM_EXTERNAL = "EXTERNAL"  # the shared remote tier
MEDIA = {CacheTier.GPU: MEDIUM_GPU, CacheTier.HOST: MEDIUM_CPU, CacheTier.DISK: MEDIUM_DISK}

# Records, in order: ("S", keys, parent keys, datas, scope key, layer group, level) for full
# blocks (lists; a parent key equal to the scope key means "first block") now stored at a
# level; ("R", key, layer group, level) for a page removed from a level; ("M", keys, parent
# keys, datas, scope keys, layer groups, from level, to level) for pages that changed level;
# ("X", keys, parent keys, datas, scope keys, layer groups) for values written to the remote
# tier; ("C",) for everything cleared.
Record = tuple[Any, ...]


class KVEventLog:
    """The engine thread's side: records, handed over per step."""

    def __init__(
        self,
        tokens_per_block: int,
        publish: Callable[[list[Record]], None],
        max_pending: int = 65_536,
    ) -> None:
        self.tokens_per_block = tokens_per_block
        self._publish = publish
        self._max_pending = max_pending
        self.pending: list[Record] = []
        self.num_batches = 0  # handed to the publisher so far (the next batch's sequence number)

    def stored_blocks(self, blocks: list[Block], layer_group: int, level: int) -> None:
        """A committed chain of full blocks of one scope (each block's page of `layer_group`)."""
        self.pending.append(
            (
                "S",
                [block.key for block in blocks],
                [block.parent.key for block in blocks],  # type: ignore[union-attr]
                [block.data for block in blocks],
                blocks[0].scope,
                layer_group,
                level,
            )
        )
        if len(self.pending) >= self._max_pending:
            self.flush()

    def stored(self, block: Block, layer_group: int, level: int) -> None:
        if block.num_tokens == self.tokens_per_block:
            self.stored_blocks([block], layer_group, level)

    def removed(self, block: Block, layer_group: int, level: int) -> None:
        if block.num_tokens == self.tokens_per_block:
            self.pending.append(("R", block.key, layer_group, level))

    def moved(self, pages: Iterable[Page], source_level: int, level: int) -> None:
        """Pages that changed level (the tree's copies among them are announced)."""
        tpb = self.tokens_per_block
        moved = [
            (block, page.layer_group)
            for page in pages
            if (block := page.block) is not None and block.num_tokens == tpb
        ]
        if not moved:
            return
        self.pending.append(
            (
                "M",
                [block.key for block, _ in moved],
                [block.parent.key for block, _ in moved],  # type: ignore[union-attr]
                [block.data for block, _ in moved],
                [block.scope for block, _ in moved],
                [group for _, group in moved],
                source_level,
                level,
            )
        )
        if len(self.pending) >= self._max_pending:
            self.flush()

    def written_remote(self, blocks: Sequence[tuple[LostBlock, int]]) -> None:
        """Pages (what their block was, layer group) queued for the remote tier."""
        self.pending.append(
            (
                "X",
                [block.key for block, _ in blocks],
                [block.parent_key or block.scope for block, _ in blocks],
                [block.data for block, _ in blocks],
                [block.scope for block, _ in blocks],
                [group for _, group in blocks],
            )
        )

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
