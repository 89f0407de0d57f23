"""What the scheduler side tells the workers each step: page copies, by vLLM block id and kvpool
slot id (the workers map kvpool's first level, `shared_dir`, by name)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class Transfer:
    """Copy whole blocks of every layer: vLLM block `block_ids[i]` <-> kvpool slot `slots[i]`."""

    request_id: str
    block_ids: list[int]
    slots: list[int]


@dataclass
class KVPoolConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's work: `saves` (vLLM -> kvpool) and `loads` (kvpool -> vLLM)."""

    shared_dir: str
    saves: list[Transfer] = field(default_factory=list)
    loads: list[Transfer] = field(default_factory=list)
