"""Self-checks of the harness (no filter involved): upstream counting, plain Envoy, Redis."""

from __future__ import annotations

import json
import uuid

from support import harness as h


def test_upstream_counts_and_answers(upstream):
    key = h.new_key()
    path = f"/things/{uuid.uuid4().hex}"
    r = h.request(upstream.port, "POST", path + "?q=1", b'{"a":1}', [("Idempotency-Key", key)])
    assert r.status == 201
    doc = json.loads(r.body)
    assert doc["key"] == key and doc["body"] == '{"a":1}'
    assert r.header("location") == f"/things/{doc['id']}"
    assert r.header("content-type") == "application/json"
    r = h.request(upstream.port, "POST", path, b"", [("x-test-status", "204"), ("Idempotency-Key", key)])
    assert r.status == 204 and r.body == b""
    r = h.request(upstream.port, "POST", path, b"", [("x-test-status", "500"), ("x-test-content-type", "text/plain"),
                                                      ("x-test-body", "boom")])
    assert r.status == 500 and r.body == b"boom" and r.header("content-type") == "text/plain"
    assert upstream.count(key=key) == 2
    assert upstream.count(path=path) == 3
    assert upstream.count(path=path + "?q=1") == 1
    assert upstream.count(key=key, method="GET") == 0


def test_upstream_first_status_fails_only_the_first_execution_of_a_key_and_path(upstream):
    key = h.new_key("first")
    path = f"/things/{uuid.uuid4().hex}"
    hdrs = [("Idempotency-Key", key), ("x-test-first-status", "503"), ("x-test-sleep-ms", "500")]
    first = h.request(upstream.port, "POST", path, b"{}", hdrs)
    assert first.status == 503 and first.elapsed < 0.4, first  # at once, without the sleep
    again = h.request(upstream.port, "POST", path, b"{}", hdrs)
    assert again.status == 201, again
    # Another path, or another key, is a first execution of its own.
    assert h.request(upstream.port, "POST", path + "/2", b"{}", hdrs).status == 503
    other = [("Idempotency-Key", key + "-b")] + hdrs[1:]
    assert h.request(upstream.port, "POST", path, b"{}", other).status == 503
    assert upstream.count(key=key, path=path) == 2


def test_plain_envoy_routes_to_upstream(run_dir, upstream):
    envoy = h.start_envoy(run_dir / "plain", "envoy-plain", {"plain": []}, upstream.port, h.free_port())
    try:
        path = f"/things/{uuid.uuid4().hex}"
        r = h.request(envoy.port("plain"), "POST", path, b"{}", source="127.0.0.2")
        assert r.status == 201, r
        assert upstream.count(path=path) == 1
        assert envoy.counter("http.plain.downstream_rq_completed") >= 1
        assert envoy.counter("wasmcustom.idempotency.nope") == 0
    finally:
        assert envoy.stop() is not None


def test_redis_starts_and_stops(run_dir):
    proc, port = h.start_redis(run_dir / "redis-selfcheck")
    assert h.redis_ping(port)
    proc.stop()
    assert not proc.alive()
