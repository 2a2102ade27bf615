"""A loaded target's refusals, shared by the sessions one coordinator runs on one target replica.

Under load the target trims drafts by goodput (specdec.engine.goodput): a session whose whole draft
was trimmed switches to plain decoding and probes now and then (DraftLengthPolicy.limit). A session
that starts at such a time learned nothing of it yet: it drafted its warm-up blocks, each one a draft
prefill and a Propose round trip on the same busy machine, for tokens the target then refused. At
4 concurrent sessions on the CPU those first cycles were most of what kept speculation below plain
decoding (docs/BENCHMARKS.md, "Concurrency"). So the sessions share what the target said last: a
session that starts within `hold_s` of a refusal, with no draft verified since, starts as a refused
session does (plain decoding, probes later). Pure bookkeeping; the clock is injectable for tests.
"""

from __future__ import annotations

import time
from typing import Callable


class TargetRefusals:
    def __init__(self, hold_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.hold_s = hold_s
        self._clock = clock
        self._refused_at: float | None = None

    def observe(self, num_proposed: int, num_verified: int) -> None:
        """A draft of num_proposed tokens of which the target verified num_verified."""
        if num_proposed <= 0:
            return
        self._refused_at = self._clock() if num_verified == 0 else None

    def refusing(self) -> bool:
        """The target refused a whole draft within hold_s, and verified none since."""
        return self._refused_at is not None and self._clock() - self._refused_at < self.hold_s
