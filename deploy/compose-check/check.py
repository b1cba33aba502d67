"""``make compose-check``: docker-compose.yml started for real with podman and podman-compose.

Run as root after prepare.sh (the Makefile does both). Builds the ferry image from
deploy/Dockerfile, brings the whole stack up under its own project name and free host
ports, and checks, step by step: the health checks, a chat completion and a stream
through the published gateway port, Prometheus scraping /metrics, the provisioned
dashboard's queries, the worker's CPU kernels (a prebuilt build from the image, so the
fast attention rather than the reference), the worker container killed mid-stream (the engine recovers and
the stream completes), a graceful drain when the gateway is stopped mid-stream,
``down`` leaving nothing, and a second ``up`` that reuses the converted model from the
cache volume. Prints a summary and writes results/compose-check.json; container logs
go to results/compose-check/. Exit code 0 only when every step passed.

Standard library only: it runs with the host's python3.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
import traceback
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probes import chat, dashboard_queries, http_json, prom_value, stream_completion, wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "ferry-check"
IMAGE = "localhost/ferry:compose-check"
MODEL = "smollm2-135m-instruct"
SERVICES = ["redis", "scheduler", "worker", "gateway", "prometheus"]
GRAFANA_BLOCKED = (
    "no Grafana image or package can be had on this machine: no container registry is "
    "reachable (grafana/grafana cannot be pulled), Debian ships no grafana package, Grafana's "
    "own apt repository is not reachable, and the PyPI and npm packages named 'grafana' are "
    "placeholders (PyPI grafana 0.0.1, npm grafana 1.0.1 'a placeholder ... for @types/grafana'). "
    "The grafana service was not started; its provisioned dashboard's every query was sent to "
    "the stack's Prometheus instead, exactly as Grafana's data source would send it."
)


class Check:
    def __init__(self, env: dict[str, str], compose: str, out: Path, logs: Path) -> None:
        self.env, self.compose, self.out, self.logs = env, compose, out, logs
        self.steps: list[dict[str, Any]] = []
        self.facts: dict[str, Any] = {}
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.env["FERRY_PUBLISH"] = f"127.0.0.1:{self.port}"
        self.env["GRAFANA_PUBLISH"] = f"127.0.0.1:{free_port()}"
        self.env["FERRY_IMAGE"] = IMAGE
        # A shared, loaded machine: one torch thread (two threads contending for a share of
        # a core spin against each other: steps took seconds with 2 at load 15).
        self.env.setdefault("FERRY_NUM_THREADS", "1")
        # Streams here run at seconds per token under load: give the drain room to finish.
        self.env.setdefault("FERRY_SHUTDOWN_GRACE_S", "25")

    # --- running things -------------------------------------------------------------
    def sh(self, *cmd: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        with open(self.logs / "commands.log", "a") as log:
            log.write(f"$ {' '.join(cmd)}\n")
            proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
            log.write(proc.stdout[-4000:] + proc.stderr[-4000:] + f"[rc {proc.returncode}]\n")
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:4])}... exited {proc.returncode}: {proc.stderr[-1500:]}")
        return proc

    def podman(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.sh("podman", *args, **kw)

    def compose_cmd(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.sh(self.compose, "-p", PROJECT, "-f", str(ROOT / "docker-compose.yml"),
                       "--profile", "cpu", "--profile", "monitoring", *args, **kw)

    @contextmanager
    def step(self, name: str, required: bool = True) -> Iterator[dict[str, Any]]:
        record: dict[str, Any] = {"step": name, "ok": False}
        start = time.monotonic()
        print(f"compose-check: {name} ...", flush=True)
        try:
            yield record
            record["ok"] = True
        except Exception as e:  # a failed step is recorded; later steps still run where they can
            record["error"] = f"{type(e).__name__}: {e}"
            (self.logs / f"step-{len(self.steps):02d}-traceback.txt").write_text(traceback.format_exc())
            if required:
                self.collect_logs(f"failed-{len(self.steps):02d}")
        finally:
            if not record["ok"]:
                record.setdefault("error", "interrupted")
            record["seconds"] = round(time.monotonic() - start, 1)
            self.steps.append(record)
            mark = "ok" if record["ok"] else f"FAILED ({record.get('error')})"
            print(f"compose-check: {name}: {mark} [{record['seconds']}s]", flush=True)

    # --- the project's containers ---------------------------------------------------
    def containers(self, all_states: bool = True) -> dict[str, dict[str, Any]]:
        """service -> podman's JSON record of its container, for this project."""
        args = ["ps", "--format", "json", "--filter", f"label=io.podman.compose.project={PROJECT}"]
        found = json.loads(self.podman(*args, *(["-a"] if all_states else [])).stdout or "[]")
        return {c["Labels"]["com.docker.compose.service"]: c for c in found}

    def name(self, service: str) -> str:
        return str(self.containers()[service]["Names"][0])

    def inspect(self, service: str) -> dict[str, Any]:
        record: dict[str, Any] = json.loads(self.podman("inspect", self.name(service)).stdout)[0]
        return record

    def health(self, service: str) -> str:
        """Runs the service's compose health check once (podman 4.3 schedules them with
        systemd timers, and this machine has no systemd) and returns the status."""
        self.podman("healthcheck", "run", self.name(service), check=False, timeout=60)
        state = self.inspect(service)["State"]
        return str((state.get("Health") or state.get("Healthcheck") or {}).get("Status", "none"))

    def prom(self, path: str, params: dict[str, str]) -> dict[str, Any]:
        url = f"http://127.0.0.1:9090{path}?{urllib.parse.urlencode(params)}"
        proc = self.podman("exec", self.name("prometheus"), "wget", "-q", "-O", "-", url, timeout=60)
        answer: dict[str, Any] = json.loads(proc.stdout)
        return answer

    def prom_many(self, queries: list[tuple[str, dict[str, str]]]) -> list[dict[str, Any]]:
        """Each query on one line of one wget loop inside the Prometheus container."""
        urls = "".join(f"http://127.0.0.1:9090{path}?{urllib.parse.urlencode(params)}\n" for path, params in queries)
        proc = subprocess.run(["podman", "exec", "-i", self.name("prometheus"), "sh", "-c",
                               'while read -r u; do r=$(wget -q --content-on-error -O - "$u"); '
                               'if [ -n "$r" ]; then echo "$r"; else echo \'{"status": "no answer"}\'; fi; done'],
                              input=urls, env=self.env, capture_output=True, text=True, timeout=300, check=True)
        answers = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
        if len(answers) != len(queries):
            raise RuntimeError(f"{len(queries)} queries, {len(answers)} answers: {proc.stderr[-500:]}")
        return answers

    def collect_logs(self, tag: str) -> None:
        for service, ctr in self.containers().items():
            proc = self.podman("logs", ctr["Names"][0], check=False, timeout=60)
            (self.logs / f"{tag}-{service}.log").write_text(proc.stdout + proc.stderr)

    def worker_log(self) -> str:
        proc = self.podman("logs", self.name("worker"), check=False, timeout=60)
        return proc.stdout + proc.stderr

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=io.podman.compose.project={PROJECT}"
        ctrs = json.loads(self.podman("ps", "-a", "--format", "json", "--filter", label).stdout or "[]")
        nets = self.podman("network", "ls", "--format", "{{.Name}}").stdout.split()
        pods = self.podman("pod", "ps", "--format", "{{.Name}}").stdout.split()
        return {"containers": [c["Names"][0] for c in ctrs],
                "networks": [n for n in nets if n.startswith(PROJECT)],
                "pods": [p for p in pods if PROJECT in p]}

    # --- the scenario ---------------------------------------------------------------
    def up_and_ready(self, label: str) -> None:
        with self.step(f"{label}: compose up ({', '.join(SERVICES)})") as r:
            proc = self.compose_cmd("up", "-d", *SERVICES, timeout=900)
            r["compose_warnings"] = sorted({line for line in proc.stderr.splitlines() if "WARNING" in line})
            running = {s: c["State"] for s, c in self.containers().items()}
            r["containers"] = running
            missing = [s for s in SERVICES if running.get(s) != "running"]
            if missing:
                raise AssertionError(f"not running: {missing}")
        with self.step(f"{label}: health checks pass") as r:
            waits = {}
            for service in ["redis", "scheduler", "gateway", "worker", "prometheus"]:
                def healthy(service: str = service) -> bool:
                    return self.health(service) == "healthy"
                waits[service] = round(wait_until(f"{service} healthy", healthy, 600, 3), 1)
            r["seconds_until_healthy"] = waits
        with self.step(f"{label}: gateway /ready through the published port") as r:
            r["seconds"] = wait_until("gateway /ready", lambda: http_json(f"{self.base}/ready", timeout=5)[0] == 200,
                                      600, 2)
            r["published"] = self.base

    def requests(self, label: str) -> None:
        with self.step(f"{label}: chat completion through {self.base}") as r:
            r.update(chat(self.base, MODEL, "Name three colours.", max_tokens=24))
        with self.step(f"{label}: streamed completion") as r:
            s = stream_completion(self.base, MODEL, "Once upon a time", max_tokens=32, ignore_eos=True)
            r.update(s.as_dict())
            if not (s.done and s.finish_reason == "length" and not s.errors and s.usage
                    and s.usage["completion_tokens"] == 32):
                raise AssertionError(f"stream incomplete: {s.as_dict()}")

    def monitoring(self) -> None:
        with self.step("Prometheus scrapes the gateway's /metrics") as r:
            def scraped() -> bool:
                return bool(prom_value(self.prom, "ferry:num_requests_running"))
            r["seconds_until_scraped"] = round(wait_until("ferry:num_requests_running in Prometheus", scraped, 120, 3), 1)
            r["ferry:num_requests_running"] = prom_value(self.prom, "ferry:num_requests_running")
            r["up"] = prom_value(self.prom, 'up{job="ferry-gateway"}')
            # The first scrape may fall mid-stream: wait for one after the 32 streamed tokens.
            def counted() -> bool:
                total = prom_value(self.prom, "max(ferry:generation_tokens_total)")
                return bool(total) and float(total[0]["value"][1]) >= 32
            r["seconds_until_counted"] = round(wait_until("the streamed tokens in Prometheus", counted, 60, 2), 1)
            generated = prom_value(self.prom, "max(ferry:generation_tokens_total)")
            r["ferry:generation_tokens_total"] = generated
            steps = prom_value(self.prom, "max(ferry:iteration_duration_seconds_sum) / max(ferry:iteration_duration_seconds_count)")
            r["mean_step_seconds"] = round(float(steps[0]["value"][1]), 3) if steps else None
            if not r["up"] or r["up"][0]["value"][1] != "1" or float(generated[0]["value"][1]) < 32:
                raise AssertionError("the gateway target is not up, or the tokens generated are not counted")
        with self.step("Grafana: provisioned dashboard listed by its HTTP API", required=False) as r:
            r["status"] = "blocked"
            r["reason"] = GRAFANA_BLOCKED
            raise RuntimeError("blocked: no Grafana image (see reason)")
        with self.step("dashboard panels' queries return data (sent to Prometheus as Grafana would)") as r:
            time.sleep(12)  # two more scrapes, so rate() over the requests above has two points
            result = dashboard_queries(ROOT / "deploy/grafana/dashboards/ferry.json", self.prom_many, 600)
            r.update({k: v for k, v in result.items() if k != "detail"})
            (self.logs / "dashboard-queries.json").write_text(json.dumps(result, indent=1))
            if result["queries_ok"] != result["queries"]:
                raise AssertionError(f"{result['queries'] - result['queries_ok']} dashboard queries failed")
            if result["panels_with_data"] < result["panels"] - 2:
                raise AssertionError(f"only {result['panels_with_data']} of {result['panels']} panels have data")
            served = {"Token throughput", "Time to first token", "End-to-end latency", "Requests by finish reason"}
            if not served <= set(result["panels_with_nonzero"]):
                raise AssertionError(f"no traffic shown by {sorted(served - set(result['panels_with_nonzero']))}")

    def kernels(self) -> None:
        with self.step("the worker loaded a prebuilt CPU kernel build, not the reference attention") as r:
            log = self.worker_log()
            # services/kernels/build.py's line: "CPU kernels: the amx build (...; prebuilt, /opt/ferry/kernels) ..."
            lines = [line for line in log.splitlines() if "CPU kernels: the " in line]
            r["kernels_log"] = [line[-400:] for line in lines[:2]]
            r["attention_backends"] = sorted(set(re.findall(r"attention backend: (\w+)", log)))
            if not any("prebuilt, /opt/ferry/kernels" in line for line in lines):
                raise AssertionError(f"no prebuilt kernel build loaded from /opt/ferry/kernels: {r['kernels_log']}")
            if r["attention_backends"] != ["cpu_paged"]:
                raise AssertionError(f"the worker serves with {r['attention_backends']}, not cpu_paged")

    def kill_worker_mid_stream(self) -> None:
        with self.step("worker container killed mid-stream: the engine recovers") as r:
            before = self.inspect("worker")
            killed: dict[str, Any] = {}

            def kill() -> None:
                # SIGKILL to the worker's python from the host, as the kernel's OOM killer
                # or a segfault would end it. (`podman kill` and `docker kill` count as a
                # manual stop: the restart policy then leaves the container down.)
                init = int(before["State"]["Pid"])  # the container's init (compose init: true)
                children = Path(f"/proc/{init}/task/{init}/children").read_text().split()
                killed["pids"] = children
                killed["at"] = time.monotonic()
                for pid in children:
                    os.kill(int(pid), 9)

            s = stream_completion(self.base, MODEL, "The history of the river", max_tokens=40, ignore_eos=True,
                                  at_chunk=6, action=kill, timeout_s=600)
            after = self.inspect("worker")
            r.update(s.as_dict())
            r["restart_count"] = [before.get("RestartCount", 0), after.get("RestartCount", 0)]
            r["worker_pid"] = [before["State"]["Pid"], after["State"]["Pid"]]
            r["killed_pids"] = killed.get("pids")
            if not killed:
                raise AssertionError("the stream ended before the kill")
            if not (s.done and not s.errors and s.usage and s.usage["completion_tokens"] == 40):
                raise AssertionError(f"the stream did not survive the worker kill: {s.as_dict()}")
            if after["State"]["Pid"] == before["State"]["Pid"]:
                raise AssertionError("the worker was not restarted")
            restarts = prom_value(self.prom, "max(ferry:worker_restarts_total)")
            r["ferry:worker_restarts_total"] = restarts
            # The container's log spans both processes: one conversion, the first start's.
            r["worker_log_converting_count"] = self.worker_log().count("converting ")
            if r["worker_log_converting_count"] != 1:
                raise AssertionError("the restarted worker converted the model again")
        with self.step("after the worker restart: chat completion") as r:
            r.update(chat(self.base, MODEL, "Say hello.", max_tokens=8))

    def drain_on_stop(self) -> None:
        with self.step("gateway stopped mid-stream: the in-flight stream drains") as r:
            stopped: dict[str, float] = {}

            def stop() -> None:
                t0 = time.monotonic()
                # podman stop blocks until the container exits; the stream is read meanwhile
                # by the same thread, so stop in the background and time it from here.
                stopped["proc"] = subprocess.Popen(  # type: ignore[assignment]
                    ["podman", "stop", "--time", "30", self.name("gateway")], env=self.env,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                stopped["t0"] = t0

            s = stream_completion(self.base, MODEL, "A long list of fruits:", max_tokens=16, ignore_eos=True,
                                  at_chunk=3, action=stop)
            proc: Any = stopped["proc"]
            proc.wait(timeout=60)
            r["stop_seconds"] = round(time.monotonic() - stopped["t0"], 1)
            r.update(s.as_dict())
            state = self.inspect("gateway")["State"]
            r["exit_code"] = state.get("ExitCode")
            log = self.podman("logs", self.name("gateway"), check=False).stderr
            log += self.podman("logs", self.name("gateway"), check=False).stdout
            r["uvicorn_finished"] = "Finished server process" in log
            if not (s.done and s.usage and s.usage["completion_tokens"] == 16):
                raise AssertionError(f"the stream was cut by the stop: {s.as_dict()}")
            # uvicorn re-raises the SIGTERM it handled once it has shut down, so a drained
            # gateway exits 143 (by the signal) or 0; 137 would be the runtime's SIGKILL.
            if state.get("ExitCode") not in (0, 143) or not r["uvicorn_finished"]:
                raise AssertionError(f"gateway exit code {state.get('ExitCode')}, not a finished drain")

    def resources(self) -> None:
        with self.step("resource use and limits", required=False) as r:
            stats = json.loads(self.podman("stats", "--no-stream", "--format", "json").stdout or "[]")
            names = {c["Names"][0]: s for s, c in self.containers().items()}
            r["stats"] = {names.get(x.get("name", ""), x.get("name")): {
                "mem_usage": x.get("mem_usage"), "cpu_percent": x.get("cpu_percent"), "pids": x.get("pids")}
                for x in stats if x.get("name") in names}
            r["memory_limits"] = {s: self.inspect(s)["HostConfig"].get("Memory") for s in SERVICES}

    def down(self, label: str, volumes: bool) -> None:
        with self.step(f"{label}: compose down leaves nothing") as r:
            self.compose_cmd("down", *(["-v"] if volumes else []), timeout=300)
            left = self.leftovers()
            r["left"] = left
            vols = self.podman("volume", "ls", "--format", "{{.Name}}").stdout.split()
            r["volumes"] = [v for v in vols if v.startswith(PROJECT)]
            if any(left.values()):
                raise AssertionError(f"left behind: {left}")

    def run(self) -> bool:
        self.facts["versions"] = {
            "podman": self.podman("version", "--format", "{{.Client.Version}}").stdout.strip(),
            "podman-compose": [line for line in self.sh(self.compose, "version", check=False).stdout.splitlines()
                               if "podman-compose" in line][:1],
            "runc": self.sh("runc", "--version").stdout.splitlines()[0],
        }
        self.compose_cmd("down", "-v", timeout=300, check=False)  # a clean slate: fresh volumes
        with self.step("build the ferry image from deploy/Dockerfile") as r:
            r.update(self.build())
            if r["user"] != "ferry":
                raise AssertionError(f"the image runs as {r['user']!r}, not the unprivileged user ferry")
        if not self.steps[-1]["ok"]:
            return False
        self.up_and_ready("first up (empty model cache)")
        if all(s["ok"] for s in self.steps):
            self.requests("first up")
            self.steps[-1]["worker_log_converting_count"] = self.worker_log().count("converting ")
            self.kernels()
            self.monitoring()
            self.resources()
            self.kill_worker_mid_stream()
            self.drain_on_stop()
        self.collect_logs("first-up")
        self.down("first up", volumes=False)
        self.up_and_ready("second up (model cache volume kept)")
        with self.step("second up: the model is not converted again") as r:
            r["worker_log_converting_count"] = self.worker_log().count("converting ")
            if r["worker_log_converting_count"]:
                raise AssertionError("the worker converted the model again")
            r.update(chat(self.base, MODEL, "Name a fruit.", max_tokens=8))
        self.collect_logs("second-up")
        self.down("second up", volumes=True)
        return all(s["ok"] for s in self.steps if s["step"] != "resource use and limits" and "Grafana" not in s["step"])

    def build(self) -> dict[str, Any]:
        """podman build of deploy/Dockerfile as users run it, with the local CPU torch wheel
        offered through deploy/wheels (the PyTorch index is not reachable here)."""
        wheels = ROOT / "deploy" / "wheels"
        linked = []
        for wheel in Path(self.env.get("FERRY_CHECK_WHEELS", "/opt/wheels")).glob("torch-2.13.0+cpu-*.whl"):
            target = wheels / wheel.name
            if not target.exists():
                try:
                    os.link(wheel, target)
                except OSError:
                    target.write_bytes(wheel.read_bytes())
                linked.append(target)
        offered = sorted(p.name for p in wheels.glob("*.whl"))
        start = time.monotonic()
        try:
            # PyPI is reached through a TLS proxy whose CA only the host's bundle has: the
            # RUN steps see that bundle (a build-time mount; the image keeps its own).
            ca = self.env.get("FERRY_CHECK_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt")
            self.podman("build", "--pull=never", "--network", "host", "--build-arg", "TORCH_INDEX=",
                        "--volume", f"{ca}:/etc/ssl/certs/ca-certificates.crt:ro",
                        "-f", str(ROOT / "deploy/Dockerfile"), "-t", IMAGE, str(ROOT), timeout=3600)
        finally:
            for target in linked:
                target.unlink()
        info = json.loads(self.podman("image", "inspect", IMAGE).stdout)[0]
        history = json.loads(self.podman("history", "--format", "json", IMAGE).stdout)
        return {
            "seconds": round(time.monotonic() - start, 1), "image": IMAGE,
            "size_mb": round(info["Size"] / 1e6), "user": info["Config"].get("User"),
            "layers": [{"mb": round(h["size"] / 1e6, 1), "created_by": h["CreatedBy"][:120]}
                       for h in history if h.get("size")],
            "wheels_offered": offered,
        }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", nargs="*", default=[], help="KEY=VALUE lines printed by prepare.sh")
    parser.add_argument("--out", default=str(ROOT / "results/compose-check.json"))
    args = parser.parse_args()
    env = dict(os.environ)
    env.update(line.split("=", 1) for line in args.env if "=" in line)
    out = Path(args.out)
    logs = out.parent / "compose-check"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "commands.log").write_text("")
    check = Check(env, env["PODMAN_COMPOSE"], out, logs)
    started = time.time()
    passed: bool = False
    try:
        passed = check.run()
    finally:
        check.compose_cmd("down", "-v", timeout=300, check=False)  # never leave the stack running
        report = {
            "passed": passed, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "minutes": round((time.time() - started) / 60, 1), "host": socket.gethostname(),
            "load_average": os.getloadavg(), **check.facts,
            "stand_in_images": {"python:3.11-slim": "debootstrap bookworm + Debian python3.11 (prepare.sh)",
                                "redis": env.get("FERRY_REDIS_IMAGE"), "prometheus": env.get("FERRY_PROMETHEUS_IMAGE")},
            "grafana": {"status": "blocked", "reason": GRAFANA_BLOCKED},
            "steps": check.steps, "logs": str(logs), "json": str(out),
        }
        out.write_text(json.dumps(report, indent=1))
        summarise(report)
    return 0 if passed else 1


def summarise(report: dict[str, Any]) -> None:
    print("\ncompose-check summary")
    for s in report["steps"]:
        mark = "PASS" if s["ok"] else ("BLOCKED" if s.get("status") == "blocked" else "FAIL")
        print(f"  {mark:7} {s['step']} [{s['seconds']}s]" + (f"  -- {s.get('error')}" if not s["ok"] else ""))
    by_name = {s["step"]: s for s in report["steps"]}

    def fact(step: str, key: str) -> Any:
        return next((s.get(key) for name, s in by_name.items() if name.startswith(step)), None)

    print(f"  image: {fact('build', 'size_mb')} MB, user {fact('build', 'user')}; "
          f"first start healthy after {fact('first up (empty model cache): health', 'seconds')} s "
          f"(model conversion), second after {fact('second up (model cache volume kept): health', 'seconds')} s")
    print(f"  worker killed mid-stream: longest stream gap {fact('worker container killed', 'longest_gap_s')} s, "
          f"restarts {fact('worker container killed', 'restart_count')}; gateway stop drained in "
          f"{fact('gateway stopped', 'stop_seconds')} s, exit {fact('gateway stopped', 'exit_code')}; "
          f"mean engine step {fact('Prometheus', 'mean_step_seconds')} s")
    stats = fact("resource use", "stats") or {}
    print("  memory: " + ", ".join(f"{k} {v['mem_usage'].split(' /')[0]}" for k, v in stats.items()))
    print(f"  {'PASSED' if report['passed'] else 'FAILED'} in {report['minutes']} min "
          f"(load average {report['load_average'][0]:.1f}); Grafana: {report['grafana']['status']}; "
          f"JSON: {report['json']}")


if __name__ == "__main__":
    sys.exit(main())
