"""Eviction policies: which cached blocks the manager drops first.

The mechanism is fixed (`eviction.py`): per (level, pool group) an eviction queue, lowest
priority first, then least recently released; the engine's `priority_callback` sets a block's
priority when it is committed. At the last level, where eviction loses KV for good, a policy
(`KVCacheManagerConfig.eviction_policy`) may sort the default-priority pages into classes (one
list per class, each in release order) and choose, at each eviction, which list's oldest page
goes. Engine priorities still come first: only default-priority pages are classed.

What a policy sees (each hook O(1) per block it is given):
- `used(blocks)`: a new request matched these cached blocks;
- `inserted(blocks)`: a request committed these blocks (new, or already in the tree);
- `released(block)`: a request closed; `block` is the deepest block it committed or used;
- `dropped(blocks, parents)`: these blocks' last-level pages were dropped (`parents`: their
  parents before that, which may have become leaves).
Time, for a policy, is logical: the number of blocks requests have used (matched) or committed
so far, the cache's block traffic. A block's age is the traffic since its last use, so a
policy's picks are a function of the calls the manager was given, never of a process's clock:
replicated managers on several ranks, and a replay run twice, pick the same victims. (Traffic
stands in for time as well as the trace's own clock does: on the Mooncake traces the hazard
policy's hit rates are the same or higher with it; the new blocks alone, a tempting unit, lose
up to 8% at small caches of the synthetic trace.)

What it decides:
- `classify(page)`: the class of a page queued at the last level (0: the one LRU list);
  `classify_all(pages)` the same for a batch (one call per released request);
- `scorer()`: a function scoring pages for the next evictions, (score, uncertainty): of the
  class lists' oldest leaves, the lowest score goes first (ties: the one used longest ago),
  but LRU's choice stays unless beaten by more than `margin` and both uncertainties. A
  policy whose scores depend only on a page's class and its block's last use says so
  (`scores_by_age`): the queue then scores a run of pages used at the same time once.

Policies:
- `lru`: no classes; the queue's own order.
- `hazard` (the default): learns online, per use-count class (used once, twice, three times or
  more), the probability that a block unused for a given age is used again within a horizon
  (the traffic that brings a capacity of new blocks: about how long LRU keeps a block), and
  evicts, of the class lists' oldest leaves, the one least likely to be; it leaves LRU's
  choice (the head used longest ago) only for a head scoring lower by more than `margin` plus
  one standard error of each score. Both signals matter on real traces: a block used twice is
  about twice as likely to come back as a block used once, and on conversations the next turn
  comes back a little after LRU has dropped it. The estimate is a discrete hazard over
  eviction candidates (cached leaves, and dropped ones remembered as ghosts: 8 per block of
  capacity): at each candidate's end (reused, or censored: extended, or forgotten as a ghost)
  one count in its age bin; the counts fade by 0.7 per capacity (at least 16,384) of inserted
  blocks. Until it has seen a capacity of inserted blocks it classes nothing (LRU). Cost: one
  ghost-table lookup per new block, a few attribute updates per block used, O(classes) per
  eviction, and a score table of 4 x 48 entries per class rebuilt every eighth of a capacity
  of insertions; memory: the ghost table (`kvpool.ghosts`, native form) is a ring of twice the
  ghosts' number of 40-byte places (a copy of the key, the int) and an index of four times as
  many 8-byte slots: 112 bytes a ghost, so about 0.9 KB of host memory per block of capacity
  once full; room for up to 2**20 ghosts is made at the first drop, its pages taken from the
  system as they fill (benchmarks/soak_rss.py: the resident set flat once the table of a
  131,072-block capacity is full).
- `lfu`: the same use counts, strictly: the lowest class first, LRU within a class (the
  runner-up: ahead of LRU at small caches, far behind at large ones).

See `benchmarks/eviction_study.py` and the README for what they reach on the Mooncake traces.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Final

from mypy_extensions import mypyc_attr

from kvpool.config import EVICTION_POLICIES
from kvpool.errors import ConfigError
from kvpool.ghosts import GhostTable
from kvpool.records import Block, Page

CLASSES: Final = 3  # use counts 1, 2 and 3 or more
MEMORY_BLOCKS: Final = 16384  # the least number of inserted blocks the counts fade over
CONFIDENCE: Final = 1.0  # standard errors a head's score must be below LRU's choice's, each
TIE_BREAK: Final = 0.05  # the weight of the discounted expected reuse in a hazard score
GHOST_SHIFT: Final = 20  # a ghost is one int: its last use << GHOST_SHIFT | its uses (capped)
GHOST_USES: Final = (1 << GHOST_SHIFT) - 1  # (only min(uses, CLASSES) decides anything)
PRESIZED_GHOSTS: Final = 1 << 20  # the ghosts the table has room for when it is made


def _add_one(counts: list[float], index: int) -> None:
    """`counts[index] += 1.0`, in machine floats when compiled (mypyc makes `+=` on a list item
    a generic call that boxes the 1.0)."""
    counts[index] = counts[index] + 1.0


def use_class(block: Block) -> int:
    """A block's class: how many requests used it while it was remembered, up to CLASSES (0:
    never counted, e.g. a block from the remote tier: LRU)."""
    return min(block.uses, CLASSES)


@mypyc_attr(allow_interpreted_subclasses=True)  # (tests script policies in Python)
class EvictionPolicy:
    """LRU: the eviction queue's own order (every hook a no-op)."""

    name = "lru"
    margin = 0.0  # a head scoring at most this much below the oldest head does not go first
    # Whether a page's score depends only on its class and its block's last use (then pages
    # of a class used at the same time score the same, and the queue takes them in runs).
    scores_by_age = False

    def used(self, blocks: list[Block]) -> None:
        pass

    def inserted(self, blocks: list[Block]) -> None:
        pass

    def released(self, block: Block) -> None:
        pass

    def dropped(self, blocks: list[Block], parents: list[Block | None]) -> None:
        pass

    def classify(self, page: Page) -> int:
        return 0

    def classify_all(self, pages: Sequence[Page]) -> list[int]:
        """`classify` each page (a policy may do it faster in one go)."""
        return [self.classify(page) for page in pages]

    def scorer(self) -> Callable[[Page], tuple[float, float]]:
        """How likely a classed page is to be wanted (for the next evictions), and how
        uncertain that is (a half-width): the lowest score goes first, ties to the one used
        longest ago; LRU's choice stays unless another head scores lower by more than the
        margin and both uncertainties."""
        return lambda page: (0.0, 0.0)


class HazardPolicy(EvictionPolicy):
    """Reuse hazard by use count and age (module docstring)."""

    name = "hazard"
    scores_by_age = True
    # Leave LRU's choice only for a head at least 2 points of probability less likely to be
    # used within the horizon: smaller differences are mostly noise in the estimate (without
    # this margin the conversation trace at 32,000 blocks ends 0.1% below LRU).
    margin = 0.02

    def __init__(
        self,
        capacity_blocks: int,
        horizon_factor: float = 1.0,
        bins: int = 48,
        ghosts_per_block: int = 8,
        fade: float = 0.7,
    ) -> None:
        self.capacity = capacity_blocks
        self.horizon_factor = horizon_factor
        self.bins = bins
        self.ghost_limit = ghosts_per_block * capacity_blocks
        # Counts fade by `fade` per capacity's worth of inserted blocks (at least MEMORY_BLOCKS:
        # fewer hold too few reuses per bin), in eight steps.
        self.fade = fade ** (1 / 8)
        self.fade_blocks = max(capacity_blocks, MEMORY_BLOCKS) // 8
        self.refresh_blocks = max(1, capacity_blocks // 8)  # between score table rebuilds
        # Per class (index 0 unused) and age bin: candidates that started, ended, were reused.
        self.started = [[0.0] * bins for _ in range(CLASSES + 1)]
        self.ended = [[0.0] * bins for _ in range(CLASSES + 1)]
        self.reuses = [[0.0] * bins for _ in range(CLASSES + 1)]
        # block key -> (last use, uses) packed in one int, oldest first (`kvpool.ghosts`; the
        # key itself, not its salted hash(), so no process's hash seed can matter), made at its
        # full size, up to PRESIZED_GHOSTS, at the first drop (no growing in the engine's loop;
        # a larger one, for a cache with big host or disk levels, grows as it fills)
        self.ghosts = GhostTable(min(self.ghost_limit, PRESIZED_GHOSTS))
        self.now = 0  # the clock: blocks requests used or committed so far
        self.first_insert: int | None = None
        self.inserts = 0  # new blocks so far
        self.width = 0.0  # block traffic per age bin, once a capacity of new blocks came in
        self.horizon = 0.0
        self._until_fade = self.fade_blocks
        self._until_refresh = self.refresh_blocks
        self._scores: list[list[float]] | None = None
        self._errors: list[list[float]] = []

    # -- hooks -----------------------------------------------------------------------------------

    def used(self, blocks: list[Block]) -> None:
        self.now = now = self.now + len(blocks)
        for block in blocks:
            if block.candidate:
                self._end(block, now, reused=True)
            block.uses += 1
            block.used_at = now

    def inserted(self, blocks: list[Block]) -> None:
        """Stamps the blocks with the current time, then advances it by their number."""
        if not blocks:
            return
        now = self.now
        if self.first_insert is None:
            self.first_insert = now
        parent = blocks[0].parent
        if parent is not None and parent.candidate:  # a leaf no more
            self._end(parent, now, reused=False)
        # The new blocks' ghosts, in one call (their lookups' cache misses overlap).
        found = self.ghosts.take_many(
            [block.key for block in blocks if not block.candidate and not block.uses]
        )
        new = 0
        for block in blocks:
            if block.candidate:
                self._end(block, now, reused=True)
            elif not block.uses:  # new in the tree
                ghost = found[new]
                new += 1
                if ghost >= 0:  # back after it was dropped
                    used_at, uses = ghost >> GHOST_SHIFT, ghost & GHOST_USES
                    self._count(min(uses, CLASSES), now - used_at, reused=True)
                    block.uses = uses
            block.uses += 1
            block.used_at = now
        self.inserts += new
        self.now = now + len(blocks)
        if not self.width:
            self._learn_rate()
        self._until_refresh -= new
        if self._until_refresh <= 0:
            self._until_refresh = self.refresh_blocks
            self._scores = None
        self._until_fade -= new
        if self._until_fade <= 0:
            self._fade()

    def released(self, block: Block) -> None:
        if self.width and block.in_tree and block.kids is None and not block.candidate:
            self._start(block, self.now)

    def dropped(self, blocks: list[Block], parents: list[Block | None]) -> None:
        if not self.width:
            return
        now, ghosts, started, width = self.now, self.ghosts, self.started, self.width
        last_bin = self.bins - 1
        keys: list[bytes] = []  # (put in one call: their lookups' cache misses overlap)
        values: list[int] = []
        for block in blocks:
            if not block.in_tree:  # a candidate from now on, as a ghost
                uses, used_at = block.uses, block.used_at
                if not block.candidate:  # (a leaf only since its children went with it): start
                    age_bin = int((now - used_at) / width)
                    _add_one(
                        started[uses if uses < CLASSES else CLASSES],
                        age_bin if age_bin < last_bin else last_bin,
                    )
                block.candidate = False  # (the ghost carries it)
                keys.append(block.key)
                values.append(used_at << GHOST_SHIFT | min(uses, GHOST_USES))
        ghosts.put_many(keys, values)
        excess = len(ghosts) - self.ghost_limit
        if excess > 0:  # forget the oldest: censored
            ended = self.ended
            for ghost in ghosts.forget(excess):
                used_at, uses = ghost >> GHOST_SHIFT, ghost & GHOST_USES
                age_bin = int((now - used_at) / width)
                _add_one(
                    ended[uses if uses < CLASSES else CLASSES],
                    age_bin if age_bin < last_bin else last_bin,
                )
        for parent in parents:
            if (
                parent is not None
                and not parent.candidate
                and parent.kids is None
                and parent.in_tree
                and parent.parent is not None  # (not a scope's root)
            ):
                self._start(parent, now)

    def ghost(self, key: bytes) -> tuple[int, int] | None:
        """The remembered (last use, uses) of a dropped block, or None."""
        value = self.ghosts.get(key)
        return None if value < 0 else (value >> GHOST_SHIFT, value & GHOST_USES)

    def classify(self, page: Page) -> int:
        if not self.width:
            return 0
        block = page.block
        assert block is not None  # (queued pages are committed)
        return use_class(block)

    def classify_all(self, pages: Sequence[Page]) -> list[int]:
        if not self.width:
            return [0] * len(pages)
        classes = []
        for page in pages:
            block = page.block
            assert block is not None  # (queued pages are committed)
            uses = block.uses
            classes.append(uses if uses < CLASSES else CLASSES)
        return classes

    def scorer(self) -> Callable[[Page], tuple[float, float]]:
        if not self.width:  # (nothing was classed)
            return super().scorer()
        scores, now, per_bin = self._score_table(), self.now, 4 / self.width
        size = 4 * self.bins
        errors = self._errors

        def score(page: Page) -> tuple[float, float]:
            block = page.block
            assert block is not None  # (queued pages are committed)
            position = int((now - block.used_at) * per_bin)
            if position >= size:
                return 0.0, 0.0
            return scores[page.klass][position], errors[page.klass][position]

        return score

    # -- the hazard ------------------------------------------------------------------------------

    def _bin(self, age: int) -> int:
        return min(int(age / self.width), self.bins - 1)

    def _start(self, block: Block, now: int) -> None:
        _add_one(self.started[use_class(block)], self._bin(now - block.used_at))
        block.candidate = True

    def _end(self, block: Block, now: int, reused: bool) -> None:
        self._count(use_class(block), now - block.used_at, reused)
        block.candidate = False

    def _count(self, klass: int, age: int, reused: bool) -> None:
        if self.width:
            b = self._bin(age)
            _add_one(self.ended[klass], b)
            if reused:
                _add_one(self.reuses[klass], b)

    def _learn_rate(self) -> None:
        """Once a capacity of new blocks has come in: the rate of new blocks per block of
        traffic, and from it the age bins (spanning the ghosts' memory: a ghost is forgotten
        after about `ghost_limit` new blocks) and the horizon (a capacity of new blocks)."""
        assert self.first_insert is not None
        if self.inserts >= self.capacity and self.now > self.first_insert:
            rate = self.inserts / (self.now - self.first_insert)  # new blocks per block used
            self.width = self.ghost_limit / rate / self.bins
            self.horizon = self.horizon_factor * self.capacity / rate

    def _fade(self) -> None:
        self._until_fade = self.fade_blocks
        fade = self.fade
        for table in (self.started, self.ended, self.reuses):
            for row in table:
                row[:] = [count * fade for count in row]

    def _score_table(self) -> list[list[float]]:
        """Per class, per quarter of an age bin: P(used again within the horizon | unused
        that long), from the discrete hazard per bin (reuses / candidates at risk); ties (most
        often: no reuse within the horizon either way) go to the block with the larger
        expected reuse discounted by e^(-wait / horizon), a later use counting less."""
        if self._scores is None:
            span = self.horizon / self.width  # in bins
            discount = math.exp(-0.25 / span)  # per quarter bin
            self._scores, self._errors = [[]], [[]]
            for klass in range(1, CLASSES + 1):
                at_risk, hazards, risks = 0.0, [], []
                for started, ended, reuses in zip(
                    self.started[klass], self.ended[klass], self.reuses[klass], strict=True
                ):
                    at_risk += started
                    hazards.append(min(reuses / at_risk, 1 - 1e-9) if at_risk > 0 else 0.0)
                    risks.append(at_risk)
                    at_risk -= ended
                log_survival = [0.0]
                for hazard in hazards:
                    log_survival.append(log_survival[-1] + math.log1p(-hazard))
                # (Each value below is computed once per distinct input: a bin's four quarters
                # share its hazard, and mostly their horizon's last bin.)
                chances = [1 - (1 - hazard) ** 0.25 for hazard in hazards]  # per quarter bin
                later = [0.0] * (4 * self.bins + 1)  # the discounted expected reuse
                for quarter in range(4 * self.bins - 1, -1, -1):
                    chance = chances[quarter // 4]
                    later[quarter] = chance + (1 - chance) * discount * later[quarter + 1]
                table, errors = [], []
                within = error = 0.0
                was_first = was_last = -1
                for quarter in range(4 * self.bins):
                    first = quarter // 4
                    last = min(int(quarter / 4 + span), self.bins - 1)
                    if first != was_first or last != was_last:
                        was_first, was_last = first, last
                        within = 1 - math.exp(log_survival[last + 1] - log_survival[first])
                        # (a binomial standard error, from the candidates at risk at that age)
                        error = CONFIDENCE * math.sqrt(
                            within * (1 - within) / max(risks[first], 1.0)
                        )
                    table.append(within + TIE_BREAK * later[quarter])
                    errors.append(error)
                self._scores.append(table)
                self._errors.append(errors)
        return self._scores


class LfuPolicy(HazardPolicy):
    """The hazard policy's use counts (ghosts included), strictly: the least used first, LRU
    among equals."""

    name = "lfu"

    def classify(self, page: Page) -> int:
        return use_class(page.block) if page.block is not None else 0

    def classify_all(self, pages: Sequence[Page]) -> list[int]:
        return [self.classify(page) for page in pages]

    def scorer(self) -> Callable[[Page], tuple[float, float]]:
        return lambda page: (page.klass, 0.0)


def make_policy(name: str, capacity_blocks: int) -> EvictionPolicy:
    """The policy `name` for a cache of `capacity_blocks` blocks (every level together)."""
    if name == "lru":
        return EvictionPolicy()
    if name == "hazard":
        return HazardPolicy(capacity_blocks)
    if name == "lfu":
        return LfuPolicy(capacity_blocks)
    raise ConfigError(
        f"eviction_policy={name!r} is invalid: must be one of {list(EVICTION_POLICIES)}"
    )


__all__ = [
    "CLASSES",
    "EVICTION_POLICIES",
    "EvictionPolicy",
    "HazardPolicy",
    "LfuPolicy",
    "make_policy",
    "use_class",
]
