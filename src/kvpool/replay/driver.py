"""The replay driver: a continuous-batching scheduler with no model compute, driving the real
manager through its public API and measuring what a deployment would see.

Requests arrive by timestamp (simulated time advances by `step_seconds` per engine step, or
jumps to the next arrival when idle), are admitted while memory allows (created with the prompt
minus its last token, so the cached prefix is reused, then resumed), prefill the rest in chunks
of `prefill_chunk` tokens per step, decode one token per step, up to `max_batch` at a time, are
suspended when the GPU runs out and resumed later (or preempted and recomputed when nothing can
progress), and close when done. Between steps the rebalancing hook runs (`need_adjustment` ->
`adjust()`).

The driver stops early, with a partial report, when `should_stop()` turns true (the CLI sets it
on Ctrl-C), and raises `ReplayStalled` when no request can progress at all.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvpool.cache import KVCache
from kvpool.config import EVICTION_POLICIES, KVCacheManagerConfig
from kvpool.errors import ArgumentError, KVPoolError, OutOfPagesError
from kvpool.manager import KVCacheManager
from kvpool.replay.policy import policy_for
from kvpool.replay.verify import CheckingEngine
from kvpool.replay.workloads import Request

logger = logging.getLogger("kvpool.replay")

STALL_STEPS = 100
"""Engine steps without any progress after which a replay gives up (`ReplayStalled`)."""


class ReplayStalled(KVPoolError):
    """No request could make progress for `STALL_STEPS` engine steps."""


@dataclass
class ReplayOptions:
    max_batch: int = 64
    prefill_chunk: int = 2048  # prompt tokens computed per engine step (chunked prefill)
    step_seconds: float = 0.02  # simulated time of one engine step
    as_fast_as_possible: bool = False  # ignore arrival times
    policy: str = EVICTION_POLICIES[0]
    verify: bool = False
    rebalance: bool = True
    sample_every: int = 10  # steps between occupancy samples (for the plot)

    def validate(self) -> None:
        """`ArgumentError` naming the first option out of range."""
        for name, low in (("max_batch", 1), ("prefill_chunk", 1), ("sample_every", 1)):
            value = getattr(self, name)
            if type(value) is not int or value < low:
                raise ArgumentError(f"{name}={value!r} is invalid: must be an integer >= {low}")
        if not isinstance(self.step_seconds, int | float) or not 0 <= self.step_seconds < 1e9:
            raise ArgumentError(
                f"step_seconds={self.step_seconds!r} is invalid: must be a number in [0, 1e9)"
            )
        policy_for(self.policy)


@dataclass
class Rebalance:
    step: int
    level: int
    before: list[float]
    after: list[float]


@dataclass
class LatencySummary:
    """A latency distribution in simulated seconds."""

    mean: float = 0.0
    p50: float = 0.0
    p99: float = 0.0

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencySummary:
        if not values:
            return cls()
        array = np.asarray(values, dtype=float)
        return cls(
            float(array.mean()), float(np.percentile(array, 50)), float(np.percentile(array, 99))
        )


@dataclass
class ReplayReport:
    """Every figure of a replay; `to_dict()` for JSON."""

    requests: int = 0
    requests_finished: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    hit_tokens_by_level: list[int] = field(default_factory=list)
    level_names: list[str] = field(default_factory=list)
    steps: int = 0
    peak_concurrency: int = 0
    mean_concurrency: float = 0.0
    suspensions: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0  # computed again after a preemption
    queueing_delay: LatencySummary = field(default_factory=LatencySummary)
    time_to_first_token: LatencySummary = field(default_factory=LatencySummary)
    # Tokens reused from the remote tier (KV another instance computed) and its counters;
    # None without a remote tier.
    remote_hit_tokens: int = 0
    remote: dict[str, int] | None = None
    # Per node of a remote cluster (address -> calls, errors, skipped_calls, redirects,
    # reconnects, mean_ms): empty without one.
    remote_nodes: dict[str, dict[str, float]] = field(default_factory=dict)
    dropped_pages: int = 0
    pages_moved_to_level: list[int] = field(default_factory=list)
    bytes_moved_to_level: list[int] = field(default_factory=list)
    rebalances: list[Rebalance] = field(default_factory=list)
    manager_us_per_step_mean: float = 0.0
    manager_us_per_step_p99: float = 0.0
    wall_seconds: float = 0.0
    simulated_seconds: float = 0.0
    records_verified: int = 0
    partial: bool = False  # stopped early (interrupted): the figures cover what was replayed
    # Samples for plots: step, then per (level, pool group) used fraction, and hit rate so far.
    sample_steps: list[int] = field(default_factory=list)
    occupancy: dict[str, list[float]] = field(default_factory=dict)
    hit_rate_samples: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def requests_per_second(self) -> float:
        return self.requests_finished / self.wall_seconds if self.wall_seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["hit_rate"] = self.hit_rate
        data["requests_per_second"] = self.requests_per_second
        return data


class _Running:
    __slots__ = ("cache", "index", "length", "prompt_length", "tokens")

    def __init__(self, index: int, cache: KVCache, tokens: list[int], prompt_length: int) -> None:
        self.index, self.cache, self.tokens = index, cache, tokens
        self.prompt_length, self.length = prompt_length, len(tokens)


def output_tokens(index: int, count: int) -> list[int]:
    """Deterministic generated tokens of request `index`."""
    base = (index * 7919 + 1) * 4096 % (2**31 - 8192)
    return list(range(base, base + count))


class Replay:
    """One replay of a workload against a fresh manager."""

    def __init__(
        self,
        workload: Sequence[Request],
        config: KVCacheManagerConfig,
        options: ReplayOptions | None = None,
        progress: Callable[[int, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        self.workload = workload
        self.options = options or ReplayOptions()
        self.options.validate()
        if not workload:
            raise ArgumentError("workload=[] is invalid: must hold at least one request")
        self.manager = KVCacheManager(config)
        self.policy = policy_for(self.options.policy)
        self.engine = CheckingEngine(self.manager) if self.options.verify else None
        self.progress = progress
        self.should_stop = should_stop or (lambda: False)
        self.report = ReplayReport()
        manager = self.manager
        self.report.level_names = [
            manager.get_tier(level).name for level in range(manager.num_levels)
        ]
        self.report.hit_tokens_by_level = [0] * manager.num_levels
        self._step_times: list[float] = []
        self._counted: set[int] = set()
        self._open: dict[int, KVCache] = {}  # every cache the driver has open, by request
        self._now = 0.0
        self._arrived_at: dict[int, float] = {}
        self._admitted_at: dict[int, float] = {}
        self._first_token_at: dict[int, float] = {}
        self._preempted_at: dict[int, int] = {}  # request -> tokens it had computed
        self._progress_marker = 0  # bumped by anything that moves the replay forward

    def run(self) -> ReplayReport:
        options, manager, report = self.options, self.manager, self.report
        start = time.perf_counter()
        pending = sorted(range(len(self.workload)), key=lambda i: self.workload[i].arrival)
        waiting: list[int] = []  # arrived, not admitted (preempted ones go first)
        running: list[_Running] = []
        suspended: list[_Running] = []
        concurrency: list[int] = []
        idle_steps = 0
        try:
            while pending or waiting or running or suspended:
                if self.should_stop():
                    report.partial = True
                    logger.info("stopping early after %d engine steps", report.steps)
                    break
                while pending and (
                    options.as_fast_as_possible or self.workload[pending[0]].arrival <= self._now
                ):
                    index = pending.pop(0)
                    waiting.append(index)
                    # Latency counts from arrival (from now when arrival times are ignored).
                    self._arrived_at[index] = (
                        self._now if options.as_fast_as_possible else self.workload[index].arrival
                    )
                marker = self._progress_marker
                tick = time.perf_counter()
                self._step(waiting, running, suspended)
                self.manager.flush_kv_events()
                self._step_times.append(time.perf_counter() - tick)
                report.steps += 1
                concurrency.append(len(running))
                if report.steps % options.sample_every == 0:
                    self._sample()
                if self.progress is not None:
                    self.progress(report.requests_finished, len(self.workload))
                busy = waiting or running or suspended
                idle_steps = idle_steps + 1 if busy and self._progress_marker == marker else 0
                if idle_steps >= STALL_STEPS:
                    raise ReplayStalled(
                        f"no request could make progress for {STALL_STEPS} engine steps "
                        f"({len(waiting)} waiting, {len(running)} running, {len(suspended)} "
                        "suspended): the GPU level is too small for the workload's requests, "
                        "or the batch settings allow no work"
                    )
                if running or suspended or waiting:
                    self._now += options.step_seconds
                elif pending:
                    self._now = max(
                        self._now + options.step_seconds, self.workload[pending[0]].arrival
                    )
            self._sample()
        finally:
            for cache in self._open.values():
                cache.close()
            self._open.clear()
            storage = manager._storage
            report.simulated_seconds = self._now
            report.dropped_pages = manager.num_dropped_pages
            report.pages_moved_to_level = list(storage.state.num_moved)
            report.bytes_moved_to_level = list(storage.state.bytes_moved)
            report.records_verified = self.engine.records_checked if self.engine else 0
            manager.clear_reusable_blocks()
            manager.shutdown()  # (writes what is queued for the remote tier first)
            remote = manager.remote_statistics()
            report.remote = None if remote is None else asdict(remote)
            for address, node in manager.remote_nodes().items():
                answered = node.calls + node.errors
                report.remote_nodes[address] = {
                    "calls": node.calls,
                    "errors": node.errors,
                    "skipped_calls": node.skipped_calls,
                    "redirects": node.redirects,
                    "reconnects": node.reconnects,
                    "mean_ms": node.seconds / answered * 1000 if answered else 0.0,
                }
        report.wall_seconds = time.perf_counter() - start
        report.peak_concurrency = max(concurrency, default=0)
        report.mean_concurrency = float(np.mean(concurrency)) if concurrency else 0.0
        times = np.array(self._step_times) * 1e6
        report.manager_us_per_step_mean = float(times.mean()) if times.size else 0.0
        report.manager_us_per_step_p99 = float(np.percentile(times, 99)) if times.size else 0.0
        arrivals = self._arrived_at
        report.queueing_delay = LatencySummary.of(
            [self._admitted_at[i] - arrivals[i] for i in self._admitted_at]
        )
        report.time_to_first_token = LatencySummary.of(
            [self._first_token_at[i] - arrivals[i] for i in self._first_token_at]
        )
        return report

    # -- scheduling ------------------------------------------------------------------------------

    def _step(self, waiting: list[int], running: list[_Running], suspended: list[_Running]) -> None:
        """One engine step: rebalance, resume, admit, compute, then settle the outcomes."""
        report, marker = self.report, self._progress_marker
        if self.options.rebalance and self.manager.need_adjustment:
            self._adjust()
        # Admit new work only when nothing waited to resume: it must not starve preempted work.
        may_admit = not suspended
        self._resume(suspended, running)
        if may_admit:
            self._admit(waiting, running)
        finished, stalled = self._decode(running)
        for entry in stalled:
            entry.cache.suspend()
            running.remove(entry)
            suspended.append(entry)
            report.suspensions += 1
        for entry in finished:
            entry.cache.close()
            del self._open[entry.index]
            running.remove(entry)
        report.requests_finished += len(finished)
        if finished:
            self._progress_marker += 1
        if not running and suspended and self._progress_marker == marker:
            # Nothing could progress: preempt the latest arrival (it is recomputed later; its
            # blocks stay cached), so the earliest requests always finish.
            victim = max(suspended, key=lambda entry: entry.index)
            suspended.remove(victim)
            self._preempted_at[victim.index] = victim.cache.history_length
            victim.cache.close()
            del self._open[victim.index]
            waiting.insert(0, victim.index)
            report.preemptions += 1
            self._progress_marker += 1

    def _adjust(self) -> None:
        manager = self.manager
        before = [manager.level_storage(level).ratio for level in range(manager.num_levels)]
        try:
            manager.adjust()
        except OutOfPagesError:
            return
        for level in range(manager.num_levels):
            after = manager.level_storage(level).ratio
            if after != before[level]:
                self.report.rebalances.append(
                    Rebalance(self.report.steps, level, before[level], after)
                )
                logger.info(
                    "step %d: rebalanced the %s level: %s -> %s",
                    self.report.steps,
                    self.report.level_names[level],
                    before[level],
                    after,
                )

    def _resume(self, suspended: list[_Running], running: list[_Running]) -> None:
        for entry in list(suspended):
            if len(running) >= self.options.max_batch or not entry.cache.resume():
                break
            suspended.remove(entry)
            running.append(entry)  # (progress only once it computes something)

    def _admit(self, waiting: list[int], running: list[_Running]) -> None:
        while waiting and len(running) < self.options.max_batch:
            index = waiting[0]
            request = self.workload[index]
            prompt = request.tokens()
            tokens = prompt + output_tokens(index, request.output_length)
            cache = self.manager.create_kv_cache(
                None, prompt[:-1], priority_callback=self.policy.priority
            )
            self._open[index] = cache
            local = cache.num_committed_tokens - cache.pending_remote_tokens
            levels = self._levels_of_reused(cache, local)
            resumed = cache.resume()  # (fetches the remote part of the prefix, if any)
            reused = cache.num_committed_tokens
            first_chunk = tokens[reused : min(len(prompt), reused + self.options.prefill_chunk)]
            if not resumed or not self._compute(cache, tokens, first_chunk):
                cache.close()  # no room for it now: admission waits (back-pressure)
                del self._open[index]
                break
            waiting.pop(0)
            self._progress_marker += 1
            self.policy.on_reuse(self.manager, cache)
            report = self.report
            if index in self._preempted_at:
                report.recomputed_tokens += max(0, self._preempted_at.pop(index) - reused)
            if index not in self._counted:  # a preempted request is counted once
                self._counted.add(index)
                self._admitted_at[index] = self._now
                report.requests += 1
                report.prompt_tokens += len(prompt)
                report.hit_tokens += reused
                for level, count in levels.items():
                    report.hit_tokens_by_level[level] += count
                if reused > local:
                    report.remote_hit_tokens += reused - local
            entry = _Running(index, cache, tokens, len(prompt))
            self._note_first_token(entry)
            running.append(entry)

    def _levels_of_reused(self, cache: KVCache, reused: int) -> dict[int, int]:
        """Reused tokens per level they come from (a block counts at its coldest page)."""
        tpb = self.manager.tokens_per_block
        by_level: dict[int, int] = {}
        layout = self.manager.layout
        for index in range(-(-reused // tpb)):
            levels = [
                page.level
                for g in range(layout.num_layer_groups)
                if index < len(pages := cache.pages(g)) and (page := pages[index]) is not None
            ]
            tokens = min(tpb, reused - index * tpb)
            level = max(levels, default=0)
            by_level[level] = by_level.get(level, 0) + tokens
        return by_level

    def _compute(self, cache: KVCache, tokens: list[int], new: list[int]) -> bool:
        """One engine step for `new` tokens (verified when asked)."""
        if self.engine is not None:
            if not self.engine.step(cache, tokens, new):
                return False
            self.engine.check(cache, tokens)
        else:
            if not cache.resize(cache.history_length + len(new)):
                return False
            cache.commit(new)
        self._progress_marker += 1
        return True

    def _note_first_token(self, entry: _Running) -> None:
        """The step that computes the last prompt token produces the first output token."""
        if (
            entry.index not in self._first_token_at
            and entry.cache.history_length >= entry.prompt_length
        ):
            self._first_token_at[entry.index] = self._now + self.options.step_seconds

    def _decode(self, running: list[_Running]) -> tuple[list[_Running], list[_Running]]:
        """One engine step of every running request: a prefill chunk, or one decoded token."""
        finished, stalled = [], []
        chunk = self.options.prefill_chunk
        for entry in running:
            position = entry.cache.history_length
            if position >= entry.length:
                finished.append(entry)
                continue
            if position < entry.prompt_length - 1:
                end = min(position + chunk, entry.prompt_length)
                new = entry.tokens[position:end]
            else:
                new = entry.tokens[position : position + 1]
            if self._compute(entry.cache, entry.tokens, new):
                self._note_first_token(entry)
            else:
                stalled.append(entry)
        return finished, stalled

    def _sample(self) -> None:
        report, manager = self.report, self.manager
        report.sample_steps.append(report.steps)
        for level in range(manager.num_levels):
            for index, stats in enumerate(manager.get_storage_statistics(level)):
                key = f"{report.level_names[level]} pool group {index}"
                used = (stats.total - stats.free) / stats.total if stats.total else 0.0
                report.occupancy.setdefault(key, []).append(used)
        report.hit_rate_samples.append(report.hit_rate)


def replay(
    workload: Sequence[Request],
    config: KVCacheManagerConfig,
    options: ReplayOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_manager: Callable[[KVCacheManager], None] | None = None,
) -> ReplayReport:
    """Replay `workload` through a new manager built from `config` (`on_manager` sees it
    first: to attach metrics, say)."""
    run = Replay(workload, config, options, progress, should_stop)
    if on_manager is not None:
        try:
            on_manager(run.manager)
        except BaseException:
            run.manager.shutdown()
            raise
    return run.run()
