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
import fcntl
import os
import re
import struct
import threading
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from kvpool.config import CacheTier
from kvpool.errors import StorageError
from kvpool.storage.memory import Bytes, DiskMemory, Memory
from kvpool.storage.pools import LevelStorage

FILE_PREFIX = "kvpool-disk.pg"
FILE_SUFFIX = ".kvp"
HEADER_BYTES = 4096
HEADER_MAGIC = b"KVPDISK1"
RECORD_MAGIC = b"KVPSLOT1"
FORMAT_VERSION = 1
IDENTITY_BYTES = 32
RECORD_ALIGN = 4096  # records are whole pages, so that page-sized slots stay page-aligned
_INVALID = bytes(len(RECORD_MAGIC))

# magic, format version, header CRC, identity, pool group, record bytes, number of pools
_HEADER = struct.Struct("<8sII32sIII")
# magic, record CRC (of the bytes after it, up to `used`), used bytes, identity tag (16),
# pool group, slot id, sequence number, number of pools, label length
_RECORD = struct.Struct("<8sII16sIQQHI")
RECORD_FIXED_BYTES = _RECORD.size
_READ_AHEAD = 512  # the first read of a record: its fixed part and most labels


def file_name(pool_group: int) -> str:
    return f"{FILE_PREFIX}{pool_group}{FILE_SUFFIX}"


def record_bytes(num_pools: int, label_bytes: int) -> int:
    """A slot's record size: the fixed part, a CRC per pool and the longest label, in pages."""
    used = RECORD_FIXED_BYTES + 4 * num_pools + label_bytes
    return -(-used // RECORD_ALIGN) * RECORD_ALIGN


class StoredRecord(NamedTuple):
    """A structurally valid record found when the file was opened."""

    slot: int
    sequence: int
    checksums: tuple[int, ...]  # CRC-32 of each pool's bytes of the slot
    label: bytes


def _storage_error(error: OSError, what: str) -> StorageError:
    code = error.errno or errno.EIO
    return StorageError(code, f"{what}: {os.strerror(code)}")


def _pwrite(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwritev(fd, [view], offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        view, offset = view[n:], offset + n


def _pread(fd: int, nbytes: int, offset: int) -> bytes:
    """Up to `nbytes` at `offset` (fewer at the end of the file)."""
    out = bytearray(nbytes)
    view, done = memoryview(out), 0
    while done < nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return bytes(out[:done])


class SlotFile:
    """The file of one pool group of a persistent disk level: its slots' bytes and records.

    Thread safety: the copier's threads write the pools of one slot in parallel; the record
    state (`valid`, the pending checksums) is changed under `lock`."""

    def __init__(
        self,
        path: str,
        pool_group: int,
        slot_sizes: Sequence[int],
        identity: bytes,
        label_bytes: int,
        owner: PersistentDisk,
        lock: bool,
    ) -> None:
        self.path = path
        self.pool_group = pool_group
        self.slot_sizes = tuple(slot_sizes)
        self.identity = identity
        self.record_bytes = record_bytes(len(slot_sizes), label_bytes)
        self.stride = self.record_bytes + sum(self.slot_sizes)
        self.pool_offsets = [
            self.record_bytes + sum(self.slot_sizes[:p]) for p in range(len(slot_sizes))
        ]
        self._owner = owner
        self.lock = threading.Lock()
        self.num_slots = 0
        self.valid = bytearray()  # per slot: 1 while a record may be valid on disk
        self.checksums: dict[int, list[int | None]] = {}  # per slot: pools written since
        self.found: list[StoredRecord] = []  # what the file held when opened (for recovery)
        self.reinitialized = False
        self.fd = -1
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as error:
            raise _storage_error(
                error, f"cannot open the persistent disk level file {path}"
            ) from error
        try:
            if lock:
                try:
                    fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as error:
                    if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        raise _storage_error(error, f"cannot lock {path}") from error
                    raise StorageError(
                        errno.EBUSY,
                        f"the persistent disk level {path} is in use by another kvpool manager "
                        "(it holds an exclusive flock on the file): one manager at a time may own "
                        "a persistent disk level; give each manager its own directory",
                    ) from None
            self._open()
        except BaseException:
            os.close(self.fd)
            self.fd = -1
            raise

    # -- opening ---------------------------------------------------------------------------------

    def _header(self) -> bytes:
        sizes = struct.pack(f"<{len(self.slot_sizes)}Q", *self.slot_sizes)
        body = _HEADER.pack(
            HEADER_MAGIC,
            FORMAT_VERSION,
            0,
            self.identity,
            self.pool_group,
            self.record_bytes,
            len(self.slot_sizes),
        )
        crc = zlib.crc32(body[16:] + sizes)
        return body[:12] + crc.to_bytes(4, "little") + body[16:] + sizes

    def _open(self) -> None:
        """Keep the file when its header is this level's, else empty it and write ours."""
        expected = self._header()
        try:
            size = os.fstat(self.fd).st_size
            found = _pread(self.fd, len(expected), 0)
            if found == expected:
                slots = max(0, (size - HEADER_BYTES) // self.stride)
                if size != HEADER_BYTES + slots * self.stride:  # a torn last slot: gone
                    os.ftruncate(self.fd, HEADER_BYTES + slots * self.stride)
                self.num_slots = slots
                self.valid = bytearray(slots)
                self.found = self._scan(slots)
                return
            self.reinitialized = size > 0
            os.ftruncate(self.fd, 0)  # (first: no old record survives under a new header)
            _pwrite(self.fd, expected, 0)
            os.ftruncate(self.fd, HEADER_BYTES)
        except OSError as error:
            raise _storage_error(error, f"cannot read or initialize {self.path}") from error

    def _scan(self, slots: int) -> list[StoredRecord]:
        """Every record that is whole and this level's (checked: magic, its own CRC, identity,
        pool group, slot id, pool count). Its label and payload are checked by the caller."""
        found = []
        tag = self.identity[:16]
        for slot in range(slots):
            offset = HEADER_BYTES + slot * self.stride
            head = _pread(self.fd, min(_READ_AHEAD, self.record_bytes), offset)
            if len(head) < RECORD_FIXED_BYTES or head[:8] != RECORD_MAGIC:
                continue
            self.valid[slot] = 1  # (whatever else it says: invalidated before a write)
            _, crc, used, identity, pool_group, slot_id, sequence, pools, label_length = (
                _RECORD.unpack_from(head)
            )
            expected_used = RECORD_FIXED_BYTES + 4 * pools + label_length
            if not RECORD_FIXED_BYTES <= used <= self.record_bytes or used != expected_used:
                continue
            record = head if used <= len(head) else _pread(self.fd, used, offset)
            if (
                len(record) < used
                or zlib.crc32(memoryview(record)[12:used]) != crc
                or identity != tag
                or pool_group != self.pool_group
                or slot_id != slot
                or pools != len(self.slot_sizes)
            ):
                continue
            at = RECORD_FIXED_BYTES
            checksums = struct.unpack_from(f"<{pools}I", record, at)
            at += 4 * pools
            found.append(StoredRecord(slot, sequence, checksums, bytes(record[at:used])))
        return found

    # -- size ------------------------------------------------------------------------------------

    def resize(self, num_slots: int) -> None:
        """Make room for exactly `num_slots` slots: a shrink cuts the file (the records of the
        slots cut go with them), a grow reserves the new slots' disk blocks (zeros: no record)."""
        old = self.num_slots
        if num_slots == old:
            return
        end = HEADER_BYTES + num_slots * self.stride
        with self.lock:
            if num_slots > old:
                try:
                    os.posix_fallocate(
                        self.fd, HEADER_BYTES + old * self.stride, (num_slots - old) * self.stride
                    )
                except (OSError, OverflowError) as error:
                    with contextlib.suppress(OSError):
                        os.ftruncate(self.fd, HEADER_BYTES + old * self.stride)
                    code = getattr(error, "errno", None) or errno.EFBIG
                    raise StorageError(
                        code,
                        f"cannot grow the persistent disk level file {self.path} to {end} bytes: "
                        f"{os.strerror(code)}",
                    ) from error
                self.valid += bytes(num_slots - old)
            else:
                try:
                    os.ftruncate(self.fd, end)
                except OSError as error:
                    raise _storage_error(
                        error, f"cannot shrink the persistent disk level file {self.path}"
                    ) from error
                del self.valid[num_slots:]
                for slot in [s for s in self.checksums if s >= num_slots]:
                    del self.checksums[slot]
            self.num_slots = num_slots

    # -- slots' bytes ----------------------------------------------------------------------------

    def payload_offset(self, slot: int, pool: int) -> int:
        return HEADER_BYTES + slot * self.stride + self.pool_offsets[pool]

    def before_write(self, slots: Sequence[int], pool: int | None = None) -> None:
        """Invalidate the records of `slots` (those that may be valid) before their bytes
        change: a record never outlives the bytes it describes. With `pool`, that pool's bytes
        are about to change: their checksum is unknown until `wrote`."""
        with self.lock:
            valid, checksums = self.valid, self.checksums
            for slot in slots:
                if valid[slot]:
                    _pwrite(self.fd, _INVALID, HEADER_BYTES + slot * self.stride)
                    valid[slot] = 0
                if pool is not None:
                    known = checksums.get(slot)
                    if known is not None:
                        known[pool] = None

    def wrote(self, slot: int, pool: int, checksum: int | None) -> None:
        """Pool `pool` of `slot` now holds bytes with this CRC-32 (None: written in part)."""
        with self.lock:
            known = self.checksums.get(slot)
            if known is None:
                known = self.checksums[slot] = [None] * len(self.slot_sizes)
            known[pool] = checksum

    def read_checksums(self, slot: int) -> list[int]:
        """The CRC-32 of each pool's bytes of `slot`, read from the file."""
        result = []
        for pool, size in enumerate(self.slot_sizes):
            data = _pread(self.fd, size, self.payload_offset(slot, pool))
            if len(data) != size:
                raise OSError(errno.EIO, f"slot {slot} of {self.path} is cut short")
            result.append(zlib.crc32(data))
        return result

    # -- records ---------------------------------------------------------------------------------

    def write_record(self, slot: int, label: bytes) -> None:
        """Write the record saying that `slot` holds what `label` says, with the checksums of
        the bytes written into it since its last record (read back where a pool's are not
        known). Its bytes must be written completely, by calls that returned."""
        with self.lock:
            known = self.checksums.pop(slot, None)
        if known is None and self.valid[slot]:
            return  # (its valid record describes these very bytes)
        checksums = (
            [c for c in known if c is not None]
            if known is not None and None not in known
            else self.read_checksums(slot)
        )
        pools = len(self.slot_sizes)
        used = RECORD_FIXED_BYTES + 4 * pools + len(label)
        if used > self.record_bytes:
            raise ValueError(f"a label of {len(label)} bytes does not fit a record")
        sequence = self._owner.next_sequence()
        tail = struct.pack(f"<{pools}I", *checksums) + label
        fixed = _RECORD.pack(
            RECORD_MAGIC,
            0,
            used,
            self.identity[:16],
            self.pool_group,
            slot,
            sequence,
            pools,
            len(label),
        )
        body = fixed[12:] + tail
        record = fixed[:8] + zlib.crc32(body).to_bytes(4, "little") + body
        with self.lock:
            self.valid[slot] = 1  # (first: a record torn by a failed write is invalidated too)
        _pwrite(self.fd, record, HEADER_BYTES + slot * self.stride)

    def invalidate_all(self) -> None:
        """Invalidate every record (the level forgets what it held)."""
        self.before_write([slot for slot, valid in enumerate(self.valid) if valid])

    def verify(self, records: Sequence[StoredRecord], workers: int) -> list[bool]:
        """Whether each record's slot holds the bytes its checksums describe (read in up to
        `workers` threads; the answers in the records' order)."""

        def check(record: StoredRecord) -> bool:
            try:
                return self.read_checksums(record.slot) == list(record.checksums)
            except OSError:
                return False

        if workers <= 1 or len(records) < 2:
            return [check(record) for record in records]
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvpool-verify") as pool:
            return list(pool.map(check, records))

    def close(self, sync: bool) -> None:
        if self.fd < 0:
            return
        if sync:
            with contextlib.suppress(OSError):
                os.fdatasync(self.fd)
        os.close(self.fd)
        self.fd = -1


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
                    SlotFile(path, group, sizes, identity, label_bytes, self, lock=group == 0)
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
    "PersistentDisk",
    "PersistentLevelStorage",
    "SlotFile",
    "SlotFileMemory",
    "StoredRecord",
    "file_name",
    "record_bytes",
]
