"""On a real GPU (skipped without one; `scripts/gpu_check.sh` runs them on a lent device): every
move of pages verified byte for byte with CUDA memory on the GPU level (also through staging
buffers smaller than a slot), a refused registration that must not fail the next kernel, a race
the event order must win with a window the test proves open and negative controls that must
lose it, and the reference engine and the transformers cache on the device against
transformers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs torch with a CUDA device", allow_module_level=True)

from kvpool import (  # noqa: E402
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
)
from kvpool.storage import copier, cuda_copies, device  # noqa: E402
from kvpool.storage.memory import HostMemory  # noqa: E402
from tests.engine_check import CheckingEngine  # noqa: E402
from tests.fuzz.fuzzer import fuzz  # noqa: E402
from tests.helpers import MiB, make_config, record_layer, shutdown  # noqa: E402

pytestmark = pytest.mark.cuda
TPB = 16
LAYERS = [record_layer(i, TPB, repeats=64) for i in range(2)]  # 64 KiB pages: 32 per 2 MiB


def test_the_gpu_level_is_cuda_memory_and_host_levels_are_pinned():
    m = KVCacheManager(
        make_config(LAYERS, [GpuCacheTierConfig(2 * MiB), HostCacheTierConfig(4 * MiB)], TPB)
    )
    assert m.on_device and m.page_view(0, "k").is_cuda
    host = [mem for group in m._storage.state.levels[1].pool_groups for mem in group.memories]
    refused = [mem for mem in host if mem.pinned < mem.size]
    shutdown(m)
    if refused:  # (a sandboxed runtime may refuse: then the pageable fallback is what runs)
        pytest.skip(f"the driver refused to pin host memory: {device._pin_refused[:1]}")


def test_a_refused_registration_leaves_no_error_for_the_next_kernel():
    """A `cudaHostRegister` the driver refuses (here: the range is registered already, or a
    sandbox refuses all) leaves the thread's last error set; kvpool clears it, so the next
    checked kernel launch in this thread does not report it as its own (issue 44, 2)."""
    memory = HostMemory(4 * MiB)
    address = memory.array.ctypes.data
    first = device.pin(address, 4 * MiB)
    assert not device.pin(address, 4 * MiB)  # (twice: cudaErrorHostMemoryAlreadyRegistered)
    values = torch.ones(1024, device="cuda")
    values.add_(1)  # a checked launch
    torch.cuda.synchronize()
    assert values.sum().item() == 2048 and device.clear_error() == 0
    if first:
        assert device.unpin(address)
    memory.close()


@pytest.mark.parametrize(
    ("layout", "staging"),
    [
        ("gpu-host", None),
        ("gpu-host-disk", None),
        ("gpu-host-disk", 48 * 1024),  # (staging buffers smaller than a 64 KiB slot)
        ("hybrid", 24 * 1024),
        ("tight", None),
    ],
)
def test_every_move_keeps_the_bytes_on_cuda(monkeypatch, layout, staging):
    if staging is not None:
        monkeypatch.setattr(cuda_copies, "STAGING_BYTES", staging)
    stats = fuzz(layout, 1, 1500)
    assert stats["pages moved between levels"] > 0 and stats["records checked"] > 100_000


ENGINE_SLEEP = 2_000_000_000  # GPU cycles (about a second) the engine is busy before its writes
COPY_SLEEP = 200_000_000  # GPU cycles (about 0.1 s) the copy stream idles before each copy
WAITS = ["copy waits for the engine", "engine waits for the copy", "host waits for the copy"]


@pytest.mark.parametrize("removed", [None, *WAITS])
def test_a_copy_out_races_the_engines_writes(monkeypatch, removed):
    """The engine queues a second of work, then request A's KV writes, on its stream; A is
    suspended and request B takes the whole GPU level at once, so A's (scattered) pages are
    copied out to the host while the engine's stream is still busy (asserted: the window is
    open, and kvpool's calls did not wait for it). B's writes then go into the slots A left.
    Every byte of A must arrive on the host. Each wait of the protocol, patched out, must lose
    the race (a negative control): the copy reads before A's writes land, B's writes overwrite
    A's pages before the copy reads them, or the host reads before the copy is done. The copy
    stream idles a little before each copy (a slow link), in every variant alike."""
    tiers = [GpuCacheTierConfig(2 * MiB), HostCacheTierConfig(4 * MiB)]
    m = KVCacheManager(make_config(LAYERS, tiers, TPB))
    engine = CheckingEngine(m)
    stream = torch.cuda.Stream()
    m.set_engine_stream(stream)
    copy_stream = m._storage.state.copier.order.copy_stream
    real_wait = torch.cuda.Stream.wait_event

    def wait_event(self, event):
        if self == copy_stream:
            if removed != WAITS[0]:
                real_wait(self, event)
            with torch.cuda.stream(self):
                torch.cuda._sleep(COPY_SLEEP)
        elif not (self == stream and removed == WAITS[1]):
            real_wait(self, event)

    monkeypatch.setattr(torch.cuda.Stream, "wait_event", wait_event)
    if removed == WAITS[2]:
        monkeypatch.setattr(copier.CopyEvent, "wait", lambda self, timeout=None: True)
    a_tokens = [10_000 + i for i in range(16 * TPB)]  # half the GPU level's 32 slots
    b_tokens = [20_000 + i for i in range(32 * TPB)]  # all of them
    failures = []
    with torch.cuda.stream(stream):
        a, c = m.create_kv_cache(), m.create_kv_cache()
        assert a.resume() and c.resume()
        for blocks in range(1, 17):  # A's and C's blocks alternate: A's pages are scattered
            assert a.resize(blocks * TPB) and c.resize(blocks * TPB)
        c.close()
        for group in m._storage.state.levels[0].pool_groups:  # (no earlier run's bytes there)
            for memory in group.memories:
                memory.tensor.fill_(0xA5)
        torch.cuda.synchronize()
        torch.cuda._sleep(ENGINE_SLEEP)  # the engine is busy ...
        engine.write(a, a_tokens, 0)  # ... and A's writes are queued behind it
        assert not stream.query(), "no window: the engine's writes ran before the race"
        a.commit(a_tokens)
        a.suspend()
        b = m.create_kv_cache()
        assert b.resume() and b.resize(len(b_tokens))  # A's pages are copied out now
        assert not stream.query(), "kvpool's calls waited for the engine's work"
        assert m.num_moved_pages[1] >= 16 and all(p.level == 1 for p in a.pages(0))
        engine.write(b, b_tokens, 0)  # into the slots A's pages left
        try:
            engine.check_anywhere(a, a_tokens)  # (waits for each page's copy)
        except AssertionError as error:
            failures.append(str(error))
        torch.cuda.synchronize()
        b.close()
        a.close()
    monkeypatch.undo()
    shutdown(m)
    if removed is None:
        assert not failures
    else:
        assert failures, f"with the wait '{removed}' patched out, the race was not lost"


def test_the_reference_engine_on_cuda_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from kvpool.engine import Generator, PagedDecoder, manager_config_from_hf
    from tests.test_engine import hf_greedy
    from tests.test_engine_families import COMMON, model_of

    torch.backends.cuda.matmul.allow_tf32 = False
    config = transformers.LlamaConfig(**COMMON, head_dim=256)
    model = model_of(config, seed=4)
    manager = KVCacheManager(
        manager_config_from_hf(config, 8, 2 * MiB, [HostCacheTierConfig(8 * MiB)])
    )
    decoder = PagedDecoder(config, model.state_dict(), manager)
    assert decoder.device.type == "cuda"
    prompts = [list(range(1, 60)), list(range(1, 50)) + [7], [3] * 70, list(range(20, 90))]
    results = Generator(decoder, max_batch=2).generate(prompts, 12)
    for result in results:
        tokens, logits = hf_greedy(model, result.prompt, 12)
        assert result.tokens == tokens
        for ours, theirs in zip(result.logits, logits, strict=True):
            assert (ours - theirs).abs().max() < 1e-3
    assert results[1].cached_tokens > 0 and manager.num_moved_pages[1] > 0
    manager.clear_reusable_blocks()
    manager.shutdown()


def transformers_integration():
    """kvpool's transformers integration, or a skip naming why it cannot load here (an older
    transformers than it supports, as a lent device may have)."""
    pytest.importorskip("transformers")
    try:
        from kvpool.integrations import transformers as kvt
    except ImportError as error:
        pytest.skip(str(error))
    return kvt


def test_the_transformers_cache_on_cuda_matches_dynamic_cache():
    kvt = transformers_integration()
    import transformers

    from tests.test_engine_families import COMMON

    config = transformers.LlamaConfig(**COMMON, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    model = model.eval().to("cuda")
    manager = KVCacheManager(kvt.manager_config(model, 4 * MiB, tokens_per_block=4))
    cache = kvt.KVPoolCache(model, manager)
    ids = torch.tensor([[5, 9, 13, 2, 7, 11] * 5], device="cuda")
    expected = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False)
    got = kvt.generate(model, cache, ids, None, max_new_tokens=10, do_sample=False)
    assert torch.equal(got, expected)
    manager.clear_reusable_blocks()
    manager.shutdown()
