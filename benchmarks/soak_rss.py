"""A long run through one manager, its memory sampled: the resident set must stay flat.

The peers' scheduler-cycle workload ((b) of bench_manager.py: 2,000 requests, continuous
batching of 64, 128 output tokens each) runs `--rounds` times in a row through the same
manager (layout `tiers`: GPU, host and disk levels, so pages move and are dropped throughout),
with a new random salt per round so that every round adds new blocks as well as reusing the
shared prefixes. The resident set size is printed after each round, with the eviction policy's
ghost table (blocks remembered after they were dropped, up to 8 per block of capacity: about
120,000 new ones a round here, full after 9 rounds). Once that table is full the resident set
must not grow: a leak of one object per block or per request would show as megabytes a round.

Run: python benchmarks/soak_rss.py [--rounds 14] [--num-requests 2000]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.pop("KVPOOL_DEBUG", None)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_manager

import kvpool
from kvpool import KVCacheManager, ReuseScope


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def one_round(manager: KVCacheManager, requests: list[Any], salt: int, decode_len: int) -> int:
    """The scheduler cycle of bench_manager.py once; returns the prefix hit tokens."""
    running: list[bench_manager.Running] = []
    next_request, hits = 0, 0
    while next_request < len(requests) or running:
        for item in running:
            if not item.cache.resize(item.cache.capacity + 1):
                raise RuntimeError("out of pages in decode")
        admitted = []
        while next_request < len(requests) and len(running) + len(admitted) < 64:
            prompt = requests[next_request].prompt_token_ids
            scope = ReuseScope(salt=salt) if next_request % 2 else None  # half shared, half new
            next_request += 1
            cache = manager.create_kv_cache(scope, prompt[:-1])
            hit = cache.num_committed_tokens
            if not (cache.resume() and cache.resize(len(prompt))):
                raise RuntimeError("out of pages in prefill")
            cache.commit(prompt[hit:])
            hits += hit
            admitted.append(
                bench_manager.Running(cache, requests[next_request - 1].output_token_ids)
            )
        for item in running:
            item.cache.commit((item.outputs[item.produced - 1],))
            item.produced += 1
        running += admitted
        still = []
        for item in running:
            if item.produced >= decode_len:
                item.cache.close()
            else:
                still.append(item)
        running = still
    return hits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=14)
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--peers-dir", type=Path, default=bench_manager.DEFAULT_PEERS)
    args = parser.parse_args()
    workload = bench_manager.load_workload_module(args.peers_dir)
    prefix = workload.make_prefix_workload(seed=0, num_requests=args.num_requests)
    samples = []
    with tempfile.TemporaryDirectory(prefix="kvpool-soak-") as disk_dir:
        config = bench_manager.layout_config("tiers", workload.PREFIX_POOL_BLOCKS, disk_dir)
        manager = KVCacheManager(config)
        for salt in range(args.rounds):
            hits = one_round(manager, prefix.requests, salt, prefix.params["decode_len"])
            gc.collect()
            policy = manager._policy
            ghosts = 0 if policy is None else len(getattr(policy, "ghosts", ()))
            full = policy is None or ghosts >= getattr(policy, "ghost_limit", 0) * 0.999
            sample = {"round": salt, "rss_mib": round(rss_mib(), 1), "hit_tokens": hits}
            samples.append({**sample, "ghosts": ghosts, "ghost_table_full": full})
            print(json.dumps(samples[-1]), flush=True)
        manager.shutdown()
    settled = [sample for sample in samples if sample["ghost_table_full"]]
    if len(settled) < 2:
        sys.exit("soak_rss: the ghost table never filled; run more --rounds")
    growth = settled[-1]["rss_mib"] - settled[0]["rss_mib"]
    print(
        f"backend {kvpool.backend()}: RSS {settled[0]['rss_mib']} -> {settled[-1]['rss_mib']} MiB"
        f" over rounds {settled[0]['round']}-{settled[-1]['round']} ({growth:+.1f} MiB)"
    )


if __name__ == "__main__":
    main()
