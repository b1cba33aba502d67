"""``loadtests.peers``: which (server, dtype) runs ``--servers`` asks for, in board order."""

from __future__ import annotations

import pytest

from loadtests.peers import server_runs


def test_every_server_runs_in_every_dtype_by_default() -> None:
    assert server_runs("vllm,ferry", ["bfloat16", "float32"]) == [
        ("vllm", "bfloat16"), ("ferry", "bfloat16"), ("vllm", "float32"), ("ferry", "float32")]


def test_a_fixed_dtype_runs_once_in_the_first_pass() -> None:
    runs = server_runs("vllm-all-cores@float32, vllm-all-cores, ferry, ferry-int8", ["bfloat16", "float16"])
    assert runs == [("vllm-all-cores", "float32"), ("vllm-all-cores", "bfloat16"), ("ferry", "bfloat16"),
                    ("ferry-int8", "bfloat16"), ("vllm-all-cores", "float16"), ("ferry", "float16"),
                    ("ferry-int8", "float16")]


def test_unknown_servers_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown server 'tgi'"):
        server_runs("ferry,tgi", ["float32"])
