"""Cost of `adjust_cache_level` against the cost of copying the bytes it moves.

A GPU level (host memory when there is no CUDA device) with two pool groups; the big-slot group's
live pages sit at high slot ids with the low ids free, so shrinking it must move every one of
them (a defragmenting copy). We time the adjustment and, separately, the best of three numpy
copies, slot by slot, of as many slots of the same size between touched arrays, and print
adjust / copy.

Run: python benchmarks/bench_adjust.py [--pages 1500] [--slot-kib 64]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

os.environ.pop("KVPOOL_DEBUG", None)

from kvpool import (
    AttentionLayerConfig,
    BufferConfig,
    GpuCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=1500)
    parser.add_argument("--slot-kib", type=int, default=64)
    args = parser.parse_args()
    tpb = 16
    half = args.slot_kib * 1024 // 2
    layers = [
        AttentionLayerConfig(
            0, [BufferConfig("k", half), BufferConfig("v", half)], sliding_window_size=4096
        ),
        AttentionLayerConfig(1, [BufferConfig("k", 2048), BufferConfig("v", 2048)]),
    ]
    slot = 2 * half
    group_bytes = 4 * args.pages * slot  # room for a hog of 2x pages below the live ones
    config = KVCacheManagerConfig(
        tpb, [GpuCacheTierConfig(2 * group_bytes)], layers, initial_pool_ratio=[0.5, 0.5]
    )
    manager = KVCacheManager(config)
    hog, live = manager.create_kv_cache(), manager.create_kv_cache()
    hog.resume(), live.resume()
    assert hog.resize(2 * args.pages * tpb)  # low ids
    assert live.resize(args.pages * tpb)  # high ids
    view = manager.page_view(0, "k")
    view[:] = 7  # touch the memory, as a real workload would have
    hog.close()
    storage = manager._storage
    counts = manager.get_slot_counts(0)
    target = [0.5 * 0.5, 0.5 * 1.5]  # the big-slot group loses half its bytes
    start = time.perf_counter()
    manager.adjust_cache_level(0, [t / sum(target) for t in target])
    adjust_seconds = time.perf_counter() - start
    moved = storage.num_relocated
    assert moved >= args.pages * 9 // 10, moved
    source = np.full((moved, slot), 3, dtype=np.uint8)
    destination = np.full_like(source, 5)  # touched, like the pool memory
    copy_seconds = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for index in range(moved):
            destination[index] = source[index]
        copy_seconds = min(copy_seconds, time.perf_counter() - start)
    live.close()
    print(
        json.dumps(
            {
                "benchmark": "adjust",
                "slot_bytes": slot,
                "slots_before": counts,
                "slots_after": manager.get_slot_counts(0),
                "pages_moved": moved,
                "bytes_moved": moved * slot,
                "adjust_ms": round(adjust_seconds * 1e3, 2),
                "copy_same_bytes_ms": round(copy_seconds * 1e3, 2),
                "ratio_adjust_to_copy": round(adjust_seconds / copy_seconds, 2),
            },
            indent=2,
        )
    )
    manager.clear_reusable_blocks()
    manager.shutdown()


if __name__ == "__main__":
    main()
