"""KVCacheManager: owns the layout, every level's pools, the radix tree and the requests; the
only entry point users need. Built from its core (`ManagerCore`: construction and queries) and
its rebalancing (`Rebalancing`); this module adds the requests."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Final, SupportsIndex, cast

from kvpool.cache import KVCache, PriorityCallback
from kvpool.config import CacheTier, ReuseScope
from kvpool.errors import ArgumentError, LogicError, OutOfPagesError
from kvpool.lookahead import DiskRange, Lookahead, LookaheadPool, RemoteQuery
from kvpool.manager.rebalancing import Rebalancing
from kvpool.manager.recovery import DiskRecovery
from kvpool.radix import Match, lost_block
from kvpool.records import LostBlock, Page
from kvpool.remote import NodeStatistics, RemotePrefix, RemoteStatistics
from kvpool.storage.memory import DiskMemory
from kvpool.storage.shared import SharedHostMemory, shared_pool_file
from kvpool.tokens import Token, root_key
from kvpool.validation import (
    check_bool,
    check_callable,
    check_int,
    fail,
    token_list,
)

SAVE_BATCH: Final = 256  # pages moved per batch by `save_to_disk`


class KVCacheManager(Rebalancing):
    """Paged, tiered KV-cache memory for one model."""

    _lookaheads: LookaheadPool | None = None  # (made by the first look_ahead)

    def create_kv_cache(
        self,
        reuse_scope: object = None,
        input_tokens: Sequence[Token] | None = None,
        id: SupportsIndex | None = None,
        priority_callback: PriorityCallback | None = None,
        exclude_from_stats: object = False,
        lookahead: Lookahead | None = None,
        remote: object = True,
    ) -> KVCache:
        """A new request, SUSPENDED, already holding the longest reusable prefix of
        `input_tokens` (`num_committed_tokens == history_length == capacity ==` its length).
        Leave out the prompt tokens that must be recomputed (at least the last one).
        `exclude_from_stats` marks warm-up or padding requests: they never feed rebalancing.
        `lookahead`: a ready `look_ahead` of the same scope and tokens, whose answer and values
        stand in for the remote tier's (no I/O here, none in the first resume). `remote=False`:
        the remote tier is not asked (a request that only saves what it computed)."""
        self._require_open()
        started = time.perf_counter()
        scope_key = root_key(reuse_scope)
        id = self._new_id(id)
        check_callable("priority_callback", priority_callback)
        exclude = check_bool("exclude_from_stats", exclude_from_stats)
        ask_remote = check_bool("remote", remote)
        tokens = [] if input_tokens is None else token_list("input_tokens", input_tokens)
        if lookahead is not None:
            self._check_lookahead(lookahead, scope_key, tokens)
        match, prefix = self._match(scope_key, tokens, lookahead, ask_remote)
        if self._kv_events is not None and scope_key not in self._kv_events.scopes:
            scope = cast(ReuseScope, reuse_scope or ReuseScope())  # (checked by root_key)
            self._kv_events.scopes[scope_key] = scope  # (lora ids, salts)
        if self._persist is not None and scope_key not in self._persist.scopes:
            self._persist.note_scope(scope_key, cast(ReuseScope, reuse_scope or ReuseScope()))
        cache = self._cache_class(
            self._context, self._cache_parts, id, scope_key, priority_callback, exclude
        )
        counters = self._counters
        counters.requests += 1
        counters.query_tokens += len(tokens)
        if match.num_tokens:
            cache.adopt_match(match, tokens)
            self._count_hits(cache, match.num_tokens)
        if self._policy is not None:
            self._policy.used(match.blocks)
        if prefix is not None:
            cache._remote = prefix
        if self._storage.state.events is not None:
            self._storage.state.events.append(("create", id, cache.num_committed_tokens))
        self._living[id] = cache
        self._after_call()
        if counters.calls is not None:
            self._observe("create_kv_cache", started)
        return cache

    def fork_kv_cache(self, cache: object, id: SupportsIndex | None = None) -> KVCache:
        """A new ACTIVE request continuing `cache`'s history (ACTIVE, of this manager): the
        same lengths and committed tokens, every page shared (beam search, several samples of
        one prompt). Before either writes KV, `prepare_write` copies the page it writes into
        if it is shared (copy-on-write): full blocks stay shared. Forks must commit the same
        tokens for the positions they shared (`kvpool.cache.forking`). `OutOfPagesError` when
        no slot is left for an SSM state's copy, with nothing changed."""
        self._require_open()
        if not isinstance(cache, KVCache) or self._living.get(cache.id) is not cache:
            fail("cache", cache, "an open KV cache of this manager")
        id = self._new_id(id)
        child = self._cache_class(
            self._context,
            self._cache_parts,
            id,
            cache._scope_key,
            cache._priority_callback,
            cache.exclude_from_stats,
        )
        cache._fork_into(child)
        if self._storage.state.events is not None:
            self._storage.state.events.append(("fork", cache.id, id))
        self._living[id] = child
        self._after_call()
        return child

    def _new_id(self, id: object) -> int:
        """`id` checked, or the next free one."""
        if id is None:
            id = next(self._ids)
            while id in self._living:
                id = next(self._ids)
        elif type(id) is not int:
            fail("id", id, "an int or None")
        elif id in self._living:
            raise ArgumentError(f"id={id} is invalid: must not be the id of an open KV cache")
        return id

    def _count_hits(self, cache: KVCache, reused: int) -> None:
        """Reused tokens by the level they are served from: a block counts at the coldest of
        the pages the request holds for it."""
        tpb, hits = self.tokens_per_block, self._counters.hit_tokens_by_level
        if len(hits) == 1:  # one level: no walk
            hits[0] += reused
            return
        tables = cache._pages
        for index in range(-(-reused // tpb)):
            level = 0
            for pages in tables:
                page = pages[index] if index < len(pages) else None
                if page is not None and page.level > level:
                    level = page.level
            hits[level] += min(tpb, reused - index * tpb)

    def probe_reuse(
        self, reuse_scope: object, input_tokens: Sequence[Token], remote: object = True
    ) -> int:
        """How many tokens of `input_tokens` a new request would reuse now (holds nothing).
        `remote=False`: of the local levels alone (no I/O)."""
        self._require_open()
        scope_key = root_key(reuse_scope)
        tokens = token_list("input_tokens", input_tokens)
        ask_remote = check_bool("remote", remote)
        started = time.perf_counter()
        match, prefix = self._match(scope_key, tokens, None, ask_remote)
        if self._counters.calls is not None:
            self._observe("probe_reuse", started)
        return match.num_tokens if prefix is None else prefix.end * self.tokens_per_block

    def look_ahead(self, reuse_scope: object, input_tokens: Sequence[Token]) -> Lookahead:
        """Start the I/O a lookup of `input_tokens` waits for, off this thread (read-ahead of
        the local match's disk pages, the remote tier's answer and values: `kvpool.lookahead`),
        and return at once. Poll `ready`, then pass it to `create_kv_cache`; `cancel()` it if
        the request goes away. Ready at once when the lookup needs no I/O."""
        self._require_open()
        scope_key = root_key(reuse_scope)
        tokens = token_list("input_tokens", input_tokens)
        match = self._tree.match(scope_key, tokens, self._config.enable_partial_reuse)
        query = None
        if self._remote is not None:
            aligned, parent_key, start = self._aligned(scope_key, tokens, match)
            if len(tokens) // self.tokens_per_block > start:
                query = RemoteQuery(parent_key, tokens, start, _parent_tag(aligned))
        lookahead = Lookahead(scope_key, tokens, self._disk_ranges(match), query)
        if self._lookaheads is None:
            self._lookaheads = LookaheadPool(self._remote, self._config.lookahead_threads)
        self._lookaheads.submit(lookahead)
        return lookahead

    def _disk_ranges(self, match: Match) -> list[DiskRange]:
        """The file ranges of the match's pages that are on a disk level."""
        ranges = []
        for block in match.blocks:
            for page in block.pages:
                if page is None or self._levels[page.level].tier is not CacheTier.DISK:
                    continue
                assert page.slot is not None
                group = self._levels[page.level].pool_groups[page.pool_group]
                for memory, size in zip(group.memories, group.slot_sizes, strict=True):
                    if isinstance(memory, DiskMemory):
                        at = memory.file_offset(page.slot.slot_id * size)
                        ranges.append(DiskRange(memory.fileno, at, size))
        return ranges

    def _check_lookahead(self, lookahead: object, scope_key: bytes, tokens: list[Token]) -> None:
        if not isinstance(lookahead, Lookahead):
            fail("lookahead", lookahead, "None or what look_ahead() returned")
        if not lookahead.ready:
            raise LogicError("create_kv_cache(lookahead=...) before the lookahead is ready")
        if lookahead.scope_key != scope_key or lookahead.tokens != tokens:
            raise ArgumentError(
                "lookahead is invalid: it was made for another reuse scope or other tokens"
            )

    def _aligned(
        self, scope_key: bytes, tokens: list[Token], match: Match
    ) -> tuple[Match, bytes, int]:
        """`match` cut to whole blocks (the remote tier holds whole blocks), the key of its
        last block (the scope's when none) and its number of blocks. (The last block's tag,
        which the remote lookup also needs: `_parent_tag`.)"""
        tpb = self.tokens_per_block
        aligned = match
        if match.num_tokens % tpb:
            aligned = self._tree.match(scope_key, tokens[: match.num_tokens // tpb * tpb], False)
        parent_key = aligned.blocks[-1].key if aligned.blocks else scope_key
        return aligned, parent_key, aligned.num_tokens // tpb

    def _match(
        self,
        scope_key: bytes,
        tokens: list[Token],
        lookahead: Lookahead | None = None,
        ask_remote: bool = True,
    ) -> tuple[Match, RemotePrefix | None]:
        """The longest reusable prefix of `tokens`: the local tree's match, or a block-aligned
        local match continued by the remote tier (or by `lookahead`'s answer from it) when
        that reaches further."""
        match = self._tree.match(scope_key, tokens, self._config.enable_partial_reuse)
        if self._remote is None or not ask_remote:
            return match, None
        aligned, parent_key, start = self._aligned(scope_key, tokens, match)
        if lookahead is None:
            prefix = self._remote.lookup(parent_key, tokens, start, parent_tag=_parent_tag(aligned))
        else:  # (its answer continues the local match as it is now, or it is not used)
            prefix = lookahead.remote
            if prefix is not None and (prefix.start != start or prefix.parent_key != parent_key):
                prefix = None
            self._remote.add_statistics(lookahead.stats)
            lookahead.stats = RemoteStatistics()
        tpb = self.tokens_per_block
        if prefix is None or prefix.end * tpb <= match.num_tokens:
            return match, None
        return aligned, prefix

    def remote_nodes(self) -> dict[str, NodeStatistics]:
        """Per node of a remote cluster (its address; the nodes serving slots first, in slot
        order): calls, errors, skipped calls, redirections, reconnects and latency of every
        connection of this manager to it. Empty without a cluster."""
        return {} if self._remote is None else self._remote.node_statistics()

    def write_remote(self, cache: object, first_block: SupportsIndex = 0) -> int:
        """Write `cache`'s committed full blocks from `first_block` on to the remote tier now
        (write-through), not only when the local levels drop them, so that other instances
        find them at once. Their KV must be in the pages already (they are read now, and sent
        by the writer thread). Returns the pages queued; 0 without a remote tier."""
        self._require_open()
        if not isinstance(cache, KVCache) or self._living.get(cache.id) is not cache:
            fail("cache", cache, "an open KV cache of this manager")
        first = check_int("first_block", first_block, 0)
        if self._remote is None:
            return 0
        tpb = self.tokens_per_block
        end = (cache.num_committed_tokens - cache.pending_remote_tokens) // tpb
        items: list[tuple[LostBlock, Page]] = []
        for pages in cache._pages:
            for page in pages[first:end]:
                block = None if page is None else page.block
                if page is not None and block is not None and block.num_tokens == tpb:
                    lost = lost_block(block, tpb)
                    if lost is not None:
                        items.append((lost, page))
        return self._write_remote(items) if items else 0

    def shared_memory(self) -> dict[str, str]:
        """A shared first level's pools (`GpuCacheTierConfig.shared_dir`/`shared_by_fd`): each
        pool's file name (`storage.shared.shared_pool_file`) -> the path another process maps
        (`storage.shared.map_shared`). Empty when level 0 is not shared."""
        found = {}
        for g, group in enumerate(self.level_storage(0).pool_groups):
            for pool, memory in enumerate(group.memories):
                if isinstance(memory, SharedHostMemory):
                    found[shared_pool_file(g, pool)] = memory.handle_path
        return found

    @property
    def disk_recovery(self) -> DiskRecovery | None:
        """What this manager found on its persistent disk level when it started (None without
        one): records, pages and blocks recovered, slots discarded by reason, bytes verified."""
        return self._disk_recovery

    @property
    def num_open_kv_caches(self) -> int:
        return len(self._living)

    @property
    def open_kv_caches(self) -> list[KVCache]:
        """The open requests, in the order they were created."""
        return list(self._living.values())

    def clear_reusable_blocks(self) -> None:
        """Forget every cached block (refused while requests are open), a persistent disk
        level's records included: a later manager finds none of them."""
        self._require_open()
        self._refuse_with_open_caches("clear_reusable_blocks")
        if self._persist is not None:  # (forgotten for later managers too)
            self._persist.forget_all()
        for page in self._tree.clear():
            self._storage.owners.settle(page)
        if self._kv_events is not None:
            self._kv_events.cleared()
        self._after_call()

    def save_to_disk(self) -> int:
        """Move the cached pages of the levels above a persistent disk level down to it (the
        host's, then the GPU's, oldest first; room made there as eviction makes it, dropping
        its least valuable pages), so that a manager started later on the level finds whole
        chains: eviction trims a chain from its end, so the first blocks of hot prefixes stay
        on the GPU or the host, and a chain whose first blocks are lost is not reachable after
        a restart. Call it before `shutdown()` for a warm restart (it copies as much as the
        upper levels cache; when that is more than the disk level holds, the pages moved last,
        the GPU's newest, are the ones kept). Refused while requests are open; `LogicError`
        without a persistent disk level. Returns the pages moved down."""
        self._require_open()
        self._refuse_with_open_caches("save_to_disk")
        persist = self._persist
        if persist is None:
            raise LogicError(
                "save_to_disk() needs a persistent disk level (DiskCacheTierConfig.persistent_id)"
            )
        state, allocation, migration = (
            self._storage.state,
            self._storage.allocation,
            self._storage.migration,
        )
        disk, moved = persist.level, 0
        for level in range(disk - 1, -1, -1):
            for pool_group in range(len(state.queues[level])):
                pages = list(state.queues[level][pool_group])  # (every one cached: committed)
                step = max(1, min(SAVE_BATCH, state.allocators[disk][pool_group].capacity))
                full = False
                for start in range(0, len(pages), step):
                    batch = [p for p in pages[start : start + step] if p.level == level]
                    if not batch:
                        continue
                    try:
                        allocation.make_room(disk, pool_group, len(batch))
                    except OutOfPagesError:
                        full = True
                        break
                    # (a drop may have taken some of them out of the tree: freed)
                    batch = [p for p in batch if p.slot is not None and p.level == level]
                    migration.migrate(batch, disk)
                    moved += len(batch)
                if full:  # (nothing left to drop: no more room in this pool group)
                    continue
        self._after_call()
        return moved

    def shutdown(self) -> None:
        """Release all memory (idempotent; refused while requests are open)."""
        if self._closed:
            return
        self._refuse_with_open_caches("shutdown")
        for page in self._tree.clear():
            self._storage.owners.settle(page)
        if self._lookaheads is not None:
            self._lookaheads.close()
        if self._remote is not None:
            self._remote.close()
        if self._kv_events is not None and self._publisher is not None:
            self._kv_events.cleared()
            self._kv_events.flush()
            self._publisher.close()
        self._storage.close()
        self._levels = []
        self._closed = True

    def _refuse_with_open_caches(self, operation: str) -> None:
        if self._living:
            raise LogicError(
                f"{operation}() with {len(self._living)} KV cache(s) still open; close them first"
            )


def _parent_tag(aligned: Match) -> bytes:
    """The tag of a block-aligned match's last block (b"" when it has none)."""
    return aligned.blocks[-1].tag if aligned.blocks else b""
