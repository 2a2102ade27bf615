"""Lossless under continuous batching: 8 concurrent sessions generating speculatively through the
target and draft services (subprocesses on tiny models) each get exactly what plain decoding gives
them, while the services batch their work (batch sizes above 1 in both services' metrics). The
caches hold fewer sessions than run, so rows are evicted and re-fed between batches too. A draft
service made slow on purpose loses to plain decoding under this load: the target refuses its
sessions' drafts (cycle pricing, specdec/engine/cycle_wall.py), and they still get plain decoding's
tokens."""

from __future__ import annotations

import asyncio

import pytest

from draft_service.client import connect as connect_draft
from service_procs import launch, stop_all, tiny_model_dir, wait_all
from specdec.engine.local import LocalTarget
from specdec.engine.target import TargetEngine
from specdec.generation.loop import generate
from specdec.generation.session import LoopSettings
from specdec.generation.stopping import StopChecker
from specdec.models.loader import load_model
from specdec.sampling.params import SamplingMode, SamplingParams
from specdec.server.settings import ClientSettings
from target_service.client import connect as connect_target

CONTEXT = 192
SESSIONS = 8
NEW_TOKENS = 24
PLAIN = ClientSettings(plaintext=True, timeout_s=60.0)
# Greedy and Gumbel-coupled sampling: both are token for token what plain decoding gives.
PARAMS = [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95, seed=7, mode=SamplingMode.GUMBEL)]


def prompt(i: int) -> list[int]:
    return [(7 * i + 3 * j) % 240 + 1 for j in range(4 + 3 * i)]  # different lengths: different positions


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    return {"target": tiny_model_dir(base, "target", seed=0)}


@pytest.fixture(scope="module")
def services(dirs, tmp_path_factory):
    logs = tmp_path_factory.mktemp("batching-logs")
    common = ["--plaintext", "--max-context", str(CONTEXT), "--max-batch-size", "8"]
    procs = {
        # More sessions than slots, driven by the loop over bare clients (no coordinator to wait for a
        # slot): --evict-after 0 lets them evict each other, as these tests of batching expect.
        "target": launch("target_service", [*common, "--model", str(dirs["target"]), "--num-slots", "6",
                                            "--evict-after", "0"], log_dir=logs),
        # The same without the cycle pricing: a fresh target's pricing lets one session of a burst probe
        # while the others decode plainly, and the test below is of batching drafted sessions.
        "unpriced": launch("target_service", [*common, "--model", str(dirs["target"]), "--num-slots", "6",
                                              "--evict-after", "0", "--draft-trimming", "step"], log_dir=logs),
        "same": launch("draft_service", [*common, "--model", str(dirs["target"]), "--num-slots", "6"],
                       log_dir=logs),
        "ngram": launch("draft_service", [*common, "--proposer", "ngram", "--tokenizer", str(dirs["target"])],
                        log_dir=logs),
        # 40 ms a forward: a cycle costs its session well over what the plain steps of 8 sessions take.
        "slow": launch("draft_service", [*common, "--model", str(dirs["target"]), "--num-slots", "8",
                                         "--test-delay-ms", "40"], log_dir=logs),
    }
    wait_all(*procs.values())
    yield procs
    stop_all(*procs.values())


@pytest.fixture(scope="module")
def plain(dirs):
    """Plain decoding of every session, one at a time, in process: the reference."""
    engine = TargetEngine(load_model(dirs["target"], backend="native", num_slots=2, max_context=CONTEXT))
    return [asyncio.run(run(LocalTarget(engine), None, i)) for i in range(SESSIONS)]


async def run(target, draft, i: int, k: int = 4, new_tokens: int = NEW_TOKENS, result: bool = False):
    """Session i's tokens (with result: the whole GenerationResult)."""
    async def emit(tokens):
        pass

    session_id = f"batched-{i}-{draft is not None}-{id(target)}-{new_tokens}"
    generated = await generate(target, draft, session_id, prompt(i), PARAMS[i % len(PARAMS)],
                               StopChecker(new_tokens, ()), emit, LoopSettings(num_draft_tokens=k))
    await target.end_session(session_id)
    if draft is not None:
        await draft.end_session(session_id)
    return generated if result else generated.token_ids


def batched(metrics_text: str, family: str) -> bool:
    """Whether some step of the `family` histogram held more than one item (sum > count)."""
    values: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith((f"{family}_sum", f"{family}_count")):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return any(value > values[name.replace("_sum", "_count")] for name, value in values.items() if "_sum" in name)


@pytest.mark.parametrize("kind", ["same", "ngram"])
async def test_concurrent_speculative_sessions_equal_plain_decoding(services, plain, kind):
    async with connect_target(services["unpriced"].address, PLAIN) as target, \
            connect_draft(services[kind].address, PLAIN) as draft:
        got = await asyncio.gather(*(run(target, draft, i) for i in range(SESSIONS)))
    for i in range(SESSIONS):
        assert got[i] == plain[i], f"session {i} ({PARAMS[i % len(PARAMS)]})"
    assert batched(services["unpriced"].metrics(), "specdec_target_batch_size")
    if kind == "same":
        # Only the model draft: an n-gram Propose takes microseconds, so two overlap only by chance.
        assert batched(services[kind].metrics(), "specdec_draft_batch_size")


async def test_a_draft_service_that_loses_under_load_is_refused_and_output_is_unchanged(services, dirs):
    """Fixed k = 4 from a draft service 40 ms a forward, 8 sessions at once on a source the target has
    not priced: it lets one session probe and tells the others at their start to decode plainly, and
    once a probe's cycles have lost against its plain steps it refuses them all (the metric counts
    those verdicts; whether a probe finishes its cycles before the plain sessions end depends on the
    machine's pace); every session still gets plain decoding's tokens."""
    new_tokens = 64
    engine = TargetEngine(load_model(dirs["target"], backend="native", num_slots=2, max_context=CONTEXT))
    expected = [await run(LocalTarget(engine), None, i, new_tokens=new_tokens) for i in range(SESSIONS)]
    async with connect_target(services["target"].address, PLAIN) as target, \
            connect_draft(services["slow"].address, PLAIN) as draft:
        got = await asyncio.gather(*(run(target, draft, i, new_tokens=new_tokens, result=True)
                                     for i in range(SESSIONS)))
    for i in range(SESSIONS):
        assert got[i].token_ids == expected[i], f"session {i} ({PARAMS[i % len(PARAMS)]})"
    refusals = [line for line in services["target"].metrics().splitlines()
                if line.startswith("specdec_target_draft_refusals_total ")]
    refused_at_start = sum(r.stats.cycles == 0 for r in got)
    assert refusals and (float(refusals[0].split()[1]) >= 1 or refused_at_start >= SESSIONS // 2), refused_at_start
    plain_steps = sum(r.stats.decode_steps for r in got)
    cycles = sum(r.stats.cycles for r in got)
    assert plain_steps > cycles, (plain_steps, cycles)  # refused: mostly plain decoding
