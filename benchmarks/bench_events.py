"""The cost of KV events: the scheduler-cycle workload (b) of `bench_manager.py` with events off
and on (published over ZMQ from the publisher's thread, no subscriber), runs alternating in one
process; prints the medians and their ratio.

Run: python benchmarks/bench_events.py [--runs 5] [--num-requests 2000] [--layouts full,hybrid]
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
    parser.add_argument("--layouts", default="full,hybrid")
    parser.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS)
    args = parser.parse_args()
    workload = load_workload_module(args.peers_dir)
    prefix = workload.make_prefix_workload(seed=0, num_requests=args.num_requests)
    results = {}
    for layout in args.layouts.split(","):
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.runs):
            for events in (False, True):
                result = scheduler_cycle(
                    prefix.requests,
                    layout,
                    workload.PREFIX_POOL_BLOCKS,
                    workload.MAX_BATCH,
                    prefix.params["decode_len"],
                    kv_events=events,
                )
                times[events].append(result["us_per_step_per_request"])
        off, on = statistics.median(times[False]), statistics.median(times[True])
        results[layout] = {"off_us": off, "on_us": on, "ratio": on / off}
        print(
            f"(b) {layout}: {off:.2f} us per request-step without events, {on:.2f} with "
            f"({on / off:.3f}x)",
            file=sys.stderr,
        )
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
