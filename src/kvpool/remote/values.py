"""What the shared tier stores: content-addressed keys and self-checking values.

A key is a fixed prefix, a hash tag placing it on a cluster's node (see `key_of`), a 16-byte
namespace, the block's 32-byte chained key (which already includes the reuse scope and the
whole prefix) and the layer group. The namespace hashes the
model's layout (tokens per block, life cycles, every buffer's placement and size), the user's
model id, the tenant namespace and the shard: two models or two tenants never read each other's KV.

A value is a header (magic, format version, its own key without the prefix: namespace, block
key and layer group; payload length, CRC-32) and the page's bytes, pool by pool. A value is
bound to its key: one copied or renamed to another key (a bug elsewhere, a restore gone wrong,
someone's hand) fails the check there. A value that fails any check is a miss, counted as
corrupt, never written into a page.
"""

from __future__ import annotations

import hashlib
import struct
import zlib

from kvpool.layout import KVLayout

KEY_PREFIX = b"kvpool:2:"  # (version 1's values did not name their keys)
_KEY_BODY_BYTES = 16 + 32 + 2  # namespace, block key, layer group
_HEADER = struct.Struct(f"<4sH{_KEY_BODY_BYTES}sQI")
MAGIC = b"KVPR"
VERSION = 2
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


def key_of(namespace: bytes, block_key: bytes, layer_group: int, tag: bytes | None = None) -> bytes:
    """The key of a block's page; with `tag` (a block key: `Block.tag`), a hash tag of it
    (``{`` 16 hex digits ``}``) right after the prefix, so that a cluster puts every key of
    that tag in one hash slot."""
    body = namespace + block_key + layer_group.to_bytes(2, "little")
    if tag is None:
        return KEY_PREFIX + body
    return KEY_PREFIX + b"{" + tag[:8].hex().encode() + b"}" + body


def encode_value(key: bytes, payload: bytes) -> bytes:
    """The value stored under `key` (from `key_of`): a header naming the key, then `payload`."""
    body = key[-_KEY_BODY_BYTES:]
    assert key.startswith(KEY_PREFIX) and len(key) in (
        len(KEY_PREFIX) + _KEY_BODY_BYTES,
        len(KEY_PREFIX) + _KEY_BODY_BYTES + 18,
    ), key
    header = _HEADER.pack(MAGIC, VERSION, body, len(payload), zlib.crc32(payload))
    return header + payload


def decode_value(key: bytes, value: bytes | None, expected_length: int) -> memoryview | None:
    """The payload of `value`, read under `key` (a view, no copy), or None when it is absent
    or fails a check (wrong magic or version, a header naming another key: another block,
    layer group, namespace; another length than `expected_length`, a bad checksum)."""
    if value is None or len(value) < HEADER_BYTES:
        return None
    magic, version, stored_key, length, checksum = _HEADER.unpack_from(value)
    payload = memoryview(value)[HEADER_BYTES:]
    if (
        magic != MAGIC
        or version != VERSION
        or stored_key != key[-_KEY_BODY_BYTES:]
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
