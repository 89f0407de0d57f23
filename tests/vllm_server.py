"""vLLM's OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`) with kvpool's
connector, started as a user starts it, in a process of its own, and asked over plain HTTP: for
the server tests and benchmarks. Run it with vLLM's venv's python (scripts/vllm_venv.sh)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`python -m vllm.entrypoints.openai.api_server` with kvpool's connector."""

    def __init__(
        self,
        model: str,
        extra: dict | None,
        log: Path,
        *options: str,
        env: dict[str, str] | None = None,
    ) -> None:
        """`env`: variables added to the server's environment."""
        self.model = model
        self.port = free_port()
        transfer = {
            "kv_connector": "KVPoolConnector",
            "kv_connector_module_path": "kvpool.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--port", str(self.port), "--host", "127.0.0.1",
            "--skip-tokenizer-init", "--block-size", "32", "--enforce-eager",
            "--dtype", "float32", "--max-model-len", "1024",
            "--num-gpu-blocks-override", "48", *options,
        ]  # fmt: skip
        if extra is not None:
            command += ["--kv-transfer-config", json.dumps(transfer)]
        self.log = log
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
        self.process = subprocess.Popen(
            command,
            stdout=open(log, "w"),  # noqa: SIM115 (the child keeps it)
            stderr=subprocess.STDOUT,
            env=env,
        )

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_healthy(self, timeout: float = 400) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-4000:]
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise AssertionError("the server did not become healthy:\n" + self.log.read_text()[-4000:])

    def complete(self, prompt: list[int], max_tokens: int = 4) -> list[int]:
        body = json.dumps(
            {
                "model": self.model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "return_token_ids": True,
            }
        ).encode()
        request = urllib.request.Request(
            self.url("/v1/completions"), body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as answer:
            return list(json.loads(answer.read())["choices"][0]["token_ids"])

    def stream(self, prompt: list[int], max_tokens: int = 4) -> tuple[float, list[int]]:
        """A streamed completion: (seconds to its first token, its tokens)."""
        body = json.dumps(
            {
                "model": self.model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "return_token_ids": True,
            }
        ).encode()
        request = urllib.request.Request(
            self.url("/v1/completions"), body, {"Content-Type": "application/json"}
        )
        started = time.perf_counter()
        first = None
        tokens: list[int] = []
        with urllib.request.urlopen(request, timeout=300) as answer:
            for raw in answer:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line.removeprefix("data: "))["choices"][0]
                ids = choice.get("token_ids") or []
                if ids and first is None:
                    first = time.perf_counter() - started
                tokens += ids
        assert first is not None, "the stream carried no token"
        return first, tokens

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url("/metrics"), timeout=10) as answer:
            return answer.read().decode()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL of every process of the server if it is not gone in 2
        minutes (a killed API server leaves its engine core running)."""
        tree = self.tree() if self.process.poll() is None else []
        if self.process.poll() is None:
            self.process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(120)
        for process in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        self.process.wait(60)

    def tree(self) -> list:
        root = psutil.Process(self.process.pid)
        return [root, *root.children(recursive=True)]
