"""Launched services do not outlive their launcher (specdec.processes.exit_with_parent): a launcher
killed with SIGKILL, as a CI timeout or an interrupted pytest does, takes its services with it instead
of leaving them holding ports and cores."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from service_procs import REPO, tiny_model_dir

LAUNCHER = """
import sys, time
from specdec.processes import launch
service = launch("draft_service", ["--proposer", "ngram", "--tokenizer", sys.argv[1], "--plaintext"])
service.wait_ready(120)
print(service.proc.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie (exited, not yet reaped by init) is gone too
        return stat.read().split(")")[-1].split()[0] != "Z"


def test_a_service_exits_when_its_launcher_is_killed(tmp_path_factory):
    tokenizer = tiny_model_dir(tmp_path_factory.getbasetemp(), "target", seed=0)
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tokenizer)], cwd=REPO, stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    service_pid = None
    try:
        service_pid = int(launcher.stdout.readline())
        assert _alive(service_pid)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        deadline = time.monotonic() + 30
        while _alive(service_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(service_pid), "the service outlived its killed launcher"
    finally:
        launcher.kill()
        if service_pid is not None and _alive(service_pid):
            os.kill(service_pid, signal.SIGKILL)
