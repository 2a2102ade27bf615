"""Trace the adaptive draft length's verdicts on Spec-Bench prompts, through the real services.

    python scripts/trace_adaptive_policy.py --prompts ../shared/data/specbench/dev.jsonl --ids 81,91 \
        [--draft smollm2-135m-draft] [--max-new-tokens 128] [--feed-draft-every 0]

Starts a target service and a draft service in their own processes (one torch thread each, as the
CPU benchmarks run them) and runs the coordinator's loop (SpeculativeLoop over the gRPC clients, cycle
calls as stream messages) in this process, so the costs the policy sees are the distributed system's
(the coordinator's own ~1 ms a cycle aside). Prints each turn's seconds, cycles and plain steps, then
every cycle and plain step as the policy observed it: the cycle's draft length, accepted tokens,
model and overhead milliseconds, and after it the policy's length, acceptance estimate, plain
decoding's price, the best length by the point and the optimistic estimates (milliseconds a token),
and the wait before the next probe. BENCHMARKS.md, round 25, traces the writing turn with it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", required=True, help="Spec-Bench-format JSONL")
    parser.add_argument("--ids", required=True, help="comma-separated question ids")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default="smollm2-135m-draft")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--feed-draft-every", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, default=Path("trace-logs"))
    args = parser.parse_args()

    from specdec import processes
    from specdec.generation import adaptive
    from specdec.models.registry import resolve_model
    from specdec.models.tokenizer import load_tokenizer

    target_dir, draft_dir = resolve_model(args.target), resolve_model(args.draft)
    rows = {str(r["question_id"]): r for r in map(json.loads, open(args.prompts))}
    events: list[str] = []
    observe_cycle, observe_plain = adaptive.DraftLengthPolicy.observe_cycle, adaptive.DraftLengthPolicy.observe_plain

    def traced_cycle(policy, k, accepted, draft_s, verify_s, overhead_s=0.0, *rest, **kwargs):
        observe_cycle(policy, k, accepted, draft_s, verify_s, overhead_s, *rest, **kwargs)
        line = (f"cycle k={k} accepted={accepted} draft={draft_s * 1e3:.1f} verify={verify_s * 1e3:.1f} "
                f"overhead={overhead_s * 1e3:.1f} steady={kwargs.get('steady', True)} -> k={policy._current} "
                f"acceptance={policy.acceptance:.2f}")
        plain = policy._plain_cost()
        if plain and policy._draft_s:
            point_k, point = policy._best(0.0, bonus=0.0)
            hopeful_k, hopeful = policy._best(0.0, bonus=policy._optimism())
            line += (f" plain={plain * 1e3:.1f} best={point_k}@{1e3 / point:.1f} optimistic={hopeful_k}@"
                     f"{1e3 / hopeful:.1f} wait={policy._probe_interval}")
        events.append(line)

    def traced_plain(policy, step_s, overhead_s=0.0, *rest, **kwargs):
        observe_plain(policy, step_s, overhead_s, *rest, **kwargs)
        events.append(f"plain {step_s * 1e3:.1f}+{overhead_s * 1e3:.1f} opened={kwargs.get('opened_run', False)} "
                      f"-> k={policy._current}")

    adaptive.DraftLengthPolicy.observe_cycle, adaptive.DraftLengthPolicy.observe_plain = traced_cycle, traced_plain
    env = {"OMP_NUM_THREADS": "1"}
    target = processes.launch("target_service", ["--plaintext", "--model", str(target_dir), "--num-slots", "4"],
                              log_dir=args.log_dir, env=env)
    draft = processes.launch("draft_service", ["--plaintext", "--proposer", "draft-model", "--model", str(draft_dir),
                                               "--num-slots", "4"], log_dir=args.log_dir, env=env)
    processes.wait_all(target, draft)
    try:
        asyncio.run(_turns(args, load_tokenizer(target_dir), rows, target.address, draft.address))
    finally:
        processes.stop_all(target, draft)
    print("\n".join(events))


async def _turns(args, tokenizer, rows, target_address: str, draft_address: str) -> None:
    from draft_service.client import connect as connect_draft
    from specdec.generation.loop import SpeculativeLoop, start_generation
    from specdec.generation.session import LoopSettings
    from specdec.generation.stopping import StopChecker
    from specdec.sampling.params import SamplingParams
    from specdec.server.settings import ClientSettings
    from target_service.client import connect as connect_target

    async def ignore(tokens):
        pass

    settings = ClientSettings(plaintext=True, timeout_s=60.0, cycle_calls="stream")
    async with connect_target(target_address, settings) as target, connect_draft(draft_address, settings) as draft:
        for qid in args.ids.split(","):
            encoded = tokenizer.apply_chat_template([{"role": "user", "content": rows[qid]["turns"][0]}],
                                                    add_generation_prompt=True)
            prompt = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
            session_id, started = uuid.uuid4().hex, time.perf_counter()
            cursor, _ = await start_generation(target, session_id, prompt, SamplingParams(), drafts_elsewhere=True,
                                               draft_source=draft_address)
            loop = SpeculativeLoop(target, draft, LoopSettings(num_draft_tokens=4, adaptive=True,
                                                               feed_draft_every=args.feed_draft_every))
            result = await loop.run(cursor, StopChecker(args.max_new_tokens - 1, ()), ignore)
            print(f"question {qid}: {time.perf_counter() - started:.2f} s, {result.stats.cycles} cycles, "
                  f"{result.stats.decode_steps} plain steps")
            await target.end_session(session_id)
            await draft.end_session(session_id)


if __name__ == "__main__":
    main()
