"""Pricing a drafted session's whole cycle (specdec.engine.cycle_wall): under load, a session whose drafts
come from a draft service and whose cycles, round trips included, commit fewer tokens per second than
plain decoding would, is told to decode plainly for a while; one whose cycles pay is left alone, and so
are drafts made inside the target. The steps are simulated with a clock of our own."""

from __future__ import annotations

import torch

from specdec.engine.batch import DecodeWork, VerifyWork
from specdec.engine.cycle_wall import CycleWallPricing
from specdec.engine.goodput import DraftTrimmer
from specdec.types import DraftBlock, VerifyOutcome

STEP_S, GAP_S = 0.0092, 0.0013  # a GPU-like step of 8 rows (weights-bound: rows cost little) and the gap after it


def gpu_trimmer(**kwargs) -> DraftTrimmer:
    trimmer = DraftTrimmer(**kwargs)
    for n in range(1, 41):  # T(n) = 9 ms + 0.02 ms per token fed
        trimmer.cost.observe(n, 0.009 + 0.00002 * n)
    return trimmer


def external(session_id: str, k: int = 4) -> VerifyWork:
    return VerifyWork(session_id, 10, DraftBlock(torch.arange(k)), drafted_elsewhere=True)


class Steps:
    """Batched steps back to back on a simulated clock: plain rows for `plain` sessions in every step,
    and the drafted session's verify every `every` steps (it is away in between), accepting `accepted`."""

    def __init__(self, trimmer: DraftTrimmer, plain=tuple(f"p{i}" for i in range(7))):
        self.trimmer, self.plain, self.now = trimmer, list(plain), 100.0

    def run(self, extra_works=(), extra_results=()) -> list:
        works = [*extra_works, *(DecodeWork(s, 10) for s in self.plain)]
        works = self.trimmer.trim(works)
        results = [*extra_results, *([[1]] * len(self.plain))]
        self.trimmer.observe(works, results, STEP_S, self.now)
        self.now += STEP_S + GAP_S
        return works

    def cycles(self, session_id: str, n: int, every: int, accepted: int, k: int = 4, work=external) -> list:
        kept = []
        for _ in range(n):
            for _ in range(every - 1):
                self.run()
            verify = self.run([work(session_id, k)], [VerifyOutcome(0, k, accepted, 0)])[0]
            kept.append(verify.draft.num_tokens)
        return kept


def test_a_draft_service_session_whose_cycles_lose_to_plain_steps_is_refused_for_a_while():
    # 8 sessions, plain steps every 10.5 ms; a cycle away for 6 steps (63 ms) commits 3 tokens: 48 tokens/s
    # against the 95 a plain stream gets, as the draft service measured on 2 H200s (0.58x of plain).
    trimmer = gpu_trimmer()
    steps = Steps(trimmer)
    kept = steps.cycles("slow", 4, every=6, accepted=2)
    # The first cycle sets the clock; a verdict needs two measured cycles; the next draft is cut to nothing.
    assert kept == [4, 4, 4, 0] and trimmer.cycle_wall.refusals == 1
    # Plain now, and told that no draft would be verified (so its coordinator makes no probe), for 32 of
    # its steps (the first refusal; the verify cut to nothing was one of them).
    first = trimmer.cycle_wall.first_backoff
    assert first == 32
    refused_steps = 1
    while trimmer.cycle_wall.refuses("slow"):
        steps.run([DecodeWork("slow", 10)], [[1]])
        assert trimmer.draft_limits["slow"] == 0
        refused_steps += 1
    assert refused_steps == first
    steps.run([DecodeWork("slow", 10)], [[1]])
    assert trimmer.draft_limits["slow"] > 0  # a probe may come
    # It probes (measured from its last plain step: the switch is part of the cycle), still loses, and
    # is refused twice as long: a probe decides on its one cycle.
    assert steps.cycles("slow", 2, every=6, accepted=2) == [4, 0]
    assert trimmer.cycle_wall.refuses("slow") and trimmer.cycle_wall.refusals == 2
    refused_steps = 1
    while trimmer.cycle_wall.refuses("slow"):
        steps.run([DecodeWork("slow", 10)], [[1]])
        refused_steps += 1
    assert refused_steps == 2 * first


def test_a_refusal_doubles_with_each_losing_probe_up_to_its_cap():
    """Under a steady load that drafting keeps losing to, the probes grow rarer: 32, 64, ... plain steps
    between them, up to max_backoff (1,024: capped at 128, the probes' catch-ups and lost cycles kept a
    draft service's pool below plain decoding at 4 sessions on a CPU; BENCHMARKS.md, round 49)."""
    trimmer = gpu_trimmer()
    steps = Steps(trimmer)
    pricing = trimmer.cycle_wall
    assert pricing.max_backoff == 1024
    assert steps.cycles("slow", 4, every=6, accepted=2) == [4, 4, 4, 0]
    windows = []
    for _ in range(7):
        refused_steps = 1
        while pricing.refuses("slow"):
            steps.run([DecodeWork("slow", 10)], [[1]])
            refused_steps += 1
        windows.append(refused_steps)
        assert steps.cycles("slow", 2, every=6, accepted=2) == [4, 0]  # the probe loses again
    assert windows == [32, 64, 128, 256, 512, 1024, 1024]


def test_new_sessions_start_from_the_latest_verdict():
    """Requests are short: a new session starts refused for as long as the latest refusal, so it does
    not pay the cycles that measure what its neighbours just measured; a verdict that pays clears it."""
    trimmer = gpu_trimmer()
    steps = Steps(trimmer)
    assert steps.cycles("slow", 3, every=6, accepted=2) == [4, 4, 4] and trimmer.cycle_wall.refuses("slow")
    # A new session drafting elsewhere starts from that verdict: its first draft is cut, and it is refused.
    assert steps.cycles("new", 1, every=1, accepted=0) == [0]
    assert trimmer.cycle_wall.refuses("new")
    steps.run([DecodeWork("new", 10)], [[1]])
    assert trimmer.draft_limits["new"] == 0
    # A session that has not drafted (plain decoding, or drafts made inside the target) is not.
    steps.run([DecodeWork("plain-only", 10)], [[1]])
    assert not trimmer.cycle_wall.refuses("plain-only") and trimmer.draft_limits["plain-only"] > 0
    # So is any other new session within the window; once its refusal is over, it probes, and its
    # cycles pay: that clears the verdict, and the next new session drafts at once.
    assert steps.cycles("fast", 1, every=1, accepted=4) == [0]
    while trimmer.cycle_wall.refuses("fast"):
        steps.run([DecodeWork("fast", 10)], [[1]])
    assert steps.cycles("fast", 3, every=2, accepted=4) == [4, 4, 4]
    steps.run([external("newer")], [VerifyOutcome(0, 4, 4, 0)])
    assert not trimmer.cycle_wall.refuses("newer")
    assert steps.cycles("newer", 2, every=2, accepted=4) == [4, 4]


def test_the_latest_refusal_passes_to_new_sessions_for_its_window_of_steps_only():
    """Counted in the target's steps, not the new sessions' own: a refusal longer than a request must
    not pass from each session to the next, with none ever probing (speculation off for good)."""
    trimmer = gpu_trimmer()
    steps = Steps(trimmer)
    first = trimmer.cycle_wall.first_backoff
    assert steps.cycles("slow", 4, every=6, accepted=2) == [4, 4, 4, 0]  # refused for `first` steps
    steps.run([external("early")], [VerifyOutcome(0, 4, 4, 0)])
    assert trimmer.cycle_wall.refuses("early")  # within the window: starts refused for what is left
    for _ in range(first - 1):
        steps.run()
    # The window is over, though "early" never ran a plain step of its refusal: a new session drafts,
    # and its first measured cycle decides; still losing, the refusal doubles.
    assert steps.cycles("late", 2, every=6, accepted=2) == [4, 4]
    assert trimmer.cycle_wall.refuses("late") and trimmer.cycle_wall.refusals == 2
    for _ in range(2 * first - 1):
        steps.run()
    assert steps.cycles("later", 1, every=1, accepted=2) == [0]  # 2 * first steps: still within it
    # The window ended with that step: "later" may probe now, and it probes for the source, so the
    # next new session waits for its answer (sessions of a refused source take turns, below).
    assert not trimmer.cycle_wall.refuses("later")
    assert steps.cycles("latest", 1, every=1, accepted=2) == [0]
    # It pays, for as many cycles as a first verdict takes (one lucky block is not enough): new
    # sessions draft at once.
    assert steps.cycles("later", 1, every=2, accepted=4) == [4]
    assert pricing_refuses_new(trimmer, "waits")
    assert steps.cycles("later", 1, every=2, accepted=4) == [4]
    assert steps.cycles("newest", 1, every=1, accepted=2) == [4]


def test_cycles_that_beat_plain_steps_and_drafts_made_inside_the_target_are_left_alone():
    trimmer = gpu_trimmer()
    steps = Steps(trimmer)
    # Away for 2 steps (21 ms) for 4 tokens: 190 tokens/s against 95.
    assert steps.cycles("fast", 8, every=2, accepted=3) == [4] * 8
    # A draft made inside the target (no round trip) is never priced this way, however slow its cycles.
    inside = steps.cycles("inside", 8, every=6, accepted=0,
                          work=lambda s, k: VerifyWork(s, 10, DraftBlock(torch.arange(k))))
    assert min(inside) > 0
    assert trimmer.cycle_wall.refusals == 0
    # Without cycle pricing (--draft-trimming step) the losing session of the first test is not refused.
    step_only = Steps(gpu_trimmer(price_cycles=False))
    assert step_only.cycles("slow", 8, every=6, accepted=2) == [4] * 8


def test_a_lone_session_is_the_coordinators_call():
    """With no one else active, the step is the session's own: its coordinator's adaptive length
    weighs its cycles (as the goodput trimmer leaves a lone session alone)."""
    trimmer = gpu_trimmer()
    steps = Steps(trimmer, plain=())
    assert steps.cycles("alone", 8, every=6, accepted=2) == [4] * 8
    assert trimmer.cycle_wall.refusals == 0


def test_pricing_measures_wall_time_from_the_previous_result():
    pricing = CycleWallPricing(min_cycles=1)
    plain_step = lambda sessions: 0.010  # noqa: E731 - 10 ms whatever the batch

    def step(t: float, works, results) -> None:
        pricing.observe(works, results, t, t + 0.010, plain_step)

    others = [DecodeWork("o", 1)]
    step(0.0, [external("s"), *others], [VerifyOutcome(0, 4, 3, 0), [1]])  # the first result: sets the clock
    step(0.040, [external("s"), *others], [VerifyOutcome(0, 4, 3, 0), [1]])  # 4 tokens in 40 ms: 100/s
    assert not pricing.refuses("s")  # 100 tokens/s = one per 10 ms plain step (no gap measured: idle)
    step(0.100, [external("s"), *others], [VerifyOutcome(0, 4, 0, 0), [1]])  # 1 token in 60 ms
    assert pricing.refuses("s")
    assert pricing.active_sessions(0.110, 0.06) == 2 and pricing.active_sessions(5.0, 0.06) == 0


def test_each_draft_source_has_its_own_window():
    """A slow draft service's refusal holds back new sessions of that draft service only: StartSession
    names the source (admit), and a session of another source drafts at once."""
    trimmer = gpu_trimmer()
    steps = Steps(trimmer)
    pricing = trimmer.cycle_wall
    pricing.admit("slow", steps.now, source="draft-a:50053")
    assert steps.cycles("slow", 3, every=6, accepted=2) == [4, 4, 4] and pricing.refuses("slow")
    assert pricing.admit("next-a", steps.now, source="draft-a:50053") > 0  # refused from its start
    assert pricing.refuses("next-a")
    assert pricing.admit("next-b", steps.now, source="draft-b:50053") == 0  # another source: drafts
    assert steps.cycles("next-b", 1, every=1, accepted=4) == [4] and not pricing.refuses("next-b")
    # A session whose StartSession named no source shares the unnamed window only.
    assert steps.cycles("unnamed", 1, every=1, accepted=4) == [4]


def pricing_refuses_new(trimmer: DraftTrimmer, session_id: str) -> bool:
    """Whether a new session drafting elsewhere would have its first draft cut now."""
    return trimmer.cycle_wall.refuses(session_id, external(session_id))


def refused_source_with_two_waiting_sessions():
    """A slow session refuses the source; "a" and "b" start inside its window (refused from their start)
    and decode plainly; "a" comes first in every step, so its refusal ends first. Returns the steps and
    the pricing with "a" holding the source's probe and "b" waiting its turn."""
    trimmer = gpu_trimmer()
    steps = Steps(trimmer)
    pricing = trimmer.cycle_wall
    assert steps.cycles("slow", 3, every=6, accepted=2) == [4, 4, 4] and pricing.refuses("slow")
    assert pricing.admit("a", steps.now) > 0 and pricing.admit("b", steps.now) > 0
    steps.plain.append("b")
    while pricing.refuses("a"):
        steps.run([DecodeWork("a", 10)], [[1]])
    assert pricing.refuses("b")  # its refusal ended in the same step, but "a" holds the probe
    steps.run([DecodeWork("a", 10)], [[1]])
    assert trimmer.draft_limits["a"] > 0 and trimmer.draft_limits["b"] == 0
    return steps, pricing


def test_sessions_of_a_refused_source_take_turns_to_probe():
    """One probe answers for all the sessions of a source (the load is the same for them): while it is
    out the others wait, and when it loses they wait out the source's new, doubled window."""
    steps, pricing = refused_source_with_two_waiting_sessions()
    first = pricing.first_backoff
    assert steps.cycles("a", 1, every=6, accepted=2) == [4]  # a probe: decides on its one cycle, and loses
    assert pricing.refuses("a") and pricing.refusals == 2
    waited = 0
    while pricing.refuses("b"):
        steps.run()
        waited += 1
    # "b" waited out the window that "a"'s probe opened (twice the first), not just its turn (16 steps).
    assert waited == 2 * first
    assert pricing.refuses("a")  # "a" ran no plain step since: its own refusal still runs


def test_a_probe_that_pays_drafts_on_passes_the_probe_and_half_the_loads_worth_lift_the_verdict():
    """One session drafting among plain ones says little of all of them drafting (their verify rows
    widen every step): a probe that pays drafts on and hands the probe to the next session at once,
    and only when half the refusal's load in probes have paid in a row, each drafting beside those
    before it, do new sessions draft from their start again."""
    steps, pricing = refused_source_with_two_waiting_sessions()  # refused under a load of 8
    assert steps.cycles("a", 1, every=2, accepted=4) == [4]  # 5 tokens in 2 steps: it pays
    assert pricing.admit("early", steps.now) > 0  # but one cycle may be luck: "a" holds the probe on
    assert steps.cycles("a", 1, every=2, accepted=4) == [4]  # the second cycle confirms it
    assert not pricing.refuses("a")
    for prober in ("c", "d", "e"):  # 4 of a load of 8: "a" and these three
        assert pricing.admit(prober, steps.now) == 0  # the probe is free: it probes from its start
        assert pricing.admit(f"after-{prober}", steps.now) > 0  # the next one waits for its answer
        assert steps.cycles(prober, 3, every=2, accepted=4) == [4, 4, 4]  # the clock, then two that pay
    assert pricing.admit("f", steps.now) == 0 and pricing.admit("g", steps.now) == 0  # lifted: both draft
    # "b", refused while the probes went on, waits out its own turn, then drafts.
    assert pricing.refuses("b")
    while pricing.refuses("b"):
        steps.run()
    assert steps.cycles("b", 1, every=2, accepted=4) == [4]


def test_a_loss_between_paying_probes_starts_the_count_again():
    steps, pricing = refused_source_with_two_waiting_sessions()
    assert steps.cycles("a", 2, every=2, accepted=4) == [4, 4]  # a paying probe: 1 of the 4 needed
    assert pricing.admit("c", steps.now) == 0
    assert steps.cycles("c", 2, every=6, accepted=0) == [4, 4]  # its probe loses: refused, count reset
    assert pricing.refuses("c") and pricing.refusals == 2
    assert pricing.admit("d", steps.now) > 0


def test_a_probe_that_never_answers_passes_the_turn_on():
    """A session granted the probe may end, or its coordinator may not probe: after probe_patience
    steps the next session whose turn ends takes it."""
    steps, pricing = refused_source_with_two_waiting_sessions()
    for _ in range(pricing.probe_patience - 2):  # "a" decodes plainly throughout, without a probe
        steps.run([DecodeWork("a", 10)], [[1]])
        assert pricing.refuses("b")
    steps.run([DecodeWork("a", 10)], [[1]])
    assert not pricing.refuses("b")


def test_a_lone_session_passes_its_turn_on():
    """With no one else active there is no verdict to reach (the coordinator's call): a session that
    holds a refused source's probe and finds itself alone lets the next one probe at once, without
    waiting for patience."""
    steps, pricing = refused_source_with_two_waiting_sessions()  # "a" holds the probe, "b" waits
    alone = Steps(steps.trimmer, plain=())
    alone.now = steps.now + 1.0  # the others have gone quiet
    alone.run([DecodeWork("a", 10)], [[1]])  # its last plain step
    assert alone.cycles("a", 1, every=6, accepted=0) == [4]  # its probe: losing, but alone
    assert pricing.refusals == 1
    steps.now = alone.now + 1.0  # busy again, well within probe_patience of the grant
    steps.run()
    assert pricing.admit("next", steps.now) == 0  # the probe is free: it takes it at once
    assert pricing.admit("after", steps.now) > 0


def test_a_refusal_holds_for_its_load_and_heavier_ones():
    """A verdict is about a load: under a clearly lighter one (fewer than `lighter` x the sessions the
    losing cycle met) a new session drafts at once and holds no probe, and a cycle that pays there
    does not clear the verdict for the heavier load; one that pays under that load does."""
    trimmer = gpu_trimmer()
    steps = Steps(trimmer)  # 8 sessions: the slow one and 7 plain
    pricing = trimmer.cycle_wall
    assert steps.cycles("slow", 3, every=6, accepted=2) == [4, 4, 4] and pricing.refuses("slow")
    assert pricing.admit("heavy", steps.now) > 0  # under the same load: refused from its start
    light = Steps(trimmer, plain=("p0",))
    light.now = steps.now + 1.0  # 2 sessions now: 2 < 0.75 x 8
    assert pricing.admit("light", light.now) == 0
    assert light.cycles("light", 3, every=2, accepted=4) == [4, 4, 4] and not pricing.refuses("light")
    assert pricing.admit("light2", light.now) == 0
    # Back to 8 sessions: the verdict still holds for new sessions there, though "light" paid.
    steps.now = light.now + 1.0
    steps.run()
    assert pricing.admit("heavy2", steps.now) > 0
    # Cycles that pay under the heavier load clear it.
    while pricing.refuses("heavy2"):
        steps.run([DecodeWork("heavy2", 10)], [[1]])
    assert steps.cycles("heavy2", 2, every=2, accepted=4) == [4, 4]
    assert pricing.admit("heavy3", steps.now) == 0


def test_sessions_still_waiting_for_their_prefill_count_as_load():
    """StartSessions queued behind a prefill are the next steps' rows: a cycle that meets few sessions
    with results while many wait to start is priced against the load they will make, so it does not
    clear a refusal made under that load (a burst's head looked light and let every new session draft)."""
    trimmer = gpu_trimmer()
    steps = Steps(trimmer)
    pricing = trimmer.cycle_wall
    assert steps.cycles("slow", 3, every=6, accepted=2) == [4, 4, 4] and pricing.refuses("slow")
    for _ in range(4 * pricing.first_backoff):  # the window ends
        steps.run()
    waiting = 7
    pricing.starting = lambda: waiting
    head = Steps(trimmer, plain=())  # alone so far: the others are queued for their prefill
    head.now = steps.now + 1.0
    assert pricing.admit("first", head.now) == 0  # it probes for the source
    assert pricing.admit("second", head.now) > 0  # and the next waits for its answer
    # Its cycles would pay a lone session, but not a session among 8: the refusal stands and doubles.
    assert head.cycles("first", 2, every=4, accepted=2) == [4, 4]
    assert pricing.refusals == 2 and pricing.admit("third", head.now) > 0
    # Once they have started and gone, a new session here is under a lighter load: it drafts.
    waiting = 0
    assert pricing.admit("fourth", head.now + 1.0) == 0


def test_sessions_prefilled_but_not_stepped_yet_count_as_load():
    """A burst's sessions are prefilled one after another before any of them steps: each one
    admitted must see the ones prefilled before it (no result shows them yet), or the burst's tail
    looks light and drafts against a refusal made under the burst's load."""
    trimmer = gpu_trimmer()
    steps = Steps(trimmer)
    pricing = trimmer.cycle_wall
    assert steps.cycles("slow", 3, every=6, accepted=2) == [4, 4, 4] and pricing.refuses("slow")
    now = steps.now + 1.0  # the 8 sessions have gone; a new burst of 8 is prefilled one by one
    refused = []
    for i in range(8):
        pricing.starting = lambda: 8 - i  # noqa: B023 - this one and those queued behind it
        refused.append(pricing.admit(f"burst-{i}", now) > 0)
        trimmer.session_started(f"burst-{i}", now)
        now += 0.15
    assert all(refused)
    # Once they step, their results show them; a session prefilled long ago that never stepped does not count.
    pricing.starting = lambda: 0
    assert pricing.load(now) == 8
    assert pricing.load(now + 60.0) == 0


def cpu_pool(accepted: int, drafting=("s",)) -> CycleWallPricing:
    """4 sessions on a CPU: a plain step of n tokens costs 34.7 ms + 2.33 ms a token (44 ms for 4 rows),
    and the next starts 2 ms after it. Then every step is held 10 ms for the verifies of the sessions
    `drafting` elsewhere (their round trips), whose 2 drafted tokens each make the step 51 ms."""
    pricing = CycleWallPricing(min_cycles=1)
    plain_step = lambda rows: 0.0347 + 0.00233 * rows  # noqa: E731
    sessions = ["s", "p1", "p2", "p3"]
    end = 0.0
    for _ in range(3):
        start = end + 0.002
        pricing.observe([DecodeWork(s, 1) for s in sessions], [[1]] * 4, start, start + 0.044, plain_step)
        end = start + 0.044
    for _ in range(3):
        start = end + 0.010
        works = [external(s, 2) if s in drafting else DecodeWork(s, 1) for s in sessions]
        results = [VerifyOutcome(0, 2, accepted, 0) if s in drafting else [1] for s in sessions]
        pricing.observe(works, results, start, start + 0.051, plain_step)
        end = start + 0.051
    return pricing


def test_a_cycle_is_charged_what_it_cost_the_other_rows_of_its_step():
    """The other rows waited for the verify and were widened by it: a cycle that commits 2 tokens in
    61 ms would pay its own session (33 tokens/s against plain steps' 22) but costs the other three
    a third of a token each, so the pool gets fewer tokens per second than plain decoding: refused.
    3 tokens a cycle pay for both, and so do 2 when every session drafts (no one waits for another)."""
    assert cpu_pool(accepted=1).refuses("s")
    assert not cpu_pool(accepted=2).refuses("s")
    everyone = ("s", "p1", "p2", "p3")
    assert not any(cpu_pool(accepted=1, drafting=everyone).refuses(s) for s in everyone)


def test_a_refusal_ends_when_its_load_has_gone():
    """Refused among 8 sessions, a session left with one other (a burst's tail, traffic falling) may
    probe at once, rather than decode plainly for the rest of its refusal; among as many as it lost
    under it waits the refusal out (the first test)."""
    trimmer = gpu_trimmer()
    steps = Steps(trimmer)
    pricing = trimmer.cycle_wall
    assert steps.cycles("slow", 4, every=6, accepted=2) == [4, 4, 4, 0] and pricing.refuses("slow")
    tail = Steps(trimmer, plain=("p0",))
    tail.now = steps.now + 1.0  # the other six have ended
    tail.run([DecodeWork("slow", 10)], [[1]])
    assert not pricing.refuses("slow")
    tail.run([DecodeWork("slow", 10)], [[1]])  # its next result says so: drafts would be verified
    assert trimmer.draft_limits["slow"] > 0
