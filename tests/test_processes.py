"""Launched services do not outlive their launcher (specdec.processes.exit_with_parent): a launcher
killed with SIGKILL, as a CI timeout or an interrupted pytest does, takes its services with it instead
of leaving them holding ports and cores."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def test_stop_all_kills_what_ignores_sigterm_at_one_deadline(tmp_path):
    """Three services that hang on their way out cost one timeout, not three, and each one killed is
    named with its log."""
    from specdec.processes import ServiceProcess, stop_all

    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('up', flush=True); time.sleep(600)")
    procs = []
    for name in ("coordinator", "target_service", "draft_service"):
        proc = subprocess.Popen([sys.executable, "-c", stubborn], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "up\n"  # SIGTERM is ignored from here on
        procs.append(ServiceProcess(name, proc, tmp_path / f"{name}.log", tmp_path / f"{name}.ready.json"))
    try:
        started = time.monotonic()
        killed = stop_all(*procs, timeout_s=1.0)
        assert time.monotonic() - started < 2.5
        assert all(proc.proc.returncode == -signal.SIGKILL for proc in procs)
        assert [line.split()[0] for line in killed] == ["coordinator", "target_service", "draft_service"]
        assert all(f"{proc.log_path}" in line for proc, line in zip(procs, killed))
    finally:
        for proc in procs:
            proc.proc.kill()


def test_stop_all_returns_at_once_for_services_that_stop():
    from specdec.processes import ServiceProcess, stop_all

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    service = ServiceProcess("draft_service", proc, Path("unused.log"), Path("unused.ready.json"))
    started = time.monotonic()
    assert stop_all(service, timeout_s=30.0) == [] and proc.returncode == -signal.SIGTERM
    assert time.monotonic() - started < 5.0
