#!/opt/venv/bin/python
"""Container entry point: make sure the models a service needs are there, then exec the service.

    specdec-entrypoint target_service [flags...]     (also: draft_service, coordinator, registrar, specdec)

Models live under $SPECDEC_HOME (/var/lib/specdec), a mounted volume. A model given as a directory must
exist (mount it); a registry name that is not cached yet is fetched into $SPECDEC_HOME first when
SPECDEC_FETCH_MODELS is on (the image's default), and refused with a clear message when it is off
(air-gapped clusters: pre-fill the volume with `specdec models fetch NAME`). Hugging Face hub ids are
left to the service; with fetching off they resolve from the local cache only (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import logging
import os
import sys

MODULES = {
    "target_service": "target_service", "target": "target_service",
    "draft_service": "draft_service", "draft": "draft_service",
    "coordinator": "coordinator",
    "registrar": "specdec.registrar",
    "specdec": "specdec.cli",
}
DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_DRAFT = "smollm2-135m-draft"  # the services' own defaults (registry.DEFAULT_*; this file imports no torch)
log = logging.getLogger("specdec.entrypoint")


def flag(args: list[str], name: str) -> str | None:
    """The value of `--name X` or `--name=X` (the last one wins, as with argparse)."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def model_refs(module: str, args: list[str]) -> list[str]:
    """The models (or tokenizers) the service will load, as it will resolve its flags."""
    env = os.environ.get
    if module == "target_service":
        return [flag(args, "--model") or env("SPECDEC_TARGET_MODEL") or DEFAULT_TARGET]
    if module == "draft_service":
        refs = [flag(args, "--tokenizer") or env("SPECDEC_DRAFT_TOKENIZER")]
        if (flag(args, "--proposer") or env("SPECDEC_DRAFT_PROPOSER") or "draft-model") == "draft-model":
            refs.append(flag(args, "--model") or env("SPECDEC_DRAFT_MODEL") or DEFAULT_DRAFT)
        return [r for r in refs if r]
    if module == "coordinator":
        return [flag(args, "--tokenizer") or env("SPECDEC_TOKENIZER") or DEFAULT_TARGET]
    return []


def ensure_model(ref: str, fetch: bool) -> str | None:
    """None when `ref` is usable (fetching it if allowed); otherwise what is wrong."""
    from specdec.models.registry import KNOWN_MODELS, fetch_model, resolve_model

    if os.path.isdir(ref):
        return None
    if ref in KNOWN_MODELS:
        try:
            resolve_model(ref, fetch=False)
            return None
        except Exception as exc:  # noqa: BLE001 - not cached (or not shipped): decide below
            if not fetch:
                return f"{exc} (fetching is off: SPECDEC_FETCH_MODELS=0; pre-fill $SPECDEC_HOME or allow it)"
        log.info("fetching %s into %s", ref, os.environ.get("SPECDEC_HOME"))
        fetch_model(ref)
        return None
    if ref.startswith(("/", ".")):
        return f"model directory {ref} does not exist: mount the volume that holds it"
    if not fetch:
        os.environ["HF_HUB_OFFLINE"] = "1"
    return None


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s entrypoint: %(message)s")
    if not argv or argv[0] not in MODULES:
        print(f"usage: specdec-entrypoint {{{','.join(MODULES)}}} [flags...]", file=sys.stderr)
        return 2
    module, args = MODULES[argv[0]], argv[1:]
    fetch = os.environ.get("SPECDEC_FETCH_MODELS", "1").strip().lower() in ("1", "true", "yes", "on")
    if "-h" not in args and "--help" not in args:
        for ref in model_refs(module, args):
            problem = ensure_model(ref, fetch)
            if problem:
                print(f"specdec-entrypoint: {problem}", file=sys.stderr)
                return 3
    os.execv(sys.executable, [sys.executable, "-m", module, *args])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
