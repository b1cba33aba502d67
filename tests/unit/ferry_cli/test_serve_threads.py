"""``ferry serve``'s thread budget: the environment each child starts with (no process is started)."""

from __future__ import annotations

import pytest

from ferry_cli.serve import Stack, build_parser


def stack(monkeypatch: pytest.MonkeyPatch, *flags: str, **env: str) -> Stack:
    for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "GLIBC_TUNABLES"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = build_parser().parse_args(["--num-workers", "2", *flags])
    return Stack(args, "/tmp/ferry-test-runtime", "unix:///tmp/none.sock")


def test_workers_get_the_cores_and_sleep_at_barriers(monkeypatch: pytest.MonkeyPatch) -> None:
    s = stack(monkeypatch, "--num-threads", "3")
    workers = s.by_role("worker")
    assert len(workers) == 2
    for w in workers:
        assert w.env["OMP_NUM_THREADS"] == "3" and w.env["MKL_NUM_THREADS"] == "3"
        assert w.env["GOMP_SPINCOUNT"] == "10000" and "OMP_WAIT_POLICY" not in w.env
        assert "--num-threads" in w.cmd and w.cmd[w.cmd.index("--num-threads") + 1] == "3"
    for light in s.by_role("scheduler") + s.by_role("gateway"):
        for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS"):
            assert light.env[key] == "1", (light.name, key)
        assert light.env["TOKENIZERS_PARALLELISM"] == "false"
        assert "OMP_WAIT_POLICY" not in light.env
        assert "GLIBC_TUNABLES" not in light.env  # huge pages for the workers' memory only


def test_workers_memory_on_huge_pages_unless_the_operator_says_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    assert all(w.env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1" for w in stack(monkeypatch).by_role("worker"))
    s = stack(monkeypatch, GLIBC_TUNABLES="glibc.malloc.hugetlb=0")
    assert all(w.env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0" for w in s.by_role("worker"))


def test_an_operators_openmp_policy_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    s = stack(monkeypatch, GOMP_SPINCOUNT="500")
    for w in s.by_role("worker"):
        assert "OMP_WAIT_POLICY" not in w.env and w.env["GOMP_SPINCOUNT"] == "500"
    s = stack(monkeypatch, OMP_WAIT_POLICY="PASSIVE")
    assert all(w.env["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in w.env for w in s.by_role("worker"))


def test_a_worker_started_any_other_way_gets_the_same_default() -> None:
    from services.worker.service import default_openmp_wait_policy

    env: dict[str, str] = {}
    default_openmp_wait_policy(env)
    assert env == {"GOMP_SPINCOUNT": "10000"}
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "5000"}):
        env = dict(chosen)
        default_openmp_wait_policy(env)
        assert env == chosen


@pytest.mark.parametrize("chosen", [{}, {"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "5000"}])
def test_the_offline_engine_gets_it_before_torch_loads(chosen: dict[str, str]) -> None:
    """Importing the engine package (offline.LLM, its benchmarks) sets the served worker's
    default before anything loads torch (libgomp reads it then); an operator's choice stays."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | chosen
    code = ("import json, os, sys; import services.engine; "
            "print(json.dumps([os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), "
            "'torch' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    policy, spin, torch_loaded = json.loads(out.stdout)
    assert not torch_loaded  # set before torch: the package itself loads none of it
    assert (policy, spin) == ((chosen.get("OMP_WAIT_POLICY"), chosen.get("GOMP_SPINCOUNT")) if chosen else (None, "10000"))
