"""Test helpers for services as subprocesses: the package's process helpers plus tiny models."""

from __future__ import annotations

import os
from pathlib import Path

from specdec import processes
from specdec.processes import (  # noqa: F401  (re-exported for the tests)
    SOURCE_ROOT as REPO,
    ServiceProcess,
    stop_all,
    wait_all,
)

# One intra-op thread, the target's forwards included (SPECDEC_WIDE_STEP_THREADS=0): tiny test models
# gain nothing from more, several services share the cores, and a forward spread over every core
# delays the service's own event loop (a call sent 20 ms before a SIGTERM was not yet accepted).
# tests/test_launch_client.py and tests/test_bench.py run the default. No trace export from the
# children unless a test asks for it.
TEST_ENV = {"OTEL_TRACES_EXPORTER": "none", "OMP_NUM_THREADS": "1", "SPECDEC_WIDE_STEP_THREADS": "0"}


def launch(module: str, args: list[str], *, env: dict[str, str] | None = None, **kwargs) -> ServiceProcess:
    return processes.launch(module, args, env={**TEST_ENV, **(env or {})}, cwd=REPO, **kwargs)


def start_service(module: str, args: list[str], *, timeout_s: float = 90.0, **kwargs) -> ServiceProcess:
    return launch(module, args, **kwargs).wait_ready(timeout_s)


def tiny_model_dir(base: Path, name: str, seed: int, vocab_size: int = 256) -> Path:
    """A tiny random model (with the tiny tokenizer) under `base`, made once per test session:
    pass tmp_path_factory.getbasetemp() so every test module shares it."""
    from specdec.testing.tiny_models import make_tiny_model

    path = Path(base) / "tiny-models" / name
    if not (path / "config.json").is_file():
        tmp = path.with_name(f".{name}.{os.getpid()}")
        make_tiny_model(tmp, variant="llama", vocab_size=vocab_size, seed=seed)
        tmp.rename(path)
    return path


def start_launcher(args: list[str], log_path: Path, timeout_s: float = 300.0, env: dict | None = None):
    """`specdec launch ARGS` in the background, as a user runs it, with `env` added to the
    environment its services inherit. Returns (process, coordinator address read from its log);
    stop it with SIGINT."""
    import subprocess
    import sys
    import time

    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "launch", "--port", "0", *args],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    deadline = time.monotonic() + timeout_s
    while True:
        text = log_path.read_text()
        if "coordinator " in text and " | target" in text:
            return proc, text.split("coordinator ", 1)[1].split(" |", 1)[0]
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"specdec launch did not come up:\n{text[-3000:]}")
        time.sleep(0.2)


def stop_launcher(proc, log_path: Path, timeout_s: float = 90.0) -> int:
    """Ctrl-C a launcher from start_launcher; returns its exit code. One that has not exited in timeout_s
    (its own bound: 20 s for the coordinator, 20 s for the model services, 5 s for Redis) is killed, and
    the failure shows its log and the tail of each service's log, to say which one held it."""
    import signal
    import subprocess

    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    text = log_path.read_text()
    report = [f"specdec launch did not exit within {timeout_s:.0f} s of SIGINT:\n{text[-3000:]}"]
    if "logs in " in text:
        for service_log in sorted(Path(text.split("logs in ", 1)[1].split()[0]).glob("*.log")):
            report.append(f"--- {service_log.name}:\n{service_log.read_text()[-1500:]}")
    raise AssertionError("\n".join(report))
