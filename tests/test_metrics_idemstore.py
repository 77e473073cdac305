"""idemstore's `GET /metrics` (issue 7 item 5) behind a real Envoy and filter: the Prometheus
text exposition (version 0.0.4) counts what the filter asked of the store, exactly."""

from __future__ import annotations

import http.client
import json
import math
import re
import time

from checks import assert_executed, assert_problem, assert_replay_of
import harness as h
from harness import new_key

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OUTCOMES = {
    "begin": ["locked", "record", "mismatch", "busy", "error", "cancelled"],
    "commit": ["stored", "late", "exists", "error", "cancelled"],
    "release": ["released", "not-owner", "error", "cancelled"],
}

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    """`name{k="v",...} value` lines to {(name, frozenset of (k, v)): value}; `#` lines skipped."""
    series: dict[tuple[str, frozenset], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        name, labels, value = m.groups()
        pairs = frozenset(_LABEL.findall(labels or ""))
        key = (name, pairs)
        assert key not in series, f"duplicate series: {line!r}"
        series[key] = float(value)  # float() reads "+Inf" too
    return series


class Scrape:
    def __init__(self, series: dict[tuple[str, frozenset], float]):
        self.series = series

    def get(self, name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        assert key in self.series, f"no {name}{labels} in the scrape"
        return self.series[key]

    def has(self, name: str) -> bool:
        return any(n == name for n, _ in self.series)

    def requests(self, op: str, outcome: str) -> float:
        return self.get("idemstore_requests_total", op=op, outcome=outcome)

    def histogram_count(self, name: str, **labels: str) -> float:
        """The `_count`, after checking the buckets: non-decreasing, `+Inf` equal to `_count`."""
        count = self.get(f"{name}_count", **labels)
        want = set(labels.items())
        buckets = sorted(
            (float(dict(pairs)["le"]), value)
            for (n, pairs), value in self.series.items()
            if n == f"{name}_bucket" and want <= set(pairs)
        )
        assert buckets, f"no buckets for {name}{labels}"
        assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), buckets
        assert buckets[-1][0] == math.inf and buckets[-1][1] == count, (buckets[-1], count)
        return count

    def op_counts(self) -> dict[tuple[str, str], float]:
        return {(op, outcome): self.requests(op, outcome)
                for op, outcomes in OUTCOMES.items() for outcome in outcomes}


def scrape(port: int) -> Scrape:
    conn = http.client.HTTPConnection(h.LOOPBACK, port, timeout=5)
    try:
        conn.request("GET", "/metrics")  # no x-idem-secret: /metrics needs none
        resp = conn.getresponse()
        body = resp.read()
        assert resp.status == 200, (resp.status, body[:200])
        assert resp.getheader("content-type") == CONTENT_TYPE, resp.getheader("content-type")
    finally:
        conn.close()
    return Scrape(parse(body.decode()))


def quiet(port: int, timeout: float = 10.0) -> Scrape:
    """A scrape once nothing is in flight: no waiter, and no count moving for 200 ms (earlier
    tests on this session-wide stack may still have commits or releases under way)."""
    deadline = time.monotonic() + timeout
    last = scrape(port)
    while True:
        time.sleep(0.2)
        now = scrape(port)
        if now.op_counts() == last.op_counts() and now.get("idemstore_waiters") == 0:
            return now
        assert time.monotonic() < deadline, "idemstore never went quiet"
        last = now


def deltas(before: Scrape, after: Scrape) -> dict[tuple[str, str], float]:
    b, a = before.op_counts(), after.op_counts()
    return {k: a[k] - b[k] for k in a if a[k] != b[k]}


def scrape_until(port: int, ok, what: str, timeout: float = 10.0) -> Scrape:
    deadline = time.monotonic() + timeout
    while True:
        s = scrape(port)
        if ok(s):
            return s
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


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
