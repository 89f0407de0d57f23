"""Collecting KV events where the manager changes what it caches.

The storage manager and the radix tree call the log where a full block's page enters the tree
(a commit, a fetch from the remote tier), moves to another level, or leaves the tree (a drop,
its block losing its reuse, a duplicate replaced). The log builds the wire events right there,
merging runs as they come (a committed chain of blocks is one `BlockStored`, consecutive
removals from one medium one `BlockRemoved`): per block a few integer conversions and list
appends, nothing per token beyond copying the block's token ids. `flush()` (once per engine step)
hands the step's events to the publisher's thread, which only stamps, encodes and sends them
(kept this way, the thread barely competes with the engine for the interpreter).

A page changing level is a `BlockRemoved` from the old medium and a `BlockStored` on the new
one, so a subscriber's view per medium is a set it adds to and removes from, and equals the
manager's own (`cached_blocks`). Partial blocks are not announced (a router hashes full blocks).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvpool.config import ReuseScope
from kvpool.events.naming import MEDIUM_EXTERNAL
from kvpool.events.naming import block_hash as _hash
from kvpool.records import Block, LostBlock, Page

_DIGEST_MARKER = b"\xff\xff\xff\xff"


class KVEventLog:
    """The engine thread's side: the step's events, handed over by `flush()`. Needs msgspec
    (the manager makes one only when `kv_events` is configured)."""

    def __init__(
        self,
        tokens_per_block: int,
        media: Sequence[str],
        publish: Callable[[list[Any]], None],
        max_pending: int = 65_536,
    ) -> None:
        import kvpool.events.wire as wire

        self._wire = wire
        self.tokens_per_block = tokens_per_block
        self._media = list(media)
        self._publish = publish
        self._max_pending = max_pending
        self._unpack = struct.Struct(f"<{tokens_per_block}i").unpack
        self.scopes: dict[bytes, ReuseScope] = {}  # scope key -> scope (lora ids, salts)
        self.pending: list[Any] = []  # the step's events
        self.num_batches = 0  # handed to the publisher so far (the next batch's sequence number)
        # The BlockStored a next block may extend: the event, its last key and its scope.
        self._stored: Any = None
        self._stored_key = b""
        self._stored_scope = b""

    # -- what the manager reports ----------------------------------------------------------------

    def stored_blocks(self, blocks: Sequence[Block], layer_group: int, level: int) -> None:
        """Blocks' pages of `layer_group` now cached at `level` (a committed chain; a partial
        tail block among them is not announced)."""
        medium, tpb = self._media[level], self.tokens_per_block
        for block in blocks:
            if block.num_tokens != tpb:
                continue
            parent = block.parent
            assert parent is not None
            self._store(block.key, parent.key, block.data, block.scope, layer_group, medium)

    def stored(self, block: Block, layer_group: int, level: int) -> None:
        self.stored_blocks((block,), layer_group, level)

    def removed(self, block: Block, layer_group: int, level: int) -> None:
        if block.num_tokens == self.tokens_per_block:
            self._remove(block.key, layer_group, self._media[level])

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
        source, target = self._media[source_level], self._media[level]
        for block, group in moved:
            self._remove(block.key, group, source)
        for block, group in moved:
            parent = block.parent
            assert parent is not None
            self._store(block.key, parent.key, block.data, block.scope, group, target)

    def written_remote(self, blocks: Sequence[tuple[LostBlock, int]]) -> None:
        """Pages (what their block was, layer group) queued for the remote tier."""
        for block, group in blocks:
            parent = block.parent_key or block.scope
            self._store(block.key, parent, block.data, block.scope, group, MEDIUM_EXTERNAL)

    def cleared(self) -> None:
        self._stored = None
        self.pending.append(self._wire.AllBlocksCleared())

    def flush(self) -> None:
        """Publish the step's events as one batch (nothing when there are none)."""
        if self.pending:
            events, self.pending = self.pending, []
            self._stored = None
            self.num_batches += 1
            self._publish(events)

    # -- building events -------------------------------------------------------------------------

    def _store(
        self, key: bytes, parent: bytes, data: bytes, scope: bytes, group: int, medium: str
    ) -> None:
        digests: tuple[bytes, ...] = ()
        if len(data) == 4 * self.tokens_per_block:
            tokens = list(self._unpack(data))
        else:
            tokens, digests = self._decode(data)
        scope_of = self.scopes.get(scope)
        extra = self._extra(scope_of, digests)
        last = self._stored
        if (
            last is not None
            and parent == self._stored_key
            and scope == self._stored_scope
            and last.group_idx == group
            and last.medium == medium
        ):
            last.block_hashes.append(_hash(key))
            last.token_ids += tokens
            if last.extra_keys is not None or extra is not None:
                if last.extra_keys is None:
                    last.extra_keys = [None] * (len(last.block_hashes) - 1)
                last.extra_keys.append(extra)
        else:
            last = self._stored = self._wire.BlockStored(
                [_hash(key)],
                None if parent == scope else _hash(parent),
                tokens,
                self.tokens_per_block,
                None if scope_of is None else scope_of.lora_id,
                medium,
                None,
                extra_keys=None if extra is None else [extra],
                group_idx=group,
            )
            self.pending.append(last)
            if len(self.pending) >= self._max_pending:
                self.flush()
        self._stored_key, self._stored_scope = key, scope

    def _remove(self, key: bytes, group: int, medium: str) -> None:
        self._stored = None
        pending = self.pending
        last = pending[-1] if pending else None
        if (
            type(last) is self._wire.BlockRemoved
            and last.group_idx == group
            and last.medium == medium
        ):
            last.block_hashes.append(_hash(key))
        else:
            pending.append(self._wire.BlockRemoved([_hash(key)], medium, group_idx=group))
            if len(pending) >= self._max_pending:
                self.flush()

    @staticmethod
    def _decode(data: bytes) -> tuple[list[int], tuple[bytes, ...]]:
        """A block's token ids (-1 for a multimodal digest) and its digests."""
        tokens: list[int] = []
        digests: list[bytes] = []
        offset = 0
        while offset < len(data):
            if data[offset : offset + 4] == _DIGEST_MARKER:
                digests.append(data[offset + 4 : offset + 36])
                tokens.append(-1)
                offset += 36
            else:
                tokens.append(int.from_bytes(data[offset : offset + 4], "little"))
                offset += 4
        return tokens, tuple(digests)

    @staticmethod
    def _extra(scope: ReuseScope | None, digests: tuple[bytes, ...]) -> tuple[Any, ...] | None:
        """A block's extra keys: its scope's salt, then its digests (None when neither)."""
        if scope is not None and scope.salt is not None:
            return (scope.salt, *digests)
        return digests or None


__all__ = ["KVEventLog"]
