"""SGLang's own storage machinery on CPU tensors, for the backend's tests: its device KV pool
and paged allocator, its host pool (MHA or MLA, any of the three layouts), and its HiCache
controller with kvpool's backend attached through SGLang's `dynamic` loader. Pages are written
and read the way SGLang's scheduler drives the controller: `write_storage` (the backup thread
calls `batch_set_v1`) and `prefetch` (the prefetch thread's `batch_exists`, then, once the test
plays the scheduler and hands it host memory, the I/O thread's `batch_get_v1`).

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
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

PAGE = 16  # tokens per page
LAYERS = 3
HEADS, HEAD_DIM = 4, 32  # MHA: per rank
KV_LORA, ROPE = 64, 16  # MLA
DEVICE_TOKENS = 1024
BACKEND = {
    "backend_name": "kvpool",
    "module_path": "kvpool.integrations.sglang",
    "class_name": "KVPoolHiCacheStorage",
    "interface_v1": 1,
}


def device_pool(kind: str) -> Any:
    if kind == "mha":
        return MHATokenToKVPool(
            DEVICE_TOKENS, PAGE, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu", False,
            start_layer=0, end_layer=LAYERS,
        )  # fmt: skip
    return MLATokenToKVPool(
        DEVICE_TOKENS, PAGE, torch.bfloat16, KV_LORA, ROPE, LAYERS, "cpu", False,
        start_layer=0, end_layer=LAYERS,
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
    """A device pool, a host pool and SGLang's controller with kvpool attached."""

    def __init__(
        self,
        kind: str,
        layout: str,
        extra: dict[str, Any],
        write_policy: str = "write_through",
        model_name: str = "kvpool-test-model",
    ):
        self.kind, self.layout = kind, layout
        single_rank()
        self.device = device_pool(kind)
        self.allocator = PagedTokenToKVPoolAllocator(
            DEVICE_TOKENS, PAGE, torch.bfloat16, "cpu", self.device, need_sort=False
        )
        self.host = host_pool(kind, layout, self.device)
        self.controller = HiCacheController(
            self.allocator,
            self.host,
            PAGE,
            tp_group=None,
            load_cache_event=threading.Event(),
            write_policy=write_policy,
            io_backend="direct",
            storage_backend="dynamic",
            model_name=model_name,
            storage_backend_extra_config={**BACKEND, **extra},
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


def page_bytes_for(key: str, nbytes: int) -> torch.Tensor:
    """The bytes every test writes for page `key`: a function of the key alone, so a reader
    checks what it got without knowing who wrote it."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") % (2**63)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def token_kv(engine: Engine, layer: int, slot: int) -> list[Any]:
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


def expected(engine: Engine, key: str) -> Any:
    """What every test writes for page `key`: [parts, layers, tokens, ...] of bytes that are a
    function of the key alone, so a reader checks what it got without knowing who wrote it."""
    parts = 2 if engine.kind == "mha" else 1
    one = token_kv(engine, 0, 0)[0]
    shape = (parts, LAYERS, PAGE, *one.shape)
    nbytes = one.element_size() * parts * LAYERS * PAGE * one.numel()
    return page_bytes_for(key, nbytes).view(one.dtype).view(shape)


def fill_pages(engine: Engine) -> Any:
    def fill(indices: torch.Tensor, hashes: list[str]) -> None:
        for i, key in enumerate(hashes):
            want, start = expected(engine, key), int(indices[i * PAGE])
            for layer in range(LAYERS):
                for t in range(PAGE):
                    for part, view in enumerate(token_kv(engine, layer, start + t)):
                        view.copy_(want[part, layer, t])

    return fill


def check_pages(engine: Engine, indices: Any, hashes: list[str]) -> int:
    """Pages whose bytes are exactly what `fill_pages` wrote for their key."""
    good = 0
    for i, key in enumerate(hashes):
        want, start = expected(engine, key), int(indices[i * PAGE])
        good += all(  # (as bytes: random bytes include NaNs, never equal as floats)
            torch.equal(_bytes(view), _bytes(want[part, layer, t]))
            for layer in range(LAYERS)
            for t in range(PAGE)
            for part, view in enumerate(token_kv(engine, layer, start + t))
        )
    return good


def _bytes(tensor: Any) -> Any:
    return tensor.contiguous().view(torch.uint8)


def prompt(seed: int, pages: int) -> list[int]:
    return [(seed * 7919 + t * 31) % 50000 for t in range(pages * PAGE)]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("action", choices=["write", "read", "write-forever"])
    parser.add_argument("--kind", default="mha")
    parser.add_argument("--layout", default="page_first")
    parser.add_argument("--extra", default="{}")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--pages", type=int, default=6)
    args = parser.parse_args(argv)
    engine = Engine(args.kind, args.layout, json.loads(args.extra))
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
