"""A digest of every decision the manager takes on the peers' workloads (b) and (c), for
checking that a change meant to be a speed-up changes no decision: run it before and after, the
digests must be equal. Decisions: each request's prefix hit, every drop and move (by slot id)
and re-split (`record_decisions`), and each request's page table (slot ids) after its prefill
and when it closes; every policy, every layout of `benchmarks/bench_manager.py`. On that
workload the policies rarely disagree, so the Mooncake conversation trace is replayed too
(`kvpool replay`'s prefix-cache mode, small caches, with and without lower tiers), where they
do: its hit tokens, per tier, are exact counts.

Run: python scripts/decision_digest.py [--num-requests 1000] [--trace-requests 4000]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_manager import (
    DEFAULT_PEERS,
    layout_config,
    load_workload_module,
)

import kvpool
from kvpool import KVCacheManager
from kvpool.replay.prefix import prefix_cache_hit_rate
from kvpool.replay.workloads import load_mooncake

TRACE = DEFAULT_PEERS.parents[1] / "traces" / "mooncake_conversation_trace.jsonl"


def tables(cache: Any, num_groups: int) -> bytes:
    return b"".join(cache.get_base_page_indices(g).tobytes() for g in range(num_groups))


def digest(requests: list[Any], layout: str, policy: str, workload: Any) -> tuple[str, int]:
    """Workload (b)'s driving (bench_manager.scheduler_cycle) with every decision hashed."""
    with tempfile.TemporaryDirectory(prefix="kvpool-digest-") as disk_dir:
        config = layout_config(layout, workload.PREFIX_POOL_BLOCKS, disk_dir, workload)
        manager = KVCacheManager(dataclasses.replace(config, eviction_policy=policy))
        groups = manager.layout.num_layer_groups
        manager.record_decisions(True)
        sha = hashlib.sha256()
        hits = 0
        running: list[list[Any]] = []
        next_request, decode_len = 0, 128
        while next_request < len(requests) or running:
            for item in running:
                assert item[0].resize(item[0].capacity + 1)
            admitted = []
            while next_request < len(requests) and len(running) + len(admitted) < 64:
                request = requests[next_request]
                next_request += 1
                prompt = request.prompt_token_ids
                cache = manager.create_kv_cache(None, prompt[:-1])
                hit = cache.num_committed_tokens
                assert cache.resume() and cache.resize(len(prompt))
                cache.commit(prompt[hit:])
                hits += hit
                sha.update(b"hit %d " % hit + tables(cache, groups))
                admitted.append([cache, request.output_token_ids, 1])
            for item in running:
                item[0].commit((item[1][item[2] - 1],))
                item[2] += 1
            running += admitted
            still = []
            for item in running:
                if item[2] >= decode_len:
                    sha.update(b"close " + tables(item[0], groups))
                    item[0].close()
                else:
                    still.append(item)
            running = still
            sha.update(repr(manager.take_decisions()).encode())
        manager.shutdown()
    return sha.hexdigest()[:16], hits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--trace-requests", type=int, default=4000)
    parser.add_argument("--layouts", default="full,hybrid,tiers,c")
    parser.add_argument("--policies", default="hazard,lru,lfu")
    parser.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS)
    args = parser.parse_args()
    workload = load_workload_module(args.peers_dir)
    requests = workload.make_prefix_workload(seed=0, num_requests=args.num_requests).requests
    print(f"backend {kvpool.backend()}, {args.num_requests} requests")
    for layout in args.layouts.split(","):
        for policy in args.policies.split(","):
            value, hits = digest(requests, layout, policy, workload)
            print(f"{layout:7} {policy:7} {value} hit tokens {hits}", flush=True)
    trace = load_mooncake(TRACE, limit=args.trace_requests)
    for tiers in ((0, 0), (1, 2)):
        for blocks in (1000, 4000):
            for policy in args.policies.split(","):
                result = prefix_cache_hit_rate(trace, blocks, policy, tier_ratios=tiers)
                print(
                    f"trace {blocks} blocks, tiers {tiers}, {policy:7} hit tokens "
                    f"{result.hit_tokens} {result.hit_tokens_by_tier}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
