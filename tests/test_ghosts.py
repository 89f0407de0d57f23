"""kvpool.ghosts: the C ghost table of the native backend against its reference (ghosts.py),
both against a plain model: random puts, takes and forgets, one by one and in batches (growth,
compaction, holes, keys alike but in one word, a key twice in a batch, tables made with room up
front); the same values, the same order; bad arguments refused alike, changing nothing."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

import kvpool
import kvpool.ghosts
from tests.helpers import c_module_forms

REFERENCE, IMPLEMENTATIONS = c_module_forms("ghosts")


def test_the_native_backend_runs_the_c_module():
    if kvpool.backend() != "native":
        pytest.skip("python backend")
    assert kvpool.ghosts.__file__.endswith(".so") and len(IMPLEMENTATIONS) == 2


def random_key(rng: random.Random, pool: int) -> bytes:
    n = rng.randrange(pool)
    if n % 7 == 0:  # (some keys alike but in their first word)
        return n.to_bytes(8, "little") + b"\x02" * 24
    return b"\x01" * 24 + n.to_bytes(8, "big")


def named(text: str) -> bytes:
    return text.encode().ljust(32, b".")


@pytest.mark.parametrize("module", IMPLEMENTATIONS)
@pytest.mark.parametrize("seed", range(6))
def test_matches_an_ordered_dict_under_random_operations(module, seed):
    rng = random.Random(seed)
    expected = rng.choice([0, 0, 10, 3000])  # (room made up front, or grown into)
    table, model = module.GhostTable(expected), OrderedDict()
    pool = rng.choice([20, 300, 5000])
    for step in range(6000):
        op = rng.randrange(12)
        key = random_key(rng, pool)
        if op == 10:  # a batch of puts (a key may come twice: the last value stays)
            keys = [random_key(rng, pool) for _ in range(rng.randrange(40))]
            values = [rng.randrange(1 << 30) for _ in keys]
            table.put_many(keys, values)
            for k, v in zip(keys, values, strict=True):
                model[k] = v
        elif op == 11:  # a batch of takes (a key twice: found once, then absent)
            keys = [random_key(rng, pool) for _ in range(rng.randrange(40))]
            assert table.take_many(keys) == [model.pop(k, -1) for k in keys]
        elif op < 5:
            value = rng.randrange(2**63) if rng.random() < 0.1 else rng.randrange(1 << 30)
            table.put(key, value)
            model[key] = value  # (an existing key keeps its place)
        elif op < 8:
            assert table.take(key) == model.pop(key, -1)
        elif op == 8:
            assert table.get(key) == model.get(key, -1)
        else:
            count = rng.randrange(4) if rng.random() < 0.9 else rng.randrange(len(model) + 3)
            expected = [model.popitem(last=False)[1] for _ in range(min(count, len(model)))]
            assert table.forget(count) == expected
        assert len(table) == len(model)
        if step % 500 == 0 or len(model) < 3:
            assert table.items() == list(model.items())
        if step % 50 == 0 and len(model) < 1000:  # every key still found (the index)
            assert all(table.get(key) == value for key, value in model.items())
    assert table.items() == list(model.items())
    assert table.forget(2**70) == list(model.values()) and len(table) == 0  # (any count)
    table.put(named("again"), 5)
    assert table.items() == [(named("again"), 5)]


@pytest.mark.parametrize("module", IMPLEMENTATIONS)
def test_many_entries_then_all_forgotten_in_order(module):
    table = module.GhostTable()
    keys = [i.to_bytes(32, "little") for i in range(100_000)]
    for i, key in enumerate(keys):
        table.put(key, i)
    for key in keys[::3]:
        assert table.take(key) >= 0
    left = [i for i in range(100_000) if i % 3]
    assert table.forget(10) == left[:10] and len(table) == len(left) - 10
    assert table.get(keys[1]) == -1 and table.get(keys[11]) == -1 and table.get(keys[16]) == 16
    assert table.forget(len(left)) == left[10:] and len(table) == 0


@pytest.mark.parametrize("module", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda t: t.put("key", 1), TypeError, "key must be bytes, not str"),
        (lambda t: t.put(bytearray(named("k")), 1), TypeError, "key must be bytes, not bytearray"),
        (lambda t: t.put(b"k", 1), ValueError, "key must be 32 bytes, got 1"),
        (lambda t: t.put(named("k") + b"!", 1), ValueError, "key must be 32 bytes, got 33"),
        (lambda t: t.put(named("k"), -1), ValueError, r"value must be an int in \[0, 2\^?"),
        (lambda t: t.put(named("k"), 2**63), ValueError, "value must be an int"),
        (lambda t: t.put(named("k"), True), ValueError, "value must be an int"),
        (lambda t: t.put(named("k"), 1.0), ValueError, "value must be an int"),
        (lambda t: t.take(7), TypeError, "key must be bytes, not int"),
        (lambda t: t.take(b""), ValueError, "key must be 32 bytes, got 0"),
        (lambda t: t.get(None), TypeError, "key must be bytes, not NoneType"),
        (lambda t: t.get(b"a" * 31), ValueError, "key must be 32 bytes, got 31"),
        (lambda t: t.forget(-1), ValueError, "count must be an int >= 0, got -1"),
        (lambda t: t.forget(-(2**70)), ValueError, "count must be an int >= 0"),
        (lambda t: t.forget(1.5), ValueError, "count must be an int >= 0"),
        # A batch is checked whole before anything is put or taken.
        (lambda t: t.put_many([named("a"), named("c"), "d"], [5, 6, 7]), TypeError, "key must be"),
        (lambda t: t.put_many([named("a"), b"c"], [5, 6]), ValueError, "key must be 32 bytes"),
        (lambda t: t.put_many([named("a"), named("c")], [5, -6]), ValueError, "value must be an"),
        (lambda t: t.put_many([named("a"), named("c")], [5]), ValueError, "2 keys, 1 values"),
        (lambda t: t.put_many((named("a"),), [5]), TypeError, "keys must be a list, not tuple"),
        (lambda t: t.put_many([named("a")], (5,)), TypeError, "values must be a list, not tuple"),
        (lambda t: t.take_many([named("a"), 3]), TypeError, "key must be bytes, not int"),
        (lambda t: t.take_many([named("a"), b"a"]), ValueError, "key must be 32 bytes, got 1"),
        (lambda t: t.take_many(b"ab"), TypeError, "keys must be a list, not bytes"),
    ],
)
def test_bad_arguments_are_refused_and_change_nothing(module, call, error, match):
    table = module.GhostTable()
    table.put(named("a"), 1)
    table.put(named("b"), 2)
    with pytest.raises(error, match=match.replace(r"2\^?", "")):
        call(table)
    assert table.items() == [(named("a"), 1), (named("b"), 2)]
    assert table.take(named("a")) == 1  # (and the index still finds what is there)


@pytest.mark.parametrize("module", IMPLEMENTATIONS)
@pytest.mark.parametrize("expected", [-1, 2**30 + 1, 2**70, 1.5, "8", True])
def test_a_bad_size_hint_is_refused(module, expected):
    with pytest.raises(ValueError, match=r"expected must be an int in \[0, 1073741824\]"):
        module.GhostTable(expected)


@pytest.mark.parametrize("module", IMPLEMENTATIONS)
def test_a_table_made_with_room_behaves_as_one_grown(module):
    """Room made up front changes nothing a call returns, only when the arrays are made."""
    grown, ready = module.GhostTable(), module.GhostTable(expected=5000)
    keys = [i.to_bytes(32, "big") for i in range(12_000)]
    for table in (grown, ready):
        table.put_many(keys[:7000], list(range(7000)))
        assert table.take_many(keys[::2]) == [i if i < 7000 else -1 for i in range(0, 12_000, 2)]
        table.put_many(keys[7000:], list(range(7000, 12_000)))
        assert table.forget(100) == list(range(1, 201, 2))
    assert grown.items() == ready.items() and len(grown) == len(ready) == 8400


def test_both_forms_export_the_same_limits():
    for module in IMPLEMENTATIONS:
        table_module = module.values[0]
        assert (table_module.MAX_VALUE, table_module.KEY_BYTES, table_module.MAX_EXPECTED) == (
            REFERENCE.MAX_VALUE,
            REFERENCE.KEY_BYTES,
            REFERENCE.MAX_EXPECTED,
        )


def test_the_native_table_keeps_no_key_object():
    """A ghost's key is copied in: the table holds no reference to the bytes object (a dropped
    block's key is freed with it), and what it returns is an equal key."""
    import sys

    if len(IMPLEMENTATIONS) < 2:
        pytest.skip("python backend")
    table = IMPLEMENTATIONS[1].values[0].GhostTable()
    key = bytes(range(32))
    before = sys.getrefcount(key)
    table.put(key, 7)
    table.put_many([key], [8])
    assert sys.getrefcount(key) == before
    assert table.items() == [(bytes(range(32)), 8)] and table.items()[0][0] is not key


def test_a_table_never_written_costs_nothing_and_its_room_comes_at_the_first_put():
    import tracemalloc

    if len(IMPLEMENTATIONS) < 2:
        pytest.skip("python backend")
    module = IMPLEMENTATIONS[1].values[0]
    tracemalloc.start()
    try:
        table = module.GhostTable(1 << 20)
        made = tracemalloc.get_traced_memory()[0]
        table.put(named("first"), 1)
        written = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert made < 1 << 12  # (the smallest arrays)
    assert written > 100 << 20  # (room for 2**20 entries: the ring and its index, 112 MiB)
    assert table.items() == [(named("first"), 1)]
