"""Host <-> GPU copy bandwidth of kvpool's page moves against a plain pinned copy of the same
bytes (needs a CUDA device; `scripts/gpu_check.sh` runs it).

A GPU level and a pinned host level of `--pages` pages of `--slot-kib` KiB; requests fill the
GPU, are suspended and pushed to the host by others (GPU -> host), then resumed (host -> GPU),
with the pages scattered over both levels' slots as a busy manager leaves them. Each direction
is timed from the call to the end of its copies (`torch.cuda.synchronize()`), and set against
one `copy_` of as many bytes between a pinned host tensor and a CUDA tensor, the link's
bandwidth as torch reaches it. Goal: kvpool's at least 80% of it.

Run: python benchmarks/bench_cuda.py [--pages 4096] [--slot-kib 256] [--runs 5] (medians)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.pop("KVPOOL_DEBUG", None)

import torch

from kvpool import (
    AttentionLayerConfig,
    BufferConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
)


def plain_copy_gbps(nbytes: int) -> tuple[float, float]:
    """(host -> GPU, GPU -> host) GB/s of one pinned copy of `nbytes`, best of three."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = [float("inf"), float("inf")]
    for _ in range(3):
        for direction in (0, 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            (
                gpu.copy_(host, non_blocking=True)
                if direction == 0
                else host.copy_(gpu, non_blocking=True)
            )
            torch.cuda.synchronize()
            best[direction] = min(best[direction], time.perf_counter() - start)
    return nbytes / best[0] / 1e9, nbytes / best[1] / 1e9


def moves_once(pages: int, slot_kib: int) -> dict[str, float]:
    tpb = 16
    half = slot_kib * 1024 // 2
    layers = [AttentionLayerConfig(0, [BufferConfig("k", half), BufferConfig("v", half)])]
    slot = 2 * half
    config = KVCacheManagerConfig(
        tpb, [GpuCacheTierConfig(pages * slot), HostCacheTierConfig(2 * pages * slot)], layers
    )
    manager = KVCacheManager(config)
    assert manager.on_device
    per_request = 64
    held = []
    for n in range(pages // per_request):  # fill the GPU with held requests
        cache = manager.create_kv_cache()
        assert cache.resume() and cache.resize(per_request * tpb)
        cache.commit([n * 100_000 + i for i in range(per_request * tpb)])
        cache.suspend()
        held.append(cache)
    view = manager.page_view(0, "k")
    view.fill_(7)
    del view
    torch.cuda.synchronize()
    pushers = []
    start = time.perf_counter()  # GPU -> host: new requests push the held ones out
    for _ in range(pages // per_request):
        cache = manager.create_kv_cache()
        assert cache.resume() and cache.resize(per_request * tpb)
        cache.suspend()
        pushers.append(cache)
    torch.cuda.synchronize()
    out_seconds = time.perf_counter() - start
    moved_out = manager.num_moved_pages[1]
    for cache in pushers:
        cache.close()
    torch.cuda.synchronize()
    start = time.perf_counter()  # host -> GPU: the held ones come back
    for cache in held:
        assert cache.resume()
    torch.cuda.synchronize()
    in_seconds = time.perf_counter() - start
    moved_in = manager.num_moved_pages[0]
    for cache in held:
        cache.close()
    manager.clear_reusable_blocks()
    manager.shutdown()
    to_gpu, to_host = plain_copy_gbps(moved_out * slot)  # (its order: host -> GPU first)
    return {
        "pages_out": moved_out,
        "pages_in": moved_in,
        "gpu_to_host_gbps": moved_out * slot / out_seconds / 1e9,
        "host_to_gpu_gbps": moved_in * slot / in_seconds / 1e9,
        "plain_gpu_to_host_gbps": to_host,
        "plain_host_to_gpu_gbps": to_gpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=4096)
    parser.add_argument("--slot-kib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    runs = [moves_once(args.pages, args.slot_kib) for _ in range(args.runs)]
    medians = {key: round(statistics.median(run[key] for run in runs), 2) for key in runs[0]}
    medians["gpu_to_host_of_plain"] = round(
        medians["gpu_to_host_gbps"] / medians["plain_gpu_to_host_gbps"], 2
    )
    medians["host_to_gpu_of_plain"] = round(
        medians["host_to_gpu_gbps"] / medians["plain_host_to_gpu_gbps"], 2
    )
    print(json.dumps({"benchmark": "cuda copies", "runs": args.runs, "medians": medians}, indent=2))


if __name__ == "__main__":
    main()
