"""kvpool on the peers' workloads (../shared/bench/peers/workload.py), through the public API.

(a) block churn: from a `SlotAllocator` of 100,000 slots (the allocator of one pool group at
    one level, which every page allocation goes through), allocate N slots then free them
    (N = 10, 100, 1000; 1,000 cycles after 20 warm-up cycles), like the peers' BlockPool churn.
(b) scheduler cycle: the peers' 2,000 seeded requests (16-token blocks, 70% share one of 20
    1,024-token system prefixes, prompts 512-4,096 tokens, 128 output tokens), a continuous
    batch of 64, a pool of exactly 32,768 blocks. Each step: every running request
    `resize(capacity + 1)`; each admitted request `create_kv_cache(prompt[:-1])` (prefix lookup;
    the last prompt token is always recomputed), `resume()`, `resize(len(prompt))` and
    `commit(rest of the prompt)` (vLLM caches a prompt's blocks when it schedules them, so
    requests admitted in the same step share them too); then every running request commits the
    token it was given last step; a request that produced its 128 tokens is closed.
    Hit tokens count full 16-token blocks only (`enable_partial_reuse=False`), as vLLM's do.
    Layouts: `full` (one full-attention layer), `hybrid` (sliding-window layers with 16 sink
    tokens + a full one, two pool groups), `tiers` (`full` with a host level and a disk level
    under the GPU), `lru` (`full` under the LRU eviction policy instead of the default one).
(c) the requests and driving of (b) on the peers' hybrid model (`HYBRID_PATTERN` of
    workload.py: five sliding-window layers of `HYBRID_WINDOW` tokens, no sinks, and one full
    layer), `PREFIX_POOL_BLOCKS` slots per pool group: layout `c`, reported as "c".

Prints JSON: medians over `--runs`, per-run values under `runs`.
Run: python benchmarks/bench_manager.py [--workloads a,b,c] [--layouts full,hybrid,tiers]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.pop("KVPOOL_DEBUG", None)  # the invariant checker must be off when measuring

from kvpool import (
    AttentionLayerConfig,
    BufferConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    KVEventsConfig,
)
from kvpool.layout import KVLayout
from kvpool.replay.prefix import exact_block_config
from kvpool.storage.slots import SlotAllocator

DEFAULT_PEERS = Path(__file__).resolve().parents[1].parent / "shared" / "bench" / "peers"
WARMUP_CYCLES = 20
LAYOUTS = ("full", "hybrid", "tiers", "lru", "c")


def load_workload_module(peers_dir: Path) -> Any:
    """The peers' seeded generator, read from the shared folder (never copied into the repo)."""
    if not (peers_dir / "workload.py").is_file():
        raise SystemExit(f"--peers-dir {peers_dir} has no workload.py")
    sys.path.insert(0, str(peers_dir))
    import workload

    return workload


# -- (a) block churn ------------------------------------------------------------------------------


def churn(pool_blocks: int, sizes: list[int], cycles: int) -> dict[str, dict[str, float]]:
    out = {}
    clock = time.perf_counter_ns
    for n in sizes:
        gc.collect()
        allocator = SlotAllocator(pool_blocks)
        for _ in range(WARMUP_CYCLES):
            allocator.release_multiple(allocator.allocate_multiple(n))
        alloc_ns = free_ns = 0
        start = clock()
        for _ in range(cycles):
            t1 = clock()
            slots = allocator.allocate_multiple(n)
            t2 = clock()
            allocator.release_multiple(slots)
            t3 = clock()
            alloc_ns += t2 - t1
            free_ns += t3 - t2
        loop_ns = clock() - start
        assert allocator.num_free_slots == pool_blocks
        out[str(n)] = {
            "blocks_per_call": n,
            "iterations": cycles,
            "alloc_us_per_call": alloc_ns / 1e3 / cycles,
            "free_us_per_call": free_ns / 1e3 / cycles,
            "cycle_us": loop_ns / 1e3 / cycles,
        }
    return out


# -- (b) scheduler cycle --------------------------------------------------------------------------


def layout_config(
    layout: str, pool_blocks: int, disk_dir: str, workload: Any = None
) -> KVCacheManagerConfig:
    """A manager whose full-attention pool group has exactly `pool_blocks` GPU slots (layout
    `c`: the peers' hybrid model from `workload`, the peers' workload module)."""
    base = exact_block_config(pool_blocks, 16)
    if layout == "full":
        config = base
    elif layout == "tiers":
        gpu_quota = base.cache_tiers[0].quota
        config = KVCacheManagerConfig(
            16,
            [
                base.cache_tiers[0],
                HostCacheTierConfig(gpu_quota),
                DiskCacheTierConfig(2 * gpu_quota, disk_dir),
            ],
            base.layers,
            max_util_for_resume=1.0,
        )
    elif layout == "hybrid":
        # Five sliding-window layers (512 tokens, 16 sinks) and one full layer: two pool groups.
        # The window group gets the same slot count; a request keeps at most 34 of its blocks.
        (full_layer,) = base.layers
        size = full_layer.buffers[0].size
        windowed = [
            AttentionLayerConfig(
                layer, [BufferConfig("kv", size)], sliding_window_size=512, num_sink_tokens=16
            )
            for layer in range(1, 6)
        ]
        config = KVCacheManagerConfig(
            16,
            [GpuCacheTierConfig(base.cache_tiers[0].quota * 6)],
            [AttentionLayerConfig(0, [BufferConfig("kv", size)]), *windowed],
            max_util_for_resume=1.0,
            initial_pool_ratio=[1 / 6, 5 / 6],  # bytes: equal slot counts
        )
    elif layout == "c":
        # The peers' pattern, every layer with the same bytes per token; one pool group for the
        # window layers (a slot holds all of them), one for the full layers, equal slot counts.
        (full_layer,) = base.layers
        size = full_layer.buffers[0].size
        kinds = workload.HYBRID_PATTERN
        layers = [
            AttentionLayerConfig(
                layer,
                [BufferConfig("kv", size)],
                sliding_window_size=workload.HYBRID_WINDOW if kind == "window" else None,
            )
            for layer, kind in enumerate(kinds)
        ]
        slot_bytes = [group.slot_bytes for group in KVLayout(layers, 16).pool_groups]
        config = KVCacheManagerConfig(
            16,
            [GpuCacheTierConfig(base.cache_tiers[0].quota * len(kinds))],
            layers,
            max_util_for_resume=1.0,
            initial_pool_ratio=[n / sum(slot_bytes) for n in slot_bytes],  # equal slot counts
        )
    else:
        raise SystemExit(f"--layouts: unknown layout {layout!r} (choose from {LAYOUTS})")
    return KVCacheManagerConfig(
        config.tokens_per_block,
        config.cache_tiers,
        config.layers,
        max_util_for_resume=1.0,
        enable_partial_reuse=False,
        initial_pool_ratio=config.initial_pool_ratio,
    )


class Running:
    __slots__ = ("cache", "outputs", "produced")

    def __init__(self, cache: Any, outputs: list[int]) -> None:
        self.cache = cache
        self.outputs = outputs
        self.produced = 1  # the prefill step produces the first output token


def scheduler_cycle(
    requests: list[Any],
    layout: str,
    pool_blocks: int,
    max_batch: int,
    decode_len: int,
    kv_events: bool = False,
    eviction_policy: str | None = None,
    workload: Any = None,
) -> dict[str, Any]:
    """Workload (b) (layout `c`: workload (c), from `workload`, the peers' module); with
    `kv_events`, the manager publishes KV events (flushed every step); `eviction_policy`: the
    manager's (None: its default)."""
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-") as disk_dir:
        config = layout_config(layout, pool_blocks, disk_dir, workload)
        if eviction_policy is not None:
            config = dataclasses.replace(config, eviction_policy=eviction_policy)
        if kv_events:
            config = dataclasses.replace(
                config, kv_events=KVEventsConfig("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
            )
        manager = KVCacheManager(config)
        slot_counts = [manager.get_slot_counts(level) for level in range(manager.num_levels)]
        clock = time.perf_counter_ns
        hit_tokens = prompt_tokens = steps = request_steps = 0
        running: list[Running] = []
        next_request = 0
        gc.collect()
        start = clock()
        while next_request < len(requests) or running:
            steps += 1
            for item in running:  # one decode token each
                cache = item.cache
                if not cache.resize(cache.capacity + 1):
                    raise RuntimeError("kvpool: out of pages in decode (pool too small)")
            admitted = []
            while next_request < len(requests) and len(running) + len(admitted) < max_batch:
                request = requests[next_request]
                next_request += 1
                prompt = request.prompt_token_ids
                cache = manager.create_kv_cache(None, prompt[:-1])
                hit = cache.num_committed_tokens
                if not (cache.resume() and cache.resize(len(prompt))):
                    raise RuntimeError("kvpool: out of pages in prefill (pool too small)")
                cache.commit(prompt[hit:])
                hit_tokens += hit
                prompt_tokens += len(prompt)
                admitted.append(Running(cache, request.output_token_ids))
            for item in running:  # the model ran: the token fed this step is final
                item.cache.commit((item.outputs[item.produced - 1],))
                item.produced += 1
            running += admitted
            request_steps += len(running)
            still = []
            for item in running:
                if item.produced >= decode_len:
                    item.cache.close()
                else:
                    still.append(item)
            running = still
            manager.flush_kv_events()
        total_ns = clock() - start
        stats = manager.get_storage_statistics(0)
        moved = manager.num_moved_pages
        manager.shutdown()
    return {
        "total_wall_s": total_ns / 1e9,
        "us_per_step_per_request": total_ns / 1e3 / request_steps,
        "request_steps": request_steps,
        "scheduler_steps": steps,
        "prefix_hit_tokens": hit_tokens,
        "prompt_tokens": prompt_tokens,
        "prefix_hit_rate_tokens": hit_tokens / prompt_tokens,
        "pages_moved_between_levels": moved,
        "slots_per_level": slot_counts,
        "evictable_pages_at_end": [s.evictable for s in stats],
    }


def variant_options(description: str, layouts: str) -> argparse.ArgumentParser:
    """The command line of a script comparing variants of workload (b)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--layouts", default=layouts)
    parser.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS)
    return parser


def cycle_variants(
    args: argparse.Namespace, variants: dict[str, dict[str, Any]]
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Workload (b) per layout under each variant (`scheduler_cycle` keyword arguments), the
    variants alternating run by run in this process: layout -> variant -> results."""
    workload = load_workload_module(args.peers_dir)
    prefix = workload.make_prefix_workload(seed=0, num_requests=args.num_requests)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for layout in args.layouts.split(","):
        results[layout] = {name: [] for name in variants}
        for _ in range(args.runs):
            for name, options in variants.items():
                results[layout][name].append(
                    scheduler_cycle(
                        prefix.requests,
                        layout,
                        workload.PREFIX_POOL_BLOCKS,
                        workload.MAX_BATCH,
                        prefix.params["decode_len"],
                        workload=workload,
                        **options,
                    )
                )
    return results


def median_tree(items: list[Any]) -> Any:
    first = items[0]
    if isinstance(first, dict):
        return {key: median_tree([item[key] for item in items]) for key in first}
    if isinstance(first, bool) or not isinstance(first, int | float):
        return first
    return statistics.median(items)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="a,b")
    parser.add_argument("--layouts", default="full", help=f"comma list of {', '.join(LAYOUTS)}")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--churn-sizes", default="10,100,1000")
    parser.add_argument("--churn-iters", type=int, default=1000)
    parser.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    workload = load_workload_module(args.peers_dir)
    workloads = args.workloads.split(",")
    layouts = args.layouts.split(",")
    for layout in layouts:
        if layout not in LAYOUTS:
            parser.error(f"--layouts: unknown layout {layout!r} (choose from {LAYOUTS})")
    sizes = [int(size) for size in args.churn_sizes.split(",")]
    prefix = workload.make_prefix_workload(seed=args.seed, num_requests=args.num_requests)
    # Each benchmark runs --runs times in a row (the headline (b) on the full layout before the
    # others, so that their garbage never weighs on it).
    runs: list[dict[str, Any]] = [{} for _ in range(args.runs)]
    if "a" in workloads:
        for result in runs:
            result["a"] = churn(workload.CHURN_POOL_BLOCKS, sizes, args.churn_iters)
    cycles = [layout for layout in layouts if layout != "c"] if "b" in workloads else []
    if "c" in workloads or "c" in layouts:
        cycles.append("c")
    if cycles:
        for layout in cycles:
            for result in runs:
                key = {"full": "b", "c": "c"}.get(layout, f"b_{layout}")
                result[key] = scheduler_cycle(
                    prefix.requests,
                    "full" if layout == "lru" else layout,
                    workload.PREFIX_POOL_BLOCKS,
                    workload.MAX_BATCH,
                    prefix.params["decode_len"],
                    workload=workload,
                    eviction_policy="lru" if layout == "lru" else None,
                )
            print(f"[kvpool] {args.runs} run(s) of {key} done", file=sys.stderr, flush=True)
    report = {key: median_tree([run[key] for run in runs]) for key in runs[0]}
    text = json.dumps({"peer": "kvpool", "medians": report, "runs": runs}, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
