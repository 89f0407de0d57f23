"""Cost of keeping tensor-parallel managers in step, next to the manager's own per-step cost.

Two processes over gloo (CPU), each with its own manager, run the same decode loop as
bench_decode.py (64 requests, `resize(capacity + 1)` then `commit([token])` each per step). Per
step they also agree on `need_adjustment` (one 3 + 2 x pool-groups float64 broadcast from rank
0; also with `interval=16`, amortized), and, in the debug mode, compare a digest of the step's decisions (one 8-byte all-gather plus
the digest of the decision log and the state rows). Printed per batch step, in microseconds,
and as ratios to the manager's own decode step measured in the same processes; a bare one-float
gloo broadcast is the floor any agreement pays.

Run: python benchmarks/bench_agreement.py [--model gemma-3-1b] [--steps 512] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

os.environ.pop("KVPOOL_DEBUG", None)  # the invariant checker must be off when measuring

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvpool import GpuCacheTierConfig, KVCacheManager, KVCacheManagerConfig
from kvpool.distributed import Agreement
from kvpool.presets import PRESETS


def measure(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    tpb = 32
    config = KVCacheManagerConfig(
        tpb, [GpuCacheTierConfig(64 << 30)], PRESETS[args.model].layers(tpb)
    )
    manager = KVCacheManager(config)
    caches = []
    for index in range(args.batch):
        cache = manager.create_kv_cache()
        assert cache.resume() and cache.resize(args.prompt)
        cache.commit(range(index * 100_000, index * 100_000 + args.prompt))
        caches.append(cache)
    plain = Agreement(manager)
    sparse = Agreement(manager, interval=16)
    checking = Agreement(manager, check=True)
    checking.end_step()  # the state before the loop
    bare = torch.zeros(1, dtype=torch.float64)
    timings: dict[str, list[float]] = {
        "bare_broadcast": [],
        "manager": [],
        "need_adjustment": [],
        "every_16": [],
        "check": [],
    }
    for step in range(args.steps):
        dist.barrier()  # every rank starts the step together: no wait time measured
        start = time.perf_counter()
        for index, cache in enumerate(caches):
            if not cache.resize(cache.capacity + 1):
                raise RuntimeError("out of pages: raise the quota")
            cache.commit([1_000_000 + step * args.batch + index])
        middle = time.perf_counter()
        plain.need_adjustment()
        agreed = time.perf_counter()
        sparse.need_adjustment()
        sparsely = time.perf_counter()
        checking.end_step()
        end = time.perf_counter()
        dist.broadcast(bare, 0)
        timings["bare_broadcast"].append(time.perf_counter() - end)
        timings["manager"].append(middle - start)
        timings["need_adjustment"].append(agreed - middle)
        timings["every_16"].append(sparsely - agreed)
        timings["check"].append(end - sparsely)
    for cache in caches:
        cache.close()
    manager.clear_reusable_blocks()
    manager.shutdown()
    summary = {key: statistics.median(values) for key, values in timings.items()}
    summary["every_16"] = statistics.mean(timings["every_16"])  # amortized: one step in 16 pays
    torch.save(summary, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-1b", choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=1000)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(measure, args=(2, port, args, out), nprocs=2, join=True)
        medians = [torch.load(f"{out}/{rank}.pt") for rank in range(2)]
    us = {key: max(m[key] for m in medians) * 1e6 for key in medians[0]}  # the slower rank's
    print(
        json.dumps(
            {
                "benchmark": "agreement_per_step",
                "model": args.model,
                "batch": args.batch,
                "steps": args.steps,
                "processes": 2,
                "manager_us_per_batch_step": round(us["manager"], 1),
                "bare_gloo_broadcast_us": round(us["bare_broadcast"], 1),
                "need_adjustment_agreed_us": round(us["need_adjustment"], 1),
                "need_adjustment_agreed_every_16_steps_us": round(us["every_16"], 1),
                "decision_check_us": round(us["check"], 1),
                "ratio_agreement_to_manager": round(us["need_adjustment"] / us["manager"], 3),
                "ratio_every_16_to_manager": round(us["every_16"] / us["manager"], 3),
                "ratio_check_to_manager": round(us["check"] / us["manager"], 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
