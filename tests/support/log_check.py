"""The run-wide log check, as a pytest plugin (conftest.py loads it; `-p support.log_check`
loads it into any run with tests/ on the path).

A session-scoped autouse fixture: after the last test, every Envoy log the run produced (every
Envoy started through `harness.start`, running or stopped, whatever test or fixture started
it) is read, and any wasm panic or trap line (`checks.PANIC`) fails the run. pytest reports it
as an error at the teardown of the last test that ran (also when -x/--maxfail cut the run
short: pytest then tears the session down right after the failing test), with the lines named
`<log>:<line number>: <line>`. Individual tests still check their own Envoys where they want the
failure pinned to them (the `replica_set` fixture, the drills, the hostile table, ...).
"""

from __future__ import annotations

import pytest

from . import harness as h
from .checks import log_panics

SHOWN = 40


def panic_report(bad: list[str]) -> str:
    head = f"wasm panic or trap in the Envoy logs of this run ({len(bad)} line(s)):"
    more = [f"... and {len(bad) - SHOWN} more"] if len(bad) > SHOWN else []
    return "\n".join([head] + bad[:SHOWN] + more)


@pytest.fixture(scope="session", autouse=True)
def no_wasm_panic_in_any_envoy_log():
    yield
    bad = log_panics(h.envoy_logs())
    if not bad:
        return
    pytest.fail(panic_report(bad), pytrace=False)
