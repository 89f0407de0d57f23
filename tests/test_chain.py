"""kvpool.chain: the C module of the native backend against its reference (chain.py), on the
same inputs, and both against hashlib; edge tokens (bools, negatives, 2**31, numpy ints,
floats, digests) and bad arguments."""

from __future__ import annotations

import os
import random
from hashlib import sha256

import numpy as np
import pytest

import kvpool
import kvpool.chain
from kvpool.tokens import encode_tokens
from tests.helpers import c_module_forms

REFERENCE, IMPLEMENTATIONS = c_module_forms("chain")


def test_the_native_backend_runs_the_c_module():
    if kvpool.backend() != "native":
        pytest.skip("python backend")
    assert kvpool.chain.__file__.endswith(".so") and len(IMPLEMENTATIONS) == 2


def chained(key: bytes, data: bytes, size: int) -> list[bytes]:
    keys = []
    for start in range(0, len(data), size):
        key = sha256(key + data[start : start + size]).digest()
        keys.append(key)
    return keys


TOKEN_CASES = [
    [],
    [0],
    [2**31 - 1, 0, 7],
    list(range(1000)),
    (5, 6, 7),
    [1, True, 3],  # a bool is not a token
    [1, False],
    [1, -1],
    [2**31],
    [2**63],
    [1, 2.0],
    [1, "2"],
    [1, None],
    [np.int64(4), 5],  # an integer type with __index__
    [np.int32(-1)],
    [b"x" * 32, 1],  # a digest: the general path's
    [True] * 300,
    [*range(299), True],
    [*range(299), 2**40],
]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("tokens", TOKEN_CASES, ids=range(len(TOKEN_CASES)))
def test_encode_ints_gives_the_little_endian_ints_or_none(impl, tokens):
    value = impl.encode_ints(tokens)
    valid = all(
        type(t) is not bool and not isinstance(t, bytes | float | str) and t is not None
        for t in tokens
    ) and all(0 <= int(t) < 2**31 for t in tokens)
    if valid:
        assert value == b"".join(int(t).to_bytes(4, "little") for t in tokens)
    else:
        assert value is None
    assert REFERENCE.encode_ints(tokens) == value


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_encode_ints_takes_lists_and_tuples_only(impl):
    assert impl.encode_ints(range(3)) is None
    assert impl.encode_ints(np.arange(3)) is None


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("blocks", [1, 2, 37])
def test_chain_blocks_gives_hashlibs_chain_and_the_blocks(impl, blocks):
    rng = random.Random(blocks)
    key = rng.randbytes(32)
    data = rng.randbytes(64 * blocks)
    keys, datas = impl.chain_blocks(key, data, 64)
    assert keys == chained(key, data, 64)
    assert datas == [data[i : i + 64] for i in range(0, len(data), 64)]
    assert all(type(k) is bytes and type(d) is bytes for k, d in zip(keys, datas, strict=True))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_walk_index_stops_at_the_first_missing_key(impl):
    rng = random.Random(3)
    key, data = rng.randbytes(32), rng.randbytes(64 * 10)
    keys = chained(key, data, 64)
    index = {k: ("block", i) for i, k in enumerate(keys)}
    assert impl.walk_index(key, data, 64, index) == [("block", i) for i in range(10)]
    del index[keys[6]]
    assert impl.walk_index(key, data, 64, index) == [("block", i) for i in range(6)]
    assert impl.walk_index(rng.randbytes(32), data, 64, index) == []
    assert impl.walk_index(key, b"", 64, index) == []


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bad_arguments_raise_and_name_what_is_wrong(impl):
    key = bytes(32)
    with pytest.raises(ValueError, match="key must be 32 bytes"):
        impl.chain_blocks(bytes(31), bytes(64), 64)
    with pytest.raises(ValueError, match="whole blocks"):
        impl.chain_blocks(key, bytes(65), 64)
    with pytest.raises(ValueError, match="whole blocks"):
        impl.walk_index(key, bytes(64), 0, {})
    with pytest.raises(TypeError, match="data must be bytes"):
        impl.chain_blocks(key, bytearray(64), 64)
    with pytest.raises(TypeError, match="index must be a dict"):
        impl.walk_index(key, bytes(64), 64, [])


def test_both_implementations_agree_on_random_runs():
    if len(IMPLEMENTATIONS) < 2:
        pytest.skip("python backend: no C module to compare")
    rng = random.Random(int(os.environ.get("KVPOOL_SEED", "0")))
    for _ in range(200):
        tokens = [rng.randrange(2**31) for _ in range(rng.randrange(0, 600))]
        if tokens and rng.random() < 0.3:
            tokens[rng.randrange(len(tokens))] = rng.choice([True, -3, 2**31, 1.5, b"d" * 32])
        assert kvpool.chain.encode_ints(tokens) == REFERENCE.encode_ints(tokens)
        size = 4 * rng.choice([1, 16, 64])
        data = rng.randbytes(size * rng.randrange(0, 20))
        key = rng.randbytes(32)
        assert kvpool.chain.chain_blocks(key, data, size) == REFERENCE.chain_blocks(key, data, size)


def test_encode_tokens_refuses_by_name_what_encode_ints_leaves():
    with pytest.raises(ValueError, match=r"tokens\[1\]=True"):
        encode_tokens([1, True, 2])
    with pytest.raises(ValueError, match=r"tokens\[600\]=-1"):
        encode_tokens([*range(600), -1])
    digest = b"d" * 32
    assert encode_tokens([1, digest]) == (1).to_bytes(4, "little") + b"\xff" * 4 + digest
    assert encode_tokens(np.arange(3)) == encode_tokens([0, 1, 2])


class Meddler:
    """A token whose `__index__` changes the list being encoded (adversarial input)."""

    def __init__(self, tokens: list, value: int) -> None:
        self.tokens, self.value = tokens, value

    def __index__(self) -> int:
        self.tokens.clear()
        self.tokens.extend(range(10_000))  # (the list's storage moves)
        return self.value


class Refuser:
    def __index__(self) -> int:
        raise ValueError("no")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_encode_ints_reads_a_snapshot_when_a_token_runs_code(impl):
    tokens: list = [1, 2]
    tokens.append(Meddler(tokens, 7))
    tokens += [3, 4]
    assert impl.encode_ints(tokens) == b"".join(v.to_bytes(4, "little") for v in (1, 2, 7, 3, 4))
    assert len(tokens) == 10_000  # (it did run)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_encode_ints_lets_an_error_other_than_not_an_integer_through(impl):
    import enum

    with pytest.raises(ValueError, match="no"):
        impl.encode_ints([1, Refuser()])
    Size = enum.IntEnum("Size", {"A": 5})
    assert impl.encode_ints([Size.A, 6]) == (5).to_bytes(4, "little") + (6).to_bytes(4, "little")
