#!/usr/bin/env python3
"""A test double for idemstore (stdlib only): answers the store protocol slowly, wrongly, or not
at all, so the fault drills can show what the filter does with a store that misbehaves.

It speaks HTTP/1.1 only (the filter's store cluster for it must not be h2c). Everything it does
is chosen at run time through control endpoints, so one process serves a whole test:

* ``POST /__mode`` with a JSON object, fields merged into the current mode:
  ``{"answer": "proxy" | "<garbage variant>", "delay_ms": N, "target": PORT, "health": STATUS}``

  - ``answer: "proxy"`` (the default) forwards ``/v1/*`` calls to a real idemstore on
    ``127.0.0.1:<target>`` over HTTP/1.1 and relays its answer: the double is then transparent.
    Without a target it answers ``503``.
  - ``answer: <variant>`` answers every ``/v1/*`` call with that garbage (``VARIANTS`` below).
  - ``delay_ms`` holds every ``/v1/*`` answer that long first (whatever the answer).
  - ``health`` is the status of ``GET /healthz`` (default ``200``).
* ``GET /__stats`` -> ``{"calls": {"/v1/begin": n, ...}, "answered": {"<variant>": n, ...}}``
* ``POST /__reset`` zeroes the stats.
* ``GET /__health`` -> ``200`` (readiness of the double itself).

Run: ``python3 tests/support/store_double.py --port N [--quiet]``; tests use ``StoreDouble``
(start, mode, stats; ``store_double_client.py``), which starts it as a ``harness`` process.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import struct
import sys
import threading
import time

try:
    from . import testserver
except ImportError:  # run as a script (python3 tests/support/store_double.py): no parent package
    import testserver

OUTCOME = "x-idem-outcome"
TOKEN = "x-idem-token"


def record(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    """A record in the filter's first wire form (`IDR1`, which src/store/record.rs still reads), for
    variants that are almost right."""
    out = b"IDR1" + struct.pack(">HH", status, len(headers))
    for name, value in headers:
        out += struct.pack(">H", len(name)) + name + struct.pack(">I", len(value)) + value
    return out + body


# name -> what the double answers to every /v1/* call. Each entry is either
#   ("http", status, [(header, value), ...], body)   a well-framed HTTP/1.1 answer, or
#   ("raw", bytes)                                     bytes written as they are, then close, or
#   ("close",) / ("reset",)                            no answer: FIN, or RST (SO_LINGER 0).
VARIANTS: dict[str, tuple] = {
    # 200s that do not follow the protocol
    "no_outcome": ("http", 200, [], b""),
    "unknown_outcome": ("http", 200, [(OUTCOME, "maybe")], b""),
    "outcome_upper_case": ("http", 200, [(OUTCOME, "LOCKED"), (TOKEN, "tok1")], b""),
    "outcome_empty": ("http", 200, [(OUTCOME, "")], b""),
    "outcome_latin1": ("http", 200, [(OUTCOME, "lock\xe9d")], b""),
    "locked_no_token": ("http", 200, [(OUTCOME, "locked")], b""),
    "locked_bad_token": ("http", 200, [(OUTCOME, "locked"), (TOKEN, "tok en!")], b""),
    "locked_long_token": ("http", 200, [(OUTCOME, "locked"), (TOKEN, "t" * 65)], b""),
    "record_not_a_record": ("http", 200, [(OUTCOME, "record"), ("content-type", "application/octet-stream")],
                            b"this is not a record"),
    "record_empty_body": ("http", 200, [(OUTCOME, "record")], b""),
    "record_truncated": ("http", 200, [(OUTCOME, "record")], record(201, [(b"location", b"/x")], b"")[:11]),
    "record_status_500": ("http", 200, [(OUTCOME, "record")], record(500, [], b"{}")),
    "record_status_0": ("http", 200, [(OUTCOME, "record")], record(0, [], b"{}")),
    "record_set_cookie": ("http", 200, [(OUTCOME, "record")], record(201, [(b"set-cookie", b"a=b")], b"{}")),
    "record_crlf_value": ("http", 200, [(OUTCOME, "record")],
                          record(201, [(b"location", b"/a\r\nx-injected: 1")], b"{}")),
    "record_bad_header_name": ("http", 200, [(OUTCOME, "record")], record(201, [(b"bad name", b"v")], b"{}")),
    "record_header_count_lies": ("http", 200, [(OUTCOME, "record")],
                                 b"IDR1" + struct.pack(">HH", 201, 65535) + b"{}"),
    "record_value_len_lies": ("http", 200, [(OUTCOME, "record")],
                              b"IDR1" + struct.pack(">HHH", 201, 1, 8) + b"location" + struct.pack(">I", 2**31)),
    "record_random_4mib": ("http", 200, [(OUTCOME, "record")], os.urandom(4 * 1024 * 1024)),
    # statuses other than 200
    "status_500": ("http", 500, [("content-type", "text/plain")], b"boom"),
    "status_503_with_outcome": ("http", 503, [(OUTCOME, "locked"), (TOKEN, "tok1")], b""),
    "status_404": ("http", 404, [], b"not found"),
    "status_302": ("http", 302, [("location", "http://127.0.0.1:1/v1/begin")], b""),
    "status_204": ("http", 204, [(OUTCOME, "locked"), (TOKEN, "tok1")], b""),
    "status_429": ("http", 429, [("retry-after", "1")], b""),
    "status_201_locked": ("http", 201, [(OUTCOME, "locked"), (TOKEN, "tok1")], b""),
    # headers Envoy itself refuses (upstream header limits: 60 KiB, 100 headers by default)
    "huge_header": ("http", 200, [(OUTCOME, "locked"), (TOKEN, "tok1"), ("x-junk", "j" * (200 * 1024))], b""),
    "many_headers": ("http", 200, [(OUTCOME, "locked"), (TOKEN, "tok1")]
                     + [(f"x-h{i}", "v") for i in range(300)], b""),
    # not HTTP, or HTTP cut short
    "random_bytes": ("raw", os.urandom(512)),
    "bad_status_line": ("raw", b"HTTP/1.1 2OO OK\r\nx-idem-outcome: locked\r\n\r\n"),
    "short_body": ("raw", b"HTTP/1.1 200 OK\r\nx-idem-outcome: record\r\ncontent-length: 1000\r\n\r\nIDR1"),
    "bad_chunk": ("raw", b"HTTP/1.1 200 OK\r\nx-idem-outcome: record\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"),
    "close": ("close",),
    "reset": ("reset",),
}


class Mode:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.answer = "proxy"
        self.delay_ms = 0
        self.target: int | None = None
        self.health = 200
        self.calls: dict[str, int] = {}
        self.answered: dict[str, int] = {}

    def snapshot(self) -> tuple[str, int, int | None]:
        with self.lock:
            return self.answer, self.delay_ms, self.target

    def update(self, doc: dict) -> dict:
        with self.lock:
            if "answer" in doc:
                if doc["answer"] != "proxy" and doc["answer"] not in VARIANTS:
                    raise ValueError(f"unknown answer {doc['answer']!r}")
                self.answer = doc["answer"]
            if "delay_ms" in doc:
                self.delay_ms = max(0, int(doc["delay_ms"]))
            if "target" in doc:
                self.target = None if doc["target"] is None else int(doc["target"])
            if "health" in doc:
                self.health = int(doc["health"])
            return {"answer": self.answer, "delay_ms": self.delay_ms, "target": self.target, "health": self.health}

    def count(self, path: str, answer: str) -> None:
        with self.lock:
            self.calls[path] = self.calls.get(path, 0) + 1
            self.answered[answer] = self.answered.get(answer, 0) + 1

    def stats(self) -> dict:
        with self.lock:
            return {"calls": dict(self.calls), "answered": dict(self.answered)}

    def reset(self) -> None:
        with self.lock:
            self.calls.clear()
            self.answered.clear()


MODE = Mode()


class Handler(testserver.Handler):
    server_version = "store-double/1"

    def read_body(self) -> bytes:
        length = int(self.headers.get("content-length") or 0)
        return self.rfile.read(length) if length else b""

    def send(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        # Written by hand: send_header would refuse nothing, but keep the framing explicit.
        lines = [f"HTTP/1.1 {status} {self.responses.get(status, ('X',))[0]}"]
        lines += [f"{n}: {v}" for n, v in headers]
        if status not in (204, 304):
            lines.append(f"content-length: {len(body)}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        self.wfile.write(head + (body if status not in (204, 304) else b""))
        self.wfile.flush()

    def send_json(self, status: int, doc) -> None:
        self.send(status, [("content-type", "application/json")], json.dumps(doc).encode())

    # --- control ------------------------------------------------------------------------

    def control(self, body: bytes) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/__mode" and self.command == "POST":
            try:
                self.send_json(200, MODE.update(json.loads(body or b"{}")))
            except (ValueError, TypeError) as e:
                self.send_json(400, {"error": str(e)})
        elif path == "/__stats":
            self.send_json(200, MODE.stats())
        elif path == "/__reset" and self.command == "POST":
            MODE.reset()
            self.send_json(200, {"reset": True})
        elif path == "/__health":
            self.send_json(200, {"ok": True})
        else:
            self.send_json(404, {"error": "unknown control endpoint"})

    # --- the store protocol ---------------------------------------------------------------

    def proxy(self, target: int | None, body: bytes) -> None:
        if target is None:
            self.send(503, [("content-type", "text/plain")], b"no target")
            return
        conn = http.client.HTTPConnection("127.0.0.1", target, timeout=70)
        try:
            headers = {n: v for n, v in self.headers.items()
                       if n.lower().startswith("x-idem-") or n.lower() == "content-type"}
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            out = [(n, v) for n, v in resp.getheaders()
                   if n.lower().startswith("x-idem-") or n.lower() == "content-type"]
            self.send(resp.status, out, data)
        except OSError as e:
            self.send(503, [("content-type", "text/plain")], f"proxy: {e}".encode())
        finally:
            conn.close()

    def garbage(self, variant: str) -> None:
        spec = VARIANTS[variant]
        kind = spec[0]
        if kind == "http":
            _, status, headers, body = spec
            self.send(status, headers, body)
            if status >= 300:
                self.close_connection = True
        elif kind == "raw":
            self.wfile.write(spec[1])
            self.wfile.flush()
            self.close_connection = True
        elif kind == "close":
            self.close_connection = True
        elif kind == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()

    def handle_any(self) -> None:
        body = self.read_body()
        path = self.path.split("?", 1)[0]
        if path.startswith("/__"):
            self.control(body)
            return
        if path == "/healthz":
            status = MODE.health
            self.send(status, [("content-type", "text/plain")], b"ok" if status == 200 else b"unavailable")
            return
        answer, delay_ms, target = MODE.snapshot()
        MODE.count(path, answer)
        if delay_ms:
            time.sleep(delay_ms / 1000.0)
        try:
            if answer == "proxy":
                self.proxy(target, body)
            else:
                self.garbage(answer)
        except (BrokenPipeError, ConnectionResetError):
            # Envoy gave up on the call (its timeout) before the answer.
            self.close_connection = True

    do_GET = do_POST = do_PUT = handle_any


class Server(testserver.Server):
    def handle_error(self, request, client_address):  # quiet: peers that give up are expected
        exc = sys.exc_info()[1]
        if not isinstance(exc, (BrokenPipeError, ConnectionResetError, TimeoutError)):
            super().handle_error(request, client_address)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--target", type=int, default=None, help="idemstore port for answer=proxy")
    ap.add_argument("--quiet", action="store_true", help="do not log each request")
    args = ap.parse_args(argv)
    Handler.quiet = args.quiet
    MODE.target = args.target
    srv = Server((args.host, args.port), Handler)
    return testserver.serve(srv, "store double")


if __name__ == "__main__":
    sys.exit(main())
