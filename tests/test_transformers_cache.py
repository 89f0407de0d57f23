"""kvpool as a transformers cache (`kvpool.integrations.transformers`): `model.generate()` with
its KV in kvpool's pages gives transformers' own tokens (DynamicCache) for tiny random Llama,
Mistral (sliding window), Qwen2, Gemma, Gemma 2 and Gemma 3 models, greedy, beam search and
seeded sampling, both attention paths (gathered pages and the paged attention); prefix reuse
across calls computes only the new tokens; pages travel to host and disk between calls and come
back; beams share pages and a shared page is never written in place."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvpool import (  # noqa: E402
    ArgumentError,
    DiskCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    LogicError,
)
from kvpool.integrations import transformers as kvt  # noqa: E402
from tests.helpers import smollm2  # noqa: E402
from tests.test_engine_families import COMMON as FAMILY_SIZES  # noqa: E402

MiB = 1 << 20
torch.set_num_threads(1)
COMMON = {**FAMILY_SIZES, "max_position_embeddings": 256}


def configs():
    gemma3_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    return {
        "llama": transformers.LlamaConfig(**COMMON),
        "mistral": transformers.MistralConfig(**COMMON, sliding_window=8),
        "qwen2": transformers.Qwen2Config(
            **{**COMMON, "num_hidden_layers": 3},
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
        ),
        "gemma": transformers.GemmaConfig(**COMMON, head_dim=16),
        "gemma2": transformers.Gemma2Config(
            **{**COMMON, "num_hidden_layers": 4}, head_dim=16, sliding_window=8
        ),
        "gemma3": transformers.Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 4},
            head_dim=16,
            sliding_window=8,
            layer_types=gemma3_types,
        ),
    }


FAMILIES = sorted(configs())


def model_of(name, attention="sdpa", seed=0):
    if name == "gemma2" and attention == "sdpa":
        attention = "eager"  # (transformers runs soft-capping in eager attention only)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        configs()[name], attn_implementation=attention
    )
    model.generation_config.eos_token_id = None  # always max_new_tokens
    model.generation_config.pad_token_id = 0
    return model.eval()


def manager_for(model, gpu=4 * MiB, more_tiers=None, tokens_per_block=4):
    return KVCacheManager(kvt.manager_config(model, gpu, more_tiers, tokens_per_block))


def batch(*prompts):
    """Left-padded input ids and attention mask."""
    width = max(len(prompt) for prompt in prompts)
    ids = [[0] * (width - len(p)) + list(p) for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return torch.tensor(ids), torch.tensor(mask)


PROMPTS = batch([5, 9, 13, 2, 7], list(range(1, 23)), [3] * 9)


def finish(manager):
    assert manager.num_open_kv_caches == 0
    manager.check_invariants()
    manager.clear_reusable_blocks()
    manager.shutdown()


@pytest.mark.parametrize("attention", ["sdpa", "eager", kvt.ATTENTION])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_and_beam_search_match_transformers_token_for_token(family, attention):
    if family == "gemma2" and attention == "sdpa":
        pytest.skip("transformers runs Gemma 2 (soft-capping) in eager attention only")
    reference = model_of(family, "eager" if attention == kvt.ATTENTION else attention)
    model = model_of(family, attention)
    ids, mask = PROMPTS
    manager = manager_for(model)
    cache = kvt.KVPoolCache(model, manager)
    for options in ({"do_sample": False}, {"do_sample": False, "num_beams": 4}):
        expected = reference.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=12, **options
        )
        got = kvt.generate(model, cache, ids, mask, max_new_tokens=12, **options)
        assert torch.equal(got, expected), (family, attention, options)
    assert manager.stats().forks > 0 and manager.stats().copy_on_write_pages > 0
    finish(manager)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_sampling_with_a_seed_matches_transformers(family):
    model = model_of(family)
    ids, mask = PROMPTS
    manager = manager_for(model)
    cache = kvt.KVPoolCache(model, manager)
    options = dict(do_sample=True, top_k=20, temperature=0.8, num_return_sequences=3)
    torch.manual_seed(7)
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **options)
    torch.manual_seed(7)
    got = kvt.generate(model, cache, ids, mask, max_new_tokens=10, **options)
    assert torch.equal(got, expected)
    assert manager.stats().forks == 6  # two more rows per prompt
    finish(manager)


class Counting:
    """Counts the tokens each forward pass of a model computes."""

    def __init__(self, model):
        self.tokens = 0
        model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        self.tokens += kwargs["input_ids"].numel()


@pytest.mark.parametrize("attention", ["sdpa", kvt.ATTENTION])
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
def test_the_next_turn_computes_only_its_new_tokens_and_gives_the_same_output(family, attention):
    model = model_of(family, attention)
    reference = model_of(family)
    manager = manager_for(model)
    cache = kvt.KVPoolCache(model, manager)
    ids, mask = PROMPTS
    first = kvt.generate(model, cache, ids, mask, max_new_tokens=8, do_sample=False)
    follow = torch.tensor([[11, 12, 13], [14, 15, 16], [17, 18, 19]])
    ids2 = torch.cat([first, follow], dim=1)
    mask2 = torch.cat([mask, torch.ones(3, 11, dtype=torch.long)], dim=1)
    counting = Counting(model)
    second = kvt.generate(model, cache, ids2, mask2, max_new_tokens=6, do_sample=False)
    expected = reference.generate(
        input_ids=ids2, attention_mask=mask2, max_new_tokens=6, do_sample=False
    )
    assert torch.equal(second, expected)
    # Cached: every column before the first turn's last output token (its KV was never
    # computed), the shortest row's padding included; computed: the rest, then 5 decode steps.
    cached = ids.shape[1] + 8 - 1
    assert counting.tokens == 3 * (ids2.shape[1] - cached) + 3 * 5
    finish(manager)


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_a_length_dependent_rope_reuses_no_kv_computed_under_other_frequencies(kind):
    """Issue 30: with a RoPE whose frequencies follow the sequence length, a next turn past the
    threshold reused KV computed under the first turn's frequencies. Past the limit a call
    reuses nothing and leaves nothing; below it, reuse stays."""
    from tests.test_engine_families import LENGTH_DEPENDENT

    config = transformers.LlamaConfig(**FAMILY_SIZES, **LENGTH_DEPENDENT[kind])

    def fresh():  # (transformers' dynamic state is the model's: a fresh one per reference)
        torch.manual_seed(3)
        made = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        made.generation_config.eos_token_id, made.generation_config.pad_token_id = None, 0
        return made.eval()

    model = fresh()
    manager = manager_for(model)
    cache = kvt.KVPoolCache(model, manager)
    limit = cache.reuse_limit
    assert limit == {"dynamic": 23, "longrope": 32}[kind]
    counting = Counting(model)
    turns = [list(range(1, 13))]  # 12 tokens, then + 4 + 3 (below), then past the limit
    for number, extra in enumerate([[40, 41, 42], list(range(50, 50 + limit))]):
        ids = torch.tensor([turns[-1]])
        got = kvt.generate(model, cache, ids, None, max_new_tokens=4, do_sample=False)
        expected = fresh().generate(input_ids=ids, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, expected), (kind, number)
        turns.append(got[0].tolist() + extra)
    counting.tokens = 0
    ids = torch.tensor([turns[-1]])
    assert ids.shape[1] > limit
    got = kvt.generate(model, cache, ids, None, max_new_tokens=4, do_sample=False)
    expected = fresh().generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, expected)
    assert counting.tokens == ids.shape[1] + 3 and cache.unshared_calls == 1  # nothing reused
    finish(manager)


def test_pages_go_to_host_and_disk_between_calls_and_come_back(tmp_path):
    model = model_of("llama")
    # 8 KiB pages of 16 tokens: 256 per 2 MiB on the GPU and the host, 512 on the disk.
    tiers = [HostCacheTierConfig(2 * MiB), DiskCacheTierConfig(4 * MiB, str(tmp_path))]
    manager = manager_for(model, gpu=2 * MiB, more_tiers=tiers, tokens_per_block=16)
    assert manager.get_slot_counts(0) == [256]
    cache = kvt.KVPoolCache(model, manager)
    conversation = torch.tensor([list(range(1, 60))])
    first = kvt.generate(model, cache, conversation, max_new_tokens=4, do_sample=False)
    generator = torch.Generator().manual_seed(3)
    for _ in range(150):  # other users' prompts (4 blocks each) push it down to the disk
        other = torch.randint(3, 90, (1, 62), generator=generator)
        kvt.generate(model, cache, other, max_new_tokens=2, do_sample=False)
    assert manager.stats().moved_pages_to_level[2] > 0
    hits_before = list(manager.stats().hit_tokens_by_level)
    turn = torch.cat([first, torch.tensor([[40, 41, 42]])], dim=1)
    second = kvt.generate(model, cache, turn, max_new_tokens=5, do_sample=False)
    hits = [a - b for a, b in zip(manager.stats().hit_tokens_by_level, hits_before, strict=True)]
    # Served from the disk: the 63 tokens of the first call but its last (no KV computed).
    assert hits == [0, 0, first.shape[1] - 1], hits
    expected = model_of("llama").generate(input_ids=turn, max_new_tokens=5, do_sample=False)
    assert torch.equal(second, expected)
    finish(manager)


class Watching(kvt.KVPoolCache):
    """Checks, before every write, that no page written is shared (with a beam or the tree)."""

    writes = 0

    def write_and_read(self, layer, keys, values):
        if layer.length + keys.shape[2] > self.reserved or layer.length < self.floor:
            self._reserve(layer.length + keys.shape[2])
        tpb = self.tpb
        for row, pad in zip(self.rows, self.pads, strict=True):
            group = self.manager.get_layer_group_id(layer.layer_idx)
            for position in range(max(layer.length - pad, 0), layer.length + keys.shape[2] - pad):
                page = row.pages(group)[position // tpb]
                assert page.locks == 1 and page.holds == 0 and page.block is None, page
                Watching.writes += 1
        return super().write_and_read(layer, keys, values)


def test_beams_share_their_pages_and_a_shared_page_is_never_written_in_place():
    model = model_of("llama")
    manager = manager_for(model)
    cache = Watching(model, manager)
    ids, mask = PROMPTS
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=14, num_beams=4)
    got = kvt.generate(model, cache, ids, mask, max_new_tokens=14, num_beams=4)
    assert torch.equal(got, expected) and Watching.writes > 0
    stats = manager.stats()
    assert stats.forks > 0 and stats.copy_on_write_pages > 0
    finish(manager)


def test_a_sliding_window_releases_the_blocks_it_left():
    model = model_of("mistral")  # window 8, 4-token blocks
    manager = manager_for(model)
    cache = kvt.KVPoolCache(model, manager)
    ids = torch.tensor([list(range(1, 21))])
    cache.prepare(ids)
    output = model.generate(input_ids=ids, cache=cache, max_new_tokens=30, do_sample=False)
    (row,) = cache.rows
    kept = [page for page in row.pages(0) if page is not None]
    assert len(row.pages(0)) >= 12 and len(kept) <= 8 // 4 + 2  # the window, and one to slide
    cache.finish(output)
    finish(manager)


def test_crop_takes_back_the_last_forward_pass_like_transformers():
    model = model_of("llama")
    manager = manager_for(model)
    cache = kvt.KVPoolCache(model, manager)
    ids = torch.tensor([list(range(1, 11))])
    cache.prepare(ids)
    reference = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        for kv in (cache, reference):
            model(input_ids=ids[:, :6], cache=kv)
            model(input_ids=ids[:, 6:], cache=kv)  # 4 candidate tokens ...
            kv.crop(-3)  # ... of which one is kept
        assert cache.get_seq_length() == reference.get_seq_length() == 7
        ours = model(input_ids=torch.tensor([[50, 51]]), cache=cache).logits
        theirs = model(input_ids=torch.tensor([[50, 51]]), cache=reference).logits
    assert torch.allclose(ours, theirs, atol=1e-5)
    with pytest.raises(ArgumentError, match=r"tokens_to_remove=-5 is invalid: must be >= -3"):
        cache.crop(-5)  # behind kvpool's history (column 6, where the pages were last reserved)
    # Forked after the crop, the rows write into pages reserved before it, shared now: each
    # must get its own copy first.
    with torch.no_grad():
        for kv in (cache, reference):
            kv.crop(-1)
            kv.batch_repeat_interleave(2)
            model(input_ids=torch.tensor([[60], [61]]), cache=kv)
        ours = model(input_ids=torch.tensor([[70], [70]]), cache=cache).logits
        theirs = model(input_ids=torch.tensor([[70], [70]]), cache=reference).logits
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert manager.stats().copy_on_write_pages == 1
    cache.reset()
    finish(manager)


def test_bad_calls_are_refused_by_name_and_a_failed_generate_leaves_nothing_open():
    model = model_of("llama")
    manager = manager_for(model)
    cache = kvt.KVPoolCache(model, manager)
    ids = torch.tensor([[1, 2, 3, 0]])
    with pytest.raises(
        ArgumentError, match=r"attention_mask\[0\] is invalid: must be left padding"
    ):
        cache.prepare(ids, torch.tensor([[1, 1, 1, 0]]))
    with pytest.raises(LogicError, match=r"call cache\.prepare"):
        model(input_ids=ids, cache=cache)
    cache.prepare(ids)
    with pytest.raises(LogicError, match="call finish"):
        cache.prepare(ids)
    with pytest.raises(ArgumentError, match=r"sequences\[0\] is invalid: must begin with"):
        cache.finish(torch.tensor([[1, 2, 4, 0, 9]]))  # not this row's prompt: nothing committed
    assert manager.num_open_kv_caches == 0 and manager.probe_reuse(None, [1, 2, 4]) == 0

    def broken(*args, **kwargs):
        raise KeyboardInterrupt

    model.lm_head.register_forward_hook(broken)
    with pytest.raises(KeyboardInterrupt):
        kvt.generate(model, cache, ids, max_new_tokens=3)
    assert manager.num_open_kv_caches == 0 and not cache.rows
    half = KVCacheManager(kvt.manager_config(model_of("llama").to(torch.bfloat16), 2 * MiB))
    with pytest.raises(ArgumentError, match="layer 0's pages hold 64 bytes per token, its keys"):
        kvt.generate(model, kvt.KVPoolCache(model, half), ids[:, :3], max_new_tokens=2)
    windowed = manager_for(model_of("mistral"))
    with pytest.raises(ArgumentError, match=r"manager is invalid for this model: layer 0 keeps"):
        kvt.KVPoolCache(model, windowed)
    for m in (manager, half, windowed):
        finish(m)


@pytest.mark.slow
def test_smollm2_real_weights_with_reuse_across_calls():
    tokenizer, model = smollm2()
    tokenizer.padding_side = "left"
    manager = KVCacheManager(kvt.manager_config(model, 64 * MiB))
    cache = kvt.KVPoolCache(model, manager)
    prompts = ["The capital of France is", "Water boils at a temperature of"]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    beams = model.generate(**inputs, max_new_tokens=6, num_beams=4, do_sample=False)
    assert torch.equal(kvt.generate(model, cache, **inputs, max_new_tokens=6, num_beams=4), beams)
    expected = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    got = kvt.generate(model, cache, **inputs, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, expected)
    assert "Paris" in tokenizer.decode(got[0])
    follow = tokenizer(" It is also", add_special_tokens=False).input_ids
    pads = (inputs["attention_mask"] == 0).sum(dim=1).tolist()
    ids, mask = batch(*[row[pad:].tolist() + follow for row, pad in zip(got, pads, strict=True)])
    counting = Counting(model)
    got = kvt.generate(model, cache, ids, mask, max_new_tokens=6, do_sample=False)
    # Computed: at most the follow-up, the last output token and the shorter row's padding
    # difference per row, then 5 decode steps; the rest came from kvpool.
    assert counting.tokens <= 2 * (len(follow) + 1 + max(pads)) + 2 * 5
    assert manager.stats().hit_tokens >= ids.numel() - 2 * (len(follow) + 1 + max(pads))
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, expected)
    finish(manager)
