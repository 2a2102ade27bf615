"""`specdec ray up`: draft and target as Ray actors on two GPU nodes, a coordinator in front (Ctrl-C stops).

See specdec/ray_launcher.py for the placement and docs/DEPLOYMENT.md for Ray's security model.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading

log = logging.getLogger("specdec.ray")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "ray", help="run draft, target and coordinator on a Ray cluster",
        description="Start the target and draft services as Ray actors on two different GPU nodes (a "
                    "STRICT_SPREAD placement group), publish their endpoints in Redis and start the "
                    "coordinator against them. Ray's control plane is unauthenticated and uses pickles: "
                    "private networks only.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = actions.add_parser("up", help="start everything and wait (Ctrl-C drains and stops)")
    up.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    up.add_argument("--redis-url", default=os.environ.get("SPECDEC_REDIS_URL"),
                    required="SPECDEC_REDIS_URL" not in os.environ,
                    help="Redis reachable from every node (redis:// or rediss://, password in the URL; "
                         "better in SPECDEC_REDIS_URL, which `ps` does not show)")
    up.add_argument("--redis-prefix", default="specdec")
    up.add_argument("--target", default="smollm2-135m-instruct", help="target model: registry name or directory")
    up.add_argument("--draft", default="ngram",
                    help="'ngram' or a draft model (registry name or directory present on the draft node)")
    up.add_argument("--device", default="cuda")
    up.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    up.add_argument("--num-gpus", type=float, default=1.0, help="GPUs per model replica")
    up.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per model replica")
    up.add_argument("--baseline-targets", type=int, default=0, help="plain-decoding target replicas (pool baseline)")
    up.add_argument("--port", type=int, default=50051, help="the coordinator's port")
    up.add_argument("--plaintext", action="store_true", help="no TLS anywhere (a private network only)")
    up.add_argument("--tls-cert", help="server certificate (same path on every node)")
    up.add_argument("--tls-key", help="its key")
    up.add_argument("--tls-ca", help="CA the coordinator verifies the model services with")
    up.add_argument("--tls-server-name", help="name in the model services' certificate (they are dialled by IP)")
    for name in ("target", "draft", "coordinator"):
        up.add_argument(f"--{name}-arg", action="append", default=[], metavar="FLAG",
                        help=f"extra flag for the {name} (repeatable; e.g. --{name}-arg=--num-slots=16)")
    up.add_argument("--json", action="store_true", help="print the endpoints as JSON once ready")
    parser.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace):
    from specdec.ray_launcher import RayLaunchSettings

    if not args.plaintext and not (args.tls_cert and args.tls_key):
        raise SystemExit("pass --tls-cert and --tls-key (files present on every node), or --plaintext")
    model = ["--device", args.device, "--dtype", args.dtype]
    tls = [] if args.plaintext else ["--tls-cert", args.tls_cert, "--tls-key", args.tls_key]
    target = ["--model", args.target, *model, *tls, *args.target_arg]
    if args.draft == "ngram":
        draft = ["--proposer", "ngram", "--tokenizer", args.target, *tls, *args.draft_arg]
    else:
        draft = ["--proposer", "draft-model", "--model", args.draft, *model, *tls, *args.draft_arg]
    coordinator = ["--tokenizer", args.target, *tls]
    for side in ("target", "draft"):
        if args.tls_ca:
            coordinator += [f"--{side}-tls-ca", args.tls_ca]
        if args.tls_server_name:
            coordinator += [f"--{side}-tls-server-name", args.tls_server_name]
    return RayLaunchSettings(
        redis_url=args.redis_url, redis_prefix=args.redis_prefix, target_args=tuple(target),
        draft_args=tuple(draft), coordinator_args=(*coordinator, *args.coordinator_arg),
        plaintext=args.plaintext, coordinator_port=args.port, num_gpus=args.num_gpus, num_cpus=args.num_cpus,
        baseline_targets=args.baseline_targets,
    )


def run(args: argparse.Namespace) -> int:
    try:
        import ray
    except ImportError:
        print("Ray is not installed: pip install 'specdec[ray]'", file=sys.stderr)
        return 2
    from specdec.ray_launcher import launch

    settings = settings_from_args(args)
    ray.init(address=args.address, logging_level=logging.WARNING)
    deployment = launch(settings)
    try:
        summary = {"coordinator": deployment.coordinator["endpoint"],
                   "targets": [(t["endpoint"], t["pool"], t["node_ip"]) for t in deployment.targets],
                   "drafts": [(d["endpoint"], d["pool"], d["node_ip"]) for d in deployment.drafts]}
        print(json.dumps(summary) if args.json else "\n".join(f"{k}: {v}" for k, v in summary.items()), flush=True)
        stopped = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stopped.set())
        stopped.wait()
    finally:
        deployment.shutdown()
    return 0
