"""The Helm chart and the plain manifests, validated offline.

- Helm's own engine (the Go library, through the PyPI package helm-python-sdk) lints the chart with
  each ci/ values file and renders it; no cluster, no `helm` binary.
- Every rendered document and every plain manifest passes kubernetes-validate --strict against the
  oldest Kubernetes the chart supports and the newest the validator knows; custom resources
  (ServiceMonitor, AnalysisTemplate) pass their CRD's schema, kept in k8s/schemas/, strictly.
- k8s/manifests/ equals a fresh render (scripts/render_manifests.py --check).
- The rendered output has the properties the design relies on (anti-affinity, GPUs, probes, pools,
  autoscaling, budgets, secrets by reference, draining).
"""

from __future__ import annotations

import copy
import importlib.util
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (the test extra) renders the chart")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "k8s" / "chart" / "specdec"
SCHEMAS = REPO / "k8s" / "schemas"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("argoproj.io/v1alpha1", "AnalysisTemplate")}
MODEL_DEPLOYMENTS = {"specdec-target-baseline", "specdec-target-speculative", "specdec-draft-speculative"}


def _load_render_script():
    spec = importlib.util.spec_from_file_location("render_manifests", REPO / "scripts" / "render_manifests.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render_manifests = _load_render_script()


def kube_versions() -> list[str]:
    """The chart's minimum (Chart.yaml kubeVersion) and the newest Kubernetes the validator knows."""
    minimum = re.search(r"(\d+\.\d+\.\d+)", yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"])
    return [minimum.group(1), kubernetes_validate.utils.latest_version()]


def render(values: dict | None = None) -> list[dict]:
    return [doc for _, _, doc in render_manifests.documents(render_manifests.render_chart(values))]


def values_of(path: Path) -> dict:
    return render_manifests.load_values(path)


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def containers(deployment: dict) -> dict[str, dict]:
    spec = deployment["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec["containers"] + spec.get("initContainers", [])}


def arg(container: dict, name: str) -> str | None:
    for a in container.get("args", []):
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    return None


# ---- custom resources against their CRD schemas ------------------------------------------------------


def _strict(schema):
    """Unknown fields become errors (as server-side field validation reports them), except where the
    CRD keeps unknown fields on purpose."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) if k in ("properties", "items", "additionalProperties", "anyOf", "allOf", "oneOf", "not")
           else v for k, v in schema.items()}
    if "properties" in out:
        out["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
    if (schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@cache
def crd_validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    validators = {}
    for path in SCHEMAS.glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        for version in crd["spec"]["versions"]:
            if version.get("served"):
                key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
                schema = _strict(version["schema"]["openAPIV3Schema"])
                validators[key] = jsonschema.Draft7Validator(schema)
    return validators


DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def validate_custom_resource(doc: dict) -> None:
    validator = crd_validators()[(doc["apiVersion"], doc["kind"])]
    validator.validate(doc)
    assert DNS_SUBDOMAIN.match(doc["metadata"]["name"]) and len(doc["metadata"]["name"]) <= 253


def validate(doc: dict) -> None:
    """kubernetes-validate --strict on every supported version; CRD schemas for custom resources."""
    if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
        validate_custom_resource(doc)
        return
    for version in kube_versions():
        kubernetes_validate.validate(doc, version, strict=True)  # raises on errors and unknown kinds


# ---- lint, render, validate -----------------------------------------------------------------------


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.stem)
def test_chart_lints_clean(values_file):
    report = helm.lint(CHART, values_of(values_file), strict=True, kube_version=f"v{kube_versions()[-1]}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], report


def test_lint_reports_values_outside_the_schema():
    report = helm.lint(CHART, {"trafficSplit": {"owner": "both"}}, strict=True)
    assert any("trafficSplit/owner" in e for e in report["errors"])


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.stem)
def test_every_rendered_manifest_validates(values_file):
    docs = render(values_of(values_file))
    assert docs
    for doc in docs:
        try:
            validate(doc)
        except Exception as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} ({values_file.name}): {exc}")


def test_custom_resource_validation_is_strict():
    analysis = by_kind(render(values_of(CHART / "ci" / "mesh-values.yaml")), "AnalysisTemplate")
    doc = copy.deepcopy(next(iter(analysis.values())))
    validate_custom_resource(doc)
    doc["spec"]["metrics"][0]["provider"]["prometheus"]["querry"] = "typo"
    with pytest.raises(jsonschema.ValidationError):
        validate_custom_resource(doc)


def test_plain_manifests_equal_a_fresh_render():
    assert render_manifests.check() == [], "run: python scripts/render_manifests.py"


def test_plain_manifests_pass_kubernetes_validate_strict():
    files = sorted(str(p) for p in (REPO / "k8s" / "manifests").glob("*.yaml"))
    assert len(files) == len(render_manifests.PROFILES)
    cli = Path(sys.executable).with_name("kubernetes-validate")
    for version in kube_versions():
        result = subprocess.run([str(cli), "--strict", "--quiet", "-k", version, *files],
                                check=False, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        # The only documents it cannot check itself are the custom resources, validated below.
        for line in result.stdout.splitlines():
            assert line.startswith("WARN") and ("ServiceMonitor" in line or "AnalysisTemplate" in line), line
    for path in files:
        for doc in yaml.safe_load_all(Path(path).read_text()):
            if doc and (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
                validate_custom_resource(doc)


# ---- properties of the rendered output -------------------------------------------------------------


@pytest.fixture(scope="module")
def default_docs():
    return render()


def test_draft_and_target_are_kept_on_different_nodes(default_docs):
    deployments = by_kind(default_docs, "Deployment")
    for name in MODEL_DEPLOYMENTS:
        pod = deployments[name]["spec"]["template"]
        kind = pod["metadata"]["labels"]["app.kubernetes.io/component"]
        other = {"target": "draft", "draft": "target"}[kind]
        terms = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {
            "app.kubernetes.io/instance": "specdec", "app.kubernetes.io/component": other}}} in terms, name

    preferred = by_kind(render({"affinity": {"draftTarget": "preferred"}}), "Deployment")
    for name in MODEL_DEPLOYMENTS:
        anti = preferred[name]["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
        assert "requiredDuringSchedulingIgnoredDuringExecution" not in anti
        assert any(t["weight"] == 100 for t in anti["preferredDuringSchedulingIgnoredDuringExecution"])


def test_model_pods_get_gpus_and_the_rest_do_not(default_docs):
    workloads = {**by_kind(default_docs, "Deployment"), **by_kind(default_docs, "StatefulSet")}
    for name, workload in workloads.items():
        for container in containers(workload).values():
            gpus = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
            wants = name in MODEL_DEPLOYMENTS and container["name"] != "registrar"
            assert gpus == (1 if wants else None), (name, container["name"])
            if wants:
                assert container["resources"]["requests"]["memory"] and container["resources"]["limits"]["memory"]
        if name in MODEL_DEPLOYMENTS:
            tolerations = workload["spec"]["template"]["spec"]["tolerations"]
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations


def test_model_containers_take_as_many_threads_as_cpus_they_request(default_docs):
    """torch sizes its intra-op pool by the node's cores, not the pod's share: OMP_NUM_THREADS follows
    the model container's CPU request (docs/DEPLOYMENT.md, threads)."""
    for name, workload in by_kind(default_docs, "Deployment").items():
        if name not in MODEL_DEPLOYMENTS:
            continue
        model = next(c for c in containers(workload).values() if c["name"] != "registrar")
        env = {e["name"]: e for e in model["env"]}
        for variable in ("OMP_NUM_THREADS", "SPECDEC_WIDE_STEP_THREADS"):  # wide steps: no burst past it
            assert env[variable]["valueFrom"]["resourceFieldRef"] == {
                "containerName": model["name"], "resource": "requests.cpu", "divisor": "1"}, (name, variable)
        assert model["resources"]["requests"]["cpu"]


@pytest.mark.parametrize("tls", [True, False])
def test_native_grpc_probes_on_the_health_port(tls):
    docs = render(None if tls else values_of(CHART / "ci" / "plaintext-values.yaml"))
    for name, deployment in by_kind(docs, "Deployment").items():
        component = deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        main = containers(deployment)[component]
        ports = {p["name"]: p["containerPort"] for p in main["ports"]}
        health = int(arg(main, "health-port")) if tls else int(arg(main, "port"))
        assert ports["health" if tls else "grpc"] == health
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert main[probe]["grpc"] == {"port": health}, (name, probe)
        if name in MODEL_DEPLOYMENTS:  # startup covers downloading and loading a model
            startup = main["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
        assert ("--plaintext" in main["args"]) is (not tls)


def test_both_pools_and_registry_discovery(default_docs):
    deployments = by_kind(default_docs, "Deployment")
    assert MODEL_DEPLOYMENTS | {"specdec-coordinator"} == set(deployments)
    coordinator = containers(deployments["specdec-coordinator"])["coordinator"]
    assert not any(a.startswith(("--target=", "--draft=")) for a in coordinator["args"])  # found in Redis
    for name in MODEL_DEPLOYMENTS:
        pod = deployments[name]["spec"]["template"]
        pool = pod["metadata"]["labels"]["specdec.io/pool"]
        registrar = containers(deployments[name])["registrar"]
        assert registrar["restartPolicy"] == "Always"  # a native sidecar: outlives the service's drain
        assert registrar["args"][0] == "registrar" and arg(registrar, "pool") == pool
        assert arg(registrar, "kind") == pod["metadata"]["labels"]["app.kubernetes.io/component"]
        assert arg(registrar, "redis-prefix") == arg(coordinator, "redis-prefix")
        env = {e["name"]: e for e in registrar["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    headless = by_kind(default_docs, "Service")
    for name in MODEL_DEPLOYMENTS:
        assert headless[name]["spec"]["clusterIP"] == "None"
    assert headless["specdec-coordinator"]["spec"]["type"] == "ClusterIP"
    no_baseline = by_kind(render({"pools": {"baseline": {"target": {"replicas": 0}}}}), "Deployment")
    assert "specdec-target-baseline" not in no_baseline


def test_prompt_lookup_inside_the_coordinator_deploys_no_draft_pods():
    """models.draftProposer local-ngram: the coordinator drafts itself (--draft=local:ngram); no draft
    Deployment, Service, PDB or HPA is rendered; every rendered manifest still validates."""
    docs = render({"models": {"draftProposer": "local-ngram"}})
    names = {d["metadata"]["name"] for d in docs}
    assert not any("draft" in name for name in names), sorted(names)
    coordinator = containers(by_kind(docs, "Deployment")["specdec-coordinator"])["coordinator"]
    assert "--draft=local:ngram" in coordinator["args"]
    assert {"specdec-target-speculative", "specdec-target-baseline"} <= set(by_kind(docs, "Deployment"))
    report = helm.lint(CHART, {"models": {"draftProposer": "local-ngram"}}, strict=True)
    assert not [m for m in report["messages"] if m["severity"] >= 2] and not report["errors"], report
    for doc in docs:
        validate(doc)


@pytest.mark.parametrize("proposer", ["target-ngram", "target-model"])
def test_drafts_inside_the_target_deploy_no_draft_pods(proposer):
    """models.draftProposer target-ngram / target-model: the coordinator asks the targets to draft
    (--draft=target:...); target-model makes the speculative targets host the draft model; no draft
    pods; every rendered manifest validates."""
    docs = render({"models": {"draftProposer": proposer}})
    names = {d["metadata"]["name"] for d in docs}
    assert not any("draft" in name for name in names), sorted(names)
    coordinator = containers(by_kind(docs, "Deployment")["specdec-coordinator"])["coordinator"]
    assert f"--draft=target:{proposer.split('-')[1]}" in coordinator["args"]
    deployments = by_kind(docs, "Deployment")
    hosted = "--inner-draft=smollm2-135m-draft"
    assert (hosted in containers(deployments["specdec-target-speculative"])["target"]["args"]) == (proposer == "target-model")
    assert hosted not in containers(deployments["specdec-target-baseline"])["target"]["args"]
    report = helm.lint(CHART, {"models": {"draftProposer": proposer}}, strict=True)
    assert not [m for m in report["messages"] if m["severity"] >= 2] and not report["errors"], report
    for doc in docs:
        validate(doc)


def test_the_targets_draft_trimming_and_the_drafts_copy_threshold_are_values(default_docs):
    """target.draftTrimming (default goodput, the service's own default) and draft.copyBelow (null:
    the service's default) become the services' flags; values outside their range fail the schema."""
    def args(docs, deployment, container):
        return containers(by_kind(docs, "Deployment")[deployment])[container]["args"]

    for pool in ("speculative", "baseline"):
        assert "--draft-trimming=goodput" in args(default_docs, f"specdec-target-{pool}", "target")
    assert not any(a.startswith("--copy-below") for a in args(default_docs, "specdec-draft-speculative", "draft"))
    docs = render({"target": {"draftTrimming": "step"}, "draft": {"copyBelow": 0}})
    assert "--draft-trimming=step" in args(docs, "specdec-target-speculative", "target")
    assert "--copy-below=0" in args(docs, "specdec-draft-speculative", "draft")
    for bad in ({"target": {"draftTrimming": "always"}}, {"draft": {"copyBelow": 2}}):
        report = helm.lint(CHART, bad, strict=True)
        assert report["errors"] or [m for m in report["messages"] if m["severity"] >= 2], bad


def test_autoscaling_on_serving_metrics_not_cpu(default_docs):
    hpas = by_kind(default_docs, "HorizontalPodAutoscaler")
    targets = {**by_kind(default_docs, "Deployment")}
    assert set(hpas) == set(targets)
    for name, hpa in hpas.items():
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"]["name"] in targets
        assert "replicas" not in targets[name]["spec"]  # the HPA owns the count
        for metric in hpa["spec"]["metrics"]:
            assert metric["type"] in ("Pods", "External", "Object")
            assert metric[metric["type"].lower()]["metric"]["name"].startswith("specdec_")
    cpu = {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}}
    with pytest.raises(helm.HelmError):
        render({"target": {"autoscaling": {"metrics": [cpu]}}})


def test_model_pods_scale_on_their_sessions_in_a_turn(default_docs):
    """Not on KV slots in use or all sessions: both count the caches kept between turns (until a
    slot is needed or the 10-minute idle TTL), so they stay at the maximum under steady traffic."""
    from prometheus_client import CollectorRegistry

    from specdec.observability.metrics import DraftMetrics, TargetMetrics

    registry = CollectorRegistry()
    TargetMetrics(registry)
    DraftMetrics(registry)
    families = {family.name for family in registry.collect()}
    for name, hpa in by_kind(default_docs, "HorizontalPodAutoscaler").items():
        if name == "specdec-coordinator":
            continue
        names = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
        kind = "draft" if "draft" in name else "target"
        assert names == [f"specdec_{kind}_sessions_in_turn"], (name, names)
        assert set(names) <= families


def test_disruption_budgets_cover_every_workload(default_docs):
    budgets = by_kind(default_docs, "PodDisruptionBudget")
    for name, deployment in by_kind(default_docs, "Deployment").items():
        selector = budgets[name]["spec"]["selector"]["matchLabels"]
        assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_graceful_draining(default_docs):
    for deployment in by_kind(default_docs, "Deployment").values():
        spec = deployment["spec"]["template"]["spec"]
        component = deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        main = containers(deployment)[component]
        drain, grace = float(arg(main, "drain-period")), float(arg(main, "grace-period"))
        assert drain > 0 and spec["terminationGracePeriodSeconds"] >= drain + grace
        assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    coordinator = containers(by_kind(default_docs, "Deployment")["specdec-coordinator"])["coordinator"]
    assert coordinator["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"


def test_secrets_are_referenced_never_inlined():
    for values_file in CI_VALUES:
        docs = render(values_of(values_file))
        assert not [d for d in docs if d["kind"] == "Secret"]
        for workload in [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]:
            for container in containers(workload).values():
                for env in container.get("env", []):
                    if "value" in env:
                        assert "redis://:" not in env["value"] or "$(REDIS_PASSWORD)" in env["value"], env
                        assert not re.search(r"(?i)token|password", env["name"]) or env["value"].startswith("/"), env
    external = by_kind(render(values_of(CHART / "ci" / "external-redis-values.yaml")), "Deployment")
    coordinator = containers(external["specdec-coordinator"])["coordinator"]
    env = {e["name"]: e for e in coordinator["env"]}
    assert env["SPECDEC_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "specdec-redis-url", "key": "url"}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel-collector.observability.svc:4317"
    volumes = {v["name"]: v for v in external["specdec-coordinator"]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["auth"]["secret"]["secretName"] == "specdec-api-tokens"
    assert volumes["tls-client"]["secret"]["secretName"] == "specdec-coordinator-client-tls"
    assert arg(coordinator, "target-tls-cert") == "/etc/specdec/tls-client/tls.crt"  # mutual TLS
    assert arg(coordinator, "target-tls-server-name") == "models.specdec.internal"
    target = containers(external["specdec-target-speculative"])["target"]
    assert {"name": "SPECDEC_TLS_CLIENT_CA", "value": "/etc/specdec/tls/ca.crt"} in target["env"]
    with pytest.raises(helm.HelmError, match="TLS"):
        render({"tls": {"enabled": False}, "auth": {"internalTokenSecret": "t"}})


def test_traffic_split_has_exactly_one_owner():
    from prometheus_client import CollectorRegistry

    from specdec.observability.metrics import CoordinatorMetrics

    coordinator_mode = render({"coordinator": {"canaryArgs": ["--canary-flag"]}})
    assert not by_kind(coordinator_mode, "AnalysisTemplate")
    coordinator = containers(by_kind(coordinator_mode, "Deployment")["specdec-coordinator"])["coordinator"]
    assert "--canary-flag" in coordinator["args"]  # the coordinator's own controller splits

    mesh = render(values_of(CHART / "ci" / "mesh-values.yaml"))
    coordinator = containers(by_kind(mesh, "Deployment")["specdec-coordinator"])["coordinator"]
    assert "--this-flag-must-not-render" not in coordinator["args"]  # the coordinator does not split
    assert arg(coordinator, "default-pool") == "baseline"
    assert "specdec-coordinator-canary" in by_kind(mesh, "Service")
    hpa = by_kind(mesh, "HorizontalPodAutoscaler")["specdec-coordinator"]
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "Rollout"
    (analysis,) = by_kind(mesh, "AnalysisTemplate").values()
    registry = CollectorRegistry()
    CoordinatorMetrics(registry)
    families = {family.name for family in registry.collect()}  # counters without _total
    for metric in analysis["spec"]["metrics"]:
        query = metric["provider"]["prometheus"]["query"]
        assert 'pool="speculative"' in query and 'pool="baseline"' in query
        assert metric["successCondition"].startswith("result[0] <= {{args.")
        for name in re.findall(r"specdec_coordinator_[a-z_]+", query):
            assert re.sub(r"_(bucket|total)$", "", name) in families, name  # the metric exists


def test_service_monitor_scrapes_services_with_metrics_ports():
    docs = render({"serviceMonitor": {"enabled": True}})
    (monitor,) = by_kind(docs, "ServiceMonitor").values()
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped = [s for s in by_kind(docs, "Service").values() if selector.items() <= s["metadata"]["labels"].items()]
    assert {s["metadata"]["name"] for s in scraped} == MODEL_DEPLOYMENTS | {"specdec-coordinator"}
    assert all(any(p["name"] == "metrics" for p in s["spec"]["ports"]) for s in scraped)
