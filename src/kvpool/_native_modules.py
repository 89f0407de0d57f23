"""The modules of the core that the native backend compiles (with mypyc, at install: setup.py
reads this list). Everything the manager does per block and per step is in them; the rest of
kvpool (configuration, storage bytes, the CLI, the engine, integrations) is plain Python on both
backends. Paths are relative to the package directory."""

NATIVE_MODULES = (
    "records.py",
    "tokens.py",
    "validation.py",
    "stats.py",
    "page_table.py",
    "radix.py",
    "page_list.py",
    "eviction.py",
    "policies.py",
    "storage/slots.py",
    "tiers/state.py",
    "tiers/ownership.py",
    "tiers/migration.py",
    "tiers/planning.py",
    "tiers/allocation.py",
    "tiers/resizing.py",
    "tiers/__init__.py",
    "cache/state.py",
    "cache/commits.py",
    "cache/remote_loading.py",
    "cache/forking.py",
    "cache/growth.py",
    "cache/kvcache.py",
    "cache/timed.py",
    "manager/core.py",
    "manager/rebalancing.py",
    "manager/manager.py",
)

C_MODULES = ("chain.py", "ghosts.py")
"""Modules whose native form is hand-written C, `chain.c` beside `chain.py` (the reference): what
mypyc cannot make fast because the time goes to CPython objects per block (block keys: one C
call per run of blocks; the ghost table: no Python node or int per entry). Built and selected
with the compiled modules above."""

STAMP = "_native_stamp.txt"
"""Written next to the compiled modules by the build: the digest of the sources they were
compiled from. A compiled module whose source changed since (an edited checkout) is stale."""


def stamped_sources() -> list[str]:
    """The files the stamp digests: every compiled module's source, and both sources of each C
    module."""
    return [*NATIVE_MODULES, *(f for path in C_MODULES for f in (path, path[:-3] + ".c"))]
