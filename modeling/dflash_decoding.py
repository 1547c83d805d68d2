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

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .dflash_candidate_generator import DFlashCandidateGenerator
from .dflash_fast_path import DFlashStaticStep, fast_path_blocker, static_step_for
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


def _process_scores(
    logits: torch.Tensor, prefixes: list[torch.LongTensor], drafts: torch.LongTensor, logits_processor: Any
) -> torch.Tensor:
    """The target's scores at every verified row after the logits processors, as plain generate would see them.

    logits (b, n, V); prefixes[i] (1, t_i) the committed tokens of sequence i (its left padding included, as plain
    generate's input_ids have it); drafts (b, n - 1). Row j's processors see the prefix followed by drafts[:j],
    which is the committed prefix whenever row j matters (every earlier draft accepted). Returns float32 (b, n, V).
    """
    scores = logits.to(torch.float32)
    if len(logits_processor) == 0:
        return scores
    # Per sequence and row: processors read the whole prefix, whose length differs between sequences.
    return torch.stack(
        [
            torch.cat(
                [
                    logits_processor(torch.cat([prefix, drafts[i : i + 1, :j]], dim=1), scores[i : i + 1, j])
                    for j in range(scores.shape[1])
                ]
            )
            for i, prefix in enumerate(prefixes)
        ]
    )


def _sample(probs: torch.Tensor) -> torch.LongTensor:
    """One token per row of probs (..., V)."""
    return torch.multinomial(probs.flatten(0, -2), num_samples=1).view(probs.shape[:-1])


def _verify(
    scores: torch.Tensor, drafts: torch.LongTensor, do_sample: bool, draft_probs: torch.Tensor | None
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Acceptance of a block. scores (b, n, V) processed target scores; drafts (b, n - 1).

    Returns (tokens (b, n), accepted (b,)): sequence i commits tokens[i, : accepted[i] + 1], its accepted drafts
    followed by the target's own token (the bonus, or the correction of the first rejected draft).
    - greedy, and sampling with a point-mass proposal (`draft_probs` None): the target picks its token at every
      row (argmax or a sample of its distribution) and a draft is accepted while it equals that token; each
      committed token is then exactly the target's own choice.
    - rejection sampling (`draft_probs` (b, n - 1, V), the distribution the drafts were sampled from): accept
      draft j with probability min(1, p_j(d) / q_j(d)); the first rejected one is replaced by a sample of
      normalize(max(p_j - q_j, 0)); if none is rejected the bonus is a sample of p at the last row.
    """
    if draft_probs is None:
        tokens = _sample(torch.softmax(scores, dim=-1)) if do_sample else scores.argmax(dim=-1)
        return tokens, (drafts == tokens[:, :-1]).long().cumprod(dim=1).sum(dim=1)
    probs = torch.softmax(scores, dim=-1)
    p = probs[:, :-1].gather(-1, drafts[..., None])[..., 0]
    q = draft_probs.gather(-1, drafts[..., None])[..., 0]
    keep = torch.rand_like(p) * q < p  # u < p / q without dividing by a zero q
    accepted = keep.long().cumprod(dim=1).sum(dim=1)
    residual = (probs[:, :-1] - draft_probs).clamp(min=0)
    # Where p <= q everywhere (possible only if p == q), rejection has probability 0; keep the sampler defined.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, probs[:, :-1])
    corrections = torch.cat([_sample(residual), _sample(probs[:, -1:])], dim=1)  # (b, n)
    tokens = torch.cat([drafts, corrections[:, -1:]], dim=1)
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    tokens[rows, accepted] = corrections[rows, accepted]
    return tokens, accepted


def _host_stopping_rules(stopping_criteria: Any) -> tuple[set[int], bool]:
    """The eos ids of the list, and whether it holds nothing but eos and max-length criteria (which need no call)."""
    eos_ids: set[int] = set()
    host_only = True
    for criterion in stopping_criteria:
        if isinstance(criterion, EosTokenCriteria):
            eos_ids.update(int(i) for i in criterion.eos_token_id.flatten().tolist())
        elif not isinstance(criterion, MaxLengthCriteria):
            host_only = False
    return eos_ids, host_only


def _host_stop(new: list[int], start: int, eos_ids: set[int], max_length: int) -> tuple[int, bool]:
    """How many of a sequence's `new` tokens (appended at length `start`) it keeps under eos / max_length, and
    whether it ends there."""
    ends_at = next((j for j, token in enumerate(new) if token in eos_ids), None)
    count = len(new) if ends_at is None else ends_at + 1
    return count, ends_at is not None or start + count >= max_length


def _decode_static(
    step: DFlashStaticStep, input_ids: torch.LongTensor, attention_mask: torch.Tensor, max_length: int,
    eos_ids: set[int], pad_id: int,
) -> tuple[torch.LongTensor, list[list[int]]]:
    """The fast path's host loop (dflash_fast_path.py): per step one replay and one read-back of [tokens, accepted]
    per sequence. Returns the sequences (right-padded with pad_id) and each sequence's acceptance lengths."""
    rows = input_ids.tolist()
    acceptance_lengths: list[list[int]] = [[] for _ in rows]
    running = []
    for i, token in enumerate(step.prefill(input_ids, attention_mask, max_length)):
        count, done = _host_stop([token], len(rows[i]), eos_ids, max_length)
        rows[i].append(token)
        if done:
            step.stop(i)
        else:
            running.append(i)
    if running and step.graph is None and input_ids.is_cuda:
        step.capture_graph()
    while running:
        out = step.run_step()
        still = []
        for i in running:
            accepted = out[i][-1]
            count, done = _host_stop(out[i][: accepted + 1], len(rows[i]), eos_ids, max_length)
            rows[i].extend(out[i][:count])
            acceptance_lengths[i].append(accepted + 1)
            if done:
                step.stop(i)
            else:
                still.append(i)
        running = still
    longest = max(len(row) for row in rows)
    sequences = torch.tensor([row + [pad_id] * (longest - len(row)) for row in rows], device=input_ids.device)
    return sequences, acceptance_lengths


@contextlib.contextmanager
def _pages_returned(generator: DFlashCandidateGenerator) -> Iterator[None]:
    """Every sequence's drafter pages return to the pool when the block ends, also when an exception escapes it."""
    try:
        yield
    finally:
        generator.release()


def _positions(attention_mask: torch.Tensor) -> torch.LongTensor:
    """Absolute positions of the real tokens of left-padded rows (padding gets position 0, as in generate)."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def dflash_generate(
    model: torch.nn.Module,
    input_ids: torch.LongTensor,
    logits_processor: Any,
    stopping_criteria: Any,
    generation_config: Any,
    synced_gpus: bool = False,
    streamer: Any = None,
    drafter: torch.nn.Module | None = None,
    dflash_sampling: str = "rejection",
    dflash_verify_rows: int | None = None,
    dflash_fast_path: bool | None = None,
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
    step runs without a graph); False always takes the eager loop below. The tokens are the same either way.

    Sequences of a batch accept different numbers of drafts per step. The target's cache stays one rectangular
    DynamicCache: each step keeps the rows of the longest acceptance and masks the rejected rows of the other
    sequences out of the attention mask for good (positions come from each sequence's own length, so a masked row
    is never seen again). Finished sequences leave the batch (cache, mask and drafter state).
    """
    target = model
    if dflash_sampling not in ("point_mass", "rejection"):
        raise ValueError(f"dflash_sampling must be 'point_mass' or 'rejection', got {dflash_sampling!r}")
    rejection = generation_config.do_sample and dflash_sampling == "rejection"
    check_generation_mode(generation_config, model_kwargs)
    check_drafter_fits(drafter, target)
    batch_size, prompt_len = input_ids.shape
    block_size = drafter.config.block_size
    if dflash_verify_rows is not None and not 1 <= dflash_verify_rows <= block_size:
        raise ValueError(f"dflash_verify_rows must be between 1 and the block size {block_size}, got {dflash_verify_rows}")
    verify_rows = dflash_verify_rows or block_size
    max_length = generation_config.max_length
    if max_length + block_size > drafter.config.max_position_embeddings:
        raise ValueError(
            f"max_length {max_length} plus a block of {block_size} exceeds the drafter's context allocation "
            f"(max_position_embeddings={drafter.config.max_position_embeddings}); lower max_new_tokens or the prompt"
        )
    return_dict = generation_config.return_dict_in_generate
    keep_scores = return_dict and generation_config.output_scores
    keep_logits = return_dict and generation_config.output_logits
    if batch_size > 1 and (keep_scores or keep_logits):
        raise ValueError(
            "per-token scores/logits are returned for one sequence at a time on the DFlash path (sequences of a "
            "batch commit different numbers of tokens per step); generate with a batch of 1 to get them"
        )
    if batch_size > 1 and streamer is not None:
        raise ValueError("streamers take one sequence; generate with a batch of 1 to stream")
    cache_arg = _cache_argument(target)
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    cache_refusal = rollback_problem(target, cache)
    if cache_refusal is not None:
        raise ValueError(cache_refusal)
    pad = generation_config._pad_token_tensor
    pad_id = int(pad) if pad is not None else 0
    device = input_ids.device
    attention_mask = model_kwargs.get("attention_mask")
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()

    # sequences[i, :lengths[i]] is sequence i as plain generate would hold it (left padding included).
    sequences = torch.full((batch_size, max_length), pad_id, dtype=torch.long, device=device)
    sequences[:, :prompt_len] = input_ids
    lengths = [prompt_len] * batch_size
    live = list(range(batch_size))  # batch row -> sequence index
    acceptance_lengths: list[list[int]] = [[] for _ in range(batch_size)]
    scores: list[torch.Tensor] = []
    raw_logits: list[torch.Tensor] = []

    # eos and max_length, the criteria generate always adds, are decided on the host from the token ids the step
    # already read back; only other criteria (stop strings, custom ones) are called token by token.
    eos_ids, host_criteria_only = _host_stopping_rules(stopping_criteria)

    blocker = fast_path_blocker(
        target, drafter, generation_config, logits_processor, host_criteria_only, streamer, verify_rows, attention_mask
    )
    if dflash_fast_path and blocker is not None:
        raise ValueError(f"dflash_fast_path=True, but the fast path cannot serve this call: {blocker}")
    if dflash_fast_path or (dflash_fast_path is None and blocker is None and device.type == "cuda"):
        step = static_step_for(target, drafter, batch_size, max_length, cache_arg)
        with step.generator.capture:
            sequences, acceptance_lengths = _decode_static(step, input_ids, attention_mask, max_length, eos_ids, pad_id)
        if not return_dict:
            return sequences
        return DFlashGenerateOutput(sequences=sequences, acceptance_lengths=acceptance_lengths)

    def commit(row_tokens: list[list[int]], step_scores: torch.Tensor, step_logits: torch.Tensor) -> list[int]:
        """Append each live sequence's new tokens, stopping it at the first token that ends it, exactly where plain
        generate would. Returns the batch rows still running."""
        running = []
        for row, (seq, new) in enumerate(zip(live, row_tokens)):
            start = lengths[seq]
            if host_criteria_only:
                count, done = _host_stop(new, start, eos_ids, max_length)
            else:
                count, done = len(new), False
                for j in range(len(new)):
                    sequences[seq, start + j] = new[j]
                    if bool(stopping_criteria(sequences[seq : seq + 1, : start + j + 1], step_scores[row : row + 1, j]).all()):
                        count, done = j + 1, True
                        break
            sequences[seq, start : start + count] = torch.tensor(new[:count], device=device)
            lengths[seq] = start + count
            if keep_scores:
                scores.extend(step_scores[row : row + 1, j] for j in range(count))
            if keep_logits:
                raw_logits.extend(step_logits[row : row + 1, j].to(torch.float32) for j in range(count))
            if streamer is not None:
                for token in new[:count]:
                    streamer.put(torch.tensor([token]))
            if not done:
                running.append(row)
        return running

    target_cache = TargetCacheRollback(target, cache)
    generator = DFlashCandidateGenerator(drafter, target, batch_size, max_length, max_rows=max(prompt_len, block_size))
    # Hooks live exactly as long as this block and the pages go back to the pool when it ends: the target leaves
    # generate as it came in, even on error.
    with generator.capture, _pages_returned(generator):
        # 1. Prefill: the prompt's real rows become drafter context; the target picks each sequence's first token.
        generator.capture_rows(prompt_len)
        outputs = target(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=_positions(attention_mask),
            use_cache=True,
            logits_to_keep=1,
            **{cache_arg: cache},
        )
        generator.commit_prefill(attention_mask)
        target_cache.after_prefill(attention_mask)
        prefixes = [input_ids[i : i + 1] for i in range(batch_size)]
        step_scores = _process_scores(outputs.logits[:, -1:], prefixes, input_ids[:, :0], logits_processor)
        tokens, _ = _verify(step_scores, input_ids[:, :0], generation_config.do_sample, None)
        running = commit(tokens.tolist(), step_scores, outputs.logits[:, -1:])

        # 2. Draft, verify, accept, until every sequence is finished.
        while running:
            if len(running) < len(live):  # finished sequences stop costing work
                index = torch.tensor(running, device=device)
                target_cache.keep(index)
                attention_mask = attention_mask[index]
                generator.keep(running)
                live = [live[row] for row in running]
            rows = torch.tensor(live, device=device)
            ends = torch.tensor([lengths[seq] for seq in live], device=device)
            # never verify past max_length: a sequence with r tokens left commits at most r
            room = [max_length - lengths[seq] for seq in live]
            num_rows = min(verify_rows, max(room))
            anchors = sequences[rows, ends - 1][:, None]
            candidates, draft_logits = generator.get_candidates(anchors)
            block = candidates[:, :num_rows]  # (b, n): [anchor, drafts]
            draft_probs = None
            if rejection:  # drafts sampled from the drafter's own distribution instead of its argmax
                temperature = generation_config.temperature or 1.0
                # the drafter's logits come from the lm_head's device; the target's scores are on the inputs'
                draft_probs = torch.softmax(draft_logits[:, : num_rows - 1].to(device).float() / temperature, dim=-1)
                block = torch.cat([block[:, :1], _sample(draft_probs).to(block.device)], dim=1)
            real_lengths = torch.tensor([s.seq_len for s in generator.states], device=device)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(live), num_rows)], dim=1)
            generator.capture_rows(num_rows)
            with target_cache.verifying():
                outputs = target(
                    input_ids=block,
                    attention_mask=target_cache.verify_mask(attention_mask, num_rows),
                    position_ids=real_lengths[:, None] - 1 + torch.arange(num_rows, device=device),
                    use_cache=True,
                    logits_to_keep=num_rows,
                    **{cache_arg: cache},
                )
            drafts = block[:, 1:]
            prefixes = [sequences[seq : seq + 1, : lengths[seq]] for seq in live]
            step_scores = _process_scores(outputs.logits, prefixes, drafts, logits_processor)
            tokens, accepted = _verify(step_scores, drafts, generation_config.do_sample, draft_probs)
            accepted = torch.minimum(accepted, torch.tensor(room, device=device) - 1).tolist()  # the step's host sync
            attention_mask = target_cache.rollback(attention_mask, num_rows, accepted)
            generator.update_candidate_strategy(block, step_scores, accepted)
            for seq, taken in zip(live, accepted):
                acceptance_lengths[seq].append(taken + 1)
            running = commit(
                [row_tokens[: taken + 1] for row_tokens, taken in zip(tokens.tolist(), accepted)],
                step_scores,
                outputs.logits,
            )
    if streamer is not None:
        streamer.end()
    sequences = sequences[:, : max(lengths)]
    if not return_dict:
        return sequences
    return DFlashGenerateOutput(
        sequences=sequences,
        scores=tuple(scores) if keep_scores else None,
        logits=tuple(raw_logits) if keep_logits else None,
        acceptance_lengths=acceptance_lengths,
        **{cache_arg: cache},
    )


__all__ = ["DFlashGenerateOutput", "check_drafter_fits", "check_generation_mode", "dflash_generate", "fit_problems"]
