"""Fixtures for the end-to-end suite: real Envoy, real idemstore, real Redis.

Artifacts come from the environment (the Makefile sets them), else their default paths:
ENVOY_BIN, FILTER_WASM (target/wasm32-wasip1/release/idempotency_filter.wasm), FILTER_MODULE
(target/release/libidempotency_filter.so, the native host), IDEMSTORE_BIN
(target/release/idemstore), REDIS_SERVER (redis-server on PATH). IDEM_HOST (`wasm`, the default,
or `native`) says which host the suite's filters run in (support/harness.py `host`).
Logs of every process go to tests/.logs/<run>/ (or $IDEM_TEST_LOGDIR); failing tests print
the tails of the live processes' logs. After the last test, every Envoy log of the run is
checked for wasm panics and traps (support/log_check.py).

The helpers are the package `support/` (tests/pytest.ini puts tests/ on `sys.path`).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from support import harness as h
from support.replicas import ReplicaSets
from support.stack import LISTENERS, STACKS, Stack, start_backend, start_filter_envoy

# support.log_check: the session-wide panic check of every Envoy log; pytester: its self-test
# (test_log_check.py runs small pytest sessions in subprocesses).
pytest_plugins = ["support.log_check", "pytester"]


def pytest_report_header(config):
    lines = [f"IDEM_HOST={h.host()}"]
    for env in ("ENVOY_BIN", "FILTER_WASM", "FILTER_MODULE", "IDEMSTORE_BIN"):
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
        if h.native():  # IDEM_HOST=native: the filters are the dynamic module (`harness.host`)
            found["module"] = h.native_module()
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


@pytest.fixture(scope="session", params=list(STACKS))
def stack(request, run_dir, artifacts, upstream) -> Stack:
    backend, matcher = STACKS[request.param]
    started: list[h.Proc] = []
    error = None
    try:
        store, sport, redis = start_backend(run_dir, backend, request.param)
        started += [p for p in (redis, store) if p is not None]
        envoy = start_filter_envoy(run_dir / request.param, "envoy", LISTENERS, upstream.port, sport,
                                   artifacts["wasm"], matcher)
    except h.HarnessError as e:
        error = str(e)
    if error is not None:
        for proc in reversed(started):
            proc.stop()
        pytest.fail(error, pytrace=False)
    s = Stack(backend, envoy, upstream, store, sport, redis, matcher)
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
