"""docker-compose.yml cannot drift from the code: every ferry service's command and
environment must be accepted by that service's own argument parser, every FERRY_*
variable must name a real knob, and the topology keeps its promises (private
network, only the gateway published, a GPU reservation in the gpu profile).

No docker here: the file is parsed and checked against the parsers in-process.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = ROOT / "docker-compose.yml"
NON_CONFIG_ENV = {"FERRY_LOG_LEVEL"}

# module in the compose command -> (module holding the parser builder, its name)
PARSERS = {
    "services.scheduler": ("services.scheduler.__main__", "build_parser"),
    "services.worker": ("services.worker.service", "build_parser"),
    "services.gateway": ("services.gateway.__main__", "build_parser"),
}

_VAR = re.compile(r"\$\{(\w+)(?::?([-?])([^}]*))?\}")


def interpolate(value: Any) -> str:
    """Compose's ${VAR:-default} with an empty environment: the default, else ''."""
    return _VAR.sub(lambda m: m.group(3) if m.group(2) == "-" else "", str(value))


def load_compose() -> dict[str, Any]:
    with open(COMPOSE) as f:
        return yaml.safe_load(f)


def ferry_services() -> list[tuple[str, dict[str, Any]]]:
    services = load_compose()["services"]
    return [(name, svc) for name, svc in services.items() if svc.get("command", [""])[0] in PARSERS]


def build_parser(module: str, environ: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The service's own parser, built under exactly the container's FERRY_* environment."""
    mod_name, func = PARSERS[module]
    builder = getattr(importlib.import_module(mod_name), func)
    for key in list(os.environ):
        if key.startswith("FERRY_"):
            monkeypatch.delenv(key)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    parser: argparse.ArgumentParser = builder()
    return parser


def test_every_core_service_is_present() -> None:
    modules = {svc["command"][0] for _, svc in ferry_services()}
    assert modules == set(PARSERS)
    assert "redis" in load_compose()["services"]


@pytest.mark.parametrize("name", [name for name, _ in ferry_services()])
def test_command_and_environment_accepted_by_the_service_parser(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    svc = dict(ferry_services())[name]
    env = {k: interpolate(v) for k, v in (svc.get("environment") or {}).items()}
    module, *argv = svc["command"]
    # Building the parser converts every FERRY_* default: a bad value raises here.
    parser = build_parser(module, env, monkeypatch)
    args = parser.parse_args([interpolate(a) for a in argv])
    known = {action.dest for action in parser._actions}
    checked = 0
    for key, value in env.items():
        if not key.startswith("FERRY_") or key in NON_CONFIG_ENV:
            continue
        checked += 1
        field = key[len("FERRY_"):].lower()
        assert field in known, f"{name}: {key} is not a knob of {module}"
        parsed = getattr(args, field)
        if isinstance(parsed, bool):
            assert parsed == (value.strip().lower() in ("1", "true", "yes", "on"))
        elif isinstance(parsed, int | float):
            assert parsed == type(parsed)(value), f"{name}: {key}={value!r} parsed as {parsed!r}"
        else:
            assert parsed == value
    # Every ferry service is configured through FERRY_* variables; none checked means the
    # loop above compared nothing (a renamed key or an empty environment block).
    assert checked > 0, f"{name}: no FERRY_* knob in its environment"


def test_endpoints_meet_across_containers() -> None:
    services = load_compose()["services"]
    sched = {k: interpolate(v) for k, v in services["scheduler"]["environment"].items()}
    gateway = {k: interpolate(v) for k, v in services["gateway"]["environment"].items()}
    port = lambda ep: ep.rsplit(":", 1)[1]  # noqa: E731
    assert gateway["FERRY_SCHEDULER_ENDPOINT"] == f"tcp://scheduler:{port(sched['FERRY_GATEWAY_ENDPOINT'])}"
    for worker in ("worker", "worker-gpu"):
        env = {k: interpolate(v) for k, v in services[worker]["environment"].items()}
        assert env["FERRY_PLAN_ENDPOINT"] == f"tcp://scheduler:{port(sched['FERRY_PLAN_ENDPOINT'])}"
        assert env["FERRY_RESULT_ENDPOINT"] == f"tcp://scheduler:{port(sched['FERRY_RESULT_ENDPOINT'])}"
        assert env["FERRY_NUM_WORKERS"] == sched["FERRY_NUM_WORKERS"]
        assert env["FERRY_BLOCK_SIZE"] == sched["FERRY_BLOCK_SIZE"]


def test_only_the_gateway_is_published_and_the_backend_is_private() -> None:
    doc = load_compose()
    published = [name for name, svc in doc["services"].items() if svc.get("ports")]
    # Grafana (profile "monitoring") is the one other UI; like the gateway it binds loopback.
    assert published == ["gateway", "grafana"]
    assert interpolate(doc["services"]["grafana"]["ports"][0]).startswith("127.0.0.1:")
    assert doc["networks"]["backend"]["internal"] is True
    for name, svc in doc["services"].items():
        assert "backend" in svc["networks"], name
        if name not in ("gateway", "grafana"):
            assert svc["networks"] == ["backend"], f"{name} must stay on the private network"
    # Published on the host's loopback unless the operator says otherwise.
    assert interpolate(doc["services"]["gateway"]["ports"][0]).startswith("127.0.0.1:")


def test_health_checks_and_gpu_profile() -> None:
    services = load_compose()["services"]
    for name, svc in services.items():
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no health check"
    gpu = services["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["count"] == 1 and "gpu" in devices[0]["capabilities"]
    assert interpolate(gpu["environment"]["FERRY_DEVICE"]) == "cuda"
    assert services["worker"]["profiles"] == ["cpu"]


def test_dockerfile_runs_the_service_named_by_the_command() -> None:
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["python", "-m"]' in text
    for _, svc in ferry_services():
        module = svc["command"][0]
        assert (ROOT / module.replace(".", "/") / "__main__.py").is_file(), module


def test_every_service_has_a_memory_limit_and_a_drain_window() -> None:
    services = load_compose()["services"]
    for name, svc in services.items():
        limit = interpolate(svc["deploy"]["resources"]["limits"]["memory"])
        assert re.fullmatch(r"\d+[MG]", limit), f"{name}: memory limit {limit!r}"
    seconds = lambda v: float(str(v).removesuffix("s"))  # noqa: E731
    for name in ("scheduler", "gateway"):
        svc = services[name]
        grace = float(interpolate(svc["environment"]["FERRY_SHUTDOWN_GRACE_S"]))
        # The runtime SIGKILLs after stop_grace_period: the drain must fit inside it.
        assert seconds(svc["stop_grace_period"]) > grace + 5, name
        assert svc["init"] is True, f"{name}: SIGTERM must reach python through an init"


def test_the_build_context_holds_what_the_dockerfile_reads() -> None:
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    ignore = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*"  # everything not named below stays out (venvs, .git, results)
    sources = re.findall(r"^COPY (?!--from=)(\S+) ", text, re.M) + re.findall(r"source=([\w/]+)", text)
    assert "deploy/wheels" in sources and "services/kernels" in sources
    for src in sources:
        parents = [src, *(str(p) for p in Path(src).parents if str(p) != ".")]  # services/kernels is in !services/
        assert any(f"!{p.rstrip('/')}/" in ignore or f"!{p}" in ignore for p in parents), \
            f"{src} is excluded by .dockerignore"
        assert (ROOT / src).exists(), src


def test_the_image_carries_the_four_kernel_builds_and_no_compiler() -> None:
    """A build stage compiles every ISA build without loading it; the final stage copies the
    files and points FERRY_KERNELS_DIR at them, and installs no compiler of its own."""
    from services.kernels.build import BUILDS

    text = (ROOT / "deploy" / "Dockerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    assert [s.split("\n", 1)[0] for s in stages] == ["python:3.11-slim AS deps", "deps AS kernels", "deps"]
    deps, kernels, final = stages
    compile_line = re.search(r"^RUN python -m services.kernels.build --compile-only --out (\S+) (.*)$", kernels, re.M)
    assert compile_line and compile_line[2].split() == list(BUILDS)
    out = compile_line[1]
    assert f"COPY --from=kernels {out} {out}" in final and f"ENV FERRY_KERNELS_DIR={out}" in final
    assert "g++" in kernels and not re.search(r"g\+\+|gcc|clang|apt-get install", deps + final)


def test_the_compose_check_stands_in_for_exactly_the_base_image() -> None:
    """The check builds the Dockerfile unchanged on a stand-in tagged with its FROM name."""
    froms = re.findall(r"^FROM (\S+)(?: AS (\S+))?", (ROOT / "deploy" / "Dockerfile").read_text(), re.M)
    base = [image for image, _ in froms if image not in {stage for _, stage in froms}]  # not a stage of its own
    assert base == ["python:3.11-slim"]
    prepare = (ROOT / "deploy" / "compose-check" / "prepare.sh").read_text()
    assert f"build docker.io/library/{base[0]} " in prepare


def test_every_dashboard_query_resolves_its_grafana_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check sends the dashboard's queries to Prometheus as Grafana would: a new
    dashboard variable it does not substitute must fail here, not in a run as root."""
    spec = importlib.util.spec_from_file_location("probes", ROOT / "deploy" / "compose-check" / "probes.py")
    assert spec is not None and spec.loader is not None
    probes = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "probes", probes)  # dataclasses look their module up
    spec.loader.exec_module(probes)
    import json

    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "ferry.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) > 20
    resolved = [probes.grafana_expr(e) for e in exprs]
    assert all("$" not in e for e in resolved)
    assert 'model_name=~".*"' in resolved[0]
    with pytest.raises(ValueError):
        probes.grafana_expr("rate(x[$__unknown])")
