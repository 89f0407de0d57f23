"""Block keys in runs: encoding a prompt, hashing a run of blocks, walking the tree's key index.

A block's key is SHA-256(previous key || the block's encoded tokens) (`kvpool.tokens`). These
three calls do it for many blocks at once. This file is the reference; the native backend runs
`chain.c` beside it (one C call per run instead of several objects per block), selected like
the core's compiled modules (`kvpool._backends`). Both give the same bytes and the same blocks.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from hashlib import sha256
from typing import Any

import numpy as np

KEY_BYTES = 32
MAX_TOKEN = 2**31


def encode_ints(tokens: Sequence[Any]) -> bytes | None:
    """4-byte little-endian ints, or None unless `tokens` is a list or tuple of integers (int,
    or any type with `__index__`, but not bool) in [0, 2**31)."""
    if type(tokens) is not list and type(tokens) is not tuple:
        return None
    try:
        data = struct.pack(f"<{len(tokens)}i", *tokens)
    except (struct.error, TypeError):  # not an integer, or outside [-2**31, 2**31)
        return None
    # A top byte >= 0x80 is a negative int; `struct` packs True as 1.
    if not data[3::4].isascii() or _has_bool(tokens, data):
        return None
    return data


def _has_bool(tokens: Sequence[Any], data: bytes) -> bool:
    """Whether an integer token is really a bool (packed as 0 or 1): a long run is checked only
    at the tokens with those values (numpy finds them)."""
    if len(tokens) <= 128:
        return bool in set(map(type, tokens))
    small = np.flatnonzero(np.frombuffer(data, dtype=np.uint32) < 2)
    return any(type(tokens[i]) is bool for i in small.tolist())


def _blocks(key: bytes, data: bytes, block_bytes: int) -> int:
    if type(key) is not bytes or len(key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES} bytes")
    if type(data) is not bytes:
        raise TypeError("data must be bytes")
    if block_bytes <= 0 or len(data) % block_bytes:
        raise ValueError("data must hold whole blocks of block_bytes > 0")
    return len(data) // block_bytes


def chain_blocks(key: bytes, data: bytes, block_bytes: int) -> tuple[list[bytes], list[bytes]]:
    """The chained keys of `data`'s blocks (`block_bytes` each), and the blocks themselves."""
    count = _blocks(key, data, block_bytes)
    keys, datas = [], []
    for start in range(0, count * block_bytes, block_bytes):
        block = data if count == 1 else data[start : start + block_bytes]
        key = sha256(key + block).digest()
        keys.append(key)
        datas.append(block)
    return keys, datas


def walk_index(key: bytes, data: bytes, block_bytes: int, index: dict[bytes, Any]) -> list[Any]:
    """The values `index` holds for the chained keys of `data`'s blocks, from the first on, up
    to the first key it lacks."""
    count = _blocks(key, data, block_bytes)
    if type(index) is not dict:
        raise TypeError("index must be a dict")
    found = []
    for start in range(0, count * block_bytes, block_bytes):
        key = sha256(key + data[start : start + block_bytes]).digest()
        value = index.get(key)
        if value is None:
            break
        found.append(value)
    return found
