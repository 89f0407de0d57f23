"""Every code example in the README and the documentation site runs, so none can rot.

Python blocks of a page run in order in one namespace (a page reads like a notebook), in a
temporary directory. Shell blocks are `kvpool` and `python benchmarks/...` command lines: each
`kvpool` line is parsed and checked as the CLI would before any work (`kvpool.cli.parse`), and
a block marked `run` is run for real. An HTML comment on the line before a fence says what a
block needs (invisible on the page):

    <!-- docs-test: run -->            shell: run every command (each must exit 0)
    <!-- docs-test: valkey -->         start a valkey-server; `localhost:6379` means it
    <!-- docs-test: gpu -->            only where torch sees a CUDA device
    <!-- docs-test: skip REASON -->    not run (say why on the page or here)
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
DIRECTIVE = re.compile(r"^<!-- docs-test: (\w+)\s*(.*?)\s*-->$")
SHELL = ("bash", "sh", "console")  # (an unlabelled fence is text: a diagram, a listing)


@dataclass
class Block:
    page: Path
    line: int  # of the fence
    language: str
    code: str
    directive: str = ""
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found, index = [], 0
    while index < len(lines):
        match = FENCE.match(lines[index])
        if not match:
            index += 1
            continue
        start, language = index, match.group(1)
        end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
        directive = DIRECTIVE.match(lines[start - 1]) if start else None
        found.append(
            Block(
                page,
                start + 1,
                language,
                "\n".join(lines[start + 1 : end]) + "\n",
                directive.group(1) if directive else "",
                directive.group(2) if directive else "",
            )
        )
        index = end + 1
    return found


def commands(code: str) -> list[str]:
    """The command lines of a shell block: continuation lines joined, comments and blank lines
    dropped."""
    joined = code.replace("\\\n", " ")
    return [
        line.split(" #")[0].strip()
        for line in joined.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.fixture
def valkey_url(tmp_path):
    from tests.valkey_servers import ValkeyServer, server_binary

    if server_binary() is None:
        pytest.skip("no valkey-server binary")
    server = ValkeyServer(tmp_path / "valkey").start()
    yield f"127.0.0.1:{server.port}"
    server.stop()


def needs_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_python_examples_run(page, tmp_path, monkeypatch, request):
    blocks = [b for b in blocks_of(page) if b.language == "python"]
    if not blocks:
        pytest.skip("no Python example")
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    ran = 0
    for block in blocks:
        if block.directive == "skip":
            assert block.reason, f"{block.where}: a skipped example says why"
            continue
        if block.directive == "gpu" and not needs_cuda():
            continue
        code = block.code
        if block.directive == "valkey":
            code = code.replace("localhost:6379", request.getfixturevalue("valkey_url"))
        try:
            exec(compile(code, block.where, "exec"), namespace)
        except BaseException as error:
            raise AssertionError(f"the example at {block.where} failed: {error!r}") from error
        ran += 1
    for manager in [v for v in namespace.values() if type(v).__name__ == "KVCacheManager"]:
        for cache in manager.open_kv_caches:  # type: ignore[attr-defined]
            cache.close()
        manager.shutdown()  # type: ignore[attr-defined]
    assert ran or all(b.directive in ("skip", "gpu") for b in blocks)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_command_lines_parse_and_marked_ones_run(page, tmp_path):
    from kvpool.cli import parse

    blocks = [b for b in blocks_of(page) if b.language in SHELL]
    if not any(commands(b.code) for b in blocks):
        pytest.skip("no command line")
    for block in blocks:
        for command in commands(block.code):
            words = shlex.split(command)
            if words[0] == "kvpool":
                try:
                    parse(words[1:])
                except SystemExit as stop:
                    raise AssertionError(f"{block.where}: `{command}` is refused") from stop
            elif words[:2] == ["python", "benchmarks/" + Path(words[1]).name]:
                assert (ROOT / words[1]).is_file(), f"{block.where}: no {words[1]}"
            if block.directive != "run":
                continue
            done = subprocess.run(
                [sys.executable, "-m", "kvpool.cli", *words[1:]]
                if words[0] == "kvpool"
                else [sys.executable if w == "python" else w for w in words],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=300,
                env={**os.environ, "KVPOOL_DEBUG": "0"},
            )
            assert done.returncode == 0, f"{block.where}: `{command}`:\n{done.stderr[-2000:]}"
