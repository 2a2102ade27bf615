"""Intra-op threads per forward on a CPU: the target's forwards on more cores than the process's own.

On a host whose cores the target shares with a draft service, a coordinator and Redis, each model
service runs on a slice of the cores (`specdec launch` gives each one thread on two cores), so that the
draft's steps and the target's do not fight over them. But the target's forwards are the one part of
a cycle the rest waits for: while the target verifies, the draft service is idle (sequential cycles)
and so is a coordinator waiting for the result. Run on every core with oneDNN's products, they take
1.1-1.3x less time on the two-core host of docs/BENCHMARKS.md (round 47: a 5-token verify 21 against
26 ms, a 16-session decode step 41 against 52); in the running system every method, plain decoding
included, made 13-27% more tokens per second. So a forward of at least `wide_from_tokens` tokens runs on
`wide` threads, the others on `narrow` (the threads the process started with, which a hosted draft's
forwards keep), and the count is put back after each forward: every forward on the model thread sets
what it needs.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from specdec.errors import InvalidArgument

# Every forward of the target by default. From two or three tokens on, only verifies and batched steps
# would go wide: speculation ran as fast, but plain decoding 14-17% slower (round 47).
DEFAULT_WIDE_FROM_TOKENS = 1


@dataclass(frozen=True)
class StepThreads:
    """narrow: threads for steps under wide_from_tokens tokens; wide: for the others."""

    narrow: int
    wide: int
    wide_from_tokens: int = DEFAULT_WIDE_FROM_TOKENS

    def __post_init__(self):
        if self.narrow < 1 or self.wide < 1 or self.wide_from_tokens < 1:
            raise InvalidArgument(f"step threads need narrow >= 1, wide >= 1 and wide_from_tokens >= 1, got "
                                  f"{self.narrow}, {self.wide}, {self.wide_from_tokens}")

    def for_tokens(self, tokens: int) -> int:
        return self.wide if tokens >= self.wide_from_tokens else self.narrow


@contextlib.contextmanager
def threads_for(policy: StepThreads | None, tokens: int) -> Iterator[None]:
    """Run the body on the policy's threads for a forward of `tokens` tokens, then restore the count."""
    if policy is None:
        yield
        return
    before, wanted = torch.get_num_threads(), policy.for_tokens(tokens)
    if wanted != before:
        torch.set_num_threads(wanted)
    try:
        yield
    finally:
        if wanted != before:
            torch.set_num_threads(before)


def usable_cores() -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota (a container's
    limit), so that "all cores" inside a pod means its limit, not the node's."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def policy_for(device: str, wide_threads: int | None, wide_from_tokens: int = DEFAULT_WIDE_FROM_TOKENS,
               batch_invariant: bool = False) -> StepThreads | None:
    """The policy of a model on `device`, narrow being the calling thread's count now: wide_threads None
    means every usable core, 0 means off (every step on the process's threads). None (no policy) off a
    CPU, for a batch-invariant model (which keeps its threads), or where wide would not exceed narrow."""
    if wide_threads is not None and wide_threads < 0:
        raise InvalidArgument(f"wide-step threads must be >= 0 (0: off), got {wide_threads}")
    if not device.startswith("cpu") or wide_threads == 0 or batch_invariant:
        return None
    narrow = torch.get_num_threads()
    wide = usable_cores() if wide_threads is None else wide_threads
    if wide <= narrow:
        return None
    return StepThreads(narrow, wide, wide_from_tokens)
