"""The native host behind Envoy's composite filter, as the shipped configurations wrap the filter
(`harness.skip_unless_keyed`: created only for a request with a key and a guarded method): the
module's filter is then created inside the composite's request-headers callback.

A regression test: the module of the first native commit made each stream's scheduler in
`http_filter_new`, and there a commit of events that waited for a stream (a commit's answer
after its own stream ended) never reached the stream behind the composite filter (measured with
1.40.0: its `scheduled` hook never ran); the worker's link then held every later event back
behind it, the stream's own `begin` answer too, and the request hung until the client gave up
(this test timed out three runs in three). Schedulers are now made at a stream's first pause.

One Envoy (two workers) with the wrapped module on a Redis store, in front of the counting
upstream: keyed requests one after the other, each on a connection of its own, each answered
within its timeout, and each key's retry replays it.
"""

from __future__ import annotations

from support import harness as h
from support.checks import assert_executed, assert_replay_of
from support.harness import new_key

JSON = {"content-type": "application/json"}
ROUNDS = 20


def test_wrapped_requests_are_answered_and_replayed(run_dir, upstream):
    sub = run_dir / "native-composite"
    redis, rport = h.start_redis(sub)
    admin, port = h.free_port(), h.free_port()
    guard = h.native_filter({"store": {"redis": f"redis://{h.LOOPBACK}:{rport}"}, "lock_wait_ms": 5000})
    config = {
        "admin": {"address": {"socket_address": {"address": h.LOOPBACK, "port_value": admin}}},
        "static_resources": {
            "listeners": [h.listener("api", port, [h.skip_unless_keyed(guard)])],
            "clusters": [h.static_cluster("upstream", upstream.port)],
        },
    }
    envoy = h.await_envoy(h.spawn_envoy_config(sub, "envoy-composite", config, admin, {"api": port},
                                               env=h.native_env()))
    try:
        for _ in range(ROUNDS):
            key = new_key("wrapped")
            headers = {"idempotency-key": key, **JSON}
            first = h.request(port, "POST", "/orders", b'{"item":"book"}', headers, timeout=8)
            assert_executed(first)
            assert_replay_of(h.request(port, "POST", "/orders", b'{"item":"book"}', headers, timeout=8), first)
            assert upstream.count(key=key) == 1
        # Unwrapped requests never meet the filter.
        assert h.request(port, "POST", "/orders", b"{}", JSON, timeout=8).status == 201
    finally:
        envoy.stop()
        redis.stop()
