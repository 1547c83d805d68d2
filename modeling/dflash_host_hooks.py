"""What the host does with each committed token, written once for both loops (the fast path's and the eager one).

Plain generate commits one token per forward and, for each, keeps its scores / logits (return_dict_in_generate),
calls the stopping criteria on input_ids ending with it, and hands it to the streamer. A DFlash step commits several
tokens per sequence at once; `HostHooks.commit` walks them one at a time in that same order, so a stop string or a
custom criterion ends the sequence at the very token where plain generate ends it, and a streamer sees the same
calls. eos and max_length, which generate always adds, need no call: they are decided from the token ids the step
already read back, and a call whose criteria are only those makes no call per token.

Differences from plain generate, by construction: a criterion is called for one sequence at a time (input_ids
(1, t), the sequence's padding included), since the sequences of a batch commit different numbers of tokens per
step; a per-row criterion (every one transformers ships) decides the same. The streamer and per-token scores take a
batch of 1 (`dflash_checks.check_call`), as transformers' streamers do.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .dflash_compat import pad_token_tensor


def host_stopping_rules(stopping_criteria: Any) -> tuple[set[int], bool]:
    """The eos ids of the list, and whether it holds nothing but eos and max-length criteria (which need no call)."""
    eos_ids: set[int] = set()
    eos_and_length_only = True
    for criterion in stopping_criteria:
        if isinstance(criterion, EosTokenCriteria):
            eos_ids.update(int(i) for i in criterion.eos_token_id.flatten().tolist())
        elif not isinstance(criterion, MaxLengthCriteria):
            eos_and_length_only = False
    return eos_ids, eos_and_length_only


class HostHooks:
    """One call's host side: the sequences as plain generate holds them, and the hooks each committed token passes.

    `tokens[i]` is sequence i's ids so far (padding included, wherever the mask has it), the record both loops read;
    `sequences` (b, L) mirrors it on the device only while a stopping criterion must be called (criteria read input_ids
    there).
    """

    def __init__(self, input_ids: torch.LongTensor, generation_config: Any, stopping_criteria: Any, streamer: Any):
        return_dict = generation_config.return_dict_in_generate
        self.max_length = generation_config.max_length
        self.stopping_criteria, self.streamer = stopping_criteria, streamer
        self.keep_scores = bool(return_dict and generation_config.output_scores)
        self.keep_logits = bool(return_dict and generation_config.output_logits)
        self.eos_ids, eos_and_length_only = host_stopping_rules(stopping_criteria)
        self.calls_criteria = not eos_and_length_only
        pad = pad_token_tensor(generation_config)
        self.pad_id = int(pad) if pad is not None else 0
        self.device = input_ids.device
        self.tokens: list[list[int]] = input_ids.tolist()
        self.sequences = None
        if self.calls_criteria:
            self.sequences = torch.full(
                (input_ids.shape[0], self.max_length), self.pad_id, dtype=torch.long, device=self.device
            )
            self.sequences[:, : input_ids.shape[1]] = input_ids
        self.scores: list[torch.Tensor] = []  # per committed token (1, V) float32, as plain generate returns them
        self.raw_logits: list[torch.Tensor] = []
        # Per sequence, the tokens each verify step committed: accepted drafts and the target's own token, up to the
        # first that ends the sequence (so 1 + their sum is the sequence's new tokens).
        self.acceptance_lengths: list[list[int]] = [[] for _ in self.tokens]

    def commit(
        self, sequence: int, new: list[int], scores: torch.Tensor | None = None, logits: torch.Tensor | None = None
    ) -> bool:
        """Append sequence's `new` tokens one at a time as plain generate would, up to the first that ends it.
        scores / logits (n, V): the step's rows of `new`, read only when the call keeps them. Returns whether it ended.
        """
        start = len(self.tokens[sequence])
        if self.calls_criteria:  # one copy per step; a criterion reads a growing view of it
            self.sequences[sequence, start : start + len(new)] = torch.tensor(new, device=self.device)
        for j, token in enumerate(new):
            self.tokens[sequence].append(token)
            if self.keep_scores:
                self.scores.append(scores[j : j + 1].clone())
            if self.keep_logits:
                self.raw_logits.append(logits[j : j + 1].to(dtype=torch.float32, copy=True))
            if self.calls_criteria:
                # generate hands criteria the tuple of scores so far when it keeps them, None otherwise
                seen = tuple(self.scores) if self.keep_scores else None
                input_ids = self.sequences[sequence : sequence + 1, : start + j + 1]
                done = bool(self.stopping_criteria(input_ids, seen).all())
            else:
                done = token in self.eos_ids or start + j + 1 >= self.max_length
            if self.streamer is not None:
                self.streamer.put(torch.tensor([token]))
            if done:
                return True
        return False

    def commit_verified(
        self, sequence: int, new: list[int], scores: torch.Tensor | None = None, logits: torch.Tensor | None = None
    ) -> bool:
        """`commit` of the tokens one verify step gives `sequence`, recording how many it committed."""
        start = len(self.tokens[sequence])
        done = self.commit(sequence, new, scores, logits)
        self.acceptance_lengths[sequence].append(len(self.tokens[sequence]) - start)
        return done

    def end(self) -> None:
        """The call is over: the streamer is told once."""
        if self.streamer is not None:
            self.streamer.end()

    def output_sequences(self) -> torch.LongTensor:
        """(b, longest) every sequence, right-padded with the pad id as plain generate pads finished ones."""
        longest = max(len(row) for row in self.tokens)
        padded = [row + [self.pad_id] * (longest - len(row)) for row in self.tokens]
        return torch.tensor(padded, dtype=torch.long, device=self.device)


__all__ = ["HostHooks", "host_stopping_rules"]
