"""The DFlash decoding loop, run by `target.generate(assistant_model=drafter)` (see dflash_dispatch.py).

generate prepares the generation config, logits processors, stopping criteria and the target's cache as usual,
then hands over to `dflash_generate`, which refuses what DFlash cannot honour before any forward (dflash_checks.py)
and runs one of two loops over the same step parts:
1. prefill (dflash_prefill.py): the target reads the prompt, hooks capture the chosen layers, the target picks the
   first token under the call's processors;
2. per step: the drafter proposes a block after the anchor (the last committed token;
   `DFlashCandidateGenerator.draft_rows`, then the drafter's `propose`); the target verifies [anchor, drafts] in one
   forward; its scores at every row go through the call's processors (dflash_processors.py); acceptance
   (dflash_acceptance.py) keeps drafts while the target agrees (greedy, point-mass or rejection sampling) and adds
   the target's own token after them; the target cache goes back to the committed length (dflash_target_cache.py:
   full, sliding-window and Gated DeltaNet layers) and the accepted rows become drafter context.
The fast path (dflash_fast_path.py) runs the call's rows on the continuous-batching engine (fixed device buffers,
each full-width step a CUDA graph on a GPU), on any device, whenever it can serve the call; `EagerDecoding` runs the
step's parts around transformers' own cache for the calls it cannot (dflash_fast_path_blockers.py). Either way
the committed tokens then pass the same host hooks (dflash_host_hooks.py): stopping criteria called one token at a
time (so stop strings and custom criteria end generation exactly where plain generate would), the streamer,
per-token scores and logits.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .dflash_acceptance import DecodingRule, accept, width_confidence
from .dflash_candidate_generator import DFlashCandidateGenerator
from .dflash_checks import check_call
from .dflash_compat import cache_argument, cache_from_kwargs
from .dflash_fast_path import decode_on_engine, engine_for
from .dflash_fast_path_blockers import fast_path_blocker, takes_fast_path
from .dflash_host_hooks import HostHooks
from .dflash_policy import VerifyPolicy
from .dflash_prefill import prefill
from .dflash_processors import StepProcessors
from .dflash_target_cache import TargetCacheRollback


@dataclass
class DFlashGenerateOutput(GenerateDecoderOnlyOutput):
    """generate's usual output plus, per sequence, the tokens committed at each verify step (accepted drafts + 1, up
    to the first that ends the sequence)."""

    acceptance_lengths: list[list[int]] | None = None


_cache_argument = cache_argument  # the name tests and benchmarks import


@contextlib.contextmanager
def _pages_returned(generator: DFlashCandidateGenerator) -> Iterator[None]:
    """Every sequence's drafter pages return to the pool when the block ends, also when an exception escapes it."""
    try:
        yield
    finally:
        generator.release()


class EagerDecoding:
    """The eager loop for one call: the same proposal, processors and acceptance as the fast path's step, around
    transformers' own cache; committed tokens pass the same host hooks (`host_hooks`, which keeps the sequences).

    `live` maps batch rows to sequences (finished ones leave the batch); `presence` (b, V) holds the tokens the
    repetition penalty counts, when there is one; `policy` (dflash_policy.py), when given, chooses each step's width
    under the `verify_rows` cap.
    """

    def __init__(
        self, target: torch.nn.Module, drafter: torch.nn.Module, input_ids: torch.LongTensor,
        attention_mask: torch.Tensor, cache: Any, processors: StepProcessors, rule: DecodingRule, host_hooks: HostHooks,
        verify_rows: int, policy: VerifyPolicy | None = None,
    ):
        batch_size, prompt_len = input_ids.shape
        self.target, self.cache, self.cache_arg = target, cache, cache_argument(target)
        self.target_cache = TargetCacheRollback(target, cache)  # prepares the cache's layers before the prompt
        self.input_ids, self.attention_mask = input_ids, attention_mask
        self.processors, self.rule, self.verify_rows = processors, rule, verify_rows
        self.policy = policy  # chooses per step whether to draft and how many rows to verify (None: always the cap)
        if policy is not None:
            policy.start(batch_size)
        self.host_hooks = host_hooks
        self.live = list(range(batch_size))
        self.presence: torch.Tensor | None = None
        # With a policy, plain steps may leave their rows waiting (`take_context(defer=True)`): room for two blocks.
        block_size = drafter.config.block_size
        self.generator = DFlashCandidateGenerator(
            drafter, target, batch_size, host_hooks.max_length, max_rows=max(prompt_len, block_size),
            pending_rows=block_size if policy is None else 2 * block_size,
        )

    def run(self) -> None:
        # Hooks live exactly as long as this block and the pages go back to the pool when it ends: the target leaves
        # generate as it came in, even on error.
        with self.generator.capture, _pages_returned(self.generator):
            running = self.prefill()
            while running:
                self.drop_finished(running)
                running = self.step()

    def prefill(self) -> list[int]:
        """The prompt forward (dflash_prefill.py) into transformers' cache. Returns the batch rows still running."""
        tokens, scores, logits = prefill(
            self.target, self.generator, self.input_ids, self.attention_mask, {self.cache_arg: self.cache},
            self.processors, self.rule.do_sample,
        )
        self.target_cache.after_prefill(self.attention_mask)
        # The prompt's rows are in the drafter's pages now; a verify captures at most a block.
        self.generator.resize_scratch(self.generator.block_size)
        self.presence = self.processors.prompt_presence(self.input_ids, logits.shape[-1])
        return self.commit(tokens[:, None].tolist(), scores, logits)

    def returned_cache(self) -> Any:
        """The cache for generate's output where plain generate can continue from it: a batch of 1 on a target without
        sliding layers, where it holds every committed token but the last, as plain generate's does. Otherwise None:
        in a batch, finished sequences left the cache and rows some sequences rejected stay in it (masked for them),
        and sliding layers were made full-history layers whose front slots were dropped."""
        if len(self.host_hooks.tokens) == 1 and self.target_cache.window is None:
            return self.cache
        return None

    def drop_finished(self, running: list[int]) -> None:
        """Finished sequences stop costing work: their cache rows, mask rows and drafter states go."""
        if len(running) == len(self.live):
            return
        index = torch.tensor(running, device=self.input_ids.device)
        self.target_cache.keep(index)
        self.attention_mask = self.attention_mask[index]
        self.generator.keep(running)
        self.live = [self.live[row] for row in running]

    def step(self) -> list[int]:
        """Draft, verify, accept, commit. Returns the batch rows still running.

        With a `policy` (dflash_policy.py) the step may skip the drafter and verify the anchor alone (a plain decoding
        step), or verify fewer rows than `verify_rows`, which stays the cap; the timings it measures feed the policy.
        """
        device, live = self.input_ids.device, self.live
        rows = torch.tensor(live, device=device)
        sequences = [self.host_hooks.tokens[seq] for seq in live]
        lengths = torch.tensor([len(tokens) for tokens in sequences], device=device)
        # never verify past max_length: a sequence with r tokens left commits at most r
        room = [self.host_hooks.max_length - len(tokens) for tokens in sequences]
        num_rows = min(self.verify_rows, max(room))
        anchors = torch.tensor([tokens[-1:] for tokens in sequences], device=device)  # (b, 1)
        policy, confidence, draft_probs = self.policy, None, None
        started = time.perf_counter()
        if policy is None or num_rows > 1 and policy.should_draft(live):
            # [anchor, the drafter's proposal of B - 1 rows], and their logits; the step keeps the first num_rows - 1
            candidates, draft_logits = self.generator.get_candidates(anchors, rule=self.rule)
            drafts = candidates[:, 1:]
            if self.rule.rejection:  # the sampled drafts together with the distributions they were drawn from
                # the drafter's proposal comes from the lm_head's device; the target's scores are on the inputs'
                proposal = self.generator.proposal
                drafts, draft_probs = proposal.drafts.to(device), proposal.probs.to(device)
            if policy is not None:
                selector = self.generator.drafter.config.is_dflash2
                # (b, B - 1), a host sync
                confidence = width_confidence(self.generator.proposal, draft_logits, selector).tolist()
                num_rows = policy.width(live, confidence, num_rows)
            drafts = drafts[:, : num_rows - 1]
            draft_probs = None if draft_probs is None else draft_probs[:, : num_rows - 1]
        else:  # a plain step: no drafts; the last verify's rows become drafter context, now or with a later step's
            self.generator.take_context(defer=True)
            num_rows, drafts = 1, anchors[:, :0]
        drafted = time.perf_counter()
        block = torch.cat([anchors, drafts], dim=1)  # (b, n): [anchor, drafts]
        anchor_positions = torch.tensor([s.ctx_len for s in self.generator.states], device=device)  # padding excluded
        self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones(len(live), num_rows)], dim=1)
        self.generator.capture_rows(num_rows)
        with self.target_cache.verifying() as cache:
            logits = self.target(
                input_ids=block,
                attention_mask=self.target_cache.verify_mask(self.attention_mask, num_rows),
                position_ids=anchor_positions[:, None] + torch.arange(num_rows, device=device),
                use_cache=True,
                logits_to_keep=num_rows,
                **{self.cache_arg: cache},
            ).logits
        # the committed prefixes, which only processors that run on the host read
        prefixes = None
        if self.processors.host_only:
            prefixes = [torch.tensor([tokens], device=device) for tokens in sequences]
        presence = None if self.presence is None else self.presence[rows]
        scores = self.processors(logits, lengths, presence, drafts, prefixes)
        tokens, accepted = accept(scores, drafts, self.rule.do_sample, draft_probs)
        accepted = torch.minimum(accepted, torch.tensor(room, device=device) - 1).tolist()  # the step's host sync
        self.attention_mask = self.target_cache.rollback(self.attention_mask, num_rows, accepted)
        self.generator.update_candidate_strategy(block, scores, accepted)
        if policy is not None:
            draft_seconds = None if confidence is None else drafted - started
            policy.record(live, num_rows, accepted, confidence, draft_seconds, time.perf_counter() - drafted)
        return self.commit(
            [row_tokens[: taken + 1] for row_tokens, taken in zip(tokens.tolist(), accepted)], scores, logits,
            verified=True,
        )

    def commit(
        self, row_tokens: list[list[int]], step_scores: torch.Tensor, step_logits: torch.Tensor, verified: bool = False
    ) -> list[int]:
        """Each live sequence's new tokens pass the host hooks, which stop it at the first token that ends it, exactly
        where plain generate would (`verified`: a verify step's, whose counts the hooks record). step_scores /
        step_logits (b, n, V). Returns the batch rows still running."""
        commit = self.host_hooks.commit_verified if verified else self.host_hooks.commit
        running = []
        for row, (seq, new) in enumerate(zip(self.live, row_tokens)):
            start = len(self.host_hooks.tokens[seq])
            done = commit(seq, new, step_scores[row], step_logits[row])
            if self.presence is not None:
                self.presence[seq, self.host_hooks.tokens[seq][start:]] = True
            if not done:
                running.append(row)
        return running


def _generate_output(host_hooks: HostHooks, return_dict: bool, **cache: Any) -> torch.LongTensor | DFlashGenerateOutput:
    """What generate returns: the sequences, or with return_dict_in_generate the output object (`cache`: the
    target's cache under its argument name, when the loop used transformers' own)."""
    sequences = host_hooks.output_sequences()
    if not return_dict:
        return sequences
    return DFlashGenerateOutput(
        sequences=sequences,
        scores=tuple(host_hooks.scores) if host_hooks.keep_scores else None,
        logits=tuple(host_hooks.raw_logits) if host_hooks.keep_logits else None,
        acceptance_lengths=host_hooks.acceptance_lengths,
        **cache,
    )


def adaptive_policy(adaptive: bool | VerifyPolicy) -> VerifyPolicy | None:
    """The call's verify policy from `dflash_adaptive` (see `dflash_generate`), or None for full-width steps."""
    if isinstance(adaptive, VerifyPolicy):
        return adaptive
    if not isinstance(adaptive, bool):
        raise ValueError(f"dflash_adaptive must be True, False or a VerifyPolicy, got {adaptive!r}")
    return VerifyPolicy() if adaptive else None


def dflash_generate(
    model: torch.nn.Module,
    input_ids: torch.LongTensor,
    logits_processor: Any,
    stopping_criteria: Any,
    generation_config: Any,
    streamer: Any = None,
    drafter: torch.nn.Module | None = None,
    dflash_sampling: str = "rejection",
    dflash_verify_rows: int | None = None,
    dflash_fast_path: bool | None = None,
    dflash_compile: bool | None = None,
    dflash_adaptive: bool | VerifyPolicy = False,
    dflash_onednn_linears: bool | None = None,
    **model_kwargs: Any,
) -> torch.LongTensor | DFlashGenerateOutput:
    """Speculative decoding of `model` (the target) with a DFlash `drafter`; a `custom_generate` for generate.

    `dflash_sampling` (a generate keyword) picks the acceptance rule under do_sample: "rejection" (the default)
    samples drafts from the drafter's distribution (at the generation temperature) and runs full rejection
    sampling; "point_mass" proposes the drafter's argmax and accepts it when it equals the target's sample. Both
    are exact; rejection gave the higher tau with our SmolLM2 drafter (benchmarks/sampling.md).
    `dflash_verify_rows` (a generate keyword, default: the block size) caps the rows the target verifies per step,
    anchor included: where a target forward costs in proportion to its rows (a CPU), verifying only the drafts that
    are likely to be accepted is cheaper. It never changes the output.
    `dflash_fast_path` (a generate keyword): None (the default) takes the fast path (dflash_fast_path.py: the
    engine's step, a CUDA graph on a GPU, eager on a CPU) whenever it can serve the call; True insists (an error
    names what blocks it); False always takes the eager loop (`EagerDecoding`). The tokens are the same either way.
    `dflash_compile` (a generate keyword): whether the fast path compiles its drafter pass with torch.compile before
    recording it (dflash_fast_path.py). None (the default) compiles where the step is recorded as a CUDA graph; True
    compiles also where it is not (a CPU); False keeps it eager. Only proposals can differ, never the output.
    `dflash_adaptive` (a generate keyword): whether a `VerifyPolicy` (dflash_policy.py) picks each step's rows,
    under the `dflash_verify_rows` cap, from the drafter's confidence in this block, the sequence's recent acceptance
    and the measured cost of a verify on this machine, down to one row and no drafting where speculation does not
    pay. It pays where a verify costs about in proportion to its rows: a CPU (`hf-dflash generate` turns it on
    there). False (the default) verifies every step at the full width (or `dflash_verify_rows`), so that
    `acceptance_lengths` measure the drafter and a run repeats exactly: with a policy the widths follow measured
    timings, which changes tau and, under sampling, which random numbers are drawn (the tokens stay exactly
    target-distributed, and greedy tokens never change). True makes a policy for this call; a `VerifyPolicy`
    instance is used as given, and its cost fit carries over from call to call. With a policy or a
    `dflash_verify_rows` cap the engine's steps run without a graph (the width is chosen on the host), and at small
    batches a GPU verifies 16 rows in about the time of one.
    `dflash_onednn_linears` (a generate keyword): on a CPU, whether the engine runs the drafter's pass and every
    verify (drafts, or a plain step) over float32 linear weights prepacked for oneDNN (dflash_cpu_linears.py; a
    second copy of them, held with the engine until `release_fast_path(drafter)`). None (the default): where it pays
    and fits; False: never; True: required. The prompt's forward always runs the target's own layers.
    """
    target = model
    rule = DecodingRule.for_call(generation_config, dflash_sampling)
    check_call(target, drafter, input_ids, logits_processor, generation_config, streamer, model_kwargs)
    block_size = drafter.config.block_size
    if dflash_verify_rows is not None and not 1 <= dflash_verify_rows <= block_size:
        raise ValueError(f"dflash_verify_rows must be between 1 and the block size {block_size}, got {dflash_verify_rows}")
    verify_rows = dflash_verify_rows or block_size
    policy = adaptive_policy(dflash_adaptive)
    cache = cache_from_kwargs(model_kwargs)
    processors = StepProcessors(logits_processor)
    attention_mask = model_kwargs.get("attention_mask")
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
    max_length = generation_config.max_length
    host_hooks = HostHooks(input_ids, generation_config, stopping_criteria, streamer)
    return_dict = generation_config.return_dict_in_generate
    blocker = fast_path_blocker(target, drafter, attention_mask)
    if dflash_onednn_linears and (dflash_fast_path is False or blocker is not None):
        why = f"it cannot serve this call: {blocker}" if blocker else "dflash_fast_path=False asks for the eager loop"
        raise ValueError(f"dflash_onednn_linears=True runs on the engine's step, but {why}")
    if takes_fast_path(dflash_fast_path, blocker, input_ids.device):
        engine = engine_for(target, drafter, input_ids.shape[0], max_length, dflash_onednn_linears)
        # a width chosen per step (the policy, or the cap) and processors that read each row's prefix run on the
        # host: those steps run without a graph
        on_host = policy is not None or verify_rows < block_size or bool(processors.host_only)
        compile_drafter = engine.use_graphs and not on_host if dflash_compile is None else dflash_compile
        engine.bind(
            processors, rule, host_hooks.keep_scores, host_hooks.keep_logits, compile_drafter, policy, verify_rows,
            host_hooks.tokens,
        )
        # as the eager loop's `returned_cache`: a batch of 1, where plain generate can continue from the cache. Not
        # where the mask holds padding: plain generate's cache holds a slot for each pad, the engine none
        unpadded = bool(attention_mask.all())
        returned = cache if return_dict and input_ids.shape[0] == 1 and unpadded and engine.hands_back_caches else None
        decode_on_engine(engine, input_ids, attention_mask, processors, host_hooks, returned)
        host_hooks.end()
        return _generate_output(host_hooks, return_dict, **{cache_argument(target): returned})
    loop = EagerDecoding(
        target, drafter, input_ids, attention_mask, cache, processors, rule, host_hooks, verify_rows, policy
    )
    loop.run()
    host_hooks.end()
    returned = {loop.cache_arg: loop.returned_cache()}
    return _generate_output(host_hooks, return_dict, **returned)


__all__ = ["DFlashGenerateOutput", "EagerDecoding", "dflash_generate"]
