"""Surviving the lost client: `detached_execution`, `detached_timeout_ms` and
`store_key_header`.

With `detached_execution` a guarded request that acquired the lock is not resumed through the
router: the filter sends it itself, as an HTTP callout owned by its root context, to the route's
cluster, and answers the paused client with the upstream's answer as a local response. A client
that goes away meanwhile no longer cancels the execution: the answer is committed (or the lock
released) all the same, so the client's retry replays it. Without it (the default), Envoy resets
the upstream request when the client goes (envoyproxy/envoy#11931), whatever the application did:
the key is left in doubt (`unknown_outcome: hold`) and the retry gets `409` `outcome-unknown`,
running nothing (asserted here too; tests/contract/test_in_doubt.py has the rest).

Every test runs on a dedicated Envoy (per backend, sharing the session's idemstore and counting
upstream) so that its counters move only with this module's requests, with the listeners:

- `plain`: the defaults (routed, no store key header);
- `keyheader`: routed, `store_key_header`;
- `detached`: `detached_execution` and `store_key_header`;
- `detached_fast`: `detached_execution` with `detached_timeout_ms: 1000`;

and, besides the usual routes, `/refused` to a cluster whose port nothing listens on.
"""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from support import harness as h
from support.checks import PANIC, REPLAY, assert_executed, assert_problem, assert_replay_of
from support.harness import new_key
from support.stack import Stack, plugin_config

STORE_KEY_HEADER = "x-idempotency-store-key"
HEX64 = re.compile(r"^[0-9a-f]{64}$")
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")

LISTENERS: dict[str, dict] = {
    "plain": {},
    "keyheader": {"store_key_header": STORE_KEY_HEADER},
    "detached": {"detached_execution": True, "store_key_header": STORE_KEY_HEADER},
    "detached_fast": {"detached_execution": True, "detached_timeout_ms": 1000},
}

ROUTES = [{"name": "refused", "match": {"prefix": "/refused"},
           "route": {"cluster": "refused", "timeout": "20s"}}] + h.DEFAULT_ROUTES

# The lost client: it gives up after CLIENT_TIMEOUT while the upstream takes UPSTREAM_SLEEP_MS,
# then retries with the same key, each retry with the same timeout, at most RETRIES times.
CLIENT_TIMEOUT = 1.0
UPSTREAM_SLEEP_MS = 2000
RETRIES = 3


@pytest.fixture(scope="module")
def dstack(stack, run_dir, artifacts) -> Stack:
    """An Envoy with this module's listeners on the session stack's idemstore (per backend)."""
    sub = run_dir / stack.backend / "detached"
    refused_port = h.free_port()  # nothing listens there: connections are refused

    def add_refused_cluster(config: dict) -> None:
        config["static_resources"]["clusters"].append(
            h.static_cluster("refused", refused_port, connect_timeout="0.25s"))

    filters = {ln: [h.wasm_filter(plugin_config(**cfg), artifacts["wasm"])] for ln, cfg in LISTENERS.items()}
    envoy = h.spawn_envoy(sub, "envoy-detached", filters, stack.upstream.port, stack.idemstore_port,
                          routes=ROUTES, config_hook=add_refused_cluster)
    try:
        h.await_envoy(envoy)
    except h.HarnessError as e:
        pytest.fail(f"the Envoy with the detached listeners did not start: {e}", pytrace=False)
    s = Stack(stack.backend, envoy, stack.upstream, stack.idemstore, stack.idemstore_port, stack.redis)
    yield s
    envoy.stop()


@pytest.fixture(autouse=True)
def no_panic_in_detached_envoy(dstack):
    """Fails the test on a wasm panic or trap logged by the module's Envoy during it."""
    start = len(dstack.envoy.log_text())
    yield
    bad = [ln for ln in dstack.envoy.log_text()[start:].splitlines() if PANIC.search(ln)]
    if bad:
        pytest.fail("wasm panic or trap in the detached Envoy's log:\n" + "\n".join(bad[:20]), pytrace=False)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def deltas(s: Stack, before: dict[str, int]) -> dict[str, int]:
    after = s.envoy.counters()
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}


def lose_then_retry_h1(s: Stack, listener: str, key: str, body: str) -> tuple[list[str], h.Response | None]:
    """The lost client over HTTP/1.1: the first request and up to RETRIES retries, each on a new
    connection that the client closes after CLIENT_TIMEOUT without an answer. Returns what
    happened to each attempt ("timeout" or "answered") and the first answer (or None)."""
    hdrs = [("x-test-sleep-ms", str(UPSTREAM_SLEEP_MS))]
    try:
        early = s.post("/orders", body, key, listener=listener, headers=hdrs, timeout=CLIENT_TIMEOUT)
    except TimeoutError:
        pass
    else:
        pytest.fail(f"answered before the client's timeout, the scenario needs a slow upstream: {early}")
    # The original reached the upstream before the client gave up.
    assert s.upstream.count(key=key) == 1, s.upstream.executions(key=key)
    log = ["timeout"]
    for _ in range(RETRIES):
        try:
            resp = s.post("/orders", body, key, listener=listener, headers=hdrs, timeout=CLIENT_TIMEOUT)
        except TimeoutError:
            log.append("timeout")
            continue
        log.append("answered")
        return log, resp
    return log, None


def assert_replays_single_execution(s: Stack, key: str, final: h.Response | None, log: list[str]) -> dict:
    """One execution, and `final` is its answer replayed (status 201, its body and location)."""
    execs = s.upstream.executions(key=key)
    assert len(execs) == 1, (log, execs)
    assert final is not None, f"every retry timed out: {log}"
    assert final.status == 201, (log, final)
    assert final.header(REPLAY) == "true", (log, final)
    doc = json.loads(final.body)
    assert doc["id"] == execs[0]["id"], (doc, execs)
    assert doc["key"] == key, doc
    assert final.header("location") == f"/things/{execs[0]['id']}", final
    assert final.header("content-type") == "application/json", final
    return execs[0]


# --------------------------------------------------------------------------------------------
# 1-3: the lost client
# --------------------------------------------------------------------------------------------


def test_detached_lost_client_h1_retry_replays_the_single_execution(dstack, note):
    s = dstack
    key = new_key("lost-h1")
    body = json.dumps({"item": "book", "qty": 1})
    before = s.envoy.counters()

    log, final = lose_then_retry_h1(s, "detached", key, body)
    note(f"detached lost client, HTTP/1.1 ({s.backend}): attempts {log}")
    assert_replays_single_execution(s, key, final, log)

    target = before.get("committed_after_gone", 0) + 1
    assert s.wait_counter("committed_after_gone", target) == target, deltas(s, before)
    d = deltas(s, before)
    assert d.get("detached") == 1, d
    assert d.get("stored") == 1, d
    assert d.get("released", 0) == 0, d
    assert d.get("replayed", 0) >= 1, d  # the final answer (a retry that timed out may count too)
    # A later retry, with all the time it needs, replays it too.
    again = s.post("/orders", body, key, listener="detached", headers=[("x-test-sleep-ms", "2000")])
    assert_replay_of(again, final)
    assert s.upstream.count(key=key) == 1


def test_routed_lost_client_h1_is_in_doubt_and_runs_once(dstack, note):
    """detached_execution off (the default): Envoy resets the upstream request when the client
    goes, the filter never sees an answer and leaves the key in doubt, so the first retry gets
    `409` `outcome-unknown` at once and nothing runs again."""
    s = dstack
    key = new_key("lost-routed")
    body = json.dumps({"item": "book", "qty": 1})
    before = s.envoy.counters()

    log, final = lose_then_retry_h1(s, "plain", key, body)
    execs = s.upstream.executions(key=key)
    note(f"routed lost client, HTTP/1.1 ({s.backend}): attempts {log}, {len(execs)} executions")
    assert log == ["timeout", "answered"], (log, final)
    assert_problem(final, 409, raw_key=key, code="outcome-unknown")
    assert len(execs) == 1, (log, execs)
    d = deltas(s, before)
    assert (d.get("in_doubt"), d.get("outcome_unknown"), d.get("released", 0)) == (1, 1, 0), d
    assert d.get("detached", 0) == 0, d
    assert d.get("stored", 0) == 0, d


def test_detached_lost_client_h2_stream_reset_retry_replays(dstack, note):
    """HTTP/2 with prior knowledge (codec_type AUTO): one connection; the client resets its stream
    (RST_STREAM CANCEL) after CLIENT_TIMEOUT and retries on new streams of the same connection."""
    from support.h2client import H2Client

    s = dstack
    key = new_key("lost-h2")
    body = json.dumps({"item": "pen", "qty": 3}).encode()
    hdrs = [("idempotency-key", key), ("content-type", "application/json"),
            ("x-test-sleep-ms", str(UPSTREAM_SLEEP_MS))]
    before = s.envoy.counters()
    h2_before = s.counter("http.detached.downstream_cx_http2_total")
    resets_before = s.counter("http.detached.downstream_rq_rx_reset")

    log: list[str] = []
    final = None
    with H2Client(s.port("detached")) as c:
        sid = c.send("POST", "/orders", hdrs, body)
        early = c.response(sid, CLIENT_TIMEOUT)
        assert early is None, f"answered before the client's timeout: {early}"
        c.reset(sid)
        log.append(f"stream {sid}: reset")
        assert s.upstream.count(key=key) == 1
        for _ in range(RETRIES):
            sid = c.send("POST", "/orders", hdrs, body)
            final = c.response(sid, CLIENT_TIMEOUT)
            if final is not None:
                log.append(f"stream {sid}: answered")
                break
            c.reset(sid)
            log.append(f"stream {sid}: reset")
        assert c.ping(), "the HTTP/2 connection did not survive the stream resets"

    note(f"detached lost client, h2c ({s.backend}): {log}")
    assert_replays_single_execution(s, key, final, log)
    # It was HTTP/2 downstream, and Envoy saw the client's resets.
    assert s.counter("http.detached.downstream_cx_http2_total") == h2_before + 1
    assert s.counter("http.detached.downstream_rq_rx_reset") >= resets_before + 1, log
    target = before.get("committed_after_gone", 0) + 1
    assert s.wait_counter("committed_after_gone", target) == target, deltas(s, before)
    d = deltas(s, before)
    assert d.get("detached") == 1, d
    assert d.get("stored") == 1, d


# --------------------------------------------------------------------------------------------
# the detached path with a client that stays
# --------------------------------------------------------------------------------------------


def test_detached_answer_reaches_the_client_then_replays(dstack, note):
    s = dstack
    key = new_key("detached-ok")
    before = s.envoy.counters()
    first = s.post("/orders", '{"item":"a"}', key, listener="detached")
    doc = assert_executed(first, 201)  # the upstream's status, body and own headers
    assert doc["key"] == key and doc["body"] == '{"item":"a"}', doc
    assert first.header("location") == f"/things/{doc['id']}", first
    assert first.header("content-type") == "application/json", first
    assert first.header("content-length") == str(len(first.body)), first
    assert first.header_all("transfer-encoding") == [], first
    note(f"detached answer's headers: {[k for k, _ in first.headers]}")
    retry = s.post("/orders", '{"item":"a"}', key, listener="detached")
    assert_replay_of(retry, first)
    assert s.upstream.count(key=key) == 1
    target = before.get("stored", 0) + 1
    assert s.wait_counter("stored", target) == target
    d = deltas(s, before)
    assert d.get("detached") == 1, d
    assert d.get("committed_after_gone", 0) == 0, d
    assert d.get("replayed") == 1, d


def test_detached_listener_routes_unguarded_requests(dstack):
    """Only guarded requests that took the lock are detached: no key, or an unguarded method,
    go through the router as usual."""
    s = dstack
    before = s.envoy.counters()
    no_key = s.post("/orders", "{}", None, listener="detached")
    assert_executed(no_key, 201)
    assert no_key.header("x-envoy-upstream-service-time") is not None, no_key  # the router's
    get = h.request(s.port("detached"), "GET", "/orders?x=1", None, [("idempotency-key", new_key())])
    assert_executed(get, 201)
    assert get.header("x-envoy-upstream-service-time") is not None, get
    assert deltas(s, before).get("detached", 0) == 0


# --------------------------------------------------------------------------------------------
# 4: the detached request reaches the upstream like a routed one
# --------------------------------------------------------------------------------------------

# What differs between the routed and the detached request as the upstream receives them
# (measured with Envoy 1.40.0, the routed request on a route with `timeout: 20s`, the detached
# one with the default `detached_timeout_ms` 15000); everything else is identical, including
# x-request-id (the client's, or one that Envoy generated for each request), x-forwarded-for,
# x-forwarded-proto, cookies, authorization, repeated headers and the query string:
#
# - x-envoy-expected-rq-timeout-ms: the route's timeout when routed, detached_timeout_ms when
#   detached (set by the router of Envoy's async HTTP client);
# - x-envoy-internal: true, detached only (Envoy's async client marks its requests internal);
# - x-request-id, when the client sent none: each request its own generated UUID;
# - a chunked request body is sent on chunked when routed, with content-length when detached
#   (the filter has the whole body).
DIFFERENT_VALUES = {"x-envoy-expected-rq-timeout-ms"}
ONLY_ROUTED: set[str] = set()
ONLY_DETACHED = {"x-envoy-internal"}


def header_diff(routed: list[list[str]], detached: list[list[str]]) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (routed values, detached values), for every name whose values (in order) differ."""
    def by_name(hs):
        out: dict[str, list[str]] = {}
        for k, v in hs:
            out.setdefault(k.lower(), []).append(v)
        return out

    r, d = by_name(routed), by_name(detached)
    return {n: (r.get(n, []), d.get(n, [])) for n in sorted(set(r) | set(d)) if r.get(n) != d.get(n)}


def send_pair(s: Stack, path: str, body, headers: list[tuple[str, str]]) -> tuple[dict, dict, str, str]:
    """The same request through `keyheader` (routed) and `detached`, each with its own key;
    returns what the upstream saw for each, and the keys."""
    seen = []
    keys = []
    for listener in ("keyheader", "detached"):
        key = new_key(f"cmp-{listener}")
        resp = h.request(s.port(listener), "POST", path, body, headers + [("Idempotency-Key", key)])
        assert_executed(resp, 201)
        execs = s.upstream.executions(key=key, headers=True)
        assert len(execs) == 1, execs
        seen.append(execs[0])
        keys.append(key)
    return seen[0], seen[1], keys[0], keys[1]


def strip_keys(hs: list[list[str]]) -> list[list[str]]:
    return [[k, v] for k, v in hs if k not in ("idempotency-key", STORE_KEY_HEADER)]


@pytest.mark.parametrize("variant", ["client_ids", "minimal", "chunked_body"])
def test_detached_request_matches_routed_request(dstack, variant, note):
    s = dstack
    path = "/orders/ord_7?expand=items&note=a%20b&empty="
    body_bytes = json.dumps({"item": "book", "qty": 2, "note": "é"}).encode()
    headers = [
        ("host", "api.example.test"),
        ("content-type", "application/json"),
        ("accept", "application/json"),
        ("user-agent", "e2e-client/1.0"),
        ("X-Custom", "1"),
        ("x-multi", "a"),
        ("x-multi", "b"),
        ("authorization", "Bearer t0ken"),
        ("cookie", "a=1; b=2"),
    ]
    # client_ids: the client sends x-request-id and x-forwarded-for; minimal: neither.
    if variant == "client_ids":
        headers.append(("x-request-id", "client-supplied-id-123"))
    if variant != "minimal":
        headers.append(("x-forwarded-for", "203.0.113.7"))
    body = [body_bytes[:5], body_bytes[5:]] if variant == "chunked_body" else body_bytes

    routed, detached, rkey, dkey = send_pair(s, path, body, headers)

    for seen in (routed, detached):
        assert seen["method"] == "POST", seen
        assert seen["path"] == path, seen
        assert seen["body_sha256"] == hashlib.sha256(body_bytes).hexdigest(), seen
        assert seen["version"] == "HTTP/1.1", seen
    # The client's key and the derived store key, each exactly once. The subject is the
    # connection's address: with `use_remote_address: true` (as shipped) a client-sent
    # X-Forwarded-For is not trusted, and Envoy appends the connection's address to it.
    for seen, key in ((routed, rkey), (detached, dkey)):
        got = [v for k, v in seen["headers"] if k == "idempotency-key"]
        assert got == [key], seen["headers"]
        skh = [v for k, v in seen["headers"] if k == STORE_KEY_HEADER]
        assert skh == [h.store_key(key, subject="anon:127.0.0.1")], (key, seen["headers"])
        xff = [v for k, v in seen["headers"] if k == "x-forwarded-for"]
        # Envoy appends the address it trusts; the client's value, if any, stays in front.
        assert len(xff) == 1 and xff[0].split(",")[-1].strip() != "203.0.113.7", seen["headers"]
        if variant != "minimal":
            assert xff[0].startswith("203.0.113.7,"), seen["headers"]
        assert [v for k, v in seen["headers"] if k == "x-forwarded-proto"] == ["http"], seen["headers"]

    diff = header_diff(strip_keys(routed["headers"]), strip_keys(detached["headers"]))
    note(f"routed vs detached request headers ({variant}): "
         + (", ".join(f"{n}: {r} / {d}" for n, (r, d) in diff.items()) or "identical"))
    unexpected = {}
    for name, (r, d) in diff.items():
        if name == "x-envoy-expected-rq-timeout-ms":
            assert (r, d) == (["20000"], ["15000"]), (r, d)
            continue
        if name == "x-envoy-internal":
            assert (r, d) == ([], ["true"]), (r, d)
            continue
        if variant == "chunked_body" and name == "transfer-encoding":
            assert (r, d) == (["chunked"], []), (r, d)
            continue
        if variant == "chunked_body" and name == "content-length":
            assert (r, d) == ([], [str(len(body_bytes))]), (r, d)
            continue
        if name in DIFFERENT_VALUES and r and d:
            continue
        if name in ONLY_ROUTED and r and not d:
            continue
        if name in ONLY_DETACHED and d and not r:
            continue
        if name == "x-request-id":
            # Generated by Envoy for each request (an edge Envoy, `use_remote_address: true`,
            # does not keep an external client's): both carry one, each its own.
            assert len(r) == 1 and len(d) == 1 and UUID.match(r[0]) and UUID.match(d[0]), (r, d)
            continue
        unexpected[name] = (r, d)
    assert not unexpected, (
        f"headers that differ between the routed and the detached request: {unexpected}\n"
        f"routed:   {routed['headers']}\ndetached: {detached['headers']}")


def test_store_key_header_is_derived_and_cannot_be_forged(dstack):
    s = dstack
    forged = "0" * 64
    for listener in ("keyheader", "detached"):
        # Guarded: the derived key, once, whatever the client sent.
        key = new_key(f"forge-{listener}")
        resp = s.post("/orders", "{}", key, listener=listener,
                      headers=[(STORE_KEY_HEADER, forged), (STORE_KEY_HEADER.upper(), "evil")])
        assert_executed(resp, 201)
        (ex,) = s.upstream.executions(key=key, headers=True)
        got = [v for k, v in ex["headers"] if k == STORE_KEY_HEADER]
        assert len(got) == 1 and HEX64.match(got[0]) and got[0] != forged, (listener, ex["headers"])
        assert got[0] == h.store_key(key), (listener, got)
        # Same scope and key, another route: another store key.
        key2 = new_key(f"forge-{listener}")
        s.post("/payments", "{}", key2, listener=listener)
        (ex2,) = s.upstream.executions(key=key2, headers=True)
        assert [v for k, v in ex2["headers"] if k == STORE_KEY_HEADER] == \
            [h.store_key(key2, route="payments")], ex2["headers"]

        # Unguarded (no key; a method that is not guarded): the client's value is removed.
        for method, hdrs in (("POST", []), ("GET", [("idempotency-key", new_key())]), ("PUT", [])):
            marker = new_key("unguarded")
            resp = h.request(s.port(listener), method, f"/orders?m={marker}", b"{}",
                             hdrs + [(STORE_KEY_HEADER, forged), ("content-type", "application/json")])
            assert_executed(resp, 201)
            (ex,) = s.upstream.executions(path=f"/orders?m={marker}", headers=True)
            assert [v for k, v in ex["headers"] if k == STORE_KEY_HEADER] == [], (listener, method, ex["headers"])

    # Without store_key_header the filter leaves such a header alone (it means nothing there).
    marker = new_key("plain")
    h.request(s.port("plain"), "POST", f"/orders?m={marker}", b"{}", [(STORE_KEY_HEADER, forged)])
    (ex,) = s.upstream.executions(path=f"/orders?m={marker}", headers=True)
    assert [v for k, v in ex["headers"] if k == STORE_KEY_HEADER] == [forged], ex["headers"]


# --------------------------------------------------------------------------------------------
# 5: answers that are not stored
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [500, 502, 503, 504])
def test_detached_upstream_5xx_is_passed_on_and_released(dstack, status):
    """The upstream's own error answer reaches the client as it is (its status, body and
    headers; the filter must not take an upstream's 502/503/504 for a failed callout), and the
    lock is released: the retry runs again."""
    s = dstack
    key = new_key(f"detached-{status}")
    hdrs = [("x-test-status", str(status))]
    before = s.envoy.counters()
    first = s.post("/orders", "{}", key, listener="detached", headers=hdrs)
    doc = assert_executed(first, status)
    assert doc["key"] == key and doc["status"] == "done", doc
    assert first.header("content-type") == "application/json", first
    target = before.get("released", 0) + 1
    assert s.wait_counter("released", target) == target, deltas(s, before)
    retry = s.post("/orders", "{}", key, listener="detached", headers=hdrs)
    assert_executed(retry, status)
    assert json.loads(retry.body)["id"] != doc["id"]
    assert s.upstream.count(key=key) == 2
    d = deltas(s, before)
    assert d.get("detached") == 2, d
    assert d.get("stored", 0) == 0, d


def test_detached_timeout_is_504_and_in_doubt(dstack):
    """detached_timeout_ms is 1000 on `detached_fast`: an upstream that takes 3 s gets the
    callout cancelled; the client gets a 504 problem, the lock is given back and the key is in
    doubt: the retry (at once, not held up) gets `409` `outcome-unknown` and runs nothing."""
    s = dstack
    key = new_key("detached-504")
    before = s.envoy.counters()
    resp = s.post("/orders", "{}", key, listener="detached_fast", headers=[("x-test-sleep-ms", "3000")], timeout=10)
    assert 0.9 <= resp.elapsed < 2.5, (resp.elapsed, resp)
    target = before.get("in_doubt", 0) + 1
    assert s.wait_counter("in_doubt", target) == target, (deltas(s, before), resp)
    retry = s.post("/orders", "{}", key, listener="detached_fast")
    assert_problem(retry, 409, raw_key=key, code="outcome-unknown")
    assert retry.elapsed < 1.0, retry.elapsed
    assert s.upstream.count(key=key) == 1
    # Checked last, so that a wrong answer does not hide whether the key was left in doubt.
    assert_problem(resp, 504, raw_key=key)


def test_detached_reset_is_502_and_in_doubt(dstack):
    """The upstream read the request and reset the connection (it may have done its work): the
    client gets a 502 problem, and the key is in doubt: the retry gets `409` at once."""
    s = dstack
    key = new_key("detached-reset")
    before = s.envoy.counters()
    resp = s.post("/orders", "{}", key, listener="detached", headers=[("x-test-reset", "1")], timeout=10)
    target = before.get("in_doubt", 0) + 1
    assert s.wait_counter("in_doubt", target) == target, (deltas(s, before), resp)
    retry = s.post("/orders", "{}", key, listener="detached", headers=[("x-test-reset", "1")], timeout=10)
    assert retry.elapsed < 1.0, (retry.elapsed, retry)
    assert_problem(retry, 409, raw_key=key, code="outcome-unknown")
    assert s.upstream.count(key=key) == 1
    d = deltas(s, before)
    assert (d.get("detached"), d.get("stored", 0), d.get("released", 0)) == (1, 0, 0), d
    assert_problem(resp, 502, raw_key=key)


def test_detached_refused_is_502_and_released(dstack):
    """A connection that could not be made sent nothing: the lock is released at once and the
    retry is executed again (not held up, not a 409)."""
    s = dstack
    key = new_key("detached-refused")
    before = s.envoy.counters()
    resp = s.post("/refused", "{}", key, listener="detached", timeout=10)
    target = before.get("released", 0) + 1
    assert s.wait_counter("released", target) == target, (deltas(s, before), resp)
    retry = s.post("/refused", "{}", key, listener="detached", timeout=10)
    assert retry.elapsed < 1.0, (retry.elapsed, retry)
    d = deltas(s, before)
    assert (d.get("detached"), d.get("stored", 0), d.get("in_doubt", 0)) == (2, 0, 0), d
    assert_problem(resp, 502, raw_key=key)
    assert_problem(retry, 502, raw_key=key)
