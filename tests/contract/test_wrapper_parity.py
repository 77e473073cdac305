"""The shipped wrapper never guards less than the filter, end to end.

Two Envoys on one idemstore (Redis) and the counting upstream, both from envoy/envoy.yaml (ports
and wasm path rewritten): `shipped` exactly as shipped, the filter behind Envoy's composite
filter; `bare` the same configuration with the filter in place of the wrapper, so that it sees
every request. The same table of requests goes through both, each request twice with the same
key (the second a retry): every method spelling (`POST`, `post`, `Post`, `PATCH`, `patch`,
`GET`), over HTTP/1.1 and HTTP/2 (prior knowledge), keyed and keyless, on each route policy
(orders: the defaults; payments: a key required; webhooks: inbox mode; search: the filter off;
an unnamed route), and the gRPC replay hop's header sent from outside. The outcome (both
statuses, the problem codes, the replay marker, how many times the upstream ran) must be the
same through both.

And the replay hop costs a keyless client nothing: eight streams to the replay path carrying the
hop header and no key, each sending up to 8 MiB and never finishing, are refused at their headers
and leave the shipped Envoy's resident memory within a few MB of where it was (before the
wrapper sent that header to the filter, they reached the replay listener, which held each
body: +136 MB, never given back).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from support import harness as h
from support.h2client import H2Client, H2Error
from support.pusher import Event, request_for

HOP_PATH = "/idempotency.filter.v1.GrpcReplay/Replay"
HOP = ("x-idempotency-grpc-replay", "1")
REPLAY = "x-idempotent-replay"
JSON = ("content-type", "application/json")
RUN = uuid.uuid4().hex[:8]


@dataclass
class Envoys:
    shipped: h.Envoy
    bare: h.Envoy
    upstream: h.Upstream

    def port(self, which: str) -> int:
        return getattr(self, which).port("main")


def unwrapped(text: str) -> str:
    """envoy/envoy.yaml with the composite wrapper replaced by the filter it creates."""
    doc = yaml.safe_load(text)
    [main] = [ln for ln in doc["static_resources"]["listeners"] if ln["name"] == "main"]
    hcm = main["filter_chains"][0]["filters"][0]["typed_config"]
    done = 0
    for i, f in enumerate(hcm["http_filters"]):
        if "xds_matcher" in f.get("typed_config", {}):
            [m] = f["typed_config"]["xds_matcher"]["matcher_list"]["matchers"]
            hcm["http_filters"][i] = m["on_match"]["action"]["typed_config"]["typed_config"]
            done += 1
    assert done == 1, "envoy/envoy.yaml no longer wraps the filter once"
    return yaml.safe_dump(doc, sort_keys=False)


def healthy(envoy: h.Envoy) -> None:
    # Until its health check passes, store calls fail at once (panic threshold 0).
    h.wait_for(lambda: envoy.stats(r"^cluster\.idemstore\.membership_healthy$")
               .get("cluster.idemstore.membership_healthy") == 1, "idemstore healthy", envoy.proc, timeout=10)


@pytest.fixture(scope="module")
def envoys(run_dir, artifacts, upstream) -> Envoys:
    sub = run_dir / "wrapper-parity"
    sub.mkdir(parents=True, exist_ok=True)
    started: list = []
    try:
        redis, rport = h.start_redis(sub)
        started.append(redis)
        store, sport = h.start_idemstore(sub, f"redis://127.0.0.1:{rport}")
        started.append(store)
        envoys = {}
        for name in ("shipped", "bare"):
            admin, listen = h.free_port(), h.free_port()
            text = h.shipped_envoy_yaml(admin, listen, upstream.port, sport, artifacts["wasm"])
            path = sub / f"envoy-{name}.yaml"
            path.write_text(text if name == "shipped" else unwrapped(text))
            envoy = h.await_envoy(h.Envoy(h.launch_envoy_file(sub, f"envoy-{name}", path), admin,
                                          {"main": listen}, path))
            started.append(envoy)
            healthy(envoy)
            envoys[name] = envoy
    except h.HarnessError as e:
        for p in reversed(started):
            p.stop()
        pytest.fail(str(e), pytrace=False)
    yield Envoys(envoys["shipped"], envoys["bare"], upstream)
    for p in reversed(started):
        p.stop()


# --------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    proto: str  # "h1" or "h2"
    method: str
    route: str  # the path prefix: a route of envoy/envoy.yaml
    keyed: bool
    hop: bool = False  # the gRPC replay hop's header, from outside

    @property
    def id(self) -> str:
        return f"{self.proto}-{self.method}-{self.route.strip('/').replace('/', '_') or 'root'}-" \
               f"{'keyed' if self.keyed else 'keyless'}{'-hop' if self.hop else ''}"


ROUTES = ["/orders", "/payments", "/webhooks", "/search", "/misc"]
METHODS = ["POST", "post", "Post", "PATCH", "patch", "GET"]
CASES = [Case(proto, method, route, keyed)
         for proto in ("h1", "h2") for method in METHODS for route in ROUTES for keyed in (True, False)]
CASES += [Case(proto, method, route, keyed, hop=True)
          for proto in ("h1", "h2") for method in ("POST", "post", "GET")
          for route in (HOP_PATH, "/orders") for keyed in (True, False)]


def request_of(case: Case, which: str) -> tuple[str, list[tuple[str, str]], bytes]:
    """The path, headers and body of the case's request through `which` Envoy: the same
    request for both but for the key, the event id and the path, so that the two never share a
    record and the upstream's count per path is one Envoy's (and one call's)."""
    tag = f"{RUN}-{which}-{case.id}-{uuid.uuid4().hex[:8]}"
    path = case.route if case.route == HOP_PATH else f"{case.route}/{tag}"
    if case.route == "/webhooks" and case.keyed:
        headers, body = request_for(Event(f"ev-{tag}"), "binary", 1)
    else:
        headers, body = [JSON], json.dumps({"item": "book", "case": case.id}).encode()
    if case.keyed and case.route != "/webhooks":
        headers = headers + [("idempotency-key", f"k-{tag}")]
    if case.hop:
        headers = headers + [HOP]
    return path, headers, body


def send(port: int, case: Case, path: str, headers: list, body: bytes) -> h.Response:
    if case.proto == "h1":
        return h.request(port, case.method, path, body, headers, timeout=15)
    with H2Client(port) as c:
        sid = c.send(case.method, path, headers, body)
        resp = c.response(sid, timeout=15)
        assert resp is not None, f"{case.id}: no answer over HTTP/2 within 15 s"
        return resp


def problem_code(resp: h.Response) -> str | None:
    if "problem+json" not in (resp.header("content-type") or ""):
        return None
    try:
        return json.loads(resp.body).get("code")
    except ValueError:
        return "undecodable"


def outcome(envoys: Envoys, which: str, case: Case) -> tuple:
    """(status, problem code, replayed) of the request and of its retry, and how many times
    the upstream ran it."""
    path, headers, body = request_of(case, which)
    seen = []
    for _ in range(2):
        resp = send(envoys.port(which), case, path, headers, body)
        seen.append((resp.status, problem_code(resp), resp.header(REPLAY) == "true"))
    runs = 0 if path == HOP_PATH else envoys.upstream.count(path=path)
    return (*seen, runs)


def test_the_table_covers_what_the_issue_names():
    ids = {c.id for c in CASES}
    for must in ["h2-post-orders-keyed", "h2-Post-orders-keyed", "h2-post-payments-keyless",
                 "h2-POST-idempotency.filter.v1.GrpcReplay_Replay-keyless-hop"]:
        assert must in ids, must


def test_shipped_wrapper_guards_as_the_bare_filter(envoys):
    """Every case: the same outcome through the shipped wrapper as through the bare filter."""
    differ = []
    for case in CASES:
        bare, shipped = outcome(envoys, "bare", case), outcome(envoys, "shipped", case)
        if bare != shipped:
            differ.append(f"{case.id}: bare {bare}, shipped {shipped}")
    assert not differ, "\n".join(differ)


@pytest.mark.parametrize("proto", ["h1", "h2"])
def test_what_the_probes_found_is_guarded(envoys, proto):
    """The outcomes the issue measured, on the shipped configuration itself: over HTTP/2 a
    `post` or `Post` with one key runs once and replays; a keyless `post` to payments is 400
    `missing-key`; the hop header from outside is refused (400 `internal-header`) and nothing
    runs. Over HTTP/1.1 Envoy's codec refuses a lower-case method (400) before any filter."""
    if proto == "h1":
        first, retry, runs = outcome(envoys, "shipped", Case("h1", "post", "/orders", True))
        assert (first[0], retry[0], runs) == (400, 400, 0), (first, retry, runs)
    for method in ("post", "Post", "POST"):
        if proto == "h1" and method != "POST":
            continue
        first, retry, runs = outcome(envoys, "shipped", Case(proto, method, "/orders", True))
        assert (first[0], first[2], retry[0], retry[2], runs) == (201, False, 201, True, 1), \
            (method, first, retry, runs)
    if proto == "h2":
        first, retry, runs = outcome(envoys, "shipped", Case(proto, "post", "/payments", False))
        assert (first[:2], retry[:2], runs) == ((400, "missing-key"), (400, "missing-key"), 0)
    for keyed in (True, False):
        for route in (HOP_PATH, "/orders"):
            first, retry, runs = outcome(envoys, "shipped", Case(proto, "POST", route, keyed, hop=True))
            assert (first[:2], retry[:2], runs) == ((400, "internal-header"), (400, "internal-header"), 0), \
                (route, keyed, first, retry)


# --------------------------------------------------------------------------------------------
# the replay hop's memory
# --------------------------------------------------------------------------------------------


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def unfinished_hop_streams(port: int, streams: int = 8, size: int = 8 * 1024 * 1024,
                           timeout: float = 30.0) -> list[int | None]:
    """`streams` keyless requests to the replay path with the hop header, each sending up to
    `size` bytes of body and never ending it; returns each stream's status (None: no answer)."""
    chunk = b"\0" * 65536
    with H2Client(port) as c:
        sids = [c.start("POST", HOP_PATH, [HOP, ("content-type", "application/x-idempotency-record")])
                for _ in range(streams)]
        sent = dict.fromkeys(sids, 0)
        open_ = set(sids)
        deadline = time.monotonic() + timeout
        while open_ and time.monotonic() < deadline:
            progressed = False
            for sid in list(open_):
                n = c.write(sid, chunk[:size - sent[sid]])
                if n < 0 or sent[sid] + n >= size:
                    open_.discard(sid)
                sent[sid] += max(n, 0)
                progressed |= n > 0
            # Answers and window updates; waited for when nothing could be sent.
            c.wait(0.001 if progressed else 0.05)
        statuses = []
        for sid in sids:
            try:
                resp = c.response(sid, timeout=5)
            except H2Error:
                resp = None
            statuses.append(resp.status if resp is not None else None)
        return statuses


def test_keyless_hop_streams_hold_no_memory(envoys):
    envoy = envoys.shipped
    # Warm: both workers' VMs and connections exist before the first reading.
    for _ in range(4):
        assert h.request(envoys.port("shipped"), "POST", f"/orders/{RUN}-warm", b"{}", [JSON]).status == 201
    before = rss_kb(envoy.proc.pid)
    statuses = unfinished_hop_streams(envoys.port("shipped"))
    after = rss_kb(envoy.proc.pid)
    grown_mb = (after - before) / 1024
    print(f"replay hop: 8 keyless unfinished 8 MiB streams -> {statuses}; Envoy RSS {before // 1024} MB "
          f"-> {after // 1024} MB ({grown_mb:+.1f} MB)")
    assert statuses == [400] * 8, statuses
    assert grown_mb < 8, f"Envoy's RSS grew {grown_mb:.1f} MB over eight refused hop streams"
