"""manager.stats() counts what happened, exactly; the Prometheus exporter shows those numbers
under vLLM-style names; `kvpool replay --metrics-port` serves them and they match the replay's
own report."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest

from kvpool import (
    ArgumentError,
    ConfigError,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
)
from kvpool.stats import LATENCY_BOUNDS, LatencyHistogram
from tests.engine_check import CheckingEngine
from tests.helpers import (
    MiB,
    make_config,
    prometheus_samples,
    record_layer,
    shutdown,
    write_tiny_hf_config,
)

TPB = 16
LAYERS = [record_layer(i, TPB, repeats=64) for i in range(2)]  # 64 KiB pages: 32 per 2 MiB


@pytest.fixture
def manager():
    m = KVCacheManager(
        make_config(LAYERS, [GpuCacheTierConfig(2 * MiB), HostCacheTierConfig(2 * MiB)], TPB)
    )
    yield m, CheckingEngine(m)
    shutdown(m)


def tokens_of(n, blocks):
    return [n * 1000 + i for i in range(blocks * TPB)]


def test_stats_count_requests_hits_by_level_traffic_and_suspensions(manager):
    m, engine = manager
    m.time_calls()
    first = tokens_of(1, 8)
    cache = m.create_kv_cache(None, first[:-1])
    assert cache.resume() and engine.step(cache, first, first)
    cache.suspend()
    assert cache.resume()
    cache.close()
    for n in range(2, 6):  # 32 more blocks through 32 GPU slots: the first request's go down
        other = tokens_of(n, 8)
        c = m.create_kv_cache(None, other[:-1])
        assert c.resume() and engine.step(c, other, other)
        c.close()
    stats = m.stats()
    assert stats.moved_pages_to_level[1] >= 8 and stats.moved_bytes_to_level[1] == (
        stats.moved_pages_to_level[1] * 64 * 1024
    )
    again = m.create_kv_cache(None, first + [1])  # 8 blocks, each on the host now
    stats = m.stats()
    assert stats.requests == 6 and stats.query_tokens == 5 * (8 * TPB - 1) + 8 * TPB + 1
    assert stats.hit_tokens_by_level == [0, 8 * TPB] and stats.hit_tokens == 8 * TPB
    assert stats.suspensions == 1 and stats.resumes == 6 and stats.failed_resumes == 0
    assert stats.copy_bytes >= stats.moved_bytes_to_level[1] and stats.copy_seconds > 0
    assert stats.calls["resume"].count == 6 and stats.calls["create_kv_cache"].count == 6
    assert stats.calls["commit"].count == 5 and stats.calls["close"].count == 5
    assert [u.slots for u in stats.pool_groups] == [32, 32]
    assert stats.pool_groups[0].tier == "GPU" and stats.pool_groups[1].tier == "HOST"
    again.close()
    before = m.stats().pool_groups[0].used_slots
    assert before > 0 and stats.remote is None and stats.rebalances == 0


def test_rebalances_and_failed_resumes_are_counted(manager):
    m, _ = manager
    layers = [record_layer(0, TPB, repeats=64), record_layer(1, TPB, window=32, repeats=32)]
    two = KVCacheManager(make_config(layers, [GpuCacheTierConfig(8 * MiB)], TPB))
    try:
        checking = CheckingEngine(two)
        first, second = tokens_of(1, 70), tokens_of(2, 10)
        a = two.create_kv_cache(None, [])
        assert a.resume() and checking.step(a, first, first)  # slots 0-69 of 192 in group 0
        b = two.create_kv_cache(None, [])
        assert b.resume() and checking.step(b, second, second)  # slots 70-79, kept locked
        a.close()
        two.adjust_cache_level(0, [0.2, 0.8])  # group 0 shrinks to 64 slots: b's pages move
        checking.check(b, second)
        b.close()
        stats = two.stats()
        assert stats.rebalances == 1 and stats.rebalance_seconds.count == 1
        assert stats.rebalance_bytes == 10 * 32 * 1024  # b's full-attention pages (32 KiB)
    finally:
        shutdown(two)
    holders = []
    for _ in range(4):  # GPU full of locked pages: a resume finds no room
        c = m.create_kv_cache(None, [])
        assert c.resume() and c.resize(8 * TPB)
        holders.append(c)
    waiting = m.create_kv_cache(None, [])
    assert not waiting.resume()
    assert m.stats().failed_resumes == 1
    waiting.close()
    for c in holders:
        c.close()


def test_latency_histogram_buckets():
    histogram = LatencyHistogram()
    for seconds in (5e-7, 1e-6, 3e-6, 0.03, 100.0):
        histogram.observe(seconds)
    assert histogram.count == 5 and histogram.counts[0] == 2  # <= 1 us
    assert histogram.counts[LATENCY_BOUNDS.index(5e-6)] == 1
    assert histogram.counts[-1] == 1  # beyond 10 s


def test_prometheus_exposition_shows_the_stats(manager):
    prometheus_client = pytest.importorskip("prometheus_client")
    from kvpool.metrics import PrometheusMetrics

    m, engine = manager
    registry = prometheus_client.CollectorRegistry()
    metrics = PrometheusMetrics(m, labels={"model_name": "tiny"}, registry=registry)
    tokens = tokens_of(3, 4)
    for _ in range(2):
        c = m.create_kv_cache(None, tokens[:-1])
        assert c.resume() and engine.step(c, tokens, tokens[c.num_committed_tokens :])
        c.close()
    text = prometheus_client.generate_latest(registry).decode()
    samples = prometheus_samples(text)
    stats = m.stats()

    def value(name, **labels):
        return samples[(name, tuple(sorted({"model_name": "tiny", **labels}.items())))]

    assert value("kvpool:requests_total") == 2
    assert value("kvpool:prefix_cache_queries_total") == stats.query_tokens == 2 * (4 * TPB - 1)
    assert value("kvpool:prefix_cache_hits_total", tier="GPU") == 4 * TPB - 1  # (partial)
    assert value("kvpool:prefix_cache_hits_total", tier="HOST") == 0
    usage = stats.pool_groups[0]
    assert (
        value("kvpool:kv_cache_usage_perc", level="0", tier="GPU", pool_group="0")
        == (usage.usage)
        > 0
    )
    assert value("kvpool:kv_cache_bytes", level="1", tier="HOST", pool_group="0") == 2 * MiB
    assert value("kvpool:call_duration_seconds_count", call="resume") == 2
    assert value("kvpool:call_duration_seconds_bucket", call="resume", le="+Inf") == 2
    assert value("kvpool:rebalance_duration_seconds_count") == 0
    metrics.close()
    assert prometheus_client.generate_latest(registry) == b""
    with pytest.raises(ConfigError, match="labels"):
        PrometheusMetrics(m, labels={"bad label": "x"}, registry=registry)


def test_serving_on_a_taken_port_is_an_error_naming_it_and_leaves_nothing_registered(manager):
    """Issue 30: a bare OSError, and the collector stayed registered: a second collector of
    the manager then doubled every sample."""
    import socket

    prometheus_client = pytest.importorskip("prometheus_client")
    from kvpool.metrics import PrometheusMetrics

    m, _ = manager
    registry = prometheus_client.CollectorRegistry()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        first = PrometheusMetrics(m, registry=registry)
        with pytest.raises(ArgumentError, match=rf"port={port} is invalid: must be a port"):
            first.serve(port, "127.0.0.1")
        assert prometheus_client.generate_latest(registry) == b""  # unregistered
        first.close()  # (harmless)
        checked = PrometheusMetrics(m, registry=prometheus_client.CollectorRegistry())
        for bad in (-1, 70000, 1.5, "9400"):  # refused before anything changes
            with pytest.raises(ArgumentError, match="port="):
                checked.serve(bad)
        checked.close()
        second = PrometheusMetrics(m, registry=registry)
        served = second.serve(0, "127.0.0.1")
        text = prometheus_client.generate_latest(registry).decode()
        samples = [line for line in text.splitlines() if line.startswith("kvpool:requests_total")]
        assert len(samples) == 1 and served > 0  # one collector: no doubled sample
        second.close()
    finally:
        taken.close()


def test_kvpool_replay_serves_metrics_that_match_its_report(tmp_path):
    pytest.importorskip("prometheus_client")
    model = write_tiny_hf_config(tmp_path)
    report_file = tmp_path / "report.json"
    command = [
        *(sys.executable, "-m", "kvpool.cli", "replay", "--requests", "40"),
        *("--hf-config", str(model), "--gpu", "2MiB", "--host", "2MiB", "--no-progress"),
        *("--json", str(report_file), "--metrics-port", "0", "--metrics-hold", "60"),
    ]
    process = subprocess.Popen(
        command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )
    try:
        line = process.stderr.readline()
        assert "serving Prometheus metrics on http://" in line, line
        port = int(line.rsplit(":", 1)[1].split("/")[0])
        for _ in range(600):
            if report_file.exists():
                break
            assert process.poll() is None
            time.sleep(0.1)
        report = json.loads(report_file.read_text())["report"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        process.terminate()
        process.wait(10)
    samples = prometheus_samples(text)
    assert report["preemptions"] == 0 and report["requests"] == 40
    assert samples[("kvpool:requests_total", ())] == 40  # (every admission succeeded first time)
    assert samples[("kvpool:prefix_cache_queries_total", ())] == report["prompt_tokens"] - 40
    for tier, hits in zip(report["level_names"], report["hit_tokens_by_level"], strict=True):
        assert samples[("kvpool:prefix_cache_hits_total", (("tier", tier),))] == hits
    assert report["hit_tokens"] > 0 and report["pages_moved_to_level"][1] > 0
    for level, tier in enumerate(report["level_names"]):
        labels = (("level", str(level)), ("tier", tier))
        assert (
            samples[("kvpool:migrated_pages_total", labels)]
            == report["pages_moved_to_level"][level]
        )
    evicted = sum(v for (name, _), v in samples.items() if name == "kvpool:evicted_pages_total")
    assert evicted == report["dropped_pages"]
    assert samples[("kvpool:suspensions_total", ())] == report["suspensions"]


def test_metrics_flags_are_checked_before_any_work(capsys):
    from kvpool.cli import main

    for argv, fragment in [
        (["--metrics-hold", "5"], "--metrics-hold needs --metrics-port"),
        (["--metrics-port", "70000"], "must be in [0, 65535]"),
        (["--metrics-port", "0", "--capacity-blocks", "10"], "takes no --metrics-port"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(["replay", "--requests", "2", "--no-progress", *argv])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and fragment in err, err
    assert issubclass(ArgumentError, ValueError)
