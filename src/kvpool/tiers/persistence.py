"""The records of a persistent disk level, kept in step with its pages (`DiskRecords`), and the
label a record carries: what block a slot holds.

The storage manager calls `stored(pages)` where pages arrive at the level with their bytes
written (a batch moved down or relocated by a shrink, a page placed back after a swap, a page
fetched from the remote tier and committed there). A page of a committed block gets a record;
any other page gets none (its slot's old record was invalidated when the bytes were written,
`kvpool.storage.persistent`). A page whose block is dropped, or which leaves the level, keeps
its record until its slot is written again: the record still describes what the bytes are.

A label: the block's key, its parent's key (none when the parent is its scope's root), the
scope's root key and the scope itself (a LoRA id and a salt), the layer group, the number of
tokens and the tokens encoded as the tree keeps them. Keys are chained (`kvpool.tokens`), so
a label checks itself: the key must be SHA-256 of the parent's (or the root's) key and the
tokens, and the root key must be the scope's.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from typing import NamedTuple

from kvpool.config import ReuseScope
from kvpool.records import Page
from kvpool.storage.persistent import PersistentDisk

logger = logging.getLogger(__name__)

MAX_SCOPE_BYTES = 1024  # a block of a scope whose salt is longer is not persisted
KEY_BYTES = 32
# layer group, tokens, flags (1: has a parent), key, parent key, root key, data, scope lengths
_LABEL = struct.Struct("<IIB32s32s32sIH")
_HAS_PARENT = 1


def label_bytes(tokens_per_block: int) -> int:
    """The longest label of a block of `tokens_per_block` tokens (all multimodal digests)."""
    return _LABEL.size + 36 * tokens_per_block + MAX_SCOPE_BYTES


def encode_scope(scope: ReuseScope) -> bytes:
    """A scope's fields, typed: its LoRA id (or none), its salt (none, int, str or bytes)."""
    lora, salt = scope.lora_id, scope.salt
    out = b"\0" if lora is None else b"\1" + int(lora).to_bytes(8, "little")
    if salt is None:
        return out + b"n"
    if isinstance(salt, int):
        return out + b"i" + int(salt).to_bytes(8, "little")
    raw, kind = (salt.encode(), b"s") if isinstance(salt, str) else (bytes(salt), b"b")
    return out + kind + raw


def decode_scope(data: bytes) -> ReuseScope | None:
    """The inverse of `encode_scope` (None for bytes it did not make)."""
    try:
        at, lora = 1, None
        if data[0] == 1:
            lora, at = int.from_bytes(data[1:9], "little"), 9
        elif data[0] != 0:
            return None
        kind, rest = data[at : at + 1], data[at + 1 :]
        if kind == b"n" and not rest:
            return ReuseScope(lora, None)
        if kind == b"i" and len(rest) == 8:
            return ReuseScope(lora, int.from_bytes(rest, "little"))
        if kind == b"s":
            return ReuseScope(lora, rest.decode())
        if kind == b"b":
            return ReuseScope(lora, bytes(rest))
    except (IndexError, UnicodeDecodeError):
        pass
    return None


class Label(NamedTuple):
    """What a slot holds, as its record says."""

    layer_group: int
    num_tokens: int
    key: bytes
    parent_key: bytes | None  # None: the parent is the scope's root
    scope_key: bytes
    data: bytes  # the tokens, encoded
    scope: bytes  # `encode_scope` of the scope

    def encode(self) -> bytes:
        flags = 0 if self.parent_key is None else _HAS_PARENT
        fixed = _LABEL.pack(
            self.layer_group,
            self.num_tokens,
            flags,
            self.key,
            self.parent_key or bytes(KEY_BYTES),
            self.scope_key,
            len(self.data),
            len(self.scope),
        )
        return fixed + self.data + self.scope

    @staticmethod
    def decode(raw: bytes) -> Label | None:
        """The label in `raw`, or None when its lengths do not add up."""
        if len(raw) < _LABEL.size:
            return None
        group, tokens, flags, key, parent, root, data_length, scope_length = _LABEL.unpack_from(raw)
        if len(raw) != _LABEL.size + data_length + scope_length or flags & ~_HAS_PARENT:
            return None
        data = raw[_LABEL.size : _LABEL.size + data_length]
        scope = raw[_LABEL.size + data_length :]
        return Label(group, tokens, key, parent if flags else None, root, data, scope)


class DiskRecords:
    """Writes the records of the persistent disk level `level` as committed pages arrive."""

    def __init__(self, level: int, disk: PersistentDisk) -> None:
        self.level = level
        self.disk = disk
        # Scope root key -> `encode_scope` of its scope (registered as requests are created).
        self.scopes: dict[bytes, bytes] = {}
        self.written = 0  # records written
        self.failed = 0  # records that could not be written (an I/O error: logged)
        self.unlabelled = 0  # committed pages without a record (scope unknown or too long)

    def note_scope(self, scope_key: bytes, scope: ReuseScope) -> None:
        if scope_key not in self.scopes:
            encoded = encode_scope(scope)
            if len(encoded) <= MAX_SCOPE_BYTES:
                self.scopes[scope_key] = encoded

    def stored(self, pages: Sequence[Page]) -> None:
        """Pages now in slots of the level (bytes written): record the committed ones."""
        files = self.disk.files
        for page in pages:
            block, slot = page.block, page.slot
            if block is None or slot is None or page.level != self.level:
                continue
            scope = self.scopes.get(block.scope)
            parent = block.parent
            if scope is None or parent is None:
                self.unlabelled += 1
                continue
            label = Label(
                page.layer_group,
                block.num_tokens,
                block.key,
                None if parent.parent is None else parent.key,
                block.scope,
                block.data,
                scope,
            )
            try:
                files[page.pool_group].write_record(slot.slot_id, label.encode())
            except (OSError, ValueError) as error:  # the page stays; only its record is lost
                self.failed += 1
                if self.failed == 1:
                    logger.warning(
                        "persistent disk level: a slot's record could not be written (%s); "
                        "that page will not be found after a restart",
                        error,
                    )
                continue
            self.written += 1

    def forget_all(self) -> None:
        """Invalidate every record: the level's contents are forgotten for later managers too."""
        self.disk.invalidate_all()


__all__ = ["DiskRecords", "Label", "decode_scope", "encode_scope", "label_bytes"]
