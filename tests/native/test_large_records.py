"""Answers larger than the store stream's 64 KiB (src/store/stream.rs `MAX_STREAM_RECORD`) on the
native host. The wasm filter sends such a commit to idemstore as a callout of its own; the
native host has no cluster to call, so every commit goes to its store in process. Before that,
the commit's callout could not leave (`dispatch to  failed`), the retry waited out the lock and
got a replay without the body (`x-idempotent-body-omitted`) although the answer was well within
`max_record_bytes`.

One Envoy (`envoy-large`, two workers) with two listeners, `memory` and `redis`, in front of the
counting upstream; each answer size once per listener: the first request runs, its retry
(which waits for the commit on the lock, `lock_wait_ms` 5 s) replays it byte for byte.
"""

from __future__ import annotations

import pytest

from support import harness as h
from support.checks import assert_executed, assert_replay_of
from support.harness import new_key

JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def envoy(run_dir, upstream):
    sub = run_dir / "native-large"
    redis, rport = h.start_redis(sub)
    stores = {"memory": {"memory": True}, "redis": {"redis": f"redis://{h.LOOPBACK}:{rport}"}}
    admin = h.free_port()
    ports = {ln: h.free_port() for ln in stores}
    config = {
        "admin": {"address": {"socket_address": {"address": h.LOOPBACK, "port_value": admin}}},
        "static_resources": {
            "listeners": [h.listener(ln, ports[ln], [h.native_filter({"store": store, "lock_wait_ms": 5000})])
                          for ln, store in stores.items()],
            "clusters": [h.static_cluster("upstream", upstream.port)],
        },
    }
    e = h.await_envoy(h.spawn_envoy_config(sub, "envoy-large", config, admin, ports, env=h.native_env()))
    yield e
    e.stop()
    redis.stop()


@pytest.mark.parametrize("listener", ["memory", "redis"])
@pytest.mark.parametrize("size", [64 * 1024, 64 * 1024 + 1, 512 * 1024, 1024 * 1024])
def test_an_answer_over_the_streams_64_kib_replays_exactly(envoy, upstream, listener, size):
    key = new_key("large")
    headers = {"idempotency-key": key, "x-test-body-bytes": str(size), **JSON}
    first = h.request(envoy.port(listener), "POST", "/orders", b"{}", headers)
    assert_executed(first)
    assert len(first.body) == size
    again = h.request(envoy.port(listener), "POST", "/orders", b"{}", headers)
    assert_replay_of(again, first)
    assert again.header("x-idempotent-body-omitted") is None, again
    assert upstream.count(key=key) == 1
