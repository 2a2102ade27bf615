"""Compare two benchmark pools in py-spy windows (scripts/gpu_profile_target.sh).

    python scripts/profile_phases.py OUT/profile POOL_A POOL_B [--thread MainThread] [--top 40]

OUT/profile.json is the benchmark's report and OUT/profile-windows/ (unpacked) its windows. A window
belongs to a pool when it lies inside one of that pool's concurrency rounds (from the requests'
send and end times, on the same clock); windows across two pools are left out. Prints each pool's
samples per window by thread, then the functions of one thread whose inclusive samples per window
differ most between the pools (B minus A).
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

WINDOW_S = 3.0


def pool_spans(report: dict) -> dict[tuple[str, int], tuple[float, float]]:
    spans: dict[tuple[str, int], tuple[float, float]] = {}
    for r in report["requests"]:
        if r["phase"] != "concurrency" or r["concurrency"] == 1:
            continue
        start, end = r["start_s"], r["start_s"] + r["e2e_s"]
        low, high = spans.get((r["method"], r["round"]), (start, end))
        spans[(r["method"], r["round"])] = (min(low, start), max(high, end))
    return spans


def frame_name(frame: str) -> str:
    function, _, where = frame.partition(" (")
    return f"{function}@{where.split('/')[-1].split(':')[0]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefix", type=Path, help="OUT/profile: the report is PREFIX.json, windows in PREFIX-windows/")
    parser.add_argument("pool_a")
    parser.add_argument("pool_b")
    parser.add_argument("--thread", default="MainThread", help="thread name prefix (the event loop: MainThread)")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    spans = pool_spans(json.loads(args.prefix.with_suffix(".json").read_text()))
    windows_dir = Path(f"{args.prefix}-windows")
    threads = collections.defaultdict(collections.Counter)
    inclusive = collections.defaultdict(collections.Counter)
    windows = collections.Counter()
    for line in (windows_dir / "windows.txt").read_text().splitlines():
        index, start = line.split()
        start = float(start)
        pools = {pool for (pool, _), (low, high) in spans.items()
                 if low <= start + 0.05 and start + WINDOW_S <= high + 0.3}
        path = windows_dir / f"w{index}.txt"
        if len(pools) != 1 or not path.exists():
            continue
        pool = pools.pop()
        windows[pool] += 1
        for sample in path.read_text().splitlines():
            stack, _, count = sample.rpartition(" ")
            frames = stack.split(";")
            thread = frames[0].split(": ")[-1]
            threads[pool][thread] += int(count)
            if thread.startswith(args.thread):
                for name in {frame_name(f) for f in frames[1:]}:
                    inclusive[pool][name] += int(count)
    for pool in (args.pool_a, args.pool_b):
        if not windows[pool]:
            raise SystemExit(f"no window lies inside pool {pool!r}; pools: {sorted({p for p, _ in spans})}")
        print(f"{pool}: {windows[pool]} windows; samples per window by thread:")
        for thread, count in threads[pool].most_common(6):
            print(f"  {count / windows[pool]:8.1f}  {thread}")
    a, b = args.pool_a, args.pool_b
    rows = sorted(((inclusive[b][f] / windows[b] - inclusive[a][f] / windows[a], f)
                   for f in set(inclusive[a]) | set(inclusive[b])), reverse=True)
    print(f"\n{args.thread}, inclusive samples per window: B - A, A, B (A = {a}, B = {b})")
    for delta, name in rows[:args.top]:
        print(f"  {delta:7.1f} {inclusive[a][name] / windows[a]:7.1f} {inclusive[b][name] / windows[b]:7.1f}  {name}")


if __name__ == "__main__":
    main()
