#!/usr/bin/env python3
"""A counting upstream for the end-to-end suite (stdlib only).

Every request to a path that does not start with ``/__`` is one *execution*: it is recorded
with its method, path (query string included), the value of its ``Idempotency-Key`` header
(or ``""``) and the id minted for it. Tests read the record back:

* ``GET /__counts?key=K&path=P&method=M&key_prefix=X`` -> ``{"count": n}`` for the executions
  matching every given filter (``path`` matches the path without its query string unless the
  filter itself has a ``?``; ``key_prefix`` matches keys starting with it); without filters ->
  ``{"count": total, "executions": [...]}``.
* ``GET /__executions?key=K`` -> ``{"executions": [...]}`` (the same filters); with
  ``headers=1`` each execution also has ``headers``: the request headers as received, in order,
  as ``[name, value]`` pairs (names lower-cased), and ``version``, the request's HTTP version.
* ``POST /__reset`` forgets everything.
* ``GET /__committed/<store key>`` -> the answer of the execution that carried that store key in
  ``x-idempotency-store-key`` (the filter's ``store_key_header`` in the tests) and completed its
  work: the status and body it answered; ``404`` if none did: the application's side of the filter's ``outcome_lookup``. An execution completes its
  work when its handler is done, whether or not its answer reaches anyone (a client that gave up,
  Envoy's timeout); one with ``x-test-reset`` never does.

How an execution answers is chosen per request by headers, so each test picks its own:

* ``x-test-status``: status code (default ``201``). A ``204`` or ``304`` has no body.
* ``x-test-sleep-ms``: sleep this long before answering.
* ``x-test-content-type``: response content type (default ``application/json``).
* ``x-test-body``: the response body, verbatim, instead of the default JSON document.
* ``x-test-body-bytes``: pad the default JSON document to exactly this many bytes.
* ``x-test-reset``: record the execution, then close the connection with a TCP reset instead
  of answering.
* ``x-test-first-status``: answer this status (at once, without ``x-test-sleep-ms``) to the
  first execution of this ``Idempotency-Key`` and path (query string included), then behave
  normally: a failure that a retry of the same request gets past, whatever key a proxy in front
  put on it.

The answer's bytes and headers can be chosen exactly (the first of the body headers given wins:
``x-test-body-b64``, ``x-test-body-pattern``, ``x-test-body``, else the default JSON document):

* ``x-test-body-b64``: the response body is this value base64-decoded, verbatim (any bytes).
* ``x-test-body-pattern``: a generated body, for sizes too large for a request header:
  ``allbytes:N`` is the bytes 0..255 repeated to exactly N bytes, ``text:N`` the ASCII line
  ``0123456789abcdef...`` repeated to exactly N bytes.
* ``x-test-header`` (repeatable): ``name: value`` added to the response as it is. One named
  ``content-type`` replaces the default content type (``x-test-content-type`` too).
* ``x-test-no-content-type``: send no ``content-type`` header at all.
* ``x-test-gzip``: gzip the chosen body (mtime 0, so the same body gives the same bytes) and
  send ``content-encoding: gzip``.
* ``x-test-chunked``: send the body with ``transfer-encoding: chunked`` (chunks of at most
  64 KiB) instead of a ``content-length``.

The default body is JSON with a fresh per-execution id (``thing_000001``, ...), the method,
path, key, and the request body (as text when short, else its length and SHA-256), plus a
``location: /things/<id>`` header.
"""

from __future__ import annotations

import argparse
import base64
import gc
import gzip
import hashlib
import json
import socket
import struct
import sys
import threading
import time

try:
    from . import testserver
except ImportError:  # run as a script (python3 tests/support/upstream.py): no parent package
    import testserver
from urllib.parse import parse_qs, urlsplit

ECHO_LIMIT = 4096
CHUNK = 64 * 1024


def parse_header_line(line: str) -> tuple[str, str]:
    """`name: value` (an ``x-test-header`` value) as a response header."""
    name, sep, value = line.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"x-test-header wants 'name: value', got {line!r}")
    return name.strip(), value.strip()


def body_pattern(spec: str) -> bytes:
    """``allbytes:N`` (bytes 0..255 repeated) or ``text:N`` (hex digits repeated), N bytes."""
    kind, _, n = spec.partition(":")
    size = int(n)
    if kind == "allbytes":
        unit = bytes(range(256))
    elif kind == "text":
        unit = b"0123456789abcdef"
    else:
        raise ValueError(f"unknown x-test-body-pattern {spec!r}")
    return (unit * (size // len(unit) + 1))[:size]


class State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seq = 0
        self.executions: list[dict] = []
        # By key too: a whole suite leaves hundreds of thousands, and a count by key must not
        # scan them all under the lock every request waits for.
        self.by_key: dict[str, list[dict]] = {}
        # Store key -> (status, content type, body) of the execution that completed its work.
        self.committed: dict[str, tuple[int, str, bytes]] = {}

    def record(self, method: str, path: str, key: str, body: bytes,
               headers: list[list[str]] | None = None, version: str = "") -> dict:
        with self.lock:
            self.seq += 1
            ex = {
                "seq": self.seq,
                "id": f"thing_{self.seq:06d}",
                "method": method,
                "path": path,
                "key": key,
                "body_len": len(body),
                "body_sha256": hashlib.sha256(body).hexdigest(),
                "at": time.time(),
                "headers": headers or [],
                "version": version,
            }
            self.executions.append(ex)
            self.by_key.setdefault(key, []).append(ex)
            if self.seq % 10_000 == 0:
                # What is kept is kept for good: the collector need not walk it again (a full
                # collection over a suite's executions would pause every request it walks).
                gc.freeze()
            return dict(ex)

    def select(self, query: dict[str, list[str]]) -> list[dict]:
        def match(ex: dict) -> bool:
            if "key" in query and ex["key"] != query["key"][0]:
                return False
            if "key_prefix" in query and not ex["key"].startswith(query["key_prefix"][0]):
                return False
            if "method" in query and ex["method"] != query["method"][0]:
                return False
            if "path" in query:
                want = query["path"][0]
                have = ex["path"] if "?" in want else ex["path"].split("?", 1)[0]
                if have != want:
                    return False
            return True

        with_headers = query.get("headers", ["0"])[0] == "1"

        def out(ex: dict) -> dict:
            d = dict(ex)
            if not with_headers:
                d.pop("headers", None)
                d.pop("version", None)
            return d

        with self.lock:
            pool = self.by_key.get(query["key"][0], []) if "key" in query else self.executions
            return [out(ex) for ex in pool if match(ex)]

    def nth(self, ex: dict) -> int:
        """Which execution of its key and path (query string included) `ex` is, from 1."""
        with self.lock:
            return sum(1 for e in self.by_key.get(ex["key"], [])
                       if e["path"] == ex["path"] and e["seq"] <= ex["seq"])

    def commit(self, store_key: str, status: int, ctype: str, body: bytes) -> None:
        if store_key:
            with self.lock:
                self.committed[store_key] = (status, ctype, body)

    def reset(self) -> None:
        with self.lock:
            self.executions.clear()
            self.by_key.clear()
            self.committed.clear()


STATE = State()


class Handler(testserver.Handler):
    server_version = "counting-upstream/1"

    # --- plumbing -------------------------------------------------------------------------

    def read_body(self) -> bytes:
        te = (self.headers.get("transfer-encoding") or "").lower()
        if "chunked" in te:
            chunks = []
            while True:
                line = self.rfile.readline()
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    # trailers until the empty line
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("content-length") or 0)
        return self.rfile.read(length) if length else b""

    def reply(self, status: int, body: bytes, headers: list[tuple[str, str]], chunked: bool = False) -> None:
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        has_body = status not in (204, 304) and not (100 <= status < 200)
        chunked = chunked and has_body and self.command != "HEAD"
        if chunked:
            self.send_header("transfer-encoding", "chunked")
        elif has_body:
            self.send_header("content-length", str(len(body)))
        self.end_headers()
        if chunked:
            for i in range(0, len(body), CHUNK):
                part = body[i:i + CHUNK]
                self.wfile.write(b"%x\r\n" % len(part) + part + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        elif body and has_body and self.command != "HEAD":
            self.wfile.write(body)
        self.wfile.flush()

    def reply_json(self, status: int, doc) -> None:
        self.reply(status, json.dumps(doc).encode(), [("content-type", "application/json")])

    # --- control endpoints ----------------------------------------------------------------

    def control(self, body: bytes) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query, keep_blank_values=True)
        if url.path == "/__counts" and self.command == "GET":
            sel = STATE.select(query)
            doc: dict = {"count": len(sel)}
            if not query:
                doc["executions"] = sel
            self.reply_json(200, doc)
        elif url.path == "/__executions" and self.command == "GET":
            self.reply_json(200, {"executions": STATE.select(query)})
        elif url.path == "/__reset" and self.command == "POST":
            STATE.reset()
            self.reply_json(200, {"reset": True})
        elif url.path == "/__health":
            self.reply_json(200, {"ok": True})
        elif url.path.startswith("/__committed/") and self.command == "GET":
            with STATE.lock:
                found = STATE.committed.get(url.path.removeprefix("/__committed/"))
            if found is None:
                self.reply_json(404, {"committed": False})
            else:
                # The answer the first attempt would have had, status and all.
                status, ctype, out = found
                self.reply(status, out, [("content-type", ctype)])
        else:
            self.reply_json(404, {"error": "unknown control endpoint"})

    # --- executions ---------------------------------------------------------------------

    def handle_any(self) -> None:
        body = self.read_body()
        if self.path.startswith("/__"):
            self.control(body)
            return
        key = self.headers.get("idempotency-key", "")
        received = [[name.lower(), value] for name, value in self.headers.items()]
        ex = STATE.record(self.command, self.path, key, body, received, self.request_version)

        if self.headers.get("x-test-reset"):
            # SO_LINGER 0: close() sends RST, not FIN, and nothing was answered.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()
            return

        first_status = self.headers.get("x-test-first-status")
        if first_status and STATE.nth(ex) == 1:
            status = int(first_status)
        else:
            sleep_ms = int(self.headers.get("x-test-sleep-ms") or 0)
            if sleep_ms > 0:
                time.sleep(sleep_ms / 1000.0)
            status = int(self.headers.get("x-test-status") or 201)
        ctype = self.headers.get("x-test-content-type")
        extra = [parse_header_line(v) for v in self.headers.get_all("x-test-header") or []]
        if any(n.lower() == "content-type" for n, _ in extra):
            ctype = None
        no_ctype = bool(self.headers.get("x-test-no-content-type")) or any(
            n.lower() == "content-type" for n, _ in extra)
        headers: list[tuple[str, str]] = [("location", f"/things/{ex['id']}"), ("x-upstream-id", ex["id"])]
        headers += extra
        if status in (204, 304):
            if ctype and not no_ctype:
                headers.append(("content-type", ctype))
            self.reply(status, b"", headers)
            return
        override = self.headers.get("x-test-body")
        b64 = self.headers.get("x-test-body-b64")
        pattern = self.headers.get("x-test-body-pattern")
        if b64 is not None:
            out = base64.b64decode(b64.strip(), validate=True)
        elif pattern is not None:
            out = body_pattern(pattern)
        elif override is not None:
            out = override.encode("latin-1")
        else:
            doc = {
                "id": ex["id"],
                "status": "created" if status == 201 else "done",
                "method": self.command,
                "path": self.path,
                "key": key,
                "body_len": len(body),
                "body_sha256": hashlib.sha256(body).hexdigest(),
            }
            if len(body) <= ECHO_LIMIT:
                doc["body"] = body.decode("utf-8", "replace")
            out = json.dumps(doc).encode()
            want = int(self.headers.get("x-test-body-bytes") or 0)
            if want:
                doc["pad"] = ""
                base = len(json.dumps(doc).encode())
                doc["pad"] = "p" * max(0, want - base)
                out = json.dumps(doc).encode()
        if not no_ctype:
            headers.append(("content-type", ctype or "application/json"))
        # The work is done: an outcome lookup finds it from now on, answered or not.
        STATE.commit(self.headers.get("x-idempotency-store-key", ""), status, ctype or "application/json", out)
        if self.headers.get("x-test-gzip"):
            out = gzip.compress(out, mtime=0)
            headers.append(("content-encoding", "gzip"))
        self.reply(status, out, headers, chunked=bool(self.headers.get("x-test-chunked")))

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = handle_any

    def __getattr__(self, name: str):
        # Any other method token (`post`, `PURGE`, ...) executes too: some frameworks match
        # methods case-insensitively, and the tests show what reaches them.
        if name.startswith("do_"):
            return self.handle_any
        raise AttributeError(name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--quiet", action="store_true", help="do not log each request")
    args = ap.parse_args(argv)
    Handler.quiet = args.quiet
    srv = testserver.Server((args.host, args.port), Handler)
    return testserver.serve(srv, "counting upstream")


if __name__ == "__main__":
    sys.exit(main())
