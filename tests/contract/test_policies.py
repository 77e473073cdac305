"""A policy per route (`routes`), the published policy (`policy_url`, `problem_type_base`) and the
expiry told to clients (`expiry_header`), end to end.

One Envoy, idemstore on a real Redis, the counting upstream. Both listeners have the same routes:
`orders`, `payments`, `webhooks`, `misc` (named; misc has no policy on `api`), `search` (the filter switched
off for it by Envoy's per-route `FilterConfig`, `disabled: true`) and an unnamed `/` route.

* `api`: policies only: payments strict (a key required, 4xx kept, 7 days), webhooks inbox
  mode, everything else the defaults; no `policy_url`, no `expiry_header`.
* `published`: `policy_url` and `expiry_header` at the top level, the payments policy with a
  `problem_type_base` of its own, misc with a `policy_url` of its own that has a fragment,
  `store_key_header` (so the tests find each record in Redis),
  `lock_wait_ms: 0` (a duplicate in flight is a 409 at once) and `max_body_bytes: 1024` (a 413
  is cheap).

A refused policy: an Envoy started with it exits naming the route and the key (as
test_config.py shows for the top level), and an Envoy whose listener comes from a file (LDS)
rejects the update and keeps serving with its previous policies. The shipped envoy/envoy.yaml
(three routes, three policies, search unguarded) is run as it is, ports rewritten.
"""

from __future__ import annotations

import email.utils
import json
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from support import harness as h
from support import redis_cluster as rc
from support.checks import REPLAY, assert_executed, assert_problem, assert_replay_of
from support.harness import new_key
from support.pusher import Event, request_for

POLICY_URL = "https://api.example.com/docs/idempotency"
TYPE_BASE = "https://api.example.com/problems/"
TAG_BASE = "tag:idempotency-filter,2026:problems/"
EXPIRY = "idempotency-expires"
STORE_KEY_HEADER = "x-idempotency-store-key"
# A policy_url with a fragment: no `#code` can be added, problem types stay the tag URI.
ANCHORED_URL = "https://api.example.com/docs#idempotency"
WEEK = 604800
DAY = 86400  # the default retention_seconds

PAYMENTS = {"require_key": True, "store_statuses": ["2xx", "4xx"], "retention_seconds": WEEK}
WEBHOOKS = {"mode": "inbox", "inbox": {"message_id": "cloudevents"}}
POLICIES = {"payments": PAYMENTS, "webhooks": WEBHOOKS}

# Listener name -> plugin configuration (store_cluster added).
LISTENERS = {
    "api": {"routes": POLICIES},
    "published": {"policy_url": POLICY_URL, "expiry_header": EXPIRY, "store_key_header": STORE_KEY_HEADER,
                  "lock_wait_ms": 0, "max_body_bytes": 1024,
                  "routes": {"payments": {**PAYMENTS, "problem_type_base": TYPE_BASE},
                             "misc": {"policy_url": ANCHORED_URL}}},
}

# Envoy's generic per-route filter config: the filter (its `name` in http_filters) is skipped.
DISABLED = {h.filter_name(): {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig",
                                        "disabled": True}}


def route(name: str | None, prefix: str, **extra) -> dict:
    r = {"match": {"prefix": prefix}, "route": {"cluster": "upstream", "timeout": "20s"}, **extra}
    if name:
        r["name"] = name
    return r


ROUTES = [route("orders", "/orders"), route("payments", "/payments"), route("webhooks", "/webhooks"),
          route("misc", "/misc"), route("search", "/search", typed_per_filter_config=DISABLED),
          route(None, "/")]

JSON = ("content-type", "application/json")


@dataclass
class Policies:
    envoy: h.Envoy
    upstream: h.Upstream
    store_port: int
    redis_port: int

    def post(self, listener: str, path: str, body: bytes | str = b"{}", key: str | None = None,
             headers: list | None = None) -> h.Response:
        hdrs = list(headers or [])
        if key is not None:
            hdrs.append(("Idempotency-Key", key))
        return h.request(self.envoy.port(listener), "POST", path, body, hdrs + [JSON])

    def wait_stored(self, before: int) -> None:
        # The commit lands after the answer: a retry sent before it would wait on the lock.
        assert self.envoy.wait_counter("stored", before + 1) >= before + 1, "the answer was never stored"

    def wait_released(self, before: int) -> None:
        assert self.envoy.wait_counter("released", before + 1) >= before + 1, "the lock was never released"

    def store_key(self, key: str) -> str:
        """The store key the filter sent the upstream (`store_key_header`) with `key`'s execution."""
        [ex] = self.upstream.executions(key=key, headers=True)
        [skey] = [v for n, v in ex["headers"] if n == STORE_KEY_HEADER]
        return skey

    def record_expiry(self, key: str) -> float:
        """When the record of `key` expires in Redis: now + its PTTL."""
        rkey = rc.store_record_key(self.store_key(key))
        pttl = h.wait_for(lambda: (lambda v: v if v > 0 else None)(rc.command(self.redis_port, "PTTL", rkey)),
                          f"the record {rkey} in Redis", timeout=5)
        return time.time() + pttl / 1000


@pytest.fixture(scope="module")
def policies(run_dir, artifacts, upstream) -> Policies:
    sub = run_dir / "policies"
    started: list[h.Proc] = []
    try:
        redis, rport = h.start_redis(sub)
        started.append(redis)
        store, sport = h.start_idemstore(sub, f"redis://127.0.0.1:{rport}")
        started.append(store)
        listeners = {ln: {"filters": [h.wasm_filter({"store_cluster": "idemstore", **cfg}, artifacts["wasm"])],
                          "routes": ROUTES} for ln, cfg in LISTENERS.items()}
        envoy = h.await_envoy(h.spawn_envoy_with(sub, "envoy-policies", listeners,
                                                 [h.static_cluster("upstream", upstream.port), h.store_cluster(sport)]))
    except h.HarnessError as e:
        for p in reversed(started):
            p.stop()
        pytest.fail(str(e), pytrace=False)
    yield Policies(envoy, upstream, sport, rport)
    envoy.stop()
    store.stop()
    redis.stop()


def uniq(prefix: str) -> str:
    return f"{prefix}/{uuid.uuid4().hex}"


IMF_FIXDATE = re.compile(r"^(Mon|Tue|Wed|Thu|Fri|Sat|Sun), \d{2} (Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) "
                         r"\d{4} \d{2}:\d{2}:\d{2} GMT$")


def expiry(resp: h.Response) -> float:
    """The expiry header of an answer (one, an IMF-fixdate) as a Unix time."""
    values = resp.header_all(EXPIRY)
    assert len(values) == 1 and IMF_FIXDATE.match(values[0]), resp
    return email.utils.parsedate_to_datetime(values[0]).timestamp()


# --------------------------------------------------------------------------------------------
# 1. each route by its policy
# --------------------------------------------------------------------------------------------


def test_missing_key_is_400_on_payments_and_runs_elsewhere(policies):
    """payments requires a key; orders, a named route without a policy and the unnamed route
    have the defaults: a keyless POST runs (each time)."""
    p = policies
    path = uniq("/payments")
    rejected = p.envoy.counter("rejected")
    doc = assert_problem(p.post("api", path), 400, code="missing-key")
    assert doc["type"] == TAG_BASE + "missing-key", doc
    assert p.upstream.count(path=path) == 0
    assert p.envoy.counter("rejected") == rejected + 1
    # A method the policy does not guard still passes without a key.
    assert h.request(p.envoy.port("api"), "GET", path).status == 201
    for prefix in ("/orders", "/misc", "/other"):
        path = uniq(prefix)
        for _ in range(2):
            assert_executed(p.post("api", path), 201)
        assert p.upstream.count(path=path) == 2, prefix
    assert p.envoy.counter("rejected") == rejected + 1


def test_404_is_replayed_on_payments_and_runs_again_elsewhere(policies):
    """payments keeps 4xx answers: the retry of a 404 is its replay, the upstream ran once. On
    orders (and on the routes without a policy) a 404 is not kept: the retry runs again."""
    p = policies
    notfound = [("x-test-status", "404")]
    key, path = new_key("pay404"), uniq("/payments")
    stored = p.envoy.counter("stored")
    first = p.post("api", path, key=key, headers=notfound)
    assert_executed(first, 404)
    p.wait_stored(stored)
    again = p.post("api", path, key=key, headers=notfound)
    assert_replay_of(again, first)
    assert again.header(REPLAY) == "true"
    assert p.upstream.count(key=key) == 1
    for prefix in ("/orders", "/misc", "/other"):
        key, path = new_key("ord404"), uniq(prefix)
        released = p.envoy.counter("released")
        assert_executed(p.post("api", path, key=key, headers=notfound), 404)
        p.wait_released(released)
        assert_executed(p.post("api", path, key=key, headers=notfound), 404)
        assert p.upstream.count(key=key) == 2, prefix


def test_duplicate_message_is_acknowledged_on_webhooks(policies):
    """webhooks is in inbox mode: the CloudEvent's id is the key, a redelivery (another
    attempt, another address) is acknowledged with the stored answer and never reaches the
    upstream; a delivery without an id is refused. The same deliveries to orders (no key, not
    inbox) run each time."""
    p = policies
    ev = Event(f"ev-{uuid.uuid4().hex}", source="/broker", data={"order": 7})
    path = uniq("/webhooks")
    headers, body = request_for(ev, "binary", 1)
    stored = p.envoy.counter("stored")
    first = h.request(p.envoy.port("api"), "POST", path, body, headers)
    assert_executed(first, 201)
    p.wait_stored(stored)
    for attempt, source in ((2, "127.0.0.2"), (3, None)):
        headers, body = request_for(ev, "binary", attempt)
        dup = h.request(p.envoy.port("api"), "POST", path, body, headers, source=source)
        assert_replay_of(dup, first)
    assert p.upstream.count(path=path) == 1
    no_id = [(n, v) for n, v in headers if n != "ce-id"]
    missing = uniq("/webhooks")
    assert_problem(h.request(p.envoy.port("api"), "POST", missing, body, no_id), 400, code="missing-message-id")
    assert p.upstream.count(path=missing) == 0
    orders = uniq("/orders")
    for _ in range(2):
        assert_executed(h.request(p.envoy.port("api"), "POST", orders, body, headers), 201)
    assert p.upstream.count(path=orders) == 2


def test_route_with_the_filter_disabled_moves_no_counter(policies):
    """search: Envoy's per-route FilterConfig `disabled: true` skips the filter. A keyed POST
    sent twice runs twice and moves none of the filter's counters (the stream's included); the
    same POST on orders is guarded (the control)."""
    p = policies
    filter_stats = h.filter_stats_regex()
    downstream = "http.api.downstream_rq_total"
    h.wait_for(lambda: h.store_idle(p.envoy), "no store call in flight", timeout=5)
    before = p.envoy.stats(filter_stats)
    rq = p.envoy.stats(rf"^{re.escape(downstream)}$")[downstream]
    key, path = new_key("search"), uniq("/search")
    for _ in range(2):
        resp = p.post("api", path, key=key)
        assert_executed(resp, 201)
    assert p.upstream.count(key=key) == 2
    assert p.envoy.stats(rf"^{re.escape(downstream)}$")[downstream] == rq + 2
    h.wait_for(lambda: h.store_idle(p.envoy), "no store call in flight", timeout=5)
    assert p.envoy.stats(filter_stats) == before
    guarded = p.envoy.counter("guarded")
    assert_executed(p.post("api", uniq("/orders"), key=key), 201)
    assert p.envoy.counter("guarded") == guarded + 1


# --------------------------------------------------------------------------------------------
# 2. a refused policy
# --------------------------------------------------------------------------------------------

# Case -> (routes, the refusal the log must show: the route and the key named).
REFUSED = {
    "unknown_key": ({"payments": {**PAYMENTS, "retention_secs": WEEK}, "webhooks": WEBHOOKS},
                    "invalid configuration: `routes.payments.retention_secs` is not a known key"),
    "out_of_range": ({"payments": {**PAYMENTS, "retention_seconds": 0}, "webhooks": WEBHOOKS},
                     "invalid configuration: `routes.payments.retention_seconds` must be an integer from 1 to "
                     f"{WEEK}, got 0"),
    "filter_wide": ({"payments": {**PAYMENTS, "store_cluster": "idemstore"}, "webhooks": WEBHOOKS},
                    "invalid configuration: `routes.payments.store_cluster` is filter-wide: set it at the top level"),
    # A policy is checked merged with the top level: inbox mode's rules hold per route.
    "inbox_with_require_key": ({"payments": PAYMENTS, "webhooks": {**WEBHOOKS, "require_key": True}},
                               "invalid configuration: `routes.webhooks.require_key` has no effect in inbox mode"),
}
REFUSAL_LINE = "idempotency filter refused its configuration: "


@pytest.mark.parametrize("case", ["unknown_key", "out_of_range", "filter_wide"])
def test_refused_policy_stops_envoy_at_start(case, run_dir, artifacts, upstream):
    """As test_config.py shows for the top level: a static listener whose policy is refused
    makes Envoy exit before it is ready, the wasm log line naming the route and the key."""
    routes, message = REFUSED[case]
    admin, port = h.free_port(), h.free_port()
    cfg = {"store_cluster": "idemstore", "routes": routes}
    config = h.envoy_config(admin, [h.listener("api", port, [h.wasm_filter(cfg, artifacts["wasm"])], ROUTES)],
                            upstream.port, h.free_port())
    proc = h.launch_envoy(run_dir / "policies-refused", f"envoy-{case}", config)
    try:
        log = h.envoy_refused(proc, admin)
        hits = [ln for ln in log.splitlines() if h.is_filter_log_line(ln) and REFUSAL_LINE + message in ln]
        assert hits, f"no filter log line says {message!r}\n{proc.describe(60)}"
    finally:
        proc.stop()


LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"


def write_lds(path: Path, listener: dict, version: str) -> None:
    """The listener as the file Envoy's LDS watches, swapped in at once (a rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"version_info": version, "resources": [{"@type": LISTENER_TYPE, **listener}]}))
    os.replace(tmp, path)


def test_refused_policy_update_keeps_the_previous_configuration(policies, run_dir, artifacts):
    """An Envoy whose listener comes from a file (LDS, as a control plane would push it): each
    update with a refused policy is rejected (`listener_manager.lds.update_rejected`), the log
    names the route and the key, and the listener keeps serving with its previous policies
    (payments still requires a key, orders still runs keyless). A valid update after them is
    applied (payments without its policy: a keyless POST runs)."""
    p = policies
    sub = run_dir / "policies-lds"
    sub.mkdir(parents=True, exist_ok=True)
    admin, port = h.free_port(), h.free_port()
    lds = sub / "lds.json"

    clusters = [h.static_cluster("upstream", p.upstream.port), h.store_cluster(p.store_port)]

    def listener(routes: dict) -> dict:
        cfg = {"store_cluster": "idemstore", "routes": routes}
        return h.host_listener(h.listener("api", port, [h.wasm_filter(cfg, artifacts["wasm"])], ROUTES), clusters)

    write_lds(lds, listener(POLICIES), "1")
    config = {
        "node": {"id": "policies", "cluster": "policies"},
        "admin": {"address": {"socket_address": {"address": h.LOOPBACK, "port_value": admin}}},
        "dynamic_resources": {"lds_config": {"path_config_source": {"path": str(lds)},
                                             "resource_api_version": "V3"}},
        "static_resources": {"clusters": clusters},
    }
    envoy = h.await_envoy(h.spawn_envoy_config(sub, "envoy-lds", config, admin, {"api": port}))

    def lds_stat(name: str) -> int:
        return envoy.stats(rf"^listener_manager\.lds\.{name}$").get(f"listener_manager.lds.{name}", 0)

    def still_the_old_policies() -> None:
        path = uniq("/payments")
        assert_problem(h.request(port, "POST", path, b"{}", [JSON]), 400, code="missing-key")
        assert p.upstream.count(path=path) == 0
        path = uniq("/orders")
        assert_executed(h.request(port, "POST", path, b"{}", [JSON]), 201)

    try:
        still_the_old_policies()
        assert (lds_stat("update_success"), lds_stat("update_rejected")) == (1, 0)
        for n, case in enumerate(sorted(REFUSED), 1):
            routes, message = REFUSED[case]
            write_lds(lds, listener(routes), f"bad-{n}")
            h.wait_for(lambda: lds_stat("update_rejected") >= n, f"LDS update {case} rejected", envoy.proc, timeout=10)
            assert (lds_stat("update_success"), lds_stat("update_rejected")) == (1, n), case
            hits = [ln for ln in envoy.log_text().splitlines() if REFUSAL_LINE + message in ln]
            assert len(hits) == 1, f"{case}: no single log line says {message!r}\n{envoy.proc.describe(40)}"
            still_the_old_policies()
        write_lds(lds, listener({"webhooks": WEBHOOKS}), "good-2")
        h.wait_for(lambda: lds_stat("update_success") >= 2, "the valid LDS update applied", envoy.proc, timeout=10)
        path = uniq("/payments")
        h.wait_for(lambda: h.request(port, "POST", path, b"{}", [JSON]).status == 201,
                   "payments without its policy", envoy.proc, timeout=10)
        assert p.upstream.count(path=path) >= 1
    finally:
        envoy.stop()


# --------------------------------------------------------------------------------------------
# 3. the published policy and the expiry
# --------------------------------------------------------------------------------------------


def _invalid_key(p: Policies, listener: str, prefix: str):
    path = uniq(prefix)
    return p.post(listener, path, key="k" * 256), 400, "invalid-key", path


def _missing_key(p: Policies, listener: str, prefix: str):
    path = uniq(prefix)
    return p.post(listener, path), 400, "missing-key", path


def _key_reused(p: Policies, listener: str, prefix: str):
    key, path = new_key("reused"), uniq(prefix)
    stored = p.envoy.counter("stored")
    assert_executed(p.post(listener, path, '{"qty": 1}', key), 201)
    p.wait_stored(stored)
    return p.post(listener, path, '{"qty": 2}', key), 422, "key-reused", path


def _in_flight(p: Policies, listener: str, prefix: str):
    key, path = new_key("inflight"), uniq(prefix)
    t, out = h.in_thread(lambda: p.post(listener, path, "{}", key, headers=[("x-test-sleep-ms", "800")]))
    h.wait_for(lambda: p.upstream.count(key=key) == 1, "the original at the upstream", timeout=5)
    dup = p.post(listener, path, "{}", key)
    assert_executed(h.joined(t, out), 201)
    return dup, 409, "request-in-flight", path


def _too_large(p: Policies, listener: str, prefix: str):
    path = uniq(prefix)
    return p.post(listener, path, b"x" * 2048, new_key("large")), 413, "body-too-large", path


# Case -> (make the problem, listener, route prefix, the `type` is this + code, the policy
# URL the `link` header points to, or None: no link).
PROBLEMS = {
    # published, orders: only policy_url -> POLICY_URL#code
    "published_orders_400_invalid_key": (_invalid_key, "published", "/orders", POLICY_URL + "#", POLICY_URL),
    "published_orders_422_key_reused": (_key_reused, "published", "/orders", POLICY_URL + "#", POLICY_URL),
    "published_orders_409_in_flight": (_in_flight, "published", "/orders", POLICY_URL + "#", POLICY_URL),
    "published_orders_413_body_too_large": (_too_large, "published", "/orders", POLICY_URL + "#", POLICY_URL),
    # published, payments: its policy's problem_type_base -> base + code
    "published_payments_400_missing_key": (_missing_key, "published", "/payments", TYPE_BASE, POLICY_URL),
    "published_payments_400_invalid_key": (_invalid_key, "published", "/payments", TYPE_BASE, POLICY_URL),
    # published, misc: its policy's policy_url has a fragment -> the tag URI, its own link
    "published_misc_400_invalid_key": (_invalid_key, "published", "/misc", TAG_BASE, ANCHORED_URL),
    # api: neither -> the tag URI, no link
    "api_payments_400_missing_key": (_missing_key, "api", "/payments", TAG_BASE, None),
    "api_orders_400_invalid_key": (_invalid_key, "api", "/orders", TAG_BASE, None),
    "api_orders_422_key_reused": (_key_reused, "api", "/orders", TAG_BASE, None),
}


@pytest.mark.parametrize("case", sorted(PROBLEMS))
def test_problem_links_the_policy_and_types_from_the_base(policies, case):
    make, listener, prefix, base, url = PROBLEMS[case]
    resp, status, code, path = make(policies, listener, prefix)
    doc = assert_problem(resp, status, code=code)
    assert doc["type"] == base + code, (case, doc)
    assert resp.header_all("link") == ([f'<{url}>; rel="describedby"'] if url else []), resp
    assert policies.upstream.count(path=path) <= 1


def test_expiry_header_matches_the_record_ttl(policies):
    """published (expiry_header on), orders (retention 1 day): the first answer and its replays
    carry the same HTTP date, which is when the record expires in Redis (now + PTTL) within a
    second. The date has whole seconds: the record expires within [date, date + 1 s) plus the
    moments between the answer and its commit."""
    p = policies
    key, path = new_key("exp"), uniq("/orders")
    stored = p.envoy.counter("stored")
    t0 = time.time()
    first = p.post("published", path, key=key)
    assert_executed(first, 201)
    at = expiry(first)
    assert t0 + DAY - 1 <= at <= time.time() + DAY, (at - t0, first)
    p.wait_stored(stored)
    in_redis = p.record_expiry(key)
    assert -1.0 <= in_redis - at <= 1.5, f"record expires {in_redis - at:+.3f} s after the header's date"
    for _ in range(2):
        replay = p.post("published", path, key=key)
        assert_replay_of(replay, first)
        assert abs(expiry(replay) - at) <= 1, (replay.header(EXPIRY), first.header(EXPIRY))
    assert p.upstream.count(key=key) == 1


def test_expiry_of_a_kept_404_on_payments_is_seven_days_ahead(policies):
    """published, payments (retention 604800 s, 4xx kept): a 404 and its replay carry an
    expiry 7 days ahead, Redis's TTL agreeing; on orders a 404 is not kept: no expiry header."""
    p = policies
    notfound = [("x-test-status", "404")]
    key, path = new_key("exp7"), uniq("/payments")
    stored = p.envoy.counter("stored")
    t0 = time.time()
    first = p.post("published", path, key=key, headers=notfound)
    assert_executed(first, 404)
    at = expiry(first)
    assert t0 + WEEK - 1 <= at <= time.time() + WEEK, (at - t0, first)
    p.wait_stored(stored)
    assert -1.0 <= p.record_expiry(key) - at <= 1.5
    replay = p.post("published", path, key=key, headers=notfound)
    assert_replay_of(replay, first)
    assert abs(expiry(replay) - at) <= 1, (replay.header(EXPIRY), first.header(EXPIRY))
    assert p.upstream.count(key=key) == 1
    key, path = new_key("exp404"), uniq("/orders")
    released = p.envoy.counter("released")
    resp = p.post("published", path, key=key, headers=notfound)
    assert_executed(resp, 404)
    assert resp.header(EXPIRY) is None, resp
    p.wait_released(released)


def test_expiry_header_is_off_by_default(policies):
    """api has no expiry_header: neither the first answer nor its replay carries one, on a
    route with a policy or without."""
    p = policies
    for prefix in ("/orders", "/payments"):
        key, path = new_key("noexp"), uniq(prefix)
        stored = p.envoy.counter("stored")
        first = p.post("api", path, key=key)
        assert_executed(first, 201)
        p.wait_stored(stored)
        replay = p.post("api", path, key=key)
        assert_replay_of(replay, first)
        for resp in (first, replay):
            assert resp.header(EXPIRY) is None and resp.header("link") is None, resp


# --------------------------------------------------------------------------------------------
# the shipped configuration
# --------------------------------------------------------------------------------------------


def test_shipped_envoy_yaml_three_routes_three_policies(policies, run_dir, artifacts):
    """envoy/envoy.yaml as shipped (ports and wasm path rewritten), on this module's idemstore:
    orders with the defaults, payments strict (and its policy's problems linking to the
    shipped policy_url), webhooks in inbox mode, search not guarded at all, all behind the
    composite matcher, which creates the filter for keyless requests on payments and webhooks."""
    p = policies
    text = h.SHIPPED_ENVOY_YAML.read_text()
    policy_url = re.search(r'"policy_url": "([^"]+)"', text).group(1)
    sub = run_dir / "policies-shipped"
    sub.mkdir(parents=True, exist_ok=True)
    admin, listen = h.free_port(), h.free_port()
    path = sub / "envoy-shipped.yaml"
    path.write_text(h.shipped_envoy_yaml(admin, listen, p.upstream.port, p.store_port, artifacts["wasm"]))
    envoy = h.await_envoy(h.Envoy(h.launch_envoy_file(sub, "envoy-shipped", path), admin, {"main": listen}, path))
    try:
        # Until its health check passes, store calls fail at once (panic threshold 0).
        h.wait_for(lambda: envoy.stats(r"^cluster\.idemstore\.membership_healthy$")
                   .get("cluster.idemstore.membership_healthy") == 1, "idemstore healthy", envoy.proc, timeout=10)

        def post(path: str, key: str | None = None, headers: list | None = None, body=b"{}") -> h.Response:
            hdrs = list(headers or []) + ([("Idempotency-Key", key)] if key else [])
            return h.request(listen, "POST", path, body, hdrs + [JSON])

        # orders: the defaults
        key, path = new_key("ship-ord"), uniq("/orders")
        stored = envoy.counter("stored")
        first = post(path, key)
        assert_executed(first, 201)
        assert envoy.wait_counter("stored", stored + 1) == stored + 1
        assert_replay_of(post(path, key), first)
        assert p.upstream.count(key=key) == 1
        keyless = uniq("/orders")
        assert_executed(post(keyless), 201)
        assert p.upstream.count(path=keyless) == 1
        # payments: a key required (the problem linking to the policy), a 404 kept
        path = uniq("/payments")
        doc = assert_problem(post(path), 400, code="missing-key")
        assert doc["type"] == f"{policy_url}#missing-key", doc
        assert p.upstream.count(path=path) == 0
        key, path = new_key("ship-pay"), uniq("/payments")
        stored = envoy.counter("stored")
        first = post(path, key, [("x-test-status", "404")])
        assert_executed(first, 404)
        assert envoy.wait_counter("stored", stored + 1) == stored + 1
        assert_replay_of(post(path, key, [("x-test-status", "404")]), first)
        assert p.upstream.count(key=key) == 1
        # webhooks: a redelivered CloudEvent acknowledged, handled once
        ev, path = Event(f"ev-{uuid.uuid4().hex}"), uniq("/webhooks")
        headers, body = request_for(ev, "binary", 1)
        stored = envoy.counter("stored")
        first = h.request(listen, "POST", path, body, headers)
        assert_executed(first, 201)
        assert envoy.wait_counter("stored", stored + 1) == stored + 1
        assert_replay_of(h.request(listen, "POST", path, body, headers), first)
        assert p.upstream.count(path=path) == 1
        # search: no guard, no counter
        h.wait_for(lambda: h.store_idle(envoy), "no store call in flight", timeout=5)
        before = envoy.stats(h.filter_stats_regex())
        key, path = new_key("ship-search"), uniq("/search")
        for _ in range(2):
            assert_executed(post(path, key), 201)
        assert p.upstream.count(key=key) == 2
        assert envoy.stats(h.filter_stats_regex()) == before
    finally:
        envoy.stop()
