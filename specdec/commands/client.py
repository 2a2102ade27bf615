"""`specdec client`: send a prompt to a running coordinator and stream the answer with its stats."""

from __future__ import annotations

import argparse
import json
import os
import sys

from specdec.commands.generate import add_sampling_arguments


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "client", help="stream an answer from a running coordinator",
        description="Send a prompt (or continue / resume a session) and stream the answer.",
    )
    parser.add_argument("prompt", nargs="?", help="the user's message (omit with --resume-from)")
    parser.add_argument("--address", default=os.environ.get("SPECDEC_COORDINATOR", "127.0.0.1:50051"))
    parser.add_argument("--session", help="continue this session (a new turn), or resume it")
    parser.add_argument("--resume-from", type=int, help="resume a broken stream after this position")
    parser.add_argument("--raw", action="store_true", help="no chat template")
    parser.add_argument("--pool", choices=["baseline", "speculative"], help="force a pool (debugging)")
    parser.add_argument("--no-speculation", action="store_true", help="plain decoding for this request")
    parser.add_argument("--num-draft-tokens", "-k", type=int, default=0, help="0 = the coordinator's choice")
    security = parser.add_argument_group("security")
    security.add_argument("--plaintext", action="store_true", help="no TLS (local launcher only)")
    security.add_argument("--tls-ca", help="CA certificate that signed the coordinator's certificate")
    security.add_argument("--tls-cert", help="client certificate (mutual TLS)")
    security.add_argument("--tls-key", help="client key (mutual TLS)")
    security.add_argument("--token-file", help="file holding the bearer token (SPECDEC_TOKEN also works)")
    parser.add_argument("--json", action="store_true", help="print the whole result as JSON at the end")
    add_sampling_arguments(parser)
    parser.set_defaults(func=run, max_new_tokens=None)


def run(args: argparse.Namespace) -> int:
    import grpc

    from specdec.client import Client

    if args.prompt is None and args.resume_from is None:
        print("a prompt is required unless --resume-from is given", file=sys.stderr)
        return 2
    token = os.environ.get("SPECDEC_TOKEN")
    if args.token_file:
        token = open(args.token_file).read().strip()
    client = Client(args.address, plaintext=args.plaintext, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                    tls_key=args.tls_key, token=token)
    request = dict(session_id=args.session, resume_from=args.resume_from, raw=args.raw,
                   temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                   sampling_mode=args.sampling_mode, max_new_tokens=args.max_new_tokens, stop=args.stop,
                   pool=args.pool, speculate=False if args.no_speculation else None,
                   num_draft_tokens=args.num_draft_tokens)
    chunks = []
    try:
        with client:
            for chunk in client.stream(args.prompt, **request):
                chunks.append(chunk)
                if not args.json:
                    print(chunk.text, end="", flush=True)
    except grpc.RpcError as err:
        print(f"\nerror: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    last = chunks[-1] if chunks else None
    if args.json:
        from specdec.client import collect

        print(json.dumps(collect(chunks).__dict__, indent=2))
    elif last is not None:
        print("\n", file=sys.stderr)
        print(f"session {last.session_id}  position {last.position}  finish {last.finish_reason}", file=sys.stderr)
        print(f"usage {json.dumps(last.usage)}", file=sys.stderr)
        print(f"stats {json.dumps(last.stats)}", file=sys.stderr)
    return 0
