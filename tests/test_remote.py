"""The shared remote tier against real valkey-server processes (started on free ports, stopped
even when a test fails): write-back of dropped blocks, reuse across managers and processes with
the bytes verified, isolation, bad values, the server's own eviction, a server that dies,
stalls or is absent, and a 3-node cluster."""

from __future__ import annotations

import logging
import multiprocessing
import time

import pytest

from kvpool import (
    ArgumentError,
    BufferConfig,
    ConfigError,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    RemoteCacheTierConfig,
    ReuseScope,
    SsmLayerConfig,
    StorageError,
)
from kvpool.remote.values import HEADER_BYTES, KEY_PREFIX
from kvpool.tokens import root_key
from tests.engine_check import CheckingEngine
from tests.helpers import (
    MiB,
    hybrid_layers,
    make_config,
    prometheus_samples,
    record_layer,
    shutdown,
    write_tiny_hf_config,
)
from tests.valkey_servers import ValkeyServer, server_binary, start_cluster

pytestmark = pytest.mark.skipif(server_binary() is None, reason="no valkey-server binary")

TPB = 16
REPEATS = 64  # 16 KiB buffers: 64 KiB pages (two layers, K and V), 32 per 2 MiB grain
PAGE_BYTES = 4 * 16 * REPEATS * TPB
FULL = [record_layer(i, TPB, repeats=REPEATS) for i in range(2)]


@pytest.fixture
def server(tmp_path):
    s = ValkeyServer(tmp_path / "valkey").start()
    yield s
    s.stop()


@pytest.fixture
def managers():
    made = []

    def make(url, layers=FULL, gpu_mib=2, host_mib=0, **remote):
        tiers = [GpuCacheTierConfig(gpu_mib * MiB)]
        if host_mib:
            tiers.append(HostCacheTierConfig(host_mib * MiB))
        remote.setdefault("timeout_ms", 1000)
        m = KVCacheManager(
            make_config(
                layers=layers,
                tokens_per_block=TPB,
                tiers=tiers,
                remote_tier=RemoteCacheTierConfig(url, **remote),
            )
        )
        made.append(m)
        return m, CheckingEngine(m)

    yield make
    for m in made:
        if not m._closed:
            shutdown(m)


def prompt_of(n, blocks):
    """A prompt of `blocks` full blocks, distinct per n."""
    return [n * 10_000 + i for i in range(blocks * TPB)]


def compute(m, engine, tokens, scope=None):
    """Run one request over `tokens` (reusing what it can), checking every record; returns the
    tokens it reused."""
    cache = m.create_kv_cache(scope, tokens[:-1])
    assert cache.resume()
    reused = cache.num_committed_tokens
    engine.check(cache, tokens)
    assert engine.step(cache, tokens, tokens[reused:])
    engine.check(cache, tokens)
    cache.close()
    return reused


def local_match(m, tokens, scope=None):
    return m._tree.match(root_key(scope), tokens, False).num_tokens


def fill_remote(m, engine, prompts, scope=None):
    """Compute every prompt, then push them all out of the local levels (into the remote
    tier) by computing unrelated ones, and wait for the writes."""
    for tokens in prompts:
        assert compute(m, engine, tokens, scope) == 0
    n = 0
    while any(local_match(m, tokens, scope) for tokens in prompts):
        compute(m, engine, prompt_of(900 + n, 4))
        n += 1
        assert n < 1000
    assert m.flush_remote_writes(10)


def remote_keys(server):
    return [k for k in server.client().keys(b"*") if k.startswith(KEY_PREFIX)]


# -- write-back and reuse ------------------------------------------------------------------------


def test_write_remote_sends_committed_blocks_at_once_and_another_manager_reuses_them(
    server, managers
):
    a, engine_a = managers(server.url)
    tokens = prompt_of(1, 4)
    cache = a.create_kv_cache(None, [])
    assert cache.resume()
    assert engine_a.step(cache, tokens, tokens)  # writes each block's records, commits them
    assert a.num_dropped_pages == 0 and a.remote_statistics().written_values == 0
    assert a.write_remote(cache, first_block=1) == 3  # blocks 1..3 (block 0 left out)
    assert a.flush_remote_writes(10)
    assert a.remote_statistics().written_values == 3
    assert a.write_remote(cache) == 4 and a.flush_remote_writes(10)
    cache.close()
    with pytest.raises(ArgumentError, match="cache"):
        a.write_remote(cache)

    b, engine_b = managers(server.url)  # nothing local: the four blocks come from the server
    assert compute(b, engine_b, tokens + [7]) == 4 * TPB  # (their records checked by b)


def test_write_remote_without_a_remote_tier_writes_nothing():
    m = KVCacheManager(
        make_config(layers=FULL, tokens_per_block=TPB, tiers=[GpuCacheTierConfig(2 * MiB)])
    )
    cache = m.create_kv_cache(None, [])
    assert cache.resume() and cache.resize(TPB)
    cache.commit(list(range(TPB)))
    assert m.write_remote(cache) == 0
    with pytest.raises(ArgumentError, match="first_block"):
        m.write_remote(cache, first_block=-1)
    cache.close()
    shutdown(m)


def test_blocks_dropped_from_the_last_level_are_reused_by_another_manager(server, managers):
    a, engine_a = managers(server.url)
    prompts = [prompt_of(n, 3) for n in range(4)]
    fill_remote(a, engine_a, prompts)
    stats = a.remote_statistics()
    assert a.num_dropped_pages > 0 and stats.written_values == a.num_dropped_pages
    assert stats.bytes_written == stats.written_values * (PAGE_BYTES + HEADER_BYTES)
    assert len(remote_keys(server)) == stats.written_values

    b, engine_b = managers(server.url)
    for tokens in prompts:
        # the last block is left out of the lookup (the prompt's last token is recomputed)
        assert b.probe_reuse(None, tokens[:-1]) == 2 * TPB
        assert compute(b, engine_b, tokens) == 2 * TPB  # bytes a wrote, checked by b
    stats = b.remote_statistics()
    assert stats.fetched_blocks == 8 and stats.hit_tokens == 8 * TPB
    assert stats.missing_values == stats.corrupt_values == stats.errors == 0
    # fetched blocks went into b's tree: a third request reuses them locally
    assert b.probe_reuse(None, prompts[-1]) == 3 * TPB


def test_a_remote_prefix_continues_a_local_one(server, managers):
    a, engine_a = managers(server.url)
    base = prompt_of(1, 4)
    fill_remote(a, engine_a, [base])
    b, engine_b = managers(server.url)
    assert compute(b, engine_b, base[: 2 * TPB + 1]) == 2 * TPB  # blocks 0, 1 from the server
    keys = stored_value_keys(server, b, base)
    server.client().delete(*keys[0], *keys[1])
    assert local_match(b, base) == 2 * TPB
    # blocks 2 and 3 chain on from b's local blocks 0 and 1
    assert b.probe_reuse(None, base) == 4 * TPB
    assert compute(b, engine_b, base + [5]) == 4 * TPB
    assert b.remote_statistics().fetched_blocks == 4


def test_hybrid_layout_fetches_only_the_pages_a_resume_needs(server, managers):
    layers = hybrid_layers(TPB, num_layers=4, window=2 * TPB, sinks=4, repeats=REPEATS)
    a, engine_a = managers(server.url, layers=layers)
    prompts = [prompt_of(n, 6) for n in range(3)]
    fill_remote(a, engine_a, prompts)
    b, engine_b = managers(server.url, layers=layers)
    before = b.remote_statistics().bytes_read
    assert compute(b, engine_b, prompts[0]) == 5 * TPB
    # full attention: blocks 0-4; window of 32 tokens + sink block: blocks 0, 3, 4
    assert b.remote_statistics().bytes_read - before == (5 + 3) * (PAGE_BYTES + HEADER_BYTES)


def test_ssm_layers_reuse_a_remote_prefix_only_where_a_state_snapshot_was_stored(server, managers):
    layers = [
        record_layer(0, TPB, repeats=REPEATS),
        SsmLayerConfig(1, [BufferConfig("state", 64)]),
        record_layer(2, TPB, window=32, repeats=REPEATS),
    ]
    a, engine_a = managers(server.url, layers=layers, gpu_mib=4)
    tokens = prompt_of(2, 4)
    fill_remote(a, engine_a, [tokens])  # one commit of 4 blocks: a snapshot after block 3 only
    b, engine_b = managers(server.url, layers=layers, gpu_mib=4)
    assert b.probe_reuse(None, tokens[: 3 * TPB]) == 0  # no state after block 2
    assert b.probe_reuse(None, tokens) == 4 * TPB
    assert compute(b, engine_b, tokens + [8]) == 4 * TPB  # SSM state record checked too
    assert b.remote_statistics().fetched_blocks == 4


def test_a_value_copied_under_another_namespaces_key_is_a_miss(server, managers):
    a, engine_a = managers(server.url, namespace="t1")
    tokens = prompt_of(3, 3)
    fill_remote(a, engine_a, [tokens])
    b, _ = managers(server.url, namespace="t2")
    client = server.client()
    keys_a, keys_b = stored_value_keys(server, a, tokens), stored_value_keys(server, b, tokens)
    for ours, theirs in zip(keys_a, keys_b, strict=True):
        client.set(theirs[0], client.get(ours[0]))  # a tenant's value planted under t2's key
    cache = b.create_kv_cache(None, tokens)
    assert cache.num_committed_tokens == 3 * TPB  # the keys exist...
    assert cache.resume() and cache.num_committed_tokens == 0  # ...but no value is t2's
    assert b.remote_statistics().corrupt_values == 3
    cache.close()


def test_values_swapped_between_keys_of_one_namespace_are_misses_never_wrong_kv(server, managers):
    """Issue 30: a value moved under another block's key (same namespace, same page size) was
    served as that block's KV. Each value names its key now: a swap is a miss, counted as
    corrupt, and the prefix ends before it; every record a request reads is checked."""
    import random

    a, engine_a = managers(server.url)
    prompts = [prompt_of(20 + n, 3 + n % 3) for n in range(12)]
    fill_remote(a, engine_a, prompts)
    b, engine_b = managers(server.url, gpu_mib=4)
    client = server.client()
    keys = [key for tokens in prompts for (key,) in stored_value_keys(server, b, tokens)]
    rng = random.Random(7)
    swapped = rng.sample(keys, 40)
    for first, second in zip(swapped[0::2], swapped[1::2], strict=True):
        one, two = client.get(first), client.get(second)
        assert one is not None and two is not None and one != two
        client.set(first, two)
        client.set(second, one)
    reused = sum(compute(b, engine_b, tokens) for tokens in prompts)
    stats = b.remote_statistics()
    assert stats.corrupt_values > 0 and stats.fetched_blocks > 0 and reused > 0
    # Every swapped value read was refused; the prefixes served stop before the first of them.
    assert engine_b.records_checked > 0
    b.check_invariants()


def worker_fill(url, prompts, result):
    m = KVCacheManager(
        make_config(
            layers=FULL,
            tokens_per_block=TPB,
            tiers=[GpuCacheTierConfig(2 * MiB)],
            remote_tier=RemoteCacheTierConfig(url),
        )
    )
    engine = CheckingEngine(m)
    fill_remote(m, engine, prompts)
    result.put(m.remote_statistics().written_values)
    shutdown(m)


def test_two_processes_share_prefixes_byte_for_byte(server, managers):
    prompts = [prompt_of(n, 4) for n in range(3)]
    context = multiprocessing.get_context("spawn")
    result = context.Queue()
    process = context.Process(target=worker_fill, args=(server.url, prompts, result))
    process.start()
    process.join(60)
    assert process.exitcode == 0
    assert result.get(timeout=5) > 0
    b, engine_b = managers(server.url)
    for tokens in prompts:
        assert compute(b, engine_b, tokens + [1]) == 4 * TPB
    assert engine_b.records_checked > 0 and b.remote_statistics().fetched_blocks == 12


# -- isolation -----------------------------------------------------------------------------------


def test_scopes_models_tenants_and_layouts_never_read_each_other(server, managers):
    a, engine_a = managers(server.url, model_id="m1", namespace="t1")
    tokens = prompt_of(3, 3)
    fill_remote(a, engine_a, [tokens], scope=ReuseScope(lora_id=1))
    assert (
        managers(server.url, model_id="m1", namespace="t1")[0].probe_reuse(
            ReuseScope(lora_id=1), tokens
        )
        == 3 * TPB
    )
    others = [
        (dict(model_id="m1", namespace="t1"), FULL, ReuseScope(lora_id=2)),
        (dict(model_id="m1", namespace="t1"), FULL, None),
        (dict(model_id="m2", namespace="t1"), FULL, ReuseScope(lora_id=1)),
        (dict(model_id="m1", namespace="t2"), FULL, ReuseScope(lora_id=1)),
        (dict(model_id="m1", namespace="t1"), [record_layer(i, TPB, repeats=32) for i in range(2)],
         ReuseScope(lora_id=1)),
        (dict(model_id="m1", namespace="t1"), [record_layer(i, TPB, repeats=64) for i in range(3)],
         ReuseScope(lora_id=1)),
    ]  # fmt: skip
    for remote, layers, scope in others:
        m, engine = managers(server.url, layers=layers, **remote)
        assert m.probe_reuse(scope, tokens) == 0
        assert compute(m, engine, tokens, scope) == 0
        assert m.remote_statistics().fetched_blocks == 0


# -- bad values, vanished values, the server's eviction ------------------------------------------


def stored_value_keys(server, manager, tokens):
    """The remote keys of `tokens`' blocks, per block, in order: [(key of group 0, ...)]."""
    from hashlib import sha256

    from kvpool.tokens import encode_checked, root_key

    tier = manager._remote
    key, chain = root_key(None), []
    for i in range(len(tokens) // TPB):
        key = sha256(key + encode_checked(tokens[i * TPB : (i + 1) * TPB])).digest()
        chain.append(key)
    groups = range(len(manager.layout.life_cycles))
    tags = tier.tags(b"", chain, 0)
    return [[tier.key(k, g, t) for g in groups] for k, t in zip(chain, tags, strict=True)]


@pytest.mark.parametrize("damage", ["flip", "truncate", "header", "other-type"])
def test_a_damaged_value_is_a_miss_and_shortens_the_prefix(server, managers, damage):
    a, engine_a = managers(server.url)
    tokens = prompt_of(4, 5)
    fill_remote(a, engine_a, [tokens])
    b, engine_b = managers(server.url)
    client = server.client()
    key = stored_value_keys(server, b, tokens)[2][0]  # block 2's page
    value = client.get(key)
    assert value is not None and len(value) == HEADER_BYTES + PAGE_BYTES
    if damage == "flip":
        client.set(key, value[:-5] + bytes([value[-5] ^ 1]) + value[-4:])
    elif damage == "truncate":
        client.set(key, value[: len(value) // 2])
    elif damage == "header":
        client.set(key, b"KVPR" + bytes([9]) + value[5:])
    else:
        client.delete(key)
        client.rpush(key, b"not a string")  # GET answers WRONGTYPE for this key alone
    cache = b.create_kv_cache(None, tokens[:-1])
    assert cache.num_committed_tokens == 4 * TPB  # the lookup only asks whether keys exist
    assert cache.resume()
    assert cache.num_committed_tokens == 2 * TPB  # blocks 0 and 1; nothing after the bad one
    engine_b.check(cache, tokens)
    assert engine_b.step(cache, tokens, tokens[2 * TPB :])
    engine_b.check(cache, tokens)
    cache.close()
    stats = b.remote_statistics()
    if damage == "other-type":
        assert stats.refused_commands == 1 and stats.errors == 0
    else:
        assert stats.corrupt_values == 1
    assert stats.fetched_blocks == 2
    assert b.remote_statistics().errors == 0


def test_a_value_evicted_between_lookup_and_fetch_ends_the_prefix_there(server, managers):
    a, engine_a = managers(server.url)
    tokens = prompt_of(5, 6)
    fill_remote(a, engine_a, [tokens])
    b, engine_b = managers(server.url)
    cache = b.create_kv_cache(None, tokens[:-1])
    assert cache.num_committed_tokens == 5 * TPB
    server.client().delete(stored_value_keys(server, b, tokens)[3][0])
    assert cache.resume()
    assert cache.num_committed_tokens == 3 * TPB
    assert b.remote_statistics().missing_values == 1
    engine_b.check(cache, tokens)
    assert engine_b.step(cache, tokens, tokens[3 * TPB :])
    engine_b.check(cache, tokens)
    cache.close()
    # the recomputed blocks 3.. are cached locally now; 0..2 came from the remote tier
    assert b.probe_reuse(None, tokens) == 6 * TPB


def test_prefetch_to_the_host_level_loads_the_remote_prefix(server, managers):
    a, engine_a = managers(server.url)
    tokens = prompt_of(6, 4)
    fill_remote(a, engine_a, [tokens])
    b, engine_b = managers(server.url, host_mib=2)
    cache = b.create_kv_cache(None, tokens[:-1])
    assert cache.prefetch(1)
    assert {page.level for page in cache.pages(0) if page is not None} == {1}
    assert cache.num_committed_tokens == 3 * TPB
    assert cache.resume()
    engine_b.check(cache, tokens)
    cache.close()


def test_the_server_evicting_under_maxmemory_leaves_only_whole_prefixes(tmp_path, managers):
    server = ValkeyServer(
        tmp_path / "lru", extra=("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    ).start()
    try:
        a, engine_a = managers(server.url)
        prompts = [prompt_of(n, 4) for n in range(40)]  # 160 values of 64 KiB: 10 MiB
        fill_remote(a, engine_a, prompts)
        info = server.client().info("stats")
        assert info["evicted_keys"] > 0
        # Room for every prompt: `b` drops nothing, so its own write-backs do not evict what
        # `a` left on the server while it looks the prompts up (with 4 MiB they did: 1-3 random
        # prompts hit, and one CI run saw none).
        b, engine_b = managers(server.url, gpu_mib=16)
        reused = [compute(b, engine_b, tokens + [1]) for tokens in prompts]
        assert b.num_dropped_pages == 0
        assert 0 < sum(reused) < 40 * 4 * TPB
        assert all(r % TPB == 0 for r in reused)
    finally:
        server.stop()


# -- the server failing --------------------------------------------------------------------------


def test_a_server_down_at_start_is_a_clear_error_or_a_warning(tmp_path, managers, caplog):
    down = ValkeyServer(tmp_path / "down")
    with pytest.raises(StorageError, match=rf"127\.0\.0\.1:{down.port}/0 refuses connections"):
        managers(down.url, timeout_ms=200)
    with caplog.at_level(logging.WARNING, logger="kvpool.remote"):
        m, engine = managers(down.url, timeout_ms=200, tolerate_unavailable=True,
                             reconnect_min_ms=50, reconnect_max_ms=50)  # fmt: skip
    assert "refuses connections" in caplog.text
    fill_remote(m, engine, [prompt_of(7, 3)])  # runs degraded: nothing remote, nothing fails
    stats = m.remote_statistics()
    assert stats.errors + stats.skipped_calls > 0 and stats.written_values == 0
    down.start()
    try:
        time.sleep(0.1)
        fill_remote(m, engine, [prompt_of(8, 3)])
        stats = m.remote_statistics()
        assert stats.reconnects >= 1 and stats.written_values > 0
    finally:
        down.stop()


def test_a_server_killed_mid_run_loses_no_local_kv_and_is_rejoined(server, managers):
    m, engine = managers(server.url, host_mib=2, reconnect_min_ms=50, reconnect_max_ms=200)
    held = m.create_kv_cache(None, [])
    held_tokens = prompt_of(10, 3)
    assert held.resume() and engine.step(held, held_tokens, held_tokens)
    fill_remote(m, engine, [prompt_of(11, 3)])
    server.kill()
    t0 = time.monotonic()
    for n in range(12, 20):  # drops, lookups and fetches against a dead server
        assert compute(m, engine, prompt_of(n, 3)) == 0
    assert m.flush_remote_writes(10)
    assert time.monotonic() - t0 < 5
    stats = m.remote_statistics()
    assert stats.errors > 0 and stats.failed_writes > 0
    engine.check(held, held_tokens)  # local KV is intact
    server.start()  # same port, empty
    time.sleep(0.3)
    fill_remote(m, engine, [prompt_of(30, 3)])
    assert m.remote_statistics().reconnects >= 1
    fresh, engine_f = managers(server.url)
    assert compute(fresh, engine_f, prompt_of(30, 3) + [1]) == 3 * TPB
    held.close()


def test_a_stalled_server_costs_a_call_at_most_its_timeout(server, managers):
    m, engine = managers(server.url, timeout_ms=200, reconnect_min_ms=1000, reconnect_max_ms=1000)
    tokens = prompt_of(40, 3)
    fill_remote(m, engine, [tokens])
    b, engine_b = managers(server.url, timeout_ms=200, reconnect_min_ms=1000,
                           reconnect_max_ms=1000)  # fmt: skip
    server.pause()
    try:
        t0 = time.monotonic()
        cache = b.create_kv_cache(None, tokens[:-1])
        first = time.monotonic() - t0
        assert cache.num_committed_tokens == 0  # no answer: a miss
        assert first < 0.2 * 3 + 0.3
        cache.close()
        t0 = time.monotonic()
        for _ in range(5):  # backing off: no more waiting
            b.create_kv_cache(None, tokens[:-1]).close()
        assert time.monotonic() - t0 < 0.2
        assert b.remote_statistics().skipped_calls == 5
    finally:
        server.unpause()
    time.sleep(1.1)
    assert compute(b, engine_b, tokens + [1]) == 3 * TPB


# -- cluster -------------------------------------------------------------------------------------


def test_a_three_node_cluster_spreads_and_serves_the_blocks(tmp_path, managers):
    nodes = start_cluster(tmp_path / "cluster", 3)
    try:
        urls = [node.url.rsplit("/", 1)[0] for node in nodes]
        a, engine_a = managers(urls)
        prompts = [prompt_of(n, 3) for n in range(6)]
        fill_remote(a, engine_a, prompts)
        counts = [node.client().dbsize() for node in nodes]
        assert all(c > 0 for c in counts) and sum(counts) == a.remote_statistics().written_values
        b, engine_b = managers(urls[1], cluster=True)  # one seed is enough
        for tokens in prompts:
            assert compute(b, engine_b, tokens + [1]) == 3 * TPB
        assert b.remote_statistics().fetched_blocks == 18
    finally:
        for node in nodes:
            node.stop()


# -- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (dict(url="http://x:1"), "remote_tier.url"),
        (dict(url="valkey://"), "remote_tier.url"),
        (dict(url=[]), "remote_tier.url"),
        (dict(url=["valkey://a:1", "tcp://b:2"]), r"remote_tier.url\[1\]"),
        (dict(url=5), "remote_tier.url"),
        (dict(url="valkey://a:port"), "remote_tier.url"),
        (dict(url="valkey://a:1/zero"), "remote_tier.url"),
        (dict(url="valkey://:1"), "remote_tier.url"),
        (dict(url="valkey://a:1", timeout_ms=0), "remote_tier.timeout_ms"),
        (dict(url="valkey://a:1", max_pending_writes=-1), "remote_tier.max_pending_writes"),
        (dict(url="valkey://a:1", max_lookup_blocks=1.5), "remote_tier.max_lookup_blocks"),
        (dict(url="valkey://a:1", reconnect_max_ms=10), "remote_tier.reconnect_max_ms"),
        (dict(url="valkey://a:1", cluster="yes"), "remote_tier.cluster"),
        (dict(url="valkey://a:1", namespace=3), "remote_tier.namespace"),
        (dict(url="valkey://a:1", shard=-1), "remote_tier.shard"),
        (dict(url="valkey://a:1", placement_tokens=-1), r"remote_tier.placement_tokens.*>= 0"),
        (dict(url="valkey://a:1", placement_tokens="512"), "remote_tier.placement_tokens"),
    ],
)
def test_bad_remote_config_is_refused_by_field(fields, named):
    config = make_config(remote_tier=RemoteCacheTierConfig(**fields))
    with pytest.raises(ConfigError, match=named):
        KVCacheManager(config)


# -- kvpool replay --remote ----------------------------------------------------------------------


def test_a_second_replay_reuses_what_the_first_left_in_the_server(
    server, tmp_path, capsys, monkeypatch
):
    import json

    from kvpool import _debug
    from kvpool.cli import main

    monkeypatch.setattr(_debug, "DEBUG", False)  # (--verify checks every KV record anyway)
    model = write_tiny_hf_config(tmp_path)
    argv = ["replay", "--requests", "40", "--hf-config", str(model), "--gpu", "2MiB"]
    argv += ["--host", "0", "--verify", "--no-progress", "--remote", server.url]
    reports = []
    for run in range(2):
        out = tmp_path / f"run{run}.json"
        assert main([*argv, "--json", str(out)]) == 0
        reports.append(json.loads(out.read_text())["report"])
    printed = capsys.readouterr().out
    assert "served from REMOTE" in printed
    first, second = reports
    assert first["remote"]["written_values"] > 0 and first["dropped_pages"] > 0
    # the second replay finds the first one's dropped blocks (KV records verified)
    assert second["remote_hit_tokens"] > first["remote_hit_tokens"] + 5000
    assert second["hit_tokens"] == sum(second["hit_tokens_by_level"]) + second["remote_hit_tokens"]
    assert second["hit_rate"] > first["hit_rate"] + 0.05
    assert second["records_verified"] > 0
    assert second["remote"]["missing_values"] == second["remote"]["corrupt_values"] == 0


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--remote", "http://h:1"], "--remote"),
        (["--remote", "valkey://h:1", "--capacity-blocks", "10"], "takes no --remote"),
        (["--remote-cluster"], "needs --remote"),
    ],
)
def test_replay_remote_flags_are_checked_before_any_work(capsys, extra, fragment):
    from kvpool.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["replay", "--requests", "2", "--no-progress", *extra])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and fragment in err and err.count("\n") == 1


def test_replay_against_a_server_that_is_down_is_a_one_line_error(tmp_path, capsys):
    from kvpool.cli import main

    down = ValkeyServer(tmp_path / "down")
    status = main(["replay", "--requests", "2", "--no-progress", "--remote", down.url])
    err = capsys.readouterr().err
    assert status == 2 and "refuses connections" in err and err.count("\n") == 1, err


def test_tensor_parallel_ranks_must_name_their_shard(server, managers):
    """Ranks hold different KV heads in same-sized pages: without a shard each, rank 1 would
    read rank 0's heads. The shard is in the namespace, and the agreement checks it."""
    pytest.importorskip("torch")
    import datetime

    import torch.distributed as dist

    from kvpool.distributed import Agreement
    from tests.valkey_servers import free_port

    a, engine_a = managers(server.url, shard=0)
    tokens = prompt_of(5, 3)
    fill_remote(a, engine_a, [tokens])
    assert managers(server.url, shard=0)[0].probe_reuse(None, tokens) == 3 * TPB
    assert managers(server.url, shard=1)[0].probe_reuse(None, tokens) == 0
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        with pytest.raises(ConfigError, match=r"remote_tier.shard=1 is invalid: .* rank \(0\)"):
            Agreement(managers(server.url, shard=1)[0])
        Agreement(managers(server.url, shard=1)[0], mode="any")  # data parallel: same heads
        Agreement(a)
    finally:
        dist.destroy_process_group()


def test_the_reference_engine_computes_the_same_tokens_from_another_instances_kv(server):
    """Real attention over KV that one engine instance computed and another fetched from the
    server: the same greedy tokens and logits as computing it all."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvpool.engine import Generator, PagedDecoder, manager_config_from_hf
    from tests.test_engine import hf_model, tiny

    config = tiny("mistral")  # a sliding window of 24 tokens over blocks of 8
    model = hf_model(config, seed=1)

    def engine():
        remote = RemoteCacheTierConfig(server.url, model_id="tiny-mistral-seed-1")
        manager = KVCacheManager(manager_config_from_hf(config, 8, 4 * MiB, remote_tier=remote))
        return Generator(PagedDecoder(config, model.state_dict(), manager)), manager

    prompts = [list(range(10, 50)) + [1, 2], list(range(60, 90)) + [3]]
    first_engine, first_manager = engine()
    first = first_engine.generate(prompts, 8)
    storage = first_manager._storage  # this instance goes away: its cached pages are dropped
    pages = [page for groups in storage.state.pages for group in groups for page in group.values()]
    storage.owners.drop(pages)
    assert first_manager.flush_remote_writes(10)
    first_manager.shutdown()
    second_engine, second_manager = engine()
    second = second_engine.generate(prompts, 8)
    assert [r.cached_tokens for r in second] == [40, 24]  # the prompts' full blocks
    assert second_manager.remote_statistics().fetched_blocks == 5 + 3
    for ours, theirs in zip(second, first, strict=True):
        assert ours.tokens == theirs.tokens
        for a, b in zip(ours.logits, theirs.logits, strict=True):
            assert torch.allclose(a, b, atol=1e-5)
    second_manager.clear_reusable_blocks()
    second_manager.shutdown()


@pytest.mark.parametrize("where", ["get", "write-page"])
def test_ctrl_c_during_a_fetch_changes_nothing_and_the_next_resume_loads_it(
    server, managers, monkeypatch, where
):
    from kvpool.remote.store import RemoteStore

    a, engine_a = managers(server.url)
    tokens = prompt_of(6, 4)
    fill_remote(a, engine_a, [tokens])
    b, engine_b = managers(server.url)
    cache = b.create_kv_cache(None, tokens)
    free_before = [s.available for s in b.get_storage_statistics(0)]
    calls = []
    memory = b._storage.state.levels[0].pool_groups[0].memories[0]  # (where a fetched page goes)
    target, name = (RemoteStore, "get_many") if where == "get" else (type(memory), "write")
    original = getattr(target, name)

    def interrupted(self, *args):
        calls.append(1)
        if len(calls) == 2 or where == "get":
            raise KeyboardInterrupt
        return original(self, *args)

    monkeypatch.setattr(target, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        cache.resume()
    monkeypatch.setattr(target, name, original)
    assert cache.pending_remote_tokens == 4 * TPB and cache.num_committed_tokens == 4 * TPB
    assert [s.available for s in b.get_storage_statistics(0)] == free_before
    assert local_match(b, tokens) == 0
    assert cache.resume() and cache.num_committed_tokens == 4 * TPB
    engine_b.check(cache, tokens)
    cache.close()


def test_a_server_refusing_writes_when_full_counts_them_and_keeps_serving(tmp_path, managers):
    server = ValkeyServer(
        tmp_path / "full", extra=("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    ).start()
    try:
        a, engine_a = managers(server.url)
        prompts = [prompt_of(n, 4) for n in range(16)]  # 4 MiB of values into 2 MiB
        fill_remote(a, engine_a, prompts)
        stats = a.remote_statistics()
        assert stats.refused_commands > 0 and stats.failed_writes == stats.refused_commands
        assert stats.written_values > 0 and stats.errors == 0
        b, engine_b = managers(server.url, gpu_mib=4)
        reused = [compute(b, engine_b, tokens + [1]) for tokens in prompts]
        assert sum(reused) > 0 and all(r % TPB == 0 for r in reused)
    finally:
        server.stop()


def test_a_password_from_the_url_or_the_environment(tmp_path, managers, monkeypatch):
    server = ValkeyServer(tmp_path / "auth", extra=("--requirepass", "s3cret")).start()
    try:
        with pytest.raises(StorageError, match="refuses the credentials"):
            managers(server.url, timeout_ms=500)  # no password
        url = f"valkey://:s3cret@127.0.0.1:{server.port}/0"
        a, engine_a = managers(url)
        fill_remote(a, engine_a, [prompt_of(9, 2)])
        monkeypatch.setenv("KVPOOL_REMOTE_PASSWORD", "s3cret")
        b, engine_b = managers(server.url)
        assert compute(b, engine_b, prompt_of(9, 2) + [1]) == 2 * TPB
        monkeypatch.setenv("TENANT_PASSWORD", "wrong")
        with pytest.raises(StorageError, match=r"credentials \(AuthenticationError: inv"):
            managers(server.url, password_env="TENANT_PASSWORD")
    finally:
        server.stop()


def test_a_start_up_error_says_its_real_cause(tmp_path, managers):
    """Issue 30: every start-up StorageError said errno 111, whatever the cause."""
    import errno
    import socket

    server = ValkeyServer(tmp_path / "causes", extra=("--requirepass", "s3cret")).start()
    silent = socket.socket()  # accepts connections, never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    down = ValkeyServer(tmp_path / "down")
    cases = [
        (down.url, errno.ECONNREFUSED, "refuses connections"),
        (f"valkey://127.0.0.1:{silent.getsockname()[1]}/0", errno.ETIMEDOUT, "in time"),
        (server.url, errno.EACCES, "refuses the credentials"),
        (f"valkey://:s3cret@127.0.0.1:{server.port}/99", errno.EINVAL, "DB index is out of range"),
    ]
    try:
        for url, code, words in cases:
            with pytest.raises(StorageError) as caught:
                managers(url, timeout_ms=300)
            assert caught.value.errno == code and words in str(caught.value), caught.value
            assert "s3cret" not in str(caught.value)
    finally:
        silent.close()
        server.stop()


def test_no_error_log_repr_or_report_shows_a_password(tmp_path, managers, caplog, capsys):
    """Issue 30: a bad URL's ConfigError repeated its password. Every path that quotes a URL:
    the config check, its repr, start-up errors, the warnings of a degraded or failing tier,
    `kvpool replay`'s one-line error."""
    from kvpool.cli import main

    secret = "hunter2"
    bad = f"valkey://admin:{secret}@127.0.0.1:notaport"
    with pytest.raises(ConfigError) as caught:
        KVCacheManager(make_config(remote_tier=RemoteCacheTierConfig(bad)))
    assert "remote_tier.url='valkey://***@127.0.0.1:notaport'" in str(caught.value)
    listed = RemoteCacheTierConfig(["valkey://a:1", f"valkey://:{secret}@b:2/x"])
    with pytest.raises(ConfigError) as caught_listed:
        KVCacheManager(make_config(remote_tier=listed))
    assert "url[1]='valkey://***@b:2/x'" in str(caught_listed.value)
    assert secret not in repr(listed) and secret not in repr(make_config(remote_tier=listed))
    down = ValkeyServer(tmp_path / "down")
    url = f"valkey://:{secret}@127.0.0.1:{down.port}/0"
    with pytest.raises(StorageError) as refused:
        managers(url, timeout_ms=200)
    with caplog.at_level(logging.DEBUG, logger="kvpool"):
        m, engine = managers(url, timeout_ms=200, tolerate_unavailable=True)
        fill_remote(m, engine, [prompt_of(5, 2)])  # failing calls log their warnings
    assert "refuses connections" in caplog.text
    assert main(["replay", "--requests", "4", "--no-progress", "--remote", url]) != 0
    printed = capsys.readouterr()
    assert "remote" in printed.err
    for text in (str(caught.value), str(refused.value), caplog.text, printed.out, printed.err):
        assert secret not in text, text


def test_prometheus_shows_the_remote_tier_and_stats_outlive_shutdown(server, managers):
    prometheus_client = pytest.importorskip("prometheus_client")
    from kvpool.metrics import PrometheusMetrics

    a, engine_a = managers(server.url)
    tokens = prompt_of(12, 3)
    fill_remote(a, engine_a, [tokens])
    b, engine_b = managers(server.url)
    registry = prometheus_client.CollectorRegistry()
    metrics = PrometheusMetrics(b, registry=registry)
    assert compute(b, engine_b, tokens + [1]) == 3 * TPB
    text = prometheus_client.generate_latest(registry).decode()
    samples = prometheus_samples(text)
    remote = b.remote_statistics()
    assert samples[("kvpool:remote_fetched_blocks_total", ())] == remote.fetched_blocks == 3
    assert samples[("kvpool:prefix_cache_hits_total", (("tier", "REMOTE"),))] == 3 * TPB
    assert samples[("kvpool:prefix_cache_hits_total", (("tier", "GPU"),))] == 0
    metrics.close()
    b.shutdown()
    after = b.stats()  # the counters stay readable after shutdown (a last scrape, a report)
    assert after.remote_hit_tokens == 3 * TPB and after.pool_groups == []
    assert after.requests == 1 and after.resumes == 1
