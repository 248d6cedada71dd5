# The two commands a fresh machine needs: `make serve` and `make test`. Both set up `.venv/` first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; GPU hosts override it (e.g. TORCH_SPEC=torch) or bring their own.
TORCH_SPEC ?= torch==2.13.0
GRPC_PORT ?= 8001
HTTP_PORT ?= 8000
METRICS_PORT ?= 8002
# Where `make serve` listens: loopback unless told otherwise, so a development server is not reachable
# from the network (inference is open to whoever reaches it; docs/security.md). BIND_ADDRESS=0.0.0.0
# serves other machines (and a container's published ports); each port can also be set on its own.
BIND_ADDRESS ?= 127.0.0.1
GRPC_ADDRESS ?= $(BIND_ADDRESS)
HTTP_ADDRESS ?= $(BIND_ADDRESS)
METRICS_ADDRESS ?= $(BIND_ADDRESS)
GATEWAY_PORT ?= 8080
# What the unit keeps across restarts (registered voices: $(STATE_DIR)/voices): this checkout's own.
STATE_DIR ?= $(CURDIR)/.state

.PHONY: setup serve test lint typecheck unit process integration cuda clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --progress-bar on --upgrade "pip>=24" "setuptools>=70" wheel "pybind11>=2.12"
	$(PY) -m pip install --progress-bar on "$(TORCH_SPEC)"
	$(PY) -m pip install --progress-bar on --no-build-isolation -e ".[server,dev]"
	touch $@

# The unit under tandem-unit, and tandem-gateway (OpenAI's speech API) beside it on GATEWAY_PORT.
# Ctrl-C reaches both from the terminal; a SIGTERM to make alone (a process manager) reaches only this
# shell, which forwards it to tandem-unit, waits for its drain, then stops the gateway.
serve: setup
	stop=; unit=; trap 'stop=1; [ -n "$$unit" ] && kill -TERM $$unit 2>/dev/null' TERM; trap ':' INT; \
	$(VENV)/bin/tandem-gateway --triton 127.0.0.1:$(GRPC_PORT) --host $(BIND_ADDRESS) --port $(GATEWAY_PORT) \
		--metrics-url http://127.0.0.1:$(METRICS_PORT)/metrics & gw=$$!; \
	$(VENV)/bin/tandem-unit --state-dir $(STATE_DIR) -- --model-repository model_repository \
		--grpc-address $(GRPC_ADDRESS) --grpc-port $(GRPC_PORT) \
		--http-address $(HTTP_ADDRESS) --http-port $(HTTP_PORT) \
		--metrics-address $(METRICS_ADDRESS) --metrics-port $(METRICS_PORT) & unit=$$!; \
	$(PY) -m tandem.cli.ready --pid $$unit --gateway http://$(BIND_ADDRESS):$(GATEWAY_PORT) \
		--grpc $(GRPC_ADDRESS):$(GRPC_PORT) --http $(HTTP_ADDRESS):$(HTTP_PORT) \
		--metrics $(METRICS_ADDRESS):$(METRICS_PORT) & \
	[ -n "$$stop" ] && kill -TERM $$unit; \
	wait $$unit; rc=$$?; while kill -0 $$unit 2>/dev/null; do wait $$unit; rc=$$?; done; \
	kill -TERM $$gw 2>/dev/null; while kill -0 $$gw 2>/dev/null; do wait $$gw; done; exit $$rc

# CUDA kernels and GPU transfer paths (GPU hosts; CPU CI skips their tests honestly).
cuda: setup
	$(PY) csrc/build_cuda.py

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: setup
	$(VENV)/bin/mypy backend transfer serving gateway cli bench wire

# Tests by scope: unit (this process), process (tandem's own processes, no tritonserver), integration
# (through the real tritonserver and the gateway). docs/architecture.md says what goes where.
unit: setup
	$(PY) -m pytest tests/unit -q

process: setup
	$(PY) -m pytest tests/process -q

integration: setup
	$(PY) -m pytest tests/integration -q

# --durations: the 25 slowest setups/calls at the end of the output (CI keeps its time under watch).
test: lint typecheck
	$(PY) -m pytest tests -q --durations=25

clean:
	rm -rf $(VENV) build *.egg-info csrc/*.so
