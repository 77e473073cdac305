"""The contract under concurrency: duplicates in flight, the lock wait, retention."""

from __future__ import annotations

import threading
import time

from support import harness as h
from support.checks import assert_executed, assert_problem, assert_replay_of
from support.harness import new_key


def wait_executing(stack, key: str, timeout: float = 5.0) -> None:
    """Until the upstream has started the original (so it holds the lock)."""
    deadline = time.monotonic() + timeout
    while stack.upstream.count(key=key) == 0:
        assert time.monotonic() < deadline, "the original never reached the upstream"
        time.sleep(0.01)


def test_duplicate_in_flight_waits_and_replays(stack):
    key = new_key()
    hdrs = [("x-test-sleep-ms", "1000")]
    t1, o1 = h.in_thread(lambda: stack.post("/orders", "{}", key, headers=hdrs))
    wait_executing(stack, key)
    t2, o2 = h.in_thread(lambda: stack.post("/orders", "{}", key, headers=hdrs), delay=0.2)
    original, duplicate = h.joined(t1, o1), h.joined(t2, o2)
    assert_executed(original, 201)
    assert_replay_of(duplicate, original)
    # It waited for the original rather than failing fast or running again.
    assert duplicate.elapsed >= 0.4, duplicate.elapsed
    assert stack.upstream.count(key=key) == 1


def test_duplicate_in_flight_past_lock_wait_is_409(stack):
    key = new_key()
    hdrs = [("x-test-sleep-ms", "2500")]
    before = stack.counter("conflicted")
    t1, o1 = h.in_thread(lambda: stack.post("/orders", "{}", key, listener="short", headers=hdrs))
    wait_executing(stack, key)
    t2, o2 = h.in_thread(lambda: stack.post("/orders", "{}", key, listener="short", headers=hdrs), delay=0.2)
    duplicate = h.joined(t2, o2)
    assert_problem(duplicate, 409, raw_key=key)
    # lock_wait_ms is 1000 on this listener
    assert 0.8 <= duplicate.elapsed <= 2.2, duplicate.elapsed
    original = h.joined(t1, o1)
    assert_executed(original, 201)
    assert stack.upstream.count(key=key) == 1
    assert stack.counter("conflicted") == before + 1
    # After the original finished, a retry replays it.
    assert_replay_of(stack.post("/orders", "{}", key, listener="short"), original)
    assert stack.upstream.count(key=key) == 1


def test_record_expires_after_retention(stack):
    key = new_key()
    first = stack.post("/orders", "{}", key, listener="short")
    assert_executed(first, 201)
    assert_replay_of(stack.post("/orders", "{}", key, listener="short"), first)
    time.sleep(3.0)  # retention_seconds is 2 on this listener
    again = stack.post("/orders", "{}", key, listener="short")
    assert_executed(again, 201)
    assert again.body != first.body
    assert stack.upstream.count(key=key) == 2


def test_many_simultaneous_duplicates_execute_once(stack):
    key = new_key()
    hdrs = [("x-test-sleep-ms", "500")]
    barrier = threading.Barrier(8)

    def one():
        barrier.wait(5)
        return stack.post("/orders", '{"item":"x"}', key, headers=hdrs)

    runs = [h.in_thread(one) for _ in range(8)]
    resps = []
    for t, out in runs:
        resps.append(h.joined(t, out))
    assert stack.upstream.count(key=key) == 1
    originals = [r for r in resps if r.header("x-idempotent-replay") is None]
    assert len(originals) == 1, resps
    for r in resps:
        if r is not originals[0]:
            assert_replay_of(r, originals[0])


def test_client_gone_leaves_the_key_in_doubt_not_locked(stack):
    """The client hangs up while the upstream runs (Envoy then resets the upstream request,
    envoyproxy/envoy#11931, whatever the application did): the lock is given back, so a retry is
    not stuck behind it, and the key is in doubt (`unknown_outcome: hold`): the retry gets `409`
    `outcome-unknown` at once and runs nothing (docs/configuration.md, "When the outcome is
    unknown"; tests/contract/test_in_doubt.py has the rest)."""
    import socket

    key = new_key()
    released = stack.counter("in_doubt")
    sock = socket.create_connection(("127.0.0.1", stack.port()))
    sock.sendall((f"POST /orders HTTP/1.1\r\nhost: x\r\nIdempotency-Key: {key}\r\n"
                  "content-type: application/json\r\nx-test-sleep-ms: 1500\r\ncontent-length: 2\r\n\r\n{}").encode())
    deadline = time.monotonic() + 5
    while stack.upstream.count(key=key) == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stack.upstream.count(key=key) == 1
    sock.close()
    assert stack.wait_counter("in_doubt", released + 1) == released + 1

    retry = stack.post("/orders", "{}", key)
    assert_problem(retry, 409, code="outcome-unknown")
    assert retry.elapsed < 1.0, retry.elapsed  # not waiting on an orphaned lock
    assert stack.upstream.count(key=key) == 1
