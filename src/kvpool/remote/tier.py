"""The shared tier below the local levels: what goes to it, what a lookup finds, what a fetch
brings back.

- Write-back: a committed full block's page that leaves the last local level is written to the
  store (by the write-back thread) instead of only being dropped.
- Lookup (`create_kv_cache`, `probe_reuse`): past the local prefix, one pipelined existence
  query for the next blocks of the prompt, every layer group of each; the longest prefix whose
  blocks hold every page resuming at its end needs (the rule of the local tree: full attention
  every block, a window its sinks and tail, SSM a snapshot at the end) is the remote hit.
- Fetch (`resume()`, `prefetch()`): the pages that prefix needs, in one pipelined read, each
  value checked. A value gone or failing its check shortens the prefix to the blocks before it
  (the pages the shorter prefix needs are fetched in turn), never leaves a hole, never raises.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from hashlib import sha256

from kvpool.config import RemoteCacheTierConfig
from kvpool.layout import KVLayout
from kvpool.lifecycles import AttentionLifeCycle
from kvpool.records import LostBlock, Page
from kvpool.remote.cluster import NodeStatistics
from kvpool.remote.store import RemoteStatistics, RemoteStore, WriteBack
from kvpool.remote.values import decode_value, encode_value, key_of, namespace_of
from kvpool.tokens import Token, encode_checked

Pair = tuple[int, int]  # (block index, layer group)


@dataclass
class RemotePrefix:
    """Blocks [start, end) of a request's prompt that the remote tier holds, past its local
    prefix of `start` blocks."""

    start: int
    end: int
    parent_key: bytes  # the key of block start - 1 (the scope's key when start is 0)
    keys: list[bytes]  # chained keys of blocks start .. end - 1
    tags: list[bytes | None]  # the tag placing each of them (`RemoteTier.placement_blocks`)
    datas: list[bytes]  # their encoded tokens
    tokens: list[Token]  # the prompt's first end x tokens-per-block tokens
    num_tokens: int  # the tokens of blocks [start, end): what it adds to the local prefix
    # its values, fetched and checked ahead of use (`kvpool.lookahead`): `fetch` returns them
    fetched: dict[Pair, memoryview] | None = None


class RemoteTier:
    """A manager's view of the shared store."""

    def __init__(
        self,
        config: RemoteCacheTierConfig,
        layout: KVLayout,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.layout = layout
        self.namespace = namespace_of(layout, config.model_id, config.namespace, config.shard)
        self._tpb = layout.tokens_per_block
        self._payload_bytes = [pool_group.slot_bytes for pool_group in layout.pool_groups]
        self._groups = list(enumerate(layout.life_cycles))
        self._full = [
            g for g, lc in self._groups if isinstance(lc, AttentionLifeCycle) and lc.window is None
        ]
        self.store = RemoteStore(config, clock)
        self.store.connect()
        self._writer = WriteBack(RemoteStore(config, clock), config.max_pending_writes)
        self._stats = RemoteStatistics()  # fetch and hit counters (the stores count the rest)
        self._extra_stores: list[RemoteStore] = []  # the look-ahead threads' own connections
        # Where a chain's second part starts (its tags: `RadixTree.placement_blocks`); -1: none.
        tokens = config.placement_tokens
        self.placement_blocks = -1 if tokens is None else tokens // self._tpb

    @property
    def statistics(self) -> RemoteStatistics:
        total = self._stats + self.store.stats + self._writer.store.stats
        for store in list(self._extra_stores):
            total += store.stats
        return total

    def node_statistics(self) -> dict[str, NodeStatistics]:
        """Per cluster node (its address, by slot order of the nodes serving slots first):
        the counters of every connection of the tier to it; empty without a cluster."""
        stores = [self.store, self._writer.store, *list(self._extra_stores)]
        total: dict[str, NodeStatistics] = {}
        first = self.store.cluster.primaries() if self.store.cluster is not None else []
        for address in first:
            total[address] = NodeStatistics()
        for store in stores:
            if store.cluster is not None:
                for address, stats in list(store.cluster.stats.items()):
                    total[address] = total.get(address, NodeStatistics()) + stats
        return total

    def new_store(self) -> RemoteStore:
        """Another connection to the server, for a thread of its own (closed with the tier)."""
        store = RemoteStore(self.config)
        self._extra_stores.append(store)
        return store

    def add_statistics(self, stats: RemoteStatistics) -> None:
        """Counters of a lookup done by another thread, on the manager's thread."""
        self._stats += stats

    def key(self, block_key: bytes, layer_group: int, tag: bytes | None) -> bytes:
        return key_of(self.namespace, block_key, layer_group, tag)

    def tags(self, parent_tag: bytes, keys: list[bytes], start: int) -> list[bytes | None]:
        """The tags of blocks start, start + 1, ... (of chained `keys`) after a block tagged
        `parent_tag`: the first block's and the one at `placement_blocks` are their own, the
        others their parent's (as the tree gives them: `RadixTree._new_block`)."""
        placement = self.placement_blocks
        if placement < 0:
            return [None] * len(keys)
        tags: list[bytes | None] = []
        tag = parent_tag
        for index, key in enumerate(keys, start):
            tag = key if index in (0, placement) else tag
            tags.append(tag)
        return tags

    # -- which pages a prefix needs --------------------------------------------------------------

    def needed(self, start: int, end: int) -> list[Pair]:
        """The pages of blocks [start, end) that resuming after block end - 1 needs."""
        tpb, length = self._tpb, end * self._tpb
        pairs: list[Pair] = []
        for g, life_cycle in self._groups:
            if not isinstance(life_cycle, AttentionLifeCycle):
                pairs.append((end - 1, g))  # an SSM state snapshot at the end
                continue
            beg, stale_end = life_cycle.stale_range(length, tpb)
            pairs += [(i, g) for i in range(start, end) if not beg <= i < stale_end]
        return pairs

    def usable_end(self, start: int, end: int, has: Callable[[int, int], bool]) -> int:
        """The largest end' <= `end` whose needed pages all pass `has` (`start` if none)."""
        for i in range(start, end):  # every full-attention page is needed: cap at the first gap
            if not all(has(i, g) for g in self._full):
                end = i
                break
        while end > start and not all(has(i, g) for i, g in self.needed(start, end)):
            end -= 1
        return end

    # -- lookup and fetch ------------------------------------------------------------------------

    def lookup(
        self,
        parent_key: bytes,
        tokens: Sequence[Token],
        start: int,
        store: RemoteStore | None = None,
        stats: RemoteStatistics | None = None,
        parent_tag: bytes = b"",
    ) -> RemotePrefix | None:
        """The remote part of the prefix of `tokens` past its first `start` (local) blocks
        (asked on `store` and counted in `stats`: by default the tier's own); `parent_tag` is
        the tag of local block start - 1 (`Block.tag`)."""
        store = self.store if store is None else store
        stats = self._stats if stats is None else stats
        tpb = self._tpb
        count = min(len(tokens) // tpb - start, self.config.max_lookup_blocks)
        if count <= 0:
            return None
        keys, datas = [], []
        key = parent_key
        for index in range(start, start + count):
            data = encode_checked(tokens[index * tpb : (index + 1) * tpb])
            key = sha256(key + data).digest()
            keys.append(key)
            datas.append(data)
        groups = len(self._groups)
        tags = self.tags(parent_tag, keys, start)
        found = store.exists(
            [self.key(k, g, t) for k, t in zip(keys, tags, strict=True) for g in range(groups)]
        )
        if found is None:
            return None
        stats.lookups += 1
        end = self.usable_end(start, start + count, lambda i, g: found[(i - start) * groups + g])
        if end == start:
            return None
        stats.found_blocks += end - start
        n = end - start
        return RemotePrefix(
            start,
            end,
            parent_key,
            keys[:n],
            tags[:n],
            datas[:n],
            list(tokens[: end * tpb]),
            n * tpb,
        )

    def fetch(
        self,
        prefix: RemotePrefix,
        store: RemoteStore | None = None,
        stats: RemoteStatistics | None = None,
    ) -> tuple[int, dict[Pair, memoryview]]:
        """Read the pages `prefix` needs; returns the end it can keep (shortened past a value
        that is gone or fails its check) and the payload of each page that end needs. A
        prefix fetched ahead (`fetched`) is returned as it is, without I/O."""
        if prefix.fetched is not None:
            return prefix.end, prefix.fetched
        store = self.store if store is None else store
        stats = self._stats if stats is None else stats
        start, end = prefix.start, prefix.end
        fetched: dict[Pair, memoryview | None] = {}
        while end > start:
            wanted = [pair for pair in self.needed(start, end) if pair not in fetched]
            if wanted:
                keys = [
                    self.key(prefix.keys[i - start], g, prefix.tags[i - start]) for i, g in wanted
                ]
                values = store.get_many(keys)
                unreached = store.last_unreached  # (a cluster's failed nodes: not missing)
                for n, (key, (i, g), value) in enumerate(
                    zip(keys, wanted, values or [None] * len(wanted), strict=True)
                ):
                    size = self._payload_bytes[self.layout.pool_group_of[g]]
                    payload = decode_value(key, value, size)
                    if payload is not None:
                        stats.bytes_read += len(value)  # type: ignore[arg-type]
                    elif values is not None and n not in unreached:
                        if value is None:
                            stats.missing_values += 1
                        else:
                            stats.corrupt_values += 1
                    fetched[i, g] = payload
            shorter = self.usable_end(start, end, lambda i, g: fetched.get((i, g)) is not None)
            if shorter == end:
                break
            end = shorter
        if end == start:
            return start, {}
        return end, {pair: fetched[pair] for pair in self.needed(start, end)}  # type: ignore[misc]

    def shortened(
        self, prefix: RemotePrefix, end: int, payloads: dict[Pair, memoryview]
    ) -> RemotePrefix:
        """`prefix` cut to blocks [start, end), with the payloads `fetch` returned for it."""
        n = end - prefix.start
        return RemotePrefix(
            prefix.start,
            end,
            prefix.parent_key,
            prefix.keys[:n],
            prefix.tags[:n],
            prefix.datas[:n],
            prefix.tokens[: end * self._tpb],
            n * self._tpb,
            payloads,
        )

    def note_hit(self, blocks: int) -> None:
        self._stats.fetched_blocks += blocks
        self._stats.hit_tokens += blocks * self._tpb

    # -- write-back ------------------------------------------------------------------------------

    def write_back(
        self, items: Sequence[tuple[LostBlock, Page]], read: Callable[[Page], bytes]
    ) -> list[int]:
        """Queue the bytes (`read(page)`) of committed full blocks' pages that the local levels
        are about to lose; returns the indices of the items queued. A page whose bytes cannot
        be read is skipped (counted as a failed write), and so are those beyond the queue's
        bound (counted as dropped)."""
        values, indices = [], []
        for i, (block, page) in enumerate(items):
            try:
                payload = read(page)
            except OSError:
                self._stats.failed_writes += 1
                continue
            tag = None if self.placement_blocks < 0 else block.tag
            key = self.key(block.key, page.layer_group, tag)
            values.append((key, encode_value(key, payload)))
            indices.append(i)
        if not values:
            return []
        return indices[: self._writer.submit(values)]

    def flush(self, timeout: float | None = None) -> bool:
        return self._writer.flush(timeout)

    def close(self, timeout: float = 5.0) -> None:
        self._writer.close(timeout)
        self._writer.store.close()
        self.store.close()
        for store in self._extra_stores:
            store.close()


__all__ = ["RemotePrefix", "RemoteTier"]
