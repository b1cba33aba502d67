"""The memory view of an experiment: measured beside ferry plan's prediction."""

from __future__ import annotations

from loadtests.memory_view import measured, predicted
from loadtests.trace import Trace, TraceRequest


def test_measured_takes_peaks_and_sums_preemptions() -> None:
    entry = {"runs": [{"summary": {"peak_kv_blocks_used": 10.0, "kv_blocks_total": 100.0, "peak_kv_usage": 0.1,
                                   "preemptions": 2.0, "peak_memory_bytes": 5.0}},
                      {"summary": {"peak_kv_blocks_used": 30.0, "kv_blocks_total": 100.0, "peak_kv_usage": 0.3,
                                   "preemptions": 1.0, "peak_memory_bytes": 4.0}}],
             "server": {"info": {"/v1/config": {"workers": [{"weight_bytes": 1234, "num_kv_blocks": 100}]}}}}
    view = measured(entry)
    assert view == {"weight_bytes": 1234, "kv_blocks_total": 100.0, "peak_kv_blocks_used": 30.0,
                    "peak_kv_usage": 0.3, "preemptions": 3.0, "peak_memory_bytes": 5.0}
    assert measured({"runs": [{"summary": {"preemptions": None}}]})["preemptions"] is None


def test_prediction_uses_the_configurations_kv_budget() -> None:
    reqs = [TraceRequest(id=f"r{i}", max_tokens=64, prompt="x", prompt_tokens=192) for i in range(4)]
    trace = Trace(requests=reqs, meta={})
    small = predicted("smollm2-135m-instruct", ("--kv-cache-memory", "67108864"), {"dtype": "float32"}, trace)
    big = predicted("smollm2-135m-instruct", (), {"kv_cache_memory": 268435456, "dtype": "float32"}, trace)
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x (K+V) x 4 bytes = 46,080 bytes a token, 737,280 a block.
    assert small["kv_blocks"] == 67108864 // 737280 == 91
    assert big["kv_blocks"] == 268435456 // 737280
    assert small["typical_len"] == 256 and small["max_concurrency_at_typical"] == 91 // 16
    assert 130e6 * 4 < small["weight_bytes"] < 140e6 * 4  # ~135M parameters in float32
    assert "--devices cpu:67108864" in small["command"]
