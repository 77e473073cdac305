"""Fixtures for the end-to-end suite: real Envoy, real idemstore, real Redis.

Artifacts come from the environment (the Makefile sets them), else their default paths:
ENVOY_BIN, FILTER_WASM (target/wasm32-wasip1/release/idempotency_filter.wasm),
IDEMSTORE_BIN (target/release/idemstore), REDIS_SERVER (redis-server on PATH).
Logs of every process go to tests/.logs/<run>/ (or $IDEM_TEST_LOGDIR); failing tests print
the tails of the live processes' logs.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import harness as h
from replicas import ReplicaSets

# Listener name -> plugin configuration (store_cluster added). Each listener has the routes
# `orders` (/orders), `payments` (/payments) and an unnamed one (/).
LISTENERS: dict[str, dict] = {
    "default": {},
    "require": {"require_key": True},
    "short": {"retention_seconds": 2, "lock_wait_ms": 1000},
    "subject_header": {"subject": {"header": "x-user"}},
    "closed": {"failure_mode": "closed"},
    # The subject from dynamic metadata, as jwt_authn would write it (here header_to_metadata
    # copies x-user into namespace `auth`, key `sub`, and removes the header).
    "subject_metadata": {"subject": {"metadata": {"filter": "auth", "path": ["sub"]}}},
    # Record v2 (issue 14, test_record.py): no lock wait (a duplicate in flight is a 409 at
    # once, retry-after from the lock's time left), other statuses kept, the fingerprint
    # widened to a header and compared as JSON, content types narrowed, and the old release
    # of answers too large to record.
    "strict": {"lock_wait_ms": 0, "lock_ttl_ms": 10000},
    "statuses": {"store_statuses": ["2xx", "4xx"]},
    "fingerprint": {"fingerprint_headers": ["x-tenant"],
                    "fingerprint_json": {"canonical": True, "ignore": ["/client_sent_at"]}},
    "json_only": {"store_content_types": ["application/json", "+json"]},
    "release_large": {"record_too_large": "release", "max_record_bytes": 65536},
}

# HTTP filters that run before the idempotency filter on some listeners.
PRE_FILTERS: dict[str, list[dict]] = {
    "subject_metadata": [{
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
            "request_rules": [{
                "header": "x-user",
                "on_header_present": {"metadata_namespace": "auth", "key": "sub", "type": "STRING"},
                "remove": True,
            }],
        },
    }],
}

BACKENDS = ["memory", "redis"]


def plugin_config(**overrides) -> dict:
    cfg = {"store_cluster": "idemstore"}
    cfg.update(overrides)
    return cfg


def pytest_report_header(config):
    lines = []
    for env in ("ENVOY_BIN", "FILTER_WASM", "IDEMSTORE_BIN"):
        lines.append(f"{env}={os.environ.get(env, '<default>')}")
    lines.append(f"logs: {the_run_dir()}")
    return lines


_RUN_DIR: Path | None = None


def the_run_dir() -> Path:
    """tests/.logs/<timestamp>-<pid>/ (or $IDEM_TEST_LOGDIR); older runs beyond 10 are pruned."""
    global _RUN_DIR
    if _RUN_DIR is None:
        base = os.environ.get("IDEM_TEST_LOGDIR")
        if base:
            path = Path(base)
        else:
            logs = h.TESTS / ".logs"
            path = logs / time.strftime(f"%Y%m%d-%H%M%S-{os.getpid()}")
            if logs.is_dir():
                for old in sorted(p for p in logs.iterdir() if p.is_dir())[:-9]:
                    shutil.rmtree(old, ignore_errors=True)
        path.mkdir(parents=True, exist_ok=True)
        _RUN_DIR = path
    return _RUN_DIR


@pytest.fixture(scope="session")
def run_dir() -> Path:
    return the_run_dir()


@pytest.fixture(scope="session")
def artifacts() -> dict[str, str]:
    try:
        found = {"envoy": h.envoy_bin(), "wasm": h.wasm_path(), "idemstore": h.idemstore_bin()}
    except h.HarnessError as e:
        missing = str(e)
    else:
        return found
    pytest.fail(missing, pytrace=False)


@pytest.fixture(scope="session")
def upstream(run_dir) -> h.Upstream:
    proc, port = h.start_upstream(run_dir)
    yield h.Upstream(proc, port)
    proc.stop()


@dataclass
class Stack:
    backend: str
    envoy: h.Envoy
    upstream: h.Upstream
    idemstore: h.Proc
    idemstore_port: int
    redis: h.Proc | None = None

    def port(self, listener: str = "default") -> int:
        return self.envoy.port(listener)

    def post(self, path: str, body: bytes | str = b"{}", key: str | bytes | None = None,
             listener: str = "default", headers: list | None = None, **kw) -> h.Response:
        hdrs = list(headers or [])
        if key is not None:
            hdrs.append(("Idempotency-Key", key))
        hdrs.append(("content-type", "application/json"))
        return h.request(self.port(listener), "POST", path, body, hdrs, **kw)

    def counter(self, name: str) -> int:
        return self.envoy.counter(name)

    def wait_counter(self, name: str, at_least: int, timeout: float = 5.0) -> int:
        return self.envoy.wait_counter(name, at_least, timeout)


def start_backend(run_dir: Path, backend: str) -> tuple[h.Proc, int, h.Proc | None]:
    sub = run_dir / backend
    redis = None
    redis_url = None
    if backend == "redis":
        redis, rport = h.start_redis(sub)
        redis_url = f"redis://127.0.0.1:{rport}"
    try:
        store, sport = h.start_idemstore(sub, redis_url)
    except h.HarnessError:
        if redis is not None:
            redis.stop()
        raise
    return store, sport, redis


def start_filter_envoy(run_dir: Path, name: str, listeners: dict[str, dict], upstream_port: int,
                       idemstore_port: int, wasm: str) -> h.Envoy:
    filters = {ln: PRE_FILTERS.get(ln, []) + [h.wasm_filter(plugin_config(**cfg), wasm)]
               for ln, cfg in listeners.items()}
    return h.start_envoy(run_dir, name, filters, upstream_port, idemstore_port)


@pytest.fixture(scope="session", params=BACKENDS)
def stack(request, run_dir, artifacts, upstream) -> Stack:
    backend = request.param
    started: list[h.Proc] = []
    error = None
    try:
        store, sport, redis = start_backend(run_dir, backend)
        started += [p for p in (redis, store) if p is not None]
        envoy = start_filter_envoy(run_dir / backend, "envoy", LISTENERS, upstream.port, sport, artifacts["wasm"])
    except h.HarnessError as e:
        error = str(e)
    if error is not None:
        for proc in reversed(started):
            proc.stop()
        pytest.fail(error, pytrace=False)
    s = Stack(backend, envoy, upstream, store, sport, redis)
    yield s
    envoy.stop()
    store.stop()
    if redis is not None:
        redis.stop()


# Lines tests want shown at the end of the run (measurements), also written to the run dir.
_NOTES: list[str] = []


@pytest.fixture
def note(run_dir):
    """note(line): print `line` in pytest's terminal summary and append it to <run>/notes.txt."""
    def add(line: str) -> None:
        _NOTES.append(line)
        with open(run_dir / "notes.txt", "a") as f:
            f.write(line + "\n")
    return add


def pytest_terminal_summary(terminalreporter):
    if _NOTES:
        terminalreporter.section("measurements")
        for line in _NOTES:
            terminalreporter.write_line(line)


@pytest.fixture
def replica_set(run_dir, artifacts, upstream):
    """Factory of multi-replica stacks (replicas.start_replica_set arguments, upstream and wasm
    given): `rs = replica_set("name", envoys=3, stores=2, backend="redis", plugin={...})`.
    Everything it started is stopped after the test, which fails on a wasm panic in any log."""
    sets = ReplicaSets(run_dir, upstream.port, artifacts["wasm"])
    yield sets
    panics = sets.close()
    if panics:
        pytest.fail("wasm panic or trap in a replica's Envoy log:\n" + "\n".join(panics[:20]), pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and call.when in ("setup", "call"):
        procs = h.live_processes()
        if procs:
            text = "\n".join(p.describe(30) for p in procs)
            rep.sections.append(("process logs (tails)", text))
