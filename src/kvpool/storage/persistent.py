"""A disk level that outlives its process (`DiskCacheTierConfig.persistent_id`): named files
whose slots describe themselves, so that a later manager finds the pages again.

One file per pool group in the level's directory, `kvpool-disk.pg<N>.kvp` (one file for most
models: they have one pool group), laid out slot by slot::

    [header: 4 KiB][slot 0: record | pool 0 bytes | pool 1 bytes ...][slot 1: ...] ...

The header names the format, the level's identity (a digest of the caller's persistent id and
the layout's fingerprint), the pool group, the record size and the pools' slot sizes. A file
whose header differs in anything is reinitialized (emptied) when it is opened. Slot-major
order keeps a slot's record beside its bytes and lets a pool group grow or shrink by moving
the file's end; a pool's run of slots is then one `pwritev`/`preadv` per slot rather than
per run (slots are large: a block of every layer).

A slot's *record* (`RECORD_MAGIC`, a CRC-32 of itself, the identity again, the pool group and
the slot id it belongs to, a sequence number, the CRC-32 of each pool's bytes of the slot and
an opaque label, which the tiers fill with what the slot holds: the block's key, its parent's,
its tokens, its layer group) is written after the slot's bytes, and only then; before any byte
of a slot is written again, its record is invalidated (its magic zeroed) if it was valid. So
whatever is on disk when the process dies, a valid record describes bytes that were completely
written and have not been touched since: a `SIGKILL` at any moment leaves no record that lies.
The checksums catch what the order cannot: a torn or corrupted payload (a power loss, a bad
sector, a hand), which a reader then treats as a miss.

The first file is locked (`flock`, exclusive) while a manager has the level open: a second
manager on the same directory is refused, naming the path.

Storage knows nothing of blocks: a label is bytes to it. Reading the records back and deciding
what they mean is `kvpool.manager.recovery`'s job.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import threading
import zlib
from collections.abc import Sequence

from kvpool.config import CacheTier
from kvpool.errors import StorageError
from kvpool.storage.memory import Bytes, DiskMemory, Memory
from kvpool.storage.pools import LevelStorage
from kvpool.storage.slot_file import (
    FILE_PREFIX,
    FILE_SUFFIX,
    HEADER_BYTES,
    IDENTITY_BYTES,
    RECORD_MAGIC,
    SlotFile,
    StoredRecord,
    file_name,
    record_bytes,
)


class PersistentDisk:
    """The files of a persistent disk level (one per pool group), the first of them locked."""

    def __init__(
        self,
        directory: str,
        slot_sizes: Sequence[Sequence[int]],
        identity: bytes,
        label_bytes: int,
    ) -> None:
        if len(identity) != IDENTITY_BYTES:
            raise ValueError(f"identity must be {IDENTITY_BYTES} bytes")
        self.directory = os.fspath(directory)
        self.identity = identity
        self.files: list[SlotFile] = []
        self._sequence = 0
        self._sequence_lock = threading.Lock()
        try:
            for group, sizes in enumerate(slot_sizes):
                path = os.path.join(self.directory, file_name(group))
                self.files.append(
                    SlotFile(
                        path, group, sizes, identity, label_bytes, self.next_sequence, group == 0
                    )
                )
            self._remove_stale_files(len(slot_sizes))
        except BaseException:
            self.close(sync=False)
            raise
        found = [record.sequence for file in self.files for record in file.found]
        self._sequence = max(found, default=0)

    @property
    def path(self) -> str:
        """The locked file (pool group 0's)."""
        return os.path.join(self.directory, file_name(0))

    @property
    def reinitialized(self) -> bool:
        """Whether a file held another level's contents (another identity, layout or format)."""
        return any(file.reinitialized for file in self.files)

    def _remove_stale_files(self, num_groups: int) -> None:
        """Files of pool groups this layout does not have (a layout with more, before)."""
        pattern = re.compile(re.escape(FILE_PREFIX) + r"(\d+)" + re.escape(FILE_SUFFIX) + "$")
        for name in sorted(os.listdir(self.directory)):
            match = pattern.match(name)
            if match is not None and int(match.group(1)) >= num_groups:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.directory, name))

    def next_sequence(self) -> int:
        with self._sequence_lock:
            self._sequence += 1
            return self._sequence

    def invalidate_all(self) -> None:
        for file in self.files:
            file.invalidate_all()

    def close(self, sync: bool = True) -> None:
        """Close every file (the locked one last, releasing the level)."""
        for file in reversed(self.files):
            file.close(sync)


def _checksum(parts: Sequence[memoryview], within: int, size: int) -> int | None:
    """The CRC-32 of a slot's bytes written as `parts` from offset `within` (None unless they
    are the whole slot)."""
    if within or sum(len(part) for part in parts) != size:
        return None
    checksum = 0
    for part in parts:
        checksum = zlib.crc32(part, checksum)
    return checksum


class SlotFileMemory(DiskMemory):
    """One pool of a persistent disk level: pool `pool`'s bytes of every slot of a `SlotFile`.
    Offsets are the pool's own (slot * slot size), as for any disk memory; each slot's part
    is read or written with one call, a write invalidating the slot's record first and noting
    the checksum of the bytes written."""

    kind = "disk"

    def __init__(self, file: SlotFile, pool: int, size: int) -> None:
        self._file = file
        self._pool = pool
        self._slot_size = file.slot_sizes[pool]
        self.directory = os.path.dirname(file.path)
        self._fd = file.fd
        self._size = 0
        self.resize(size)

    def resize(self, new_size: int) -> None:
        self._require_open()
        slots, rest = divmod(new_size, self._slot_size)
        if new_size < 0 or rest:
            raise StorageError(
                errno.EINVAL,
                f"{new_size} bytes is not a whole number of {self._slot_size}-byte slots",
            )
        self._file.resize(slots)
        self._size = new_size

    def file_offset(self, offset: int) -> int:
        slot, within = divmod(offset, self._slot_size)
        return self._file.payload_offset(slot, self._pool) + within

    def _one_extent(self, offset: int, nbytes: int) -> bool:
        return nbytes > 0 and offset // self._slot_size == (offset + nbytes - 1) // self._slot_size

    def _vector_io(self, op: str, offset: int, buffers: Sequence[Bytes]) -> None:
        self._require_open()
        views = [buffer.data.cast("B") for buffer in buffers]
        total = sum(len(view) for view in views)
        self._check_range(offset, total)
        size, file = self._slot_size, self._file
        # The range cut at slot boundaries: (slot, offset in the slot, the views' parts).
        pieces: list[tuple[int, int, list[memoryview]]] = []
        position = offset
        for view in views:
            while len(view):
                slot, within = divmod(position, size)
                n = min(len(view), size - within)
                if pieces and pieces[-1][0] == slot:
                    pieces[-1][2].append(view[:n])
                else:
                    pieces.append((slot, within, [view[:n]]))
                view = view[n:]
                position += n
        write = op == "write"
        try:
            if write:
                file.before_write([slot for slot, _, _ in pieces], self._pool)
            call = os.pwritev if write else os.preadv
            for slot, within, parts in pieces:
                at = file.payload_offset(slot, self._pool) + within
                remaining = list(parts)
                while remaining:
                    n = call(self._fd, remaining, at)
                    if n == 0:
                        raise StorageError(
                            errno.EIO, f"unexpected end of the disk level file {file.path} at {at}"
                        )
                    at += n
                    while remaining and n >= len(remaining[0]):
                        n -= len(remaining[0])
                        remaining.pop(0)
                    if n:
                        remaining[0] = remaining[0][n:]
        except OSError as error:
            if isinstance(error, StorageError):
                raise
            raise self._io_error(op, offset, total, error) from error
        if write:  # (in this thread: on 2 cores, checksum threads beside it were slower)
            for slot, within, parts in pieces:
                file.wrote(slot, self._pool, _checksum(parts, within, size))

    def close(self) -> None:
        """Let go of the file (the level closes it)."""
        self._fd = -1
        self._size = 0


class PersistentLevelStorage(LevelStorage):
    """A disk level in a `PersistentDisk`'s files instead of unlinked ones."""

    def __init__(
        self,
        quota: int,
        slot_sizes: Sequence[Sequence[int]],
        ratio: Sequence[float],
        min_slots: Sequence[int],
        *,
        path: str,
        identity: bytes,
        label_bytes: int,
        quota_name: str = "quota",
        granularity: int | None = None,
    ) -> None:
        self.persistent = PersistentDisk(path, slot_sizes, identity, label_bytes)
        try:
            super().__init__(
                CacheTier.DISK,
                quota,
                slot_sizes,
                ratio,
                min_slots,
                granularity=granularity,
                disk_path=path,
                quota_name=quota_name,
            )
        except BaseException:
            self.persistent.close(sync=False)
            raise

    def _make_memory(self, pool_group: int, pool: int, size: int) -> Memory:
        return SlotFileMemory(self.persistent.files[pool_group], pool, size)

    def close(self) -> None:
        super().close()
        persistent = getattr(self, "persistent", None)
        if persistent is not None:
            persistent.close()


__all__ = [
    "FILE_PREFIX",
    "HEADER_BYTES",
    "RECORD_MAGIC",
    "PersistentDisk",
    "PersistentLevelStorage",
    "SlotFile",
    "SlotFileMemory",
    "StoredRecord",
    "file_name",
    "record_bytes",
]
