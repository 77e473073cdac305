"""idemstore's `GET /metrics` read as Prometheus text (exposition format 0.0.4): `scrape` a
port, compare request counts per (op, outcome) with `deltas`, or wait for `quiet` (nothing in
flight) first. Used by test_metrics_idemstore.py and test_record_cache.py."""

from __future__ import annotations

import math
import re
import time

from . import harness as h

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OUTCOMES = {
    "begin": ["locked", "record", "mismatch", "busy", "expired", "in-doubt", "error", "cancelled"],
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
    conn = h.http_connection(port, timeout=5)  # HTTPS to a TLS idemstore (IDEM_SECURE_STORE)
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
