"""Cost of `adjust_cache_level` against the cost of copying the bytes it moves.

A GPU level (host memory when there is no CUDA device) with two pool groups; the big-slot group's
live pages sit at high slot ids with the low ids free, so shrinking it must move every one of
them (a defragmenting copy). We time the adjustment and, separately, the best of three copies,
slot by slot, of as many slots of the same size between touched memory of the level's kind (our
`HostMemory`, huge pages and all, without a CUDA device; CUDA tensors with one), and print
adjust / copy. Plain numpy arrays (4 KiB pages from malloc) are timed too, for reference.

Run: python benchmarks/bench_adjust.py [--pages 1500] [--slot-kib 64] [--runs 5] (medians)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import numpy as np

os.environ.pop("KVPOOL_DEBUG", None)

from kvpool import (
    AttentionLayerConfig,
    BufferConfig,
    GpuCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
)
from kvpool.storage import DeviceMemory, HostMemory


def copy_time(slots: int, slot_bytes: int, cuda: bool, numpy_arrays: bool = False) -> float:
    """Best of three: copying `slots` slots one by one between two touched memories."""
    if cuda:
        import torch

        memory = torch.full((2, slots, slot_bytes), 3, dtype=torch.uint8, device="cuda")
        source, destination = memory[0], memory[1]
    elif numpy_arrays:
        source = np.full((slots, slot_bytes), 3, dtype=np.uint8)
        destination = np.full_like(source, 5)
    else:
        memory = HostMemory(2 * slots * slot_bytes)
        memory.array[:] = 3
        source, destination = memory.array.reshape(2, slots, slot_bytes)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for index in range(slots):
            destination[index] = source[index]
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def adjust_once(pages: int, slot_kib: int) -> dict[str, Any]:
    """One manager: fill it as described above, time the adjustment and the copies."""
    tpb = 16
    half = slot_kib * 1024 // 2
    layers = [
        AttentionLayerConfig(
            0, [BufferConfig("k", half), BufferConfig("v", half)], sliding_window_size=4096
        ),
        AttentionLayerConfig(1, [BufferConfig("k", 2048), BufferConfig("v", 2048)]),
    ]
    slot = 2 * half
    group_bytes = 4 * pages * slot  # room for a hog of 2x pages below the live ones
    config = KVCacheManagerConfig(
        tpb, [GpuCacheTierConfig(2 * group_bytes)], layers, initial_pool_ratio=[0.5, 0.5]
    )
    manager = KVCacheManager(config)
    hog, live = manager.create_kv_cache(), manager.create_kv_cache()
    hog.resume(), live.resume()
    assert hog.resize(2 * pages * tpb)  # low ids
    assert live.resize(pages * tpb)  # high ids
    view = manager.page_view(0, "k")
    view[:] = 7  # touch the memory, as a real workload would have
    del view
    hog.close()
    storage = manager._storage.state
    counts = manager.get_slot_counts(0)
    target = [0.5 * 0.5, 0.5 * 1.5]  # the big-slot group loses half its bytes
    memory = storage.levels[0].pool_groups[0].memories[0]
    cuda = isinstance(memory, DeviceMemory) and memory.is_cuda
    if cuda:
        import torch

        torch.cuda.synchronize()
    start = time.perf_counter()
    manager.adjust_cache_level(0, [t / sum(target) for t in target])
    if cuda:  # (its copies are asynchronous: time them to the end)
        torch.cuda.synchronize()
    adjust_seconds = time.perf_counter() - start
    moved = storage.num_relocated
    assert moved >= pages * 9 // 10, moved
    memory = storage.levels[0].pool_groups[0].memories[0]
    result = {
        "slot_bytes": slot,
        "slots_before": counts,
        "slots_after": manager.get_slot_counts(0),
        "pages_moved": moved,
        "bytes_moved": moved * slot,
        "memory": memory.kind,
        "adjust_ms": adjust_seconds * 1e3,
        "copy_same_bytes_ms": copy_time(moved, slot, cuda) * 1e3,
        "copy_same_bytes_numpy_arrays_ms": copy_time(moved, slot, False, numpy_arrays=True) * 1e3,
    }
    live.close()
    manager.clear_reusable_blocks()
    manager.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=1500)
    parser.add_argument("--slot-kib", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    runs = [adjust_once(args.pages, args.slot_kib) for _ in range(args.runs)]
    summary = dict(runs[0])
    for name in ("adjust_ms", "copy_same_bytes_ms", "copy_same_bytes_numpy_arrays_ms"):
        summary[name] = round(statistics.median(run[name] for run in runs), 2)
    summary["ratio_adjust_to_copy"] = round(
        statistics.median(run["adjust_ms"] / run["copy_same_bytes_ms"] for run in runs), 2
    )
    print(json.dumps({"benchmark": "adjust", "runs": args.runs, "medians": summary}, indent=2))


if __name__ == "__main__":
    main()
