"""Does a slow shared tier hold vLLM's scheduler? vLLM's OpenAI server with kvpool's connector,
its Valkey server behind a proxy that delays every reply (`--delay-ms`, 100 by default: a
server across a congested network), against the same server without a remote tier.

The workload, the same in every row: `--requests` requests sent at a steady rate, a third of
them a prompt whose prefix only the Valkey server holds (written there beforehand by another
server: they must fetch it), the rest a prompt this server already holds in its host memory
(warmed before the measured phase: they need nothing from Valkey). Greedy, a few tokens each.

Rows: no remote tier; remote tier with synchronous lookups (`async_lookups: false`, the
connector's former behaviour: the lookup fetches inside vLLM's scheduler step); remote tier
with asynchronous lookups (the default: "not yet" to vLLM while the look-ahead threads fetch).
Columns: time to first token (client side, streamed) p50 and p99 of each class, the local
class's p99 against the row without a remote tier (the goal: at most 1.1x), and vLLM's
scheduler step (`Scheduler.schedule`, timed in the engine core by a `sitecustomize` hook)
p50 and p99 over the measured phase's steps that ran requests, and the number of empty steps
(vLLM's engine loop steps again at once while a request waits: the connector pauses them). Every row's tokens are checked equal to the first row's.

A second table: the CPU seconds each part used over each row's measured phase (the server's
engine core and worker processes, its API server, the valkey-server, the delaying proxy's
thread in this process, and every other process of the machine): on a small machine the
proxy and the server compete with vLLM for the cores, and so does anyone else's work (a
row whose "others" column is large was measured on a busy machine).

Run (in the venv scripts/vllm_venv.sh makes):
    build/vllm-venv/bin/python benchmarks/bench_vllm_lookups.py [--requests 60] [--delay-ms 100]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.delay_proxy import DelayProxy  # noqa: E402
from tests.valkey_servers import ValkeyServer  # noqa: E402
from tests.vllm_server import Server  # noqa: E402

BLOCK = 32
STEP_HOOK = """
import os, time
path = os.environ.get("KVPOOL_BENCH_STEPS")
if path:
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except Exception:
        Scheduler = None
    if Scheduler is not None:
        original = Scheduler.schedule
        log = open(path, "a", buffering=1)
        def schedule(self, *args, **kwargs):
            started = time.perf_counter()
            output = original(self, *args, **kwargs)
            log.write(f"{time.perf_counter() - started} {output.total_num_scheduled_tokens}\\n")
            return output
        Scheduler.schedule = schedule
"""


def tiny_model(directory: Path) -> str:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


CPU_PARTS = ("engine core", "workers", "API server", "valkey", "proxy", "others")


def cpu_seconds(server, valkey_pid: int, proxy_tid: int) -> dict[str, float]:
    """CPU seconds used so far by each part (`CPU_PARTS`; others: the machine's busy time
    less the parts')."""

    def used(process: psutil.Process) -> float:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = process.cpu_times()
            return times.user + times.system
        return 0.0

    found = dict.fromkeys(CPU_PARTS, 0.0)
    for process in server.tree():
        name = process.name()
        part = "API server" if process.pid == server.process.pid else "others"
        if "EngineCore" in name:
            part = "engine core"
        elif "Worker" in name:
            part = "workers"
        found[part] += used(process)
    found["valkey"] = used(psutil.Process(valkey_pid))
    for thread in psutil.Process().threads():
        if thread.id == proxy_tid:
            found["proxy"] = thread.user_time + thread.system_time
    machine = psutil.cpu_times()
    found["others"] += (
        machine.user + machine.nice + machine.system + machine.irq + machine.softirq
    ) - sum(found.values())
    return found


def run_row(name, extra, model, workload, warm, gaps, log_dir, watch) -> dict:
    options = ("--num-gpu-blocks-override", "96")
    hook = log_dir / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(STEP_HOOK)
    steps = log_dir / f"{name}.steps"
    pythonpath = os.pathsep.join([str(hook), str(ROOT / "src"), str(ROOT)])
    env = {"PYTHONPATH": pythonpath, "KVPOOL_BENCH_STEPS": str(steps)}
    server = Server(model, extra, log_dir / f"{name}.log", *options, env=env)
    try:
        server.wait_healthy()
        server.complete([1999] * 40)  # (a first forward pass unrelated to any loaded prefix)
        for prompt in warm:  # this server's host memory holds these afterwards
            server.complete(prompt, 2)
        server.complete([1998] * 40)  # (the step after the last finish copies its blocks)
        measured_from = len(steps.read_text().splitlines()) if steps.exists() else 0
        results: list[tuple[str, float, list[int]] | None] = [None] * len(workload)
        cpu_before = cpu_seconds(server, *watch)

        def send(i: int) -> None:
            kind, prompt = workload[i]
            ttft, tokens = server.stream(prompt, 4)
            results[i] = (kind, ttft, tokens)

        with concurrent.futures.ThreadPoolExecutor(len(workload)) as pool:
            futures = []
            for i in range(len(workload)):
                futures.append(pool.submit(send, i))
                time.sleep(gaps[i])
            for future in futures:
                future.result()
        cpu_after = cpu_seconds(server, *watch)
    finally:
        server.stop()
    done = [r for r in results if r is not None]
    row = {"name": name, "tokens": [r[2] for r in done]}
    lines = [line.split() for line in steps.read_text().splitlines()[measured_from:]]
    busy = [float(t) for t, tokens in lines if int(tokens) > 0]  # (steps that ran requests)
    row["step"] = (statistics.median(busy), percentile(busy, 0.99))
    row["empty_steps"] = sum(int(tokens) == 0 for _, tokens in lines)
    row["cpu"] = {part: cpu_after[part] - cpu_before[part] for part in CPU_PARTS}
    for kind in ("local", "remote"):
        times = [r[1] for r in done if r[0] == kind]
        row[kind] = (statistics.median(times), percentile(times, 0.99))
        row[f"{kind}_times"] = times
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--delay-ms", type=float, default=100)
    parser.add_argument("--rate", type=float, default=4, help="requests per second")
    parser.add_argument(
        "--arrivals", choices=["steady", "poisson"], default="steady",
        help="steady: one request every 1/rate s; poisson: exponential gaps of mean 1/rate s, "
        "the same seeded gaps in every row (with steady arrivals a fetch that ends a fixed time "
        "after a later request's arrival meets every such request: see docs/benchmarks.md)",
    )  # fmt: skip
    parser.add_argument("--prompt", type=int, default=16 * BLOCK + 5)
    parser.add_argument(
        "--rows",
        default="none,sync,async",
        help="which rows, in order, comma-separated (none: no remote tier; sync, async: "
        "lookups); a row named twice runs twice (alternating runs on a noisy machine)",
    )
    args = parser.parse_args()
    rng = random.Random(0)
    arrivals = random.Random(1)
    gaps = [
        1 / args.rate if args.arrivals == "steady" else arrivals.expovariate(args.rate)
        for _ in range(args.requests)
    ]
    n_remote = args.requests // 3
    remote_prompts = [[rng.randrange(2000) for _ in range(args.prompt)] for _ in range(n_remote)]
    local_prompts = [[rng.randrange(2000) for _ in range(args.prompt)] for _ in range(8)]
    workload = []
    for i in range(args.requests):
        if i % 3 == 2 and remote_prompts:
            workload.append(("remote", remote_prompts.pop()))
        else:
            workload.append(("local", local_prompts[i % len(local_prompts)]))
    remote_all = [p for k, p in workload if k == "remote"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model = tiny_model(tmp_path / "model")
        valkey = ValkeyServer(tmp_path / "valkey").start()
        proxy = DelayProxy("127.0.0.1", valkey.port, args.delay_ms).start()
        try:
            direct = f"valkey://127.0.0.1:{valkey.port}"
            writer = Server(model, {"host_bytes": 256 << 20, "remote_url": direct},
                            tmp_path / "writer.log", "--num-gpu-blocks-override", "96")  # fmt: skip
            try:
                writer.wait_healthy()
                for prompt in remote_all:
                    writer.complete(prompt, 1)
                writer.complete([1997] * 40)
            finally:
                writer.stop()  # (its shutdown flushes what it queued)
            delayed = f"valkey://127.0.0.1:{proxy.port}"
            base = {"host_bytes": 256 << 20, "remote_timeout_ms": 5000}
            kinds = {
                "none": ("no remote tier", base),
                "sync": ("remote, synchronous lookups",
                         {**base, "remote_url": delayed, "async_lookups": False}),
                "async": ("remote, asynchronous lookups", {**base, "remote_url": delayed}),
            }  # fmt: skip
            assert valkey.process is not None and proxy._thread is not None
            watch = (valkey.process.pid, proxy._thread.native_id)
            rows = [
                run_row(*kinds[kind], model, workload, local_prompts, gaps, tmp_path, watch)
                for kind in args.rows.split(",")
            ]
        finally:
            proxy.stop()
            valkey.stop()
    reference = rows[0]["local"][1]
    print(
        f"\n{args.requests} requests at {args.rate}/s ({args.arrivals}), a third fetching from Valkey behind a "
        f"{args.delay_ms:.0f} ms proxy; TTFT in ms (client side, streamed)\n"
    )
    print(
        "| row | local p50 | local p99 | remote p50 | remote p99 | local p99 / no remote "
        "| step p50 | step p99 | empty steps |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        local, remote, step = row["local"], row["remote"], row["step"]
        print(
            f"| {row['name']} | {local[0] * 1e3:.0f} | {local[1] * 1e3:.0f} | "
            f"{remote[0] * 1e3:.0f} | {remote[1] * 1e3:.0f} | {local[1] / reference:.2f} | "
            f"{step[0] * 1e3:.2f} | {step[1] * 1e3:.1f} | {row['empty_steps']:,} |"
        )
    print("\nCPU seconds over each row's measured phase\n")
    print("| row | " + " | ".join(CPU_PARTS) + " |")
    print("|---" * (len(CPU_PARTS) + 1) + "|")
    for row in rows:
        print(f"| {row['name']} | " + " | ".join(f"{row['cpu'][p]:.2f}" for p in CPU_PARTS) + " |")
    pooled: dict[str, list[float]] = {}
    for row in rows:  # (the p99 of one row's 80 local requests is its second slowest)
        pooled.setdefault(row["name"], []).extend(row["local_times"])
    if len(pooled) > 1 and len(rows) > len(pooled):
        print("\nLocal requests of all the rows of a kind together\n")
        print("| rows | local requests | local p50 | local p99 | local p99 / no remote |")
        print("|---|---|---|---|---|")
        base = percentile(next(iter(pooled.values())), 0.99)
        for name, times in pooled.items():
            print(f"| {name} | {len(times)} | {statistics.median(times) * 1e3:.0f} | "
                  f"{percentile(times, 0.99) * 1e3:.0f} | {percentile(times, 0.99) / base:.2f} |")  # fmt: skip
    same = all(row["tokens"] == rows[0]["tokens"] for row in rows)
    print(f"\ntokens equal in every row: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
