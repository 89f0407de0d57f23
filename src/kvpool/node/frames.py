"""Length-prefixed frames on a Unix stream socket, read with as few system calls and wake-ups
as the daemon's round trip allows: a frame of up to 64 KiB arrives in one `recv`, and a reader
that expects an answer soon can poll for it (`poll_s`) before it sleeps in the kernel. A
sleeping process costs a wake-up on every message (tens of microseconds on a virtual machine,
more than the daemon's work on a small lookup); a bounded poll costs only CPU, and only while
a reply is due.

A frame is a 4-byte big-endian length and the payload (the same framing as
`multiprocessing.connection` for frames under 2 GiB). Time limits are the socket's own
(SO_RCVTIMEO, SO_SNDTIMEO: `sockets.set_timeouts`): past one, `recv` and `send` raise
`OSError`; a closed peer is `EOFError`."""

from __future__ import annotations

import os
import socket
import struct
import time

_HEADER = struct.Struct("!I")
_CHUNK = 1 << 16


class FrameSocket:
    """One end of a connection carrying frames. Not thread-safe (one reader and one writer at a
    time; the daemon's loop and the client's lock see to it)."""

    def __init__(self, sock: socket.socket, poll_s: float = 0.0) -> None:
        self.sock = sock
        self.poll_s = poll_s
        # (poll only while answers come within `poll_s`: a busy daemon, whose answers come
        # later, is not also starved of CPU by its clients' polling)
        self._polling = poll_s > 0
        self.polled = 0  # reads that found their bytes while polling (no sleep, no wake-up)
        self._buffer = bytearray()

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def buffered(self) -> int:
        """Bytes read past the last whole frame returned (the start of a next frame)."""
        return len(self._buffer)

    def send(self, payload: bytes) -> None:
        if len(payload) > 0xFFFFFFFF:
            raise ValueError(f"a frame of {len(payload)} bytes is longer than 4 GiB")
        self.sock.sendall(_HEADER.pack(len(payload)) + payload)

    def recv(self, limit: int, poll: bool = True) -> bytes:
        """The next frame's payload. A frame longer than `limit` is an `OSError` (the caller
        drops the connection; nothing of it is kept)."""
        buffer = self._buffer
        started = time.perf_counter()
        while True:
            if len(buffer) >= 4:
                (size,) = _HEADER.unpack_from(buffer)
                if size > limit:
                    buffer.clear()
                    raise OSError(f"a frame of {size} bytes; at most {limit} are allowed")
                end = 4 + size
                if len(buffer) >= end:
                    payload = bytes(buffer[4:end])
                    del buffer[:end]
                    if poll and self.poll_s > 0:
                        self._polling = time.perf_counter() - started <= self.poll_s
                    return payload
            chunk = self._read(poll and self._polling)
            if not chunk:
                raise EOFError("the peer closed the connection")
            buffer += chunk

    def recv_exact(self, size: int) -> bytes:
        """Exactly `size` bytes, read no further (a message whose last byte carries file
        descriptors must be read by `socket.recv_fds`, not swallowed here)."""
        out = bytearray()
        while len(out) < size:
            chunk = self.sock.recv(size - len(out))
            if not chunk:
                raise EOFError("the peer closed the connection")
            out += chunk
        return bytes(out)

    def recv_frame_exact(self, limit: int) -> bytes:
        """One frame, read to its last byte and not past it (`recv_exact`)."""
        if self._buffer:
            raise OSError("bytes arrived before the frame that was expected")
        (size,) = _HEADER.unpack(self.recv_exact(4))
        if size > limit:
            raise OSError(f"a frame of {size} bytes; at most {limit} are allowed")
        return self.recv_exact(size)

    def _read(self, poll: bool) -> bytes:
        if poll:
            deadline = time.perf_counter() + self.poll_s
            while True:
                try:
                    chunk = self.sock.recv(_CHUNK, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    if time.perf_counter() >= deadline:
                        break
                    os.sched_yield()  # (another process of this CPU, the daemon say, first)
                else:
                    self.polled += 1
                    return chunk
        return self.sock.recv(_CHUNK)  # (blocks; SO_RCVTIMEO bounds it)

    def close(self) -> None:
        self._buffer.clear()
        self.sock.close()


__all__ = ["FrameSocket"]
