"""The hazard policy's ghost table: what it remembers of blocks it dropped, oldest first.

One entry per dropped block: its key (32 bytes) -> an int the policy packs (last use and uses).
The policy adds an entry at every drop, looks up every new block (both in batches: `put_many`,
`take_many`), and forgets the oldest entries once the table is full, so all three are O(1) a
key. Order is insertion order; setting a key that is already there changes its value, not its
place (as a dict does). This file is the reference; the native backend runs `ghosts.c` beside
it (an insertion-ordered open-addressing table holding copies of the keys and C ints: no Python
object per entry, so a dropped block's key is freed with it), selected like the core's compiled
modules.
"""

from __future__ import annotations

from collections import OrderedDict

MAX_VALUE = 2**63 - 1
KEY_BYTES = 32  # (a block key: `kvpool.chain.KEY_BYTES`)
MAX_EXPECTED = 2**30


def _check_key(key: bytes) -> None:
    if type(key) is not bytes:
        raise TypeError(f"key must be bytes, not {type(key).__name__}")
    if len(key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES} bytes, got {len(key)}")


def _check_value(value: object) -> None:
    if type(value) is not int or not 0 <= value <= MAX_VALUE:
        raise ValueError(f"value must be an int in [0, {MAX_VALUE}], got {value!r}")


class GhostTable:
    """Keys (32-byte bytes) -> values (ints in [0, 2**63)), in insertion order; room for
    `expected` entries is made at the first put (the native form's arrays: no growing on the
    way there)."""

    def __init__(self, expected: int = 0) -> None:
        if type(expected) is not int or not 0 <= expected <= MAX_EXPECTED:
            raise ValueError(f"expected must be an int in [0, {MAX_EXPECTED}], got {expected!r}")
        # (An OrderedDict: a plain dict's first item costs O(deleted items) to find.)
        self._entries: OrderedDict[bytes, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> int:
        """`key`'s value, or -1."""
        _check_key(key)
        return self._entries.get(key, -1)

    def take(self, key: bytes) -> int:
        """Remove `key` and return its value, or -1 (and nothing changes) if it is absent."""
        _check_key(key)
        return self._entries.pop(key, -1)

    def put(self, key: bytes, value: int) -> None:
        """Set `key`'s value (a new key goes last)."""
        _check_key(key)
        _check_value(value)
        self._entries[key] = value

    def take_many(self, keys: list[bytes]) -> list[int]:
        """`take` each key, in order (the native form asks for the index slots ahead: the batch's
        cache misses overlap). Keys are checked before any is taken."""
        if type(keys) is not list:
            raise TypeError(f"keys must be a list, not {type(keys).__name__}")
        for key in keys:
            _check_key(key)
        pop = self._entries.pop
        return [pop(key, -1) for key in keys]

    def put_many(self, keys: list[bytes], values: list[int]) -> None:
        """`put` each (key, value), in order; every argument is checked before any is put."""
        if type(values) is not list:
            raise TypeError(f"values must be a list, not {type(values).__name__}")
        if type(keys) is list and len(keys) != len(values):
            raise ValueError(
                f"keys and values must be as long: {len(keys)} keys, {len(values)} values"
            )
        if type(keys) is not list:
            raise TypeError(f"keys must be a list, not {type(keys).__name__}")
        for key in keys:
            _check_key(key)
        for value in values:
            _check_value(value)
        entries = self._entries
        for key, value in zip(keys, values, strict=True):
            entries[key] = value

    def forget(self, count: int) -> list[int]:
        """Remove the `count` oldest entries (all, if fewer) and return their values, oldest
        first."""
        if type(count) is not int or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        pop = self._entries.popitem
        return [pop(last=False)[1] for _ in range(min(count, len(self._entries)))]

    def items(self) -> list[tuple[bytes, int]]:
        """Every (key, value), oldest first."""
        return list(self._entries.items())
