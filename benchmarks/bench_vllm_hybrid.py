"""vLLM's KV capacity on a hybrid model, alone and with kvpool's connector: a Gemma-3-style tiny
random-weight model (5 sliding-window layers to 1 full-attention layer), each engine started in
its own process with the same KV-cache memory (VLLM_CPU_KVCACHE_SPACE), reading what vLLM
itself reports at start: its "KV cache size: N tokens" (vLLM's worst-case token capacity for
requests of max_model_len tokens) and its block count. Rows: vLLM alone; vLLM + kvpool (the
connector declares SupportsHMA: vLLM keeps its hybrid allocator); vLLM + kvpool with the hybrid
allocator off (what vLLM did for a connector without SupportsHMA: every layer keeps every
block). Each engine also serves a few prompts twice, and the tokens are checked against vLLM
alone.

Run (in the venv scripts/vllm_venv.sh makes):
    build/vllm-venv/bin/python benchmarks/bench_vllm_hybrid.py [--layers 6] [--window 128]
        [--block-size 64] [--max-model-len 8192] [--kv-space-gib 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_model(directory: Path, layers: int, window: int, max_len: int) -> None:
    import torch
    import transformers

    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    config = transformers.Gemma3TextConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=window,
        layer_types=types,
        vocab_size=2048,
        max_position_embeddings=max_len,
    )
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(config).save_pretrained(directory)


def run(spec: dict, space_gib: int) -> tuple[dict, list]:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "vllm_connector" / "engine_run.py"),
            json.dumps(spec),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": str(space_gib)},
    )
    lines = done.stdout.splitlines()
    engine = [json.loads(x[len("ENGINE ") :]) for x in lines if x.startswith("ENGINE ")]
    result = [json.loads(x[len("RESULT ") :]) for x in lines if x.startswith("RESULT ")]
    if done.returncode != 0 or not engine or not result:
        sys.exit(f"engine failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return engine[0], result[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6, help="every sixth is full attention")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--kv-space-gib", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        make_model(model, args.layers, args.window, args.max_model_len)
        prompts = [[(i * 7 + j * 13) % 2000 for j in range(3 * args.window + 5)] for i in range(2)]
        base = {
            "model": str(model),
            "prompts": prompts,
            "rounds": ["one", "one"],
            "num_blocks": None,
            "block_size": args.block_size,
            "max_model_len": args.max_model_len,
        }
        stats = Path(tmp) / "stats.json"
        kvpool = {"host_bytes": 256 << 20, "stats_path": str(stats)}
        rows = [
            ("vLLM alone", {**base, "extra": None}),
            ("vLLM + kvpool", {**base, "extra": kvpool}),
            (
                "vLLM + kvpool, hybrid allocator off",
                {**base, "extra": kvpool, "disable_hybrid_kv_cache_manager": True},
            ),
        ]
        print(
            f"Gemma-3-style: {args.layers} layers (5 sliding : 1 full), window {args.window}, "
            f"{args.block_size}-token blocks, max_model_len {args.max_model_len}, "
            f"VLLM_CPU_KVCACHE_SPACE={args.kv_space_gib} GiB, float32"
        )
        print(f"{'':38} {'KV cache size':>14} {'blocks':>8} {'hybrid':>7} {'ratio':>6} tokens")
        reference = None
        for name, spec in rows:
            stats.unlink(missing_ok=True)
            engine, result = run(spec, args.kv_space_gib)
            size = engine["kv_cache_size_tokens"]
            outputs = [[r["tokens"] for r in round_] for round_ in result]
            if reference is None:
                reference = (size, outputs)
            same = "= alone" if outputs == reference[1] else "DIFFER"
            print(
                f"{name:38} {size:>14,} {engine['num_gpu_blocks']:>8,} "
                f"{'on' if engine['hybrid_kv_cache_manager'] else 'off':>7} "
                f"{size / reference[0]:>6.3f} {same}"
            )
            if spec["extra"] is not None and stats.exists():
                groups = json.loads(stats.read_text())["kv_cache_groups"]
                print(f"{'':38} kvpool saw {len(groups)} KV-cache groups: {', '.join(groups)}")


if __name__ == "__main__":
    main()
