"""`specdec canary status|promote|abort|pause|resume`: the canary rollout of speculation, through a
running coordinator's API (docs/CANARY.md). Any coordinator replica answers: the state is in Redis.

    specdec canary status --address coordinator:50051 --tls-ca ca.pem
    specdec canary promote --reason "dashboards look fine" [--to-last-step]
    specdec canary abort --reason "incident 42"
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ACTIONS = ("status", "promote", "abort", "pause", "resume")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "canary", help="show or steer the canary rollout of speculation (coordinator API)",
        description="Show the canary state, windows and decision log, or promote / abort / pause / resume it.",
    )
    parser.add_argument("action", choices=ACTIONS)
    parser.add_argument("--address", default=os.environ.get("SPECDEC_COORDINATOR", "127.0.0.1:50051"))
    parser.add_argument("--reason", default="", help="recorded in the decision log")
    parser.add_argument("--to-last-step", action="store_true", help="promote: go to the last step at once")
    parser.add_argument("--decisions", type=int, default=10, help="status: decisions to show, newest first")
    parser.add_argument("--json", action="store_true", help="print the response as JSON")
    security = parser.add_argument_group("security")
    security.add_argument("--plaintext", action="store_true", help="no TLS (local launcher only)")
    security.add_argument("--tls-ca", help="CA certificate that signed the coordinator's certificate")
    security.add_argument("--tls-cert", help="client certificate (mutual TLS)")
    security.add_argument("--tls-key", help="client key (mutual TLS)")
    security.add_argument("--token-file", help="file holding the bearer token (SPECDEC_TOKEN also works)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf import json_format

    from specdec.client import Client
    from specdec.rpc import coordinator_pb2 as pb

    token = os.environ.get("SPECDEC_TOKEN")
    if args.token_file:
        token = open(args.token_file).read().strip()
    client = Client(args.address, plaintext=args.plaintext, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                    tls_key=args.tls_key, token=token)
    calls = {
        "status": lambda: client.stub.GetCanary(pb.CoordinatorServiceGetCanaryRequest(max_decisions=args.decisions),
                                                timeout=30),
        "promote": lambda: client.stub.PromoteCanary(pb.CoordinatorServicePromoteCanaryRequest(
            reason=args.reason, to_last_step=args.to_last_step), timeout=30),
        "abort": lambda: client.stub.AbortCanary(pb.CoordinatorServiceAbortCanaryRequest(reason=args.reason),
                                                 timeout=30),
        "pause": lambda: client.stub.PauseCanary(pb.CoordinatorServicePauseCanaryRequest(reason=args.reason),
                                                 timeout=30),
        "resume": lambda: client.stub.ResumeCanary(pb.CoordinatorServiceResumeCanaryRequest(reason=args.reason),
                                                   timeout=30),
    }
    try:
        with client:
            response = calls[args.action]()
    except grpc.RpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(json_format.MessageToDict(response, preserving_proto_field_name=True), indent=2))
    else:
        print(describe(response, pb))
    return 0


def describe(response, pb) -> str:
    """The response as a few readable lines."""
    state = response.state
    lines = [f"phase {pb.CanaryPhase.Name(state.phase).removeprefix('CANARY_PHASE_').lower()}"
             f"{' (paused)' if state.paused else ''}  speculative {state.speculative_weight:g}%  "
             f"baseline {state.baseline_weight:g}%  steps {','.join(f'{s:g}' for s in state.steps)}",
             f"last change: {state.reason or '-'}", f"decider: {state.decider or '(none)'}"]
    if not hasattr(response, "windows"):
        return "\n".join(lines)
    if response.last_evaluation:
        lines.append(f"last evaluation: {response.last_evaluation}")
    lines.append(f"{'pool':<12} {'requests':>8} {'errors':>6} {'tpot p50':>9} {'tpot p99':>9} "
                 f"{'ttft p50':>9} {'ttft p99':>9} {'accept':>7}")
    for w in response.windows:
        pool = pb.Pool.Name(w.pool).removeprefix("POOL_").lower()
        lines.append(f"{pool:<12} {w.requests:>8} {w.errors:>6} {_ms(w.tpot_p50_seconds)} {_ms(w.tpot_p99_seconds)} "
                     f"{_ms(w.ttft_p50_seconds)} {_ms(w.ttft_p99_seconds)} {w.acceptance_rate:>7.1%}")
    e = response.equality
    lines.append(f"equality checks: {e.equal} equal, {e.ties} ties, {e.failed} failed, {e.unscored} unscored, "
                 f"{e.errors} replay errors")
    for d in response.decisions:
        action = pb.CanaryAction.Name(d.action).removeprefix("CANARY_ACTION_").lower()
        who = "manual" if d.manual else d.decided_by
        lines.append(f"  {d.time.ToDatetime():%Y-%m-%d %H:%M:%S} {action:<9} {d.from_weight:g}% -> "
                     f"{d.to_weight:g}%  [{who}] {d.reason}")
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:>7.1f}ms"
