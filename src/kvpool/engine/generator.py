"""Greedy generation in a continuous batch, with every KV byte in kvpool.

Admits prompts while memory allows (reusing cached prefixes: only the unmatched suffix is
computed, always at least the last prompt token; with a length-dependent RoPE, a prompt longer
than the decoder's `reuse_limit` is computed whole in a scope of its own, since its frequencies
are not those of any cached KV, and it leaves no KV for others either), decodes one token per request per step,
suspends requests when the GPU level is full and resumes them later (their pages may travel to
host or disk and back), runs the rebalancing hook between steps, and closes finished requests so
their blocks stay reusable.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvpool.cache import KVCache
from kvpool.config import ReuseScope
from kvpool.distributed import Agreement
from kvpool.engine.model import PagedDecoder
from kvpool.errors import ArgumentError

logger = logging.getLogger("kvpool.engine")


@dataclass
class Generation:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # generated
    logits: list[torch.Tensor] = field(default_factory=list)  # one row per generated token
    cached_tokens: int = 0  # prompt tokens served from the cache
    cache: KVCache | None = None


class Generator:
    def __init__(
        self,
        decoder: PagedDecoder,
        max_batch: int = 8,
        between_steps: Callable[[int], None] | None = None,
        agreement: Agreement | None = None,
    ) -> None:
        """`agreement` (`kvpool.distributed`): rebalance when the ranks agree to, and check
        their decisions each step; needed under tensor parallelism."""
        self.decoder = decoder
        self.manager = decoder.manager
        self.max_batch = max_batch
        self.between_steps = between_steps  # a test hook, called with the step number
        self.agreement = agreement
        self.suspensions = 0
        self.unshared_prompts = 0  # prompts past the decoder's reuse limit (own scope each)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Generation]:
        """Greedy continuations of `prompts`, `max_new_tokens` each. If anything raises (the
        model, the manager, Ctrl-C), every request opened here is closed before the error
        propagates: the manager keeps only reusable committed blocks."""
        if max_new_tokens < 1:
            raise ArgumentError(f"max_new_tokens={max_new_tokens} is invalid: must be >= 1")
        vocab = self.decoder.vocab_size
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ArgumentError(f"prompts[{i}] is empty: a prompt needs at least one token")
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise ArgumentError(
                    f"prompts[{i}] holds token id {bad}, outside the vocabulary [0, {vocab})"
                )
        results = [Generation(list(prompt)) for prompt in prompts]
        try:
            self._run(results, max_new_tokens)
        except BaseException:
            for result in results:
                if result.cache is not None:
                    result.cache.close()
            raise
        return results

    def _run(self, results: list[Generation], max_new_tokens: int) -> None:
        """Each step: rebalance, resume, admit and compute prompts one by one (a later one may
        reuse an earlier one's blocks); grow, suspend or close the running requests, then
        compute their next token. Under tensor parallelism the ranks check that they agree
        before each forward pass or batch of them (whose collectives would otherwise
        mismatch)."""
        waiting = list(range(len(results)))
        running: list[int] = []
        suspended: list[int] = []
        step = 0
        while waiting or running or suspended:
            step += 1
            if step > 100_000:
                raise RuntimeError("generation made no progress")
            if self.between_steps is not None:
                self.between_steps(step)
            self._rebalance()
            may_admit = not suspended
            for index in list(suspended):
                cache = results[index].cache
                assert cache is not None
                if len(running) >= self.max_batch or not cache.resume():
                    break
                if running and not self._room_to_grow():
                    cache.suspend()  # it could not take a step: let the others finish first
                    break
                suspended.remove(index)
                running.append(index)
            prefilled = False
            while may_admit and waiting and len(running) < self.max_batch:
                result = results[waiting[0]]
                if not self._admit(result):
                    break
                running.append(waiting.pop(0))
                self._agree()
                # Computed and committed before the next admission, which may reuse it.
                assert result.cache is not None
                computed = result.prompt[result.cached_tokens :]
                self._emit(result, self.decoder.forward(result.cache, computed))
                result.cache.commit(computed)
                prefilled = True
            decodes: list[int] = []
            closed = False
            for index in list(running):
                result = results[index]
                cache = result.cache
                assert cache is not None
                if len(result.tokens) >= max_new_tokens:
                    cache.close()
                    running.remove(index)
                    closed = True
                elif cache.resize(cache.capacity + 1):
                    decodes.append(index)
                else:
                    cache.suspend()
                    running.remove(index)
                    suspended.append(index)
                    self.suspensions += 1
            self._agree()
            for index in decodes:
                result = results[index]
                assert result.cache is not None
                fed = result.tokens[-1]  # computed now; its logits give the next token
                self._emit(result, self.decoder.forward(result.cache, [fed]))
                result.cache.commit([fed])
            self.manager.flush_kv_events()  # (the step's KV events, one batch)
            if not (prefilled or decodes or closed) and suspended and not running:
                raise RuntimeError("the GPU level cannot hold a single request of this batch")

    def _agree(self) -> None:
        if self.agreement is not None:
            self.agreement.end_step()

    def _rebalance(self) -> None:
        if self.agreement is not None:
            if self.agreement.need_adjustment():
                self.agreement.adjust()
        elif self.manager.need_adjustment:
            self.manager.adjust()

    def _room_to_grow(self) -> bool:
        """Whether every GPU pool group can still give a running request a new block."""
        return all(stats.available > 0 for stats in self.manager.get_storage_statistics(0))

    def _admit(self, result: Generation) -> bool:
        prompt = result.prompt
        scope = None
        limit = self.decoder.reuse_limit
        if limit is not None and len(prompt) > limit:
            if not self.unshared_prompts:
                logger.info(
                    "RoPE frequencies depend on the length: prompts of more than %d tokens "
                    "are computed without prefix reuse and leave no KV for others",
                    limit,
                )
            self.unshared_prompts += 1
            scope = ReuseScope(salt=f"kvpool:unshared:{self.unshared_prompts}")
        cache = self.manager.create_kv_cache(scope, prompt[:-1])
        result.cache = cache
        if not cache.resume() or not cache.resize(len(prompt)):
            cache.close()
            result.cache = None
            return False
        # (read after resume(): a prefix found in a remote tier is final only once fetched)
        result.cached_tokens = cache.num_committed_tokens
        return True

    @staticmethod
    def _emit(result: Generation, logits: torch.Tensor) -> None:
        last = logits[-1]
        result.logits.append(last)
        result.tokens.append(int(torch.argmax(last)))
