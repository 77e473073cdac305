"""idemstore's `GET /metrics` behind a real Envoy and filter: the Prometheus
text exposition (version 0.0.4) counts what the filter asked of the store, exactly."""

from __future__ import annotations

import http.client
import json

from support import harness as h
from support.checks import assert_executed, assert_problem, assert_replay_of
from support.harness import new_key
from support.idemstore_metrics import OUTCOMES, deltas, quiet, scrape, scrape_until


def test_idemstore_metrics_count_request_retries_and_mismatch(stack):
    port = stack.idemstore_port
    before = quiet(port)
    durations_before = {op: before.histogram_count("idemstore_request_duration_seconds", op=op)
                        for op in OUTCOMES}
    waits_before = before.histogram_count("idemstore_begin_wait_seconds")
    hits_before = stack.counter("cache_hits")

    key = new_key("metrics")
    body = json.dumps({"item": "metrics", "qty": 1})
    first = stack.post("/orders", body, key)
    assert_executed(first, 201)
    # The commit follows the answer to the client: wait for it, so the retries replay at once.
    stored = before.requests("commit", "stored") + 1
    scrape_until(port, lambda s: s.requests("commit", "stored") >= stored, "the commit never came")

    for _ in range(2):
        assert_replay_of(stack.post("/orders", body, key), first)
    assert_problem(stack.post("/orders", json.dumps({"item": "other"}), key), 422, raw_key=key)
    assert stack.upstream.count(key=key) == 1

    after = quiet(port)
    # A worker's VM answers a retry from its record cache once the store has replayed that
    # record to it (`cache_hits`): the first replay always asks the store; the second, and the
    # 422, ask it unless they meet the same VM.
    hits = stack.counter("cache_hits") - hits_before
    got = deltas(before, after)
    assert got.get(("begin", "record"), 0) >= 1, got
    assert got.get(("begin", "record"), 0) + got.get(("begin", "mismatch"), 0) + hits == 3, (got, hits)
    expected = {
        ("begin", "locked"): 1,
        ("begin", "record"): got.get(("begin", "record"), 0),
        ("begin", "mismatch"): got.get(("begin", "mismatch"), 0),
        ("commit", "stored"): 1,
    }
    assert got == {k: v for k, v in expected.items() if v}, got

    # Each operation observed once in its op's duration histogram; nothing waited.
    for op in OUTCOMES:
        moved = sum(n for (o, _), n in expected.items() if o == op)
        count = after.histogram_count("idemstore_request_duration_seconds", op=op)
        assert count - durations_before[op] == moved, op
        assert count == sum(after.requests(op, outcome) for outcome in OUTCOMES[op]), op
    assert after.histogram_count("idemstore_begin_wait_seconds") == waits_before
    assert after.get("idemstore_waiters") == 0

    # Nothing refused, no backend error; the backend answers; memory gauges only in memory.
    for reason in ("secret", "invalid", "too_large"):
        name = "idemstore_rejected_total"
        assert after.get(name, reason=reason) == before.get(name, reason=reason), reason
    for op in OUTCOMES:
        for reason in ("unavailable", "full"):
            name, labels = "idemstore_backend_errors_total", {"op": op, "reason": reason}
            assert after.get(name, **labels) == before.get(name, **labels), labels
    assert after.get("idemstore_backend_up") == 1
    if stack.backend == "memory":
        assert after.get("idemstore_memory_keys") >= 1
        assert after.get("idemstore_memory_bytes") > 0
        assert after.get("idemstore_memory_keys") <= after.get("idemstore_memory_max_keys")
    else:
        assert not after.has("idemstore_memory_keys")


def test_idemstore_metrics_need_no_secret(run_dir, artifacts):
    """On a store that requires the shared secret, /metrics answers without it (like /healthz)
    on the same listener; a protocol call without it is refused (401) and counted."""
    port = h.free_port()
    argv = [h.idemstore_bin(), "--listen", f"{h.LOOPBACK}:{port}", "--secret", "metrics-e2e-Secret"]
    proc = h.start("idemstore-metrics-secret", argv, run_dir, env={"RUST_LOG": "info"})
    try:
        h.await_idemstore(proc, port)
        before = scrape(port)
        assert before.get("idemstore_rejected_total", reason="secret") == 0
        conn = http.client.HTTPConnection(h.LOOPBACK, port, timeout=5)
        try:
            conn.request("POST", "/v1/begin", headers={"x-idem-key": "a" * 64, "x-idem-body-hash": "b" * 64,
                                                       "x-idem-lock-ttl-ms": "1000", "x-idem-wait-ms": "1"})
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 401
        finally:
            conn.close()
        after = scrape(port)
        assert after.get("idemstore_rejected_total", reason="secret") == 1
        assert sum(after.op_counts().values()) == 0, "a refused request reached the store"
        assert after.get("idemstore_memory_keys") == 0
    finally:
        proc.stop()
