"""The cycle pricing's verdicts where none was measured yet or several come at once
(specdec.engine.cycle_wall): a draft source never priced stands refused with an empty window once met
under load (one probe, the rest plain), losses within a running window are one verdict, and paid
probes count by session. The simulated steps are test_cycle_wall's."""

from __future__ import annotations

from specdec.engine.batch import DecodeWork
from specdec.types import VerifyOutcome
from test_cycle_wall import Steps, external, gpu_trimmer, refused_source_with_two_waiting_sessions


def fresh_burst(size: int = 8):
    """A target that has served plain sessions only: `size` of them have just ended (they still count
    as load for a few steps) when `size` sessions of one draft source start together (StartSessions
    queued for their prefills), and then step together. Returns the steps (all but s0 decoding
    plainly), the pricing and the plain steps each session was refused for at its start."""
    trimmer = gpu_trimmer()
    pricing = trimmer.cycle_wall
    before = Steps(trimmer, plain=[f"plain-{i}" for i in range(size)])
    for _ in range(3):
        before.run()
    admitted = []
    for i in range(size):  # prefilled one after another
        pricing.starting = lambda: size - i  # noqa: B023 - this one and those queued behind it
        admitted.append(pricing.admit(f"s{i}", before.now, "draft:1"))
        trimmer.session_started(f"s{i}", before.now)
    pricing.starting = lambda: 0
    steps = Steps(trimmer, plain=[f"s{i}" for i in range(1, size)])
    steps.now = before.now
    return steps, pricing, admitted


def test_a_burst_on_a_fresh_target_sends_one_probe_before_any_verdict():
    """A draft source never priced, met under load, stands refused with an empty window: one session of
    the burst probes and the others decode plainly (no draft prefill, no round trips) until its verdict.
    Without it every session of a burst drafted 3-6 cycles before any verdict existed (round 52)."""
    steps, pricing, admitted = fresh_burst()
    assert admitted[0] == 0 and all(wait > 0 for wait in admitted[1:])
    assert pricing.load(steps.now) == 16  # the plain sessions just gone and the burst
    for _ in range(8):
        steps.run()
    assert pricing.load(steps.now) == 8  # the burst alone now, half the load it started under
    assert all(pricing.refuses(f"s{i}") for i in range(1, 8))  # still held: s0 has not answered
    # Its clock, then two cycles that lose, inside probe_patience steps (after that another would probe).
    assert steps.cycles("s0", 3, every=4, accepted=1) == [4, 4, 4]
    assert pricing.refusals == 1 and pricing.refuses("s0")
    assert all(pricing.refuses(f"s{i}") for i in range(1, 8))  # and the others wait out its window


def test_a_fresh_sources_prior_lifts_after_half_the_bursts_worth_of_paid_probes():
    """Where drafting pays under the burst's load, the probes pass from session to session as after a
    refusal, and the prior lifts for new sessions after half the burst's worth (8 sessions: 4, one
    more where a session that left still counts) paid, not after the first: it was made when the burst
    had only begun to arrive, and follows it as it grows."""
    trimmer = gpu_trimmer()
    pricing = trimmer.cycle_wall
    pricing.starting = lambda: 1
    assert pricing.admit("first", 100.0, "draft:1") == 0  # alone: the coordinator's call, no prior
    pricing.starting = lambda: 2
    assert pricing.admit("s0", 100.0, "draft:1") == 0  # two: the prior, and s0 probes
    pricing.starting = lambda: 8
    assert pricing.admit("s1", 100.0, "draft:1") > 0  # eight: its load
    pricing.starting = lambda: 0
    # 8 sessions throughout: the prober drafting, those before it (plain rows here: only their load
    # matters) and plain ones, each prober taking a plain one's place.
    plain = [f"p{i}" for i in range(7)]
    steps = Steps(trimmer, plain=list(plain))
    steps.now = 100.0
    steps.run()
    paid = 0
    for prober in ("s0", "c", "d", "e", "f", "g"):
        if prober != "s0":
            steps.plain.remove(plain.pop())
            assert pricing.admit(prober, steps.now, "draft:1") == 0  # the probe is free: it takes it
        if pricing.admit(f"wait-{prober}", steps.now, "draft:1") == 0:  # lifted: new sessions draft
            break
        assert steps.cycles(prober, 3, every=2, accepted=4) == [4, 4, 4]  # the clock, then two that pay
        steps.plain.append(prober)
        paid += 1
    assert 4 <= paid <= 5 and pricing.refusals == 0


def test_a_lone_session_on_a_fresh_target_drafts_at_once():
    trimmer = gpu_trimmer()
    steps = Steps(trimmer, plain=())
    assert trimmer.cycle_wall.admit("alone", steps.now, "draft:1") == 0
    assert steps.cycles("alone", 3, every=2, accepted=4) == [4, 4, 4]


def test_sessions_that_lose_in_the_same_step_are_one_verdict():
    """Sessions drafting beside each other lose together: the source's refusal is set once, not
    doubled for each (eight in one step on a CPU at 16 sessions made a 1,024-step refusal)."""
    trimmer = gpu_trimmer()
    pricing = trimmer.cycle_wall
    drafters = [f"d{i}" for i in range(4)]
    steps = Steps(trimmer, plain=[f"p{i}" for i in range(4)])
    steps.run([DecodeWork(d, 10) for d in drafters], [[1]] * 4)  # known sessions, drafting from now on
    for _ in range(3):  # a cycle every 4 steps of 1 token: each loses
        for _ in range(3):
            steps.run()
        steps.run([external(d) for d in drafters], [VerifyOutcome(0, 4, 0, 0)] * 4)
    assert pricing.refusals == 4 and all(pricing.refuses(d) for d in drafters)
    assert 0 < pricing.admit("new", steps.now) <= pricing.first_backoff


def test_a_probe_that_drafts_on_counts_once_towards_lifting_the_verdict():
    """Half the load's worth of probes means sessions, each drafting beside those before it: one probe
    paying cycle after cycle is one session's luck, however many cycles it pays."""
    steps, pricing = refused_source_with_two_waiting_sessions()  # refused under a load of 8: 4 needed
    assert steps.cycles("a", 6, every=2, accepted=4) == [4] * 6  # it pays, and drafts on
    assert pricing.admit("c", steps.now) == 0  # the probe is free: the next session takes it
    assert pricing.admit("d", steps.now) > 0  # and the verdict still holds for the one after
