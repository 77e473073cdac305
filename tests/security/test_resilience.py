"""Wasm VM resilience: upstream answers the filter cannot use (bytes that are not UTF-8, framing
that lies, oversized or repeated headers, trailers, bodies cut short) leave the worker serving.
Each answer either is stored and replayed byte for byte, or is passed on and, as the upstream
had the request and no usable answer came back, leaves the key in doubt (the retry gets `409`
`outcome-unknown` and runs nothing); no `wasm.*` failure counter moves and no panic is logged (on
the native host: Envoy still runs and answers, and the module logged no caught panic). A store that
answers garbage is the fault drill's
(`failures/test_drills.py::test_drill_garbage_store_fails_open`). Every shipped Envoy config sets
`failure_policy: FAIL_RELOAD`."""

from __future__ import annotations

import http.client
import socket
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from support import harness as h
from support.checks import PANIC, REPLAY, vm_failure_stats
from support.stack import plugin_config

JSON_HEAD = b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\n"


def framed(head: bytes, body: bytes) -> bytes:
    return head + b"content-length: %d\r\n\r\n" % len(body) + body


@dataclass
class Answer:
    wire: bytes
    status: int | None  # what the client gets (None: the stream is reset, no answer)
    stored: bool  # a retry is a replay
    # Not stored: the answer never came whole (the key is in doubt: the retry gets 409 and runs
    # nothing), rather than whole but not one a record can keep (released: the retry runs).
    lost: bool = False


ANSWERS: dict[str, Answer] = {
    "plain": Answer(framed(JSON_HEAD + b"location: /o/1\r\n", b'{"id":1}'), 201, True),
    # Kept headers whose values are not UTF-8 / not visible ASCII.
    "location_latin1": Answer(framed(JSON_HEAD + b"location: /caf\xe9\r\n", b'{"id":2}'), 201, True),
    "location_utf8": Answer(framed(JSON_HEAD + "location: /caf\u00e9\r\n".encode(), b'{"id":3}'), 201, True),
    # A session cookie and hop-by-hop headers are passed on to this client, never replayed.
    "set_cookie": Answer(framed(JSON_HEAD + b"set-cookie: session=abc; HttpOnly\r\nset-cookie: b=2\r\n"
                                b"keep-alive: timeout=5\r\nproxy-authenticate: Basic\r\n", b'{"id":11}'), 201, True),
    "location_twice": Answer(framed(JSON_HEAD + b"location: /a\r\nlocation: /b\r\n", b'{"id":4}'), 201, True),
    "content_type_garbage": Answer(framed(b"HTTP/1.1 201 Created\r\ncontent-type: application/json\xff\xfe\r\n",
                                          b'{"id":5}'), 201, False),
    # Envoy joins the two into one value (`application/json,text/plain`), which the client gets
    # and every replay repeats: kept, as any content type is.
    "content_type_twice": Answer(framed(JSON_HEAD + b"content-type: text/plain\r\n", b'{"id":6}'), 201, True),
    "content_type_params": Answer(framed(b"HTTP/1.1 201 Created\r\ncontent-type: Application/JSON; charset=utf-8\r\n",
                                         b'{"id":7}'), 201, True),
    "json_body_not_json": Answer(framed(JSON_HEAD, b"\x00\xff not json"), 201, True),
    "empty_json_body": Answer(framed(JSON_HEAD, b""), 201, True),
    "status_299": Answer(framed(b"HTTP/1.1 299 Whatever\r\ncontent-type: application/json\r\n", b"{}"), 299, True),
    "continue_then_201": Answer(b"HTTP/1.1 100 Continue\r\n\r\n" + framed(JSON_HEAD, b'{"id":8}'), 201, True),
    "many_headers": Answer(framed(JSON_HEAD + b"".join(b"x-h%d: v\r\n" % i for i in range(90)), b'{"id":9}'),
                           201, True),
    # A large header outside the kept list: the record leaves it out.
    "header_50kb": Answer(framed(JSON_HEAD + b"x-junk: " + b"j" * 50000 + b"\r\n", b"{}"), 201, True),
    # Past Envoy's upstream header limit: Envoy answers 503 itself.
    "header_too_large": Answer(framed(JSON_HEAD + b"x-junk: " + b"j" * 200000 + b"\r\n", b"{}"), 503, False, lost=True),
    "chunked_with_trailers": Answer(JSON_HEAD + b"transfer-encoding: chunked\r\n\r\n"
                                    b"3\r\n{\"a\r\n4\r\n\":1}\r\n0\r\nx-trailer: t\r\n\r\n", 201, True),
    # The body is cut short (content-length promises more), or the chunk framing breaks: Envoy
    # resets the stream after the headers went out.
    "body_cut_short": Answer(JSON_HEAD + b"content-length: 1000\r\n\r\n{\"id\":", 201, False, lost=True),
    "bad_chunk": Answer(JSON_HEAD + b"transfer-encoding: chunked\r\n\r\n3\r\n{\"a\r\nzz\r\n", 201, False, lost=True),
    # Not HTTP at all: Envoy's 503.
    "not_http": Answer(b"\x16\x03\x01\x02\x00garbage\r\n\r\n", 503, False, lost=True),
    "close_without_answer": Answer(b"", 503, False, lost=True),
    # HTTP/1.0-style body delimited by the connection's close.
    "close_delimited_body": Answer(JSON_HEAD + b"connection: close\r\n\r\n{\"id\":10}", 201, True),
}


class RawUpstream:
    """An upstream that answers `/raw/<answer>/...` with ANSWERS[answer].wire, verbatim, then
    closes; it counts the requests per path."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((h.LOOPBACK, 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.handle, args=(conn,), daemon=True).start()

    def handle(self, conn: socket.socket):
        with conn:
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            path = lines[0].split(b" ")[1].decode()
            length = 0
            for ln in lines[1:]:
                name, _, value = ln.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            while len(body) < length:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                body += chunk
            with self.lock:
                self.counts[path] = self.counts.get(path, 0) + 1
            answer = ANSWERS[path.split("/")[2]]
            try:
                conn.sendall(answer.wire)
            except OSError:
                pass

    def count(self, path: str) -> int:
        with self.lock:
            return self.counts.get(path, 0)

    def close(self):
        self.sock.close()


@pytest.fixture(scope="module")
def raw_stack(run_dir, artifacts):
    sub = run_dir / "resilience"
    up = RawUpstream()
    store, sport = h.start_idemstore(sub)
    filters = {"default": [h.wasm_filter(plugin_config(), artifacts["wasm"])]}
    envoy = h.start_envoy(sub, "envoy", filters, up.port, sport)
    before = vm_stats(envoy)
    yield envoy, up, before
    envoy.stop()
    store.stop()
    up.close()


def vm_stats(envoy: h.Envoy) -> dict[str, int]:
    """The wasm VM's failure counters; on the native host {} once Envoy is seen running and LIVE
    (`checks.vm_failure_stats`)."""
    stats = vm_failure_stats(envoy)
    return {k: v for k, v in stats.items() if "fail" in k or "reload" in k or "backoff" in k or k.endswith(".created")}


def send(port: int, path: str, key: str) -> h.Response | None:
    """None when the answer is cut short after its headers (Envoy resets the stream)."""
    try:
        return h.request(port, "POST", path, b"{}", [("Idempotency-Key", key), ("content-type", "application/json")],
                         timeout=10)
    except (http.client.HTTPException, ConnectionError):
        return None


@pytest.mark.parametrize("name", list(ANSWERS))
def test_upstream_answer_the_filter_cannot_use(raw_stack, name):
    envoy, up, _ = raw_stack
    answer = ANSWERS[name]
    port = envoy.port("default")
    path = f"/raw/{name}/{uuid.uuid4().hex}"
    key = h.new_key(name)
    stored = envoy.counter("stored")
    released = envoy.counter("released")
    in_doubt = envoy.counter("in_doubt")
    first = send(port, path, key)
    if answer.status is not None and answer.stored:
        assert first is not None and first.status == answer.status, first
    if answer.stored:
        envoy.wait_counter("stored", stored + 1)
    elif answer.lost:
        h.poll_until(lambda: envoy.counter("in_doubt"), in_doubt + 1, timeout=5)
    else:
        h.poll_until(lambda: envoy.counter("released"), released + 1, timeout=5)
    again = send(port, path, key)
    if answer.stored:
        assert again is not None and again.header(REPLAY) == "true", again
        assert again.status == first.status and again.body == first.body, (again, first)
        assert again.header_all("content-type") == first.header_all("content-type"), (again, first)
        for header in ("set-cookie", "keep-alive", "proxy-authenticate"):
            assert again.header(header) is None, (header, again)
        if name == "set_cookie":
            assert first.header_all("set-cookie") == ["session=abc; HttpOnly", "b=2"], first
        assert up.count(path) == 1
    elif answer.lost:
        assert again is not None and again.status == 409, again
        assert b'"code":"outcome-unknown"' in again.body, again
        assert up.count(path) == 1
    else:
        assert again is None or again.header(REPLAY) is None, again
        assert up.count(path) == 2


def test_vm_kept_serving(raw_stack):
    """After every answer above (the file runs top to bottom): no wasm failure, no panic, and a
    normal request is still guarded and replayed."""
    envoy, up, before = raw_stack
    after = vm_stats(envoy)
    assert after == before, (before, after)
    assert not [ln for ln in envoy.log_text().splitlines() if PANIC.search(ln)]
    path = f"/raw/plain/{uuid.uuid4().hex}"
    key = h.new_key("after")
    first = send(envoy.port("default"), path, key)
    assert first.status == 201 and first.header(REPLAY) is None, first
    envoy.wait_counter("stored", 1)
    assert send(envoy.port("default"), path, key).header(REPLAY) == "true"
    assert up.count(path) == 1


def wasm_filters(doc) -> list[dict]:
    found = []
    if isinstance(doc, dict):
        # The Wasm filter itself (inside the composite matcher's ExecuteFilterAction, when wrapped).
        if "envoy.extensions.filters.http.wasm" in str(doc.get("typed_config", {}).get("@type", "")):
            found.append(doc)
        for v in doc.values():
            found += wasm_filters(v)
    elif isinstance(doc, list):
        for v in doc:
            found += wasm_filters(v)
    return found


SHIPPED = sorted((h.ROOT / "envoy").rglob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(h.ROOT)) for p in SHIPPED])
def test_shipped_configs_set_fail_reload(path: Path):
    """A trapped VM is reloaded on the next request (FAIL_RELOAD), not left failed (FAIL_CLOSED
    refuses every request on that worker; FAIL_OPEN silently drops the guarantee)."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    filters = [f for d in docs for f in wasm_filters(d)]
    if path.name == "envoy.yaml":
        assert filters, "the shipped envoy.yaml has no wasm filter?"
    for f in filters:
        policy = f["typed_config"]["config"].get("failure_policy")
        assert policy == "FAIL_RELOAD", (path, policy)
