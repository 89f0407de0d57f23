"""The cost of KV events: the scheduler-cycle workload (b) of `bench_manager.py` with events off
and on (published over ZMQ from the publisher's thread, no subscriber), runs alternating in one
process; prints the medians and their ratio.

Run: python benchmarks/bench_events.py [--runs 5] [--num-requests 2000] [--layouts full,hybrid]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_manager import cycle_variants, variant_options


def main() -> None:
    parser = variant_options(__doc__.splitlines()[0], layouts="full,hybrid")
    args = parser.parse_args()
    runs = cycle_variants(args, {"off": {}, "on": {"kv_events": True}})
    results = {}
    for layout, by_variant in runs.items():
        off, on = (
            statistics.median(r["us_per_step_per_request"] for r in by_variant[name])
            for name in ("off", "on")
        )
        results[layout] = {"off_us": off, "on_us": on, "ratio": on / off}
        print(
            f"(b) {layout}: {off:.2f} us per request-step without events, {on:.2f} with "
            f"({on / off:.3f}x)",
            file=sys.stderr,
        )
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
