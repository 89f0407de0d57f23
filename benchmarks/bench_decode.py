"""Decode-step cost of the manager's bookkeeping: 64 running requests, one token each per step.

Each request-step is `resize(capacity + 1)` then `commit([token])`, the calls an engine makes per
generated token; every 32nd step a block fills, is hashed and goes into the radix tree, and for
sliding-window layers a block leaves the window. No KV bytes are written.

Baseline, in the same process: a minimal pure-Python request object whose step appends the
token to a list and bumps two counters (the least any Python bookkeeping can do), so the ratio
says how many such trivial steps one kvpool step costs, whatever the machine.

Run: python benchmarks/bench_decode.py [--model gemma-3-1b] [--steps 512] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.pop("KVPOOL_DEBUG", None)  # the invariant checker must be off when measuring

from kvpool import GpuCacheTierConfig, KVCacheManager, KVCacheManagerConfig
from kvpool.presets import PRESETS


class MinimalRequest:
    __slots__ = ("capacity", "committed", "tokens")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.capacity = self.committed = 0

    def step(self, token: int) -> None:
        self.capacity += 1
        self.tokens.append(token)
        self.committed += 1


def run_baseline(batch: int, steps: int) -> float:
    requests = [MinimalRequest() for _ in range(batch)]
    start = time.perf_counter()
    for step in range(steps):
        for index, request in enumerate(requests):
            request.step(step * batch + index)
    return (time.perf_counter() - start) / (batch * steps)


def run_kvpool(model: str, batch: int, steps: int, prompt: int) -> tuple[float, dict[str, int]]:
    tpb = 32
    layers = PRESETS[model].layers(tpb)
    config = KVCacheManagerConfig(tpb, [GpuCacheTierConfig(64 << 30)], layers)
    manager = KVCacheManager(config)
    caches = []
    for index in range(batch):
        cache = manager.create_kv_cache()
        assert cache.resume()
        assert cache.resize(prompt)
        cache.commit(range(index * 100_000, index * 100_000 + prompt))
        caches.append(cache)
    start = time.perf_counter()
    for step in range(steps):
        for index, cache in enumerate(caches):
            if not cache.resize(cache.capacity + 1):
                raise RuntimeError("out of pages: raise the quota")
            cache.commit([1_000_000 + step * batch + index])
    elapsed = (time.perf_counter() - start) / (batch * steps)
    stats = manager.get_storage_statistics(0)
    for cache in caches:
        cache.close()
    manager.clear_reusable_blocks()
    manager.shutdown()
    return elapsed, {"slots_per_group": [s.total for s in stats]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-1b", choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    kvpool_times, baseline_times = [], []
    for _ in range(args.repeats):
        baseline_times.append(run_baseline(args.batch, args.steps))
        seconds, info = run_kvpool(args.model, args.batch, args.steps, args.prompt)
        kvpool_times.append(seconds)
    kvpool_us = statistics.median(kvpool_times) * 1e6
    baseline_us = statistics.median(baseline_times) * 1e6
    print(
        json.dumps(
            {
                "benchmark": "decode_step",
                "model": args.model,
                "batch": args.batch,
                "steps": args.steps,
                "kvpool_us_per_request_step": round(kvpool_us, 3),
                "kvpool_us_per_batch_step": round(kvpool_us * args.batch, 1),
                "baseline_us_per_request_step": round(baseline_us, 4),
                "ratio_kvpool_to_baseline": round(kvpool_us / baseline_us, 1),
                **info,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
