"""deploy/k8s cannot drift from Kubernetes or from the code.

- every manifest validates against the Kubernetes OpenAPI schemas, offline and
  strictly (unknown fields are errors), with ``kubernetes-validate``;
- the kustomization lists exactly the manifests in the folder;
- every ferry container's command and FERRY_* environment is accepted by that
  service's own parser (as tests/unit/deploy/test_compose.py does for compose), with
  Kubernetes' ``$(VAR)`` references expanded;
- the same images and the same FERRY_* variables as docker-compose.yml;
- the probes, GPU requests, disruption budgets and the autoscaler are there and
  point at what exists (ports by name, the HPA at the gateway Deployment).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.unit.deploy.test_compose import NON_CONFIG_ENV, PARSERS, build_parser, interpolate, load_compose

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.32.0"  # a release current clusters run; the schemas ship inside the package
_REF = re.compile(r"\$\((\w+)\)")
FIELD_VALUES = {"POD_NAME": "ferry-engine-0", "POD_NAMESPACE": "ferry"}


def manifests() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return out


def by_kind(kind: str, name: str) -> dict[str, Any]:
    return next(doc for _, doc in manifests() if doc["kind"] == kind and doc["metadata"]["name"] == name)


def containers() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for label, doc in manifests():
        spec = doc.get("spec", {}).get("template", {}).get("spec")
        if spec:
            found += [(f"{label}/{c['name']}", c) for c in spec["containers"]]
    return found


def ferry_containers() -> list[tuple[str, dict[str, Any]]]:
    return [(label, c) for label, c in containers() if c["image"].startswith("ferry:")]


def literal_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's literal variables with ``$(VAR)`` references expanded as Kubernetes would."""
    values = dict(FIELD_VALUES)
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            value = _REF.sub(lambda m: values.get(m.group(1), m.group(0)), str(item["value"]))
            values[item["name"]] = env[item["name"]] = value
    return env


@pytest.mark.parametrize("label", [label for label, _ in manifests()])
def test_every_manifest_validates_against_the_kubernetes_schemas(label: str) -> None:
    doc = dict(manifests())[label]
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validator_catches_a_broken_manifest() -> None:
    doc = by_kind("Deployment", "ferry-gateway")
    broken = {**doc, "spec": {**doc["spec"], "replicas": "two"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    typo = {**doc, "spec": {**doc["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, KUBERNETES_VERSION, strict=True)


def test_the_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = sorted(kustomization["resources"])
    assert listed == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("label", [label for label, _ in ferry_containers()])
def test_command_and_environment_accepted_by_the_service_parser(label: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    container = dict(ferry_containers())[label]
    module, *argv = container["args"]
    assert module in PARSERS, f"{label}: {module} is not a ferry service"
    env = literal_env(container)
    parser = build_parser(module, env, monkeypatch)  # converts every FERRY_* default: bad values raise
    args = parser.parse_args(argv)
    known = {action.dest for action in parser._actions}
    names = [item["name"] for item in container["env"] if item["name"].startswith("FERRY_")]
    assert names, f"{label}: no FERRY_* knob"
    for name in names:
        if name in NON_CONFIG_ENV:
            continue
        field = name[len("FERRY_"):].lower()
        assert field in known, f"{label}: {name} is not a knob of {module}"
        if name in env:
            parsed = getattr(args, field)
            if isinstance(parsed, bool):
                assert parsed == (env[name].lower() in ("1", "true", "yes", "on"))
            elif isinstance(parsed, int | float):
                assert parsed == type(parsed)(env[name])
            else:
                assert parsed == env[name]


def test_same_images_and_variables_as_compose() -> None:
    services = load_compose()["services"]
    k8s = {c["args"][0] + ("@gpu" if c["image"].endswith(":gpu") else ""): c for _, c in ferry_containers()}
    pairs = {"scheduler": "services.scheduler", "worker-gpu": "services.worker@gpu", "gateway": "services.gateway"}
    for compose_name, key in pairs.items():
        svc, container = services[compose_name], k8s[key]
        assert interpolate(svc["image"]) == container["image"], compose_name
        compose_vars = {k for k in svc["environment"] if k.startswith("FERRY_")}
        k8s_vars = {item["name"] for item in container["env"]}
        assert compose_vars <= k8s_vars, f"{compose_name}: missing {sorted(compose_vars - k8s_vars)}"


def test_endpoints_meet_inside_the_engine_pod_and_from_the_gateway() -> None:
    engine = by_kind("StatefulSet", "ferry-engine")
    pod = {c["name"]: literal_env(c) for c in engine["spec"]["template"]["spec"]["containers"]}
    sched, worker = pod["scheduler"], pod["worker"]
    port = lambda ep: ep.rsplit(":", 1)[1]  # noqa: E731
    for knob in ("FERRY_PLAN_ENDPOINT", "FERRY_RESULT_ENDPOINT"):
        assert worker[knob] == f"tcp://127.0.0.1:{port(sched[knob])}"
    for knob in ("FERRY_NUM_WORKERS", "FERRY_BLOCK_SIZE", "FERRY_MAX_NUM_SEQS", "FERRY_MAX_NUM_BATCHED_TOKENS"):
        assert worker[knob] == sched[knob], knob
    service = by_kind("Service", engine["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"  # per-pod DNS names
    assert sched["FERRY_ADVERTISE_ENDPOINT"] == "tcp://ferry-engine-0.ferry-engine.ferry.svc.cluster.local:5555"
    gateway = literal_env(by_kind("Deployment", "ferry-gateway")["spec"]["template"]["spec"]["containers"][0])
    assert gateway["FERRY_SCHEDULER_ENDPOINT"] == f"tcp://ferry-engine-0.ferry-engine:{port(sched['FERRY_GATEWAY_ENDPOINT'])}"
    assert gateway["FERRY_REDIS_URL"] == sched["FERRY_REDIS_URL"]
    assert gateway["FERRY_DISCOVER_ENGINES"] == "true"


def test_probes_gpus_budgets_and_autoscaling() -> None:
    engine = by_kind("StatefulSet", "ferry-engine")["spec"]["template"]["spec"]
    sched = next(c for c in engine["containers"] if c["name"] == "scheduler")
    port_names = {p["name"]: p["containerPort"] for p in sched["ports"]}
    assert sched["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert sched["livenessProbe"]["httpGet"]["path"] == "/health"
    assert port_names[sched["readinessProbe"]["httpGet"]["port"]] == int(literal_env(sched)["FERRY_HEALTH_PORT"])
    worker = next(c for c in engine["containers"] if c["name"] == "worker")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert literal_env(worker)["FERRY_DEVICE"] == "cuda"
    for name in ("ferry-engine", "ferry-gateway"):
        pdb = by_kind("PodDisruptionBudget", name)
        owner = by_kind("StatefulSet" if name == "ferry-engine" else "Deployment", name)
        assert pdb["spec"]["selector"]["matchLabels"] == owner["spec"]["selector"]["matchLabels"]
    hpa = by_kind("HorizontalPodAutoscaler", "ferry-gateway")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "ferry-gateway"}
    assert hpa["metrics"][0]["resource"]["name"] == "cpu"
    gw = by_kind("Deployment", "ferry-gateway")["spec"]["template"]
    assert gw["spec"]["containers"][0]["resources"]["requests"]["cpu"]  # an HPA on CPU needs a request
    scrape = yaml.safe_load(by_kind("ConfigMap", "prometheus")["data"]["prometheus.yml"])
    assert scrape["scrape_configs"][0]["kubernetes_sd_configs"][0]["role"] == "pod"
    assert gw["metadata"]["annotations"]["prometheus.io/port"] == "8000"
