"""The page format both sides derive from vLLM's KV-cache config: every KV-cache group of a
hybrid model mapped to a kvpool layer group of the same life cycle, what is refused by name
(and why), and tensor parallelism (each rank reads and writes its own heads of a shared page,
in every group)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs vLLM (scripts/test.sh runs this in its vLLM venv)")
torch = pytest.importorskip("torch")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)

from kvpool.errors import ConfigError  # noqa: E402
from kvpool.integrations.vllm.identity import _page_parts  # noqa: E402
from kvpool.integrations.vllm.metadata import KVPoolConnectorMetadata, Transfer  # noqa: E402
from kvpool.integrations.vllm.scheduler import SchedulerSide  # noqa: E402
from kvpool.integrations.vllm.settings import (  # noqa: E402
    ConnectorSettings,
    GroupFormat,
    PageFormat,
)
from kvpool.integrations.vllm.worker import WorkerSide  # noqa: E402
from kvpool.layout import KVLayout  # noqa: E402
from kvpool.lifecycles import AttentionLifeCycle  # noqa: E402


def vllm_config(tp=1, pp=1, dcp=1):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp, pipeline_parallel_size=pp, decode_context_parallel_size=dcp
        )
    )


def full(heads=2, block=32, **kw):
    return FullAttentionSpec(block, num_kv_heads=heads, head_size=64, dtype=torch.float16, **kw)


def window(size=128, block=32, **kw):
    return SlidingWindowSpec(
        block, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=size, **kw
    )


def config(*groups):
    """One group per spec, layer i in group i (a spec given as a list: that many layers)."""
    specs, layer = [], 0
    for spec in groups:
        count = 1
        if isinstance(spec, tuple):
            spec, count = spec
        specs.append(KVCacheGroupSpec([f"layers.{layer + i}" for i in range(count)], spec))
        layer += count
    return KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=specs)


def test_a_full_attention_model_gives_its_page_format():
    page = PageFormat.from_vllm(vllm_config(), config(full()))
    assert page.groups == (GroupFormat(("layers.0",), 2, 64, 2, None),)
    assert page.block_size == 32 and not page.windowed
    assert page.buffer_bytes(0) == 2 * 32 * 64 * 2  # heads x block x head size x fp16


def test_a_hybrid_model_maps_each_vllm_group_to_the_kvpool_layer_group_of_its_life_cycle():
    """Gemma-3 style, as vLLM's hybrid allocator groups it: one full-attention group and
    several sliding-window groups of the same spec (vLLM splits them to equal group sizes)."""
    hybrid = config((full(), 2), (window(), 2), (window(), 2), (window(), 2))
    page = PageFormat.from_vllm(vllm_config(), hybrid)
    assert [g.window for g in page.groups] == [None, 128, 128, 128] and page.windowed
    assert [str(g) for g in page.groups] == [
        "full attention (2 layers)",
        *["sliding window 128 (2 layers)"] * 3,
    ]
    assert [list(page.layer_ids(g)) for g in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    settings = ConnectorSettings.parse({"host_bytes": 4 << 20})
    manager = page.manager_config(settings, "m")
    assert [layer.sliding_window_size for layer in manager.layers] == [None] * 2 + [128] * 6
    layout = KVLayout(manager.layers, manager.tokens_per_block)
    # two kvpool life cycles: the three sliding groups share one (a page holds their 6 layers)
    assert layout.life_cycles == [AttentionLifeCycle(None, 0), AttentionLifeCycle(128, 0)]
    assert page.layer_groups(layout) == [0, 1, 1, 1]
    # a sliding window's kvpool life cycle frees exactly what vLLM frees: at history h the
    # blocks wholly before h + 1 - window (vLLM: get_num_skipped_tokens(h) // block_size)
    for history in range(0, 700, 7):
        _, end = layout.life_cycles[1].stale_range(history, 32)
        assert end == max(0, history - 128 + 1) // 32


def test_host_memory_too_small_for_a_hybrid_models_pool_groups_is_named():
    # (1 full layer, 2 sliding ones: pages of different sizes, two kvpool pool groups of 2 MiB
    # units each)
    page = PageFormat.from_vllm(vllm_config(), config(full(), (window(), 2)))
    settings = ConnectorSettings.parse({"host_bytes": 2 << 20})
    with pytest.raises(ConfigError, match="cache_tiers\\[0\\] is host_bytes"):
        SchedulerSide(settings, page, "m")


def test_a_sliding_window_with_extra_retained_tokens_keeps_them_too():
    page = PageFormat.from_vllm(vllm_config(), config(full(), window(100, extra_retained_tokens=3)))
    assert page.groups[1].window == 103


def test_the_page_format_is_part_of_the_model_identity():
    one = _page_parts(PageFormat.from_vllm(vllm_config(), config(full(), window(128))))
    other = _page_parts(PageFormat.from_vllm(vllm_config(), config(full(), window(256))))
    assert one != other and one["page.group1.window"] == 128


@pytest.mark.parametrize(
    ("groups", "parallel", "message"),
    [
        (
            (full(), MambaSpec(32, shapes=((4, 8),), dtypes=(torch.float16,))),
            {},
            r"group 1 \(MambaSpec: layers.1\): a Mamba/SSM layer's state",
        ),
        ((MLAAttentionSpec(32, num_kv_heads=1, head_size=64, dtype=torch.float16),), {}, "MLA"),
        (
            (
                full(),
                ChunkedLocalAttentionSpec(
                    32, num_kv_heads=2, head_size=64, dtype=torch.float16, attention_chunk_size=128
                ),
            ),
            {},
            "ChunkedLocalAttentionSpec.*current chunk's blocks",
        ),
        (
            (
                SinkFullAttentionSpec(
                    32, num_kv_heads=2, head_size=64, dtype=torch.float16, sink_len=32
                ),
            ),
            {},
            "SinkFullAttentionSpec.*learned KV",
        ),
        ((full(kv_quant_mode=KVQuantMode.FP8_PER_TENSOR),), {}, "kv_quant_mode=FP8_PER_TENSOR"),
        ((full(head_size_v=32),), {}, "head_size_v=32"),
        ((full(page_size_padded=1 << 16),), {}, "page_size_padded"),
        ((full(), window(block=16)), {}, r"one block size .* \[16, 32\]"),
        ((full(),), {"pp": 2}, "pipeline_parallel_size=1 only"),
        ((full(),), {"dcp": 2}, "decode_context_parallel_size=1 only"),
    ],
)
def test_what_it_cannot_hold_exactly_is_refused_by_name(groups, parallel, message):
    with pytest.raises(ConfigError, match=message):
        PageFormat.from_vllm(vllm_config(**parallel), config(*groups))


def test_tensor_parallel_ranks_share_a_page_each_with_its_own_heads_in_every_group(tmp_path):
    """Two groups (full attention, a sliding window) of one layer each, two ranks."""

    def page_of(rank):
        groups = (GroupFormat(("l0",), 1, 64, 4), GroupFormat(("l1",), 1, 64, 4, 32))
        return PageFormat(groups, 16, rank, 2)

    scheduler_page = page_of(0)  # (any rank: the scheduler's view)
    settings = ConnectorSettings.parse({"host_bytes": 2 << 20})
    scheduler = SchedulerSide(settings, scheduler_page, "m", num_workers=2)
    config_ = scheduler_page.manager_config(settings, "m")
    layout = KVLayout(config_.layers, 16)
    assert scheduler.layer_groups == [0, 1]
    workers, tensors = [], []
    for rank in range(2):
        worker = WorkerSide(page_of(rank), 4, layout)
        kv = {name: torch.randn(4, 2, 1, 16, 64) for name in ("l0", "l1")}
        worker.register_kv_caches(kv)
        workers.append(worker)
        tensors.append(kv)
    cache = scheduler.manager.create_kv_cache(None, [])
    assert cache.resume() and cache.resize(32)
    slots = [[int(s) for s in cache.get_base_page_indices(g)] for g in (0, 1)]
    meta = KVPoolConnectorMetadata(scheduler.shared, saves=[Transfer("r", [[2, 3], [1, 0]], slots)])
    for worker in workers:
        worker.start_load_kv(meta)
    manager = scheduler.manager

    def pages_of(layer, role):
        rows = cache.get_page_indices(layer, role)
        pages = torch.from_numpy(manager.page_view(layer, role)[rows].copy())
        return pages.view(torch.float32).view(2, 2, 16, 64)

    # each page holds rank 0's head, then rank 1's, in every group, layer and role
    for layer, (name, blocks) in enumerate((("l0", [2, 3]), ("l1", [1, 0]))):
        for kv, role in enumerate(("k", "v")):
            for rank in range(2):
                assert torch.equal(
                    pages_of(layer, role)[:, rank], tensors[rank][name][blocks, kv, 0]
                )
    for rank, worker in enumerate(workers):  # and each rank loads back exactly its own head
        for tensor in tensors[rank].values():
            tensor.zero_()
        load = Transfer("r", [[0, 1], [3, 2]], slots)
        worker.start_load_kv(KVPoolConnectorMetadata(scheduler.shared, loads=[load]))
    for layer, (name, blocks) in enumerate((("l0", [0, 1]), ("l1", [3, 2]))):
        for kv, role in enumerate(("k", "v")):
            for rank in range(2):
                assert torch.equal(
                    tensors[rank][name][blocks, kv, 0], pages_of(layer, role)[:, rank]
                )
    # a load naming a block kvpool has no page for fails (vLLM recomputes) and copies nothing
    before = tensors[0]["l0"].clone()
    bad = Transfer("bad", [[0], [1]], [[slots[0][0]], [-1]])
    workers[0].start_load_kv(KVPoolConnectorMetadata(scheduler.shared, loads=[bad]))
    assert workers[0].take_failed_loads() == {"bad"}
    assert torch.equal(tensors[0]["l0"][1:], before[1:])
    cache.close()
    scheduler.shutdown()
