"""Adaptive draft length per session: maximise expected tokens per unit of time.

Leviathan et al. (2023, sec. 3.3): a cycle that drafts k tokens commits E(k) tokens on average and
costs k * t_draft + t_verify(k + 1); plain decoding commits 1 token per t_plain. We pick the k
(0 = plain decoding) with the highest E(k) / cost(k), from quantities measured on this session
(measurements.py says how each is measured, and why), so a draft that stops paying (low
acceptance, a loaded target whose verify grows with k) is shrunk or switched off, and re-probed
later in case the text became predictable again. A target that trims drafts under load (it sees
the whole batch) caps k at what it verified.

How it decides, beyond the textbook argmax, each because a benchmark showed the need
(docs/BENCHMARKS.md):
- Switching off needs an optimistic estimate to lose too (acceptance + half a standard error of
  the evidence, which fades while off, and the acceptance over a longer memory where that is
  higher): switching off ends the measurements that could switch it back on, and three unlucky
  opening cycles used to be enough.
- Switching off must pay for itself (round 24): the plain run's opening round trip and the probe
  that ends it cost more than a few plain steps save where drafting loses by little, so the wait
  before the next probe is as long as the saving needs to repay them (_paying_wait), and where no
  wait up to longest_probe_wait would, it keeps drafting; nor does it switch for a saving under
  least_saving of a step, within the estimates' noise. Each probe that fails doubles the wait.
- One plain step after the warm-up and one every explore_plain_every cycles measure what plain
  decoding costs now (under concurrency, queueing included) instead of guessing it.
- A draft model that reports its confidences also gets a per-block stop (confidence.py): the policy
  then asks for up to max_tokens and a confidence threshold below which the draft stops, so each
  block is as long as that block's own text pays for; best_k's choice only decides whether to
  speculate.
- A turn starts from what earlier turns on its route measured (shared_estimates.py, warm_start),
  drafting at least one token: its own cycles decide whether its text pays.

Pure bookkeeping: no I/O, no clocks. The loop reports what each cycle cost.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.generation.measurements import Measurements
from specdec.generation.shared_estimates import PolicyEstimates


UNTIL_TOLD = 1 << 20  # a plain run's length while the target refuses drafts: the loop caps it at the budget


def expected_tokens(acceptance: float, k: int) -> float:
    """E(k) = 1 + a + ... + a^k: tokens a cycle of k drafted tokens commits on average, when every
    drafted token is accepted with the same probability a (Leviathan et al., eq. 1)."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


@dataclass
class DraftLengthPolicy(Measurements):
    initial: int = 4
    max_tokens: int = 8
    warmup_cycles: int = 3  # speculative cycles at `initial` before adapting
    probe_every: int = 16  # plain cycles before a trimmed fixed length is tried in full again
    first_probe_after: int = 4  # the shortest wait (plain cycles) before a re-probe once switched off
    longest_probe_wait: int = 64  # the longest; each probe that fails doubles the wait up to it
    short_stint: int = 8  # speculative cycles: switched off again within fewer, the wait doubles
    switch_share: float = 0.5  # of what plain decoding saves, the most that switching to it may cost
    least_saving: float = 0.05  # of a plain step, per token: plain decoding must save more to switch to it
    switch_off_after: int = 2  # consecutive cycles whose verdict is "plain" before switching off
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
    _cycles: int = 0
    _since_plain: int = 0  # speculative cycles since the last plain step
    _plain_seen: bool = False
    _plain_since_probe: int = 0
    _current: int = 0
    _probe_interval: int = 0  # plain cycles before the next probe while off
    _wait: int = 0  # the wait best_k chose with its last verdict of 0
    _last_wait: int = 0  # the wait of the last switch-off
    _stint: int = 0  # speculative cycles since speculation was last switched on
    _limited_for: int = 0  # fixed length: cycles drafted under a trimmed limit so far
    _off_votes: int = 0  # consecutive "plain" verdicts while speculating
    _target_refuses: bool = False  # the last plain step's target would have verified no draft
    _best_rate: float | None = None  # tokens per second of best_k's choice

    def __post_init__(self) -> None:
        self._current = max(0, min(self.initial, self.max_tokens))
        self._probe_interval = self.probe_every
        self._stint = self.short_stint  # a first switch-off does not follow a probe that was too hopeful

    @property
    def cycles(self) -> int:
        """Speculative cycles observed (a warm start counts as warmup_cycles of them)."""
        return self._cycles

    @property
    def switched_off(self) -> bool:
        """Speculation is off by the policy's own verdict until a probe (not while the target refuses
        drafts: that may last, and the probe waits for the target to say so)."""
        return self._current == 0 and not self._target_refuses

    def next_k(self) -> int:
        """How many tokens to draft in the next cycle (0: decode plainly)."""
        if self._current == 0:
            if self._plain_since_probe >= self._probe_interval and not self._target_refuses:
                self._plain_since_probe = 0
                return self._probe_length()  # one probe cycle
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
        was_off, backoff = self._current == 0, self._probe_interval
        if k > 0:  # the target verified a draft: the load lets speculation through again
            self._probe_interval = self.probe_every
        self._measure_cycle(k, num_accepted, draft_s, verify_s, overhead_s, confidences, steady,
                            k if draft_steps is None else draft_steps, drafted_ahead, beside)
        if was_off and k > 0 and self.adapt:
            self._measure_probe(draft_s + verify_s + overhead_s)
        self._cycles += 1
        self._since_plain += 1
        self._stint += 1
        if not self.adapt:
            self._restore_fixed_length()
        elif self._cycles >= self.warmup_cycles:
            self._current = self._decide(self.best_k(), was_off, backoff if k > 0 else None)

    def _decide(self, best: int, was_off: bool, backoff: int | None) -> int:
        """best_k's verdict, with hysteresis on switching off: a wrong switch-off costs a wait of plain
        steps, so it takes switch_off_after verdicts in a row. The wait is best_k's (_paying_wait),
        doubled after a probe that did not pay, and after a probe that switched speculation on for
        fewer than short_stint cycles (it was too hopeful: on two GPUs at alpha 0.6, probes every few
        plain steps that each switched it on for a few losing cycles held a session at 0.9x of plain).
        backoff: the wait before this cycle, if it was a verified probe (None otherwise)."""
        if best > 0:
            self._off_votes = 0
            if was_off:
                self._stint = 0
            return best
        if was_off:
            if backoff is not None:  # a probe that did not pay: the next one later
                self._probe_interval = min(max(2 * backoff, self._wait), self.longest_probe_wait)
            return 0
        self._off_votes += 1
        if self._off_votes < self.switch_off_after:
            return self._current
        self._off_votes = 0
        self._plain_since_probe = 0
        wait = self._wait
        if self._stint < self.short_stint:
            wait = max(wait, 2 * self._last_wait)
        self._probe_interval = self._last_wait = min(wait, self.longest_probe_wait)
        return 0

    def summary(self) -> str:
        """The estimates the verdicts rest on, in words (the loop's DEBUG trace of a turn)."""
        plain = self._plain_cost()
        if plain is None or self._draft_s is None:
            return f"acceptance {self.acceptance:.2f}, no costs yet"
        cycles = ", ".join(f"k{k} {self.cycle_cost(k) * 1000:.1f}ms" for k in (1, 2, 3, 4))
        return f"acceptance {self.acceptance:.2f}, plain {plain * 1000:.1f}ms/token, cycles {cycles}"

    def _probe_length(self) -> int:
        """A probe's draft length: the best by the estimates with the optimism bonus, from 1 to
        `initial` (a probe at k = 4 where only k = 1 might pay costs the most)."""
        plain = self._plain_cost()
        if not self.adapt or plain is None or self._draft_s is None:
            return max(1, min(self.initial, self.max_tokens))
        best, _ = self._best(0.0, bonus=self._optimism())
        return max(1, min(best, self.initial, self.max_tokens))

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

    def observe_plain(self, step_s: float, overhead_s: float = 0.0, draft_limit: int | None = None,
                      opened_run: bool = False, queued_s: float = 0.0) -> None:
        """A plain step: its model seconds, its seconds outside the model, and how many drafted tokens
        the target would have verified in that step (None: it did not say). While the target says 0,
        no probe is made: it would be trimmed to nothing at the cost of a draft round trip.

        opened_run: the step opened a streamed run of plain steps (an exploring step does), paying
        the stream's opening and a whole round trip, which the run's later steps overlap (the target
        starts each while the last token travels). Plain decoding once switched off is such a run,
        so of this step only its wait in the target's batcher (queued_s) estimates what a plain step
        costs outside the model; the rest is the price of switching (_paying_wait). Priced as its
        opening step, plain decoding looked 40% dearer than it is on two GPUs (9.7 ms against 7.0 ms
        a token), and the adaptive length kept drafting at 0.89x of plain (BENCHMARKS.md, round 23)."""
        self._target_refuses = draft_limit == 0
        self._plain_seen, self._since_plain = True, 0
        self._measure_plain(step_s, overhead_s, opened_run, queued_s)
        self._plain_since_probe += 1
        if self._current == 0 and self.adapt:
            self._fade_evidence()

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
        """argmax over k in [0, max_tokens] of E(k) / cost(k). 0 wins when plain decoding saves more
        than least_saving of a step a token (on two H100s at alpha 0.6, where k = 2 tied plain
        decoding, turns that switched off on a thinner margin ran 6-15% slower than either: each
        switch restarts the pipeline and the draft catches up), drafting does not pay even judged
        optimistically (_optimism: switching off stops the measurements that could switch it on
        again, so a few unlucky cycles must not be enough), and plain decoding's gain pays for the
        switch within a wait of at most longest_probe_wait plain steps (_paying_wait)."""
        plain = self._plain_cost()
        if plain is None or self._draft_s is None:
            return self._current
        best_k, best_rate = self._best(1.0 / plain, bonus=0.0)
        self._best_rate = best_rate
        if best_k > 0:
            return best_k
        point_k, point_rate = self._best(0.0, bonus=0.0)
        if 1.0 / point_rate - plain < self.least_saving * plain:  # a margin within the estimates' noise
            return point_k
        drafting_k, drafting_rate = self._best(0.0, bonus=self._optimism())
        wait = self._paying_wait(plain, 1.0 / drafting_rate, max(1, min(drafting_k, self.initial)))
        if wait is None:
            return drafting_k
        self._wait = wait
        return 0

    def _paying_wait(self, plain_s: float, drafting_s: float, probe_k: int) -> int | None:
        """The plain steps to wait before the next probe if speculation switches off now: the
        shortest (from first_probe_after, doubling) whose switching cost, spread over it, takes at
        most switch_share of what plain decoding saves per token; None if even longest_probe_wait's does not
        (keep drafting). plain_s, drafting_s: seconds per token; the switch's cost: _switch_cost."""
        saved = drafting_s - plain_s
        if saved <= 0.0:
            return None
        switch = self._switch_cost(probe_k, plain_s)
        wait = max(1, self.first_probe_after)
        while switch / wait > saved * self.switch_share:
            wait *= 2
            if wait > self.longest_probe_wait:
                return None
        return wait

    def _best(self, plain_rate: float, bonus: float) -> tuple[int, float]:
        """(k, tokens per second) of the best draft length, acceptance raised by `bonus`."""
        best_k, best_rate = 0, plain_rate
        for k in range(1, self.max_tokens + 1):
            rate = self.expected_tokens(k, bonus) / self.cycle_cost(k)
            if rate > best_rate * 1.0001:  # ties go to the shorter draft
                best_k, best_rate = k, rate
        return best_k, best_rate

    def warm_start(self, estimates: PolicyEstimates) -> None:
        """Start from earlier turns' estimates: their costs as a few measurements, their acceptance
        as a few cycles (warm_*), at the length they make best (at least 1), adapting from the first
        cycle instead of after warmup_cycles at `initial`. Nothing happens before a turn measured a
        draft."""
        e = estimates
        if not self.adapt or e.draft_s is None or e.forward_moments is None:
            return
        self._start_from(e, self.warm_forwards, self.warm_cycles, self.warm_trials, self.warm_confidences,
                         self.warmup_cycles)
        self._plain_seen = e.plain_overhead_s is not None
        self._cycles = self.warmup_cycles
        # Where earlier turns found drafting did not pay, this turn still drafts one token first: its
        # text may be another, and its own cycles switch it off (switch_off_after verdicts) if not.
        # (Starting such turns plainly gained 1% in a simulation with one acceptance rate for all
        # turns, and lost 8% on the CPU with the real draft: a predictable turn after one that was
        # not decoded its first 64 tokens plainly; round 24.)
        self._current = max(1, self.best_k())
