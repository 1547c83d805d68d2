"""The DFlash decoding loop, run by `target.generate(assistant_model=drafter)` (see dflash_dispatch.py).

generate prepares the generation config, logits processors, stopping criteria and the target's cache as usual,
then hands over to `dflash_generate`:
1. prefill: the target reads the prompt, hooks capture the chosen layers, the target picks the first token;
2. per step: the drafter proposes a block after the anchor (the last committed token); the target verifies
   [anchor, drafts] in one forward; drafts are accepted while each equals the token the target itself chooses at
   that row (argmax, or its sample under do_sample: a point-mass proposal, so the output is distributed exactly as
   the target's); the target's token at the first mismatch is the bonus; the target cache is cropped back to the
   committed length and the accepted rows become drafter context.
Every committed token passes through the stopping criteria one at a time, so eos, max_length, stop strings and
custom criteria end generation exactly where plain generate would.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .dflash_candidate_generator import DFlashCandidateGenerator


@dataclass
class DFlashGenerateOutput(GenerateDecoderOnlyOutput):
    """generate's usual output plus, per sequence, the tokens committed at each verify step (accepted drafts + 1)."""

    acceptance_lengths: list[list[int]] | None = None


def _cache_argument(model: torch.nn.Module) -> str:
    """transformers renamed the forward's cache argument `past_key_values` -> `cache` in 5.24."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def check_drafter_fits(drafter: torch.nn.Module, target: torch.nn.Module) -> None:
    """Refuse a drafter that cannot serve this target, before any work, naming what differs and the fix."""
    config = drafter.config
    text = target.config.get_text_config()
    problems = []
    if config.target_hidden_size != text.hidden_size:
        problems.append(
            f"the drafter reads target hidden states of width {config.target_hidden_size}, the target's are "
            f"{text.hidden_size}"
        )
    embedding_rows = target.get_input_embeddings().weight.shape[0]
    if config.mask_token_id is None or not 0 <= config.mask_token_id < embedding_rows:
        problems.append(
            f"mask_token_id {config.mask_token_id} is not a row of the target's embedding (0..{embedding_rows - 1})"
        )
    lm_rows = target.get_output_embeddings().weight.shape[0]
    if config.vocab_size != lm_rows:
        problems.append(f"the drafter expects a vocabulary of {config.vocab_size}, the target's lm_head has {lm_rows}")
    bad_layers = [i for i in config.target_layer_ids if not 0 <= i < text.num_hidden_layers]
    if bad_layers:
        problems.append(
            f"target_layer_ids {bad_layers} do not exist in the target ({text.num_hidden_layers} layers, 0-based)"
        )
    if problems:
        raise ValueError(
            "this DFlash drafter does not fit the target: "
            + "; ".join(problems)
            + ". Use a drafter trained for this target, or build one with DFlashConfig.for_target(target.config)."
        )
    if any(p.device.type == "meta" for p in drafter.parameters()):
        raise ValueError("the drafter's weights are on the meta device; load them or move the drafter to a device")


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


def _choose_tokens(
    logits: torch.Tensor,
    prefix_ids: torch.LongTensor,
    drafts: torch.LongTensor,
    logits_processor: Any,
    do_sample: bool,
) -> tuple[torch.LongTensor, torch.Tensor]:
    """The target's own token at every verified row, as plain generate would pick it there.

    logits (b, n, V); prefix_ids (b, t) the committed tokens; drafts (b, n - 1). Row i's processors see the prefix
    followed by drafts[:, :i], which is the committed prefix whenever row i matters (every earlier draft accepted).
    Returns tokens (b, n) and the processed scores (b, n, V) in float32.
    """
    scores = logits.to(torch.float32)
    if len(logits_processor) > 0:
        scores = torch.stack(
            [
                logits_processor(torch.cat([prefix_ids, drafts[:, :i]], dim=1), scores[:, i])
                for i in range(scores.shape[1])
            ],
            dim=1,
        )
    if not do_sample:
        return scores.argmax(dim=-1), scores
    probs = torch.softmax(scores, dim=-1)
    tokens = torch.multinomial(probs.flatten(0, 1), num_samples=1).view(probs.shape[:2])
    return tokens, scores


def dflash_generate(
    model: torch.nn.Module,
    input_ids: torch.LongTensor,
    logits_processor: Any,
    stopping_criteria: Any,
    generation_config: Any,
    synced_gpus: bool = False,
    streamer: Any = None,
    drafter: torch.nn.Module | None = None,
    **model_kwargs: Any,
) -> torch.LongTensor | DFlashGenerateOutput:
    """Speculative decoding of `model` (the target) with a DFlash `drafter`; a `custom_generate` for generate."""
    target = model
    check_generation_mode(generation_config, model_kwargs)
    check_drafter_fits(drafter, target)
    batch_size, prompt_len = input_ids.shape
    if batch_size != 1:
        raise ValueError(f"the DFlash path decodes one sequence at a time for now; got a batch of {batch_size}")
    block_size = drafter.config.block_size
    max_length = generation_config.max_length
    if max_length + block_size > drafter.config.max_position_embeddings:
        raise ValueError(
            f"max_length {max_length} plus a block of {block_size} exceeds the drafter's context allocation "
            f"(max_position_embeddings={drafter.config.max_position_embeddings}); lower max_new_tokens or the prompt"
        )
    cache_arg = _cache_argument(target)
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is None or not hasattr(cache, "crop"):
        raise ValueError(
            "the DFlash path needs a cache that can be cropped after each verify (DynamicCache, the default); "
            f"got {type(cache).__name__}. Drop cache_implementation / the cache argument"
        )
    attention_mask = model_kwargs.get("attention_mask")
    prompt_mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    if not bool(prompt_mask.all()):
        raise ValueError("padded prompts arrive with batched DFlash decoding; pass an unpadded single prompt")
    return_dict = generation_config.return_dict_in_generate
    keep_scores = return_dict and generation_config.output_scores
    keep_logits = return_dict and generation_config.output_logits
    scores: list[torch.Tensor] = []
    raw_logits: list[torch.Tensor] = []
    acceptance_lengths: list[int] = []

    generator = DFlashCandidateGenerator(drafter, target, batch_size, max_length, max_rows=max(prompt_len, block_size))
    # Hooks live exactly as long as this block: the target leaves generate as it came in, even on error.
    with generator.capture:
        # 1. Prefill: the prompt's rows become drafter context; the target picks the first token.
        generator.capture_rows(prompt_len)
        outputs = target(
            input_ids=input_ids,
            position_ids=torch.arange(prompt_len, device=input_ids.device)[None],
            use_cache=True,
            logits_to_keep=1,
            **{cache_arg: cache},
        )
        generator.commit_prefill(prompt_mask)
        tokens, step_scores = _choose_tokens(
            outputs.logits[:, -1:], input_ids, input_ids[:, :0], logits_processor, generation_config.do_sample
        )
        input_ids, finished = _commit(
            input_ids, tokens[:, :1], step_scores, outputs.logits[:, -1:], stopping_criteria, streamer,
            scores if keep_scores else None, raw_logits if keep_logits else None,
        )
        # 2. Draft, verify, accept, until a stopping criterion says so.
        while not finished:
            cur_len = input_ids.shape[1]
            num_rows = min(block_size, max_length - cur_len)  # never verify past max_length
            candidates, _ = generator.get_candidates(input_ids)
            block = candidates[:, cur_len - 1 : cur_len - 1 + num_rows]  # [anchor, drafts]
            generator.capture_rows(num_rows)
            outputs = target(
                input_ids=block,
                position_ids=(cur_len - 1 + torch.arange(num_rows, device=block.device))[None],
                use_cache=True,
                logits_to_keep=num_rows,
                **{cache_arg: cache},
            )
            drafts = block[:, 1:]
            tokens, step_scores = _choose_tokens(
                outputs.logits, input_ids, drafts, logits_processor, generation_config.do_sample
            )
            # Accepted drafts: the longest prefix where each draft equals the target's token at the row before it.
            accepted = int((drafts == tokens[:, :-1]).cumprod(dim=1).sum())  # the one host sync of the step
            rejected = num_rows - 1 - accepted
            if rejected:  # keep rows 0..accepted (the anchor and the accepted drafts); a negative crop drops rows
                cache.crop(-rejected)
            generator.update_candidate_strategy(input_ids, step_scores, accepted)
            acceptance_lengths.append(accepted + 1)
            input_ids, finished = _commit(
                input_ids, tokens[:, : accepted + 1], step_scores, outputs.logits, stopping_criteria, streamer,
                scores if keep_scores else None, raw_logits if keep_logits else None,
            )
    generator.release()
    if streamer is not None:
        streamer.end()
    if not return_dict:
        return input_ids
    return DFlashGenerateOutput(
        sequences=input_ids,
        scores=tuple(scores) if keep_scores else None,
        logits=tuple(raw_logits) if keep_logits else None,
        acceptance_lengths=[acceptance_lengths],
        **{cache_arg: cache},
    )


def _commit(
    input_ids: torch.LongTensor,
    new_tokens: torch.LongTensor,
    step_scores: torch.Tensor,
    step_logits: torch.Tensor,
    stopping_criteria: Any,
    streamer: Any,
    scores: list[torch.Tensor] | None,
    raw_logits: list[torch.Tensor] | None,
) -> tuple[torch.LongTensor, bool]:
    """Append new tokens one at a time, as plain generate would, stopping at the first that ends the sequence."""
    finished = False
    for i in range(new_tokens.shape[1]):
        input_ids = torch.cat([input_ids, new_tokens[:, i : i + 1]], dim=1)
        if scores is not None:
            scores.append(step_scores[:, i])
        if raw_logits is not None:
            raw_logits.append(step_logits[:, i].to(torch.float32))
        if streamer is not None:
            streamer.put(new_tokens[:, i].cpu())
        if bool(stopping_criteria(input_ids, step_scores[:, i]).all()):
            finished = True
            break
    return input_ids, finished


__all__ = ["DFlashGenerateOutput", "check_drafter_fits", "check_generation_mode", "dflash_generate"]
