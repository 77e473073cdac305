#!/usr/bin/env python3
"""A redelivering pusher for the inbox tests (stdlib only): a broker's push delivery, at least once.

It delivers a stream of events over HTTP/1.1 keep-alive connections to one or more ports (Envoy
replicas), the way Knative, Dapr, Event Grid or Pub/Sub push deliver to a subscriber:

* every event is delivered once, plus a *duplicate* with probability ``duplicate_rate`` (the
  broker redelivers although it may have had an ack: at-least-once);
* a share ``concurrent_rate`` of the duplicates is queued right next to its original, so that
  two workers send both at the same moment on different connections (and, with several ports,
  usually to different replicas): a redelivery while the first delivery is still running;
* the queue is shuffled within windows of ``reorder_window`` deliveries (out-of-order delivery);
* ``workers`` threads each keep one connection per port; deliveries go to the ports round-robin
  (``spread="round_robin"``) or at random (``spread="random"``);
* a delivery that does not get a ``2xx`` (an error status, a reset, a timeout) is redelivered
  after ``backoff_s`` (a Knative/Pub/Sub retry), until the event was acknowledged or it has had
  ``max_attempts`` deliveries;
* it stops when the queue is empty and no delivery is in flight, or at ``deadline_s``.

Formats (``fmt``): ``binary`` (CloudEvents binary mode: ``ce-*`` headers, JSON data),
``structured`` (``application/cloudevents+json``), ``pubsub`` (a Pub/Sub push body whose
``deliveryAttempt`` grows with every redelivery of one event).

Run by hand: ``python3 tests/support/pusher.py --ports 10000 --events 1000 --path /events``.
"""

from __future__ import annotations

import argparse
import base64
import collections
import http.client
import json
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

LOOPBACK = "127.0.0.1"
REPLAY = "x-idempotent-replay"


@dataclass
class Event:
    id: str
    source: str = "/pusher"
    type: str = "com.example.test"
    data: dict = field(default_factory=dict)


def request_for(ev: Event, fmt: str, attempt: int) -> tuple[list[tuple[str, str]], bytes]:
    """Headers and body of one delivery of `ev` in `fmt` (attempt: 1 for the first)."""
    if fmt == "binary":
        headers = [("ce-specversion", "1.0"), ("ce-id", ev.id), ("ce-source", ev.source),
                   ("ce-type", ev.type), ("content-type", "application/json")]
        return headers, json.dumps(ev.data).encode()
    if fmt == "structured":
        doc = {"specversion": "1.0", "id": ev.id, "source": ev.source, "type": ev.type,
               "datacontenttype": "application/json", "data": ev.data}
        return [("content-type", "application/cloudevents+json; charset=utf-8")], json.dumps(doc).encode()
    if fmt == "pubsub":
        doc = {
            "message": {
                "attributes": {"type": ev.type},
                "data": base64.b64encode(json.dumps(ev.data).encode()).decode(),
                "messageId": ev.id,
                "publishTime": "2026-12-02T19:00:00.000Z",
            },
            "subscription": "projects/test/subscriptions/inbox",
            "deliveryAttempt": attempt,
        }
        return [("content-type", "application/json")], json.dumps(doc).encode()
    raise ValueError(f"unknown format {fmt!r}")


@dataclass
class Delivery:
    event: int          # index into the event list
    kind: str           # "original", "duplicate", "concurrent" (a duplicate sent with its original), "redelivery"
    not_before: float = 0.0


@dataclass
class Outcome:
    event: int
    kind: str
    port: int
    status: int         # 0: no answer (reset, timeout, refused)
    replay: bool
    elapsed: float
    attempt: int


@dataclass
class PushSpec:
    path: str = "/events"
    fmt: str = "binary"
    duplicate_rate: float = 0.3
    concurrent_rate: float = 0.5
    reorder_window: int = 50
    workers: int = 24
    spread: str = "round_robin"
    backoff_s: float = 0.05
    max_attempts: int = 8
    deadline_s: float = 120.0
    timeout_s: float = 15.0
    seed: int = 1


@dataclass
class PushResult:
    outcomes: list[Outcome]
    acked: set[int]
    attempts: dict[int, int]
    elapsed: float
    events: int
    duplicates: int
    concurrent: int
    timed_out: bool

    def statuses(self) -> collections.Counter:
        return collections.Counter(o.status for o in self.outcomes)

    def replays(self) -> int:
        return sum(1 for o in self.outcomes if o.replay)

    def summary(self) -> str:
        st = dict(sorted(self.statuses().items()))
        return (f"{self.events} events, {len(self.outcomes)} deliveries ({self.duplicates} duplicates, "
                f"{self.concurrent} of them concurrent, {len(self.outcomes) - self.events - self.duplicates} "
                f"redeliveries), acked {len(self.acked)}, replays {self.replays()}, statuses {st}, "
                f"{self.elapsed:.1f}s ({len(self.outcomes) / max(self.elapsed, 1e-9):.0f} deliveries/s)")


class _Conn:
    """One keep-alive connection to a port, reopened after any failure."""

    def __init__(self, port: int, timeout: float):
        self.port = port
        self.timeout = timeout
        self.conn: http.client.HTTPConnection | None = None

    def post(self, path: str, headers: list[tuple[str, str]], body: bytes) -> tuple[int, bool]:
        for retry in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(LOOPBACK, self.port, timeout=self.timeout)
                self.conn.connect()
                self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                self.conn.putrequest("POST", path, skip_accept_encoding=True)
                for n, v in headers:
                    self.conn.putheader(n, v)
                self.conn.putheader("content-length", str(len(body)))
                self.conn.endheaders(body)
                resp = self.conn.getresponse()
                resp.read()
                replay = resp.getheader(REPLAY) == "true"
                if resp.getheader("connection", "").lower() == "close":
                    self.close()
                return resp.status, replay
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
                # A keep-alive connection the server closed while idle: the request never got
                # there, so it is sent again once on a fresh connection (as HTTP clients do).
                self.close()
                if retry or not isinstance(e, (http.client.RemoteDisconnected, BrokenPipeError)):
                    raise
            except BaseException:
                self.close()
                raise
        raise ConnectionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def plan(n_events: int, spec: PushSpec, rng: random.Random) -> tuple[list[Delivery], int, int]:
    """The initial delivery queue: originals, duplicates (some next to their original), shuffled
    in windows. Returns (queue, duplicates, concurrent duplicates)."""
    keyed: list[tuple[float, int, Delivery]] = []
    dups = conc = 0
    for i in range(n_events):
        keyed.append((float(i), len(keyed), Delivery(i, "original")))
        if rng.random() < spec.duplicate_rate:
            dups += 1
            if rng.random() < spec.concurrent_rate:
                conc += 1
                keyed.append((float(i), len(keyed), Delivery(i, "concurrent")))
            else:
                # A later duplicate lands anywhere after its original.
                keyed.append((rng.uniform(i + 0.5, n_events), len(keyed), Delivery(i, "duplicate")))
    keyed.sort(key=lambda k: (k[0], k[1]))
    queue = [d for _, _, d in keyed]
    if spec.reorder_window > 1:
        out: list[Delivery] = []
        for start in range(0, len(queue), spec.reorder_window):
            window = queue[start:start + spec.reorder_window]
            # Keep each concurrent duplicate glued to its original: shuffle units.
            units: list[list[Delivery]] = []
            for d in window:
                if d.kind == "concurrent" and units and units[-1][0].event == d.event:
                    units[-1].append(d)
                else:
                    units.append([d])
            rng.shuffle(units)
            out += [d for u in units for d in u]
        queue = out
    return queue, dups, conc


def push(ports: list[int], events: list[Event], spec: PushSpec) -> PushResult:
    rng = random.Random(spec.seed)
    queue_list, dups, conc = plan(len(events), spec, rng)
    queue = collections.deque(queue_list)
    cond = threading.Condition()
    in_flight = 0
    acked: set[int] = set()
    attempts: dict[int, int] = collections.defaultdict(int)
    outcomes: list[Outcome] = []
    rr = [0]
    t0 = time.monotonic()
    deadline = t0 + spec.deadline_s
    timed_out = [False]

    def next_delivery() -> tuple[Delivery, int, int] | None:
        nonlocal in_flight
        with cond:
            while True:
                now = time.monotonic()
                if now > deadline:
                    timed_out[0] = True
                    cond.notify_all()
                    return None
                if queue:
                    d = queue[0]
                    if d.not_before <= now:
                        queue.popleft()
                        in_flight += 1
                        attempts[d.event] += 1
                        if spec.spread == "random":
                            port = rng.choice(ports)
                        else:
                            port = ports[rr[0] % len(ports)]
                            rr[0] += 1
                        return d, port, attempts[d.event]
                    cond.wait(min(d.not_before - now, 0.05))
                    continue
                if in_flight == 0:
                    cond.notify_all()
                    return None
                cond.wait(0.05)

    def finished(d: Delivery, outcome: Outcome) -> None:
        nonlocal in_flight
        with cond:
            in_flight -= 1
            outcomes.append(outcome)
            ok = 200 <= outcome.status <= 299
            if ok:
                acked.add(d.event)
            elif d.event not in acked and attempts[d.event] < spec.max_attempts:
                # Not acknowledged: the broker redelivers after a backoff (to the back of the line).
                when = time.monotonic() + spec.backoff_s
                redelivery = Delivery(d.event, "redelivery", when)
                pos = len(queue)
                while pos > 0 and queue[pos - 1].not_before > when:
                    pos -= 1
                queue.insert(pos, redelivery)
            cond.notify_all()

    def worker() -> None:
        conns = {p: _Conn(p, spec.timeout_s) for p in ports}
        try:
            while True:
                got = next_delivery()
                if got is None:
                    return
                d, port, attempt = got
                headers, body = request_for(events[d.event], spec.fmt, attempt)
                t = time.monotonic()
                try:
                    status, replay = conns[port].post(spec.path, headers, body)
                except (OSError, http.client.HTTPException):
                    status, replay = 0, False
                finished(d, Outcome(d.event, d.kind, port, status, replay, time.monotonic() - t, attempt))
        finally:
            for c in conns.values():
                c.close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(spec.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(spec.deadline_s + spec.timeout_s + 5)
    return PushResult(outcomes, acked, dict(attempts), time.monotonic() - t0, len(events), dups, conc,
                      timed_out[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ports", required=True, help="comma-separated ports")
    ap.add_argument("--events", type=int, default=1000)
    ap.add_argument("--path", default="/events")
    ap.add_argument("--format", default="binary", choices=["binary", "structured", "pubsub"])
    ap.add_argument("--duplicate-rate", type=float, default=0.3)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--spread", default="round_robin", choices=["round_robin", "random"])
    ap.add_argument("--prefix", default="ev")
    args = ap.parse_args(argv)
    spec = PushSpec(path=args.path, fmt=args.format, duplicate_rate=args.duplicate_rate,
                    workers=args.workers, spread=args.spread)
    events = [Event(f"{args.prefix}-{i}", data={"n": i}) for i in range(args.events)]
    result = push([int(p) for p in args.ports.split(",")], events, spec)
    print(result.summary())
    return 0 if len(result.acked) == len(events) else 1


if __name__ == "__main__":
    sys.exit(main())
