"""Continuous batching: many requests with shared system prompts under memory pressure, every
record verified at every step, invariants checked after every call."""

import random

from kvpool import GpuCacheTierConfig, KVCacheManager
from tests.engine_check import CheckingEngine
from tests.helpers import MiB, hybrid_layers, make_config

TPB = 16


class Request:
    def __init__(self, rid, tokens, prompt_length):
        self.rid, self.tokens, self.prompt_length = rid, tokens, prompt_length
        self.cache = None
        self.admitted = 0


def make_requests(rng, count):
    system_prompts = [
        [rng.randrange(50_000) for _ in range(rng.randrange(16, 80))] for _ in range(5)
    ]
    requests = []
    for rid in range(count):
        prefix = rng.choice(system_prompts) if rng.random() < 0.7 else []
        user = [rng.randrange(50_000) for _ in range(rng.randrange(4, 60))]
        output = [rng.randrange(50_000) for _ in range(rng.randrange(4, 40))]
        requests.append(Request(rid, prefix + user + output, len(prefix) + len(user)))
    return requests


def test_continuous_batching_under_pressure():
    rng = random.Random(1234)
    layers = hybrid_layers(TPB, num_layers=4, window=64, sinks=4, repeats=32)
    m = KVCacheManager(
        make_config(layers=layers, tokens_per_block=TPB, tiers=[GpuCacheTierConfig(2 * MiB)])
    )
    total = m.get_storage_statistics(0)[0].total
    assert total == 64
    engine = CheckingEngine(m)
    waiting = make_requests(rng, 220)
    arrivals = sorted(rng.randrange(0, 600) for _ in waiting)
    running, suspended, finished = [], [], []
    counters = {"reused": 0, "suspended": 0, "resumed": 0, "recomputed": 0, "steps": 0}
    step = 0
    while waiting or running or suspended:
        step += 1
        assert step < 20_000, "scheduler made no progress"
        progressed = False
        # Resume suspended requests first (oldest first); admit arrivals only when none was
        # waiting to resume, so new work never starves preempted work.
        may_admit = not suspended
        for request in list(suspended):
            if request.cache.resume():
                suspended.remove(request)
                running.append(request)
                counters["resumed"] += 1
        while may_admit and waiting and arrivals[0] <= step and len(running) < 8:
            request = waiting[0]
            # Always recompute at least the last prompt token.
            cache = m.create_kv_cache(None, request.tokens[: request.prompt_length - 1])
            if not cache.resume():
                cache.close()  # no room now: try again later
                break
            waiting.pop(0)
            arrivals.pop(0)
            request.cache = cache
            request.admitted = step
            counters["reused"] += cache.num_committed_tokens
            running.append(request)
            engine.check(cache, request.tokens)
        for request in list(running):
            cache = request.cache
            done = cache.history_length
            chunk = (
                request.tokens[done : request.prompt_length]
                if done < request.prompt_length
                else request.tokens[done : done + 1]
            )
            if engine.step(cache, request.tokens, chunk):
                counters["steps"] += 1
                progressed = True
                engine.check(cache, request.tokens)
                if cache.history_length == len(request.tokens):
                    cache.close()
                    running.remove(request)
                    finished.append(request)
            else:
                cache.suspend()
                running.remove(request)
                suspended.append(request)
                counters["suspended"] += 1
        if not progressed and suspended and not running:
            # No request could take a step: preempt the most recently admitted suspended request
            # by recompute (close it, queue it again: its committed blocks stay cached and are
            # reused), so the oldest ones always get to finish.
            victim = max(suspended, key=lambda r: r.admitted)
            suspended.remove(victim)
            victim.cache.close()
            victim.cache = None
            waiting.insert(0, victim)
            arrivals.insert(0, step)
            counters["recomputed"] += 1
    assert len(finished) == 220
    assert counters["suspended"] > 0 and counters["resumed"] > 0, counters
    assert counters["reused"] > 2000, counters
    assert m.num_dropped_pages > 0
    assert engine.records_checked > 1_000_000
    assert m.num_open_kv_caches == 0
    m.clear_reusable_blocks()
    stats = m.get_storage_statistics(0)[0]
    assert stats.free == stats.total == 64 and stats.evictable == 0
    m.shutdown()
