"""What the continuous-batching tests share: one intra-op thread, a tiny target, its engines."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.target import TargetEngine
from specdec.models.loader import load_model

CONTEXT = 160  # tokens per KV slot


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared machine spinning threads
    cost many times the work."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from specdec.testing.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("batching") / "target", vocab_size=256, seed=0)


def target_engine(path, slots: int) -> TargetEngine:
    return TargetEngine(load_model(path, backend="native", num_slots=slots, max_context=CONTEXT))
