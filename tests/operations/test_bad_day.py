"""The bad day a wrong answer was stored: `idemstore records` (the real binary) finds a request's
record by the same derivation as the filter (subject, method, route, client key) or by its
store key, deletes it and its lock, and the next retry runs again; a wrong subject or key finds
and deletes nothing. Against the test's Redis directly, and through idemstore's admin routes
with its shared secret (refused without it or with another, nothing deleted).

One Envoy worker (`--concurrency 1`), so that every request of a listener meets the same VM's
record cache. The listeners that retry after a delete run with the cache off
(`record_cache_entries: 0`, as README "When a wrong answer was stored" advises); the `cache`
listener shows what a worker that cached the record does: it keeps replaying it."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from support import harness as h
from support.checks import assert_executed, assert_replay_of
from support.harness import new_key
from support.stack import plugin_config

SECRET = "e2e-bad-Day_secret!"
STORE_KEY_HEADER = "x-idempotency-store-key"
NO_CACHE = {"record_cache_entries": 0, "store_secret": SECRET}
LISTENERS = {
    # The store key reaches the upstream too: the test checks the tool derives that very key.
    "nocache": {**NO_CACHE, "store_key_header": STORE_KEY_HEADER},
    "header": {**NO_CACHE, "subject": {"header": "x-user"}},
    "cache": {"store_secret": SECRET},
}
# The route `/orders` takes in the harness's routes (a named route: its name is the scope).
ROUTE = "orders"
# Requests come from 127.0.0.1 and the listeners have no `subject`: the filter's subject.
ANON = "anon:127.0.0.1"


@pytest.fixture(scope="module")
def bad_day(run_dir, artifacts, upstream):
    sub = run_dir / "bad-day"
    sub.mkdir(parents=True, exist_ok=True)
    secret_file = sub / "secret"
    secret_file.write_text(SECRET + "\n")
    wrong_file = sub / "wrong-secret"
    wrong_file.write_text("not-the-secret\n")
    redis, rport = h.start_redis(sub)
    store = None
    try:
        sport = h.free_port()
        argv = [h.idemstore_bin(), "--listen", f"{h.LOOPBACK}:{sport}", "--redis",
                f"redis://{h.LOOPBACK}:{rport}", "--secret-file", str(secret_file)]
        store = h.start("idemstore-bad-day", argv, sub, env={"RUST_LOG": "info"})
        h.await_idemstore(store, sport)
        filters = {ln: [h.wasm_filter(plugin_config(**cfg), artifacts["wasm"])] for ln, cfg in LISTENERS.items()}
        envoy = h.await_envoy(h.spawn_envoy(sub, "envoy", filters, upstream.port, sport, concurrency=1))
    except h.HarnessError:
        if store is not None:
            store.stop()
        redis.stop()
        raise
    yield {
        "envoy": envoy, "store": store, "redis": f"redis://{h.LOOPBACK}:{rport}",
        "url": f"http://{h.LOOPBACK}:{sport}", "secret": str(secret_file), "wrong": str(wrong_file),
    }
    envoy.stop()
    store.stop()
    redis.stop()


def records(*args: str) -> subprocess.CompletedProcess:
    """`idemstore records ...` as an operator runs it, without the service's environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IDEMSTORE_")}
    return subprocess.run([h.idemstore_bin(), "records", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def request_of(key: str, subject: str = ANON) -> list[str]:
    return ["--subject", subject, "--method", "POST", "--route", ROUTE, "--key", key]


def post(envoy: h.Envoy, listener: str, key: str, headers: list | None = None) -> h.Response:
    hdrs = [("Idempotency-Key", key), ("content-type", "application/json"), *(headers or [])]
    return h.request(envoy.port(listener), "POST", "/orders", '{"item":"lamp"}', hdrs)


def stored_and_replayed(envoy: h.Envoy, listener: str, key: str, upstream, headers=None) -> h.Response:
    """A first request that ran, and its retry replayed: the record is in the store."""
    first = post(envoy, listener, key, headers)
    assert_executed(first, 201)
    assert_replay_of(post(envoy, listener, key, headers), first)
    assert upstream.count(key=key) == 1
    return first


def test_delete_lets_the_next_retry_run_again(bad_day, upstream):
    envoy, redis = bad_day["envoy"], bad_day["redis"]
    key = new_key("bad")
    first = stored_and_replayed(envoy, "nocache", key, upstream)

    # The tool derives the store key the filter derived (the upstream saw it in the header).
    seen = [v for n, v in upstream.executions(key=key, headers=True)[0]["headers"] if n == STORE_KEY_HEADER]
    found = records("lookup", "--redis", redis, "--json", *request_of(key))
    assert found.returncode == 0, found
    report = json.loads(found.stdout)
    assert [report["store_key"]] == seen
    assert report["record"]["status"] == 201 and report["lock"] is None, report
    assert report["record"]["ttl_ms"] > 86_000_000, report

    # A wrong subject, key or route: nothing found, nothing deleted.
    for wrong in (request_of(key, "anon:127.0.0.2"), request_of(key + "x"),
                  ["--subject", ANON, "--method", "POST", "--route", "/orders", "--key", key]):
        missed = records("delete", "--redis", redis, *wrong)
        assert missed.returncode == 1, missed
        assert "nothing found for store key" in missed.stdout and "nothing deleted" in missed.stdout, missed
    assert_replay_of(post(envoy, "nocache", key), first)
    assert upstream.count(key=key) == 1

    deleted = records("delete", "--redis", redis, *request_of(key))
    assert deleted.returncode == 0, deleted
    assert f"store key  {seen[0]}" in deleted.stdout, deleted.stdout
    assert "record     status 201" in deleted.stdout, deleted.stdout
    assert deleted.stdout.endswith("deleted record\n"), deleted.stdout

    # The next retry runs again, and its answer is the record from now on.
    second = post(envoy, "nocache", key)
    assert_executed(second, 201)
    assert second.body != first.body
    assert upstream.count(key=key) == 2
    assert_replay_of(post(envoy, "nocache", key), second)
    assert upstream.count(key=key) == 2

    again = records("delete", "--redis", redis, "--store-key", seen[0][:12])
    assert again.returncode == 0 and "deleted record" in again.stdout, again
    gone = records("lookup", "--redis", redis, "--store-key", seen[0])
    assert gone.returncode == 1 and f"nothing found for store key {seen[0]}" in gone.stdout, gone


def test_the_subject_from_a_header(bad_day, upstream):
    envoy, redis = bad_day["envoy"], bad_day["redis"]
    key = new_key("bad-subject")
    alice = [("x-user", "alice")]
    first = stored_and_replayed(envoy, "header", key, upstream, alice)

    # Another caller's subject finds nothing; the bare caller is not a subject the filter makes.
    missed = records("delete", "--redis", redis, *request_of(key, "id:bob"))
    assert missed.returncode == 1 and "nothing deleted" in missed.stdout, missed
    refused = records("delete", "--redis", redis, *request_of(key, "alice"))
    assert refused.returncode == 2 and "id:<caller>" in refused.stderr, refused
    assert_replay_of(post(envoy, "header", key, alice), first)
    assert upstream.count(key=key) == 1

    deleted = records("delete", "--redis", redis, *request_of(key, "id:alice"))
    assert deleted.returncode == 0 and deleted.stdout.endswith("deleted record\n"), deleted
    assert_executed(post(envoy, "header", key, alice), 201)
    assert upstream.count(key=key) == 2


def test_over_http_with_the_secret(bad_day, upstream):
    envoy, url = bad_day["envoy"], bad_day["url"]
    key = new_key("bad-http")
    first = stored_and_replayed(envoy, "nocache", key, upstream)

    for secret in ([], ["--secret-file", bad_day["wrong"]]):
        for command in ("lookup", "delete"):
            refused = records(command, "--url", url, *secret, *request_of(key))
            assert refused.returncode == 2, refused
            assert "idemstore refused the secret (401)" in refused.stderr, refused
            assert SECRET not in refused.stderr + refused.stdout
    assert_replay_of(post(envoy, "nocache", key), first)
    assert upstream.count(key=key) == 1

    found = records("lookup", "--url", url, "--secret-file", bad_day["secret"], "--json", *request_of(key))
    assert found.returncode == 0, found
    store_key = json.loads(found.stdout)["store_key"]
    counts = records("count", "--url", url, "--secret-file", bad_day["secret"], "--json")
    assert counts.returncode == 0 and json.loads(counts.stdout)["records"] >= 1, counts
    direct = records("count", "--redis", bad_day["redis"], "--json")
    assert json.loads(direct.stdout) == json.loads(counts.stdout), (direct, counts)

    # By the 12 characters the filter's debug log lines show.
    deleted = records("delete", "--url", url, "--secret-file", bad_day["secret"], "--store-key", store_key[:12])
    assert deleted.returncode == 0, deleted
    assert f"the only store key starting with {store_key[:12]}" in deleted.stdout, deleted.stdout
    assert deleted.stdout.endswith("deleted record\n"), deleted.stdout
    assert "an operator deleted what a store key held" in bad_day["store"].log_text()
    assert_executed(post(envoy, "nocache", key), 201)
    assert upstream.count(key=key) == 2


def test_a_worker_that_cached_the_record_keeps_replaying_it(bad_day, upstream):
    """README "When a wrong answer was stored": the record cache is not told of a delete. The
    worker that replayed the record keeps it until it expires; a filter without the cache (here
    another listener, the same store key) runs the request again."""
    envoy, redis = bad_day["envoy"], bad_day["redis"]
    key = new_key("bad-cache")
    first = stored_and_replayed(envoy, "cache", key, upstream)  # the retry's replay is now cached
    hits = envoy.counter("cache_hits")
    deleted = records("delete", "--redis", redis, *request_of(key))
    assert deleted.returncode == 0 and "deleted record" in deleted.stdout, deleted

    assert_replay_of(post(envoy, "cache", key), first)
    assert envoy.counter("cache_hits") == hits + 1
    assert upstream.count(key=key) == 1
    # The same store key through the listener without the cache: the store has no record now.
    assert_executed(post(envoy, "nocache", key), 201)
    assert upstream.count(key=key) == 2
    # The caching worker still answers with the record it kept, not the new one.
    assert_replay_of(post(envoy, "cache", key), first)
    assert upstream.count(key=key) == 2
