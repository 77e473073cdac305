"""Records are scoped by subject (caller) and route."""

from __future__ import annotations

import uuid

from support.checks import assert_executed, assert_problem, assert_replay_of, body_json
from support.harness import new_key


def test_two_client_ips_are_two_callers(stack):
    key = new_key()
    a = stack.post("/orders", "{}", key, source="127.0.0.1")
    b = stack.post("/orders", "{}", key, source="127.0.0.2")
    assert_executed(a, 201)
    assert_executed(b, 201)
    assert body_json(a)["id"] != body_json(b)["id"]
    assert stack.upstream.count(key=key) == 2

    # A retry from a new connection (new source port) is the same caller.
    assert_replay_of(stack.post("/orders", "{}", key, source="127.0.0.1"), a)
    assert_replay_of(stack.post("/orders", "{}", key, source="127.0.0.2"), b)
    assert stack.upstream.count(key=key) == 2


def test_forged_forwarded_for_does_not_change_the_caller(stack):
    """The default subject is the connection's address: an X-Forwarded-For header the client
    sends can neither borrow another caller's records nor escape its own."""
    key = new_key()
    a = stack.post("/orders", "{}", key, headers=[("x-forwarded-for", "203.0.113.7")])
    assert_executed(a, 201)
    assert_replay_of(stack.post("/orders", "{}", key, headers=[("x-forwarded-for", "198.51.100.9")]), a)
    assert_replay_of(stack.post("/orders", "{}", key), a)
    assert stack.upstream.count(key=key) == 1


def test_subject_header_separates_callers(stack):
    key = new_key()
    alice = stack.post("/orders", "{}", key, listener="subject_header", headers=[("x-user", "alice")])
    bob = stack.post("/orders", "{}", key, listener="subject_header", headers=[("x-user", "bob")])
    assert_executed(alice, 201)
    assert_executed(bob, 201)
    assert stack.upstream.count(key=key) == 2

    # Same user from another IP: same subject, so a replay.
    again = stack.post("/orders", "{}", key, listener="subject_header", headers=[("x-user", "alice")],
                       source="127.0.0.3")
    assert_replay_of(again, alice)
    assert_replay_of(stack.post("/orders", "{}", key, listener="subject_header", headers=[("x-user", "bob")]), bob)
    assert stack.upstream.count(key=key) == 2


def test_named_routes_are_separate_scopes(stack):
    key = new_key()
    orders = stack.post("/orders", "{}", key)
    payments = stack.post("/payments", "{}", key)
    assert_executed(orders, 201)
    assert_executed(payments, 201)
    assert stack.upstream.count(key=key) == 2
    assert_replay_of(stack.post("/payments", "{}", key), payments)
    assert_replay_of(stack.post("/orders", "{}", key), orders)
    assert stack.upstream.count(key=key) == 2


def test_named_route_scope_is_the_name_and_the_target_is_fingerprinted(stack):
    key = new_key()
    first = stack.post("/orders/one", "{}", key)
    assert_executed(first, 201)
    # Same route name (`orders`), so the same record; but it answers another target: 422,
    # never a replay, and nothing runs.
    other = stack.post("/orders/two", "{}", key)
    doc = assert_problem(other, 422, raw_key=key)
    assert doc["code"] == "key-reused" and doc["differs"] == "target", doc
    assert stack.upstream.count(key=key) == 1
    assert_replay_of(stack.post("/orders/one", "{}", key), first)
    assert stack.upstream.count(key=key) == 1


def test_unnamed_route_scope_is_the_path_without_query(stack):
    key = new_key()
    base = f"/things/{uuid.uuid4().hex}"
    a = stack.post(f"{base}/a", "{}", key)
    b = stack.post(f"{base}/b", "{}", key)
    assert_executed(a, 201)
    assert_executed(b, 201)
    assert stack.upstream.count(key=key) == 2

    # One scope for both queries, but the query is part of the target: 422, not a replay.
    key2 = new_key()
    q1 = stack.post(f"{base}/a?x=1", "{}", key2)
    assert_executed(q1, 201)
    q2 = stack.post(f"{base}/a?x=2", "{}", key2)
    assert assert_problem(q2, 422, raw_key=key2)["differs"] == "target"
    assert_replay_of(stack.post(f"{base}/a?x=1", "{}", key2), q1)
    assert stack.upstream.count(key=key2) == 1


def test_subject_from_dynamic_metadata_separates_callers(stack):
    key = new_key()
    ln = "subject_metadata"
    alice = stack.post("/orders", "{}", key, listener=ln, headers=[("x-user", "alice")])
    bob = stack.post("/orders", "{}", key, listener=ln, headers=[("x-user", "bob")])
    assert_executed(alice, 201)
    assert_executed(bob, 201)
    assert stack.upstream.count(key=key) == 2
    again = stack.post("/orders", "{}", key, listener=ln, headers=[("x-user", "alice")], source="127.0.0.4")
    assert_replay_of(again, alice)
    assert_replay_of(stack.post("/orders", "{}", key, listener=ln, headers=[("x-user", "bob")]), bob)
    assert stack.upstream.count(key=key) == 2
