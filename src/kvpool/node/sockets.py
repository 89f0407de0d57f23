"""The Unix socket's own guarantees the daemon and its clients rely on: time limits on every
send and receive (a peer that stops reading, or sends half a frame, costs one limit), and the
peer's credentials as the kernel knows them."""

from __future__ import annotations

import socket
import struct

_TIMEVAL = "ll"


def set_timeouts(sock: socket.socket, seconds: float) -> None:
    whole = int(seconds)
    value = struct.pack(_TIMEVAL, whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end (the kernel's, not the peer's word)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def groups_of(pid: int) -> set[int]:
    """A process's supplementary groups (empty where /proc does not show it)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()


__all__ = ["groups_of", "peer_credentials", "set_timeouts"]
