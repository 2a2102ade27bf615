"""Sampling parameters of one request, validated once at the edge."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from specdec.errors import InvalidArgument


# Sampled temperatures: near 0 the distribution is already greedy's (use 0), past 1e4 already uniform.
MIN_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 1e4


class SamplingMode(enum.Enum):
    """How sampled (temperature > 0) requests are verified.

    REJECTION: Leviathan et al. / Chen et al. rejection sampling; same distribution as plain decoding.
    GUMBEL: Gumbel-max coupling; draft and target share each position's Gumbel noise, so the output is
    token for token what plain decoding with the same seed produces (testable, canary-checkable).
    """

    REJECTION = "rejection"
    GUMBEL = "gumbel"


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k truncation
    top_p: float = 1.0  # 1.0 means no nucleus truncation
    seed: int = 0
    mode: SamplingMode = SamplingMode.REJECTION

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> "SamplingParams":
        # Also rejects NaN. The logits are scaled in float32 (warp.py): a tiny temperature overflows them
        # to inf and softmax gives NaN (1e-300 rounds to 0 in float32), one beyond float32's range (1e300,
        # inf) turns a masked -inf into NaN. The range keeps far from both.
        if not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            raise InvalidArgument(f"temperature must be >= 0 and finite: 0 (greedy) or in [{MIN_TEMPERATURE:g}, "
                                  f"{MAX_TEMPERATURE:g}], got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 (0 = disabled), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1] (1 = disabled), got {self.top_p}")
        if not 0 <= self.seed < 2**63:
            raise InvalidArgument(f"seed must be in [0, 2**63), got {self.seed}")
        return self
