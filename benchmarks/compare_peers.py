"""kvpool against vLLM v1 and SGLang on the same seeded workloads, in one invocation.

Builds the peers' virtual environment if needed (../shared/bench/peers/setup.sh, ~4 min once),
runs their harness (peer_bench.py, in that environment) and benchmarks/bench_manager.py (in this
one) with the same sizes and number of runs, and prints the ratios kvpool / peer of the medians:
below 1 means kvpool is faster. (b) also checks that kvpool's prefix hit tokens equal vLLM's;
(c), the hybrid model, compares against vLLM with two KV cache groups and with the six groups
its planner makes, and against SGLang's UnifiedRadixCache.

Run: python benchmarks/compare_peers.py [--runs 3] [--quick] [--out results.json] [--plot bars.svg]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_PEERS = HERE.parents[1] / "shared" / "bench" / "peers"


def run_json(command: list[str], out: Path) -> dict[str, Any]:
    print("$", " ".join(command), file=sys.stderr, flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def ratio(ours: float, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}" if theirs else "-"


def plot(kv: dict[str, Any], vllm: dict[str, Any], sglang: dict[str, Any], path: Path) -> None:
    """Seconds (or us) of each workload for kvpool and each peer, as grouped bars, each group
    scaled to the slowest: the peers' comparison at a glance (docs/benchmarks.md)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def get(result: dict[str, Any] | None, key: str) -> float | None:
        return None if not result else result.get(key)

    groups: list[tuple[str, dict[str, float | None]]] = []
    for n in kv["a"]:
        groups.append(
            (
                f"(a) churn N={n}",
                {
                    "kvpool": kv["a"][n]["cycle_us"],
                    "vLLM": get(vllm.get("a", {}).get(n), "cycle_us"),
                    "SGLang": get(sglang.get("a", {}).get(n), "cycle_us"),
                },
            )
        )
    groups.append(
        (
            "(b) scheduler cycle",
            {
                "kvpool": kv["b"]["total_wall_s"],
                "vLLM": get(vllm.get("b"), "total_wall_s"),
                "SGLang": get(sglang.get("b"), "total_wall_s"),
            },
        )
    )
    groups.append(
        (
            "(c) hybrid model\n(vLLM: its 6-group plan)",
            {
                "kvpool": kv["c"]["total_wall_s"],
                "vLLM": get(vllm.get("c_6groups") or vllm.get("c"), "total_wall_s"),
                "SGLang": get(sglang.get("c"), "total_wall_s"),
            },
        )
    )
    names = ["kvpool", "vLLM", "SGLang"]
    figure, axes = plt.subplots(figsize=(8, 3.6))
    width = 0.26
    for i, name in enumerate(names):
        heights = []
        for _, values in groups:
            known = [v for v in values.values() if v]
            value = values.get(name)
            heights.append(value / max(known) if value else 0.0)
        axes.bar([g + (i - 1) * width for g in range(len(groups))], heights, width, label=name)
    axes.set_xticks(range(len(groups)), [label for label, _ in groups], fontsize=8)
    axes.set_ylabel("time, relative to the slowest")
    axes.set_title("kvpool, vLLM and SGLang on the same seeded workloads (lower is faster)")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 run, 200 requests, 100 cycles")
    parser.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS)
    parser.add_argument("--peer-python", default="/tmp/peervenv/bin/python")
    parser.add_argument("--no-setup", action="store_true", help="do not run the peers' setup.sh")
    parser.add_argument("--out", help="also write every figure here (JSON)")
    parser.add_argument("--plot", help="bars of kvpool's time against each peer's (.svg, .png)")
    args = parser.parse_args()
    runs, requests, iterations = (1, 200, 100) if args.quick else (args.runs, 2000, 1000)
    if not args.no_setup:
        subprocess.run(["bash", str(args.peers_dir / "setup.sh")], check=True)
    sizes = ["--num-requests", str(requests), "--churn-iters", str(iterations)]
    with tempfile.TemporaryDirectory() as tmp:
        peers = run_json(
            [
                args.peer_python,
                str(args.peers_dir / "peer_bench.py"),
                "--runs",
                str(runs),
                "--workloads",
                "a,b,c",
                *sizes,
                "--out",
                f"{tmp}/peers.json",
            ],
            Path(tmp) / "peers.json",
        )
        ours = run_json(
            [
                sys.executable,
                str(HERE / "bench_manager.py"),
                "--runs",
                str(runs),
                "--workloads",
                "a,b,c",
                "--layouts",
                "full,hybrid,tiers,lru",
                "--peers-dir",
                str(args.peers_dir),
                *sizes,
                "--out",
                f"{tmp}/kvpool.json",
            ],
            Path(tmp) / "kvpool.json",
        )
    kv = ours["medians"]
    vllm = peers["results"].get("vllm", {})
    sglang = peers["results"].get("sglang", {})
    lines = [f"medians of {runs} run(s); ratio = kvpool / peer (below 1: kvpool is faster)", ""]
    lines.append("(a) allocate N blocks + free them, us per cycle")
    lines.append(f"{'N':>6} {'kvpool':>9} {'vLLM':>9} {'ratio':>6} {'SGLang':>9} {'ratio':>6}")
    for n, result in kv["a"].items():
        theirs = vllm.get("a", {}).get(n, {}).get("cycle_us")
        sgl = sglang.get("a", {}).get(n, {}).get("cycle_us")
        lines.append(
            f"{n:>6} {result['cycle_us']:9.2f} {theirs or 0:9.2f} {ratio(result['cycle_us'], theirs):>6}"
            f" {sgl or 0:9.2f} {ratio(result['cycle_us'], sgl):>6}"
        )
    lines.append("")
    lines.append("(b) scheduler cycle: total seconds, us per request-step, prefix hit tokens")
    for name, result in [("vLLM", vllm.get("b")), ("SGLang", sglang.get("b"))]:
        if result:
            lines.append(
                f"{name:>14} {result['total_wall_s']:7.3f} s {result['us_per_step_per_request']:7.2f} us"
                f" {result['prefix_hit_tokens']:>10,}"
            )
    for key, label in [
        ("b", "kvpool"),
        ("b_hybrid", "kvpool hybrid"),
        ("b_tiers", "kvpool tiers"),
        ("b_lru", "kvpool lru"),
    ]:
        result = kv[key]
        lines.append(
            f"{label:>14} {result['total_wall_s']:7.3f} s {result['us_per_step_per_request']:7.2f} us"
            f" {result['prefix_hit_tokens']:>10,}"
            f"   vs vLLM {ratio(result['total_wall_s'], vllm.get('b', {}).get('total_wall_s'))}"
            f"  vs SGLang {ratio(result['total_wall_s'], sglang.get('b', {}).get('total_wall_s'))}"
            f"  vs kvpool full {ratio(result['total_wall_s'], kv['b']['total_wall_s'])}"
        )
    same = vllm.get("b", {}).get("prefix_hit_tokens") == kv["b"]["prefix_hit_tokens"]
    lines.append(f"hit tokens equal to vLLM's: {same}")
    lines.append("")
    lines.append(
        "(c) hybrid model (5 window layers + 1 full): total seconds, hit tokens, kvpool / peer"
    )
    ours_c = kv["c"]
    for name, result in [
        ("vLLM 2 groups", vllm.get("c")),
        ("vLLM 6 groups", vllm.get("c_6groups")),
        ("SGLang", sglang.get("c")),
    ]:
        if result:
            lines.append(
                f"{name:>14} {result['total_wall_s']:7.3f} s {result['prefix_hit_tokens']:>10,}"
                f"   kvpool / {name}: {ratio(ours_c['total_wall_s'], result['total_wall_s'])}"
            )
    lines.append(
        f"{'kvpool':>14} {ours_c['total_wall_s']:7.3f} s {ours_c['prefix_hit_tokens']:>10,}"
    )
    print("\n".join(lines))
    if args.plot:
        plot(kv, vllm, sglang, Path(args.plot))
    if args.out:
        Path(args.out).write_text(json.dumps({"peers": peers, "kvpool": ours}, indent=1) + "\n")


if __name__ == "__main__":
    main()
