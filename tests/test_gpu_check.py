"""`scripts/gpu_check.sh` as a lent device runs it (issue 44): from a copy of the work tree (what
travels: tracked and untracked files, no compiled modules), in a sandbox without network, with
nothing to download; one summary line per check, the CUDA ones skipped with the reason on a
machine without a GPU. And `benchmarks/bench_cuda.py` sets each direction against its own
plain copy."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKS = [
    "python:",
    "packages:",
    "kvpool:",
    "gpu: skipped: no CUDA device",
    "pinning: skipped: no CUDA device",
    "cuda tests: skipped: no CUDA device",
    "device paths on the CPU stand-in: ",
    "bench_cuda: skipped: no CUDA device",
    "bench_adjust: skipped: no CUDA device",
    "exit status 0",
]


def without_network() -> list[str]:
    """A command prefix that runs in new user and network namespaces (only a loopback that is
    down: nothing can be downloaded), or a skip naming why there are none here."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")
    probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"no user and network namespaces here: {probe.stderr.strip()}")
    return ["unshare", "-rn"]


def copy_work_tree(destination: Path) -> None:
    """The files the device tool sends: tracked, and untracked that git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    for name in filter(None, listed.split(b"\0")):
        source = ROOT / os.fsdecode(name)
        if source.is_file():
            target = destination / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


@pytest.mark.slow
def test_gpu_check_runs_offline_from_a_copy_of_the_work_tree(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: run scripts/gpu_check.sh itself")
    prefix = without_network()
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to copy the work tree from")
    tree = tmp_path / "tree"
    copy_work_tree(tree)
    assert not list((tree / "src" / "kvpool").rglob("*.so"))  # (as on a lent device)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVPOOL_BACKEND")}
    # (the fuzzer's runs left out: the script's own run takes a minute more with them)
    env.update(OUT=str(tmp_path / "out"), PYTHON=sys.executable, PYTEST_ADDOPTS="-k 'not fuzzer'")
    done = subprocess.run(
        [*prefix, "bash", "scripts/gpu_check.sh"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    lines = [line.removeprefix("gpu_check: ") for line in done.stdout.splitlines()]
    for check in CHECKS:
        assert sum(line.startswith(check) for line in lines) == 1, (check, report)
    assert len(lines) == len(CHECKS), report  # (one line per check, nothing else)
    kvpool_line = next(line for line in lines if line.startswith("kvpool:"))
    assert f"{tree}/src/kvpool, backend python" in kvpool_line  # the copy, as source
    stand_in = next(line for line in lines if line.startswith("device paths"))
    assert " passed" in stand_in and "failed" not in stand_in
    assert (tmp_path / "out" / "device paths on the CPU stand-in.txt").is_file()


def test_bench_cuda_sets_each_direction_against_its_own_plain_copy(monkeypatch):
    torch = pytest.importorskip("torch")
    from kvpool.storage import device
    from tests import fake_cuda

    monkeypatch.setattr(device, "_pin_refused", [])
    fake_cuda.install(monkeypatch)
    monkeypatch.setenv("KVPOOL_DEBUG", os.environ.get("KVPOOL_DEBUG", "1"))  # (it pops it)
    spec = importlib.util.spec_from_file_location("bench_cuda", ROOT / "benchmarks/bench_cuda.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    # What `plain_copy_gbps` returns, in its order: (host -> GPU, GPU -> host).
    monkeypatch.setattr(bench, "plain_copy_gbps", lambda nbytes: (1.0, 2.0))
    result = bench.moves_once(128, 64)
    assert result["pages_out"] >= 128 and result["pages_in"] >= 128
    assert result["plain_host_to_gpu_gbps"] == 1.0
    assert result["plain_gpu_to_host_gbps"] == 2.0
