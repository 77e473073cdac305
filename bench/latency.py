"""Client-visible latency of the filter, against a no-filter Envoy in the same run.

One Envoy process with three listeners on the same routes and upstream: `plain` (router only),
`idem` (the idempotency filter, idemstore on Redis) and `native` (the same filter as the native
host, docs/native.md: the dynamic module, its store in Envoy's process on the same Redis;
left out, with a line saying so, when the module is not built). Requests are sequential on
fresh connections, so the figures are per-request latency, not throughput. Measured:

- a unique request (one `begin` before the upstream; the `commit` after the client has its
  answer) versus the same request through `plain`, on `idem` and on `native`;
- a replay (one `begin`, no upstream), on each;
- a store round trip straight to idemstore (what a commit on the critical path would add);
- commit to replay: a duplicate waiting for a running original, from the original's answer
  reaching its client to the replay reaching the duplicate's client, on each.

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


def await_replay(port: int, key: str, timeout: float = 5.0) -> None:
    """Until `key` is replayed: its record is stored. The native host counts `stored` when the
    store's answer reaches the worker with its next stream, so its counter trails the store on
    an idle listener; the answers do not."""
    deadline = time.monotonic() + timeout
    while h.request(port, "POST", "/orders", '{"item":"book"}',
                    headers=[("content-type", "application/json"), ("idempotency-key", key)]
                    ).header("x-idempotent-replay") != "true":
        if time.monotonic() > deadline:
            raise SystemExit(f"{key} was not stored within {timeout:g} s")
        time.sleep(0.05)


def native_counters(envoy: h.Envoy) -> dict[str, int]:
    """The module's counters (`idempotency.*`), the store stream's left out as `counters()` does."""
    return {k[len("idempotency."):]: v for k, v in envoy.stats(r"^idempotency\.").items()
            if k[len("idempotency."):] not in h.STREAM_COUNTERS}


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
        try:
            # The native host in the same Envoy, on its own listener: the same workers, routes
            # and upstream as the other two, its store on idemstore's Redis.
            h.native_module()
            filters["native"] = [h.native_filter({"store": {"redis": f"redis://127.0.0.1:{redis_port}"}})]
        except h.HarnessError as e:
            print(f"latency: no native host ({e})")
        admin = h.free_port()
        ports = {ln: h.free_port() for ln in filters}
        config = h.envoy_config(admin, [h.listener(ln, ports[ln], f) for ln, f in filters.items()], up_port,
                                store_port)
        envoy = h.spawn_envoy_config(run_dir, "envoy", config, admin, ports,
                                     env=h.native_env() if "native" in filters else None)
        procs.append(envoy.proc)
        h.await_envoy(envoy)
        upstream = h.Upstream(up_proc, up_port)
        fronts = [f for f in ("idem", "native") if f in filters]

        n = args.requests
        for f in fronts:  # warm every path
            timed_posts(envoy.port(f), 50, lambda i, f=f: f"warm-{f}-{i}")
        timed_posts(envoy.port("plain"), 50, lambda i: None)
        plain = summary(timed_posts(envoy.port("plain"), n, lambda i: None))
        unique, replay, c2r = {}, {}, {}
        for f in fronts:
            unique[f] = summary(timed_posts(envoy.port(f), n, lambda i, f=f: f"u-{f}-{time.time_ns()}-{i}"))
        for f in fronts:
            key = f"r-{f}-{time.time_ns()}"
            timed_posts(envoy.port(f), 1, lambda i: key)
            await_replay(envoy.port(f), key)
            replay[f] = summary(timed_posts(envoy.port(f), n, lambda i: key))
        commit = summary(store_round_trips(store_port, n))
        for f in fronts:
            c2r[f] = summary(commit_to_replay(envoy.port(f), upstream, args.duplicates))
        counters = envoy.counters()
        native = native_counters(envoy) if "native" in fronts else {}
    finally:
        for p in reversed(procs):
            p.stop()

    rows = [
        ("no filter (same Envoy, `plain` listener)", plain),
        ("unique request through the filter", unique["idem"]),
        ("replay through the filter", replay["idem"]),
        ("one store round trip (commit, straight to idemstore)", commit),
        ("commit to replay, duplicate waiting on a running original", c2r["idem"]),
    ]
    if native:
        rows += [
            ("unique request through the native host", unique["native"]),
            ("replay through the native host", replay["native"]),
            ("commit to replay through the native host", c2r["native"]),
        ]
    lines = [
        "## Latency",
        "",
        f"`bench/latency.py`, {time.strftime('%Y-%m-%d')}: Envoy 1.40 (`--concurrency 2`), idemstore on Redis,",
        "the counting upstream from `tests/`, all on loopback on a 2-core machine; sequential requests on",
        "fresh connections; the filter as shipped (`store_transport: stream`)"
        + ("; the native host on its own listener of the same Envoy, its store on the same Redis"
           if native else "") + ". Milliseconds.",
        "",
        "| what | n | p50 | p90 | p99 | mean |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in rows:
        lines.append(f"| {name} | {s['n']} | {s['p50']:.2f} | {s['p90']:.2f} | {s['p99']:.2f} | {s['mean']:.2f} |")
    lines += [
        "",
        f"The filter adds {unique['idem']['p50'] - plain['p50']:.2f} ms at p50 to a unique request (one `begin`). The",
        "`commit` is sent after the client has its answer; had it been on the critical path, a unique",
        f"request would also wait for it (p50 {commit['p50']:.2f} ms straight to idemstore, more through",
        "the store stream).",
    ]
    if native:
        lines += [
            f"The native host adds {unique['native']['p50'] - plain['p50']:.2f} ms at p50 to a unique request",
            "(its `begin`: one Redis script call from the module's store threads, no idemstore) and",
            f"{replay['native']['p50'] - plain['p50']:+.2f} ms to a replay (the filter: "
            f"{replay['idem']['p50'] - plain['p50']:+.2f} ms).",
        ]
    lines += [
        "",
        "Counters after the run: " + ", ".join(f"{k} {v}" for k, v in sorted(counters.items()) if v),
    ]
    if native:
        lines += ["", "The native host's (`idempotency.*`): "
                  + ", ".join(f"{k} {v}" for k, v in sorted(native.items()) if v)]
    lines += [""]
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
