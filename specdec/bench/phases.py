"""The three phases of a run, each interleaved so that a neighbour's load hits every method alike.

Batch 1: per prompt, the methods (and one timing of the engines) run one after another; the order
rotates from prompt to prompt. Concurrency: per level, each service method serves the same
requests with that many sessions in flight; the method order rotates between rounds. Network delay:
the service methods again, batch 1, through a delayed network (netdelay.py), level after level.
"""

from __future__ import annotations

import asyncio
import contextlib

from specdec.bench import target_batches
from specdec.bench.methods import RequestResult

STEP_TIMES = "(engine step times)"


def rotation(names: list[str], index: int) -> list[str]:
    """The base order (shuffled once per run) rotated by `index`."""
    shift = index % len(names)
    return names[shift:] + names[:shift]


async def warm_up(bench, runners: dict) -> None:
    prompt = bench.prompts[0]
    for runner in runners.values():
        await runner.run(prompt, bench.prompt_ids[prompt.question_id], 8)


async def batch1(bench, timer) -> None:
    names = [m for m in bench.methods if m in bench.runners] + [STEP_TIMES]
    bench.rng.shuffle(names)
    for run in range(bench.config.runs):
        for i, prompt in enumerate(bench.prompts):
            ids = bench.prompt_ids[prompt.question_id]
            for slot, name in enumerate(rotation(names, i + run)):
                if name == STEP_TIMES:
                    bench.collected.times.append(timer.measure(prompt.question_id, prompt.category, ids))
                else:
                    result = await bench.runners[name].run(prompt, ids, bench.config.max_new_tokens)
                    result.round, result.order = run, slot
                    bench.collected.results.append(result)
                bench.tick(f"{prompt.category} {name}")


async def concurrency(bench, runners: dict, target=None) -> None:
    """`target`: the target service's process, whose metrics say how full its steps were per method
    and level (target_batches.py; notes["target_batches"])."""
    c = bench.config
    prompts = [bench.prompts[i % len(bench.prompts)] for i in range(c.concurrency_prompts)]
    names = list(runners)
    batches = bench.collected.notes.setdefault("target_batches", {})
    for level in [lv for lv in c.concurrency if lv > 1]:
        for rnd in range(c.concurrency_rounds):
            for name in rotation(names, rnd):
                queue = list(prompts)
                rows: list[RequestResult] = []

                async def client() -> None:
                    while queue:
                        prompt = queue.pop(0)
                        result = await runners[name].run(prompt, bench.prompt_ids[prompt.question_id],
                                                         c.max_new_tokens)
                        result.phase, result.concurrency, result.round = "concurrency", level, rnd
                        rows.append(result)
                        bench.tick(f"c={level} {name}")

                before = await _target_counts(target)
                await asyncio.gather(*(client() for _ in range(level)))
                bench.collected.results.extend(rows)
                after = await _target_counts(target)
                if before is not None and after is not None:
                    target_batches.add_difference(batches.setdefault(str(level), {}).setdefault(name, {}),
                                                  before, after)


async def _target_counts(target) -> dict | None:
    """The target's step counters now (None without a target, or if its metrics did not answer)."""
    if target is None:
        return None
    try:
        return target_batches.snapshot(await asyncio.to_thread(target.metrics))
    except OSError:
        return None


async def netem(bench, stack: contextlib.AsyncExitStack, deployment) -> None:
    """Service methods behind a network delay: netns + tc netem where that works, else delay relays
    in front of the running services (labelled in the report)."""
    from specdec.bench import netdelay
    from specdec.bench.services import Deployment

    c = bench.config
    why = netdelay.probe_netem() if c.netem_mode != "proxy" else "proxy mode requested (--netem-mode proxy)"
    probe = None
    if why is None:
        network = netdelay.NetnsNetwork(bench.log_dir)
        stack.callback(network.close)
        delayed = stack.enter_context(Deployment(bench.service_options(), network).start(bench.proposers()))
        coordinators = delayed.coordinators
    elif c.netem_mode == "netns" and any(c.netem_ms):
        raise RuntimeError(f"--netem-mode netns, but netem does not work here: {why}")
    elif c.netem_mode == "netns":  # zero delay only: the namespaces and veth links without netem
        network = netdelay.NetnsNetwork(bench.log_dir)
        stack.callback(network.close)
        delayed = stack.enter_context(Deployment(bench.service_options(), network).start(bench.proposers()))
        coordinators = delayed.coordinators
    else:
        network = netdelay.ProxyNetwork(bench.log_dir, why)
        stack.callback(network.close)
        coordinators = deployment.add_coordinators(network)
        probe = {"direct": deployment.target.address, "relayed": network.route("target", deployment.target.address)}
    runners = bench.service_methods(coordinators)
    stack.push_async_callback(close_all, runners)
    notes = bench.collected.notes["netem"] = {"network": network.describe(), "levels": {}}
    prompts = bench.prompts[: c.netem_prompts]
    names = list(runners)
    for level in sorted({0.0, *c.netem_ms}):
        network.set_delay(level)
        note = {"configured_delay_ms_each_direction": level}
        if probe:
            rtt = netdelay.measure_round_trip(probe)
            note.update({f"grpc_round_trip_{k}_s": v for k, v in rtt.items()},
                        added_round_trip_ms=1e3 * (rtt["relayed"] - rtt["direct"]))
        notes["levels"][str(level)] = note
        await warm_up(bench, runners)
        for i, prompt in enumerate(prompts):
            for slot, name in enumerate(rotation(names, i)):
                result = await runners[name].run(prompt, bench.prompt_ids[prompt.question_id], c.max_new_tokens)
                result.phase, result.delay_ms, result.order = "netem", level, slot
                bench.collected.results.append(result)
                bench.tick(f"netem {level}ms {name}")


async def close_all(runners: dict) -> None:
    for runner in runners.values():
        await runner.close()
