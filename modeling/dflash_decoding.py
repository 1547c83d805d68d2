"""The DFlash decoding loop, run by `target.generate(assistant_model=drafter)` (see dflash_dispatch.py).

generate prepares the generation config, logits processors, stopping criteria and the target's cache as usual,
then hands over to `dflash_generate`, which refuses what DFlash cannot honour before any forward and runs one of two
loops over the same step parts:
1. prefill (dflash_prefill.py): the target reads the prompt, hooks capture the chosen layers, the target picks the
   first token under the call's processors;
2. per step: the drafter proposes a block after the anchor (the last committed token;
   `DFlashCandidateGenerator.draft_logits`); the target verifies [anchor, drafts] in one forward; its scores at every
   row go through the call's processors (dflash_processors.py); acceptance (dflash_acceptance.py) keeps drafts while
   the target agrees (greedy, point-mass or rejection sampling) and adds the target's own token after them; the
   target cache goes back to the committed length (dflash_target_cache.py: full, sliding-window and Gated DeltaNet
   layers) and the accepted rows become drafter context.
The fast path (dflash_fast_path.py) runs a step on fixed device buffers, as a CUDA graph on a GPU; `EagerDecoding`
runs it around transformers' own cache. Either way the committed tokens then pass the same host hooks
(dflash_host_hooks.py): stopping criteria called one token at a time (so stop strings and custom criteria end
generation exactly where plain generate would), the streamer, per-token scores and logits.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .dflash_acceptance import DecodingRule, accept
from .dflash_candidate_generator import DFlashCandidateGenerator
from .dflash_fast_path import DFlashStaticStep, fast_path_blocker, static_step_for, takes_fast_path
from .dflash_host_hooks import HostHooks
from .dflash_prefill import prefill
from .dflash_processors import StepProcessors, check_logits_processors
from .dflash_target_cache import TargetCacheRollback, rollback_problem


@dataclass
class DFlashGenerateOutput(GenerateDecoderOnlyOutput):
    """generate's usual output plus, per sequence, the tokens committed at each verify step (accepted drafts + 1)."""

    acceptance_lengths: list[list[int]] | None = None


def _cache_argument(model: torch.nn.Module) -> str:
    """transformers renamed the forward's cache argument `past_key_values` -> `cache` in 5.24."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def fit_problems(
    config: Any, target_config: Any, embedding_rows: int | None = None, lm_head_rows: int | None = None
) -> list[str]:
    """What stops a drafter with `config` from serving a target with `target_config`; empty when it fits.

    Works from configs alone (`hf-dflash info`); pass the row counts of the loaded target's input embedding and
    lm_head when you have them, since they can differ from the config's `vocab_size` (resized embeddings).
    """
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    embedding_rows = text.vocab_size if embedding_rows is None else embedding_rows
    lm_head_rows = text.vocab_size if lm_head_rows is None else lm_head_rows
    problems = []
    if config.target_hidden_size != text.hidden_size:
        problems.append(
            f"the drafter reads target hidden states of width {config.target_hidden_size}, the target's are "
            f"{text.hidden_size}"
        )
    if config.mask_token_id is None or not 0 <= config.mask_token_id < embedding_rows:
        problems.append(
            f"mask_token_id {config.mask_token_id} is not a row of the target's embedding (0..{embedding_rows - 1})"
        )
    if config.vocab_size != lm_head_rows:
        problems.append(
            f"the drafter expects a vocabulary of {config.vocab_size}, the target's lm_head has {lm_head_rows}"
        )
    bad_layers = [i for i in config.target_layer_ids if not 0 <= i < text.num_hidden_layers]
    if bad_layers:
        problems.append(
            f"target_layer_ids {bad_layers} do not exist in the target ({text.num_hidden_layers} layers, 0-based)"
        )
    # A config that states its target's depth (ours, z-lab's) otherwise gets max(target_layer_ids) + 1: only a stated
    # depth that differs from the target's says the drafter was trained on another model of the same width.
    stated_depth = config.num_target_layers not in (None, max(config.target_layer_ids) + 1)
    if stated_depth and config.num_target_layers != text.num_hidden_layers:
        problems.append(
            f"the drafter was built for a target of {config.num_target_layers} layers, this one has "
            f"{text.num_hidden_layers}"
        )
    return problems


def check_drafter_fits(drafter: torch.nn.Module, target: torch.nn.Module) -> None:
    """Refuse a drafter that cannot serve this target, before any work, naming what differs and the fix."""
    problems = fit_problems(
        drafter.config,
        target.config,
        embedding_rows=target.get_input_embeddings().weight.shape[0],
        lm_head_rows=target.get_output_embeddings().weight.shape[0],
    )
    if problems:
        raise ValueError(
            "this DFlash drafter does not fit the target: "
            + "; ".join(problems)
            + ". Use a drafter trained for this target, or build one with DFlashConfig.for_target(target.config)."
        )
    if any(p.device.type == "meta" for p in drafter.parameters()):
        raise ValueError("the drafter's weights are on the meta device; load them or move the drafter to a device")


# The inputs generate hands the target on every call (it derives position_ids from the attention mask); the DFlash
# loops build their own of each. Any other model input (an image's pixel_values, ...) would not reach the target.
MODEL_INPUTS_DFLASH_BUILDS = frozenset(
    {"attention_mask", "position_ids", "logits_to_keep", "cache", "past_key_values", "use_cache"}
)


def _reaches_the_target(name: str, value: Any) -> bool:
    """Whether a model input would change the target's forward: not when absent or empty (generate passes an empty
    `mm_encoder_outputs` for a text-only call), nor a token-type mask of zeros (every token text, as a multimodal
    processor marks a text-only prompt)."""
    if value is None or (isinstance(value, (dict, list, tuple)) and len(value) == 0):
        return False
    if name.endswith("token_type_ids") and isinstance(value, torch.Tensor):
        return bool(value.any())
    return True


def check_generation_mode(generation_config: Any, model_kwargs: dict[str, Any]) -> None:
    """Refuse what DFlash cannot honour, before any work."""
    if (generation_config.num_beams or 1) > 1:
        raise ValueError("DFlash decodes one hypothesis per sequence: beam search is not supported; set num_beams=1")
    if generation_config.penalty_alpha is not None and generation_config.penalty_alpha > 0:
        raise ValueError("contrastive search (penalty_alpha) is not supported with a DFlash drafter")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError(
            "output_attentions / output_hidden_states are not available on the DFlash path; the target's hidden "
            "states are captured only at the drafter's layers"
        )
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("DFlash needs input_ids (the drafter embeds tokens with the target); pass input_ids")
    unread = sorted(
        name for name, value in model_kwargs.items()
        if name not in MODEL_INPUTS_DFLASH_BUILDS and _reaches_the_target(name, value)
    )
    if unread:
        raise ValueError(
            f"{unread} would not reach the target on the DFlash path, which decodes text from input_ids and "
            "attention_mask alone; drop them, or the drafter"
        )
    if generation_config.constraints is not None or generation_config.force_words_ids is not None:
        raise ValueError("constrained beam search (constraints / force_words_ids) is not supported with a DFlash drafter")
    if generation_config.dola_layers is not None:
        raise ValueError(
            "DoLa decoding (dola_layers) changes the target's distribution, which the DFlash path reproduces exactly: "
            "drop dola_layers or the drafter"
        )
    # Other assistants generate would otherwise ignore silently: the DFlash drafter is the assistant of this call.
    other_assistants = {
        name: getattr(generation_config, name, None)
        for name in ("prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")
        if getattr(generation_config, name, None) not in (None, False)
    }
    if other_assistants:
        raise ValueError(
            f"{other_assistants} choose another assistant; with assistant_model=<DFlash drafter> drop them"
        )
    # Settings of transformers' own assistants; a DFlash drafter always drafts block_size - 1 tokens per step. generate
    # fills unset fields from these defaults, so only a value that differs from them was asked for.
    defaults = generation_config._get_default_generation_params()
    tuned = sorted(
        name
        for name in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
        if getattr(generation_config, name, None) not in (None, defaults.get(name))
    )
    if tuned:
        raise ValueError(
            f"{tuned} do not apply to a DFlash drafter (it drafts block_size - 1 tokens per step); drop them, or pass "
            "dflash_verify_rows=N to verify fewer rows per step"
        )


def _decode_static(
    step: DFlashStaticStep, input_ids: torch.LongTensor, attention_mask: torch.Tensor, processors: StepProcessors,
    host_hooks: HostHooks,
) -> list[list[int]]:
    """The fast path's host loop (dflash_fast_path.py): per step one replay and one read-back of [tokens, accepted]
    per running sequence, whose committed tokens then pass the call's host hooks (`host_hooks`, which keeps the
    sequences). Returns each sequence's acceptance lengths."""
    acceptance_lengths: list[list[int]] = [[] for _ in range(input_ids.shape[0])]
    first, scores, logits = step.prefill(input_ids, attention_mask, host_hooks.max_length, processors)
    running = []
    for i, token in enumerate(first):
        if host_hooks.commit(i, [token], scores[i], logits[i]):
            step.stop(i)
        else:
            running.append(i)
    while running:
        step.compact(running)  # finished sequences leave the step's batch
        out = step.run_step()
        still = []
        for i in running:
            accepted = out[i][-1]
            acceptance_lengths[i].append(accepted + 1)
            if host_hooks.commit(i, out[i][: accepted + 1], *step.verified_rows(i)):
                step.stop(i)
            else:
                still.append(i)
        running = still
    return acceptance_lengths


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
    repetition penalty counts, when there is one.
    """

    def __init__(
        self, target: torch.nn.Module, drafter: torch.nn.Module, input_ids: torch.LongTensor,
        attention_mask: torch.Tensor, cache: Any, processors: StepProcessors, rule: DecodingRule, host_hooks: HostHooks,
        verify_rows: int,
    ):
        batch_size, prompt_len = input_ids.shape
        self.target, self.cache, self.cache_arg = target, cache, _cache_argument(target)
        self.target_cache = TargetCacheRollback(target, cache)  # prepares the cache's layers before the prompt
        self.input_ids, self.attention_mask = input_ids, attention_mask
        self.processors, self.rule, self.verify_rows = processors, rule, verify_rows
        self.host_hooks = host_hooks
        self.live = list(range(batch_size))
        self.acceptance_lengths: list[list[int]] = [[] for _ in range(batch_size)]
        self.presence: torch.Tensor | None = None
        self.generator = DFlashCandidateGenerator(
            drafter, target, batch_size, host_hooks.max_length, max_rows=max(prompt_len, drafter.config.block_size)
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
            self.target, self.generator, self.input_ids, self.attention_mask, self.attention_mask,
            {self.cache_arg: self.cache}, self.processors, self.rule.do_sample,
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
        """Draft, verify, accept, commit. Returns the batch rows still running."""
        device, live = self.input_ids.device, self.live
        rows = torch.tensor(live, device=device)
        sequences = [self.host_hooks.tokens[seq] for seq in live]
        lengths = torch.tensor([len(tokens) for tokens in sequences], device=device)
        # never verify past max_length: a sequence with r tokens left commits at most r
        room = [self.host_hooks.max_length - len(tokens) for tokens in sequences]
        num_rows = min(self.verify_rows, max(room))
        anchors = torch.tensor([tokens[-1:] for tokens in sequences], device=device)  # (b, 1)
        candidates, draft_logits = self.generator.get_candidates(anchors)  # [anchor, argmax drafts], their logits
        drafts, draft_probs = candidates[:, 1:num_rows], None
        if self.rule.rejection:  # drafts sampled from the drafter's own distribution instead of its argmax
            # the drafter's logits come from the lm_head's device; the target's scores are on the inputs'
            drafts, draft_probs = self.rule.propose(draft_logits[:, : num_rows - 1].to(device))
        block = torch.cat([anchors, drafts], dim=1)  # (b, n): [anchor, drafts]
        anchor_positions = torch.tensor([s.ctx_len for s in self.generator.states], device=device)  # padding excluded
        self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones(len(live), num_rows)], dim=1)
        self.generator.capture_rows(num_rows)
        with self.target_cache.verifying():
            logits = self.target(
                input_ids=block,
                attention_mask=self.target_cache.verify_mask(self.attention_mask, num_rows),
                position_ids=anchor_positions[:, None] + torch.arange(num_rows, device=device),
                use_cache=True,
                logits_to_keep=num_rows,
                **{self.cache_arg: self.cache},
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
        for seq, taken in zip(live, accepted):
            self.acceptance_lengths[seq].append(taken + 1)
        return self.commit(
            [row_tokens[: taken + 1] for row_tokens, taken in zip(tokens.tolist(), accepted)], scores, logits
        )

    def commit(self, row_tokens: list[list[int]], step_scores: torch.Tensor, step_logits: torch.Tensor) -> list[int]:
        """Each live sequence's new tokens pass the host hooks, which stop it at the first token that ends it, exactly
        where plain generate would. step_scores / step_logits (b, n, V). Returns the batch rows still running."""
        running = []
        for row, (seq, new) in enumerate(zip(self.live, row_tokens)):
            start = len(self.host_hooks.tokens[seq])
            done = self.host_hooks.commit(seq, new, step_scores[row], step_logits[row])
            if self.presence is not None:
                self.presence[seq, self.host_hooks.tokens[seq][start:]] = True
            if not done:
                running.append(row)
        return running


def _generate_output(
    host_hooks: HostHooks, acceptance_lengths: list[list[int]], return_dict: bool, **cache: Any
) -> torch.LongTensor | DFlashGenerateOutput:
    """What generate returns: the sequences, or with return_dict_in_generate the output object (`cache`: the
    target's cache under its argument name, when the loop used transformers' own)."""
    sequences = host_hooks.output_sequences()
    if not return_dict:
        return sequences
    return DFlashGenerateOutput(
        sequences=sequences,
        scores=tuple(host_hooks.scores) if host_hooks.keep_scores else None,
        logits=tuple(host_hooks.raw_logits) if host_hooks.keep_logits else None,
        acceptance_lengths=acceptance_lengths,
        **cache,
    )


def _check_call(
    target: torch.nn.Module, drafter: torch.nn.Module, input_ids: torch.LongTensor, logits_processor: Any,
    generation_config: Any, streamer: Any, model_kwargs: dict[str, Any],
) -> None:
    """Refuse, before any forward, what this call asks that DFlash cannot honour."""
    batch_size = input_ids.shape[0]
    check_generation_mode(generation_config, model_kwargs)
    check_logits_processors(logits_processor, batch_size)
    check_drafter_fits(drafter, target)
    block_size = drafter.config.block_size
    max_length = generation_config.max_length
    if max_length + block_size > drafter.config.max_position_embeddings:
        raise ValueError(
            f"max_length {max_length} plus a block of {block_size} exceeds the drafter's context allocation "
            f"(max_position_embeddings={drafter.config.max_position_embeddings}); lower max_new_tokens or the prompt"
        )
    return_dict = generation_config.return_dict_in_generate
    if batch_size > 1 and return_dict and (generation_config.output_scores or generation_config.output_logits):
        raise ValueError(
            "per-token scores/logits are returned for one sequence at a time on the DFlash path (sequences of a "
            "batch commit different numbers of tokens per step); generate with a batch of 1 to get them"
        )
    if batch_size > 1 and streamer is not None:
        raise ValueError("streamers take one sequence; generate with a batch of 1 to stream")
    position_ids, mask = model_kwargs.get("position_ids"), model_kwargs.get("attention_mask")
    if position_ids is not None and position_ids.shape == input_ids.shape:  # (a multimodal rope's 3-D ids: not read)
        real = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
        counted = real.long().cumsum(dim=-1) - 1  # what generate derives, and what the DFlash loops use
        if not torch.equal(position_ids.to(counted.device)[real], counted[real]):
            raise ValueError(
                "position_ids other than each sequence's count of its real tokens (what generate derives from the "
                "attention mask) would not reach the target on the DFlash path: drop position_ids"
            )
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    cache_refusal = rollback_problem(target, cache)
    if cache_refusal is not None:
        raise ValueError(cache_refusal)
    held = int(cache.get_seq_length())
    if held > 0:
        raise ValueError(
            f"the cache passed to generate already holds {held} tokens; the DFlash drafter "
            "reads the target's hidden states of the whole prompt, which a cache does not keep: pass the whole prompt "
            "with no cache (or an empty one)"
        )


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
    **model_kwargs: Any,
) -> torch.LongTensor | DFlashGenerateOutput:
    """Speculative decoding of `model` (the target) with a DFlash `drafter`; a `custom_generate` for generate.

    `dflash_sampling` (a generate keyword) picks the acceptance rule under do_sample: "rejection" (the default)
    samples drafts from the drafter's distribution (at the generation temperature) and runs full rejection
    sampling; "point_mass" proposes the drafter's argmax and accepts it when it equals the target's sample. Both
    are exact; rejection gave the higher tau with our SmolLM2 drafter (benchmarks/NOTES.md).
    `dflash_verify_rows` (a generate keyword, default: the block size) caps the rows the target verifies per step,
    anchor included: where a target forward costs in proportion to its rows (a CPU), verifying only the drafts that
    are likely to be accepted is cheaper. It never changes the output.
    `dflash_fast_path` (a generate keyword): None (the default) takes the CUDA-graph fast path (dflash_fast_path.py)
    whenever it can serve the call on a GPU; True insists (an error names what blocks it; on a CPU the same static
    step runs without a graph); False always takes the eager loop (`EagerDecoding`). The tokens are the same
    either way.
    `dflash_compile` (a generate keyword): whether the fast path compiles its drafter pass with torch.compile before
    recording it (dflash_fast_path.py). None (the default) compiles where the step is recorded as a CUDA graph; True
    compiles also where it is not (a CPU); False keeps it eager. Only proposals can differ, never the output.
    """
    target = model
    rule = DecodingRule.for_call(generation_config, dflash_sampling)
    _check_call(target, drafter, input_ids, logits_processor, generation_config, streamer, model_kwargs)
    block_size = drafter.config.block_size
    if dflash_verify_rows is not None and not 1 <= dflash_verify_rows <= block_size:
        raise ValueError(f"dflash_verify_rows must be between 1 and the block size {block_size}, got {dflash_verify_rows}")
    verify_rows = dflash_verify_rows or block_size
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    processors = StepProcessors(logits_processor)
    attention_mask = model_kwargs.get("attention_mask")
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
    max_length = generation_config.max_length
    host_hooks = HostHooks(input_ids, generation_config, stopping_criteria, streamer)
    return_dict = generation_config.return_dict_in_generate
    blocker = fast_path_blocker(target, drafter, processors, verify_rows, attention_mask)
    if takes_fast_path(dflash_fast_path, blocker, input_ids.device):
        step = static_step_for(target, drafter, input_ids.shape[0], max_length, _cache_argument(target))
        compile_drafter = step.use_graphs if dflash_compile is None else dflash_compile
        step.bind(processors, rule, host_hooks.keep_scores, host_hooks.keep_logits, compile_drafter)
        with step.generator.capture:
            acceptance_lengths = _decode_static(step, input_ids, attention_mask, processors, host_hooks)
        host_hooks.end()
        return _generate_output(host_hooks, acceptance_lengths, return_dict)
    loop = EagerDecoding(
        target, drafter, input_ids, attention_mask, cache, processors, rule, host_hooks, verify_rows
    )
    loop.run()
    host_hooks.end()
    returned = {loop.cache_arg: loop.returned_cache()}
    return _generate_output(host_hooks, loop.acceptance_lengths, return_dict, **returned)


__all__ = [
    "DFlashGenerateOutput", "EagerDecoding", "check_drafter_fits", "check_generation_mode", "dflash_generate", "fit_problems",
]
