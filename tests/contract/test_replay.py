"""Store and replay: the first request executes and is stored, its retries replay it, the same
key with another body is a 422, and what is not stored."""

from __future__ import annotations

import json

import pytest

from support import harness as h
from support.checks import REPLAY, assert_executed, assert_problem, assert_replay_of
from support.harness import new_key


def test_first_executes_then_five_retries_replay(stack):
    key = new_key()
    body = json.dumps({"item": "book", "qty": 2})
    before = stack.envoy.counters()

    first = stack.post("/orders", body, key)
    doc = assert_executed(first, 201)
    assert doc["key"] == key and doc["body"] == body
    assert first.header("location") == f"/things/{doc['id']}"
    assert first.header("content-type") == "application/json"

    for _ in range(5):
        retry = stack.post("/orders", body, key)
        assert_replay_of(retry, first)
        assert stack.upstream.count(key=key) == 1

    after = stack.envoy.counters()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta.get("guarded") == 6, delta
    assert delta.get("executed") == 1, delta
    assert delta.get("replayed") == 5, delta
    assert stack.wait_counter("stored", before.get("stored", 0) + 1) == before.get("stored", 0) + 1
    assert stack.upstream.count(key=key) == 1


def test_no_content_replays_as_bare_204(stack):
    key = new_key()
    first = stack.post("/orders", "{}", key, headers=[("x-test-status", "204")])
    assert_executed(first, 204)
    assert first.body == b""

    retry = stack.post("/orders", "{}", key, headers=[("x-test-status", "204")])
    assert retry.status == 204, retry
    assert retry.body == b""
    assert retry.header(REPLAY) == "true", retry
    assert retry.header("location") == first.header("location")
    assert stack.upstream.count(key=key) == 1


def test_json_suffix_content_type_is_stored(stack):
    key = new_key()
    hdrs = [("x-test-content-type", "application/vnd.example+json; charset=utf-8")]
    first = stack.post("/orders", "{}", key, headers=hdrs)
    assert_executed(first, 201)
    retry = stack.post("/orders", "{}", key, headers=hdrs)
    assert_replay_of(retry, first)
    assert stack.upstream.count(key=key) == 1


def test_same_key_different_body_is_422(stack):
    key = new_key()
    first = stack.post("/orders", json.dumps({"item": "a"}), key)
    assert_executed(first, 201)
    before = stack.counter("mismatched")

    other = stack.post("/orders", json.dumps({"item": "b"}), key)
    doc = assert_problem(other, 422, raw_key=key)
    assert key not in doc["detail"]
    assert stack.upstream.count(key=key) == 1
    assert stack.counter("mismatched") == before + 1

    # The record is untouched: the original body still replays.
    again = stack.post("/orders", json.dumps({"item": "a"}), key)
    assert_replay_of(again, first)
    assert stack.upstream.count(key=key) == 1


@pytest.mark.parametrize("status", [400, 500, 302])
def test_non_2xx_is_not_stored(stack, status):
    key = new_key()
    hdrs = [("x-test-status", str(status))]
    first = stack.post("/orders", "{}", key, headers=hdrs)
    assert_executed(first, status)
    retry = stack.post("/orders", "{}", key, headers=hdrs)
    assert_executed(retry, status)
    assert retry.body != first.body  # a fresh execution, a fresh id
    assert stack.upstream.count(key=key) == 2

    # Once it succeeds, it is stored.
    ok = stack.post("/orders", "{}", key)
    assert_executed(ok, 201)
    assert_replay_of(stack.post("/orders", "{}", key), ok)
    assert stack.upstream.count(key=key) == 3


def test_2xx_text_plain_is_stored_and_replayed(stack):
    key = new_key()
    hdrs = [("x-test-content-type", "text/plain"), ("x-test-body", "created")]
    first = stack.post("/orders", "{}", key, headers=hdrs)
    assert_executed(first, 201)
    assert first.body == b"created"
    retry = stack.post("/orders", "{}", key, headers=hdrs)
    assert_replay_of(retry, first)
    assert retry.header("content-type") == "text/plain"
    assert stack.upstream.count(key=key) == 1


def test_unguarded_method_with_key_runs_every_time(stack):
    key = new_key()
    for _ in range(2):
        resp = h.request(stack.port(), "PUT", "/orders", b"{}", [("Idempotency-Key", key)])
        assert_executed(resp, 201)
    assert stack.upstream.count(key=key) == 2


@pytest.mark.parametrize("status", [200, 202])
def test_other_2xx_replay_with_their_status(stack, status):
    key = new_key()
    hdrs = [("x-test-status", str(status))]
    first = stack.post("/orders", "{}", key, headers=hdrs)
    assert_executed(first, status)
    assert_replay_of(stack.post("/orders", "{}", key, headers=hdrs), first)
    assert stack.upstream.count(key=key) == 1


def test_patch_is_guarded(stack):
    key = new_key()
    hdrs = [("Idempotency-Key", key), ("content-type", "application/json")]
    first = h.request(stack.port(), "PATCH", "/orders/ord_1", b'{"qty":3}', hdrs)
    assert_executed(first, 201)
    retry = h.request(stack.port(), "PATCH", "/orders/ord_1", b'{"qty":3}', hdrs)
    assert_replay_of(retry, first)
    assert stack.upstream.count(key=key) == 1


def test_chunked_request_body_hashes_like_a_sized_one(stack):
    key = new_key()
    body = b'{"item":"book","note":"' + b"n" * 3000 + b'"}'
    first = stack.post("/orders", [body[:10], body[10:1500], body[1500:]], key)
    assert_executed(first, 201)
    # The same bytes with a content-length: the same request.
    assert_replay_of(stack.post("/orders", body, key), first)
    # Different bytes, chunked: a mismatch.
    assert_problem(stack.post("/orders", [body[:-2], b'x"}'], key), 422, raw_key=key)
    assert stack.upstream.count(key=key) == 1


def test_large_response_within_record_limit_replays_exactly(stack):
    key = new_key()
    hdrs = [("x-test-body-bytes", str(512 * 1024))]
    first = stack.post("/orders", "{}", key, headers=hdrs)
    assert_executed(first, 201)
    assert len(first.body) == 512 * 1024
    assert_replay_of(stack.post("/orders", "{}", key, headers=hdrs), first)
    assert stack.upstream.count(key=key) == 1


def test_response_over_record_limit_is_recorded_without_its_body(stack):
    key = new_key()
    hdrs = [("x-test-body-bytes", str(1048576 + 1024))]
    first = stack.post("/orders", "{}", key, headers=hdrs)
    assert_executed(first, 201)
    assert len(first.body) == 1048576 + 1024
    stack.wait_counter("stored", 1)
    retry = stack.post("/orders", "{}", key, headers=hdrs)
    assert retry.status == 201, retry
    assert retry.body == b"", retry
    assert retry.header(REPLAY) == "true", retry
    assert retry.header("x-idempotent-body-omitted") == "true", retry
    assert retry.header("location") == first.header("location"), retry
    assert stack.upstream.count(key=key) == 1