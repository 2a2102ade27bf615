"""Draft trimming by goodput: under load, verify only the drafted tokens that pay for their compute.

Plain decoding of B sessions costs one forward of B tokens; verifying k drafted tokens each costs a
forward of B(k + 1). While the weights dominate (a GPU at small batches) both cost about the same;
on a CPU, or a GPU at large batches, the forward grows with its tokens, and drafted tokens that are
likely rejected slow down every session of the batch: speculation falls below plain decoding, the
common complaint against speculative serving. The target sees what the coordinator cannot: the
whole batch and what each forward costs. So before each batched step the trimmer cuts every verify's
draft to the prefix that maximises the batch's expected committed tokens per second (goodput, as in
SmartSpec, Liu et al. 2024):

    goodput = sum_i E_i(d_i) / T(n),   E_i(d) = 1 + a_i + a_i^2 + ... + a_i^d

E_i is Leviathan et al. (2023, sec. 3.1) with a_i the acceptance rate measured on session i's own
verifies, and T = alpha + beta * n is fitted online to the measured steps (step_cost.py; where the
backend pads, alpha includes what the step's rows cost whatever their width), n being what the backend
computes: rows x the widest row where it pads (CUDA graphs' shapes), so that the plan is a step
width and drafted tokens up to it ride along free; the tokens fed where it packs ragged rows (the
native backend's eager path; transformers runs rows one at a time), so that every drafted token pays
its own beta (step_plan.py has both plans). (Until 2026-11-26 it counted the tokens fed while the
native backend still padded: a lone row's draft passed as if it cost its own tokens only, and on 2
CPU cores at 4 sessions speculation under load measured 2-20% below plain decoding; then padded
everywhere until the backend packed, round 29.) Verifying a prefix of a draft is verifying a shorter
draft, so the output is unchanged. The outcome's num_drafted says how many tokens were verified, so
the coordinator's adaptive draft length sees the trimmed length and its cost, and shrinks k or stops
drafting by itself (plain decoding while every drafted token is cut).

The trimmer also tells each session that decodes plainly how many drafted tokens this step would
have verified for it (draft_limits: its row as a verify of up to ADMISSION_PROBE_TOKENS at its own
acceptance, the others as they are; or, where that is more, what it would keep were every plain row
of the step not drafting on a draft service to probe with it). A coordinator whose session
speculates no longer probes while that is 0: under load every probe cost its session a draft round
trip and the batch a longer step for nothing, and at 4 sessions on a CPU those probes were most of
speculation's loss to plain decoding.
The joint probe is there because some costs are the whole step's: the hosted draft's passes, and a
padded step's width. One row's draft alone rarely pays for them, all rows' drafts together may: told
only its own probe, every plain row hears 0 and the batch stays plain where drafting together would
win (one H200, 8B / 1B hosted, 8 sessions at alpha 0.8: 2 draft steps of 3.5 ms and a 9.5 ms
verify commit about 20 tokens, against a 9.4 ms plain step's 8). The hosted draft's passes are
priced by the rows drafting in them (step_cost.DraftStepPrice): priced as one row's, 16 rows drafting
together looked as cheap as one and drafted at 0.87 of plain decoding (docs/BENCHMARKS.md, rounds 38
and 39).

A price too high to let any draft through is never corrected by a step that drafted: in padded plans,
after a plain stretch, the rows that could draft together try it for a step (exploration.py).

What a step cost cannot show, the round trips of a session drafting on a draft service, is priced
per session over its whole cycle by cycle_wall.py; a session it refuses has its drafts cut to nothing
and a draft_limit of 0, whatever the step's goodput.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from specdec.engine.batch import DecodeWork, Result, VerifyWork, Work, run_target_batch
from specdec.engine.cycle_wall import CycleWallPricing
from specdec.engine.exploration import JointExploration
from specdec.engine.step_cost import DraftStepPrice, StepCost
from specdec.engine.step_plan import RowSpec, packed_plan, padded_width
from specdec.engine.target import TargetEngine
from specdec.types import DraftBlock, VerifyOutcome

ADMISSION_PROBE_TOKENS = 8  # the draft a plain row is asked about (the longest CUDA-graph verify)


@dataclass
class _Acceptance:
    accepted: float
    trials: float


class DraftTrimmer:
    """Per-session acceptance and the step cost; trims a batch's drafts (thread-confined like the
    engine: trim and observe run on the model thread)."""

    def __init__(self, prior: float = 0.8, prior_trials: float = 2.0, decay: float = 0.9,
                 max_sessions: int = 4096, margin: float = 0.0, price_cycles: bool = True, packed: bool = False):
        # An optimistic prior lets a new session show what its drafts are worth before load cuts
        # them. A session cut to nothing keeps its estimate until the load lets its drafts through.
        self.prior, self.prior_trials, self.decay = prior, prior_trials, decay
        # Speculation must raise the step's goodput by this share over plain decoding, or every draft
        # is cut: a drafted row also costs its session a draft round trip, during which it misses
        # the target's steps (sessions fall out of step, waiting on each other's draft and verify
        # phases), which the step cost does not see. At 4 sessions on 2 CPU cores the model
        # predicted speculation to break even while it measured 0.80-0.85x plain (docs/BENCHMARKS.md);
        # 0.2 took that to 0.92-0.95x. Off by default: on tiny test models, whose step-cost fit is
        # noisy, it also cut drafts that paid (the target service's --trim-margin).
        self.margin = margin
        # How the backend runs ragged rows (step_plan.py): packed, a step costs the tokens it feeds;
        # else every row is padded to the widest (CUDA graphs' shapes).
        self.packed = packed
        self.max_sessions = max_sessions
        # A draft from a draft service also costs its session a round trip per cycle, which no step
        # cost shows: cycle_wall.py prices the whole cycle and refuses sessions whose cycles lose.
        self.cycle_wall = CycleWallPricing(margin=margin, max_sessions=max_sessions) if price_cycles else None
        self.cost = StepCost(per_row=not packed)
        # Seconds per step of the draft model the target hosts (specdec.engine.inner_draft) by the rows
        # drafting, fitted over its draft passes; 0 until one ran. A step whose rows draft there runs
        # width - 1 such steps on the same thread before its forward: part of what widening it costs.
        self.draft_price = DraftStepPrice()
        # Padded plans: after a plain stretch, rows that could draft together try it once, so that a
        # price too high to let any draft through is corrected by a step that drafted (exploration.py).
        self.exploration = JointExploration()
        self.trimmed_tokens = 0  # drafted tokens left unverified so far (a metric)
        self._sessions: OrderedDict[str, _Acceptance] = OrderedDict()  # least recently seen first
        # Session -> drafted tokens the last step would have verified for its plain row (see the
        # module's doc). Replaced whole after each step, so other threads may read it as it is.
        self.draft_limits: dict[str, int] = {}

    def acceptance(self, session_id: str) -> float:
        stats = self._sessions.get(session_id)
        if stats is None:
            return self.prior
        return (stats.accepted + self.prior * self.prior_trials) / (stats.trials + self.prior_trials)

    def trim(self, works: Sequence[Work]) -> list[Work]:
        """The works with each verify's draft cut to the prefix that maximises the goodput.

        A lone session is left alone: its drafted tokens slow down no one else, and the coordinator's
        adaptive draft length already weighs them against its own measured costs."""
        kept = self.plan(works)
        return [self._cut(work, keep) if isinstance(work, VerifyWork) else work for work, keep in zip(works, kept)]

    def plan(self, works: Sequence[Work], drafting_here: bool = False) -> list[int]:
        """The drafted tokens trim would keep of each work (0 for a decode), and the draft_limits of
        the plain rows. A draft made on the target itself (specdec.engine.inner_draft.InnerDraftWork)
        is planned as a verify of its longest length before it is drafted, so no cut token is
        drafted; drafting_here: some rows draft with the hosted draft model, whose passes the width pays."""
        fit = self.cost.fit(len(works))
        refused = self._refused(works)
        if fit is None or len(works) < 2:  # no cost measured yet, or no one else in the step
            # Nothing known but the refusals: the coordinators probe as they see fit.
            self.draft_limits = {works[i].session_id: 0 for i in refused if isinstance(works[i], DecodeWork)}
            return [0 if i in refused else _base_and_draft(w)[1] for i, w in enumerate(works)]
        rows = [RowSpec(*_base_and_draft(w), self.acceptance(w.session_id)) for w in works]
        rows = [dataclasses.replace(r, draft=0) if i in refused else r for i, r in enumerate(rows)]
        alpha, beta = fit
        if self.packed:
            return self._plan_packed(works, rows, refused, alpha, beta, drafting_here)
        widest = max(max(r.base + r.draft for r in rows), 1 + ADMISSION_PROBE_TOKENS)
        totals = [0.0] * (widest + 1)  # the rows' expected tokens by step width
        for row in rows:
            for width, gain in enumerate(row.gains(widest)):
                totals[width] += gain
        bases = sorted((r.base for r in rows), reverse=True)
        # The hosted draft's passes: width - 1 draft steps before the forward, priced by the rows
        # drafting in them, for rows drafting here (and for the plain rows' probes, once this target
        # has drafted: its sessions draft here).
        here = _drafting_here(works)
        probes = self._probes(works, rows, refused)

        def drafting(num_rows: int) -> list[float]:
            step = self.draft_price.at(num_rows)
            return [max(0, width - 1) * step for width in range(widest + 1)]

        width = padded_width(len(rows), bases[0], totals, alpha, beta, self.margin,
                             drafting(here) if drafting_here else None)
        # Every plain row probing at once (the module's doc): a decode row gains 1 at any width, a
        # probe its gains; rows that do not probe keep their widths.
        together = self._together(works, probes)
        joint = list(totals)
        for probe in together.values():
            joint = [total - 1.0 + gain for total, gain in zip(joint, probe.gains(widest))]
        joint_base = max([r.base for i, r in enumerate(rows) if i not in together], default=1)
        joint_width = padded_width(len(rows), joint_base, joint, alpha, beta, self.margin,
                                   drafting(here + len(together)))
        alone_drafting = drafting(here + 1)
        limits = {}
        for index, work in enumerate(works):
            if isinstance(work, DecodeWork):  # what this row would keep as a verify of the probe's size
                probe = probes.get(index)
                if probe is None:  # refused
                    limits[work.session_id] = 0
                    continue
                others_base = bases[1] if rows[index].base == bases[0] else bases[0]
                swapped = [total - 1.0 + gain for total, gain in zip(totals, probe.gains(widest))]
                alone = padded_width(len(rows), max(others_base, 1), swapped, alpha, beta, self.margin,
                                     alone_drafting)
                best = max(alone, joint_width) if index in together else alone
                limits[work.session_id] = max(0, min(probe.draft, best - probe.base))
        if self.exploration.planned(width > bases[0] or any(limits.values()), len(together)):
            for index in together:
                limits[works[index].session_id] = max(limits[works[index].session_id], 1)
        width = self.exploration.width(width, [r.base for r in rows if r.draft > 0])
        self.draft_limits = limits
        return [max(0, min(row.draft, width - row.base)) for row in rows]

    @staticmethod
    def _probes(works: Sequence[Work], rows: list[RowSpec], refused: set[int]) -> dict[int, RowSpec]:
        """The plain rows that may probe (not refused), each as a verify of the probe's size."""
        return {i: RowSpec(1, ADMISSION_PROBE_TOKENS, rows[i].acceptance) for i, work in enumerate(works)
                if isinstance(work, DecodeWork) and i not in refused}

    def _together(self, works: Sequence[Work], probes: dict[int, RowSpec]) -> dict[int, RowSpec]:
        """The probes that may probe jointly: not those of sessions drafting on a draft service, whose
        cycles also cost round trips the step does not show (cycle_wall.py prices them one session at
        a time). Told to probe together on one H200, that pool fell from 0.95 / 1.00 of plain decoding
        to 0.88 / 0.89 at 8 / 16 sessions (docs/BENCHMARKS.md, round 39)."""
        if self.cycle_wall is None:
            return probes
        return {i: p for i, p in probes.items() if not self.cycle_wall.drafts_elsewhere(works[i].session_id)}

    def _plan_packed(self, works: Sequence[Work], rows: list[RowSpec], refused: set[int], alpha: float,
                     beta: float, drafting_here: bool) -> list[int]:
        """plan() for a backend whose step costs the tokens it feeds (step_plan.py); a plain row's
        limit is what its probe would keep in the planned step (the hosted draft's passes priced, as
        in plan(), once this target has drafted)."""
        here, probes = _drafting_here(works), self._probes(works, rows, refused)
        price = self.draft_price.at
        planned = packed_plan(rows, alpha, beta, self.margin, price(here) if drafting_here else 0.0)
        # Every plain row probing at once (the module's doc): they share the hosted draft's passes.
        together = self._together(works, probes)
        joint = packed_plan([together.get(i, row) for i, row in enumerate(rows)], alpha, beta, self.margin,
                            price(here + len(together))) if len(together) > 1 else None
        self.draft_limits = {
            work.session_id: 0 if index not in probes else max(
                planned.limit(rows[index].acceptance, ADMISSION_PROBE_TOKENS, beta, self.margin, price(here + 1)),
                joint.kept[index] if joint is not None and index in together else 0)
            for index, work in enumerate(works) if isinstance(work, DecodeWork)
        }
        return planned.kept

    def observe_draft(self, steps: int, seconds: float, rows: int = 1) -> None:
        """A draft pass of the hosted draft model: `steps` draft steps over `rows` rows in `seconds`."""
        self.draft_price.observe(rows, steps, seconds)

    def admit_drafting_elsewhere(self, session_id: str, now: float, source: str = "") -> int | None:
        """A new session whose drafts will come from a draft service (`source`): 0 if the cycle pricing
        refuses it from the start (its plain steps then say so too), else None (nothing to say)."""
        if self.cycle_wall is None or not self.cycle_wall.admit(session_id, now, source):
            return None
        return 0

    def session_started(self, session_id: str, now: float) -> None:
        """Any session was prefilled: load its first step will add (the cycle pricing counts it)."""
        if self.cycle_wall is not None:
            self.cycle_wall.started(session_id, now)

    def _refused(self, works: Sequence[Work]) -> set[int]:
        """The rows whose sessions cycle_wall refuses for now (their drafts do not pay their round trips)."""
        if self.cycle_wall is None:
            return set()
        return {i for i, w in enumerate(works) if self.cycle_wall.refuses(w.session_id, w)}

    def plain_step_s(self, num_sessions: int) -> float | None:
        """Model seconds of a plain step of num_sessions rows, from the fit (None before one)."""
        fit = self.cost.fit(num_sessions)
        return None if fit is None else fit[0] + fit[1] * num_sessions

    def observe(self, works: Sequence[Work], results: Sequence[Result], seconds: float,
                started: float | None = None) -> None:
        """After a step (`seconds` long, from perf_counter `started`): its cost (against the tokens
        it fed if packed, else its padded size, rows x the widest row), the acceptance seen by each
        verified draft, and each session's cycle wall time (cycle_wall.py)."""
        widths = [base + draft for base, draft in map(_base_and_draft, works) if base + draft > 0]
        if widths:
            self.cost.observe(sum(widths) if self.packed else len(widths) * max(widths), seconds, len(widths))
        if self.cycle_wall is not None and started is not None:
            self.cycle_wall.observe(works, results, started, started + seconds, self.plain_step_s)
        self.exploration.observed(any(isinstance(w, VerifyWork) and w.draft.num_tokens for w in works))
        for work, result in zip(works, results):
            if isinstance(work, VerifyWork) and isinstance(result, VerifyOutcome) and result.num_drafted:
                stats = self._stats(work.session_id)
                rejected = 1 if result.num_accepted < result.num_drafted else 0
                stats.accepted = self.decay * stats.accepted + result.num_accepted
                stats.trials = self.decay * stats.trials + result.num_accepted + rejected

    def _cut(self, work: VerifyWork, keep: int) -> VerifyWork:
        if keep >= work.draft.num_tokens:
            return work
        self.trimmed_tokens += work.draft.num_tokens - keep
        return dataclasses.replace(work, draft=prefix(work.draft, keep))

    def _stats(self, session_id: str) -> _Acceptance:
        stats = self._sessions.get(session_id)
        if stats is None:
            stats = self._sessions[session_id] = _Acceptance(0.0, 0.0)
            while len(self._sessions) > self.max_sessions:  # forget the longest unseen
                self._sessions.popitem(last=False)
        self._sessions.move_to_end(session_id)
        return stats


def _drafting_here(works: Sequence[Work]) -> int:
    """The rows that draft on this target before the step (inner_draft.InnerDraftWork)."""
    return sum(1 for w in works if not isinstance(w, (VerifyWork, DecodeWork)))


def _base_and_draft(work) -> tuple[int, int]:
    """(tokens the work feeds besides drafted ones, its drafted tokens): a verify feeds the token its
    first drafted one follows; a decode its appended tokens and the one it samples (none: no row); a
    draft still to be made on the target (inner_draft.InnerDraftWork) is a verify of its longest length."""
    if isinstance(work, VerifyWork):
        return 1, work.draft.num_tokens
    if isinstance(work, DecodeWork):
        return len(work.append_token_ids) + work.num_tokens, 0
    return 1, work.num_draft_tokens


def prefix(draft: DraftBlock, length: int) -> DraftBlock:
    """The first `length` drafted tokens with their distributions: a shorter draft."""
    confidences = draft.confidences[:length]
    if draft.draft_probs is None:
        return DraftBlock(draft.token_ids[:length], confidences=confidences)
    return DraftBlock(draft.token_ids[:length], draft.draft_prob_ids[:length], draft.draft_probs[:length],
                      confidences)


def run_trimmed_batch(engine: TargetEngine, trimmer: DraftTrimmer, works: Sequence[Work]) -> list[Result]:
    """run_target_batch with the drafts trimmed by goodput, timing the step for the cost model."""
    works = trimmer.trim(works)
    started = time.perf_counter()
    results = run_target_batch(engine, works)
    trimmer.observe(works, results, time.perf_counter() - started, started)
    return results
