"""The cost of the eviction policy: the scheduler-cycle workload (b) of `bench_manager.py` under
`lru` and under each other policy, runs alternating in one process; prints the medians, their
ratio to LRU, and the prefix hit tokens each policy got.

Run: python benchmarks/bench_policy.py [--runs 5] [--policies hazard,lfu] [--layouts full,hybrid,tiers]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_manager import cycle_variants, variant_options


def main() -> None:
    parser = variant_options(__doc__.splitlines()[0], layouts="full,hybrid,tiers")
    parser.add_argument("--policies", default="hazard")
    args = parser.parse_args()
    policies = ["lru", *args.policies.split(",")]
    runs = cycle_variants(args, {policy: {"eviction_policy": policy} for policy in policies})
    results = {}
    for layout, by_policy in runs.items():
        medians = {
            policy: statistics.median(r["us_per_step_per_request"] for r in by_policy[policy])
            for policy in policies
        }
        results[layout] = {
            policy: {
                "us": medians[policy],
                "ratio": medians[policy] / medians["lru"],
                "prefix_hit_tokens": by_policy[policy][-1]["prefix_hit_tokens"],
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
