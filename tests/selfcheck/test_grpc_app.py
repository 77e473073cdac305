"""Self-checks of the gRPC upstream and clients (support/grpc_app.py), with no Envoy: what the
gRPC end-to-end tests rely on must hold when the server is called directly."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from support import grpc_app as g
from support import harness as h


@pytest.fixture(scope="module")
def server():
    s = g.OrdersServer().start()
    yield s
    s.stop()


def test_create_order_counts_per_key_and_echoes(server):
    key = h.new_key("grpc")
    first = g.create_order(server.port, key, item="pen", quantity=3)
    again = g.create_order(server.port, key, item="pen", quantity=3)
    assert first.code == grpc.StatusCode.OK and again.code == grpc.StatusCode.OK, (first, again)
    a, b = first.order(), again.order()
    assert (a.item, a.quantity, a.blob) == ("pen", 3, b"")
    assert a.id != b.id and b.execution > a.execution  # two executions, told apart
    assert server.executions("CreateOrder", key) == 2
    assert server.executions("ListOrders", key) == 0
    pb2, _ = g.protos()
    request = pb2.CreateOrderRequest(item="pen", quantity=3).SerializeToString()
    assert [c for c in server.calls() if c[1] == key] == [("CreateOrder", key, request)] * 2
    g.create_order(server.port, item="nokey")
    assert any(c[0] == "CreateOrder" and c[1] == "" for c in server.calls())


def test_bin_metadata_trailers_and_status_details_arrive_exactly(server):
    key = h.new_key("grpc-bin")
    r = g.create_order(server.port, key, metadata=[("x-test-binary", "1")])
    assert r.code == grpc.StatusCode.OK, r
    assert r.initial_value("x-order-bin") == g.BIN_VALUE
    assert r.initial_value("x-order-id") == f"order-{r.order().execution}"
    assert r.trailing_value("x-trace-bin") == g.TRACE_BIN
    assert r.trailing_value("x-trace") == f"trace-{r.order().execution}"
    pb2, _ = g.protos()
    details = pb2.RpcStatus.FromString(r.trailing_value(g.STATUS_DETAILS))
    assert (details.code, details.message) == (0, "ok")
    chat = pb2.ChatMessage()
    assert details.details[0].Unpack(chat) and chat.text == "detail \x00 \u00e9"

    err = g.create_order(server.port, key, metadata=[("x-test-binary", "1"), ("x-test-grpc-status", "9"),
                                                    ("x-test-grpc-message", "no stock")])
    assert (err.code, err.details, err.message) == (grpc.StatusCode.FAILED_PRECONDITION, "no stock", None)
    assert err.initial_value("x-order-bin") == g.BIN_VALUE
    assert err.trailing_value("x-trace-bin") == g.TRACE_BIN
    details = pb2.RpcStatus.FromString(err.trailing_value(g.STATUS_DETAILS))
    assert (details.code, details.message) == (9, "no stock")
    assert server.executions("CreateOrder", key) == 2


def test_grpc_status_and_first_status(server):
    key = h.new_key("grpc-status")
    meta = [("x-test-grpc-status", "5"), ("x-test-grpc-message", "gone")]
    r = g.create_order(server.port, key, metadata=meta)
    assert (r.code, r.details, r.message, r.initial) == (grpc.StatusCode.NOT_FOUND, "gone", None, [])
    assert server.executions("CreateOrder", key) == 1  # an error is still an execution

    key = h.new_key("grpc-first")
    meta = [("x-test-first-status", "14"), ("x-test-delay-ms", "300")]
    started = time.monotonic()
    first = g.create_order(server.port, key, metadata=meta)
    assert first.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 0.25
    again = g.create_order(server.port, key, metadata=meta)
    assert again.code == grpc.StatusCode.OK and time.monotonic() - started >= 0.3
    assert g.create_order(server.port, key + "-b", metadata=meta).code == grpc.StatusCode.UNAVAILABLE
    assert server.executions("CreateOrder", key) == 2


def test_large_reply_arrives_exactly(server):
    size = 1024 * 1024
    r = g.create_order(server.port, h.new_key("grpc-big"), reply_bytes=size)
    assert r.code == grpc.StatusCode.OK
    assert r.order().blob == g.blob(size) and len(g.blob(size)) == size
    assert g.decode_order(r.message).SerializeToString() == r.message


def test_concurrent_calls_run_at_once(server):
    key = h.new_key("grpc-burst")
    results = []

    def call():
        results.append(g.create_order(server.port, key, metadata=[("x-test-delay-ms", "500")]))
    threads = [threading.Thread(target=call) for _ in range(24)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - started < 2.0  # not 24 x 0.5 s
    assert [r.code for r in results] == [grpc.StatusCode.OK] * 24
    assert server.executions("CreateOrder", key) == 24


def test_streaming_methods_work_and_count_once_per_call(server):
    key = h.new_key("grpc-stream")
    code, orders = g.list_orders(server.port, 5, key)
    assert code == grpc.StatusCode.OK and [o.quantity for o in orders] == [0, 1, 2, 3, 4]
    code, replies = g.chat(server.port, ["a", "b", "c"], key)
    assert code == grpc.StatusCode.OK and replies == ["a", "b", "c"]
    code, order = g.upload(server.port, [{"item": "x", "quantity": 2}, {"item": "y", "quantity": 5}], key)
    assert code == grpc.StatusCode.OK and (order.item, order.quantity) == ("x,y", 7)
    for method in ("ListOrders", "Chat", "Upload"):
        assert server.executions(method, key) == 1, method
    assert server.executions(key=key) == 3
    code, orders = g.list_orders(server.port, 2, key, metadata=[("x-test-grpc-status", "7")])
    assert (code, orders) == (grpc.StatusCode.PERMISSION_DENIED, [])


def test_reset_and_stop_do_not_wait_for_sleepers():
    s = g.OrdersServer().start()
    try:
        g.create_order(s.port)
        assert s.executions() == 1
        s.reset()
        assert s.executions() == 0 and s.calls() == []
        done = []
        t = threading.Thread(target=lambda: done.append(
            g.create_order(s.port, metadata=[("x-test-delay-ms", "30000")], timeout=30)))
        t.start()
        deadline = time.monotonic() + 5
        while s.executions() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        started = time.monotonic()
        s.stop()
    t.join(10)
    assert time.monotonic() - started < 3 and done and done[0].code is not None
