# The two commands a newcomer needs: `make serve` (a demo model on :8080) and `make test`.
# Both create .venv/ on first use; nothing else has to be installed by hand except Java 17.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# SageMaker SDK v2 for the tests of what notebooks written for it send: it cannot share a venv with v3.
SDK_V2_VENV := .sdk-v2-venv
TORCH_SPEC ?= torch==2.13.0
PORT ?= 8080
PYTEST_ARGS ?=
# The suite on this many pytest workers, each test file on one of them (its module's server with it); 0 runs it
# in this process. Two fill the 2 cores of a CI machine: 5 minutes of tests instead of 8.5. Where nvidia-smi lists
# a GPU, 0: tests/gpu measure the card's memory, which another worker's tests would move.
PYTEST_WORKERS ?= $(shell nvidia-smi -L 2>/dev/null | grep -q GPU && echo 0 || echo 2)

.PHONY: install serve test lint check-java test-image bench gpu-proof-kit clean

# What serving needs (requirements.txt and torch), then what developing adds (requirements-dev.txt), in one venv.
SERVE_INSTALLED := $(VENV)/.installed-serve
DEV_INSTALLED := $(VENV)/.installed-dev

install: $(DEV_INSTALLED)

$(SERVE_INSTALLED): requirements.txt pyproject.toml | check-java
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade "pip>=24" "setuptools<81" wheel
	$(BIN)/pip install --quiet "$(TORCH_SPEC)" -r requirements.txt
	# compat: a path in a .pth file. The default editable finder is an import hook that every Python process pays
	# for at start (10 ms here), and MMS starts one per model LOAD.
	$(BIN)/pip install --quiet --no-build-isolation --no-deps -e . --config-settings editable_mode=compat
	touch $@

$(DEV_INSTALLED): $(SERVE_INSTALLED) requirements-dev.txt
	$(BIN)/pip install --quiet "$(TORCH_SPEC)" -r requirements-dev.txt
	touch $@

$(SDK_V2_VENV)/.installed: requirements-sdk-v2.txt
	$(PYTHON) -m venv $(SDK_V2_VENV)
	$(SDK_V2_VENV)/bin/pip install --quiet --upgrade "pip>=24"
	$(SDK_V2_VENV)/bin/pip install --quiet -r requirements-sdk-v2.txt
	touch $@

check-java:
	@scripts/check-java

serve: $(SERVE_INSTALLED)
	$(BIN)/python scripts/make-test-models --demo .demo/models
	SAGEMAKER_BIND_TO_PORT=$(PORT) MME_RUNTIME_DIR=$(CURDIR)/.demo/run-$(PORT) MME_MODEL_ROOT=$(CURDIR)/.demo/models \
	MME_LOAD_MODELS=demo=$(CURDIR)/.demo/models/demo \
	$(BIN)/python dockerd-entrypoint.py serve

test: $(DEV_INSTALLED) $(SDK_V2_VENV)/.installed
	$(BIN)/python -m pytest --numprocesses $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Builds the image and runs it: PING, LOAD, INVOKE, METRICS, UNLOAD and a clean SIGTERM stop (tests/container/README.md).
# Uses a Docker engine when one answers, else podman as root; about 2 minutes the first time on a CI machine.
TEST_IMAGE_ARGS ?=

test-image: install
	$(BIN)/python scripts/test-image $(TEST_IMAGE_ARGS)

# The benchmarks (benchmarks/__main__.py), all eight by default (minutes each). BENCH_ARGS='stock --write-docs' runs one
# and writes its tables into docs/benchmarks.md; BENCH_ARGS='handler -- --requests 300' passes options to one.
BENCH_ARGS ?=

bench: install
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

# What an air-gapped GPU host lacks to run scripts/gpu-proof (docs/where-it-runs.md#proving-a-gpu-host): wheels and a
# trimmed Java 17 in .gpu-proof-kit/, checked to fit beside the tree in the 56 MiB such a host is sent. Needs a JDK.
gpu-proof-kit:
	$(PYTHON) scripts/gpu-proof-kit

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy mme_runtime

clean:
	rm -rf $(VENV) $(SDK_V2_VENV) .demo .pytest_cache .mypy_cache .ruff_cache .gpu-proof-kit gpu-proof-report
