"""Shared test setup: every test runs with the debug invariant checks on."""

import os

os.environ.setdefault("KVPOOL_DEBUG", "1")


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
