"""The node daemon's framing (`kvpool.node.frames`) on real socket pairs: frames split across
sends and packed into one arrive whole and in order; a frame past the limit, a closed peer and
a peer that never answers are errors, not hangs; a frame read exactly leaves the descriptors
that follow it; polling for a reply stops while replies come later than the poll."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from kvpool.node.frames import FrameSocket
from kvpool.node.sockets import set_timeouts


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    set_timeouts(a, 2.0)
    set_timeouts(b, 2.0)
    yield FrameSocket(a), FrameSocket(b)
    a.close()
    b.close()


def frame(payload: bytes) -> bytes:
    return struct.pack("!I", len(payload)) + payload


def test_frames_split_across_sends_or_packed_into_one_arrive_whole_and_in_order(pair):
    left, right = pair
    big = bytes(range(256)) * 1000  # (past one read of 64 KiB)
    raw = frame(b"one") + frame(big) + frame(b"") + frame(b"three")

    def send_in_pieces() -> None:
        for at in range(0, len(raw), 7001):  # (cut anywhere: mid-header, mid-payload)
            left.sock.sendall(raw[at : at + 7001])
            time.sleep(0.001)

    sender = threading.Thread(target=send_in_pieces, daemon=True)
    sender.start()
    assert right.recv(1 << 20) == b"one"
    assert right.buffered > 0  # (the rest came with it)
    assert right.recv(1 << 20) == big
    assert right.recv(1 << 20) == b""
    assert right.recv(1 << 20) == b"three"
    sender.join(5)
    assert right.buffered == 0
    left.send(b"back")
    assert right.recv(16) == b"back"


def test_a_frame_past_the_limit_a_closed_peer_and_a_silent_peer_are_errors(pair):
    left, right = pair
    left.send(b"x" * 100)
    with pytest.raises(OSError, match="a frame of 100 bytes; at most 99"):
        right.recv(99)
    assert right.buffered == 0  # (nothing of it kept)
    set_timeouts(right.sock, 0.05)
    started = time.monotonic()
    with pytest.raises(OSError):  # (SO_RCVTIMEO: EAGAIN, not a hang)
        right.recv(1 << 20)
    assert time.monotonic() - started < 1.0
    left.sock.sendall(frame(b"half")[:5])
    left.close()
    with pytest.raises(EOFError):
        right.recv(1 << 20)


def test_an_exact_frame_leaves_the_descriptors_that_follow_it(pair, tmp_path):
    left, right = pair
    path = tmp_path / "shared"
    path.write_bytes(b"kvpool")
    fd = os.open(path, os.O_RDONLY)
    try:
        left.send(b"welcome")
        socket.send_fds(left.sock, [b"f"], [fd])
    finally:
        os.close(fd)
    assert right.recv_frame_exact(1 << 20) == b"welcome"
    _, fds, _, _ = socket.recv_fds(right.sock, 1, 1)
    assert len(fds) == 1
    with os.fdopen(fds[0], "rb") as received:
        assert received.read() == b"kvpool"


def echo_after(sock: FrameSocket, delay_s: float, count: int) -> threading.Thread:
    def run() -> None:
        for _ in range(count):
            payload = sock.recv(1 << 20)
            time.sleep(delay_s)
            sock.send(payload)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_reader_polls_while_replies_are_quick_and_sleeps_while_they_are_slow():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    client = FrameSocket(a, poll_s=0.05)
    server = FrameSocket(b)
    try:
        thread = echo_after(server, 0.0, 20)
        for i in range(20):
            client.send(b"%d" % i)
            assert client.recv(64) == b"%d" % i
        thread.join(5)
        assert client.polled >= 10 and client._polling  # (quick: answered while polling)
        thread = echo_after(server, 0.12, 3)  # (slower than the poll)
        for _ in range(3):
            client.send(b"slow")
            assert client.recv(64) == b"slow"
        thread.join(5)
        assert not client._polling  # (it sleeps until replies are quick again)
        polled = client.polled
        thread = echo_after(server, 0.12, 2)
        for _ in range(2):
            client.send(b"slow")
            started = time.perf_counter()
            assert client.recv(64) == b"slow"
            assert time.perf_counter() - started >= 0.1
        thread.join(5)
        assert client.polled == polled  # (no polling while replies are slow)
        thread = echo_after(server, 0.0, 5)
        for _ in range(5):
            client.send(b"quick")
            assert client.recv(64) == b"quick"
        thread.join(5)
        assert client._polling  # (quick again: polling again)
    finally:
        a.close()
        b.close()
