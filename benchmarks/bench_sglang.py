"""kvpool's SGLang storage backend against SGLang's own `file` backend (HiCacheFile, with its
LRU evictor capped at the same bytes) as SGLang's L3, on the Mooncake conversation trace.

Each request's prompt is its trace blocks (`hash_ids`, one SGLang page each, keys chained as
SGLang chains its page hashes). Per request, as SGLang's cache controller drives L3 for a
prompt its GPU and host caches miss: `batch_exists` on the pages (the leading run), a read
of those pages into SGLang's host pool, then a write of the rest (write-through), in batches
of SGLang's STORAGE_BATCH_SIZE. kvpool is driven through `batch_get_v1`/`batch_set_v1` (SGLang
does so for `dynamic` backends with `interface_v1`); `file` through SGLang's generic path (flat
page tensors, as its controller's `_generic_page_get`/`_generic_page_set` do). Both use the same
host pool (SGLang's `MHATokenToKVPoolHost`, page_first) and the same disk budget; kvpool's
staging level counts in it. The L1/L2 caches SGLang keeps above L3 are left out: this measures
the storage backends alone.

    build/sglang-venv/bin/python benchmarks/bench_sglang.py --requests 1000 --budget-pages 5000

Prints hit tokens from L3, bytes read and written, and the time per page of each call.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    STORAGE_BATCH_SIZE,
    HiCacheFile,
    HiCacheStorageConfig,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402

from kvpool.integrations.sglang import KVPoolHiCacheStorage  # noqa: E402

TRACE = Path("/work/shared/traces/mooncake_conversation_trace.jsonl")
PAGE = 512  # tokens per trace block
LAYERS, HEADS, HEAD_DIM = 1, 1, 8  # 16 KiB pages (bf16 K and V)
MiB = 1 << 20


def host_pool() -> Any:
    device = MHATokenToKVPool(
        8 * PAGE, PAGE, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu", False,
        start_layer=0, end_layer=LAYERS,
    )  # fmt: skip
    return MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info, 40.0, 0, PAGE, "page_first",
        pin_memory=False, device_capacity_tokens=device.size, start_layer=0, end_layer=LAYERS,
    )  # fmt: skip


def storage_config(extra: dict[str, Any]) -> Any:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="bench-model", extra_config=extra,
    )  # fmt: skip


def chained(hash_ids: list[int]) -> list[str]:
    keys, previous = [], b""
    for block in hash_ids:
        previous = hashlib.sha256(previous + block.to_bytes(8, "little")).digest()
        keys.append(previous.hex())
    return keys


class Driver:
    """One backend as SGLang's controller calls it; times every call."""

    def __init__(self, name: str, backend: Any, host: Any, zero_copy: bool):
        self.name, self.backend, self.host, self.zero_copy = name, backend, host, zero_copy
        self.seconds = {"exists": 0.0, "get": 0.0, "set": 0.0}
        self.pages = {"exists": 0, "get": 0, "set": 0}
        self.hit_pages = self.set_ok = 0

    def _timed(self, what: str, pages: int, call: Any) -> Any:
        started = time.perf_counter()
        result = call()
        self.seconds[what] += time.perf_counter() - started
        self.pages[what] += pages
        return result

    def exists(self, keys: list[str]) -> int:
        found = 0
        for i in range(0, len(keys), STORAGE_BATCH_SIZE):
            batch = keys[i : i + STORAGE_BATCH_SIZE]
            hit = self._timed("exists", len(batch), lambda b=batch: self.backend.batch_exists(b))
            found += hit
            if hit < len(batch):
                break
        return found

    def get(self, keys: list[str], indices: torch.Tensor) -> int:
        if self.zero_copy:
            done = self._timed("get", len(keys), lambda: self.backend.batch_get_v1(keys, indices))
            return done.index(False) if False in done else len(done)

        def generic() -> int:  # (the controller's _generic_page_get)
            pages = [self.host.get_dummy_flat_data_page() for _ in keys]
            data = self.backend.batch_get(keys, pages)
            count = 0
            for i, page in enumerate(data):
                if page is None:
                    break
                self.host.set_from_flat_data_page(int(indices[i * PAGE]), page)
                count += 1
            return count

        return int(self._timed("get", len(keys), generic))

    def set(self, keys: list[str], indices: torch.Tensor) -> bool:
        if self.zero_copy:
            return bool(
                self._timed("set", len(keys), lambda: all(self.backend.batch_set_v1(keys, indices)))
            )

        def generic() -> bool:  # (the controller's _generic_page_set)
            data = [self.host.get_data_page(int(indices[i * PAGE])) for i in range(len(keys))]
            return bool(self.backend.batch_set(keys, data))

        return bool(self._timed("set", len(keys), generic))

    def request(self, keys: list[str]) -> None:
        hit = self.exists(keys)
        for start in range(0, len(keys), STORAGE_BATCH_SIZE):
            batch = keys[start : start + STORAGE_BATCH_SIZE]
            indices = self.host.alloc(len(batch) * PAGE)
            assert indices is not None
            try:
                cached = max(0, min(len(batch), hit - start))
                if cached:
                    self.hit_pages += self.get(batch[:cached], indices[: cached * PAGE])
                if cached < len(batch):
                    rest = indices[cached * PAGE :]
                    self.set_ok += len(batch) - cached if self.set(batch[cached:], rest) else 0
            finally:
                self.host.free(indices)

    def report(self, page_bytes: int) -> dict[str, Any]:
        per_page = {
            k: round(self.seconds[k] / self.pages[k] * 1e6, 1) if self.pages[k] else None
            for k in self.seconds
        }
        return {
            "backend": self.name,
            "hit_tokens": self.hit_pages * PAGE,
            "bytes_read": self.hit_pages * page_bytes,
            "bytes_written": self.pages["set"] * page_bytes,
            "us_per_page": per_page,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--budget-pages", type=int, default=5000, help="disk budget, in pages")
    parser.add_argument("--dir", default=None, help="where both backends keep their files")
    parser.add_argument(
        "--rounds", type=int, default=0,
        help="instead of the trace: time per page of set and get, both backends alternating "
        "this many rounds (--round-pages written, 1,024 read back at random, within the budget)",
    )  # fmt: skip
    parser.add_argument("--round-pages", type=int, default=2000, help="pages a round writes")
    args = parser.parse_args()
    page_bytes = 2 * LAYERS * PAGE * HEADS * HEAD_DIM * 2
    smallest = -(-4 * MiB // page_bytes)  # (kvpool's staging and disk levels: 2 MiB each at least)
    if args.budget_pages < smallest:
        parser.error(f"--budget-pages={args.budget_pages} is too small: must be >= {smallest}")
    if args.round_pages < STORAGE_BATCH_SIZE:
        parser.error(f"--round-pages={args.round_pages} is too small: must be >= 128")
    if args.requests < 1:
        parser.error(f"--requests={args.requests} is invalid: must be >= 1")
    if args.rounds:
        alternating(args)
        return
    rows = [json.loads(line) for line in TRACE.open()][: args.requests]
    prompts = [chained(row["hash_ids"]) for row in rows]
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-sglang-"))
    results = []
    for name in ["file", "kvpool"]:
        where = root / name
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir(parents=True)
        host = host_pool()
        page_bytes = host.get_data_page(0, flat=True).numel() * 2
        budget = args.budget_pages * page_bytes
        if name == "file":
            extra = {"file_storage_path": str(where), "max_size": budget}
            backend: Any = HiCacheFile(storage_config(extra))
            backend.register_mem_pool_host(host)
            driver = Driver(name, backend, host, zero_copy=False)
        else:
            staging = 2 * MiB  # (kvpool's minimum level: it counts in the budget)
            extra = {"staging_bytes": staging, "disk_bytes": budget - staging,
                     "disk_path": str(where), "disk_persist": False}  # fmt: skip
            backend = KVPoolHiCacheStorage(storage_config(extra), {})
            backend.register_mem_pool_host(host)
            driver = Driver(name, backend, host, zero_copy=True)
        started = time.perf_counter()
        for keys in prompts:
            driver.request(keys)
        report = driver.report(page_bytes)
        report["seconds"] = round(time.perf_counter() - started, 1)
        if name == "kvpool":
            report["kvpool"] = backend.statistics()
            stats = backend.manager.stats()  # (its own traffic between levels: promotions too)
            report["kvpool"]["bytes_moved_to_level"] = dict(
                zip(stats.level_names, stats.moved_bytes_to_level, strict=True)
            )
            backend.close()
        results.append(report)
        print(json.dumps(report), flush=True)
    total = sum(len(p) for p in prompts)
    unique = len({k for p in prompts for k in p})
    print(f"{len(prompts)} requests, {total} pages ({unique} distinct), budget "
          f"{args.budget_pages} pages of {page_bytes} bytes")  # fmt: skip
    print(
        "| backend | hit tokens from L3 | bytes read | bytes written | us/page exists | get | set |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        u = r["us_per_page"]
        print(f"| {r['backend']} | {r['hit_tokens']:,} | {r['bytes_read']:,} | "
              f"{r['bytes_written']:,} | {u['exists']} | {u['get']} | {u['set']} |")  # fmt: skip
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    os.sync()


def make(name: str, where: Path, budget_pages: int) -> Driver:
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    host = host_pool()
    page_bytes = host.get_data_page(0, flat=True).numel() * 2
    budget = budget_pages * page_bytes
    if name == "file":
        backend: Any = HiCacheFile(
            storage_config({"file_storage_path": str(where), "max_size": budget})
        )
        backend.register_mem_pool_host(host)
        return Driver(name, backend, host, zero_copy=False)
    staging = 2 * MiB
    extra = {"staging_bytes": staging, "disk_bytes": budget - staging, "disk_path": str(where),
             "disk_persist": False}  # fmt: skip
    backend = KVPoolHiCacheStorage(storage_config(extra), {})
    backend.register_mem_pool_host(host)
    return Driver(name, backend, host, zero_copy=True)


def alternating(args: argparse.Namespace) -> None:
    """Per page set and get of each backend, alternating, with every page within the budget:
    the cost of the calls alone, on a noisy machine compared round by round."""
    import random

    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-sglang-"))
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(args.round_pages)]
    rng = random.Random(1)
    reads = [rng.sample(keys, STORAGE_BATCH_SIZE) for _ in range(8)]
    print("| round | backend | us/page set | us/page get |")
    print("|---|---|---|---|")
    for r in range(args.rounds):
        for name in ["file", "kvpool"]:
            budget = max(args.budget_pages, args.round_pages + 400)  # (every page fits)
            driver = make(name, root / f"{name}{r}", budget)
            indices = driver.host.alloc(STORAGE_BATCH_SIZE * PAGE)
            for i in range(0, len(keys), STORAGE_BATCH_SIZE):
                batch = keys[i : i + STORAGE_BATCH_SIZE]
                assert driver.set(batch, indices[: len(batch) * PAGE])
            for batch in reads:
                assert driver.get(batch, indices) == len(batch)
            driver.host.free(indices)
            u = driver.report(0)["us_per_page"]
            print(f"| {r} | {name} | {u['set']} | {u['get']} |", flush=True)
            if name == "kvpool":
                driver.backend.close()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
