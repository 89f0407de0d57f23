"""Shared test setup: every test runs with the debug invariant checks on."""

import os

import pytest

os.environ.setdefault("KVPOOL_DEBUG", "1")

import kvpool


def pytest_collection_modifyitems(config, items):
    """`reference_only` tests patch methods of core classes: on the native backend (compiled
    classes) the patch would not reach compiled callers, so they run on the python one."""
    if kvpool.backend() == "python":
        return
    skip = pytest.mark.skip(reason="patches a core method: runs on the python backend")
    for item in items:
        if "reference_only" in item.keywords:
            item.add_marker(skip)


def pytest_addoption(parser):
    parser.addoption(
        "--fuzz-ops",
        type=int,
        default=int(os.environ.get("KVPOOL_FUZZ_OPS", "2000")),
        help="operations per layout in tests/fuzz (default 2000; KVPOOL_FUZZ_OPS)",
    )
    parser.addoption(
        "--fuzz-seed",
        type=int,
        default=int(os.environ.get("KVPOOL_FUZZ_SEED", "1")),
        help="seed of the fuzzer's operation sequences (KVPOOL_FUZZ_SEED)",
    )
