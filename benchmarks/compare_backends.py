"""The native backend against the python one (the reference), on the same benchmarks, in one
invocation: each benchmark runs in a child process per backend (`KVPOOL_BACKEND`), the two
alternating `--rounds` times, and the ratio native / python of the medians is printed (below 1:
the native backend is faster). (b) also checks that both found the same prefix hits.

Benchmarks: (a) block churn, (b) the scheduler cycle (default policy), (b) with LRU, (b) with
host and disk levels, (c) the hybrid model (benchmarks/bench_manager.py), the decode step of
a Llama-like and a hybrid model (benchmarks/bench_decode.py), `adjust()` moving a pool group's
every page and its ratio to a plain copy of the same bytes (benchmarks/bench_adjust.py).

Run: python benchmarks/compare_backends.py [--rounds 3] [--num-requests 2000] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BACKENDS = ("native", "python")


def run(backend: str, command: list[str], to_file: bool = True) -> dict[str, Any]:
    """The JSON a benchmark writes (to `--out`, or with `to_file=False` to stdout)."""
    env = dict(os.environ, KVPOOL_BACKEND=backend)
    env.pop("KVPOOL_DEBUG", None)
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "out.json"
        extra = ["--out", str(out)] if to_file else []
        done = subprocess.run(
            [*command, *extra], env=env, check=True, capture_output=True, text=True
        )
        return dict(json.loads(out.read_text() if to_file else done.stdout))


def check_backend(backend: str) -> str:
    env = dict(os.environ, KVPOOL_BACKEND=backend)
    probe = "import kvpool; print(kvpool.backend_info().describe())"
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    for backend in BACKENDS:
        ran = check_backend(backend)
        if ran != backend:
            sys.exit(f"compare_backends: KVPOOL_BACKEND={backend} runs {ran}")
    manager = [
        sys.executable,
        str(HERE / "bench_manager.py"),
        "--workloads",
        "a,b,c",
        "--layouts",
        "full,lru,tiers",
        "--runs",
        "1",
        "--num-requests",
        str(args.num_requests),
    ]
    decode = [sys.executable, str(HERE / "bench_decode.py"), "--repeats", "1"]
    adjust = [sys.executable, str(HERE / "bench_adjust.py"), "--runs", "3"]
    figures: dict[str, dict[str, list[float]]] = {backend: {} for backend in BACKENDS}
    hits: dict[str, set[int]] = {backend: set() for backend in BACKENDS}
    for round_ in range(args.rounds):
        for backend in BACKENDS if round_ % 2 == 0 else BACKENDS[::-1]:
            found = figures[backend]
            medians = run(backend, manager)["medians"]
            for n, churn in medians["a"].items():
                found.setdefault(f"(a) churn N={n}, us", []).append(churn["cycle_us"])
            for key, name in [
                ("b", "(b) cycle, default policy, s"),
                ("b_lru", "(b) cycle, LRU, s"),
                ("b_tiers", "(b) cycle, GPU+host+disk, s"),
                ("c", "(c) hybrid model, s"),
            ]:
                found.setdefault(name, []).append(medians[key]["total_wall_s"])
            hits[backend].add(medians["b"]["prefix_hit_tokens"])
            for model, name in [("llama-3-8b", "Llama"), ("gemma-3-1b", "hybrid")]:
                result = run(backend, [*decode, "--model", model], to_file=False)
                found.setdefault(f"decode step, {name}, us per request-step", []).append(
                    result["kvpool_us_per_request_step"]
                )
            result = run(backend, adjust, to_file=False)["medians"]
            found.setdefault("adjust(), ms", []).append(result["adjust_ms"])
            found.setdefault("adjust() / its copy", []).append(result["ratio_adjust_to_copy"])
        print(f"[compare_backends] round {round_ + 1} of {args.rounds} done", file=sys.stderr)
    if hits["native"] != hits["python"] or len(hits["native"]) != 1:
        sys.exit(f"compare_backends: (b) prefix hits differ: {hits}")
    rows = []
    for name in figures["native"]:
        native = statistics.median(figures["native"][name])
        python = statistics.median(figures["python"][name])
        rows.append(
            {"benchmark": name, "native": native, "python": python, "ratio": native / python}
        )
    width = max(len(row["benchmark"]) for row in rows)
    print(f"{'benchmark':<{width}}  {'native':>9}  {'python':>9}  native/python")
    for row in rows:
        print(
            f"{row['benchmark']:<{width}}  {row['native']:>9.3f}  {row['python']:>9.3f}"
            f"  {row['ratio']:.2f}"
        )
    print(f"(b) prefix hit tokens, both backends: {hits['native'].pop()}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
