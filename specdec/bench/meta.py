"""What a benchmark report must say about where and on what it ran: machine, commit, models."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

from specdec.processes import SOURCE_ROOT


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=SOURCE_ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# The vector extensions that decide a CPU's matrix-product speed. Two hosts that both call themselves
# "AMD EPYC" ran a 5-token verify of the default target at about 1.07x and at 1.74-2.02x a one-token step
# (BENCHMARKS.md, round 44): a CPU report names the family, model and these flags so that runs on
# different hosts are not compared as if they were one machine.
SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_identity(cpuinfo: str) -> dict:
    """Vendor, family, model, stepping and the SIMD_FLAGS present, from /proc/cpuinfo's first CPU."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block is enough: a VM's vCPUs are alike
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    return {"vendor": fields.get("vendor_id"), "family": fields.get("cpu family"), "model": fields.get("model"),
            "stepping": fields.get("stepping"), "simd": [flag for flag in SIMD_FLAGS if flag in flags]}


def _cpu_identity() -> dict | None:
    try:
        return cpu_identity(Path("/proc/cpuinfo").read_text())
    except OSError:
        return None


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def machine() -> dict:
    import torch
    import transformers

    out = {
        "cpu": _cpu_model(), "cpu_identity": _cpu_identity(), "cores": os.cpu_count(), "memory_gib": _memory_gib(),
        "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "specdec_env": specdec_env(os.environ),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if torch.cuda.is_available():
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return out


def specdec_env(environ) -> dict:
    """The SPECDEC_* variables set for the run: switches such as SPECDEC_LINEAR_KERNEL change what the
    services compute with, and the services inherit them from the benchmark."""
    return {key: value for key, value in sorted(environ.items()) if key.startswith("SPECDEC_")}


def commit() -> dict:
    return {"commit": _git("rev-parse", "HEAD"), "branch": _git("rev-parse", "--abbrev-ref", "HEAD"),
            **tree_changes(_git("status", "--porcelain", "--untracked-files=no"))}


def tree_changes(porcelain: str) -> dict:
    """What in the working tree differs from the commit, from `git status --porcelain`: the changed
    files, and the deleted ones apart, those under docs/ only counted (a GPU machine's copy of the tree
    leaves the reports out to fit its transfer limit, and they cannot change a run)."""
    # Split on the status letters, not at column 3: _git strips the output, which eats the first
    # line's leading blank (" M path" became "M path", and its path lost a letter).
    entries = [line.split(maxsplit=1) for line in porcelain.splitlines() if line.strip()]
    deleted = [path for status, path in entries if "D" in status]
    return {"modified_tracked_files": [path for status, path in entries if "D" not in status],
            "deleted_tracked_files": [path for path in deleted if not path.startswith("docs/")],
            "deleted_docs_files": sum(path.startswith("docs/") for path in deleted)}


def model_facts(directory: Path | None) -> dict | None:
    """Parameters (from the safetensors headers, nothing loaded), bytes on disk, architecture."""
    if directory is None:
        return None
    import json

    from safetensors import safe_open

    params = 0
    files = sorted(Path(directory).glob("*.safetensors"))
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                numel = 1
                for dim in f.get_slice(name).get_shape():
                    numel *= dim
                params += numel
    config = json.loads((Path(directory) / "config.json").read_text())
    from specdec.models.registry import sha256_file

    return {"path": str(directory), "parameters": params, "safetensors_bytes": sum(p.stat().st_size for p in files),
            "safetensors_sha256": {p.name: sha256_file(p) for p in files}, "dtype_on_disk": config.get("dtype",
                                                                                             config.get("torch_dtype")),
            "architecture": (config.get("architectures") or [config.get("model_type")])[0],
            "layers": config.get("num_hidden_layers"), "hidden": config.get("hidden_size"),
            "vocab": config.get("vocab_size")}
