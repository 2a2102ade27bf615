"""Wide forwards on more intra-op threads (specdec.models.step_threads): the rule, the model's use of it
(each forward on the count its tokens call for, the process's count put back after), its results, and
the target service's flags."""

from __future__ import annotations

import argparse

import pytest
import torch

from specdec.errors import InvalidArgument
from specdec.models.llama import LlamaModel
from specdec.models.step_threads import StepThreads, policy_for, threads_for, usable_cores
from specdec.server.settings import ConfigError
from target_service.main import TargetServiceSettings, add_arguments, parse_wide_step_threads, settings_from_args
from tests.models_helpers import random_tokens, relative_error, tiny_dir


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_rule_and_its_bounds():
    policy = StepThreads(narrow=1, wide=3, wide_from_tokens=4)
    assert [policy.for_tokens(n) for n in (1, 3, 4, 300)] == [1, 1, 3, 3]
    for bad in (dict(narrow=0, wide=2), dict(narrow=1, wide=0), dict(narrow=1, wide=2, wide_from_tokens=0)):
        with pytest.raises(InvalidArgument, match="step threads need"):
            StepThreads(**bad)


def test_threads_for_sets_the_count_and_puts_it_back_even_on_error(one_thread):
    policy = StepThreads(narrow=1, wide=2, wide_from_tokens=3)
    with threads_for(policy, 5):
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 1
    with threads_for(policy, 2):
        assert torch.get_num_threads() == 1
    with pytest.raises(RuntimeError, match="boom"):
        with threads_for(policy, 8):
            raise RuntimeError("boom")
    assert torch.get_num_threads() == 1
    with threads_for(None, 100):  # no policy: nothing changes
        assert torch.get_num_threads() == 1


def test_policy_for_devices_flags_and_cores(one_thread):
    assert usable_cores() >= 1
    assert policy_for("cuda:0", 8) is None  # GPUs keep their threads
    assert policy_for("cpu", 0) is None  # off
    assert policy_for("cpu", 1) is None  # no wider than the process's own count
    assert policy_for("cpu", 4, 5) == StepThreads(1, 4, 5)
    auto = policy_for("cpu", None)
    assert auto is None if usable_cores() == 1 else auto == StepThreads(1, usable_cores())
    with pytest.raises(InvalidArgument, match=">= 0"):
        policy_for("cpu", -1)


def threads_seen(model: LlamaModel) -> list[int]:
    """Record the intra-op threads each forward of `model` runs its products on."""
    seen: list[int] = []
    linear = model.linear

    class Recording:
        def __getattr__(self, name):
            return getattr(linear, name)

        def __call__(self, *args, **kwargs):
            seen.append(torch.get_num_threads())
            return linear(*args, **kwargs)

        def add(self, *args, **kwargs):
            seen.append(torch.get_num_threads())
            return linear.add(*args, **kwargs)

    model.linear = Recording()
    return seen


def test_a_model_runs_wide_forwards_wide_and_computes_the_same(tmp_path, one_thread):
    path = tiny_dir(tmp_path, "llama")
    policy = StepThreads(narrow=1, wide=2, wide_from_tokens=3)
    plain = LlamaModel(path, num_slots=2, max_context=64)
    model = LlamaModel(path, num_slots=2, max_context=64, step_threads=policy)
    seen = threads_seen(model)
    prompt, verify = random_tokens(12, seed=1), random_tokens(4, seed=2)
    outputs, threads = [], []
    for m in (plain, model):
        slot = m.allocate()
        outputs.append([])
        for tokens, logits in ((prompt, 1), (verify[:1], 1), (verify[1:], 3)):  # prefill, step, verify block
            outputs[-1].append(m.forward([slot], [tokens], [logits])[0])
            if m is model:
                threads.append(set(seen))
                seen.clear()
    assert threads == [{2}, {1}, {2}]
    assert torch.get_num_threads() == 1  # put back after every forward
    for got, want in zip(outputs[1], outputs[0]):
        # other kernels (oneDNN on two threads for the compiled loop on one): float32 rounding apart
        assert relative_error(got, want) < 1e-5
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_batch_invariant_models_keep_their_threads(tmp_path, one_thread):
    model = LlamaModel(tiny_dir(tmp_path, "llama"), num_slots=1, max_context=64, batch_invariant=True,
                       step_threads=StepThreads(1, 2, 1))
    seen = threads_seen(model)
    model.forward([model.allocate()], [random_tokens(8)], [1])
    assert set(seen) == {1}


def parse(*flags: str) -> TargetServiceSettings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return settings_from_args(parser.parse_args(["--plaintext", *flags]))


def test_the_target_service_flags():
    settings = parse()
    assert (settings.wide_step_threads, settings.wide_step_tokens) == (None, 1)  # every usable core, every forward
    assert (parse("--wide-step-threads", "0").wide_step_threads, parse("--wide-step-threads", "4").wide_step_threads) == (0, 4)
    assert parse("--wide-step-tokens", "8").wide_step_tokens == 8
    assert parse_wide_step_threads("AUTO") is None
    with pytest.raises(argparse.ArgumentTypeError, match="'auto' or a thread count"):
        parse_wide_step_threads("many")
    with pytest.raises(ConfigError, match="--wide-step-threads must be 'auto' or >= 0"):
        parse("--wide-step-threads", "-2")
    with pytest.raises(ConfigError, match="--wide-step-tokens must be >= 1"):
        parse("--wide-step-tokens", "0")
