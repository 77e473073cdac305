"""Record format v2: what a record answers and what it holds.

The fingerprint covers the target (method, path and query as received) and the headers in
`fingerprint_headers`, besides the body (as JSON under `fingerprint_json`); every `2xx` is kept
whatever its content type, its bytes exact, except streams; representation headers
(content-type, content-encoding, content-range) are always recorded, and a stored coding the
retry does not accept is a `406`; an answer over `max_record_bytes` is kept without its body;
`store_statuses`, `store_content_types`, `lock_wait_ms: 0` with `retry-after`; and every
problem carries its `code`. Each test runs on both backends (the `stack` fixture).
"""

from __future__ import annotations

import base64
import gzip
import math
import threading
import time

import pytest

from support import harness as h
from support.checks import REPLAY, assert_executed, assert_problem, assert_replay_of
from support.harness import new_key

OMITTED = "x-idempotent-body-omitted"
MIB = 1024 * 1024


def b64(data: bytes) -> str:
    """An `x-test-body-b64` value."""
    return base64.b64encode(data).decode()


def all_bytes(n: int) -> bytes:
    """What `x-test-body-pattern: allbytes:N` answers."""
    unit = bytes(range(256))
    return (unit * (n // 256 + 1))[:n]


def text_bytes(n: int) -> bytes:
    """What `x-test-body-pattern: text:N` answers."""
    unit = b"0123456789abcdef"
    return (unit * (n // len(unit) + 1))[:n]


def wait_executing(stack, key: str, timeout: float = 5.0) -> None:
    """Until the upstream has started the original (so it holds the lock)."""
    deadline = time.monotonic() + timeout
    while stack.upstream.count(key=key) == 0:
        assert time.monotonic() < deadline, "the original never reached the upstream"
        time.sleep(0.01)


def wait_stored(stack, before: int) -> None:
    """Until the commit after a response is counted (commits follow the response)."""
    assert stack.wait_counter("stored", before + 1) >= before + 1, "the answer was never stored"


def delta(stack, before: dict[str, int]) -> dict[str, int]:
    after = stack.envoy.counters()
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}


# --------------------------------------------------------------------------------------------
# a. the target is part of the fingerprint
# --------------------------------------------------------------------------------------------

TARGETS = {
    # route `orders` (prefix /orders): one scope for both targets
    "query": ("/orders?coupon=A", "/orders?coupon=B"),
    "path": ("/orders/1/freeze", "/orders/2/freeze"),
    # the unnamed route scopes by the path without its query: the query still counts
    "query_unnamed_route": ("/misc/checkout?coupon=A", "/misc/checkout?coupon=B"),
}


@pytest.mark.parametrize("case", sorted(TARGETS))
def test_same_key_another_target_is_422_target(stack, case):
    original_path, other_path = TARGETS[case]
    key = new_key()
    first = stack.post(original_path, "{}", key)
    doc = assert_executed(first, 201)
    assert doc["path"] == original_path
    before = stack.counter("mismatched")

    other = stack.post(other_path, "{}", key)
    doc = assert_problem(other, 422, raw_key=key, code="key-reused")
    assert doc["differs"] == "target", doc
    assert "header" not in doc, doc
    assert stack.upstream.count(key=key) == 1
    assert stack.wait_counter("mismatched", before + 1) == before + 1

    # The record is untouched: the original target still replays, the other one is still a 422.
    assert_replay_of(stack.post(original_path, "{}", key), first)
    assert_problem(stack.post(other_path, "{}", key), 422, code="key-reused")
    assert stack.upstream.count(key=key) == 1


# --------------------------------------------------------------------------------------------
# b. every 2xx is kept whatever its content type, bytes exact
# --------------------------------------------------------------------------------------------

ANSWERS = {
    "text_plain": ([("x-test-content-type", "text/plain; charset=utf-8"),
                    ("x-test-body-b64", b64(b"order 42 accepted\r\n\xc3\xa9\n"))], b"order 42 accepted\r\n\xc3\xa9\n"),
    "xml": ([("x-test-content-type", "application/xml"),
             ("x-test-body", '<?xml version="1.0"?><order id="42" state="accepted"/>')],
            b'<?xml version="1.0"?><order id="42" state="accepted"/>'),
    "octet_stream_64k_all_bytes": ([("x-test-content-type", "application/octet-stream"),
                                    ("x-test-body-pattern", "allbytes:65536")], all_bytes(65536)),
    "no_content_type": ([("x-test-no-content-type", "1"), ("x-test-body-b64", b64(b"\x00\xff\r\n\x80 \x1f\x8b"))],
                        b"\x00\xff\r\n\x80 \x1f\x8b"),
}


@pytest.mark.parametrize("case", sorted(ANSWERS))
def test_any_2xx_content_type_executes_once_and_replays_byte_identical(stack, case):
    hdrs, body = ANSWERS[case]
    key = new_key()
    stored = stack.counter("stored")
    first = stack.post("/orders", "{}", key, headers=hdrs)
    assert_executed(first, 201)
    assert first.body == body
    wait_stored(stack, stored)

    # The content type is checked on its own below where Envoy's local reply changes it.
    kept = ("location",) if case == "no_content_type" else ("content-type", "location")
    for _ in range(2):
        retry = stack.post("/orders", "{}", key, headers=hdrs)
        assert_replay_of(retry, first, kept=kept)
        assert retry.body == body
        assert retry.header(OMITTED) is None, retry
    assert stack.upstream.count(key=key) == 1


# Envoy's local reply (the filter's replay is one) removes content-type when the body is empty
# and sets `text/plain` when there is a body and no content-type (Utility::prepareLocalReply,
# measured with 1.40.0): the filter undoes both in its response callback, so that a replay
# keeps the stored header, or its absence.
CT_PROBES = {
    # upstream headers, the content type the upstream sends (None: none)
    "body_omitted": ([("x-test-content-type", "application/octet-stream"),
                      ("x-test-body-pattern", f"allbytes:{2 * MIB}")], "application/octet-stream"),
    "body_without_content_type": ([("x-test-no-content-type", "1"), ("x-test-body", "abc")], None),
    "empty_body_with_content_type": ([("x-test-content-type", "application/json"),
                                      ("x-test-body", "")], "application/json"),
    "204_with_content_type": ([("x-test-status", "204"), ("x-test-content-type", "text/plain")], "text/plain"),
}


@pytest.mark.parametrize("case", sorted(CT_PROBES))
def test_replay_keeps_the_content_type_exactly(stack, case):
    hdrs, ctype = CT_PROBES[case]
    key = new_key()
    stored = stack.counter("stored")
    first = stack.post("/orders", "{}", key, headers=hdrs)
    assert first.header(REPLAY) is None and first.header("content-type") == ctype, first
    wait_stored(stack, stored)
    retry = stack.post("/orders", "{}", key, headers=hdrs)
    assert retry.header(REPLAY) == "true", retry
    if case == "body_omitted":
        assert (retry.status, retry.body, retry.header(OMITTED)) == (first.status, b"", "true"), retry
    else:
        assert (retry.status, retry.body) == (first.status, first.body), (retry, first)
    assert retry.header("content-type") == ctype, retry
    assert stack.upstream.count(key=key) == 1


# --------------------------------------------------------------------------------------------
# c. a content coding is recorded, and replayed only to a retry that accepts it
# --------------------------------------------------------------------------------------------

def test_gzip_answer_replays_to_gzip_retries_and_is_406_for_others(stack):
    key = new_key()
    plain = text_bytes(20000)
    hdrs = [("x-test-gzip", "1"), ("x-test-content-type", "text/plain"),
            ("x-test-body-pattern", "text:20000")]
    stored = stack.counter("stored")
    first = stack.post("/orders", "{}", key, headers=hdrs + [("accept-encoding", "gzip")])
    assert_executed(first, 201)
    assert first.header("content-encoding") == "gzip", first
    assert gzip.decompress(first.body) == plain
    # The harness sends no accept-encoding unless told: the first request carried exactly one.
    (ex,) = stack.upstream.executions(key=key, headers=True)
    assert [v for n, v in ex["headers"] if n == "accept-encoding"] == ["gzip"], ex
    wait_stored(stack, stored)

    kept = ("content-type", "location", "content-encoding")
    for accept in ["gzip", "br, gzip;q=0.5", "*", "x-gzip"]:
        replay = stack.post("/orders", "{}", key, headers=[("accept-encoding", accept)])
        assert_replay_of(replay, first, kept=kept)
        assert replay.header("content-encoding") == "gzip", (accept, replay)
        assert gzip.decompress(replay.body) == plain

    before = stack.envoy.counters()
    refusals = [None, "br", "gzip;q=0", "identity"]
    for accept in refusals:
        extra = [] if accept is None else [("accept-encoding", accept)]
        resp = stack.post("/orders", "{}", key, headers=extra)
        doc = assert_problem(resp, 406, raw_key=key, code="encoding-not-acceptable")
        assert "gzip" in doc["detail"], doc
        assert resp.header("content-encoding") is None, resp
    d = delta(stack, before)
    assert d.get("rejected") == len(refusals), d
    assert d.get("executed", 0) == 0 and d.get("replayed", 0) == 0, d
    assert stack.upstream.count(key=key) == 1

    # Asked again with the coding, the same stored bytes.
    replay = stack.post("/orders", "{}", key, headers=[("accept-encoding", "gzip")])
    assert_replay_of(replay, first, kept=kept)
    assert stack.upstream.count(key=key) == 1


# --------------------------------------------------------------------------------------------
# d. answers over max_record_bytes
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("framing", ["content_length", "chunked"])
def test_answer_over_record_limit_runs_once_and_replays_without_body(stack, framing):
    size = 2 * MIB
    hdrs = [("x-test-content-type", "application/octet-stream"),
            ("x-test-body-pattern", f"allbytes:{size}")]
    if framing == "chunked":
        hdrs.append(("x-test-chunked", "1"))
    key = new_key()
    stored = stack.counter("stored")
    first = stack.post("/orders", "{}", key, headers=hdrs)
    assert_executed(first, 201)
    assert first.body == all_bytes(size)  # the client got all of it
    if framing == "chunked":
        assert first.header("content-length") is None, first
    wait_stored(stack, stored)

    for _ in range(2):
        retry = stack.post("/orders", "{}", key, headers=hdrs)
        assert retry.status == first.status, retry
        assert retry.body == b"", retry
        assert retry.header(REPLAY) == "true", retry
        assert retry.header(OMITTED) == "true", retry
        # content-type: see test_replay_keeps_the_content_type_exactly[body_omitted]
        assert retry.header("location") == first.header("location"), retry
        assert retry.header("x-upstream-id") is None, retry
    assert stack.upstream.count(key=key) == 1


@pytest.mark.parametrize("framing", ["content_length", "chunked"])
def test_release_large_runs_an_answer_over_the_limit_again(stack, framing):
    """`record_too_large: release` (max_record_bytes 64 KiB): the old behaviour."""
    hdrs = [("x-test-body-bytes", str(100 * 1024))]
    if framing == "chunked":
        hdrs.append(("x-test-chunked", "1"))
    key = new_key()
    released = stack.counter("released")
    first = stack.post("/orders", "{}", key, listener="release_large", headers=hdrs)
    assert_executed(first, 201)
    assert len(first.body) == 100 * 1024
    assert stack.wait_counter("released", released + 1) >= released + 1
    retry = stack.post("/orders", "{}", key, listener="release_large", headers=hdrs)
    assert_executed(retry, 201)
    assert len(retry.body) == 100 * 1024 and retry.body != first.body  # a fresh execution
    assert retry.header(OMITTED) is None, retry
    assert stack.upstream.count(key=key) == 2

    # Within the limit it is kept as usual.
    small = new_key()
    ok = stack.post("/orders", "{}", small, listener="release_large", headers=[("x-test-body-bytes", "60000")])
    assert_executed(ok, 201)
    assert_replay_of(stack.post("/orders", "{}", small, listener="release_large"), ok)
    assert stack.upstream.count(key=small) == 1


# --------------------------------------------------------------------------------------------
# e. twenty duplicates at once, a text/plain original
# --------------------------------------------------------------------------------------------

def test_twenty_concurrent_duplicates_of_a_text_plain_answer_execute_once(stack):
    key = new_key()
    # The default JSON document (a fresh id per execution) sent as text/plain: two executions
    # could not give identical answers.
    hdrs = [("x-test-sleep-ms", "500"), ("x-test-content-type", "text/plain")]
    n = 20
    barrier = threading.Barrier(n)

    def one():
        barrier.wait(10)
        return stack.post("/orders", '{"item":"x"}', key, headers=hdrs)

    runs = [h.in_thread(one) for _ in range(n)]
    resps = [h.joined(t, out) for t, out in runs]
    assert stack.upstream.count(key=key) == 1
    originals = [r for r in resps if r.header(REPLAY) is None]
    assert len(originals) == 1, resps
    original = originals[0]
    assert_executed(original, 201)
    assert original.header("content-type") == "text/plain", original
    for r in resps:
        assert (r.status, r.body) == (original.status, original.body), (r, original)
        if r is not original:
            assert_replay_of(r, original)


# --------------------------------------------------------------------------------------------
# f. lock_wait_ms 0: a duplicate in flight is a 409 at once, retry-after from the lock
# --------------------------------------------------------------------------------------------

def test_no_lock_wait_duplicate_is_409_at_once_with_retry_after(stack):
    key = new_key()
    hdrs = [("x-test-sleep-ms", "2000")]
    conflicted, stored = stack.counter("conflicted"), stack.counter("stored")
    t0 = time.monotonic()
    t1, o1 = h.in_thread(lambda: stack.post("/orders", "{}", key, listener="strict", headers=hdrs))
    wait_executing(stack, key)

    dup = stack.post("/orders", "{}", key, listener="strict", headers=hdrs)
    age = time.monotonic() - t0  # the lock is at most this old
    assert_problem(dup, 409, raw_key=key, code="request-in-flight")
    assert dup.elapsed < 1.0, dup.elapsed
    ra = dup.header("retry-after")
    assert ra is not None and ra.isdigit(), dup
    # lock_ttl_ms is 10000: what is left of it, in whole seconds rounded up.
    assert 1 <= int(ra) <= 10, ra
    assert int(ra) >= math.floor(10 - age), (ra, age)
    assert stack.wait_counter("conflicted", conflicted + 1) == conflicted + 1

    original = h.joined(t1, o1)
    assert_executed(original, 201)
    assert dup.elapsed < original.elapsed
    wait_stored(stack, stored)
    assert_replay_of(stack.post("/orders", "{}", key, listener="strict"), original)
    assert stack.upstream.count(key=key) == 1


# --------------------------------------------------------------------------------------------
# g. store_statuses
# --------------------------------------------------------------------------------------------

def test_store_statuses_keeps_a_404_and_the_default_releases_it(stack):
    hdrs = [("x-test-status", "404")]
    key = new_key()
    first = stack.post("/orders", "{}", key, listener="statuses", headers=hdrs)
    assert_executed(first, 404)
    for _ in range(2):
        assert_replay_of(stack.post("/orders", "{}", key, listener="statuses", headers=hdrs), first)
    assert stack.upstream.count(key=key) == 1

    # 5xx is not listed: released, runs again.
    key5 = new_key()
    hdrs5 = [("x-test-status", "503")]
    assert_executed(stack.post("/orders", "{}", key5, listener="statuses", headers=hdrs5), 503)
    assert_executed(stack.post("/orders", "{}", key5, listener="statuses", headers=hdrs5), 503)
    assert stack.upstream.count(key=key5) == 2

    # The default keeps 2xx only: the 404 gives the lock back and its retry runs.
    other = new_key()
    released = stack.counter("released")
    first = stack.post("/orders", "{}", other, headers=hdrs)
    assert_executed(first, 404)
    assert stack.wait_counter("released", released + 1) >= released + 1
    retry = stack.post("/orders", "{}", other, headers=hdrs)
    assert_executed(retry, 404)
    assert retry.body != first.body
    assert stack.upstream.count(key=other) == 2


# --------------------------------------------------------------------------------------------
# h. every problem the filter makes carries its code
# --------------------------------------------------------------------------------------------

def _problem_400_two_keys(stack):
    hdrs = [("Idempotency-Key", "key-a"), ("Idempotency-Key", "key-b"), ("content-type", "application/json")]
    return h.request(stack.port(), "POST", "/orders", b"{}", hdrs), 400, "invalid-key", None


def _problem_400_empty_key(stack):
    return stack.post("/orders", "{}", ""), 400, "invalid-key", None


def _problem_400_missing_key(stack):
    return stack.post("/orders", "{}", listener="require"), 400, "missing-key", None


def _problem_413(stack):
    key = new_key()
    return stack.post("/orders", b"x" * (MIB + 1), key), 413, "body-too-large", key


def _problem_422(stack):
    key = new_key()
    assert_executed(stack.post("/orders", '{"a":1}', key), 201)
    return stack.post("/orders", '{"a":2}', key), 422, "key-reused", key


def _problem_409(stack):
    key = new_key()
    t, o = h.in_thread(lambda: stack.post("/orders", "{}", key, listener="strict",
                                          headers=[("x-test-sleep-ms", "800")]))
    wait_executing(stack, key)
    resp = stack.post("/orders", "{}", key, listener="strict")
    assert_executed(h.joined(t, o), 201)
    return resp, 409, "request-in-flight", key


def _problem_406(stack):
    key = new_key()
    stored = stack.counter("stored")
    hdrs = [("x-test-gzip", "1"), ("x-test-content-type", "text/plain"), ("accept-encoding", "gzip")]
    assert_executed(stack.post("/orders", "{}", key, headers=hdrs), 201)
    wait_stored(stack, stored)
    return stack.post("/orders", "{}", key), 406, "encoding-not-acceptable", key


PROBLEMS = {
    "400_two_keys": _problem_400_two_keys,
    "400_empty_key": _problem_400_empty_key,
    "400_missing_key": _problem_400_missing_key,
    "413_body_too_large": _problem_413,
    "422_key_reused": _problem_422,
    "409_in_flight": _problem_409,
    "406_encoding": _problem_406,
}


@pytest.mark.parametrize("case", sorted(PROBLEMS))
def test_every_problem_carries_its_code(stack, case):
    resp, status, code, key = PROBLEMS[case](stack)
    doc = assert_problem(resp, status, raw_key=key, code=code)
    if code == "key-reused":
        assert doc["differs"] == "body", doc
    else:
        assert "differs" not in doc and "header" not in doc, doc
    if key is not None:
        assert stack.upstream.count(key=key) <= 1


# --------------------------------------------------------------------------------------------
# i. fingerprint_headers and fingerprint_json
# --------------------------------------------------------------------------------------------

def test_fingerprinted_header_changed_is_422_header(stack):
    key = new_key()
    post = lambda tenant_hdrs: stack.post("/orders", "{}", key, listener="fingerprint", headers=tenant_hdrs)
    before = stack.counter("mismatched")
    first = post([("x-tenant", "t1")])
    assert_executed(first, 201)
    assert_replay_of(post([("x-tenant", "t1")]), first)

    for hdrs in ([("x-tenant", "t2")], [], [("x-tenant", "")], [("x-tenant", "t1"), ("x-tenant", "t1")]):
        doc = assert_problem(post(hdrs), 422, raw_key=key, code="key-reused")
        assert doc["differs"] == "header" and doc["header"] == "x-tenant", (hdrs, doc)
        assert "t1" not in doc["detail"] and "t2" not in doc["detail"], doc
    assert stack.wait_counter("mismatched", before + 4) == before + 4
    assert_replay_of(post([("x-tenant", "t1")]), first)
    assert stack.upstream.count(key=key) == 1


def test_fingerprint_json_ignores_order_whitespace_and_ignored_members(stack):
    key = new_key()
    post = lambda body: stack.post("/orders", body, key, listener="fingerprint", headers=[("x-tenant", "t1")])
    first = post('{"sku":"book","qty":2,"client_sent_at":"2025-01-01T00:00:00Z","ship":{"to":"A","by":"air"}}')
    assert_executed(first, 201)
    for same in [
        '{"client_sent_at":"2025-01-01T00:00:09Z","ship":{"by":"air","to":"A"},"qty":2,"sku":"book"}',
        ' {\n  "sku" : "book",\n\t"qty": 2,\n  "ship": { "to": "A", "by": "air" }\n}\n',
        '{"sku":"book","qty":2,"ship":{"to":"A","by":"air"}}',
    ]:
        assert_replay_of(post(same), first)
    before = stack.counter("mismatched")
    for other in [
        '{"sku":"book","qty":3,"client_sent_at":"2025-01-01T00:00:00Z","ship":{"to":"A","by":"air"}}',
        '{"sku":"book","qty":2.0,"client_sent_at":"2025-01-01T00:00:00Z","ship":{"to":"A","by":"air"}}',
        '{"sku":"book","qty":2,"ship":{"to":"B","by":"air"}}',
    ]:
        doc = assert_problem(post(other), 422, raw_key=key, code="key-reused")
        assert doc["differs"] == "body", doc
    assert stack.wait_counter("mismatched", before + 3) == before + 3
    assert stack.upstream.count(key=key) == 1


def test_fingerprint_json_compares_a_non_json_body_as_bytes(stack):
    key = new_key()
    post = lambda body: stack.post("/orders", body, key, listener="fingerprint", headers=[("x-tenant", "t1")])
    first = post(b"sku=book&qty=2")
    assert_executed(first, 201)
    assert_replay_of(post(b"sku=book&qty=2"), first)
    doc = assert_problem(post(b"qty=2&sku=book"), 422, raw_key=key, code="key-reused")
    assert doc["differs"] == "body", doc
    assert stack.upstream.count(key=key) == 1



def test_fingerprint_json_never_takes_serde_jsons_number_key_for_a_number(stack):
    """The JSON parser reads `{"$serde_json::private::Number":"123"}` as the number 123: such a
    body is compared as bytes, so a retry with the body `123` is another request, not a replay."""
    key = new_key()
    post = lambda body: stack.post("/orders", body, key, listener="fingerprint", headers=[("x-tenant", "t1")])
    token_body = '{"$serde_json::private::Number":"123"}'
    first = post(token_body)
    assert_executed(first, 201)
    assert_replay_of(post(token_body), first)
    for other in ["123", '{"\\u0024serde_json::private::Number":"123"}', ' {"$serde_json::private::Number":"123"}']:
        doc = assert_problem(post(other), 422, raw_key=key, code="key-reused")
        assert doc["differs"] == "body", (other, doc)
    assert stack.upstream.count(key=key) == 1

# --------------------------------------------------------------------------------------------
# j. store_content_types narrows; k. streams are never kept
# --------------------------------------------------------------------------------------------

def test_store_content_types_keeps_only_the_listed_types(stack):
    text = [("x-test-content-type", "text/plain"), ("x-test-body", "created")]
    key = new_key()
    assert_executed(stack.post("/orders", "{}", key, listener="json_only", headers=text), 201)
    assert_executed(stack.post("/orders", "{}", key, listener="json_only", headers=text), 201)
    assert stack.upstream.count(key=key) == 2

    problem = [("x-test-content-type", "application/problem+json")]
    key = new_key()
    first = stack.post("/orders", "{}", key, listener="json_only", headers=problem)
    assert_executed(first, 201)
    assert first.header("content-type") == "application/problem+json"
    assert_replay_of(stack.post("/orders", "{}", key, listener="json_only", headers=problem), first)
    assert stack.upstream.count(key=key) == 1


@pytest.mark.parametrize("ctype", ["text/event-stream", "multipart/x-mixed-replace; boundary=frame"])
def test_streams_are_not_stored(stack, ctype):
    hdrs = [("x-test-status", "200"), ("x-test-content-type", ctype),
            ("x-test-body-b64", b64(b"data: one\n\ndata: two\n\n"))]
    key = new_key()
    released = stack.counter("released")
    first = stack.post("/orders", "{}", key, headers=hdrs)
    assert_executed(first, 200)
    assert first.header("content-type") == ctype
    assert stack.wait_counter("released", released + 1) >= released + 1
    retry = stack.post("/orders", "{}", key, headers=hdrs)
    assert_executed(retry, 200)
    assert retry.header("x-upstream-id") != first.header("x-upstream-id")
    assert stack.upstream.count(key=key) == 2


# --------------------------------------------------------------------------------------------
# l. Envoy's compressor before the filter: identity bytes recorded, every answer compressed
# --------------------------------------------------------------------------------------------

GZIP_COMPRESSOR = {
    "name": "envoy.filters.http.compressor",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.compressor.v3.Compressor",
        # The default content types (text/plain among them) and min_content_length (30).
        "compressor_library": {
            "name": "gzip",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.compression.gzip.compressor.v3.Gzip"},
        },
    },
}


@pytest.fixture(scope="module")
def compressed_stack(run_dir, artifacts, upstream):
    """An Envoy of its own, [compressor, idempotency filter, router] on listener `compressed`,
    with an in-memory idemstore."""
    sub = run_dir / "compressor"
    store, sport = h.start_idemstore(sub)
    try:
        filters = {"compressed": [GZIP_COMPRESSOR, h.wasm_filter({"store_cluster": "idemstore"}, artifacts["wasm"])]}
        envoy = h.start_envoy(sub, "envoy-compressor", filters, upstream.port, sport)
    except BaseException:
        store.stop()
        raise
    yield envoy
    envoy.stop()
    store.stop()


def test_compressor_before_the_filter_records_identity_and_compresses_every_answer(compressed_stack, upstream):
    """docs/records.md: with the compressor before this filter, the filter records the plain
    bytes, and the compressor encodes the first answer and every replay (a local reply) for the
    Accept-Encoding of each request."""
    envoy = compressed_stack
    port = envoy.port("compressed")
    plain = text_bytes(20000)
    hdrs = [("x-test-content-type", "text/plain"), ("x-test-body-pattern", "text:20000"),
            ("content-type", "application/json")]
    key = new_key()

    def post(accept: str | None) -> h.Response:
        extra = [] if accept is None else [("accept-encoding", accept)]
        return h.request(port, "POST", "/orders", b"{}", hdrs + [("Idempotency-Key", key)] + extra)

    gz = "http.compressed.compressor.gzip.gzip."
    before = envoy.stats(r"^http\.compressed\.compressor\.")
    stored = envoy.counter("stored")
    first = post("gzip")
    assert_executed(first, 201)
    assert first.header("content-encoding") == "gzip", first
    assert gzip.decompress(first.body) == plain
    assert upstream.count(key=key) == 1
    assert envoy.wait_counter("stored", stored + 1) >= stored + 1, "the answer was never stored"

    # The record holds the identity bytes: a retry without Accept-Encoding is a plain replay
    # (not a 406), which the compressor leaves alone.
    bare = post(None)
    assert (bare.status, bare.header(REPLAY)) == (201, "true"), bare
    assert bare.header("content-encoding") is None, bare
    assert bare.body == plain
    assert bare.header("content-type") == "text/plain", bare
    assert upstream.count(key=key) == 1

    # The same record, compressed again for a retry that accepts gzip.
    again = post("gzip")
    assert (again.status, again.header(REPLAY)) == (201, "true"), again
    assert again.header("content-encoding") == "gzip", again
    assert gzip.decompress(again.body) == plain
    assert again.header("location") == first.header("location"), again
    assert upstream.count(key=key) == 1

    # Envoy's compressor did it: two answers compressed from 2 x 20000 plain bytes (the first
    # and the last replay), the bare retry left alone for want of an Accept-Encoding.
    after = envoy.stats(r"^http\.compressed\.compressor\.")
    d = {k[len(gz):]: after[k] - before.get(k, 0) for k in after if k.startswith(gz)}
    assert (d["compressed"], d["not_compressed"], d["no_accept_header"]) == (2, 1, 1), d
    assert d["total_uncompressed_bytes"] == 2 * len(plain), d
    assert envoy.counter("executed") == 1 and envoy.counter("replayed") == 2
