"""The replay driver: a continuous-batching scheduler with no model compute, driving the real
manager through its public API and measuring what a deployment would see.

Requests arrive by timestamp (simulated time advances by `step_seconds` per engine step, or
jumps to the next arrival when idle), are admitted while memory allows (created with the prompt
minus its last token, so the cached prefix is reused, then resumed), prefill the rest in chunks
of `prefill_chunk` tokens per step, decode one token per step, up to `max_batch` at a time, are
suspended when the GPU runs out and resumed later, and close when done. Between steps the rebalancing hook runs (`need_adjustment` -> `adjust()`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvpool.cache import KVCache
from kvpool.config import KVCacheManagerConfig
from kvpool.errors import OutOfPagesError
from kvpool.manager import KVCacheManager
from kvpool.replay.policy import policy_for
from kvpool.replay.verify import CheckingEngine
from kvpool.replay.workloads import Request


@dataclass
class ReplayOptions:
    max_batch: int = 64
    prefill_chunk: int = 2048  # prompt tokens computed per engine step (chunked prefill)
    step_seconds: float = 0.02  # simulated time of one engine step
    as_fast_as_possible: bool = False  # ignore arrival times
    policy: str = "default"
    verify: bool = False
    rebalance: bool = True
    sample_every: int = 10  # steps between occupancy samples (for the plot)


@dataclass
class Rebalance:
    step: int
    level: int
    before: list[float]
    after: list[float]


@dataclass
class ReplayReport:
    """Every figure of a replay; `to_dict()` for JSON."""

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    hit_tokens_by_level: list[int] = field(default_factory=list)
    level_names: list[str] = field(default_factory=list)
    steps: int = 0
    peak_concurrency: int = 0
    mean_concurrency: float = 0.0
    suspensions: int = 0
    preemptions: int = 0
    dropped_pages: int = 0
    pages_moved_to_level: list[int] = field(default_factory=list)
    bytes_moved_to_level: list[int] = field(default_factory=list)
    rebalances: list[Rebalance] = field(default_factory=list)
    manager_us_per_step_mean: float = 0.0
    manager_us_per_step_p99: float = 0.0
    wall_seconds: float = 0.0
    simulated_seconds: float = 0.0
    records_verified: int = 0
    # Samples for plots: step, then per (level, pool group) used fraction, and hit rate so far.
    sample_steps: list[int] = field(default_factory=list)
    occupancy: dict[str, list[float]] = field(default_factory=dict)
    hit_rate_samples: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.wall_seconds if self.wall_seconds else 0.0

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
    ) -> None:
        self.workload = workload
        self.options = options or ReplayOptions()
        self.manager = KVCacheManager(config)
        self.policy = policy_for(self.options.policy)
        self.engine = CheckingEngine(self.manager) if self.options.verify else None
        self.progress = progress
        self.report = ReplayReport()
        manager = self.manager
        self.report.level_names = [
            manager.get_tier(level).name for level in range(manager.num_levels)
        ]
        self.report.hit_tokens_by_level = [0] * manager.num_levels
        self._step_times: list[float] = []
        self._counted: set[int] = set()

    def run(self) -> ReplayReport:
        options, manager, report = self.options, self.manager, self.report
        start = time.perf_counter()
        pending = sorted(range(len(self.workload)), key=lambda i: self.workload[i].arrival)
        waiting: list[int] = []  # arrived, not admitted (preempted ones go first)
        running: list[_Running] = []
        suspended: list[_Running] = []
        now = 0.0
        done = 0
        concurrency: list[int] = []
        try:
            while pending or waiting or running or suspended:
                while pending and (
                    options.as_fast_as_possible or self.workload[pending[0]].arrival <= now
                ):
                    waiting.append(pending.pop(0))
                spent = 0.0
                tick = time.perf_counter()
                if options.rebalance and manager.need_adjustment:
                    self._adjust()
                # Admit new work only when nothing waited to resume: it must not starve
                # preempted work.
                may_admit = not suspended
                self._resume(suspended, running)
                progressed = may_admit and self._admit(waiting, running)
                finished, stalled = self._decode(running)
                progressed |= len(running) > len(finished) + len(stalled) or bool(finished)
                for entry in stalled:
                    entry.cache.suspend()
                    running.remove(entry)
                    suspended.append(entry)
                    report.suspensions += 1
                for entry in finished:
                    entry.cache.close()
                    running.remove(entry)
                done += len(finished)
                progressed |= len(stalled) < len(running) + len(stalled) + len(finished) and bool(
                    running or finished
                )
                if not running and suspended and not progressed:
                    # Preempt the latest arrival (recompute it later; its blocks stay cached),
                    # so the earliest requests always finish.
                    victim = max(suspended, key=lambda entry: entry.index)
                    suspended.remove(victim)
                    victim.cache.close()
                    waiting.insert(0, victim.index)
                    report.preemptions += 1
                spent += time.perf_counter() - tick
                self._step_times.append(spent)
                report.steps += 1
                concurrency.append(len(running))
                if report.steps % options.sample_every == 0:
                    self._sample()
                if self.progress is not None:
                    self.progress(done, len(self.workload))
                if running or suspended or waiting:
                    now += options.step_seconds
                elif pending:
                    now = max(now + options.step_seconds, self.workload[pending[0]].arrival)
            self._sample()
            report.simulated_seconds = now
        finally:
            for entry in running + suspended:
                entry.cache.close()
            storage = manager._storage
            report.dropped_pages = manager.num_dropped_pages
            report.pages_moved_to_level = list(storage.num_moved)
            report.bytes_moved_to_level = list(storage.bytes_moved)
            report.records_verified = self.engine.records_checked if self.engine else 0
            manager.clear_reusable_blocks()
            manager.shutdown()
        report.wall_seconds = time.perf_counter() - start
        report.peak_concurrency = max(concurrency, default=0)
        report.mean_concurrency = float(np.mean(concurrency)) if concurrency else 0.0
        times = np.array(self._step_times) * 1e6
        report.manager_us_per_step_mean = float(times.mean()) if times.size else 0.0
        report.manager_us_per_step_p99 = float(np.percentile(times, 99)) if times.size else 0.0
        return report

    # -- scheduling ------------------------------------------------------------------------------

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

    def _resume(self, suspended: list[_Running], running: list[_Running]) -> None:
        for entry in list(suspended):
            if len(running) >= self.options.max_batch or not entry.cache.resume():
                break
            suspended.remove(entry)
            running.append(entry)

    def _admit(self, waiting: list[int], running: list[_Running]) -> bool:
        admitted = False
        while waiting and len(running) < self.options.max_batch:
            index = waiting[0]
            request = self.workload[index]
            prompt = request.tokens()
            tokens = prompt + output_tokens(index, request.output_length)
            cache = self.manager.create_kv_cache(
                None, prompt[:-1], priority_callback=self.policy.priority
            )
            reused = cache.num_committed_tokens
            levels = self._levels_of_reused(cache, reused)
            first_chunk = tokens[reused : min(len(prompt), reused + self.options.prefill_chunk)]
            if not cache.resume() or not self._compute(cache, tokens, first_chunk):
                cache.close()  # no room for it now: admission waits (back-pressure)
                break
            waiting.pop(0)
            self.policy.on_reuse(self.manager, cache)
            report = self.report
            if index not in self._counted:  # a preempted request is counted once
                self._counted.add(index)
                report.requests += 1
                report.prompt_tokens += len(prompt)
                report.hit_tokens += reused
                for level, count in levels.items():
                    report.hit_tokens_by_level[level] += count
            running.append(_Running(index, cache, tokens, len(prompt)))
            admitted = True
        return admitted

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
            return True
        if not cache.resize(cache.history_length + len(new)):
            return False
        cache.commit(new)
        return True

    def _decode(self, running: list[_Running]) -> tuple[list[_Running], list[_Running]]:
        """One engine step of every running request: a prefill chunk, or one decoded token."""
        finished, stalled = [], []
        chunk = self.options.prefill_chunk
        for entry in running:
            position = entry.cache.history_length
            if position >= entry.length:
                finished.append(entry)
            elif position < entry.prompt_length - 1:
                end = min(position + chunk, entry.prompt_length)
                if not self._compute(entry.cache, entry.tokens, entry.tokens[position:end]):
                    stalled.append(entry)
            elif not self._compute(
                entry.cache, entry.tokens, entry.tokens[position : position + 1]
            ):
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
) -> ReplayReport:
    """Replay `workload` through a new manager built from `config`."""
    return Replay(workload, config, options, progress).run()
