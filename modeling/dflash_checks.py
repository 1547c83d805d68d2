"""What DFlash refuses, before any forward: a drafter that does not fit the target, and generate options or inputs it
cannot honour. Each refusal is one ValueError naming the fix. The checks that belong to one part stay with it and are
called from here: `check_logits_processors` (dflash_processors.py) and `rollback_problem` (dflash_target_cache.py).
One call is served but warned about: a target whose RoPE changes with the sequence's length (`rope_switch_problem`;
`rope_switch` also serves the continuous-batching manager's requests).

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.utils import logging

from .configuration_dflash import rope_per_layer_type
from .dflash_compat import CACHE_ARGUMENTS, cache_from_kwargs, default_generation_params
from .dflash_fast_path_blockers import target_layer_types
from .dflash_masks import SLIDING, pads_after_real_tokens
from .dflash_processors import check_logits_processors
from .dflash_target_cache import rollback_problem

logger = logging.get_logger(__name__)


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
    {"attention_mask", "position_ids", "logits_to_keep", *CACHE_ARGUMENTS, "use_cache"}
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
    defaults = default_generation_params(generation_config)
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


def check_call(
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
    padding = padding_problem(target.config.get_text_config(), mask)
    if padding is not None:
        raise ValueError(padding)
    rope_switch = rope_switch_problem(target.config.get_text_config(), input_ids.shape[1], max_length, block_size)
    if rope_switch is not None:
        logger.warning_once(f"DFlash: {rope_switch}")
    cache = cache_from_kwargs(model_kwargs)
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


def padding_problem(text: Any, attention_mask: torch.Tensor | None) -> str | None:
    """Why neither DFlash loop can give plain generate's tokens for this attention mask, or None.

    Both number a row's real tokens 0..n-1 and window them by those positions, as plain generate does under left
    padding. Plain generate reads a row that ends in padding at its last column, a pad numbered 0, and numbers its new
    tokens on from there (transformers warns that right padding gives wrong results); and its sliding windows span
    columns, so padding between a row's real tokens narrows what a window holds of them.
    """
    if attention_mask is None:
        return None
    if not bool(attention_mask[:, -1].bool().all()):
        return (
            "a row of the attention mask ends in padding, which plain generate reads at a pad (transformers warns it "
            "gives wrong results) and DFlash cannot reproduce: pad prompts on the left"
        )
    if pads_after_real_tokens(attention_mask) and SLIDING in target_layer_types(text):
        return (
            "the attention mask has padding between a row's real tokens, which the target's sliding windows count as "
            "columns in plain generate and DFlash windows by position: pad prompts on the left only"
        )
    return None


def rope_switch(text: Any, prompt_length: int, max_length: int, block_size: int) -> tuple[str, int] | None:
    """(the RoPE kind, the position where it switches) when a sequence of `prompt_length` tokens decoded to
    `max_length` can rotate otherwise under DFlash than under plain decoding, or None.

    transformers' `longrope` RoPE (Phi-3's long-context checkpoints) takes its long factors for a whole forward once it
    reaches past `original_max_position_embeddings`, and `dynamic` RoPE rescales its frequencies for good once a
    forward reaches past `max_position_embeddings`. A verify block reaches up to a block further than plain decoding's
    one-token step (its rows past max_length included, which commit nothing but still rotate), so from a block
    before that length the target's queries and keys may rotate otherwise than in plain decoding. A longrope prompt
    already past it took the long factors in both."""
    rope = getattr(text, "rope_parameters", None) or {}
    kinds = list(rope.values()) if rope_per_layer_type(rope) else [rope]
    for parameters in kinds:
        kind = parameters.get("rope_type", "default")
        if kind == "longrope":
            switch = parameters.get("original_max_position_embeddings") or getattr(
                text, "original_max_position_embeddings", None
            )
            if switch is None or prompt_length > switch:
                continue
        elif "dynamic" in kind:
            switch = text.max_position_embeddings
        else:
            continue
        if max_length + block_size > switch:
            return kind, switch
    return None


def rope_switch_problem(text: Any, prompt_length: int, max_length: int, block_size: int) -> str | None:
    """Why a generate call's tokens may part from plain generate's (`rope_switch`), or None."""
    found = rope_switch(text, prompt_length, max_length, block_size)
    if found is None:
        return None
    kind, switch = found
    return (
        f"the target's {kind} RoPE changes its frequencies once a forward passes {switch} positions, which a "
        f"verify block of {block_size} reaches before plain decoding does: this call's tokens may then differ "
        f"from plain generate's (a max_length of at most {switch - block_size} keeps them identical)"
    )


__all__ = [
    "MODEL_INPUTS_DFLASH_BUILDS", "check_call", "check_drafter_fits", "check_generation_mode", "fit_problems",
    "rope_switch", "rope_switch_problem",
]
