"""Batched slot-copy bandwidth (kvpool's Copier) against plain copies of the same bytes.

host->host: Copier vs a numpy fancy-index copy `dst[ids] = src[ids]` and vs a numpy slice copy
per slot.
host->disk, disk->host: Copier (coalesced pwritev/preadv in a thread pool) vs one raw
os.pwrite / os.pread per slot. The disk file is in --dir (default: the system temp dir); the page
cache is not dropped, so disk figures are page-cache bandwidth unless the file is larger than RAM.

Run: python benchmarks/bench_copy.py [--slot-kib 256] [--slots 512] [--batch 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np

from kvpool.config import CacheTier
from kvpool.storage.copier import Copier
from kvpool.storage.memory import DiskMemory, HostMemory
from kvpool.storage.pools import LevelStorage


def timed(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slot-kib", type=int, default=256)
    parser.add_argument("--slots", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--scattered", action="store_true", help="random slot ids instead of runs")
    args = parser.parse_args()
    size = args.slot_kib * 1024
    quota = size * args.slots
    host_a = LevelStorage(CacheTier.HOST, quota, [(size,)], [1.0], [1], granularity=size)
    host_b = LevelStorage(CacheTier.HOST, quota, [(size,)], [1.0], [1], granularity=size)
    disk = LevelStorage(
        CacheTier.DISK, quota, [(size,)], [1.0], [1], granularity=size, disk_path=args.dir
    )
    rng = np.random.default_rng(0)
    src_memory = host_a.pool_groups[0].memories[0]
    dst_memory = host_b.pool_groups[0].memories[0]
    disk_memory = disk.pool_groups[0].memories[0]
    assert isinstance(src_memory, HostMemory) and isinstance(dst_memory, HostMemory)
    assert isinstance(disk_memory, DiskMemory)
    src_memory.array[:quota] = rng.integers(0, 256, quota, dtype=np.uint8)
    if args.scattered:
        src_ids = rng.permutation(args.slots)[: args.batch]
        dst_ids = rng.permutation(args.slots)[: args.batch]
    else:
        src_ids = np.arange(args.batch)
        dst_ids = np.arange(args.slots - args.batch, args.slots)
    pairs = list(zip(src_ids.tolist(), dst_ids.tolist(), strict=True))
    nbytes = args.batch * size
    copier = Copier()
    src_view = src_memory.array[:quota].reshape(args.slots, size)
    dst_view = dst_memory.array[:quota].reshape(args.slots, size)
    fd = disk_memory.fileno

    def numpy_fancy() -> None:
        dst_view[dst_ids] = src_view[src_ids]

    def numpy_per_slot() -> None:
        for s, d in pairs:
            dst_view[d] = src_view[s]

    def raw_pwrite() -> None:
        for s, d in pairs:
            os.pwrite(fd, src_view[s], d * size)

    def raw_pread() -> None:
        for s, d in pairs:
            os.preadv(fd, [dst_view[s]], d * size)

    routes = {
        "host_to_host": (
            host_a,
            host_b,
            pairs,
            {"numpy_fancy": numpy_fancy, "numpy_per_slot": numpy_per_slot},
        ),
        "host_to_disk": (host_a, disk, pairs, {"pwrite_per_slot": raw_pwrite}),
        "disk_to_host": (disk, host_b, [(d, s) for s, d in pairs], {"pread_per_slot": raw_pread}),
    }
    results: dict[str, dict[str, float]] = {}
    for name, (source, destination, route, baselines) in routes.items():

        def kvpool_copy(source=source, destination=destination, route=route) -> None:
            copier.copy(source.pool_groups[0], destination.pool_groups[0], route).check()

        seconds = timed(kvpool_copy, args.repeats)
        results[name] = {"kvpool_gb_per_s": round(nbytes / seconds / 1e9, 2)}
        for baseline_name, baseline in baselines.items():
            baseline_seconds = timed(baseline, args.repeats)
            results[name][f"{baseline_name}_gb_per_s"] = round(nbytes / baseline_seconds / 1e9, 2)
            results[name][f"ratio_kvpool_to_{baseline_name}"] = round(baseline_seconds / seconds, 2)
    copier.close()
    for storage in (host_a, host_b, disk):
        storage.close()
    print(
        json.dumps(
            {
                "benchmark": "copy",
                "slot_bytes": size,
                "batch_slots": args.batch,
                "scattered": args.scattered,
                **results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
