"""KVCache: one request's blocks, lengths, page tables and state machine.

Lengths: ``num_committed_tokens <= history_length <= capacity``. `capacity` tokens have blocks
(``ceil(capacity / tokens_per_block)``); the KV of the first `history_length` tokens is computed;
committed tokens are final and their full blocks are in the radix tree.

Every page in the request's tables is owned by it: locked while ACTIVE, held while SUSPENDED.
Per step the work is proportional to the blocks that change, never to the history.

SSM layers: the live state slot must hold the state after exactly the committed tokens whenever a
commit fills a block or `stop_committing()` runs; kvpool then snapshots it into the tree, and a
later request can reuse a prefix only up to such a snapshot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from hashlib import sha256
from typing import TYPE_CHECKING, NoReturn

import numpy as np
import numpy.typing as npt

from kvpool import _debug
from kvpool.errors import ArgumentError, LogicError, OutOfPagesError, StorageError
from kvpool.layout import KVLayout
from kvpool.page_table import PageTable
from kvpool.radix import Match, RadixTree
from kvpool.records import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY, Block, Page
from kvpool.tokens import MAX_TOKEN, Token, block_key_of_encoded, encode_checked, encode_tokens
from kvpool.validation import check_index, token_list

if TYPE_CHECKING:
    from kvpool.tiers import Staged, StorageManager

GPU_LEVEL = 0
logger = logging.getLogger("kvpool")
PriorityCallback = Callable[[int, int], int]
"""(block ordinal, layer group id) -> eviction priority in [0, 100]; lower is evicted first.
Called for every layer group of every block a commit fills (or the tail `stop_committing`
inserts), before the commit changes anything: if it raises or returns a bad value, the commit
raises with nothing changed."""
Priorities = dict[tuple[int, int], int]


class KVCacheStatus(Enum):
    ACTIVE = "active"
    SUSPENDED = "suspended"
    CLOSED = "closed"


_ACTIVE = KVCacheStatus.ACTIVE  # (a module constant: checked on every step)


@dataclass
class CacheContext:
    """What a request needs from its manager (so the cache does not depend on the manager)."""

    layout: KVLayout
    storage: StorageManager
    tree: RadixTree
    max_util_for_resume: float
    on_close: Callable[[KVCache], None]
    check: Callable[[], None]
    check_thread: Callable[[], None]


class KVCache:
    """One request's KV cache. Created SUSPENDED by `KVCacheManager.create_kv_cache`."""

    def __init__(
        self,
        context: CacheContext,
        cache_id: int,
        scope_key: bytes,
        priority_callback: PriorityCallback | None,
        exclude_from_stats: bool = False,
    ) -> None:
        self._ctx = context
        self.id = cache_id
        self.exclude_from_stats = exclude_from_stats
        """Warm-up or padding requests: their shapes never feed the rebalancing estimate."""
        self.reused_length = 0  # tokens reused at creation
        self._sum_capacity = self._sum_history = self._num_resizes = 0  # for `mean_shape`
        self._priority_callback = priority_callback
        self._status = KVCacheStatus.SUSPENDED
        layout = context.layout
        self._tpb = layout.tokens_per_block
        self._capacity = self._history = self._committed = 0
        self._committing = True
        self._scope_key = scope_key
        # Key of the last committed full block: the next block goes under the tree's block with
        # this key (or the scope's root), looked up when it is committed, so no block object is
        # kept between calls.
        self._prev_key = scope_key
        self._tail: list[Token] = []  # committed tokens of the unfinished block
        self._attention = layout.attention
        self._attention_groups = [g for g, _ in layout.attention_pools]
        self._attention_pools = layout.attention_pools
        self._attention_per_pool = layout.attention_per_pool
        self._windowed = layout.windowed
        self._ssm = layout.ssm_groups
        self._table = PageTable(len(layout.life_cycles), self._ssm)
        self._pages = self._table.pages  # per layer group: the page of each block (or SSM state)
        self._released_end = [0] * len(self._pages)  # stale blocks below this are released
        self._window_check = 0  # below this history length no window lets a block go
        # Shared pages to copy into private ones on first resume: (layer group, block, page).
        # The block is -1 for an SSM state snapshot.
        self._deferred: list[tuple[int, int, Page]] = []

    # -- state -----------------------------------------------------------------------------------

    @property
    def status(self) -> KVCacheStatus:
        return self._status

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def history_length(self) -> int:
        return self._history

    @property
    def num_committed_tokens(self) -> int:
        return self._committed

    @property
    def num_blocks(self) -> int:
        return -(-self._capacity // self._tpb)

    @property
    def mean_shape(self) -> tuple[float, float]:
        """Mean capacity and history length over the calls to `resize` (0, 0 if none)."""
        count = self._num_resizes
        return (self._sum_capacity / count, self._sum_history / count) if count else (0.0, 0.0)

    def resume(self) -> bool:
        """Bring every page the request needs to the GPU level and lock it there. Returns False
        (still suspended, nothing moved) when a GPU pool group is fuller than
        `max_util_for_resume` or the GPU cannot take the pages (plus the private copies made on
        first resume), even by pushing other pages down."""
        self._require_open("resume")
        if self._status is KVCacheStatus.ACTIVE:
            return True
        storage, layout = self._ctx.storage, self._ctx.layout
        for pool_group in range(layout.num_pool_groups):
            total = storage.levels[GPU_LEVEL].pool_groups[pool_group].num_slots
            used = total - storage.num_available(GPU_LEVEL, pool_group)
            if total and used / total > self._ctx.max_util_for_resume:
                return False
        ours = [page for pages in self._pages for page in pages if page is not None]
        extra = [0] * layout.num_pool_groups  # private copies made on first resume
        for g, block, _ in self._deferred:
            if block >= 0:
                extra[layout.pool_group_of[g]] += 1
        for g in self._ssm:
            if self._pages[g][0] is None:
                extra[layout.pool_group_of[g]] += 1
        snapshots = [page for _, block, page in self._deferred if block < 0]
        storage.lock_held(ours)  # locked pages are never evicted: ours stay put while we make room
        moved = False
        staged = None
        try:
            if snapshots:  # read now: a failed read of a snapshot changes nothing
                staged = storage.stage(snapshots)
            moved = storage.bring_to(ours, GPU_LEVEL, extra)
            if moved:
                self._make_private_copies(staged or storage.stage(()))
        except BaseException:
            moved = False
            raise
        finally:
            if staged is not None:
                staged.close()
            if not moved:
                for page in ours:
                    storage.hold(page)
                    storage.unlock(page)
        if not moved:
            return False
        self._status = KVCacheStatus.ACTIVE
        self.refresh_tables()
        self._after_call()
        return True

    def refresh_tables(self) -> None:
        """Rewrite the page tables from the pages (their slots change when pages move)."""
        self._table.refresh()

    def prefetch(self, level: int) -> bool:
        """Suspended requests only: move the request's pages that are colder than `level` up
        to it, as far as `level` has room (best effort). True when none is left colder."""
        self._require_open("prefetch")
        if self._status is not KVCacheStatus.SUSPENDED:
            raise LogicError(
                f"prefetch() on KV cache {self.id}, which is {self._status.value} (it must be suspended)"
            )
        storage = self._ctx.storage
        check_index("level", level, len(storage.levels))
        ours = [page for pages in self._pages for page in pages if page is not None]
        ours += [page for _, index, page in self._deferred if index < 0]  # SSM snapshots
        ours = list(dict.fromkeys(ours))  # a page twice (shared by two blocks) is locked once
        for page in ours:
            storage.lock(page)  # none of ours is evicted to make room for the others
        try:
            storage.lift([page for page in ours if page.level > level], level)
        finally:
            for page in ours:
                storage.unlock(page)
        self._after_call()
        return all(page.level <= level for page in ours)

    def _make_private_copies(self, staged: Staged) -> None:
        """First resume: copy a partially reused block and a reused SSM snapshot (from its RAM
        copy in `staged`) into private pages (shared pages are never written), and give SSM
        layers their live state slot. The caller holds the room for them; on a copy error
        nothing changes."""
        storage = self._ctx.storage
        snapshots = {g: page for g, block, page in self._deferred if block < 0}
        copies: list[tuple[int, int, Page, Page]] = []  # (group, block, shared, private)
        try:
            for g, block, shared in self._deferred:
                if block >= 0:
                    copies.append((g, block, shared, self._new_page(g)))
            for g in self._ssm:
                if self._pages[g][0] is None:
                    live = self._new_page(g)
                    copies.append((g, 0, snapshots.get(g, live), live))
            storage.copy_pages(
                [(shared, private) for _, _, shared, private in copies if shared is not private],
                staged,
            )
        except BaseException:
            for _, _, _, private in copies:
                storage.unlock(private)
            raise
        for g, block, shared, private in copies:
            self._pages[g][block] = private
            if shared is private:
                continue
            if g in self._ssm:
                storage.unhold(shared)  # the snapshot: held, not in our table
            else:
                storage.unlock(shared)  # the partial block: locked with our other pages
        self._deferred = []

    def suspend(self) -> None:
        """Turn the request's locks into holds: its pages may then move to colder levels (never
        dropped) while others run."""
        self._require_open("suspend")
        if self._status is KVCacheStatus.SUSPENDED:
            return
        storage = self._ctx.storage
        for pages in self._pages:
            for page in pages:
                if page is not None:
                    storage.hold(page)
                    storage.unlock(page)
        self._status = KVCacheStatus.SUSPENDED
        self._after_call()

    def close(self) -> None:
        """Finish the request (idempotent): commit the partial tail, release every page.
        Committed pages stay cached in the tree for reuse."""
        if self._status is KVCacheStatus.CLOSED:
            return
        if self._committing:
            self.stop_committing()
        storage = self._ctx.storage
        for _, index, snapshot in self._deferred:
            if index < 0:
                storage.unhold(snapshot)
        self._deferred = []
        # Last block first: parents become evictable after their children, so eviction trims
        # a cached chain from its end and shorter prefixes stay reusable.
        release = storage.unlock_all if self._status is KVCacheStatus.ACTIVE else storage.unhold_all
        for g in range(len(self._pages)):
            release([page for page in reversed(self._table.clear_all(g)) if page is not None])
        self._status = KVCacheStatus.CLOSED
        self._ctx.on_close(self)
        self._after_call()

    # -- growth ----------------------------------------------------------------------------------

    def resize(self, capacity: int, history_length: int | None = None) -> bool:
        """Reserve blocks for `capacity` tokens and advance the history. All or nothing: returns
        False, with nothing changed, when the pages cannot be found even by eviction.
        Blocks that fall out of a sliding window are released (sink blocks stay)."""
        if self._status is not _ACTIVE:
            self._require_active("resize")
        history = self._history if history_length is None else history_length
        if type(capacity) is not int or capacity < 0:  # bool is not accepted either
            raise ArgumentError(f"capacity={capacity!r} is invalid: must be an integer >= 0")
        if type(history) is not int or history < 0:
            raise ArgumentError(f"history_length={history!r} is invalid: must be an integer >= 0")
        if history < self._history:
            raise LogicError(f"history_length cannot decrease (from {self._history} to {history})")
        if history > capacity:
            raise LogicError(f"history_length {history} cannot exceed capacity {capacity}")
        self._sum_capacity += capacity
        self._sum_history += history
        self._num_resizes += 1
        tpb = self._tpb
        old_blocks, new_blocks = -(-self._capacity // tpb), -(-capacity // tpb)
        stale: list[tuple[int, tuple[int, int]]] | tuple[()] = ()
        unchanged = True
        if self._windowed and history >= self._window_check:
            stale = [(g, lc.stale_range(history, tpb)) for g, lc in self._windowed]
            unchanged = all(end <= self._released_end[g] for g, (_, end) in stale)
            if unchanged:
                self._window_check = self._next_window_check()
        if unchanged:  # nothing leaves a window: the common case, kept short
            if new_blocks > old_blocks and not self._grow(new_blocks - old_blocks):
                return False
            if new_blocks >= old_blocks:
                self._capacity, self._history = capacity, history
                if _debug.DEBUG:
                    self._ctx.check()
                return True
        layout, storage = self._ctx.layout, self._ctx.storage
        stale_of = dict(stale)
        releases: list[tuple[int, int]] = []
        grants: dict[int, list[int]] = {}
        for g in self._attention_groups:
            pages = self._pages[g]
            beg, end = stale_of.get(g, (0, 0))
            # Newly stale blocks, then blocks past a smaller capacity (stale ones never reach
            # that far: end <= ceil(history / tpb) <= new_blocks).
            for index in (
                *range(max(beg, self._released_end[g]), min(end, old_blocks)),
                *range(new_blocks, old_blocks),
            ):
                if pages[index] is not None:
                    releases.append((g, index))
            if new_blocks > old_blocks:
                wanted = [i for i in range(old_blocks, new_blocks) if not beg <= i < end]
                if wanted:
                    grants[g] = wanted
        # Pages owned only by this request: an uncommitted one gives its slot straight to a new
        # block of its layer group; a committed one becomes evictable, so it frees a slot too.
        recycle: dict[int, list[int]] = {}  # layer group -> blocks whose page moves to a new block
        freed_committed: dict[int, list[Page]] = {}  # per pool group
        for g, index in releases:
            page = self._pages[g][index]
            assert page is not None
            if page.locks + page.holds == 1:
                if page.block is None:
                    chosen = recycle.setdefault(g, [])
                    if len(chosen) < len(grants.get(g, ())):
                        chosen.append(index)
                else:
                    freed_committed.setdefault(page.pool_group, []).append(page)
        fresh = [0] * layout.num_pool_groups  # slots to allocate per pool group
        for g, wanted in grants.items():
            fresh[layout.pool_group_of[g]] += len(wanted) - len(recycle.get(g, ()))
        # Make room before releasing anything, so that a refusal (or an I/O error) changes
        # nothing: by the usual eviction if it can, else by dropping our own released cached
        # pages afterwards (which needs no I/O).
        drop_own = False
        if not storage.reserve(GPU_LEVEL, fresh):
            first = [max(0, n - len(freed_committed.get(pg, ()))) for pg, n in enumerate(fresh)]
            if not freed_committed or not storage.reserve(GPU_LEVEL, first):
                return False
            drop_own = True
        recycled: dict[int, list[Page]] = {}
        for g, index in releases:
            if index in recycle.get(g, ()):
                page = self._pages[g][index]
                assert page is not None
                recycled.setdefault(g, []).append(page)  # keeps its slot and our lock
                self._table.clear(g, index)
            else:
                self._clear_page(g, index)
        for g in self._attention_groups:
            self._table.resize(g, new_blocks)
        if drop_own:
            for pool_group, pages_freed in freed_committed.items():
                missing = fresh[pool_group] - storage.num_free(GPU_LEVEL, pool_group)
                if missing > 0:
                    storage.drop([page for page in pages_freed if page.queued][:missing])
        for g, wanted in grants.items():
            reuse = recycled.get(g, [])
            reuse += self._new_pages(g, len(wanted) - len(reuse))
            self._table.set_many(g, wanted, reuse)
        for g, (_, end) in stale:
            if end > self._released_end[g]:
                self._released_end[g] = end
        self._window_check = self._next_window_check()
        self._capacity, self._history = capacity, history
        if _debug.DEBUG:
            self._ctx.check()
        return True

    def _next_window_check(self) -> int:
        """The least history length at which a sliding window may let a block beyond the
        released ones go (`stale_range`'s end passes them: h + 1 - w >= (released + 1) * tpb)."""
        check = 2**63
        for g, lc in self._windowed:
            assert lc.window is not None
            check = min(check, (self._released_end[g] + 1) * self._tpb + lc.window - 1)
        return check

    def _grow(self, count: int) -> bool:
        """Append `count` new blocks to every attention layer group (all or nothing)."""
        storage = self._ctx.storage
        per_pool = self._attention_per_pool
        if not storage.reserve(
            GPU_LEVEL, per_pool if count == 1 else [count * n for n in per_pool]
        ):
            return False
        for g, pool_group in self._attention_pools:
            self._table.extend(g, storage.new_pages(GPU_LEVEL, pool_group, g, count, locks=1))
        return True

    # -- commit ----------------------------------------------------------------------------------

    def commit(self, tokens: Sequence[Token]) -> None:
        """Make the next `tokens` (whose KV is written) final. Every block they fill goes into
        the radix tree; if an identical block is already there, this request switches to the
        tree's pages and frees its own."""
        if self._status is not _ACTIVE:
            self._require_active("commit")
        if not self._committing:
            raise LogicError("cannot commit tokens after stop_committing()")
        if type(tokens) is not tuple and type(tokens) is not list:
            tokens = token_list("tokens", tokens)
        count = len(tokens)
        committed = self._committed + count
        if count == 1 and type(tokens[0]) is int and 0 <= tokens[0] < MAX_TOKEN:
            if committed > self._capacity:
                self._refuse_commit(count)
            tail = self._tail
            if len(tail) + 1 < self._tpb:  # a decode step that fills no block: kept short
                tail.append(tokens[0])
                self._committed = committed
                if committed > self._history:
                    self._history = committed
                if _debug.DEBUG:
                    self._ctx.check()
                return
            encoded = None
        else:
            encoded = encode_tokens(tokens)  # validates before anything changes
            if len(encoded) != 4 * count:
                encoded = None  # digest tokens: blocks are encoded one by one
            if committed > self._capacity:
                self._refuse_commit(count)
        self._commit_tokens(tokens, encoded)
        if _debug.DEBUG:
            self._ctx.check()

    def _refuse_commit(self, count: int) -> NoReturn:
        raise LogicError(
            f"cannot commit {count} tokens: {self._committed} are committed and the capacity "
            f"is {self._capacity}"
        )

    def _commit_tokens(self, tokens: Sequence[Token], encoded: bytes | None) -> None:
        """`commit` of checked tokens. When they fill blocks, the priority callback and the SSM
        snapshot pages are settled before anything changes, then the blocks go into the tree."""
        tail, tpb, count = self._tail, self._tpb, len(tokens)
        filled = len(tail) + count
        priorities = snapshots = None
        if filled >= tpb:
            if self._priority_callback is not None:
                priorities = self._priorities((self._committed - len(tail)) // tpb, filled // tpb)
            if self._ssm and filled % tpb == 0:
                snapshots = self._snapshot_pages()
        # Nothing has changed so far.
        tail += tokens
        self._committed += count
        if self._committed > self._history:
            self._history = self._committed
        if filled >= tpb:
            self._commit_full_blocks(encoded, len(tail) - count, priorities, snapshots)

    def _commit_full_blocks(
        self,
        encoded: bytes | None,
        encoded_start: int,
        priorities: Priorities | None,
        snapshots: dict[int, Page] | None,
    ) -> None:
        """Insert the tail's full blocks into the tree, in order; keep the rest as the tail.
        `encoded` (if not None) holds the tail's tokens from `encoded_start` on, 4 bytes each."""
        tail, tpb = self._tail, self._tpb
        num_full = len(tail) // tpb
        first = (self._committed - len(tail)) // tpb
        parent = self._insertion_parent()
        keys, datas = [], []
        key = self._prev_key
        for start in range(0, num_full * tpb, tpb):
            if encoded is not None and start >= encoded_start:
                offset = 4 * (start - encoded_start)
                block_data = encoded[offset : offset + 4 * tpb]
            else:
                block_data = encode_checked(tail[start : start + tpb])
            key = sha256(key + block_data).digest()
            keys.append(key)
            datas.append(block_data)
        self._prev_key = key
        del tail[: num_full * tpb]
        if parent is None:  # the previous block left the tree: nothing to share under
            self._snapshot_ssm(None, priorities, snapshots)
            return
        blocks, orphans = self._ctx.tree.insert_chain(parent, keys, datas)
        for orphan in orphans:
            self._ctx.storage.settle(orphan)
        self._attach_pages(first, blocks, priorities)
        if snapshots:
            self._snapshot_ssm(blocks[-1], priorities, snapshots)

    def _insertion_parent(self) -> Block | None:
        """The tree block the next committed block goes under (None if it is not in the tree)."""
        tree = self._ctx.tree
        if self._prev_key == self._scope_key:
            return tree.root(self._scope_key)
        return tree.index.get(self._prev_key)

    def _attach_pages(
        self, first: int, blocks: Sequence[Block], priorities: Priorities | None
    ) -> None:
        """Make our pages of blocks `first`, `first + 1`, ... the tree blocks' pages (with their
        `priorities`, if given); where a block already has one, share it instead (one copy of
        the KV, not two)."""
        storage = self._ctx.storage
        for g in self._attention_groups:
            pages = self._pages[g]
            for index, block in enumerate(blocks, first):
                page = pages[index] if index < len(pages) else None
                if page is None or page.block is not None:
                    continue
                existing = block[g]
                if existing is None:
                    if priorities is not None:
                        storage.set_priority(page, priorities[block.ordinal, g])
                    block[g] = page
                    page.block = block
                    if not page.locks:
                        storage.settle(page)
                elif block.num_tokens == self._tpb:
                    self._share(g, index, page, existing)

    def _share(self, g: int, index: int, page: Page, existing: Page) -> None:
        """Block `index` is already in the tree with page `existing`: use the tree's page if it
        is on the GPU, else (colder and unused) put ours in its place."""
        storage, tree = self._ctx.storage, self._ctx.tree
        if existing.level == GPU_LEVEL:
            self._acquire(existing)
            self._set_page(g, index, existing)
            self._release(page)
        elif not existing.locks and not existing.holds:
            block = existing.block
            assert block is not None
            tree.detach(existing)
            storage.settle(existing)
            storage.set_priority(page, existing.priority)
            tree.attach(block, page)
            storage.settle(page)

    def _snapshot_pages(self) -> dict[int, Page]:
        """Before a commit that ends at a block boundary changes anything: a locked page per
        SSM layer group for the state snapshot (best effort: none where no slot can be had,
        and none at all after an I/O error while making room)."""
        storage = self._ctx.storage
        pages: dict[int, Page] = {}
        try:
            for g in self._ssm:
                if self._pages[g][0] is not None:
                    pool_group = self._ctx.layout.pool_group_of[g]
                    (pages[g],) = storage.new_pages(GPU_LEVEL, pool_group, g, 1, locks=1)
        except (OutOfPagesError, StorageError) as error:
            if isinstance(error, StorageError):
                logger.warning("no SSM state snapshot: making room failed (%s)", error)
        except BaseException:
            for page in pages.values():
                storage.unlock(page)
            raise
        return pages

    def _snapshot_ssm(
        self, block: Block | None, priorities: Priorities | None, pages: dict[int, Page] | None
    ) -> None:
        """Copy each live SSM state into its snapshot page (from `_snapshot_pages`) and attach
        it to `block`; pages not needed (the block has a snapshot already) are freed."""
        if not pages:
            return
        storage = self._ctx.storage
        for g, page in pages.items():
            live = self._pages[g][0]
            if block is not None and live is not None and block[g] is None:
                try:
                    storage.copy_pages([(live, page)])
                except StorageError:
                    storage.unlock(page)  # uncommitted and unowned: freed
                    continue
                page.priority = (
                    DEFAULT_PRIORITY if priorities is None else priorities[block.ordinal, g]
                )
                self._ctx.tree.attach(block, page)
            storage.unlock(page)

    def stop_committing(self) -> None:
        """No more commits: the unfinished tail block goes into the tree as a partial block."""
        self._require_open("stop_committing")
        if not self._committing:
            return
        if self._tail:
            index = self._committed // self._tpb
            priorities = None
            if self._priority_callback is not None:
                priorities = self._priorities(index, 1)  # before anything changes
            snapshots = self._snapshot_pages() if self._ssm else None
            data = encode_checked(self._tail)
            key = block_key_of_encoded(self._prev_key, data)
            self._commit_block(index, data, len(self._tail), key, priorities, snapshots)
        self._committing = False
        self._after_call()

    def _commit_block(
        self,
        index: int,
        data: bytes,
        num_tokens: int,
        key: bytes,
        priorities: Priorities | None,
        snapshots: dict[int, Page] | None,
    ) -> None:
        """Insert block `index` (the partial tail: `num_tokens` tokens encoded as `data`) with
        `key` under the previous committed block, and snapshot the SSM states at its end."""
        parent = self._insertion_parent()
        block = None
        if parent is not None:
            block, orphans = self._ctx.tree.insert(parent, key, data, num_tokens)
            for orphan in orphans:
                self._ctx.storage.settle(orphan)
        if block is not None:
            self._attach_pages(index, [block], priorities)
        self._snapshot_ssm(block, priorities, snapshots)

    def _priorities(self, first: int, count: int) -> Priorities:
        """The callback's priority for blocks `first` ... `first + count - 1` of every layer
        group, checked, before a commit changes anything."""
        callback = self._priority_callback
        assert callback is not None
        priorities = {}
        for ordinal in range(first, first + count):
            for layer_group in range(len(self._pages)):
                priority = callback(ordinal, layer_group)
                if type(priority) is not int or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
                    raise ArgumentError(
                        f"priority_callback({ordinal}, {layer_group})={priority!r} is invalid: "
                        f"must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}]"
                    )
                priorities[ordinal, layer_group] = priority
        return priorities

    # -- creation from a match (called by the manager) -------------------------------------------

    def adopt_match(self, match: Match, tokens: Sequence[Token]) -> None:
        """Hold the pages of a reused prefix: the blocks each layer group needs at its end, and
        the deferred private copies (partial last block, SSM snapshot)."""
        length, tpb = match.num_tokens, self._tpb
        if not length:
            return
        storage = self._ctx.storage
        num_blocks = -(-length // tpb)
        partial = length % tpb != 0
        for g, lc in self._attention:
            beg, end = lc.stale_range(length, tpb)
            self._table.resize(g, num_blocks)
            indices = [index for index in range(num_blocks) if not beg <= index < end]
            pages = [match.blocks[index][g] for index in indices]
            assert None not in pages, "match pruning guarantees the pages"
            storage.hold_all(pages)  # type: ignore[arg-type]
            if partial and indices and indices[-1] == num_blocks - 1:
                self._deferred.append((g, num_blocks - 1, pages[-1]))  # type: ignore[arg-type]
            self._table.set_many(g, indices, pages)  # type: ignore[arg-type]
            self._released_end[g] = end
        for g in self._ssm:
            snapshot = match.blocks[num_blocks - 1][g]
            assert snapshot is not None, "match pruning guarantees the snapshot"
            storage.hold(snapshot)
            self._deferred.append((g, -1, snapshot))
        full_blocks = length // tpb
        if full_blocks:
            self._prev_key = match.blocks[full_blocks - 1].key
        self._tail = list(tokens[full_blocks * tpb : length])
        self._capacity = self._history = self._committed = self.reused_length = length

    # -- page tables -----------------------------------------------------------------------------

    def get_base_page_indices(self, layer_group_id: int) -> npt.NDArray[np.int32]:
        """Slot id of each block's page in `layer_group_id` (-1 where the block has none), as a
        read-only int32 view; for an SSM layer group one entry, the live state's slot."""
        self._require_open("get_base_page_indices")
        check_index("layer_group_id", layer_group_id, len(self._pages))
        return self._table.base_indices(layer_group_id)

    def get_page_indices(self, layer_id: int, role: str) -> npt.NDArray[np.int32]:
        """Rows of `manager.page_view(layer_id, role)` for each block (-1 where none)."""
        self._require_open("get_page_indices")
        return self._table.page_indices(self._ctx.layout.placement(layer_id, role))

    def pages(self, layer_group_id: int) -> list[Page | None]:
        """The request's pages of one layer group (for introspection and tests)."""
        return list(self._pages[layer_group_id])

    # -- helpers ---------------------------------------------------------------------------------

    def _new_page(self, g: int) -> Page:
        (page,) = self._new_pages(g, 1)
        return page

    def _new_pages(self, g: int, count: int) -> list[Page]:
        """`count` new pages of layer group `g` on the GPU, locked by this request."""
        if count <= 0:
            return []
        return self._ctx.storage.new_pages(
            GPU_LEVEL, self._ctx.layout.pool_group_of[g], g, count, locks=1
        )

    def _set_page(self, g: int, index: int, page: Page) -> None:
        """Put a page this request already owns into its table."""
        self._table.set(g, index, page)

    def _clear_page(self, g: int, index: int) -> None:
        self._release(self._table.clear(g, index))

    def _acquire(self, page: Page) -> None:
        if self._status is KVCacheStatus.ACTIVE:
            self._ctx.storage.lock(page)
        else:
            self._ctx.storage.hold(page)

    def _release(self, page: Page) -> None:
        if self._status is KVCacheStatus.ACTIVE:
            self._ctx.storage.unlock(page)
        else:
            self._ctx.storage.unhold(page)

    def _require_open(self, operation: str) -> None:
        if self._status is KVCacheStatus.CLOSED:
            raise LogicError(f"{operation}() on KV cache {self.id}, which is closed")
        if _debug.DEBUG:
            self._ctx.check_thread()

    def _require_active(self, operation: str) -> None:
        if self._status is not KVCacheStatus.ACTIVE:
            raise LogicError(
                f"{operation}() on KV cache {self.id}, which is {self._status.value} (it must be active)"
            )

    def _after_call(self) -> None:
        if _debug.DEBUG:
            self._ctx.check()

    def __repr__(self) -> str:
        return (
            f"KVCache(id {self.id}, {self._status.value}, capacity {self._capacity}, history "
            f"{self._history}, committed {self._committed})"
        )
