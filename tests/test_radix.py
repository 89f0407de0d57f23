"""Block keys and the radix tree's removal rules."""

import hashlib

import pytest

from kvpool import ReuseScope
from kvpool.errors import ArgumentError
from kvpool.layout import KVLayout
from kvpool.radix import RadixTree
from kvpool.records import Page
from kvpool.storage import SlotAllocator
from kvpool.tokens import _common_token_prefix, block_key, decode_tokens, encode_tokens, root_key
from tests.helpers import kv_layer, ssm_layer


def test_root_keys_of_scopes_all_differ():
    scopes = [
        None,
        ReuseScope(),
        ReuseScope(lora_id=0),
        ReuseScope(salt=0),
        ReuseScope(0, 0),
        ReuseScope(5),
        ReuseScope(salt=5),
        ReuseScope(salt="5"),
    ]
    keys = [root_key(s) for s in scopes]
    assert keys[0] == keys[1]  # None is the empty scope
    assert len(set(keys[1:])) == len(scopes) - 1
    assert all(len(k) == 32 for k in keys)
    # A str salt is hashed as its UTF-8 bytes.
    assert root_key(ReuseScope(salt="5")) == root_key(ReuseScope(salt=b"5"))


def test_root_key_encoding_is_pinned():
    assert (
        root_key(ReuseScope(7, None))
        == hashlib.sha256(bytes([1]) + b"i" + (7).to_bytes(8, "little")).digest()
    )
    assert root_key(None) == hashlib.sha256(bytes([0])).digest()


@pytest.mark.parametrize(
    "scope", [ReuseScope(-1), ReuseScope(2**64), ReuseScope("x"), ReuseScope(salt=1.5), "scope"]
)
def test_bad_scopes(scope):
    with pytest.raises(ArgumentError, match="reuse_scope"):
        root_key(scope)


def test_block_key_chains_and_encodes_ints_little_endian():
    previous = root_key(None)
    assert (
        block_key(previous, [1, 2])
        == hashlib.sha256(previous + (1).to_bytes(4, "little") + (2).to_bytes(4, "little")).digest()
    )
    assert block_key(previous, [1, 2]) != block_key(block_key(previous, [0]), [1, 2])


def test_digest_tokens_cannot_collide_with_int_tokens():
    digest = bytes(range(32))
    ints = [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 32, 4)]
    assert all(0 <= t < 2**31 for t in ints)
    assert encode_tokens([digest]) != encode_tokens(ints)
    assert block_key(b"", [digest]) != block_key(b"", ints)
    assert (
        block_key(b"", [digest, 3])
        == hashlib.sha256(b"\xff" * 4 + digest + (3).to_bytes(4, "little")).digest()
    )


@pytest.mark.parametrize("token", [-1, 2**31, 1.0, "a", b"short", bytes(33), None])
def test_invalid_tokens(token):
    with pytest.raises(
        ArgumentError, match="must be an int in \\[0, 2\\*\\*31\\) or a 32-byte digest"
    ):
        encode_tokens([1, token, 2])


def insert(tree, parent, tokens):
    """Insert a block of `tokens` under `parent` (its key chained from the parent's)."""
    return tree.insert(parent, block_key(parent.key, tokens), encode_tokens(tokens), len(tokens))


def make_page(allocator, group, layout):
    return Page(allocator.allocate(), 0, layout.pool_group_of[group], group)


def build_chain(tree, layout, allocator, length, groups):
    """A chain of `length` full blocks with a page in each of `groups`."""
    tpb = layout.tokens_per_block
    parent = tree.root(root_key(None))
    blocks = []
    for i in range(length):
        tokens = tuple(range(i * tpb, (i + 1) * tpb))
        block, orphans = insert(tree, parent, tokens)
        assert not orphans
        for group in groups:
            tree.attach(block, make_page(allocator, group, layout))
        blocks.append(block)
        parent = block
    return blocks


def test_dropping_a_full_attention_page_removes_the_subtree():
    layout = KVLayout([kv_layer(0, window=32), kv_layer(1)], 16)
    tree, allocator = RadixTree(layout), SlotAllocator(100)
    blocks = build_chain(tree, layout, allocator, 4, groups=[0, 1])
    orphans = tree.remove_page(blocks[1][1])
    # Block 1 and its descendants are unreachable: their other pages are orphaned.
    assert len(orphans) == 1 + 2 * 2
    assert [b.in_tree for b in blocks] == [True, False, False, False]
    assert list(tree.blocks()) == [blocks[0]]
    assert all(p.block is None for p in orphans)


def test_dropping_a_window_page_keeps_the_block_while_another_group_has_a_page():
    """Stale-tail prune regression: every layer group's slot must be empty before pruning."""
    layout = KVLayout([kv_layer(0, window=32), kv_layer(1)], 16)
    tree, allocator = RadixTree(layout), SlotAllocator(100)
    blocks = build_chain(tree, layout, allocator, 2, groups=[0, 1])
    assert not tree.remove_page(blocks[1][0])
    assert blocks[1].in_tree and blocks[1][1] is not None
    # A block holding only a window page: when that goes, the empty tail is pruned upwards.
    layout_swa = KVLayout([kv_layer(0, window=32), kv_layer(1, window=64)], 16)
    tree, allocator = RadixTree(layout_swa), SlotAllocator(100)
    blocks = build_chain(tree, layout_swa, allocator, 3, groups=[0, 1])
    tree.remove_page(blocks[2][1])
    assert blocks[2].in_tree  # group 0 still has a page
    tree.remove_page(blocks[2][0])
    assert not blocks[2].in_tree and blocks[1].in_tree


def test_pruning_empties_the_scope_root():
    layout = KVLayout([kv_layer(0, window=32, sinks=0), ssm_layer(1, size=100)], 16)
    tree, allocator = RadixTree(layout), SlotAllocator(100)
    blocks = build_chain(tree, layout, allocator, 1, groups=[0])
    assert not tree.remove_page(blocks[0][0])
    assert tree.roots == {}


@pytest.mark.parametrize("scope", [None, ReuseScope(salt="user-7"), ReuseScope(lora_id=2**64 - 1)])
def test_dropping_a_chain_leaf_first_empties_the_tree_and_its_scope_root(scope):
    """The LRU's usual order (leaf first): each drop removes its block, and the last one the
    scope's root, so per-user salts do not leave roots behind."""
    layout = KVLayout([kv_layer(0)], 16)
    tree, allocator = RadixTree(layout), SlotAllocator(100)
    parent = tree.root(root_key(scope))
    blocks = []
    for i in range(3):
        block, _ = insert(tree, parent, tuple(range(i * 16, (i + 1) * 16)))
        tree.attach(block, make_page(allocator, 0, layout))
        blocks.append(parent := block)
    for depth, block in enumerate(reversed(blocks)):
        assert not tree.remove_page(block[0])
        assert len(tree.index) == 2 - depth and not block.in_tree
        assert (tree.roots != {}) == (depth < 2)
    assert list(tree.blocks()) == []


def test_partial_siblings_that_do_not_extend_each_other_both_stay():
    layout = KVLayout([kv_layer(0)], 16)
    tree = RadixTree(layout)
    root = tree.root(root_key(None))
    short, _ = insert(tree, root, (1, 2, 3, 4))
    other, orphans = insert(tree, root, (1, 2, 9, 9, 9, 9, 9, 9))  # longer, not an extension
    assert short is not None and other is not None and not orphans
    assert set(root.children) == {short, other} and root.num_partial_children == 2


def test_insert_chain_replaces_partial_siblings_and_returns_their_pages():
    layout = KVLayout([kv_layer(0)], 16)
    tree, allocator = RadixTree(layout), SlotAllocator(100)
    root = tree.root(root_key(None))
    first, _ = insert(tree, root, tuple(range(16)))
    partial, _ = insert(tree, first, tuple(range(16, 20)))
    page, partial_key = make_page(allocator, 0, layout), partial.key
    tree.attach(partial, page)
    tokens = tuple(range(16, 32))
    blocks, orphans = tree.insert_chain(
        first, [block_key(first.key, tokens)], [encode_tokens(tokens)]
    )
    assert orphans == [page] and page.block is None and partial_key not in tree.index
    assert first.children == blocks and first.num_partial_children == 0


def test_longer_block_replaces_a_partial_sibling():
    layout = KVLayout([kv_layer(0)], 16)
    tree, allocator = RadixTree(layout), SlotAllocator(100)
    root = tree.root(root_key(None))
    partial_tokens = tuple(range(5))
    partial, _ = insert(tree, root, partial_tokens)
    partial_key = partial.key
    tree.attach(partial, make_page(allocator, 0, layout))
    # A shorter partial covered by it is useless.
    useless, orphans = insert(tree, root, partial_tokens[:3])
    assert useless is None and not orphans
    full_tokens = tuple(range(16))
    full, orphans = insert(tree, root, full_tokens)
    assert full is not None and full.tokens == full_tokens
    assert len(orphans) == 1 and orphans[0].block is None
    assert root.children == [full] and root.num_partial_children == 0
    assert partial_key not in tree.index and tree.index == {full.key: full}


def test_clear_removes_everything():
    layout = KVLayout([kv_layer(0)], 16)
    tree, allocator = RadixTree(layout), SlotAllocator(100)
    build_chain(tree, layout, allocator, 3, groups=[0])
    tree.root(root_key(ReuseScope(1)))  # a childless root
    assert len(tree.clear()) == 3
    assert tree.roots == {} and list(tree.blocks()) == []


@pytest.mark.parametrize("digest_at", [None, 3, 70, 200])
def test_match_agrees_with_the_plain_key_chain(digest_at):
    """The walk encodes tokens in doubling chunks; with a digest token anywhere (not 4 bytes)
    it falls back to one block at a time. Either way it finds the blocks of the plain chain."""
    layout = KVLayout([kv_layer(0)], 16)
    tree, allocator = RadixTree(layout), SlotAllocator(1000)
    tokens: list = list(range(1000, 1000 + 16 * 300))
    if digest_at is not None:
        tokens[digest_at * 16 + 5] = bytes(range(32))
    node, key = tree.root(root_key(None)), root_key(None)
    for start in range(0, 16 * 250, 16):  # the first 250 blocks are in the tree
        key = block_key(key, tokens[start : start + 16])
        node, _ = insert(tree, node, tokens[start : start + 16])
        tree.attach(node, make_page(allocator, 0, layout))
    for length in (15, 16, 16 * 5 + 3, 16 * 64, 16 * 65, 16 * 250, 16 * 300):
        match = tree.match(root_key(None), tokens[:length], partial=False)
        assert match.num_tokens == min(length // 16, 250) * 16
    other = [*tokens[: 16 * 100], *range(7, 7 + 16 * 10)]
    assert tree.match(root_key(None), other, partial=False).num_tokens == 16 * 100


def test_children_switch_between_one_inline_child_and_a_dict():
    layout = KVLayout([kv_layer(0)], 16)
    tree, allocator = RadixTree(layout), SlotAllocator(100)
    root = tree.root(root_key(None))
    first, _ = insert(tree, root, tuple(range(16)))
    assert root.kids is first  # one child: no dict
    blocks = [first] + [insert(tree, root, tuple(range(k, k + 16)))[0] for k in (100, 200)]
    assert isinstance(root.kids, dict) and root.children == blocks
    for block in blocks:
        tree.attach(block, make_page(allocator, 0, layout))
    for block in blocks[:2]:  # dropping a leaf's only page prunes it
        tree.remove_page(block[0])
    assert root.kids is blocks[2] and not blocks[0].in_tree
    assert root.child(blocks[2].key) is blocks[2] and root.child(blocks[0].key) is None
    match = tree.match(root_key(None), list(range(200, 216)) + [5], partial=False)
    assert match.blocks == [blocks[2]] and match.num_tokens == 16


def test_encoded_tokens_decode_and_compare_by_token():
    digest = bytes(range(32))
    tokens = (7, digest, 2**31 - 1, 0)
    assert decode_tokens(encode_tokens(tokens)) == tokens
    assert decode_tokens(encode_tokens(range(5))) == (0, 1, 2, 3, 4)
    common = _common_token_prefix
    assert common(encode_tokens([1, 2, 3]), encode_tokens([1, 2, 4])) == 2
    assert common(encode_tokens([1, 2, 3]), encode_tokens([1, 2 + 256, 3])) == 1
    assert common(encode_tokens([1, digest, 3]), encode_tokens([1, digest, 4])) == 2
    other = bytes([0] * 31 + [1])
    assert common(encode_tokens([1, digest, 3]), encode_tokens([1, other])) == 1
