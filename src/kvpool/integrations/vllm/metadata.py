"""What the scheduler side tells the workers each step: page copies, by vLLM block id and kvpool
slot id, and where kvpool's first level is (`shared`: each pool's memfd, which a worker opens
through /proc/<scheduler pid>/fd and maps once)."""

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

    shared: dict[str, str]  # pool file name -> the path a worker maps
    saves: list[Transfer] = field(default_factory=list)
    loads: list[Transfer] = field(default_factory=list)
