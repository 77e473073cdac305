"""Client-visible latency of the filter, against a no-filter Envoy in the same run.

One Envoy process with two listeners on the same routes and upstream: `plain` (router only) and
`idem` (the idempotency filter, idemstore on Redis). Requests are sequential on fresh
connections, so the figures are per-request latency, not throughput. Measured:

- a unique request (one `begin` before the upstream; the `commit` after the client has its
  answer) versus the same request through `plain`;
- a replay (one `begin`, no upstream);
- a store round trip straight to idemstore (what a commit on the critical path would add);
- commit to replay: a duplicate waiting for a running original, from the original's answer
  reaching its client to the replay reaching the duplicate's client.

Writes the figures to bench/RESULTS.md (section "Latency") and prints them.

    make bench            # or: python3 bench/latency.py [--requests 500]
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from support import harness as h  # noqa: E402

RESULTS = ROOT / "bench" / "RESULTS.md"


def pct(samples: list[float], p: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def summary(samples_s: list[float]) -> dict[str, float]:
    ms = [x * 1000 for x in samples_s]
    return {"n": len(ms), "p50": pct(ms, 50), "p90": pct(ms, 90), "p99": pct(ms, 99), "mean": statistics.fmean(ms)}


def timed_posts(port: int, n: int, key_of, body: str = '{"item":"book"}') -> list[float]:
    out = []
    for i in range(n):
        key = key_of(i)
        headers = [("content-type", "application/json")] + ([("idempotency-key", key)] if key else [])
        r = h.request(port, "POST", "/orders", body, headers=headers)
        if r.status != 201:
            raise SystemExit(f"unexpected answer {r.status}: {r.body[:200]!r}")
        out.append(r.elapsed)
    return out


def store_round_trips(store_port: int, n: int) -> list[float]:
    """begin (locks) then commit, straight to idemstore over HTTP/1.1: the commit's time."""
    out = []
    conn = http.client.HTTPConnection(h.LOOPBACK, store_port, timeout=5)
    try:
        for i in range(n):
            key = f"{i:064x}"[-64:]
            body_hash = "ab" * 32
            conn.request("POST", "/v1/begin", headers={
                "x-idem-key": key, "x-idem-body-hash": body_hash,
                "x-idem-lock-ttl-ms": "30000", "x-idem-wait-ms": "1"})
            resp = conn.getresponse()
            resp.read()
            token = resp.getheader("x-idem-token")
            if token is None:
                raise SystemExit(f"begin did not lock: {resp.status} {resp.getheader('x-idem-outcome')}")
            record = b"IDR1\x00\xc9\x00\x00" + b'{"id":"ord_1","item":"book"}'
            t0 = time.monotonic()
            conn.request("POST", "/v1/commit", body=record, headers={
                "x-idem-key": key, "x-idem-token": token, "x-idem-body-hash": body_hash,
                "x-idem-retention-s": "60", "content-type": "application/octet-stream"})
            resp = conn.getresponse()
            resp.read()
            out.append(time.monotonic() - t0)
    finally:
        conn.close()
    return out


def commit_to_replay(port: int, upstream: h.Upstream, n: int) -> list[float]:
    """Duplicate waits on a running original (upstream sleeps 100 ms); the replay's delay after
    the original's answer."""
    out = []
    for i in range(n):
        key = h.new_key("c2r")
        hdrs = [("content-type", "application/json"), ("idempotency-key", key), ("x-test-sleep-ms", "100")]
        done: dict[str, float] = {}

        def original():
            h.request(port, "POST", "/orders", "{}", headers=hdrs)
            done["original"] = time.monotonic()

        t = threading.Thread(target=original)
        t.start()
        deadline = time.monotonic() + 5
        while upstream.count(key=key) == 0:
            if time.monotonic() > deadline:
                raise SystemExit("the original never reached the upstream")
            time.sleep(0.002)
        r = h.request(port, "POST", "/orders", "{}", headers=hdrs)
        replayed_at = time.monotonic()
        t.join(10)
        if r.header("x-idempotent-replay") != "true":
            raise SystemExit(f"duplicate was not a replay: {r}")
        out.append(replayed_at - done["original"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--duplicates", type=int, default=100)
    args = ap.parse_args()

    run_dir = ROOT / "bench" / ".runs" / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    procs: list = []
    try:
        up_proc, up_port = h.start_upstream(run_dir)
        procs.append(up_proc)
        redis, redis_port = h.start_redis(run_dir)
        procs.append(redis)
        store, store_port = h.start_idemstore(run_dir, redis_url=f"redis://127.0.0.1:{redis_port}")
        procs.append(store)
        filters = {"plain": [], "idem": [h.wasm_filter({"store_cluster": "idemstore"}, h.wasm_path())]}
        envoy = h.start_envoy(run_dir, "envoy", filters, up_port, store_port)
        procs.append(envoy.proc)
        upstream = h.Upstream(up_proc, up_port)

        n = args.requests
        timed_posts(envoy.port("idem"), 50, lambda i: f"warm-{i}")  # warm both paths
        timed_posts(envoy.port("plain"), 50, lambda i: None)
        plain = summary(timed_posts(envoy.port("plain"), n, lambda i: None))
        unique = summary(timed_posts(envoy.port("idem"), n, lambda i: f"u-{time.time_ns()}-{i}"))
        key = f"r-{time.time_ns()}"
        timed_posts(envoy.port("idem"), 1, lambda i: key)
        envoy.wait_counter("stored", 51)
        replay = summary(timed_posts(envoy.port("idem"), n, lambda i: key))
        commit = summary(store_round_trips(store_port, n))
        c2r = summary(commit_to_replay(envoy.port("idem"), upstream, args.duplicates))
        counters = envoy.counters()
    finally:
        for p in reversed(procs):
            p.stop()

    rows = [
        ("no filter (same Envoy, `plain` listener)", plain),
        ("unique request through the filter", unique),
        ("replay through the filter", replay),
        ("one store round trip (commit, straight to idemstore)", commit),
        ("commit to replay, duplicate waiting on a running original", c2r),
    ]
    lines = [
        "## Latency",
        "",
        f"`bench/latency.py`, {time.strftime('%Y-%m-%d')}: Envoy 1.40 (`--concurrency 2`), idemstore on Redis,",
        "the counting upstream from `tests/`, all on loopback on a 2-core machine; sequential requests on",
        "fresh connections; the filter as shipped (`store_transport: stream`). Milliseconds.",
        "",
        "| what | n | p50 | p90 | p99 | mean |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in rows:
        lines.append(f"| {name} | {s['n']} | {s['p50']:.2f} | {s['p90']:.2f} | {s['p99']:.2f} | {s['mean']:.2f} |")
    lines += [
        "",
        f"The filter adds {unique['p50'] - plain['p50']:.2f} ms at p50 to a unique request (one `begin`). The",
        "`commit` is sent after the client has its answer; had it been on the critical path, a unique",
        f"request would also wait for it (p50 {commit['p50']:.2f} ms straight to idemstore, more through",
        "the store stream).",
        "",
        "Counters after the run: " + ", ".join(f"{k} {v}" for k, v in sorted(counters.items()) if v),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    write_section(text)
    return 0


def write_section(section: str) -> None:
    """Replaces the `## Latency` section of RESULTS.md, keeping any other section."""
    head = "# Benchmark results\n\nWritten by `make bench`; each section by the script it names.\n\n"
    old = RESULTS.read_text() if RESULTS.exists() else head
    start = old.find("## Latency")
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + section
    else:
        end = old.find("\n## ", start + 1)
        new = old[:start] + section + ("" if end < 0 else old[end:])
    RESULTS.write_text(new.rstrip("\n") + "\n")


if __name__ == "__main__":
    sys.exit(main())
