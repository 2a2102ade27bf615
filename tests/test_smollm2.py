"""Lossless on the real default model, SmolLM2-135M-Instruct (fp32, CPU): in one process and
through the three services. Greedy output must equal plain target decoding token for token."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from service_procs import start_launcher, stop_launcher
from specdec.client import Client
from specdec.engine.draft import DraftEngine
from specdec.engine.local import LocalDraft, LocalTarget
from specdec.engine.target import TargetEngine
from specdec.generation.loop import generate
from specdec.generation.session import LoopSettings
from specdec.generation.stopping import StopChecker
from specdec.models.loader import load_model
from specdec.models.tokenizer import encode_prompt, eos_token_ids, load_tokenizer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.ngram import NgramProposer
from specdec.sampling.params import SamplingParams
from specdec.testing.tiny_models import make_tiny_model

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "List three prime numbers and explain why they are prime.",
]
MAX_NEW_TOKENS = 40


@pytest.fixture(scope="module")
def smol(default_target_dir):
    tokenizer = load_tokenizer(default_target_dir)
    return default_target_dir, tokenizer, eos_token_ids(tokenizer, default_target_dir)


@pytest.fixture(scope="module")
def random_draft_dir(smol, tmp_path_factory):
    """A random-weight Llama with SmolLM2's vocabulary and tokenizer: a draft that is nearly always
    wrong, the hardest case for losslessness."""
    target_dir, tokenizer, _ = smol
    path = make_tiny_model(tmp_path_factory.mktemp("smol-random") / "draft", vocab_size=len(tokenizer),
                           hidden_size=64, num_layers=2, seed=5, tokenizer=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (target_dir / name).exists():
            shutil.copy(target_dir / name, path / name)
    return path


def run_local(target: TargetEngine, draft: DraftEngine | None, prompt_ids, eos, k=4):
    async def ignore(tokens):
        pass

    stop = StopChecker(MAX_NEW_TOKENS, eos)
    result = asyncio.run(generate(LocalTarget(target), LocalDraft(draft) if draft else None, "s", prompt_ids,
                                  SamplingParams(), stop, ignore, LoopSettings(num_draft_tokens=k)))
    target.end_session("s")
    if draft:
        draft.end_session("s")
    return result


@pytest.fixture(scope="module")
def plain_outputs(smol):
    target_dir, tokenizer, eos = smol
    target = TargetEngine(load_model(target_dir, num_slots=1, max_context=1024))
    return {p: run_local(target, None, encode_prompt(tokenizer, p), eos).token_ids for p in PROMPTS}


@pytest.mark.parametrize("kind", ["identical", "random", "ngram"])
def test_in_process_greedy_equals_plain_decoding(smol, random_draft_dir, plain_outputs, kind):
    target_dir, tokenizer, eos = smol
    target = TargetEngine(load_model(target_dir, num_slots=1, max_context=1024))
    if kind == "ngram":
        proposer = NgramProposer()
    else:
        draft_dir = target_dir if kind == "identical" else random_draft_dir
        proposer = DraftModelProposer(load_model(draft_dir, num_slots=1, max_context=512))
    for prompt in PROMPTS:
        result = run_local(target, DraftEngine(proposer), encode_prompt(tokenizer, prompt), eos)
        assert result.token_ids == plain_outputs[prompt], (kind, prompt)
        if kind == "identical":
            assert result.stats.acceptance_rate == 1.0


@pytest.fixture(scope="module", params=["identical", "random", "ngram"])
def launched(request, smol, random_draft_dir, tmp_path_factory):
    """The three services and Redis as processes (`specdec launch`), one launch per draft kind."""
    target_dir = smol[0]
    draft = {"identical": str(target_dir), "random": str(random_draft_dir), "ngram": "ngram"}[request.param]
    log_path = tmp_path_factory.mktemp("launch") / "launch.log"
    # The identical draft accepts everything only as itself: where it is unsure, the copy rule
    # (specdec.proposers.copy_guess) would replace its token with a copied one.
    env = {"SPECDEC_DRAFT_COPY_BELOW": "0"} if request.param == "identical" else {}
    proc, address = start_launcher(["--target", str(target_dir), "--draft", draft], log_path, env=env)
    yield request.param, address
    assert stop_launcher(proc, log_path) == 0, log_path.read_text()[-3000:]


@pytest.mark.slow  # three launches of the whole system with the real model: 95 s on 2 cores
def test_through_the_services_greedy_equals_plain_decoding(launched, plain_outputs):
    kind, address = launched
    with Client(address, plaintext=True) as client:
        for prompt in PROMPTS:
            answer = client.generate(prompt, max_new_tokens=MAX_NEW_TOKENS)
            assert answer.token_ids == plain_outputs[prompt], (kind, prompt)
            assert answer.stats["cycles"] > 0
            if kind == "identical":
                assert answer.stats["accepted"] == answer.stats["drafted"]
