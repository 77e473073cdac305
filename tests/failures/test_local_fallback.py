"""The local fallback. While the store (idemstore or its Redis) is down and
`failure_mode` is `open`, each Envoy process still runs a key once: a process-wide lock in
Envoy's shared data (every worker sees it) and a local record of the answer.

Why these tests: before this fallback, every request of an outage ran unguarded, so a client
retrying into an outage (the moment retries are most likely) executed its operation again per
retry. The tests check, with real processes (Redis, idemstore on it, Envoy with the filter and
the counting upstream), that:

- twenty concurrent duplicates reaching one Envoy (2 and 4 workers) in an outage execute once,
  the other nineteen wait and replay the answer byte for byte; a later retry replays from the
  local record and another body gets `422`;
- with `local_fallback: false` every duplicate runs (the control: the first test can fail);
- once the store answers again the local records are handed back to it, so a retry through
  another Envoy replica on the same store replays instead of running again.

The store cluster has no health check: with idemstore killed every store call is refused at
once, the breaker (which counts only timeouts) stays closed and each request tries the store.
On the native host the store runs in Envoy's process: the outage is its Redis killed (and
restarted on the same port), every store call again refused at once.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from support import burst
from support import harness as h
from support.checks import REPLAY, assert_executed, assert_problem, assert_replay_of

LISTENER = "main"
PLUGIN = {"store_cluster": "idemstore", "store_timeout_ms": 300, "lock_wait_ms": 3000}
# Long enough that every duplicate arrives while the first is still at the upstream.
UPSTREAM_SLEEP_MS = 300
DUPLICATES = 20


# --------------------------------------------------------------------------------------------
# the stack: Redis, idemstore on it, N filter Envoys on that idemstore
# --------------------------------------------------------------------------------------------


def accepts(port: int) -> bool:
    try:
        return h.tcp_accepts(port)
    except OSError:
        return False


@dataclass
class Outage:
    sub: Path
    redis: h.Proc
    redis_port: int
    store: h.Proc | None = None
    store_port: int = 0
    envoys: list[h.Envoy] = field(default_factory=list)

    @property
    def redis_url(self) -> str:
        return f"redis://{h.LOOPBACK}:{self.redis_port}"

    def kill_store(self) -> None:
        """SIGKILL idemstore, then wait until its port refuses connections (the outage is real
        before any request is sent). On the native host the store runs in Envoy's process, on
        this Redis: the Redis is killed instead."""
        if h.native():
            self.redis.kill()
            h.wait_for(lambda: not accepts(self.redis_port), f"redis port {self.redis_port} refusing", timeout=10)
            return
        self.store.kill()
        h.wait_for(lambda: not accepts(self.store_port), f"idemstore port {self.store_port} refusing", timeout=10)

    def restart_store(self) -> None:
        """idemstore again on the same port (the Envoys' cluster names that port), until /healthz 200;
        on the native host, a Redis again on the port the module's `store` names, until PING."""
        if h.native():
            self.redis, _ = h.start_redis(self.sub, port=self.redis_port)
            return
        self.store, _ = h.start_idemstore(self.sub, self.redis_url, port=self.store_port)

    def stop(self) -> None:
        for proc in [e.proc for e in self.envoys] + [self.store, self.redis]:
            if proc is not None:
                proc.stop(timeout=10)


@pytest.fixture
def outage_stack(run_dir, artifacts, upstream):
    """Factory: `outage_stack(name, plugin, envoys=1, concurrency=2)` starts Redis, idemstore and
    the Envoys (all spawned, then awaited); everything is stopped by PID after the test."""
    made: list[Outage] = []

    def start(name: str, plugin: dict, envoys: int = 1, concurrency: int = 2) -> Outage:
        sub = run_dir / f"local-fallback-{name}"
        redis, rport = h.start_redis(sub)
        stack = Outage(sub, redis, rport)
        made.append(stack)
        filters = {LISTENER: [h.wasm_filter(plugin, artifacts["wasm"])]}
        try:
            stack.store, stack.store_port = h.start_idemstore(sub, stack.redis_url)
            for n in range(envoys):
                stack.envoys.append(h.spawn_envoy(sub, f"envoy-{n}", filters, upstream.port, stack.store_port,
                                                  concurrency=concurrency))
            for e in stack.envoys:
                h.await_envoy(e)
        except h.HarnessError as e:
            error = str(e)
        else:
            return stack
        # Outside the handler (no chained traceback). A filter that refuses a key of `plugin`
        # (e.g. one built before the key existed) logs why: lead with that line.
        refused = [ln for e in stack.envoys for ln in e.log_text().splitlines() if "refused its configuration" in ln]
        pytest.fail("\n".join([f"stack {name} did not start with plugin config {json.dumps(plugin)}", *refused, error]),
                    pytrace=False)

    yield start
    for stack in made:
        stack.stop()


# --------------------------------------------------------------------------------------------
# requests and counters
# --------------------------------------------------------------------------------------------


def order(key: str, qty: int = 1) -> str:
    return json.dumps({"item": "local-fallback", "key": key, "qty": qty})


def post(envoy: h.Envoy, key: str, body: str, sleep_ms: int = 0) -> h.Response:
    headers = [("Idempotency-Key", key), ("content-type", "application/json")]
    if sleep_ms:
        headers.append(("x-test-sleep-ms", str(sleep_ms)))
    return h.request(envoy.port(LISTENER), "POST", "/orders", body, headers, timeout=15)


def concurrent_posts(envoy: h.Envoy, key: str, body: str, n: int) -> list[h.Response]:
    """`n` requests with one key and body, each on its own connection, released together by a
    barrier so that they overlap the first one's upstream sleep."""
    barrier = threading.Barrier(n)

    def one() -> h.Response:
        barrier.wait(timeout=10)
        return post(envoy, key, body, sleep_ms=UPSTREAM_SLEEP_MS)

    runs = [h.in_thread(one) for _ in range(n)]
    return [h.joined(t, out, timeout=30) for t, out in runs]


def counter_delta(envoy: h.Envoy, before: dict[str, int], settle: dict[str, int] | None = None,
                  timeout: float = 5.0) -> dict[str, int]:
    """Counters now minus `before` (a counter not yet defined is 0). With `settle`, polls until
    each named counter has moved at least that much or `timeout` passes: some counters land
    after the answer the client already has."""
    deadline = time.monotonic() + timeout
    while True:
        after = envoy.counters()
        d = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
        if all(d.get(k, 0) >= v for k, v in (settle or {}).items()) or time.monotonic() >= deadline:
            return d
        time.sleep(0.02)


def picked(d: dict[str, int], *names: str) -> dict[str, int]:
    return {n: d.get(n, 0) for n in names}


def warm_up(envoy: h.Envoy) -> None:
    """One guarded request through the live store: the stack works before the outage."""
    before = envoy.counters()
    assert_executed(post(envoy, h.new_key("lf-warm"), order("warm")))
    d = counter_delta(envoy, before, settle={"executed": 1, "stored": 1})
    assert picked(d, "executed", "stored", "degraded") == {"executed": 1, "stored": 1, "degraded": 0}, d


def is_replay(r: h.Response) -> bool:
    return r.header(REPLAY) == "true"


def summary(answers: list[h.Response]) -> dict:
    """Statuses, replay flags and distinct bodies of a burst, for assertion messages and notes."""
    statuses: dict[int, int] = {}
    for r in answers:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    return {"statuses": statuses, "replays": sum(map(is_replay, answers)),
            "distinct_bodies": len({r.body for r in answers}),
            "max_ms": round(max(r.elapsed for r in answers) * 1000)}


# --------------------------------------------------------------------------------------------
# the tests
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("concurrency", [2, 4])
def test_duplicates_during_an_outage_run_once(outage_stack, upstream, note, concurrency):
    stack = outage_stack(f"burst-c{concurrency}", PLUGIN, concurrency=concurrency)
    envoy = stack.envoys[0]
    warm_up(envoy)
    stack.kill_store()
    key = h.new_key("lf-burst")
    body = order(key)
    before = envoy.counters()

    answers = concurrent_posts(envoy, key, body, DUPLICATES)
    runs = upstream.count(key=key)
    d = counter_delta(envoy, before, settle={"local_locks": 1, "local_replays": DUPLICATES - 1})
    got = summary(answers)
    note(f"local fallback, --concurrency {concurrency}: {DUPLICATES} concurrent duplicates in an outage: "
         f"{runs} upstream execution(s), {got['replays']} replays, statuses {got['statuses']}, "
         f"{got['distinct_bodies']} distinct bodies, slowest {got['max_ms']} ms; counters "
         f"{picked(d, 'local_locks', 'local_replays', 'degraded', 'executed', 'replayed')}")

    assert runs == 1, f"the upstream ran the key {runs} times, not once: {got}"
    assert got["statuses"] == {201: DUPLICATES}, got
    originals = [r for r in answers if not is_replay(r)]
    assert len(originals) == 1, got
    for r in answers:
        if is_replay(r):
            assert_replay_of(r, originals[0])
    assert picked(d, "local_locks", "local_replays", "replayed", "guarded") == {
        "local_locks": 1, "local_replays": DUPLICATES - 1, "replayed": DUPLICATES - 1, "guarded": DUPLICATES}, d
    assert d.get("degraded", 0) >= 1, d

    # Still in the outage: a retry replays from the local record, another body is refused.
    before = envoy.counters()
    assert_replay_of(post(envoy, key, body), originals[0])
    assert counter_delta(envoy, before, settle={"local_replays": 1}).get("local_replays", 0) == 1
    assert_problem(post(envoy, key, order(key, qty=2)), 422, raw_key=key)
    assert upstream.count(key=key) == 1


def test_local_fallback_off_runs_every_duplicate(outage_stack, upstream, note):
    n = 5
    stack = outage_stack("off", {**PLUGIN, "local_fallback": False})
    envoy = stack.envoys[0]
    warm_up(envoy)
    stack.kill_store()
    key = h.new_key("lf-off")
    before = envoy.counters()

    answers = concurrent_posts(envoy, key, order(key), n)
    runs = upstream.count(key=key)
    d = counter_delta(envoy, before, settle={"degraded": n})
    got = summary(answers)
    note(f"local_fallback false: {n} concurrent duplicates in an outage: {runs} upstream executions, "
         f"statuses {got['statuses']}, {got['replays']} replays; counters {picked(d, 'degraded', 'local_locks')}")

    assert got["statuses"] == {201: n} and got["replays"] == 0, got
    assert runs == n, f"the upstream ran the key {runs} times, not {n}: {got}"
    assert picked(d, "degraded", "local_locks") == {"degraded": n, "local_locks": 0}, d


def until_guarded(envoy: h.Envoy, timeout: float = 10.0) -> int:
    """Fresh keys through `envoy` until one runs with the store (its `degraded` does not move):
    the store is back for this Envoy, and this traffic may be what triggers the hand-back.
    Returns how many requests it took."""
    deadline = time.monotonic() + timeout
    sent = 0
    while True:
        degraded = envoy.counter("degraded")
        r = post(envoy, h.new_key("lf-trigger"), order("trigger"))
        sent += 1
        assert r.status == 201 and not is_replay(r), r
        if envoy.counter("degraded") == degraded:
            return sent
        assert time.monotonic() < deadline, f"no request ran with the store in {timeout}s ({sent} sent)"
        time.sleep(0.05)


def test_hand_back_after_recovery_reaches_another_replica(outage_stack, upstream, note):
    stack = outage_stack("handback", PLUGIN, envoys=2)
    a, b = stack.envoys
    warm_up(a)
    warm_up(b)
    stack.kill_store()
    key = h.new_key("lf-handback")
    body = order(key)

    first = post(a, key, body)
    assert_executed(first)
    assert upstream.count(key=key) == 1
    retry = post(a, key, body)
    assert upstream.count(key=key) == 1, f"the retry through replica A ran again during the outage: {retry}"
    assert_replay_of(retry, first)

    stack.restart_store()
    t_back = time.monotonic()
    triggers = until_guarded(a)
    handed = a.wait_counter("handed_back", 1, timeout=10)
    took = time.monotonic() - t_back
    other = post(b, key, body)
    runs = upstream.count(key=key)
    note(f"local fallback hand-back: replica A handed_back {handed} ({triggers} request(s) after the restart, "
         f"{took:.2f}s after idemstore's /healthz 200), handback_dropped {a.counter('handback_dropped')}; "
         f"retry through replica B: {other.status} replay={is_replay(other)}, upstream executions {runs}")

    assert handed >= 1, f"replica A handed back no record within 10s of the store's return: {a.counters()}"
    assert runs == 1, f"the retry through replica B ran the key again: {other}"
    assert_replay_of(other, first)


FLOOD_KEYS = 100_000
FLOOD_ENTRIES, FLOOD_BYTES = 2048, 1 << 20


def allocated(envoy: h.Envoy) -> int:
    """Envoy's heap in use (the admin's /memory), where shared data lives."""
    status, body = h.http_get_status(envoy.admin_port, "/memory", timeout=5)
    assert status == 200, status
    return int(json.loads(body)["allocated"])


def test_a_flood_in_an_outage_stays_within_its_bound(outage_stack, upstream, note):
    """100,000 unique keys through one Envoy while idemstore is down, with the local records
    bounded to 2,048 entries and 1 MiB: every request runs once (under the local lock), Envoy's
    heap grows by about the bound, not by a record per key, the oldest records are the ones
    pushed out (counted on `handback_dropped`) and the newest still replay."""
    plugin = {**PLUGIN, "local_record_entries": FLOOD_ENTRIES, "local_record_bytes": FLOOD_BYTES}
    stack = outage_stack("flood", plugin)
    envoy = stack.envoys[0]
    warm_up(envoy)
    stack.kill_store()
    before = envoy.counters()
    heap0 = allocated(envoy)
    spec = burst.BurstSpec(keys=FLOOD_KEYS, duplicates=1, sleep_ms=(0, 0), keys_in_flight=32, deadline=600,
                           request_timeout=30)
    run = burst.run_burst([envoy.port(LISTENER)], spec)
    heap1 = allocated(envoy)
    replies = run.all_replies()
    statuses = Counter(r.status for r in replies)
    d = counter_delta(envoy, before)
    assert statuses == {201: FLOOD_KEYS}, statuses
    assert d.get("local_locks", 0) == FLOOD_KEYS, d
    growth = heap1 - heap0
    # Unbounded, the records alone would take well over 30 MB (a ~300-byte answer each).
    assert growth < FLOOD_BYTES + 8 * (1 << 20), growth
    assert d.get("handback_dropped", 0) >= FLOOD_KEYS - FLOOD_ENTRIES, d
    # The oldest went first: the first keys run again, the last ones replay.
    plans = run.plans
    newest = [post(envoy, p.key, p.body.decode()) for p in plans[-20:]]
    oldest = [post(envoy, p.key, p.body.decode()) for p in plans[:20]]
    assert sum(is_replay(r) for r in newest) >= 18, [r.status for r in newest]
    assert not any(is_replay(r) for r in oldest), [r.status for r in oldest]
    note(f"local fallback flood: {FLOOD_KEYS} unique keys in an outage in {run.elapsed:.1f}s "
         f"({FLOOD_KEYS / run.elapsed:.0f}/s), bound {FLOOD_ENTRIES} entries / {FLOOD_BYTES >> 10} KiB: Envoy heap "
         f"{heap0 >> 20} -> {heap1 >> 20} MiB (+{growth >> 10} KiB), handback_dropped {d.get('handback_dropped', 0)}, "
         f"newest 20 replayed {sum(is_replay(r) for r in newest)}, oldest 20 replayed {sum(is_replay(r) for r in oldest)}")
