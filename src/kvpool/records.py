"""The two linked bookkeeping records: a `Page` (one slot holding one block of one layer group at
one cache level) and a `Block` (one committed block in the radix tree, the list of its pages).
Each points at the other, so they live in one module.

A page's status is derived from its owners: requests that are running *lock* it (it must stay on
the GPU), suspended requests *hold* it (it may move to a colder level but is never dropped).
A page attached to a radix-tree block is *committed*: immutable and shareable; when nobody owns it
any more it stays cached and becomes evictable. An uncommitted page nobody owns is freed at once.

The storage manager reuses the Page object of a freed page for a later one (`reset`), so nothing
may keep a page after it is freed; nothing in kvpool does (owners, blocks and queues let go first).
Likewise the tree reuses Block objects that left it: requests keep block keys, never blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import Enum
from typing import Final, NamedTuple

from kvpool.storage.slots import Slot
from kvpool.tokens import Token, decode_tokens

DEFAULT_PRIORITY: Final = 35
MIN_PRIORITY: Final = 0
MAX_PRIORITY: Final = 100


class PageStatus(Enum):
    LOCKED = "locked"
    HELD = "held"
    DROPPABLE = "droppable"


class Page:
    """Ownership record of one slot; the `StorageManager` changes the counts."""

    __slots__ = (
        "after",
        "aside",
        "before",
        "block",
        "going",
        "holds",
        "klass",
        "layer_group",
        "level",
        "locks",
        "pool_group",
        "priority",
        "queued",
        "slot",
    )

    def __init__(
        self, slot: Slot | None, level: int, pool_group: int, layer_group: int, locks: int = 0
    ) -> None:
        self.reset(slot, level, pool_group, layer_group, locks)

    def reset(
        self, slot: Slot | None, level: int, pool_group: int, layer_group: int, locks: int
    ) -> None:
        """(Re)start as a new page in `slot` (the storage manager reuses freed Page objects)."""
        self.slot: Slot | None = slot
        self.level = level
        self.pool_group = pool_group
        self.layer_group = layer_group
        self.block: Block | None = None  # set while the page is the tree block's copy
        self.locks = locks
        self.holds = 0
        self.priority = DEFAULT_PRIORITY
        self.queued = False  # in its (level, pool group) eviction queue
        self.klass = 0  # its eviction policy class there (`kvpool.policies`; 0: none)
        # Its neighbours in its eviction list (`kvpool.page_list`), while it is in one:
        self.before: Page | None = None
        self.after: Page | None = None
        self.aside = False  # set aside by its queue (a classed page that is not a leaf)
        self.going = False  # picked to go in the batch its queue is picking now

    @property
    def slot_id(self) -> int:
        assert self.slot is not None, "page was freed"
        return self.slot.slot_id

    @property
    def status(self) -> PageStatus:
        if self.locks:
            return PageStatus.LOCKED
        return PageStatus.HELD if self.holds else PageStatus.DROPPABLE

    def __repr__(self) -> str:
        slot = self.slot.slot_id if self.slot is not None else "freed"
        kind = "committed" if self.block is not None else "uncommitted"
        return (
            f"Page(level {self.level}, pool group {self.pool_group}, slot {slot}, {kind}, "
            f"locks {self.locks}, holds {self.holds})"
        )


class Block:
    """One committed block: full (`tokens_per_block` tokens) or a partial tail (fewer, a leaf).

    `pages[g]` is its page for layer group `g`, or None (never stored, or dropped); `block[g]`
    reads and writes it too. (A plain class holding the list rather than a list subclass: the
    native backend compiles a plain class into a C struct, whose attributes the hot path reads
    without a dictionary lookup; a compiled class cannot subclass list.) Blocks compare and
    hash by identity. `data` is the block's
    tokens as `encode_tokens` writes them (bytes: nothing for the collector to track). `kids` is
    None for a leaf, the child itself when there is one (most blocks of a chain), or a dict
    key -> child when there are several.
    """

    __slots__ = (
        "candidate",
        "data",
        "in_tree",
        "key",
        "kids",
        "num_partial_children",
        "num_tokens",
        "ordinal",
        "pages",
        "parent",
        "scope",
        "tag",
        "used_at",
        "uses",
    )

    def __init__(
        self,
        key: bytes,
        parent: Block | None,
        data: bytes,
        num_tokens: int,
        no_pages: list[None],
    ) -> None:
        self.pages: list[Page | None] = list(no_pages)
        self.key = key
        self.parent = parent
        self.data = data
        self.num_tokens = num_tokens
        self.ordinal: int = -1 if parent is None else parent.ordinal + 1
        self.scope: bytes = key if parent is None else parent.scope  # the root's key
        # The key whose hash slot places the block's remote values on a cluster's node (its
        # own, or an ancestor's: `RadixTree.placement_blocks`).
        self.tag: bytes = key
        # Kept only by an eviction policy that needs them (`kvpool.policies`):
        self.used_at = 0  # when a request last used it (the policy's logical time)
        self.uses = 0  # how many requests used it
        self.candidate = False  # counted as an eviction candidate (a leaf, since `used_at`)
        self.kids: Block | dict[bytes, Block] | None = None
        self.num_partial_children = 0  # children with fewer tokens than a block
        self.in_tree = True

    def __getitem__(self, layer_group: int) -> Page | None:
        return self.pages[layer_group]

    def __setitem__(self, layer_group: int, page: Page | None) -> None:
        self.pages[layer_group] = page

    def __len__(self) -> int:
        return len(self.pages)

    def __iter__(self) -> Iterator[Page | None]:
        return iter(self.pages)

    def __bool__(self) -> bool:
        return True

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def child(self, key: bytes) -> Block | None:
        kids = self.kids
        if kids is None:
            return None
        if isinstance(kids, dict):
            return kids.get(key)
        return kids if kids.key == key else None

    @property
    def children(self) -> list[Block]:
        kids = self.kids
        if kids is None:
            return []
        return list(kids.values()) if isinstance(kids, dict) else [kids]

    @property
    def tokens(self) -> tuple[Token, ...]:
        """The block's tokens, decoded from `data` (for introspection)."""
        return decode_tokens(self.data)

    def __repr__(self) -> str:
        return (
            f"Block(ordinal {self.ordinal}, {self.num_tokens} tokens, "
            f"{len(self.children)} children)"
        )


class LostBlock(NamedTuple):
    """What a block that left the tree was (for writing its pages elsewhere)."""

    key: bytes
    parent_key: bytes | None  # None for a scope's first block
    data: bytes
    scope: bytes
    tag: bytes  # the key that places its remote values (`Block.tag`)
