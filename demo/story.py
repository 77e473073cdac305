#!/usr/bin/env python3
"""The story `make demo` tells against the local stack (`make run`'s ports), printing each step:

1. a client creates an order, "loses" the answer and retries: the same order, replayed;
   a phone gives up on a slow order (the app still makes it): its retry does not order twice,
   the app's answer (found by `outcome_lookup`) is replayed;
2. the same key with a changed body: 422;
3. twenty concurrent retries of one request: one order;
4. the same twenty without the filter (straight to the app): twenty orders;
5. /payments, its own policy: no key is a 400 linking to the published policy, and a declined
   payment (402) is kept: its retry gets the same decline, the card is charged once;
6. /webhooks, inbox mode: a broker delivers one CloudEvent twice, the app handles it once;
7. /search, the filter switched off for the route: the same keyed POST twice runs twice;
8. Envoy's counters for all of it.

Exits 0 only if every step behaved. Stdlib only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
import uuid

ENVOY = ("127.0.0.1", 10000)
ADMIN = ("127.0.0.1", 9901)
APP = ("127.0.0.1", 8081)
COUNTERS = ("guarded", "executed", "replayed", "mismatched", "conflicted", "rejected", "degraded", "stored",
            "in_doubt", "in_doubt_resolved.lookup")

failures: list[str] = []


def call(addr, method, path, body=None, headers=None, timeout=10.0):
    conn = http.client.HTTPConnection(*addr, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        hdrs = {"content-type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            doc = json.loads(raw) if raw else None
        except ValueError:
            doc = raw.decode(errors="replace")
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, doc
    finally:
        conn.close()


def check(ok: bool, what: str) -> None:
    print(f"   {'ok ' if ok else 'FAIL'} {what}")
    if not ok:
        failures.append(what)


def show(status, headers, doc, extra=()):
    shown = {k: headers[k] for k in ("location", "x-idempotent-replay", "retry-after", *extra) if k in headers}
    print(f"   -> {status} {json.dumps(shown)} {json.dumps(doc)[:160]}")


def wait_ready(timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            status, _, doc = call(ADMIN, "GET", "/ready", timeout=1)
            # Envoy is ready before its first health check of idemstore has passed, and until
            # then (panic threshold 0) every store call fails at once: requests would run
            # unguarded (`degraded`).
            _, _, clusters = call(ADMIN, "GET", "/clusters", timeout=1)
            store_healthy = "idemstore::127.0.0.1:8380::health_flags::healthy" in str(clusters)
            if status == 200 and store_healthy and call(APP, "GET", "/healthz", timeout=1)[0] == 200:
                return
        except OSError as e:
            last = e
        time.sleep(0.1)
    sys.exit(f"demo: the stack did not become ready in {timeout:.0f}s ({last})")


def counters() -> dict[str, int]:
    _, _, doc = call(ADMIN, "GET", "/stats?filter=^wasmcustom\\.idempotency\\.&format=json")
    out = {}
    for s in doc["stats"]:
        if "value" in s:  # counters; the store latency histograms come as another entry
            out[s["name"].removeprefix("wasmcustom.idempotency.")] = s["value"]
    return out


def burst(addr, n, body, headers) -> list[tuple[int, dict, object]]:
    results: list = [None] * n
    go = threading.Event()

    def one(i):
        go.wait()
        results[i] = call(addr, "POST", "/orders", body, headers)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(30)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wait", type=float, default=30.0, help="seconds to wait for the stack")
    args = ap.parse_args()
    wait_ready(args.wait)
    run = uuid.uuid4().hex[:8]
    before = counters()

    print(f"1. Alice creates an order (Idempotency-Key: order-{run}-1)")
    key = f"order-{run}-1"
    order = {"item": "book", "qty": 1, "customer": "alice"}
    status, headers, first = call(ENVOY, "POST", "/orders", order, {"Idempotency-Key": key})
    show(status, headers, first)
    check(status == 201 and "x-idempotent-replay" not in headers, "201, executed by the app")
    print("   ... the answer is lost on the way back; her client retries the same request")
    status, headers, again = call(ENVOY, "POST", "/orders", order, {"Idempotency-Key": key})
    show(status, headers, again)
    check(status == 201 and again == first, f"the same order {first.get('id') if isinstance(first, dict) else '?'}")
    check(headers.get("x-idempotent-replay") == "true", "x-idempotent-replay: true")

    bob = f"order-{run}-2"
    lamp = {"item": "lamp", "qty": 1, "customer": "bob"}
    print(f"   Bob orders a lamp (Idempotency-Key: {bob}); the app takes 2 s, his phone gives up after 1 s")
    try:
        call(ENVOY, "POST", "/orders", lamp, {"Idempotency-Key": bob, "x-demo-delay-ms": "2000"}, timeout=1)
        check(False, "the phone gave up")
    except TimeoutError:
        print("   -> no answer")

    def bobs_orders():
        return [o for o in call(APP, "GET", "/orders")[2]["orders"] if o.get("customer") == "bob"]

    deadline = time.monotonic() + 10
    while not bobs_orders() and time.monotonic() < deadline:
        time.sleep(0.1)
    print("   ... the app made the order all the same; the phone retries the same request")
    status, headers, again = call(ENVOY, "POST", "/orders", lamp, {"Idempotency-Key": bob})
    show(status, headers, again)
    check(status == 201 and headers.get("x-idempotent-replay") == "true",
          "201, the app's order replayed (the filter asked it: outcome_lookup)")
    check(len(bobs_orders()) == 1, "one lamp ordered")

    print("2. A buggy client reuses the key with a different body")
    status, headers, doc = call(ENVOY, "POST", "/orders", {**order, "qty": 2}, {"Idempotency-Key": key})
    show(status, headers, doc)
    check(status == 422 and headers.get("content-type", "").startswith("application/problem+json"),
          "422 problem+json, nothing created")

    tag = f"burst-{run}"
    print(f"3. Twenty concurrent retries of one request (Idempotency-Key: {tag})")
    results = burst(ENVOY, 20, {"item": tag}, {"Idempotency-Key": tag})
    ids = {doc.get("id") for s, _, doc in results if s == 201 and isinstance(doc, dict)}
    statuses = sorted({s for s, _, _ in results})
    replays = sum(1 for _, h, _ in results if h.get("x-idempotent-replay") == "true")
    print(f"   -> statuses {statuses}, {replays} replays, order ids {sorted(ids)}")
    _, _, listing = call(APP, "GET", "/orders")
    made = [o for o in listing["orders"] if o.get("item") == tag]
    print(f"   -> the app holds {len(made)} order(s) for {tag}")
    check(statuses == [201] and len(ids) == 1 and len(made) == 1, "one order created, twenty identical answers")

    plain = f"plain-{run}"
    print("4. The same twenty without the filter (straight to the app on :8081)")
    results = burst(APP, 20, {"item": plain}, {"Idempotency-Key": plain})
    ids = {doc.get("id") for s, _, doc in results if s == 201 and isinstance(doc, dict)}
    _, _, listing = call(APP, "GET", "/orders")
    made = [o for o in listing["orders"] if o.get("item") == plain]
    print(f"   -> {len(ids)} different order ids; the app holds {len(made)} order(s) for {plain}")
    check(len(ids) == 20 and len(made) == 20, "twenty orders: the duplicates the filter prevents")

    print("5. /payments has its own policy: a key required, 4xx answers kept, records kept 7 days")
    _, _, app_before = call(APP, "GET", "/payments")
    status, headers, doc = call(ENVOY, "POST", "/payments", {"amount": 10, "card": "visa"})
    show(status, headers, doc, extra=("link",))
    check(status == 400 and isinstance(doc, dict) and doc.get("code") == "missing-key",
          "no Idempotency-Key: 400 missing-key, nothing charged")
    check('rel="describedby"' in headers.get("link", ""), "the problem links to the published policy (link: ...)")
    pay_key = f"pay-{run}"
    declined = {"amount": 10, "card": "declined"}
    status, headers, first = call(ENVOY, "POST", "/payments", declined, {"Idempotency-Key": pay_key})
    show(status, headers, first)
    check(status == 402 and "x-idempotent-replay" not in headers, "a declined payment: 402 from the app")
    time.sleep(0.2)  # the answer is stored just after it is sent
    status, headers, again = call(ENVOY, "POST", "/payments", declined, {"Idempotency-Key": pay_key})
    show(status, headers, again)
    check(status == 402 and again == first and headers.get("x-idempotent-replay") == "true",
          "its retry: the same 402, replayed (on /orders a 4xx is not kept and would run again)")
    _, _, app_after = call(APP, "GET", "/payments")
    check(app_after["attempts"] - app_before["attempts"] == 1, "the card was charged once")

    print("6. /webhooks is in inbox mode: the broker delivers one CloudEvent twice")
    event = f"evt-{run}"
    ce = {"ce-specversion": "1.0", "ce-id": event, "ce-source": "/demo/broker", "ce-type": "com.example.paid"}
    for attempt in (1, 2):
        status, headers, doc = call(ENVOY, "POST", "/webhooks", {"order": "ord_000001"}, ce)
        show(status, headers, doc)
        replayed = headers.get("x-idempotent-replay") == "true"
        check(status == 200 and replayed == (attempt == 2),
              "delivery 1: handled" if attempt == 1 else "delivery 2: acknowledged, a replay")
    _, _, events = call(APP, "GET", "/webhooks")
    check(events["events"].get(event) == 1, f"the app handled {event} once")

    print("7. /search needs no guard: the route switches the filter off (typed_per_filter_config)")
    _, _, searches = call(APP, "GET", "/search")
    for _ in range(2):
        status, headers, doc = call(ENVOY, "POST", "/search", {"q": "book"}, {"Idempotency-Key": f"search-{run}"})
        show(status, headers, doc)
        check(status == 200 and "x-idempotent-replay" not in headers, "ran, not replayed")
    _, _, searches_after = call(APP, "GET", "/search")
    check(searches_after["searches"] - searches["searches"] == 2, "both searches ran")

    print("8. Envoy's counters for this run (/stats?filter=wasmcustom)")
    time.sleep(0.2)
    after = counters()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
    print("   " + "  ".join(f"{k}={v}" for k, v in delta.items()))
    check(delta["guarded"] == 29 and delta["executed"] == 5 and delta["replayed"] == 22
          and delta["mismatched"] == 1 and delta["in_doubt_resolved.lookup"] == 1 and delta["degraded"] == 0,
          "guarded 29 = executed 5 + replayed 22 + mismatched 1 + resolved by lookup 1 (the searches "
          "not guarded); degraded 0")
    check(delta["in_doubt"] == 1, "in doubt 1: Bob's lamp, until the lookup")
    check(delta["rejected"] == 1, "rejected 1: the payment without a key")

    print()
    if failures:
        print(f"demo: {len(failures)} step(s) misbehaved: {failures}")
        return 1
    print("demo: every step behaved")
    return 0


if __name__ == "__main__":
    sys.exit(main())
