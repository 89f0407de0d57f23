"""Tensor-parallel ranks whose managers agree (issue 16), in real processes over gloo: generation
identical to single-process transformers, rebalancing on the same step on every rank although
their clocks disagree, a planted divergence named by the check, and both agreement modes."""

import datetime
import re
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from kvpool import ArgumentError, GpuCacheTierConfig, KVCacheManager  # noqa: E402
from kvpool.engine.parallel import kv_head_split  # noqa: E402
from tests import distributed_worker  # noqa: E402
from tests.helpers import MiB, kv_layer, make_config  # noqa: E402
from tests.test_engine import hf_greedy  # noqa: E402

torch.set_num_threads(1)
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, max_position_embeddings=512)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(tmp_path, world, scenario, *args):
    """Run `scenario` in `world` processes; what each saw, by rank."""
    mp.spawn(
        distributed_worker.launch,
        args=(world, free_port(), scenario, str(tmp_path), *args),
        nprocs=world,
        join=True,
    )
    return [torch.load(tmp_path / f"{scenario}-{r}.pt", weights_only=False) for r in range(world)]


def model_of(config, seed):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    return model.eval()


def llama(**overrides):
    return transformers.LlamaConfig(
        **COMMON,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        **overrides,
    )


def with_random_biases(model):
    """transformers starts biases at zero: make every one matter."""
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith(".bias"):
                tensor.uniform_(-0.5, 0.5)
    return model


def hybrid():
    """Three sliding-window layers and a full one: two pool groups of different slot sizes."""
    return transformers.Gemma3TextConfig(
        **COMMON,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=128,
        sliding_window=16,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
    )


REBALANCE = dict(
    rebalance_min_sampled_kv_caches=2,
    rebalance_cooldown_secs=30.0,
    rebalance_target_ratio_update_interval=1,
    rebalance_moving_average_decay=0.5,
)


def job(config, model, groups, rounds, gpu, max_batch=8, host=4 * MiB, **options):
    return {
        "config": config,
        "state_dict": model.state_dict(),
        "groups": groups,
        "rounds": rounds,
        "gpu": gpu,
        "host": host,
        "disk": 8 * MiB,
        "max_batch": max_batch,
        "options": options,
    }


def conversation(seed, count, length, first_tokens, second_tokens):
    """Prompts, then prompts that extend their starts (served from the cache)."""
    prompts = [[(seed + i * 13 + j * 7) % 90 + 1 for j in range(length)] for i in range(count)]
    again = [p[: length - 3] + [(seed + i) % 90 + 1, 5] for i, p in enumerate(prompts[:3])]
    return [(prompts, first_tokens), (again, second_tokens)]


def check_node(outcomes, model, ranks):
    """The ranks of one tensor-parallel group saw the same things, and their generations are
    transformers' own, token for token with logits within 1e-4."""
    first = outcomes[ranks[0]]
    for rank in ranks[1:]:
        other = outcomes[rank]
        for key in ("adjusted_at", "steps", "suspensions", "moved", "slot_counts"):
            assert other[key] == first[key], (key, rank)
        for ours, theirs in zip(first["rounds"], other["rounds"], strict=True):
            for a, b in zip(ours, theirs, strict=True):
                assert a[0] == b[0] and a[1] == b[1] and a[3] == b[3]
                assert torch.equal(a[2], b[2])  # the same all-reduced activations
    for results in first["rounds"]:
        for prompt, tokens, logits, _ in results:
            expected, expected_logits = hf_greedy(model, prompt, len(tokens))
            assert tokens == expected
            assert (logits - torch.stack(expected_logits)).abs().max() < 1e-4
    assert any(cached > 0 for *_, cached in first["rounds"][1])  # the prefix came from the cache


@pytest.mark.slow
def test_tensor_parallel_generation_agrees_with_transformers_and_rebalances_in_step(tmp_path):
    """TP=2 over gloo, a Llama and a hybrid (sliding window + full) model, through host and
    disk. Rank 1's clock is stuck, so only rank 0 ever wants to rebalance on its own: the
    agreement makes both re-split on the same step, and the check finds every step's
    decisions equal."""
    llama_config = llama()
    models = {"llama": llama_config, "hybrid": hybrid()}
    weights = {name: model_of(config, seed=3) for name, config in models.items()}
    jobs = [
        job(
            llama_config,
            weights["llama"],
            [[0, 1]],
            [conversation(1, 12, 64, 160, 6)],
            2 * MiB,
            12,
            2 * MiB,
        ),
        job(
            models["hybrid"],
            weights["hybrid"],
            [[0, 1]],
            [conversation(2, 8, 24, 120, 6)],
            8 * MiB,
            initial_pool_ratio=[0.8, 0.2],
            **REBALANCE,
        ),
    ]
    outcomes = spawn(tmp_path, 2, "generate", jobs)
    for number, name in enumerate(models):
        by_rank = [outcome[number] for outcome in outcomes]
        check_node(by_rank, weights[name], [0, 1])
        first = by_rank[0]
        assert first["suspensions"] > 0 and first["moved"][1] > 0 and first["moved"][2] > 0
    hybrid_ranks = [outcome[1] for outcome in outcomes]
    assert hybrid_ranks[0]["adjusted_at"], "the estimator never asked for a rebalance"
    assert any(hybrid_ranks[0]["local_need"]) and not any(hybrid_ranks[1]["local_need"])
    split = hybrid_ranks[0]["slot_counts"][0]
    assert split != [128, 128]  # the GPU level was re-split from its initial 0.75 / 0.25
    # Each rank's pages hold its own KV heads: half of them.
    assert outcomes[0][0]["slot_bytes"] == 1 * 128 * 4 * 8  # one of Llama's 2 KV heads each


@pytest.mark.slow
def test_four_ranks_replicate_kv_heads_and_two_nodes_run_their_own_replicas(tmp_path):
    """TP=4 on a model with 2 KV heads (each rank holds one, replicated as engines do), then
    the same 4 processes as two "nodes" of TP=2, each with its own prompts. The model has MLP
    and attention biases (issue 30: gate/up biases split with their columns, down and output
    biases added once)."""
    config = llama(mlp_bias=True, attention_bias=True)
    model = with_random_biases(model_of(config, seed=4))
    assert "model.layers.0.mlp.up_proj.bias" in model.state_dict()
    jobs = [
        job(config, model, [[0, 1, 2, 3]], [conversation(3, 6, 40, 30, 4)], 2 * MiB),
        job(
            config,
            model,
            [[0, 1], [2, 3]],
            [conversation(4, 4, 32, 20, 4), conversation(5, 4, 32, 20, 4)],
            2 * MiB,
        ),
    ]
    outcomes = spawn(tmp_path, 4, "generate", jobs)
    whole = [outcome[0] for outcome in outcomes]
    check_node(whole, model, [0, 1, 2, 3])
    assert whole[0]["slot_bytes"] == 1 * 128 * 4 * 8
    nodes = [outcome[1] for outcome in outcomes]
    assert [n["node"] for n in nodes] == [0, 0, 1, 1] and [n["tp_rank"] for n in nodes] == [
        0,
        1,
        0,
        1,
    ]
    check_node(nodes, model, [0, 1])
    check_node(nodes, model, [2, 3])
    assert nodes[0]["rounds"][0][0][0] != nodes[2]["rounds"][0][0][0]  # their own prompts


def generations(output):
    """prompt -> printed token ids, from `kvpool generate` output."""
    found = re.findall(r"prompt: '(.*)'\n  output token ids: (\[.*\])", output)
    return {prompt: ids for prompt, ids in found}


@pytest.mark.slow
def test_torchrun_over_two_nodes_matches_one_process(tmp_path, capsys):
    """Two "machines" on one: two torchrun launches (--nnodes 2, one per node rank) meeting at
    a c10d rendezvous, two processes each; each node's pair is one tensor-parallel replica."""
    prompts = ["one prompt", "two prompts", "three prompts", "four"]
    flags = ["generate", "--tiny", "llama", "--max-new-tokens", "5"]
    flags += [arg for prompt in prompts for arg in ("--prompt", prompt)]
    endpoint = f"127.0.0.1:{free_port()}"
    launches = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
            ]
            + ["--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
            + ["-m", "kvpool.cli", *flags, "--tensor-parallel", "2", "--check-agreement"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
        )
        for node in (0, 1)
    ]
    outputs = [launch.communicate(timeout=240)[0] for launch in launches]
    assert [launch.returncode for launch in launches] == [0, 0], outputs
    assert "replica 0 of 2 (ranks 0-1, tensor parallel 2)" in outputs[0], outputs[0]
    assert "replica 1 of 2 (ranks 2-3, tensor parallel 2)" in outputs[1], outputs[1]
    assert all("checked equal on every rank" in output for output in outputs)
    from kvpool.cli import main

    assert main(flags) == 0  # one process
    alone = generations(capsys.readouterr().out)
    assert generations(outputs[0]) == {p: alone[p] for p in prompts[0::2]}
    assert generations(outputs[1]) == {p: alone[p] for p in prompts[1::2]}


def test_a_rank_that_diverges_is_named_on_the_step_it_does(tmp_path):
    outcomes = spawn(tmp_path, 2, "diverge")
    for outcome in outcomes:
        assert outcome["ended"] == list(range(outcome["diverges_at"]))  # agreed until then
        message = outcome["message"]
        assert message is not None and f"step {outcome['diverges_at'] + 1}:" in message
        assert "'drop'" in message and "rank 1" in message, message


def test_ranks_on_their_own_clocks_agree_with_the_default_policy_once_it_has_learned(tmp_path):
    """Issue 30: the hazard policy read each process's clock, and ranks dropped different
    blocks once it had learned (a DivergenceError within a few hundred steps). Its time is
    now the inflow of blocks, the same on every rank."""
    outcomes = spawn(tmp_path, 2, "policy_agreement", 1500)
    for outcome in outcomes:
        assert outcome["message"] is None, outcome["message"]
        assert outcome["steps"] == 1500
        # The run reached the regime that matters: the policy learned and classed pages,
        # many capacities of blocks came in, the host level took evicted pages and dropped.
        assert outcome["learned"] and outcome["classed"] > 0
        assert outcome["inflow"] > 4 * outcome["capacity"]
        assert outcome["dropped"] > 0 and outcome["moved"][1] > 0
    assert outcomes[0]["hits"] == outcomes[1]["hits"] > 0


def test_need_adjustment_is_agreed_in_both_modes(tmp_path):
    outcomes = spawn(tmp_path, 2, "agreement_modes")
    for rank, outcome in enumerate(outcomes):
        broadcast, any_rank = outcome["broadcast"], outcome["any"]
        # Broadcast: rank 0's cooldown passed, rank 1's clock is stuck; both re-split alike.
        assert broadcast["local"] == (rank == 0) and broadcast["agreed"]
        assert broadcast["after"] != broadcast["before"]
        # Any: only rank 1 saw requests; both agree to adjust, each toward its own targets.
        assert any_rank["local"] == (rank == 1) and any_rank["agreed"]
        assert (any_rank["after"] != any_rank["before"]) == (rank == 1)
    assert outcomes[0]["broadcast"]["after"] == outcomes[1]["broadcast"]["after"]


@pytest.fixture
def one_process_group():
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    yield
    dist.destroy_process_group()


def test_agreement_refuses_bad_arguments(one_process_group):
    from kvpool.distributed import Agreement

    manager = KVCacheManager(make_config(layers=[kv_layer(0)], tiers=[GpuCacheTierConfig(2 * MiB)]))
    with pytest.raises(
        ArgumentError, match=r"mode='all' is invalid: must be one of \['broadcast', 'any'\]"
    ):
        Agreement(manager, mode="all")
    with pytest.raises(ArgumentError, match=r"src=1 is invalid: must be an integer in \[0, 0\]"):
        Agreement(manager, src=1)
    with pytest.raises(ArgumentError, match=r"check=1 is invalid"):
        Agreement(manager, check=1)
    with pytest.raises(ArgumentError, match=r"interval=0 is invalid: must be an integer >= 1"):
        Agreement(manager, interval=0)
    with pytest.raises(ArgumentError, match=r"on='yes' is invalid"):
        manager.record_decisions("yes")
    agreement = Agreement(manager, check=True)
    assert not agreement.need_adjustment()
    agreement.end_step()  # one rank agrees with itself
    manager.shutdown()


def test_agreement_needs_an_initialized_process_group():
    from kvpool.distributed import Agreement

    manager = KVCacheManager(make_config(layers=[kv_layer(0)], tiers=[GpuCacheTierConfig(2 * MiB)]))
    with pytest.raises(ArgumentError, match=r"torch\.distributed initialized"):
        Agreement(manager)
    manager.shutdown()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "expected"),
    [(4, 2, 2, (2, 1)), (4, 2, 4, (1, 1)), (8, 8, 4, (2, 2)), (4, 4, 1, (4, 4))],
)
def test_kv_head_split(heads, kv_heads, size, expected):
    assert kv_head_split(heads, kv_heads, size) == expected


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "message"),
    [
        (4, 2, 3, r"num_attention_heads=4 is invalid for tensor_parallel_size=3"),
        (12, 3, 2, r"num_key_value_heads=3 is invalid for tensor_parallel_size=2"),
        (4, 2, 0, r"tensor_parallel_size=0 is invalid"),
    ],
)
def test_kv_head_split_refuses_what_does_not_divide(heads, kv_heads, size, message):
    with pytest.raises(ArgumentError, match=message):
        kv_head_split(heads, kv_heads, size)
