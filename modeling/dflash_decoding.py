"""The DFlash decoding of `target.generate(assistant_model=drafter)` (see dflash_dispatch.py).

generate prepares the generation config, logits processors, stopping criteria and the target's cache as usual,
then hands over to `dflash_generate`, which refuses what DFlash cannot honour before any forward (dflash_checks.py)
and runs the call's rows on the engine (dflash_engine.py, through dflash_fast_path.py): its rows are admitted at
step 0 and each leaves the batch the step it ends. Per step the drafter proposes a block after each row's anchor,
the target verifies [anchor, drafts] in one forward, its scores pass the call's processors
(dflash_processors.py), acceptance (dflash_acceptance.py) keeps drafts while the target agrees (greedy, point-mass
or rejection sampling) and adds the target's own token after them. The committed tokens then pass the host hooks
(dflash_host_hooks.py): stopping criteria called one token at a time (so stop strings and custom criteria end
generation exactly where plain generate would), the streamer, per-token scores and logits.

Where the target's keys/values live is the one choice per call. The engine's own paged pool, whenever it can serve
the call (the fast path: fixed device buffers, each full-width step a CUDA graph on a GPU); otherwise transformers'
cache of the call (`TransformersTargetCache`, dflash_target_cache.py: the target runs its own attention and masks
over it, the same step on both sides of it, eagerly), for the calls `fast_path_blocker` names
(dflash_fast_path_blockers.py) or those that ask for it with `dflash_fast_path=False`.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .dflash_acceptance import DecodingRule
from .dflash_checks import check_call
from .dflash_compat import cache_argument, cache_from_kwargs
from .dflash_fast_path import decode_on_engine, engine_for
from .dflash_fast_path_blockers import fast_path_blocker, takes_fast_path
from .dflash_host_hooks import HostHooks
from .dflash_policy import VerifyPolicy
from .dflash_processors import StepProcessors
from .dflash_target_cache import TransformersTargetCache


@dataclass
class DFlashGenerateOutput(GenerateDecoderOnlyOutput):
    """generate's usual output plus, per sequence, the tokens committed at each verify step (accepted drafts + 1, up
    to the first that ends the sequence)."""

    acceptance_lengths: list[list[int]] | None = None


_cache_argument = cache_argument  # the name tests and benchmarks import


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
    `dflash_fast_path` (a generate keyword): where the target's keys/values live. None (the default): the engine's
    paged pool (the fast path, dflash_fast_path.py: a CUDA graph on a GPU, eager on a CPU) whenever it can serve the
    call, else transformers' cache of the call; True insists on the pool (an error names what blocks it); False always
    takes transformers' cache. The step, and the tokens, are the same either way.
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
    instance is used as given, and its cost fit carries over from call to call. On a GPU a policy's steps run as
    two recorded graphs, the drafter's and the verify's at the width chosen on the host between them (rounded up to a
    power of two); at small batches a GPU verifies 16 rows in about the time of one.
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
    paged = takes_fast_path(dflash_fast_path, blocker, input_ids.device)
    # over transformers' cache: built (and its layers prepared) before any forward; it refuses a cache DFlash cannot
    # roll back
    call_cache = None if paged else TransformersTargetCache(target, cache, attention_mask, cache_argument(target))
    engine = engine_for(
        target, drafter, input_ids.shape[0], max_length, dflash_onednn_linears, transformers_cache=not paged,
    )
    # processors that read each row's prefix run on the host: those steps run without a graph, where the compiled
    # drafter's pass gains little (a width chosen per step runs between recorded parts, the drafter's compiled)
    on_host = bool(processors.host_only)
    compile_drafter = engine.use_graphs and not on_host if dflash_compile is None else dflash_compile
    engine.bind(
        processors, rule, host_hooks.keep_scores, host_hooks.keep_logits, compile_drafter, policy, verify_rows,
        host_hooks.tokens,
    )
    # A batch of 1 hands its cache back, where plain generate can continue from it: it holds every committed token
    # but the last, as plain generate's does. The engine's pool copies its keys/values into it, not where the mask
    # holds padding (plain generate's cache holds a slot for each pad, the pool none); transformers' cache of the call
    # is that cache, not where sliding layers were made full-history layers whose front slots were dropped. In a
    # batch, finished sequences left the cache and rows some sequences rejected stay in it (masked for them).
    single = return_dict and input_ids.shape[0] == 1
    if paged:
        returned = cache if single and bool(attention_mask.all()) and engine.hands_back_caches else None
    else:
        returned = cache if single and call_cache.window is None else None
    decode_on_engine(
        engine, input_ids, attention_mask, processors, host_hooks, returned if paged else None, call_cache
    )
    host_hooks.end()
    return _generate_output(host_hooks, return_dict, **{cache_argument(target): returned})


__all__ = ["DFlashGenerateOutput", "dflash_generate"]
