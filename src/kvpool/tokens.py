"""Tokens: their checks and encoding, and the chained keys that name blocks and reuse scopes.

A block's key is SHA-256(previous key || the block's tokens encoded); the first key is derived
from the request's reuse scope, so requests share blocks only within one scope. Keys are compared,
not tokens, so they must stay collision resistant (256 bits). A key names a block and its whole
prefix.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any, Final

from kvpool.chain import encode_ints
from kvpool.config import ReuseScope
from kvpool.errors import ArgumentError

Token = int | bytes
DIGEST_BYTES: Final = 32
MAX_TOKEN: Final = 2**31
# Marks a 32-byte multimodal digest in the hashed byte stream. Int tokens are encoded as 4-byte
# little-endian values below 2**31, which never end in 0xff, so the encoding is unambiguous.
_DIGEST_MARKER: Final = b"\xff\xff\xff\xff"


def root_key(scope: object) -> bytes:
    """Key of a reuse scope's root: a presence mask, then each present field.

    `None`, `(lora=0)`, `(salt=0)` and `(0, 0)` all differ, and so do `(lora=5)` and `(salt=5)`.
    """
    if scope is None:  # (most requests: hashed once)
        return _DEFAULT_ROOT_KEY
    return _root_key(scope)


def _root_key(scope: object) -> bytes:
    if not isinstance(scope, ReuseScope):
        raise ArgumentError(f"reuse_scope={scope!r} is invalid: must be a ReuseScope or None")
    mask = 0
    fields = []
    values: tuple[object, ...] = tuple(scope)  # (a field of any type is refused by name below)
    for bit, (name, value) in enumerate(zip(ReuseScope._fields, values, strict=True)):
        if value is None:
            continue
        mask |= 1 << bit
        fields.append(_encode_scope_field(name, value))
    return hashlib.sha256(bytes([mask]) + b"".join(fields)).digest()


def _encode_scope_field(name: str, value: object) -> bytes:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64:
        return b"i" + value.to_bytes(8, "little")
    if name == "salt" and isinstance(value, str | bytes):
        raw = value.encode() if isinstance(value, str) else value
        return b"s" + len(raw).to_bytes(8, "little") + raw
    allowed = (
        "an integer in [0, 2**64), a str, bytes or None"
        if name == "salt"
        else "an integer in [0, 2**64) or None"
    )
    raise ArgumentError(f"reuse_scope.{name}={value!r} is invalid: must be {allowed}")


_DEFAULT_ROOT_KEY: Final = _root_key(ReuseScope())


def encode_tokens(tokens: Sequence[Any], name: str = "tokens") -> bytes:
    """Bytes of a block's tokens: ints in [0, 2**31) as 4-byte little-endian, 32-byte digests
    after a marker. Anything else (bools included) raises `ArgumentError` (a ValueError) naming
    `name[i]`."""
    if len(tokens) == 1 and type(tokens[0]) is int and 0 <= tokens[0] < MAX_TOKEN:
        return tokens[0].to_bytes(4, "little")  # a decode step's one token
    data = encode_ints(tokens if type(tokens) is list or type(tokens) is tuple else list(tokens))
    if data is None:  # digests, or a token to refuse by name
        data = b"".join(_encode_token(token, name, i) for i, token in enumerate(tokens))
    return data


def encode_checked(tokens: Sequence[Token]) -> bytes:
    """`encode_tokens` for tokens that were checked already (a request's committed tokens)."""
    data = encode_ints(tokens)
    return encode_tokens(tokens) if data is None else data


def _encode_token(token: object, name: str = "tokens", index: int = 0) -> bytes:
    if isinstance(token, int) and not isinstance(token, bool):
        if 0 <= token < MAX_TOKEN:
            return int(token).to_bytes(4, "little")
    elif isinstance(token, bytes) and len(token) == DIGEST_BYTES:
        return _DIGEST_MARKER + token
    raise ArgumentError(
        f"{name}[{index}]={token!r} is invalid: must be an int in [0, 2**31) or a "
        f"{DIGEST_BYTES}-byte digest"
    )


def block_key(previous_key: bytes, tokens: Sequence[Token]) -> bytes:
    return hashlib.sha256(previous_key + encode_tokens(tokens)).digest()


def block_key_of_encoded(previous_key: bytes, encoded: bytes) -> bytes:
    """`block_key` for tokens already validated and encoded by `encode_tokens`."""
    return hashlib.sha256(previous_key + encoded).digest()


def decode_tokens(data: bytes) -> tuple[Token, ...]:
    """The inverse of `encode_tokens`."""
    if _DIGEST_MARKER not in data:
        return struct.unpack(f"<{len(data) // 4}i", data)
    tokens: list[Token] = []
    position = 0
    while position < len(data):
        if data[position : position + 4] == _DIGEST_MARKER:
            tokens.append(bytes(data[position + 4 : position + 4 + DIGEST_BYTES]))
            position += 4 + DIGEST_BYTES
        else:
            tokens.append(int.from_bytes(data[position : position + 4], "little"))
            position += 4
    return tuple(tokens)


def _common_token_prefix(a: bytes, b: bytes) -> int:
    """How many leading tokens two encoded token strings share."""
    size = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        size += 1
    if _DIGEST_MARKER not in a[:size]:
        return size // 4
    count = position = 0
    while True:
        width = 4 + DIGEST_BYTES if a[position : position + 4] == _DIGEST_MARKER else 4
        if position + width > size:
            return count
        position += width
        count += 1
