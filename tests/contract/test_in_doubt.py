"""When the outcome is unknown: an attempt that reached the application and whose answer was lost
is never run again blindly (`unknown_outcome`, `outcome_lookup`).

One Envoy (its own idemstore on Redis, the session's counting upstream), listeners:

- `hold`: the defaults (`unknown_outcome: hold`), `store_key_header`, `lock_ttl_ms` 3000;
- `lookup`: the same with `outcome_lookup` on the counting upstream's `/__committed/{key}`
  (the application's record of what it committed under a store key);
- `again`: `unknown_outcome: run_again` (the behaviour before the guarantee);
- `detached`: `detached_execution` with `detached_timeout_ms` 1000.

Routes: `orders` (20 s), `slow` (Envoy's route timeout 1 s), `refused` (a cluster whose port
nothing listens on, until a test starts an upstream there) and `nohost` (a cluster without
endpoints). Each row: the first attempt, the application finishing its work (polled on the
upstream), then the same request again with the same key; asserted: what the client saw, what
the retry got and how many times the application ran it.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import h2.errors
import pytest

from support import harness as h
from support.checks import PANIC, REPLAY, assert_problem
from support.h2client import H2Client
from support.stack import plugin_config

STORE_KEY_HEADER = "x-idempotency-store-key"
LOCK_TTL_MS = 3000
BASE = {"store_key_header": STORE_KEY_HEADER, "lock_ttl_ms": LOCK_TTL_MS}
LISTENERS = {
    "hold": BASE,
    "lookup": {**BASE, "outcome_lookup": {"path": "/__committed/{key}"}},
    "again": {**BASE, "unknown_outcome": "run_again"},
    "detached": {**BASE, "detached_execution": True, "detached_timeout_ms": 1000},
}
JSON = ("content-type", "application/json")


def route(name: str, cluster: str, timeout: str = "20s") -> dict:
    return {"name": name, "match": {"prefix": f"/{name}"}, "route": {"cluster": cluster, "timeout": timeout}}


ROUTES = [route("orders", "upstream"), route("slow", "upstream", "1s"), route("refused", "refused"),
          route("nohost", "nohost")]


class World:
    def __init__(self, envoy: h.Envoy, upstream: h.Upstream, refused_port: int, run_dir, store_port: int):
        self.store_port = store_port
        self.envoy = envoy
        self.upstream = upstream
        self.refused_port = refused_port
        self.run_dir = run_dir

    def port(self, listener: str) -> int:
        return self.envoy.port(listener)

    def post(self, listener: str, path: str, key: str, body: str = '{"item":"book"}', headers=(),
             timeout: float = 15.0) -> h.Response:
        return h.request(self.port(listener), "POST", path, body, [("Idempotency-Key", key), JSON, *headers],
                         timeout=timeout)

    def give_up(self, listener: str, path: str, key: str, after: float, headers=(), body: str = '{"item":"book"}'):
        """The client sends the request and goes away after `after` seconds without an answer."""
        with pytest.raises(TimeoutError):
            self.post(listener, path, key, body, headers, timeout=after)

    def committed(self, store_key: str) -> bool:
        return 200 <= h.http_get_status(self.upstream.port, f"/__committed/{store_key}")[0] < 300


@pytest.fixture(scope="module")
def world(run_dir, artifacts, upstream) -> World:
    sub = run_dir / "in-doubt"
    store, sport, redis = None, None, None
    try:
        redis, rport = h.start_redis(sub)
        store, sport = h.start_idemstore(sub, f"redis://127.0.0.1:{rport}")
        refused_port = h.free_port()

        def clusters(config: dict) -> None:
            config["static_resources"]["clusters"] += [
                h.static_cluster("refused", refused_port, connect_timeout="0.25s"),
                {"name": "nohost", "type": "STATIC", "connect_timeout": "0.25s",
                 "load_assignment": {"cluster_name": "nohost", "endpoints": []}},
            ]

        filters = {ln: [h.wasm_filter(plugin_config(**cfg), artifacts["wasm"])] for ln, cfg in LISTENERS.items()}
        envoy = h.await_envoy(h.spawn_envoy(sub, "envoy-in-doubt", filters, upstream.port, sport,
                                            routes=ROUTES, config_hook=clusters))
    except h.HarnessError as e:
        for p in (store, redis):
            if p is not None:
                p.stop()
        pytest.fail(str(e), pytrace=False)
    yield World(envoy, upstream, refused_port, sub, sport)
    envoy.stop()
    store.stop()
    redis.stop()


@pytest.fixture(autouse=True)
def no_panic(world):
    start = len(world.envoy.log_text())
    yield
    bad = [ln for ln in world.envoy.log_text()[start:].splitlines() if PANIC.search(ln)]
    assert not bad, bad[:10]


def new_key(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:12]}"


def uniq(route_name: str) -> str:
    return f"/{route_name}/{uuid.uuid4().hex[:12]}"


def outcome_unknown(resp: h.Response) -> dict:
    return assert_problem(resp, 409, code="outcome-unknown")


def wait_committed(world: World, key: str, route_name: str) -> None:
    """Until the application has finished the first attempt's work (its handler is done)."""
    sk = h.store_key(key, route_name)
    h.wait_for(lambda: world.committed(sk), "the application finished the first attempt", timeout=15)


# --------------------------------------------------------------------------------------------
# the endings that leave a key in doubt
# --------------------------------------------------------------------------------------------


def test_client_gave_up_retry_is_409_and_nothing_runs_again(world):
    key, path = new_key("gaveup"), uniq("orders")
    in_doubt = world.envoy.counter("in_doubt")
    world.give_up("hold", path, key, after=0.3, headers=[("x-test-sleep-ms", "800")])
    assert world.envoy.wait_counter("in_doubt", in_doubt + 1) == in_doubt + 1
    wait_committed(world, key, "orders")
    doc = outcome_unknown(world.post("hold", path, key))
    assert "taken effect" in doc["detail"], doc
    assert world.upstream.count(path=path) == 1
    # Still in doubt later, and another body is still a 422.
    outcome_unknown(world.post("hold", path, key))
    assert world.post("hold", path, key, body='{"item":"pen"}').status == 422
    assert world.upstream.count(path=path) == 1


def test_route_timeout_504_then_409_with_retry_after_while_it_may_run(world):
    key, path = new_key("timeout"), uniq("slow")
    first = world.post("hold", path, key, headers=[("x-test-sleep-ms", "2000")])
    assert first.status == 504, first
    # At once: the first attempt may still be running (lock_ttl_ms after it began).
    retry = world.post("hold", path, key)
    outcome_unknown(retry)
    assert retry.header("retry-after") in {"1", "2", "3"}, retry
    wait_committed(world, key, "slow")
    outcome_unknown(world.post("hold", path, key))
    assert world.upstream.count(path=path) == 1


def test_detached_client_gone_still_replays(world):
    key, path = new_key("detached-gone"), uniq("orders")
    stored = world.envoy.counter("stored")
    world.give_up("detached", path, key, after=0.3, headers=[("x-test-sleep-ms", "600")])
    assert world.envoy.wait_counter("stored", stored + 1, timeout=10) >= stored + 1
    retry = world.post("detached", path, key)
    assert (retry.status, retry.header(REPLAY)) == (201, "true"), retry
    assert world.upstream.count(path=path) == 1


def test_http2_client_reset_is_in_doubt(world):
    key, path = new_key("h2"), uniq("orders")
    in_doubt = world.envoy.counter("in_doubt")
    with H2Client(world.port("hold")) as c:
        sid = c.send("POST", path, [("idempotency-key", key), JSON, ("x-test-sleep-ms", "800")], b'{"item":"book"}')
        assert c.response(sid, timeout=0.3) is None
        c.reset(sid, h2.errors.ErrorCodes.CANCEL)
        assert c.ping()
    assert world.envoy.wait_counter("in_doubt", in_doubt + 1) == in_doubt + 1
    wait_committed(world, key, "orders")
    outcome_unknown(h2_post(world, "hold", path, key))
    assert world.upstream.count(path=path) == 1


def test_an_envoy_that_died_mid_attempt_leaves_the_key_in_doubt(world, artifacts):
    """The store knows by itself: the dead Envoy's lock expires, the attempt's trace does not."""
    sub = world.run_dir / "victim"
    victim = h.await_envoy(h.spawn_envoy(
        sub, "envoy-victim", {"hold": [h.wasm_filter(plugin_config(**{**BASE, "lock_ttl_ms": 1000}),
                                                     artifacts["wasm"])]},
        world.upstream.port, world.store_port, routes=[route("orders", "upstream")]))
    key, path = new_key("died"), uniq("orders")
    try:
        sk = h.store_key(key, "orders")
        t = threading.Thread(target=lambda: _swallow(lambda: h.request(
            victim.port("hold"), "POST", path, '{"item":"book"}',
            [("Idempotency-Key", key), JSON, ("x-test-sleep-ms", "1500")], timeout=5)))
        t.start()
        h.wait_for(lambda: world.upstream.count(path=path) == 1, "the first attempt reached the app", timeout=10)
        victim.proc.popen.kill()
        victim.proc.popen.wait(timeout=10)
        killed = time.monotonic()
        t.join(timeout=10)
    finally:
        victim.stop()
    # Past the dead Envoy's lock (1 s): the next Envoy's retry meets the trace.
    h.wait_for(lambda: world.committed(sk), "the application finished", timeout=10)
    # Only time ends the dead Envoy's lock.
    h.wait_for(lambda: time.monotonic() > killed + 1.1, "the dead Envoy's lock_ttl_ms", timeout=5)
    outcome_unknown(world.post("hold", path, key))
    assert world.upstream.count(path=path) == 1


def _swallow(fn):
    try:
        fn()
    except OSError:
        pass


# --------------------------------------------------------------------------------------------
# resolving an in-doubt key
# --------------------------------------------------------------------------------------------


def test_lookup_replays_what_the_application_committed(world):
    for route_name, first_headers, timeout in [("orders", [("x-test-sleep-ms", "800")], 0.3),
                                              ("slow", [("x-test-sleep-ms", "2000")], None)]:
        key, path = new_key("lookup"), uniq(route_name)
        if timeout:
            world.give_up("lookup", path, key, after=timeout, headers=first_headers)
        else:
            assert world.post("lookup", path, key, headers=first_headers).status == 504
        wait_committed(world, key, route_name)
        retry = world.post("lookup", path, key)
        assert (retry.status, retry.header(REPLAY)) == (201, "true"), retry
        assert json.loads(retry.body)["path"] == path, retry
        again = world.post("lookup", path, key)
        assert (again.status, again.header(REPLAY), again.body) == (201, "true", retry.body), again
        assert world.upstream.count(path=path) == 1, route_name


def test_lookup_404_runs_the_retry_only_after_lock_ttl(world):
    key, path = new_key("lookup-404"), uniq("orders")
    began = time.monotonic()
    assert world.post("lookup", path, key, headers=[("x-test-reset", "1")]).status == 503
    # The application says it did not commit, but the first attempt might still be running.
    early = world.post("lookup", path, key)
    if time.monotonic() - began < LOCK_TTL_MS / 1000 - 0.2:
        outcome_unknown(early)
        assert early.header("retry-after") is not None, early
        assert world.upstream.count(path=path) == 1
    h.wait_for(lambda: time.monotonic() - began > LOCK_TTL_MS / 1000 + 0.1, "lock_ttl_ms passed", timeout=10)
    retry = world.post("lookup", path, key)
    assert (retry.status, retry.header(REPLAY)) == (201, None), retry
    assert world.upstream.count(path=path) == 2
    replay = world.post("lookup", path, key)
    assert (replay.status, replay.header(REPLAY)) == (201, "true"), replay
    assert world.upstream.count(path=path) == 2


# --------------------------------------------------------------------------------------------
# what is not held
# --------------------------------------------------------------------------------------------


def test_never_sent_is_released_and_runs_once_the_upstream_is_up(world):
    key, path = new_key("refused"), uniq("refused")
    in_doubt = world.envoy.counter("in_doubt")
    first = world.post("hold", path, key)
    assert first.status == 503, first
    late, port = h.start_upstream(world.run_dir / "late-upstream", world.refused_port)
    try:
        retry = world.post("hold", path, key)
        assert (retry.status, retry.header(REPLAY)) == (201, None), retry
        assert h.Upstream(late, port).count(path=path) == 1
    finally:
        late.stop()
    assert world.envoy.counter("in_doubt") == in_doubt


def test_no_healthy_upstream_is_not_held(world):
    key, path = new_key("nohost"), uniq("nohost")
    in_doubt = world.envoy.counter("in_doubt")
    for _ in range(2):
        resp = world.post("hold", path, key)
        assert resp.status == 503 and b"no healthy upstream" in resp.body, resp
    assert world.envoy.counter("in_doubt") == in_doubt


@pytest.mark.parametrize("status", ["500", "503"])
def test_the_applications_own_errors_are_released(world, status):
    key, path = new_key(f"own-{status}"), uniq("orders")
    assert world.post("hold", path, key, headers=[("x-test-status", status)]).status == int(status)
    assert world.post("hold", path, key).status == 201
    assert world.upstream.count(path=path) == 2


def test_run_again_runs_the_retry(world):
    key, path = new_key("again"), uniq("slow")
    assert world.post("again", path, key, headers=[("x-test-sleep-ms", "2000")]).status == 504
    wait_committed(world, key, "slow")
    retry = world.post("again", path, key)
    assert (retry.status, retry.header(REPLAY)) == (201, None), retry
    assert world.upstream.count(path=path) == 2


def h2_post(world: World, listener: str, path: str, key: str, headers=(), body: bytes = b'{"item":"book"}',
            timeout: float = 15.0) -> h.Response | None:
    with H2Client(world.port(listener)) as c:
        sid = c.send("POST", path, [("idempotency-key", key), JSON, *headers], body)
        return c.response(sid, timeout=timeout)


ROWS = {
    # row: listener, route, the first attempt's headers, what its client sees
    "route_timeout": ("hold", "slow", [("x-test-sleep-ms", "2000")], 504),
    "work_done_then_reset": ("hold", "orders", [("x-test-reset", "1")], 503),
    "detached_timeout": ("detached", "orders", [("x-test-sleep-ms", "2000")], 504),
}


@pytest.mark.parametrize("proto", ["h1", "h2"])
@pytest.mark.parametrize("row", list(ROWS))
def test_the_rows_end_to_end(world, row, proto):
    """The table's rows over HTTP/1.1 and HTTP/2 (prior knowledge): one execution, and the retry
    `409` `outcome-unknown`, also once the application has finished its work."""
    listener, route_name, headers, status = ROWS[row]
    post = world.post if proto == "h1" else lambda *a, **kw: h2_post(world, *a, **kw)
    key, path = new_key(f"{proto}-{row}"), uniq(route_name)
    first = post(listener, path, key, headers=headers)
    assert first is not None and first.status == status, first
    outcome_unknown(post(listener, path, key))
    if row != "work_done_then_reset":  # the reset comes before the application's work
        wait_committed(world, key, route_name)
        outcome_unknown(post(listener, path, key))
    assert world.upstream.count(path=path) == 1
