"""The reference engine and the transformers cache over a GPU level of CUDA memory, on the CPU:
under `tests/fake_cuda.py` the pages are torch tensors (CPU ones), so the torch paths a GPU
takes (page views as tensors, index tensors moved to the pages' device, copies on the copy
stream) run here, against transformers token for token. `tests/test_cuda.py` runs the same on a
real GPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvpool import HostCacheTierConfig, KVCacheManager  # noqa: E402
from kvpool.engine import Generator, PagedDecoder, manager_config_from_hf  # noqa: E402
from kvpool.storage import device  # noqa: E402
from tests import fake_cuda  # noqa: E402
from tests.test_engine import check_against_hf  # noqa: E402
from tests.test_engine_families import COMMON, model_of  # noqa: E402

MiB = 1 << 20


@pytest.fixture
def cuda(monkeypatch):
    monkeypatch.setattr(device, "_pin_refused", [])
    return fake_cuda.install(monkeypatch)


def test_the_reference_engine_over_cuda_pages_matches_transformers(cuda):
    config = transformers.LlamaConfig(**COMMON, head_dim=256)  # 64 KiB slots: 32 on the GPU
    model = model_of(config, seed=4)
    manager = KVCacheManager(
        manager_config_from_hf(config, 8, 2 * MiB, [HostCacheTierConfig(8 * MiB)])
    )
    assert manager.on_device and isinstance(manager.page_view(0, "k"), torch.Tensor)
    decoder = PagedDecoder(config, model.state_dict(), manager)
    prompts = [list(range(1, 60)), list(range(1, 50)) + [7], [3] * 70, list(range(20, 90))]
    generator = Generator(decoder, max_batch=2)
    results = generator.generate(prompts, 12)
    check_against_hf(model, results, 12)
    assert results[1].cached_tokens > 0  # reused the first prompt's blocks
    assert manager.num_moved_pages[1] > 0  # suspended pages went to the host and back
    assert cuda.ops("launch") and not cuda.ops("device synchronize", "stream synchronize")
    manager.clear_reusable_blocks()
    manager.shutdown()


def test_the_transformers_cache_over_cuda_pages_matches_dynamic_cache(cuda):
    try:  # (refused by name with a transformers older than it supports: a lent device's)
        from kvpool.integrations import transformers as kvt
    except ImportError as error:
        pytest.skip(str(error))

    config = transformers.LlamaConfig(**COMMON, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    model = model.eval()
    manager = KVCacheManager(kvt.manager_config(model, 4 * MiB, tokens_per_block=4))
    cache = kvt.KVPoolCache(model, manager)
    ids = torch.tensor([[5, 9, 13, 2, 7, 11] * 5])
    expected = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False)
    got = kvt.generate(model, cache, ids, None, max_new_tokens=10, do_sample=False)
    assert torch.equal(got, expected)
    manager.clear_reusable_blocks()
    manager.shutdown()
