"""vLLM's OpenAI-compatible server with kvpool's connector, started as a user starts it, asked
over plain HTTP, and stopped the ways servers stop: SIGTERM (systemd, Kubernetes), SIGINT
(Ctrl-C), SIGKILL of the server, of its engine core and of its worker. After each, no kvpool
file is in /dev/shm, no process of the server is left (after SIGKILL of the server itself,
once its orphans are ended) and nothing holds kvpool's host memory (its memfds, found by inode
in every process's descriptors and mappings)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM (scripts/test.sh runs this in its vLLM venv)")
psutil = pytest.importorskip("psutil")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from tests.vllm_server import Server  # noqa: E402

pytestmark = pytest.mark.slow
MEMFD = "memfd:kvpool-pool-"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("server-model")
    config = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


def memfd_holders(inodes: set[int]) -> list[str]:
    """Every process that holds (open or mapped) a file with one of `inodes` of kvpool's."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if MEMFD in os.readlink(fd) and os.stat(fd).st_ino in inodes:
                    found.append(f"{proc.name} fd {fd.name}")
            for line in (proc / "maps").read_text().splitlines():
                fields = line.split()
                if len(fields) >= 6 and MEMFD in line and int(fields[4]) in inodes:
                    found.append(f"{proc.name} maps {fields[5]}")
        except (OSError, ValueError):
            continue
    return found


def kvpool_memory(server: Server) -> tuple[int, set[int], list[int]]:
    """(the engine core's pid, the inodes of kvpool's memfds, the pids that map them)."""
    core, inodes, mappers = None, set(), []
    for process in server.tree():
        proc = Path("/proc") / str(process.pid)
        try:
            for fd in (proc / "fd").iterdir():
                if MEMFD in os.readlink(fd):
                    core = process.pid
                    inodes.add(os.stat(fd).st_ino)
        except OSError:
            continue
    for process in server.tree():
        if process.pid != core:
            maps = (Path("/proc") / str(process.pid) / "maps").read_text()
            if MEMFD in maps:
                mappers.append(process.pid)
    assert core is not None and inodes, "kvpool's host memory was not found in the server"
    return core, inodes, mappers


CASES = ["sigterm", "sigint", "kill-server", "kill-engine-core", "kill-worker"]


@pytest.mark.parametrize("case", CASES)
def test_the_server_leaves_no_memory_and_no_file_however_it_stops(model, tmp_path, case):
    before = {p for p in os.listdir("/dev/shm") if "kvpool" in p}
    server = Server(model, {"host_bytes": 64 << 20}, tmp_path / "server.log")
    tree = [psutil.Process(server.process.pid)]
    try:
        server.wait_healthy()
        prompt = [(7 * j + 3) % 2000 for j in range(300)]
        first = server.complete(prompt)
        deadline = time.monotonic() + 60
        while True:  # the worker maps kvpool's memory when it saves the first request's blocks
            second = server.complete(prompt)
            core, inodes, mappers = kvpool_memory(server)
            if mappers or time.monotonic() > deadline:
                break
        assert second == first and mappers, "no worker mapped kvpool's memory"
        assert "kvpool:saved_blocks_total{" in server.metrics()
        tree = server.tree()
        if case == "sigterm":
            server.process.send_signal(signal.SIGTERM)
        elif case == "sigint":
            server.process.send_signal(signal.SIGINT)
        elif case == "kill-server":
            server.process.kill()
        elif case == "kill-engine-core":
            os.kill(core, signal.SIGKILL)
        else:
            os.kill(mappers[0], signal.SIGKILL)
        if case == "kill-server":
            # vLLM's engine core does not watch its API server: killed with SIGKILL, the
            # server leaves its engine core and worker running (orphans, which hold their
            # memory, kvpool's with the rest, as any process does), never a file: once a
            # supervisor ends them, nothing is left.
            server.process.wait(30)
            assert {p for p in os.listdir("/dev/shm") if "kvpool" in p} <= before
            pids = {process.pid for process in tree}
            holders = {int(h.split()[0]) for h in memfd_holders(inodes)}
            assert holders <= pids, f"kvpool's memory held outside the server: {holders - pids}"
            for process in tree[1:]:
                process.kill()
        else:
            server.process.wait(120)  # (the server exits by itself)
        _, alive = psutil.wait_procs(tree, timeout=120)
        assert not alive, f"left running after {case}: {alive}"
        assert memfd_holders(inodes) == []
        assert {p for p in os.listdir("/dev/shm") if "kvpool" in p} <= before
    finally:
        for process in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        server.process.wait(60)


@pytest.mark.parametrize("asynchronous", [True, False])
def test_a_request_served_from_host_memory_never_waits_for_anothers_fetch(
    model, tmp_path, asynchronous
):
    """The Valkey server stops answering (SIGSTOP) while a request fetches its prefix from it:
    a request whose prefix is in the server's host memory completes meanwhile. With
    synchronous lookups (the control), it waits for the other's fetch to time out."""
    import threading

    from tests.valkey_servers import ValkeyServer, server_binary

    if server_binary() is None:
        pytest.skip("no valkey-server binary")
    valkey = ValkeyServer(tmp_path / "valkey").start()
    url = f"valkey://127.0.0.1:{valkey.port}"
    remote = [(11 * j + 5) % 2000 for j in range(300)]
    local = [(13 * j + 1) % 2000 for j in range(300)]
    servers = []
    try:
        writer = Server(model, {"host_bytes": 64 << 20, "remote_url": url}, tmp_path / "w.log")
        servers.append(writer)
        writer.wait_healthy()
        expected = writer.complete(remote)
        writer.process.terminate()  # (its shutdown flushes the writes)
        writer.process.wait(120)
        timeout_ms = 60_000 if asynchronous else 8_000
        extra = {
            "host_bytes": 64 << 20,
            "remote_url": url,
            "remote_timeout_ms": timeout_ms,
            "async_lookups": asynchronous,
        }
        server = Server(model, extra, tmp_path / "server.log")
        servers.append(server)
        server.wait_healthy()
        server.complete([1999, 3, 5] * 5)  # (a first request unrelated to any prefix)
        wanted = server.complete(local)  # now in this server's host memory
        server.complete([1998, 3, 5] * 5)  # (the step after it copies its blocks out)
        valkey.pause()
        fetched: list[list[int]] = []
        fetching = threading.Thread(target=lambda: fetched.append(server.complete(remote)))
        fetching.start()
        time.sleep(2)  # (its lookup is waiting on the stopped server now)
        started = time.monotonic()
        assert server.complete(local) == wanted
        took = time.monotonic() - started
        if asynchronous:
            assert fetching.is_alive(), "the fetch ended: nothing was tested"
            assert took < 20, f"a host-memory hit waited {took:.1f} s for another's fetch"
        else:  # the control: the scheduler's thread is in the other's fetch until it times out
            assert took > 4, f"the synchronous control did not wait ({took:.1f} s)"
        valkey.unpause()
        fetching.join(180)
        assert fetched == [expected]  # (served from Valkey, or recomputed: the same tokens)
    finally:
        valkey.unpause()
        for server in servers:
            server.stop()
        valkey.stop()
