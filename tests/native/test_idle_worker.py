"""A store answer that comes back after its stream has ended, on a worker with no other stream:
the commit of an answered request (the commit is off the client's path: it is sent as the
answer goes out). Envoy 1.40's only way onto a worker from another thread is the scheduler of
one of the worker's live streams (a scheduler holds its filter by weak reference: once the
stream is destroyed, a commit on it is dropped). With no stream to wake, the store's thread
runs the worker's coordinator itself, under the worker's baton (src/host/native/link.rs), so
`stored` is counted at once, not at the worker's next stream.

One Envoy with one worker (`--concurrency 1`), so that no other stream can happen to carry the
answer, and nothing else sent to it between a request and the check.
"""

from __future__ import annotations

import pytest

from support import harness as h
from support.checks import assert_executed
from support.harness import new_key

JSON = {"content-type": "application/json"}
ROUNDS = 10


@pytest.fixture(scope="module")
def redis(run_dir):
    proc, port = h.start_redis(run_dir / "native-idle")
    yield port
    proc.stop()


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_a_commit_answered_after_the_stream_ended_is_counted(run_dir, upstream, redis, backend):
    store = {"memory": True} if backend == "memory" else {"redis": f"redis://{h.LOOPBACK}:{redis}"}
    admin, port = h.free_port(), h.free_port()
    config = {
        "admin": {"address": {"socket_address": {"address": h.LOOPBACK, "port_value": admin}}},
        "static_resources": {
            "listeners": [h.listener("api", port, [h.native_filter({"store": store})])],
            "clusters": [h.static_cluster("upstream", upstream.port)],
        },
    }
    envoy = h.await_envoy(h.spawn_envoy_config(run_dir / "native-idle", f"envoy-idle-{backend}", config, admin,
                                               {"api": port}, concurrency=1, env=h.native_env()))
    try:
        uncounted = []
        for n in range(1, ROUNDS + 1):
            key = new_key("idle")
            assert_executed(h.request(port, "POST", "/orders", b"{}", {"idempotency-key": key, **JSON}))
            assert upstream.count(key=key) == 1
            stored = h.poll_until(lambda: envoy.counter("idempotency.stored"), n, 2.0)
            if stored < n:
                uncounted.append(n)
                # The next stream carries the queued answer: a keyless GET on the same worker.
                h.request(port, "GET", "/orders", None)
                assert h.poll_until(lambda: envoy.counter("idempotency.stored"), n, 2.0) == n
        assert not uncounted, (f"{len(uncounted)} of {ROUNDS} commits counted only once another stream "
                               f"came (idempotency.store_stream_calls stayed 1 meanwhile)")
    finally:
        envoy.stop()
