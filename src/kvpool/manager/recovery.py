"""Finding a persistent disk level's blocks again when a manager starts.

What a record says is checked, then what it describes (`recover`):

1. the record itself (`kvpool.storage.persistent`: whole, this level's identity, this pool group
   and slot), then its label: a layer group of this pool group, 1 to `tokens_per_block` tokens
   encoded as the tree encodes them, a scope whose root key is the label's, and a key that is
   SHA-256 of the parent's (or the root's) key and the tokens; a slot the level no longer has
   (a smaller quota) is dropped;
2. the slot's bytes against the record's checksums (every pool, read from the file: `verify`);
3. one record per (block, layer group): the latest (highest sequence number) wins;
4. the blocks, from each scope's root down, depth first: a block is taken when its parent was
   (or is the root) and it has the pages a block at its depth needs to stay in the tree (full
   attention at every depth, a window's sinks); a block whose parent is gone cannot be reached
   by a prefix match, so it and everything below it are dropped. Full children before partial
   ones, longer partial ones first, then in the order their first record was found.

The taken blocks go into the tree with their pages at the disk level, droppable and queued
(deepest first: eviction trims a chain from its end), the eviction policy told as for
committed blocks and KV events announced as for any stored block. Every step is a function of
the files alone (scan order, sequence numbers, no clock, no hash seed): the same files give the
same tree, slot ids and queue order, on either backend. Recovery writes nothing: a record it
does not take stays until its slot is written again.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from kvpool.config import ReuseScope
from kvpool.errors import ArgumentError
from kvpool.events.log import KVEventLog
from kvpool.layout import KVLayout
from kvpool.lifecycles import AttentionLifeCycle
from kvpool.policies import EvictionPolicy
from kvpool.radix import RadixTree
from kvpool.records import Block, Page
from kvpool.remote.values import layout_fingerprint
from kvpool.storage.slot_file import StoredRecord
from kvpool.tiers import StorageManager
from kvpool.tiers.persistence import DiskRecords, Label, decode_scope
from kvpool.tokens import decode_tokens, encode_tokens, root_key

VERIFY_WORKERS = 4  # threads reading and checksumming slots at start-up

BEYOND = "beyond the level's size"
LABEL = "inconsistent label"
CHECKSUM = "checksum mismatch"
DUPLICATE = "older duplicate"
UNREACHABLE = "unreachable"
COVERED = "partial block covered"


def disk_identity(persistent_id: str, layout: KVLayout) -> bytes:
    """What a persistent disk level's files are bound to: the caller's id and the layout."""
    raw = persistent_id.encode()
    return hashlib.sha256(
        b"kvpool-disk\0" + len(raw).to_bytes(4, "little") + raw + layout_fingerprint(layout)
    ).digest()


@dataclass
class DiskRecovery:
    """What a manager found on its persistent disk level when it started."""

    path: str  # the level's locked file
    started_empty: bool  # the files held another identity, layout or format: emptied
    records: int  # whole records of this level found
    pages: int  # pages recovered (in the tree at the disk level)
    blocks: int  # blocks recovered
    bytes_verified: int  # payload bytes read and checksummed
    verify_seconds: float
    seconds: float  # the whole recovery
    discarded: dict[str, int] = field(default_factory=dict)  # slots not taken, by reason
    # ("recover", pool group, slot, layer group, key) and ("discard", pool group, slot,
    # reason), in the order decided: equal for equal files, on either backend.
    decisions: list[tuple[object, ...]] = field(default_factory=list)


class _Found(NamedTuple):
    order: int  # scan position over every pool group
    pool_group: int
    record: StoredRecord
    label: Label
    scope: ReuseScope


class _Block:
    __slots__ = ("children", "key", "label", "order", "pages", "scope")

    def __init__(self, found: _Found) -> None:
        self.key = found.label.key
        self.label = found.label
        self.scope = found.scope
        self.order = found.order
        self.pages: dict[int, tuple[int, int]] = {}  # layer group -> (pool group, slot)
        self.children: list[_Block] = []


def _checked_scope(label: Label | None, layout: KVLayout, pool_group: int) -> ReuseScope | None:
    """The label's scope when the label is consistent with itself and the layout, else None."""
    if label is None:
        return None
    tpb = layout.tokens_per_block
    group = label.layer_group
    if not 0 <= group < layout.num_layer_groups or layout.pool_group_of[group] != pool_group:
        return None
    if not 1 <= label.num_tokens <= tpb:
        return None
    try:
        tokens = decode_tokens(label.data)
        if len(tokens) != label.num_tokens or encode_tokens(tokens) != label.data:
            return None
    except (ArgumentError, ValueError, IndexError):
        return None
    scope = decode_scope(label.scope)
    try:
        if scope is None or root_key(scope) != label.scope_key:
            return None
    except ArgumentError:
        return None
    previous = label.scope_key if label.parent_key is None else label.parent_key
    if hashlib.sha256(previous + label.data).digest() != label.key:
        return None
    return scope


def _anchors(layout: KVLayout) -> list[int]:
    """Per layer group: blocks below this depth need its page to stay in the tree (as the
    tree's own rule, `RadixTree.remove_pages`)."""
    return [
        (2**63 if lc.window is None else lc.num_sink_blocks)
        if isinstance(lc, AttentionLifeCycle)
        else 0
        for lc in layout.life_cycles
    ]


def recover(
    layout: KVLayout,
    tree: RadixTree,
    storage: StorageManager,
    records: DiskRecords,
    policy: EvictionPolicy | None,
    kv_events: KVEventLog | None,
) -> DiskRecovery:
    """Put the blocks the level's files hold back into `tree` (see the module's docstring)."""
    started = time.perf_counter()
    disk, level, state = records.disk, records.level, storage.state
    tpb = layout.tokens_per_block
    decisions: list[tuple[object, ...]] = []
    discarded: dict[str, int] = {}

    def discard(pool_group: int, slot: int, reason: str) -> None:
        decisions.append(("discard", pool_group, slot, reason))
        discarded[reason] = discarded.get(reason, 0) + 1

    # 1. The records, checked.
    candidates: list[list[_Found]] = [[] for _ in disk.files]
    order = 0
    total_records = 0
    for g, file in enumerate(disk.files):
        capacity = state.allocators[level][g].capacity
        for record in file.found:
            total_records += 1
            order += 1
            if record.slot >= capacity:
                discard(g, record.slot, BEYOND)
                continue
            label = Label.decode(record.label)
            scope = _checked_scope(label, layout, g)
            if scope is None or label is None:
                discard(g, record.slot, LABEL)
                continue
            candidates[g].append(_Found(order, g, record, label, scope))
        file.found = []  # (read once)
    # 2. Their bytes.
    verify_started = time.perf_counter()
    verified: list[_Found] = []
    bytes_verified = 0
    workers = min(VERIFY_WORKERS, os.cpu_count() or 1)
    for g, file in enumerate(disk.files):
        answers = file.verify([found.record for found in candidates[g]], workers)
        for found, good in zip(candidates[g], answers, strict=True):
            bytes_verified += sum(file.slot_sizes)
            if good:
                verified.append(found)
            else:
                discard(g, found.record.slot, CHECKSUM)
    verify_seconds = time.perf_counter() - verify_started
    # 3. One record per (block, layer group): the latest.
    latest: dict[tuple[bytes, int], _Found] = {}
    for found in verified:
        page_key = (found.label.key, found.label.layer_group)
        other = latest.get(page_key)
        if other is None or found.record.sequence > other.record.sequence:
            latest[page_key] = found
    blocks: dict[bytes, _Block] = {}
    for found in verified:
        label = found.label
        if latest[label.key, label.layer_group] is not found:
            discard(found.pool_group, found.record.slot, DUPLICATE)
            continue
        block = blocks.get(label.key)
        if block is None:
            block = blocks[label.key] = _Block(found)
        elif block.label[1:] != label[1:]:  # (the same key with other contents: a collision)
            discard(found.pool_group, found.record.slot, LABEL)
            continue
        block.pages[label.layer_group] = (found.pool_group, found.record.slot)
    # 4. The tree, from the roots down.
    roots: dict[bytes, list[_Block]] = {}
    for block in sorted(blocks.values(), key=lambda b: b.order):
        parent_key = block.label.parent_key
        if parent_key is None:
            roots.setdefault(block.label.scope_key, []).append(block)
        else:
            parent = blocks.get(parent_key)
            if parent is not None and parent.label.scope_key == block.label.scope_key:
                parent.children.append(block)
    anchors = _anchors(layout)

    def sibling_order(block: _Block) -> tuple[bool, int, int]:
        return (block.label.num_tokens != tpb, -block.label.num_tokens, block.order)

    taken: list[tuple[_Block, int]] = []  # (block, depth), depth first
    reached: set[bytes] = set()
    for scope_key in roots:
        stack = [(child, 0) for child in sorted(roots[scope_key], key=sibling_order, reverse=True)]
        while stack:
            block, depth = stack.pop()
            reached.add(block.key)
            needed = [g for g, anchor in enumerate(anchors) if depth < anchor]
            if any(g not in block.pages for g in needed):
                _drop_subtree(block, discard, reached)
                continue
            taken.append((block, depth))
            children = sorted(block.children, key=sibling_order, reverse=True)
            if block.label.num_tokens != tpb:  # (a partial block has no children)
                for child in reversed(children):
                    _drop_subtree(child, discard, reached)
                continue
            stack += [(child, depth + 1) for child in children]
    for block in sorted(blocks.values(), key=lambda b: b.order):
        if block.key not in reached:  # (its parent is gone: no prefix match reaches it)
            reached.add(block.key)
            for g, slot in sorted(block.pages.values()):
                discard(g, slot, UNREACHABLE)
    # 5. Into the tree: slots, pages, queues.
    slots: list[list[int]] = [[] for _ in disk.files]
    for block, _ in taken:
        for g, slot in block.pages.values():
            slots[g].append(slot)
    handles = []
    for g, used in enumerate(slots):
        allocator = state.allocators[level][g]
        assert allocator.num_active_slots == 0, "recovery runs on an empty level"
        handles.append(allocator.allocate_multiple(max(used) + 1) if used else [])
    in_tree: dict[bytes, Block] = {}
    new_blocks: list[Block] = []
    new_pages: list[Page] = []
    taken_slots: list[set[int]] = [set() for _ in disk.files]
    for block, _ in taken:
        label = block.label
        under = (
            tree.root(label.scope_key) if label.parent_key is None else in_tree[label.parent_key]
        )
        if kv_events is not None and label.scope_key not in kv_events.scopes:
            kv_events.scopes[label.scope_key] = block.scope
        records.scopes.setdefault(label.scope_key, label.scope)
        inserted, orphans = tree.insert(under, label.key, label.data, label.num_tokens)
        assert not orphans, "full blocks first, longer partial blocks first: none replaced"
        if inserted is None:  # a partial block whose tokens start a sibling's: useless
            for g, slot in block.pages.values():
                discard(g, slot, COVERED)
            continue
        in_tree[label.key] = inserted
        new_blocks.append(inserted)
        for layer_group in sorted(block.pages):
            g, slot = block.pages[layer_group]
            handle = handles[g][slot]
            assert handle.slot_id == slot
            if state.spare_pages:
                page = state.spare_pages.pop()
                page.reset(handle, level, g, layer_group, 0)
            else:
                page = Page(handle, level, g, layer_group)
            state.pages[level][g][slot] = page
            tree.attach(inserted, page)
            new_pages.append(page)
            taken_slots[g].add(slot)
            decisions.append(("recover", g, slot, layer_group, label.key))
    for g, group_handles in enumerate(handles):
        unused = [handle for handle in group_handles if handle.slot_id not in taken_slots[g]]
        if unused:
            state.allocators[level][g].release_multiple(unused)
    if policy is not None and new_blocks:
        policy.inserted(new_blocks)
    for page in reversed(new_pages):  # deepest first: eviction trims chains from their ends
        storage.owners.settle(page)
    return DiskRecovery(
        path=disk.path,
        started_empty=disk.reinitialized,
        records=total_records,
        pages=len(new_pages),
        blocks=len(new_blocks),
        bytes_verified=bytes_verified,
        verify_seconds=verify_seconds,
        seconds=time.perf_counter() - started,
        discarded=discarded,
        decisions=decisions,
    )


def _drop_subtree(
    top: _Block, discard: Callable[[int, int, str], None], reached: set[bytes]
) -> None:
    """Discard the pages of `top` and of every block below it (they cannot be reached)."""
    stack = [top]
    while stack:
        block = stack.pop()
        reached.add(block.key)
        for g, slot in sorted(block.pages.values()):
            discard(g, slot, UNREACHABLE)
        stack += reversed(block.children)


__all__ = ["DiskRecovery", "disk_identity", "recover"]
