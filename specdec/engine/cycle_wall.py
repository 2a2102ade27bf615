"""Pricing a speculative cycle by its wall time: does drafting elsewhere pay for its round trips?

The goodput trimmer (goodput.py) prices a batched step: which drafted tokens raise the step's
tokens per second. It cannot see what a cycle costs a session whose drafts come from a draft
service: between two of its verifies the session is away, calling Propose (a round trip, the draft's
own forwards, the coordinator's bookkeeping), while a session that decodes plainly gets a token in
every step the target runs, with no round trip (its tokens are streamed). Under load that is the whole
difference: on 2 H200s at 8 sessions (8B target, 1B draft service, alpha 0.8, k = 4) a cycle took
62 ms for 3.3 tokens, 9 ms of it the target's forward, while plain steps came every 10.7 ms, so
speculation ran at 0.58x of plain decoding and the trimmer let every draft through (docs/BENCHMARKS.md).

So the target measures, per session, the wall time from its previous result to the result of each
verify (the whole cycle, away time included) and the tokens the cycle committed, and compares
tokens / wall with what a plain stream would give it now: one token per plain step of the current
sessions, T(B) from the trimmer's step-cost fit plus the measured gap between back-to-back steps.
A session whose cycles lose is refused: its drafts are cut to nothing and its draft_limit is 0, so
its coordinator decodes it plainly (streamed) and makes no probe, for a number of its plain steps
that doubles with each refusal in a row; then it may probe again, and its next cycle decides afresh.
Sessions are short (a request of 128 tokens is a dozen cycles), so a new session does not start from
nothing: for as many of the target's steps as the latest refusal lasts, a new session whose first row
is a draft from elsewhere has it cut and is refused for what is left of it (the load and the draft
service are the same for all). The window is counted in the target's steps, not in the new sessions'
own: counted per session, a refusal longer than a request would pass from each session to the next
one, none would ever probe, and speculation would stay off for good (a canary saw exactly that). After
the window, new sessions draft, and their first measured cycle decides afresh (doubling the refusal if
it still loses); one verdict that pays lets new sessions draft at once again. A coordinator that
says at StartSession that the session will draft elsewhere is told there (admit), so a session
refused from its start opens no draft session and pays no draft prefill and no Propose at all. It
also names the draft source there (the draft service's address), and each source has its own
window: a slow draft service's verdict says nothing of another's cycles. Drafts
made inside the target (inner_draft.py) are never away, so they always pass.

While a source stands refused, its sessions take turns to probe: a session whose own refusal ends
inside the source's latest window waits for the window's end, and after it one session at a time
probes (holding the source's probe for up to probe_patience steps, until its verdict) while the
others wait. The load is the same for all of them, so one probe answers for all: eight sessions
probing on their own clocks had paid eight probes' round trips and draft catch-ups for one answer
(on 2 H200s at 8 sessions, 118 cycles for 32 requests that decoded 94% of their tokens plainly). A
probe that pays over min_cycles cycles (one losing cycle confirms a refusal, but one lucky block must
not lift it) drafts on, and passes the probe to the next session at once. The verdict itself lifts for
new sessions only after half its load's worth of probes paid in a row, each drafting beside those
before it, because one session drafting among plain ones says little of all of them drafting: on a
CPU at 16 sessions one probe paid (15-16 tokens/s against plain's 11), the verdict was lifted, and the
waiting sessions drafted together at 1.7-5 tokens/s, their verify rows widening every step. A lone
session gets no verdict, so its turn passes on at its first cycle.

A verdict holds for a load: the sessions the losing cycle met, counting those whose StartSession
is still queued for its prefill (`starting`, told by the service) and those prefilled whose first
step has not come (`started`): no result shows them yet, but they are the next steps' rows. A
session under a clearly lighter load (below `lighter` x the refusal's) may draft (a refused one
too, at once: a burst's tail need not decode plainly for the rest of its refusals), and only cycles
that pay under at least that load count towards lifting the verdict. Without that, a probe that paid at a burst's
tail, with most sessions gone, or at its head, with most still prefilling, let every new session of
the next burst draft, and each then lost two to seven cycles before its refusal (on the CPU at 16
sessions, 44-62 losing cycles a burst; docs/BENCHMARKS.md, "Round 30").

A fresh target has no verdict for any source, and a burst's sessions all drafted 3-6 cycles before the
first one came (0.875 of plain decoding on a CPU at 16 sessions, round 52). So a source met for the
first time under a load of two sessions or more stands refused with an empty window (the prior): one
session probes, and the others decode plainly from their start (no draft prefill, no round trip) until
the probes have paid or a loss has opened a window. Sessions that drafted beside each other and lose
within a running window are one verdict, not one doubling each.

A cycle is also charged what it cost the step's other rows. The target holds a step for a session
just served (batcher._gather), so while one drafts elsewhere the others wait for its verify, and its
drafted tokens widen their step: on a CPU at 4 sessions a cycle's round trip held the step for about
7 ms and its verify row added another 7 to a 44 ms step, and the cycles that committed 2 tokens paid
their own session but lost the pool's throughput (0.93 of plain decoding). So the interval from the
previous step's end to the verify step's end is set against a plain step of as many rows (the fit,
plus the gap between plain steps), and the share of the other rows' lost tokens (rows - m of them
for m verify rows drafted elsewhere) is taken off the cycle's tokens: whether the batch, not the
session alone, gets more tokens per second than plain decoding would give it.

Like the trimmer, this only chooses how many drafted tokens to verify: the output is unchanged.
Thread-confined to the model thread, as the trimmer is. No I/O; the caller passes the clock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

from specdec.types import VerifyOutcome

# A session prefilled this long ago without a step since no longer counts as load about to arrive: a
# burst's last prefill waits for all the others' (16 x 150 ms on a CPU) and its first draft.
JOIN_WINDOW_S = 10.0
# The load of the prior's verdict (_unpriced): none was measured, so it holds under any load of two or more.
PRIOR_LOAD = -1


@dataclass
class _Pace:
    last_result: float  # perf_counter seconds when the session's latest step ended
    wall_s: float | None = None  # EWMA of a cycle's wall time (previous result -> this verify's result)
    tokens: float | None = None  # EWMA of tokens committed per cycle
    others: float = 0.0  # EWMA of the tokens a cycle cost the other rows of its verify step
    cycles: int = 0  # cycles measured since the last reset
    refused_for: int = 0  # plain steps left before the session may draft again
    backoff: int = 0  # the next refusal's length in plain steps (doubles while refusals follow)
    refused_load: int = 0  # the load its refusal was made under (a clearly lighter one ends it)
    source: str = ""  # where its drafts come from (StartSession's draft_source; "": not said)


class CycleWallPricing:
    def __init__(self, margin: float = 0.0, decay: float = 0.7, min_cycles: int = 2, first_backoff: int = 32,
                 max_backoff: int = 1024, max_sessions: int = 4096, probe_patience: int = 16, lighter: float = 0.75):
        # min_cycles: a session's first verdict waits for this many measured cycles (the first one
        # after a plain run also pays the switch: a plain run cancelled, the draft catching up). A
        # probe after a refusal decides on its one cycle: it only has to confirm the refusal.
        # max_backoff: a probe costs more than its own losing cycle (the draft's catch-up over every
        # token since its last one, the probing session's round trips). Capped at 128 steps, a probe
        # every 2.6 s of a steady 4-session load on two CPU cores kept the draft service's pool at
        # 0.90-0.96 of plain decoding (adaptive length; k = 4 0.87-0.91); capped at 1,024, 0.99 (k = 4
        # 0.94-1.00; docs/BENCHMARKS.md, round 49). A clearly lighter load, or probes that pay, still
        # end a refusal at once.
        self.margin, self.decay, self.min_cycles = margin, decay, min_cycles
        self.first_backoff, self.max_backoff = first_backoff, max_backoff
        self.max_sessions, self.probe_patience, self.lighter = max_sessions, probe_patience, lighter
        # Sessions whose StartSession waits for its prefill (the service counts them; any thread may
        # call it): load that the next steps will carry, and that the sessions with results do not show.
        self.starting: Callable[[], int] = lambda: 0
        # Sessions prefilled (started) whose first step has not come yet: also load no result shows.
        self._joined: OrderedDict[str, float] = OrderedDict()
        self.refusals = 0  # sessions refused so far (a metric)
        self._steps = 0  # steps observed: the clock of the latest refusal's window for new sessions
        # Per draft source: (the step of its latest refusal, the plain steps it refused for, the load it
        # holds for); absent once enough probes paid under that load. One window per source: a slow
        # draft service's verdict must not hold back the new sessions of another.
        self._verdicts: dict[str, tuple[int, int, int]] = {}
        self._priced: OrderedDict[str, None] = OrderedDict()  # sources met under load (_unpriced)
        # Per refused source: probes that paid under its load since its latest refusal. One drafting
        # session among plain ones says little of all of them drafting (their verify rows widen every
        # session's step), so the verdict lifts only once half its load's worth of probes, each
        # drafting beside the ones before it, paid.
        # Counted by session: one probe drafting on pays cycle after cycle, and each cycle counted as a
        # probe let one session's luck stand for three of the eight a load of 16 needs.
        self._paid_probes: dict[str, set[str]] = {}
        # Per refused source: (the session probing for it, the step its probe was granted): one at a time.
        self._probes: dict[str, tuple[str, int]] = {}
        self._sources: OrderedDict[str, str] = OrderedDict()  # session -> draft source (StartSession)
        self._sessions: OrderedDict[str, _Pace] = OrderedDict()
        self._gap_s: float | None = None  # between one step's end and the next one's start, when busy
        self._plain_gap_s: float | None = None  # the same before steps without a verify drafted elsewhere
        self._step_s = 0.0  # the latest step's length
        self._last_end: float | None = None

    def refuses(self, session_id: str, work=None) -> bool:
        """Whether the session may not draft now; `work`, its row in the step being planned, decides
        for a session not seen yet (a draft from elsewhere starts from the latest verdict)."""
        pace = self._sessions.get(session_id)
        if pace is None:
            source = self._sources.get(session_id, "")
            return _drafted_elsewhere(work) and self._turn(session_id, source, self.load(self._last_end)) > 0
        return pace.refused_for > 0

    def drafts_elsewhere(self, session_id: str) -> bool:
        """Whether the session said at its start that its drafts come from a draft service (admit)."""
        return session_id in self._sources

    def admit(self, session_id: str, now: float, source: str = "") -> int:
        """A session that will draft elsewhere (at `source`) starts (StartSession says so): the plain
        steps it is refused for from the start (what is left of its source's latest refusal window; 0:
        it may draft). A refused one is told at once, so its coordinator opens no draft session for it."""
        self._remember(self._sources, session_id, source)
        pace = self._new_pace(session_id, source, now, self.load(now))
        if pace.refused_for:  # (unrefused, its first row sets the clock: a cycle is not measured from a prefill)
            self._remember(self._sessions, session_id, pace)
        return pace.refused_for

    def _new_pace(self, session_id: str, source: str, last_result: float, load: int) -> _Pace:
        """A new session drafting from `source` under `load` starts from its latest verdict: refused for
        the rest of its window; after it, it waits its turn to probe, its first measured cycle decides,
        and a loss doubles that refusal."""
        _, length, refused_load = self._verdicts.get(source, (0, 0, 0))
        return _Pace(last_result=last_result, refused_for=self._wait_to_probe(session_id, source, load),
                     backoff=length, refused_load=refused_load, source=source)

    def _wait_to_probe(self, session_id: str, source: str, load: int) -> int:
        """Steps the session must still decode plainly before it may draft from `source` (0: now; it then
        holds the source's probe, if the source stands refused for this load)."""
        wait = self._turn(session_id, source, load)
        if wait == 0 and self._holds(source, load):
            self._probes[source] = (session_id, self._steps)
        return wait

    def _holds(self, source: str, load: int) -> bool:
        """Whether the source stands refused for `load` (a clearly lighter load than its refusal's is not)."""
        verdict = self._verdicts.get(source)
        if verdict is None:
            return False
        return load >= 2 if verdict[2] == PRIOR_LOAD else load >= self.lighter * verdict[2]

    def _turn(self, session_id: str, source: str, load: int) -> int:
        """_wait_to_probe without taking the probe."""
        self._unpriced(source, load)
        if not self._holds(source, load):  # never refused, paid since, or a lighter load: no turns to take
            return 0
        left = self._inherited_refusal(source)
        if left:
            return left
        prober, granted = self._probes.get(source, ("", -self.probe_patience))
        waited = self._steps - granted
        if prober != session_id and waited < self.probe_patience:  # another's probe will answer for it
            return self.probe_patience - waited
        return 0

    def _unpriced(self, source: str, load: int) -> None:
        """The prior (module docstring): a verdict with an empty window and no load of its own. It holds
        under any load of two sessions or more, not only heavier ones as a measured refusal does: the
        load counted at a burst's start also counts the sessions just ended (32 for a burst of 16 after
        another), and held for that load only, it let the burst draft. It lifts after half the load's
        worth of probes paid, that load measured by the paying cycles."""
        if load < 2 or source in self._priced:
            return
        self._remember(self._priced, source, None)
        self._verdicts.setdefault(source, (self._steps, 0, PRIOR_LOAD))

    def _inherited_refusal(self, source: str) -> int:
        """Plain steps left of the source's latest refusal window: what a new session starts refused for."""
        step, length, _ = self._verdicts.get(source, (0, 0, 0))
        return max(0, step + length - self._steps)

    def started(self, session_id: str, now: float) -> None:
        """A session was prefilled (any session, drafting or not): it is load from now on, though
        until its first step no result shows it."""
        self._remember(self._joined, session_id, now)

    def load(self, now: float | None) -> int:
        """The sessions the next steps carry: those with a result in the last few steps, those
        prefilled but not stepped yet, and those still waiting for their prefill."""
        horizon = 4 * (self._step_s + (self._gap_s or 0.0))
        recent = 0 if now is None else self.active_sessions(now, horizon)
        return recent + self._arriving(now)

    def _arriving(self, now: float | None) -> int:
        """Sessions no result shows yet: started in the last JOIN_WINDOW_S without a step since (older
        ones have gone without a step, or their coordinator is elsewhere: forgotten), and those still
        waiting for their prefill."""
        while self._joined and now is not None and now - next(iter(self._joined.values())) > JOIN_WINDOW_S:
            self._joined.popitem(last=False)
        return len(self._joined) + self.starting()

    def active_sessions(self, now: float, horizon_s: float) -> int:
        """Sessions with a result in the last horizon_s seconds (a session that ended stops counting).
        The sessions are kept in the order they were last seen, so this reads only the recent ones:
        it runs per drafted row of every step, beside up to max_sessions remembered sessions."""
        count = 0
        for session_id, pace in reversed(self._sessions.items()):
            if now - pace.last_result > horizon_s:
                break
            # One refused at its start is remembered from its admission, but until its first step it
            # is counted as prefilled (_joined): once, or each admission in a burst saw the load twice.
            count += session_id not in self._joined
        return count

    def observe(self, works: Sequence, results: Sequence, started: float, ended: float,
                plain_step_s: Callable[[int], float | None]) -> None:
        """After a step that ran from `started` to `ended`: each row's session either drafted (a
        VerifyWork: a cycle, measured from its previous result) or decoded plainly (a refusal's
        countdown). plain_step_s(B): the model seconds of a plain step of B sessions, if known."""
        self._steps += 1
        step_s = ended - started
        away = sum(isinstance(r, VerifyOutcome) and _drafted_elsewhere(w) for w, r in zip(works, results))
        rows = len({w.session_id for w in works})
        others_lost = 0.0
        if self._last_end is not None and 0.0 <= started - self._last_end <= step_s:  # back to back
            gap = started - self._last_end
            self._gap_s = self._average(self._gap_s, gap)
            if away:
                others_lost = self._others_lost(rows, away, gap + step_s, plain_step_s)
            else:
                self._plain_gap_s = self._average(self._plain_gap_s, gap)
        self._last_end, self._step_s = ended, step_s
        for work in works:
            self._joined.pop(work.session_id, None)
        # The load now, before the rows below move their sessions to the recent end: one back from a
        # long cycle would stop the count there. At least this step's rows.
        load = max(self.load(ended), rows + self._arriving(ended))
        for work, result in zip(works, results):
            if isinstance(result, Exception):
                continue
            pace = self._sessions.get(work.session_id)
            if pace is None:  # a session whose first row drafted elsewhere starts from the latest verdict
                source = self._sources.get(work.session_id, "")
                pace = self._new_pace(work.session_id, source, ended, load) if _drafted_elsewhere(work) \
                    else _Pace(last_result=ended, source=source)
                self._remember(self._sessions, work.session_id, pace)
                continue
            self._sessions.move_to_end(work.session_id)
            wall = ended - pace.last_result
            if wall <= 0.0:  # a second row of the session in this step: no cycle to measure
                continue
            if pace.refused_for > 0:  # a step of the refusal, plain (or a verify cut to nothing)
                # The load it lost under has gone (a burst's tail, traffic falling): it may probe now.
                pace.refused_for = 0 if load < self.lighter * pace.refused_load else pace.refused_for - 1
                if pace.refused_for == 0:
                    pace.refused_for = self._wait_to_probe(work.session_id, pace.source, load)
                if pace.refused_for == 0:  # a probe may come: measure it afresh
                    pace.wall_s, pace.tokens, pace.cycles = None, None, 0
            elif isinstance(result, VerifyOutcome) and _drafted_elsewhere(work):
                # The load this cycle met: the sessions with a result during it (this one's previous
                # result included), at least the rows of this step, and those about to join.
                active = max(self.active_sessions(ended, wall), len(works)) + self._arriving(ended)
                self._cycle(work.session_id, pace, result.num_accepted + 1, others_lost, wall,
                            plain_step_s(active) if active > 1 else None, active)
            pace.last_result = ended

    def _average(self, average: float | None, value: float) -> float:
        return value if average is None else self.decay * average + (1 - self.decay) * value

    def _others_lost(self, rows: int, away: int, interval: float, plain_step_s) -> float:
        """Tokens each of a step's `away` verify rows drafted elsewhere cost its other rows: those got
        one token in `interval` (the wait for the step, the step) where plain steps of `rows` rows
        come one per plain period. Negative when the step came sooner (noise must not bias it up)."""
        plain = plain_step_s(rows) if rows > away else None
        if plain is None or self._plain_gap_s is None:
            return 0.0
        return (rows - away) * (interval / (plain + self._plain_gap_s) - 1.0) / away

    def _cycle(self, session_id: str, pace: _Pace, tokens: int, others_lost: float, wall: float,
               plain_step_s: float | None, load: int) -> None:
        pace.wall_s = self._average(pace.wall_s, wall)
        pace.tokens = self._average(pace.tokens, tokens)
        pace.others = self._average(pace.others if pace.cycles else None, others_lost)
        pace.cycles += 1
        if plain_step_s is None:  # alone: no verdict (the coordinator's call), so its turn passes on
            self._answered(session_id, pace.source)
            return
        if pace.cycles < (1 if pace.backoff else self.min_cycles):
            return
        gap = self._plain_gap_s if self._plain_gap_s is not None else self._gap_s  # None: no step back to back
        plain_period = plain_step_s + (gap or 0.0)
        pays = (pace.tokens - pace.others) / pace.wall_s >= (1.0 + self.margin) / plain_period
        if pays and pace.cycles < self.min_cycles:
            # A probe's one cycle confirms a refusal, but one lucky block must not lift it: every waiting
            # session would draft at once (on the CPU at 16 sessions, 15 lost a cycle each after one).
            return
        self._answered(session_id, pace.source)
        if pays:
            pace.backoff = 0  # it pays: it drafts on, and a later refusal starts short again
            if self._holds(pace.source, load):  # under the refusal's load: the next session may probe now
                paid = self._paid_probes.setdefault(pace.source, set())
                paid.add(session_id)
                held_load = self._verdicts[pace.source][2]
                if len(paid) >= (load if held_load == PRIOR_LOAD else held_load) / 2:  # enough: new sessions draft
                    del self._verdicts[pace.source], self._paid_probes[pace.source]
            return
        # The source's refusal doubles, whichever of its sessions probed, and holds from the lightest
        # load it lost under.
        step, length, refused_load = self._verdicts.get(pace.source, (0, 0, PRIOR_LOAD))
        refused_load = load if refused_load == PRIOR_LOAD else min(load, refused_load)
        if length and self._steps < step + length:
            # The source's refusal still runs: sessions that drafted beside each other lose together, and
            # their losses are one verdict. Doubled for each, eight losing in one step on a CPU at 16
            # sessions set a 1,024-step refusal at once.
            pace.backoff, pace.refused_for = length, step + length - self._steps
        else:
            length = max(pace.backoff, length)
            pace.backoff = self.first_backoff if length == 0 else min(2 * length, self.max_backoff)
            pace.refused_for, step = pace.backoff, self._steps
        pace.refused_load = load
        self._verdicts[pace.source] = (step, pace.backoff, refused_load)
        self._paid_probes.pop(pace.source, None)
        self.refusals += 1

    def _answered(self, session_id: str, source: str) -> None:
        """The session's verdict came: if it held its source's probe, the next session may take it."""
        if self._probes.get(source, ("",))[0] == session_id:
            del self._probes[source]

    def _remember(self, mapping: OrderedDict, session_id: str, value) -> None:
        mapping[session_id] = value
        mapping.move_to_end(session_id)
        while len(mapping) > self.max_sessions:  # forget the longest unseen
            mapping.popitem(last=False)


def _drafted_elsewhere(work) -> bool:
    """A verify of a draft that came over the network (batch.VerifyWork.drafted_elsewhere)."""
    return bool(getattr(work, "drafted_elsewhere", False))
