"""What the shared tier stores: content-addressed keys and self-checking values.

A key is a fixed prefix, a 16-byte namespace, the block's 32-byte chained key (which already
includes the reuse scope and the whole prefix) and the layer group. The namespace hashes the
model's layout (tokens per block, life cycles, every buffer's placement and size), the user's
model id, the tenant namespace and the shard: two models or two tenants never read each other's KV.

A value is a header (magic, format version, the namespace again, payload length, CRC-32) and
the page's bytes, pool by pool. A value that fails any check is a miss, never written into a
page.
"""

from __future__ import annotations

import hashlib
import struct
import zlib

from kvpool.layout import KVLayout

KEY_PREFIX = b"kvpool:1:"
_HEADER = struct.Struct("<4sH2x16sQI")
MAGIC = b"KVPR"
VERSION = 1
HEADER_BYTES = _HEADER.size


def layout_fingerprint(layout: KVLayout) -> bytes:
    """A digest of everything that decides how a page's bytes are laid out."""
    placements = sorted(
        (p.layer_id, p.role, p.layer_group, p.pool_group, p.pool, p.size, p.position)
        for p in layout.buffers.values()
    )
    description = repr(
        (layout.tokens_per_block, [str(lc) for lc in layout.life_cycles], placements)
    )
    return hashlib.sha256(description.encode()).digest()


def namespace_of(layout: KVLayout, model_id: str, namespace: str, shard: int = 0) -> bytes:
    """The 16-byte namespace of a layout, model id, tenant namespace and shard (the part of
    the model's KV heads a tensor-parallel rank holds)."""
    parts = [
        b"kvpool-remote",
        layout_fingerprint(layout),
        model_id.encode(),
        namespace.encode(),
        str(shard).encode(),
    ]
    return hashlib.sha256(b"\0".join(len(p).to_bytes(4, "little") + p for p in parts)).digest()[:16]


def key_of(namespace: bytes, block_key: bytes, layer_group: int) -> bytes:
    return KEY_PREFIX + namespace + block_key + layer_group.to_bytes(2, "little")


def encode_value(namespace: bytes, payload: bytes) -> bytes:
    header = _HEADER.pack(MAGIC, VERSION, namespace, len(payload), zlib.crc32(payload))
    return header + payload


def decode_value(namespace: bytes, value: bytes | None, expected_length: int) -> memoryview | None:
    """The payload of `value` (a view, no copy), or None when it is absent or fails a check
    (wrong magic, version or namespace, another length than `expected_length`, a bad
    checksum)."""
    if value is None or len(value) < HEADER_BYTES:
        return None
    magic, version, stored_namespace, length, checksum = _HEADER.unpack_from(value)
    payload = memoryview(value)[HEADER_BYTES:]
    if (
        magic != MAGIC
        or version != VERSION
        or stored_namespace != namespace
        or length != expected_length
        or len(payload) != length
        or zlib.crc32(payload) != checksum
    ):
        return None
    return payload


__all__ = [
    "HEADER_BYTES",
    "KEY_PREFIX",
    "decode_value",
    "encode_value",
    "key_of",
    "layout_fingerprint",
    "namespace_of",
]
