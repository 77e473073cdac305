"""The VM's cache of recently replayed records (`record_cache_entries`, `record_cache_bytes`):
a retried key is answered without a store call, byte for byte the stored answer, and never
after the record has expired in the store. One worker (`--concurrency 1`), so that every
request meets the same VM's cache and the store's counts are exact.

The store calls are counted by idemstore (`GET /metrics`, per op and outcome); on the native host
(IDEM_HOST=native), whose store runs in Envoy, by the Redis it uses: every store call is one Lua
script there (`begin`, `commit`, `release`), so the script calls Redis ran are the calls, the
retries' `begin`s among them (the memory backend has nothing to read from outside: skipped)."""

from __future__ import annotations

import json
import time

import pytest

from support import harness as h
from support import redis_cluster as rc
from support.checks import assert_executed, assert_problem, assert_replay_of
from support.harness import new_key
from support.idemstore_metrics import deltas, quiet
from support.stack import plugin_config, start_backend

LISTENERS = {
    "cache": {},
    "nocache": {"record_cache_entries": 0},
    "short": {"retention_seconds": 2},
    "tiny": {"record_cache_entries": 2},
}


@pytest.fixture(scope="module", params=["memory", "redis"])
def one_worker(request, run_dir, artifacts, upstream):
    sub = run_dir / f"record-cache-{request.param}"
    store, sport, redis = start_backend(sub, request.param)
    try:
        filters = {ln: [h.wasm_filter(plugin_config(**cfg), artifacts["wasm"])] for ln, cfg in LISTENERS.items()}
        envoy = h.await_envoy(h.spawn_envoy(sub, "envoy", filters, upstream.port, sport, concurrency=1))
    except h.HarnessError:
        store.stop()
        if redis is not None:
            redis.stop()
        raise
    yield envoy, StoreCalls(sport, redis)
    envoy.stop()
    store.stop()
    if redis is not None:
        redis.stop()


class StoreCalls:
    """The store calls the stack's store served: `snapshot()` once nothing is in flight, and
    `since(snapshot)`: on the wasm host idemstore's counts by (op, outcome) that moved; on the
    native host {("begin", "record"): n}-shaped, n the Lua script calls its Redis ran (the
    retries of these tests only replay: every call a `begin` that finds the record)."""

    def __init__(self, idemstore_port: int, redis: h.Proc | None):
        self.idemstore_port = idemstore_port
        # Its TLS port on a secured store (IDEM_SECURE_STORE), where `rc.command` speaks TLS.
        flag = "--tls-port" if redis is not None and "--tls-port" in redis.argv else "--port"
        self.redis_port = None if redis is None else int(redis.argv[redis.argv.index(flag) + 1])

    def _scripts(self) -> int:
        stats = rc.info_fields(rc.text(self.redis_port, "INFO", "commandstats"))
        calls = 0
        for name in ("cmdstat_evalsha", "cmdstat_eval"):
            fields = dict(f.split("=", 1) for f in stats.get(name, "calls=0").split(","))
            calls += int(fields["calls"])
        return calls

    def snapshot(self):
        if not h.native():
            return quiet(self.idemstore_port)
        if self.redis_port is None:
            pytest.skip(h.NO_IDEMSTORE + " (and the in-memory store's calls cannot be read from outside)")
        # As `quiet`: no count moving for 200 ms (a commit may still be landing).
        last = self._scripts()
        for _ in range(50):
            time.sleep(0.2)
            now = self._scripts()
            if now == last:
                return now
            last = now
        raise AssertionError("the store's Redis never went quiet")

    def since(self, before) -> dict:
        after = self.snapshot()
        if not h.native():
            return deltas(before, after)
        return {("begin", "record"): after - before} if after != before else {}


def post(envoy, listener, key, body="{}"):
    hdrs = [("content-type", "application/json"), ("Idempotency-Key", key)]
    return h.request(envoy.port(listener), "POST", "/orders", body, hdrs)


def test_retries_are_answered_from_the_cache_without_a_store_call(one_worker, upstream):
    envoy, calls = one_worker
    key = new_key("cache")
    body = json.dumps({"item": "lamp"})
    first = post(envoy, "cache", key, body)
    assert_executed(first, 201)
    before, hits = calls.snapshot(), envoy.counter("cache_hits")

    # The first retry asks the store, which returns the record with its lifetime; the cache
    # answers the twenty after it.
    for _ in range(21):
        assert_replay_of(post(envoy, "cache", key, body), first)
    assert upstream.count(key=key) == 1
    assert envoy.counter("cache_hits") - hits == 20
    assert calls.since(before) == {("begin", "record"): 1}

    # Another body under the same key: the cached record's hash says 422, as the store would.
    other = post(envoy, "cache", key, json.dumps({"item": "desk"}))
    assert_problem(other, 422, raw_key=key)
    assert envoy.counter("cache_hits") - hits == 21
    assert_replay_of(post(envoy, "cache", key, body), first)
    assert calls.since(before) == {("begin", "record"): 1}
    assert upstream.count(key=key) == 1


def test_without_the_cache_every_retry_asks_the_store(one_worker, upstream):
    envoy, calls = one_worker
    key = new_key("nocache")
    first = post(envoy, "nocache", key)
    assert_executed(first, 201)
    before, hits = calls.snapshot(), envoy.counter("cache_hits")
    for _ in range(10):
        assert_replay_of(post(envoy, "nocache", key), first)
    assert envoy.counter("cache_hits") == hits
    assert calls.since(before) == {("begin", "record"): 10}
    assert upstream.count(key=key) == 1


def test_the_cache_is_bounded_and_forgets_the_oldest(one_worker, upstream):
    """Two entries: after three keys are replayed, the first one asks the store again."""
    envoy, calls = one_worker
    keys = [new_key("tiny") for _ in range(3)]
    firsts = {k: post(envoy, "tiny", k) for k in keys}
    for k in keys:
        assert_replay_of(post(envoy, "tiny", k), firsts[k])  # from the store, then cached
    before = calls.snapshot()
    assert_replay_of(post(envoy, "tiny", keys[2]), firsts[keys[2]])  # cached
    assert_replay_of(post(envoy, "tiny", keys[1]), firsts[keys[1]])  # cached
    assert_replay_of(post(envoy, "tiny", keys[0]), firsts[keys[0]])  # evicted: the store again
    assert calls.since(before) == {("begin", "record"): 1}
    assert all(upstream.count(key=k) == 1 for k in keys)


def test_a_cached_record_is_never_replayed_after_it_expired_in_the_store(one_worker, upstream):
    """`retention_seconds: 2`: retried every 50 ms from the cache, the key runs again once the
    store's record has expired, not later (the cache keeps it no longer than the store's
    reported lifetime) and not earlier."""
    envoy, _ = one_worker
    key = new_key("expiry")
    sent = time.monotonic()
    first = post(envoy, "short", key)
    done = time.monotonic()
    assert_executed(first, 201)
    hits = envoy.counter("cache_hits")
    replays = 0
    while True:
        r = post(envoy, "short", key)
        now = time.monotonic()
        if r.header("x-idempotent-replay") == "true":
            assert_replay_of(r, first)
            replays += 1
            # The record was stored after `sent`, for 2 s: a replay after that is a stale one.
            assert now - sent < 2.0 + 0.25, f"replayed {now - sent:.2f} s after the first request"
        else:
            assert_executed(r, 201)
            break
        assert now - sent < 10, "never executed again"
        time.sleep(0.05)
    assert now - done >= 2.0 - 0.25, f"ran again only {now - done:.2f} s after the first answer"
    assert upstream.count(key=key) == 2
    assert replays >= 10
    assert envoy.counter("cache_hits") - hits >= replays - 1
