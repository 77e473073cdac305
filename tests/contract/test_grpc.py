"""Unary gRPC calls, end to end: real Envoy, the real filter, idemstore on Redis, a grpcio server
that counts executions (support/grpc_app.py) and grpcio clients.

- `guard` Envoy: listeners `guard` (the filter with `detached_execution`, so that an attempt a
  client Envoy abandons keeps running and its answer is stored; `-bin` metadata listed in
  `replay_headers`; `Chat` listed in `grpc_streaming_methods`; `max_record_bytes` 2 MiB),
  `nowait` (`lock_wait_ms: 0`), `small` (`max_record_bytes` 64 KiB), `closed` (a store that
  is down, `failure_mode: closed`, `require_key`), `fallback` (that store, failing open: the
  local fallback) and `istio` (`pause_on_headers: false` and the buffer filter, as under
  Istio), each with the replay route first, and the replay listener (support/harness.py
  `add_grpc_replay`, as every shipped config has it);
- `noroute` Envoy: the guard without the replay route and listener;
- `client` Envoy (a caller's sidecar): listeners `retry` (route retries on
  cancelled/deadline-exceeded/unavailable/reset, per-try timeout 300 ms), `hedge` (the same,
  hedged on the per-try timeout) and `mint` (the retries, and mint mode adding keys), all to
  the `guard` listener over HTTP/2.

On the native host (IDEM_HOST=native), which refuses `detached_execution` (docs/native.md, "Not
yet"), the guard's listeners run routed: every call these tests send to the guard itself is
answered as before, and the client Envoy's retries and hedges, whose abandoned attempts must
keep running, skip.
"""

from __future__ import annotations

import threading

import grpc
import pytest

from support import grpc_app as g
from support import harness as h
from support.checks import assert_grpc_problem
from support.stack import istio_filters, plugin_config, start_backend

OK = grpc.StatusCode.OK
LISTED = ["content-type", "x-order-bin", "x-order-id", "x-trace-bin", "x-trace"]
GUARD = plugin_config(detached_execution=not h.native(), lock_wait_ms=5000, replay_headers=LISTED,
                      grpc_streaming_methods=[g.CHAT], max_record_bytes=2 * 1024 * 1024)
# What the client Envoy's retries and hedges need of the guard: an attempt they abandon keeps running.
NEEDS_DETACHED = h.native_refusal({"detached_execution": True})
RETRY_ON = "cancelled,deadline-exceeded,unavailable,reset"
RETRY_POLICY = {"retry_on": RETRY_ON, "num_retries": 3, "per_try_timeout": "0.3s"}
SLOW = [("x-test-delay-ms", "1000")]


def grpc_routes(cluster: str) -> list[dict]:
    return [{"name": "orders", "match": {"prefix": "/"}, "route": {"cluster": cluster, "timeout": "20s"}}]


def h2_upstream(config: dict, port: int) -> None:
    clusters = config["static_resources"]["clusters"]
    clusters[:] = [c for c in clusters if c["name"] != "upstream"] + [h.static_cluster("upstream", port, http2=True)]


@pytest.fixture(scope="module")
def orders():
    server = g.OrdersServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def envoys(run_dir, artifacts, orders):
    store, sport, redis = start_backend(run_dir, "redis", name="grpc")
    wasm = artifacts["wasm"]
    dead = h.free_port()

    def guard_hook(config):
        h2_upstream(config, orders.port)
        config["static_resources"]["clusters"].append(h.store_cluster(dead, name="deadstore"))
        h.add_grpc_replay(config, wasm, max_record_bytes=GUARD["max_record_bytes"])

    listeners = {
        "guard": [h.wasm_filter(GUARD, wasm)],
        "nowait": [h.wasm_filter({**GUARD, "lock_wait_ms": 0}, wasm)],
        "small": [h.wasm_filter({**GUARD, "max_record_bytes": 65536}, wasm)],
        "closed": [h.wasm_filter(plugin_config(store_cluster="deadstore", failure_mode="closed",
                                               local_fallback=False, require_key=True), wasm)],
        # The store down, failing open: the local fallback keeps one execution per key.
        "fallback": [h.wasm_filter({**GUARD, "store_cluster": "deadstore"}, wasm)],
        # Istio's WasmPlugin shape: the headers go on and wait in the buffer filter.
        "istio": istio_filters(wasm, **GUARD),
    }
    guard = h.spawn_envoy(run_dir, "grpc-guard", listeners, orders.port, sport,
                          routes=grpc_routes("upstream"), config_hook=guard_hook)
    routed = {**GUARD, "detached_execution": False}
    noroute = h.spawn_envoy(run_dir, "grpc-noroute", {"guard": [h.wasm_filter(routed, wasm)]}, orders.port, sport,
                            routes=grpc_routes("upstream"), config_hook=lambda c: h2_upstream(c, orders.port))
    h.await_envoy(guard)
    h.await_envoy(noroute)
    to_guard = [h.static_cluster("guarded", guard.port("guard"), http2=True)]
    client = h.await_envoy(h.spawn_envoy_with(run_dir, "grpc-client", {
        "retry": {"routes": grpc_routes("guarded"), "virtual_host": {"retry_policy": RETRY_POLICY}},
        "hedge": {"routes": grpc_routes("guarded"), "virtual_host": {
            "retry_policy": RETRY_POLICY, "hedge_policy": {"hedge_on_per_try_timeout": True}}},
        "mint": {"filters": [h.wasm_filter({"mode": "mint"}, wasm, vm_id="mint")],
                 "routes": grpc_routes("guarded"), "virtual_host": {"retry_policy": RETRY_POLICY}},
    }, to_guard))
    yield {"guard": guard, "noroute": noroute, "client": client}
    for e in (client, noroute, guard):
        e.stop()
    store.stop()
    if redis is not None:
        redis.stop()


def port(envoys, name: str, listener: str = "guard") -> int:
    return envoys[name].port(listener)


def assert_same_answer(first: g.GrpcResult, again: g.GrpcResult) -> None:
    assert (first.code, again.code) == (OK, OK), (first, again)
    assert again.message == first.message
    assert again.initial_value("x-idempotent-replay") == "true"
    # The same metadata as the original's, but for what every hop adds and the marker.
    added = {"date", "server", "x-envoy-upstream-service-time", "x-idempotent-replay"}
    assert {k for k, _ in again.initial} - added == {k for k, _ in first.initial} - added
    for name in ("x-order-bin", "x-order-id"):
        assert again.initial_value(name) == first.initial_value(name), name
    for name in ("x-trace-bin", "x-trace", g.STATUS_DETAILS):
        assert again.trailing_value(name) == first.trailing_value(name), name


def test_a_unary_call_runs_once_and_its_retry_gets_the_same_message_and_trailers(envoys, orders):
    key = h.new_key("grpc")
    binary = [("x-test-binary", "1")]
    first = g.create_order(port(envoys, "guard"), key, item="book", metadata=binary)
    assert first.code == OK and first.initial_value("x-idempotent-replay") is None
    assert first.trailing_value("x-trace-bin") == g.TRACE_BIN and first.initial_value("x-order-bin") == g.BIN_VALUE
    assert first.trailing_value(g.STATUS_DETAILS)
    again = g.create_order(port(envoys, "guard"), key, item="book", metadata=binary)
    assert_same_answer(first, again)
    assert again.order().execution == first.order().execution
    assert orders.executions(key=key) == 1


def test_another_message_under_the_same_key_is_failed_precondition(envoys, orders):
    key = h.new_key("grpc")
    assert g.create_order(port(envoys, "guard"), key, item="book").code == OK
    other = g.create_order(port(envoys, "guard"), key, item="pen")
    assert other.code == grpc.StatusCode.FAILED_PRECONDITION
    assert_grpc_problem(other.details, "key-reused")
    assert other.message is None
    assert orders.executions(key=key) == 1


def test_an_error_status_is_not_stored_and_its_retry_runs(envoys, orders):
    key = h.new_key("grpc")
    fail_once = [("x-test-first-status", "14")]
    assert g.create_order(port(envoys, "guard"), key, metadata=fail_once).code == grpc.StatusCode.UNAVAILABLE
    second = g.create_order(port(envoys, "guard"), key, metadata=fail_once)
    assert second.code == OK and second.initial_value("x-idempotent-replay") is None
    third = g.create_order(port(envoys, "guard"), key, metadata=fail_once)
    assert third.initial_value("x-idempotent-replay") == "true"
    assert third.message == second.message
    assert orders.executions(key=key) == 2


def test_twenty_concurrent_calls_with_one_key_run_once_with_twenty_identical_answers(envoys, orders):
    key = h.new_key("grpc")
    results: list[g.GrpcResult] = []
    lock = threading.Lock()

    def one():
        r = g.create_order(port(envoys, "guard"), key, metadata=[("x-test-delay-ms", "500")])
        with lock:
            results.append(r)

    threads = [threading.Thread(target=one) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 20
    assert {r.code for r in results} == {OK}
    assert len({r.message for r in results}) == 1
    assert sum(r.initial_value("x-idempotent-replay") == "true" for r in results) == 19
    assert orders.executions(key=key) == 1


def test_a_one_mebibyte_message_replays_exactly(envoys, orders):
    key = h.new_key("grpc")
    first = g.create_order(port(envoys, "guard"), key, reply_bytes=1024 * 1024)
    assert first.code == OK and len(first.message) > 1024 * 1024
    again = g.create_order(port(envoys, "guard"), key, reply_bytes=1024 * 1024)
    assert_same_answer(first, again)
    assert orders.executions(key=key) == 1


def test_an_answer_over_max_record_bytes_is_not_run_again_and_says_so(envoys, orders):
    key = h.new_key("grpc")
    assert g.create_order(port(envoys, "guard", "small"), key, reply_bytes=100_000).code == OK
    again = g.create_order(port(envoys, "guard", "small"), key, reply_bytes=100_000)
    assert again.code == grpc.StatusCode.ALREADY_EXISTS
    assert again.details.startswith("answer-omitted: ")
    assert again.trailing_value("x-idempotent-replay") == "true"
    assert again.trailing_value("x-idempotent-body-omitted") == "true"
    assert orders.executions(key=key) == 1


def test_a_call_in_flight_with_no_wait_is_unavailable_with_the_locks_time_left(envoys, orders):
    key = h.new_key("grpc")
    first, out = h.in_thread(lambda: g.create_order(port(envoys, "guard", "nowait"), key, metadata=SLOW))
    h.wait_for(lambda: orders.executions(key=key) == 1, "the first call running", timeout=10)
    busy = g.create_order(port(envoys, "guard", "nowait"), key, metadata=SLOW)
    assert h.joined(first, out).code == OK
    assert busy.code == grpc.StatusCode.UNAVAILABLE
    assert_grpc_problem(busy.details, "request-in-flight")
    pushback = int(busy.trailing_value("grpc-retry-pushback-ms"))
    assert 0 < pushback <= 30_000
    assert orders.executions(key=key) == 1


def test_refusals_are_grpc_statuses_with_a_message(envoys, orders):
    closed = port(envoys, "guard", "closed")
    missing = g.create_order(closed, None)
    too_long = g.create_order(port(envoys, "guard"), "k" * 300)
    down = g.create_order(closed, h.new_key("grpc"))
    forged = g.create_order(port(envoys, "guard"), h.new_key("grpc"), metadata=[("x-idempotency-grpc-replay", "1")])
    instances = []
    for result, status, code in ((missing, grpc.StatusCode.INVALID_ARGUMENT, "missing-key"),
                                 (too_long, grpc.StatusCode.INVALID_ARGUMENT, "invalid-key"),
                                 (down, grpc.StatusCode.UNAVAILABLE, "store-unavailable"),
                                 (forged, grpc.StatusCode.INVALID_ARGUMENT, "internal-header")):
        assert result.code == status, (code, result)
        instances.append(assert_grpc_problem(result.details, code))
    # Each refusal is an occurrence of its own.
    assert len(set(instances)) == 4, instances
    assert orders.executions(key="k" * 300) == 0


def test_streaming_calls_pass_through_counted_and_nothing_is_stored(envoys, orders):
    guard = envoys["guard"]
    before = guard.counter("grpc_unguarded")
    key = h.new_key("grpc")
    for _ in range(2):
        code, replies = g.list_orders(port(envoys, "guard"), 3, key)
        assert code == OK and len(replies) == 3
    assert orders.executions(method="ListOrders", key=key) == 2
    code, texts = g.chat(port(envoys, "guard"), ["a", "b"], key)
    assert (code, texts) == (OK, ["a", "b"])
    code, order = g.upload(port(envoys, "guard"), [{"item": "a"}, {"item": "b"}], key)
    assert code == OK and order.item == "a,b"
    assert orders.executions(method="Chat", key=key) == 1 and orders.executions(method="Upload", key=key) == 1
    # Two answers with three messages, the listed Chat, the Upload with two messages.
    assert guard.wait_counter("grpc_unguarded", before + 4) == before + 4


def test_without_the_replay_route_a_retry_fails_and_nothing_runs_again(envoys, orders):
    key = h.new_key("grpc")
    assert g.create_order(port(envoys, "noroute"), key).code == OK
    again = g.create_order(port(envoys, "noroute"), key)
    assert again.code == grpc.StatusCode.UNIMPLEMENTED, again
    assert orders.executions(key=key) == 1


@pytest.mark.parametrize("listener", ["retry", "hedge"])
def test_envoy_retries_and_hedges_of_a_slow_call_run_it_once(envoys, orders, listener):
    h.skip_on_native(NEEDS_DETACHED)
    key = h.new_key("grpc")
    r = g.create_order(port(envoys, "client", listener), key, metadata=SLOW)
    assert r.code == OK, r
    assert orders.executions(key=key) == 1
    retried = envoys["client"].stats(r"^cluster\.guarded\.upstream_rq_(retry|per_try_timeout)$")
    assert retried.get("cluster.guarded.upstream_rq_per_try_timeout", 0) > 0, retried


def test_envoy_retries_of_a_keyless_call_run_it_once_under_a_minted_key(envoys, orders):
    h.skip_on_native(NEEDS_DETACHED)
    item = h.new_key("minted-item")
    r = g.create_order(port(envoys, "client", "mint"), None, item=item, metadata=SLOW)
    assert r.code == OK, r
    runs = [c for c in orders.calls() if c[0] == "CreateOrder" and item.encode() in c[2]]
    assert len(runs) == 1, runs
    assert runs[0][1].startswith('"') and len(runs[0][1]) == 34


def test_the_local_fallback_replays_too(envoys, orders):
    key = h.new_key("fallback")
    first = g.create_order(port(envoys, "guard", "fallback"), key, metadata=[("x-test-binary", "1")])
    again = g.create_order(port(envoys, "guard", "fallback"), key, metadata=[("x-test-binary", "1")])
    assert_same_answer(first, again)
    assert orders.executions(key=key) == 1
    assert envoys["guard"].counter("local_replays") >= 1


def test_with_the_headers_gone_on_a_replay_fails_safe(envoys, orders):
    """Istio's shape (`pause_on_headers: false`): the request headers have gone on to the buffer
    filter, Envoy refuses to change them, and the retry cannot be re-routed. It is refused
    (`UNAVAILABLE`, a status clients retry), never run again; the first call ran routed (not
    detached: its answer could not reach the client either). The native host may still change
    them while the buffer filter holds them: there the retry is replayed."""
    key = h.new_key("istio")
    first = g.create_order(port(envoys, "guard", "istio"), key)
    assert first.code == OK and first.initial_value("x-idempotent-replay") is None
    again = g.create_order(port(envoys, "guard", "istio"), key)
    if h.native():
        assert again.code == OK and again.initial_value("x-idempotent-replay") == "true", again
        assert again.message == first.message
    else:
        assert again.code == grpc.StatusCode.UNAVAILABLE, again
        assert_grpc_problem(again.details, "replay-failed")
    assert orders.executions(key=key) == 1


def test_on_redis_cluster_and_in_inbox_mode_calls_run_once(run_dir, artifacts, orders):
    """The store on a Redis Cluster (3 masters): keys over every master run once and replay
    exactly; and inbox mode keys a call by its message id (`x-message-id` metadata)."""
    from support import redis_cluster as rc
    cluster = rc.start_cluster(run_dir / "grpc-cluster", masters=3, replicas=0)
    store = envoy = None
    try:
        store, sport = rc.spawn_idemstore(run_dir / "grpc-cluster", cluster.urls(), name="idemstore-grpc-cluster")
        h.await_idemstore(store, sport)
        wasm = artifacts["wasm"]
        inbox = plugin_config(mode="inbox", inbox={"message_id": {"header": "x-message-id"}})

        def hook(config):
            h2_upstream(config, orders.port)
            h.add_grpc_replay(config, wasm, max_record_bytes=GUARD["max_record_bytes"])

        envoy = h.await_envoy(h.spawn_envoy(
            run_dir, "grpc-cluster-envoy", {"guard": [h.wasm_filter(GUARD, wasm)], "inbox": [h.wasm_filter(inbox, wasm)]},
            orders.port, sport, routes=grpc_routes("upstream"), config_hook=hook))
        keys = [h.new_key("cluster") for _ in range(12)]
        firsts = {k: g.create_order(envoy.port("guard"), k, metadata=[("x-test-binary", "1")]) for k in keys}
        for k in keys:
            assert_same_answer(firsts[k], g.create_order(envoy.port("guard"), k, metadata=[("x-test-binary", "1")]))
            assert orders.executions(key=k) == 1
        holding = [p for p in cluster.alive_ports() if int(rc.text(p, "DBSIZE")) > 0]
        assert len(holding) > 1, "the records are spread over the masters"

        message = [("x-message-id", h.new_key("msg"))]
        first = g.create_order(envoy.port("inbox"), None, item="event", metadata=message)
        again = g.create_order(envoy.port("inbox"), None, item="event", metadata=message)
        assert first.code == OK and again.message == first.message
        assert again.initial_value("x-idempotent-replay") == "true"
        runs = [c for c in orders.calls() if c[0] == "CreateOrder" and b"event" in c[2]]
        assert len(runs) == 1, runs
    finally:
        for p in (envoy, store):
            if p is not None:
                p.stop()
        cluster.stop()


def test_a_call_whose_answer_was_lost_is_not_run_again_and_is_aborted(envoys, orders):
    """`unknown_outcome: hold` (the default): a routed call whose client gave up (its deadline)
    while the service ran it is in doubt; its retry runs nothing and gets `ABORTED` with
    `outcome-unknown:` (not `UNAVAILABLE`, which clients retry by themselves)."""
    envoy = envoys["noroute"]
    key = h.new_key("grpc-lost")
    in_doubt = envoy.counter("in_doubt")
    first = g.create_order(port(envoys, "noroute"), key, metadata=SLOW, timeout=0.3)
    assert first.code == grpc.StatusCode.DEADLINE_EXCEEDED, first
    assert envoy.wait_counter("in_doubt", in_doubt + 1) == in_doubt + 1
    h.wait_for(lambda: orders.executions(key=key) == 1, "the service ran the first call", timeout=10)
    again = g.create_order(port(envoys, "noroute"), key)
    assert again.code == grpc.StatusCode.ABORTED, again
    assert_grpc_problem(again.details, "outcome-unknown")
    assert again.message is None
    assert orders.executions(key=key) == 1
