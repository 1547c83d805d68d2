"""The DFlash2 drafter: DFlash plus a convolution along the block in every layer and a candidate selector.

DFlash2 (z-lab, August 2026) keeps DFlash's one-pass block drafter (two-stream attention over the context rows and
the block rows, the target's embedding and lm_head) and adds, as z-lab's reference, vLLM and SGLang implement it:

- A grouped dynamic causal depthwise convolution around attention and around the MLP of every layer
  (`DFlash2GroupedConv`). From the sublayer's normalized input x, `kernel_projection` predicts one kernel per tap and
  channel group for each side: the first half of its output features for the convolution before the sublayer, the
  second half for the one after it. Row t of a block becomes
  sum over taps j < K of (base_kernel[side, j] + dynamic[t, side, j]) * row t - j, with rows before the block zero.
- Scaled, soft-capped logits: c * tanh(lm_head(h) * output_multiplier / c), c = final_logit_softcapping.
- A candidate selector (`DFlash2CandidateSelector`) that turns the rows' logits into a coherent path: each row keeps
  its top-k tokens and scores them against the token chosen before it (the anchor for row 1) with a low-rank bigram
  term, S_i(p, c) = unary_i(c) + <predecessor_codebook[p] * hidden_projection(h_i), successor_codebook[c]>.
  Greedy decoding walks the rows taking each row's best candidate; sampling draws each row from
  softmax(S_i(p, .) / T) over its candidates, which is the proposal distribution rejection sampling accepts against.

Shapes: b = batch, n = block rows (B, or B - 1 after the anchor), H = hidden size, K = conv taps, G = channel groups,
k = selector_top_k, r = selector_rank, V = target vocabulary.

The DFlash2 fields are `DFlashConfig`'s (conv_kernel_size, conv_group_size, selector_rank, selector_top_k,
output_multiplier, final_logit_softcapping, input_embedding_scale; checked there, published defaults for those a config
leaves out), read once into `DFlash2Settings`.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import BaseModelOutput

from .configuration_dflash import DFlashConfig
from .dflash_acceptance import DecodingRule, Proposal, sample
from .modeling_dflash import DFlashDecoderLayer, DFlashDraftModel


@dataclass(frozen=True)
class DFlash2Settings:
    """The fields DFlash2 adds to a DFlash config, read once."""

    conv_kernel_size: int
    """Taps of each convolution (2 in every published drafter): the row itself and the K - 1 rows before it."""
    conv_group_size: int
    """Channels that share one dynamic kernel value; divides hidden_size."""
    selector_rank: int
    """Width of the selector's codebooks."""
    selector_top_k: int
    """Candidates per row the selector chooses among."""
    output_multiplier: float = 1.0
    """Scale of the lm_head's logits before the soft cap."""
    final_logit_softcapping: float | None = None
    """c of c * tanh(logits / c); None (or 0 in a config, as z-lab's and vLLM's readers take it) for no cap."""
    input_embedding_scale: float = 1.0
    """Scale of the block rows' embeddings (anchor and mask rows alike; the context is not scaled)."""

    @classmethod
    def from_config(cls, config: DFlashConfig) -> "DFlash2Settings":
        """The settings of a DFlash2 config (`DFlashConfig` has checked every field, alone and against the others)."""
        if not config.is_dflash2:
            raise ValueError(
                "this is a DFlash drafter config (no DFlash2 fields); build a DFlashDraftModel from it, or give it the "
                "DFlash2 fields (conv_kernel_size, conv_group_size, selector_rank, selector_top_k, ...)"
            )
        return cls(
            conv_kernel_size=config.conv_kernel_size,
            conv_group_size=config.conv_group_size,
            selector_rank=config.selector_rank,
            selector_top_k=config.selector_top_k,
            output_multiplier=float(config.output_multiplier),
            final_logit_softcapping=None if config.final_logit_softcapping is None
            else float(config.final_logit_softcapping),
            input_embedding_scale=float(config.input_embedding_scale),
        )

    def unary_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """lm_head logits (...) -> float32 c * tanh(logits * output_multiplier / c), the scores the selector starts
        from. -inf (a token outside a draft vocabulary) stays -inf, where the cap alone would make it -c."""
        scaled = logits.float() * self.output_multiplier
        if self.final_logit_softcapping is None:
            return scaled
        cap = self.final_logit_softcapping
        return torch.where(scaled == -math.inf, scaled, torch.tanh(scaled / cap) * cap)


class DFlash2KernelProjection(nn.Linear):
    """The convolution's kernel predictor: a plain linear map (its own class only so that a fresh drafter starts it
    at zero, see `DFlash2DraftModel._init_weights`)."""


class DFlash2GroupedConv(nn.Module):
    """Grouped dynamic causal depthwise convolution along the block rows, one on each side of a sublayer.

    base_kernel (2, K, H): static per-channel weights, [0] before the sublayer, [1] after it, [:, 0] the row itself.
    kernel_projection (H -> 2 * K * G): dynamic weights per row, one per tap and group of `group_size` contiguous
    channels, laid out (side, tap, group). Both sides' dynamic weights come from the sublayer's normalized input.

    Rows are consecutive blocks of `block_size` (one block when drafting; many, end to end, when training), and a tap
    never reaches into the block before.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.num_groups = hidden_size // group_size
        self.block_size = block_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = DFlash2KernelProjection(hidden_size, 2 * kernel_size * self.num_groups, bias=False)

    def prepare(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """normed (b, n, H) the sublayer's normalized input -> (its convolution (b, n, H), the dynamic weights the
        convolution after the sublayer takes (b, n, K, G))."""
        dynamic = self.kernel_projection(normed).view(*normed.shape[:-1], 2, self.kernel_size, self.num_groups)
        return self.convolve(normed, dynamic[..., 0, :, :], side=0), dynamic[..., 1, :, :]

    def finish(self, output: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        """output (b, n, H) the sublayer's output, dynamic (b, n, K, G) from `prepare` -> (b, n, H)."""
        return self.convolve(output, dynamic, side=1)

    def convolve(self, rows: torch.Tensor, dynamic: torch.Tensor, side: int) -> torch.Tensor:
        batch, num_rows, hidden = rows.shape
        grouped = rows.view(batch, num_rows, self.num_groups, self.group_size)  # (b, n, G, g)
        base = self.base_kernel[side].to(rows.dtype).view(self.kernel_size, self.num_groups, self.group_size)
        kernel = base + dynamic.unsqueeze(-1)  # (b, n, K, G, g): the weights at output row t
        out = kernel[:, :, 0] * grouped
        row_in_block = torch.arange(num_rows, device=rows.device) % self.block_size
        for tap in range(1, min(self.kernel_size, num_rows)):
            earlier = F.pad(grouped[:, :-tap], (0, 0, 0, 0, tap, 0))  # row t holds row t - tap, zero before row 0
            earlier = earlier * (row_in_block >= tap).to(rows.dtype)[:, None, None]  # nor from the previous block
            out = out + kernel[:, :, tap] * earlier
        return out.view(batch, num_rows, hidden)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """DFlash's layer with a convolution before and after attention and before and after the MLP:
    h + conv_after(attention(conv_before(norm(h)))), then the same around the MLP. Attention sees the convolved
    rows as its queries and as the block's own keys/values; context rows are untouched."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        settings = DFlash2Settings.from_config(config)
        shape = (config.hidden_size, settings.conv_kernel_size, settings.conv_group_size, config.block_size)
        self.attention_conv = DFlash2GroupedConv(*shape)
        self.mlp_conv = DFlash2GroupedConv(*shape)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        context_features: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Any | None = None,
    ) -> torch.Tensor:
        rows, after = self.attention_conv.prepare(self.input_layernorm(hidden_states))
        attended = self.self_attn(rows, position_embeddings, context_features, attention_mask, cache)
        hidden_states = hidden_states + self.attention_conv.finish(attended, after)
        rows, after = self.mlp_conv.prepare(self.post_attention_layernorm(hidden_states))
        return hidden_states + self.mlp_conv.finish(self.mlp(rows), after)


class DFlash2CandidateSelector(nn.Module):
    """Scores a row's candidate tokens against the token before them.

    hidden_projection (H -> r), predecessor_codebook (V, r), successor_codebook (V, r): the transition score of
    candidate c after token p at a row of final hidden state h is <predecessor_codebook[p] * hidden_projection(h),
    successor_codebook[c]>."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))

    def transition(
        self, projected: torch.Tensor, predecessor_ids: torch.LongTensor, successors: torch.Tensor
    ) -> torch.Tensor:
        """projected (..., r) hidden_projection of the rows, predecessor_ids (...), successors (..., k, r) the
        candidates' successor_codebook rows -> float32 transition scores (..., k)."""
        context = self.predecessor_codebook[predecessor_ids].float() * projected.float()  # (..., r)
        return (successors.float() @ context.unsqueeze(-1)).squeeze(-1)

    def scores(
        self,
        hidden: torch.Tensor,
        unary: torch.Tensor,
        predecessor_ids: torch.LongTensor,
        candidate_ids: torch.LongTensor,
    ) -> torch.Tensor:
        """Each row's candidates scored after a known predecessor (teacher forcing, in training): hidden (..., H) the
        rows' final hidden states, unary (..., k) the candidates' unary logits, predecessor_ids (...), candidate_ids
        (..., k) -> float32 scores (..., k)."""
        projected = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))
        return unary.float() + self.transition(projected, predecessor_ids, self.successor_codebook[candidate_ids])


class DFlash2DraftModel(DFlashDraftModel):
    """A DFlash2 drafter. Pass it as `assistant_model=` like a DFlash one.

    Weights: DFlash's, plus layers.{i}.attention_conv.{base_kernel, kernel_projection.weight}, the same for mlp_conv,
    and candidate_selector.{hidden_projection.weight, predecessor_codebook, successor_codebook}.

    `forward` takes the block's plain target embeddings and applies `input_embedding_scale` itself; everything
    else (context features, the paged-cache path, masks per layer type) is DFlash's.
    """

    decoder_layer_class = DFlash2DecoderLayer
    causal_sliding_window = False  # a symmetric window: block rows see each other both ways (is_causal: false)
    _no_split_modules = ["DFlash2DecoderLayer"]

    def __init__(self, config: DFlashConfig):
        self.settings = DFlash2Settings.from_config(config)  # checked before any layer is built
        super().__init__(config)
        self.candidate_selector = DFlash2CandidateSelector(
            config.hidden_size, config.vocab_size, self.settings.selector_rank, self.settings.selector_top_k
        )
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """A fresh DFlash2 drafter computes what its DFlash backbone computes, as SpecForge starts one: each
        convolution is the identity (tap 0 of base_kernel 1, the rest 0, kernel_projection 0) and the selector adds
        nothing (successor_codebook 0), so every row's draft is its argmax; training moves them from there."""
        super()._init_weights(module)
        if isinstance(module, DFlash2KernelProjection):
            module.weight.zero_()
        elif isinstance(module, DFlash2GroupedConv):
            module.base_kernel.zero_()
            module.base_kernel[:, 0] = 1.0
        elif isinstance(module, DFlash2CandidateSelector):
            module.predecessor_codebook.normal_(mean=0.0, std=self.config.initializer_range)
            module.successor_codebook.zero_()

    def unary_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """lm_head logits -> the drafter's own logits (scaled, soft-capped, float32); see `DFlash2Settings`."""
        return self.settings.unary_logits(logits)

    def forward(self, noise_embeds: torch.Tensor, *args: Any, **kwargs: Any) -> BaseModelOutput:
        """`DFlashDraftModel.forward`, with the block rows' embeddings (b, q, H) scaled by input_embedding_scale."""
        if self.settings.input_embedding_scale != 1.0:
            noise_embeds = noise_embeds * self.settings.input_embedding_scale
        return super().forward(noise_embeds, *args, **kwargs)

    def propose(
        self,
        hidden: torch.Tensor,
        anchor_ids: torch.LongTensor,
        head: Callable[[torch.Tensor], torch.Tensor],
        rule: DecodingRule,
    ) -> Proposal:
        """Drafts for block rows 1..B-1 along the selector's path.

        Each row keeps the top-k tokens of its logits and scores them after the token drafted at the row before
        (the anchor for row 1). Greedy and point-mass sampling take each row's best score (ties: the earlier
        candidate, candidates in decreasing logit order); rejection sampling draws each row from
        q = softmax(scores / temperature) over its candidates (0 elsewhere) and returns those rows as `probs`, each
        given the drafts before it. `confidence` is q of the draft (at temperature 1 when greedy).

        Fixed-shape tensor work without host synchronization (one step per row), so a CUDA graph can hold it.

        The proposal distribution, and why sampling stays exact. Row i's q is the selector's own sampling
        distribution given the draft actually drawn at row i - 1: softmax(S_i(d_{i-1}, c) / T) over the row's k
        candidates, 0 on every other token. That is how the engines that serve DFlash2 define it: vLLM (pull request
        52816) writes the candidates' scores into a row of -inf draft logits and Gumbel-samples it at the request's
        temperature, the rejection sampler taking q as that row's softmax; SGLang (pull request 35371) walks the rows
        by inverse CDF and returns q over the k candidates (one-hot for greedy rows). Rejection sampling is exact for
        any proposal as long as (1) each draft is drawn from the very q handed to the verifier, (2) q_i is the
        distribution given the tokens before row i, which are the committed ones exactly when row i is examined (the
        rows before it were all accepted; rows after a rejection are never read), and (3) the drafter's random numbers
        are independent of the verifier's (vLLM salts its draft noise for this reason; here every draw takes fresh
        numbers from the default generator). q may give 0 to most of the vocabulary: those tokens are never drafted,
        and the residual max(p - q, 0) returns their target mass. The temperature is the call's, so q is as sharp as
        the target's p, which is what keeps acceptance high; top-k / top-p shape only p. Greedy drafting (and the
        point-mass rule) takes each row's best score and needs no q.

        hidden (b, B - 1, H) the final-norm rows; anchor_ids (b, 1); head maps rows to the target vocabulary's
        logits (b, B - 1, V), -inf outside a draft vocabulary (such tokens are never drafted)."""
        selector = self.candidate_selector
        weight = selector.hidden_projection.weight
        logits = head(hidden)  # (b, n, V)
        top, candidates = logits.topk(selector.top_k, dim=-1)  # (b, n, k), decreasing
        unary = self.unary_logits(top)
        projected = selector.hidden_projection(hidden.to(weight.device, weight.dtype))  # (b, n, r)
        successors = selector.successor_codebook[candidates.to(weight.device)]  # (b, n, k, r)
        previous = anchor_ids[:, 0].to(weight.device)
        picks, rows = [], []
        for i in range(hidden.shape[1]):
            scores = unary[:, i] + selector.transition(projected[:, i], previous, successors[:, i]).to(unary.device)
            if rule.rejection:
                q = torch.softmax(scores / rule.temperature, dim=-1)  # (b, k)
                pick = sample(q)
            else:
                q = torch.softmax(scores, dim=-1)
                pick = scores.argmax(dim=-1)
            picks.append(pick)
            rows.append(q)
            previous = candidates[:, i].gather(-1, pick[:, None])[:, 0].to(weight.device)
        picks_, q_rows = torch.stack(picks, dim=1), torch.stack(rows, dim=1)  # (b, n), (b, n, k)
        drafts = candidates.gather(-1, picks_[..., None])[..., 0]
        confidence = q_rows.gather(-1, picks_[..., None])[..., 0]
        probs = None
        if rule.rejection:
            probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
            probs.scatter_(-1, candidates, q_rows)  # (b, n, V): each row's q, 0 outside its candidates
        return Proposal(drafts=drafts, probs=probs, confidence=confidence)


__all__ = [
    "DFlash2CandidateSelector",
    "DFlash2DecoderLayer",
    "DFlash2DraftModel",
    "DFlash2GroupedConv",
    "DFlash2KernelProjection",
    "DFlash2Settings",
]
