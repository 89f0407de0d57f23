"""The connector refuses, at import, vLLM releases it was not built against."""

from __future__ import annotations

import importlib
import sys

import pytest

vllm = pytest.importorskip("vllm", reason="needs vLLM (scripts/test.sh runs this in its vLLM venv)")


def fresh_import(monkeypatch, version: str):
    monkeypatch.setattr(vllm, "__version__", version)
    for name in [n for n in sys.modules if n.startswith("kvpool.integrations.vllm")]:
        monkeypatch.delitem(sys.modules, name)
    return importlib.import_module("kvpool.integrations.vllm")


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "dev"])
def test_unsupported_vllm_is_refused_by_name(monkeypatch, version):
    with pytest.raises(
        ImportError, match=rf"supports vLLM 0\.32\.x, 0\.33\.x; this is vLLM {version}"
    ):
        fresh_import(monkeypatch, version)


@pytest.mark.parametrize("version", ["0.32.0", "0.33.1+cpu"])
def test_supported_vllm_imports(monkeypatch, version):
    assert fresh_import(monkeypatch, version).KVPoolConnector.__name__ == "KVPoolConnector"


def test_bad_extra_config_keys_are_named():
    from kvpool.errors import ConfigError
    from kvpool.integrations.vllm.settings import ConnectorSettings

    cases = {
        "host_bytes": (0, "an integer >= 1"),
        "disk_bytes": (1 << 20, "disk_path"),  # a disk level needs its directory
        "eviction_policy": ("fifo", "one of"),
        "remote_url": ("http://x", "remote_url"),
        "shared_dir": ("/dev/shm", "no file in /dev/shm"),
        "model_id": ("  ", "a non-empty string"),
        "host_bytes_typo": (1, "the keys are"),
    }
    for key, (value, message) in cases.items():
        with pytest.raises(ConfigError, match=message):
            ConnectorSettings.parse({key: value})
    assert ConnectorSettings.parse(None).host_bytes == 1 << 30
