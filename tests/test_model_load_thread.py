"""A CPU model loads on a thread of its own (specdec/models/loader.py): the OpenMP team a load starts
ends with that thread, instead of staying beside the model thread's team in a service."""

import os
import subprocess
import sys
import threading

import pytest

from models_helpers import random_tokens, tiny_dir
from specdec.models import loader

TEAM_OUTLIVES_ITS_THREAD = """
import os, sys, time, torch
from specdec.models.loader import on_own_thread
def tasks(): return len(os.listdir("/proc/self/task"))
a = torch.randn(512, 512)
start = tasks()
on_own_thread(lambda: [a @ a for _ in range(20)], "cpu")
for _ in range(200):  # the thread and its team's worker end just after join() returns
    if tasks() == start:
        break
    time.sleep(0.01)
after_own_thread = tasks() - start
[a @ a for _ in range(20)]
print(after_own_thread, tasks() - start)
"""


def test_an_openmp_team_ends_with_the_thread_that_started_it():
    """Products on two threads start a team of one worker; run on a thread of its own, the team is
    gone when it returns, run on this thread it stays (what a load used to leave behind)."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", TEAM_OUTLIVES_ITS_THREAD], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["0", "1"]


def test_on_own_thread_returns_the_result_or_raises_the_error():
    caller = threading.get_ident()
    assert loader.on_own_thread(lambda: threading.get_ident(), "cpu") != caller
    assert loader.on_own_thread(lambda: threading.get_ident(), "cuda") == caller

    def broken():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        loader.on_own_thread(broken, "cpu")


def test_a_cpu_model_loads_on_another_thread_and_serves_on_this_one(tmp_path, monkeypatch):
    loaded_on = []
    real = loader._load
    monkeypatch.setattr(loader, "_load", lambda *args: loaded_on.append(threading.get_ident()) or real(*args))
    model = loader.load_model(tiny_dir(tmp_path, "llama3"), num_slots=2, max_context=64)
    assert loaded_on and loaded_on[0] != threading.get_ident()
    slot = model.allocate()
    assert model.forward([slot], [random_tokens(5)], [1])[0].shape[0] == 1
