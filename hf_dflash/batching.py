"""Many prompts through `generate` in batches: sorted by length (less padding), left-padded, each answer cut after its
first eos. Used by `regenerate` (training data) and by `generate_data_parallel` (each process's share); `bench` takes
its pad id and its cut at the first eos."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .modeling.dflash_devices import execution_device


def left_pad_token_id(tokenizer: PreTrainedTokenizerBase | None, target: PreTrainedModel) -> int:
    """Left padding needs an id; attention masks hide it, so eos serves when there is no pad token."""
    config = target.generation_config
    for candidate in (
        getattr(tokenizer, "pad_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
        config.pad_token_id,
        config.eos_token_id,
    ):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    raise ValueError("no pad or eos token id to left-pad the batches with; pass pad_token_id=...")


def eos_token_ids(target: PreTrainedModel, generate_kwargs: dict[str, object] | None = None) -> set[int]:
    """The ids `generate` stops a sequence at: the call's `eos_token_id`, else the target's generation config's."""
    eos = (generate_kwargs or {}).get("eos_token_id", target.generation_config.eos_token_id)
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])


def up_to_first_eos(row: list[int], eos_ids: set[int]) -> list[int]:
    """A sequence's new tokens up to and including its first eos: what follows is padding of a finished row."""
    return row[: next((j + 1 for j, token in enumerate(row) if token in eos_ids), len(row))]


def generate_in_batches(
    target: PreTrainedModel,
    token_ids: list[list[int]],
    pad_token_id: int,
    batch_size: int,
    drafter: torch.nn.Module | None = None,
    progress: bool = True,
    desc: str = "generate",
    **generate_kwargs: object,
) -> list[list[int]]:
    """Each prompt's new tokens (up to and including its first eos), in the order of `token_ids`.

    With a `drafter`, every batch decodes with DFlash (`assistant_model=drafter`); without one, with plain generate.
    `generate_kwargs` go to every `generate` call (max_new_tokens, do_sample, ...).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if generate_kwargs.get("return_dict_in_generate"):
        raise ValueError("generate_in_batches returns token lists; drop return_dict_in_generate")
    eos_ids = eos_token_ids(target, generate_kwargs)
    # Inputs go where the embedding computes: for a target split or offloaded by device_map, target.device may be
    # another layer's device, or meta.
    device = execution_device(target.get_input_embeddings())
    assistant = {} if drafter is None else {"assistant_model": drafter}
    order = sorted(range(len(token_ids)), key=lambda i: len(token_ids[i]))
    answers: list[list[int]] = [[] for _ in token_ids]
    with tqdm(total=len(order), desc=desc, unit="prompt", disable=not progress) as bar:
        for first in range(0, len(order), batch_size):
            chunk = order[first : first + batch_size]
            batch = [token_ids[i] for i in chunk]
            width = max(len(ids) for ids in batch)
            input_ids = torch.tensor([[pad_token_id] * (width - len(ids)) + ids for ids in batch], device=device)
            attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=device)
            out = target.generate(
                input_ids=input_ids, attention_mask=attention_mask, pad_token_id=pad_token_id, **assistant,
                **generate_kwargs,
            )
            for i, row in zip(chunk, out[:, width:].tolist()):
                answers[i] = up_to_first_eos(row, eos_ids)
            bar.update(len(chunk))
    return answers


__all__ = ["eos_token_ids", "generate_in_batches", "left_pad_token_id", "up_to_first_eos"]
