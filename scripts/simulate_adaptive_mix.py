"""The adaptive draft length against fixed lengths on a mix of turns, each with its own acceptance
rate, at two GPUs' costs (tests/test_switch_off.py: simulate_turns), with an oracle that picks each
turn's best of plain decoding and k = 2, 3, 4. The mix is the benchmark's: `--replay-alpha 0.75
--replay-alpha-spread 0.25` over 12 prompts in the order of `--replay-seed` (replay.reference_alphas).

    python scripts/simulate_adaptive_mix.py --seeds 0,1,2,3 --warm-up

--warm-up: first a short turn that accepts nothing, as the benchmark's warm-up request (a prompt the
replay draft has no reference for). Numbers: docs/BENCHMARKS.md, "Round 27".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_switch_off import simulate_turns  # noqa: E402

from specdec.generation.adaptive import DraftLengthPolicy  # noqa: E402
from specdec.proposers.replay import reference_alphas  # noqa: E402

POLICIES = {
    "plain": lambda: DraftLengthPolicy(0, 0, adapt=False),
    "k2": lambda: DraftLengthPolicy(2, 2, adapt=False),
    "k3": lambda: DraftLengthPolicy(3, 3, adapt=False),
    "k4": lambda: DraftLengthPolicy(4, 4, adapt=False),
    "adaptive": lambda: DraftLengthPolicy(4, 8, confidence_stop=False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2,3", help="replay seeds (each a mix order)")
    parser.add_argument("--alpha", type=float, default=0.75)
    parser.add_argument("--spread", type=float, default=0.25)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=6, help="simulations per mix (noise seeds)")
    parser.add_argument("--warm-up", action="store_true", help="a first short turn that accepts nothing")
    args = parser.parse_args()
    for seed in (int(s) for s in args.seeds.split(",")):
        alphas = reference_alphas(args.prompts, args.alpha, args.spread, seed)
        turns = ([0.0] if args.warm_up else []) + alphas
        seconds = {}
        for name, make in POLICIES.items():
            runs = [simulate_turns(make, turns, seed=r, first_turn_tokens=16 if args.warm_up else None)
                    for r in range(args.repeats)]
            seconds[name] = np.mean([[s for _, s in run[len(turns) - len(alphas):]] for run in runs], axis=0)
        oracle = np.min([seconds[n] for n in ("plain", "k2", "k3", "k4")], axis=0)
        totals = "  ".join(f"{name} {times.sum() * 1000:.0f}" for name, times in seconds.items())
        print(f"seed {seed}: ms  {totals}  oracle {oracle.sum() * 1000:.0f}  "
              f"adaptive/oracle {seconds['adaptive'].sum() / oracle.sum():.3f}  "
              f"adaptive/best fixed {seconds['adaptive'].sum() / min(seconds[n].sum() for n in ('k2', 'k3', 'k4')):.3f}")


if __name__ == "__main__":
    main()
