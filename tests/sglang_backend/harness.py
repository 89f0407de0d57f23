"""SGLang's own storage machinery on CPU tensors, for the backend's tests: its device KV pool
and paged allocator, its host pool (MHA or MLA, any of the three layouts), and its HiCache
controller with kvpool's backend attached through SGLang's `dynamic` loader. Pages are written
and read the way SGLang's scheduler drives the controller: `write_storage` (the backup thread
calls `batch_set_v1`) and `prefetch` (the prefetch thread's `batch_exists`, then, once the test
plays the scheduler and hands it host memory, the I/O thread's `batch_get_v1`).

A hybrid model (`Engine(..., pools=("mamba",))`, `("swa",)`, or `pools=()` with
`hybrid=True`: a plain model as SGLang 0.5.23's server runs it) gets SGLang's
`HybridCacheController` over a `HostPoolGroup`, as `hybrid_pool_assembler.py` builds them: the
KV pool (the anchor), an SWA pool (an MHA host pool of its own layers) and a Mamba state pool
(`MambaPoolHost`, with a side state); the controller registers each with
`register_mem_host_pool_v2`, writes the extra pools with `batch_set_v2` next to the KV pages'
`batch_set_v1`, asks `batch_exists_v2` with the pools' hit policies, and reads them with
`batch_get_v2` once the KV pages are in, as `UnifiedRadixCache` drives it (a node's Mamba state
keyed by its last page, its SWA window by its last `SWA_WINDOW` pages).

Runs as a library and as a script (`python -m tests.sglang_backend.harness write|read ...`),
so that pages written by one process are read by another.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
import warnings
from typing import Any

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (  # noqa: E402
    HybridCacheController,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry  # noqa: E402
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

PAGE = 16  # tokens per page
LAYERS = 3
HEADS, HEAD_DIM = 4, 32  # MHA: per rank
KV_LORA, ROPE = 64, 16  # MLA
DEVICE_TOKENS = 1024
SWA_LAYERS, SWA_WINDOW = 2, 2  # SWA: its layers, and the pages a node's window keeps
MAMBA_LAYERS, MAMBA_SLOTS = 2, 16  # Mamba: its layers, device state slots
BACKEND = {
    "backend_name": "kvpool",
    "module_path": "kvpool.integrations.sglang",
    "class_name": "KVPoolHiCacheStorage",
    "interface_v1": 1,
}


def device_pool(kind: str, layers: int = LAYERS) -> Any:
    if kind == "mha":
        return MHATokenToKVPool(
            DEVICE_TOKENS, PAGE, torch.bfloat16, HEADS, HEAD_DIM, layers, "cpu", False,
            start_layer=0, end_layer=layers,
        )  # fmt: skip
    return MLATokenToKVPool(
        DEVICE_TOKENS, PAGE, torch.bfloat16, KV_LORA, ROPE, layers, "cpu", False,
        start_layer=0, end_layer=layers,
    )  # fmt: skip


def mamba_host_pool(layout: str) -> Any:
    """SGLang's Mamba state host pool (as `build_mamba_host_pool` makes it) over CPU device
    state tensors: a float32 temporal state, a bf16 conv state and an int32 side state."""
    info = MambaStateBufferInfo(
        temporal=torch.zeros(MAMBA_LAYERS, MAMBA_SLOTS, 4, 8, dtype=torch.float32),
        conv=(torch.zeros(MAMBA_LAYERS, MAMBA_SLOTS, 3, 16, dtype=torch.bfloat16),),
        extra_checkpoint_buffers=(torch.zeros(MAMBA_SLOTS, 3, dtype=torch.int32),),
    )
    layout = "page_first" if layout == "layer_first" else layout  # (its two layouts)
    return MambaPoolHost(info, 4.0, 0, device_capacity=MAMBA_SLOTS, pin_memory=False,
                         layout=layout)  # fmt: skip


class SwaPool:
    """The SWA pool of a hybrid engine, for `fill_pages`/`check_pages` (its own layers)."""

    def __init__(self, kind: str, layout: str, host: Any, layers: int):
        self.kind, self.layout, self.host, self.layers, self.salt = (
            kind, layout, host, layers, "swa|"
        )  # fmt: skip


def host_pool(kind: str, layout: str, device: Any, ratio: float = 2.0) -> Any:
    info = device.get_device_pool_infos()[0].buffer_info
    common = dict(
        pin_memory=False,
        device_capacity_tokens=device.size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
    )
    if kind == "mha":
        return MHATokenToKVPoolHost(info, ratio, 0, PAGE, layout, **common)
    return MLATokenToKVPoolHost(info, ratio, 0, PAGE, layout, target_layer_num=LAYERS, **common)


def single_rank() -> None:
    """What SGLang's launcher states before its controller starts: one rank, no parallelism."""
    get_parallel().override_permanently(
        tp_rank=0, tp_size=1, pp_size=1, pp_rank=0, attn_dp_size=1, attn_dp_rank=0,
        attn_tp_size=1, attn_tp_rank=0, attn_cp_rank=0, attn_cp_size=1, attn_dcp_size=1,
        attn_dcp_rank=0, moe_ep_size=1, moe_ep_rank=0, moe_dp_size=1, moe_tp_size=1,
    )  # fmt: skip


class Engine:
    """A device pool, a host pool and SGLang's controller with kvpool attached; with `pools`
    (`swa`, `mamba`) or `hybrid`, SGLang's hybrid controller over a host pool group."""

    layers = LAYERS
    salt = ""  # (the KV pages' bytes: `page_bytes_for(salt + key)`)

    def __init__(
        self,
        kind: str,
        layout: str,
        extra: dict[str, Any],
        write_policy: str = "write_through",
        model_name: str = "kvpool-test-model",
        pools: tuple[str, ...] = (),
        hybrid: bool = False,
        swa_layers: int = SWA_LAYERS,
    ):
        self.kind, self.layout, self.pools = kind, layout, pools
        single_rank()
        self.device = device_pool(kind)
        self.allocator = PagedTokenToKVPoolAllocator(
            DEVICE_TOKENS, PAGE, torch.bfloat16, "cpu", self.device, need_sort=False
        )
        self.host = host_pool(kind, layout, self.device)
        self.swa: SwaPool | None = None
        self.mamba: Any = None
        common = dict(
            tp_group=None,
            load_cache_event=threading.Event(),
            write_policy=write_policy,
            io_backend="direct",
            storage_backend="dynamic",
            model_name=model_name,
            storage_backend_extra_config={**BACKEND, **extra},
        )
        if not pools and not hybrid:
            self.controller = HiCacheController(self.allocator, self.host, PAGE, **common)
        else:
            entries = [PoolEntry(PoolName.KV, self.host, self.device, lambda i: i, True)]
            if "swa" in pools:
                swa_device = device_pool(kind, swa_layers)  # (LAYERS: pages as big as KV's)
                self.swa = SwaPool(kind, layout, host_pool(kind, layout, swa_device), swa_layers)
                entries.append(PoolEntry(PoolName.SWA, self.swa.host, swa_device, lambda i: i))
            if "mamba" in pools:
                self.mamba = mamba_host_pool(layout)
                entries.append(PoolEntry(PoolName.MAMBA, self.mamba, None, lambda i: None))
            self.controller = HybridCacheController(
                self.allocator, HostPoolGroup(entries), PAGE, **common
            )
        self.backend = self.controller.storage_backend

    # -- what SGLang's scheduler does around the controller ----------------------------------

    def hashes(self, tokens: list[int]) -> list[str]:
        return list(get_hash_str(tokens, None, page_size=PAGE))

    def write(self, tokens: list[int], fill: Any) -> list[str]:
        """Put pages of `tokens` into host memory (`fill(host_indices, hashes)` writes their
        KV), then have the controller back them up; returns the page hashes."""
        pages = len(tokens) // PAGE
        indices = self.host.alloc(pages * PAGE)
        assert indices is not None, "host pool full"
        hashes = self.hashes(tokens[: pages * PAGE])
        fill(indices, hashes)
        op_id = self.controller.write_storage(indices, tokens[: pages * PAGE], hash_value=hashes,
                                              prefix_keys=[])  # fmt: skip
        while True:
            done = self.controller.ack_backup_queue.get(timeout=60)
            if done.id == op_id:
                break
        self.host.free(indices)
        if done.completed_tokens != pages * PAGE:
            raise RuntimeError(f"backup stored {done.completed_tokens} of {pages * PAGE} tokens")
        return hashes

    def read(self, tokens: list[int], rid: str = "r") -> tuple[int, Any, list[str]]:
        """Prefetch `tokens` as the scheduler does: the controller's hit query, host memory for
        the hit, its page transfer, every rank's acks. Returns (tokens loaded, host indices,
        hashes of the loaded pages); the caller frees the indices."""
        operation = self.controller.prefetch(rid, tokens, None, prefix_keys=[])
        hit = self.controller.prefetch_hit_queue.get(timeout=60)
        assert hit is operation
        if hit.storage_hit_count == 0:
            return 0, None, []
        indices = self.host.alloc(hit.storage_hit_count)
        assert indices is not None, "host pool full"
        hit.host_indices = indices
        self.controller.prefetch_buffer.put(hit)
        loaded = 0
        while True:
            ack = self.controller.ack_prefetch_queue.get(timeout=60)
            assert ack.rid == rid
            if ack.completed_req:
                break
            loaded = max(loaded, ack.completed_tokens or 0)
        return loaded, indices, hit.hash_value[: loaded // PAGE]

    def close(self) -> None:
        self.controller.detach_storage_backend()

    # -- a hybrid model's nodes, as UnifiedRadixCache writes and prefetches them ---------------

    def write_node(
        self, tokens: list[int], start: int, end: int, pools: tuple[str, ...] = ("mamba", "swa")
    ) -> dict[str, Any]:
        """Write pages [start, end) of `tokens` as one node: its KV pages, its Mamba state
        (keyed by its last page) and its SWA window (its last `SWA_WINDOW` pages), of the
        engine's pools that are in `pools`, each filled with bytes that are a function of the
        key. Returns the backup's per-pool result."""
        hashes = self.hashes(tokens[: end * PAGE])[start:end]
        indices = self.host.alloc((end - start) * PAGE)
        assert indices is not None, "host pool full"
        fill_pages(self)(indices, hashes)
        extra, frees = [], []
        if self.mamba is not None and "mamba" in pools:
            slot = self.mamba.alloc(1)
            fill_state(self.mamba, int(slot[0]), hashes[-1])
            extra.append(PoolTransfer(PoolName.MAMBA, host_indices=slot, keys=[hashes[-1]],
                                      hit_policy=PoolHitPolicy.TRAILING_PAGES))  # fmt: skip
            frees.append((self.mamba, slot))
        if self.swa is not None and "swa" in pools:
            window = hashes[-SWA_WINDOW:]
            slots = self.swa.host.alloc(len(window) * PAGE)
            fill_pages(self.swa)(slots, window)
            extra.append(PoolTransfer(PoolName.SWA, host_indices=slots, keys=window,
                                      hit_policy=PoolHitPolicy.TRAILING_PAGES))  # fmt: skip
            frees.append((self.swa.host, slots))
        op_id = self.controller.write_storage(indices, tokens[start * PAGE : end * PAGE],
                                              hash_value=hashes, prefix_keys=[],
                                              extra_pools=extra or None)  # fmt: skip
        while True:
            done = self.controller.ack_backup_queue.get(timeout=60)
            if done.id == op_id:
                break
        self.host.free(indices)
        for pool, slots in frees:
            pool.free(slots)
        return {"kv_tokens": done.completed_tokens,
                **{str(k): v for k, v in done.pool_storage_result.extra_pool_hit_pages.items()}}  # fmt: skip

    def read_hybrid(self, tokens: list[int], rid: str = "r") -> dict[str, Any]:
        """Prefetch `tokens` with the extra pools, as UnifiedRadixCache does: placeholder keys
        for the trailing pools, host memory for the (rank-reduced) hit and each pool's window,
        the controller's page transfer (KV, then the extra pools), every ack. Returns the hit,
        the tokens loaded, each pool's pages loaded, and which pages arrived with the right
        bytes (KV pages, Mamba state, SWA window); frees the host memory."""
        extra = []
        if self.mamba is not None:
            extra.append(PoolTransfer(PoolName.MAMBA, keys=["__placeholder__"],
                                      hit_policy=PoolHitPolicy.TRAILING_PAGES))  # fmt: skip
        if self.swa is not None:
            extra.append(PoolTransfer(PoolName.SWA, keys=["__placeholder__"] * SWA_WINDOW,
                                      hit_policy=PoolHitPolicy.TRAILING_PAGES))  # fmt: skip
        operation = self.controller.prefetch(CacheRequestHandle(rid, 0), tokens, None,
                                             prefix_keys=[], extra_pools=extra or None)  # fmt: skip
        hit = self.controller.prefetch_hit_queue.get(timeout=60)
        assert hit is operation
        found: dict[str, Any] = {"hit_pages": hit.storage_hit_count // PAGE, "loaded_pages": 0,
                                 "pool_hits": {}, "good": {}}  # fmt: skip
        if hit.storage_hit_count == 0:
            return found
        pages = hit.storage_hit_count // PAGE
        indices = self.host.alloc(hit.storage_hit_count)
        assert indices is not None, "host pool full"
        owners = {PoolName.MAMBA: self.mamba, PoolName.SWA: self.swa and self.swa.host}
        for transfer in extra:
            want = 1 if transfer.name == PoolName.MAMBA else min(SWA_WINDOW, pages) * PAGE
            transfer.host_indices = owners[transfer.name].alloc(want)
        hit.host_indices = indices
        self.controller.prefetch_buffer.put(hit)
        loaded, pool_hits = 0, {}
        while True:
            ack = self.controller.ack_prefetch_queue.get(timeout=60)
            assert ack.rid == rid
            if ack.pool_hits:
                pool_hits.update({str(k): v for k, v in ack.pool_hits.items() if v})
            if ack.completed_req:
                break
            loaded = max(loaded, ack.completed_tokens or 0)
        hashes = hit.hash_value[: loaded // PAGE]
        good = {"kv": check_pages(self, indices, hashes)}
        for transfer in extra:  # (keys: the trailing pages of the hit, as the controller set)
            if transfer.name == PoolName.MAMBA:
                good["mamba"] = check_state(self.mamba, int(transfer.host_indices[0]),
                                            transfer.keys[0])  # fmt: skip
            else:
                n = pool_hits.get("swa", 0)
                good["swa"] = check_pages(self.swa, transfer.host_indices, transfer.keys[:n])
            owners[transfer.name].free(transfer.host_indices)
        self.host.free(indices)
        found.update(loaded_pages=loaded // PAGE, pool_hits=pool_hits, good=good,
                     keys={str(t.name): list(t.keys) for t in extra})  # fmt: skip
        return found


def page_bytes_for(key: str, nbytes: int) -> torch.Tensor:
    """The bytes every test writes for page `key`: a function of the key alone, so a reader
    checks what it got without knowing who wrote it."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") % (2**63)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def token_kv(engine: Any, layer: int, slot: int) -> list[Any]:
    """The host pool's memory of one token slot of one layer ([K, V] of [heads, dim] for MHA,
    [latent] of [1, dim] for MLA), found from the host pool's buffer shapes as SGLang allocates
    them (`init_kv_buffer`), independently of the backend's own page views."""
    buffer, layout = engine.host.kv_buffer, engine.layout
    page, offset = divmod(slot, PAGE)
    if engine.kind == "mha":  # [2, ...]
        if layout == "layer_first":  # [2, L, size, H, D]
            return [buffer[0, layer, slot], buffer[1, layer, slot]]
        if layout == "page_first":  # [2, size, L, H, D]
            return [buffer[0, slot, layer], buffer[1, slot, layer]]
        return [
            buffer[0, page, layer, offset],
            buffer[1, page, layer, offset],
        ]  # [2, n, L, P, H, D]
    if layout == "layer_first":  # [L, size, 1, D]
        return [buffer[layer, slot]]
    if layout == "page_first":  # [size, L, 1, D]
        return [buffer[slot, layer]]
    return [buffer[page, layer, offset]]  # [n, L, P, 1, D]


def expected(engine: Any, key: str) -> Any:
    """What every test writes for page `key`: [parts, layers, tokens, ...] of bytes that are a
    function of the key alone, so a reader checks what it got without knowing who wrote it
    (`engine`: an Engine's KV pool, or its SwaPool, whose bytes differ)."""
    parts = 2 if engine.kind == "mha" else 1
    one = token_kv(engine, 0, 0)[0]
    shape = (parts, engine.layers, PAGE, *one.shape)
    nbytes = one.element_size() * parts * engine.layers * PAGE * one.numel()
    return page_bytes_for(engine.salt + key, nbytes).view(one.dtype).view(shape)


def fill_pages(engine: Any) -> Any:
    def fill(indices: torch.Tensor, hashes: list[str]) -> None:
        for i, key in enumerate(hashes):
            want, start = expected(engine, key), int(indices[i * PAGE])
            for layer in range(engine.layers):
                for t in range(PAGE):
                    for part, view in enumerate(token_kv(engine, layer, start + t)):
                        view.copy_(want[part, layer, t])

    return fill


def check_pages(engine: Any, indices: Any, hashes: list[str]) -> int:
    """Pages whose bytes are exactly what `fill_pages` wrote for their key."""
    good = 0
    for i, key in enumerate(hashes):
        want, start = expected(engine, key), int(indices[i * PAGE])
        good += all(  # (as bytes: random bytes include NaNs, never equal as floats)
            torch.equal(_bytes(view), _bytes(want[part, layer, t]))
            for layer in range(engine.layers)
            for t in range(PAGE)
            for part, view in enumerate(token_kv(engine, layer, start + t))
        )
    return good


def fill_state(mamba: Any, slot: int, key: str) -> None:
    """Mamba state slot `slot` := the bytes every test writes for the state keyed `key`
    (through SGLang's own `set_from_flat_data_page`, independently of the backend's views)."""
    mamba.set_from_flat_data_page(slot, page_bytes_for("mamba|" + key, mamba.size_per_token))


def check_state(mamba: Any, slot: int, key: str) -> bool:
    """Whether slot `slot` holds exactly the state `fill_state` wrote for `key`."""
    got = mamba.get_data_page(slot, flat=True)
    return torch.equal(got, page_bytes_for("mamba|" + key, mamba.size_per_token))


def stored_rows(backend: Any, pool: str, keys: list[str]) -> tuple[Any, list[int]]:
    """The manager's page view of pool `pool` and the rows `keys` are stored in (a test's
    way to damage or swap stored values)."""
    found = backend.pools[pool]
    manager = found.manager
    manager.transfer_to_current_thread()  # (the controller's threads drove it so far)
    rows = []
    for key in keys:
        cache = manager.create_kv_cache(found.scope, [found.token(key)])
        assert cache.resume()
        rows.append(int(cache.get_page_indices(0, "page")[0]))
        cache.close()
    return manager.page_view(0, "page"), rows


def _bytes(tensor: Any) -> Any:
    return tensor.contiguous().view(torch.uint8)


def prompt(seed: int, pages: int) -> list[int]:
    return [(seed * 7919 + t * 31) % 50000 for t in range(pages * PAGE)]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "action", choices=["write", "read", "write-forever", "write-hybrid", "read-hybrid"]
    )
    parser.add_argument("--pools", default="", help="a hybrid engine's extra pools: mamba,swa")
    parser.add_argument("--swa-layers", type=int, default=SWA_LAYERS)
    parser.add_argument("--kind", default="mha")
    parser.add_argument("--layout", default="page_first")
    parser.add_argument("--extra", default="{}")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--pages", type=int, default=6)
    args = parser.parse_args(argv)
    pools = tuple(p for p in args.pools.split(",") if p)
    engine = Engine(args.kind, args.layout, json.loads(args.extra), pools=pools,
                    hybrid="hybrid" in args.action, swa_layers=args.swa_layers)  # fmt: skip
    report: dict[str, Any] = {}
    if args.action == "write":
        for p in range(args.prompts):
            engine.write(prompt(p, args.pages), fill_pages(engine))
    elif args.action == "write-forever":  # (until killed: a fresh prompt at a time)
        p = 0
        while True:
            engine.write(prompt(1000 + p, args.pages), fill_pages(engine))
            p += 1
            print(f"wrote {p}", flush=True)
    elif args.action == "write-hybrid":  # (each prompt as two nodes: a state at each end)
        for p in range(args.prompts):
            tokens = prompt(p, args.pages)
            report[f"p{p}a"] = engine.write_node(tokens, 0, args.pages // 2)
            report[f"p{p}b"] = engine.write_node(tokens, args.pages // 2, args.pages)
    elif args.action == "read-hybrid":
        report["reads"] = [
            engine.read_hybrid(prompt(p, args.pages), rid=f"r{p}") for p in range(args.prompts)
        ]
    else:
        loaded_pages = good = 0
        for p in range(args.prompts):
            loaded, indices, hashes = engine.read(prompt(p, args.pages), rid=f"r{p}")
            loaded_pages += loaded // PAGE
            if indices is not None:
                good += check_pages(engine, indices, hashes)
                engine.host.free(indices)
        report = {"loaded_pages": loaded_pages, "good_pages": good}
    report["stats"] = engine.backend.statistics()
    engine.close()
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
