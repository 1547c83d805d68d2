"""`VerifyPolicy`: how many block rows the target verifies at each step, chosen for committed tokens per second.

Verifying fewer rows never changes the output: greedy commits the target's own tokens, and accepting or rejecting a
prefix of the drafts is still exact rejection sampling. It changes only the cost. Where a target forward costs about
in proportion to its rows (a CPU, or a GPU at high concurrency), verifying 16 rows per step when the drafter's late
drafts are mostly rejected pays for rows that commit nothing; verifying 1 row (the anchor, no drafts) is plain
decoding, and then drafting is skipped too.

The policy weighs, per step:
- what a width k is expected to commit: E(k) = 1 + sum_{j < k} prod_{i <= j} p_i, where p_i is the chance draft i is
  accepted given the drafts before it were: the drafter's own probability of draft i (its confidence), times a
  per-sequence calibration ratio (decayed counts of drafts accepted over confidence spent on the drafts the target
  judged), so a drafter over-confident on this prompt is discounted and an under-confident one trusted more;
- what a width k costs on this machine: `VerifyCost` keeps, per batch-size class, each width's own mean seconds from
  the verify steps' timings (a CPU's cost is a staircase in k, not a line: its matrix products change kernels at some
  row count), fills the widths never timed from their timed neighbours and a line a + b * k fitted to them all, and
  adds the drafter's mean seconds per step;
and verifies the k that maximises E(k) / (drafter + verify(k)). Where the engine can verify a different number of
rows per sequence (a ragged verify, packed so that its cost is its total rows: `row_widths`), each sequence gets its
own width: the rows of all sequences are ranked by what each adds to its sequence's E (prod_{i <= j} p_i, which
falls along a block), and the step verifies the best-ranked rows up to the count of the most tokens per second, its
cost read at their mean width per sequence. Before drafting, it decides whether to draft at all:
when a sequence's recent drafted steps committed fewer tokens per second than a plain one-row step would, the step
skips the drafter and verifies the anchor alone (per batch: only when every sequence would). A few steps explore
(`explore_every`): one verifies the full width, one drafts after a run of plain steps, and halfway between two
full-width steps one times the width next to its choice that was timed longest ago (or never), so the costs and the
calibration keep seeing what they would otherwise stop measuring.

Sequences are named by any hashable key, so that they can join and leave a running batch: a generate call names
its batch rows 0..b-1 (`start`), the continuous-batching manager (dflash_continuous.py) names each request as it is
admitted (`add`) and forgets it when it leaves (`remove`).

Everything here is host arithmetic on a few floats per sequence: deterministic given the same timings (tests pass a
`VerifyCost` with fixed figures), and no device work.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


# The calibration's prior: this much of a draft of confidence 1, accepted. Small, so that a few judged drafts outweigh
# it: a drafter confident and always wrong on this prompt is discounted to a few percent within a handful of steps.
PRIOR = 0.25
# The most recent widths a policy keeps in `widths` (an engine's policy runs as long as its server).
WIDTH_LOG = 4096
# A timing counts as at most this many times the mean of its kind so far: a step stalled by another process on a
# shared machine would otherwise make drafting, or a width, look dear for many steps, and a drafter the policy stopped
# running is timed again only when it explores.
STALL = 2.0


def _at(curve: Sequence[float], rows: float) -> float:
    """curve[k - 1] is the cost of k rows: its value at a mean of `rows` rows (between two widths, on the line
    between them)."""
    low = min(max(int(rows), 1), len(curve))
    high = min(low + 1, len(curve))
    return curve[low - 1] + (rows - low) * (curve[high - 1] - curve[low - 1]) if high > low else curve[low - 1]


def batch_class(batch_size: int) -> int:
    """The power of two at or above `batch_size`: batches of similar size share one cost fit."""
    return 1 << max(batch_size - 1, 0).bit_length()


@dataclass
class _ClassCost:
    """One batch-size class's timings: decayed weighted least squares of seconds against rows (sums of w, w*k, w*k^2,
    w*t, w*k*t), each width's own decayed mean seconds, and the drafter's decayed mean seconds per step."""

    sums: list[float] = field(default_factory=lambda: [0.0] * 5)
    # per width: [decayed sum of seconds, decayed count, the record number of its latest timing]
    widths: dict[int, list[float]] = field(default_factory=dict)
    records: int = 0
    draft_seconds: float | None = None

    def add(self, rows: float, seconds: float, decay: float) -> None:
        """A verify of `rows` rows per sequence; a ragged verify's mean (a fraction) counts toward the two widths
        around it, each in proportion to its nearness."""
        low = int(rows)
        shares = [(width, share) for width, share in ((low, low + 1 - rows), (low + 1, rows - low)) if share > 0]
        nearest = max(shares, key=lambda pair: pair[1])[0]
        width_sum, count, _ = self.widths.get(nearest, (0.0, 0.0, 0))
        # A step stalled by another process counts as at most `STALL` times the width's mean; a width's first timing
        # as at most `STALL` times the dearest width's.
        means = [total / weight for total, weight, _ in self.widths.values()]
        if means:
            seconds = min(seconds, STALL * (width_sum / count if count else max(means)))
        values = (1.0, rows, rows * rows, seconds, rows * seconds)
        self.sums = [decay * total + value for total, value in zip(self.sums, values)]
        self.records += 1
        # A width's mean decays only when it is timed again: a width the policy stopped choosing keeps its figure.
        for width, share in shares:
            width_sum, count, _ = self.widths.get(width, (0.0, 0.0, 0))
            self.widths[width] = [decay * width_sum + share * seconds, decay * count + share, self.records]

    def line(self) -> tuple[float, float] | None:
        """(a, b) with a, b >= 0, once two different widths were timed; else None."""
        if len(self.widths) < 2:
            return None
        s0, s1, s2, t0, t1 = self.sums
        spread = s0 * s2 - s1 * s1
        if spread <= 1e-12 * max(s0 * s2, 1e-30):
            return None
        slope = (s0 * t1 - s1 * t0) / spread
        if slope < 0:  # noise on a cost that does not grow with rows: charge the mean
            return t0 / s0, 0.0
        return max((t0 - slope * s1) / s0, 0.0), slope

    def curve(self, cap: int, slope: float) -> list[float]:
        """Seconds of a verify of 1..cap rows: a timed width's own mean; between two timed widths, the straight line
        between their means; outside them, the nearest one's mean moved along the fitted `slope`. Below the narrowest
        timed width w, k rows cost at least k / w of it: a verify's cost per row does not grow as rows fall, and a
        steep slope would otherwise make a narrow verify free (and the policy divide by its zero cost)."""
        means = {k: total / count for k, (total, count, _) in self.widths.items()}
        timed = sorted(means)
        curve = []
        for k in range(1, cap + 1):
            below = max((w for w in timed if w <= k), default=None)
            above = min((w for w in timed if w >= k), default=None)
            if below is not None and above is not None:
                share = 0.0 if above == below else (k - below) / (above - below)
                curve.append(means[below] + share * (means[above] - means[below]))
            elif below is not None:
                curve.append(means[below] + slope * (k - below))
            else:
                curve.append(max(means[above] - slope * (above - k), means[above] * k / above))
        return curve


class VerifyCost:
    """The measured cost of a step on this machine, learned online from the step's own timings.

    Per batch-size class (`batch_class`): the seconds of a verify of k rows per sequence (the target's forward, the
    processors and acceptance) and the drafter's mean seconds per drafted step, from the recent steps (weights decay
    by `decay` per step). A verify's cost need not be a line in k: on a CPU the matrix products change kernels with
    the row count, so that it climbs in steps (benchmarks/step-cost.md); each width keeps its own mean (`curve`),
    and the line a + b * k fitted to all of them (`line`) only fills in widths never timed. `fixed` = (a, b, drafter
    seconds) skips learning and makes the cost that line exactly (tests inject costs this way); `record` then does
    nothing.
    """

    def __init__(self, decay: float = 0.95, fixed: tuple[float, float, float] | None = None):
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay, self.fixed = decay, fixed
        self.fits: dict[int, _ClassCost] = {}

    def record(self, batch_size: int, rows: float, verify_seconds: float, draft_seconds: float | None) -> None:
        """One step's timings: its verify of `rows` rows per sequence (a ragged verify's mean), and its drafter pass
        (None when it did not draft)."""
        if self.fixed is not None:
            return
        fit = self.fits.setdefault(batch_class(batch_size), _ClassCost())
        fit.add(rows, verify_seconds, self.decay)
        if draft_seconds is not None:
            previous = fit.draft_seconds
            fit.draft_seconds = (
                draft_seconds if previous is None
                else self.decay * previous + (1 - self.decay) * min(draft_seconds, STALL * previous)
            )

    def line(self, batch_size: int) -> tuple[float, float, float] | None:
        """(a, b, drafter seconds) for this batch size, or None until two widths and one drafter pass were timed."""
        if self.fixed is not None:
            return self.fixed
        fit = self.fits.get(batch_class(batch_size))
        if fit is None or fit.draft_seconds is None:
            return None
        line = fit.line()
        return None if line is None else (*line, fit.draft_seconds)

    def curve(self, batch_size: int, cap: int) -> tuple[list[float], float] | None:
        """([seconds of a verify of 1, ..., cap rows], drafter seconds) for this batch size, or None until `line`
        has one (two widths and one drafter pass timed)."""
        line = self.line(batch_size)
        if line is None:
            return None
        a, b, draft = line
        if self.fixed is not None:
            return [a + b * k for k in range(1, cap + 1)], draft
        return self.fits[batch_class(batch_size)].curve(cap, b), draft

    def widths_seen(self, batch_size: int) -> set[int]:
        fit = self.fits.get(batch_class(batch_size))
        return set() if fit is None else set(fit.widths)

    def least_recent(self, batch_size: int, widths: Sequence[int]) -> int:
        """Of `widths`, one never timed at this batch size (the first such), else the one timed longest ago."""
        fit = self.fits.get(batch_class(batch_size))
        if fit is None:
            return widths[0]
        return min(widths, key=lambda k: fit.widths[k][2] if k in fit.widths else -1)


@dataclass
class _SequenceStats:
    """One sequence's decayed counts: drafts accepted and confidence spent on the drafts the target judged (the
    calibration); its drafted steps, the tokens they committed and the rows they verified; and the plain steps since
    it last drafted."""

    accepted: float = 0.0
    confidence: float = 0.0
    drafted_steps: float = 0.0
    drafted_tokens: float = 0.0
    drafted_rows: float = 0.0
    plain_run: int = 0


class VerifyPolicy:
    """Chooses per step whether to draft and how many rows to verify, for a batch of sequences.

    Args:
        cost: the machine's `VerifyCost` (default: a new one that learns from this policy's steps). Pass one
            `VerifyPolicy` to several `generate` calls and its cost fit carries over; each call restarts the
            per-sequence calibration (`start`).
        explore_every: every this many drafted steps verify the full width once, and a sequence that stopped drafting
            drafts again, verified at the full width, after this many plain steps.
        decay: the weight of a past step in the calibration, per step (recent acceptance counts most).
        whole_batch: how a batch's sequences' wishes combine. False (a generate call, a few sequences): the
            batch verifies the widest of its sequences' choices (or each its own, `per_sequence`), and drafts while
            any sequence's drafting pays. True (the continuous-batching engine, dozens of sequences in a step): the
            width that commits the most tokens per second summed over the batch, and drafting while the batch's
            drafted steps commit more tokens per second than plain ones would; with many sequences some one of them
            nearly always wants the full block, which the widest choice would then verify for all of them. Its
            exploring steps verify twice the width it would take (a batch drafting again after plain steps: that
            width) rather than the whole block.
        per_sequence: whether each sequence gets its own width (`row_widths`) where the engine verifies ragged
            blocks: with `whole_batch`, the rows of most tokens per second over the batch; without, each
            sequence's own choice, the batch no longer verifying the widest of them for all. False: one width for
            the batch (`width`).

    Sequences: `start(batch_size)` names a new batch 0..batch_size-1 (a generate call); `add(key)`
    and `remove(key)` let one join or leave at any step (the continuous-batching engine). Per step
    `should_draft(live)` -> bool, then after drafting `width(live, confidence, cap)` -> k, and after the verify
    `record(live, k, accepted, confidence, draft_s, verify_s)` (k: one width, or per sequence `row_widths`' list).
    `live` lists the keys of the sequences in the step, in batch order; finished ones may simply be left out of it
    (stats are per key). `widths` holds the verified widths in order (a ragged step's widest), the latest
    `WIDTH_LOG` of them.
    """

    def __init__(
        self, cost: VerifyCost | None = None, explore_every: int = 16, decay: float = 0.9, whole_batch: bool = False,
        per_sequence: bool = True,
    ):
        if explore_every < 2:
            raise ValueError(f"explore_every must be at least 2, got {explore_every}")
        self.cost = VerifyCost() if cost is None else cost
        self.explore_every, self.decay, self.whole_batch = explore_every, decay, whole_batch
        self.per_sequence = per_sequence
        self.stats: dict[Hashable, _SequenceStats] = {}
        self.steps = 0
        self.widths: deque[int] = deque(maxlen=WIDTH_LOG)

    def start(self, batch_size: int) -> None:
        """New sequences 0..batch_size-1 in place of any held: their calibration starts from the prior (`PRIOR`);
        the cost fit is kept."""
        self.stats = {seq: _SequenceStats() for seq in range(batch_size)}
        self.steps = 0
        self.widths.clear()

    def add(self, key: Hashable) -> None:
        """A sequence joins the batch under `key`: its calibration starts from the prior."""
        self.stats[key] = _SequenceStats()

    def remove(self, key: Hashable) -> None:
        """A sequence leaves: its stats go (the cost fit, shared by every sequence, stays)."""
        del self.stats[key]

    # -- before drafting -------------------------------------------------------------------------------------------

    def should_draft(self, live: Sequence[Hashable]) -> bool:
        """Whether this step drafts: unless every live sequence's drafted steps lately committed fewer tokens per
        second than a plain step would (their tokens per step over the modelled cost of their mean width; with
        `whole_batch`, unless the batch's summed rate is below the plain steps'), and none is due to explore."""
        widest = max((self.stats[seq].drafted_rows / self.stats[seq].drafted_steps for seq in live
                      if self.stats[seq].drafted_steps), default=1.0)
        costs = self.cost.curve(len(live), math.ceil(widest))
        if costs is None:
            return True
        if self.cost.fixed is None and 1 not in self.cost.widths_seen(len(live)):
            # Time a plain step once: drafting is judged against it, and no verify of drafts shows what one row costs
            # (on a CPU two rows cost nearly twice one, on a GPU about the same).
            return False
        verify, draft = costs
        plain = verify[0]  # a plain step verifies the anchor alone
        drafted_rate = 0.0  # the batch's tokens per second on drafted steps, summed over its sequences
        for seq in live:
            stats = self.stats[seq]
            if stats.drafted_steps == 0 or stats.plain_run + 1 >= self.explore_every:
                return True
            tokens, rows = stats.drafted_tokens / stats.drafted_steps, stats.drafted_rows / stats.drafted_steps
            seconds = draft + _at(verify, rows)
            if not self.whole_batch and tokens * plain > seconds:  # faster than a plain step
                return True
            drafted_rate += tokens / seconds
        return self.whole_batch and drafted_rate > len(live) / plain  # a plain step commits one token each

    # -- after drafting --------------------------------------------------------------------------------------------

    def calibrated(self, seq: Hashable, confidence: Sequence[float]) -> list[float]:
        """The chance each draft is accepted given the ones before it were: confidence (B - 1,) times this
        sequence's ratio of accepted drafts to confidence spent, both counted from `PRIOR`."""
        stats = self.stats[seq]
        ratio = (stats.accepted + PRIOR) / (stats.confidence + PRIOR)
        return [min(ratio * c, 0.99) for c in confidence]

    @staticmethod
    def expected_tokens(p: Sequence[float], rows: int) -> float:
        """E(k): tokens a verify of `rows` rows commits when draft j is accepted with chance p[j] given the earlier
        ones were: 1 (the target's own token) + sum_{j < rows - 1} prod_{i <= j} p[i]."""
        return VerifyPolicy.expected_curve(p, rows)[-1]

    @staticmethod
    def expected_curve(p: Sequence[float], cap: int) -> list[float]:
        """[E(1), ..., E(cap)] (`expected_tokens` at every width up to `cap`), in one pass."""
        curve, total, survive = [1.0], 1.0, 1.0
        for j in range(cap - 1):
            survive *= p[j]
            total += survive
            curve.append(total)
        return curve

    def width(self, live: Sequence[Hashable], confidence: Sequence[Sequence[float]], cap: int) -> int:
        """Rows to verify this step (1..cap), after the drafter ran. confidence (b, B - 1): the drafter's
        probability of each live sequence's drafts. The batch verifies the widest of its sequences' choices (with
        `whole_batch`, the width of the most tokens per second over the batch)."""
        return self._width(live, confidence, cap)[0]

    def _width(
        self, live: Sequence[Hashable], confidence: Sequence[Sequence[float]], cap: int
    ) -> tuple[int, list[list[float]] | None]:
        """`width`, and each sequence's expected-token curve up to `cap` (`expected_curve`) when the width was
        chosen from them; None when the step explores (or costs are not known yet)."""
        self.steps += 1
        costs = self.cost.curve(len(live), cap)
        # a sequence drafting again after a run of plain steps is judged on every row: its own confidence alone kept
        # it plain, and only a verify of its drafts can show that the drafter is better than it thinks
        returning = any(self.stats[seq].plain_run + 1 >= self.explore_every for seq in live)
        explore = returning or self.steps % self.explore_every == 0
        if costs is None or explore and not self.whole_batch:
            # explore: the full width first, then a narrow one, until two widths were timed; then now and then (a
            # whole batch: 4 rows first, as a full block of dozens of rows costs many steps)
            seen, first = self.cost.widths_seen(len(live)), min(4 if self.whole_batch else cap, cap)
            return (min(2, cap) if first in seen and min(2, cap) not in seen else first), None
        verify, draft = costs
        curves = [self.expected_curve(self.calibrated(seq, c), cap) for seq, c in zip(live, confidence)]
        if self.whole_batch:  # the batch's tokens per second at each width
            rates = [sum(curve[k] for curve in curves) / (draft + verify[k]) for k in range(cap)]
            best = 1 + max(range(cap), key=rates.__getitem__)
            # A whole batch at the full width can cost many steps' worth. Drafting again after plain steps, it verifies
            # its best width (at least 2 rows): what it would take if drafting paid again. Its periodic exploring
            # step verifies twice that, enough to judge drafts past the ones it takes and to keep the fit's widths
            # apart.
            if returning:
                return min(cap, max(2, best)), None
            return (min(cap, max(2, 2 * best)), None) if explore else (best, curves)
        best = max(self._own_width(curve, costs, cap) for curve in curves)
        if self.steps % self.explore_every == self.explore_every // 2 and cap > 2:
            # Halfway between full-width steps, a width next to the chosen one, the one timed longest ago (or never):
            # where the cost changes kernels between two widths, a width between two timed ones may be cheaper than
            # the straight line through them says, and only a timing of its own shows it.
            return self.cost.least_recent(len(live), [k for k in (best - 1, best + 1) if 2 <= k <= cap]), None
        return best, curves

    @staticmethod
    def _own_width(curve: Sequence[float], costs: tuple[list[float], float], cap: int) -> int:
        """The width (1..cap) at which one sequence's expected tokens `curve` come fastest, under `costs` (the
        verify's seconds per width, the drafter's)."""
        verify, draft = costs
        return 1 + max(range(cap), key=lambda k: curve[k] / (draft + verify[k]))

    def row_widths(
        self, live: Sequence[Hashable], confidence: Sequence[Sequence[float]], caps: Sequence[int]
    ) -> list[int]:
        """Rows to verify per sequence (sequence i: 1..caps[i]) for a ragged verify, whose cost is that of its mean
        width per sequence. Sequence i's row k + 1 adds E_i(k + 1) - E_i(k) = prod_{j < k} p_ij tokens, which falls
        with k, so taking rows best first gives each sequence a prefix of its block and, for every total, the most
        tokens that total can commit; the step takes the total of the most tokens per second. Without `whole_batch`,
        each sequence verifies its own choice (`width` takes the widest of them). Where `width` explores (or costs
        are not known yet), and without `per_sequence`, every sequence verifies `width`'s choice (within its cap)."""
        uniform, curves = self._width(live, confidence, max(caps))
        if curves is None or not self.per_sequence:
            return [min(uniform, cap) for cap in caps]
        costs = self.cost.curve(len(live), max(caps))
        if not self.whole_batch:
            return [self._own_width(curve, costs, cap) for curve, cap in zip(curves, caps)]
        verify, draft = costs
        gains = []  # (tokens a row adds, its sequence), each sequence's rows in order
        for i, curve in enumerate(curves):  # a curve up to caps[i] is the first caps[i] entries of this one
            gains += [(curve[k] - curve[k - 1], i) for k in range(1, caps[i])]
        gains.sort(key=lambda gain: -gain[0])  # stable: a sequence's equal gains stay in their order
        n = len(live)
        tokens, best, best_rate = float(n), 0, n / (draft + verify[0])
        for taken, (gain, _) in enumerate(gains, 1):
            tokens += gain
            rate = tokens / (draft + _at(verify, (n + taken) / n))
            if rate > best_rate:
                best, best_rate = taken, rate
        widths = [1] * n
        for _, i in gains[:best]:
            widths[i] += 1
        return widths

    # -- after the verify --------------------------------------------------------------------------------------------

    def record(
        self, live: Sequence[Hashable], rows: int | Sequence[int], accepted: Sequence[int],
        confidence: Sequence[Sequence[float]] | None, draft_seconds: float | None, verify_seconds: float | None,
    ) -> None:
        """One step's outcome: it verified `rows` rows per live sequence (or sequence i rows[i]) and sequence i
        accepted accepted[i] drafts; confidence (b, B - 1) of the drafts (None when it did not draft), and its
        timings (the verify's None when the step's time is no measure of its cost: a CUDA graph's first run or
        recording)."""
        per_sequence = [rows] * len(live) if isinstance(rows, int) else list(rows)
        self.widths.append(max(per_sequence))
        if verify_seconds is not None:
            self.cost.record(len(live), sum(per_sequence) / len(live), verify_seconds, draft_seconds)
        decay = self.decay
        for i, seq in enumerate(live):
            stats = self.stats[seq]
            if confidence is None:
                stats.plain_run += 1
                continue
            stats.plain_run = 0
            # the drafts the target judged: the accepted ones and the first rejected one, within the verified rows
            judged = min(accepted[i] + 1, per_sequence[i] - 1)
            stats.accepted = decay * stats.accepted + accepted[i]
            stats.confidence = decay * stats.confidence + sum(confidence[i][:judged])
            stats.drafted_steps = decay * stats.drafted_steps + 1
            stats.drafted_tokens = decay * stats.drafted_tokens + accepted[i] + 1
            stats.drafted_rows = decay * stats.drafted_rows + per_sequence[i]


__all__ = ["PRIOR", "STALL", "VerifyCost", "VerifyPolicy", "WIDTH_LOG", "batch_class"]
