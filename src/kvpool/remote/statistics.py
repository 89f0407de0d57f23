"""The remote tier's counters (one concept: what every store and the tier count, summed)."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class RemoteStatistics:
    """Counters of the remote tier (`KVCacheManager.remote_statistics()`)."""

    lookups: int = 0  # existence queries answered by the server
    found_blocks: int = 0  # blocks past the local prefix those queries found
    fetched_blocks: int = 0  # blocks fetched into local pages: hits from other instances
    hit_tokens: int = 0  # tokens those blocks gave requests
    missing_values: int = 0  # values gone between the lookup and the fetch (evicted)
    corrupt_values: int = 0  # values that failed their check (never written into a page)
    errors: int = 0  # calls that failed: connection, timeout, server error
    skipped_calls: int = 0  # calls not made while the server was down (backoff)
    refused_commands: int = 0  # commands of an answered call the server refused (per key)
    reconnects: int = 0  # times the server came back after being down
    queued_writes: int = 0  # values handed to the write-back thread
    written_values: int = 0
    dropped_writes: int = 0  # not queued: the write-back queue was full
    failed_writes: int = 0  # lost to a failed call
    bytes_written: int = 0
    bytes_read: int = 0

    def __add__(self, other: RemoteStatistics) -> RemoteStatistics:
        return RemoteStatistics(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )


__all__ = ["RemoteStatistics"]
