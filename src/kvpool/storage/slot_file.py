"""The file of one pool group of a persistent disk level (`SlotFile`): its header, and per slot
a record and the slot's bytes. The layout, the order of writes and what a record says are
described in `kvpool.storage.persistent`."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from kvpool.errors import StorageError

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
        next_sequence: Callable[[], int],
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
        self._next_sequence = next_sequence
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
        sequence = self._next_sequence()
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
