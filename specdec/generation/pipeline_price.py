"""Whether a session's speculative drafts pay for what they cost the verify beside them.

A pipelined cycle drafts the next block while the target verifies this one. A hit saves the next
cycle its Propose round trip; every speculative draft costs whatever it adds to the verify it runs
beside. Where the draft has hardware of its own that is nearly nothing. Where it shares the target's
(one GPU, two processes: CUDA time-slices them; the same CPU cores), the verify slows by about the
draft's own time: on one H200 a verify with the next block being drafted beside it took twice its
time, and pipelined cycles ran at 0.83x of plain decoding where sequential ones made 1.04x
(docs/BENCHMARKS.md, "Round 36"). The share of blocks accepted whole (pipeline.py's gate) cannot see
that; this price can:

    pipeline while  hit rate x (an ordinary Propose's wall time)  >=  (the verify's wall time with a
                    speculative draft beside it) - (its wall time alone)

each term a moving average over the cycles of the turns that share the price (the coordinator keeps
one per (target, draft) route: where the draft runs is the deployment's, not the turn's). To keep
both verify times current, one cycle in `every` does what the current choice does not (a sequential
cycle while pipelining, a pipelined one while not), one in `first_every` until each side has a few
samples. Pure bookkeeping: the caller times the calls.
"""

from __future__ import annotations

GAIN = 0.1  # weight of the newest cycle in each moving average (about the last 10)
MIN_SAMPLES = 3  # of each side before the price decides anything
FIRST_EVERY = 4  # until then, one cycle in this many samples the other side
EVERY = 16  # afterwards, one cycle in this many


class PipelinePrice:
    def __init__(self, every: int = EVERY, first_every: int = FIRST_EVERY):
        self.every, self.first_every = every, first_every
        self.alone_s: float | None = None  # verify wall, no speculative draft beside it
        self.beside_s: float | None = None  # verify wall with one (until both answered)
        self.propose_s: float | None = None  # an ordinary Propose's wall: what a hit saves
        self.hit_rate = 1.0  # of cycles with a speculative draft; starts hopeful, as the full-accept gate does
        self.samples = {"alone": 0, "beside": 0}
        self.cycles = 0

    def pays(self) -> bool:
        """The price's verdict now (True until both sides have their samples)."""
        if min(self.samples.values()) < MIN_SAMPLES or self.propose_s is None:
            return True
        return self.hit_rate * self.propose_s >= self.beside_s - self.alone_s

    def draft_beside(self) -> bool:
        """Whether this cycle drafts speculatively beside its verify: the verdict, except on the
        sampling cycles, which try the other side."""
        self.cycles += 1
        learning = min(self.samples.values()) < MIN_SAMPLES
        sample = self.cycles % (self.first_every if learning else self.every) == 0
        return self.pays() != sample

    def proposed(self, seconds: float) -> None:
        self.propose_s = _average(self.propose_s, seconds)

    def verified(self, seconds: float, beside: bool, hit: bool | None = None) -> None:
        """A cycle's verify (with its speculative draft, if any: the wall until both came back)."""
        if beside:
            self.beside_s = _average(self.beside_s, seconds)
            self.samples["beside"] += 1
            if hit is not None:
                self.hit_rate += GAIN * (float(hit) - self.hit_rate)
        else:
            self.alone_s = _average(self.alone_s, seconds)
            self.samples["alone"] += 1


def _average(current: float | None, sample: float) -> float:
    return sample if current is None else current + GAIN * (sample - current)
