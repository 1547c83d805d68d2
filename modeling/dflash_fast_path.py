"""The fast path of `generate(assistant_model=drafter)`: the call's rows run on the continuous-batching engine.

On a GPU, eager PyTorch spends most of a step launching kernels (about 50 ms for a Qwen3-8B step on an H200 whose
memory floor is 4 ms). The engine (dflash_engine.py) runs a whole step (store the new context keys/values, draft a
block, verify it, accept, move each sequence's anchor) on preallocated buffers with every index on the device, and on
a CUDA device records each step shape once as a CUDA graph and replays it. A generate call is one of its clients, as
transformers' continuous-batching API is (dflash_continuous.py): its rows are admitted at step 0, without their
padding, and each leaves the batch the step it ends (the last row moves into its place, so the step runs on the
running rows only, at the next power of two of them). Per step the host reads back the committed tokens once; they
then pass the call's host hooks (dflash_host_hooks.py: eos / max_length, other stopping criteria token by token,
the streamer, and per-token scores / logits, which the step writes to buffers only for a call that returns them),
exactly as plain generate would stop and report. The call's logits processors and decoding rule choose the tokens
(`DFlashEngine.bind`).

Which calls the fast path serves, and the warning that says why one does not: dflash_fast_path_blockers.py. On a
CPU the engine runs the same step without a graph, which is how CI tests it. A call's verify policy
(`dflash_adaptive`) chooses each step's width on the host between two recorded parts of the step (the drafter's and
the verify's); processors that read the whole prefix are called on the host, so those steps run without a graph on
any device, as do a bitsandbytes target's.

The drafter's pass of the step (its context keys/values, masks, layers and the lm_head over the draft rows: our own
code) is compiled with torch.compile (inductor, fixed shapes) before a graph records it, so the graph replays
inductor's fused kernels where it would replay hundreds of small eager ones (RMSNorm, rotary, masks, casts);
`generate(..., dflash_compile=False)` keeps it eager. The target's forward is never compiled: the verified tokens
come from the target alone, so a compiled drafter can only change which drafts are proposed (tau), never the output.
If compiling fails, a warning names why and the step runs the eager drafter.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

from typing import Any

import torch

from .dflash_engine import DFlashEngine
from .dflash_host_hooks import HostHooks
from .dflash_processors import StepProcessors
from .dflash_target_cache import TransformersTargetCache

# A call's max_length is rounded up to this many positions: calls of similar length share one held engine.
CALL_LENGTH_BUCKET = 256


def engine_for(
    target: torch.nn.Module, drafter: torch.nn.Module, batch_size: int, max_length: int,
    onednn_linears: bool | None = None, transformers_cache: bool = False,
) -> DFlashEngine:
    """The engine that serves generate calls of this target, batch size, `onednn_linears` and `transformers_cache`
    (the engine's arguments), built once and kept on the drafter, one at a time, to bound the memory it holds (a call
    holds the drafter's lock while it uses it). A held engine serves any call whose `max_length` (padding included) it
    holds, up to four times over (its pools hold every row at its full length), while the drafter keeps the draft
    vocabulary it was built for."""
    length = -(-max_length // CALL_LENGTH_BUCKET) * CALL_LENGTH_BUCKET
    key = (id(target), batch_size, target.dtype, onednn_linears, transformers_cache)
    held = getattr(drafter, "_dflash_engine", None)
    if (
        held is None
        or held[0] != key
        or not max_length <= held[1].max_sequence_length <= 4 * length
        or held[1].proposer.draft_vocabulary is not drafter.draft_vocabulary  # its head copied the old one's rows
    ):
        drafter._dflash_engine = None  # let the old buffers go before allocating new ones
        engine = DFlashEngine(
            target, drafter, max_batch_size=batch_size, max_sequence_length=length, adaptive=False,
            contiguous_rows=True, onednn_linears=onednn_linears, transformers_cache=transformers_cache,
        )
        drafter._dflash_engine = (key, engine)
    return drafter._dflash_engine[1]


def release_fast_path(drafter: torch.nn.Module) -> None:
    """Free the engine (its pools, buffers and CUDA graphs) that fast-path calls keep on `drafter`."""
    drafter._dflash_engine = None


def decode_on_engine(
    engine: DFlashEngine, input_ids: torch.LongTensor, attention_mask: torch.Tensor, processors: StepProcessors,
    host_hooks: HostHooks, cache: Any = None, call_cache: TransformersTargetCache | None = None,
) -> None:
    """The fast path's host loop for a bound call (`DFlashEngine.bind`): its rows are admitted at step 0 and leave
    the engine's batch the step they end; per step one step of the engine and one read-back of the committed
    tokens, which then pass the call's host hooks (`host_hooks`, which keeps the sequences). Every row leaves the
    engine when the call ends, also by an exception. `cache`: transformers' empty cache of a call of one sequence,
    which receives the sequence's keys/values before it leaves (`DFlashEngine.copy_into_cache`). `call_cache`: the
    call's target cache, for an engine over transformers' cache (`DFlashEngine.admit_call`)."""

    def leave(sequences: list[int]) -> None:
        if cache is not None and sequences:
            engine.copy_into_cache(sequences[0], cache)
        engine.retire_many(sequences)

    try:
        first, scores, logits = engine.admit_call(
            input_ids, attention_mask, host_hooks.max_length, processors, call_cache
        )
        leave([i for i, token in enumerate(first) if host_hooks.commit(i, [token], scores[i], logits[i])])
        while engine.sequences:
            leave([
                sequence for sequence, tokens in engine.run_step().items()
                if host_hooks.commit_verified(sequence, tokens, *engine.verified_rows(sequence))
            ])
    finally:
        engine.retire_all()


__all__ = ["CALL_LENGTH_BUCKET", "decode_on_engine", "engine_for", "release_fast_path"]
