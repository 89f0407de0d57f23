"""On a real GPU (skipped without one; `scripts/gpu_check.sh` runs them on a lent device): every
move of pages verified byte for byte with CUDA memory on the GPU level, a race the event order
must win (the engine's kernels still writing pages when a suspend copies them out), and the
reference engine and the transformers cache on the device against transformers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs torch with a CUDA device", allow_module_level=True)

from kvpool import (  # noqa: E402
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
)
from tests.engine_check import CheckingEngine  # noqa: E402
from tests.fuzz.fuzzer import fuzz  # noqa: E402
from tests.helpers import MiB, make_config, record_layer, shutdown  # noqa: E402

pytestmark = pytest.mark.cuda
TPB = 16
LAYERS = [record_layer(i, TPB, repeats=64) for i in range(2)]  # 64 KiB pages


def test_the_gpu_level_is_cuda_memory_and_host_levels_are_pinned():
    m = KVCacheManager(
        make_config(LAYERS, [GpuCacheTierConfig(2 * MiB), HostCacheTierConfig(4 * MiB)], TPB)
    )
    assert m.on_device and m.page_view(0, "k").is_cuda
    host = [mem for group in m._storage.state.levels[1].pool_groups for mem in group.memories]
    assert all(mem.pinned == mem.size for mem in host), "the driver refused to pin host memory"
    shutdown(m)


@pytest.mark.parametrize("layout", ["gpu-host", "gpu-host-disk", "hybrid", "tight"])
def test_every_move_keeps_the_bytes_on_cuda(layout):
    stats = fuzz(layout, 1, 1500)
    assert stats["pages moved between levels"] > 0 and stats["records checked"] > 100_000


def test_a_suspend_copies_out_what_the_engines_kernels_are_still_writing(tmp_path):
    """The engine queues a long kernel, then the writes of a request's KV, on its stream, and
    suspends the request at once; other requests push its pages to the host and the disk. The
    copies out wait for the engine's work (an event recorded at the call): every byte arrives.
    Without that wait they would copy the pages before the writes land."""
    tiers = [
        GpuCacheTierConfig(2 * MiB),
        HostCacheTierConfig(2 * MiB),
        DiskCacheTierConfig(8 * MiB, str(tmp_path)),
    ]
    m = KVCacheManager(make_config(LAYERS, tiers, TPB))
    engine = CheckingEngine(m)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # the engine's own stream, current for its calls
        held = []
        for n in range(3):
            tokens = [n * 10_000 + i for i in range(8 * TPB)]
            cache = m.create_kv_cache()
            assert cache.resume() and cache.resize(len(tokens))
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the writes
            engine.write(cache, tokens, 0)  # queued behind it
            cache.commit(tokens)
            cache.suspend()  # right away: the writes have not run yet
            held.append((cache, tokens))
        for n in range(3, 9):  # push the held pages out of the GPU (and some to the disk)
            tokens = [n * 10_000 + i for i in range(8 * TPB)]
            cache = m.create_kv_cache()
            assert cache.resume() and engine.step(cache, tokens, tokens)
            cache.close()
        assert m.num_moved_pages[1] > 0
        for cache, tokens in held:
            engine.check_anywhere(cache, tokens)  # (waits for each page's copy, not the device)
            assert cache.resume()
            engine.check(cache, tokens)
            cache.close()
    shutdown(m)


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


def test_the_transformers_cache_on_cuda_matches_dynamic_cache():
    transformers = pytest.importorskip("transformers")
    from kvpool.integrations import transformers as kvt
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
