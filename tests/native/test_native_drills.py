"""Drills on the native host (the store in Envoy's process, on Redis): Redis stopped and
restarted under load, the Envoy configuration reloaded under load (a new filter configuration,
so a new store runtime, and the old one destroyed after its last stream), a listener drained
with requests in flight, and Envoy killed mid-request. The load, the probes and the verdicts are
tests/failures/test_drills.py's: every key is probed once more after the load, and the
independent count of executions per key decides what ran with the guarantee.

Figures go to the `note` fixture (the issue's closing note asks for them).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import pytest

from failures.test_drills import (Load, check_executions, classify, counter_delta, executions_per_key, mark_when, ms,
                                  pct, probe, redis_up)
from support import harness as h
from support.checks import assert_problem
from support.harness import new_key

JSON = ("content-type", "application/json")


def native_listener(name: str, port: int, config: dict) -> dict:
    return h.listener(name, port, [h.native_filter(config)])


def bootstrap(admin: int, upstream_port: int, listeners: list[dict] | None = None,
              lds: Path | None = None) -> dict:
    config: dict = {
        "node": {"id": "native-drills", "cluster": "native-drills"},
        "admin": {"address": {"socket_address": {"address": h.LOOPBACK, "port_value": admin}}},
        "static_resources": {"listeners": listeners or [],
                             "clusters": [h.static_cluster("upstream", upstream_port)]},
    }
    if lds is not None:
        config["dynamic_resources"] = {"lds_config": {
            "resource_api_version": "V3",
            "path_config_source": {"path": str(lds), "watched_directory": {"path": str(lds.parent)}},
        }}
    return config


def counters(envoy: h.Envoy) -> dict[str, int]:
    return {k.split(".", 1)[1]: v for k, v in envoy.stats(r"^idempotency\.").items()}


class Redis:
    """A Redis on a fixed port, with envoy/redis.conf (an append-only file: records survive a
    restart, as in production), that can be stopped and started again."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.port = h.free_port()
        self.proc: h.Proc | None = None
        self.start()

    def start(self) -> None:
        data = self.run_dir / f"redis-{self.port}"
        data.mkdir(parents=True, exist_ok=True)
        self.proc = h.start("redis", [h.redis_bin(), str(h.ROOT / "envoy" / "redis.conf"), "--port", str(self.port),
                                      "--dir", str(data)], self.run_dir)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    @property
    def url(self) -> str:
        return f"redis://{h.LOOPBACK}:{self.port}"


@pytest.fixture
def redis(run_dir):
    r = Redis(run_dir / "native-drills")
    h.wait_for(lambda: redis_up(r.port), "redis PING", timeout=10)
    yield r
    r.stop()


def start_native(run_dir: Path, name: str, upstream_port: int, config: dict, concurrency: int = 2) -> h.Envoy:
    admin, port = h.free_port(), h.free_port()
    envoy = h.spawn_envoy_config(run_dir, name, bootstrap(admin, upstream_port, [native_listener("main", port, config)]),
                                 admin, {"main": port}, concurrency=concurrency, env=h.native_env())
    return h.await_envoy(envoy)


def test_drill_redis_stopped_and_restarted(run_dir, upstream, redis, note):
    """Redis stopped 1.5 s into a 7 s load and started again on its port 2.5 s later. No key
    runs twice; what ran in the outage ran under the local lock (counted on `degraded`); the
    guarantee is back within 2 s of Redis answering PING (the Redis client reconnects on the
    next call), for good; records stored before the stop are replayed after it."""
    envoy = start_native(run_dir / "native-drills", "envoy-redis-drill", upstream.port,
                         {"store": {"redis": redis.url, "timeout_ms": 300}})
    try:
        before = counters(envoy)
        load = Load({"main": envoy.port("main")}, new_key("nredis"), period=0.004, seed=21)

        def stop():
            redis.stop()
            load.mark("redis_down")

        def restart():
            redis.start()
            load.mark("redis_spawned")
            mark_when(load.events, "redis_ready", lambda: redis_up(redis.port))

        load.at(1.5, "stop", stop)
        load.at(4.0, "restart", restart)
        load.run(7.0)
        h.wait_for(lambda: "redis_ready" in load.events, "redis ready", timeout=10)
        check_executions(load, upstream)
        probes = probe(load)
        v = classify(load, probes)
        d = counter_delta(counters(envoy), before)
        ev = load.events
        twice = {k: n for k, n in executions_per_key(load).items() if n > 1}
        assert not v.bad, "\n".join(v.bad[:20])
        assert not twice, (twice, [(round(x.t0 - load.t0, 3), x.short()) for x in load.sent
                                   if (x.listener, x.key) in twice], {k: round(t - load.t0, 3) for k, t in ev.items()})
        assert d["degraded"] > 0, d
        assert d["commit_failed"] == 0 and d["conflicted"] == 0, d
        t_down, t_ready = ev["redis_down"], ev["redis_ready"]
        early = [x.short() for x in load.sent if x.t1 <= ev["stop:start"] and not v.is_guarded(x)]
        assert not early, early[:5]
        tail = max((x.t0 for x in load.sent if x.t0 >= ev["redis_spawned"] and not v.is_guarded(x)),
                   default=ev["redis_spawned"])
        back = next((x for x in load.sent if x.t0 >= tail and v.is_guarded(x)), None)
        assert back is not None, "no request was guarded again after the restart"
        late = [(round(x.t0 - t_ready, 3), x.short()) for x in load.sent if x.t0 >= back.t0 and not v.is_guarded(x)]
        assert not late, (round(back.t0 - t_ready, 3), late[:5])
        recovery = back.t0 - t_ready
        assert recovery < 2.0, recovery
        pre = {x.key for x in load.sent if x.t1 <= ev["stop:start"] and x.exec_id}
        assert pre and all(probes[("main", k)].kind == "record" for k in pre)
        held = [x.elapsed for x in load.sent if t_down <= x.t0 <= t_ready]
        assert "panic" not in envoy.log_text()
        note(f"native drill redis stopped/restarted: {len(load.sent)} requests ({len(probes)} keys); Redis down "
             f"{t_ready - t_down:.2f}s; degraded {d['degraded']} (local locks {d['local_locks']}, local replays "
             f"{d['local_replays']}, handed back {d['handed_back']}), 503 withheld {len(v.withheld)}, keys run "
             f"twice 0; held in the outage p50 {ms(pct(held, 0.5))} max {ms(max(held))}; first guarded request "
             f"{ms(recovery)} after PING ok")
    finally:
        envoy.stop()


def listener_resource(port: int, config: dict) -> dict:
    return {"@type": "type.googleapis.com/envoy.config.listener.v3.Listener",
            **native_listener("main", port, config)}


def write_lds(path: Path, port: int, config: dict) -> None:
    # Envoy watches the directory and reads the file on a move into place (never half written).
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"resources": [listener_resource(port, config)]}))
    tmp.rename(path)


def test_drill_configuration_reloaded_under_load(run_dir, upstream, redis, note):
    """The listener's filter configuration changes three times during a 6 s load (LDS from a
    file): each change makes a new configuration (a new store runtime and Redis client) and
    Envoy destroys the old one once its last stream is done (its threads stopped). Every
    request is answered 201, no key runs twice, nothing degrades, and each reload says so."""
    d = run_dir / "native-reload"
    d.mkdir(parents=True, exist_ok=True)
    lds = d / "lds.json"
    admin, port = h.free_port(), h.free_port()
    base = {"store": {"redis": redis.url}}
    write_lds(lds, port, {**base, "retention_seconds": 3600})
    envoy = h.await_envoy(h.spawn_envoy_config(d, "envoy-reload", bootstrap(admin, upstream.port, lds=lds),
                                                admin, {"main": port}, env=h.native_env()))
    try:
        before = counters(envoy)
        load = Load({"main": port}, new_key("nreload"), period=0.002, workers=4, seed=5)
        updates = []

        def reload(n: int):
            def go():
                seen = envoy.stats(r"^listener_manager\.listener_modified$").get("listener_manager.listener_modified", 0)
                write_lds(lds, port, {**base, "retention_seconds": 3600 + n})
                h.wait_for(lambda: envoy.stats(r"^listener_manager\.listener_modified$")
                           .get("listener_manager.listener_modified", 0) > seen, "the listener to be modified")
                updates.append(time.monotonic())
            return go

        for n, at in enumerate((1.0, 2.5, 4.0), start=1):
            load.at(at, f"reload{n}", reload(n))
        load.run(6.0)
        check_executions(load, upstream)
        probes = probe(load)
        v = classify(load, probes)
        delta = counter_delta(counters(envoy), before)
        twice = {k: n for k, n in executions_per_key(load).items() if n > 1}
        assert not v.bad, "\n".join(v.bad[:20])
        assert not twice, twice
        assert all(x.status == 201 for x in load.sent), [x.short() for x in load.sent if x.status != 201][:5]
        assert delta["degraded"] == 0 and not v.unguarded, delta
        log = envoy.log_text()
        assert log.count("idempotency: configured; store: redis") == 4, log.count("configured; store")
        assert "panic" not in log
        note(f"native drill configuration reloaded 3 times under load: {len(load.sent)} requests "
             f"({len(probes)} keys, {sum(x.retry for x in load.sent)} retries) all 201, degraded 0, keys run twice 0; "
             f"p50 {ms(pct([x.elapsed for x in load.sent], 0.5))}, max {ms(max(x.elapsed for x in load.sent))}")
    finally:
        envoy.stop()


def test_drain_lets_requests_in_flight_finish(run_dir, upstream, redis, note):
    """Requests waiting on a slow upstream (and duplicates waiting on their lock) when Envoy is
    told to drain its listeners gracefully: each finishes (201 once, the duplicates replay),
    and Envoy then exits 0 on SIGTERM."""
    envoy = start_native(run_dir / "native-drills", "envoy-drain", upstream.port,
                         {"store": {"redis": redis.url}, "lock_wait_ms": 5000})
    keys = [new_key("ndrain") for _ in range(6)]
    out: dict[tuple[str, int], h.Response] = {}

    def send(key: str, i: int) -> None:
        out[(key, i)] = h.request(envoy.port("main"), "POST", "/orders", b"{}",
                                  [("Idempotency-Key", key), ("x-test-sleep-ms", "1500"), JSON], timeout=15)

    threads = [threading.Thread(target=send, args=(k, i)) for k in keys for i in range(3)]
    for t in threads:
        t.start()
    h.wait_for(lambda: sum(upstream.count(key=k) for k in keys) == len(keys), "every key to reach the upstream",
               timeout=10)
    t0 = time.monotonic()
    status, _ = _admin_post(envoy.admin_port, "/drain_listeners?graceful")
    assert status == 200
    for t in threads:
        t.join(20)
    elapsed = time.monotonic() - t0
    try:
        for k in keys:
            answers = [out[(k, i)] for i in range(3)]
            assert sorted(a.status for a in answers) == [201, 201, 201], answers
            assert sum(a.header("x-idempotent-replay") == "true" for a in answers) == 2, answers
            assert upstream.count(key=k) == 1
        envoy.proc.popen.send_signal(signal.SIGTERM)
        assert envoy.proc.popen.wait(20) == 0
        note(f"native drain: {len(keys)} keys x 3 requests in flight (1.5 s upstream) when the listeners drained: "
             f"all 201, each key executed once, done {ms(elapsed)} after the drain; Envoy exited 0 on SIGTERM")
    finally:
        envoy.stop()


def _admin_post(port: int, path: str) -> tuple[int, bytes]:
    conn = h.http_connection(port, timeout=5)
    try:
        conn.request("POST", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_envoy_killed_mid_request(run_dir, upstream, redis, note):
    """Envoy SIGKILLed while a guarded request runs (its lock held in Redis): a new Envoy on the
    same Redis answers the retry 409 `request-in-flight` while the lock lives (`lock_ttl_ms`),
    and once it has expired 409 `outcome-unknown` (`unknown_outcome: hold`, the default: the
    attempt reached the application and its answer was lost); it never runs the key again."""
    cfg = {"store": {"redis": redis.url}, "lock_ttl_ms": 2000, "lock_wait_ms": 0}
    first = start_native(run_dir / "native-drills", "envoy-kill-1", upstream.port, cfg)
    key = new_key("nkill")
    t = threading.Thread(target=lambda: _quiet(lambda: h.request(
        first.port("main"), "POST", "/orders", b"{}", [("Idempotency-Key", key), ("x-test-sleep-ms", "3000"), JSON],
        timeout=10)))
    t.start()
    h.wait_for(lambda: upstream.count(key=key) == 1, "the request to reach the upstream", timeout=10)
    killed_at = time.monotonic()
    first.proc.popen.send_signal(signal.SIGKILL)
    first.proc.popen.wait(10)
    t.join(15)
    second = start_native(run_dir / "native-drills", "envoy-kill-2", upstream.port, cfg)
    try:
        def retry() -> h.Response:
            return h.request(second.port("main"), "POST", "/orders", b"{}", [("Idempotency-Key", key), JSON])

        assert_problem(retry(), 409, key, code="request-in-flight")
        h.wait_for(lambda: retry().json().get("code") == "outcome-unknown", "the lock to expire", timeout=10)
        in_doubt_after = time.monotonic() - killed_at
        assert_problem(retry(), 409, key, code="outcome-unknown")
        assert upstream.count(key=key) == 1
        note(f"native Envoy killed mid-request: the retry on a new Envoy got 409 request-in-flight while the lock "
             f"lived, then 409 outcome-unknown ({ms(in_doubt_after)} after the kill, lock_ttl_ms 2000); executions 1")
    finally:
        second.stop()


def _quiet(fn) -> None:
    try:
        fn()
    except OSError:
        pass


def test_frozen_redis_is_bounded_by_store_timeout(run_dir, upstream, redis, note):
    """Redis frozen (SIGSTOP): its client would wait `store.timeout_ms` (5 s here), but the
    coordinator's deadline (`store_timeout_ms` 300 + `lock_wait_ms` 200, swept on the worker's
    tick) fails each request open within it, counted on `degraded`; after SIGCONT the guarantee
    is back."""
    envoy = start_native(run_dir / "native-drills", "envoy-freeze", upstream.port,
                         {"store": {"redis": redis.url, "timeout_ms": 5000}, "store_timeout_ms": 300,
                          "lock_wait_ms": 200, "breaker_open_ms": 0})
    try:
        before = counters(envoy)
        redis.proc.popen.send_signal(signal.SIGSTOP)
        held = []
        try:
            for _ in range(3):
                t0 = time.monotonic()
                r = h.request(envoy.port("main"), "POST", "/orders", b"{}", [("Idempotency-Key", new_key("nfrz")), JSON],
                              timeout=10)
                held.append(time.monotonic() - t0)
                assert r.status == 201 and r.header("x-upstream-id"), r
        finally:
            redis.proc.popen.send_signal(signal.SIGCONT)
        assert all(0.45 <= x < 0.8 for x in held), held
        assert counter_delta(counters(envoy), before)["degraded"] == 3
        key = new_key("nfrz-after")
        h.wait_for(lambda: h.request(envoy.port("main"), "POST", "/orders", b"{}", [("Idempotency-Key", key), JSON])
                   .header("x-idempotent-replay") == "true", "a replay once Redis runs again", timeout=15)
        note(f"native Redis frozen: 3 requests failed open after {', '.join(ms(x) for x in held)} "
             f"(store_timeout_ms 300 + lock_wait_ms 200), guarded again after SIGCONT")
    finally:
        envoy.stop()


def test_an_idle_worker_takes_late_answers_as_of_when_they_came(run_dir, upstream, redis, note):
    """One worker. A request's commit meets a frozen Redis (SIGSTOP while the upstream works),
    so the worker's ticks queue up while its only stream is gone; Redis thaws 200 ms later and
    the answer queues behind them; the worker then idles past `store_timeout_ms`. Its next
    stream drains the queue: each event is taken as of when it came, so the commit counts as
    stored (not a timeout, no failed commit, no breaker), and nothing degrades after."""
    envoy = start_native(run_dir / "native-drills", "envoy-idle", upstream.port,
                         {"store": {"redis": redis.url, "timeout_ms": 5000}, "store_timeout_ms": 1000},
                         concurrency=1)
    try:
        key = new_key("nidle")
        out: dict[str, h.Response] = {}
        t = threading.Thread(target=lambda: out.setdefault("r", h.request(
            envoy.port("main"), "POST", "/orders", b"{}", [("Idempotency-Key", key), ("x-test-sleep-ms", "300"), JSON])))
        t.start()
        h.wait_for(lambda: upstream.count(key=key) == 1, "the request to reach the upstream", timeout=10)
        redis.proc.popen.send_signal(signal.SIGSTOP)
        try:
            t.join(10)
            assert out["r"].status == 201
            time.sleep(0.2)  # the commit waits on the frozen Redis while the worker's ticks queue
        finally:
            redis.proc.popen.send_signal(signal.SIGCONT)
        time.sleep(3.0)  # idle past the commit's deadline: the queued answer is older than it now
        before = counters(envoy)
        second = new_key("nidle-2")
        r = h.request(envoy.port("main"), "POST", "/orders", b"{}", [("Idempotency-Key", second), JSON])
        assert r.status == 201 and r.header("x-upstream-id"), r
        after = counter_delta(counters(envoy), before)
        assert after["stored"] >= 1, after  # the late commit, counted when the worker woke
        for name in ("commit_failed", "store_errors", "degraded", "store_skipped"):
            assert after.get(name, 0) == 0, (name, after)
        assert "timed out" not in envoy.log_text()
        assert h.request(envoy.port("main"), "POST", "/orders", b"{}", [("Idempotency-Key", key), JSON]) \
            .header("x-idempotent-replay") == "true"
    finally:
        envoy.stop()
