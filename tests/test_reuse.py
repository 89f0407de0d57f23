"""Prefix reuse: full and partial block reuse verified byte for byte, scopes, misses."""

import pytest

from kvpool import GpuCacheTierConfig, KVCacheManager, ReuseScope
from tests.engine_check import CheckingEngine
from tests.helpers import MiB, hybrid_layers, make_config, record_layer, shutdown

TPB = 16


@pytest.fixture
def setup():
    managers = []

    def make(layers=None, quota=4 * MiB, **kwargs):
        m = KVCacheManager(
            make_config(
                layers=layers or hybrid_layers(TPB, window=32, sinks=4),
                tokens_per_block=TPB,
                tiers=[GpuCacheTierConfig(quota)],
                **kwargs,
            )
        )
        managers.append(m)
        return m, CheckingEngine(m)

    yield make
    for m in managers:
        shutdown(m)


def run_request(m, engine, tokens, prompt_length, scope=None, reuse_expected=None):
    """Create (reusing what the tree has of the prompt), prefill the rest, decode to the end,
    verifying every record at every step; returns the number of reused tokens."""
    cache = m.create_kv_cache(scope, tokens[:prompt_length])
    reused = cache.num_committed_tokens
    assert cache.capacity == cache.history_length == reused
    if reuse_expected is not None:
        assert reused == reuse_expected
    assert cache.resume()
    engine.check(cache, tokens)  # reads bytes another request wrote
    if prompt_length > reused:
        assert engine.step(cache, tokens, tokens[reused:prompt_length])
    for position in range(prompt_length, len(tokens)):
        engine.check(cache, tokens)
        assert engine.step(cache, tokens, tokens[position : position + 1])
    engine.check(cache, tokens)
    cache.close()
    return reused


def test_second_request_reuses_both_prompt_blocks_and_reads_the_first_ones_bytes(setup):
    m, engine = setup()
    prompt = list(range(100, 132))  # two blocks
    assert run_request(m, engine, prompt + [7, 8, 9], 32, reuse_expected=0) == 0
    checked = engine.records_checked
    reused = run_request(m, engine, prompt + [10, 11], 32, reuse_expected=32)
    assert reused == 32 and engine.records_checked > checked
    assert m.probe_reuse(None, prompt) == 32


@pytest.mark.parametrize("layers", ["full", "hybrid"])
def test_conversation_reuses_every_earlier_round(setup, layers):
    """Each round's prompt is the previous round's prompt and answer plus a new turn: it reuses
    all of that (the blocks committed after a reused prefix chain on from the prefix)."""
    full = [record_layer(i, TPB) for i in range(2)]
    m, engine = setup(layers=full if layers == "full" else None)
    history: list[int] = []
    for round_ in range(5):
        turn = [1000 * (round_ + 1) + i for i in range(21)]
        answer = [500 + round_ * 40 + i for i in range(11)]
        prompt = history + turn
        expected = len(history)  # everything before this turn was committed and closed
        assert (
            run_request(m, engine, prompt + answer, len(prompt), reuse_expected=expected)
            == expected
        )
        history = prompt + answer
    assert m.probe_reuse(None, history) == len(history) == 160


def test_full_reuse_shares_pages_instead_of_copying(setup):
    m, engine = setup()
    prompt = list(range(32))
    first = m.create_kv_cache(None, prompt)
    first.resume()
    engine.step(first, prompt, prompt)
    second = m.create_kv_cache(None, prompt)
    assert second.num_committed_tokens == 32
    second.resume()
    for group in range(m.layout.num_layer_groups):
        assert list(second.get_base_page_indices(group)) == list(first.get_base_page_indices(group))
    engine.check(second, prompt)
    first.close()
    second.close()


def test_identical_block_committed_twice_keeps_one_copy(setup):
    m, engine = setup()
    prompt = list(range(500, 532))
    a, b = m.create_kv_cache(None, prompt), m.create_kv_cache(None, prompt)  # both miss
    a.resume(), b.resume()
    free_before = m.get_storage_statistics(0)[0].free
    assert engine.step(a, prompt, prompt)
    assert engine.step(b, prompt, prompt)  # b's blocks already exist: b switches to a's pages
    for group in range(m.layout.num_layer_groups):
        assert list(b.get_base_page_indices(group)) == list(a.get_base_page_indices(group))
    assert free_before - m.get_storage_statistics(0)[0].free == 4  # 2 blocks x 2 groups, once
    engine.check(b, prompt)
    a.close(), b.close()


def test_partial_reuse_copies_into_a_private_page(setup):
    m, engine = setup()
    prompt = list(range(200, 232))
    run_request(m, engine, prompt + [1], 32)
    # Shares block 0 and the first 4 tokens of block 1, then diverges.
    other = prompt[:20] + list(range(900, 930))
    cache = m.create_kv_cache(None, other[:30])
    assert cache.num_committed_tokens == 20
    shared_pages = [cache.get_base_page_indices(g)[1] for g in range(2)]
    assert cache.resume()
    private_pages = [cache.get_base_page_indices(g)[1] for g in range(2)]
    assert all(p != s for p, s in zip(private_pages, shared_pages, strict=True))
    engine.check(cache, other)  # the copied records of tokens 16..19
    assert engine.step(cache, other, other[20:30])
    engine.check(cache, other)
    cache.close()
    # The first request's block 1 was never written: a full reuse still verifies.
    assert run_request(m, engine, prompt + [2, 3], 32, reuse_expected=32) == 32


def test_partial_reuse_can_be_turned_off(setup):
    m, engine = setup(enable_partial_reuse=False)
    prompt = list(range(200, 232))
    run_request(m, engine, prompt + [1], 32)
    assert m.probe_reuse(None, prompt[:20] + [999] * 12) == 16


def test_partial_tail_of_a_finished_request_is_reusable(setup):
    m, engine = setup()
    turn = list(range(300, 340))  # 2.5 blocks
    run_request(m, engine, turn, 20)  # 20 prompt tokens, decodes to 40, closes
    reused = run_request(m, engine, turn + [41, 42, 43], 43, reuse_expected=40)
    assert reused == 40


def test_reuse_after_eviction_is_a_miss(setup):
    # 64 KiB slots: 32 of them, one pool group shared by both layer groups.
    m, engine = setup(
        layers=hybrid_layers(TPB, num_layers=4, window=32, sinks=4, repeats=64), quota=2 * MiB
    )
    assert m.get_storage_statistics(0)[0].total == 32
    prompt = list(range(32))
    run_request(m, engine, prompt + [5], 32)
    assert m.probe_reuse(None, prompt) == 32
    for i in range(3):  # other traffic evicts it
        run_request(m, engine, list(range(1000 * (i + 1), 1000 * (i + 1) + 100)), 100)
    assert m.num_dropped_pages > 0
    assert m.probe_reuse(None, prompt) == 0
    assert run_request(m, engine, prompt + [6], 32, reuse_expected=0) == 0  # no stale bytes read


@pytest.mark.parametrize(
    ("scope", "reused"),
    [
        (ReuseScope(7, 11), 32),
        (ReuseScope(7, 12), 0),
        (ReuseScope(8, 11), 0),
        (ReuseScope(7, None), 0),
        (ReuseScope(None, 11), 0),
        (None, 0),
        (ReuseScope(), 0),
    ],
)
def test_scope_isolation(setup, scope, reused):
    m, engine = setup()
    prompt = list(range(32))
    run_request(m, engine, prompt + [1], 32, scope=ReuseScope(7, 11))
    assert m.probe_reuse(scope, prompt) == reused
    assert run_request(m, engine, prompt + [2], 32, scope=scope, reuse_expected=reused) == reused


def test_sliding_window_match_needs_only_the_window_and_sinks(setup):
    """A window-only model: blocks outside the window at the match end need no page."""
    layers = [record_layer(i, TPB, window=32, sinks=4) for i in range(2)]
    m, engine = setup(layers=layers)
    tokens = list(range(5000, 5200))
    run_request(m, engine, tokens, 10)  # decodes to 200 tokens
    # Drop the cached pages of blocks 1..8 (stale at 176 tokens) as eviction would.
    owners = m._storage.owners
    for block in list(m._tree.blocks()):
        if 1 <= block.ordinal <= 8:
            owners.drop([block[0]])
    assert m.probe_reuse(None, tokens[:176]) == 176  # window [145, 175] + sink block 0
    # At 150 the window needs block 7: gone. Cutting back block by block finds no complete
    # window until 16 tokens (only the sink block needed).
    assert m.probe_reuse(None, tokens[:150]) == 16
    assert run_request(m, engine, tokens[:180], 176, reuse_expected=176) == 176


@pytest.mark.reference_only
@pytest.mark.parametrize("deepest_first", [True, False])
def test_dropping_full_attention_pages_frees_the_window_pages_of_their_blocks(setup, deepest_first):
    """A block that loses its full-attention page leaves the tree with its descendants; their
    window pages (another pool group) are freed with them, in one release per pool group,
    and come back in the order they were freed: the usual leaf path (deepest first) and the
    subtree path (root first)."""
    layers = [record_layer(0, TPB, window=32, sinks=4), record_layer(1, TPB, repeats=2)]
    m, engine = setup(layers=layers)
    assert m._context.layout.pool_group_of == [0, 1]  # window pages, full pages
    tokens = list(range(300, 397))
    cache = m.create_kv_cache(None, [])
    assert cache.resume() and cache.resize(len(tokens))
    engine.step(cache, tokens, tokens)  # (no decode steps: every window page stays cached)
    cache.close()
    chain = sorted(m._tree.blocks(), key=lambda block: block.ordinal)
    window_pages = [block[0] for block in chain]
    assert len(chain) == 7 and all(page is not None and page.queued for page in window_pages)
    window = m._storage.state.allocators[0][0]
    free_before = window.num_free_slots
    releases = []
    release_multiple = window.release_multiple
    window.release_multiple = lambda slots, *rest: (
        releases.append([slot.slot_id for slot in slots]),
        release_multiple(slots, *rest),
    )[1]
    full_pages = [block[1] for block in chain]
    m._storage.owners.drop(full_pages[::-1] if deepest_first else full_pages)
    assert not list(m._tree.blocks())
    assert window.num_free_slots == free_before + 7
    assert all(page.slot is None for page in window_pages)
    assert len(releases) == 1 and sorted(releases[0]) == list(range(7))
    if deepest_first:
        assert releases[0] == list(range(6, -1, -1))
    assert window._recycled[window._head :][-7:] == [window._slots[i] for i in releases[0]]
    m.check_invariants()
    assert run_request(m, engine, tokens + [1], len(tokens), reuse_expected=0) == 0
