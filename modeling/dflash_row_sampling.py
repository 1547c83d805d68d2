"""Sampling settings per row, for the continuous-batching engine: each request keeps its own temperature, top-k,
top-p and repetition penalty (transformers serve sends the first three per request), while the rows share one verify
step.

`SamplingSettings` is one request's; `penalize` and `warp` apply every row's at once, exactly as transformers'
repetition penalty and warpers do for one request (the penalty on the tokens the prefix holds, then temperature,
top-k and top-p, each row with its own values), so a row's token is the one plain `generate` would choose, or draws
from the distribution it would draw from, with that request's settings. A greedy row (do_sample off, or top-k 1,
which keeps only the argmax) takes the argmax of its penalized logits, which no warper moves.

What else a generation config may ask for (min_p, bad words, a minimum length, ...) is not served per row: the
manager refuses such a config with a ValueError naming the option.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .dflash_processors import row_presence

# Generation-config fields that make logits processors the engine does not apply, with the values that make none.
UNSERVED = {
    "min_p": (0.0,), "typical_p": (1.0,), "epsilon_cutoff": (0.0,),
    "eta_cutoff": (0.0,), "top_h": (), "no_repeat_ngram_size": (0,), "bad_words_ids": (), "min_length": (0,),
    "min_new_tokens": (0,), "sequence_bias": (), "suppress_tokens": (), "begin_suppress_tokens": (),
    "forced_bos_token_id": (), "forced_eos_token_id": (), "exponential_decay_length_penalty": (),
    "encoder_repetition_penalty": (1.0,), "guidance_scale": (1.0,), "watermarking_config": (),
    "renormalize_logits": (False,),
}
# The options a request may set for itself, with their types (what transformers serve reads to build them).
PER_REQUEST = {"temperature": float, "top_k": int, "top_p": float, "repetition_penalty": float}
# The options that make a request sample when it sets them (as transformers' manager applies them).
SAMPLING_OPTIONS = ("temperature", "top_k", "top_p")


@dataclass(frozen=True)
class SamplingSettings:
    """How one request picks its tokens: greedy, or sampled after temperature, top-k (0: off) and top-p (1: off),
    either way after its repetition penalty (1: off) on the tokens it already holds."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    @classmethod
    def from_config(cls, generation_config: Any) -> "SamplingSettings":
        """A generation config's settings; ValueError naming the option for what the engine does not apply."""
        asked = [
            name for name, off in UNSERVED.items()
            if (value := getattr(generation_config, name, None)) is not None and value not in off
        ]
        if asked:
            raise ValueError(
                "DFlash continuous batching applies temperature, top_k, top_p and repetition_penalty only; the "
                f"generation config also sets {', '.join(asked)}: unset it, or use generate(assistant_model=drafter), "
                "which applies it"
            )
        return cls(
            do_sample=bool(generation_config.do_sample),
            temperature=float(generation_config.temperature if generation_config.temperature is not None else 1.0),
            top_k=int(generation_config.top_k or 0),
            top_p=float(generation_config.top_p if generation_config.top_p is not None else 1.0),
            repetition_penalty=float(getattr(generation_config, "repetition_penalty", None) or 1.0),
        )

    def with_request(self, options: dict[str, Any]) -> "SamplingSettings":
        """These settings with a request's own temperature / top_k / top_p / repetition_penalty; ValueError for any
        other option, or a value out of range. A request that sets temperature, top_k or top_p samples (as
        transformers' manager applies them); a repetition penalty alone leaves greedy requests greedy."""
        unknown = sorted(set(options) - set(PER_REQUEST))
        if unknown:
            raise ValueError(
                f"a request may set {', '.join(PER_REQUEST)} for itself; {', '.join(unknown)} is not served per "
                "request by DFlash continuous batching: set it in the manager's generation config"
            )
        if not options:
            return self
        values = {**vars(self), **{name: PER_REQUEST[name](value) for name, value in options.items()}}
        if (values["temperature"] <= 0 or values["top_k"] < 0 or not 0 < values["top_p"] <= 1
                or values["repetition_penalty"] <= 0):
            raise ValueError(
                f"temperature and repetition_penalty must be > 0, top_k >= 0 and top_p in (0, 1]; the request sets "
                f"{options}"
            )
        if any(name in options for name in SAMPLING_OPTIONS):
            values["do_sample"] = True  # greedy again where top_k is 1 (`greedy`)
        return SamplingSettings(**values)

    @property
    def penalized(self) -> bool:
        """Whether the request's scores take a repetition penalty."""
        return self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        """Whether the request's token is the argmax (top-k 1 keeps the argmax alone)."""
        return not self.do_sample or self.top_k == 1


def penalize(
    logits: torch.Tensor, presence: torch.Tensor, drafts: torch.LongTensor, repetition_penalty: torch.Tensor
) -> torch.Tensor:
    """Scores (n, q, V) float32: logits (n, q, V) with each row's repetition_penalty (n,) on the tokens it counts,
    as transformers' RepetitionPenaltyLogitsProcessor (a negative score multiplied, another divided): the tokens of
    its prefix (presence (n, V)), and at verify row j also drafts[:, :j] (drafts (n, q - 1)). A penalty of 1 leaves
    the row's logits as they are."""
    scores = logits.float()
    counted = row_presence(presence, drafts).view(scores.shape)
    penalty = repetition_penalty[:, None, None]
    return torch.where(counted, torch.where(scores < 0, scores * penalty, scores / penalty), scores)


def warp(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Scores (n, q, V) float32 to sample each row from: logits (n, q, V) / temperature (n,), then each row's top_k
    (n,) largest kept (0: all), then the smallest set of top_p (n,) probability (ties and order as transformers'
    TopKLogitsWarper and TopPLogitsWarper), the rest -inf."""
    scores = logits.float() / temperature[:, None, None]
    vocab = scores.shape[-1]
    descending = scores.sort(dim=-1, descending=True).values  # (n, q, V)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # (n,)
    kth = descending.gather(-1, (k - 1)[:, None, None].expand(-1, scores.shape[1], 1))  # (n, q, 1)
    scores = scores.masked_fill(scores < kth, -float("inf"))
    ascending, order = scores.sort(dim=-1)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - top_p)[:, None, None]
    remove[..., -1:] = False  # at least one token
    return scores.masked_fill(remove.scatter(-1, order, remove), -float("inf"))


__all__ = ["PER_REQUEST", "SamplingSettings", "penalize", "warp"]
