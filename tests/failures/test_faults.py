"""Faults: the store goes away; fail open (default) or closed. On the native host the store is
in Envoy's process: its Redis is what goes away."""

from __future__ import annotations

import pytest

from support import harness as h
from support.checks import assert_executed, assert_problem, assert_replay_of
from support.harness import new_key
from support.stack import Stack, start_backend, start_filter_envoy


@pytest.fixture(params=["idemstore_killed", "redis_killed"])
def fault_stack(request, run_dir, artifacts, upstream):
    """A dedicated store and Envoy (listeners `default` and `closed`) that the test may break."""
    fault = request.param
    if fault == "idemstore_killed":
        h.skip_on_native("native host: no idemstore to kill; the in-memory store runs in Envoy's process "
                         "(the store outage is the redis_killed case)")
    sub = run_dir / f"faults-{fault}"
    backend = "redis" if fault == "redis_killed" else "memory"
    store, sport, redis = start_backend(sub, backend)
    try:
        envoy = start_filter_envoy(sub, "envoy", {"default": {}, "closed": {"failure_mode": "closed"}},
                                   upstream.port, sport, artifacts["wasm"])
    except h.HarnessError:
        store.stop()
        if redis is not None:
            redis.stop()
        raise
    s = Stack(backend, envoy, upstream, store, sport, redis)
    s.fault = fault
    s.run_dir = sub
    yield s
    envoy.stop()
    s.idemstore.stop()
    if redis is not None:
        redis.stop()


def test_store_down_fails_open_or_closed(fault_stack):
    s = fault_stack
    # Guarded while the store is up.
    key = new_key()
    first = s.post("/orders", "{}", key)
    assert_executed(first, 201)
    assert s.wait_counter("stored", 1) == 1  # the commit landed before we break the store
    assert_replay_of(s.post("/orders", "{}", key), first)
    assert s.counter("degraded") == 0

    if s.fault == "idemstore_killed":
        s.idemstore.kill()
    else:
        s.redis.kill()

    # failure_mode open (default): every request runs, unguarded, and is counted.
    degraded = s.counter("degraded")
    keys = [new_key() for _ in range(5)]
    for k in keys:
        assert_executed(s.post("/orders", "{}", k), 201)
    assert sum(s.upstream.count(key=k) for k in keys) == 5
    assert s.counter("degraded") == degraded + 5

    # failure_mode closed: 503 problem, nothing runs.
    ck = new_key()
    resp = s.post("/orders", "{}", ck, listener="closed")
    assert_problem(resp, 503, raw_key=ck)
    assert s.upstream.count(key=ck) == 0
    # The guarantee was given up for this request too (by refusing it), so it counts as degraded.
    assert s.counter("degraded") == degraded + 6
    assert s.counter("unavailable") == 1

    # Unkeyed requests never needed the store.
    assert_executed(s.post("/orders", "{}", listener="closed"), 201)


@pytest.mark.parametrize("fault_stack", ["idemstore_killed"], indirect=True)
def test_store_restart_recovers(fault_stack):
    s = fault_stack
    s.idemstore.kill()
    assert_executed(s.post("/orders", "{}", new_key()), 201)  # degraded, open
    store, _ = h.start_idemstore(s.run_dir, port=s.idemstore_port)
    s.idemstore = store
    key = new_key()
    first = s.post("/orders", "{}", key)
    assert_executed(first, 201)
    assert_replay_of(s.post("/orders", "{}", key), first)
    assert s.upstream.count(key=key) == 1
