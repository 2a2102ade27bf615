"""What a session measured of its draft and its target, and what each choice costs by it.

The adaptive draft length (adaptive.py) picks the k with the most expected tokens per second; this
is the "expected tokens" and the "second": acceptance per draft position, the draft's seconds per
token, the target's cost per verified token, the overhead of a cycle and of a plain step. How each is
measured, and why, comes from benchmarks it lost before (docs/BENCHMARKS.md):
- Costs are split into model time and a fixed per-cycle overhead (RPC, batching, coordination;
  engine/cycle_cost.py). Dividing a whole Propose call's wall time by k charged the call's
  fixed cost per drafted token: short drafts looked cheap, long ones dear. Now cost(k) =
  k * t_draft + t_verify(k + 1) + overhead_speculative and a plain step t_plain + overhead_plain.
- E(k) comes from the acceptance measured at each draft position, not from one rate a and the
  geometric series 1 + a + ... + a^k. Lookup drafts (n-gram) are not geometric: a draft that
  copies a repeated span is accepted the longer, the further it got. Each position's conditional
  rate is shrunk toward the overall rate, so unseen or rarely reached positions use that.
- The target's cost is one fit t(n) = t0 + t1 * n + t2 * [n > 1] over the tokens a forward
  verifies, to every verify and plain step of the session (forward_cost.py), instead of a separate
  running average per size: on a shared CPU one slow step made its size look dear for many
  cycles, and sizes measured at different loads were compared with each other.
- A cycle whose draft first caught up (the prompt's prefill, tokens decoded plainly meanwhile) is
  not a drafting cost: a long prompt's prefill once priced drafting at 20 ms a token.
- Pipelined cycles (pipeline.py): the draft drafts the next block beside the verify, so a cycle
  whose block was drafted ahead (a hit: k accepted and the guessed bonus right) skips the Propose
  before its verify, and the drafting beside it costs only what outlasts the verify. Charged as
  sequential cycles, drafting looked twice as dear and k shrank to ~1.2 on two GPUs, where k = 4
  ran 8% faster (round 22).
- A plain step that opens a streamed run (an exploring step) pays a round trip the run's later
  steps overlap: it prices plain decoding by its queueing only, and its round trip as the price of
  switching to plain decoding (round 23: priced as its opening step, plain decoding looked 40%
  dearer than it is on two GPUs, and the adaptive length kept drafting at 0.89x of plain).

Pure bookkeeping: no I/O, no clocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.generation.confidence import ConfidenceCalibration
from specdec.generation.forward_cost import ForwardCost
from specdec.generation.shared_estimates import PolicyEstimates


@dataclass(kw_only=True)
class Measurements:
    decay: float = 0.9  # weight of the past in every running estimate (recent text matters most)
    prior_acceptance: float = 0.5
    prior_trials: float = 2.0  # pseudo-trials: two lucky cycles don't mean a = 1
    optimism: float = 0.5  # standard errors of acceptance granted before speculation is switched off
    evidence_decay: float = 0.98  # per cycle, for how sure the acceptance estimate is (_optimism)
    outlier_ratio: float = 2.0  # a drafted token's seconds count at most this times the estimate
    # Running estimates (exponentially weighted).
    _accepted: float = 0.0  # accepted draft tokens
    _trials: float = 0.0  # acceptance tests: accepted tokens + rejections
    _evidence: float = 0.0  # the same, fading more slowly: how sure the estimate is
    _evidence_accepted: float = 0.0  # accepted draft tokens, fading as slowly
    _tested: list[float] = field(default_factory=list)  # [j]: cycles whose draft token j was tested
    _passed: list[float] = field(default_factory=list)  # [j]: ... and accepted
    # The same, this turn's own and unfaded (a warm start's pseudo-counts left out): what it tells
    # its route (estimates()).
    _own_accepted: float = 0.0
    _own_trials: float = 0.0
    _own_tested: list[float] = field(default_factory=list)
    _own_passed: list[float] = field(default_factory=list)
    _draft_s: float | None = None  # model seconds per drafted token
    _forward: ForwardCost = field(default_factory=ForwardCost)  # target seconds by tokens fed
    _speculative_overhead_s: float | None = None  # per speculative cycle that proposed, outside the models
    _ahead_overhead_s: float | None = None  # per pipelined cycle whose block was drafted ahead (no Propose)
    _pipelined: bool = False  # the last cycle drafted its successor beside its verify
    _plain_overhead_s: float | None = None  # per plain step inside a streamed run, outside the model
    _opening_overhead_s: float | None = None  # per plain step that opened a run (an exploring step)
    _probe_s: float | None = None  # per probe cycle (after plain steps), catch-up included
    _calibration: ConfidenceCalibration = field(default_factory=ConfidenceCalibration)

    @property
    def acceptance(self) -> float:
        # Each cycle runs acceptance tests until the first rejection: accepted / trials estimates
        # the per-token acceptance rate without the bias of counting only accepted tokens.
        return (self._accepted + self.prior_trials * self.prior_acceptance) / (self._trials + self.prior_trials)

    def position_acceptance(self, j: int) -> float:
        """P(draft token j is accepted | tokens 0..j-1 were), shrunk toward the overall rate."""
        tested = self._tested[j] if j < len(self._tested) else 0.0
        passed = self._passed[j] if j < len(self._passed) else 0.0
        return (passed + self.prior_trials * self.acceptance) / (tested + self.prior_trials)

    def expected_tokens(self, k: int, bonus: float = 0.0) -> float:
        """E(k) = 1 + sum over j < k of P(tokens 0..j all accepted), from the per-position rates
        (each raised by `bonus`, at most to 1)."""
        total, survive = 1.0, 1.0
        for j in range(k):
            survive *= min(1.0, self.position_acceptance(j) + bonus)
            total += survive
        return total

    def cycle_cost(self, k: int) -> float:
        """Expected seconds of a cycle that drafts k tokens. Sequential: draft, then verify, plus the
        overhead. Pipelined: the successor is drafted (its guess, then k tokens) beside the verify,
        and with probability hit(k) it is the next block, whose cycle then skips the Propose."""
        verify = self.verify_cost(k + 1)
        overhead = self._speculative_overhead_s or 0.0
        if not self._pipelined:
            return k * self._draft_s + verify + overhead
        hit = self.hit_probability(k)
        ahead_overhead = overhead if self._ahead_overhead_s is None else self._ahead_overhead_s
        return ((1.0 - hit) * (k * self._draft_s + overhead) + hit * ahead_overhead
                + max(verify, (k + 1) * self._draft_s))

    def hit_probability(self, k: int) -> float:
        """P(a block of k is accepted whole and the draft's next token is the target's): a pipelined
        successor drafted on that guess is then the next block. The guess is judged like a drafted
        token at position k."""
        survive = 1.0
        for j in range(k + 1):
            survive *= self.position_acceptance(j)
        return survive

    def verify_cost(self, num_tokens: int) -> float:
        """Target model seconds of a forward that verifies num_tokens (1: a plain step)."""
        return self._forward.cost(num_tokens)

    def _plain_cost(self) -> float | None:
        """Seconds per plain step, overhead included. Before any plain step was seen: the
        speculative cycles' overhead (which include a Propose round trip that plain decoding would
        not pay: an estimate that leans toward speculating, until a plain step measures the truth)."""
        if not self._forward.seen:
            return None
        step = self.verify_cost(1)
        overhead = self._plain_overhead_s
        if overhead is None:
            overhead = self._speculative_overhead_s or 0.0
        return step + overhead

    def _switch_cost(self, probe_k: int, plain_s: float) -> float:
        """Seconds that switching to plain decoding costs beyond its plain steps: the step that
        opens the plain run (its round trip, which the run's later steps overlap) and the probe that
        ends it, a sequential cycle after the draft caught up on the plain tokens (a forward), less
        the plain steps its expected tokens would have taken."""
        reopening = 0.0
        if self._opening_overhead_s is not None:
            reopening = max(0.0, self._opening_overhead_s - (self._plain_overhead_s or 0.0))
        probe = (probe_k + 1) * self._draft_s + self.verify_cost(probe_k + 1) + (self._speculative_overhead_s or 0.0)
        if self._probe_s is not None:  # as measured: a catch-up of tens of tokens, the pipeline restarting
            probe = max(probe, self._probe_s)
        return reopening + max(0.0, probe - self.expected_tokens(probe_k) * plain_s)

    def _optimism(self) -> float:
        """An upper-confidence bonus on the acceptance rate: `optimism` standard errors of a rate
        measured on the trials so far (the evidence, which fades slowly). Large after a few
        cycles, small after many; it grows back while speculation is off (observe_plain forgets),
        so probes switch it on again unless acceptance really is too low."""
        trials = self._evidence + self.prior_trials
        # The acceptance over the evidence's longer memory, if higher: noise in the last ten cycles'
        # estimate switched drafts off that paid (alpha 0.7 in tests/test_switch_off.py). Shrunk
        # toward the recent estimate, so that once the evidence faded (off) it adds nothing.
        recent = self.acceptance
        longer = (self._evidence_accepted + self.prior_trials * recent) / trials
        return max(0.0, longer - recent) + self.optimism * (0.25 / trials) ** 0.5

    def _measure_cycle(self, k: int, num_accepted: int, draft_s: float, verify_s: float, overhead_s: float,
                       confidences: tuple[float, ...], steady: bool, draft_steps: int, drafted_ahead: bool,
                       beside: bool) -> None:
        """A speculative cycle's measurements (DraftLengthPolicy.observe_cycle says what each is)."""
        rejected = 1 if num_accepted < k else 0
        self._calibration.observe(tuple(confidences)[:k], num_accepted)
        self._accepted = self.decay * self._accepted + num_accepted
        self._trials = self.decay * self._trials + num_accepted + rejected
        self._evidence = self.evidence_decay * self._evidence + num_accepted + rejected
        self._evidence_accepted = self.evidence_decay * self._evidence_accepted + num_accepted
        self._own_accepted += num_accepted
        self._own_trials += num_accepted + rejected
        self._measure_positions(k, num_accepted)
        per_token = draft_s / draft_steps if draft_steps > 0 else None
        if per_token is not None and steady:
            if self._draft_s is not None:  # one slow Propose (a pause, a graph captured) is not the price
                per_token = min(per_token, self.outlier_ratio * self._draft_s)
            self._draft_s = self._ewma(self._draft_s, per_token)
        elif per_token is not None and self._draft_s is not None:
            # A catch-up only adds to a cycle's draft time: it bounds the price from above. Without the
            # bound, a price inflated once (a slow first Propose, in a simulation with outliers) kept
            # speculation off for good, every probe after plain steps being a catch-up.
            self._draft_s = min(self._draft_s, per_token)
        self._forward.observe(k + 1, verify_s)
        self._pipelined = beside
        if steady and drafted_ahead:
            self._ahead_overhead_s = self._ewma(self._ahead_overhead_s, overhead_s)
        elif steady:
            self._speculative_overhead_s = self._ewma(self._speculative_overhead_s, overhead_s)

    def _measure_plain(self, step_s: float, overhead_s: float, opened_run: bool, queued_s: float) -> None:
        """A plain step's measurements. One that opened a streamed run prices a plain step by its
        wait in the target's batcher (queued_s: the load), and keeps its overhead apart as what
        reopening a run costs (_switch_cost)."""
        self._forward.observe(1, step_s)
        if opened_run:
            self._opening_overhead_s = self._ewma(self._opening_overhead_s, overhead_s)
        self._plain_overhead_s = self._ewma(self._plain_overhead_s, queued_s if opened_run else overhead_s)

    def _measure_probe(self, seconds: float) -> None:
        """A probe cycle's seconds: draft, verify and the overhead on its critical path. On two H100s a
        probe after a plain run cost 19 ms of model time against 16 ms for a steady cycle (the draft
        catching up on the plain tokens), which the cost model alone did not see (round 24)."""
        self._probe_s = self._ewma(self._probe_s, seconds)

    def _fade_evidence(self) -> None:
        """While speculation is off the acceptance measured earlier grows stale."""
        self._evidence *= self.decay
        self._evidence_accepted *= self.decay

    def estimates(self) -> PolicyEstimates:
        """What this session measured, for the next turns on its route (shared_estimates.py)."""
        cycles = self._own_tested[0] if self._own_tested else 0.0
        weight, survived = self._calibration.shares()
        return PolicyEstimates(
            draft_s=self._draft_s, forward_moments=self._forward.moments(),
            speculative_overhead_s=self._speculative_overhead_s, ahead_overhead_s=self._ahead_overhead_s,
            plain_overhead_s=self._plain_overhead_s, opening_overhead_s=self._opening_overhead_s,
            probe_s=self._probe_s, pipelined=self._pipelined,
            acceptance=self._own_accepted / self._own_trials if self._own_trials > 0 else None,
            tested=tuple(t / cycles for t in self._own_tested) if cycles > 0 else (),
            passed=tuple(p / cycles for p in self._own_passed) if cycles > 0 else (),
            calibration_weight=weight, calibration_survived=survived,
            trials=self._own_trials, accepted=self._own_accepted,
            tested_counts=tuple(self._own_tested), passed_counts=tuple(self._own_passed),
        )

    def _start_from(self, e: PolicyEstimates, forwards: float, cycles: float, trials: float, confidences: float,
                    calibration_blocks: int) -> None:
        """Earlier turns' estimates as this session's first measurements, each with the weight of
        that many of its own (DraftLengthPolicy.warm_start)."""
        self._draft_s = e.draft_s
        self._forward.start_from(e.forward_moments, forwards)
        self._speculative_overhead_s, self._ahead_overhead_s = e.speculative_overhead_s, e.ahead_overhead_s
        self._plain_overhead_s, self._opening_overhead_s = e.plain_overhead_s, e.opening_overhead_s
        self._probe_s = e.probe_s
        self._pipelined = e.pipelined
        if e.acceptance is not None:
            self._accepted, self._trials = trials * e.acceptance, trials
            self._evidence, self._evidence_accepted = trials, trials * e.acceptance
        self._tested = [cycles * t for t in e.tested]
        self._passed = [cycles * p for p in e.passed]
        self._calibration.start_from(e.calibration_weight, e.calibration_survived, confidences, calibration_blocks)

    def _measure_positions(self, k: int, num_accepted: int) -> None:
        """Token j was tested iff j <= num_accepted (tests stop at the first rejection)."""
        for counts in (self._tested, self._passed, self._own_tested, self._own_passed):
            counts.extend([0.0] * (k - len(counts)))
        for j in range(len(self._tested)):
            self._tested[j] *= self.decay
            self._passed[j] *= self.decay
        for j in range(min(k, num_accepted + 1)):
            self._tested[j] += 1.0
            self._passed[j] += 1.0 if j < num_accepted else 0.0
            self._own_tested[j] += 1.0
            self._own_passed[j] += 1.0 if j < num_accepted else 0.0

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1.0 - self.decay) * new
