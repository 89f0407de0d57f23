"""The `kvpool` command."""

import shutil
import subprocess

import pytest

import kvpool
from kvpool.cli import main, parse_bytes


def test_info_prints_the_pool_group_layout(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"backend {kvpool.backend_info().describe()}" in out.splitlines()[0]
    assert "model gemma-3-1b" in out
    assert "0: sliding window 512; layers 0-4,6-10,12-16,18-22,24-25; pool group 0" in out
    assert "1: full attention; layers 5,11,17,23; pool group 1" in out
    assert "slot sizes [704.00 KiB]" in out and "slot sizes [128.00 KiB]" in out
    assert "GPU level memory:" in out
    assert "0 GPU: quota 1.00 GiB" in out


def test_info_with_host_tier_and_other_model(capsys):
    assert (
        main(["info", "--model", "llama-3-8b", "--gpu-quota", "64MiB", "--host-quota", "256MiB"])
        == 0
    )
    out = capsys.readouterr().out
    assert "pool group 0: 16 slots (512 tokens), 100.0% of the level" in out
    assert "1 HOST: quota 256.00 MiB" in out
    assert "pool group 0: 64 slots (2048 tokens)" in out


def test_info_reports_a_quota_too_small(capsys):
    assert main(["info", "--gpu-quota", "1MiB"]) == 2
    err = capsys.readouterr().err
    assert "--gpu=1048576 is invalid: must be at least" in err


@pytest.mark.parametrize(
    ("text", "value"), [("4096", 4096), ("1KiB", 1024), ("2m", 2 << 20), ("1.5GiB", 3 << 29)]
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_installed_entry_point_runs():
    exe = shutil.which("kvpool")
    if exe is None:
        pytest.fail("the kvpool command is not installed (pip install -e .)")
    result = subprocess.run(
        [exe, "info", "--model", "mistral-7b"], capture_output=True, text=True, check=True
    )
    assert "sliding window 4096" in result.stdout
