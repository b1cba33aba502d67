"""Every ``FERRY_*`` environment variable, declared once: name, default, values, meaning.

Two kinds:

- **Switches** (``SWITCHES``): choices no config field carries: the CPU fast paths'
  A/B switches, logging defaults, the heap policy. Python reads each through its
  ``Switch`` at call time (``envs.CPU_FUSED_OPS.get()``), so a test's
  ``monkeypatch.setenv`` applies at once; no other module reads a ``FERRY_*`` name from
  ``os.environ`` (tests/unit/shared/test_envs.py greps the shipped tree). A few are read
  elsewhere and only declared here, their ``reader`` says where: the C++ kernels and
  their loader (which import nothing of ferry), docker-compose.yml's own variables, and
  the test suite's and ``make compose-check``'s.
- **Config fields** (``config_variables()``): ``FERRY_<FIELD>`` sets the default of the
  flag ``--<field>`` of every service whose config has that field; shared/config.py
  derives them from the config structs, and this module only lists them.

``render_markdown()`` renders both as the tables of docs/environment.md (a test
compares them); ``python -m shared.envs`` prints it.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import msgspec

from shared.config import GatewayConfig, SchedulerConfig, WorkerConfig, _field_docs

T = TypeVar("T")

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")
EMPTY = "''"  # an empty default, as the docs show it
CONFIGS: tuple[tuple[str, type[msgspec.Struct]], ...] = (
    ("scheduler", SchedulerConfig), ("worker", WorkerConfig), ("gateway", GatewayConfig))
Reader = Literal["python", "kernels", "compose", "dev"]
READERS: dict[Reader, str] = {
    "python": "Read by ferry's processes",
    "kernels": "Read by the CPU kernels and their loader (which import nothing of ferry)",
    "compose": "docker-compose.yml's own variables",
    "dev": "Development: the test suite and `make compose-check`",
}


@dataclass(frozen=True)
class Switch(Generic[T]):
    """One environment variable: its default (as one would set it), the values it takes,
    one line of meaning, and the parser its text goes through."""

    name: str
    default: str
    values: str
    doc: str
    parse: Callable[[str], T]
    reader: Reader = "python"

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable's text as set (None: unset)."""
        return (os.environ if environ is None else environ).get(self.name)

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        """The parsed value, the default when unset; a value it does not take raises ValueError."""
        text = self.raw(environ)
        text = self.default if text is None else text
        try:
            return self.parse(text)
        except ValueError as exc:
            raise ValueError(f"{self.name}={text!r}: {exc}") from None


SWITCHES: dict[str, Switch[Any]] = {}


def _declare(name: str, default: str, values: str, doc: str, parse: Callable[[str], T],
             reader: Reader = "python") -> Switch[T]:
    assert name.startswith("FERRY_") and name not in SWITCHES, name
    switch = Switch(name, default, values, doc, parse, reader)
    SWITCHES[name] = switch
    return switch


def on_unless_off(text: str) -> bool:
    """A switch that is on unless set to 0/false/no/off."""
    return text.strip().lower() not in OFF


def off_unless_on(text: str) -> bool:
    """A switch that is off unless set to 1/true/yes/on."""
    return text.strip().lower() in ON


def _text(text: str) -> str:
    return text


def _auto_or_flag(text: str) -> bool | None:
    """None for ``auto``, else a flag (0/1 and their spellings)."""
    setting = text.strip().lower()
    if setting == "auto":
        return None
    if setting in ON or setting in OFF:
        return setting in ON
    raise ValueError("auto, 1 or 0")


def _tiled_linear(text: str) -> Literal["auto", "small", "off"]:
    setting = text.strip().lower()
    if setting in OFF:
        return "off"
    if setting == "small":
        return "small"
    if setting in ("auto", *ON):
        return "auto"
    raise ValueError("auto, small or 0")


AMX_PROMPT_KINDS = frozenset({"qkv", "o", "gate_up", "down"})  # PackedLinear's projection kinds


def _amx_prompt(text: str) -> frozenset[str] | None:
    """None for ``auto`` (ferry's choice), else the projection kinds named."""
    setting = text.strip().lower()
    if setting in ("auto", *ON):
        return None
    if setting == "all":
        return AMX_PROMPT_KINDS
    if setting in (*OFF, "none", ""):
        return frozenset()
    kinds = frozenset(k.strip() for k in setting.split(","))
    if not kinds <= AMX_PROMPT_KINDS:
        raise ValueError(f"auto, all, 0 or a comma list of {', '.join(sorted(AMX_PROMPT_KINDS))}")
    return kinds


def _march(text: str) -> str:
    march = text.strip()  # '': the widest build this CPU runs (services/kernels/build.py)
    if not all(c.isalnum() or c in "-_." for c in march):
        raise ValueError("not a -march value")
    return march


def _non_negative_int(text: str) -> int:
    return max(0, int(text))


# --- the CPU fast paths (docs/worker.md); each off switch is for A/B runs or a misbehaving machine

CPU_PACKED_LINEAR = _declare(
    "FERRY_CPU_PACKED_LINEAR", "1", "1, 0",
    "Linear weights packed for oneDNN, q/k/v and gate/up fused (bfloat16, float32); 0: plain `F.linear`.",
    on_unless_off)
CPU_PACKED_EXPERTS = _declare(
    "FERRY_CPU_PACKED_EXPERTS", "1", "1, 0",
    "Mixture-of-experts layers: each expert's products on packed weights, tokens grouped per expert "
    "(with FERRY_CPU_PACKED_LINEAR); 0: transformers' experts module.",
    on_unless_off)
CPU_FUSED_OPS = _declare(
    "FERRY_CPU_FUSED_OPS", "1", "1, 0",
    "Norms, RoPE and the MLP activation as fused C++ ops; 0: transformers' own modules (and no lean forward).",
    on_unless_off)
CPU_LEAN_FORWARD = _declare(
    "FERRY_CPU_LEAN_FORWARD", "1", "1, 0",
    "The lean forward for fully fused Llama/Mistral/Qwen2 layers; 0: transformers' forward.",
    on_unless_off)
CPU_DECODE_LAYERS = _declare(
    "FERRY_CPU_DECODE_LAYERS", "1", "1, 0",
    "A decode step's layers in one C++ call; 0: the lean forward's Python layer loop.",
    on_unless_off)
CPU_PREFILL_KERNEL = _declare(
    "FERRY_CPU_PREFILL_KERNEL", "1", "1, 0",
    "`cpu_paged`'s prompt-attention kernel for fresh chunks; 0: SDPA.",
    on_unless_off)
CPU_BF16_DOT = _declare(
    "FERRY_CPU_BF16_DOT", "auto", "auto, 1, 0",
    "bfloat16 attention through AVX512-BF16 dot products (auto: decodes on float32 FMAs where the CPU "
    "has AMX); 1: dot products everywhere; 0: float32 FMAs everywhere.",
    _auto_or_flag)
CPU_TILED_LINEAR = _declare(
    "FERRY_CPU_TILED_LINEAR", "auto", "auto, small, 0",
    "bfloat16 products on ferry's tiled kernel (auto: every row count without AMX, none beside the AMX "
    "products); small: 1-6 rows on any CPU, oneDNN past them; 0: oneDNN alone.",
    _tiled_linear)
CPU_AMX_LINEAR = _declare(
    "FERRY_CPU_AMX_LINEAR", "1", "1, 0",
    "With AMX: a decode step's products as AMX tile products; 0: the tiled kernel at 1-6 rows, oneDNN past.",
    on_unless_off)
CPU_AMX_PROMPT = _declare(
    "FERRY_CPU_AMX_PROMPT", "auto", "auto, all, 0, or a comma list of qkv, o, gate_up, down",
    "With AMX: the projections whose prompt rows go to the AMX products, dropping oneDNN's copy "
    "(auto: all four); 0: none, oneDNN's copies kept.",
    _amx_prompt)
CPU_INT8_ONEDNN = _declare(
    "FERRY_CPU_INT8_ONEDNN", "1", "1, 0",
    "`--quantization int8`: products on oneDNN's prepacked int8 linear where the CPU has AMX-INT8; "
    "0: `torch._int_mm`.",
    on_unless_off)
CPU_FLOAT32_EXACT = _declare(
    "FERRY_CPU_FLOAT32_EXACT", "0", "0, 1",
    "1: float32 computed with transformers' own ops (linears, norms, rotary, SDPA for prompts; ~2x slower), "
    "the reference for A/B runs.",
    off_unless_on)
CPU_MARCH = _declare(
    "FERRY_CPU_MARCH", "", "avx2, avx512, avx512_bf16, amx, or a `-march` value",
    "Which CPU kernel build to load ('': the widest of the four this CPU runs; avx2: the AVX2 paths on any "
    "newer CPU; a -march value such as native builds that one).",
    _march, reader="kernels")
KERNELS_DIR = _declare(
    "FERRY_KERNELS_DIR", "", "a folder",
    "Prebuilt CPU kernel builds (`python -m services.kernels.build --compile-only --out DIR`): the worker "
    "imports its build from there with no compiler, and compiles only one the folder lacks ('': none; the "
    "image sets /opt/ferry/kernels).",
    _text, reader="kernels")
CPU_POOL_SPIN_US = _declare(
    "FERRY_CPU_POOL_SPIN_US", "200", "microseconds",
    "How long a kernel pool helper spins for its next job before it sleeps.",
    _non_negative_int, reader="kernels")

# --- process-wide defaults

MALLOC_KEEP = _declare(
    "FERRY_MALLOC_KEEP", "1", "1, 0",
    "Workers keep up to 1 GiB of freed heap for the next step instead of trimming it (glibc); "
    "0: glibc's own thresholds.",
    on_unless_off)
LOG_LEVEL = _declare(
    "FERRY_LOG_LEVEL", "INFO", "DEBUG, INFO, WARNING, ERROR",
    "Default of every process's `--log-level`.", _text)
LOG_FORMAT = _declare(
    "FERRY_LOG_FORMAT", "json", "json, text",
    "Default of `--log-format`: one JSON object per line, or text for terminals.", _text)
LOG_PROMPTS = _declare(
    "FERRY_LOG_PROMPTS", "0", "0, 1",
    "Default of `--log-prompts`: prompt and output content in the logs (0: only sizes).", off_unless_on)
DATA_PARALLEL_SIZE = _declare(
    "FERRY_DATA_PARALLEL_SIZE", "1", "an integer",
    "Default of `ferry serve --data-parallel-size`: engines behind the gateway.", int)

# --- docker-compose.yml's variables (compose substitutes them; no process reads them)

for _name, _default, _values, _doc in (
    ("FERRY_IMAGE", "ferry:latest", "an image", "The image of ferry's CPU services."),
    ("FERRY_GPU_IMAGE", "ferry:gpu", "an image", "The GPU worker's image (profile gpu)."),
    ("FERRY_REDIS_IMAGE", "redis:7.4-alpine", "an image", "Redis's image."),
    ("FERRY_PROMETHEUS_IMAGE", "prom/prometheus:v3.1.0", "an image", "Prometheus's image."),
    ("FERRY_GRAFANA_IMAGE", "grafana/grafana:11.4.0", "an image", "Grafana's image."),
    ("FERRY_PUBLISH", "127.0.0.1:8000", "[host:]port", "Where the gateway's port 8000 is published on the host."),
    ("FERRY_WORKER_MEMORY_LIMIT", "4G", "a size", "The worker container's memory limit (the GPU worker's: 8G)."),
):
    _declare(_name, _default, _values, _doc, _text, reader="compose")

# --- development

for _name, _default, _values, _doc in (
    ("FERRY_DOCS_SLOW", "0", "0, 1", "1: the docs tests also run the examples marked slow."),
    ("FERRY_TEST_CACHE", "~/.cache/ferry/test-models", "a folder", "Where the tests build their tiny models."),
    ("FERRY_DASHBOARD_SCREENSHOT", "", "a path", "The browser test also copies its dashboard screenshot here."),
    ("FERRY_CHECK_STATE", "~/.cache/ferry-compose-check", "a folder", "`make compose-check`'s tools and images."),
    ("FERRY_CHECK_DEBIAN_MIRROR", "http://deb.debian.org/debian", "a URL", "`make compose-check`'s Debian mirror."),
    ("FERRY_CHECK_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt", "a path",
     "The CA bundle `make compose-check` mounts into the image build."),
    ("FERRY_CHECK_WHEELS", "/opt/wheels", "a folder", "Where `make compose-check` finds a local torch wheel."),
):
    _declare(_name, _default, _values, _doc, _text, reader="dev")


# --- the config fields' variables (shared/config.py reads them)

@dataclass(frozen=True)
class ConfigVariable:
    """``FERRY_<FIELD>``: the default of ``--<field>`` in every service whose config has it."""

    name: str
    flag: str
    type: str
    default: str
    services: tuple[str, ...]
    doc: str


def config_variables() -> list[ConfigVariable]:
    """One row per config field name, over the scheduler's, the worker's and the gateway's configs."""
    rows: dict[str, dict[str, Any]] = {}
    for service, cls in CONFIGS:
        docs = _field_docs(cls)
        for field in msgspec.structs.fields(cls):
            row = rows.setdefault(field.name, {"default": field.default, "type": field.type, "docs": {}})
            row["docs"][service] = " ".join(docs.get(field.name, "").split())
    out = []
    for name in sorted(rows):
        row = rows[name]
        docs = row["docs"]
        texts = {d for d in docs.values() if d}
        doc = texts.pop() if len(texts) == 1 else "; ".join(f"{s}: {d.rstrip('.')}" for s, d in docs.items() if d)
        tp = row["type"] if isinstance(row["type"], str) else getattr(row["type"], "__name__", str(row["type"]))
        out.append(ConfigVariable("FERRY_" + name.upper(), "--" + name.replace("_", "-"), tp,
                                  _default_text(row["default"]), tuple(docs), doc))
    return out


def _default_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return EMPTY if value == "" else str(value)


def field_env(field: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The text of config field ``field``'s variable (``FERRY_<FIELD>``; None: unset), for the
    few places that take a field's value outside a service's flags (``ferry keys``, the model cache)."""
    if not any(field in cls.__struct_fields__ for _, cls in CONFIGS):
        raise KeyError(f"no config field {field!r}")
    return (os.environ if environ is None else environ).get("FERRY_" + field.upper())


def declared_names() -> set[str]:
    """Every ``FERRY_*`` name this module declares: the switches and the config fields' variables."""
    return set(SWITCHES) | {v.name for v in config_variables()}


# --- the docs' tables

def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown() -> str:
    """The tables docs/environment.md shows, between its ``envs`` markers."""
    lines: list[str] = []
    for reader, title in READERS.items():
        lines += [f"## {title}", "", "| Variable | Default | Values | Meaning |", "|---|---|---|---|"]
        lines += [f"| `{s.name}` | `{_cell(s.default or EMPTY)}` | {_cell(s.values)} | {_cell(s.doc)} |"
                  for s in SWITCHES.values() if s.reader == reader]
        lines.append("")
    lines += ["## Config fields: the default of each service's flag", "",
              "| Variable | Flag | Type | Default | Services | Meaning |", "|---|---|---|---|---|---|"]
    lines += [f"| `{v.name}` | `{v.flag}` | {v.type} | `{_cell(v.default)}` | {', '.join(v.services)} | {_cell(v.doc)} |"
              for v in config_variables()]
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- envs: begin (python -m shared.envs --write docs/environment.md) -->", "<!-- envs: end -->"


def replace_table(page: str, table: str) -> str:
    """``page`` with the text between its markers replaced by ``table``."""
    pattern = re.compile(re.escape(BEGIN) + r"\n.*?" + re.escape(END), re.S)
    if not pattern.search(page):
        raise ValueError("the page has no envs markers")
    return pattern.sub(lambda _: f"{BEGIN}\n{table}{END}", page)


def main(argv: list[str]) -> int:
    """Print the tables, or with ``--write PAGE`` put them between PAGE's markers."""
    if argv[:1] == ["--write"] and len(argv) == 2:
        with open(argv[1]) as f:
            page = f.read()
        with open(argv[1], "w") as f:
            f.write(replace_table(page, render_markdown()))
        return 0
    sys.stdout.write(render_markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
