"""``ferry plan``: rows computed by hand, device parsing, warnings, errors, output formats."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ferry_cli import plan
from ferry_cli.plan_devices import (
    BUILTIN_DEVICES,
    GIB,
    MIB,
    parse_bytes,
    parse_device,
    parse_devices,
    with_prices,
)
from shared import capacity as cap
from tests.unit.shared.test_capacity import LLAMA2_7B, LLAMA3_8B

H100 = parse_device("h100")
ROOT = Path(__file__).resolve().parents[3]



@pytest.fixture(autouse=True)
def cpu_without_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hand-computed CPU rows assume 'auto' = float32, whatever CPU runs the tests."""
    monkeypatch.setattr(cap, "cpu_has_native_bf16", lambda *_: False)

def write_model(tmp_path: Path, config: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[dict], str]:
    rc = plan.main([*argv, "--json"])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if rc == 0 else []), out.err


def test_llama3_8b_on_h100_by_hand() -> None:
    opts = plan.PlanOptions(max_model_len=8192, concurrency=32, prompt_len=1024, output_len=512)
    row = plan.plan_device(LLAMA3_8B, H100, opts, throughput=2000.0)
    weights = 2 * 8_030_261_248
    activations = cap.activation_peak_bytes(LLAMA3_8B, "bfloat16", 2048, 32)
    budget = int(81559 * MIB * 0.9) - weights - activations - GIB
    assert row["weight_bytes"] == weights
    assert row["kv_budget_bytes"] == budget
    assert row["kv_bytes_per_token"] == 131_072
    assert row["kv_blocks"] == budget // (131_072 * 16)
    assert row["max_concurrency_at_max_model_len"] == row["kv_blocks"] // 512
    assert row["max_concurrency_at_typical"] == row["kv_blocks"] // 96
    assert row["fits"] is (row["max_concurrency_at_max_model_len"] >= 32)
    assert row["headroom_bytes"] == budget - 32 * 512 * 131_072 * 16
    assert row["usd_per_million_output_tokens"] == pytest.approx(2.50 / (2000 * 3600) * 1e6)
    assert row["throughput_source"] == "given"


def test_fp8_kv_doubles_the_blocks() -> None:
    opts = plan.PlanOptions(max_model_len=4096, concurrency=1)
    bf16 = plan.plan_device(LLAMA2_7B, H100, opts, None)
    fp8 = plan.plan_device(LLAMA2_7B, H100, plan.PlanOptions(max_model_len=4096, kv_cache_dtype="fp8"), None)
    assert fp8["kv_bytes_per_token"] * 2 == bf16["kv_bytes_per_token"] == 524_288
    assert fp8["kv_blocks"] in (2 * bf16["kv_blocks"], 2 * bf16["kv_blocks"] + 1)


def test_cpu_budget_is_exactly_the_bytes_given() -> None:
    device = parse_device("cpu:1GiB")
    assert device.memory_bytes == 1 << 30
    row = plan.plan_device(LLAMA3_8B, device, plan.PlanOptions(max_model_len=8192, dtype="float32"), None)
    # float32: a KV token is 256 KiB and a block 4 MiB.
    assert (row["dtype"], row["kv_cache_dtype"]) == ("float32", "float32")
    assert row["kv_budget_bytes"] == 1 << 30
    assert row["kv_blocks"] == 256
    assert row["max_concurrency_at_max_model_len"] == 0
    assert row["usd_per_million_output_tokens"] is None


def test_model_larger_than_the_device() -> None:
    big = {**LLAMA3_8B, "num_hidden_layers": 320}  # ~75B parameters, 150 GB in bf16
    row = plan.plan_device(big, parse_device("rtx5090"), plan.PlanOptions(max_model_len=8192), None)
    assert row["weights_fit"] is False and row["fits"] is False
    assert row["kv_blocks"] == 0 and row["headroom_bytes"] < 0
    assert "does not fit at all" in row["warnings"][0]


def test_max_model_len_larger_than_memory() -> None:
    row = plan.plan_device(LLAMA3_8B, parse_device("cpu:64MiB"), plan.PlanOptions(max_model_len=8192), None)
    assert row["kv_blocks"] == 16 and row["kv_tokens"] == 256
    assert row["max_concurrency_at_max_model_len"] == 0
    assert "cannot be held by even one sequence" in row["warnings"][0]


def test_concurrency_beyond_capacity_warns_of_preemption() -> None:
    opts = plan.PlanOptions(max_model_len=8192, concurrency=64, prompt_len=512, output_len=256)
    row = plan.plan_device(LLAMA3_8B, parse_device("cpu:8GiB"), opts, None)
    assert row["max_concurrency_at_max_model_len"] == 4  # 2048 blocks of 4 MiB, 512 per sequence
    assert row["max_concurrency_at_typical"] == 42  # 48 blocks per 768-token sequence
    assert row["fits"] is False
    assert "will force preemption even at the typical length" in row["warnings"][0]


def test_device_parsing() -> None:
    assert parse_bytes("8GiB") == 8 << 30 and parse_bytes("80GB") == 80 * 10**9 and parse_bytes("1024") == 1024
    assert parse_device("custom:L40S:48").memory_bytes == 48 * GIB
    assert [d.name for d in parse_devices([])] == [d.name for d in BUILTIN_DEVICES]
    assert [d.name for d in parse_devices(["h200,cpu:1G", "b200"])] == ["H200-141GB", "cpu:1GiB", "B200-180GB"]
    with pytest.raises(ValueError, match="unknown device"):
        parse_device("tpu-v5")
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")


def test_price_overrides() -> None:
    devices = with_prices(parse_devices(["h100,custom:mine:24"]), ["H100=4", "mine=0.25"])
    assert [d.usd_per_hour for d in devices] == [4.0, 0.25]
    with pytest.raises(ValueError, match="no device named"):
        with_prices(devices, ["a100=1"])


def test_json_output_from_a_local_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = write_model(tmp_path, LLAMA3_8B)
    rc, rows, err = run_json(["--model", model, "--concurrency", "8", "--devices", "h100,cpu:1GiB",
                              "--throughput", "h100=1500"], capsys)
    assert rc == 0 and [r["device"] for r in rows] == ["H100-SXM-80GB", "cpu:1GiB"]
    for key in ("device", "weight_bytes", "kv_bytes_per_token", "kv_blocks", "max_concurrency_at_max_model_len", "fits"):
        assert key in rows[0]
    assert rows[0]["max_model_len"] == 8192  # the model's own limit by default
    assert rows[0]["throughput_tok_s"] == 1500 and rows[1]["throughput_tok_s"] is None
    assert "cannot be held by even one sequence" in err


def test_markdown_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert plan.main(["--model", write_model(tmp_path, LLAMA2_7B), "--concurrency", "4"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| device"))
    assert "KV blocks" in header and "max conc @max_len" in header and "$/M out tok" in header
    assert sum(line.startswith("| ") for line in out.splitlines()) == 1 + len(BUILTIN_DEVICES)
    assert "6,738,415,616 parameters" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--concurrency", "0"], "--concurrency must be at least 1"),
        (["--prompt-len", "8000", "--output-len", "1000"], "exceeds max_model_len 8192"),
        (["--devices", "tpu"], "unknown device"),
        (["--gpu-memory-utilization", "1.5"], "gpu-memory-utilization"),
    ],
)
def test_bad_input_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    rc, _, err = run_json(["--model", write_model(tmp_path, LLAMA3_8B), *argv], capsys)
    assert rc == 2 and message in err and "Traceback" not in err


def test_unknown_model_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_json(["--model", "no/such/model"], capsys)
    assert rc == 2 and "never downloads models" in err


def test_builtin_gguf_plan_never_imports_torch() -> None:
    code = (
        "import sys, json, io, contextlib\n"
        "from ferry_cli.main import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        "    rc = main(['plan', '--model', 'smollm2-135m-instruct', '--devices', 'cpu:1GiB', '--dtype', 'float32', '--json'])\n"
        "print(json.dumps({'rc': rc, 'rows': json.loads(buf.getvalue()),"
        " 'torch': 'torch' in sys.modules, 'transformers': 'transformers' in sys.modules}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    result = json.loads(out.stdout)
    assert result["rc"] == 0 and result["torch"] is False and result["transformers"] is False
    row = result["rows"][0]
    assert row["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4  # float32
    assert row["kv_blocks"] == (1 << 30) // (23_040 * 2 * 16)
    assert row["weight_bytes"] == 134_515_008 * 4


def test_cpu_budgets_are_named_readably() -> None:
    from ferry_cli.plan_devices import readable_size

    assert parse_device("cpu:16GiB").name == "cpu:16GiB"
    assert parse_device("cpu:17179869184").name == "cpu:16GiB"
    assert readable_size(1536 << 20) == "1536MiB"
    assert readable_size(1000) == "1000B"


def test_tensor_parallel_2_llama3_8b_on_h100_by_hand(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Per device: the projections halve, embeddings/norms/LM head stay whole, KV per token halves."""
    opts = plan.PlanOptions(max_model_len=8192, concurrency=32, prompt_len=1024, output_len=512,
                            tensor_parallel_size=2)
    row = plan.plan_device(LLAMA3_8B, H100, opts, throughput=2000.0)
    # embeddings + LM head (2 x 128256 x 4096) + norms (65 x 4096), whole on each device
    whole = 2 * 525_336_576 + 266_240
    # attention (32 x 41,943,040) + MLP (32 x 3 x 4096 x 14336), split in two
    split = (1_342_177_280 + 5_637_144_576) // 2
    weights = 2 * (whole + split)
    assert weights == 9_081_200_640
    # per token: 3 x 4096 hidden + (16 + 2 x 4) heads x 128 + 3 x 7168 intermediate, 2048 tokens, bf16;
    # plus fp32 logits and probabilities for 32 rows of 128256
    activations = 2048 * (12_288 + 3_072 + 21_504) * 2 + 2 * 32 * 128_256 * 4
    assert activations == 183_828_480
    budget = int(81559 * MIB * 0.9) - weights - activations - GIB
    assert row["device"] == f"2x {H100.name}" and row["tensor_parallel_size"] == 2
    assert row["weight_bytes"] == weights
    assert row["activation_peak_bytes"] == activations
    assert row["kv_budget_bytes"] == budget
    assert row["kv_bytes_per_token"] == 65_536  # 8 KV heads split in two
    assert row["kv_blocks"] == budget // (65_536 * 16)
    assert row["usd_per_million_output_tokens"] == pytest.approx(2 * 2.50 / (2000 * 3600) * 1e6)
    single = plan.plan_device(LLAMA3_8B, H100, plan.PlanOptions(max_model_len=8192, concurrency=32), None)
    assert row["kv_blocks"] > 2 * single["kv_blocks"]  # half the KV per token and less weight per device
    # the flag, and a size the model cannot be split by
    model = write_model(tmp_path, LLAMA3_8B)
    rc, rows, _ = run_json(["--model", model, "--devices", "h100", "--tensor-parallel-size", "2",
                            "--max-model-len", "8192"], capsys)
    assert rc == 0 and rows[0]["kv_bytes_per_token"] == 65_536
    rc, _, err = run_json(["--model", model, "--devices", "h100", "--tensor-parallel-size", "3"], capsys)
    assert rc == 2 and "does not divide the model's attention heads (32)" in err


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # tied LM head and no biases; untied with q/k/v biases
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_weights_equal_the_quantized_worker_model(kind: str, dtype: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`ferry plan --quantization int8` predicts the bytes the worker's int8 model really holds."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.worker.model.quantize import Int8Linear, apply_int8
    from services.worker.runner import _weight_bytes
    from tests.conftest import cached_tiny_model

    folder = cached_tiny_model(kind)
    config = json.loads((folder / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    fused, quantized = apply_int8(model, model.model, config["vocab_size"], None)  # what the worker does
    assert fused == 2 * config["num_hidden_layers"] and quantized == 4 * config["num_hidden_layers"]
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == quantized
    assert cap.int8_weight_bytes(config, dtype) == _weight_bytes(model)
    rc, rows, _ = run_json(["--model", str(folder), "--quantization", "int8", "--devices", "cpu:64MiB",
                            "--max-model-len", "1024", "--dtype", dtype], capsys)
    assert rc == 0 and rows[0]["weight_bytes"] == _weight_bytes(model)
    # SmolLM2-135M by hand, in bfloat16: 30 layers x (576 x (576 + 2 x 192) + 576 x 576 + 3 x 576 x 1536)
    # int8 weights, float32 per output and input channel of the 4 int8 layers (q/k/v and gate/up fused),
    # and the bfloat16 embedding (the tied LM head) + 61 norms of 576.
    smol = plan.load_planned_model("smollm2-135m-instruct").config
    body = 30 * (576 * 960 + 576 * 576 + 3 * 576 * 1536)
    channels = 30 * ((576 + 960) + (576 + 576) + (576 + 3072) + (1536 + 576))
    assert cap.int8_weight_bytes(smol, "bfloat16") == body + 4 * channels + 2 * (49152 * 576 + 61 * 576) == 163_875_456


def test_a_windowed_model_counts_its_windowed_layers_by_their_window() -> None:
    """Gemma-3's layout (five layers in six with a window of 1,024): the worker's hybrid KV cache
    keeps a window's blocks for those, so many more long sequences fit than if every layer kept
    every block; the row says how the budget splits."""
    gemma3 = dict(LLAMA3_8B, model_type="gemma3_text", sliding_window=1024,
                  layer_types=["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(32)])
    device = parse_device("cpu:8GiB")
    opts = plan.PlanOptions(max_model_len=8192, dtype="bfloat16", concurrency=8)
    plain = plan.plan_device(LLAMA3_8B, device, opts, None)
    row = plan.plan_device(gemma3, device, opts, None)
    h = row["hybrid_kv"]
    assert h is not None and h["window"] == 1024 and h["window_layers"] == 27
    assert plain["hybrid_kv"] is None
    # per sequence at 8,192 tokens: 5 x 512 + 27 x 65 layer-blocks against 32 x 512, 3.8x fewer
    assert row["max_concurrency_at_max_model_len"] >= 3 * plain["max_concurrency_at_max_model_len"] > 0
    # by hand: bfloat16 block of 16 tokens, one layer: 2 x 16 x 8 x 128 x 2 bytes = 64 KiB
    layer_block = 64 << 10
    assert (h["global_blocks"] * 5 + h["window_blocks"] * 27) * layer_block <= row["kv_budget_bytes"]
    at_max = min(h["global_blocks"] // 512, (h["window_blocks"] - 128) // 65)
    assert row["max_concurrency_at_max_model_len"] == at_max
    wide = plan.plan_device(dict(gemma3, sliding_window=8192), device, opts, None)  # window = max_model_len
    assert wide["hybrid_kv"] is None
