"""Adaptive draft length per session: maximise expected tokens per unit of time.

Leviathan et al. (2023, sec. 3.3): a cycle that drafts k tokens commits E(k) tokens on average and
costs k * t_draft + t_verify(k + 1); plain decoding commits 1 token per t_plain. We pick the k
(0 = plain decoding) with the highest E(k) / cost(k), from quantities measured on this session, so
a draft that stops paying (low acceptance, a loaded target whose verify grows with k) is shrunk or
switched off, and re-probed every `probe_every` plain cycles in case the text became predictable
again. A target that trims drafts under load (it sees the whole batch) caps k at what it verified.

Three refinements over the textbook rule, all because the textbook rule lost to a fixed k = 4 in
the benchmark (docs/BENCHMARKS.md):
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

Then three more, because it still lost (a quiet run: 1.30x against k = 3's 1.39x with the draft
model; its sessions decoded 17-21% of their steps plainly):
- Switching off needs an optimistic estimate to lose too (acceptance + half a standard error of
  the evidence, which fades while off): switching off ends the measurements that could switch it
  back on, and three unlucky opening cycles used to be enough.
- A cycle whose draft first caught up (the prompt's prefill, tokens decoded plainly meanwhile) is
  not a drafting cost: a long prompt's prefill once priced drafting at 20 ms a token.
- One plain step after the warm-up and one every explore_plain_every cycles measure what plain
  decoding costs now (under concurrency, queueing included) instead of guessing it.

Pipelined cycles (pipeline.py) cost differently: the draft drafts the next block beside the verify,
so a cycle whose block was drafted ahead (a hit: k accepted and the guessed bonus right) skips the
Propose before its verify, and the drafting beside it costs only what outlasts the verify. Charging
them as sequential cycles (the draft's time in full, the speculative Propose's too) made drafting look
twice as dear and shrank k to ~1.2 on two GPUs, where k = 4 ran 8% faster (BENCHMARKS.md, round 22).

A draft model that reports its confidences also gets a per-block stop (confidence.py): the policy
then asks for up to max_tokens and a confidence threshold below which the draft stops, so each block
is as long as that block's own text pays for; best_k's choice only decides whether to speculate.

Pure bookkeeping: no I/O, no clocks. The loop reports what each cycle cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.generation.confidence import ConfidenceCalibration
from specdec.generation.forward_cost import ForwardCost
from specdec.generation.shared_estimates import PolicyEstimates


UNTIL_TOLD = 1 << 20  # a plain run's length while the target refuses drafts: the loop caps it at the budget


def expected_tokens(acceptance: float, k: int) -> float:
    """E(k) = 1 + a + ... + a^k: tokens a cycle of k drafted tokens commits on average, when every
    drafted token is accepted with the same probability a (Leviathan et al., eq. 1)."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


@dataclass
class DraftLengthPolicy:
    initial: int = 4
    max_tokens: int = 8
    decay: float = 0.9  # weight of the past in every running estimate (recent text matters most)
    warmup_cycles: int = 3  # speculative cycles at `initial` before adapting
    probe_every: int = 16  # plain cycles between re-probes once speculation is off (at most)
    first_probe_after: int = 4  # plain cycles before the first re-probe; doubles per probe that fails
    switch_off_after: int = 2  # consecutive cycles whose verdict is "plain" before switching off
    prior_acceptance: float = 0.5
    prior_trials: float = 2.0  # pseudo-trials: two lucky cycles don't mean a = 1
    optimism: float = 0.5  # standard errors of acceptance granted before speculation is switched off
    evidence_decay: float = 0.98  # per cycle, for how sure the acceptance estimate is (_optimism)
    explore_plain_every: int = 64  # speculative cycles between plain steps that re-measure plain decoding
    # False: a fixed draft length (the request named it); only the loaded target's trimming
    # shortens it, for probe_every cycles at a time (see limit()).
    adapt: bool = True
    confidence_stop: bool = True  # adaptive only: stop each draft by its confidence (confidence.py)
    # How much earlier turns' estimates weigh in warm_start(), in the units each estimate counts.
    warm_forwards: float = 8.0  # target forwards (its own weigh 1 each, fading 0.95 per forward)
    warm_cycles: float = 3.0  # cycles' worth of acceptance per draft position
    warm_trials: float = 6.0  # acceptance tests, for the overall rate and its evidence
    warm_confidences: float = 40.0  # drafted tokens' confidences
    # Running estimates (exponentially weighted).
    _accepted: float = 0.0  # accepted draft tokens
    _trials: float = 0.0  # acceptance tests: accepted tokens + rejections
    _evidence: float = 0.0  # the same, fading more slowly: how sure the estimate is
    _tested: list[float] = field(default_factory=list)  # [j]: cycles whose draft token j was tested
    _passed: list[float] = field(default_factory=list)  # [j]: ... and accepted
    _draft_s: float | None = None  # model seconds per drafted token
    _forward: "ForwardCost" = field(default_factory=lambda: ForwardCost())  # target seconds by tokens fed
    _speculative_overhead_s: float | None = None  # per speculative cycle that proposed, outside the models
    _ahead_overhead_s: float | None = None  # per pipelined cycle whose block was drafted ahead (no Propose)
    _pipelined: bool = False  # the last cycle drafted its successor beside its verify
    _plain_overhead_s: float | None = None  # per plain cycle, outside the model
    _cycles: int = 0
    _since_plain: int = 0  # speculative cycles since the last plain step
    _plain_seen: bool = False
    _plain_since_probe: int = 0
    _current: int = 0
    _probe_interval: int = 0  # plain cycles between probes now: probe_every, longer under load
    _limited_for: int = 0  # fixed length: cycles drafted under a trimmed limit so far
    _off_votes: int = 0  # consecutive "plain" verdicts while speculating
    _target_refuses: bool = False  # the last plain step's target would have verified no draft
    _calibration: ConfidenceCalibration = field(default_factory=ConfidenceCalibration)
    _best_rate: float | None = None  # tokens per second of best_k's choice

    def __post_init__(self) -> None:
        self._current = max(0, min(self.initial, self.max_tokens))
        self._probe_interval = self.probe_every

    @property
    def acceptance(self) -> float:
        # Each cycle runs acceptance tests until the first rejection: accepted / trials estimates
        # the per-token acceptance rate without the bias of counting only accepted tokens.
        return (self._accepted + self.prior_trials * self.prior_acceptance) / (self._trials + self.prior_trials)

    @property
    def cycles(self) -> int:
        """Speculative cycles observed (a warm start counts as warmup_cycles of them)."""
        return self._cycles

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

    def next_k(self) -> int:
        """How many tokens to draft in the next cycle (0: decode plainly)."""
        if self._current == 0:
            if self._plain_since_probe >= self._probe_interval and not self._target_refuses:
                self._plain_since_probe = 0
                return max(1, min(self.initial, self.max_tokens))  # one probe cycle
            return 0
        if self.adapt and self._since_plain >= (self.explore_plain_every if self._plain_seen else self.warmup_cycles):
            # What a plain step costs now, queueing behind other sessions included, is what speculation
            # is measured against; before any was seen it is a guess (_plain_cost). One plain step
            # after the warm-up, and one every explore_plain_every cycles as the load changes.
            self._since_plain = 0
            return 0
        if self._stops_by_confidence():
            return self.max_tokens  # the draft's confidence stop decides the length (stop_below)
        return self._current

    def plain_run(self) -> int:
        """After next_k() said 0: how many plain steps in a row it will ask for, this one included
        (up to the next probe while off, else this exploring step alone), so that the loop decodes
        them as one streamed run."""
        if self._current == 0:
            # While the target refuses: until it says otherwise (the loop ends the run at the next
            # probe). A run of a probe interval restarted the stream every 16 steps for nothing, and
            # a restart can cost the session its row in the others' next batched step.
            if self._target_refuses:
                return UNTIL_TOLD
            return max(1, self._probe_interval - self._plain_since_probe)
        return 1

    def stop_below(self) -> float:
        """The confidence product below which the next draft stops (0: draft next_k() tokens).
        Drafting one more token costs a draft step and a verified token and adds survival * a
        expected tokens: worth it while that beats the best rate, rate * cost / a."""
        if not self._stops_by_confidence():
            return 0.0
        # One more token inside a block that already has some: the verify's marginal token (t1),
        # not the jump from a plain step to a multi-token verify (t1 + t2), which the block pays once.
        step = max(0.0, self.verify_cost(3) - self.verify_cost(2))
        needed = self._best_rate * (self._draft_s + step) / max(self.acceptance, 1e-3)
        return self._calibration.threshold(needed)

    def _stops_by_confidence(self) -> bool:
        return (self.adapt and self.confidence_stop and self._current > 0 and self._best_rate is not None
                and self._draft_s is not None and self._calibration.blocks >= self.warmup_cycles)

    def observe_cycle(self, k: int, num_accepted: int, draft_s: float, verify_s: float,
                      overhead_s: float = 0.0, confidences: tuple[float, ...] = (), steady: bool = True,
                      draft_steps: int | None = None, drafted_ahead: bool = False, beside: bool = False) -> None:
        """A speculative cycle: k tokens verified, num_accepted accepted; model seconds of the
        draft (draft_steps drafted tokens, default k) and of the verify, and the cycle's seconds
        outside the models on its critical path; the draft's confidence in each verified token, if
        it has them. steady=False: the draft first caught up on a prompt or on plainly decoded
        tokens (a prefill, maybe a StartSession), so its time and the cycle's overhead are not a
        steady cycle's and are left out of the costs (a long prompt's draft prefill once counted as
        20 ms per drafted token and switched sessions off). Pipelining: drafted_ahead, the block was
        drafted during the previous verify (no Propose before this one); beside, the next block was
        drafted during this verify."""
        rejected = 1 if num_accepted < k else 0
        was_off, backoff = self._current == 0, self._probe_interval
        self._calibration.observe(tuple(confidences)[:k], num_accepted)
        if k > 0:  # the target verified a draft: the load lets speculation through again
            self._probe_interval = self.probe_every
        self._accepted = self.decay * self._accepted + num_accepted
        self._trials = self.decay * self._trials + num_accepted + rejected
        self._evidence = self.evidence_decay * self._evidence + num_accepted + rejected
        self._observe_positions(k, num_accepted)
        draft_steps = k if draft_steps is None else draft_steps
        if draft_steps > 0 and steady:
            self._draft_s = self._ewma(self._draft_s, draft_s / draft_steps)
        self._forward.observe(k + 1, verify_s)
        self._pipelined = beside
        if steady and drafted_ahead:
            self._ahead_overhead_s = self._ewma(self._ahead_overhead_s, overhead_s)
        elif steady:
            self._speculative_overhead_s = self._ewma(self._speculative_overhead_s, overhead_s)
        self._cycles += 1
        self._since_plain += 1
        if not self.adapt:
            self._restore_fixed_length()
        elif self._cycles >= self.warmup_cycles:
            self._current = self._decide(self.best_k(), was_off, backoff if k > 0 else None)

    def _decide(self, best: int, was_off: bool, backoff: int | None) -> int:
        """best_k's verdict, with hysteresis on switching off. A wrong switch-off costs a run of plain
        steps until the next probe (16 each in a quiet CPU sweep, on prompts where every fixed k beat
        plain decoding), so it takes switch_off_after verdicts in a row, and the first re-probe comes
        after first_probe_after plain steps, each failed probe doubling the wait up to probe_every.
        backoff: the wait before this cycle, if it was a verified probe (None otherwise)."""
        if best > 0 or was_off:
            self._off_votes = 0
            if best == 0 and backoff is not None:  # a probe that did not pay: the next one later
                self._probe_interval = min(2 * backoff, self.probe_every)
            return best
        self._off_votes += 1
        if self._off_votes < self.switch_off_after:
            return self._current
        self._off_votes = 0
        self._plain_since_probe = 0
        self._probe_interval = min(self.first_probe_after, self.probe_every)
        return 0

    def limit(self, num_tokens: int) -> None:
        """The target verified only num_tokens of the draft: it trimmed the rest because, in its
        current batch, they did not pay (specdec.engine.goodput). Draft no more than that until a
        later cycle shows more pays. 0 switches to plain decoding, re-probed ever less often while
        the target keeps refusing (every probe costs the loaded batch a draft round trip)."""
        self._current = min(self._current, max(0, num_tokens))
        self._limited_for = 0
        if num_tokens == 0:
            self._probe_interval = min(2 * self._probe_interval, 16 * self.probe_every)

    def start_refused(self) -> None:
        """The target said at the session's start that it would cut a draft to nothing (cycles through
        the draft service lose under its load): start plain, and probe only once its plain steps'
        draft_limit allows one, as after a refusal mid-session."""
        self._current = 0
        self._target_refuses = True

    def observe_plain(self, step_s: float, overhead_s: float = 0.0, draft_limit: int | None = None) -> None:
        """A plain step: its model seconds, its seconds outside the model, and how many drafted tokens
        the target would have verified in that step (None: it did not say). While the target says 0,
        no probe is made: it would be trimmed to nothing at the cost of a draft round trip."""
        self._target_refuses = draft_limit == 0
        self._plain_seen, self._since_plain = True, 0
        self._forward.observe(1, step_s)
        self._plain_overhead_s = self._ewma(self._plain_overhead_s, overhead_s)
        self._plain_since_probe += 1
        if self._current == 0 and self.adapt:  # off: the acceptance measured earlier grows stale
            self._evidence *= self.decay

    def _restore_fixed_length(self) -> None:
        """A fixed length cut by the target's trimming is tried in full again after probe_every
        cycles: the load may have gone (cut to 0, next_k's probes do the same)."""
        if 0 < self._current < self.initial:
            self._limited_for += 1
            if self._limited_for >= self.probe_every:
                self._current = min(self.initial, self.max_tokens)
        elif self._current == 0 and self._plain_since_probe == 0:  # a probe cycle was verified
            self._current = min(self.initial, self.max_tokens)

    def best_k(self) -> int:
        """argmax over k in [0, max_tokens] of E(k) / cost(k); 0 wins when drafting doesn't pay,
        judged optimistically (_optimism): switching off stops the measurements that could switch
        it on again, so a few unlucky cycles must not be enough."""
        plain = self._plain_cost()
        if plain is None or self._draft_s is None:
            return self._current
        best_k, best_rate = self._best(1.0 / plain, bonus=0.0)
        if best_k == 0:
            best_k, _ = self._best(1.0 / plain, bonus=self._optimism())
        self._best_rate = best_rate
        return best_k

    def _best(self, plain_rate: float, bonus: float) -> tuple[int, float]:
        """(k, tokens per second) of the best draft length, acceptance raised by `bonus`."""
        best_k, best_rate = 0, plain_rate
        for k in range(1, self.max_tokens + 1):
            rate = self.expected_tokens(k, bonus) / self.cycle_cost(k)
            if rate > best_rate * 1.0001:  # ties go to the shorter draft
                best_k, best_rate = k, rate
        return best_k, best_rate

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

    def _optimism(self) -> float:
        """An upper-confidence bonus on the acceptance rate: `optimism` standard errors of a rate
        measured on the trials so far (the evidence, which fades slowly). Large after a few
        cycles, small after many; it grows back while speculation is off (observe_plain forgets),
        so probes switch it on again unless acceptance really is too low."""
        return self.optimism * (0.25 / (self._evidence + self.prior_trials)) ** 0.5

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

    def estimates(self) -> PolicyEstimates:
        """What this policy measured, for the next turns on its route (shared_estimates.py)."""
        cycles = self._tested[0] if self._tested else 0.0
        weight, survived = self._calibration.shares()
        return PolicyEstimates(
            draft_s=self._draft_s, forward_moments=self._forward.moments(),
            speculative_overhead_s=self._speculative_overhead_s, ahead_overhead_s=self._ahead_overhead_s,
            plain_overhead_s=self._plain_overhead_s, pipelined=self._pipelined,
            acceptance=self._accepted / self._trials if self._trials > 0 else None,
            tested=tuple(t / cycles for t in self._tested) if cycles > 0 else (),
            passed=tuple(p / cycles for p in self._passed) if cycles > 0 else (),
            calibration_weight=weight, calibration_survived=survived,
        )

    def warm_start(self, estimates: PolicyEstimates) -> None:
        """Start from earlier turns' estimates: their costs as a few measurements, their acceptance
        as a few cycles (warm_*), at the length they make best (at least 1), adapting from the first
        cycle instead of after warmup_cycles at `initial`. Nothing happens before a turn measured a
        draft."""
        e = estimates
        if not self.adapt or e.draft_s is None or e.forward_moments is None:
            return
        self._draft_s = e.draft_s
        self._forward.start_from(e.forward_moments, self.warm_forwards)
        self._speculative_overhead_s, self._ahead_overhead_s = e.speculative_overhead_s, e.ahead_overhead_s
        self._plain_overhead_s, self._plain_seen = e.plain_overhead_s, e.plain_overhead_s is not None
        self._pipelined = e.pipelined
        if e.acceptance is not None:
            self._accepted, self._trials = self.warm_trials * e.acceptance, self.warm_trials
            self._evidence = self.warm_trials
        self._tested = [self.warm_cycles * t for t in e.tested]
        self._passed = [self.warm_cycles * p for p in e.passed]
        self._calibration.start_from(e.calibration_weight, e.calibration_survived, self.warm_confidences,
                                     self.warmup_cycles)
        self._cycles = self.warmup_cycles
        # Where earlier turns found drafting did not pay, this turn still drafts one token first: its
        # text may be another, and its own cycles switch it off (switch_off_after verdicts) if not.
        self._current = max(1, self.best_k())

    def _observe_positions(self, k: int, num_accepted: int) -> None:
        """Token j was tested iff j <= num_accepted (tests stop at the first rejection)."""
        grow = k - len(self._tested)
        if grow > 0:
            self._tested.extend([0.0] * grow)
            self._passed.extend([0.0] * grow)
        for j in range(len(self._tested)):
            self._tested[j] *= self.decay
            self._passed[j] *= self.decay
        for j in range(min(k, num_accepted + 1)):
            self._tested[j] += 1.0
            self._passed[j] += 1.0 if j < num_accepted else 0.0

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1.0 - self.decay) * new
