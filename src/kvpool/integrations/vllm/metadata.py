"""What the scheduler side tells the workers each step: page copies, per vLLM KV-cache group by
vLLM block id and kvpool slot id, and where kvpool's first level is (`shared`: each pool's
memfd, which a worker opens through /proc/<scheduler pid>/fd and maps once)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class Transfer:
    """Copy whole blocks of every layer of each vLLM KV-cache group g: vLLM block
    `block_ids[g][i]` <-> kvpool slot `slots[g][i]` (a slot of the group's kvpool layer group).
    A group with nothing to copy has empty lists (a sliding window's blocks out of the window)."""

    request_id: str
    block_ids: list[list[int]]
    slots: list[list[int]]

    @property
    def num_blocks(self) -> int:
        """vLLM blocks copied, all groups together."""
        return sum(len(ids) for ids in self.block_ids)


@dataclass
class KVPoolConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's work: `saves` (vLLM -> kvpool, blocks of finished requests, before the
    forward pass or after it), `loads` (kvpool -> vLLM), and `stores` (vLLM -> kvpool after
    this step's forward pass: the blocks a prompt ends with, which a sliding window frees as
    the request decodes)."""

    shared: dict[str, str]  # pool file name -> the path a worker maps
    saves: list[Transfer] = field(default_factory=list)
    loads: list[Transfer] = field(default_factory=list)
    stores: list[Transfer] = field(default_factory=list)
