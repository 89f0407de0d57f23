"""KV events for routers (`KVCacheManagerConfig.kv_events`): what a manager caches, on which
medium, published over ZMQ in vLLM's wire format. `wire` holds the event classes (needs
msgspec), `log` the engine-side collector, `publisher` the ZMQ thread (needs pyzmq)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.events.log import KVEventLog
from kvpool.events.naming import MEDIA

if TYPE_CHECKING:
    from kvpool.manager import KVCacheManager


def cached_blocks(manager: KVCacheManager) -> dict[str, set[tuple[int, int]]]:
    """The manager's own view of what its events announce: per medium, the (64-bit block hash,
    layer group) of every full block's page in its tree. O(cached blocks): for tests and
    debugging, not for the engine's loop."""
    from kvpool.events.naming import block_hash

    tpb = manager.tokens_per_block
    media = [MEDIA[manager.get_tier(level)] for level in range(manager.num_levels)]
    view: dict[str, set[tuple[int, int]]] = {}
    for block in manager._tree.index.values():
        if block.num_tokens != tpb:
            continue
        for group, page in enumerate(block):
            if page is not None:
                view.setdefault(media[page.level], set()).add((block_hash(block.key), group))
    return view


__all__ = ["KVEventLog", "cached_blocks"]
