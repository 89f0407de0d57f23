"""The persistent disk level (`DiskCacheTierConfig.persistent_id`): a manager started later on
the same files finds the blocks that were on disk, byte for byte, after a clean shutdown and
after a SIGKILL at any moment; nothing else is ever served (another identity or layout, a
corrupted payload, a truncated file, an overwritten record: misses); one live manager per
directory; recovery takes the same decisions twice and on both backends.

Every page's bytes are a function of its block's key, layer and role (`pattern`), so any page
found after a restart, on disk or brought up to the GPU, is checked against what it must hold
without knowing which requests wrote it."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

import kvpool
from kvpool import (
    ConfigError,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    LogicError,
    ReuseScope,
    StorageError,
)
from kvpool.lifecycles import SsmLifeCycle
from kvpool.storage.slot_file import _RECORD, HEADER_BYTES, RECORD_MAGIC, file_name
from kvpool.tiers.persistence import _LABEL
from kvpool.tokens import block_key_of_encoded, encode_tokens, root_key
from tests import test_fault_matrix as fault_matrix
from tests.engine_check import CheckingEngine, token_value
from tests.faults import DiskFaults
from tests.helpers import MiB, make_config, record_layer, shutdown, ssm_layer

TPB = 16
ROOT = Path(__file__).resolve().parents[1]
ID = "model-digest-0123456789abcdef"
# One pool group (two full-attention layers, 64 KiB pages): 128 disk slots in 8 MiB.
LAYERS = [record_layer(0, TPB, repeats=64), record_layer(1, TPB, repeats=64)]
# Two pool groups: full attention and a window with sinks share 32 KiB slots; SSM states 48 KiB.
HYBRID = [
    record_layer(0, TPB, repeats=64),
    record_layer(1, TPB, window=32, sinks=4, repeats=64),
    ssm_layer(2, size=48 * 1024),
]


def config(directory, persistent_id=ID, layers=LAYERS, disk_mib=8, host_mib=0, **overrides):
    tiers = [GpuCacheTierConfig((4 if layers is HYBRID else 2) * MiB)]  # (a grain per group)
    if host_mib:
        tiers.append(HostCacheTierConfig(host_mib * MiB))
    tiers.append(DiskCacheTierConfig(disk_mib * MiB, str(directory), persistent_id=persistent_id))
    return make_config(layers, tiers, TPB, **overrides)


def pattern(key: bytes, layer_id: int, role: str, size: int) -> np.ndarray:
    """`size` bytes that only (key, layer, role) gives: its digest repeated."""
    seed = hashlib.sha256(key + layer_id.to_bytes(4, "little") + role.encode()).digest()
    return np.frombuffer((seed * (size // 32 + 1))[:size], dtype=np.uint8)


def block_bytes(parent_key, tokens, layer_id, role, size):
    """A block's page for (layer, role): one slice per token, the `pattern` of the key of the
    block's tokens up to it (what the token's KV depends on: its whole prefix), so a partial
    block's page is the first slices of a full one's."""
    per, parts = size // TPB, []
    for i in range(len(tokens)):
        key = block_key_of_encoded(parent_key, encode_tokens(tokens[: i + 1]))
        parts.append(pattern(key, layer_id, role, per))
    return np.concatenate(parts)


def prompt(n, blocks=4):
    return [n * 1000 + i for i in range(blocks * TPB)]


def chain_keys(tokens, scope=None):
    """The key of every block of `tokens` (the last one partial if they end mid-block)."""
    keys, key = [], root_key(scope)
    for start in range(0, len(tokens), TPB):
        key = block_key_of_encoded(key, encode_tokens(tokens[start : start + TPB]))
        keys.append(key)
    return keys


def is_ssm(manager, placement):
    return isinstance(manager.layout.life_cycles[placement.layer_group], SsmLifeCycle)


def fill(manager, cache, tokens, scope=None):
    """Write the pages of every block of `tokens` not committed yet (and the SSM states: the
    pattern of the last block's key), then commit them (the cache is active and sized)."""
    keys = [root_key(scope), *chain_keys(tokens, scope)]
    first = cache.num_committed_tokens // TPB
    for (layer_id, role), placement in manager.layout.buffers.items():
        view = manager.page_view(layer_id, role)
        rows = cache.get_page_indices(layer_id, role)
        if is_ssm(manager, placement):
            view[rows[0]] = pattern(keys[-1], layer_id, role, view.shape[1])
            continue
        for index in range(first, len(keys) - 1):
            if rows[index] >= 0:
                block = tokens[index * TPB : (index + 1) * TPB]
                data = block_bytes(keys[index], block, layer_id, role, view.shape[1])
                view[rows[index], : len(data)] = data
    cache.commit(tokens[cache.num_committed_tokens :])


def run(manager, tokens, scope=None):
    """One request over `tokens`: reuse what is cached, write and commit the rest."""
    cache = manager.create_kv_cache(scope, tokens[:-1])
    assert cache.resume()
    assert cache.resize(len(tokens))
    fill(manager, cache, tokens, scope)
    cache.close()


def check_active(manager, cache, tokens, scope=None):
    """An active request's pages of its reused full blocks hold exactly their bytes; returns
    how many pages were compared."""
    keys = [root_key(scope), *chain_keys(tokens, scope)]
    checked = 0
    for (layer_id, role), placement in manager.layout.buffers.items():
        if is_ssm(manager, placement):
            continue
        view = manager.page_view(layer_id, role)
        rows = cache.get_page_indices(layer_id, role)
        for index in range(cache.num_committed_tokens // TPB):
            if rows[index] >= 0:
                block = tokens[index * TPB : (index + 1) * TPB]
                expected = block_bytes(keys[index], block, layer_id, role, view.shape[1])
                assert np.array_equal(np.asarray(view[rows[index]]), expected), (layer_id, index)
                checked += 1
    return checked


def disk_pages(manager):
    """{(block key, layer group): page} of every tree page at the disk level."""
    level = manager.num_levels - 1
    return {
        (block.key, group): page
        for block in manager._tree.index.values()
        for group, page in enumerate(block.pages)
        if page is not None and page.level == level
    }


def check_disk_bytes(manager):
    """Every tree page on the disk level, read from the file, holds its block's bytes (an SSM
    snapshot of a full block: the pattern of its key); returns how many pages."""
    storage = manager.level_storage(manager.num_levels - 1)
    pages = disk_pages(manager)
    for (key, group), page in pages.items():
        block = page.block
        pool_group = storage.pool_groups[page.pool_group]
        for placement in manager.layout.buffers.values():
            if placement.layer_group != group:
                continue
            slot_size = pool_group.slot_sizes[placement.pool]
            at = page.slot_id * slot_size + placement.offset
            got = pool_group.memories[placement.pool].read(at, placement.size)
            if is_ssm(manager, placement):
                if block.num_tokens == TPB:
                    expected = pattern(key, placement.layer_id, placement.role, placement.size)
                    assert np.array_equal(got, expected), (key.hex()[:8], placement)
                continue
            expected = block_bytes(
                block.parent.key, block.tokens, placement.layer_id, placement.role, placement.size
            )
            assert np.array_equal(got[: len(expected)], expected), (key.hex()[:8], placement)
    return len(pages)


def unrecorded(manager):
    """Tree pages on the disk level whose slot has no valid record naming their block and
    layer group (read from the file)."""
    storage = manager.level_storage(manager.num_levels - 1)
    missing = []
    for (key, group), page in disk_pages(manager).items():
        file = storage.persistent.files[page.pool_group]
        with open(file.path, "rb") as handle:
            handle.seek(HEADER_BYTES + page.slot_id * file.stride)
            head = handle.read(_RECORD.size + 4 * len(file.slot_sizes) + _LABEL.size)
        at = _RECORD.size + 4 * len(file.slot_sizes)
        group_of, _, _, key_of = _LABEL.unpack_from(head, at)[:4]
        if head[:8] != RECORD_MAGIC or key_of != key or group_of != group:
            missing.append(page)
    return missing


def level_file(directory, pool_group=0):
    return Path(directory) / file_name(pool_group)


def stride_of(manager, pool_group=0):
    file = manager.level_storage(manager.num_levels - 1).persistent.files[pool_group]
    return file.record_bytes, file.stride


def fill_disk(manager, count=40):
    """Enough prompts of 4 blocks that the GPU level pushes most of them to disk."""
    prompts = [prompt(n) for n in range(count)]
    for tokens in prompts:
        run(manager, tokens)
    return prompts


# -- the API ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["", 5, b"digest", ["x"]])
def test_persistent_id_is_checked_before_anything_is_built(tmp_path, bad):
    with pytest.raises(ConfigError, match=r"cache_tiers\[1\]\.persistent_id") as raised:
        KVCacheManager(config(tmp_path, persistent_id=bad))
    assert "non-empty string" in str(raised.value) and "None" in str(raised.value)
    assert list(tmp_path.iterdir()) == []  # nothing was built


def test_without_an_id_the_level_is_unlinked_and_found_empty(tmp_path):
    m = KVCacheManager(config(tmp_path, persistent_id=None))
    fill_disk(m)
    assert m.disk_recovery is None and list(tmp_path.iterdir()) == []
    shutdown(m)


# -- finding the blocks again -------------------------------------------------------------------


def test_a_restarted_manager_finds_every_disk_block_byte_for_byte(tmp_path):
    m = KVCacheManager(config(tmp_path))
    first = m.disk_recovery
    assert first is not None and first.pages == 0 and not first.started_empty
    prompts = fill_disk(m)
    on_disk = set(disk_pages(m))
    assert len(on_disk) >= 100  # (the path: most blocks went down to disk)
    assert check_disk_bytes(m) == len(on_disk) and unrecorded(m) == []
    shutdown(m)

    m = KVCacheManager(config(tmp_path))
    found = m.disk_recovery
    assert set(disk_pages(m)) >= on_disk  # every block that was on disk is back, there
    assert found.pages == len(disk_pages(m)) and found.blocks == found.pages
    assert found.discarded == {} and found.bytes_verified == found.pages * 64 * 1024
    assert check_disk_bytes(m) == found.pages
    reused = 0
    for tokens in prompts:
        keys = chain_keys(tokens)
        expected = 0
        while expected < len(keys) and (keys[expected], 0) in disk_pages(m):
            expected += 1
        assert m.probe_reuse(None, tokens) == expected * TPB
        cache = m.create_kv_cache(None, tokens[:-1])
        assert cache.num_committed_tokens == min(expected * TPB, len(tokens) - 1)
        assert cache.resume()  # brought up from disk as any disk page
        reused += check_active(m, cache, tokens)
        cache.close()
    assert reused >= 2 * 90  # (both layers, most blocks, compared byte for byte)
    shutdown(m)


def test_a_second_live_manager_on_the_directory_is_refused_by_path(tmp_path):
    m = KVCacheManager(config(tmp_path))
    with pytest.raises(StorageError, match="in use by another kvpool manager") as raised:
        KVCacheManager(config(tmp_path))
    assert str(level_file(tmp_path)) in str(raised.value)
    with pytest.raises(StorageError):  # (another id does not get past the lock either)
        KVCacheManager(config(tmp_path, persistent_id="other"))
    assert check_disk_bytes(m) == 0
    shutdown(m)
    KVCacheManager(config(tmp_path)).shutdown()  # released with the first


def test_another_identity_or_layout_finds_nothing_and_reuses_the_files(tmp_path):
    m = KVCacheManager(config(tmp_path))
    prompts = fill_disk(m)
    assert len(disk_pages(m)) > 100
    shutdown(m)
    size = level_file(tmp_path).stat().st_size

    m = KVCacheManager(config(tmp_path, persistent_id="another model"))
    assert m.disk_recovery.started_empty and m.disk_recovery.pages == 0
    assert all(m.probe_reuse(None, tokens) == 0 for tokens in prompts)
    shutdown(m)
    assert level_file(tmp_path).stat().st_size == size  # the same file, reinitialized
    m = KVCacheManager(config(tmp_path))  # the old contents are gone for good
    assert m.disk_recovery.started_empty and m.disk_recovery.records == 0
    prompts = fill_disk(m)
    shutdown(m)

    layouts = [
        [record_layer(0, TPB, repeats=32), record_layer(1, TPB, repeats=32)],  # buffer sizes
        [record_layer(0, TPB, repeats=64), record_layer(2, TPB, repeats=64)],  # placements
        [record_layer(0, TPB, repeats=64), record_layer(1, TPB, window=32, repeats=64)],
    ]
    for layers in layouts:
        m = KVCacheManager(config(tmp_path, layers=layers))
        assert m.disk_recovery.started_empty and m.disk_recovery.pages == 0
        assert all(m.probe_reuse(None, tokens) == 0 for tokens in prompts)
        shutdown(m)


def test_save_to_disk_keeps_the_chain_heads_a_restart_needs(tmp_path):
    """A system prompt every request shares stays on the GPU (hot: eviction trims chains from
    their ends); the conversations below it go down to disk. After a restart none of them is
    reachable, unless `save_to_disk()` moved the GPU's pages down first."""
    system = [7_000_000 + i for i in range(2 * TPB)]
    conversations = [system + [n * 1000 + i for i in range(3 * TPB)] for n in range(60)]
    for save in (False, True):
        directory = tmp_path / str(save)
        directory.mkdir()
        m = KVCacheManager(config(directory))
        for tokens in conversations:
            run(m, tokens)
        assert [m._tree.index[key].pages[0].level for key in chain_keys(system)] == [0, 0]
        assert len(disk_pages(m)) > 90  # (conversations' blocks on disk, their heads above)
        if save:
            gpu_pages = m.get_storage_statistics(0)[0].evictable
            assert m.save_to_disk() == gpu_pages
            assert {page.level for page in disk_pages(m).values()} == {1}
            assert unrecorded(m) == []
            assert m.get_storage_statistics(0)[0].free == 32  # (all moved down)
        shutdown(m)
        m = KVCacheManager(config(directory))
        reused = [m.probe_reuse(None, tokens) for tokens in conversations]
        if save:
            assert sum(r == len(conversations[0]) for r in reused) >= 30
            assert check_disk_bytes(m) == m.disk_recovery.pages
        else:
            assert reused == [0] * 60 and m.disk_recovery.discarded["unreachable"] > 90
        shutdown(m)
    m = KVCacheManager(config(tmp_path / "True", persistent_id=None))
    with pytest.raises(LogicError, match="persistent disk level"):
        m.save_to_disk()
    shutdown(m)


def test_clear_reusable_blocks_forgets_them_for_later_managers_too(tmp_path):
    m = KVCacheManager(config(tmp_path))
    fill_disk(m)
    assert len(disk_pages(m)) > 100
    m.clear_reusable_blocks()
    shutdown(m)
    m = KVCacheManager(config(tmp_path))
    assert m.disk_recovery.records == 0 and m.disk_recovery.pages == 0
    shutdown(m)


# -- what is on disk is checked ---------------------------------------------------------------


def written(tmp_path, count=40):
    """Fill a level and shut it down; returns (prompts, slot of each disk block, record
    bytes, stride)."""
    m = KVCacheManager(config(tmp_path))
    prompts = fill_disk(m, count)
    slots = {key: page.slot_id for (key, group), page in disk_pages(m).items()}
    record, stride = stride_of(m)
    shutdown(m)
    return prompts, slots, record, stride


def reachable(prompts, slots, lost):
    """Blocks of `prompts` a restart can find when the blocks in `lost` are gone."""
    found = set()
    for tokens in prompts:
        for key in chain_keys(tokens):
            if key not in slots or key in lost:
                break
            found.add(key)
    return found


def patch(path, offset, data):
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(data)


def test_a_corrupted_payload_byte_is_a_miss_never_wrong_bytes(tmp_path):
    prompts, slots, record, stride = written(tmp_path)
    victim = chain_keys(prompts[5])[1]  # the second block of a prompt on disk
    slot = slots[victim]
    offset = HEADER_BYTES + slot * stride + record + 12345
    data = level_file(tmp_path).read_bytes()[offset : offset + 1]
    patch(level_file(tmp_path), offset, bytes([data[0] ^ 0x40]))

    m = KVCacheManager(config(tmp_path))
    found = m.disk_recovery
    assert found.discarded == {"checksum mismatch": 1, "unreachable": 2}  # its children too
    assert ("discard", 0, slot, "checksum mismatch") in found.decisions
    keys = {key for key, _ in disk_pages(m)}
    assert keys == reachable(prompts, slots, {victim}) and victim not in keys
    assert m.probe_reuse(None, prompts[5]) == TPB  # the first block only
    assert check_disk_bytes(m) == len(keys)
    shutdown(m)


def test_a_torn_write_under_a_stale_record_is_a_miss(tmp_path):
    """A slot's bytes rewritten (another block's, in part) while its record stayed."""
    prompts, slots, record, stride = written(tmp_path)
    a, b = chain_keys(prompts[3])[3], chain_keys(prompts[4])[3]  # two leaves
    path = level_file(tmp_path)
    whole = path.read_bytes()
    payload_b = whole[HEADER_BYTES + slots[b] * stride + record :][: stride - record]
    patch(path, HEADER_BYTES + slots[a] * stride + record, payload_b[: (stride - record) // 2])
    m = KVCacheManager(config(tmp_path))
    assert m.disk_recovery.discarded == {"checksum mismatch": 1}
    assert a not in {key for key, _ in disk_pages(m)} and check_disk_bytes(m) > 100
    assert m.probe_reuse(None, prompts[3]) == 3 * TPB
    shutdown(m)


def test_a_truncated_file_loses_only_the_slots_cut(tmp_path):
    prompts, slots, record, stride = written(tmp_path)
    path = level_file(tmp_path)
    cut = max(slots.values())  # cut in the middle of the highest slot's bytes
    os.truncate(path, HEADER_BYTES + cut * stride + record + 100)
    m = KVCacheManager(config(tmp_path))
    lost = {key for key, slot in slots.items() if slot >= cut}
    assert len(lost) == 1
    assert {key for key, _ in disk_pages(m)} == reachable(prompts, slots, lost)
    assert check_disk_bytes(m) == len(reachable(prompts, slots, lost))
    assert path.stat().st_size == HEADER_BYTES + 128 * stride  # grown back to its slots
    shutdown(m)
    # Cut into the records and the header: the level starts empty, nothing wrong is served.
    for size in (HEADER_BYTES + 3 * stride + 10, HEADER_BYTES - 1, 0):
        os.truncate(path, size)
        m = KVCacheManager(config(tmp_path))
        assert check_disk_bytes(m) == m.disk_recovery.pages
        shutdown(m)


def test_overwritten_records_are_misses(tmp_path):
    prompts, slots, record, stride = written(tmp_path)
    path = level_file(tmp_path)
    whole = path.read_bytes()
    leaves = [chain_keys(tokens)[3] for tokens in prompts if chain_keys(tokens)[3] in slots]
    a, b, c, d = leaves[:4]

    def record_of(key):
        at = HEADER_BYTES + slots[key] * stride
        return whole[at : at + record]

    # a's record copied over b's (it names a's slot), garbage over c's, one bit of d's flipped.
    patch(path, HEADER_BYTES + slots[b] * stride, record_of(a))
    patch(path, HEADER_BYTES + slots[c] * stride, b"KVPSLOT1" + os.urandom(200))
    flipped = bytearray(record_of(d)[:200])
    flipped[100] ^= 1
    patch(path, HEADER_BYTES + slots[d] * stride, bytes(flipped))
    m = KVCacheManager(config(tmp_path))
    keys = {key for key, _ in disk_pages(m)}
    assert keys == reachable(prompts, slots, {b, c, d}) and a in keys
    assert m.disk_recovery.records == len(slots) - 3  # (not even whole records)
    assert check_disk_bytes(m) == len(keys)
    shutdown(m)


def test_a_record_of_other_weights_is_a_miss(tmp_path):
    """The same slot of another identity's file, bytes and record, copied in: refused."""
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    mine.mkdir(), theirs.mkdir()
    prompts, slots, _, stride = written(mine)
    m = KVCacheManager(config(theirs, persistent_id="other weights"))
    fill_disk(m)
    shutdown(m)
    victim = chain_keys(prompts[2])[3]
    at = HEADER_BYTES + slots[victim] * stride
    patch(level_file(mine), at, level_file(theirs).read_bytes()[at : at + stride])
    m = KVCacheManager(config(mine))
    keys = {key for key, _ in disk_pages(m)}
    assert keys == reachable(prompts, slots, {victim})
    assert m.disk_recovery.records == len(slots) - 1
    shutdown(m)


def record_magic(directory, slot, stride, pool_group=0):
    with open(level_file(directory, pool_group), "rb") as file:
        file.seek(HEADER_BYTES + slot * stride)
        return file.read(8)


def test_a_slot_written_again_loses_its_record_first(tmp_path):
    """Committed blocks fill the disk (each slot with a record); a suspended request's pages,
    never committed, are then pushed down into those slots: their records are gone."""
    m = KVCacheManager(config(tmp_path))
    fill_disk(m)
    _, stride = stride_of(m)
    recorded = {page.slot_id for page in disk_pages(m).values()}
    assert all(record_magic(tmp_path, slot, stride) == RECORD_MAGIC for slot in recorded)
    held = m.create_kv_cache(None, [])
    assert held.resume() and held.resize(20 * TPB)  # 20 blocks written, never committed
    held.suspend()
    for n in range(40, 50):
        run(m, prompt(n))
    level = m.num_levels - 1
    pushed = [page for page in held._pages[0] if page is not None and page.level == level]
    assert len(pushed) >= 10 and {page.slot_id for page in pushed} & recorded  # (the path)
    for page in pushed:
        assert record_magic(tmp_path, page.slot_id, stride) != RECORD_MAGIC
    held.close()
    shutdown(m)
    m = KVCacheManager(config(tmp_path))
    assert check_disk_bytes(m) == m.disk_recovery.pages > 50
    shutdown(m)


def copy_slot(directory, source, target, stride, sequence_delta):
    """Copy a slot (record and bytes) to another slot, its record rewritten to name that slot
    and a sequence number moved by `sequence_delta` (as a relocation leaves its source and
    target, or a block lifted off disk and written back elsewhere, before the old slot is
    written again)."""
    path = level_file(directory)
    whole = bytearray(path.read_bytes()[HEADER_BYTES + source * stride :][:stride])
    fields = list(_RECORD.unpack_from(whole))
    used = fields[2]
    fields[5], fields[6] = target, fields[6] + sequence_delta
    whole[: _RECORD.size] = _RECORD.pack(*fields)
    whole[8:12] = zlib.crc32(bytes(whole[12:used])).to_bytes(4, "little")
    patch(path, HEADER_BYTES + target * stride, bytes(whole))


@pytest.mark.parametrize("newer", [False, True])
def test_of_two_records_of_a_page_the_latest_wins(tmp_path, newer):
    prompts, slots, _, stride = written(tmp_path, count=20)  # (free slots left)
    key = chain_keys(prompts[2])[3]
    target = max(slots.values()) + 5
    copy_slot(tmp_path, slots[key], target, stride, 1 if newer else -1)
    m = KVCacheManager(config(tmp_path))
    found = m.disk_recovery
    assert found.discarded == {"older duplicate": 1}
    loser = slots[key] if newer else target
    assert ("discard", 0, loser, "older duplicate") in found.decisions
    assert disk_pages(m)[key, 0].slot_id == (target if newer else slots[key])
    assert check_disk_bytes(m) == len(slots)
    assert m.get_storage_statistics(m.num_levels - 1)[0].free == 128 - len(slots)
    shutdown(m)


def test_a_label_that_does_not_chain_to_its_key_is_a_miss(tmp_path):
    """A record, whole and checksummed, whose tokens are not the ones its key was made of
    (another token, or another parent): refused, whatever its bytes."""
    prompts, slots, _, stride = written(tmp_path)
    path = level_file(tmp_path)
    label_at = _RECORD.size + 4  # (one pool)
    for key, offset in ((chain_keys(prompts[6])[3], _LABEL.size), (chain_keys(prompts[7])[3], 45)):
        at = HEADER_BYTES + slots[key] * stride
        record = bytearray(path.read_bytes()[at:][:stride])
        record[label_at + offset] ^= 1  # a token's byte, or the parent key's
        used = _RECORD.unpack_from(record)[2]
        record[8:12] = zlib.crc32(bytes(record[12:used])).to_bytes(4, "little")
        patch(path, at, bytes(record))
    m = KVCacheManager(config(tmp_path))
    assert m.disk_recovery.discarded == {"inconsistent label": 2}
    assert check_disk_bytes(m) == len(slots) - 2
    shutdown(m)


def test_a_block_without_its_full_attention_page_is_not_recovered(tmp_path):
    """Hybrid model: a block whose full-attention page fails its check is gone with everything
    below it, even though its window page is whole."""
    m = KVCacheManager(config(tmp_path, layers=HYBRID))
    prompts = [prompt(n) for n in range(40)]
    for tokens in prompts:
        run(m, tokens)
    pages = disk_pages(m)
    victim = next(
        key
        for tokens in prompts
        for key in chain_keys(tokens)[1:3]
        if (key, 0) in pages and (key, 1) in pages
    )
    slot = pages[victim, 0].slot_id
    before = set(pages)
    _, stride = stride_of(m)
    record = stride_of(m)[0]
    shutdown(m)
    patch(level_file(tmp_path), HEADER_BYTES + slot * stride + record + 7, b"\x99")
    m = KVCacheManager(config(tmp_path, layers=HYBRID))
    found = m.disk_recovery
    assert found.discarded["checksum mismatch"] == 1 and found.discarded["unreachable"] >= 1
    assert victim not in m._tree.index
    assert (victim, 1) in before and not any(key == victim for key, _ in disk_pages(m))
    assert check_disk_bytes(m) == found.pages
    shutdown(m)


def test_a_look_ahead_reads_the_pages_where_they_are_in_the_file(tmp_path):
    prompts, slots, record, stride = written(tmp_path)
    m = KVCacheManager(config(tmp_path))
    tokens = prompts[4]
    lookahead = m.look_ahead(None, tokens[:-1])
    keys = chain_keys(tokens)
    assert [(r.offset, r.nbytes) for r in lookahead.disk] == [
        (HEADER_BYTES + slots[key] * stride + record, stride - record) for key in keys
    ]
    assert lookahead.wait(10) and lookahead.read_ahead_bytes == 4 * (stride - record)
    cache = m.create_kv_cache(None, tokens[:-1], lookahead=lookahead)
    assert cache.resume() and check_active(m, cache, tokens) == 4 * 3  # (k, v of 2 layers)
    cache.close()
    shutdown(m)


def test_pages_fetched_from_the_remote_tier_into_the_disk_level_are_recorded(tmp_path):
    from kvpool import RemoteCacheTierConfig
    from tests.valkey_servers import ValkeyServer, server_binary

    if server_binary() is None:
        pytest.skip("no valkey-server binary")
    server = ValkeyServer(tmp_path / "valkey").start()
    remote = RemoteCacheTierConfig(server.url, timeout_ms=2000)
    directory = tmp_path / "disk"
    directory.mkdir()
    try:
        writer = KVCacheManager(
            make_config(LAYERS, [GpuCacheTierConfig(2 * MiB)], TPB, remote_tier=remote)
        )
        prompts = [prompt(n) for n in range(3)]
        for tokens in prompts:
            cache = writer.create_kv_cache(None, tokens[:-1])
            assert cache.resume() and cache.resize(len(tokens))
            fill(writer, cache, tokens)
            assert writer.write_remote(cache) == 4
            cache.close()
        assert writer.flush_remote_writes()
        shutdown(writer)

        m = KVCacheManager(config(directory, remote_tier=remote))
        level = m.num_levels - 1
        for tokens in prompts:
            cache = m.create_kv_cache(None, tokens[:-1])
            assert cache.pending_remote_tokens == 3 * TPB  # (the remote part: 3 whole blocks)
            assert cache.prefetch(level)  # fetched into pages at the disk level
            cache.close()
        assert len(disk_pages(m)) == 9 and m._persist.written == 9  # (the path)
        shutdown(m)
    finally:
        server.stop()
    m = KVCacheManager(config(directory))  # no remote tier now: the disk level has them
    assert m.disk_recovery.pages == 9 and check_disk_bytes(m) == 9
    assert [m.probe_reuse(None, tokens) for tokens in prompts] == [3 * TPB] * 3
    shutdown(m)


# -- crashes ------------------------------------------------------------------------------------

WRITER = """
import sys, time
sys.path.insert(0, {root!r})
from tests.test_persistent_disk import writer
writer({directory!r}, {layers!r}, {seed})
"""


def writer(directory, layers, seed):
    """Run requests forever, saying after each how many ran (for the parent to kill it).
    Some requests stay suspended with uncommitted blocks (held pages, pushed down); now and
    then the disk level is re-split (hybrid) or resized."""
    m = KVCacheManager(config(directory, layers=HYBRID if layers == "hybrid" else LAYERS))
    rng = np.random.default_rng(seed)
    held = []
    for n in range(100_000):
        tokens = prompt(int(rng.integers(0, 60)), blocks=int(rng.integers(1, 6)))
        cache = m.create_kv_cache(None, tokens[:-1])
        if not cache.resume():
            cache.close()
            continue
        if n % 7 == 3:  # blocks written, never committed (tokens of their own): suspended
            private = [900_000 + n * 100 + i for i in range(3 * TPB)]
            if cache.resize(cache.num_committed_tokens + len(private)):
                cache.suspend()
                held.append(cache)
                if len(held) > 3:
                    held.pop(0).close()
                print("held", flush=True)
                continue
        assert cache.resize(len(tokens))
        fill(m, cache, tokens)
        cache.close()
        level = m.num_levels - 1
        if n % 17 == 16:  # slots relocated inside the files, their ends moved (killed there too)
            if layers == "hybrid":
                m.adjust_cache_level(level, [0.4, 0.6] if n % 34 == 16 else [0.7, 0.3])
            else:
                m.resize(level, (6 if n % 34 == 16 else 8) * MiB)
        print(n, len(disk_pages(m)), flush=True)


def crash(directory, after, layers="plain", seed=0):
    """Start a writer, let it run `after` requests (with most blocks reaching disk), check that
    its level is locked, SIGKILL it in the middle of whatever it does."""
    script = WRITER.format(root=str(ROOT), directory=str(directory), layers=layers, seed=seed)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        count = 0
        while count < after:
            line = process.stdout.readline()
            assert line, "the writer stopped"
            count += line[0].isdigit()
        with pytest.raises(StorageError, match="in use"):  # its level is its own
            KVCacheManager(config(directory, layers=HYBRID if layers == "hybrid" else LAYERS))
        process.send_signal(signal.SIGKILL)
        process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == -signal.SIGKILL


@pytest.mark.parametrize("after", [40, 90, 150])
def test_a_killed_writer_leaves_only_true_blocks(tmp_path, after):
    crash(tmp_path, after, seed=after)
    m = KVCacheManager(config(tmp_path))
    found = m.disk_recovery
    assert found.pages > 20, found  # (the path: it found pages a killed process left)
    assert check_disk_bytes(m) == found.pages  # each one holds its block's bytes
    for block in m._tree.index.values():  # committed blocks only: no held page's tokens
        assert all(token < 900_000 for token in block.tokens)
    for n in range(60):  # brought up and read as any disk page
        tokens = prompt(n, blocks=5)
        cache = m.create_kv_cache(None, tokens[:-1])
        if cache.num_committed_tokens:
            assert cache.resume()
            check_active(m, cache, tokens)
        cache.close()
    shutdown(m)


def test_a_killed_writer_of_a_hybrid_model_leaves_only_true_blocks(tmp_path):
    crash(tmp_path, 120, layers="hybrid", seed=5)
    m = KVCacheManager(config(tmp_path, layers=HYBRID))
    found = m.disk_recovery
    assert found.pages > 30
    pages = disk_pages(m)
    assert {group for _, group in pages} == {0, 1, 2}  # full, window, SSM snapshots
    assert check_disk_bytes(m) == found.pages
    for block in m._tree.index.values():
        assert block.pages[0] is not None  # every block kept has its full-attention page
    shutdown(m)


# -- I/O errors and interrupts ----------------------------------------------------------------


def check_engine_records(manager):
    """Every tree page on the disk level holds the data-verifying engine's records of its
    block's tokens at their positions (`tests.engine_check`); returns how many pages."""
    engine = CheckingEngine(manager)
    storage = manager.level_storage(manager.num_levels - 1)
    pages = disk_pages(manager)
    for (_, group), page in pages.items():
        block = page.block
        positions = block.ordinal * TPB + np.arange(block.num_tokens)
        values = [token_value(token) for token in block.tokens]
        pool_group = storage.pool_groups[page.pool_group]
        for placement, role_index, ssm in engine.buffers:
            if ssm or placement.layer_group != group:
                continue
            at = page.slot_id * pool_group.slot_sizes[placement.pool] + placement.offset
            got = pool_group.memories[placement.pool].read(at, placement.size)
            records = got.view(np.int32).reshape(TPB, -1, 4)[: block.num_tokens]
            expected = np.stack(
                [
                    values,
                    positions,
                    np.full_like(positions, placement.layer_id),
                    np.full_like(positions, role_index),
                ],
                axis=1,
            )
            assert (records == expected[:, None, :]).all(), (block, placement)
    return len(pages)


WRITE_FAULTS = [case for case in fault_matrix.CASES if case[1] != "preadv"]


@pytest.mark.parametrize("skip", [0, 2])
@pytest.mark.parametrize("code", ["EIO", "interrupt"])
@pytest.mark.parametrize(
    ("operation", "call", "scenario"), WRITE_FAULTS, ids=[f"{o}-{c}" for o, c, _ in WRITE_FAULTS]
)
def test_a_failed_write_leaves_only_true_records(
    tmp_path, monkeypatch, operation, call, scenario, code, skip
):
    """The fault matrix's write and grow faults (an I/O error, Ctrl-C; at the first call or
    the third: a record's invalidation, a slot's bytes, a record) on a persistent level: the
    manager stays consistent, and what a restart finds is true."""
    monkeypatch.setattr(
        fault_matrix,
        "DiskCacheTierConfig",
        lambda quota, path: DiskCacheTierConfig(quota, path, persistent_id=ID),
    )
    s = scenario(tmp_path)
    m = s.manager
    try:
        faults = DiskFaults(m).install(monkeypatch)
        if code == "interrupt":  # (Ctrl-C reaches the main thread: copy there)
            monkeypatch.setattr(m._storage.state.copier, "_inline_bytes", 1 << 62)
        faults.fail(call, fault_matrix.CODES[code], skip=skip)
        with contextlib.suppress(StorageError, KeyboardInterrupt):
            s.action()
        assert skip or faults.injected[call] == 1, f"{operation} never reached {call}"
        faults.disarm()
        m.check_invariants()
        for cache, tokens in s.requests:
            s.engine.check_anywhere(cache, tokens)
        assert check_engine_records(m) == len(disk_pages(m))
        assert len(unrecorded(m)) <= m._persist.failed  # (a record whose write failed)
    finally:
        shutdown(m)
    m = KVCacheManager(m.config)  # (a chain whose head was on an upper level is unreachable)
    assert check_engine_records(m) == m.disk_recovery.pages
    shutdown(m)


# -- rebalancing, resizing ---------------------------------------------------------------------


def test_rebalancing_and_resizing_the_disk_level_keep_the_records_true(tmp_path):
    """Two pool groups on disk: one shrinks (its pages relocated below the cut, the cut ones
    dropped), then grows; the level shrinks and grows; the records follow every move."""
    m = KVCacheManager(config(tmp_path, layers=HYBRID, disk_mib=16))
    level = m.num_levels - 1
    initial, ratio = m.get_slot_counts(level), m._initial_ratio()
    prompts = [prompt(n, blocks=4) for n in range(50)]
    for tokens in prompts:
        run(m, tokens)
    moved = m._storage.state.num_relocated
    m.adjust_cache_level(level, [0.3, 0.7])  # the attention group shrinks: relocations
    assert m.get_slot_counts(level)[0] < initial[0]
    assert m._storage.state.num_relocated > moved  # (the path)
    assert check_disk_bytes(m) > 20
    for tokens in prompts[:10]:
        run(m, tokens)
    m.adjust_cache_level(level, [0.8, 0.2])  # and grows back
    assert m.resize(level, 10 * MiB)  # a smaller level
    moved = m._storage.state.num_relocated
    for tokens in prompts[20:40]:
        run(m, tokens)
    m.adjust_cache_level(level, ratio, 16 * MiB)  # back to a fresh manager's split
    assert m.get_slot_counts(level) == initial
    on_disk = set(disk_pages(m))
    assert len(on_disk) > 50 and check_disk_bytes(m) == len(on_disk) and unrecorded(m) == []
    shutdown(m)

    m = KVCacheManager(config(tmp_path, layers=HYBRID, disk_mib=16))
    assert set(disk_pages(m)) >= on_disk
    assert check_disk_bytes(m) == m.disk_recovery.pages
    shutdown(m)


# -- determinism --------------------------------------------------------------------------------

RECOVER = """
import json, sys
sys.path.insert(0, {root!r})
from tests.test_persistent_disk import recovery_log
print(json.dumps(recovery_log({directory!r})))
"""


def recovery_log(directory):
    """Recover the level in `directory`, then run the same requests: the decisions of both."""
    m = KVCacheManager(config(directory, layers=HYBRID))
    m.record_decisions()
    for n in range(20):
        run(m, prompt(n * 3 % 50, blocks=5))
    log = [list(map(repr, d)) for d in m.disk_recovery.decisions]
    log += [list(map(repr, d)) for d in m.take_decisions()]
    shutdown(m)
    return [kvpool.backend(), log]


def test_recovery_decides_the_same_twice_and_on_both_backends(tmp_path):
    origin = tmp_path / "origin"
    origin.mkdir()
    crash(origin, 100, layers="hybrid", seed=11)
    copies = []
    for name in ("a", "b", "c"):
        shutil.copytree(origin, tmp_path / name)
        copies.append(tmp_path / name)
    backend, first = recovery_log(copies[0])
    _, second = recovery_log(copies[1])
    assert first == second and len(first) > 50
    assert sum(d[0] == "'recover'" for d in first) > 30
    other = "python" if backend == "native" else "native"
    env = {**os.environ, "KVPOOL_BACKEND": other}
    script = RECOVER.format(root=str(ROOT), directory=str(copies[2]))
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    other_backend, third = json.loads(done.stdout.strip().splitlines()[-1])
    assert third == first
    if other_backend == backend:
        pytest.skip(f"only the {backend} backend is available here (recovered twice: equal)")


# -- KV events ---------------------------------------------------------------------------------


def test_recovered_blocks_are_announced_on_the_disk_medium(tmp_path):
    pytest.importorskip("msgspec")
    pytest.importorskip("zmq")
    from kvpool import KVEventsConfig
    from kvpool.events import cached_blocks
    from tests.test_kv_events import Subscriber, checkpoint

    scope = ReuseScope(lora_id=3, salt="tenant-a")
    m = KVCacheManager(config(tmp_path))
    for n in range(40):
        run(m, prompt(n), scope if n % 2 else None)
    shutdown(m)
    events = KVEventsConfig("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    m = KVCacheManager(config(tmp_path, kv_events=events))
    subscriber = Subscriber(m.kv_event_endpoints, "independent")
    try:
        view = checkpoint(m, subscriber)  # the recovered blocks, announced as stored
        assert len(view["DISK"]) == m.disk_recovery.pages > 100
        assert m._kv_events.scopes[root_key(scope)] == scope  # (its lora id and salt)
        for n in range(6):  # recovered blocks move up, others down: announced as ever
            run(m, prompt(n), scope if n % 2 else None)
        assert checkpoint(m, subscriber) == cached_blocks(m)
    finally:
        subscriber.close()
        shutdown(m)


def test_a_restart_is_not_slower_than_it_says(tmp_path):
    """The recovery's own account: bytes verified and time (reported, not a benchmark)."""
    m = KVCacheManager(config(tmp_path))
    fill_disk(m)
    shutdown(m)
    started = time.perf_counter()
    m = KVCacheManager(config(tmp_path))
    took = time.perf_counter() - started
    found = m.disk_recovery
    assert found.seconds <= took and found.verify_seconds <= found.seconds
    assert found.bytes_verified == found.pages * 64 * 1024
    shutdown(m)
