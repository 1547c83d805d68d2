"""Property test of the drafter's state machine against a slow, obviously-correct reference.

Hypothesis drives `DFlashCandidateGenerator` through random sequences of the events the decoding loop produces
(prefill, propose, a propose refused because no verify came in between, verify with any acceptance per sequence,
sequences ending on eos / max length and leaving the batch, an over-long append refused, the final release). The
target's forwards are replaced by random rows written into the capture scratch, which is all the generator reads
from them. The reference is plain Python lists: per sequence, the context rows, their positions and the counts
the loop implies. After every event the generator must agree with it, keep every page in exactly one place
(one block table or the free list), never move a page a sequence is using, and hold in its pages exactly the
keys/values a from-scratch computation gives. Every propose's drafts must equal the drafter run from scratch over
the reference context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hf_dflash import PAGE_SIZE, DFlashCandidateGenerator
from tests.conftest import SOAK, VOCAB, scratch_draft_logits, tiny_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

TARGET = tiny_target("qwen3", seed=21, num_hidden_layers=4)
# Block sizes at both ends and one that straddles a page boundary after a few steps.
DRAFTERS = {b: tiny_drafter(TARGET, seed=22, num_layers=2, block_size=b) for b in (2, 5, 16)}
WIDTH = DRAFTERS[2].config.num_context_features


@dataclass
class ReferenceSequence:
    """One sequence as plain lists: what the generator's state must say about it."""

    rows: list[torch.Tensor] = field(default_factory=list)  # context rows (k*H_target,), in slot order
    positions: list[int] = field(default_factory=list)
    seq_len: int = 0  # tokens committed: the context, then the anchor
    ctx_committed: int = 0
    ctx_count_drafter: int = 0
    pages: int = 0  # pages the sequence must hold: enough for the furthest slot any propose addressed
    table: list[int] = field(default_factory=list)  # the block table last seen; pages in use never move


CALL = dict(
    block_size=st.sampled_from(sorted(DRAFTERS)),
    prompt_lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4),
    extra_length=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)


class DrafterStateMachine(RuleBasedStateMachine):
    @initialize(**CALL)
    def prefill(self, block_size: int, prompt_lengths: list[int], extra_length: int, seed: int) -> None:
        """A generate call starts: a fresh generator, the prompt forward's rows committed (left padding dropped)."""
        torch.manual_seed(seed)
        self.drafter = DRAFTERS[block_size]
        self.block_size = block_size
        width = max(prompt_lengths)
        self.max_length = width + extra_length  # as generate sizes it: padded prompt + new tokens
        batch = len(prompt_lengths)
        self.generator = DFlashCandidateGenerator(
            self.drafter, TARGET, batch, self.max_length, max_rows=max(width, block_size)
        )
        mask = torch.zeros(batch, width, dtype=torch.long)
        for i, n in enumerate(prompt_lengths):
            mask[i, width - n :] = 1  # left padding
        self.generator.capture_rows(width)
        self.write_target_rows(width)
        self.generator.commit_prefill(mask)
        self.reference = []
        for i, n in enumerate(prompt_lengths):
            rows = list(self.generator.scratch[i, width - n : width].clone())
            # the prompt's keys/values go to the pages at once, with room for the first block
            self.reference.append(
                ReferenceSequence(
                    rows=rows, positions=list(range(n)), seq_len=n + 1, ctx_committed=n, ctx_count_drafter=n,
                    pages=-(-(n + block_size) // PAGE_SIZE),
                )
            )
        # padded length of each sequence, as the loop's `lengths` (max_length counts the padding)
        self.padded = [width + 1] * batch
        self.proposed = False
        self.released = False

    def write_target_rows(self, num_rows: int) -> None:
        """What the hooks do during a target forward: fill the live rows of the scratch."""
        destination = self.generator.capture.destination
        assert destination is not None and destination.shape[:2] == (len(self.generator.states), num_rows)
        destination.copy_(torch.randn_like(destination))

    def room(self, row: int) -> int:
        return self.max_length - self.padded[row]

    # -- events -------------------------------------------------------------------------------------------------

    @precondition(lambda self: not self.released and not self.proposed and self.reference)
    @precondition(lambda self: all(self.room(i) > 0 for i in range(len(self.reference))))
    @rule(data=st.data())
    def propose(self, data: st.DataObject) -> None:
        anchors = torch.tensor(
            [[data.draw(st.integers(0, VOCAB - 2), label="anchor")] for _ in self.reference], dtype=torch.long
        )
        candidates, logits = self.generator.get_candidates(anchors)
        self.block = candidates  # what the target verifies next
        assert candidates.shape == (len(self.reference), self.block_size)
        assert torch.equal(candidates[:, :1], anchors)
        assert torch.equal(candidates[:, 1:], logits.argmax(-1))
        for ref, anchor, row_logits in zip(self.reference, anchors[:, 0].tolist(), logits):
            ref.ctx_committed = len(ref.rows)
            ref.ctx_count_drafter = len(ref.rows) + self.block_size
            ref.pages = max(ref.pages, -(-ref.ctx_count_drafter // PAGE_SIZE))
            expected = scratch_draft_logits(TARGET, self.drafter, torch.stack(ref.rows), anchor)
            torch.testing.assert_close(row_logits, expected, rtol=1e-4, atol=1e-4)
        self.proposed = True

    @precondition(lambda self: not self.released and self.proposed)
    @rule()
    def propose_without_verify_is_refused(self) -> None:
        with pytest.raises(RuntimeError, match="stale"):
            self.generator.get_candidates(torch.zeros(len(self.reference), 1, dtype=torch.long))

    @precondition(lambda self: not self.released and self.proposed)
    @rule(data=st.data())
    def verify(self, data: st.DataObject) -> None:
        # The loop never verifies past max_length: a sequence with r tokens left commits at most r.
        accepted = [
            data.draw(st.integers(0, min(self.block_size - 1, self.room(i) - 1)), label=f"accepted[{i}]")
            for i in range(len(self.reference))
        ]
        num_rows = min(self.block_size, max(self.room(i) for i in range(len(self.reference))))
        self.generator.capture_rows(num_rows)
        self.write_target_rows(num_rows)
        scratch = self.generator.scratch
        self.generator.update_candidate_strategy(self.block, None, accepted)
        for i, (ref, taken) in enumerate(zip(self.reference, accepted)):
            ref.positions.extend(range(len(ref.rows), len(ref.rows) + taken + 1))
            ref.rows.extend(scratch[i, : taken + 1].clone())
            ref.seq_len += taken + 1
            ref.ctx_count_drafter = ref.ctx_committed  # the block rows' slots are dropped
            self.padded[i] += taken + 1
        self.proposed = False

    @precondition(lambda self: not self.released and not self.proposed and self.reference)
    @rule(data=st.data())
    def sequences_end(self, data: st.DataObject) -> None:
        """eos or max length: the finished sequences leave the batch, the others go on in the given order."""
        must_leave = {i for i in range(len(self.reference)) if self.room(i) <= 0}
        candidates = [i for i in range(len(self.reference)) if i not in must_leave]
        kept = data.draw(st.lists(st.sampled_from(candidates), unique=True) if candidates else st.just([]), label="kept")
        self.generator.keep(kept)
        self.reference = [self.reference[i] for i in kept]
        self.padded = [self.padded[i] for i in kept]

    @precondition(lambda self: not self.released and self.reference)
    @rule(data=st.data())
    def overlong_append_is_refused(self, data: st.DataObject) -> None:
        row = data.draw(st.integers(0, len(self.reference) - 1), label="row")
        state = self.generator.states[row]
        pending = state.ctx_len - state.ctx_committed
        excess = state.max_pending_rows - pending + data.draw(st.integers(1, 3), label="excess")
        with pytest.raises(ValueError, match=f"holds {state.max_pending_rows} rows"):
            state.append_context(torch.randn(excess, WIDTH))

    @precondition(lambda self: self.released)
    @rule(**CALL)
    def next_call(self, block_size: int, prompt_lengths: list[int], extra_length: int, seed: int) -> None:
        self.prefill(block_size, prompt_lengths, extra_length, seed)

    @rule()
    def release(self) -> None:
        """The end of generate; also run again afterwards: a second release must not hand out any page twice."""
        self.generator.release()
        self.reference = []
        self.released = True

    # -- what must hold after every event -----------------------------------------------------------------------

    @invariant()
    def states_match_the_reference(self) -> None:
        states = self.generator.states
        assert len(states) == len(self.reference)
        for state, ref in zip(states, self.reference):
            n = len(ref.rows)
            assert (state.ctx_len, state.ctx_committed, state.ctx_count_drafter) == (
                n, ref.ctx_committed, ref.ctx_count_drafter
            )
            assert state.ctx_len == ref.seq_len - 1  # every committed position before the anchor
            # the accumulator holds exactly the rows no propose has turned into keys/values yet, and never more than
            # one block of them
            pending = ref.rows[ref.ctx_committed :]
            assert len(pending) <= state.max_pending_rows == self.block_size
            if pending:
                assert torch.equal(state.ctx_hidden_acc[: len(pending)], torch.stack(pending))
            assert state.context_ready == (not self.proposed)

    @invariant()
    def every_page_is_in_exactly_one_place(self) -> None:
        cache = self.generator.cache
        tables = [state.block_table for state in self.generator.states]
        everywhere = [page for table in tables for page in table] + cache.free_pages
        assert sorted(everywhere) == list(range(cache.num_pages)), "a page is lost or reachable twice"
        for state, ref in zip(self.generator.states, self.reference):
            assert len(state.block_table) == ref.pages
            assert state.block_table[: len(ref.table)] == ref.table, "a page in use moved"
            ref.table = list(state.block_table)
            if state.block_table:
                assert state.block_table_dev.tolist() == state.block_table
        if self.released:
            assert len(cache.free_pages) == cache.num_pages

    @invariant()
    def pages_hold_the_context_keys_and_values(self) -> None:
        cache = self.generator.cache
        for state, ref in zip(self.generator.states, self.reference):
            if not ref.ctx_committed:
                continue
            rows = torch.stack(ref.rows[: ref.ctx_committed])[None]
            with torch.no_grad():
                expected = self.drafter.context_key_values(rows, torch.tensor(ref.positions[: ref.ctx_committed])[None])
            slots = cache.slot_mapping(state, 0, ref.ctx_committed)[None]
            for layer, (key, value) in enumerate(expected):
                stored_key, stored_value = cache.read(layer, slots)
                torch.testing.assert_close(stored_key, key, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(stored_value, value, rtol=1e-5, atol=1e-5)


DrafterStateMachine.TestCase.settings = settings(
    max_examples=400 if SOAK else 50,
    stateful_step_count=40 if SOAK else 20,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_drafter_state_machine = DrafterStateMachine.TestCase
