"""A store frozen (SIGSTOP) past the filter's timeouts, then thawed, leaves no lock behind, over
both store cluster protocols; and so does a store that serves every
call late (a relay that holds each call past the filter's timeout, then passes it on), the case
where Envoy's cancellations cannot help.

While idemstore is frozen, the filter gives up on each `begin` after its timeout and the request
runs unguarded (`failure_mode: open`), but calls may stay queued (on h2c, in the connection).
Thawed, idemstore works through them. Each `begin` carries its deadline
(`x-idem-deadline-ms`), so idemstore answers the late ones `expired` instead of locking their
keys for `lock_ttl_ms` with nobody to commit or release: a retry of every key that ran during
the freeze then executes or replays at once, never a `409`."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from support import harness as h
from support.idemstore_metrics import scrape
from support.store_double_client import StoreDouble, http1_cluster

TIMEOUT_MS, WAIT_MS = 300, 200
FREEZE_S = 3.0
KEYS = 30


def frozen_pid(store: h.Proc, redis: h.Proc) -> int:
    """The process a freeze stops: idemstore, or on the native host (whose store runs in Envoy's
    process) its Redis."""
    return redis.pid if h.native() else store.pid


def await_thawed(store: h.Proc, sport: int, redis: h.Proc, rport: int, timeout: float = 10.0) -> None:
    """Until the frozen store answers again: idemstore's /healthz 200, or its Redis's PING."""
    if h.native():
        h.wait_for(lambda: h.redis_ping(rport), "redis thawed", redis, timeout=timeout)
    else:
        h.wait_for(lambda: h.request(sport, "GET", "/healthz", None, timeout=2).status == 200, "idemstore thawed",
                   store, timeout=timeout)


def drill(run_dir, artifacts, upstream, protocol: str) -> dict:
    """`protocol`: `http1` or `h2c` (idemstore frozen), or `relay` (HTTP/1.1 through a relay
    that holds each call 1 s while the store is "frozen", then passes it on). On the native host
    the store runs in Envoy's process: its Redis is what freezes (`h2c`, the suite's own store
    cluster protocol, stands for that case; the others are idemstore's protocols)."""
    if protocol != "h2c":
        h.skip_on_native(f"native host: no store cluster to idemstore ({protocol}); the frozen store is "
                         "its Redis, the h2c case")
    sub = run_dir / f"freeze-{protocol}"
    redis, rport = h.start_redis(sub)
    store, sport = h.start_idemstore(sub, f"redis://127.0.0.1:{rport}")
    envoy = relay = None
    try:
        if protocol == "relay":
            relay = StoreDouble(sub, target=sport)
            cluster = http1_cluster("idemstore", relay.port)
        elif protocol == "h2c":
            cluster = h.store_cluster(sport)
        else:
            cluster = http1_cluster("idemstore", sport)
        # The breaker off: every key's call goes out and reaches the store late (with it on,
        # most would skip the store; the test below has it on). The local fallback off: the
        # keys run unguarded, so that their retries show whether the store left a lock.
        cfg = {"store_cluster": "idemstore", "store_timeout_ms": TIMEOUT_MS, "lock_wait_ms": WAIT_MS,
               "breaker_open_ms": 0, "local_fallback": False}
        if protocol != "h2c":
            # Over HTTP/1.1 (and through the relay, which speaks idemstore's HTTP API) only
            # callouts go; h2c runs on the suite's transport.
            cfg["store_transport"] = "callout"

        def hook(config):
            clusters = config["static_resources"]["clusters"]
            clusters[:] = [c for c in clusters if c["name"] != "idemstore"] + [cluster]

        envoy = h.await_envoy(h.spawn_envoy(sub, "envoy", {"main": [h.wasm_filter(cfg, artifacts["wasm"])]},
                                            upstream.port, h.free_port(), config_hook=hook))
        port = envoy.port("main")
        prefix = h.new_key(f"freeze-{protocol}")
        keys = [f"{prefix}-{i}" for i in range(KEYS)]

        def post(key):
            return h.request(port, "POST", "/orders", json.dumps({"key": key}),
                             [("Idempotency-Key", key), ("content-type", "application/json")], timeout=10)

        def freeze(on: bool):
            if relay is not None:
                relay.mode(delay_ms=1000 if on else 0)
            else:
                os.kill(frozen_pid(store, redis), signal.SIGSTOP if on else signal.SIGCONT)

        # Warm the store connections, so the frozen calls queue on them.
        assert post(f"{prefix}-warm").status == 201
        before = envoy.counters()
        freeze(True)
        frozen_at = time.monotonic()
        answers: dict[str, h.Response] = {}
        try:
            threads = []
            for i, key in enumerate(keys):
                # Spread over the freeze, so calls queue early and late in it.
                t = threading.Thread(target=lambda k=key: answers.__setitem__(k, post(k)))
                threads.append(t)
                t.start()
                time.sleep((FREEZE_S - 0.8) / KEYS)
            for t in threads:
                t.join(timeout=10)
            time.sleep(max(0.0, FREEZE_S - (time.monotonic() - frozen_at)))
        finally:
            freeze(False)
        thawed_at = time.monotonic()
        assert all(answers[k].status == 201 for k in keys), {k: answers[k].status for k in keys if k in answers}
        d = {k: v - before.get(k, 0) for k, v in envoy.counters().items()}
        assert d.get("degraded") == KEYS, d

        # Thawed: idemstore answers again once it has worked through the queue.
        await_thawed(store, sport, redis, rport)
        if relay is not None:
            # Every held call has reached idemstore (the warm-up's begin, then the 30 late ones).
            h.wait_for(lambda: sum(scrape(sport).requests("begin", o) for o in ("locked", "expired")) >= 1 + KEYS,
                       "the relay passed every held begin on", store, timeout=10)
        retries = {k: post(k) for k in keys}
        took = time.monotonic() - thawed_at
        statuses = {k: r.status for k, r in retries.items()}
        assert all(s == 201 for s in statuses.values()), statuses
        assert not [k for k, r in retries.items() if r.elapsed >= WAIT_MS / 1000], \
            {k: round(r.elapsed, 3) for k, r in retries.items()}
        # Each key ran once unguarded in the freeze and once more now, guarded (nothing was
        # recorded for it); none waited on a lock left behind.
        assert all(upstream.count(key=k) == 2 for k in keys), {k: upstream.count(key=k) for k in keys}
        if h.native():
            # No idemstore in the path to count the late begins: the retries above are the check.
            return {"expired": None, "locked": None, "took": took}
        metrics = scrape(sport)
        return {"expired": metrics.requests("begin", "expired"), "locked": metrics.requests("begin", "locked"),
                "took": took}
    finally:
        if envoy is not None:
            envoy.stop()
        if relay is not None:
            relay.stop()
        store.stop()
        redis.stop()


@pytest.mark.parametrize("protocol", ["http1", "h2c", "relay"])
def test_a_thawed_store_leaves_no_lock_behind(run_dir, artifacts, upstream, note, protocol):
    got = drill(run_dir, artifacts, upstream, protocol)
    if protocol == "relay":
        # Every held begin reached idemstore past its deadline.
        assert got["expired"] == KEYS, got
    if protocol == "h2c" and not h.native():
        # Envoy's timed-out h2c streams stay queued in the connection and idemstore serves them
        # once thawed (measured here: every one of them). On HTTP/1.1 Envoy closes the timed-out
        # connections and idemstore (hyper, no half-close) drops their requests unread.
        assert got["expired"] > 0, got
    if h.native():
        note(f"native host: the store's Redis frozen {FREEZE_S:.0f} s, {KEYS} keys run unguarded in the freeze: "
             f"retries of all {KEYS} ran at once (no 409), {got['took']:.2f}s for all retries")
        return
    note(f"store frozen {FREEZE_S:.0f} s ({protocol} store cluster), {KEYS} keys run unguarded in the freeze: "
         f"{got['expired']:.0f} late begins answered expired, retries of all {KEYS} ran at once (no 409), "
         f"{got['took']:.2f}s for all retries")


BREAKER_TIMEOUT_MS = 500


def test_a_frozen_store_costs_one_timeout_per_interval(run_dir, artifacts, upstream, note):
    """idemstore SIGSTOPped 3 s under a steady load of unique keys from 8 clients (store_timeout_ms
    500, lock_wait_ms 0, the default breaker: 3 timeouts in a row open it for 500 ms, then one
    probe). During the freeze requests wait at most one timeout (plus the upstream), most
    skip the store at once (counted on `store_skipped` and `degraded`; p99 checked, the maximum
    reported), and the store sees a few
    `begin`s per interval, not one per request; after the thaw requests are guarded again at once.
    (The same freeze with the breaker off is the control: every request waits its timeout.)
    On the native host the store's Redis is frozen (the store runs in Envoy's process)."""
    sub = run_dir / "freeze-breaker"
    redis, rport = h.start_redis(sub)
    store, sport = h.start_idemstore(sub, f"redis://127.0.0.1:{rport}")
    envoy = None
    try:
        cluster = h.store_cluster(sport)
        base = {"store_cluster": "idemstore", "store_timeout_ms": BREAKER_TIMEOUT_MS, "lock_wait_ms": 0}

        def hook(config):
            clusters = config["static_resources"]["clusters"]
            clusters[:] = [c for c in clusters if c["name"] != "idemstore"] + [cluster]

        filters = {"main": [h.wasm_filter(base, artifacts["wasm"])],
                   "off": [h.wasm_filter({**base, "breaker_open_ms": 0}, artifacts["wasm"])]}
        envoy = h.await_envoy(h.spawn_envoy(sub, "envoy", filters, upstream.port, h.free_port(), config_hook=hook))
        results = {}
        for listener in ("main", "off"):
            port = envoy.port(listener)
            prefix = h.new_key(f"breaker-{listener}")
            sent: list[tuple[float, float, int | str]] = []
            stop = threading.Event()
            lock = threading.Lock()

            def client(n, port=port, prefix=prefix, sent=sent, stop=stop, lock=lock):
                i = 0
                while not stop.is_set():
                    key = f"{prefix}-{n}-{i}"
                    i += 1
                    t0 = time.monotonic()
                    try:
                        status = h.request(port, "POST", "/orders", json.dumps({"key": key}),
                                           [("Idempotency-Key", key), ("content-type", "application/json")],
                                           timeout=10).status
                    except OSError as e:
                        # Recorded, not lost with the thread: a client that fails says how.
                        status = f"{key}: {e!r}"
                    with lock:
                        sent.append((t0, time.monotonic(), status))

            before = envoy.counters()
            threads = [threading.Thread(target=client, args=(n,)) for n in range(8)]
            for t in threads:
                t.start()
            time.sleep(1.0)
            os.kill(frozen_pid(store, redis), signal.SIGSTOP)
            frozen_at = time.monotonic()
            try:
                time.sleep(FREEZE_S)
            finally:
                os.kill(frozen_pid(store, redis), signal.SIGCONT)
            thawed_at = time.monotonic()
            # A second for the breaker to close, then at least 16 requests (not a fixed window:
            # under the whole suite one pause of this machine, or of the shared upstream, once
            # left a 0.5 s window without any).
            time.sleep(1.0)
            settled = envoy.counters()
            settled_at = time.monotonic()

            def started_after() -> int:
                with lock:
                    return sum(1 for t0, _, _ in sent if t0 >= settled_at)

            h.wait_for(lambda: started_after() >= 16, "16 requests after the thaw", timeout=10)
            stop.set()
            for t in threads:
                t.join(timeout=10)
            assert not any(t.is_alive() for t in threads), "a client still waits 10 s after the load stopped"
            await_thawed(store, sport, redis, rport, timeout=20.0)
            end = envoy.counters()
            d = {k: v - before.get(k, 0) for k, v in end.items()}
            # Started in the freeze and answered before the thaw.
            frozen = [t1 - t0 for t0, t1, _ in sent if t0 >= frozen_at and t1 <= thawed_at]
            after = sorted(t1 - t0 for t0, t1, _ in sent if t0 >= settled_at)
            assert all(status == 201 for _, _, status in sent), [s for _, _, s in sent if s != 201][:5]
            assert frozen and after, (len(frozen), len(after))
            frozen.sort()
            results[listener] = {
                "requests": len(sent), "frozen": len(frozen), "p50": frozen[len(frozen) // 2],
                "p99": frozen[int(len(frozen) * 0.99)], "max": frozen[-1],
                "slow": sum(1 for x in frozen if x >= BREAKER_TIMEOUT_MS / 1000 - 0.05),
                "after_p50": after[len(after) // 2], "after_max": after[-1],
                "after_skipped": end.get("store_skipped", 0) - settled.get("store_skipped", 0),
                "skipped": d.get("store_skipped", 0), "degraded": d.get("degraded", 0),
            }
        on, off = results["main"], results["off"]
        bound = BREAKER_TIMEOUT_MS / 1000 + 0.15
        # p99 at most one timeout (plus the upstream and this machine's jitter): a frozen store
        # costs a request no more than one timeout; the maximum is reported (one request
        # scheduled late on this 2-core machine under the whole suite was seen at 0.8 s).
        assert on["p99"] <= bound and off["p99"] <= bound, results
        # With the breaker most requests in the freeze skip the store at once; without it each
        # one waits its timeout.
        assert on["p50"] < 0.05, on
        assert on["skipped"] > 0 and on["skipped"] <= on["degraded"], on
        assert off["p50"] >= BREAKER_TIMEOUT_MS / 1000 - 0.05 and off["skipped"] == 0, off
        assert on["slow"] * 3 < off["slow"] or on["slow"] <= 2 * (3 + FREEZE_S / 0.5 + 1) + 8, results
        # Thawed: guarded again, fast.
        assert on["after_skipped"] == 0 and on["after_p50"] < 0.2, on
        key = h.new_key("breaker-after")
        executed0 = envoy.counter("executed")
        first = h.request(envoy.port("main"), "POST", "/orders", "{}", [("Idempotency-Key", key)])
        assert first.status == 201 and envoy.counter("executed") == executed0 + 1
        note(f"idemstore frozen {FREEZE_S:.0f} s under 8 clients (store_timeout_ms {BREAKER_TIMEOUT_MS}, lock_wait_ms 0): "
             f"breaker on: {on['frozen']} requests in the freeze, p50 {on['p50'] * 1000:.0f} ms, "
             f"p99 {on['p99'] * 1000:.0f} ms, max {on['max'] * 1000:.0f} ms, {on['slow']} waited a timeout, "
             f"store_skipped {on['skipped']}; breaker off: {off['frozen']} requests, p50 {off['p50'] * 1000:.0f} ms, "
             f"p99 {off['p99'] * 1000:.0f} ms, {off['slow']} waited a timeout; after the thaw p50 "
             f"{on['after_p50'] * 1000:.0f} ms, max {on['after_max'] * 1000:.0f} ms")
    finally:
        if envoy is not None:
            envoy.stop()
        store.stop()
        redis.stop()
