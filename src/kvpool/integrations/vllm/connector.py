"""`KVPoolConnector`: vLLM's v1 KV-connector interface over kvpool, both roles. The scheduler
role owns kvpool's manager (`scheduler.SchedulerSide`); the worker role copies blocks
(`worker.WorkerSide`). It supports vLLM's hybrid KV-cache allocator (`SupportsHMA`): one vLLM
KV-cache group per kvpool life cycle (full attention, sliding window)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvpool.errors import ConfigError
from kvpool.integrations.vllm.identity import vllm_model_identity
from kvpool.integrations.vllm.metadata import KVPoolConnectorMetadata
from kvpool.integrations.vllm.metrics import Deltas, KVPoolConnectorStats, KVPoolPromMetrics
from kvpool.integrations.vllm.scheduler import SchedulerSide
from kvpool.integrations.vllm.settings import ConnectorSettings, PageFormat
from kvpool.integrations.vllm.worker import WorkerSide
from kvpool.layout import KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvpool.vllm")
# (under vLLM's logger: vLLM shows its INFO lines, not those of other libraries)
start_log = logging.getLogger("vllm.kvpool")


try:  # (how a worker reports failed loads of a model with several KV-cache groups)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover (a vLLM without it: one KV-cache group only)
    KVConnectorTransferResults = None


class KVPoolConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """kvpool's host, disk and shared tiers below vLLM's GPU prefix cache."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.parse(transfer.kv_connector_extra_config)
        self.page = PageFormat.from_vllm(vllm_config, kv_cache_config)
        if len(self.page.groups) > 1 and KVConnectorTransferResults is None:
            raise ConfigError(
                "KVPoolConnector needs vLLM's KVConnectorTransferResults for a model with "
                f"{len(self.page.groups)} KV-cache groups (failed loads are reported per "
                "request); this vLLM has none: pass --disable-hybrid-kv-cache-manager"
            )
        self._deltas = Deltas()
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            identity = vllm_model_identity(vllm_config, self.page, self.settings.model_id)
            start_log.info("kvpool: model identity %s", identity)
            log.info(
                "kvpool: %d KV-cache groups: %s",
                len(self.page.groups),
                ", ".join(str(group) for group in self.page.groups),
            )
            workers = int(getattr(vllm_config.parallel_config, "world_size", 1) or 1)
            self._scheduler = SchedulerSide(self.settings, self.page, identity.digest, workers)
        else:
            config = self.page.manager_config(self.settings, "")
            layout = KVLayout(config.layers, config.tokens_per_block)
            self._worker = WorkerSide(self.page, int(kv_cache_config.num_blocks), layout)

    @property
    def scheduler_side(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call on the worker role"
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side call on the scheduler role"
        return self._worker

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, never wrong output

    # -- worker role ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolConnectorMetadata)
        self.worker_side.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # (start_load_kv copied everything)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # (saves copy finished requests' blocks, in start_load_kv)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolConnectorMetadata)
        self.worker_side.wait_for_save(meta)  # (stores: blocks this forward pass completed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker_side.get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Finished saves and loads; with several KV-cache groups, failed loads by request
        (vLLM's block ids are per group, so vLLM takes no block-level load errors then)."""
        sending, recving = self.worker_side.get_finished()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=self.worker_side.take_failed_loads(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker_side.build_worker_meta()

    # -- both roles ----------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This side's counts since the last call (vLLM adds the workers' and the scheduler's)."""
        if self._scheduler is not None:
            return self._deltas.take(self._scheduler.counts())
        return self._deltas.take(dict(self.worker_side.counts))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVPoolConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KVPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- scheduler role ------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        manager = getattr(self, "_kv_cache_manager", None)  # (bind_kv_cache_manager's)
        block_ids_of = None if manager is None else manager.get_block_ids
        return self.scheduler_side.build_connector_meta(scheduler_output, block_ids_of)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """(vLLM calls this for a connector without `SupportsHMA`: one group.)"""
        return self.scheduler_side.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, block_ids)

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
