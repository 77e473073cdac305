"""The mode Istio can configure: its WasmPlugin cannot set `allow_on_headers_stop_iteration`, so
the filter runs with `"pause_on_headers": false` and `envoy.filters.http.buffer` after it. The
headers of a guarded request with a body go on and wait in the buffer filter; the filter holds
the body until the store answers. Shown here with plain Envoy, on both backends: the contract
holds and the upstream sees nothing of a request the filter answers itself."""

from __future__ import annotations

import uuid

import pytest

from support import harness as h
from support.checks import assert_executed, assert_problem, assert_replay_of
from support.harness import new_key
from support.stack import istio_filters, start_backend


@pytest.fixture(scope="module", params=["memory", "redis"])
def istio(request, run_dir, artifacts, upstream):
    sub = run_dir / f"istio-mode-{request.param}"
    store, sport, redis = start_backend(sub, request.param)
    try:
        envoy = h.start_envoy(sub, "envoy", {
            "istio": istio_filters(artifacts["wasm"], lock_wait_ms=3000),
            # The control: the same filter without the buffer filter after it.
            "nobuffer": istio_filters(artifacts["wasm"], buffer_filter=False),
        }, upstream.port, sport)
    except h.HarnessError:
        store.stop()
        if redis is not None:
            redis.stop()
        raise
    yield envoy
    envoy.stop()
    store.stop()
    if redis is not None:
        redis.stop()


def post(envoy, path, body, key=None, extra=(), listener="istio"):
    hdrs = [("content-type", "application/json"), *extra]
    if key is not None:
        hdrs.append(("Idempotency-Key", key))
    return h.request(envoy.port(listener), "POST", path, body, hdrs)


def upstream_requests(envoy) -> int:
    """Requests Envoy started towards the upstream cluster, complete or not."""
    return envoy.stats(r"^cluster\.upstream\.upstream_rq_total$").get("cluster.upstream.upstream_rq_total", 0)


def test_contract_without_stop_on_headers(istio, upstream):
    path = f"/orders/{uuid.uuid4().hex}"
    key = new_key("istio")
    stored = istio.counter("stored")
    first = post(istio, path, '{"sku":1}', key)
    assert_executed(first, 201)
    istio.wait_counter("stored", stored + 1)
    started = upstream_requests(istio)
    for _ in range(3):
        assert_replay_of(post(istio, path, '{"sku":1}', key), first)
    assert upstream.count(path=path) == 1
    assert_problem(post(istio, path, '{"sku":2}', key), 422, raw_key=key)
    # Answered by the filter: Envoy never even opened a request to the upstream.
    assert upstream_requests(istio) == started
    # A headers-only POST stops on its headers, which works in this mode too.
    k2 = new_key("istio-empty")
    empty = post(istio, path, b"", k2)
    assert_executed(empty, 201)
    assert_replay_of(post(istio, path, b"", k2), empty)
    # Chunked: the body arrives in pieces, the hash is of the whole.
    k3 = new_key("istio-chunked")
    chunked = h.request(istio.port("istio"), "POST", path, [b'{"a"', b":1}"],
                        [("content-type", "application/json"), ("Idempotency-Key", k3)])
    assert_executed(chunked, 201)
    assert_replay_of(post(istio, path, b'{"a":1}', k3), chunked)
    assert upstream.count(path=path) == 3
    # Unkeyed requests pass through the buffer filter as usual.
    assert_executed(post(istio, path, "{}"), 201)
    assert upstream.count(path=path) == 4


def test_too_large_is_the_filters_413(istio, upstream):
    path = f"/orders/{uuid.uuid4().hex}"
    key = new_key("istio-big")
    resp = post(istio, path, b"x" * (1048576 + 1), key)
    assert_problem(resp, 413, raw_key=key)
    resp = h.request(istio.port("istio"), "POST", path, [b"x" * 65536] * 16 + [b"x"],
                     [("content-type", "application/json"), ("Idempotency-Key", key)])
    assert_problem(resp, 413, raw_key=key)
    assert upstream.count(path=path) == 0


def test_duplicate_in_flight_waits_and_replays(istio, upstream):
    """The original holds the lock for 800 ms; a duplicate's body is held by the filter, its
    headers by the buffer filter, until the original commits: then it replays."""
    path = f"/orders/{uuid.uuid4().hex}"
    key = new_key("istio-dup")
    t, out = h.in_thread(lambda: post(istio, path, "{}", key, [("x-test-sleep-ms", "800")]))
    h.poll_until(lambda: upstream.count(path=path), 1, timeout=5)
    dup = post(istio, path, "{}", key)
    first = h.joined(t, out)
    assert_executed(first, 201)
    assert_replay_of(dup, first)
    assert upstream.count(path=path) == 1


def test_without_the_buffer_filter_the_upstream_sees_the_headers(istio, upstream):
    """The control, and why the buffer filter is required in this mode: without it the headers
    of a duplicate that the filter then answers itself (a replay) are already on their way to
    the upstream: Envoy starts a request there (`upstream_rq_total`) and resets it when the
    replay goes out. The body never arrives, but the application may have seen a second request
    begin (this test upstream then records it with the 0 bytes it got; an application that acts
    on headers alone would run twice)."""
    path = f"/orders/{uuid.uuid4().hex}"
    key = new_key("nobuffer")
    stored = istio.counter("stored")
    first = post(istio, path, "{}", key, listener="nobuffer")
    assert_executed(first, 201)
    istio.wait_counter("stored", stored + 1)
    started = upstream_requests(istio)
    assert_replay_of(post(istio, path, "{}", key, listener="nobuffer"), first)
    h.poll_until(lambda: upstream_requests(istio), started + 1, timeout=5)
    # Whether the application got as far as reading the headers before the reset is a race; it
    # never gets the body.
    seen = upstream.executions(path=path)
    assert [e["body_len"] for e in seen] in ([2], [2, 0]), seen
