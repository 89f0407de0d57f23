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

STAMP = "_native_stamp.txt"
"""Written next to the compiled modules by the build: the digest of the sources they were
compiled from. A compiled module whose source changed since (an edited checkout) is stale."""
