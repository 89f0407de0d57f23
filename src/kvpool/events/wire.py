"""KV events on the wire, as vLLM's `vllm/distributed/kv_events.py` (0.33) defines them, so a
KV-aware router that reads vLLM's stream reads kvpool's unchanged.

A message is three ZMQ frames: the topic, the sequence number (8 bytes, big-endian) and a
msgpack `EventBatch` (an array `[ts, events, data_parallel_rank]`); each event is a map tagged
with its class name (`{"type": "BlockStored", ...}`).

Block hashes: the low 64 bits of kvpool's 256-bit chained block key read big-endian (vLLM's
default `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` derives its integers from its SHA-256 keys the same
way). Token ids are included, so a router can hash blocks its own way.

Media: "GPU", "CPU" (host RAM), "DISK" and "EXTERNAL" (the shared remote tier).
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvpool.events.naming import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_EXTERNAL, MEDIUM_GPU, block_hash


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the events."""


class BlockStored(KVCacheEvent):
    """Full blocks, a chain (each the next one's parent), now cached on `medium`."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]  # block_size per block; -1 where a multimodal digest stands
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # (cache salt, digests) per block
    group_idx: int | None = None  # the layer group
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks no longer cached on `medium`."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block of this publisher is gone, on every medium."""


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def decode_batch(payload: bytes) -> KVEventBatch:
    """A message's third frame, decoded (a subscriber's side)."""
    return _DECODER.decode(payload)


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "MEDIUM_EXTERNAL",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVCacheEvent",
    "KVEventBatch",
    "block_hash",
    "decode_batch",
]
