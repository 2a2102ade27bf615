"""The README's path: `specdec launch` starts Redis, target, draft and coordinator as processes; the
client library (blocking and asyncio) and `specdec launch --prompt` talk to it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from service_procs import REPO, start_launcher, stop_launcher
from specdec.client import AsyncClient, Client
from specdec.engine.local import LocalTarget
from specdec.engine.target import TargetEngine
from specdec.generation.loop import generate
from specdec.generation.stopping import StopChecker
from specdec.models.loader import load_model
from specdec.models.step_threads import usable_cores
from specdec.models.tokenizer import encode_prompt, eos_token_ids, load_tokenizer
from specdec.sampling.params import SamplingParams

PROMPT = "Tell me about the sea."


def plain_greedy(model_dir, prompt_ids, max_new_tokens):
    target = LocalTarget(TargetEngine(load_model(model_dir, num_slots=1)))
    stop = StopChecker(max_new_tokens, eos_token_ids(load_tokenizer(model_dir), model_dir))

    async def ignore(tokens):
        pass

    return asyncio.run(generate(target, None, "ref", prompt_ids, SamplingParams(), stop, ignore)).token_ids


def specdec_cmd(*args):
    return [sys.executable, "-m", "specdec.cli", *args]


@pytest.mark.parametrize("placement, extra", [("service", []), ("target", []),
                                              ("service", ["--batch-invariant", "--batch-invariant-rows", "3"]),
                                              ("service", ["--threads", "2"])],
                         ids=["service", "target", "batch-invariant", "threads"])
def test_launch_with_prompt_prints_the_plain_decoding_answer(models, placement, extra, tmp_path):
    """The draft model as a service of its own, or hosted by the target (--draft-placement target);
    and a batch-invariant target (--batch-invariant reaches the target service)."""
    target, draft = models
    result = subprocess.run(
        specdec_cmd("launch", "--target", str(target), "--draft", str(draft), "--port", "0", *extra,
                    "--log-dir", str(tmp_path), "--draft-placement", placement, "--prompt", PROMPT,
                    "--max-new-tokens", "24", "--json"),
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout[result.stdout.index("{"):])
    prompt_ids = encode_prompt(load_tokenizer(target), PROMPT)
    assert answer["token_ids"] == plain_greedy(target, prompt_ids, 24)
    proposer = {"service": "draft-model", "target": "draft-model-target"}[placement]
    assert answer["stats"]["proposer"] == proposer and answer["stats"]["cycles"] > 0
    target_log = "".join(p.read_text() for p in tmp_path.glob("target_service*.log"))
    assert ("batch-invariant, products of 3 rows" in target_log) == ("--batch-invariant" in extra), target_log[-2000:]
    # --threads reaches both model services; without it OMP_NUM_THREADS (1 here) wins
    threads = "2" if "--threads" in extra else "1"
    assert f"; {threads} intra-op threads" in target_log, target_log[-2000:]
    # the target's own forwards on every usable core (step_threads.py), unless the process has them all
    wide = usable_cores() > int(threads) and "--batch-invariant" not in extra
    assert (f"intra-op threads, its forwards on {usable_cores()})" in target_log) == wide, target_log[-2000:]
    if placement == "service":
        draft_log = "".join(p.read_text() for p in tmp_path.glob("draft_service*.log"))
        assert f"({threads} intra-op threads)" in draft_log, draft_log[-2000:]


@pytest.mark.parametrize(("threads", "device", "services", "cores", "environ", "expected"), [
    (None, "cpu", 2, 2, {}, "1"),  # 2 cores: one left to the coordinator, Redis and the loops; 1 each
    (None, "cpu", 1, 2, {}, "1"),  # the draft hosted by the target: one model service
    (None, "cpu", 2, 16, {}, "7"),
    (None, "cpu", 1, 16, {}, "15"),
    (None, "cpu", 2, 1, {}, "1"),
    (None, "cpu", 2, None, {}, "1"),  # os.cpu_count() may not know
    (None, "cpu", 2, 16, {"OMP_NUM_THREADS": "3"}, None),  # the environment's own setting wins
    (None, "cuda:0", 2, 16, {}, None),  # on a GPU torch's default stays
    (4, "cpu", 2, 2, {"OMP_NUM_THREADS": "3"}, "4"),  # the flag wins over everything
])
def test_launch_splits_the_cores_between_the_model_services(threads, device, services, cores, environ, expected):
    from specdec.commands.launch import model_threads

    env = model_threads(threads, device, services, cores, environ)
    assert env.get("OMP_NUM_THREADS") == expected


def test_launch_refuses_zero_threads(tmp_path):
    result = subprocess.run(specdec_cmd("launch", "--threads", "0", "--prompt", PROMPT),
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "--threads must be at least 1" in result.stderr


def test_launch_refuses_a_chunk_size_without_the_mode(tmp_path):
    result = subprocess.run(specdec_cmd("launch", "--batch-invariant-rows", "16", "--prompt", PROMPT),
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "--batch-invariant-rows needs --batch-invariant" in result.stderr


@pytest.fixture(scope="module")
def launched(models, tmp_path_factory):
    """`specdec launch` in the background, as a user runs it."""
    target, draft = models
    log_path = tmp_path_factory.mktemp("launch") / "launch.log"
    proc, address = start_launcher(["--target", str(target), "--draft", "ngram"], log_path)
    yield address, target
    assert stop_launcher(proc, log_path) == 0, log_path.read_text()[-3000:]


def test_blocking_client_streams_continues_and_ends_a_session(launched):
    address, target = launched
    tokenizer = load_tokenizer(target)
    with Client(address, plaintext=True) as client:
        chunks = list(client.stream(PROMPT, max_new_tokens=12))
        assert chunks[-1].finish_reason in ("length", "eos") and chunks[-1].usage["completion_tokens"] >= 1
        first = [t for c in chunks for t in c.token_ids]
        assert first == plain_greedy(target, encode_prompt(tokenizer, PROMPT), 12)
        session_id = chunks[-1].session_id
        second = client.generate("And the sky?", session_id=session_id, max_new_tokens=6)
        assert second.session_id == session_id and second.position > chunks[-1].position
        info = client.get_session(session_id)
        assert info["session_id"] == session_id and info["position"] == second.position
        assert client.end_session(session_id)


def test_async_client_and_bad_input(launched):
    import grpc

    address, target = launched

    async def scenario():
        async with AsyncClient(address, plaintext=True) as client:
            completion = await client.generate(PROMPT, max_new_tokens=8, temperature=0.7, seed=3)
            again = await client.generate(PROMPT, max_new_tokens=8, temperature=0.7, seed=3)
            assert completion.token_ids == again.token_ids  # seeded sampling is reproducible
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.generate(PROMPT, max_new_tokens=8, top_p=1.5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err.value.details()

    asyncio.run(scenario())


def test_launch_stops_everything_when_a_service_dies(models, tmp_path):
    """A launcher whose target was killed says so and exits 1, instead of serving on half a system."""
    target, _ = models
    logs = tmp_path / "logs"
    proc, _ = start_launcher(["--target", str(target), "--draft", "ngram", "--log-dir", str(logs)],
                             tmp_path / "launch.log")
    try:
        subprocess.run(["pkill", "-9", "-f", f"target_service.*{logs}"], check=True)
        assert proc.wait(60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    text = (tmp_path / "launch.log").read_text()
    assert "target_service exited (code -9)" in text and str(logs) in text
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", str(logs)], capture_output=True, text=True).stdout
    assert left == "", f"processes outlived the launcher: {left}"
