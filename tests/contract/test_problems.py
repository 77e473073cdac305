"""The members every refusal carries (`instance`, `retryable`), where its `instance` shows up
(the filter's log line, the access log), and `mismatch_status`, end to end.

One Envoy (`envoy-problems`, two workers) on an in-memory idemstore, the counting upstream and
an in-process gRPC service (support/grpc_app.py). Every listener keeps the client's
`x-request-id` (`preserve_external_request_id: true`), so that what a client sends there
reaches the filter. Listeners (routes `orders`, `payments`, `misc` (named), and an unnamed
`/`; on `grpc` one route `orders` to the gRPC service):

* `api`: `lock_wait_ms: 0` (a duplicate in flight is a 409 at once), `max_body_bytes: 1024`
  (a 413 is cheap); payments' policy requires a key and sets `mismatch_status: 409`, misc's
  policy sets only `retention_seconds`; orders and `/` have no policy.
* `acp`: `mismatch_status: 409` at the top level; payments' policy sets it back to `422`,
  misc's policy does not set it.
* `closed`: its store cluster has no idemstore behind it, `failure_mode: closed`, no local
  fallback: every keyed request is a 503.
* `detached`: `detached_execution` with `detached_timeout_ms: 300`.
* `inbox`: inbox mode (CloudEvents ids), `lock_wait_ms: 0`.
* `grpc`: `mismatch_status: 409` (gRPC calls get `FAILED_PRECONDITION` all the same).

And the shipped envoy/envoy.yaml as it is (ports and wasm path rewritten, `envoy-shipped`) on
the same idemstore: its stdout access log (`instance=...`), which the harness keeps in the
Envoy's log file beside the filter's log lines. Measured with Envoy 1.40.0 there
(`use_remote_address: true`, no `internal_address_config`): a loopback client is external,
so Envoy replaces its `x-request-id` with a UUID of its own; and its HTTP/1 codec refuses a
header value with a control character other than a tab (NUL, 0x01, ESC, DEL) with its own
`400` (`text/plain`), before any filter.
"""

from __future__ import annotations

import re
import socket
import uuid
from dataclasses import dataclass

import grpc
import pytest

from support import grpc_app as g
from support import harness as h
from support import idemstore_metrics as m
from support.checks import (INSTANCE, assert_executed, assert_grpc_problem, assert_problem, assert_replay_of,
                            documented, documented_problems)
from support.harness import new_key
from support.pusher import Event, request_for

JSON = ("content-type", "application/json")
HOP = ("x-idempotency-grpc-replay", "1")

# Listener name -> plugin configuration (store_cluster added unless given).
LISTENERS = {
    "api": {"lock_wait_ms": 0, "max_body_bytes": 1024,
            "routes": {"payments": {"require_key": True, "mismatch_status": 409},
                       "misc": {"retention_seconds": 3600}}},
    "acp": {"mismatch_status": 409,
            "routes": {"payments": {"mismatch_status": 422}, "misc": {"retention_seconds": 3600}}},
    "closed": {"store_cluster": "deadstore", "failure_mode": "closed", "local_fallback": False},
    "detached": {"detached_execution": True, "detached_timeout_ms": 300},
    "inbox": {"mode": "inbox", "inbox": {"message_id": "cloudevents"}, "lock_wait_ms": 0},
    "grpc": {"mismatch_status": 409},
}


def route(name: str | None, prefix: str, cluster: str = "upstream") -> dict:
    r = {"match": {"prefix": prefix}, "route": {"cluster": cluster, "timeout": "20s"}}
    if name:
        r["name"] = name
    return r


ROUTES = [route("orders", "/orders"), route("payments", "/payments"), route("misc", "/misc"), route(None, "/")]
GRPC_ROUTES = [route("orders", "/", cluster="grpc")]


@dataclass
class Problems:
    envoy: h.Envoy
    shipped_envoy: h.Envoy | None  # None where the host refuses envoy/envoy.yaml's filter
    upstream: h.Upstream
    orders: g.OrdersServer
    store_port: int
    shipped_refused: str | None = None

    @property
    def shipped(self) -> h.Envoy:
        if self.shipped_envoy is None:
            pytest.skip(self.shipped_refused)
        return self.shipped_envoy

    def post(self, listener: str, path: str, body: bytes | str = b"{}", key: str | None = None,
             headers: list | None = None, **kw) -> h.Response:
        hdrs = list(headers or []) + ([("Idempotency-Key", key)] if key is not None else [])
        return h.request(self.envoy.port(listener), "POST", path, body, hdrs + [JSON], **kw)

    def post_shipped(self, path: str, body: bytes | str = b"{}", key: str | None = None,
                     headers: list | None = None) -> h.Response:
        hdrs = list(headers or []) + ([("Idempotency-Key", key)] if key is not None else [])
        return h.request(self.shipped.port("main"), "POST", path, body, hdrs + [JSON])

    def wait_stored(self, before: int, envoy: h.Envoy | None = None) -> None:
        # The commit lands after the answer: a retry sent before it would find the lock.
        envoy = envoy or self.envoy
        assert envoy.wait_counter("stored", before + 1) >= before + 1, "the answer was never stored"


@pytest.fixture(scope="module")
def problems(run_dir, artifacts, upstream) -> Problems:
    sub = run_dir / "problems"
    wasm = artifacts["wasm"]
    started: list = []
    orders = g.OrdersServer().start()
    try:
        store, sport = h.start_idemstore(sub)
        started.append(store)
        admin = h.free_port()
        ports = {ln: h.free_port() for ln in LISTENERS}
        listeners = []
        for ln, cfg in LISTENERS.items():
            spec = h.listener(ln, ports[ln], [h.wasm_filter({"store_cluster": "idemstore", **cfg}, wasm)],
                              GRPC_ROUTES if ln == "grpc" else ROUTES)
            spec["filter_chains"][0]["filters"][0]["typed_config"]["preserve_external_request_id"] = True
            listeners.append(spec)
        config = h.envoy_config(admin, listeners, upstream.port, sport)
        config["static_resources"]["clusters"] += [h.store_cluster(h.free_port(), name="deadstore"),
                                                   h.static_cluster("grpc", orders.port, http2=True)]
        envoy = h.spawn_envoy_config(sub, "envoy-problems", config, admin, ports)
        started.append(envoy)
        admin, listen = h.free_port(), h.free_port()
        path = sub / "envoy-shipped.yaml"
        path.write_text(h.shipped_envoy_yaml(admin, listen, upstream.port, sport, wasm))
        shipped, refused = None, h.file_refusal(path)
        if refused is None:
            # Its access log goes to stdout, which Envoy flushes every 10 s by default: every 100 ms
            # here, so that a test waits for its line a moment, not 10 s (the config is unchanged).
            shipped = h.Envoy(h.launch_envoy_file(sub, "envoy-shipped", path,
                                                  extra_args=["--file-flush-interval-msec", "100"]),
                              admin, {"main": listen}, path)
            started.append(shipped)
        h.await_envoy(envoy)
        if shipped is not None:
            h.await_envoy(shipped)
            # Until its health check passes, the shipped Envoy's store calls fail at once (panic
            # threshold 0) and a request runs unguarded.
            h.wait_for(lambda: shipped.stats(r"^cluster\.idemstore\.membership_healthy$")
                       .get("cluster.idemstore.membership_healthy") == 1, "idemstore healthy", shipped.proc,
                       timeout=10)
    except h.HarnessError as e:
        for p in reversed(started):
            p.stop()
        orders.stop()
        pytest.fail(str(e), pytrace=False)
    yield Problems(envoy, shipped, upstream, orders, sport, refused)
    for p in reversed(started):
        p.stop()
    orders.stop()


def uniq(prefix: str) -> str:
    return f"{prefix}/{uuid.uuid4().hex}"


def without_instance(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k != "instance"}


# --------------------------------------------------------------------------------------------
# the logs
# --------------------------------------------------------------------------------------------

def refusal_line(code: str, status: int | None = None, grpc_status: int | None = None, instance: str = "") -> str:
    """The end of the filter's log line for one refusal (src/worker/coordinator/mod.rs,
    `log_refusal`): `refused <code> (<status>), instance <urn>`, `(grpc-status N)` for a call."""
    what = f"grpc-status {grpc_status}" if grpc_status is not None else str(status)
    return f": refused {code} ({what}), instance {instance}"


def log_lines(envoy: h.Envoy, needle: str, at_least: int = 1, timeout: float = 10.0) -> list[str]:
    """The lines of the Envoy's log (its own log and, for the shipped config, its stdout access
    log) containing `needle`, polled until there are `at_least`: the access log is flushed on an
    interval, after the answer."""
    def found():
        lines = [ln for ln in envoy.log_text().splitlines() if needle in ln]
        return lines if len(lines) >= at_least else None
    return h.wait_for(found, f"{at_least} log line(s) with {needle!r}", envoy.proc, timeout=timeout)


def filter_line(envoy: h.Envoy, code: str, instance: str, status: int | None = None,
                grpc_status: int | None = None) -> tuple[str, str, str]:
    """The one filter log line of the refusal `instance`: (the line, its request id, its key
    field)."""
    [line] = log_lines(envoy, f"instance {instance}")
    assert f"[info][{h.filter_log_component()}]" in line and line.endswith(refusal_line(code, status, grpc_status, instance)), line
    m = re.search(r" request (\S+) key (\S+): refused ", line)
    assert m, line
    return line, m.group(1), m.group(2)


def access_line(envoy: h.Envoy, method_path: str, status: int) -> str:
    """The one access log line (envoy/envoy.yaml's format) of the request to `method_path`."""
    [line] = log_lines(envoy, f'"{method_path}"')
    assert f'" {status} ' in line, line
    return line


ACCESS = re.compile(r" idempotency=(\S+) instance=(\S+) \d+ms (\S+)$")


def access_fields(line: str) -> tuple[str, str, str]:
    """(outcome, instance, x-request-id) of a shipped access log line."""
    m = ACCESS.search(line)
    assert m, line
    return m.group(1), m.group(2), m.group(3)


# --------------------------------------------------------------------------------------------
# a. one instance per occurrence
# --------------------------------------------------------------------------------------------


def test_the_same_refusal_twice_gets_two_instances(problems):
    """The very same request (method, path, body, key and an explicit `x-request-id`, which
    this listener keeps) refused twice: two instances, each in its own filter log line, both
    lines naming the client's request id. The same for a missing key sent twice. The
    upstream ran the key once and the keyless payment never."""
    p = problems
    key, path = new_key("twice"), uniq("/orders")
    rid = f"client-chosen-{uuid.uuid4().hex}"
    same = [("x-request-id", rid)]
    stored = p.envoy.counter("stored")
    assert_executed(p.post("api", path, '{"qty": 1}', key, same), 201)
    p.wait_stored(stored)
    reused = [assert_problem(p.post("api", path, '{"qty": 2}', key, same), 422, raw_key=key, code="key-reused")
              for _ in range(2)]
    assert reused[0]["instance"] != reused[1]["instance"], reused
    # Besides the instance, the two problems are the same document.
    assert without_instance(reused[0]) == without_instance(reused[1]), reused
    for doc in reused:
        _, logged_rid, prefix = filter_line(p.envoy, "key-reused", doc["instance"], status=422)
        assert logged_rid == rid and prefix != "-", (logged_rid, prefix)
        assert rid not in doc["instance"]
    assert p.upstream.count(key=key) == 1

    pay = uniq("/payments")
    missing = [assert_problem(p.post("api", pay, headers=same), 400, code="missing-key") for _ in range(2)]
    assert missing[0]["instance"] != missing[1]["instance"], missing
    for doc in missing:
        _, logged_rid, prefix = filter_line(p.envoy, "missing-key", doc["instance"], status=400)
        assert (logged_rid, prefix) == (rid, "-")
    assert p.upstream.count(path=pay) == 0


def test_many_refusals_over_both_workers_never_share_an_instance(problems):
    """Forty invalid keys, each on a connection of its own (so both workers' VMs, each with
    its own seed, answer some): forty distinct instances, none of them a request id."""
    p = problems
    path = uniq("/orders")
    rid = str(uuid.uuid4())
    docs = [assert_problem(p.post("api", path, key="bad key", headers=[("x-request-id", rid)]), 400,
                           code="invalid-key") for _ in range(40)]
    instances = {d["instance"] for d in docs}
    assert len(instances) == 40, sorted(instances)
    assert f"urn:uuid:{rid}" not in instances
    assert p.upstream.count(path=path) == 0


# --------------------------------------------------------------------------------------------
# b. a request id the client chose
# --------------------------------------------------------------------------------------------

# Case -> the x-request-id value (bytes as sent; http.client sends a str as Latin-1).
REQUEST_IDS = {
    "not_a_uuid": b"order-42",
    "looks_like_a_uuid_urn": b"urn:uuid:00000000-0000-4000-8000-000000000000",
    "json_quotes_backslashes": b'x", "instance": "urn:uuid:evil\\" \\\\ }',
    "inner_tab": b"before\tafter",
    "utf8": "caf\u00e9-\u00fc".encode(),
    "crlf_like_text": b"a\\r\\nb: c",
    "ten_kb": b"r" * 10240,
}
# Values Envoy's HTTP/1 codec refuses with its own 400 before any filter (see the docstring).
REFUSED_BY_ENVOY = {"nul": b"a\x00b", "soh": b"a\x01b", "esc": b"\x1b[31mred", "del": b"a\x7fb"}


def cleaned(value: bytes) -> str:
    """The request id as the filter writes it in a log line (src/worker/coordinator/mod.rs,
    `request_id`): at most 64 bytes, each one that is not visible ASCII a `?`."""
    return "".join(chr(b) if 0x21 <= b <= 0x7e else "?" for b in value[:64]) or "-"


def assert_safe_line(line: str) -> None:
    assert all(0x20 <= ord(c) <= 0x7e for c in line), f"a control or non-ASCII character in {line!r}"


@pytest.mark.parametrize("case", sorted(REQUEST_IDS))
def test_a_hostile_request_id_reaches_the_filter_and_stays_out_of_the_problem(problems, case):
    """The client's request id reaches the filter (this listener keeps it): the problem is
    valid JSON with an `instance` of the filter's own (a UUID URN containing none of the
    header's bytes), the body does not echo the header, and the filter's log line for it is
    one line of visible ASCII with the id cleaned."""
    p = problems
    value = REQUEST_IDS[case]
    path = uniq("/payments")
    resp = p.post("api", path, headers=[("x-request-id", value)])
    doc = assert_problem(resp, 400, code="missing-key")
    assert INSTANCE.match(doc["instance"]), doc
    assert value not in resp.body, resp
    line, logged_rid, prefix = filter_line(p.envoy, "missing-key", doc["instance"], status=400)
    assert_safe_line(line)
    assert (logged_rid, prefix) == (cleaned(value), "-"), line
    assert doc["instance"] != "urn:uuid:00000000-0000-4000-8000-000000000000"
    assert p.upstream.count(path=path) == 0


def test_envoy_refuses_control_characters_in_the_request_id_itself(problems):
    """NUL, SOH, ESC and DEL in `x-request-id` never reach the filter: Envoy answers its own
    `400` (not a problem document) and the filter logs no refusal for it."""
    p = problems
    rejected = p.envoy.counter("rejected")
    for name, value in REFUSED_BY_ENVOY.items():
        path = uniq("/payments")
        resp = p.post("api", path, headers=[("x-request-id", value)])
        assert resp.status == 400 and "problem" not in (resp.header("content-type") or ""), (name, resp)
        assert p.upstream.count(path=path) == 0
    assert p.envoy.counter("rejected") == rejected


@pytest.mark.parametrize("case", ["json_quotes_backslashes", "inner_tab", "utf8", "ten_kb"])
def test_shipped_config_gives_hostile_request_ids_a_uuid_instance(problems, case):
    """Through the shipped envoy/envoy.yaml the client's request id is replaced by Envoy (a
    loopback client is external there): the problem's instance is still the filter's UUID URN,
    and the access log line and the filter's line agree on the instance and on Envoy's request
    id (a UUID, not the header)."""
    p = problems
    value = REQUEST_IDS[case]
    path = uniq("/payments")
    resp = p.post_shipped(path, headers=[("x-request-id", value)])
    doc = assert_problem(resp, 400, code="missing-key")
    assert value not in resp.body, resp
    line, logged_rid, _ = filter_line(p.shipped, "missing-key", doc["instance"], status=400)
    assert_safe_line(line)
    outcome, instance, access_rid = access_fields(access_line(p.shipped, f"POST {path} HTTP/1.1", 400))
    assert (outcome, instance) == ("rejected", doc["instance"])
    assert logged_rid == access_rid and re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}",
                                                     access_rid), (logged_rid, access_rid)


# --------------------------------------------------------------------------------------------
# c. the instance in the access log
# --------------------------------------------------------------------------------------------


def test_shipped_access_log_and_filter_line_carry_the_same_instance(problems):
    """envoy/envoy.yaml as shipped: a first request runs (`idempotency=executed instance=-`),
    the same key with another body is a 422 whose `instance` is in its access log line
    (`idempotency=mismatch instance=<urn>`) and in the filter's line (`refused key-reused
    (422), instance <urn>`), the two lines naming the same request id; a keyless POST that
    is never guarded logs `instance=-` too. The app ran the key once."""
    p = problems
    s = p.shipped
    key, path = new_key("shipped"), uniq("/orders")
    stored = s.counter("stored")
    assert_executed(p.post_shipped(path, '{"qty": 1}', key), 201)
    p.wait_stored(stored, s)
    doc = assert_problem(p.post_shipped(path, '{"qty": 2}', key), 422, raw_key=key, code="key-reused")
    urn = doc["instance"]
    [refused, executed] = sorted(log_lines(s, f'"POST {path} HTTP/1.1"', at_least=2), key=lambda ln: '" 422 ' not in ln)
    assert '" 422 ' in refused and '" 201 ' in executed, (refused, executed)
    outcome, instance, access_rid = access_fields(refused)
    assert (outcome, instance) == ("mismatch", urn), refused
    _, logged_rid, prefix = filter_line(s, "key-reused", urn, status=422)
    assert logged_rid == access_rid and prefix != "-", (logged_rid, access_rid)
    assert access_fields(executed)[:2] == ("executed", "-"), executed
    assert key not in refused and key not in executed
    assert p.upstream.count(key=key) == 1
    keyless = uniq("/orders")
    assert_executed(p.post_shipped(keyless), 201)
    assert access_fields(access_line(s, f"POST {keyless} HTTP/1.1", 201))[:2] == ("-", "-")


def test_shipped_grpc_refusal_names_its_instance_in_the_access_log(problems):
    """A gRPC call through the shipped config with a key too long: `INVALID_ARGUMENT`, its
    `grpc-message` `invalid-key: ... (instance <urn>)`, the access log line of the call (HTTP
    200, as gRPC answers) carries that `instance`, the filter's line says `refused invalid-key
    (grpc-status 3)`. Nothing reached the service."""
    p = problems
    s = p.shipped
    key = "k" * 300
    calls = p.orders.executions(key=key)
    r = g.create_order(s.port("main"), key)
    assert r.code == grpc.StatusCode.INVALID_ARGUMENT and r.message is None, r
    urn = assert_grpc_problem(r.details, "invalid-key")
    lines = log_lines(s, f" instance={urn} ")
    assert len(lines) == 1 and f'"POST {g.CREATE_ORDER} HTTP/2" 200 ' in lines[0], lines
    assert access_fields(lines[0])[:2] == ("rejected", urn), lines
    filter_line(s, "invalid-key", urn, grpc_status=3)
    assert p.orders.executions(key=key) == calls == 0


# --------------------------------------------------------------------------------------------
# d. mismatch_status
# --------------------------------------------------------------------------------------------

# (listener, route prefix) -> the status of a reused key with another body there.
MISMATCH = {
    ("api", "/payments"): 409,  # its policy
    ("api", "/orders"): 422,    # no policy: the top level's default
    ("api", "/misc"): 422,      # a policy that does not set it
    ("api", "/other"): 422,     # the unnamed route
    ("acp", "/orders"): 409,    # no policy: the top level's 409
    ("acp", "/misc"): 409,      # a policy that does not set it keeps the top level's
    ("acp", "/other"): 409,
    ("acp", "/payments"): 422,  # its policy sets 422 back
}


@pytest.mark.parametrize("listener,prefix", sorted(MISMATCH), ids=lambda v: v.strip("/"))
def test_mismatch_status_per_route_and_top_level(problems, listener, prefix):
    """A reused key with another body is `key-reused`, `retryable: false`, with the route's
    `mismatch_status` (its policy's, else the top level's, else 422); the first request still
    replays after it and the upstream ran the key once."""
    p = problems
    want = MISMATCH[(listener, prefix)]
    key, path = new_key("mismatch"), uniq(prefix)
    stored = p.envoy.counter("stored")
    first = p.post(listener, path, '{"qty": 1}', key)
    assert_executed(first, 201)
    p.wait_stored(stored)
    doc = assert_problem(p.post(listener, path, '{"qty": 2}', key), want, raw_key=key, code="key-reused")
    assert (doc["retryable"], doc["differs"]) == (False, "body"), doc
    assert_replay_of(p.post(listener, path, '{"qty": 1}', key), first)
    assert p.upstream.count(key=key) == 1


def test_mismatch_status_409_leaves_grpc_failed_precondition(problems):
    """`mismatch_status: 409` is for HTTP: a gRPC call reusing a key with another message is
    still `FAILED_PRECONDITION` `key-reused`, its instance in the filter's line."""
    p = problems
    key = new_key("grpc-mismatch")
    stored = p.envoy.counter("stored")
    assert g.create_order(p.envoy.port("grpc"), key, item="book").code == grpc.StatusCode.OK
    p.wait_stored(stored)
    other = g.create_order(p.envoy.port("grpc"), key, item="pen")
    assert other.code == grpc.StatusCode.FAILED_PRECONDITION and other.message is None, other
    urn = assert_grpc_problem(other.details, "key-reused")
    filter_line(p.envoy, "key-reused", urn, grpc_status=9)
    assert p.orders.executions(key=key) == 1


# --------------------------------------------------------------------------------------------
# e. every code an HTTP client can get
# --------------------------------------------------------------------------------------------
# Each makes one problem: (the answer, how to count the upstream's executions of it, how many).


def _missing_key(p: Problems):
    path = uniq("/payments")
    return p.post("api", path), {"path": path}, 0


def _invalid_key(p: Problems):
    path = uniq("/orders")
    return p.post("api", path, key="k" * 256), {"path": path}, 0


def _internal_header(p: Problems):
    path = uniq("/orders")
    return p.post("api", path, key=new_key("hop"), headers=[HOP]), {"path": path}, 0


def _body_too_large(p: Problems):
    path = uniq("/orders")
    return p.post("api", path, b"x" * 2048, new_key("large")), {"path": path}, 0


def _key_reused(p: Problems):
    key, path = new_key("reused"), uniq("/orders")
    stored = p.envoy.counter("stored")
    assert_executed(p.post("api", path, '{"qty": 1}', key), 201)
    p.wait_stored(stored)
    return p.post("api", path, '{"qty": 2}', key), {"key": key}, 1


def _request_in_flight(p: Problems):
    key, path = new_key("inflight"), uniq("/orders")
    t, out = h.in_thread(lambda: p.post("api", path, "{}", key, headers=[("x-test-sleep-ms", "800")]))
    h.wait_for(lambda: p.upstream.count(key=key) == 1, "the original at the upstream", timeout=5)
    dup = p.post("api", path, "{}", key)
    assert_executed(h.joined(t, out), 201)
    return dup, {"key": key}, 1


def _encoding_not_acceptable(p: Problems):
    key, path = new_key("gzip"), uniq("/orders")
    stored = p.envoy.counter("stored")
    gz = [("x-test-gzip", "1"), ("x-test-content-type", "text/plain"), ("accept-encoding", "gzip")]
    assert_executed(p.post("api", path, "{}", key, gz), 201)
    p.wait_stored(stored)
    return p.post("api", path, "{}", key), {"key": key}, 1


def _outcome_unknown(p: Problems):
    """The client hangs up while the upstream runs: the key is in doubt, its retry is refused."""
    key, path = new_key("doubt"), uniq("/orders")
    in_doubt = p.envoy.counter("in_doubt")
    releases = None if h.native() else m.scrape(p.store_port).get("idemstore_in_doubt_releases_total")
    sock = socket.create_connection((h.LOOPBACK, p.envoy.port("api")))
    try:
        sock.sendall((f"POST {path} HTTP/1.1\r\nhost: x\r\nIdempotency-Key: {key}\r\ncontent-type: application/json\r\n"
                      "x-test-sleep-ms: 1000\r\ncontent-length: 2\r\n\r\n{}").encode())
        h.wait_for(lambda: p.upstream.count(key=key) == 1, "the original at the upstream", timeout=5)
    finally:
        sock.close()
    assert p.envoy.wait_counter("in_doubt", in_doubt + 1) == in_doubt + 1
    # The filter counts the attempt in doubt, then releases its lock so: a retry before the store
    # has that release finds the lock held (409 request-in-flight, seen under load).
    if h.native():
        # The store is the module's (no idemstore): the release is one of its store calls in
        # flight (the gauge `store_stream_calls`), counted before `in_doubt`.
        h.wait_for(lambda: h.store_idle(p.envoy), "the store kept the attempt in doubt", timeout=10)
    else:
        m.scrape_until(p.store_port, lambda s: s.get("idemstore_in_doubt_releases_total") > releases,
                       "the store kept the attempt in doubt")
    return p.post("api", path, "{}", key), {"key": key}, 1


def _store_unavailable(p: Problems):
    path = uniq("/orders")
    return p.post("closed", path, key=new_key("closed")), {"path": path}, 0


def _upstream_failed(p: Problems):
    # The upstream reads the request, then resets the connection (one execution).
    key = new_key("reset")
    return p.post("detached", uniq("/orders"), key=key, headers=[("x-test-reset", "1")], timeout=10), {"key": key}, 1


def _upstream_timeout(p: Problems):
    key = new_key("slow")
    return (p.post("detached", uniq("/orders"), key=key, headers=[("x-test-sleep-ms", "1500")], timeout=10),
            {"key": key}, 1)


def _deliver(p: Problems, path: str, ev: Event, drop: str | None = None, extra: list | None = None) -> h.Response:
    headers, body = request_for(ev, "binary", 1)
    headers = [(n, v) for n, v in headers if n != drop] + list(extra or [])
    return h.request(p.envoy.port("inbox"), "POST", path, body, headers)


def _missing_message_id(p: Problems):
    path = uniq("/orders")
    return _deliver(p, path, Event("unused"), drop="ce-id"), {"path": path}, 0


def _invalid_message_id(p: Problems):
    path = uniq("/orders")
    return _deliver(p, path, Event("")), {"path": path}, 0


def _message_in_flight(p: Problems):
    ev, path = Event(f"ev-{uuid.uuid4().hex}"), uniq("/orders")
    t, out = h.in_thread(lambda: _deliver(p, path, ev, extra=[("x-test-sleep-ms", "800")]))
    h.wait_for(lambda: p.upstream.count(path=path) == 1, "the first delivery at the upstream", timeout=5)
    dup = _deliver(p, path, ev)
    assert_executed(h.joined(t, out), 201)
    return dup, {"path": path}, 1


CODES = {
    "missing-key": _missing_key,
    "invalid-key": _invalid_key,
    "internal-header": _internal_header,
    "body-too-large": _body_too_large,
    "key-reused": _key_reused,
    "request-in-flight": _request_in_flight,
    "encoding-not-acceptable": _encoding_not_acceptable,
    "outcome-unknown": _outcome_unknown,
    "store-unavailable": _store_unavailable,
    "upstream-failed": _upstream_failed,
    "upstream-timeout": _upstream_timeout,
    "missing-message-id": _missing_message_id,
    "invalid-message-id": _invalid_message_id,
    "message-in-flight": _message_in_flight,
}


def test_every_documented_http_code_is_provoked_here():
    """The table below covers every code of docs/configuration.md's Problems table that an
    HTTP client can get (all but the gRPC-only ones: tests/contract/test_grpc.py)."""
    http_codes = {code for code, (status, _) in documented_problems().items() if status is not None}
    assert set(CODES) == http_codes, (sorted(set(CODES) - http_codes), sorted(http_codes - set(CODES)))


@pytest.mark.parametrize("code", sorted(CODES))
def test_every_code_carries_its_instance_and_documented_retryable(problems, code):
    """Each code as docs/configuration.md documents it: its status, `retryable`, an `instance`
    of its own that the filter's log line names; the upstream ran the request as often as the
    case says (once for what had started, never for a refusal up front)."""
    p = problems
    resp, count_by, runs = CODES[code](p)
    status, retryable = documented(code)
    doc = assert_problem(resp, status, code=code)
    assert doc["retryable"] is retryable, doc
    filter_line(p.envoy, code, doc["instance"], status=status)
    if retryable and status == 409:
        assert int(resp.header("retry-after") or 0) >= 1, resp
    assert p.upstream.count(**count_by) == runs, (code, count_by)
