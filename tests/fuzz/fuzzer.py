"""A model-based fuzzer for the manager: seeded random sequences of every public operation,
checked against a simple reference model after every step.

Each operation is a small JSON-able list (`["step", 3, 17]`: request #3 computes and commits 17
more tokens), so a failing sequence can be saved, replayed and shrunk to a few operations.
Requests are named by the order of their `create` operations; an operation on a request that
does not exist (after shrinking) is skipped.

After every operation:
- `check_invariants()` (slots, owners, queues, tree links);
- every live request's bytes are verified wherever its pages are (GPU, host or disk) with the
  data-verifying engine: each token's record names its value and position;
- an ACTIVE request has a page for every block it needs (windows and SSM included);
- a reused prefix was committed before, in the same reuse scope (the model keeps a chained hash
  of every committed prefix per scope): no cross-scope reuse;
- an operation that reports failure (False, `OutOfPagesError`, `LogicError`, an argument error)
  changed nothing; one that raised `StorageError` (an injected I/O fault) left every request's
  state, pages and bytes as they were.

The `remote` layout puts a shared tier (a valkey-server the run starts) below the levels, and
its `tamper` operation swaps two stored values, copies one over another key or damages one, as
a bug elsewhere or a hand on the server would: whatever a request then reads must still be its
own KV (a tampered value is a miss), checked record by record.

Twins (`--twins`): the same operations drive two managers, one on a clock that counts the
operations and one on the process's own `time.monotonic` (shifted by a day), and their decision
logs (`record_decisions`: prefix hits, drops and moves by slot id, re-splits) must be equal
after every operation: every decision is a function of the calls, never of a clock. (Injected
faults are left out there: which of a batch's parallel copies meets a fault is thread timing.)

Backends (`--backends`): the same operations drive a manager on this process's backend
(`kvpool.backend()`) and one on the other backend, in a child process (`KVPOOL_BACKEND`), and
their decision logs must be equal after every operation: the native backend decides exactly as
the python one, its reference. (No injected faults, as for the twins.)

Run a long fuzz:   python -m tests.fuzz.fuzzer --ops 100000 [--layout NAME] [--seed N]
                   [--twins | --backends]
Replay a failure:  python -m tests.fuzz.fuzzer --replay failure.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import kvpool
from kvpool import (
    AttentionLayerConfig,
    BufferConfig,
    ConfigError,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    KVCacheStatus,
    LogicError,
    OutOfPagesError,
    RemoteCacheTierConfig,
    ReuseScope,
    SsmLayerConfig,
    StorageError,
)
from kvpool.events import cached_blocks
from kvpool.events.log import KVEventLog
from kvpool.events.naming import MEDIA, MEDIUM_EXTERNAL
from kvpool.lifecycles import SsmLifeCycle
from kvpool.remote.values import KEY_PREFIX
from kvpool.tiers import allocation
from tests.engine_check import CheckingEngine
from tests.faults import DiskFaults, state_of
from tests.valkey_servers import ValkeyServer, server_binary

MiB = 1 << 20
TPB = 4
# Every operation is followed by the whole check (`Run.verify`: invariants, the KV events, every
# open request's bytes) unless this says every how many (a long sanitizer run, where the checks
# cost most of the time and the native code is what is under test). Both backends of a
# differential run read it (the other one's process inherits it).
VERIFY_EVERY = int(os.environ.get("KVPOOL_FUZZ_VERIFY_EVERY", "1"))
SCOPES = [None, ReuseScope(lora_id=1), ReuseScope(salt="tenant-b")]
Op = list[Any]


# -- layouts -----------------------------------------------------------------------------------


def _kv(layer_id: int, window: int | None = None, sinks: int | None = None) -> AttentionLayerConfig:
    size = 16 * 256 * TPB  # 256 repeats of the 16-byte record per token: 16 KiB per block
    buffers = [BufferConfig("k", size), BufferConfig("v", size)]
    return AttentionLayerConfig(layer_id, buffers, window, sinks)


def _tiers(directory: str, gpu: int, host: int = 0, disk: int = 0) -> list[Any]:
    tiers: list[Any] = [GpuCacheTierConfig(gpu * MiB)]
    if host:
        tiers.append(HostCacheTierConfig(host * MiB))
    if disk:
        tiers.append(DiskCacheTierConfig(disk * MiB, directory))
    return tiers


def _config(layers: list[Any], tiers: list[Any], **overrides: Any) -> KVCacheManagerConfig:
    settings: dict[str, Any] = {
        "rebalance_min_sampled_kv_caches": 4,
        "rebalance_cooldown_secs": 0.0,
        "rebalance_target_ratio_update_interval": 2,
    }
    settings.update(overrides)
    return KVCacheManagerConfig(TPB, tiers, layers, **settings)


# Full-attention slots are 64 KiB (2 layers x K, V x 16 KiB): 32 per 2 MiB.
LAYOUTS: dict[str, Callable[[str], KVCacheManagerConfig]] = {
    "gpu": lambda d: _config([_kv(0), _kv(1)], _tiers(d, gpu=2)),
    "gpu-host": lambda d: _config([_kv(0), _kv(1)], _tiers(d, gpu=2, host=2)),
    "gpu-host-disk": lambda d: _config([_kv(0), _kv(1)], _tiers(d, gpu=2, host=2, disk=4)),
    # Every level small: suspended requests' held pages fill all of them, so resumes must swap
    # pages between levels and allocations fail for want of droppable pages.
    "tight": lambda d: _config([_kv(0), _kv(1)], _tiers(d, gpu=2, host=2, disk=2)),
    # The default (hazard) eviction policy everywhere else; plain LRU here.
    "lru-policy": lambda d: _config(
        [_kv(0), _kv(1)], _tiers(d, gpu=2, host=2, disk=4), eviction_policy="lru"
    ),
    "no-partial-reuse": lambda d: _config(
        [_kv(0), _kv(1)], _tiers(d, gpu=2, host=2), enable_partial_reuse=False
    ),
    # Eviction in batches of 1 + 4 pages per 32-slot level (see `LAYOUT_SETTINGS`), where the
    # other layouts' levels are too small for a spare page (0.1%).
    "eviction-batches": lambda d: _config([_kv(0), _kv(1)], _tiers(d, gpu=2, host=2, disk=4)),
    # A window of 8 tokens with 4 sink tokens, full attention and an SSM layer: three life
    # cycles in two pool groups (the attention layers share a slot layout).
    "hybrid": lambda d: _config(
        [
            _kv(0, window=8, sinks=4),
            _kv(1),
            SsmLayerConfig(2, [BufferConfig("state", 64 * 1024)]),
        ],
        _tiers(d, gpu=4, host=4, disk=8),
    ),
    # A shared tier below a GPU and a host level (a server the run starts), values tampered
    # with now and then (the `tamper` operation).
    "remote": lambda d: _config([_kv(0), _kv(1)], _tiers(d, gpu=2, host=2)),
}
REMOTE_LAYOUTS = {"remote"}

# Module attributes a layout sets for its run: (module, name, value).
LAYOUT_SETTINGS: dict[str, list[tuple[Any, str, Any]]] = {
    "eviction-batches": [(allocation, "EVICTION_SPARE_SHIFT", 3)],
}


# -- the reference model -----------------------------------------------------------------------


@dataclass
class Request:
    tokens: list[Any]
    scope: int
    cache: Any
    chain: list[int]  # hash of each prefix of `tokens` in this scope
    published: int = 0  # committed prefixes already entered in the model
    callback: str = "none"


def chain_hashes(scope: int, tokens: list[Any]) -> list[int]:
    chain, h = [], hash(("scope", scope))
    for token in tokens:
        h = hash((h, token))
        chain.append(h)
    return chain


@dataclass
class Run:
    """One manager, the data-verifying engine, and the model of every request."""

    layout: str
    directory: str
    monkeypatch: Any
    seed: int = 0
    real_clock: bool = False  # the process's clock (shifted by a day), not the operation count
    remote_url: str | None = None  # the shared tier's server (a remote layout)
    requests: list[Request | None] = field(default_factory=list)
    open_requests: dict[int, Request] = field(default_factory=dict)  # by number, not closed
    committed: set[int] = field(default_factory=set)
    stats: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.now = 0.0
        for module, name, value in LAYOUT_SETTINGS.get(self.layout, ()):
            self.monkeypatch.setattr(module, name, value)
        clock = (lambda: time.monotonic() + 86400.0) if self.real_clock else (lambda: self.now)
        config = LAYOUTS[self.layout](self.directory)
        if self.remote_url is not None:
            remote = RemoteCacheTierConfig(self.remote_url, timeout_ms=5000)
            config = dataclasses.replace(config, remote_tier=remote)
        self.manager = KVCacheManager(config, clock=clock)
        self.engine = CheckingEngine(self.manager)
        self.faults = DiskFaults(self.manager).install(self.monkeypatch)
        rng = random.Random(self.seed)
        self.prefixes = [
            [rng.randrange(1 << 31) for _ in range(rng.choice([0, 3, 4, 9, 16, 30]))]
            for _ in range(5)
        ]
        self.callback_calls = 0
        self._client: Any = None
        self._fault_ttl = 0
        self._injected_before = 0
        # KV events, applied to a router's view (in process): after every operation, whatever
        # failed or was interrupted, the view must equal the tree's.
        manager = self.manager
        media = [MEDIA[manager.get_tier(level)] for level in range(manager.num_levels)]
        self.event_view: dict[str, set[tuple[int, int]]] = {}
        log = KVEventLog(TPB, media, self._apply_events)
        manager._kv_events = manager._storage.state.kv_events = manager._tree.kv_events = log

    # -- operations ----------------------------------------------------------------------------

    def apply(self, op: Op) -> None:
        self.now += 1.0
        name, args = op[0], op[1:]
        self.stats["ops"] += 1
        if name == "fault":  # armed until it fires or five more operations ran
            code = None if args[1] == "interrupt" else getattr(errno, args[1])
            self.faults.fail(args[0], code, skip=args[2])
            self._fault_ttl = 5
            return
        self._injected_before = self.faults.total_injected
        try:
            getattr(self, f"op_{name}")(*args)
        finally:
            self._fault_ttl -= 1
            if self._fault_ttl <= 0 or self.faults.total_injected > self._injected_before:
                self.faults.disarm()
            if self.remote_url is not None:  # (the server's content a function of the ops)
                assert self.manager.flush_remote_writes(30)
        if self.stats["ops"] % VERIFY_EVERY == 0:
            with self.faults.paused():
                self.verify()

    def _live(self, index: int) -> Request | None:
        request = self.open_requests.get(index)
        if request is not None and request.cache.status is KVCacheStatus.CLOSED:
            del self.open_requests[index]
            return None
        return request

    def _callback(self, kind: str) -> Callable[[int, int], Any] | None:
        if kind == "none":
            return None
        if kind == "constant":
            return lambda ordinal, group: 60
        if kind == "by-ordinal":
            return lambda ordinal, group: (ordinal * 7 + group * 13) % 101

        # "flaky": fails on some calls (a bad value or an exception), which must change nothing
        def flaky(ordinal: int, group: int) -> Any:
            self.callback_calls += 1
            if self.callback_calls % 5 == 0:
                raise RuntimeError("priority callback failed")
            if self.callback_calls % 7 == 0:
                return 500
            return 20

        return flaky

    def op_create(
        self, scope: int, prefix: int, tail_seed: int, tail: int, prompt: int, callback: str
    ) -> None:
        rng = random.Random(tail_seed)
        tokens = self.prefixes[prefix] + [rng.randrange(1 << 31) for _ in range(tail)]
        if callback == "digest":  # a multimodal digest among the tokens
            tokens = tokens[:2] + [bytes(rng.randrange(256) for _ in range(32))] + tokens[2:]
            callback = "none"
        prompt = min(prompt, len(tokens))
        cache = self.manager.create_kv_cache(
            SCOPES[scope], tokens[:prompt], priority_callback=self._callback(callback)
        )
        request = Request(tokens, scope, cache, chain_hashes(scope, tokens), callback=callback)
        self.open_requests[len(self.requests)] = request
        self.requests.append(request)
        reused = cache.num_committed_tokens
        assert reused <= prompt, (reused, prompt)
        assert cache.capacity == cache.history_length == reused
        if reused:
            assert request.chain[reused - 1] in self.committed, (
                f"request {len(self.requests) - 1} reused {reused} tokens never committed in scope {scope}"
            )
            self.stats["reused tokens"] += reused
        request.published = reused
        self.stats["creates"] += 1

    def op_fork(self, index: int, tail_seed: int, tail: int) -> None:
        """Fork an active request (a beam): it shares the history, then goes on with tokens of
        its own."""
        parent = self._live(index)
        if parent is None or parent.cache.status is not KVCacheStatus.ACTIVE:
            self.requests.append(None)  # (its number stays taken)
            return
        cache = self._storage_failure(
            lambda: self._expect_no_change(
                lambda: self.manager.fork_kv_cache(parent.cache), OutOfPagesError
            )
        )[1]
        if cache is None or isinstance(cache, BaseException):
            self.requests.append(None)
            return
        rng = random.Random(tail_seed)
        shared = parent.tokens[: cache.history_length]
        tokens = shared + [rng.randrange(1 << 31) for _ in range(tail)]
        chain = chain_hashes(parent.scope, tokens)
        request = Request(tokens, parent.scope, cache, chain, callback=parent.callback)
        request.published = cache.num_committed_tokens  # (the parent's, already in the model)
        self.open_requests[len(self.requests)] = request
        self.requests.append(request)
        self.stats["forks"] += 1

    def _expect_no_change(self, call: Callable[[], Any], *errors: type[BaseException]) -> Any:
        """Run `call`; if it returns False or raises one of `errors`, nothing may have changed."""
        before = state_of(self.manager)
        try:
            result = call()
        except errors as error:
            self.stats[f"refused: {type(error).__name__}"] += 1
            after = state_of(self.manager)
            assert after == before, f"{type(error).__name__} ({error}) changed the state"
            return error
        if result is False:
            assert state_of(self.manager) == before, "a call that returned False changed the state"
        return result

    def _storage_failure(self, call: Callable[[], Any]) -> tuple[bool, Any]:
        """Run `call` with any armed fault: a `StorageError` (or an injected interrupt) must
        leave every request's status, lengths and pages as they were. Returns (failed, result)."""
        before = state_of(self.manager)["caches"]
        try:
            return False, call()
        except (StorageError, KeyboardInterrupt) as error:
            if self.faults.total_injected == self._injected_before:
                raise  # not caused by an injected fault: a real failure
            self.stats[f"fault surfaced: {type(error).__name__}"] += 1
            assert state_of(self.manager)["caches"] == before, f"{error!r} changed a request"
            return True, None

    def op_resume(self, index: int) -> None:
        request = self._live(index)
        if request is None:
            return
        cache = request.cache
        was = cache.status
        failed, resumed = self._storage_failure(lambda: self._expect_no_change(cache.resume))
        if failed:
            return
        assert resumed is (cache.status is KVCacheStatus.ACTIVE)
        if resumed and was is KVCacheStatus.SUSPENDED:
            self.stats["resumes"] += 1
        elif not resumed:
            self.stats["resume refused"] += 1

    def op_suspend(self, index: int) -> None:
        request = self._live(index)
        if request is not None:
            request.cache.suspend()
            assert request.cache.status is KVCacheStatus.SUSPENDED

    def op_void(self) -> None:
        """A request removed while shrinking a failure: its number stays taken."""
        self.requests.append(None)

    def op_preempt(self) -> None:
        """Suspend every active request (an engine making room for a burst)."""
        for request in self.open_requests.values():
            if request.cache.status is KVCacheStatus.ACTIVE:
                request.cache.suspend()

    def op_step(self, index: int, count: int) -> None:
        """resize to history + count, write the records, commit (an engine step)."""
        request = self._live(index)
        if request is None or request.cache.status is not KVCacheStatus.ACTIVE:
            return
        cache = request.cache
        start = cache.history_length
        new = request.tokens[start : start + count]
        if not new:
            return
        if not cache._committing:
            return  # after stop_committing() nothing more is computed here
        failed, grown = self._storage_failure(
            lambda: self._expect_no_change(lambda: cache.resize(start + len(new)))
        )
        if failed or not grown:
            self.stats["resize refused" if not failed else "resize failed"] += 1
            return
        assert cache.capacity == start + len(new) and cache.history_length == start
        failed, private = self._storage_failure(
            lambda: self._expect_no_change(lambda: cache.prepare_write(start, start + len(new)))
        )
        if failed or not private:  # a page shared with a fork could not be copied
            self.stats["copy-on-write refused" if not failed else "copy-on-write failed"] += 1
            return
        self.engine.write(cache, new, start)
        if not self._call_with_callback(request, lambda: cache.commit(new)):
            # An injected interrupt: nothing was committed, the next step redoes it. An engine's
            # recurrent state is back at the committed tokens then (it kept a copy).
            if start:
                self.engine.write_state(cache, request.tokens[start - 1], start)
            return
        assert cache.num_committed_tokens == cache.history_length == start + len(new)
        self._publish(request)
        self.stats["tokens computed"] += len(new)

    def _call_with_callback(self, request: Request, call: Callable[[], Any]) -> bool:
        """Run a call that may invoke the request's priority callback: if the (flaky) callback
        fails, nothing may have changed, and the call is made again without it. False when an
        injected fault interrupted the call (which then changed nothing of the request)."""
        failed, outcome = self._storage_failure(
            lambda: self._expect_no_change(call, RuntimeError, ValueError)
        )
        if failed:
            return False
        if isinstance(outcome, BaseException):
            assert request.callback == "flaky", outcome
            callback, request.cache._priority_callback = request.cache._priority_callback, None
            with self.faults.paused():
                call()
            request.cache._priority_callback = callback
        return True

    def op_grow(self, index: int, extra: int) -> None:
        """Reserve capacity ahead of the history (or give some back, with a negative extra)."""
        request = self._live(index)
        if request is None or request.cache.status is not KVCacheStatus.ACTIVE:
            return
        cache = request.cache
        capacity = max(cache.history_length, cache.capacity + extra)
        failed, grown = self._storage_failure(
            lambda: self._expect_no_change(lambda: cache.resize(capacity))
        )
        if not failed and grown:
            assert cache.capacity == capacity

    def op_stop(self, index: int) -> None:
        request = self._live(index)
        if request is not None and self._call_with_callback(request, request.cache.stop_committing):
            self._publish(request)

    def op_close(self, index: int) -> None:
        request = self._live(index)
        if request is None or not self._call_with_callback(request, request.cache.close):
            return
        assert request.cache.status is KVCacheStatus.CLOSED
        self._publish(request)
        self.stats["closes"] += 1

    def op_prefetch(self, index: int, level: int) -> None:
        request = self._live(index)
        if request is None or request.cache.status is not KVCacheStatus.SUSPENDED:
            return
        level = min(level, self.manager.num_levels - 1)
        failed, done = self._storage_failure(lambda: request.cache.prefetch(level))
        if failed:
            return
        colder = [
            page
            for g in range(self.manager.layout.num_layer_groups)
            for page in request.cache.pages(g)
            if page is not None and page.level > level
        ]
        assert done is (not colder) or request.cache._deferred, (done, colder)
        self.stats["prefetches"] += 1

    def op_clear(self) -> None:
        if self.manager.num_open_kv_caches:
            self._expect_no_change(self.manager.clear_reusable_blocks, LogicError)
        else:
            self.manager.clear_reusable_blocks()
            assert not list(self.manager._tree.blocks())
            self.stats["clears"] += 1

    def op_quota(self, level: int, factor: float) -> None:
        """manager.resize(level, quota * factor): refused while a request is active."""
        level = min(level, self.manager.num_levels - 1)
        initial = self.manager.config.cache_tiers[level].quota
        quota = max(1, int(initial * factor))
        failed, outcome = self._storage_failure(
            lambda: self._expect_no_change(
                lambda: self.manager.resize(level, quota), LogicError, ConfigError
            )
        )
        if not failed and outcome is True:
            assert self.manager.get_quota(level) == quota
            self.stats["quota changes"] += 1

    def op_adjust(self, level: int, weights: list[float]) -> None:
        """adjust_cache_level with a random split (requests may be active)."""
        level = min(level, self.manager.num_levels - 1)
        ratio = (weights * self.manager.num_pool_groups)[: self.manager.num_pool_groups]
        failed, outcome = self._storage_failure(
            lambda: self._expect_no_change(
                lambda: self.manager.adjust_cache_level(level, ratio), OutOfPagesError
            )
        )
        if not failed and not isinstance(outcome, BaseException):
            self.stats["adjusts"] += 1

    def op_tamper(self, kind: str, seed: int) -> None:
        """Swap two values on the server, copy one over another key, or damage one."""
        if self.remote_url is None:
            return
        client = self._server_client()
        keys = sorted(k for k in client.keys(b"*") if k.startswith(KEY_PREFIX))
        if len(keys) < 2:
            return
        rng = random.Random(seed)
        first, second = rng.sample(keys, 2)
        one, two = client.get(first), client.get(second)
        if one is None or two is None:
            return
        if kind == "swap":
            client.set(first, two)
            client.set(second, one)
        elif kind == "copy":
            client.set(second, one)
        else:  # "damage": one byte of the payload flipped
            at = len(one) - 1 - rng.randrange(min(len(one), 4096))
            client.set(first, one[:at] + bytes([one[at] ^ 0x40]) + one[at + 1 :])
        self.stats["values tampered with"] += 1

    def _server_client(self) -> Any:
        if self._client is None:
            import valkey

            self._client = valkey.Valkey.from_url(self.remote_url, socket_timeout=5)
        return self._client

    def op_rebalance(self) -> None:
        """The engine's rebalancing hook: adjust() when need_adjustment says so."""
        if self.manager.need_adjustment:
            failed, outcome = self._storage_failure(
                lambda: self._expect_no_change(self.manager.adjust, OutOfPagesError)
            )
            if not failed and not isinstance(outcome, BaseException):
                self.stats["rebalances"] += 1

    def _publish(self, request: Request) -> None:
        """Enter the request's newly committed prefixes into the model."""
        committed = request.cache.num_committed_tokens
        if committed > request.published:
            self.committed.update(request.chain[request.published : committed])
            request.published = committed

    # -- checks --------------------------------------------------------------------------------

    def _apply_events(self, events: list[Any]) -> None:
        for event in events:
            kind = type(event).__name__
            if kind == "AllBlocksCleared":
                self.event_view.clear()
                continue
            blocks = self.event_view.setdefault(event.medium, set())
            if event.medium == MEDIUM_EXTERNAL:  # (the server, not the tree: never removed)
                assert kind == "BlockStored", event
                blocks.update((h, event.group_idx) for h in event.block_hashes)
                continue
            for pair in [(h, event.group_idx) for h in event.block_hashes]:
                if kind == "BlockStored":
                    assert pair not in blocks, f"KV event stores {pair} twice on {event.medium}"
                    blocks.add(pair)
                else:
                    assert pair in blocks, f"KV event removes {pair}, not on {event.medium}"
                    blocks.discard(pair)

    def verify(self) -> None:
        manager = self.manager
        manager.check_invariants()
        manager.flush_kv_events()
        view = {
            medium: blocks
            for medium, blocks in self.event_view.items()
            if blocks and medium != MEDIUM_EXTERNAL
        }
        assert view == cached_blocks(manager), "the KV events disagree with the tree"
        layout = manager.layout
        for index in list(self.open_requests):
            request = self._live(index)
            if request is None:
                continue
            cache = request.cache
            self.engine.check_anywhere(cache, request.tokens)
            if cache.status is not KVCacheStatus.ACTIVE:
                continue
            blocks = -(-cache.capacity // TPB)
            for g, life_cycle in enumerate(layout.life_cycles):
                pages = cache.pages(g)
                if isinstance(life_cycle, SsmLifeCycle):
                    assert pages[0] is not None, f"active request {cache.id} has no SSM state"
                    continue
                beg, end = life_cycle.stale_range(cache.history_length, TPB)
                missing = [i for i in range(blocks) if not beg <= i < end and pages[i] is None]
                assert not missing, f"active request {cache.id} group {g} misses blocks {missing}"

    def close(self) -> None:
        for request in self.requests:
            if request is not None:
                request.cache._priority_callback = None
                request.cache.close()
        self.manager.clear_reusable_blocks()
        for level in range(self.manager.num_levels):
            for stats in self.manager.get_storage_statistics(level):
                assert stats.free == stats.total, f"level {level} leaked slots: {stats}"
        self.manager.shutdown()


# -- generation --------------------------------------------------------------------------------

OP_WEIGHTS = {
    "create": 5,
    "resume": 10,
    "step": 45,
    "grow": 4,
    "suspend": 6,
    "preempt": 2,
    "prefetch": 3,
    "close": 6,
    "fork": 2,
    "stop": 1,
    "clear": 1,
    "quota": 1,
    "adjust": 2,
    "rebalance": 2,
    "fault": 3,
    "tamper": 0,  # (remote layouts: see REMOTE_WEIGHTS)
}
REMOTE_WEIGHTS = {**OP_WEIGHTS, "tamper": 3, "clear": 2}
FAULT_CALLS = ["pwritev", "preadv", "posix_fallocate"]
FAULT_CODES = ["EIO", "ENOSPC", "interrupt"]


def generate(rng: random.Random, run: Run) -> Op:
    """One operation, weighted, on requests in a state where it does something."""
    weights = REMOTE_WEIGHTS if run.remote_url is not None else OP_WEIGHTS
    names = list(weights)
    name = rng.choices(names, weights=[weights[n] for n in names])[0]
    live = [i for i in list(run.open_requests) if run._live(i) is not None]
    active = [i for i in live if run.requests[i].cache.status is KVCacheStatus.ACTIVE]  # type: ignore[union-attr]
    suspended = [i for i in live if i not in active]
    if name in ("step", "grow", "fork") and not active:
        name = "resume"
    if name in ("resume", "prefetch") and not suspended:
        name = "create"
    if name in ("suspend", "close", "stop") and not live:
        name = "create"
    if name == "close" and len(live) < 4:
        name = "create"
    if name == "create":
        if len(live) >= 10:
            return ["close", rng.choice(live)]
        return [
            "create",
            rng.randrange(len(SCOPES)),
            rng.randrange(len(run.prefixes)),
            rng.randrange(1 << 30),
            rng.choice([1, 3, 8, 20, 40, 90]),
            rng.choice([0, 2, 4, 9, 17, 40, 80, 160]),
            rng.choice(["none"] * 6 + ["constant", "by-ordinal", "flaky", "digest"]),
        ]
    if name == "step":
        index = rng.choice(active)
        request = run.requests[index]
        assert request is not None
        if request.cache.history_length >= len(request.tokens):
            return [rng.choice(["close", "suspend"]), index]  # done: it may linger suspended
        return ["step", index, rng.choice([1, 1, 1, 2, 3, 4, 7, 13, 30])]
    if name == "grow":
        return ["grow", rng.choice(active), rng.choice([-6, -1, 1, 4, 9])]
    if name == "fork":
        if len(live) >= 10:
            return ["close", rng.choice(live)]
        return ["fork", rng.choice(active), rng.randrange(1 << 30), rng.choice([1, 3, 9, 30])]
    if name in ("resume", "prefetch"):
        index = rng.choice(suspended)
        return ["resume", index] if name == "resume" else ["prefetch", index, rng.randrange(2)]
    if name in ("suspend", "close", "stop"):
        return [name, rng.choice(active if name == "suspend" and active else live)]
    if name == "quota":
        return ["quota", rng.randrange(3), rng.choice([0.5, 0.75, 1.0, 1.5])]
    if name == "adjust":
        return ["adjust", rng.randrange(3), [rng.choice([0.1, 0.3, 0.5, 1.0]) for _ in range(3)]]
    if name == "fault":
        return ["fault", rng.choice(FAULT_CALLS), rng.choice(FAULT_CODES), rng.randrange(3)]
    if name == "tamper":
        return ["tamper", rng.choice(["swap", "copy", "damage"]), rng.randrange(1 << 30)]
    return [name]


# -- running, replaying and shrinking ----------------------------------------------------------


class FuzzFailure(AssertionError):
    def __init__(self, layout: str, seed: int, ops: list[Op], error: BaseException) -> None:
        self.layout, self.seed, self.ops, self.error = layout, seed, ops, error
        super().__init__(f"{type(error).__name__}: {error}")


@contextlib.contextmanager
def _run(layout: str, seed: int, real_clock: bool = False) -> Iterator[Run]:
    with (
        tempfile.TemporaryDirectory(prefix="kvpool-fuzz-") as directory,
        pytest.MonkeyPatch.context() as mp,
    ):
        server = None
        if layout in REMOTE_LAYOUTS:
            if server_binary() is None:
                pytest.skip("no valkey-server binary")
            server = ValkeyServer(Path(directory) / "valkey").start()
        try:
            run = Run(layout, directory, mp, seed, real_clock, server and server.url)
            try:
                yield run
            finally:
                with contextlib.suppress(Exception):
                    run.manager._closed or run.close()
        finally:
            if server is not None:
                server.stop()


def replay(layout: str, seed: int, ops: list[Op], finish: bool = True) -> Run:
    """Apply `ops` in order on a fresh manager; raises the first check that fails."""
    with _run(layout, seed) as run:
        for op in ops:
            run.apply(op)
        if finish:
            run.close()
        return run


def fuzz(layout: str, seed: int, num_ops: int) -> Counter[str]:
    """Generate and apply `num_ops` operations; on a failure raise `FuzzFailure` with the
    operations applied so far (the last one failed)."""
    rng = random.Random(seed)
    ops: list[Op] = []
    with _run(layout, seed) as run:
        try:
            for _ in range(num_ops):
                op = generate(rng, run)
                ops.append(op)
                run.apply(op)
            counters = run.manager._storage.state
            policy = run.manager._policy
            learned = int(getattr(policy, "width", 0) > 0)  # (the hazard policy classes pages)
            moved, dropped = sum(counters.num_moved), counters.num_dropped
            swapped, relocated = counters.num_swapped, counters.num_relocated
            copied = run.manager.stats().copy_on_write_pages
            remote = run.manager.remote_statistics()
            run.close()
        except BaseException as error:
            raise FuzzFailure(layout, seed, ops, error) from error
        stats = run.stats
        stats["faults injected"] = run.faults.total_injected
        stats["pages moved between levels"] = moved
        stats["pages dropped"] = dropped
        stats["pages swapped"] = swapped
        stats["pages relocated"] = relocated
        stats["pages copied on write"] = copied
        stats["records checked"] = run.engine.records_checked
        stats["eviction policy learned"] = learned
        if remote is not None:
            stats["remote blocks fetched"] = remote.fetched_blocks
            stats["remote values refused"] = remote.corrupt_values
        return stats


def _decisions(run: Run, ops: list[Op], log: list[list[Any]] | None = None) -> list[list[Any]]:
    """Apply `ops` recording the manager's decisions: one list per operation."""
    log = [] if log is None else log
    run.manager.record_decisions(True)
    for op in ops:
        run.apply(op)
        log.append(run.manager.take_decisions())
    return log


def replay_twins(layout: str, seed: int, ops: list[Op]) -> Run:
    """Apply `ops` to a manager on the operation clock and to one on the process's clock;
    raises `AssertionError` at the first operation after which their decisions differ."""
    with _run(layout, seed) as first:
        logs = _decisions(first, ops)
        first.close()
    with _run(layout, seed, real_clock=True) as second:
        logs_second = _decisions(second, ops)
        second.close()
    for index, (ours, theirs) in enumerate(zip(logs, logs_second, strict=True)):
        if ours != theirs:
            raise AssertionError(
                f"twins decided differently at operation {index} {ops[index]}: {ours} != {theirs}"
            )
    return second


def twins(layout: str, seed: int, num_ops: int) -> Counter[str]:
    """Generate `num_ops` operations (no injected faults) on a manager on the operation clock,
    then drive a twin on the process's clock with them; their decisions must be equal after
    every operation (`FuzzFailure` otherwise)."""
    rng = random.Random(seed)
    ops: list[Op] = []
    with _run(layout, seed) as run:
        run.manager.record_decisions(True)
        try:
            while len(ops) < num_ops:
                op = generate(rng, run)
                if op[0] == "fault":
                    continue
                ops.append(op)
                run.apply(op)
                run.manager.take_decisions()
            run.close()
        except BaseException as error:
            raise FuzzFailure(layout, seed, ops, error) from error
    try:
        second = replay_twins(layout, seed, ops)
    except BaseException as error:
        raise FuzzFailure(layout, seed, ops, error) from error
    policy = second.manager._policy
    stats = second.stats
    stats["eviction policy learned"] = int(getattr(policy, "width", 0) > 0)
    stats["pages dropped"] = second.manager._storage.state.num_dropped
    return stats


def other_backend() -> str:
    return "python" if kvpool.backend() == "native" else "native"


def decisions_on_the_other_backend(layout: str, seed: int, ops: list[Op]) -> list[list[Any]]:
    """The decision log of `ops` replayed by a child process on the other backend."""
    with tempfile.TemporaryDirectory(prefix="kvpool-backends-") as directory:
        given, taken = Path(directory) / "ops.json", Path(directory) / "decisions.json"
        given.write_text(json.dumps({"layout": layout, "seed": seed, "ops": ops}))
        env = dict(os.environ, KVPOOL_BACKEND=other_backend())
        command = [sys.executable, "-m", "tests.fuzz.fuzzer", "--decisions", str(given)]
        done = subprocess.run(
            [*command, "--out", str(taken)], env=env, capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise AssertionError(f"the {other_backend()} backend's replay failed: {done.stderr}")
        result = json.loads(taken.read_text())
    if result["backend"] == kvpool.backend():
        pytest.skip(f"the {other_backend()} backend does not run here: {result['why']}")
    return list(result["decisions"])


def _compare(ops: list[Op], ours: list[list[Any]], theirs: list[list[Any]], what: str) -> None:
    ours = json.loads(json.dumps(ours))  # (as the other side's came: tuples as lists)
    for index, (mine, other) in enumerate(zip(ours, theirs, strict=True)):
        if mine != other:
            raise AssertionError(
                f"{what} decided differently at operation {index} {ops[index]}: {mine} != {other}"
            )


def replay_backends(layout: str, seed: int, ops: list[Op]) -> Run:
    """Apply `ops` on this process's backend and, in a child process, on the other; raises
    `AssertionError` at the first operation after which their decisions differ."""
    with _run(layout, seed) as run:
        logs = _decisions(run, ops)
        run.close()
    _compare(ops, logs, decisions_on_the_other_backend(layout, seed, ops), "backends")
    return run


def backends(layout: str, seed: int, num_ops: int) -> Counter[str]:
    """Generate `num_ops` operations (no injected faults) on this process's backend, recording
    its decisions, then replay them on the other backend (a child process); their decisions
    must be equal after every operation (`FuzzFailure` otherwise)."""
    rng = random.Random(seed)
    ops: list[Op] = []
    logs: list[list[Any]] = []
    with _run(layout, seed) as run:
        run.manager.record_decisions(True)
        try:
            while len(ops) < num_ops:
                op = generate(rng, run)
                if op[0] == "fault":
                    continue
                ops.append(op)
                run.apply(op)
                logs.append(run.manager.take_decisions())
            learned = int(getattr(run.manager._policy, "width", 0) > 0)
            dropped = run.manager._storage.state.num_dropped
            run.close()
        except BaseException as error:
            raise FuzzFailure(layout, seed, ops, error) from error
    try:
        _compare(ops, logs, decisions_on_the_other_backend(layout, seed, ops), "backends")
    except AssertionError as error:
        raise FuzzFailure(layout, seed, ops, error) from error
    stats = run.stats
    stats["eviction policy learned"] = learned
    stats["pages dropped"] = dropped
    stats["decisions compared"] = sum(map(len, logs))
    return stats


def _fails(
    layout: str, seed: int, ops: list[Op], signature: str, replayer: Callable[..., Any] = replay
) -> bool:
    try:
        replayer(layout, seed, ops)
    except BaseException as error:
        return _signature(error) == signature
    return False


def _signature(error: BaseException) -> str:
    """What makes two failures the same: the error type and its message up to the first digit
    (numbers, such as slot ids, differ between a long and a shrunk run)."""
    return f"{type(error).__name__}: {re.split(r'[0-9]', str(error), maxsplit=1)[0][:60]}"


MAKERS = ("create", "void", "fork")  # operations that make a request (by creation order)


def _request_of(op: Op) -> int | None:
    """The request an operation is about (by creation order; a fork's parent), or None."""
    if op[0] in ("resume", "suspend", "step", "grow", "stop", "close", "prefetch", "fork"):
        return int(op[1])
    return None


def shrink(
    layout: str,
    seed: int,
    ops: list[Op],
    error: BaseException,
    seconds: float = 300.0,
    replayer: Callable[..., Any] = replay,
) -> list[Op]:
    """Make a failing operation list short while the same failure still happens (for at most
    `seconds`; the shortest list found by then is returned): first drop whole requests (their
    `create` becomes a `void` that keeps later requests' numbers), then chunks of operations,
    halving the chunk size (delta debugging). `replayer`: `replay`, or `replay_twins`."""
    signature = _signature(error)
    deadline = time.monotonic() + seconds

    def without(ops: list[Op], dropped: set[int]) -> list[Op]:
        kept, request, dropped = [], -1, set(dropped)
        for op in ops:
            if op[0] in MAKERS:
                request += 1
                if op[0] == "fork" and op[1] in dropped:
                    dropped.add(request)  # (a fork of a dropped request goes with it)
                kept.append(["void"] if request in dropped else op)
            elif _request_of(op) not in dropped:
                kept.append(op)
        return kept

    for reduce in ("requests", "operations"):
        items = list(range(sum(op[0] in MAKERS for op in ops)))
        if reduce == "operations":
            items = list(range(len(ops)))
        chunk = max(1, len(items) // 2)
        while chunk >= 1 and time.monotonic() < deadline:
            i = 0
            while i < len(items) and time.monotonic() < deadline:
                dropped = items[i : i + chunk]
                if reduce == "requests":
                    candidate = without(ops, set(dropped))
                else:
                    gone = set(dropped)
                    candidate = [op for j, op in enumerate(ops) if j not in gone]
                if (
                    candidate
                    and candidate != ops
                    and _fails(layout, seed, candidate, signature, replayer)
                ):
                    ops = candidate
                    items = items[:i] + items[i + chunk :]
                    if reduce == "operations":
                        items = list(range(len(ops)))
                else:
                    i += chunk
            chunk //= 2
    compact = _renumber(ops)
    return compact if _fails(layout, seed, compact, signature, replayer) else ops


def _renumber(ops: list[Op]) -> list[Op]:
    """Drop `void` requests, renumbering the others."""
    number: dict[int, int] = {}
    request = -1
    for op in ops:
        if op[0] in MAKERS:
            request += 1
            if op[0] != "void":
                number[request] = len(number)
    return [
        [op[0], number[op[1]], *op[2:]] if _request_of(op) is not None else op
        for op in ops
        if op[0] != "void" and (_request_of(op) is None or op[1] in number)
    ]


def save(
    path: Path,
    layout: str,
    seed: int,
    ops: list[Op],
    error: BaseException,
    twins: bool = False,
    backends: bool = False,
) -> None:
    saved = {"layout": layout, "seed": seed, "error": _signature(error), "ops": ops}
    if twins:
        saved["twins"] = True
    if backends:
        saved["backends"] = True
    path.write_text(json.dumps(saved, indent=None))


def write_decisions(given: Path, out: Path) -> None:
    """`--decisions`: replay a saved operation list and write its decision log and this
    process's backend (the other side of `backends`)."""
    saved = json.loads(given.read_text())
    with _run(saved["layout"], saved["seed"]) as run:
        logs = _decisions(run, saved["ops"])
        run.close()
    info = kvpool.backend_info()
    out.write_text(json.dumps({"backend": info.name, "why": info.reason, "decisions": logs}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=10_000, help="operations per layout")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), action="append")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--replay", type=Path, help="replay a saved failure")
    parser.add_argument("--out", type=Path, default=Path("fuzz-failure.json"))
    parser.add_argument("--shrink-seconds", type=float, default=300.0)
    parser.add_argument(
        "--twins", action="store_true", help="compare the decisions of two managers' clocks"
    )
    parser.add_argument(
        "--backends", action="store_true", help="compare the decisions of the two backends"
    )
    parser.add_argument("--decisions", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.decisions:
        write_decisions(args.decisions, args.out)
        return 0
    if args.replay:
        saved = json.loads(args.replay.read_text())
        replayer = replay_twins if saved.get("twins") else replay
        replayer = replay_backends if saved.get("backends") else replayer
        replayer(saved["layout"], saved["seed"], saved["ops"])
        print("replay passed")
        return 0
    total: Counter[str] = Counter()
    run_layout = backends if args.backends else twins if args.twins else fuzz
    replayer = replay_backends if args.backends else replay_twins if args.twins else replay
    for layout in args.layout or sorted(LAYOUTS):
        started = time.perf_counter()
        try:
            stats = run_layout(layout, args.seed, args.ops)
        except FuzzFailure as failure:
            traceback.print_exception(failure.error)
            flags = (args.twins, args.backends)
            save(args.out, failure.layout, failure.seed, failure.ops, failure.error, *flags)
            small = shrink(
                failure.layout,
                failure.seed,
                failure.ops,
                failure.error,
                args.shrink_seconds,
                replayer,
            )
            save(args.out, failure.layout, failure.seed, small, failure.error, *flags)
            print(
                f"{layout}: failed after {len(failure.ops)} ops; shrunk to {len(small)}: {args.out}"
            )
            return 1
        total += stats
        print(f"{layout}: {dict(sorted(stats.items()))} in {time.perf_counter() - started:.0f} s")
    print(f"all: {dict(sorted(total.items()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
