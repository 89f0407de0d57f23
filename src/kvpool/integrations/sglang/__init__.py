"""kvpool as SGLang's HiCache L3 storage backend: kvpool's levels (host memory, a persistent
disk level with eviction by its policy, a shared Valkey tier) below SGLang's host pool. Load it
with SGLang's `dynamic` backend:

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvpool",
        "module_path": "kvpool.integrations.sglang", "class_name": "KVPoolHiCacheStorage",
        "interface_v1": 1, "disk_bytes": 107374182400, "disk_path": "/mnt/nvme/kvpool"}'

(`kvpool.integrations.sglang.settings` lists every key; the guide is docs/guides/sglang.md.)
"""

from __future__ import annotations

from importlib import metadata

SUPPORTED_SGLANG = ((0, 5, 23),)  # releases whose storage interface this backend is built on


def _release(version: str) -> tuple[int, ...] | None:
    """(major, minor, patch) of a version string ("0.5.23.post1", "0.5.23+cpu": (0, 5, 23))."""
    head = version.split("+")[0].split(".")
    try:
        return tuple(int(part) for part in head[:3])
    except ValueError:
        return None


def _check_sglang_version() -> None:
    try:
        version = metadata.version("sglang")
    except metadata.PackageNotFoundError as error:
        raise ImportError(
            "kvpool.integrations.sglang needs SGLang (pip install 'kvpool[sglang]')"
        ) from error
    if _release(version) not in SUPPORTED_SGLANG:
        supported = ", ".join(".".join(map(str, r)) for r in SUPPORTED_SGLANG)
        raise ImportError(
            f"kvpool.integrations.sglang supports SGLang {supported}; this is SGLang {version}"
        )


_check_sglang_version()

from kvpool.integrations.sglang.backend import KVPoolHiCacheStorage  # noqa: E402

__all__ = ["SUPPORTED_SGLANG", "KVPoolHiCacheStorage"]
