"""The inbox: exactly-once handling of messages a broker pushes over HTTP.

A real Envoy (filter in `"mode": "inbox"`) in front of `inbox_app.py`, which counts side effects
per event id. Binary-mode CloudEvents, structured-mode CloudEvents and Google Pub/Sub push bodies
(id at `/message/messageId`, `deliveryAttempt` changing between deliveries) are each covered:
first delivery runs, a duplicate replays and never reaches the app, a failed first delivery is
released and its redelivery runs, a missing id is rejected or passed, `duplicate_status`, a
text/plain handler, a duplicate while the first delivery is still running.

The acceptance test pushes 10,000 events (30 % duplicates, half of them concurrent with their
original, 5 % failed first deliveries) with `pusher.py` over two Envoy replicas sharing one
idemstore on Redis, and checks every id had its side effect exactly once.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from support import harness as h
from support.checks import PANIC, REPLAY, assert_problem
from support.inbox_app import fails_first
from support.pusher import Event, PushSpec, push, request_for
from support.replicas import ReplicaSets
from support.stack import istio_filters

INBOX = {"mode": "inbox"}
PUBSUB = {"mode": "inbox", "inbox": {"message_id": {"json_pointer": "/message/messageId"}}}

# Listener name -> plugin configuration (store_cluster added).
LISTENERS = {
    "ce": INBOX,
    "ce_pass": {"mode": "inbox", "inbox": {"missing_id": "pass"}},
    "ce_dup": {"mode": "inbox", "inbox": {"duplicate_status": 200}},
    "ce_short_wait": {"mode": "inbox", "lock_wait_ms": 200},
    # The store key header is set from the body callback (the id is in the body).
    "pubsub": {**PUBSUB, "store_key_header": "x-inbox-store-key"},
    "pubsub_pass": {"mode": "inbox", "inbox": {"message_id": {"json_pointer": "/message/messageId"},
                                               "missing_id": "pass"}},
    "pubsub_dup": {"mode": "inbox", "inbox": {"message_id": {"json_pointer": "/message/messageId"},
                                              "duplicate_status": 204}},
    "header": {"mode": "inbox", "inbox": {"message_id": {"header": "x-message-id"}}},
}

# Format -> (listener, listener with missing_id pass, listener with duplicate_status).
FORMATS = {
    "binary": ("ce", "ce_pass", "ce_dup"),
    "structured": ("ce", "ce_pass", "ce_dup"),
    "pubsub": ("pubsub", "pubsub_pass", "pubsub_dup"),
}

PATH = "/events"


# --------------------------------------------------------------------------------------------
# processes
# --------------------------------------------------------------------------------------------


@dataclass
class App:
    proc: h.Proc
    port: int

    def _get(self, path: str) -> dict:
        status, body = h.http_get_status(self.port, path, timeout=10)
        assert status == 200, (status, body)
        return json.loads(body)

    def count(self, eid: str) -> tuple[int, int]:
        """(side effects, deliveries) of one id."""
        doc = self._get(f"/__count?id={eid}")
        return doc["effects"], doc["deliveries"]

    def counts(self) -> dict:
        return self._get("/__counts")


def start_app(run_dir: Path, fail_rate: float = 0.0) -> App:
    port = h.free_port()
    argv = [sys.executable, str(h.SUPPORT / "inbox_app.py"), "--port", str(port), "--quiet",
            "--fail-first-rate", str(fail_rate)]
    proc = h.start("inbox-app", argv, run_dir)
    h.await_ready(proc, lambda: h.http_get_status(port, "/__health")[0] == 200, "inbox app /__health")
    return App(proc, port)


@dataclass
class InboxStack:
    envoy: h.Envoy
    app: App
    store: h.Proc

    def port(self, listener: str) -> int:
        return self.envoy.port(listener)

    def counter(self, name: str) -> int:
        return self.envoy.counter(name)


@pytest.fixture(scope="module")
def inbox(run_dir, artifacts) -> InboxStack:
    sub = run_dir / "inbox"
    app = start_app(sub)
    started: list[h.Proc] = [app.proc]
    try:
        store, sport = h.start_idemstore(sub)
        started.append(store)
        filters = {ln: [h.wasm_filter({"store_cluster": "idemstore", **cfg}, artifacts["wasm"])]
                   for ln, cfg in LISTENERS.items()}
        # Istio's mode: headers go on to a buffer filter, the filter holds the body.
        filters["istio"] = istio_filters(artifacts["wasm"], mode="inbox", inbox={"missing_id": "pass"})
        envoy = h.start_envoy(sub, "envoy-inbox", filters, app.port, sport)
    except h.HarnessError as e:
        for p in reversed(started):
            p.stop()
        pytest.fail(str(e), pytrace=False)
    yield InboxStack(envoy, app, store)
    envoy.stop()
    store.stop()
    app.proc.stop()
    panics = [ln for ln in envoy.log_text().splitlines() if PANIC.search(ln)]
    assert not panics, "wasm panic or trap in the inbox Envoy's log:\n" + "\n".join(panics[:20])


def new_id(prefix: str = "ev") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def deliver(port: int, fmt: str, ev: Event, attempt: int = 1, source: str | None = None,
            extra: list | None = None) -> h.Response:
    headers, body = request_for(ev, fmt, attempt)
    return h.request(port, "POST", PATH, body, headers + list(extra or []), source=source)


def wait_stored(stack: InboxStack, at_least: int) -> None:
    # The commit lands after the response: a duplicate sent before it would wait on the lock.
    assert stack.envoy.wait_counter("stored", at_least) >= at_least


# --------------------------------------------------------------------------------------------
# per format
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_first_delivery_runs_and_duplicates_replay(inbox, fmt):
    listener = FORMATS[fmt][0]
    ev = Event(new_id(), source="/orders-service", data={"order": 7})
    stored = inbox.counter("stored")
    first = deliver(inbox.port(listener), fmt, ev)
    assert first.status == 200, first
    assert first.header(REPLAY) is None, first
    assert first.json()["handled"] == ev.id
    wait_stored(inbox, stored + 1)
    replayed = inbox.counter("replayed")
    # The broker redelivers: from another address (another broker replica), and for Pub/Sub
    # with a higher deliveryAttempt (a different body: the id is the identity, no 422).
    for attempt, source in [(2, "127.0.0.2"), (3, None)]:
        dup = deliver(inbox.port(listener), fmt, ev, attempt=attempt, source=source)
        assert dup.status == 200, dup
        assert dup.header(REPLAY) == "true", dup
        assert dup.body == first.body
        assert dup.header("content-type") == "application/json"
    assert inbox.app.count(ev.id) == (1, 1), "a duplicate reached the app"
    assert inbox.counter("replayed") == replayed + 2


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_failed_first_delivery_is_released_and_the_redelivery_runs(inbox, fmt):
    listener = FORMATS[fmt][0]
    ev = Event(new_id("fail"))
    released = inbox.counter("released")
    first = deliver(inbox.port(listener), fmt, ev)
    assert first.status == 500, first
    assert inbox.app.count(ev.id) == (0, 1)
    assert inbox.envoy.wait_counter("released", released + 1) == released + 1
    stored = inbox.counter("stored")
    second = deliver(inbox.port(listener), fmt, ev, attempt=2)
    assert second.status == 200 and second.header(REPLAY) is None, second
    assert inbox.app.count(ev.id) == (1, 2)
    wait_stored(inbox, stored + 1)
    third = deliver(inbox.port(listener), fmt, ev, attempt=3)
    assert third.status == 200 and third.header(REPLAY) == "true", third
    assert inbox.app.count(ev.id) == (1, 2)


def missing_id_request(fmt: str) -> tuple[list, bytes]:
    """A delivery in `fmt` without its id: binary without ce-id, structured without `id`,
    Pub/Sub without `messageId`."""
    headers, body = request_for(Event("placeholder"), fmt, 1)
    if fmt == "binary":
        headers = [(n, v) for n, v in headers if n != "ce-id"]
    elif fmt == "structured":
        doc = json.loads(body)
        del doc["id"]
        body = json.dumps(doc).encode()
    else:
        doc = json.loads(body)
        del doc["message"]["messageId"]
        body = json.dumps(doc).encode()
    return headers, body


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_missing_id_is_rejected_or_passed(inbox, fmt):
    reject, passing, _ = FORMATS[fmt]
    headers, body = missing_id_request(fmt)
    before = inbox.app.count("")[1]
    rejected = inbox.counter("rejected")
    resp = h.request(inbox.port(reject), "POST", PATH, body, headers)
    doc = assert_problem(resp, 400, code="missing-message-id")
    assert doc["type"].endswith("/missing-message-id"), doc
    assert inbox.counter("rejected") == rejected + 1
    assert inbox.app.count("")[1] == before, "a rejected delivery reached the app"
    # `missing_id: pass` runs it unguarded, counted; twice is twice.
    passthrough = inbox.counter("passthrough")
    for _ in range(2):
        resp = h.request(inbox.port(passing), "POST", PATH, body, headers)
        assert resp.status == 200 and resp.header(REPLAY) is None, resp
    assert inbox.app.count("")[1] == before + 2
    assert inbox.counter("passthrough") == passthrough + 2


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_malformed_ids_are_rejected_even_with_pass(inbox, fmt):
    _, passing, _ = FORMATS[fmt]
    long_id = "L" * 256
    for bad in ["", long_id]:
        resp = deliver(inbox.port(passing), fmt, Event(bad))
        doc = assert_problem(resp, 400, raw_key=bad or None, code="invalid-message-id")
        assert doc["type"].endswith("/invalid-message-id"), doc
    assert inbox.app.count(long_id) == (0, 0)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_duplicate_status_answers_duplicates_bare(inbox, fmt):
    _, _, listener = FORMATS[fmt]
    want = LISTENERS[listener]["inbox"]["duplicate_status"]
    ev = Event(new_id())
    stored = inbox.counter("stored")
    first = deliver(inbox.port(listener), fmt, ev)
    assert first.status == 200 and first.json()["handled"] == ev.id, first
    wait_stored(inbox, stored + 1)
    dup = deliver(inbox.port(listener), fmt, ev, attempt=2)
    assert dup.status == want, dup
    assert dup.body == b"" and dup.header(REPLAY) == "true", dup
    assert inbox.app.count(ev.id) == (1, 1)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_text_plain_handler_is_deduplicated(inbox, fmt):
    """A text/plain 2xx marks the message handled and is kept like any answer: the duplicate
    gets it replayed."""
    listener = FORMATS[fmt][0]
    ev = Event(new_id("text"))
    stored = inbox.counter("stored")
    first = deliver(inbox.port(listener), fmt, ev)
    assert first.status == 200 and first.body == b"ok", first
    assert first.header("content-type") == "text/plain"
    wait_stored(inbox, stored + 1)
    dup = deliver(inbox.port(listener), fmt, ev, attempt=2)
    assert dup.status == 200 and dup.header(REPLAY) == "true", dup
    assert dup.body == b"ok" and dup.header("content-type") == "text/plain", dup
    assert inbox.app.count(ev.id) == (1, 1)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_duplicate_while_the_first_runs_waits_and_replays(inbox, fmt):
    listener = FORMATS[fmt][0]
    ev = Event(new_id("slow"))
    port = inbox.port(listener)
    t, out = h.in_thread(lambda: deliver(port, fmt, ev))
    h.wait_for(lambda: inbox.app.count(ev.id)[1] == 1, "the first delivery reaches the app", timeout=5)
    t0 = time.monotonic()
    dup = deliver(port, fmt, ev, attempt=2, source="127.0.0.3")
    waited = time.monotonic() - t0
    first = h.joined(t, out)
    assert first.status == 200 and first.header(REPLAY) is None, first
    assert dup.status == 200 and dup.header(REPLAY) == "true", dup
    assert dup.body == first.body
    assert waited > 0.3, f"the duplicate did not wait for the first delivery ({waited:.3f}s)"
    assert inbox.app.count(ev.id) == (1, 1)


def test_duplicate_past_the_lock_wait_gets_409_then_replays(inbox):
    """lock_wait_ms 200 against an 800 ms handler: the in-flight duplicate gets 409 (the broker
    retries it), never a second execution; its retry after the first finished replays."""
    port = inbox.port("ce_short_wait")
    ev = Event(new_id("slow"))
    stored = inbox.counter("stored")
    t, out = h.in_thread(lambda: deliver(port, "binary", ev))
    h.wait_for(lambda: inbox.app.count(ev.id)[1] == 1, "the first delivery reaches the app", timeout=5)
    dup = deliver(port, "binary", ev, attempt=2)
    doc = assert_problem(dup, 409, code="message-in-flight")
    assert doc["type"].endswith("/message-in-flight"), doc
    # The holder's lock (TTL 30 s, taken under a second ago) in whole seconds, from idemstore.
    assert dup.header("retry-after") in ("29", "30"), dup
    assert h.joined(t, out).status == 200
    wait_stored(inbox, stored + 1)
    again = deliver(port, "binary", ev, attempt=3)
    assert again.status == 200 and again.header(REPLAY) == "true", again
    assert inbox.app.count(ev.id) == (1, 1)


def test_header_source_and_idempotency_key_ignored(inbox):
    """`message_id: {"header": ...}`; the Idempotency-Key header plays no part in inbox mode."""
    port = inbox.port("header")
    eid = new_id()
    stored = inbox.counter("stored")
    first = h.request(port, "POST", PATH, b"{}", [("x-message-id", eid), ("idempotency-key", "a"),
                                                 ("content-type", "application/json")])
    assert first.status == 200 and first.header(REPLAY) is None, first
    wait_stored(inbox, stored + 1)
    dup = h.request(port, "POST", PATH, b"{}", [("x-message-id", eid), ("idempotency-key", "b"),
                                               ("content-type", "application/json")])
    assert dup.status == 200 and dup.header(REPLAY) == "true", dup
    assert inbox.app.count(eid) == (1, 1)
    # An Idempotency-Key alone is no message id.
    resp = h.request(port, "POST", PATH, b"{}", [("idempotency-key", eid)])
    assert_problem(resp, 400)


def test_cloudevents_batch_is_a_missing_id(inbox):
    batch = json.dumps([{"specversion": "1.0", "id": "b1", "source": "/s", "type": "t"}]).encode()
    resp = h.request(inbox.port("ce"), "POST", PATH, batch,
                     [("content-type", "application/cloudevents-batch+json")])
    assert_problem(resp, 400)
    resp = h.request(inbox.port("ce_pass"), "POST", PATH, batch,
                     [("content-type", "application/cloudevents-batch+json")])
    assert resp.status == 200, resp


@pytest.mark.parametrize("fmt", ["binary", "structured"])
def test_istio_mode(inbox, fmt):
    """`pause_on_headers: false` with the buffer filter after this one (what Istio's WasmPlugin
    can configure): a structured event's id is read from the held body; a missing one passes."""
    port = inbox.port("istio")
    ev = Event(new_id())
    stored = inbox.counter("stored")
    first = deliver(port, fmt, ev)
    assert first.status == 200 and first.header(REPLAY) is None, first
    wait_stored(inbox, stored + 1)
    dup = deliver(port, fmt, ev, attempt=2)
    assert dup.status == 200 and dup.header(REPLAY) == "true" and dup.body == first.body, dup
    assert inbox.app.count(ev.id) == (1, 1)
    headers, body = missing_id_request(fmt)
    before = inbox.app.count("")[1]
    resp = h.request(port, "POST", PATH, body, headers)
    assert resp.status == 200 and resp.header(REPLAY) is None, resp
    assert inbox.app.count("")[1] == before + 1


def test_unguarded_methods_pass(inbox):
    resp = h.request(inbox.port("ce"), "GET", "/__counts")
    assert resp.status == 200, resp


def test_shipped_inbox_example_serves(inbox, run_dir):
    """envoy/inbox.yaml as shipped (ports and wasm path rewritten) in front of the app and the
    module's idemstore: a CloudEvent and a Pub/Sub push each run once; their duplicates replay
    (the Pub/Sub one as the configured bare 204)."""
    sub = run_dir / "inbox-example"
    sub.mkdir(parents=True, exist_ok=True)
    admin, events_port, pubsub_port = h.free_port(), h.free_port(), h.free_port()
    store_port = int(inbox.store.argv[inbox.store.argv.index("--listen") + 1].rsplit(":", 1)[1])
    text = (h.ROOT / "envoy" / "inbox.yaml").read_text()
    for old, new in {"port_value: 9901": admin, "port_value: 10000": events_port,
                     "port_value: 10001": pubsub_port, "port_value: 8081": inbox.app.port,
                     "port_value: 8380": store_port}.items():
        assert old in text, old
        text = text.replace(old + "}", f"port_value: {new}}}")
    text = text.replace("target/wasm32-wasip1/release/idempotency_filter.wasm", h.wasm_path())
    path = sub / "inbox.yaml"
    path.write_text(text)
    proc = h.launch_envoy_file(sub, "envoy-inbox-example", path)
    try:
        envoy = h.await_envoy(h.Envoy(proc, admin, {"events": events_port, "pubsub": pubsub_port}, path))
        h.wait_for(lambda: envoy.stats(r"^cluster\.idemstore\.membership_healthy$")
                   .get("cluster.idemstore.membership_healthy") == 1, "idemstore healthy", proc, timeout=10)
        ce = Event(new_id(), source="/orders")
        first = h.request(events_port, "POST", "/events", *reversed(request_for(ce, "binary", 1)))
        assert first.status == 200 and first.header(REPLAY) is None, first
        assert envoy.wait_counter("stored", 1) == 1
        dup = h.request(events_port, "POST", "/events", *reversed(request_for(ce, "structured", 2)))
        assert dup.status == 200 and dup.header(REPLAY) == "true" and dup.body == first.body, dup
        msg = Event(new_id())
        first = h.request(pubsub_port, "POST", "/pubsub/orders", *reversed(request_for(msg, "pubsub", 1)))
        assert first.status == 200 and first.header(REPLAY) is None, first
        assert envoy.wait_counter("stored", 2) == 2
        dup = h.request(pubsub_port, "POST", "/pubsub/orders", *reversed(request_for(msg, "pubsub", 2)))
        assert (dup.status, dup.body, dup.header(REPLAY)) == (204, b"", "true"), dup
        assert inbox.app.count(ce.id) == (1, 1) and inbox.app.count(msg.id) == (1, 1)
    finally:
        proc.stop()


# --------------------------------------------------------------------------------------------
# acceptance: 10,000 events over two replicas
# --------------------------------------------------------------------------------------------

EVENTS = 10_000
DUPLICATE_RATE = 0.30
FAIL_FIRST_RATE = 0.05
COUNTERS = ("guarded", "executed", "replayed", "stored", "released", "conflicted", "rejected", "passthrough",
            "degraded", "store_errors", "commit_failed", "unavailable", "mismatched")


# The acceptance run is binary CloudEvents; structured events and Pub/Sub push bodies (whose
# `deliveryAttempt` changes on every redelivery) go through the same run, smaller.
@pytest.mark.parametrize("fmt,events_n", [("binary", EVENTS), ("structured", 2_000), ("pubsub", 2_000)])
def test_exactly_once_over_two_replicas(run_dir, artifacts, note, fmt, events_n):
    sub = run_dir / f"inbox-acceptance-{fmt}"
    app = start_app(sub, fail_rate=FAIL_FIRST_RATE)
    sets = ReplicaSets(sub, app.port, artifacts["wasm"])
    try:
        rs = sets("replicas", envoys=2, stores=1, backend="redis", plugin=PUBSUB if fmt == "pubsub" else INBOX)
        run = uuid.uuid4().hex[:8]
        events = [Event(f"acc-{run}-{i}", source="/broker/orders", data={"n": i}) for i in range(events_n)]
        failing = {ev.id for ev in events if fails_first(ev.id, FAIL_FIRST_RATE)}
        spec = PushSpec(path=PATH, fmt=fmt, duplicate_rate=DUPLICATE_RATE, concurrent_rate=0.5,
                        reorder_window=50, workers=24, spread="round_robin", backoff_s=0.05,
                        max_attempts=8, deadline_s=150, seed=9)
        t0 = time.monotonic()
        result = push(rs.ports(), events, spec)
        elapsed = time.monotonic() - t0
        (rs.run_dir / "push.txt").write_text(result.summary() + "\n")
        assert not result.timed_out, result.summary()
        assert len(result.acked) == events_n, result.summary()

        counts = app.counts()
        effects, deliveries = counts["effects"], counts["deliveries"]
        ours = {ev.id for ev in events}
        assert set(effects) == ours, "events without a side effect, or side effects of no event"
        multiple = {k: v for k, v in effects.items() if v != 1}
        assert not multiple, f"{len(multiple)} ids had their side effect more than once: {list(multiple.items())[:5]}"
        total_effects = sum(effects.values())
        # Every delivery that reached the app: one per event, plus the failed first ones.
        duplicates_executed = sum(deliveries[k] for k in ours) - events_n - len(failing)
        assert duplicates_executed == 0, duplicates_executed
        assert all(deliveries[k] == 1 + (k in failing) for k in ours)

        # The filter's counters on both Envoys agree with what the app and the pusher saw.
        def total(name: str) -> int:
            return rs.counter_total(name)

        assert h.poll_until(lambda: total("stored"), events_n, 10) == events_n
        per_envoy = [rs.counters(i) for i in range(2)]
        sums = {name: sum(c.get(name, 0) for c in per_envoy) for name in COUNTERS}
        statuses = result.statuses()
        answered = len(result.outcomes) - statuses.get(0, 0)
        assert sums["executed"] == events_n + len(failing), sums
        assert sums["released"] == len(failing), sums
        assert sums["stored"] == events_n, sums
        assert sums["replayed"] == result.replays(), (sums, result.summary())
        assert sums["guarded"] == answered, (sums, result.summary())
        assert sums["guarded"] == sums["executed"] + sums["replayed"] + sums["conflicted"], sums
        assert statuses.get(500, 0) == len(failing), result.summary()
        for name in ("rejected", "passthrough", "degraded", "store_errors", "commit_failed", "unavailable",
                     "mismatched"):
            assert sums[name] == 0, (name, sums)
        assert all(c.get("executed", 0) > 0 and c.get("replayed", 0) > 0 for c in per_envoy), per_envoy
        note(f"inbox acceptance ({fmt}): {result.summary()}")
        note(f"inbox acceptance ({fmt}): side effects {total_effects} for {events_n} events, duplicates executed "
             f"{duplicates_executed}, failed first deliveries {len(failing)}, counters {sums}, "
             f"per envoy executed {[c.get('executed', 0) for c in per_envoy]}, push {elapsed:.1f}s")
    finally:
        panics = sets.close()
        app.proc.stop()
    assert not panics, panics
