"""`specdec launch`: Redis, target, draft and coordinator as processes on this machine.

Plaintext on 127.0.0.1 only: this is the single-machine setup. Production deployments run each
service with TLS (see docs/DEPLOYMENT.md).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger("specdec.launch")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "launch", help="start Redis, draft, target and coordinator locally",
        description="Start a real Redis server, the target and draft services and the coordinator as "
                    "processes on 127.0.0.1; with --prompt, send one prompt, print the answer and stop.",
    )
    parser.add_argument("--target", default="smollm2-135m-instruct", help="registry name or HF directory")
    parser.add_argument("--draft", default=None,
                        help="'ngram', 'none' (plain decoding), a registry name or an HF directory "
                             "(default: the packaged draft if present, else ngram)")
    parser.add_argument("--draft-placement", choices=["service", "target"], default="service",
                        help="service: a draft service of its own (Propose and Verify calls per cycle); target: "
                             "the target drafts inside its decode stream (it hosts the draft model, or looks "
                             "n-grams up), no draft service and no round trip per cycle (DEPLOYMENT.md)")
    parser.add_argument("--redis-url", help="use this Redis instead of starting an embedded one")
    parser.add_argument("--port", type=int, default=50051, help="the coordinator's port")
    parser.add_argument("--backend", choices=["native", "hf", "auto"], default="native")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the target computes every row of a batched step as it would alone: exact output "
                             "in half precision, at a cost (docs/DEPLOYMENT.md)")
    parser.add_argument("--batch-invariant-rows", type=int, metavar="ROWS",
                        help="with --batch-invariant: the rows of its product chunks (default 160 on a GPU, 8 on a CPU)")
    parser.add_argument("--num-draft-tokens", "-k", type=int, default=4)
    parser.add_argument("--pipelining", choices=["on", "off", "auto"], default="auto",
                        help="the coordinator's --pipelining: draft the next block during verification "
                             "(auto: per session, while its blocks are often accepted whole)")
    parser.add_argument("--pipeline-branches", type=int, choices=[1, 2, 3], default=1,
                        help="with --pipelining on: branches per speculative draft (2: + a second bonus guess, "
                             "3: + all but the last token accepted; docs/PIPELINING.md)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="intra-op threads of each model service (default on a CPU: the cores but one, split "
                             "between the target and the draft service, at least 1; OMP_NUM_THREADS, when set, "
                             "wins). Processes that share cores must not each take them all (docs/DEPLOYMENT.md)")
    parser.add_argument("--log-dir", type=Path, help="service logs (default: a temporary folder)")
    parser.add_argument("--prompt", help="send this prompt, print the answer and statistics, then stop")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="for --prompt")
    parser.add_argument("--json", action="store_true", help="with --prompt: print the result as JSON")
    parser.set_defaults(func=run)


def model_args(args: argparse.Namespace) -> list[str]:
    return ["--backend", args.backend, "--device", args.device, "--dtype", args.dtype]


def model_threads(threads: int | None, device: str, model_services: int, cores: int | None,
                  environ=os.environ) -> dict[str, str]:
    """The environment that sets each model service's intra-op threads. Left to torch (all cores) on a
    GPU or where OMP_NUM_THREADS is set. On a CPU every process here shares the cores, and one that takes
    all of them for a step waits whenever the others run: on 2 cores, 2 threads each made plain decoding
    8-10% slower and speculation no faster than 1 each (docs/BENCHMARKS.md, round 46). So one core is left
    to the coordinator, Redis and the event loops, and the rest is split between the model services."""
    if threads is not None:
        return {"OMP_NUM_THREADS": str(threads)}
    if "OMP_NUM_THREADS" in environ or not device.startswith("cpu"):
        return {}
    return {"OMP_NUM_THREADS": str(max(1, ((cores or 1) - 1) // model_services))}


def draft_args(draft: str, args: argparse.Namespace, target_dir: Path) -> list[str] | None:
    if draft == "none":
        return None
    common = ["--host", "127.0.0.1", "--plaintext", "--num-draft-tokens", str(args.num_draft_tokens)]
    if draft == "ngram":
        return common + ["--proposer", "ngram", "--tokenizer", str(target_dir)]
    from specdec.models.registry import resolve_model

    return common + ["--proposer", "draft-model", "--model", str(resolve_model(draft)), *model_args(args)]


def run(args: argparse.Namespace) -> int:
    from specdec.commands.generate import default_draft
    from specdec.models.registry import resolve_model
    from specdec.processes import launch, wait_all
    from specdec.store import EmbeddedRedis

    from specdec.server.service import check_batch_invariant_rows
    from specdec.server.settings import ConfigError

    try:  # before anything starts, as the target service would say it
        check_batch_invariant_rows(args.batch_invariant, args.batch_invariant_rows)
    except ConfigError as exc:
        raise SystemExit(f"specdec launch: {exc}") from None
    if args.threads is not None and args.threads < 1:
        raise SystemExit(f"specdec launch: --threads must be at least 1, got {args.threads}")
    draft = args.draft or default_draft()
    target_dir = resolve_model(args.target)  # fetch once here, with progress, not inside the service
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="specdec-launch-"))
    with contextlib.ExitStack() as stack:
        redis_url, embedded = args.redis_url, None
        if not redis_url:
            embedded = stack.enter_context(EmbeddedRedis())
            redis_url = embedded.url
        log.info("redis at %s; logs in %s", redis_url.split("@")[-1], log_dir)
        inner = args.draft_placement == "target" and draft != "none"
        target_cli = ["--host", "127.0.0.1", "--plaintext", "--model", str(target_dir), *model_args(args)]
        if args.batch_invariant:
            target_cli.append("--batch-invariant")
        if args.batch_invariant_rows is not None:
            target_cli += ["--batch-invariant-rows", str(args.batch_invariant_rows)]
        if inner and draft != "ngram":  # the target hosts the draft model
            target_cli += ["--inner-draft", str(resolve_model(draft))]
        draft_cli = None if inner else draft_args(draft, args, target_dir)
        model_services = 2 if draft_cli is not None and draft != "ngram" else 1  # a draft service with a model
        threads_env = model_threads(args.threads, args.device, model_services, os.cpu_count())
        target = launch("target_service", target_cli, log_dir=log_dir, env=threads_env)
        services = [target]
        draft_proc = launch("draft_service", draft_cli, log_dir=log_dir, env=threads_env) if draft_cli else None
        services += [draft_proc] if draft_proc else []
        stack.callback(stop_logged, list(services))
        wait_all(*services, timeout_s=300)
        coordinator_cli = ["--host", "127.0.0.1", "--plaintext", "--port", str(args.port),
                           "--tokenizer", str(target_dir), "--redis-url", redis_url,
                           "--target", target.address, "--target-plaintext", "--draft-plaintext",
                           "--num-draft-tokens", str(args.num_draft_tokens), "--pipelining", args.pipelining,
                           "--pipeline-branches", str(args.pipeline_branches)]
        if draft_proc:
            coordinator_cli += ["--draft", draft_proc.address]
        elif inner:
            coordinator_cli += ["--draft", "target:ngram" if draft == "ngram" else "target:model"]
        else:
            coordinator_cli += ["--default-pool", "baseline"]
        coordinator = launch("coordinator", coordinator_cli, log_dir=log_dir)
        services.append(coordinator)
        stack.callback(stop_logged, [coordinator])
        wait_all(coordinator, timeout_s=120)
        log.info("coordinator %s | target %s | draft %s (%s)", coordinator.address, target.address,
                 draft_proc.address if draft_proc else "inside the target" if inner else "-", draft)
        if args.prompt is None:
            return wait_for_signal(services, embedded)
        return ask(coordinator.address, args)


def stop_logged(services) -> None:
    """Stop services (the coordinator first, so that its running turns end against live backends), saying
    in the log how long each stage took: a launcher slow to stop shows where it waited."""
    from specdec.processes import stop_all

    started = time.monotonic()
    names = ", ".join(service.module for service in services)
    log.info("stopping %s", names)
    killed = stop_all(*services)
    log.info("%s stopped in %.1f s%s", names, time.monotonic() - started, " (some killed)" if killed else "")


def ask(address: str, args: argparse.Namespace) -> int:
    from specdec.commands.client import run as client_run

    client_args = argparse.Namespace(
        prompt=args.prompt, address=address, session=None, resume_from=None, raw=False, pool=None,
        no_speculation=False, num_draft_tokens=0, plaintext=True, tls_ca=None, tls_cert=None,
        tls_key=None, token_file=None, json=args.json, max_new_tokens=args.max_new_tokens,
        temperature=0.0, top_k=0, top_p=1.0, seed=0, sampling_mode="rejection", stop=[],
    )
    return client_run(client_args)


def wait_for_signal(services, redis=None, poll_s: float = 0.5) -> int:
    """Until Ctrl-C / SIGTERM (-> 0), or until a service or the embedded Redis exits on its own
    (-> 1, naming it and its log; the rest is then stopped instead of serving on half a system)."""
    stopped = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopped.set())
    print("services are running; Ctrl-C stops them", file=sys.stderr)
    while not stopped.wait(poll_s):
        for service in services:
            code = service.proc.poll()
            if code is not None:
                print(f"specdec launch: {service.module} exited (code {code}); its log: {service.log_path}; "
                      "stopping the rest", file=sys.stderr)
                return 1
        if redis is not None and not redis.running:
            print("specdec launch: the embedded redis-server exited; stopping the rest", file=sys.stderr)
            return 1
    return 0
