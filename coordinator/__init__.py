"""The coordinator: the public CoordinatorService.

It runs the speculative loop (specdec.generation.loop) per session against draft and target replicas
over gRPC, records every committed token in Redis before streaming it, and keeps nothing else, so
any coordinator replica can continue or resume any session.

    main.py       flags -> CoordinatorSettings (settings.py), assembly, serving, graceful shutdown
    servicer.py   protobuf <-> domain (convert.py), nothing else
    requests.py   a Generate request as the coordinator sees it, validated
    prompts.py    prompt / chat turn -> token ids with the target's tokenizer
    sessions.py   session lifecycle: Generate (new session, next turn, resume), Cancel, End, Get
    claims.py     the one fenced Redis write that makes a stream the owner of a turn
    state.py      what a session's Redis record holds beyond the store's fields
    turn.py       one turn: first token, the loop, the final state
    stream.py     a turn's messages: replay, record-before-stream, text
    recorder.py   the turn's fenced, pipelined writes to Redis
    failover.py   the session's target and draft, rebuilt on another replica when one is lost
    routing.py    replica choice (flags or Redis registry), one client per endpoint
    telemetry.py  request and cycle spans, Prometheus metrics
"""
