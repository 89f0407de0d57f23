"""What KV events call things, shared by the engine-side log and the wire classes: the name of
each medium (where a block's page is) and a block's 64-bit hash on the wire."""

from __future__ import annotations

from kvpool.config import CacheTier

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"
MEDIUM_EXTERNAL = "EXTERNAL"  # the shared remote tier
MEDIA = {CacheTier.GPU: MEDIUM_GPU, CacheTier.HOST: MEDIUM_CPU, CacheTier.DISK: MEDIUM_DISK}


def block_hash(key: bytes) -> int:
    """The 64-bit hash of a block on the wire: the low 64 bits of its 256-bit chained key read
    big-endian (as vLLM derives its integer hashes from its SHA-256 keys)."""
    return int.from_bytes(key[-8:], "big")


__all__ = [
    "MEDIA",
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "MEDIUM_EXTERNAL",
    "MEDIUM_GPU",
    "block_hash",
]
