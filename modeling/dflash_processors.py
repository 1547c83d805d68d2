"""The call's logits processors applied to every verified row of a step at once, on the device.

Plain generate calls each processor once per token with the whole prefix. A verify step scores B rows per sequence
at once, and row j must see what plain generate would have seen there: the committed prefix followed by drafts[:j].
Most processors that generate builds read less than the prefix, which is what lets them run on the device, inside
the fast path's CUDA graph, for all rows together:

- row processors read only their row's scores (temperature, top-k, top-p, top-h, min-p, typical-p, epsilon, eta,
  suppress-tokens, inf/nan removal, renormalization, single-token sequence bias / bad words): called as they are on
  the (b * B, V) rows, except that a top-k followed by a top-p (generate's order) runs as one `TopKTopP`, which gives
  the pair's scores without sorting the whole vocabulary, wherever that is the faster of the two (`merged_pays`);
- length-gated processors act only at some prefix lengths (min-length, min-new-tokens, begin-suppress, forced
  BOS/EOS): each is called once as if its condition held, and each row takes that result where its own length meets
  the condition;
- the repetition penalty reads the set of tokens in the prefix: the prompt's set is read once from the processor
  itself (so its treatment of left padding, which changed between transformers versions, is kept), committed tokens
  join it after each step, and row j adds drafts[:j].

The others read the whole prefix (no-repeat n-grams, multi-token sequence bias / bad words, prefix_allowed_tokens_fn,
green-list watermarking, the exponential length penalty) or are unknown to us (a processor passed in
`logits_processor`): they stay on the host and are called one sequence and one row at a time, in their place in the
list, exact because they keep no state between calls; such a call's steps run eagerly (no CUDA graph can call the
host). Processors that keep state between calls or run their own forward (classifier-free guidance, SynthID
watermarking) cannot see B rows in one step the way they saw one token per call, and are refused before any forward
(`check_logits_processors`).

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers.generation import logits_process as lp

from .dflash_compat import distribution_checks_default


def _classes(*names: str) -> tuple[type, ...]:
    """The processor classes of these names that this transformers version has (top-h came in 5.x)."""
    return tuple(getattr(lp, name) for name in names if hasattr(lp, name))


ROW_PROCESSORS = _classes(
    "TemperatureLogitsWarper",
    "TopKLogitsWarper",
    "TopPLogitsWarper",
    "TopHLogitsWarper",
    "MinPLogitsWarper",
    "TypicalLogitsWarper",
    "EpsilonLogitsWarper",
    "EtaLogitsWarper",
    "SuppressTokensLogitsProcessor",
    "InfNanRemoveLogitsProcessor",
    "LogitNormalization",
)
# Processor -> (the prefix length at which its condition holds, the condition per row length (rows,) -> bool (rows,)).
LENGTH_GATES: dict[type, tuple[Callable[[Any], int], Callable[[Any, torch.Tensor], torch.Tensor]]] = {
    lp.MinLengthLogitsProcessor: (lambda p: 0, lambda p, length: length < p.min_length),
    lp.MinNewTokensLengthLogitsProcessor: (
        lambda p: 0, lambda p, length: length - p.prompt_length_to_skip < p.min_new_tokens
    ),
    lp.SuppressTokensAtBeginLogitsProcessor: (lambda p: p.begin_index, lambda p, length: length == p.begin_index),
    lp.ForcedBOSTokenLogitsProcessor: (lambda p: 1, lambda p, length: length == 1),
    lp.ForcedEOSTokenLogitsProcessor: (lambda p: p.max_length - 1, lambda p, length: length == p.max_length - 1),
}
# Keep state between calls or run their own forward: refused (see the module docstring).
STATEFUL_PROCESSORS = _classes(
    "UnbatchedClassifierFreeGuidanceLogitsProcessor",
    "ClassifierFreeGuidanceLogitsProcessor",
    "SynthIDTextWatermarkLogitsProcessor",
)
# Hold one tensor row per sequence of the batch (or call a function with the row index), so a call with one sequence
# at a time reads the wrong row: served for a batch of 1 only.
BATCH_BOUND_PROCESSORS = _classes(
    "PrefixConstrainedLogitsProcessor", "EncoderRepetitionPenaltyLogitsProcessor", "EncoderNoRepeatNGramLogitsProcessor"
)
# Attributes a processor fills or changes while it runs (caches, per-call inputs), left out of the signature.
_RUNTIME_ATTRIBUTES = {"prompt_ignore_length", "logits_indices", "cu_seq_lens_q", "length_1_bias", "multi_token_biases",
                       "prepared_bias_variables"}


def check_logits_processors(logits_processor: Any, batch_size: int) -> None:
    """Refuse, before any forward, the processors a verify of several rows per step cannot serve exactly."""
    for processor in logits_processor:
        if isinstance(processor, STATEFUL_PROCESSORS):
            what = "guidance_scale (classifier-free guidance)" if "Guidance" in type(processor).__name__ else (
                "SynthID text watermarking"
            )
            raise ValueError(
                f"{what} is not supported with a DFlash drafter: its {type(processor).__name__} keeps state between "
                "calls (its own forward's cache, or a context of past tokens) one token at a time, which a verify of "
                "several tokens per step would corrupt; drop it or the drafter"
            )
        if batch_size > 1 and isinstance(processor, BATCH_BOUND_PROCESSORS):
            raise ValueError(
                f"{type(processor).__name__} holds one row per sequence of the batch, and DFlash applies it to one "
                "sequence at a time; generate with a batch of 1 to use it"
            )


def _single_token_bias(processor: Any) -> bool:
    """A sequence-bias / bad-words processor whose sequences are all one token long reads no prefix."""
    return isinstance(processor, lp.SequenceBiasLogitsProcessor) and all(
        len(sequence) == 1 for sequence in processor.sequence_bias
    )


def _frozen(value: Any) -> Any:
    """A hashable stand-in for a processor attribute (tensors by their values)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), tuple(value.flatten().tolist()))
    if isinstance(value, dict):
        return tuple(sorted((repr(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)


@contextlib.contextmanager
def _no_distribution_checks() -> Iterator[None]:
    """Eta and top-h build a torch Categorical, whose argument check reads a tensor back to the host (which a CUDA
    graph cannot record); the arguments are logits, always valid, so the check is off while they run."""
    checks = distribution_checks_default()
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(checks)


class TopKTopP:
    """A TopKLogitsWarper followed by a TopPLogitsWarper, both filtering to -inf, in one step whose scores equal the
    pair's bit for bit (ties as a stable sort orders them, below), sorting only top-k's k values where the pair's top-p
    sorts every row in full.

    Top-k keeps every token whose score is at least the k-th largest: a group of tokens tied at that value all survive,
    so the survivors number m >= k (m = V when fewer than k scores are finite). Top-p then sorts the row ascending,
    cuts where the softmax's running sum is <= 1 - top_p, and keeps the last min_tokens_to_keep. That ascending row is
    known without a sort: -inf V - m times, the k-th value once for each token tied at it, then the values above it
    ascending (all among topk's k values). Built at full width, its softmax and running sum are the pair's own,
    value for value; each survivor then reads the cut at its place in that order. Exact ties are placed as a stable
    sort places them (the lower token index first, so cut first). The pair's own sort is not asked to be stable:
    on the CPU it orders exact ties arbitrarily, so where top-p's cut falls inside a group of equal scores the pair
    keeps an arbitrary subset of that group, and this step the highest-indexed ones (same count, same scores).
    Fixed shapes throughout and no host sync, so it records in a CUDA graph.
    """

    def __init__(self, top_k: int, top_p: float, min_tokens_to_keep: int):
        self.top_k, self.top_p, self.min_tokens_to_keep = top_k, top_p, min_tokens_to_keep

    @staticmethod
    def merges(first: Any, second: Any) -> bool:
        """Whether this pair is served exactly: another filter value would leave top-k's cut tokens with a finite
        score that top-p's softmax counts."""
        return (
            type(first) is lp.TopKLogitsWarper and type(second) is lp.TopPLogitsWarper
            and first.filter_value == -float("inf") and second.filter_value == -float("inf")
        )

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        """scores (rows, V) -> (rows, V): the pair's scores (input_ids unused, as by the pair)."""
        vocab = scores.shape[-1]
        k = min(self.top_k, vocab)
        top_values, top_indices = scores.topk(k)  # (rows, k) descending; which of tied tokens it picks is arbitrary
        kth = top_values[:, -1:]  # (rows, 1)
        at_kth = scores == kth  # (rows, V)
        tie_rank = at_kth.cumsum(-1)  # (rows, V) 1 + the number of ties of the k-th value before each token
        survivors = (top_values > kth).sum(-1, keepdim=True) + tie_rank[:, -1:]  # (rows, 1) m
        # Top-p's ascending row of top-k's output: -inf, then the k-th value from place V - m on, then the top k.
        places = torch.arange(vocab, device=scores.device)
        ascending = torch.where(places < vocab - survivors, -float("inf"), kth)  # (rows, V)
        ascending[:, vocab - k :] = top_values.flip(-1)
        cut = ascending.softmax(dim=-1).cumsum_(dim=-1) <= (1 - self.top_p)
        cut[..., -self.min_tokens_to_keep :] = False
        # The tokens tied at the k-th value fill places V - m onward in token order (in place: a full-width int64).
        tie_place = tie_rank.add_(vocab - 1 - survivors).clamp_min_(0)  # (rows, V), garbage but in range elsewhere
        keep = cut.gather(-1, tie_place).logical_not_().logical_and_(at_kth)
        # The top-k entries above the k-th value hold the last places: order them ascending by (score, token index).
        by_index, index_order = top_indices.sort(dim=-1)
        values_by_index = top_values.gather(-1, index_order)
        ascending_top, top_order = values_by_index.sort(dim=-1, stable=True)  # (rows, k)
        top_tokens = by_index.gather(-1, top_order)
        above_kth_kept = torch.where(ascending_top > kth, ~cut[:, vocab - k :], keep.gather(-1, top_tokens))
        keep.scatter_(-1, top_tokens, above_kth_kept)
        return torch.where(keep, scores, -float("inf"))


# On a CUDA device TopKTopP's twenty-odd small kernels cost more than the pair's one sort of a few rows: on an H200,
# with both recorded as CUDA graphs, the pair was faster at 16 x 151,936 scores (Qwen3-8B, batch 1) and the merged step
# at 256 x 49,152 (SmolLM2, batch 16). The line is drawn where a straight line through each method's two points
# crosses the other's, about 5M scores; the shapes in between were not measured. On a CPU the merged step was faster at
# every shape tried (16 to 256 rows). The timings: benchmarks/sampling.md, 2026-12-05.
MERGED_TOP_K_TOP_P_FROM_CUDA = 5_000_000


def merged_pays(scores: torch.Tensor) -> bool:
    """Whether TopKTopP is the faster way to apply a top-k -> top-p pair to `scores` (rows, V); both give the
    same scores where the pair's sort orders ties stably, as it does on a GPU."""
    return not scores.is_cuda or scores.numel() >= MERGED_TOP_K_TOP_P_FROM_CUDA


def _merge_top_k_top_p(processors: list[Any]) -> list[Any]:
    """The list with each exactly mergeable TopK -> TopP pair replaced by one TopKTopP."""
    merged = []
    for processor in processors:
        if merged and TopKTopP.merges(merged[-1], processor):
            top_k = merged.pop()
            processor = TopKTopP(top_k.top_k, processor.top_p, processor.min_tokens_to_keep)
        merged.append(processor)
    return merged


class StepProcessors:
    """The call's processors, sorted into those the device applies to all verify rows and those left on the host.

    `host_only` names the processors that need the host (empty when the whole list runs on the device).
    `signature` identifies what the device work computes, so a recorded CUDA graph is replayed only for a call whose
    processors compute the same thing.
    """

    def __init__(self, logits_processor: Any):
        self.processors = list(logits_processor)
        # What __call__ applies where `merged_pays`: the list with top-k -> top-p merged (exact, so `signature` still
        # reads the list).
        self.merged_steps = _merge_top_k_top_p(self.processors)
        penalties = [p for p in self.processors if type(p) is lp.RepetitionPenaltyLogitsProcessor]
        host = [
            p for p in self.processors
            if not (type(p) in ROW_PROCESSORS or type(p) in LENGTH_GATES or _single_token_bias(p))
            and not (penalties and p is penalties[0])
        ]
        self._host = host
        self.host_only = [type(p).__name__ for p in host]
        # One repetition penalty is served on the device; a second one (passed by hand) would need its own prompt set.
        self.penalty = penalties[0] if penalties else None
        self._every_token_penalty = (
            lp.RepetitionPenaltyLogitsProcessor(self.penalty.penalty) if self.penalty is not None else None
        )

    @property
    def signature(self) -> tuple:
        """What the device work computes: the processors' types and settings (asked only of a device-ready list)."""
        return tuple(
            (type(p).__name__, tuple(sorted((k, _frozen(v)) for k, v in vars(p).items() if k not in _RUNTIME_ATTRIBUTES)))
            for p in self.processors
        )

    def first_token_scores(self, input_ids: torch.LongTensor, logits: torch.Tensor) -> torch.Tensor:
        """The prefill's scores, processed exactly as plain generate processes its first token: every processor
        called once on the whole batch. input_ids (b, P); logits (b, V) -> float32 (b, V)."""
        scores = logits.to(dtype=torch.float32, copy=True)  # processors may write in place; the logits are returned
        for processor in self.processors:
            scores = processor(input_ids, scores)
        return scores

    def prompt_presence(self, input_ids: torch.LongTensor, vocab_size: int) -> torch.Tensor | None:
        """(b, V) bool: the tokens of each prompt that the repetition penalty counts, or None without a penalty.

        Read from the processor itself: it divides a score of 1 exactly where it counts the token.
        """
        if self.penalty is None:
            return None
        ones = torch.ones(input_ids.shape[0], vocab_size, dtype=torch.float32, device=input_ids.device)
        return self.penalty(input_ids, ones) != 1

    def __call__(
        self,
        logits: torch.Tensor,
        lengths: torch.LongTensor,
        presence: torch.Tensor | None,
        drafts: torch.LongTensor,
        prefixes: list[torch.LongTensor] | None = None,
    ) -> torch.Tensor:
        """Processed float32 scores (b, n, V) of the verify rows, each processor applied in the list's order.

        logits (b, n, V); lengths (b,) each sequence's length as plain generate's input_ids have it (padding
        included) before row 0's token; presence (b, V) the tokens the repetition penalty counts so far (None without
        one); drafts (b, n - 1): row j sees the prefix followed by drafts[:, :j], which is the committed prefix
        whenever row j matters (every earlier draft accepted). `prefixes[i]` (1, t_i), the committed tokens of
        sequence i, is needed only by host processors.
        """
        b, n, vocab = logits.shape
        scores = logits.to(dtype=torch.float32, copy=True).reshape(b * n, vocab)
        row_lengths = (lengths[:, None] + torch.arange(n, device=lengths.device)).reshape(b * n)
        no_prefix = torch.zeros((), dtype=torch.long, device=scores.device).expand(b * n, 0)
        steps = self.merged_steps if merged_pays(scores) else self.processors  # a shape is fixed in a CUDA graph
        with _no_distribution_checks():
            for processor in steps:
                if processor is self.penalty:
                    every_token = torch.arange(vocab, device=scores.device).expand(b * n, vocab)
                    penalized = self._every_token_penalty(every_token, scores)
                    scores = torch.where(row_presence(presence, drafts), penalized, scores)
                elif type(processor) in LENGTH_GATES:
                    trigger_length, holds = LENGTH_GATES[type(processor)]
                    prefix = torch.zeros((), dtype=torch.long, device=scores.device).expand(b * n, trigger_length(processor))
                    scores = torch.where(holds(processor, row_lengths)[:, None], processor(prefix, scores), scores)
                elif any(processor is p for p in self._host):
                    scores = _row_by_row(processor, scores.view(b, n, vocab), prefixes, drafts).reshape(b * n, vocab)
                else:
                    scores = processor(no_prefix, scores)
        return scores.view(b, n, vocab)


def row_presence(presence: torch.Tensor, drafts: torch.LongTensor) -> torch.Tensor:
    """(b * n, V) bool: the tokens the repetition penalty counts at each verify row. presence (b, V): a sequence's
    prefix's tokens; drafts (b, n - 1): row j of a sequence also counts drafts[:j]."""
    b, vocab = presence.shape
    n = drafts.shape[1] + 1
    earlier = torch.ones(n, n - 1, dtype=torch.int32, device=drafts.device).tril(-1)  # [j, k] = k < j
    hits = torch.zeros(b, n, vocab, dtype=torch.int32, device=drafts.device)
    hits.scatter_add_(2, drafts[:, None, :].expand(b, n, n - 1), earlier.expand(b, n, n - 1))
    return (presence[:, None] | (hits > 0)).reshape(b * n, vocab)


def _row_by_row(
    processor: Any, scores: torch.Tensor, prefixes: list[torch.LongTensor], drafts: torch.LongTensor
) -> torch.Tensor:
    """A host processor called as plain generate calls it: one sequence and one row at a time, row j with the
    sequence's prefix followed by drafts[:j]. scores (b, n, V) -> (b, n, V)."""
    return torch.stack(
        [
            torch.cat(
                [
                    processor(torch.cat([prefix, drafts[i : i + 1, :j]], dim=1), scores[i : i + 1, j])
                    for j in range(scores.shape[1])
                ]
            )
            for i, prefix in enumerate(prefixes)
        ]
    )


__all__ = ["StepProcessors", "check_logits_processors", "row_presence"]
