"""Eviction policies: the plug-in point (KVCacheManagerConfig.eviction_policy), the classed
queue's exact eviction order, the hazard policy's learning and decisions against hand-worked
cases, and what it gains through a manager (with the KV bytes of every reuse checked)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from kvpool import ConfigError, GpuCacheTierConfig, KVCacheManager
from kvpool.errors import CorruptedError
from kvpool.eviction import ClassedQueue, EvictionQueue
from kvpool.policies import CLASSES, EvictionPolicy, HazardPolicy, LfuPolicy, make_policy, use_class
from kvpool.records import DEFAULT_PRIORITY, Block, Page
from tests.engine_check import CheckingEngine
from tests.helpers import MiB, make_config, record_layer, shutdown

TPB = 16
LAYERS = [record_layer(i, TPB, repeats=64) for i in range(2)]  # 64 KiB pages: 32 per 2 MiB
TRACES = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "traces")


def block(key: int, parent: Block | None = None, uses: int = 1, used_at: float = 0.0) -> Block:
    made = Block(key.to_bytes(32, "big"), parent, b"", TPB, [None])
    made.uses, made.used_at = uses, int(used_at)  # (the policy's clock counts blocks)
    if parent is not None:
        assert parent.kids is None
        parent.kids = made
    return made


def page_of(owner: Block, priority: int = DEFAULT_PRIORITY) -> Page:
    page = Page(None, 0, 0, 0)
    page.priority = priority
    page.block, owner[0] = owner, page
    return page


class ScriptedPolicy(EvictionPolicy):
    """Classes by use count; scores each block as given (uncertainty: `error`)."""

    def __init__(self, scores: dict[int, float], error: float = 0.0) -> None:
        self.scores = scores
        self.error = error

    def classify(self, page: Page) -> int:
        assert page.block is not None
        return use_class(page.block)

    def scorer(self):  # type: ignore[no-untyped-def]
        return lambda page: (self.scores[int.from_bytes(page.block.key, "big")], self.error)


def test_the_classed_queue_takes_the_oldest_leaf_of_the_class_the_policy_picks():
    a1 = block(1, uses=3, used_at=10.0)
    a2 = block(2, a1, uses=1, used_at=10.0)  # a1's child: a1 is not a leaf until a2 goes
    b = block(3, uses=2, used_at=5.0)
    c = block(4, uses=1, used_at=1.0)
    d = block(5, uses=1, used_at=7.0)
    low, high = block(6, used_at=50.0), block(7, used_at=0.0)
    queue = ClassedQueue(ScriptedPolicy({1: 0.05, 2: 0.9, 3: 0.2, 4: 0.5, 5: 0.1}), CLASSES)
    pages = {
        key: page_of(owner)
        for key, owner in zip(["a2", "a1", "b", "c", "d"], (a2, a1, b, c, d), strict=True)
    }
    engine_low, engine_high = page_of(low, priority=10), page_of(high, priority=90)
    # Released in the order of their last use (a chain leaf first).
    queue.push_all([pages["c"], engine_high, pages["b"], engine_low, pages["d"]])
    queue.push(pages["a2"])
    queue.push(pages["a1"])
    assert [page.klass for page in pages.values()] == [1, 3, 2, 1, 1]
    assert engine_low.klass == engine_high.klass == 0  # engine priorities are not classed
    # Heads: class 1 c (released first), class 2 b, class 3 none (a1 has a child). The policy
    # picks b (0.2 < 0.5), then c, then d (0.1; class 1's oldest is d, then a2), then a2,
    # whose going makes a1 a leaf (0.05); engine priorities around them.
    expected = [engine_low, pages["b"], pages["c"], pages["d"], pages["a2"], pages["a1"]]
    assert queue.oldest(7) == [*expected, engine_high]
    assert list(queue) == [*expected, engine_high] and len(queue) == 7  # peeking takes nothing
    queue.check_invariants()
    assert [queue.pop() for _ in range(7)] == [*expected, engine_high]
    assert len(queue) == 0 and not any(page.queued for page in pages.values())
    queue.check_invariants()


def test_a_parent_set_aside_comes_back_when_its_child_leaves_the_queue():
    parent = block(1, uses=3, used_at=1.0)
    child = block(2, parent, uses=1, used_at=1.0)
    other = block(3, uses=2, used_at=5.0)
    queue = ClassedQueue(ScriptedPolicy({1: 0.0, 2: 0.9, 3: 0.5}), CLASSES)
    child_page, parent_page, other_page = page_of(child), page_of(parent), page_of(other)
    queue.push_all([child_page, parent_page, other_page])
    assert queue.oldest(1) == [other_page]  # (the child scores 0.9, the parent is not a leaf)
    queue.remove_all([child_page])  # dropped (or moved to another level)
    child.parent, parent.kids = None, None
    assert queue.oldest(2) == [parent_page, other_page]  # a leaf now: 0.0
    queue.check_invariants()


def test_a_batch_of_victims_is_picked_as_if_taken_one_by_one():
    # The child goes first; its parent is a leaf from then on and, scoring lowest, goes
    # before the other class's head (not after everything else).
    parent = block(1, uses=3, used_at=1.0)
    child = block(2, parent, uses=1, used_at=1.0)
    other = block(3, uses=2, used_at=2.0)
    pages = [page_of(child), page_of(parent), page_of(other)]
    queue = ClassedQueue(ScriptedPolicy({1: 0.0, 2: 0.1, 3: 0.5}), CLASSES)
    queue.push_all(pages)
    assert queue.oldest(3) == pages
    queue.check_invariants()


@pytest.mark.parametrize(
    ("newer_score", "error", "first"),
    [(0.49, 0.0, "older"), (0.47, 0.0, "newer"), (0.47, 0.01, "older"), (0.43, 0.02, "newer")],
)
def test_a_head_must_score_a_margin_and_its_uncertainty_below_the_oldest_to_go_first(
    newer_score, error, first
):
    # Margin 0.02, plus each head's uncertainty: 0.5 - 0.47 > 0.02 but not > 0.04.
    older, newer = block(1, uses=1, used_at=1.0), block(2, uses=2, used_at=5.0)
    policy = ScriptedPolicy({1: 0.5, 2: newer_score}, error)
    policy.margin = 0.02
    queue = ClassedQueue(policy, CLASSES)
    pages = {"older": page_of(older), "newer": page_of(newer)}
    queue.push_all(list(pages.values()))
    assert queue.oldest(1) == [pages[first]]


def test_an_interrupt_while_picking_victims_leaves_the_queue_as_it_was():
    owners = [block(n, uses=1 + n % 3, used_at=float(n)) for n in range(1, 9)]
    pages = [page_of(owner) for owner in owners]
    scores = {n: 0.1 * n for n in range(1, 9)}
    policy = ScriptedPolicy(scores)
    queue = ClassedQueue(policy, CLASSES)
    queue.push_all(pages)
    expected = queue.oldest(8)
    calls = [0]

    def scorer():  # type: ignore[no-untyped-def]
        def score(page):  # type: ignore[no-untyped-def]
            calls[0] += 1
            if calls[0] == 6:
                raise KeyboardInterrupt
            return scores[int.from_bytes(page.block.key, "big")], 0.0

        return score

    policy.scorer = scorer  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        queue.oldest(8)
    assert calls[0] == 6  # (it stopped in the middle)
    policy.scorer = ScriptedPolicy.scorer.__get__(policy)  # type: ignore[method-assign]
    queue.check_invariants()
    assert len(queue) == 8 and queue.oldest(8) == expected


def test_pages_the_policy_does_not_class_keep_lru_order_in_a_batch():
    """Pages classed 0 (here: uses 0, as before the policy has learned) and pages with engine
    priorities go to the priority lists, in release order, whichever batch they came in."""
    chain = [block(10 + i, uses=0) for i in range(4)]
    classed = block(20, uses=1)
    urgent = page_of(block(30, uses=1), priority=DEFAULT_PRIORITY - 10)
    plain = [page_of(owner) for owner in chain]
    queue = ClassedQueue(ScriptedPolicy({20: 0.0}), CLASSES)
    queue.push_all([plain[0], urgent, plain[1], page_of(classed)])
    queue.push_all([plain[2], plain[3]])
    assert len(queue) == 6 and queue._num_classed() == 1
    queue.check_invariants()
    assert queue.oldest(5) == [urgent, *plain]  # (then the classed band, after default LRU)


def test_a_page_removed_and_queued_again_goes_last_and_a_misplaced_one_is_found():
    first, second = block(1, uses=2, used_at=1.0), block(2, uses=2, used_at=2.0)
    pages = [page_of(first), page_of(second)]
    queue = ClassedQueue(ScriptedPolicy({1: 0.0, 2: 0.0}), CLASSES)
    queue.push_all(pages)
    assert queue.oldest(2) == pages
    queue.remove(pages[0])  # locked by a request, then released again
    assert pages[0].klass == 0 and not pages[0].queued
    first.used_at = 3
    queue.push(pages[0])
    assert queue.oldest(2) == [pages[1], pages[0]] and len(queue) == 2
    queue.check_invariants()
    pages[0].klass = 1  # (in class list 2 in fact)
    with pytest.raises(CorruptedError, match="is in class list 2"):
        queue.check_invariants()


def test_a_page_that_left_the_classed_queue_is_never_taken_from_it_again():
    # A last-level page brought up a level: out of the classed queue, into a plain one; then
    # back, with an engine priority (not classed). Neither queue may lose track of it.
    owner = block(1, uses=2)
    page = page_of(owner)
    last_level, upper = ClassedQueue(ScriptedPolicy({1: 0.0}), CLASSES), EvictionQueue()
    last_level.push(page)
    assert page.klass == 2
    last_level.remove_all([page])
    upper.push(page)
    assert last_level.oldest(5) == [] and len(last_level) == 0
    assert upper.oldest(5) == [page]
    upper.remove(page)
    page.priority = 60
    last_level.push(page)
    assert page.klass == 0 and last_level.oldest(5) == [page]
    last_level.remove(page)
    assert len(last_level) == 0
    last_level.check_invariants()
    upper.check_invariants()


def learned_policy() -> HazardPolicy:
    """10 blocks of capacity and 10 bins: once 10 new blocks came in, one per block of traffic,
    bins of 80 ghosts / 10 = 8 blocks of traffic and a horizon of 10 (the policy's clock
    counts the blocks requests used or committed; the test sets it by hand). Then, counts by hand-fed candidates: 40 class-2 leaves all used again 26
    after their last use (bin 3); 40 class-1 leaves never, dropped and forgotten at 68 (bin 8)."""
    policy = HazardPolicy(10, bins=10)
    root = block(0)
    for n in range(1, 11):
        assert policy.width == 0
        policy.inserted([Block(n.to_bytes(32, "big"), root, b"", TPB, [None])])
        assert policy.now == n
    assert policy.width == 8 and policy.horizon == 10
    policy._until_fade = 10**9  # no fading while the test feeds counts
    for n in range(40):
        policy.now = 100
        twice = block(1000 + n, root, uses=2, used_at=100)
        root.kids = None
        policy.released(twice)
        policy.now = 125
        policy.used([twice])  # (a block of traffic: the clock reads 126)
        assert twice.uses == 3 and not twice.candidate and twice.used_at == 126
        policy.now = 100
        once = block(2000 + n, root, uses=1, used_at=100)
        root.kids = None
        policy.released(once)
        once.in_tree = False
        policy.dropped([once], [root])  # a ghost now
    for _ in range(40):
        policy.ghosts.forget(1)  # (forgotten: counted by hand below)
        policy._count(1, 68, reused=False)
    assert sum(policy.reuses[2]) == 40 and policy.reuses[2][3] == 40
    assert sum(policy.reuses[1]) == 0 and policy.ended[1][8] == 40
    return policy


def test_the_hazard_policy_evicts_the_block_least_likely_to_be_used_within_the_horizon():
    policy = learned_policy()
    policy.now = 500
    older_twice = page_of(block(1, uses=2, used_at=480))  # 20 ago: due at 26
    newer_once = page_of(block(2, uses=1, used_at=499))
    stale_twice = page_of(block(3, uses=2, used_at=460))
    for page in (older_twice, newer_once, stale_twice):
        page.klass = policy.classify(page)
    assert (older_twice.klass, newer_once.klass) == (2, 1)
    score = policy.scorer()
    # LRU would take the older block; the hazard keeps it: reused within 10 blocks of traffic
    # with probability 1, against 0 for a block used once.
    assert 1.0 <= score(older_twice)[0] < 1.05 and score(newer_once) == (0.0, 0.0)  # (+ tie-break)
    # Past every reuse seen (32 and more), a class-2 block is as unlikely as a class-1
    # one (the queue then takes the one used longest ago).
    assert score(stale_twice)[0] == 0.0
    # Through a classed queue: the stale one, then the newer block used once; the block
    # used twice, due soon, last.
    queue = ClassedQueue(policy, CLASSES)
    queue.push_all([stale_twice, older_twice, newer_once])
    assert queue.oldest(3) == [stale_twice, newer_once, older_twice]
    # A block used three times or more is in the last class.
    assert use_class(block(4, uses=7)) == CLASSES


def test_the_hazard_policy_classes_nothing_before_it_has_seen_a_capacity_of_blocks():
    policy = HazardPolicy(10)
    owner = block(1, block(0))
    policy.inserted([owner])
    assert policy.width == 0 and policy.classify(page_of(owner)) == 0
    policy.released(owner)
    assert not owner.candidate  # nothing is counted before the bins are known


def test_a_dropped_block_that_comes_back_counts_as_a_reuse_at_its_age_and_keeps_its_uses():
    policy = learned_policy()
    root = block(0)
    gone = block(7, root, uses=2, used_at=150)
    policy.now = 150
    policy.released(gone)
    assert gone.candidate
    gone.in_tree = False
    policy.now = 160
    policy.dropped([gone], [root])
    assert policy.ghost(gone.key) == (150, 2) and not gone.candidate
    before = policy.reuses[2][2]
    back = Block(gone.key, root, b"", TPB, [None])
    policy.now = 170
    policy.inserted([back])  # back after 20 blocks of traffic: bin 2
    assert policy.reuses[2][2] == before + 1 and policy.ghost(gone.key) is None
    assert back.uses == 3 and back.used_at == 170 and policy.now == 171
    # More ghosts than 8 per block of capacity: the oldest are forgotten, counted as ended.
    ended = sum(policy.ended[1])
    for key in range(3000, 3085):
        leaf = block(key, block(0), uses=1, used_at=165)
        policy.released(leaf)
        leaf.in_tree = False
        policy.dropped([leaf], [None])
    assert len(policy.ghosts) == 80 and sum(policy.ended[1]) == ended + 5
    assert policy.ghost((3004).to_bytes(32, "big")) is None  # the oldest went
    assert policy.ghosts.items()[0][0] == (3005).to_bytes(32, "big")


def shared_documents(seconds: int) -> list[tuple[float, list[int]]]:
    """Every second a one-off three-block prompt; every 3 s one of four three-block documents
    with a one-block question (each document every 12 s)."""
    turns = []
    for second in range(seconds):
        turns.append((float(second), list(range(second * 1000, second * 1000 + 3 * TPB))))
        if second % 3 == 0:
            start = 10**7 + second // 3 % 4 * 1000
            question = list(range(2 * 10**7 + second * 100, 2 * 10**7 + second * 100 + TPB))
            turns.append((second + 0.5, list(range(start, start + 3 * TPB)) + question))
    return turns


def serve(policy: str, turns: list[tuple[float, list[int]]]) -> tuple[int, KVCacheManager]:
    """Replay the turns through a 32-block manager with `policy`; the reused tokens of the
    second half (every reused KV record checked by the engine)."""
    now = [0.0]
    m = KVCacheManager(
        make_config(LAYERS, [GpuCacheTierConfig(2 * MiB)], TPB, eviction_policy=policy),
        clock=lambda: now[0],
    )
    engine = CheckingEngine(m)
    hits = 0
    for index, (arrival, tokens) in enumerate(turns):
        now[0] = arrival
        cache = m.create_kv_cache(None, tokens)
        reused = cache.num_committed_tokens
        if index >= len(turns) // 2:
            hits += reused
        assert cache.resume() and engine.step(cache, tokens, tokens[reused:])
        engine.check(cache, tokens)  # the reused records too
        cache.close()
    assert engine.records_checked > 0
    return hits, m


def test_through_a_manager_the_hazard_policy_keeps_what_comes_back():
    # 32 blocks; about 3.3 blocks come in per second, so LRU keeps a block about 9.6 s, and
    # each document comes back after 12 s: LRU never reuses one. (The policy's clock counts
    # blocks of traffic, not seconds: the same proportions.) The hazard policy learns that
    # blocks used once are not used again and blocks used twice are, 12 s later.
    turns = shared_documents(400)
    lru, m_lru = serve("lru", turns)
    hazard, m_hazard = serve("hazard", turns)
    policy = m_hazard._policy
    assert isinstance(policy, HazardPolicy) and policy.width > 0 and policy.ghosts
    assert sum(policy.reuses[CLASSES]) > 0
    documents_measured = sum(
        1 for index, turn in enumerate(turns) if index >= len(turns) // 2 and turn[0] % 1
    )
    assert lru == 0 and hazard >= 0.9 * documents_measured * 3 * TPB, (lru, hazard)
    for m in (m_lru, m_hazard):
        m.check_invariants()
        shutdown(m)


def test_lfu_drops_blocks_used_once_before_blocks_used_more():
    policy = LfuPolicy(10)
    once, twice = block(1, used_at=5), block(2, used_at=1)
    policy.inserted([once, twice])
    policy.used([twice])
    pages = [page_of(twice), page_of(once)]
    queue = ClassedQueue(policy, CLASSES)
    queue.push_all(pages)
    assert [page.klass for page in pages] == [3, 2]  # (uses 1 -> 2 -> 3 with the hand set)
    assert queue.oldest(2) == [pages[1], pages[0]]


def test_the_hazard_policy_learns_on_a_real_trace_through_the_manager():
    path = os.path.join(TRACES, "mooncake_conversation_trace.jsonl")
    if not os.path.isfile(path):
        pytest.skip("needs ../shared/traces")
    from kvpool import _debug
    from kvpool.replay.prefix import exact_block_config
    from kvpool.replay.workloads import load_mooncake

    was, _debug.DEBUG = _debug.DEBUG, False
    try:
        now = [0.0]
        config = dataclasses.replace(exact_block_config(500), eviction_policy="hazard")
        m = KVCacheManager(config, clock=lambda: now[0])
        for request in load_mooncake(path, limit=1500):
            now[0] = request.arrival
            prompt = request.tokens()
            cache = m.create_kv_cache(None, prompt)
            if cache.resume() and cache.resize(len(prompt)):
                cache.commit(prompt[cache.num_committed_tokens :])
            cache.close()
        policy = m._policy
        assert isinstance(policy, HazardPolicy) and policy.width > 0 and policy.ghosts
        assert all(sum(policy.started[klass]) > 0 for klass in range(1, CLASSES + 1))
        assert sum(map(sum, policy.reuses)) > 0
        queue = m._storage.state.queues[0][0]
        assert isinstance(queue, ClassedQueue) and queue._classed > 0
        m.check_invariants()
        m.clear_reusable_blocks()
        m.shutdown()
    finally:
        _debug.DEBUG = was
    lru = KVCacheManager(
        make_config(LAYERS, [GpuCacheTierConfig(2 * MiB)], TPB, eviction_policy="lru")
    )
    assert lru._policy is None and lru._context.policy is None
    assert not isinstance(lru._storage.state.queues[0][0], ClassedQueue)
    shutdown(lru)


def test_an_unknown_policy_is_refused_by_field():
    with pytest.raises(ConfigError, match=r"eviction_policy='mru' is invalid: must be one of"):
        KVCacheManager(make_config(eviction_policy="mru"))


class AgePolicy(ScriptedPolicy):
    """Scores a page by its class and its block's last use only (so pages used at the same
    time score the same); counts the scores it computed."""

    def __init__(self, by_age: bool) -> None:
        super().__init__({})
        self.scores_by_age = by_age
        self.margin = 0.05
        self.calls = 0

    def scorer(self):  # type: ignore[no-untyped-def]
        def score(page):  # type: ignore[no-untyped-def]
            self.calls += 1
            return (page.klass * 7 + page.block.used_at * 3) % 5 / 5, 0.01 * page.klass

        return score


def random_queue(
    seed: int, by_age: bool, groups: int = 1
) -> tuple[ClassedQueue, AgePolicy, list[Page]]:
    """Chains of blocks (some forking) with few distinct last uses, released deepest first,
    one layer group after the other (`groups` of them in the one queue; the second holds pages
    of a chain's last blocks only, as a sliding window's group does)."""
    import random

    rng = random.Random(seed)
    policy = AgePolicy(by_age)
    queue = ClassedQueue(policy, CLASSES)
    key = 0
    released: list[Page] = []
    for _ in range(rng.randint(1, 12)):
        key += 1
        parent = Block(key.to_bytes(32, "big"), None, b"", TPB, [None] * groups)
        parent.uses, parent.used_at = rng.randint(1, 4), rng.randint(0, 3)
        chain = [parent]
        for _ in range(rng.randint(0, 8)):
            key += 1
            child = Block(key.to_bytes(32, "big"), parent, b"", TPB, [None] * groups)
            child.uses, child.used_at = rng.randint(1, 4), rng.randint(0, 3)
            if parent.kids is None:
                parent.kids = child
            elif isinstance(parent.kids, dict):
                parent.kids[child.key] = child
            else:
                parent.kids = {parent.kids.key: parent.kids, child.key: child}
            chain.append(child)
            parent = chain[rng.randrange(len(chain))]  # (a fork now and then)
        pages = [page_of(owner) for owner in reversed(chain)]
        for group in range(1, groups):
            window = chain[rng.randrange(len(chain)) :]
            pages += [page_in(owner, group) for owner in reversed(window)]
        rng.shuffle(pages) if rng.random() < 0.3 else None
        released += pages
    for start in range(0, len(released), 4):
        queue.push_all(released[start : start + 4])
    return queue, policy, released


def page_in(owner: Block, group: int) -> Page:
    """A default-priority page of `owner` in layer group `group` (pool group 0)."""
    page = Page(None, 0, 0, group)
    page.block, owner.pages[group] = owner, page
    return page


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("seed", range(100))
def test_runs_of_pages_used_at_the_same_time_are_taken_as_if_one_by_one(seed, groups):
    # (Two layer groups in one queue: a run's shortcuts, the child's page being the one just
    # picked and the parent's the next one, hold only within one layer group.)
    runs, _, pages = random_queue(seed, by_age=True, groups=groups)
    single, _, _ = random_queue(seed, by_age=False, groups=groups)
    keys = lambda found: [  # noqa: E731
        (int.from_bytes(p.block.key, "big"), p.layer_group) for p in found
    ]
    count = len(pages)
    for _ in range(3):  # peeking changes nothing that matters: the same pages each time
        assert keys(runs.oldest(count)) == keys(single.oldest(count))
        runs.check_invariants()
        single.check_invariants()
    while len(single):  # and taking them off in batches of 3
        taken, expected = runs.oldest(3), single.oldest(3)
        assert keys(taken) == keys(expected)
        runs.remove_all(taken)
        single.remove_all(expected)
        runs.check_invariants()
    assert len(runs) == 0


def test_the_queue_scores_a_run_once():
    # Eight pages of one chain, all used at the same time: one score for the whole run.
    parent = block(1, uses=1, used_at=2.0)
    chain = [parent]
    for key in range(2, 9):
        chain.append(block(key, chain[-1], uses=1, used_at=2.0))
    for by_age, most in ((True, 2), (False, 8)):
        policy = AgePolicy(by_age)
        queue = ClassedQueue(policy, CLASSES)
        for owner in chain:
            owner[0] = None
        queue.push_all([page_of(owner) for owner in reversed(chain)])
        assert len(queue.oldest(8)) == 8
        assert policy.calls <= most and (by_age or policy.calls == 8), policy.calls


@pytest.mark.parametrize("policy", ["hazard", "lfu"])
def test_two_managers_on_clocks_apart_take_the_same_decisions(policy):
    """Issue 30's reproduction: the same calls to two managers whose clocks differ by up to
    2 ms. The learned policy once read the clock, and the managers dropped different blocks
    from request 562 on; its time is now the inflow of blocks."""
    import random

    now, jitter = [0.0], random.Random(1)
    config = make_config(
        [record_layer(0, 8, repeats=1024)], [GpuCacheTierConfig(2 * MiB)], 8, eviction_policy=policy
    )
    managers = [
        KVCacheManager(config, clock=lambda: now[0]),
        KVCacheManager(config, clock=lambda: now[0] + jitter.random() * 0.002),
    ]
    for m in managers:
        m.record_decisions(True)
    rng = random.Random(0)
    documents = [
        [rng.randrange(1000) for _ in range(rng.choice([16, 24, 40, 64]))] for _ in range(60)
    ]
    weights = [1 / (i + 1) for i in range(60)]
    drops = 0
    for _ in range(1200):
        now[0] += rng.expovariate(50.0)
        prompt = rng.choices(documents, weights)[0]
        prompt = prompt + [rng.randrange(1000) for _ in range(rng.randrange(1, 20))]
        logs = []
        for m in managers:
            cache = m.create_kv_cache(None, prompt)
            if cache.resume() and cache.resize(len(prompt)):
                cache.commit(prompt[cache.num_committed_tokens :])
            cache.close()
            logs.append(m.take_decisions())
        assert logs[0] == logs[1]
        drops += sum(1 for decision in logs[0] if decision[0] == "drop")
    learned = managers[0]._policy
    assert isinstance(learned, HazardPolicy) and learned.width > 0 and drops > 100
    assert managers[0]._storage.state.queues[0][0]._classed > 0
    for m in managers:
        shutdown(m)


def test_a_drop_starts_each_new_candidate_once_in_its_age_bin_and_censors_forgotten_ghosts():
    """`dropped`, count by count (bins of 8 blocks of traffic, 10 bins, 80 ghosts): a block that
    became a leaf only as its children went starts as a candidate at its age; one already a
    candidate does not start again; the class is the use count up to 3; an age past the bins
    counts in the last; a ghost forgotten past the limit ends (censored) at its age."""
    policy = learned_policy()
    started = [row[:] for row in policy.started]
    policy.now = 125
    newly = [block(5000 + n, uses=2, used_at=100) for n in range(2)]  # age 25: bin 3
    for owner in newly:
        owner.in_tree = False
    already = block(5002, uses=1, used_at=100)
    already.candidate, already.in_tree = True, False  # (counted when it was released)
    often = block(5003, uses=7, used_at=120)  # class 3, age 5: bin 0
    often.in_tree = False
    old = block(5004, uses=1, used_at=0)  # age 125: past the last bin (9)
    old.in_tree = False
    policy.dropped([*newly, already, often, old], [None] * 5)
    expected = [row[:] for row in started]
    expected[2][3] += 2
    expected[3][0] += 1
    expected[1][9] += 1
    assert policy.started == expected
    assert all(not owner.candidate for owner in (*newly, already, often, old))
    assert policy.ghost(newly[0].key) == (100, 2) and policy.ghost(often.key) == (120, 7)
    # Ghosts up to the limit are kept; each one past it forgets the oldest, ended at its age.
    while len(policy.ghosts) < policy.ghost_limit:
        filler = block(6000 + len(policy.ghosts), uses=1, used_at=124)
        filler.candidate, filler.in_tree = True, False
        policy.dropped([filler], [None])
    ended = [row[:] for row in policy.ended]
    oldest_key = policy.ghosts.items()[0][0]
    oldest_used_at, oldest_uses = policy.ghost(oldest_key)
    extra = block(7000, uses=1, used_at=125)
    extra.candidate, extra.in_tree = True, False
    policy.dropped([extra], [None])
    assert policy.ghost(oldest_key) is None and len(policy.ghosts) == policy.ghost_limit
    age_bin = min((125 - oldest_used_at) // 8, 9)
    ended[min(oldest_uses, CLASSES)][age_bin] += 1
    assert policy.ended == ended


def test_hazard_scores_match_the_hand_worked_definition():
    """The learned policy's class-2 blocks are all used again at age 26 (bin 3): the hazard is
    0 in bins 0-2 and 1 (less 1e-9) in bin 3. With a horizon of 1.25 bins and a discount of
    e^(-0.25 / 1.25) per quarter bin, worked by hand: a block just used scores only the
    tie-break, 0.05 x d^12 x later(bin 3); one used 20 ago is reused within the horizon for
    sure, plus 0.05 x d^2 x later(bin 3); past the table (80 blocks of traffic, 4 x 10 quarter
    bins), nothing."""
    import math

    policy = learned_policy()
    policy.now = 500
    score = policy.scorer()

    def of(age):
        page = page_of(block(1, uses=2, used_at=500 - age))
        page.klass = policy.classify(page)
        return score(page)

    d, chance = math.exp(-0.2), 1 - (1e-9) ** 0.25  # per quarter bin: discount, reuse
    later = chance  # the discounted expected reuse from bin 3's quarters, last one first
    for _ in range(3):
        later = chance + (1 - chance) * d * later
    just_used, recent = of(0), of(20)
    assert just_used[0] == pytest.approx(0.05 * d**12 * later, rel=1e-9) and just_used[1] == 0.0
    assert recent[0] == pytest.approx(1 - 1e-9 + 0.05 * d**2 * later, rel=1e-9)
    assert recent[1] == pytest.approx(math.sqrt((1 - 1e-9) * 1e-9 / 40), rel=1e-3)
    assert of(79) == (0.0, 0.0) and of(80) == (0.0, 0.0) and of(500) == (0.0, 0.0)


def test_a_policy_for_a_huge_cache_takes_little_memory_until_it_drops_blocks():
    """The ghost table is made with room for at most 2**20 ghosts, and its pages are taken from
    the system only as they fill: a cache of 50 million blocks (big host and disk levels) costs
    no memory up front (made at its full size, 400 million ghosts, the native table would ask
    for 56 GiB: a MemoryError on a machine with less)."""

    def rss_mib() -> float:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    before = rss_mib()
    policy = make_policy("hazard", 50_000_000)
    assert rss_mib() - before < 16
    assert isinstance(policy, HazardPolicy) and policy.ghost_limit == 400_000_000
    # The first drop makes the room asked for: at most 2**20 ghosts (112 MiB of arrays, their
    # pages taken as they fill), not the 56 GiB of 400 million.
    import tracemalloc

    tracemalloc.start()
    try:
        policy.ghosts.put(bytes(32), 1)
        asked = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert asked < 200 << 20
