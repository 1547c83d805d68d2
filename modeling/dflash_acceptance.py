"""Acceptance of a verified block: greedy, point-mass and rejection sampling, written once.

Everything here is tensor work with fixed shapes and no host synchronization, so the engine's step records it inside its
CUDA graph on a GPU and runs the same functions eagerly elsewhere. Random numbers come from the default generator
(`sample` draws without `torch.multinomial`): a CUDA graph replays them with fresh values on every replay, and
`torch.manual_seed` before generate reproduces a run.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def sample(probs: torch.Tensor) -> torch.LongTensor:
    """One token per row of probs (..., V), drawn with probability probs[..., v] / probs[...].sum(); a token of
    probability 0 is never drawn.

    Two exact rules, chosen by what is cheap where the tensor lives. On a CPU, random numbers cost about 20 ns each
    (one scalar generator), so a draw over every logit of a verify step dominated a sampled step (25 of 178 ms per step
    for SmolLM2 at batch 1): the inverse CDF draws one number per row. On an accelerator the draws are nearly free and
    a parallel running sum rounds differently from token to token, which could give a token of probability 0 a
    sliver of the line, so there each row runs the exponential race.
    """
    if probs.device.type == "cpu":
        return inverse_cdf_sample(probs)
    return exponential_race_sample(probs)


def exponential_race_sample(probs: torch.Tensor) -> torch.LongTensor:
    """`sample` by the exponential race: with E_v ~ Exp(1) independent, argmax_v p_v / E_v is v with probability
    p_v / sum(p). A zero-probability token scores 0 and is never drawn; the clamp keeps an Exp(1) draw of exactly 0
    (which some generators can return) from dividing by zero."""
    race = torch.empty_like(probs, dtype=torch.float32).exponential_().clamp_(min=torch.finfo(torch.float32).tiny)
    return (probs.float() / race).argmax(dim=-1)


def inverse_cdf_sample(probs: torch.Tensor) -> torch.LongTensor:
    """`sample` by the inverse CDF: one uniform u per row, and the first token whose running sum exceeds u times the
    row's total. The CPU's running sum adds one token after another, so a zero-probability token leaves it unchanged
    and no point of [0, total) falls on it (tests/test_sampling.py checks both that and the distribution)."""
    running = probs.float().cumsum(dim=-1)  # (..., V)
    total = running[..., -1:]
    # u * total may round up to total itself; the largest float below total keeps the point inside the row
    point = torch.minimum(torch.rand_like(total) * total, torch.nextafter(total, torch.zeros_like(total)))
    # clamped: a row of no weight at all gets a token of the row (as from the race), not an index past it
    return torch.searchsorted(running, point, right=True)[..., 0].clamp_(max=probs.shape[-1] - 1)


def draft_distribution(draft_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The distribution rejection sampling draws drafts from: the drafter's softmax at the generation temperature.

    draft_logits (b, n, V) -> float32 (b, n, V). Any full-support proposal keeps rejection sampling exact; this one
    tracks the target's temperature, which is what keeps acceptance high.
    """
    return torch.softmax(draft_logits.float() / temperature, dim=-1)


def draft_confidence(draft_logits: torch.Tensor, draft_probs: torch.Tensor | None) -> torch.Tensor:
    """The drafter's confidence in each block row (b, n) float32: the largest probability of the row's distribution,
    `draft_probs` (b, n, V) when the drafts were sampled from it, else the softmax of draft_logits (b, n, V) (under
    greedy drafting, the probability of the draft itself). What a verify policy reads (dflash_policy.py).

    A function of the distributions only, never of the sampled drafts: a policy that verified a sampled draft or not
    depending on which token was drawn would bias rejection sampling (the verified drafts would no longer be draws of
    q), while a width chosen from q alone leaves every verified draft a plain draw of q, so acceptance stays exact."""
    probs = torch.softmax(draft_logits.float(), dim=-1) if draft_probs is None else draft_probs
    return probs.amax(dim=-1)


def width_confidence(proposal: "Proposal", draft_logits: torch.Tensor, selector: bool) -> torch.Tensor:
    """What a verify policy (dflash_policy.py) reads of a proposal to choose how many rows to verify (b, B - 1)
    float32, in both loops. Argmax drafts are a function of the drafter's state alone, so their own confidence serves
    (for a DFlash drafter the largest probability of each row). Sampled drafts must not decide the width
    (`draft_confidence`): a DFlash drafter's rows give the largest probability of the distribution they were drawn
    from; a DFlash2 row's distribution depends on the draft drawn before it, so its confidence comes from the rows'
    own logits (draft_logits (b, B - 1, V))."""
    if proposal.probs is None:
        return proposal.confidence
    return draft_confidence(draft_logits, None if selector else proposal.probs)


@dataclass
class Proposal:
    """A drafter's proposal for the B - 1 rows after each anchor (`DFlashDraftModel.propose`)."""

    drafts: torch.LongTensor
    """(b, B - 1) the proposed tokens."""
    probs: torch.Tensor | None
    """(b, B - 1, V) float32: row j's distribution given the drafts before it, the one drafts[:, j] was drawn from
    (rejection sampling reads it); None when the drafts are deterministic (greedy, point-mass sampling)."""
    confidence: torch.Tensor
    """(b, B - 1) float32: the drafter's probability of each draft given the drafts before it, which the engine's
    policy reads to decide how many rows are worth verifying; it never changes which tokens are committed."""


@dataclass(frozen=True)
class DecodingRule:
    """How a call proposes and accepts: greedy, sampling with a point-mass proposal, or full rejection sampling."""

    do_sample: bool
    rejection: bool
    """Drafts are sampled from the drafter's distribution at `temperature` and accepted by rejection sampling;
    otherwise the drafter's argmax is proposed and accepted when it equals the target's own choice."""
    temperature: float = 1.0

    @classmethod
    def for_call(cls, generation_config: object, dflash_sampling: str) -> "DecodingRule":
        if dflash_sampling not in ("point_mass", "rejection"):
            raise ValueError(f"dflash_sampling must be 'point_mass' or 'rejection', got {dflash_sampling!r}")
        do_sample = bool(generation_config.do_sample)
        return cls(
            do_sample=do_sample,
            rejection=do_sample and dflash_sampling == "rejection",
            temperature=float(generation_config.temperature or 1.0),
        )

    def propose(self, draft_logits: torch.Tensor) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """draft_logits (b, n, V) -> (drafts (b, n), the distribution they were sampled from (b, n, V) or None)."""
        if not self.rejection:
            return draft_logits.argmax(dim=-1), None
        probs = draft_distribution(draft_logits, self.temperature)
        return sample(probs), probs


def accept(
    scores: torch.Tensor, drafts: torch.LongTensor, do_sample: bool | torch.Tensor, draft_probs: torch.Tensor | None
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Acceptance of a block. scores (b, n, V) processed target scores; drafts (b, n - 1); do_sample for every
    sequence, or per sequence (b,) bool (the engine's rows keep their own settings; point-mass proposals only).

    Returns (tokens (b, n), accepted (b,)): sequence i commits tokens[i, : accepted[i] + 1], its accepted drafts
    followed by the target's own token (the bonus, or the correction of the first rejected draft).
    - greedy, and sampling with a point-mass proposal (`draft_probs` None): the target picks its token at every
      row (argmax or a sample of its distribution) and a draft is accepted while it equals that token; each
      committed token is then exactly the target's own choice.
    - rejection sampling (`draft_probs` (b, n - 1, V), the distribution the drafts were sampled from): accept
      draft j with probability min(1, p_j(d) / q_j(d)); the first rejected one is replaced by a sample of
      normalize(max(p_j - q_j, 0)); if none is rejected the bonus is a sample of p at the last row. Only that one
      row per sequence is sampled: the residuals of rows after it are never read.
    """
    if draft_probs is None:
        if isinstance(do_sample, torch.Tensor):
            tokens = torch.where(do_sample[:, None], sample(torch.softmax(scores, dim=-1)), scores.argmax(dim=-1))
        else:
            tokens = sample(torch.softmax(scores, dim=-1)) if do_sample else scores.argmax(dim=-1)
        return tokens, (drafts == tokens[:, :-1]).long().cumprod(dim=1).sum(dim=1)
    probs = torch.softmax(scores, dim=-1)
    p = probs[:, :-1].gather(-1, drafts[..., None])[..., 0]  # (b, n - 1)
    q = draft_probs.gather(-1, drafts[..., None])[..., 0]
    keep = torch.rand_like(p) * q < p  # u < p / q without dividing by a zero q
    accepted = keep.long().cumprod(dim=1).sum(dim=1)  # (b,)
    # Row `accepted` of each sequence: its target distribution, and its proposal, taken as 0 at the bonus row (after
    # a whole block), where the residual max(p - 0, 0) is then p itself.
    drafted, vocab = draft_probs.shape[1:]
    target_row = probs.gather(1, accepted[:, None, None].expand(-1, 1, vocab))[:, 0]  # (b, V)
    if drafted:
        proposal = draft_probs.gather(1, accepted.clamp(max=drafted - 1)[:, None, None].expand(-1, 1, vocab))[:, 0]
        draft_row = proposal * (accepted < drafted)[:, None]
    else:  # a block of no drafts (the last token before max_length): the bonus row alone
        draft_row = torch.zeros_like(target_row)
    residual = (target_row - draft_row).clamp_(min=0)
    # Where p <= q everywhere (possible only if p == q), rejection has probability 0; keep the sampler defined.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target_row)
    correction = sample(residual)[:, None]  # (b, 1)
    # tokens[j] = drafts[j] for j < accepted, the correction at accepted (later columns are never read)
    columns = torch.arange(drafted + 1, device=drafts.device)
    tokens = torch.where(columns == accepted[:, None], correction, torch.cat([drafts, correction], dim=1))
    return tokens, accepted


__all__ = [
    "DecodingRule", "Proposal", "accept", "draft_confidence", "draft_distribution", "exponential_race_sample",
    "inverse_cdf_sample", "sample", "width_confidence",
]
