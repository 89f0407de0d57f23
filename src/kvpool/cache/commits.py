"""Commits: tokens become final and their full blocks go into the radix tree (shared with other
requests where the tree has them); the unfinished tail goes in at `stop_committing()`.

SSM layers: the live state slot must hold the state after exactly the committed tokens whenever a
commit fills a block or `stop_committing()` runs; kvpool then snapshots it into the tree, and a
later request can reuse a prefix only up to such a snapshot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from hashlib import sha256
from typing import NoReturn

from kvpool.cache.state import ACTIVE, GPU_LEVEL, CacheContext, Priorities, RequestState
from kvpool.chain import chain_blocks, encode_ints
from kvpool.errors import ArgumentError, LogicError, OutOfPagesError, StorageError
from kvpool.radix import Match
from kvpool.records import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY, Block, Page
from kvpool.tokens import MAX_TOKEN, Token, block_key_of_encoded, encode_checked, encode_tokens
from kvpool.validation import token_list

logger = logging.getLogger("kvpool")


class Commits:
    """`commit`, `stop_committing` and the reuse of a matched prefix at creation, for every
    request of a manager (each call names the request)."""

    def __init__(self, context: CacheContext) -> None:
        self._ctx = context

    def commit(self, request: RequestState, tokens: Sequence[Token]) -> None:
        """`KVCache.commit`: a decode step that fills no block only appends to the tail."""
        if request._status is not ACTIVE:
            request._require_active("commit")
        if not request._committing:
            raise LogicError("cannot commit tokens after stop_committing()")
        if type(tokens) is not tuple and type(tokens) is not list:
            tokens = token_list("tokens", tokens)
        count = len(tokens)
        committed = request._committed + count
        token = tokens[0] if count == 1 else None  # (one read: a generic one when compiled)
        if type(token) is int and 0 <= token < MAX_TOKEN:
            if committed > request._capacity:
                self._refuse_commit(request, count)
            tail = request._tail
            if len(tail) + 1 < request._tpb:  # a decode step that fills no block: kept short
                tail.append(token)
                request._committed = committed
                if committed > request._history:
                    request._history = committed
                if request._checks:
                    self._ctx.check()
                return
            encoded = None
        else:
            encoded = encode_tokens(tokens)  # validates before anything changes
            if len(encoded) != 4 * count:
                encoded = None  # digest tokens: blocks are encoded one by one
            if committed > request._capacity:
                self._refuse_commit(request, count)
        self._commit_tokens(request, tokens, encoded)
        if request._checks:
            self._ctx.check()

    def _refuse_commit(self, request: RequestState, count: int) -> NoReturn:
        raise LogicError(
            f"cannot commit {count} tokens: {request._committed} are committed and the capacity "
            f"is {request._capacity}"
        )

    def _commit_tokens(
        self, request: RequestState, tokens: Sequence[Token], encoded: bytes | None
    ) -> None:
        """`commit` of checked tokens. When they fill blocks, the priority callback and the SSM
        snapshot pages are settled before anything changes, then the blocks go into the tree."""
        tail, tpb, count = request._tail, request._tpb, len(tokens)
        filled = len(tail) + count
        priorities = snapshots = None
        if filled >= tpb:
            if request._priority_callback is not None:
                priorities = self._priorities(
                    request, (request._committed - len(tail)) // tpb, filled // tpb
                )
            if request._ssm and filled % tpb == 0:
                snapshots = self._snapshot_pages(request)
        # Nothing has changed so far.
        tail += tokens
        request._committed += count
        if request._committed > request._history:
            request._history = request._committed
        if filled >= tpb:
            self._commit_full_blocks(request, encoded, len(tail) - count, priorities, snapshots)

    def _commit_full_blocks(
        self,
        request: RequestState,
        encoded: bytes | None,
        encoded_start: int,
        priorities: Priorities | None,
        snapshots: dict[int, Page] | None,
    ) -> None:
        """Insert the tail's full blocks into the tree, in order; keep the rest as the tail.
        `encoded` (if not None) holds the tail's tokens from `encoded_start` on, 4 bytes each."""
        tail, tpb = request._tail, request._tpb
        num_full = len(tail) // tpb
        first = (request._committed - len(tail)) // tpb
        parent = self._insertion_parent(request)
        size = num_full * tpb
        if encoded is not None and encoded_start == 0:  # (a prefill: the usual case)
            run: bytes | None = encoded if len(encoded) == 4 * size else encoded[: 4 * size]
        else:
            run = encode_ints(tail if len(tail) == size else tail[:size])
        if run is not None:  # every token an int: the blocks in one call
            keys, datas = chain_blocks(request._prev_key, run, 4 * tpb)
        else:  # digest tokens: each block's size is its own
            keys, datas = [], []
            key = request._prev_key
            for start in range(0, size, tpb):
                block_data = encode_checked(tail[start : start + tpb])
                key = sha256(key + block_data).digest()
                keys.append(key)
                datas.append(block_data)
        request._prev_key = keys[-1]
        del tail[:size]
        if parent is None:  # the previous block left the tree: nothing to share under
            self._snapshot_ssm(request, None, priorities, snapshots)
            return
        blocks, orphans = self._ctx.tree.insert_chain(parent, keys, datas)
        if self._ctx.policy is not None:
            self._ctx.policy.inserted(blocks)
        for orphan in orphans:
            self._ctx.owners.settle(orphan)
        self._attach_pages(request, first, blocks, priorities)
        if snapshots:
            self._snapshot_ssm(request, blocks[-1], priorities, snapshots)

    def _insertion_parent(self, request: RequestState) -> Block | None:
        """The tree block the next committed block goes under (None if it is not in the tree)."""
        tree = self._ctx.tree
        if request._prev_key == request._scope_key:
            return tree.root(request._scope_key)
        return tree.index.get(request._prev_key)

    def _attach_pages(
        self, request: RequestState, first: int, blocks: list[Block], priorities: Priorities | None
    ) -> None:
        """Make the request's pages of blocks `first`, `first + 1`, ... the tree blocks' pages
        (with their `priorities`, if given); where a block already has one, share it instead
        (one copy of the KV, not two)."""
        owners = self._ctx.owners
        events = self._ctx.tree.kv_events
        for g in request._attention_groups:
            pages = request._pages[g]
            attached: list[Block] | None = [] if events is not None else None
            for i in range(len(blocks)):  # (enumerate with a start is generic, compiled or not)
                index, block = first + i, blocks[i]
                page = pages[index] if index < len(pages) else None
                if page is None or page.block is not None:
                    continue
                existing = block.pages[g]
                if existing is None:
                    if priorities is not None:
                        owners.set_priority(page, priorities[block.ordinal, g])
                    block.pages[g] = page
                    page.block = block
                    if attached is not None:
                        attached.append(block)
                    if not page.locks:
                        owners.settle(page)
                elif block.num_tokens == request._tpb:
                    self._share(request, g, index, page, existing)
            if attached:
                assert events is not None
                events.stored_blocks(attached, g, GPU_LEVEL)  # (commits happen while ACTIVE)

    def _share(self, request: RequestState, g: int, index: int, page: Page, existing: Page) -> None:
        """Block `index` is already in the tree with page `existing`: use the tree's page if it
        is on the GPU, else (colder and unused) put the request's in its place."""
        owners, tree = self._ctx.owners, self._ctx.tree
        if existing.level == GPU_LEVEL:
            owners.lock(existing)  # commits happen only while ACTIVE
            request._set_page(g, index, existing)
            owners.unlock(page)
        elif not existing.locks and not existing.holds:
            block = existing.block
            assert block is not None
            tree.detach(existing)
            owners.settle(existing)
            owners.set_priority(page, existing.priority)
            tree.attach(block, page)
            owners.settle(page)

    def _snapshot_pages(self, request: RequestState) -> dict[int, Page]:
        """Before a commit that ends at a block boundary changes anything: a locked page per
        SSM layer group for the state snapshot (best effort: none where no slot can be had,
        and none at all after an I/O error while making room)."""
        owners, allocation = self._ctx.owners, self._ctx.allocation
        pages: dict[int, Page] = {}
        try:
            for g in request._ssm:
                if request._pages[g][0] is not None:
                    pool_group = self._ctx.layout.pool_group_of[g]
                    (pages[g],) = allocation.new_pages(GPU_LEVEL, pool_group, g, 1, locks=1)
        except (OutOfPagesError, StorageError) as error:
            if isinstance(error, StorageError):
                logger.warning("no SSM state snapshot: making room failed (%s)", error)
        except BaseException:
            for page in pages.values():
                owners.unlock(page)
            raise
        return pages

    def _snapshot_ssm(
        self,
        request: RequestState,
        block: Block | None,
        priorities: Priorities | None,
        pages: dict[int, Page] | None,
    ) -> None:
        """Copy each live SSM state into its snapshot page (from `_snapshot_pages`) and attach
        it to `block`; pages not needed (the block has a snapshot already) are freed."""
        if not pages:
            return
        owners, migration = self._ctx.owners, self._ctx.migration
        for g, page in pages.items():
            live = request._pages[g][0]
            if block is not None and live is not None and block.pages[g] is None:
                try:
                    migration.copy_pages([(live, page)])
                except StorageError:
                    owners.unlock(page)  # uncommitted and unowned: freed
                    continue
                page.priority = (
                    DEFAULT_PRIORITY if priorities is None else priorities[block.ordinal, g]
                )
                self._ctx.tree.attach(block, page)
            owners.unlock(page)

    def stop_committing(self, request: RequestState) -> None:
        """`KVCache.stop_committing`."""
        request._require_open("stop_committing")
        if not request._committing:
            return
        if request._tail:
            index = request._committed // request._tpb
            priorities = None
            if request._priority_callback is not None:
                priorities = self._priorities(request, index, 1)  # before anything changes
            snapshots = self._snapshot_pages(request) if request._ssm else None
            data = encode_checked(request._tail)
            key = block_key_of_encoded(request._prev_key, data)
            self._commit_block(request, index, data, len(request._tail), key, priorities, snapshots)
        request._committing = False
        request._after_call()

    def _commit_block(
        self,
        request: RequestState,
        index: int,
        data: bytes,
        num_tokens: int,
        key: bytes,
        priorities: Priorities | None,
        snapshots: dict[int, Page] | None,
    ) -> None:
        """Insert block `index` (the partial tail: `num_tokens` tokens encoded as `data`) with
        `key` under the previous committed block, and snapshot the SSM states at its end."""
        parent = self._insertion_parent(request)
        block = None
        if parent is not None:
            block, orphans = self._ctx.tree.insert(parent, key, data, num_tokens)
            for orphan in orphans:
                self._ctx.owners.settle(orphan)
        if block is not None:
            if self._ctx.policy is not None:
                self._ctx.policy.inserted([block])
            self._attach_pages(request, index, [block], priorities)
        self._snapshot_ssm(request, block, priorities, snapshots)

    def _priorities(self, request: RequestState, first: int, count: int) -> Priorities:
        """The callback's priority for blocks `first` ... `first + count - 1` of every layer
        group, checked, before a commit changes anything."""
        # (typed as returning anything, so that compiled code hands the result to the check)
        callback: Callable[[int, int], object] | None = request._priority_callback
        assert callback is not None
        priorities = {}
        for ordinal in range(first, first + count):
            for layer_group in range(len(request._pages)):
                priority: object = callback(ordinal, layer_group)  # (an engine's: any type)
                if type(priority) is not int or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
                    raise ArgumentError(
                        f"priority_callback({ordinal}, {layer_group})={priority!r} is invalid: "
                        f"must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}]"
                    )
                priorities[ordinal, layer_group] = priority
        return priorities

    def adopt_match(self, request: RequestState, match: Match, tokens: Sequence[Token]) -> None:
        """Hold the pages of a reused prefix: the blocks each layer group needs at its end, and
        the deferred private copies (partial last block, SSM snapshot)."""
        length, tpb = match.num_tokens, request._tpb
        if not length:
            return
        owners = self._ctx.owners
        num_blocks = -(-length // tpb)
        partial = length % tpb != 0
        for g, lc in request._attention:
            beg, end = lc.stale_range(length, tpb)
            request._table.resize(g, num_blocks)
            indices = [index for index in range(num_blocks) if not beg <= index < end]
            pages = [match.blocks[index].pages[g] for index in indices]
            assert None not in pages, "match pruning guarantees the pages"
            owners.hold_all(pages)  # type: ignore[arg-type]
            if partial and indices and indices[-1] == num_blocks - 1:
                request._deferred.append((g, num_blocks - 1, pages[-1]))  # type: ignore[arg-type]
            request._table.set_many(g, indices, pages)  # type: ignore[arg-type]
            request._released_end[g] = end
        for g in request._ssm:
            snapshot = match.blocks[num_blocks - 1][g]
            assert snapshot is not None, "match pruning guarantees the snapshot"
            owners.hold(snapshot)
            request._deferred.append((g, -1, snapshot))
        full_blocks = length // tpb
        if full_blocks:
            request._prev_key = match.blocks[full_blocks - 1].key
        request._tail = list(tokens[full_blocks * tpb : length])
        request._capacity = request._history = request._committed = request.reused_length = length
