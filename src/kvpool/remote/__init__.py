"""The shared remote tier on Valkey (see `tier.py`): content-addressed values any engine
instance with the same model layout can read."""

from kvpool.remote.cluster import NodeStatistics
from kvpool.remote.store import RemoteStatistics, RemoteStore, WriteBack
from kvpool.remote.tier import RemotePrefix, RemoteTier

__all__ = [
    "NodeStatistics",
    "RemotePrefix",
    "RemoteStatistics",
    "RemoteStore",
    "RemoteTier",
    "WriteBack",
]
