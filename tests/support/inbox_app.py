#!/usr/bin/env python3
"""A message handler for the inbox tests (stdlib only): it counts side effects per event id.

Every POST to a path that does not start with ``/__`` is one *delivery* of the event whose id
the app reads itself, the way a subscriber would:

* ``ce-id`` header (binary-mode CloudEvent), else
* ``id`` of an ``application/cloudevents+json`` body (structured mode), else
* ``message.messageId`` of a JSON body (Google Pub/Sub push), else
* the ``x-message-id`` header, else ``""``.

A delivery answered with a ``2xx`` applies the event's *side effect* once (``effects[id] += 1``);
a failed one applies nothing (as if its transaction rolled back). How a delivery is answered
depends on the id, so every broker format can ask for it:

* ``fail-...``: the first delivery of the id answers ``500``, later ones succeed;
* ``--fail-first-rate R``: likewise for a fraction R of all ids, chosen by a hash of the id
  (``fails_first(id, R)``, importable, so a test knows which ids will fail);
* ``text-...``: answers ``200`` with ``text/plain`` (``ok``) instead of JSON;
* ``slow-...``: counted on arrival, answered after 800 ms (``--slow-ms`` to change);
* anything else: ``200`` with ``{"handled": id, "effect": n}`` as ``application/json``.

Control endpoints: ``GET /__counts`` -> ``{"effects": {id: n}, "deliveries": {id: n},
"statuses": {id: [status, ...]}}``; ``GET /__count?id=X`` -> ``{"effects": n, "deliveries": n}``;
``POST /__reset``; ``GET /__health``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
import time
from urllib.parse import parse_qs, urlsplit

try:
    from . import testserver
except ImportError:  # run as a script (python3 tests/support/inbox_app.py): no parent package
    import testserver


def fails_first(event_id: str, rate: float) -> bool:
    """True for the ids whose first delivery fails: a fixed fraction `rate`, by SHA-256 of the id."""
    if event_id.startswith("fail-"):
        return True
    if rate <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(event_id.encode()).digest()[:8], "big")
    return h / 2**64 < rate


def event_id(headers, body: bytes) -> str:
    """The id as the subscriber reads it (see the module docs)."""
    ce_id = headers.get("ce-id")
    if ce_id is not None:
        return ce_id
    ctype = (headers.get("content-type") or "").split(";")[0].strip().lower()
    try:
        doc = json.loads(body) if body else None
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        if ctype == "application/cloudevents+json" and isinstance(doc.get("id"), str):
            return doc["id"]
        msg = doc.get("message")
        if isinstance(msg, dict) and msg.get("messageId") is not None:
            return str(msg["messageId"])
    return headers.get("x-message-id") or ""


class State:
    def __init__(self, fail_rate: float) -> None:
        self.lock = threading.Lock()
        self.fail_rate = fail_rate
        self.effects: dict[str, int] = {}
        self.deliveries: dict[str, int] = {}
        self.statuses: dict[str, list[int]] = {}

    def deliver(self, eid: str) -> tuple[int, int]:
        """Counts a delivery; returns (delivery number for this id, status to answer)."""
        with self.lock:
            n = self.deliveries.get(eid, 0) + 1
            self.deliveries[eid] = n
            status = 500 if n == 1 and fails_first(eid, self.fail_rate) else 200
            if status == 200:
                self.effects[eid] = self.effects.get(eid, 0) + 1
            self.statuses.setdefault(eid, []).append(status)
            return n, status

    def snapshot(self) -> dict:
        with self.lock:
            return {"effects": dict(self.effects), "deliveries": dict(self.deliveries),
                    "statuses": {k: list(v) for k, v in self.statuses.items()}}

    def reset(self) -> None:
        with self.lock:
            self.effects.clear()
            self.deliveries.clear()
            self.statuses.clear()


STATE = State(0.0)
SLOW_MS = 800


class Handler(testserver.Handler):
    server_version = "inbox-app/1"

    def read_body(self) -> bytes:
        te = (self.headers.get("transfer-encoding") or "").lower()
        if "chunked" in te:
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("content-length") or 0)
        return self.rfile.read(length) if length else b""

    def reply(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def reply_json(self, status: int, doc) -> None:
        self.reply(status, json.dumps(doc).encode(), "application/json")

    def control(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        if url.path == "/__counts" and self.command == "GET":
            self.reply_json(200, STATE.snapshot())
        elif url.path == "/__count" and self.command == "GET":
            eid = query.get("id", [""])[0]
            snap = STATE.snapshot()
            self.reply_json(200, {"effects": snap["effects"].get(eid, 0),
                                  "deliveries": snap["deliveries"].get(eid, 0)})
        elif url.path == "/__reset" and self.command == "POST":
            STATE.reset()
            self.reply_json(200, {"reset": True})
        elif url.path == "/__health":
            self.reply_json(200, {"ok": True})
        else:
            self.reply_json(404, {"error": "unknown control endpoint"})

    def do_POST(self) -> None:
        body = self.read_body()
        if self.path.startswith("/__"):
            self.control()
            return
        eid = event_id(self.headers, body)
        # Counted on arrival (a test can see a slow delivery is in progress), answered after.
        n, status = STATE.deliver(eid)
        if eid.startswith("slow-"):
            time.sleep(SLOW_MS / 1000.0)
        if status != 200:
            self.reply_json(status, {"error": "transient failure", "id": eid, "delivery": n})
        elif eid.startswith("text-"):
            self.reply(200, b"ok", "text/plain")
        else:
            self.reply_json(200, {"handled": eid, "delivery": n})

    def do_GET(self) -> None:
        self.read_body()
        if self.path.startswith("/__"):
            self.control()
        else:
            self.reply_json(404, {"error": "POST events here"})


def main(argv: list[str] | None = None) -> int:
    global STATE, SLOW_MS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--fail-first-rate", type=float, default=0.0)
    ap.add_argument("--slow-ms", type=int, default=800)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    STATE = State(args.fail_first_rate)
    SLOW_MS = args.slow_ms
    Handler.quiet = args.quiet
    srv = testserver.Server((args.host, args.port), Handler)
    return testserver.serve(srv, "inbox app")


if __name__ == "__main__":
    sys.exit(main())
