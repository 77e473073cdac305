"""Hostile input, one row per request through the real Envoy: what the client gets back and
whether the upstream executed it. Keys that are not keys, bodies at and past the limit, framing
that lies, HTTP/2 trailers, odd methods. Whoever rejects a row (Envoy's codec or the filter),
nothing unguarded runs for a request that carried a key the filter could not honour, and the VM
keeps serving: the last test checks that no wasm failure counter moved and no panic was logged
(on the native host: Envoy still runs and answers, and the module logged no caught panic).
"""

from __future__ import annotations

import http.client
import socket
import uuid
from dataclasses import dataclass, field
from typing import Callable

import pytest

from support import harness as h
from support.checks import PANIC, REPLAY, assert_problem, vm_failure_stats
from support.h2client import H2Client, H2Error

MEMORY_ONLY = pytest.mark.parametrize("stack", ["memory"], indirect=True)

LIMIT = 1048576  # max_body_bytes default
JSON = ("content-type", "application/json")
# A well-formed key for rows about something else; each row gets its own path, so keys never
# collide across rows (the route is part of the store key).
KEY = "order-7f3a"


@dataclass
class Ctx:
    port: int
    path: str


@dataclass
class Row:
    send: Callable[[Ctx], h.Response | None]
    status: int | None  # None: no HTTP answer at all (connection closed or stream reset)
    executed: int  # times the upstream ran it
    problem: bool = False  # the filter's own application/problem+json
    replay: bool = False  # the same request again is a replay (the upstream count stays)
    guarded: int = 0  # how much `idempotency.guarded` moves
    extra: dict = field(default_factory=dict)


def h1(headers: list, body: bytes | list[bytes] = b"{}", method: str = "POST"):
    def send(c: Ctx):
        return h.request(c.port, method, c.path, body, list(headers) + [JSON], timeout=10)
    return send


def key(value, body: bytes | list[bytes] = b"{}", method: str = "POST"):
    return h1([("Idempotency-Key", value)], body, method)


def raw(build: Callable[[Ctx], bytes], half_close: bool = False):
    """Bytes written as they are; the first answer parsed, None if the connection closes first."""
    def send(c: Ctx):
        with socket.create_connection((h.LOOPBACK, c.port), timeout=10) as s:
            s.sendall(build(c))
            if half_close:
                s.shutdown(socket.SHUT_WR)
            resp = http.client.HTTPResponse(s)
            try:
                resp.begin()
            except (http.client.RemoteDisconnected, ConnectionResetError, http.client.BadStatusLine):
                return None
            body = resp.read()
            return h.Response(resp.status, [(k.lower(), v) for k, v in resp.getheaders()], body)
    return send


def head(c: Ctx, method: str = "POST", extra: str = "") -> str:
    return f"{method} {c.path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{extra}"


def h2(headers: list, body: bytes = b"{}", trailers: list | None = None, content_length: bool = True,
       method: str = "POST"):
    def send(c: Ctx):
        with H2Client(c.port) as cl:
            sid = cl.send(method, c.path, list(headers) + [JSON], body, trailers, content_length)
            try:
                return cl.response(sid, timeout=10)
            except H2Error:
                return None
    return send


ROWS: dict[str, Row] = {
    # --- keys --------------------------------------------------------------------------------
    "key_plain": Row(key("order-1"), 201, 1, replay=True, guarded=2),
    "key_surrounding_spaces_trimmed": Row(key("  order-1  "), 201, 1, replay=True, guarded=2),
    "key_inner_space": Row(key("order 1"), 400, 0, problem=True),
    "key_inner_tab": Row(key("order\t1"), 400, 0, problem=True),
    "key_only_spaces": Row(key("   "), 400, 0, problem=True),
    "key_empty": Row(key(""), 400, 0, problem=True),
    "key_double_quote_inside": Row(key('ord"er'), 201, 1, replay=True, guarded=2),
    "key_sf_string": Row(key('"order-1"'), 201, 1, replay=True, guarded=2),
    "key_sf_string_with_space": Row(key('"order 1"'), 201, 1, replay=True, guarded=2),
    "key_sf_string_escapes": Row(key(r'"a\"b\\c"'), 201, 1, replay=True, guarded=2),
    "key_sf_string_bad_escape": Row(key(r'"a\nb"'), 400, 0, problem=True),
    "key_sf_string_unterminated": Row(key('"order-1'), 400, 0, problem=True),
    "key_sf_string_trailing_junk": Row(key('"order"-1'), 400, 0, problem=True),
    "key_sf_string_empty": Row(key('""'), 400, 0, problem=True),
    "key_comma_list": Row(key("a,b"), 400, 0, problem=True),
    "key_sf_string_with_comma": Row(key('"a,b"'), 201, 1, replay=True, guarded=2),
    "key_unicode_utf8": Row(key("caf\u00e9".encode()), 400, 0, problem=True),
    "key_emoji_utf8": Row(key("\U0001f600".encode()), 400, 0, problem=True),
    "key_latin1_byte": Row(key(b"k\xff"), 400, 0, problem=True),
    # Envoy's HTTP/1 codec refuses NUL (and other controls) in a header value before any filter.
    "key_nul": Row(key(b"ab\x00cd"), 400, 0),
    "key_255": Row(key("k" * 255), 201, 1, replay=True, guarded=2),
    "key_256": Row(key("k" * 256), 400, 0, problem=True),
    "key_10kb": Row(key("k" * 10240), 400, 0, problem=True),
    # Past Envoy's 60 KiB request header limit: Envoy's own 431.
    "key_100kb": Row(key("k" * 102400), 431, 0),
    "key_header_name_upper_case": Row(h1([("IDEMPOTENCY-KEY", "order-1")]), 201, 1, replay=True, guarded=2),
    "key_repeated_95_times": Row(h1([("Idempotency-Key", "order-1")] * 95), 400, 0, problem=True),
    # 100 key headers plus host, content-type, content-length: past Envoy's 100-header limit.
    "key_repeated_100_times": Row(h1([("Idempotency-Key", "order-1")] * 100), 431, 0),
    # Envoy's HTTP/1 parser removes a bare CR inside a header value before any filter: the key
    # is `abcd` (docs/configuration.md, "Keys and scope").
    "key_bare_cr_h1": Row(raw(lambda c: head(c, extra="idempotency-key: ab\rcd\r\ncontent-length: 2\r\n\r\n{}")
                              .encode()), 201, 1, replay=True, guarded=2, extra={"replayed_by": "abcd"}),
    # A key in trailers only is not read: the request is one without a key (unguarded).
    "key_only_in_h1_trailers": Row(
        raw(lambda c: (head(c, extra="transfer-encoding: chunked\r\n\r\n")
                       + f"2\r\n{{}}\r\n0\r\nidempotency-key: {KEY}\r\n\r\n").encode()),
        201, 1, extra={"again_executes": True}),
    "key_only_in_h2_trailers": Row(h2([], b"{}", trailers=[("idempotency-key", KEY)]), 201, 1,
                                   extra={"again_executes": True}),
    "key_repeated_different": Row(h1([("Idempotency-Key", f"k{i}") for i in range(100)][:90]), 400, 0,
                                  problem=True),
    # --- bodies ------------------------------------------------------------------------------
    "body_empty": Row(key(KEY, b""), 201, 1, replay=True, guarded=2),
    "body_at_limit": Row(key(KEY, b"x" * LIMIT), 201, 1, guarded=1),
    "body_one_byte_over": Row(key(KEY, b"x" * (LIMIT + 1)), 413, 0, problem=True, guarded=1),
    "body_binary_with_nul": Row(key(KEY, bytes(range(256)) * 4), 201, 1, replay=True, guarded=2),
    "body_chunked": Row(key(KEY, [b'{"a":', b"1", b"}"]), 201, 1, replay=True, guarded=2),
    "body_chunked_over_limit": Row(key(KEY, [b"x" * 65536] * 16 + [b"x"]), 413, 0, problem=True, guarded=1),
    "body_chunked_empty": Row(key(KEY, []), 201, 1, replay=True, guarded=2),
    # content-length says more than arrives, then the client half-closes: no answer, nothing runs.
    "content_length_longer_than_body": Row(
        raw(lambda c: (head(c, extra=f"idempotency-key: {KEY}\r\ncontent-length: 100\r\n\r\n") + "{}").encode(),
            half_close=True), None, 0, guarded=1),
    # content-length says less: the request is the first 2 bytes; the rest is a second "request"
    # that the codec refuses after the first answer.
    "content_length_shorter_than_body": Row(
        raw(lambda c: (head(c, extra=f"idempotency-key: {KEY}\r\ncontent-length: 2\r\n\r\n") + "{}garbage").encode()),
        201, 1, guarded=1),
    "content_length_and_chunked": Row(
        raw(lambda c: (head(c, extra=f"idempotency-key: {KEY}\r\ncontent-length: 2\r\n"
                                     "transfer-encoding: chunked\r\n\r\n") + "2\r\n{}\r\n0\r\n\r\n").encode()),
        400, 0),
    "content_length_twice_different": Row(
        raw(lambda c: (head(c, extra=f"idempotency-key: {KEY}\r\ncontent-length: 2\r\n"
                                     "content-length: 3\r\n\r\n") + "{}}").encode()),
        400, 0),
    "content_length_not_a_number": Row(
        raw(lambda c: (head(c, extra=f"idempotency-key: {KEY}\r\ncontent-length: 2x\r\n\r\n") + "{}").encode()),
        400, 0),
    # --- methods -----------------------------------------------------------------------------
    # Envoy's HTTP/1 codec refuses a method that is not upper case.
    "method_lower_case": Row(key(KEY, method="post"), 400, 0),
    # Over HTTP/2 it reaches the filter. Methods are case-sensitive (RFC 9110 9.1), but some
    # frameworks match them case-insensitively (Express lower-cases them), so `post` is guarded
    # as `POST` and shares its records: an unguarded duplicate is the failure this filter exists
    # to prevent.
    "method_lower_case_h2": Row(h2([("idempotency-key", KEY)], method="post"), 201, 1, replay=True, guarded=2),
    "method_put_not_guarded": Row(key(KEY, method="PUT"), 201, 1, guarded=0, extra={"again_executes": True}),
    "method_patch_guarded": Row(key(KEY, method="PATCH"), 201, 1, replay=True, guarded=2),
    # --- HTTP/2 ------------------------------------------------------------------------------
    "h2_key": Row(h2([("idempotency-key", KEY)]), 201, 1, replay=True, guarded=2),
    "h2_trailers": Row(h2([("idempotency-key", KEY)], b'{"a":1}', trailers=[("x-checksum", "abc")]), 201, 1,
                       replay=True, guarded=2),
    "h2_trailers_no_body": Row(h2([("idempotency-key", KEY)], b"", trailers=[("x-checksum", "abc")]), 201, 1,
                               replay=True, guarded=2),
    "h2_no_content_length": Row(h2([("idempotency-key", KEY)], b'{"a":1}', content_length=False), 201, 1,
                                replay=True, guarded=2),
    # HTTP/2 content-length that does not match the DATA: Envoy resets the stream.
    "h2_content_length_lies": Row(h2([("idempotency-key", KEY), ("content-length", "100")], b"{}"), None, 0,
                                  guarded=1),
    "h2_key_sf_string": Row(h2([("idempotency-key", '"a b"')]), 201, 1, replay=True, guarded=2),
    "h2_key_non_ascii": Row(h2([("idempotency-key", "caf\u00e9")]), 400, 0, problem=True),
    "h2_two_key_headers": Row(h2([("idempotency-key", "a"), ("idempotency-key", "b")]), 400, 0, problem=True),
}


@MEMORY_ONLY
@pytest.mark.parametrize("name", list(ROWS))
def test_hostile_input(stack, vm_before, name):
    row = ROWS[name]
    ctx = Ctx(stack.port(), f"/hostile/{name}/{uuid.uuid4().hex}")
    guarded = stack.counter("guarded")
    resp = row.send(ctx)
    if row.status is None:
        assert resp is None, resp
    else:
        assert resp is not None, f"{name}: no answer"
        assert resp.status == row.status, resp
        assert resp.header(REPLAY) is None, resp
    if row.problem:
        assert_problem(resp, row.status)
    elif resp is not None and resp.status >= 400:
        # Envoy's own refusals, or the filter's 413 problem: never the upstream's.
        assert resp.header("x-upstream-id") is None, resp
    if row.replay:
        again = row.send(ctx)
        assert again is not None and again.status == row.status and again.header(REPLAY) == "true", again
        assert again.body == resp.body, (again, resp)
    if "replayed_by" in row.extra:
        other = key(row.extra["replayed_by"])(ctx)
        assert other.status == row.status and other.header(REPLAY) == "true", other
        assert other.body == resp.body, (other, resp)
    if row.extra.get("again_executes"):
        again = row.send(ctx)
        assert again is not None and again.status == row.status and again.header(REPLAY) is None, again
    want = row.executed + (1 if row.extra.get("again_executes") else 0)
    # The count is read after the answer: an execution that was going to happen has happened.
    assert stack.upstream.count(path=ctx.path) == want, name
    assert stack.counter("guarded") - guarded == row.guarded + ("replayed_by" in row.extra), name


def vm_stats(stack) -> dict[str, int]:
    """Counters that move when a wasm VM fails (trap -> reload under FAIL_RELOAD, or refused
    within the reload backoff) and the number of V8 VMs ever created (a reload creates one);
    on the native host, {} once Envoy is seen running and LIVE (`checks.vm_failure_stats`)."""
    stats = vm_failure_stats(stack.envoy)
    return {k: v for k, v in stats.items() if "fail" in k or "reload" in k or "backoff" in k or k.endswith(".created")}


@pytest.fixture(scope="module")
def vm_before(stack):
    return vm_stats(stack)


@MEMORY_ONLY
def test_hostile_rows_left_the_vm_serving(stack, vm_before):
    """After the table (pytest runs this file top to bottom): the VM never failed."""
    after = vm_stats(stack)
    assert after == vm_before, (vm_before, after)
    assert not {k: v for k, v in after.items() if not k.endswith(".created") and v}, after
    bad = [ln for ln in stack.envoy.log_text().splitlines() if PANIC.search(ln)]
    assert not bad, bad[:10]
    k = "order-after-hostile"
    first = stack.post(f"/hostile/after/{uuid.uuid4().hex}", "{}", k)
    assert first.status == 201 and first.header(REPLAY) is None, first


def test_table_has_at_least_30_rows():
    assert len(ROWS) >= 30
