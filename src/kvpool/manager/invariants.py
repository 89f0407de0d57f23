"""The manager's consistency check (run after every public call with `KVPOOL_DEBUG=1`): slot
accounting, page owners, eviction queues and radix-tree links all agree."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvpool.cache import KVCacheStatus, RequestState
from kvpool.errors import CorruptedError
from kvpool.layout import KVLayout
from kvpool.radix import RadixTree
from kvpool.tiers import StorageManager


def check_invariants(
    layout: KVLayout, storage: StorageManager, tree: RadixTree, caches: Iterable[RequestState]
) -> None:
    """Raise `CorruptedError` naming the first problems found (up to ten)."""
    problems: list[str] = []
    locks: dict[int, int] = {}
    holds: dict[int, int] = {}
    pages: dict[int, Any] = {}
    for cache in caches:
        active = cache.status is KVCacheStatus.ACTIVE
        for g in range(layout.num_layer_groups):
            table = cache.get_base_page_indices(g)
            for index, page in enumerate(cache.pages(g)):
                if page is not None:
                    pages[id(page)] = page
                    counts = locks if active else holds
                    counts[id(page)] = counts.get(id(page), 0) + 1
                if not active:
                    continue  # a suspended request's table is refreshed on resume
                expected = -1 if page is None else page.slot_id
                if table[index] != expected:
                    problems.append(
                        f"cache {cache.id} group {g} block {index}: table {table[index]} != {expected}"
                    )
                if page is not None and page.level != 0:
                    problems.append(f"cache {cache.id} is active but {page} is not on the GPU")
        for _, index, page in cache._deferred:
            if index < 0:
                pages[id(page)] = page
                holds[id(page)] = holds.get(id(page), 0) + 1
    tpb = layout.tokens_per_block
    for block in [*tree.roots.values(), *tree.blocks()]:
        partial = sum(1 for child in block.children if child.num_tokens < tpb)
        if partial != block.num_partial_children:
            problems.append(
                f"{block}: counts {block.num_partial_children} partial children, has {partial}"
            )
    in_tree = list(tree.blocks())
    if len(in_tree) != len(tree.index) or any(
        tree.index.get(block.key) is not block for block in in_tree
    ):
        problems.append("the tree's key index does not match its blocks")
    for block in in_tree:
        if not block.in_tree or block.parent is None or block.parent.child(block.key) is not block:
            problems.append(f"{block}: broken parent link")
        for g, page in enumerate(block):
            if page is not None:
                pages[id(page)] = page
                if page.block is not block or page.layer_group != g:
                    problems.append(f"{page} is not linked back to {block}")
    for queues in storage.state.queues:
        for queue in queues:
            queue.check_invariants()
            for page in queue:
                pages[id(page)] = page
    used: dict[tuple[int, int], set[int]] = {}
    for key, page in pages.items():
        if page.slot is None:
            problems.append(f"{page} is referenced but freed")
            continue
        if (page.locks, page.holds) != (locks.get(key, 0), holds.get(key, 0)):
            problems.append(
                f"{page}: owners counted {locks.get(key, 0)} locks, {holds.get(key, 0)} holds"
            )
        if page.queued != storage.owners.is_evictable(page):
            problems.append(
                f"{page}: queued {page.queued} but evictable {storage.owners.is_evictable(page)}"
            )
        if not page.locks and not page.holds and page.block is None:
            problems.append(f"{page}: nobody owns it and it is not cached")
        if storage.state.pages[page.level][page.pool_group].get(page.slot_id) is not page:
            problems.append(f"{page} is missing from the slot registry")
        slots = used.setdefault((page.level, page.pool_group), set())
        if page.slot_id in slots:
            problems.append(f"slot {page.slot_id} of pool group {page.pool_group} has two pages")
        slots.add(page.slot_id)
    for level, level_storage in enumerate(storage.state.levels):
        for pg, group in enumerate(level_storage.pool_groups):
            group.allocator.check_invariants()
            occupied = group.allocator.num_occupied_slots
            if occupied != len(storage.state.pages[level][pg]):
                problems.append(f"level {level} pool group {pg}: slot registry out of date")
            if occupied != len(used.get((level, pg), ())):
                problems.append(
                    f"level {level} pool group {pg}: {occupied} slots occupied, {len(used.get((level, pg), ()))} pages"
                )
            queued = sum(
                1 for p in pages.values() if p.queued and p.level == level and p.pool_group == pg
            )
            if queued != len(storage.state.queues[level][pg]):
                problems.append(f"level {level} pool group {pg}: queue length mismatch")
    if problems:
        raise CorruptedError("; ".join(problems[:10]))
