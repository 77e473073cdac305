#!/usr/bin/env python3
"""A tiny API to put behind Envoy and the idempotency filter (stdlib only). envoy/envoy.yaml
gives each of its paths its own route and policy.

    POST /orders          create an order from a JSON body -> 201 {"id": "ord_000001", ...}
                          with `location: /orders/<id>`; kept with the filter's store key
                          (`x-idempotency-store-key`); `x-demo-delay-ms: N` makes it a slow
                          handler: the order is created after N ms, whoever is still waiting
    GET  /orders          list orders
    GET  /orders/<id>     one order, or 404
    GET  /orders/by-key/<store key>
                          the order created under that store key, answered as its POST was
                          (201 and `location`), or 404: the filter's `outcome_lookup`
    POST /payments        charge: 201 {"id": "pay_000001", ...}, or 402 when the body's "card"
                          is "declined"; every charge attempt is counted
    GET  /payments        payments made and charge attempts
    POST /webhooks        a CloudEvent (binary mode: its id in `ce-id`) handled: 200
                          {"handled": id, "times": n}, n the times this id was handled
    GET  /webhooks        times each event id was handled
    POST /search          a search: 200 {"query": ..., "results": [...]}, counted
    GET  /search          how many searches ran
    GET  /healthz         200

It is deliberately *not* idempotent: every POST creates a new order, charges again or handles
the event again, which is what the filter in front of it fixes. Each request is logged to
stdout.

    python3 demo/orders_app.py --port 8081
    curl -si -X POST localhost:10000/orders -H 'Idempotency-Key: k1' -d '{"item":"book"}'
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

MAX_BODY = 8 * 1024 * 1024


class Server(ThreadingHTTPServer):
    # socketserver's default backlog is 5: a burst of clients straight to the app (make demo's
    # comparison without the filter) would see connections reset.
    request_queue_size = 128
    daemon_threads = True


class Orders:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = 0
        self._orders: dict[str, dict] = {}
        # The filter's store key -> order id: written with the order, as a unique column would be.
        self._by_key: dict[str, str] = {}

    def create(self, payload, store_key: str | None = None) -> dict:
        with self._lock:
            if store_key and store_key in self._by_key:
                # One order per store key, whatever reaches the app twice.
                return dict(self._orders[self._by_key[store_key]])
            self._seq += 1
            oid = f"ord_{self._seq:06d}"
            order = {
                "id": oid,
                "status": "created",
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            if isinstance(payload, dict):
                for k, v in payload.items():
                    order.setdefault(k, v)
            else:
                order["item"] = payload
            self._orders[oid] = order
            if store_key:
                self._by_key[store_key] = oid
            return dict(order)

    def by_key(self, store_key: str) -> dict | None:
        with self._lock:
            oid = self._by_key.get(store_key)
            return dict(self._orders[oid]) if oid else None

    def get(self, oid: str) -> dict | None:
        with self._lock:
            o = self._orders.get(oid)
            return dict(o) if o else None

    def list(self) -> list[dict]:
        with self._lock:
            return [dict(o) for o in self._orders.values()]


ORDERS = Orders()


class Counts:
    """What the other paths did: payments made, charge attempts, events handled, searches."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.payments: list[dict] = []
        self.attempts = 0
        self.events: dict[str, int] = {}
        self.searches = 0

    def charge(self, payload) -> tuple[int, dict]:
        with self._lock:
            self.attempts += 1
            doc = payload if isinstance(payload, dict) else {}
            if doc.get("card") == "declined":
                return 402, {"error": "card declined", "attempt": self.attempts}
            pay = {"id": f"pay_{len(self.payments) + 1:06d}", "status": "captured",
                   "amount": doc.get("amount"), "attempt": self.attempts}
            self.payments.append(pay)
            return 201, dict(pay)

    def handle(self, event_id: str) -> int:
        with self._lock:
            self.events[event_id] = self.events.get(event_id, 0) + 1
            return self.events[event_id]

    def search(self) -> int:
        with self._lock:
            self.searches += 1
            return self.searches

    def snapshot(self) -> dict:
        with self._lock:
            return {"payments": [dict(p) for p in self.payments], "attempts": self.attempts,
                    "events": dict(self.events), "searches": self.searches}


COUNTS = Counts()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "orders-demo/1"

    def setup(self):
        super().setup()
        # Headers and body leave in separate writes: without TCP_NODELAY, Nagle's algorithm
        # holds the body until the peer's delayed ACK (about 40 ms) on every response.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, fmt: str, *args) -> None:
        key = self.headers.get("idempotency-key") if hasattr(self, "headers") and self.headers else None
        suffix = f" idempotency-key={key!r}" if key else ""
        sys.stdout.write(f"{self.log_date_time_string()} {self.client_address[0]} {fmt % args}{suffix}\n")
        sys.stdout.flush()

    def send_json(self, status: int, doc, extra: list[tuple[str, str]] | None = None) -> None:
        body = json.dumps(doc).encode() + b"\n"
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        for k, v in extra or []:
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def problem(self, status: int, title: str, detail: str) -> None:
        self.send_json(status, {"error": title, "detail": detail})

    def read_body(self) -> bytes | None:
        length = self.headers.get("content-length")
        if length is None:
            if "chunked" in (self.headers.get("transfer-encoding") or "").lower():
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
            return b""
        n = int(length)
        if n > MAX_BODY:
            return None
        return self.rfile.read(n)

    def do_GET(self) -> None:
        path = urlsplit(self.path).path.rstrip("/") or "/"
        if path == "/healthz":
            self.send_json(200, {"ok": True})
        elif path == "/orders":
            self.send_json(200, {"orders": ORDERS.list()})
        elif path in ("/payments", "/webhooks", "/search"):
            snap = COUNTS.snapshot()
            self.send_json(200, {"/payments": {"payments": snap["payments"], "attempts": snap["attempts"]},
                                 "/webhooks": {"events": snap["events"]},
                                 "/search": {"searches": snap["searches"]}}[path])
        elif path.startswith("/orders/by-key/"):
            order = ORDERS.by_key(path[len("/orders/by-key/"):])
            if order is None:
                self.problem(404, "not found", "no order was created under this key")
            else:
                self.send_json(201, order, [("location", f"/orders/{order['id']}")])
        elif path.startswith("/orders/"):
            order = ORDERS.get(path[len("/orders/"):])
            if order is None:
                self.problem(404, "not found", f"no order {path[len('/orders/'):]}")
            else:
                self.send_json(200, order)
        else:
            self.problem(404, "not found", f"no route for GET {path}")

    def do_POST(self) -> None:
        path = urlsplit(self.path).path.rstrip("/")
        body = self.read_body()
        if body is None:
            self.close_connection = True
            self.problem(413, "too large", "request body too large")
            return
        if path not in ("/orders", "/payments", "/webhooks", "/search"):
            self.problem(404, "not found", f"no route for POST {path}")
            return
        try:
            payload = json.loads(body) if body.strip() else {}
        except ValueError:
            self.problem(400, "bad request", "the body is not JSON")
            return
        if path == "/payments":
            status, doc = COUNTS.charge(payload)
            extra = [("location", f"/payments/{doc['id']}")] if status == 201 else []
            self.send_json(status, doc, extra)
            return
        if path == "/webhooks":
            event_id = self.headers.get("ce-id") or (payload.get("id") if isinstance(payload, dict) else None)
            if not event_id:
                self.problem(400, "bad request", "no event id (ce-id)")
                return
            self.send_json(200, {"handled": event_id, "times": COUNTS.handle(str(event_id))})
            return
        if path == "/search":
            query = payload.get("q") if isinstance(payload, dict) else None
            self.send_json(200, {"query": query, "results": [], "search": COUNTS.search()})
            return
        delay_ms = int(self.headers.get("x-demo-delay-ms") or 0)
        if delay_ms > 0:
            time.sleep(min(delay_ms, 60_000) / 1000)
        order = ORDERS.create(payload, self.headers.get("x-idempotency-store-key"))
        try:
            self.send_json(201, order, [("location", f"/orders/{order['id']}")])
        except OSError:
            # The client (or Envoy's timeout) left: the order stands; its answer is lost.
            self.close_connection = True

    do_HEAD = do_GET


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="demo orders API")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8081)
    args = ap.parse_args(argv)
    srv = Server((args.host, args.port), Handler)
    srv.daemon_threads = True
    print(f"orders app listening on http://{args.host}:{args.port}", flush=True)
    try:
        srv.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
