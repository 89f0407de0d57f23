"""The cost of the eviction policy: the scheduler-cycle workload (b) of `bench_manager.py` under
`lru` and under each other policy, runs alternating in one process; prints the medians, their
ratio to LRU, and the prefix hit tokens each policy got.

Run: python benchmarks/bench_policy.py [--runs 5] [--policies hazard,lfu] [--layouts full,hybrid,tiers]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_manager import DEFAULT_PEERS, load_workload_module, scheduler_cycle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--policies", default="hazard")
    parser.add_argument("--layouts", default="full,hybrid,tiers")
    parser.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS)
    args = parser.parse_args()
    workload = load_workload_module(args.peers_dir)
    prefix = workload.make_prefix_workload(seed=0, num_requests=args.num_requests)
    policies = ["lru", *args.policies.split(",")]
    results = {}
    for layout in args.layouts.split(","):
        times: dict[str, list[float]] = {policy: [] for policy in policies}
        hits: dict[str, int] = {}
        for _ in range(args.runs):
            for policy in policies:
                result = scheduler_cycle(
                    prefix.requests,
                    layout,
                    workload.PREFIX_POOL_BLOCKS,
                    workload.MAX_BATCH,
                    prefix.params["decode_len"],
                    eviction_policy=policy,
                )
                times[policy].append(result["us_per_step_per_request"])
                hits[policy] = result["prefix_hit_tokens"]
        lru = statistics.median(times["lru"])
        results[layout] = {
            policy: {
                "us": statistics.median(times[policy]),
                "ratio": statistics.median(times[policy]) / lru,
                "prefix_hit_tokens": hits[policy],
            }
            for policy in policies
        }
        for policy, figures in results[layout].items():
            print(
                f"(b) {layout} {policy}: {figures['us']:.2f} us per request-step "
                f"({figures['ratio']:.3f}x lru), {figures['prefix_hit_tokens']:,} hit tokens",
                file=sys.stderr,
            )
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
