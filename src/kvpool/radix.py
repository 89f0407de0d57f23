"""Prefix reuse: the radix tree of committed blocks, keyed by chained block keys (`tokens`).

The tree never owns pages: it points at each block's page per layer group, and the requests
(locks, holds) and the eviction queues decide their lifetime. When a page is dropped, the tree
removes what became unreachable and returns the pages that lost their block.

Since a key names a block and its whole prefix, the tree also indexes its blocks by key: lookups
need no walk, and requests keep keys, never blocks, between calls. So a block that leaves the
tree is reused for a later one: the engine's steady state creates no tree objects.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from hashlib import sha256
from typing import Final

from kvpool.chain import walk_index
from kvpool.events.log import KVEventLog
from kvpool.layout import KVLayout
from kvpool.lifecycles import AttentionLifeCycle, SsmLifeCycle
from kvpool.records import Block, LostBlock, Page
from kvpool.tokens import Token, _common_token_prefix, encode_checked, encode_tokens

# Partial matching and partial-block insertion scan a node's children only when it has few.
MAX_CHILDREN_SCANNED: Final = 32
_NO_PAGES: tuple[Page, ...] = ()  # "no orphans", without a new list per insert


def _add_child(parent: Block, block: Block) -> None:
    kids = parent.kids
    if kids is None:
        parent.kids = block
    elif isinstance(kids, dict):
        kids[block.key] = block
    else:
        parent.kids = {kids.key: kids, block.key: block}


def _remove_child(parent: Block, block: Block) -> None:
    kids = parent.kids
    if kids is block:
        parent.kids = None
        return
    assert isinstance(kids, dict) and kids[block.key] is block
    del kids[block.key]
    if len(kids) == 1:
        (parent.kids,) = kids.values()


def lost_block(block: Block, tokens_per_block: int) -> LostBlock | None:
    """What a full block is, for after it leaves the tree (None for a partial one)."""
    if block.num_tokens != tokens_per_block:
        return None
    parent = block.parent
    parent_key = None if parent is None or parent.parent is None else parent.key
    return LostBlock(block.key, parent_key, block.data, block.scope, block.tag)


@dataclass
class Match:
    """A reusable prefix of `num_tokens` tokens stored in `blocks`. All but the last block are
    used in full; when `num_tokens` is not block aligned the last one is used in part."""

    blocks: list[Block]
    num_tokens: int


class RadixTree:
    """Committed blocks of every reuse scope, keyed by chained block keys."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.roots: dict[bytes, Block] = {}
        # Every non-root block in the tree by key. Keys are chained from the scope's key, so a
        # key alone names a block and its whole prefix: lookups need no walk from the root.
        self.index: dict[bytes, Block] = {}
        # Non-root blocks that left the tree, reused for new ones (no garbage per block once the
        # tree has been as large as it gets). Nothing outside the tree keeps a block: requests
        # look their insertion point up by key.
        self._no_pages: list[None] = [None] * layout.num_layer_groups  # a new block's pages
        self._spare: list[Block] = []
        self._tokens_per_block = layout.tokens_per_block
        # A chain's blocks take the `tag` of its first block up to this ordinal, that of the
        # block at this ordinal from there on: a remote cluster keeps each part on one node
        # (`RemoteCacheTierConfig.placement_tokens`); -1: every block is its own tag.
        self.placement_blocks = -1
        # Told where full blocks' pages enter or leave the tree (None: no KV events).
        self.kv_events: KVEventLog | None = None
        # Per layer group: blocks below this ordinal need its page to stay reusable (every
        # block for full attention, the sink blocks for a window, none for SSM).
        self._anchor_blocks = [
            (2**63 if lc.window is None else lc.num_sink_blocks)
            if isinstance(lc, AttentionLifeCycle)
            else 0
            for lc in layout.life_cycles
        ]

    def make_spare_blocks(self, count: int) -> None:
        """Make `count` block records now, for the first blocks the tree takes in."""
        no_pages, spare = self._no_pages, self._spare
        spare += [Block(b"", None, b"", 0, no_pages) for _ in range(count)]

    def root(self, key: bytes) -> Block:
        """The root of a scope (created on first use; removed again when it has no children)."""
        node = self.roots.get(key)
        if node is None:
            node = self.roots[key] = Block(key, None, b"", 0, self._no_pages)
        return node

    # -- lookup ----------------------------------------------------------------------------------

    def match(self, scope_key: bytes, tokens: Sequence[Token], partial: bool) -> Match:
        """The longest prefix of `tokens` whose KV the tree holds in every layer group that the
        next token needs (see `_usable_length`). Every token is checked (`ArgumentError`),
        whether or not the scope has blocks."""
        encoded = encode_tokens(tokens, "input_tokens") if tokens else b""
        blocks, num_tokens = self._walk(scope_key, tokens, encoded, partial)
        usable = self._usable_length(blocks, num_tokens)
        tpb = self.layout.tokens_per_block
        return Match(blocks[: -(-usable // tpb)], usable)

    def _walk(
        self, scope_key: bytes, tokens: Sequence[Token], encoded: bytes, partial: bool
    ) -> tuple[list[Block], int]:
        """Blocks whose keys match, then (with `partial`) the child sharing the longest token
        prefix with the rest; returns the blocks and the matched token count. `encoded` is
        `encode_tokens(tokens)`: sliced per block when every token took 4 bytes (no digests)."""
        node = self.roots.get(scope_key)
        if node is None:
            return [], 0
        tpb = self.layout.tokens_per_block
        blocks: list[Block]
        uniform = len(encoded) == 4 * len(tokens)
        if uniform:  # (one call for the whole run of full blocks)
            full = 4 * tpb * (len(tokens) // tpb)
            run = encoded if full == len(encoded) else encoded[:full]
            blocks = walk_index(scope_key, run, 4 * tpb, self.index)
        else:
            blocks = []
            key, index = scope_key, self.index
            for start in range(0, len(tokens) - tpb + 1, tpb):
                key = sha256(key + encode_checked(tokens[start : start + tpb])).digest()
                found = index.get(key)
                if found is None:
                    break
                blocks.append(found)
        if blocks:
            node = blocks[-1]
        matched = len(blocks) * tpb
        children = node.children if partial else []
        if children and len(children) <= MAX_CHILDREN_SCANNED:
            if uniform:
                rest = encoded[4 * matched : 4 * (matched + tpb)]
            else:
                rest = encode_checked(tokens[matched : matched + tpb])
            best, best_len = None, 0
            for child in children:
                n = _common_token_prefix(child.data, rest)
                if n > best_len:
                    best, best_len = child, n
            if best is not None:
                blocks.append(best)
                matched += best_len
        return blocks, matched

    def _usable_length(self, blocks: list[Block], num_tokens: int) -> int:
        """Shorten a match until every layer group has the pages resuming at its end needs:
        attention needs the non-stale blocks (sinks and the window tail); SSM needs a state
        snapshot taken exactly at the end. Each retry strictly shortens, so this terminates."""
        tpb = self.layout.tokens_per_block
        while True:
            length = num_tokens
            for group, life_cycle in enumerate(self.layout.life_cycles):
                if isinstance(life_cycle, SsmLifeCycle):
                    length = _ssm_endpoint(blocks, group, length, tpb)
                else:
                    length = _attention_endpoint(blocks, group, life_cycle, length, tpb)
            if length == num_tokens:
                return length
            num_tokens = length

    # -- insertion -------------------------------------------------------------------------------

    def insert(
        self, parent: Block, key: bytes, data: bytes, num_tokens: int
    ) -> tuple[Block | None, Sequence[Page]]:
        """Add a block of `num_tokens` tokens encoded as `data` under `parent`; returns it (or
        the existing block with that key) and the pages orphaned on the way.

        A partial block whose tokens start a sibling's tokens is useless (None is returned). A
        new block replaces the partial siblings whose tokens it extends.
        """
        existing = self.index.get(key)
        if existing is not None:
            return existing, _NO_PAGES
        partial = num_tokens < self._tokens_per_block
        if partial:
            siblings = parent.children
            if len(siblings) <= MAX_CHILDREN_SCANNED:
                for child in siblings:
                    if child.data.startswith(data):
                        return None, _NO_PAGES
        orphans: Sequence[Page] = _NO_PAGES
        if parent.num_partial_children:
            removed: list[Page] = []
            for child in parent.children:
                if child.num_tokens < num_tokens and data.startswith(child.data):
                    self._remove_subtree(child, removed)
            orphans = removed
        block = self._new_block(key, parent, data, num_tokens)
        _add_child(parent, block)
        if partial:
            parent.num_partial_children += 1
        return block, orphans

    def insert_chain(
        self, parent: Block, keys: list[bytes], datas: list[bytes]
    ) -> tuple[list[Block], Sequence[Page]]:
        """`insert` full blocks one below the other, starting under `parent`."""
        blocks: list[Block] = []
        orphans: Sequence[Page] = _NO_PAGES
        index, tpb = self.index, self._tokens_per_block
        assert len(keys) == len(datas)
        for i in range(len(keys)):  # (not zip(..., strict=True): generic, compiled or not)
            key, data = keys[i], datas[i]
            child = index.get(key)
            if child is None:
                if parent.kids is None:  # the usual case: extend a chain
                    child = parent.kids = self._new_block(key, parent, data, tpb)
                else:
                    found, removed = self.insert(parent, key, data, tpb)
                    assert found is not None, "a full block is always inserted"
                    child = found
                    if removed:
                        orphans = [*orphans, *removed]
            blocks.append(child)
            parent = child
        return blocks, orphans

    def _new_block(self, key: bytes, parent: Block, data: bytes, num_tokens: int) -> Block:
        """A block for the tree (a reused one when there is one), entered in the index."""
        if self._spare:
            block = self._spare.pop()
            block.key, block.parent, block.data, block.num_tokens = key, parent, data, num_tokens
            block.ordinal = parent.ordinal + 1
            block.scope = parent.scope
            block.kids = None
            block.num_partial_children = 0
            block.in_tree = True
            block.used_at, block.uses, block.candidate = 0, 0, False
        else:
            block = Block(key, parent, data, num_tokens, self._no_pages)
        ordinal, placement = block.ordinal, self.placement_blocks
        block.tag = key if placement < 0 or ordinal == 0 or ordinal == placement else parent.tag
        self.index[key] = block
        return block

    def _retire(self, block: Block) -> None:
        """`block` (without pages or children) left the tree: keep it for reuse. Roots are
        never reused."""
        block.in_tree = False
        if block.parent is not None:
            del self.index[block.key]
            block.parent = None
            self._spare.append(block)

    def detach(self, page: Page) -> None:
        """Unlink a page from its block, which keeps its place in the tree."""
        block = page.block
        assert block is not None and block.pages[page.layer_group] is page
        if self.kv_events is not None:
            self.kv_events.removed(block, page.layer_group, page.level)
        block.pages[page.layer_group] = None
        page.block = None

    def attach(self, block: Block, page: Page) -> None:
        assert block.pages[page.layer_group] is None and page.block is None
        block.pages[page.layer_group] = page
        page.block = block
        if self.kv_events is not None:
            self.kv_events.stored(block, page.layer_group, page.level)

    # -- removal ---------------------------------------------------------------------------------

    def remove_page(self, page: Page) -> Sequence[Page]:
        """`remove_pages` for one page."""
        return self.remove_pages((page,))

    def remove_pages(
        self, pages: Iterable[Page], lost_blocks: list[LostBlock | None] | None = None
    ) -> Sequence[Page]:
        """Detach dropped pages from their blocks; return the other pages that lost their block
        (pages that lost it to an earlier one of `pages` are skipped). With `lost_blocks`, what
        each returned page's block was is appended to it (None for a partial block).

        Without a full-attention (or sink) page a block and all its descendants can never be
        reused again, so they go. Then childless blocks without any page are pruned upwards.
        """
        orphans: list[Page] = []
        anchors, index, spare, tpb = (
            self._anchor_blocks,
            self.index,
            self._spare,
            self._tokens_per_block,
        )
        events = self.kv_events
        for page in pages:
            block = page.block
            if block is None:
                continue
            group = page.layer_group
            assert block.pages[group] is page
            if events is not None:
                events.removed(block, group, page.level)
            block.pages[group] = None
            page.block = None
            if block.ordinal >= anchors[group]:
                self._prune_upwards(block)
                continue
            parent = block.parent
            if parent is not None and block.kids is None:
                # A leaf, the usual victim: its other pages lost with it, `_unlink` and
                # `_retire` inline.
                if _has_page(block):
                    self._detach_all(block, orphans, lost_blocks)
                if parent.kids is block:
                    parent.kids = None
                else:
                    _remove_child(parent, block)
                if block.num_tokens < tpb:
                    parent.num_partial_children -= 1
                block.in_tree = False
                del index[block.key]
                block.parent = None
                spare.append(block)
                if parent.kids is None and not _has_page(parent):
                    self._prune_upwards(parent)
                continue
            self._remove_subtree(block, orphans, lost_blocks)
            if parent is not None:
                self._prune_upwards(parent)
        return orphans

    def clear(self) -> list[Page]:
        """Remove every block (and drop the spare ones); return their pages. (No removal
        events: the caller announces everything cleared.)"""
        orphans: list[Page] = []
        events, self.kv_events = self.kv_events, None
        try:
            for root in list(self.roots.values()):
                self._remove_subtree(root, orphans)
        finally:
            self.kv_events = events
        self._spare = []
        return orphans

    def _remove_subtree(
        self, top: Block, orphans: list[Page], lost: list[LostBlock | None] | None = None
    ) -> None:
        """Unlink `top` and everything below it (iteratively, leaf first); their pages go to
        `orphans` (and what their blocks were to `lost`, if given)."""
        if top.parent is not None:
            self._unlink(top)
        elif self.roots.get(top.key) is top:
            del self.roots[top.key]
        stack = [top]
        while stack:
            block = stack.pop()
            if block.kids is not None:
                stack.extend(block.children)
                block.kids = None
            if _has_page(block):
                self._detach_all(block, orphans, lost)
            self._retire(block)

    def _detach_all(
        self, block: Block, orphans: list[Page], lost: list[LostBlock | None] | None
    ) -> None:
        """Detach every page `block` still has (it is leaving the tree): they go to `orphans`,
        and what the block was, once per page, to `lost` (if given)."""
        events = self.kv_events
        for group, page in enumerate(block.pages):
            if page is not None:
                if events is not None:
                    events.removed(block, group, page.level)
                page.block = None
                block.pages[group] = None
                orphans.append(page)
                if lost is not None:
                    lost.append(lost_block(block, self._tokens_per_block))

    def _unlink(self, block: Block) -> None:
        parent = block.parent
        assert parent is not None
        _remove_child(parent, block)
        if block.num_tokens < self._tokens_per_block:
            parent.num_partial_children -= 1

    def _prune_upwards(self, block: Block) -> None:
        """Remove childless blocks that hold no page in any layer group, up to the root."""
        while block.kids is None and not _has_page(block):
            parent = block.parent
            if parent is None:
                if self.roots.get(block.key) is block:
                    del self.roots[block.key]
                block.in_tree = False
                return
            self._unlink(block)
            self._retire(block)
            block = parent

    # -- introspection ---------------------------------------------------------------------------

    def blocks(self) -> Iterator[Block]:
        """Every non-root block."""
        stack = list(self.roots.values())
        while stack:
            block = stack.pop()
            stack.extend(block.children)
            if not block.is_root:
                yield block


def _attention_endpoint(
    blocks: list[Block], group: int, life_cycle: AttentionLifeCycle, length: int, tpb: int
) -> int:
    """Cut `length` before the first block the next step needs that has no page in `group`."""
    beg, end = life_cycle.stale_range(length, tpb)
    for index in range(-(-length // tpb)):
        if beg <= index < end:
            continue
        if blocks[index].pages[group] is None:
            return index * tpb
    return length


def _ssm_endpoint(blocks: list[Block], group: int, length: int, tpb: int) -> int:
    """The longest prefix (<= length) that ends exactly where a block has a state snapshot."""
    for index in range(-(-length // tpb) - 1, -1, -1):
        block = blocks[index]
        end = index * tpb + block.num_tokens
        if end <= length and block.pages[group] is not None:
            return end
    return 0


def _has_page(block: Block) -> bool:
    """Whether any layer group of `block` still has its page (over the list: compiled, a
    native loop; `any(block)` went through `Block.__iter__`)."""
    return any(page is not None for page in block.pages)
