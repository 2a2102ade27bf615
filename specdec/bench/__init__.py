"""`specdec bench`: speed side by side, in one interleaved run on one machine.

    prompts.py         Spec-Bench-format prompt files and selection (categories, limits)
    methods.py         what is measured: plain decoding and this system through the services (gRPC,
                       Redis), plain decoding in process; one RequestResult per request
    hf.py              the peers: Hugging Face greedy, assisted generation (same pair), prompt lookup
    services.py        Redis, target, draft services, coordinators as processes (as `specdec launch`)
    netdelay.py        a network delay between coordinator and services: netns + tc netem, or relays
    delay_proxy.py     the relay process that holds bytes for the delay (netem's fallback)
    netns_exec.py      runs a service inside a network namespace
    timing.py          draft step, target step and verify times measured on the engines in process
    runner.py          setup (models, peers, references, services) and the run
    phases.py          the interleaved schedules: batch 1, concurrency, network delay
    report.py          per method, category and overall: speedup, ideal, efficiency, losslessness, goals
    output.py, plot.py the JSON document, the printed tables, the PNG
    meta.py            machine, commit, model sizes
    gpu.py             model scale: random-weight models of real shapes, the memory-bandwidth floor
    replay_service.py  the draft service with the replay proposer (specdec/proposers/replay.py)

Speed is proven here, never in timed tests (../shared/docs/BENCHMARKS.md).
"""
