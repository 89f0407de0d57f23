"""Storage: memories, slot allocators and the pools of each cache level (nothing about requests)."""

from kvpool.storage.device_memory import DeviceMemory
from kvpool.storage.memory import DiskMemory, HostMemory, Memory
from kvpool.storage.pools import LevelStorage, PoolGroup, slot_counts_from_ratio
from kvpool.storage.slots import Slot, SlotAllocator

__all__ = [
    "DeviceMemory",
    "DiskMemory",
    "HostMemory",
    "LevelStorage",
    "Memory",
    "PoolGroup",
    "Slot",
    "SlotAllocator",
    "slot_counts_from_ratio",
]
