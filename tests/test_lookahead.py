"""`look_ahead`: a lookup's I/O (the remote tier's answer and values, disk read-ahead) runs on
the manager's look-ahead threads, never on the caller's; `create_kv_cache(lookahead=...)` then
takes the values without asking the server. Against real valkey-server processes; every byte
served is checked (CheckingEngine's records)."""

from __future__ import annotations

import pytest

from kvpool import (
    ArgumentError,
    ConfigError,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    KVCacheManager,
    LogicError,
    RemoteCacheTierConfig,
)
from tests.engine_check import CheckingEngine
from tests.helpers import MiB, make_config, record_layer, shutdown
from tests.valkey_servers import ValkeyServer, server_binary

TPB = 16
REPEATS = 64
FULL = [record_layer(i, TPB, repeats=REPEATS) for i in range(2)]
needs_valkey = pytest.mark.skipif(server_binary() is None, reason="no valkey-server binary")


@pytest.fixture
def server(tmp_path):
    s = ValkeyServer(tmp_path / "valkey").start()
    yield s
    s.stop()


@pytest.fixture
def managers():
    made = []

    def make(url=None, tiers=None, **remote):
        remote.setdefault("timeout_ms", 1000)
        m = KVCacheManager(
            make_config(
                layers=FULL,
                tokens_per_block=TPB,
                tiers=tiers or [GpuCacheTierConfig(2 * MiB)],
                remote_tier=None if url is None else RemoteCacheTierConfig(url, **remote),
            )
        )
        made.append(m)
        return m, CheckingEngine(m)

    yield make
    for m in made:
        if not m._closed:
            shutdown(m)


def prompt_of(n, blocks):
    return [n * 10_000 + i for i in range(blocks * TPB)]


def compute(m, engine, tokens, lookahead=None):
    cache = m.create_kv_cache(None, tokens[:-1], lookahead=lookahead)
    assert cache.resume()
    reused = cache.num_committed_tokens
    engine.check(cache, tokens)  # every reused page holds what was written for its tokens
    assert engine.step(cache, tokens, tokens[reused:])
    cache.close()
    return reused


def level_of(m, tokens):
    cache = m.create_kv_cache(None, tokens)
    levels = {page.level for page in cache.pages(0)}
    cache.close()
    return min(levels) if levels else -1


def forbid_remote_calls(m, monkeypatch):
    """The manager's own connection must not be used: every call on it fails the test."""

    def refuse(*_):
        raise AssertionError("the manager's thread asked the remote tier")

    monkeypatch.setattr(m._remote.store, "exists", refuse)
    monkeypatch.setattr(m._remote.store, "get_many", refuse)


@needs_valkey
def test_a_lookahead_fetches_on_its_thread_and_create_takes_its_checked_values(
    server, managers, monkeypatch
):
    a, engine_a = managers(server.url, tiers=[GpuCacheTierConfig(2 * MiB)])
    prompts = [prompt_of(n, 3) for n in range(3)]
    for tokens in prompts:
        assert compute(a, engine_a, tokens) == 0
        a_cache = a.create_kv_cache(None, tokens)
        a.write_remote(a_cache)
        a_cache.close()
    assert a.flush_remote_writes(10)

    b, engine_b = managers(server.url)
    forbid_remote_calls(b, monkeypatch)
    for tokens in prompts:
        lookahead = b.look_ahead(None, tokens[:-1])
        assert lookahead.needs_io and lookahead.wait(10)
        assert lookahead.remote is not None and lookahead.remote.end == 2
        assert compute(b, engine_b, tokens, lookahead) == 2 * TPB  # bytes a wrote, checked
    stats = b.remote_statistics()
    assert stats.fetched_blocks == 6 and stats.lookups == 3 and stats.corrupt_values == 0


@needs_valkey
def test_a_stalled_server_never_holds_the_callers_thread(server, managers):
    a, engine_a = managers(server.url)
    tokens = prompt_of(1, 3)
    assert compute(a, engine_a, tokens) == 0
    a_cache = a.create_kv_cache(None, tokens)
    a.write_remote(a_cache)
    a_cache.close()
    assert a.flush_remote_writes(10)
    b, engine_b = managers(server.url, timeout_ms=3000)
    server.pause()  # (SIGSTOP: it answers nothing until resumed)
    try:
        lookahead = b.look_ahead(None, tokens[:-1])  # returns although nobody can answer
        assert not lookahead.ready
        with pytest.raises(LogicError, match="before the lookahead is ready"):
            b.create_kv_cache(None, tokens[:-1], lookahead=lookahead)
        assert b.num_open_kv_caches == 0  # (refused before any state changed)
    finally:
        server.unpause()
    assert lookahead.wait(10)
    assert compute(b, engine_b, tokens, lookahead) == 2 * TPB


@needs_valkey
def test_a_cancelled_lookahead_is_not_used_and_a_stale_one_is_checked(server, managers):
    a, engine_a = managers(server.url)
    tokens = prompt_of(2, 4)
    assert compute(a, engine_a, tokens) == 0
    a_cache = a.create_kv_cache(None, tokens)
    a.write_remote(a_cache)
    a_cache.close()
    assert a.flush_remote_writes(10)

    b, engine_b = managers(server.url)
    cancelled = b.look_ahead(None, tokens[:-1])
    cancelled.cancel()
    assert cancelled.wait(10) and cancelled.remote is None
    assert compute(b, engine_b, tokens, cancelled) == 0  # (nothing asked: a miss)

    c, engine_c = managers(server.url)
    stale = c.look_ahead(None, tokens[:-1])  # found blocks 0..2 past an empty local match
    assert stale.wait(10) and stale.remote is not None and stale.remote.start == 0
    assert compute(c, engine_c, tokens[: TPB + 1]) == TPB  # block 0 is local now
    # the answer no longer continues the local match: not used (the local block is)
    assert compute(c, engine_c, tokens, stale) == TPB + 1  # (its partial tail too)
    with pytest.raises(ArgumentError, match="lookahead"):
        c.create_kv_cache(None, tokens[:-2], lookahead=stale)
    with pytest.raises(ArgumentError, match="lookahead"):
        c.create_kv_cache(None, tokens[:-1], lookahead="no")


def test_disk_pages_are_read_ahead_and_a_local_hit_needs_no_io(managers, tmp_path):
    tiers = [GpuCacheTierConfig(2 * MiB), DiskCacheTierConfig(8 * MiB, str(tmp_path))]
    m, engine = managers(tiers=tiers)
    first = prompt_of(1, 3)
    assert compute(m, engine, first) == 0
    n = 0
    while level_of(m, first[:-1]) == 0:  # push its pages to disk
        compute(m, engine, prompt_of(100 + n, 3))
        n += 1
        assert n < 100
    lookahead = m.look_ahead(None, first[:-1])
    assert lookahead.needs_io and lookahead.wait(10)
    page_bytes = sum(m.layout.pool_groups[0].slot_sizes)
    # its three blocks' pages (two full, the last one's partial tail reused too)
    assert lookahead.read_ahead_bytes == 3 * page_bytes
    assert compute(m, engine, first, lookahead) == len(first) - 1  # brought up, bytes checked
    again = m.look_ahead(None, first[:-1])  # at level 0 now: nothing to wait for
    assert again.ready and not again.needs_io
    assert compute(m, engine, first, again) == len(first) - 1


def test_lookahead_threads_is_checked():
    with pytest.raises(ConfigError, match="lookahead_threads"):
        KVCacheManager(make_config(lookahead_threads=0))
