"""Retries and hedges of a service mesh, end to end: mint mode on the sending side, the guard on
the receiving side.

A **client Envoy** (the caller's sidecar) runs the filter in mint mode (`{"mode": "mint"}`): a
guarded request (POST, PATCH) without an `Idempotency-Key` gets `idempotency-key: "<32 hex>"`
(an RFC 8941 sf-string, 128 random bits) before the router, so every retry and hedged attempt
of that request carries the same key; a key the client sent is left alone; no store call;
counted on `minted`. Its route retries: `per_try_timeout: 0.3s`, `num_retries: 3`,
`retry_on: "5xx,reset"` (`RETRY_POLICY`). A **server Envoy** (the service's sidecar) runs the
filter as it is, with `detached_execution: true` (an attempt the sender abandons keeps running,
and its answer is stored) and a `lock_wait_ms` long enough for a retry to wait for the original,
on an in-memory idemstore of this module, in front of the session's counting upstream.

- `server`: listeners `guard` (the filter) and `bare` (no filter);
- `client`: listeners `mint` (mint filter, the retry policy, cluster `server` to `guard`) and
  `hedge` (the same with `hedge_policy: {hedge_on_per_try_timeout: true}` on the virtual host,
  cluster `server_hedged` to `guard`);
- `bare_client`: listener `bare` (the retry policy, no filter, cluster `server_bare` to the
  server's `bare` listener): the same topology without the filters;
- `mtls_server`: listener `mtls` (TLS, client certificates required and verified against the
  test CA) and `plain` (plain text), both with the filter scoping records by the peer
  certificate's URI SAN (`"subject": {"property": ["connection", "uri_san_peer_certificate"]}`);
- `mtls_clients`: listeners `one`, `two`, `nosan` (mint filter, the retry policy), each to
  the server's `mtls` listener with its own client certificate (URI SANs `SPIFFE_ONE`,
  `SPIFFE_TWO`; `nosan` has a DNS SAN only). The certificates are made at run time
  (`support/pki.py`).

The app's timing and answers come from the counting upstream's request headers
(`x-test-sleep-ms`, `x-test-first-status`); executions are counted there per path and key.
"""

from __future__ import annotations

import json
import re
import socket
import ssl
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from support import harness as h
from support import pki as tls
from support.checks import PANIC, REPLAY, assert_executed, assert_replay_of
from support.harness import new_key
from support.stack import plugin_config, start_backend

MINTED = re.compile(r'^"[0-9a-f]{32}"$')

RETRY_POLICY = {"retry_on": "5xx,reset", "num_retries": 3, "per_try_timeout": "0.3s"}
APP_SLEEP_MS = 1000  # the app is slower than three per-try timeouts, faster than four
ATTEMPTS = 1 + RETRY_POLICY["num_retries"]

MINT = {"mode": "mint"}
GUARD = plugin_config(detached_execution=True, lock_wait_ms=5000)
SAN_SUBJECT = {"property": ["connection", "uri_san_peer_certificate"]}
SAN_GUARD = plugin_config(subject=SAN_SUBJECT, detached_execution=True, lock_wait_ms=5000)
SPIFFE_ONE = "spiffe://test/ns/a/sa/one"
SPIFFE_TWO = "spiffe://test/ns/a/sa/two"

BODY = json.dumps({"item": "book", "qty": 1})

# Every Envoy this module started, and how much of its log a test has seen (panic check per test).
_ENVOYS: list[h.Envoy] = []


# --------------------------------------------------------------------------------------------
# the topology
# --------------------------------------------------------------------------------------------


def client_routes(cluster: str) -> list[dict]:
    return [{"name": "mesh", "match": {"prefix": "/"},
             "route": {"cluster": cluster, "timeout": "10s", "retry_policy": RETRY_POLICY}}]


def running(*envoys: h.Envoy) -> None:
    """Awaits Envoys spawned together; one that does not start fails the test (the others are
    stopped)."""
    _ENVOYS.extend(envoys)
    try:
        for envoy in envoys:
            h.await_envoy(envoy)
    except h.HarnessError as e:
        for envoy in envoys:
            envoy.stop()
        pytest.fail(f"an Envoy of the mesh did not start: {e}", pytrace=False)


@pytest.fixture(scope="module")
def mesh_dir(run_dir) -> Path:
    return run_dir / "mesh"


@pytest.fixture(scope="module")
def store_port(mesh_dir, artifacts) -> int:
    proc, port, _ = start_backend(mesh_dir, "memory", "idemstore")
    yield port
    proc.stop()


@pytest.fixture(scope="module")
def server(mesh_dir, artifacts, upstream, store_port) -> h.Envoy:
    envoy = h.spawn_envoy_with(mesh_dir, "envoy-server", {
        "guard": {"filters": [h.wasm_filter(GUARD, artifacts["wasm"])]},
        "bare": {},
    }, [h.static_cluster("upstream", upstream.port), h.store_cluster(store_port)])
    running(envoy)
    yield envoy
    envoy.stop()


@pytest.fixture(scope="module")
def client(mesh_dir, artifacts, server) -> h.Envoy:
    mint = h.wasm_filter(MINT, artifacts["wasm"])
    envoy = h.spawn_envoy_with(mesh_dir, "envoy-client", {
        "mint": {"filters": [mint], "routes": client_routes("server")},
        "hedge": {"filters": [mint], "routes": client_routes("server_hedged"),
                  "virtual_host": {"hedge_policy": {"hedge_on_per_try_timeout": True}}},
    }, [h.static_cluster("server", server.port("guard")),
        h.static_cluster("server_hedged", server.port("guard"))])
    running(envoy)
    yield envoy
    envoy.stop()


@pytest.fixture(scope="module")
def bare_client(mesh_dir, server) -> h.Envoy:
    envoy = h.spawn_envoy_with(mesh_dir, "envoy-client-bare", {
        "bare": {"routes": client_routes("server_bare")},
    }, [h.static_cluster("server_bare", server.port("bare"))])
    running(envoy)
    yield envoy
    envoy.stop()


@dataclass
class Certs:
    ca: Path
    server: tls.Cert
    one: tls.Cert
    two: tls.Cert
    nosan: tls.Cert


@pytest.fixture(scope="module")
def certs(mesh_dir) -> Certs:
    pki = tls.Pki(mesh_dir / "pki")
    return Certs(
        ca=pki.ca,
        server=pki.issue("server", dns=("localhost",), ips=("127.0.0.1",), server=True),
        one=pki.issue("workload-one", uris=(SPIFFE_ONE,), client=True),
        two=pki.issue("workload-two", uris=(SPIFFE_TWO,), client=True),
        nosan=pki.issue("workload-nosan", dns=("workload-nosan.test",), client=True),
    )


@dataclass
class Mtls:
    server: h.Envoy
    clients: h.Envoy
    certs: Certs


@pytest.fixture(scope="module")
def mtls(mesh_dir, artifacts, upstream, store_port, certs) -> Mtls:
    wasm = artifacts["wasm"]
    srv = h.spawn_envoy_with(mesh_dir, "envoy-mtls-server", {
        "mtls": {"filters": [h.wasm_filter(SAN_GUARD, wasm)],
                 "transport_socket": tls.downstream_tls(certs.server, certs.ca, require_client=True)},
        "plain": {"filters": [h.wasm_filter(SAN_GUARD, wasm)]},
    }, [h.static_cluster("upstream", upstream.port), h.store_cluster(store_port)])
    mint = h.wasm_filter(MINT, wasm)
    workloads = {"one": certs.one, "two": certs.two, "nosan": certs.nosan}
    cli = h.spawn_envoy_with(
        mesh_dir, "envoy-mtls-clients",
        {name: {"filters": [mint], "routes": client_routes(f"mtls_{name}")} for name in workloads},
        [h.static_cluster(f"mtls_{name}", srv.port("mtls"), transport_socket=tls.upstream_tls(certs.ca, cert))
         for name, cert in workloads.items()])
    running(srv, cli)
    yield Mtls(srv, cli, certs)
    cli.stop()
    srv.stop()


@pytest.fixture(autouse=True)
def no_panic_in_mesh_envoys():
    """Fails the test on a wasm panic or trap logged meanwhile by any Envoy of this module."""
    seen = {id(e): len(e.log_text()) for e in _ENVOYS}
    yield
    bad = []
    for e in _ENVOYS:
        bad += [f"{e.proc.name}: {ln}" for ln in e.log_text()[seen.get(id(e), 0):].splitlines() if PANIC.search(ln)]
    if bad:
        pytest.fail("wasm panic or trap in a mesh Envoy's log:\n" + "\n".join(bad[:20]), pytrace=False)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def unique_path(what: str) -> str:
    """A path of the server's `orders` route that no other request uses (executions are
    counted by it, whatever key a request carried)."""
    return f"/orders/{what}-{uuid.uuid4().hex}"


def post(port: int, path: str, key: str | None = None, headers: list | tuple = (), body: str = BODY,
         timeout: float = 15.0) -> h.Response:
    hdrs = [("content-type", "application/json"), *headers]
    if key is not None:
        hdrs.insert(0, ("Idempotency-Key", key))
    return h.request(port, "POST", path, body, hdrs, timeout=timeout)


def deltas(envoy: h.Envoy, before: dict[str, int]) -> dict[str, int]:
    after = envoy.counters()
    return {k: after.get(k, 0) - before.get(k, 0) for k in after.keys() | before.keys()
            if after.get(k, 0) != before.get(k, 0)}


CLUSTER_STATS = ("upstream_rq_total", "upstream_rq_per_try_timeout", "upstream_rq_retry",
                 "upstream_rq_retry_success", "upstream_rq_5xx", "upstream_cx_total", "ssl.handshake")


def cluster_stats(envoy: h.Envoy, cluster: str) -> dict[str, int]:
    got = envoy.stats("^cluster\\." + re.escape(cluster) + "\\.")
    prefix = f"cluster.{cluster}."
    return {name: got.get(prefix + name, 0) for name in CLUSTER_STATS}


def stat_deltas(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def downstream_requests(envoy: h.Envoy, listener: str) -> int:
    return envoy.counter(f"http.{listener}.downstream_rq_total")


def received(execution: dict, name: str) -> list[str]:
    return [v for k, v in execution["headers"] if k == name]


def assert_answer_of(resp: h.Response, execution: dict, status: int = 201) -> dict:
    """`resp` is the app's answer of `execution` (its status, its body, its location), replayed
    or not."""
    assert resp.status == status, resp
    doc = json.loads(resp.body)
    assert doc["id"] == execution["id"], (doc, execution)
    assert doc["key"] == execution["key"], (doc, execution)
    assert doc["body"] == BODY, doc
    assert resp.header("location") == f"/things/{execution['id']}", resp
    assert resp.header("content-type") == "application/json", resp
    return doc


def settle(envoy: h.Envoy, before: dict[str, int], **at_least: int) -> dict[str, int]:
    """Waits until each named counter moved by at least the given amount (a commit or a release
    lands after the client has its answer), then returns all the filter's counter deltas."""
    for name, n in at_least.items():
        envoy.wait_counter(name, before.get(name, 0) + n)
    return deltas(envoy, before)


# --------------------------------------------------------------------------------------------
# 1. per-try timeouts and hedges: one execution
# --------------------------------------------------------------------------------------------


def slow_request_runs_once(client, server, upstream, listener: str, cluster: str, path: str):
    """A keyless POST to an app taking `APP_SLEEP_MS`, through the client Envoy's `listener`
    (whose route sends `cluster` to the guard): it executed exactly once, under a minted key, and
    the client got that execution's answer. Returns the answer, the execution, the client
    cluster's stat deltas and how many attempts reached the guard."""
    stats_before = cluster_stats(client, cluster)
    rq_before = downstream_requests(server, "guard")

    resp = post(client.port(listener), path, headers=[("x-test-sleep-ms", str(APP_SLEEP_MS))])

    execs = upstream.executions(path=path, headers=True)
    assert len(execs) == 1, (resp, execs)
    ex = execs[0]
    assert MINTED.match(ex["key"]), ex["key"]
    assert_answer_of(resp, ex)
    stats = stat_deltas(cluster_stats(client, cluster), stats_before)
    return resp, ex, stats, downstream_requests(server, "guard") - rq_before


def test_retries_after_per_try_timeouts_execute_once(client, server, upstream, note):
    """The app takes 1 s, each attempt 0.3 s: attempts 1-3 time out at the client Envoy, which
    abandons them; the first keeps running (detached) and is stored; the retries carry the
    minted key, wait for it and the last one replays its answer."""
    path = unique_path("retry")
    c_before, s_before = client.counters(), server.counters()
    resp, ex, stats, attempts = slow_request_runs_once(client, server, upstream, "mint", "server", path)
    assert received(ex, "idempotency-key") == [ex["key"]], ex["headers"]
    note(f"mesh retries: {attempts} attempts reached the server, client cluster {stats}, "
         f"answered in {resp.elapsed:.2f} s, replay={resp.header(REPLAY)}")
    assert stats["upstream_rq_per_try_timeout"] >= 1, stats
    assert stats["upstream_rq_retry"] >= 1, stats
    assert 2 <= attempts <= ATTEMPTS, (attempts, stats)

    # One key for the whole request, whatever the number of attempts.
    assert deltas(client, c_before) == {"minted": 1}, deltas(client, c_before)
    d = settle(server, s_before, stored=1, committed_after_gone=1)
    assert d.get("stored") == 1, d
    assert d.get("detached") == 1, d
    assert d.get("committed_after_gone") == 1, d
    assert d.get("released", 0) == 0, d
    if resp.header(REPLAY) == "true":
        assert d.get("replayed", 0) >= 1, d
    # No attempt executes late.
    time.sleep(0.3)
    assert upstream.count(path=path) == 1, upstream.executions(path=path)


def test_without_the_filters_every_attempt_executes(bare_client, upstream, note):
    """The same request through the same retry policy with neither filter: each of the four
    attempts runs the app, and the client gets the last per-try timeout."""
    path = unique_path("bare")
    stats_before = cluster_stats(bare_client, "server_bare")

    resp = post(bare_client.port("bare"), path, headers=[("x-test-sleep-ms", str(APP_SLEEP_MS))])

    assert resp.status == 504, resp
    assert h.poll_until(lambda: upstream.count(path=path), ATTEMPTS, timeout=2) == ATTEMPTS
    time.sleep(0.3)
    execs = upstream.executions(path=path, headers=True)
    assert len(execs) == ATTEMPTS, execs
    assert all(received(ex, "idempotency-key") == [] for ex in execs), execs
    stats = stat_deltas(cluster_stats(bare_client, "server_bare"), stats_before)
    note(f"mesh retries without the filters: {len(execs)} executions, client cluster {stats}")
    assert stats["upstream_rq_per_try_timeout"] == ATTEMPTS, stats
    assert stats["upstream_rq_retry"] == ATTEMPTS - 1, stats


def test_hedged_attempts_execute_once(client, server, upstream, note):
    """hedge_on_per_try_timeout: a per-try timeout sends another attempt and keeps the first;
    the hedges carry the minted key and wait for the first, which answers the client."""
    path = unique_path("hedge")
    c_before, s_before = client.counters(), server.counters()
    resp, ex, stats, attempts = slow_request_runs_once(client, server, upstream, "hedge", "server_hedged", path)
    note(f"mesh hedges: {attempts} attempts reached the server, client cluster {stats}, "
         f"answered in {resp.elapsed:.2f} s, replay={resp.header(REPLAY)}")
    # Envoy counts a hedge on `upstream_rq_retry` (a per-try timeout that hedges is not counted
    # on `upstream_rq_per_try_timeout`), each on a connection of its own (HTTP/1.1).
    assert stats["upstream_rq_retry"] >= 1, stats
    assert stats["upstream_cx_total"] >= 2, stats
    assert attempts >= 2, (attempts, stats)

    assert deltas(client, c_before) == {"minted": 1}, deltas(client, c_before)
    d = settle(server, s_before, stored=1)
    assert d.get("stored") == 1, d
    assert d.get("detached") == 1, d
    assert d.get("released", 0) == 0, d
    # The first attempt was kept (a hedge, not a retry): its client was still there.
    assert d.get("committed_after_gone", 0) == 0, d
    time.sleep(0.3)
    assert upstream.count(path=path) == 1, upstream.executions(path=path)


# --------------------------------------------------------------------------------------------
# 2. a 5xx first: not stored, the retry executes
# --------------------------------------------------------------------------------------------


def test_failed_first_attempt_is_not_stored_and_the_retry_executes(client, server, upstream):
    """The app answers 503 at once to the first attempt and 201 to the next: the 503 releases
    the lock, the client Envoy retries (5xx) with the same minted key, the retry executes and is
    stored; the client gets the 201, and the record is the 201."""
    path = unique_path("first503")
    hdrs = [("x-test-first-status", "503")]
    c_before, s_before = client.counters(), server.counters()
    stats_before = cluster_stats(client, "server")

    resp = post(client.port("mint"), path, headers=hdrs)

    execs = upstream.executions(path=path, headers=True)
    assert len(execs) == 2, (resp, execs)
    key = execs[0]["key"]
    assert MINTED.match(key), key
    assert execs[1]["key"] == key, execs
    assert_answer_of(resp, execs[1], 201)
    assert resp.header(REPLAY) is None, resp

    stats = stat_deltas(cluster_stats(client, "server"), stats_before)
    assert stats["upstream_rq_retry"] == 1, stats
    assert stats["upstream_rq_per_try_timeout"] == 0, stats
    assert deltas(client, c_before) == {"minted": 1}, deltas(client, c_before)
    d = settle(server, s_before, stored=1, released=1)
    assert d.get("stored") == 1, d
    assert d.get("released") == 1, d
    assert d.get("detached") == 2, d

    # The same request with the minted key, straight to the server (the same anonymous
    # subject, 127.0.0.1): the stored 201 is replayed, the 503 never was a record.
    again = post(server.port("guard"), path, key=key, headers=hdrs)
    assert_replay_of(again, resp)
    assert upstream.count(path=path) == 2


# --------------------------------------------------------------------------------------------
# 3. keys minted per request, client keys left alone
# --------------------------------------------------------------------------------------------


def test_identical_keyless_requests_get_different_keys(client, upstream, note):
    """Two keyless POSTs with the same body at the same moment are two requests: each gets its
    own key, both execute. A client's key reaches the server as it was sent; a GET gets none."""
    path = unique_path("twins")
    before = client.counters()
    port = client.port("mint")
    barrier = threading.Barrier(2)
    sent_at: list[float] = []

    def send() -> h.Response:
        barrier.wait(5)
        sent_at.append(time.monotonic())
        return post(port, path, headers=[("x-test-sleep-ms", "100")])

    runs = [h.in_thread(send) for _ in range(2)]
    resps = [h.joined(t, out) for t, out in runs]

    execs = upstream.executions(path=path, headers=True)
    note(f"mesh twins: sent {abs(sent_at[0] - sent_at[1]) * 1e3:.3f} ms apart, executions "
         f"{abs(execs[0]['at'] - execs[-1]['at']) * 1e3:.1f} ms apart" if len(execs) == 2 else "")
    assert len(execs) == 2, (resps, execs)
    keys = [ex["key"] for ex in execs]
    assert all(MINTED.match(k) for k in keys), keys
    assert keys[0] != keys[1], keys
    for ex in execs:
        assert received(ex, "idempotency-key") == [ex["key"]], ex["headers"]
    by_id = {ex["id"]: ex for ex in execs}
    for resp in resps:
        assert_executed(resp, 201)
        assert_answer_of(resp, by_id[json.loads(resp.body)["id"]])
    assert {json.loads(r.body)["id"] for r in resps} == set(by_id), resps

    # A key the client sent is left alone: a token and an sf-string, as they were.
    for own in (new_key("client"), f'"{new_key("client-sf")}"'):
        own_path = unique_path("own")
        r = post(port, own_path, key=own)
        assert_executed(r, 201)
        (ex,) = upstream.executions(path=own_path, headers=True)
        assert ex["key"] == own, ex
        assert received(ex, "idempotency-key") == [own], ex["headers"]

    # A method the filter does not guard gets no key.
    get_path = unique_path("get")
    g = h.request(port, "GET", get_path, None)
    assert g.status == 201, g
    (ex,) = upstream.executions(path=get_path, headers=True)
    assert received(ex, "idempotency-key") == [], ex["headers"]

    assert deltas(client, before) == {"minted": 2}, deltas(client, before)


# --------------------------------------------------------------------------------------------
# 4. mutual TLS: the subject is the peer certificate's URI SAN
# --------------------------------------------------------------------------------------------


def test_mtls_workloads_sharing_a_key_each_get_their_own_record(mtls, upstream):
    """Two workloads (client certificates with URI SANs SPIFFE_ONE and SPIFFE_TWO) send the same
    key and body: two executions, each retry replays its own workload's answer. A plain-text
    caller with that key is the anonymous subject (its IP): it executes once more and is never
    answered with either workload's record."""
    key = new_key("mtls")
    path = unique_path("mtls")
    cli = mtls.clients
    tls_before = {n: cluster_stats(cli, f"mtls_{n}")["ssl.handshake"] for n in ("one", "two")}

    a1 = post(cli.port("one"), path, key=key)
    doc_a = assert_executed(a1, 201)
    assert upstream.count(key=key) == 1
    b1 = post(cli.port("two"), path, key=key)
    doc_b = assert_executed(b1, 201)
    assert upstream.count(key=key) == 2
    assert doc_a["id"] != doc_b["id"]

    a2 = post(cli.port("one"), path, key=key)
    assert_replay_of(a2, a1)
    b2 = post(cli.port("two"), path, key=key)
    assert_replay_of(b2, b1)
    assert upstream.count(key=key) == 2

    # Both went over TLS with their own certificate (their own connections).
    for n in ("one", "two"):
        assert cluster_stats(cli, f"mtls_{n}")["ssl.handshake"] > tls_before[n], n

    # The plain-text listener: no peer certificate, the anonymous subject.
    plain = mtls.server.port("plain")
    p1 = post(plain, path, key=key)
    doc_p = assert_executed(p1, 201)
    assert upstream.count(key=key) == 3
    assert doc_p["id"] not in (doc_a["id"], doc_b["id"])
    p2 = post(plain, path, key=key)
    assert_replay_of(p2, p1)
    assert upstream.count(key=key) == 3

    # And the workloads' records are still theirs.
    assert_replay_of(post(cli.port("one"), path, key=key), a1)
    assert_replay_of(post(cli.port("two"), path, key=key), b1)
    assert upstream.count(key=key) == 3


def test_mtls_listener_refuses_a_caller_without_a_certificate(mtls, upstream):
    """The server's mTLS listener requires a client certificate: a TLS caller without one gets
    no HTTP answer and runs nothing."""
    path = unique_path("nocert")
    ctx = ssl.create_default_context(cafile=str(mtls.certs.ca))
    got = b""
    with socket.create_connection((h.LOOPBACK, mtls.server.port("mtls")), timeout=5) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname="localhost") as s:
                s.sendall(f"POST {path} HTTP/1.1\r\nhost: localhost\r\nidempotency-key: k\r\n"
                          f"content-length: 2\r\n\r\n{{}}".encode())
                got = s.recv(4096)
        except (ssl.SSLError, ConnectionError):
            pass
    assert not got.startswith(b"HTTP/"), got
    assert upstream.count(path=path) == 0


def test_mtls_peer_without_uri_san_is_the_anonymous_subject(mtls, upstream):
    """A client certificate without a URI SAN gives an empty property: the caller is the
    anonymous subject, the client IP (127.0.0.1, as for the plain-text caller, whose record it
    replays), while a workload with a URI SAN has its own record."""
    key = new_key("nosan")
    path = unique_path("nosan")
    cli = mtls.clients

    p1 = post(mtls.server.port("plain"), path, key=key)
    assert_executed(p1, 201)
    assert upstream.count(key=key) == 1

    n1 = post(cli.port("nosan"), path, key=key)
    assert_replay_of(n1, p1)
    assert upstream.count(key=key) == 1
    assert cluster_stats(cli, "mtls_nosan")["ssl.handshake"] >= 1

    o1 = post(cli.port("one"), path, key=key)
    doc_o = assert_executed(o1, 201)
    assert doc_o["id"] != json.loads(p1.body)["id"]
    assert upstream.count(key=key) == 2
