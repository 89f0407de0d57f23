"""What a connector asks of kvpool, in engine-agnostic terms (scope, tokens, layer groups,
slots), so that the same connector code runs over a manager of its own (`LocalStore`) or a
node daemon's shared one (`kvpool.node.client.NodeClient`). The store takes every kvpool
decision (what is reused, where pages live, what is evicted); the connector keeps the engine's
specifics (block ids, null blocks, windows, copies).

A handle is the store's request holding pages a worker reads (a load) or writes (a save):
`release` (or the handle's `close()`) lets them go; `commit_save` makes a save's tokens
reusable. Slots are per kvpool layer group, one per block, the rows the workers copy."""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvpool.config import ReuseScope
from kvpool.errors import KVPoolError
from kvpool.manager import KVCacheManager
from kvpool.node.lookups import Answer, AsyncLookups
from kvpool.tokens import Token

log = logging.getLogger("kvpool.node")


class Outcome(enum.Enum):
    WAITING = "waiting"  # a lookup's I/O runs: ask again later
    MISS = "miss"  # nothing to load (or the store is unreachable)
    FAILED = "failed"  # a read failed bringing the prefix up: a miss
    HAVE = "have"  # a save: the store holds every block already
    NO_ROOM = "no_room"  # a save: no room at the first level


@dataclasses.dataclass
class Hit:
    """A lookup that holds `tokens` tokens (whole blocks) at the first level until released:
    `slots[g][b]` the slot of block b in layer group g (-1: none, a window's block out of its
    window), `tiers[b]` where block b was before the lookup (host, disk or remote)."""

    handle: Any
    tokens: int
    slots: list[list[int]]
    tiers: list[str]


@dataclasses.dataclass
class SavePlan:
    """New pages for blocks [first_block, first_block + len(slots[g])) of a save, held until
    `commit_save` or `release`."""

    handle: Any
    first_block: int
    slots: list[list[int]]


class Store(Protocol):
    """The operations a connector's scheduler side needs (module docstring)."""

    generation: int  # changes when the shared memory does (a daemon restarted)

    def lookup(
        self, key: str, scope: ReuseScope | None, tokens: Sequence[Token], async_io: bool
    ) -> Hit | Outcome: ...

    def cancel(self, key: str) -> None: ...

    def idle(self, timeout_s: float, wake: Callable[[], bool] | None = None) -> None:
        """The engine has nothing to run until a waiting lookup is ready: return when one is,
        when `wake()` is true (the engine has new input), or after `timeout_s`."""
        ...

    def plan_save(
        self, scope: ReuseScope | None, tokens: Sequence[Token]
    ) -> SavePlan | Outcome: ...

    def commit_save(self, handle: Any, tokens: Sequence[Token], first_block: int) -> None: ...

    def release(self, handle: Any) -> None: ...

    def shared_memory(self) -> dict[str, str]: ...

    def memory(self) -> tuple[int, dict[str, str]]: ...

    def statistics(self) -> dict[str, Any]: ...

    def shutdown(self, persist: bool) -> None: ...


class LocalStore:
    """A store over a manager: the connector's own (in-process), or a node daemon's. Handles
    are the manager's `KVCache`s. `tier_group`: the layer group whose pages say where a block
    is (a full-attention group's; a window's pages are only its tail)."""

    generation = 0

    def __init__(self, manager: KVCacheManager, tier_group: int, lookup_limit: int = 256):
        self.manager = manager
        self.block_size = manager.config.tokens_per_block
        self.num_layer_groups = len(manager.layout.life_cycles)
        self.tier_group = tier_group
        self.lookups = AsyncLookups(manager, lookup_limit)
        # (with the first level alone nothing is ever read: a lookup needs no look-ahead)
        config = manager.config
        self.reads = config.remote_tier is not None or len(config.cache_tiers) > 1

    def lookup(
        self, key: str, scope: ReuseScope | None, tokens: Sequence[Token], async_io: bool
    ) -> Hit | Outcome:
        """Whole blocks of `tokens` the store holds, resumed to the first level (`Hit`), or
        why not. With `async_io`, a lookup needing disk or remote reads is `WAITING` while
        the look-ahead threads read (`node.lookups`)."""
        bs, manager = self.block_size, self.manager
        if not self.reads:  # (one match: what the tree holds is in the first level)
            cache = manager.create_kv_cache(scope, list(tokens))
        elif async_io:
            answer, lookahead = self.lookups.ask(key, scope, list(tokens))
            if answer is Answer.WAITING:
                return Outcome.WAITING
            if lookahead is None:  # (skipped: too many lookups wait already)
                return Outcome.MISS
            cache = manager.create_kv_cache(scope, lookahead.tokens, lookahead=lookahead)
        else:
            if manager.probe_reuse(scope, tokens) < bs:
                return Outcome.MISS
            cache = manager.create_kv_cache(scope, list(tokens))
        if cache.num_committed_tokens < bs:
            cache.close()
            return Outcome.MISS
        tiers = self._tiers_of(cache) if self.reads else []  # (one level: "host" below)
        try:
            resumed = cache.resume()
        except (KVPoolError, OSError) as error:  # a read failed: a miss, not an engine error
            log.warning("kvpool: cannot bring a prefix up for %s: %s", key, error)
            cache.close()
            return Outcome.FAILED
        served = cache.num_committed_tokens // bs * bs
        if not resumed or served == 0:
            cache.close()
            return Outcome.MISS
        blocks = served // bs
        tiers += ["remote" if self.reads else "host"] * (blocks - len(tiers))
        slots = [self._slots(cache, g, 0, blocks) for g in range(self.num_layer_groups)]
        return Hit(cache, served, slots, tiers[:blocks])

    def _slots(self, cache: Any, group: int, first: int, last: int) -> list[int]:
        found: list[int] = cache.get_base_page_indices(group)[first:last].tolist()
        return found

    def _tiers_of(self, cache: Any) -> list[str]:
        """Where each locally held block of a new request is now (before its resume): its
        page's level in `tier_group`; a block without a page there counts with the next
        block that has one."""
        held = (cache.num_committed_tokens - cache.pending_remote_tokens) // self.block_size
        tiers: list[str] = []
        following = "host"
        for page in reversed(cache.pages(self.tier_group)[:held]):
            if page is not None:
                following = "host" if page.level == 0 else "disk"
            tiers.append(following)
        tiers.reverse()
        return tiers

    def cancel(self, key: str) -> None:
        """The lookup's request went away: drop its look-ahead."""
        self.lookups.cancel(key)

    def idle(self, timeout_s: float, wake: Callable[[], bool] | None = None) -> None:
        self.lookups.wait_any(timeout_s, wake=wake)

    def plan_save(self, scope: ReuseScope | None, tokens: Sequence[Token]) -> SavePlan | Outcome:
        """A request for `tokens` (whole blocks) whose history is at their end, with new pages
        for the blocks the store lacks. The remote tier is not asked (no I/O in an engine's
        step): what only it holds is saved again."""
        manager = self.manager
        if manager.probe_reuse(scope, tokens, remote=False) >= len(tokens):
            return Outcome.HAVE
        cache = manager.create_kv_cache(scope, list(tokens), remote=False)
        try:
            room = cache.resume() and cache.resize(len(tokens), len(tokens))
        except (KVPoolError, OSError) as error:
            log.warning("kvpool: not saving: %s", error)
            room = False
        if not room:
            cache.close()
            return Outcome.NO_ROOM
        held = cache.num_committed_tokens  # (final after resume: a remote fetch may shorten it)
        first, last = held // self.block_size, len(tokens) // self.block_size
        if first >= last:
            cache.close()
            return Outcome.HAVE
        slots = [self._slots(cache, g, first, last) for g in range(self.num_layer_groups)]
        return SavePlan(cache, first, slots)

    def commit_save(self, handle: Any, tokens: Sequence[Token], first_block: int) -> None:
        """Commit a save's new `tokens` (its bytes are there), write them to the remote tier at
        once (write-through: other engines find them now), and close it."""
        try:
            handle.commit(list(tokens))
            self.manager.write_remote(handle, first_block)
        finally:
            handle.close()

    def release(self, handle: Any) -> None:
        handle.close()

    def shared_memory(self) -> dict[str, str]:
        """Each pool's file name -> the path another process maps."""
        return self.manager.shared_memory()

    def memory(self) -> tuple[int, dict[str, str]]:
        """The generation (always 0: the memory never changes) and `shared_memory()`."""
        return 0, self.manager.shared_memory()

    def statistics(self) -> dict[str, Any]:
        remote = self.manager.remote_statistics()
        return {
            "manager_hit_tokens_by_level": list(self.manager.stats().hit_tokens_by_level),
            "remote": None if remote is None else dataclasses.asdict(remote),
        }

    def shutdown(self, persist: bool) -> None:
        """Write what waits for the remote tier, move the cached pages down to a persistent
        disk level (`persist`), and free the manager."""
        self.lookups.cancel_all()
        try:
            self.manager.flush_remote_writes()
            if persist:  # (a restart finds the hot prefixes' heads too)
                self.manager.save_to_disk()
        finally:
            self.manager.shutdown()


__all__ = ["Hit", "LocalStore", "Outcome", "SavePlan", "Store"]
