"""The page format both sides derive from vLLM's KV-cache config: what is refused by name, and
tensor parallelism (each rank reads and writes its own heads of a shared page)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs vLLM (scripts/test.sh runs this in its vLLM venv)")
torch = pytest.importorskip("torch")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from kvpool.errors import ConfigError  # noqa: E402
from kvpool.integrations.vllm.metadata import KVPoolConnectorMetadata, Transfer  # noqa: E402
from kvpool.integrations.vllm.scheduler import SchedulerSide  # noqa: E402
from kvpool.integrations.vllm.settings import ConnectorSettings, PageFormat  # noqa: E402
from kvpool.integrations.vllm.worker import WorkerSide  # noqa: E402
from kvpool.layout import KVLayout  # noqa: E402


def vllm_config(tp=1, pp=1):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    )


def full(heads=2, **kw):
    return FullAttentionSpec(32, num_kv_heads=heads, head_size=64, dtype=torch.float16, **kw)


def config(*groups):
    specs = [KVCacheGroupSpec([f"layers.{i}"], spec) for i, spec in enumerate(groups)]
    return KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=specs)


def test_a_full_attention_model_gives_its_page_format():
    page = PageFormat.from_vllm(vllm_config(), config(full()))
    assert page.layer_names == ("layers.0",) and page.block_size == 32
    assert page.buffer_bytes == 2 * 32 * 64 * 2  # heads x block x head size x fp16


@pytest.mark.parametrize(
    ("groups", "parallel", "message"),
    [
        ((full(), full()), {}, "one KV-cache group; this one has 2"),
        (
            (
                SlidingWindowSpec(
                    32, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=128
                ),
            ),
            {},
            "full attention only",
        ),
        ((full(head_size_v=32),), {}, "head_size_v=32"),
        ((full(),), {"pp": 2}, "pipeline_parallel_size=1 only"),
    ],
)
def test_what_it_cannot_hold_exactly_is_refused_by_name(groups, parallel, message):
    with pytest.raises(ConfigError, match=message):
        PageFormat.from_vllm(vllm_config(**parallel), config(*groups))


def test_tensor_parallel_ranks_share_a_page_each_with_its_own_heads(tmp_path):
    layers = ("l0", "l1")
    full_page = PageFormat(layers, 16, 1, 64, 4, 0, 2)  # (any rank: the scheduler's view)
    settings = ConnectorSettings.parse({"host_bytes": 2 << 20})
    scheduler = SchedulerSide(settings, full_page, "m")
    config_ = full_page.manager_config(settings, "m")
    workers, tensors = [], []
    for rank in range(2):
        page = PageFormat(layers, 16, 1, 64, 4, rank, 2)
        worker = WorkerSide(page, 4, KVLayout(config_.layers, 16))
        kv = {name: torch.randn(4, 2, 1, 16, 64) for name in layers}
        worker.register_kv_caches(kv)
        workers.append(worker)
        tensors.append(kv)
    cache = scheduler.manager.create_kv_cache(None, [])
    assert cache.resume() and cache.resize(32)
    slots = [int(s) for s in cache.get_base_page_indices(0)]
    meta = KVPoolConnectorMetadata(scheduler.shared, saves=[Transfer("r", [2, 3], slots)])
    for worker in workers:
        worker.start_load_kv(meta)
    # the page holds rank 0's head, then rank 1's, of both blocks, in every layer and role
    manager = scheduler.manager
    for layer, name in enumerate(layers):
        for kv, role in enumerate(("k", "v")):
            rows = cache.get_page_indices(layer, role)
            pages = torch.from_numpy(manager.page_view(layer, role)[rows].copy())
            pages = pages.view(torch.float32).view(2, 2, 16, 64)
            for rank in range(2):
                assert torch.equal(pages[:, rank], tensors[rank][name][[2, 3], kv, 0])
    for rank, worker in enumerate(workers):  # and each rank loads back exactly its own head
        for tensor in tensors[rank].values():
            tensor.zero_()
        worker.start_load_kv(
            KVPoolConnectorMetadata(scheduler.shared, loads=[Transfer("r", [0, 1], slots)])
        )
    for layer, name in enumerate(layers):
        for kv, role in enumerate(("k", "v")):
            rows = cache.get_page_indices(layer, role)
            pages = torch.from_numpy(manager.page_view(layer, role)[rows].copy())
            pages = pages.view(torch.float32).view(2, 2, 16, 64)
            for rank in range(2):
                assert torch.equal(tensors[rank][name][[0, 1], kv, 0], pages[:, rank])
    cache.close()
    scheduler.shutdown()
