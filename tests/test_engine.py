"""The reference engine against Hugging Face transformers: identical greedy tokens and logits
within 1e-4, with every KV byte read and written through kvpool."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvpool import HostCacheTierConfig, KVCacheManager  # noqa: E402
from kvpool.engine import Generator, PagedDecoder, manager_config_from_hf  # noqa: E402
from tests.helpers import smollm2  # noqa: E402

MiB = 1 << 20
torch.set_num_threads(1)  # tiny matrices: thread hand-offs cost more than the work


def tiny(kind):
    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "mistral":
        return transformers.MistralConfig(**common, sliding_window=24)
    return transformers.Qwen2Config(**common)


def hf_model(config, seed=0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager"
    ).eval()
    return model


def hf_greedy(model, prompt, new_tokens):
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),  # (token 0 is no padding)
        max_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [logits[0] for logits in out.logits]


def make_engine(config, model, gpu=4 * MiB, more_tiers=None, **options):
    manager = KVCacheManager(manager_config_from_hf(config, 8, gpu, more_tiers, **options))
    return PagedDecoder(config, model.state_dict(), manager), manager


def check_against_hf(model, results, new_tokens):
    for result in results:
        tokens, logits = hf_greedy(model, result.prompt, new_tokens)
        assert result.tokens == tokens
        for ours, theirs in zip(result.logits, logits, strict=True):
            assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_single_prompt_and_batch_match_transformers(kind):
    config = tiny(kind)
    model = hf_model(config)
    decoder, manager = make_engine(config, model)
    generator = Generator(decoder, max_batch=4)
    prompts = [[5, 9, 13, 2, 7], list(range(1, 38)), [3] * 12, list(range(40, 60))]
    results = generator.generate(prompts, 20)
    check_against_hf(model, results, 20)
    manager.clear_reusable_blocks()
    manager.shutdown()


def test_shared_prefix_is_served_from_cache():
    config = tiny("mistral")
    model = hf_model(config, seed=1)
    decoder, manager = make_engine(config, model)
    generator = Generator(decoder)
    prefix = list(range(10, 50))
    first = generator.generate([prefix + [1, 2]], 8)
    second = generator.generate([prefix + [3, 4, 5]], 8)
    assert first[0].cached_tokens == 0 and second[0].cached_tokens > 0
    check_against_hf(model, first + second, 8)
    manager.clear_reusable_blocks()
    manager.shutdown()


def test_tiny_gpu_suspends_and_pages_travel_to_host_and_disk(tmp_path):
    config = tiny("llama")
    model = hf_model(config, seed=2)
    # A slot holds 8 tokens of both layers' K and V (2 KV heads x 16 dims x 4 bytes): 4 KiB, so
    # the 2 MiB GPU level has 512 slots. Four running prompts of 128 blocks fill it exactly; the
    # first decode step that needs a new block suspends requests, whose pages move to the host;
    # eight prompts in all push cached pages on to the disk.
    from kvpool import DiskCacheTierConfig

    decoder, manager = make_engine(
        config,
        model,
        gpu=2 * MiB,
        more_tiers=[HostCacheTierConfig(2 * MiB), DiskCacheTierConfig(4 * MiB, str(tmp_path))],
    )
    assert manager.get_storage_statistics(0)[0].total == 512
    prompts = [[(i * 7 + j) % 90 + 1 for j in range(128 * 8 - 1)] for i in range(8)]
    generator = Generator(decoder, max_batch=4)
    results = generator.generate(prompts, 12)
    assert generator.suspensions > 0
    moved = manager.num_moved_pages
    assert moved[1] > 0 and moved[2] > 0  # to the host and on to the disk
    assert moved[0] > 0  # and back to the GPU
    check_against_hf(model, results, 12)
    manager.clear_reusable_blocks()
    manager.shutdown()


def test_forced_adjust_in_the_middle():
    config = tiny("mistral")
    model = hf_model(config, seed=3)
    decoder, manager = make_engine(config, model, gpu=8 * MiB)

    def between(step):
        if step == 5:
            manager.adjust_cache_level(0, [1.0], quota=4 * MiB)

    generator = Generator(decoder, max_batch=3, between_steps=between)
    prompts = [list(range(1, 30)), list(range(30, 45)), list(range(50, 90))]
    results = generator.generate(prompts, 12)
    assert manager.get_quota(0) == 4 * MiB
    check_against_hf(model, results, 12)
    manager.clear_reusable_blocks()
    manager.shutdown()


@pytest.mark.parametrize(
    ("prompts", "new_tokens", "message"),
    [
        ([[1, 2], []], 4, r"prompts\[1\] is empty"),
        ([[1, 96]], 4, r"prompts\[0\] holds token id 96, outside the vocabulary \[0, 96\)"),
        ([[1, -1]], 4, r"token id -1"),
        ([[1, 2]], 0, r"max_new_tokens=0 is invalid: must be >= 1"),
    ],
)
def test_generator_refuses_bad_prompts_before_opening_a_request(prompts, new_tokens, message):
    from kvpool import ArgumentError

    config = tiny("llama")
    decoder, manager = make_engine(config, hf_model(config))
    with pytest.raises(ArgumentError, match=message):
        Generator(decoder).generate(prompts, new_tokens)
    assert manager.get_storage_statistics(0)[0].free == manager.get_storage_statistics(0)[0].total
    manager.shutdown()


@pytest.mark.parametrize("error", [RuntimeError("model failed"), KeyboardInterrupt()])
def test_generator_closes_its_requests_when_a_step_raises(error):
    """An error mid-generation (here from the step hook, after requests were admitted) leaves
    no request open: the manager can be cleared and reused, and the committed prefix is reusable."""
    config = tiny("mistral")
    model = hf_model(config, seed=4)
    decoder, manager = make_engine(config, model)

    def between(step):
        if step == 4:
            raise error

    prompts = [list(range(1, 40)), list(range(1, 30)) + [77]]
    with pytest.raises(type(error)):
        Generator(decoder, between_steps=between).generate(prompts, 8)
    stats = manager.get_storage_statistics(0)[0]
    assert stats.evictable == stats.total - stats.free > 0  # only reusable blocks remain
    again = Generator(decoder).generate(prompts, 8)
    assert again[0].cached_tokens > 0
    check_against_hf(model, again, 8)
    manager.clear_reusable_blocks()
    manager.shutdown()


def test_interleaved_windows_match_transformers():
    """Gemma-style interleaving: one layer with a sliding window, one with full attention."""
    config = transformers.Qwen2Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=1,
    )
    model = hf_model(config, seed=4)
    decoder, manager = make_engine(config, model)
    assert decoder.spec.windows == (None, 16)
    results = Generator(decoder).generate([list(range(1, 41)), list(range(41, 60))], 16)
    check_against_hf(model, results, 16)
    manager.clear_reusable_blocks()
    manager.shutdown()


@pytest.mark.slow
def test_smollm2_real_weights_match_transformers():
    tokenizer, model = smollm2()
    manager = KVCacheManager(manager_config_from_hf(model.config, 16, 64 * MiB))
    decoder = PagedDecoder(model.config, model.state_dict(), manager)
    prompt = tokenizer("The capital of France is", return_tensors="pt").input_ids[0].tolist()
    (result,) = Generator(decoder).generate([prompt], 12)
    tokens, logits = hf_greedy(model, prompt, 12)
    assert result.tokens == tokens
    assert "Paris" in tokenizer.decode(result.tokens)
    for ours, theirs in zip(result.logits, logits, strict=True):
        assert torch.allclose(ours, theirs, atol=1e-3), (ours - theirs).abs().max()
    manager.clear_reusable_blocks()
    manager.shutdown()
