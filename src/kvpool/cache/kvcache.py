"""KVCache: one request's KV cache, the handle an engine holds. It is the request's state
(`RequestState`) and its life cycle (resume, suspend, prefetch, close); what changes its pages
step by step is done by parts made once per manager (`CacheParts`), which it calls with itself:
`Growth` (resize, sliding windows), `Commits` (commit, the radix tree), `Forking`
(copy-on-write, forks) and `RemoteLoading` (the remote part of a reused prefix)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, SupportsIndex

import numpy as np

from kvpool.cache.commits import Commits
from kvpool.cache.forking import Forking
from kvpool.cache.growth import Growth
from kvpool.cache.remote_loading import RemoteLoading
from kvpool.cache.state import (
    GPU_LEVEL,
    CacheContext,
    KVCacheStatus,
    PriorityCallback,
    RequestState,
)
from kvpool.errors import ArgumentError, LogicError
from kvpool.radix import Match
from kvpool.records import Block, Page
from kvpool.tiers import Staged
from kvpool.tokens import Token
from kvpool.validation import check_index, fail


class CacheParts:
    """What every request's cache of one manager calls: one object per concern, each holding
    the manager's `CacheContext` and nothing of a request between calls (its state is its own)."""

    def __init__(self, context: CacheContext) -> None:
        self.commits = Commits(context)
        self.remote_loading = RemoteLoading(context, self.commits)
        self.forking = Forking(context)
        self.growth = Growth(context)


class KVCache(RequestState):
    """One request's KV cache. Created SUSPENDED by `KVCacheManager.create_kv_cache`."""

    def __init__(
        self,
        context: CacheContext,
        parts: CacheParts,
        cache_id: int,
        scope_key: bytes,
        priority_callback: PriorityCallback | None,
        exclude_from_stats: bool = False,
    ) -> None:
        super().__init__(context, cache_id, scope_key, priority_callback, exclude_from_stats)
        self._parts = parts

    def resize(self, capacity: SupportsIndex, history_length: SupportsIndex | None = None) -> bool:
        """Reserve blocks for `capacity` tokens and advance the history. All or nothing: returns
        False, with nothing changed, when the pages cannot be found even by eviction.
        Blocks that fall out of a sliding window are released (sink blocks stay)."""
        return self._parts.growth.resize(self, capacity, history_length)

    def commit(self, tokens: Sequence[Token]) -> None:
        """Make the next `tokens` (whose KV is written) final. Every block they fill goes into
        the radix tree; if an identical block is already there, this request switches to the
        tree's pages and frees its own."""
        self._parts.commits.commit(self, tokens)

    def stop_committing(self) -> None:
        """No more commits: the unfinished tail block goes into the tree as a partial block."""
        self._parts.commits.stop_committing(self)

    def prepare_write(self, begin: SupportsIndex, end: SupportsIndex) -> bool:
        """Make the pages of token positions [begin, end) this request's alone before the
        engine writes their KV: a page shared with a fork (or with the tree) is copied into a
        new private page, once. Returns False, with nothing changed, when no slot can be had
        even by eviction. `begin >= num_committed_tokens` (committed tokens are final) and
        `end <= capacity`."""
        return self._parts.forking.prepare_write(self, begin, end)

    def adopt_match(self, match: Match, tokens: Sequence[Token]) -> None:
        """At creation: hold the pages of the reused prefix `match` (see `Commits`)."""
        self._parts.commits.adopt_match(self, match, tokens)

    def _fork_into(self, child: RequestState) -> None:
        """Make `child` an ACTIVE copy of this request (see `Forking.fork_into`)."""
        self._parts.forking.fork_into(self, child)

    def resume(self) -> bool:
        """Bring every page the request needs to the GPU level and lock it there. Returns False
        (still suspended, nothing moved) when a GPU pool group is fuller than
        `max_util_for_resume` or the GPU cannot take the pages (plus the private copies made on
        first resume), even by pushing other pages down. The first resume also fetches the
        part of the prefix found in the remote tier (see `num_committed_tokens`); fetched
        pages stay fetched even when it then returns False."""
        self._require_open("resume")
        if self._status is KVCacheStatus.ACTIVE:
            return True
        owners, allocation, migration, state, layout = (
            self._ctx.owners,
            self._ctx.allocation,
            self._ctx.migration,
            self._ctx.state,
            self._ctx.layout,
        )
        for pool_group in range(layout.num_pool_groups):
            total = state.levels[GPU_LEVEL].pool_groups[pool_group].num_slots
            used = total - state.num_available(GPU_LEVEL, pool_group)
            if total and used / total > self._ctx.max_util_for_resume:
                return self._resume_failed()
        if self._remote is not None and not self._parts.remote_loading.load(self, GPU_LEVEL):
            return self._resume_failed()
        ours = [page for pages in self._pages for page in pages if page is not None]
        extra = [0] * layout.num_pool_groups  # private copies made on first resume
        for g, block, _ in self._deferred:
            if block >= 0:
                extra[layout.pool_group_of[g]] += 1
        for g in self._ssm:
            if self._pages[g][0] is None:
                extra[layout.pool_group_of[g]] += 1
        snapshots = [page for _, block, page in self._deferred if block < 0]
        owners.lock_held(ours)  # locked pages are never evicted: ours stay put while we make room
        moved = False
        staged = None
        try:
            if snapshots:  # read now: a failed read of a snapshot changes nothing
                staged = migration.stage(snapshots)
            moved = allocation.bring_to(ours, GPU_LEVEL, extra)
            if moved:
                self._make_private_copies(staged or migration.stage(()))
        except BaseException:
            moved = False
            raise
        finally:
            if staged is not None:
                staged.close()
            if not moved:
                for page in ours:
                    owners.hold(page)
                    owners.unlock(page)
        if not moved:
            return self._resume_failed()
        self._status = KVCacheStatus.ACTIVE
        self.refresh_tables()
        self._ctx.counters.resumes += 1
        self._after_call()
        return True

    def _resume_failed(self) -> bool:
        self._ctx.counters.failed_resumes += 1
        return False

    def read_committed(
        self, block: SupportsIndex, layer_id: SupportsIndex, role: object, out: Any
    ) -> None:
        """Copy buffer (`layer_id`, `role`) of committed block `block` into `out` (a writable,
        C-contiguous uint8 numpy array of the buffer's size) from whichever level holds its
        page, moving nothing. A storage backend under an engine's own host cache serves a
        stored page this way: one read from the disk level, no promotion and no eviction on
        the way (the lookup that created this request counted as the page's use). The
        request's pages are held or locked, so the page stays put meanwhile. Not for a prefix
        still pending in the remote tier (`resume` or `prefetch` fetches it first).
        `StorageError` when the disk read fails, with nothing changed."""
        self._require_open("read_committed")
        if self.pending_remote_tokens:
            raise LogicError(
                f"read_committed() on KV cache {self.id}: its remote prefix is not fetched "
                "(resume() or prefetch() first)"
            )
        tpb = self._tpb
        index = check_index("block", block, -(-self._committed // tpb))
        placement = self._ctx.layout.placement(layer_id, role)
        if not (
            isinstance(out, np.ndarray)
            and out.dtype == np.uint8
            and out.size == placement.size
            and out.flags.c_contiguous
            and out.flags.writeable
        ):
            fail(
                "out",
                f"{type(out).__name__} {getattr(out, 'dtype', '')} x{getattr(out, 'size', '?')}",
                f"a writable C-contiguous uint8 numpy array of {placement.size} bytes",
            )
        page = self._pages[placement.layer_group][index]
        if page is None:
            raise ArgumentError(
                f"block={index} is invalid: KV cache {self.id} holds no page of it for layer "
                f"{placement.layer_id} (out of its window)"
            )
        self._ctx.migration.read_buffer(page, placement.pool, placement.offset, out)

    def prefetch(self, level: SupportsIndex) -> bool:
        """Suspended requests only: move the request's pages that are colder than `level` up
        to it, as far as `level` has room (best effort). True when none is left colder."""
        self._require_open("prefetch")
        if self._status is not KVCacheStatus.SUSPENDED:
            raise LogicError(
                f"prefetch() on KV cache {self.id}, which is {self._status.value} (it must be suspended)"
            )
        owners, allocation, state = self._ctx.owners, self._ctx.allocation, self._ctx.state
        level = check_index("level", level, len(state.levels))
        if self._remote is not None and not self._parts.remote_loading.load(self, level):
            self._after_call()
            return False
        ours = [page for pages in self._pages for page in pages if page is not None]
        ours += [page for _, index, page in self._deferred if index < 0]  # SSM snapshots
        ours = list(dict.fromkeys(ours))  # a page twice (shared by two blocks) is locked once
        for page in ours:
            owners.lock(page)  # none of ours is evicted to make room for the others
        try:
            allocation.lift([page for page in ours if page.level > level], level)
        finally:
            for page in ours:
                owners.unlock(page)
        self._after_call()
        return all(page.level <= level for page in ours)

    def _make_private_copies(self, staged: Staged) -> None:
        """First resume: copy a partially reused block and a reused SSM snapshot (from its RAM
        copy in `staged`) into private pages (shared pages are never written), and give SSM
        layers their live state slot. The caller holds the room for them; on a copy error
        nothing changes."""
        owners, migration = self._ctx.owners, self._ctx.migration
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
            migration.copy_pages(
                [(shared, private) for _, _, shared, private in copies if shared is not private],
                staged,
            )
        except BaseException:
            for _, _, _, private in copies:
                owners.unlock(private)
            raise
        for g, block, shared, private in copies:
            self._pages[g][block] = private
            if shared is private:
                continue
            if g in self._ssm:
                owners.unhold(shared)  # the snapshot: held, not in our table
            else:
                owners.unlock(shared)  # the partial block: locked with our other pages
        self._deferred = []

    def _deepest_block(self) -> Block | None:
        """The last tree block among the request's pages (for the eviction policy)."""
        for pages in self._pages:
            for page in reversed(pages):
                if page is not None and page.block is not None:
                    return page.block
        return None

    def suspend(self) -> None:
        """Turn the request's locks into holds: its pages may then move to colder levels (never
        dropped) while others run."""
        self._require_open("suspend")
        if self._status is KVCacheStatus.SUSPENDED:
            return
        owners = self._ctx.owners
        for pages in self._pages:
            for page in pages:
                if page is not None:
                    owners.hold(page)
                    owners.unlock(page)
        self._status = KVCacheStatus.SUSPENDED
        self._ctx.counters.suspensions += 1
        self._after_call()

    def close(self) -> None:
        """Finish the request (idempotent): commit the partial tail, release every page.
        Committed pages stay cached in the tree for reuse."""
        if self._status is KVCacheStatus.CLOSED:
            return
        self._parts.remote_loading.forget(self)
        if self._committing:
            self.stop_committing()
        owners = self._ctx.owners
        for _, index, snapshot in self._deferred:
            if index < 0:
                owners.unhold(snapshot)
        self._deferred = []
        policy = self._ctx.policy
        if policy is not None:
            deepest = self._deepest_block()
            if deepest is not None:
                policy.released(deepest)
        # Last block first: parents become evictable after their children, so eviction trims
        # a cached chain from its end and shorter prefixes stay reusable.
        release = owners.unlock_all if self._status is KVCacheStatus.ACTIVE else owners.unhold_all
        for g in range(len(self._pages)):
            release([page for page in reversed(self._table.clear_all(g)) if page is not None])
        self._status = KVCacheStatus.CLOSED
        self._ctx.on_close(self)
        self._after_call()
