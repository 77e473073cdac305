"""Which requests are guarded, the key's syntax, and the body limit (413)."""

from __future__ import annotations

import uuid

import pytest

from support import harness as h
from support.checks import REPLAY, assert_executed, assert_problem, assert_replay_of
from support.harness import new_key


def uniq_path() -> str:
    return f"/things/{uuid.uuid4().hex}"


def test_no_key_runs_every_time(stack):
    path = uniq_path()
    before = stack.counter("passthrough")
    for _ in range(3):
        assert_executed(stack.post(path, "{}"), 201)
    assert stack.upstream.count(path=path) == 3
    # Behind the composite matcher, the filter is not created for them: nothing to count.
    assert stack.counter("passthrough") == before + (0 if stack.matcher else 3)


def test_require_key_rejects_missing_key(stack):
    path = uniq_path()
    before = stack.counter("rejected")
    resp = stack.post(path, "{}", listener="require")
    assert_problem(resp, 400)
    assert stack.upstream.count(path=path) == 0
    assert stack.counter("rejected") == before + 1

    # Methods that are not guarded still pass without a key ...
    resp = h.request(stack.port("require"), "GET", path)
    assert resp.status == 201 and resp.header(REPLAY) is None, resp
    # ... and a keyed request is guarded as usual.
    key = new_key()
    first = stack.post(path, "{}", key, listener="require")
    assert_executed(first, 201)
    assert_replay_of(stack.post(path, "{}", key, listener="require"), first)
    assert stack.upstream.count(path=path) == 2


MALFORMED = {
    "empty": [("Idempotency-Key", "")],
    "too_long": [("Idempotency-Key", "k" * 256)],
    "tab": [("Idempotency-Key", "ab\tcd")],
    "non_ascii": [("Idempotency-Key", b"caf\xc3\xa9")],
    "two_headers": [("Idempotency-Key", "one-key"), ("Idempotency-Key", "one-key")],
    "two_different_headers": [("Idempotency-Key", "key-a"), ("Idempotency-Key", "key-b")],
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_key_is_400_problem(stack, case):
    path = uniq_path()
    hdrs = MALFORMED[case] + [("content-type", "application/json")]
    before = stack.counter("rejected")
    resp = h.request(stack.port(), "POST", path, b"{}", hdrs)
    raw = hdrs[0][1]
    assert_problem(resp, 400, raw_key=raw if len(raw) > 3 else None)
    assert stack.upstream.count(path=path) == 0
    assert stack.counter("rejected") == before + 1


@pytest.mark.parametrize("raw", ["ab\x01cd", "ab\x7fcd"])
def test_control_character_key_never_reaches_upstream(stack, raw):
    # Envoy's HTTP/1 codec itself refuses these header values with a plain 400 before any
    # filter runs, so this is Envoy's answer, not the filter's problem document.
    path = uniq_path()
    resp = h.request(stack.port(), "POST", path, b"{}", [("Idempotency-Key", raw)])
    assert resp.status == 400, resp
    assert stack.upstream.count(path=path) == 0


def test_quoted_sf_string_equals_bare_key(stack):
    key = new_key()
    first = stack.post("/orders", "{}", f'"{key}"')
    assert_executed(first, 201)
    retry = stack.post("/orders", "{}", key)
    assert_replay_of(retry, first)
    again = stack.post("/orders", "{}", f'"{key}"')
    assert_replay_of(again, first)
    assert stack.upstream.count(path="/orders", key=f'"{key}"') + stack.upstream.count(path="/orders", key=key) == 1


def test_key_of_max_length_is_accepted(stack):
    key = new_key("m")
    key = key + "x" * (255 - len(key))
    assert len(key) == 255
    first = stack.post("/orders", "{}", key)
    assert_executed(first, 201)
    assert_replay_of(stack.post("/orders", "{}", key), first)
    assert stack.upstream.count(key=key) == 1


def test_body_over_limit_is_413(stack):
    path = uniq_path()
    key = new_key()
    body = b"a" * (1048576 + 1)
    resp = stack.post(path, body, key)
    assert_problem(resp, 413, raw_key=key)
    assert stack.upstream.count(path=path) == 0


def test_body_at_limit_executes_and_replays(stack):
    path = uniq_path()
    key = new_key()
    body = b"b" * 1048576
    first = stack.post(path, body, key)
    doc = assert_executed(first, 201)
    assert doc["body_len"] == 1048576
    assert_replay_of(stack.post(path, body, key), first)
    assert stack.upstream.count(path=path) == 1
