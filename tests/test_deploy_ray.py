"""The Ray launcher on a simulated two-GPU-node cluster (logical GPUs on CPU): draft and target land on
different nodes, register in Redis, and a greedy generation through the coordinator equals plain
decoding of the target."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from service_procs import TEST_ENV, tiny_model_dir

from specdec.engine.local import LocalTarget
from specdec.engine.target import TargetEngine
from specdec.generation.loop import generate
from specdec.generation.session import LoopSettings
from specdec.generation.stopping import StopChecker
from specdec.models.loader import load_model
from specdec.models.tokenizer import encode_prompt, load_tokenizer
from specdec.sampling.params import SamplingParams

ray = pytest.importorskip("ray")  # an optional extra

PROMPT = "Ray places the draft and the target on different nodes."
MAX_NEW_TOKENS = 24


def plain_decoding(target_dir, prompt_ids: list[int], n: int) -> list[int]:
    """The target alone, greedy, through the same loop with no draft: the reference."""
    engine = TargetEngine(load_model(target_dir, backend="native", num_slots=1, max_context=256))
    emitted: list[int] = []

    async def emit(tokens):
        emitted.extend(tokens)

    asyncio.run(generate(LocalTarget(engine), None, uuid.uuid4().hex, prompt_ids, SamplingParams(),
                         StopChecker(n, ()), emit, LoopSettings()))
    return emitted


@pytest.fixture
def two_gpu_node_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=1, num_gpus=1)
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    try:
        yield {node["NodeID"] for node in ray.nodes() if node["Alive"] and node["Resources"].get("GPU")}
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.timeout(240)
def test_draft_and_target_on_different_gpu_nodes_and_lossless(two_gpu_node_cluster, redis_url, tmp_path_factory):
    import redis as redis_sync

    from specdec.client import Client
    from specdec.ray_launcher import RayLaunchSettings, launch

    base = tmp_path_factory.getbasetemp()
    target_dir, draft_dir = tiny_model_dir(base, "target", seed=0), tiny_model_dir(base, "draft", seed=1)
    prefix = f"ray{uuid.uuid4().hex[:8]}"
    model = ("--backend", "native", "--device", "cpu", "--max-context", "256", "--num-slots", "2")
    settings = RayLaunchSettings(
        redis_url=redis_url, redis_prefix=prefix, plaintext=True, coordinator_port=0,
        # The simulated nodes share this host: listen on loopback only and advertise that.
        bind_host="127.0.0.1", advertise_host="127.0.0.1",
        target_args=("--model", str(target_dir), *model),
        draft_args=("--proposer", "draft-model", "--model", str(draft_dir), *model),
        coordinator_args=("--tokenizer", str(target_dir)),
        num_gpus=1, num_cpus=1, ready_timeout_s=120, env=tuple(TEST_ENV.items()),
    )
    deployment = launch(settings)
    try:
        (target,), (draft,) = deployment.targets, deployment.drafts
        # STRICT_SPREAD: two different nodes, both of them GPU nodes, one logical GPU each.
        assert target["node_id"] != draft["node_id"]
        assert {target["node_id"], draft["node_id"]} == two_gpu_node_cluster
        assert target["cuda_visible_devices"] and draft["cuda_visible_devices"]
        # Published in the registry, where the coordinator (started with no endpoints) found them.
        client = redis_sync.Redis.from_url(redis_url)
        registered = {client.hget(key, "endpoint").decode(): client.hget(key, "kind").decode()
                      for key in client.scan_iter(f"{prefix}:{{replicas}}:replica:*")}
        assert registered == {target["endpoint"]: "target", draft["endpoint"]: "draft"}

        with Client(deployment.coordinator["endpoint"], plaintext=True) as api:
            completion = api.generate(PROMPT, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        prompt_ids = encode_prompt(load_tokenizer(target_dir), prompt=PROMPT)
        assert completion.token_ids == plain_decoding(target_dir, prompt_ids, MAX_NEW_TOKENS)
        assert completion.stats.get("pool", "").lower().endswith("speculative")
    finally:
        deployment.shutdown(timeout_s=20)
    # Drained and deregistered on shutdown.
    assert not list(client.scan_iter(f"{prefix}:{{replicas}}:replica:*"))


def test_ray_command_flags():
    from specdec.cli import build_parser
    from specdec.commands.ray import settings_from_args

    parser = build_parser()
    with pytest.raises(SystemExit):  # neither TLS nor an explicit --plaintext
        settings_from_args(parser.parse_args(["ray", "up", "--redis-url", "redis://r:6379/0"]))
    args = parser.parse_args([
        "ray", "up", "--redis-url", "redis://:pw@r:6379/0", "--tls-cert", "/c.pem", "--tls-key", "/k.pem",
        "--tls-ca", "/ca.pem", "--tls-server-name", "specdec-models", "--draft", "ngram", "--baseline-targets", "2",
        "--target-arg=--num-slots=16"])
    settings = settings_from_args(args)
    assert settings.baseline_targets == 2 and not settings.plaintext
    assert ("--tls-cert", "/c.pem") == settings.target_args[settings.target_args.index("--tls-cert"):][:2]
    assert settings.draft_args[:4] == ("--proposer", "ngram", "--tokenizer", "smollm2-135m-instruct")
    coordinator = " ".join(settings.coordinator_args)
    assert "--target-tls-ca /ca.pem" in coordinator and "--draft-tls-server-name specdec-models" in coordinator
    assert "--num-slots=16" in settings.target_args
    from specdec.ray_launcher import service_specs

    target, draft, baseline, front = service_specs(settings)
    assert [b.pool for b in baseline] == ["baseline", "baseline"] and target.pool == draft.pool == "speculative"
    assert "redis://" not in " ".join(front.args)  # the URL (and its password) travels in the environment
    assert dict(front.env)["SPECDEC_REDIS_URL"] == "redis://:pw@r:6379/0"
