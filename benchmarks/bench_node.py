"""One KV cache per node against a cache per engine, and what the node daemon's socket costs.

1. Hits: the multi-turn workload of benchmarks/vllm_connector.py (a first message of 1,200
   tokens, 250 new tokens and a 16-token answer a turn; each turn of a conversation after a turn
   of every other), sent round-robin to `--engines` engines; with the same total host memory,
   per-engine managers (each `--host-mib / engines`, in this process: the decisions a
   connector's own manager takes) against one `kvpool serve` daemon holding all of it (its
   engines' clients over the socket). Prompt tokens served from kvpool are counted; the ratio is
   shared / per-engine. (Store level: no model runs; TTFT needs vLLM engines.)
2. Latency: a lookup that hits (48 blocks) in process (`LocalStore`) against the same lookup
   through the daemon (`NodeClient`); the difference is the daemon's added latency. Then
   `--clients` processes issuing lookups at once: each lookup's latency, p50 and p99.

   Then `--clients` processes issuing lookups at once, back to back (saturating the daemon's
   thread), and paced (`--rate` a second each, Poisson arrivals).

Run: python benchmarks/bench_node.py [--engines 2] [--conversations 15] [--host-mib 8]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from tests.node_helpers import BLOCK, Daemon, client, hello, pin, socket_dir  # noqa: E402

from kvpool.manager import KVCacheManager  # noqa: E402
from kvpool.node.settings import DaemonSettings  # noqa: E402
from kvpool.node.store import Hit, LocalStore, SavePlan  # noqa: E402

MiB = 1 << 20


def workload(conversations: int, turns: int, seed: int = 0) -> list[tuple[int, list[int]]]:
    """(conversation, prompt tokens) in arrival order: turn t of every conversation, then t+1."""
    rng = random.Random(seed)
    history = [[rng.randrange(50_000) for _ in range(1200)] for _ in range(conversations)]
    requests = []
    for _ in range(turns):
        for c in range(conversations):
            requests.append((c, list(history[c])))
            history[c] += [rng.randrange(50_000) for _ in range(16 + 250)]  # answer, new message
    return requests


def serve(store, key: str, tokens: list[int]) -> int:
    """One request on an engine: look up its prompt, save it (the answer's tokens are in the
    next prompt); the tokens served from kvpool."""
    usable = (len(tokens) - 1) // BLOCK * BLOCK
    found = store.lookup(key, None, tokens[:usable], True)
    served = found.tokens if isinstance(found, Hit) else 0
    if isinstance(found, Hit):
        store.release(found.handle)
    plan = store.plan_save(None, tokens[:usable])
    if isinstance(plan, SavePlan):
        store.commit_save(plan.handle, tokens[plan.first_block * BLOCK : usable], plan.first_block)
    return served


def local_store(host_bytes: int) -> LocalStore:
    settings = DaemonSettings(socket="/tmp/unused.sock", host_bytes=host_bytes)
    return LocalStore(KVCacheManager(settings.manager_config(hello())), 0)


def hits(args: argparse.Namespace, directory: str) -> tuple[int, int, int]:
    requests = workload(args.conversations, args.turns)
    total = sum((len(t) - 1) // BLOCK * BLOCK for _, t in requests)
    share = args.host_mib * MiB // args.engines
    engines = [local_store(share) for _ in range(args.engines)]
    per_engine = sum(
        serve(engines[i % args.engines], f"r{i}", tokens) for i, (_, tokens) in enumerate(requests)
    )
    daemon = Daemon(f"{directory}/hits.sock", "--host-bytes", f"{args.host_mib}MiB").start()
    try:
        clients = [client(daemon.socket) for _ in range(args.engines)]
        shared = sum(
            serve(clients[i % args.engines], f"r{i}", tokens)
            for i, (_, tokens) in enumerate(requests)
        )
    finally:
        daemon.stop()
    return per_engine, shared, total


def timed_lookups(store, tokens: list[int], count: int, tag: str, rate: float = 0.0) -> list[float]:
    """Each lookup's seconds (`rate`: lookups per second at most; 0: back to back)."""
    found = []
    for i in range(count):
        if rate:
            time.sleep(random.expovariate(rate))
        started = time.perf_counter()
        hit = store.lookup(f"{tag}{i}", None, tokens, True)
        found.append(time.perf_counter() - started)
        assert isinstance(hit, Hit), hit
        store.release(hit.handle)
    return found


def one_client(sock: str, tokens: list[int], count: int, rate: float, poll_s, cpus, start, queue):
    if cpus is not None:
        pin(os.getpid(), cpus)
    engine = client(sock, poll_s=poll_s)
    start.wait()
    queue.put(timed_lookups(engine, tokens, count, "c", rate))


def p99(values: list[float]) -> float:
    return sorted(values)[int(len(values) * 0.99)]


def latency(args: argparse.Namespace, directory: str) -> dict[str, float]:
    tokens = list(range(10_000, 10_000 + 48 * BLOCK))
    local = local_store(16 * MiB)
    serve(local, "warm", tokens + [0])
    polls = ("--busy-poll-us", str(args.busy_poll_us))
    daemon = Daemon(f"{directory}/lat.sock", "--host-bytes", "16MiB", *polls).start()
    try:
        if args.daemon_cpus is not None:
            assert daemon.process is not None
            pin(daemon.process.pid, args.daemon_cpus)
        engine = client(daemon.socket, poll_s=args.node_poll_us / 1e6)
        serve(engine, "warm", tokens + [0])
        rounds = []
        for _ in range(3):  # alternating, medians
            rounds.append(
                (
                    timed_lookups(local, tokens, args.lookups, "l"),
                    timed_lookups(engine, tokens, args.lookups, "d"),
                )
            )
        inproc = [t for r in rounds for t in r[0]]
        remote = [t for r in rounds for t in r[1]]
        together = {
            rate: concurrent(args, daemon.socket, tokens, rate) for rate in (0.0, args.rate)
        }
    finally:
        daemon.stop()
    return {
        "in_process_median_us": statistics.median(inproc) * 1e6,
        "daemon_median_us": statistics.median(remote) * 1e6,
        "added_median_us": (statistics.median(remote) - statistics.median(inproc)) * 1e6,
        "in_process_p99_us": p99(inproc) * 1e6,
        "daemon_p99_us": p99(remote) * 1e6,
        "saturated_median_us": statistics.median(together[0.0]) * 1e6,
        "saturated_p99_us": p99(together[0.0]) * 1e6,
        "paced_median_us": statistics.median(together[args.rate]) * 1e6,
        "paced_p99_us": p99(together[args.rate]) * 1e6,
    }


def concurrent(args: argparse.Namespace, sock: str, tokens: list[int], rate: float) -> list[float]:
    """`--clients` processes looking up at once (`rate` each, 0: back to back)."""
    context = multiprocessing.get_context("fork")
    start, queue = context.Event(), context.Queue()
    workers = [
        context.Process(
            target=one_client,
            args=(
                sock,
                tokens,
                args.lookups,
                rate,
                args.node_poll_us / 1e6,
                args.client_cpus,
                start,
                queue,
            ),
        )
        for _ in range(args.clients)
    ]
    for worker in workers:
        worker.start()
    time.sleep(1.0)
    start.set()
    together = [t for _ in workers for t in queue.get(timeout=600)]
    for worker in workers:
        worker.join(60)
    return together


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=15)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--host-mib", type=int, default=8, help="total host memory (MiB)")
    parser.add_argument("--lookups", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument(
        "--rate", type=float, default=200.0, help="lookups per second per client, paced run"
    )
    parser.add_argument("--no-latency", action="store_true", help="the hits only")
    parser.add_argument("--busy-poll-us", type=int, default=200, help="the daemon's poll")
    parser.add_argument("--node-poll-us", type=int, default=300, help="each client's poll")
    parser.add_argument(
        "--daemon-cpus", default=None,
        help="CPUs of the daemon in the latency runs (e.g. 1: a core of its own, as a node gives it)",
    )  # fmt: skip
    parser.add_argument("--client-cpus", default=None, help="CPUs of the client processes, e.g. 0")
    args = parser.parse_args()
    import kvpool

    directory = socket_dir()
    try:
        per_engine, shared, total = hits(args, directory)
        print(f"backend: {kvpool.backend()}; {args.engines} engines, round-robin, "
              f"{args.conversations} conversations x {args.turns} turns, "
              f"{args.host_mib} MiB of host memory in all")  # fmt: skip
        print("| caches | prompt tokens from kvpool | of all prompt tokens |")
        print("|---|---|---|")
        print(f"| one per engine ({args.host_mib / args.engines:g} MiB each) | {per_engine:,} | {per_engine / total:.1%} |")  # fmt: skip
        print(f"| one node daemon ({args.host_mib} MiB) | {shared:,} | {shared / total:.1%} |")
        print(f"shared / per-engine: {shared / max(per_engine, 1):.2f}x")
        if args.no_latency:
            return
        found = latency(args, directory)
        print(
            f"lookup, 48 blocks, hit: in process {found['in_process_median_us']:.1f} us "
            f"(p99 {found['in_process_p99_us']:.1f}), through the daemon "
            f"{found['daemon_median_us']:.1f} us (p99 {found['daemon_p99_us']:.1f}): "
            f"added {found['added_median_us']:.1f} us"
        )
        print(f"{args.clients} clients at once, back to back: median "
              f"{found['saturated_median_us']:.1f} us, p99 {found['saturated_p99_us']:.1f} us; "
              f"{args.rate:g} lookups/s each: median {found['paced_median_us']:.1f} us, "
              f"p99 {found['paced_p99_us']:.1f} us")  # fmt: skip
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
