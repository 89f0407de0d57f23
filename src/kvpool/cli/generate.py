"""`kvpool generate`: greedy generation with the reference engine, every KV byte in kvpool.

The model is a transformers model directory (safetensors and config.json, optionally a
tokenizer), a GGUF file, or a tiny random model of one of the supported families (`--tiny`,
for trying kvpool without weights). Without a tokenizer (`--tiny`, or a directory without
tokenizer files) prompts are read as UTF-8 bytes and the output is token ids. Prints each
generation and the cache statistics: tokens served from the cache, slots per pool group and
level, pages moved between levels, suspensions.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from kvpool.cli.info import tiers_of
from kvpool.errors import ArgumentError
from kvpool.replay.report import format_bytes

TINY = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "gemma2": "Gemma2Config",
    "gemma3": "Gemma3TextConfig",
}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _engine() -> tuple[Any, Any]:
    try:
        import torch
        import transformers
    except ImportError as error:
        raise ArgumentError(
            f"kvpool generate needs the reference engine's extra ({error.name} is missing): "
            "pip install 'kvpool[engine]'"
        ) from None
    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    return torch, transformers


def _tiny_model(family: str, seed: int) -> tuple[Any, Any, None]:
    torch, transformers = _engine()
    common: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    if family in ("gemma2", "gemma3", "qwen3"):
        common["head_dim"] = 16
    if family in ("gemma2", "gemma3", "mistral"):
        common["sliding_window"] = 64
    if family == "gemma3":
        common["num_hidden_layers"] = 6  # five sliding-window layers, then a full one
    config = getattr(transformers, TINY[family])(**common)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    return model, config, None


def _load(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(model, config, tokenizer or None)."""
    torch, transformers = _engine()
    if args.tiny:
        return _tiny_model(args.tiny, args.seed)
    if args.gguf:
        folder, name = os.path.split(os.path.abspath(args.gguf))
        if not os.path.isfile(args.gguf):
            raise ArgumentError(f"--gguf {args.gguf!r}: no such file")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        return model.eval(), model.config, tokenizer
    if not os.path.isfile(os.path.join(args.model_dir, "config.json")):
        raise ArgumentError(f"--model-dir {args.model_dir!r}: no config.json there")
    from kvpool.engine.spec import model_spec

    # Refuse what the engine does not implement by its config field, before loading weights.
    model_spec(transformers.AutoConfig.from_pretrained(args.model_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tokenizer = None
    # Without tokenizer files transformers builds an empty tokenizer that encodes to nothing.
    if any(os.path.isfile(os.path.join(args.model_dir, name)) for name in TOKENIZER_FILES):
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
    return model.eval(), model.config, tokenizer


def _prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as file:
                prompts = [line.rstrip("\n") for line in file if line.strip()]
        except (OSError, UnicodeDecodeError) as error:
            raise ArgumentError(f"--prompts-file {args.prompts_file!r}: {error}") from None
    else:
        prompts = list(args.prompt)
    if not prompts:
        raise ArgumentError("no prompt: give --prompt TEXT (repeatable) or --prompts-file FILE")
    return prompts


@dataclass
class Replica:
    """Where this process stands when torchrun launched several: its tensor-parallel group
    (`tensor_parallel` consecutive ranks form one replica of the model) and which replica."""

    group: Any
    index: int
    count: int
    first_rank: int


def _join(args: argparse.Namespace) -> Replica | None:
    """Under torchrun (WORLD_SIZE > 1): join the process group (gloo: the reference engine
    computes on the CPU) and this rank's replica; None when run alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    size = args.tensor_parallel or world
    if world == 1:
        if size != 1:
            raise ArgumentError(
                f"--tensor-parallel {size} needs {size} processes: launch with "
                f"torchrun --nproc-per-node {size} -m kvpool.cli generate ..."
            )
        return None
    if world % size:
        raise ArgumentError(
            f"--tensor-parallel {size} is invalid: must divide the {world} processes torchrun started"
        )
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = [dist.new_group(list(range(i, i + size))) for i in range(0, world, size)]
    return Replica(groups[rank // size], rank // size, world // size, rank // size * size)


def generate_command(args: argparse.Namespace) -> int:
    prompts = _prompts(args)
    replica = _join(args)
    try:
        return _generate(args, prompts, replica)
    finally:
        if replica is not None:
            import torch.distributed as dist

            dist.destroy_process_group()


def _generate(args: argparse.Namespace, prompts: list[str], replica: Replica | None) -> int:
    from kvpool.cli.info import build_manager
    from kvpool.distributed import Agreement
    from kvpool.engine import Generator, PagedDecoder, manager_config_from_hf
    from kvpool.engine.parallel import TensorParallel

    tp = TensorParallel.of(replica.group) if replica is not None else TensorParallel(0, 1)
    if replica is not None:  # the replicas share the prompts out
        prompts = prompts[replica.index :: replica.count]
    model, config, tokenizer = _load(args)
    if tokenizer is None:
        vocab = int(config.vocab_size)
        encoded = [[byte % vocab for byte in text.encode()] or [0] for text in prompts]
    else:
        encoded = [tokenizer(text).input_ids for text in prompts]
        for text, ids in zip(prompts, encoded, strict=True):
            if not ids:
                raise ArgumentError(f"prompt {text!r} encodes to no tokens with this tokenizer")
    manager_config = manager_config_from_hf(
        config, args.tokens_per_block, args.gpu, tensor_parallel_size=tp.size
    )
    manager_config.cache_tiers = tiers_of(args)
    manager = build_manager(manager_config)
    try:
        decoder = PagedDecoder(config, model.state_dict(), manager, tensor_parallel=tp)
        agreement = None
        if replica is not None:
            agreement = Agreement(manager, replica.group, check=args.check_agreement)
        generator = Generator(decoder, max_batch=args.max_batch, agreement=agreement)
        results = generator.generate(encoded, args.max_new_tokens) if encoded else []
        if tp.rank != 0:
            return 0
        if replica is not None:
            last = replica.first_rank + tp.size - 1
            print(
                f"replica {replica.index} of {replica.count} "
                f"(ranks {replica.first_rank}-{last}, tensor parallel {tp.size}):"
            )
        for text, result in zip(prompts, results, strict=True):
            output = tokenizer.decode(result.tokens) if tokenizer is not None else result.tokens
            print(f"prompt: {text!r}")
            print(
                f"  output: {output!r}"
                if tokenizer is not None
                else f"  output token ids: {output}"
            )
            print(f"  {len(result.prompt)} prompt tokens, {result.cached_tokens} from the cache")
        print("cache" + (" (each rank's, for its KV heads):" if tp.size > 1 else ":"))
        for level in range(manager.num_levels):
            stats = manager.get_storage_statistics(level)
            print(
                f"  {manager.get_tier(level).name}: quota {format_bytes(manager.get_quota(level))}, "
                + ", ".join(
                    f"{s.total - s.free}/{s.total} slots used ({s.evictable} cached)" for s in stats
                )
                + f", {manager.num_moved_pages[level]} pages moved in"
            )
        print(f"  suspensions {generator.suspensions}, dropped pages {manager.num_dropped_pages}")
        if agreement is not None:
            checked = "checked equal on every rank" if args.check_agreement else "not checked"
            print(
                f"  {agreement.step} scheduling steps ({checked}), {agreement.num_adjustments} rebalances"
            )
    finally:
        manager.clear_reusable_blocks()
        manager.shutdown()
    return 0


def add_generate_parser(commands: Any, formatter: Any, memory_flags: Any) -> None:
    parser = commands.add_parser(
        "generate",
        help="greedy generation with the reference engine, KV in kvpool",
        formatter_class=formatter,
        description=__doc__,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-dir", metavar="DIR", help="a transformers model directory")
    source.add_argument("--gguf", metavar="FILE", help="a GGUF model file")
    source.add_argument("--tiny", choices=sorted(TINY), help="a tiny random model of this family")
    text = parser.add_mutually_exclusive_group()
    text.add_argument(
        "--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable)"
    )
    text.add_argument("--prompts-file", metavar="FILE", help="one prompt per line")
    from kvpool.cli.arguments import int_at_least

    parser.add_argument(
        "--max-new-tokens",
        type=int_at_least(1),
        default=32,
        metavar="N",
        help="tokens to generate per prompt",
    )
    parser.add_argument(
        "--max-batch", type=int_at_least(1), default=8, metavar="N", help="requests per step"
    )
    parser.add_argument(
        "--tokens-per-block", type=int_at_least(1), default=16, metavar="N", help="block size"
    )
    parser.add_argument("--seed", type=int_at_least(0), default=0, help="seed of a --tiny model")
    parser.add_argument(
        "--tensor-parallel",
        type=int_at_least(1),
        metavar="N",
        help="ranks per model replica under torchrun (default: all of them)",
    )
    parser.add_argument(
        "--check-agreement",
        action="store_true",
        help="under torchrun: compare every step's cache decisions across the ranks",
    )
    memory_flags(parser, gpu="256MiB", host="0")
    parser.set_defaults(run=generate_command)


__all__ = ["add_generate_parser", "generate_command"]
