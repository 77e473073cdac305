"""Records written by the previous version (format 1, `IDR1`) after an upgrade: still replayed as
they were written, never decoded wrongly. A record whose bytes no version wrote is never
replayed: the `begin` is a store fault (the request fails open, counted). The records are put
into Redis by hand, as the previous filter's commit left them (docs/records.md)."""

from __future__ import annotations

import hashlib
import struct

import pytest

from support import harness
from support.checks import REPLAY, assert_executed, assert_problem
from support.harness import new_key
from support.redis_cluster import command


def store_key(subject: str, method: str, route: str, client_key: str) -> str:
    return harness.store_key(client_key, route, subject, method)


def first_format(status: int, headers: list[tuple[str, str]], body: bytes) -> bytes:
    """A record as the previous version encoded it: "IDR1", status, headers, body."""
    out = b"IDR1" + struct.pack(">HH", status, len(headers))
    for name, value in headers:
        out += struct.pack(">H", len(name)) + name.encode() + struct.pack(">I", len(value)) + value.encode()
    return out + body


def redis_port(stack) -> int:
    """The stack's Redis port: its TLS port on a secured store (IDEM_SECURE_STORE), where
    `command` speaks TLS as the admin."""
    argv = stack.redis.argv
    flag = "--tls-port" if "--tls-port" in argv else "--port"
    return int(argv[argv.index(flag) + 1])


def key_prefix(stack) -> str:
    """idemstore's `--key-prefix` (a secured store has one), else none."""
    argv = stack.idemstore.argv
    return argv[argv.index("--key-prefix") + 1] if "--key-prefix" in argv else ""


def put_record(stack, key: str, request_body: bytes, record: bytes) -> None:
    """The record for `POST /orders` (route `orders`) from 127.0.0.1 with `key`, as Redis keeps
    it: the request body's SHA-256 in hex, then the record's bytes."""
    sk = store_key("anon:127.0.0.1", "POST", "orders", key)
    value = hashlib.sha256(request_body).hexdigest().encode() + record
    assert command(redis_port(stack), "SET", f"{key_prefix(stack)}idem:{{{sk}}}:r", value, "PX", 60000) == "OK"


@pytest.fixture
def redis_stack(stack):
    if stack.backend != "redis":
        pytest.skip("writes records into Redis directly")
    return stack


def test_a_first_format_record_still_replays(redis_stack):
    stack = redis_stack
    key = new_key("legacy")
    body = b'{"item":"book"}'
    put_record(stack, key, body, first_format(
        201, [("content-type", "application/json"), ("location", "/things/legacy")], b'{"id":"legacy"}'))
    for _ in range(2):
        retry = stack.post("/orders", body, key)
        assert retry.status == 201, retry
        assert retry.header(REPLAY) == "true", retry
        assert retry.body == b'{"id":"legacy"}', retry
        assert retry.header("content-type") == "application/json", retry
        assert retry.header("location") == "/things/legacy", retry
    # The store still compares its body hash.
    other = stack.post("/orders", b'{"item":"pen"}', key)
    assert assert_problem(other, 422, raw_key=key, code="key-reused")["differs"] == "body"
    assert stack.upstream.count(key=key) == 0


def test_a_record_no_version_wrote_is_never_replayed(redis_stack):
    stack = redis_stack
    for record in [b"IDR9" + first_format(201, [], b"x")[4:], b"IDR1\x01\xf4\x00\x00oops", b"IDR2\x00\xc9\x80\x00\x00"]:
        key = new_key("garbage")
        body = b"{}"
        put_record(stack, key, body, record)
        degraded = stack.counter("degraded")
        resp = stack.post("/orders", body, key)
        # failure_mode open: the request runs (without the guarantee, counted), nothing replayed.
        assert_executed(resp, 201)
        assert stack.counter("degraded") == degraded + 1, record
        assert stack.upstream.count(key=key) == 1
