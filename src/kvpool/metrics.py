"""Prometheus metrics of a manager (extra `metrics`: prometheus_client).

`PrometheusMetrics(manager)` registers a collector that reads `manager.stats()` at each scrape,
so the engine pays nothing between scrapes. Names follow vLLM's and SGLang's conventions
(`kvpool:` prefix, counters exported with `_total`); every sample carries the constant `labels`
given (e.g. `model_name`), plus its own:

| metric | type | labels | what |
|---|---|---|---|
| kvpool:kv_cache_usage_perc | gauge | level, tier, pool_group | fraction of slots in use (0-1) |
| kvpool:kv_cache_slots | gauge | level, tier, pool_group | slots |
| kvpool:kv_cache_used_slots | gauge | level, tier, pool_group | slots in use |
| kvpool:kv_cache_evictable_slots | gauge | level, tier, pool_group | cached, unowned slots |
| kvpool:kv_cache_bytes | gauge | level, tier, pool_group | bytes of the slots |
| kvpool:requests | counter | | create_kv_cache calls |
| kvpool:prefix_cache_queries | counter | | tokens looked up |
| kvpool:prefix_cache_hits | counter | tier | tokens reused, by serving tier (GPU, HOST, DISK, REMOTE) |
| kvpool:evicted_pages | counter | level, tier | cached pages dropped from the local levels |
| kvpool:migrated_pages, kvpool:migrated_bytes | counter | level, tier | pages copied into a level |
| kvpool:swapped_pages | counter | | pages brought up through RAM |
| kvpool:copy_bytes, kvpool:copy_seconds | counter | | page-move copies (bandwidth: rate of both) |
| kvpool:suspensions, kvpool:resumes, kvpool:failed_resumes | counter | | |
| kvpool:forks, kvpool:copy_on_write_pages | counter | | forked requests; shared pages copied before a write |
| kvpool:rebalances, kvpool:rebalance_bytes | counter | | re-splits and the bytes they moved |
| kvpool:rebalance_duration_seconds | histogram | | |
| kvpool:call_duration_seconds | histogram | call | after `manager.time_calls()` |
| kvpool:remote_* | counter | | the remote tier's counters, when there is one |
| kvpool:remote_node_calls, _errors, _skipped_calls, _redirects, _reconnects | counter | node | per node of a remote cluster (`KVCacheManager.remote_nodes()`) |
| kvpool:remote_node_latency_seconds | histogram | node | per node: its pipelines' latency, failed ones included |
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from kvpool.errors import ArgumentError, ConfigError
from kvpool.stats import LATENCY_BOUNDS, LatencyHistogram, ManagerStats
from kvpool.validation import check_int, fail

if TYPE_CHECKING:
    from kvpool.manager import KVCacheManager


class PrometheusMetrics:
    """A collector of one manager's `stats()`, registered in `registry` (the default one
    unless given); `serve(port)` starts an HTTP server for /metrics; `close()` unregisters."""

    def __init__(
        self,
        manager: KVCacheManager,
        labels: Mapping[str, str] | None = None,
        registry: Any = None,
        time_calls: bool = True,
    ) -> None:
        try:
            import prometheus_client
        except ImportError:
            raise ConfigError(
                "kvpool.metrics needs prometheus_client: pip install 'kvpool[metrics]'"
            ) from None
        self.manager = manager
        self.labels = dict(labels or {})
        for name, value in self.labels.items():
            if not isinstance(name, str) or not name.isidentifier() or not isinstance(value, str):
                raise ConfigError(f"labels[{name!r}]={value!r} is invalid: must be str: str")
        self.registry = prometheus_client.REGISTRY if registry is None else registry
        self._server: Any = None
        if time_calls:
            manager.time_calls(True)
        self.registry.register(self)
        self._registered = True

    def describe(self) -> list[Any]:
        return []  # (no names up front: the registry then never collects at registration)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        stats = self.manager.stats()
        family: Any
        constant = list(self.labels)
        values = list(self.labels.values())
        pool_labels = [*constant, "level", "tier", "pool_group"]
        gauges = {
            "kv_cache_usage_perc": ("fraction of the pool group's slots in use", "usage"),
            "kv_cache_slots": ("slots of the pool group", "slots"),
            "kv_cache_used_slots": ("slots in use", "used_slots"),
            "kv_cache_evictable_slots": ("cached slots nobody holds", "evictable_slots"),
        }
        for name, (documentation, attribute) in gauges.items():
            family = GaugeMetricFamily(f"kvpool:{name}", documentation, labels=pool_labels)
            for usage in stats.pool_groups:
                key = [*values, str(usage.level), usage.tier, str(usage.pool_group)]
                family.add_metric(key, float(getattr(usage, attribute)))
            yield family
        family = GaugeMetricFamily(
            "kvpool:kv_cache_bytes", "bytes of the slots", labels=pool_labels
        )
        for usage in stats.pool_groups:
            key = [*values, str(usage.level), usage.tier, str(usage.pool_group)]
            family.add_metric(key, float(usage.slots * usage.slot_bytes))
        yield family

        def counter(name: str, documentation: str, value: float) -> Any:
            family = CounterMetricFamily(f"kvpool:{name}", documentation, labels=constant)
            family.add_metric(values, value)
            return family

        yield counter("requests", "create_kv_cache calls", stats.requests)
        yield counter("prefix_cache_queries", "tokens looked up for reuse", stats.query_tokens)
        family = CounterMetricFamily(
            "kvpool:prefix_cache_hits", "tokens reused, by serving tier", labels=[*constant, "tier"]
        )
        for name, hits in zip(stats.level_names, stats.hit_tokens_by_level, strict=True):
            family.add_metric([*values, name], hits)
        if stats.remote is not None:
            family.add_metric([*values, "REMOTE"], stats.remote_hit_tokens)
        yield family
        level_labels = [*constant, "level", "tier"]
        per_level = {
            "evicted_pages": (
                "cached pages dropped out of the level",
                stats.dropped_pages_by_level,
            ),
            "migrated_pages": ("pages copied into the level", stats.moved_pages_to_level),
            "migrated_bytes": ("bytes copied into the level", stats.moved_bytes_to_level),
        }
        for name, (documentation, counts) in per_level.items():
            family = CounterMetricFamily(f"kvpool:{name}", documentation, labels=level_labels)
            for level, (tier, count) in enumerate(zip(stats.level_names, counts, strict=True)):
                family.add_metric([*values, str(level), tier], count)
            yield family
        yield counter("swapped_pages", "pages brought up through RAM", stats.swapped_pages)
        yield counter("copy_bytes", "bytes copied by page moves", stats.copy_bytes)
        yield counter("copy_seconds", "seconds spent in page-move copies", stats.copy_seconds)
        yield counter("suspensions", "suspend() calls", stats.suspensions)
        yield counter("resumes", "resume() calls that resumed", stats.resumes)
        yield counter("failed_resumes", "resume() calls that found no room", stats.failed_resumes)
        yield counter("forks", "requests forked from another", stats.forks)
        yield counter(
            "copy_on_write_pages", "shared pages copied before a write", stats.copy_on_write_pages
        )
        yield counter("rebalances", "re-splits of a level", stats.rebalances)
        yield counter("rebalance_bytes", "bytes re-splits moved", stats.rebalance_bytes)
        family = HistogramMetricFamily(
            "kvpool:rebalance_duration_seconds", "duration of re-splits", labels=constant
        )
        family.add_metric(values, *_buckets(stats.rebalance_seconds))
        yield family
        family = HistogramMetricFamily(
            "kvpool:call_duration_seconds", "latency of manager calls", labels=[*constant, "call"]
        )
        for call, histogram in sorted(stats.calls.items()):
            family.add_metric([*values, call], *_buckets(histogram))
        yield family
        if stats.remote is not None:
            for field in fields(stats.remote):
                value = getattr(stats.remote, field.name)
                yield counter(f"remote_{field.name}", f"remote tier: {field.name}", value)
        yield from self._remote_nodes(constant, values)

    def _remote_nodes(self, constant: list[str], values: list[str]) -> Iterator[Any]:
        """Per node of a remote cluster: its counters and latency histogram."""
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        from kvpool.remote.cluster import LATENCY_BUCKETS

        nodes = self.manager.remote_nodes()
        if not nodes:
            return
        family: Any
        labels = [*constant, "node"]
        for name, documentation in (
            ("calls", "pipelines the node answered"),
            ("errors", "pipelines to the node that failed (connection, timeout)"),
            ("skipped_calls", "pipelines not sent while the node was backing off"),
            ("redirects", "MOVED and ASK answers of the node followed"),
            ("reconnects", "times the node answered again after failing"),
        ):
            family = CounterMetricFamily(f"kvpool:remote_node_{name}", documentation, labels=labels)
            for address, stats in nodes.items():
                family.add_metric([*values, address], getattr(stats, name))
            yield family
        family = HistogramMetricFamily(
            "kvpool:remote_node_latency_seconds", "latency of pipelines to the node", labels=labels
        )
        for address, stats in nodes.items():
            cumulative, buckets = 0.0, []
            for bound, count in zip([*LATENCY_BUCKETS, float("inf")], stats.latency, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            family.add_metric([*values, address], buckets, stats.seconds)
        yield family

    def serve(self, port: int, address: str = "0.0.0.0") -> int:
        """Serve /metrics over HTTP on `port` (0: a free one) from a daemon thread; returns the
        port. A port that cannot be bound (taken, not allowed) is an `ArgumentError` naming it,
        and the collector is unregistered first (a second one would double every sample)."""
        from prometheus_client import start_http_server

        check_int("port", port, 0, 65535)
        if not isinstance(address, str):
            fail("address", address, "a host name or an IP address")
        try:
            self._server, _ = start_http_server(port, address, registry=self.registry)
        except OSError as error:
            self.close()
            raise ArgumentError(
                f"port={port} is invalid: must be a port this process can bind on {address} "
                f"({error.strerror or error}); the collector was unregistered"
            ) from None
        bound: int = self._server.server_port
        return bound

    def close(self) -> None:
        """Stop serving and unregister (the manager keeps timing calls until told not to).
        Closing twice is harmless."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._registered:
            self._registered = False
            self.registry.unregister(self)


def _buckets(histogram: LatencyHistogram) -> tuple[list[tuple[str, float]], float]:
    cumulative, buckets = 0.0, []
    for bound, count in zip([*LATENCY_BOUNDS, float("inf")], histogram.counts, strict=True):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
    return buckets, histogram.total_seconds


__all__ = ["ManagerStats", "PrometheusMetrics"]
