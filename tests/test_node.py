"""The node daemon (`kvpool serve`) in its own process, with engines' clients over its real
Unix socket: a prefix one engine saved is read by another from the daemon's shared memory
(bytes checked); engines killed while holding pages; the daemon killed and restarted; a full
daemon; a slow or broken client; another user's client; bad input."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import termios
import time

import pytest

from kvpool.errors import ConfigError
from kvpool.node import protocol as p
from kvpool.node.store import Hit, Outcome, SavePlan
from tests.node_helpers import (
    BLOCK,
    LAYERS,
    ROOT,
    Daemon,
    client,
    hello,
    read_blocks,
    socket_dir,
    write_blocks,
)

TOKENS = list(range(1000, 1000 + 3 * BLOCK))


@pytest.fixture
def sock_dir():
    path = socket_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon(sock_dir):
    found = Daemon(f"{sock_dir}/kvpool.sock", "--host-bytes", "4MiB", "--release-grace-ms", "300")
    yield found.start()
    found.stop()


def save(engine, tokens, first_value):
    """An engine's save: plan, its workers write recognizable bytes, commit."""
    plan = engine.plan_save(None, tokens)
    assert isinstance(plan, SavePlan), plan
    write_blocks(engine, plan.slots[0], first_value)
    engine.commit_save(plan.handle, tokens[plan.first_block * BLOCK :], plan.first_block)
    return plan


def stats(engine):
    found = engine.statistics()["node"]
    assert found is not None
    return found


def test_a_prefix_one_engine_saved_is_read_by_another_from_the_daemons_memory(daemon):
    a, b = client(daemon.socket), client(daemon.socket)
    save(a, TOKENS, 40)
    hit = b.lookup("b-1", None, TOKENS + [1, 2], True)
    assert isinstance(hit, Hit) and hit.tokens == len(TOKENS)
    assert hit.tiers == ["host"] * 3
    assert read_blocks(b, hit.slots[0]) == [{40}, {41}, {42}]  # engine A's bytes, in B's map
    b.release(hit.handle)
    # another model with the same layout, or another salt: never the same KV
    other = client(daemon.socket, model="model-b")
    assert other.lookup("o-1", None, TOKENS, True) is Outcome.MISS
    from kvpool.config import ReuseScope

    assert b.lookup("b-2", ReuseScope(None, "tenant-2"), TOKENS, True) is Outcome.MISS
    node = stats(b)
    assert node["engines"] == 3 and node["held"] == 0 and node["open_requests"] == 0
    assert node["manager_hit_tokens_by_level"][0] == len(TOKENS)


def test_an_engines_idle_pause_is_short_and_ends_on_its_input(daemon):
    """The daemon's look-aheads are not seen from an engine: its pause of an empty step lasts
    at most IDLE_S whatever it is offered (a longer one would only answer a ready lookup
    later), and ends at once when the engine has input."""
    from kvpool.node.client import IDLE_S

    engine = client(daemon.socket)
    started = time.perf_counter()
    engine.idle(30.0)
    assert IDLE_S * 0.9 <= time.perf_counter() - started < 5
    asked = []
    engine.idle(30.0, lambda: not asked.append(1))  # (input waiting: no sleep at all)
    assert asked == [1]


def test_an_engine_of_another_layout_is_refused_naming_the_difference(daemon):
    client(daemon.socket)  # (the first engine sets the layout)
    other = [p.Layer(0, [("k", 1024), ("v", 1024)]), LAYERS[1]]
    with pytest.raises(ConfigError, match=r"another slot layout \(layer 0"):
        client_of = __import__("kvpool.node.client", fromlist=["NodeClient"]).NodeClient
        client_of(daemon.socket, hello("model-c", other)).connect(required=True)


HOLDER = """
import sys, time
sys.path.insert(0, {root!r})
from tests.node_helpers import client
from kvpool.node.store import Hit, SavePlan
engine = client({sock!r})
hit = engine.lookup("held", None, {tokens!r}, True)
plan = engine.plan_save(None, list(range(5000, 5000 + 64)))
assert isinstance(hit, Hit) and isinstance(plan, SavePlan), (hit, plan)
print("HELD", flush=True)
time.sleep(600)
"""


def test_an_engine_killed_holding_pages_releases_them_within_seconds(daemon):
    a = client(daemon.socket)
    save(a, TOKENS, 60)
    script = HOLDER.format(root=str(ROOT), sock=daemon.socket, tokens=TOKENS)
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "HELD"
        assert stats(a)["held"] == 2 and stats(a)["open_requests"] == 2
        holder.send_signal(signal.SIGKILL)  # mid-load and mid-save
        holder.wait(10)
        killed = time.monotonic()
        while stats(a)["open_requests"] and time.monotonic() - killed < 5:
            time.sleep(0.05)
    finally:
        holder.kill()
    node = stats(a)
    assert node["open_requests"] == 0 and node["released_on_disconnect"] == 2
    assert time.monotonic() - killed < 3
    # nothing of the other engine's lost; the uncommitted save left nothing findable
    hit = a.lookup("after", None, TOKENS, True)
    assert isinstance(hit, Hit) and read_blocks(a, hit.slots[0]) == [{60}, {61}, {62}]
    assert a.lookup("never", None, list(range(5000, 5000 + 64)), True) is Outcome.MISS


def test_a_dead_daemon_is_a_miss_at_once_and_its_engines_reconnect_to_the_next(sock_dir):
    path = f"{sock_dir}/kvpool.sock"
    first = Daemon(path, "--host-bytes", "4MiB").start()
    try:
        a = client(path, timeout_s=0.2)
        save(a, TOKENS, 80)
        hit = a.lookup("h", None, TOKENS, True)
        assert isinstance(hit, Hit)
        old_paths = a.shared_memory()
        first.kill()
        started = time.monotonic()
        assert a.lookup("h2", None, TOKENS, True) is Outcome.MISS
        assert a.plan_save(None, TOKENS) is Outcome.NO_ROOM  # (no save, no error)
        a.release(hit.handle)  # (stale: nothing to send)
        assert time.monotonic() - started < 0.5
        assert not a.connected and a.counters["failures"] >= 1
        second = Daemon(path, "--host-bytes", "4MiB").start()
        try:
            deadline = time.monotonic() + 5
            while a.lookup("h3", None, TOKENS, True) is Outcome.MISS and not a.connected:
                assert time.monotonic() < deadline, "the client did not reconnect"
                time.sleep(0.05)
            assert a.connected and a.generation == 3  # (lost: 2; reconnected: 3)
            assert a.shared_memory() != old_paths  # (the workers remap)
            assert a.lookup("h4", None, TOKENS, True) is Outcome.MISS  # a new, empty cache
            save(a, TOKENS, 90)
            again = a.lookup("h5", None, TOKENS, True)
            assert isinstance(again, Hit) and read_blocks(a, again.slots[0])[0] == {90}
        finally:
            second.stop()
    finally:
        first.stop()


def test_a_full_daemon_answers_no_room(sock_dir):
    path = f"{sock_dir}/kvpool.sock"
    small = Daemon(path, "--host-bytes", "2MiB").start()  # 1,024 slots of 2 KiB
    try:
        a = client(path)
        held = []
        for n in range(400):
            plan = a.plan_save(None, list(range(n * 1000, n * 1000 + 4 * BLOCK)))
            if plan is Outcome.NO_ROOM:
                break
            held.append(plan)
        assert plan is Outcome.NO_ROOM and 200 <= len(held) < 400
        assert stats(a)["no_room"] == 1
    finally:
        small.stop()


def test_a_client_that_sends_half_a_message_or_stops_reading_is_dropped_not_waited_on(daemon):
    a = client(daemon.socket)
    save(a, TOKENS, 20)
    half = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    half.connect(daemon.socket)
    half.sendall(struct.pack("!i", 1000) + b"\x00" * 10)  # a frame of 1,000 bytes, 10 sent
    deaf = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deaf.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    deaf.connect(daemon.socket)
    frame = p.encoder.encode(hello("deaf"))
    deaf.sendall(struct.pack("!i", len(frame)) + frame)
    assert read_by_peer(deaf, 5.0)
    ask = p.encoder.encode(p.Stats())
    deaf.setblocking(False)
    try:
        for _ in range(20000):  # requests one at a time, never reading a reply
            deaf.send(struct.pack("!i", len(ask)) + ask)
            if not read_by_peer(deaf, 2.0):  # (not two at once; unread: the daemon stopped)
                break
    except (BlockingIOError, ConnectionError):
        pass
    worst = 0.0
    deadline = time.monotonic() + 10
    while stats(a)["dropped"] < 2 and time.monotonic() < deadline:
        started = time.monotonic()
        hit = a.lookup("a", None, TOKENS, True)
        worst = max(worst, time.monotonic() - started)
        assert isinstance(hit, Hit)
        a.release(hit.handle)
    node = stats(a)
    assert node["dropped"] == 2 and node["engines"] == 1  # both gone, A served throughout
    assert worst < 0.9  # (at most one time limit, 0.5 s, behind a broken client)
    half.close()
    deaf.close()
    log = "".join(daemon.log)
    assert "it does not read its replies" in log and "dropped: BlockingIOError" in log


def test_a_client_that_sends_a_request_before_its_last_reply_is_dropped(daemon):
    a = client(daemon.socket)
    save(a, TOKENS, 20)
    eager = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    eager.connect(daemon.socket)
    frames = [p.encoder.encode(hello("eager")), p.encoder.encode(p.Stats())]
    eager.sendall(b"".join(struct.pack("!i", len(f)) + f for f in frames))  # (two at once)
    deadline = time.monotonic() + 10
    while stats(a)["dropped"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stats(a)["dropped"] == 1 and stats(a)["engines"] == 1
    assert "it sent a request before reading its last reply" in "".join(daemon.log)
    hit = a.lookup("a", None, TOKENS, True)  # (the others are served as before)
    assert isinstance(hit, Hit) and read_blocks(a, hit.slots[0]) == [{20}, {21}, {22}]
    eager.close()


def test_a_client_whose_descriptors_pass_1024_connects(daemon):
    """An engine holds many descriptors (vLLM, torch, sockets): the welcome's wait must not be
    select(), which refuses a descriptor past 1,023."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip("needs a descriptor limit of 1,200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    fillers = []
    try:
        while not fillers or fillers[-1] < 1100:
            fillers.append(os.open("/dev/null", os.O_RDONLY))
        a = client(daemon.socket)
        assert a._conn is not None and a._conn.fileno() > 1100
        save(a, TOKENS, 30)
        hit = a.lookup("a", None, TOKENS, True)
        assert isinstance(hit, Hit) and read_blocks(a, hit.slots[0]) == [{30}, {31}, {32}]
        a.shutdown()
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("polling", [True, False])
def test_lookups_are_answered_while_both_ends_poll_with_no_wake_up(sock_dir, polling):
    # (polls long enough that a loaded CI machine's pauses between messages fit in them)
    flags = ["--busy-poll-us", "20000" if polling else "0"]
    daemon = Daemon(f"{sock_dir}/kvpool.sock", "--host-bytes", "4MiB", *flags).start()
    try:
        a = client(daemon.socket, poll_s=0.05 if polling else 0.0)
        save(a, TOKENS, 20)
        for i in range(50):
            hit = a.lookup(f"r{i}", None, TOKENS, True)
            assert isinstance(hit, Hit) and hit.tokens == len(TOKENS)
            a.release(hit.handle)
        node = stats(a)
        if polling:  # (most messages found by the daemon's poll, most replies by the client's)
            assert node["polled"] >= 25 and a.counters["polled"] >= 25
        else:
            assert node["polled"] == 0 and a.counters["polled"] == 0
    finally:
        daemon.stop()


def read_by_peer(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the peer read all this socket sent (its send queue empty) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        unread = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
        if struct.unpack("i", unread)[0] == 0:
            return True
        time.sleep(0.0002)
    return False


NOBODY = 65534


def _as_nobody(code: str) -> subprocess.CompletedProcess[str]:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a client as another user")
    return subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        + [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": os.environ.get("PATH", ""), "HOME": "/tmp"},
        cwd="/tmp",
    )


CONNECT = """
import json, socket
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(10)
try:
    sock.connect({sock!r})
except OSError as error:
    print(json.dumps({{"connected": False, "error": repr(error)}}))
else:
    data = b""
    while chunk := sock.recv(4096):  # (the daemon answers a refusal and closes)
        data += chunk
    print(json.dumps({{"connected": True, "error": data.decode("utf-8", "replace")}}))
"""  # (the standard library only: another user may not read this user's packages)


def test_a_client_of_another_user_is_refused_by_the_socket_and_by_its_credentials(daemon):
    assert os.stat(daemon.socket).st_mode & 0o777 == 0o600
    done = _as_nobody(CONNECT.format(sock=daemon.socket))
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert not found["connected"] and "PermissionError" in found["error"]
    assert stats(client(daemon.socket))["connections"] == 1  # (it never got to the daemon)
    os.chmod(daemon.socket, 0o666)  # (past the file's mode: the peer's credentials)
    done = _as_nobody(CONNECT.format(sock=daemon.socket))
    found = json.loads(done.stdout)
    assert found["connected"] and f"uid {NOBODY} is not the daemon's user" in found["error"]
    a = client(daemon.socket)  # (the daemon's own user still is)
    assert stats(a)["refused"] == 1 and stats(a)["connections"] == 2


def test_sigterm_exits_cleanly_and_removes_the_socket(daemon):
    a = client(daemon.socket)
    save(a, TOKENS, 1)
    status, err = daemon.terminate()
    assert status == 0 and not os.path.exists(daemon.socket)
    assert "'disconnects': 1" in err and "'open_requests': 0" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--socket", "relative.sock"], "--socket='relative.sock' is invalid: must be an absolute"),
        (["--socket", "/nonexistent/dir/k.sock"], "in an existing directory"),
        (["--socket", "/tmp/k.sock", "--disk-bytes", "1GiB"], "--disk-path=None is invalid"),
        (["--socket", "/tmp/k.sock", "--group", "no-such-group-x"], "--group='no-such-group-x'"),
        (["--socket", "/tmp/k.sock", "--io-timeout-ms", "0"], "must be an integer >= 1"),
        (["--socket", "/tmp/k.sock", "--busy-poll-us", "-1"], "must be an integer >= 0"),
        (["--socket", "/tmp/k.sock", "--busy-poll-us", "200000"], "--busy-poll-us=200000 is"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag_before_anything_is_created(flags, message):
    done = subprocess.run(
        [sys.executable, "-m", "kvpool.cli", "serve", *flags],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not os.path.exists("/tmp/k.sock")


@pytest.mark.parametrize(
    "url", ["/run/kvpool.sock", "tcp://host:1", "unix://run/kvpool.sock", 5, "unix:///" + "x" * 120]
)
def test_a_bad_node_cache_url_is_refused_naming_it(url):
    with pytest.raises(ConfigError, match=r"node_cache=.* is invalid: must be"):
        p.socket_path(url)


def test_help_explains_the_daemon():
    done = subprocess.run(
        [sys.executable, "-m", "kvpool.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert done.returncode == 0 and "node_cache" in done.stdout and "SIGTERM" in done.stdout


def test_the_daemon_serves_its_managers_metrics(sock_dir):
    pytest.importorskip("prometheus_client")
    import urllib.request

    with socket.socket() as probe:  # (a free port)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    path = f"{sock_dir}/kvpool.sock"
    daemon = Daemon(path, "--host-bytes", "4MiB", "--metrics-port", str(port)).start()
    try:
        a, b = client(path), client(path)
        save(a, TOKENS, 3)
        hit = b.lookup("m", None, TOKENS, True)
        assert isinstance(hit, Hit)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
            text = page.read().decode()
    finally:
        daemon.stop()
    assert "kvpool:kv_cache_usage_perc" in text
    hits = [line for line in text.splitlines() if line.startswith("kvpool:") and "hit" in line]
    assert any(line.endswith(f" {float(len(TOKENS))}") for line in hits), hits
