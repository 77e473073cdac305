"""What the filter writes down: never the client's raw key, in no log line of the filter, no
idemstore log and no Redis key or record; its log lines name the request (Envoy's request id) and
the store key's prefix instead, so one request can be followed without exposing the key."""

from __future__ import annotations

import re
import socket
import uuid

from support import harness as h
from support.checks import assert_executed, assert_problem, assert_replay_of
from support.stack import plugin_config

JSON = ("content-type", "application/json")
# The upstream echoes the key in its default body: a fixed body keeps it out of the record, as
# an application's own answer would (what the application puts in its answer is its business).
FIXED = ("x-test-body", '{"order":"o-1"}')
WASM_LINE = re.compile(r"\[wasm\].*wasm log")
DECISION = re.compile(r"request (\S+) key ([0-9a-f]{12}|-): idempotency\.(\w+)")
FAULT = re.compile(r"request (\S+) key ([0-9a-f]{12}): store Begin \(try 1\): (.+)$")


def filter_line(line: str) -> bool:
    """A log line of the filter: the wasm VM's (`wasm log`), or the native host's (component
    `dynamic_modules`, prefixed `idempotency:`)."""
    return h.is_filter_log_line(line) if h.native() else bool(WASM_LINE.search(line))


def redis_dump(port: int) -> bytes:
    """Every key and value in the Redis database (DUMP-free: KEYS, then TYPE-appropriate reads)."""
    def cmd(sock, *args: bytes) -> bytes:
        out = b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
        sock.sendall(out)
        return read_reply(sock.makefile("rb"))

    with socket.create_connection((h.LOOPBACK, port), timeout=5) as s:
        keys = cmd(s, b"KEYS", b"*")
        blob = b"".join(keys)
        for k in keys:
            kind = cmd(s, b"TYPE", k)
            if kind == b"string":
                blob += cmd(s, b"GET", k) or b""
            elif kind == b"hash":
                blob += b"".join(cmd(s, b"HGETALL", k))
        return blob


def read_reply(f):
    line = f.readline().rstrip(b"\r\n")
    kind, rest = line[:1], line[1:]
    if kind in (b"+", b"-"):
        return rest
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = f.read(n + 2)[:-2]
        return data
    if kind == b"*":
        return [read_reply(f) for _ in range(int(rest))]
    raise AssertionError(f"unexpected redis reply {line!r}")


def test_raw_key_is_never_logged_or_stored(run_dir, artifacts, upstream):
    sub = run_dir / "privacy"
    redis, rport = h.start_redis(sub)
    store, sport = h.start_idemstore(sub, f"redis://127.0.0.1:{rport}")
    filters = {"default": [h.wasm_filter(plugin_config(lock_wait_ms=200), artifacts["wasm"])]}
    envoy = h.start_envoy(sub, "envoy", filters, upstream.port, sport, log_level="debug")
    try:
        secret = f"SECRETKEY{uuid.uuid4().hex}"
        port = envoy.port("default")
        path = f"/privacy/{uuid.uuid4().hex}"

        def post(body="{}", key=secret, extra=()):
            return h.request(port, "POST", path, body, [("Idempotency-Key", key), JSON, FIXED, *extra])

        first = post()
        assert_executed(first, 201)
        envoy.wait_counter("stored", 1)
        assert_replay_of(post(), first)
        assert_problem(post(body='{"other":1}'), 422, raw_key=secret)
        # A malformed key that contains the secret: refused, not echoed, not logged.
        assert_problem(post(key=secret + " x"), 400, raw_key=secret)
        # A duplicate past the wait: 409 (the original holds the lock for 1.5 s).
        slow_key = secret + "slow"
        t, out = h.in_thread(lambda: post(key=slow_key, extra=[("x-test-sleep-ms", "1500")]))
        h.poll_until(lambda: upstream.count(path=path), 2, timeout=5)
        assert_problem(post(key=slow_key), 409, raw_key=slow_key)
        assert_executed(h.joined(t, out), 201)
        envoy.wait_counter("stored", 2)

        # Everything stored so far (the outage below writes nothing: the store is gone).
        stored = redis_dump(rport)
        # The store goes away: the fault lines carry the request id and the key prefix too. On
        # the native host the store runs in Envoy's process: its Redis goes away.
        if h.native():
            redis.stop()
        else:
            store.stop()
        fault_key = secret + "fault"
        assert_executed(post(key=fault_key), 201)

        log = envoy.log_text()
        wasm_lines = [ln for ln in log.splitlines() if filter_line(ln)]
        assert wasm_lines, "no filter log lines at debug level"
        leaked = [ln for ln in wasm_lines if secret in ln]
        assert not leaked, leaked[:5]
        assert secret not in store.log_text()
        assert stored, "nothing in redis"
        assert secret.encode() not in stored

        # Every decision line names the request by the id Envoy gave it (the upstream saw the
        # same x-request-id) and the key by the store key's prefix.
        decisions = [m.groups() for m in map(DECISION.search, wasm_lines) if m]
        outcomes = {d[2] for d in decisions}
        assert {"guarded", "executed", "replayed", "mismatched", "conflicted", "rejected", "degraded"} <= outcomes, outcomes
        executed = [ex for ex in upstream.executions(path=path, headers=True)]
        rids = {dict(ex["headers"]).get("x-request-id") for ex in executed}
        executed_rids = {d[0] for d in decisions if d[2] == "executed"}
        assert executed_rids and executed_rids <= rids, (executed_rids, rids)
        faults = [m.groups() for m in map(FAULT.search, wasm_lines) if m]
        assert len(faults) == 1 and faults[0][0] in rids, faults
        # One request, one store key: the fault line and the decision lines of that request agree.
        fault_rid, fault_prefix, _ = faults[0]
        assert {d[1] for d in decisions if d[0] == fault_rid} == {fault_prefix}, decisions
    finally:
        envoy.stop()
        store.stop()
        redis.stop()
