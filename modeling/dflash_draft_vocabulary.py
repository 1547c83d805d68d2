"""A drafter's reduced draft vocabulary: the target token ids it drafts over, and their file beside the weights.

In memory a draft vocabulary is one tensor, the sorted target ids it keeps ((K,) int64); drafting computes logits for
those lm_head rows only and gives every other token -inf (`DraftVocabularyHead`, which the one propose forward of both
loops calls), so drafts always lie inside it while the target's verification keeps the output exact. On disk it is
`draft_vocab.safetensors`, in vLLM speculators' two maps (a folder converts to speculators without loss): `d2t` (K,)
int64, target id = draft id + d2t[draft id], and `t2d` (V,) bool, the target ids kept.

This file is part of the remote-code bundle: it imports only torch, transformers (and safetensors, which transformers
requires) and its sibling files.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .dflash_compat import tensor_version

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


def checked_draft_vocabulary(token_ids: torch.Tensor | Sequence[int], vocab_size: int) -> torch.LongTensor:
    """token ids (any order) -> the sorted (K,) int64 draft vocabulary, or a ValueError naming the fix. Ids must be
    target ids, each once. The mask token need not be among them: it is an input of the drafter, never a draft."""
    ids = torch.as_tensor(token_ids)
    if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(
            f"a draft vocabulary is a non-empty 1-D list of integer target token ids, got {ids.dtype} of shape "
            f"{tuple(ids.shape)}; pass e.g. torch.tensor([ids...]) (or None to draft over the full vocabulary)"
        )
    ids = ids.to("cpu", torch.long).sort().values
    repeated = ids[1:][ids[1:] == ids[:-1]]
    if len(repeated):
        raise ValueError(f"the draft vocabulary repeats token id {int(repeated[0])}; pass each id once (torch.unique)")
    if ids[0] < 0 or ids[-1] >= vocab_size:
        bad = int(ids[0]) if ids[0] < 0 else int(ids[-1])
        raise ValueError(
            f"draft vocabulary token id {bad} is outside the target vocabulary (0..{vocab_size - 1}); pass target ids"
        )
    return ids


def draft_vocabulary_maps(draft_vocabulary: torch.LongTensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """The sorted target ids (K,) -> speculators' {"d2t": (K,) int64, "t2d": (V,) bool}."""
    ids = draft_vocabulary.cpu()
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return {"d2t": ids - torch.arange(len(ids)), "t2d": t2d}


def draft_vocabulary_from_maps(
    maps: dict[str, torch.Tensor], vocab_size: int, draft_vocab_size: int | None, source: object
) -> torch.LongTensor:
    """speculators' d2t/t2d -> the sorted target ids (K,), after checking the two maps describe one vocabulary of
    `draft_vocab_size` ids (when given) among `vocab_size`."""
    fix = f"write {DRAFT_VOCAB_FILE} again (DFlashDraftModel.set_draft_vocabulary, then save_pretrained)"
    if set(maps) != {"d2t", "t2d"}:
        raise ValueError(f"{source} holds {sorted(maps)}, not the draft-vocabulary maps d2t and t2d; {fix}")
    d2t, t2d = maps["d2t"], maps["t2d"]
    if d2t.dim() != 1 or t2d.shape != (vocab_size,) or d2t.is_floating_point():
        raise ValueError(
            f"{source}: d2t {tuple(d2t.shape)} and t2d {tuple(t2d.shape)} do not fit a target vocabulary of "
            f"{vocab_size}; {fix}"
        )
    if draft_vocab_size is not None and len(d2t) != draft_vocab_size:
        raise ValueError(
            f"{source} holds {len(d2t)} draft ids but the config records draft_vocab_size {draft_vocab_size}; {fix}"
        )
    ids = torch.arange(len(d2t)) + d2t.long()
    if not torch.equal(ids, t2d.bool().nonzero()[:, 0]):
        raise ValueError(f"{source}: d2t and t2d disagree on which target ids the draft vocabulary keeps; {fix}")
    return ids


def sliceable_head(lm_head: torch.nn.Module) -> bool:
    """Whether the lm_head is a plain Linear over a readable floating-point weight, whose rows can be copied out. A
    quantized one (integer or packed weights, a quantizer's tensor subclass) or an offloaded one (weights on the meta
    device until its hook loads them) is not."""
    weight = lm_head.weight
    return (
        type(lm_head) is torch.nn.Linear
        and type(weight) in (torch.Tensor, torch.nn.Parameter)
        and weight.is_floating_point()
        and weight.device.type != "meta"
    )


class DraftVocabularyHead:
    """The target's lm_head restricted to a drafter's draft vocabulary: (b, n, H) -> full-vocabulary logits
    (b, n, V), -inf at every token outside it, so greedy argmax, sampling and rejection sampling downstream run
    unchanged (the drafter's q is 0 outside the set; the target's residual covers those tokens).

    Computes only the kept rows: a contiguous copy of them (weight, and bias if any), made once, where and in the dtype
    the lm_head computes (K x H elements, e.g. 16,384 x 576 for SmolLM2's 49,152-token head). A head whose rows cannot
    be copied (`sliceable_head`: quantized, offloaded) computes full logits and masks them: the same drafts, no saving.
    Fixed shapes and no host read, so the fast path's compiled step and CUDA graph run it as they run the lm_head.
    """

    def __init__(self, lm_head: torch.nn.Module, token_ids: torch.LongTensor, vocab_size: int, device: torch.device):
        self.lm_head = lm_head
        self.vocab_size = vocab_size
        self.token_ids = token_ids.to(device)  # (K,) sorted target ids
        # the kept rows as a linear layer of their own (H -> K), so that a CPU engine's oneDNN products take it too
        self.kept: torch.nn.Linear | None = None
        self.outside = None
        if sliceable_head(lm_head):
            rows = self.token_ids.to(lm_head.weight.device)
            weight = lm_head.weight.detach()[rows].to(device).contiguous()  # (K, H)
            self.kept = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=lm_head.bias is not None, device="meta")
            self.kept.weight = torch.nn.Parameter(weight, requires_grad=False)
            if lm_head.bias is not None:
                self.kept.bias = torch.nn.Parameter(
                    lm_head.bias.detach()[rows].to(device).contiguous(), requires_grad=False  # (K,)
                )
        else:
            self.outside = torch.ones(vocab_size, dtype=torch.bool, device=device)
            self.outside[self.token_ids] = False

    @classmethod
    def for_drafter(
        cls, drafter: torch.nn.Module, lm_head: torch.nn.Module, device: torch.device
    ) -> "DraftVocabularyHead | None":
        """The head for `drafter`'s draft vocabulary, or None when it drafts over the full vocabulary. Kept on the
        drafter while its vocabulary and the lm_head's weight stay as they were, so that each eager generate call
        does not copy the rows again (about one step's saving)."""
        token_ids = drafter.draft_vocabulary
        if token_ids is None:
            return None
        weight = lm_head.weight
        key = (id(lm_head), weight.data_ptr(), tensor_version(weight), weight.dtype, str(device), id(token_ids))
        held = getattr(drafter, "_dflash_draft_head", None)
        if held is None or held[0] != key:
            drafter._dflash_draft_head = None  # let the old copy go first
            drafter._dflash_draft_head = (key, cls(lm_head, token_ids, drafter.config.vocab_size, device))
        return drafter._dflash_draft_head[1]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.kept is None:
            return self.lm_head(hidden).masked_fill(self.outside, float("-inf"))
        kept = self.kept(hidden)  # (b, n, K)
        logits = kept.new_full((*kept.shape[:-1], self.vocab_size), float("-inf"))  # (b, n, V)
        return logits.index_copy_(-1, self.token_ids, kept)


__all__ = [
    "DRAFT_VOCAB_FILE", "DraftVocabularyHead", "checked_draft_vocabulary", "draft_vocabulary_from_maps",
    "draft_vocabulary_maps", "sliceable_head",
]
