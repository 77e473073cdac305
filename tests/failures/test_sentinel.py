"""idemstore on Redis Sentinel: the master killed under steady load, and a failover back.

One master, one replica and three sentinels (`support/sentinel.py`; AUTH on every node and
every sentinel), idemstores started with `--redis-sentinel` and `--redis-sentinel-master`,
one filter Envoy (`--concurrency 2`) whose `idemstore` cluster has the shipped health check
(`/healthz`, panic threshold 0) and an access log with each request's outcome (filter state
`wasm.idempotency_outcome`), so every request of the load is classified exactly.

The drill (the master killed under load): client threads send fresh keys, each at least twice (an
immediate retry, and later retries of older keys), while the master is SIGKILLed. Until the
sentinels promote the replica, idemstore has no master (`/healthz` 503): Envoy's health check
takes it out and the filter fails open under its local lock (one execution per key within the
Envoy, retries of keys stored before the kill get `503` + `retry-after`). Measured and noted:
the failover (kill -> the replica is master and every sentinel says so), idemstore's
`/healthz` back, Envoy seeing it healthy, the first request executed under the store's lock
again, the degraded requests and the executions per key (`<run>/sentinel_failover.txt`).

Replication is asynchronous (as on Cluster, see test_redis_cluster.py): the test makes its
"records stored before the kill are replayed" check deterministic with `WAIT 1` on the master
before the kill.

The failback: the killed master comes back as a replica, then a manual failover
(`SENTINEL FAILOVER`, as for maintenance) makes it master again while the other stays up.
Sentinel demotes a reachable old master only when it converts it to a replica, about ten
seconds later (it waits 4 x its 2 s publish period after the role change), and that resync
discards whatever was written there meanwhile; so idemstore has to notice the sentinels' new
master by itself, within `FOLLOW_BOUND_S`, not only after a connection error or `READONLY`.

Over TLS (TLS and AUTH to the sentinels too): `sentinel_stack(..., tls=True)` runs the
nodes and the sentinels on TLS only with client certificates required (`support/secure.py`'s
certificates) and gives idemstore `rediss://` sentinels, the CA and its client certificate; the
short `test_sentinel_over_tls_master_killed` kills the master without load and checks replays,
exactly-once fresh keys under the store's lock and `/healthz`.
"""

from __future__ import annotations

import json
import random
import ssl
import threading
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from support import burst
from support import harness as h
from support import redis_cluster as rc
from support import secure
from support import sentinel as sn
from support.burst import assert_exactly_once, fire
from support.checks import REPLAY, assert_executed, assert_problem, assert_replay_of
from support.replicas import LISTENER, ReplicaSet, plugin_config, totals, wait_settled, wait_totals

STORE_KEY_HEADER = "x-idempotency-store-key"
PLUGIN = {"store_key_header": STORE_KEY_HEADER}
DRILL_ID = "x-drill-id"
ACCESS_LOG_FORMAT = {
    "id": f"%REQ({DRILL_ID.upper()})%",
    "status": "%RESPONSE_CODE%",
    "idempotency": "%FILTER_STATE(wasm.idempotency_outcome:PLAIN)%",
}


# --------------------------------------------------------------------------------------------
# the stack: sentinels, idemstores on them, one health-checking filter Envoy
# --------------------------------------------------------------------------------------------


@dataclass
class SentinelStack:
    sub: Path
    sentinels: sn.SentinelSet
    rs: ReplicaSet          # the Envoy and the idemstores (burst.fire, totals)
    access_log: Path
    pki: secure.Material | None = None   # the certificates, when everything runs on TLS

    @property
    def envoy(self) -> h.Envoy:
        return self.rs.envoys[0]

    @property
    def port(self) -> int:
        return self.rs.port(0)

    def post(self, key: str) -> h.Response:
        hdrs = [("idempotency-key", key), ("content-type", "application/json")]
        return h.request(self.port, "POST", "/orders", body_for(key), hdrs, timeout=10)

    def outcomes(self, ids: set[str], timeout: float = 10.0) -> dict[str, str | None]:
        """Drill id -> the filter's outcome, from the access log (flushed about every second)."""
        def read():
            out = {}
            if self.access_log.exists():
                for line in self.access_log.read_text().splitlines():
                    doc = json.loads(line)
                    if doc.get("id") in ids:
                        out[doc["id"]] = doc.get("idempotency")
            return out if len(out) == len(ids) else None
        return h.wait_for(read, f"{len(ids)} access log lines", timeout=timeout, interval=0.1)


def body_for(key: str) -> bytes:
    # The same body on every retry of a key (another would be a 422).
    return json.dumps({"order": key, "qty": 1 + len(key) % 5}, separators=(",", ":")).encode()


def host_flags(envoy: h.Envoy) -> list[str]:
    status, body = h.http_get_status(envoy.admin_port, "/clusters", timeout=5)
    assert status == 200, status
    return [parts[3] for parts in (line.split("::") for line in body.decode().splitlines())
            if len(parts) == 4 and parts[0] == "idemstore" and parts[2] == "health_flags"]


def hosts_healthy(envoy: h.Envoy) -> bool:
    flags = host_flags(envoy)
    return bool(flags) and all(f == "healthy" for f in flags)


def store_back(st: "SentinelStack", store_port: int) -> bool:
    """The filter's store answers again: idemstore's /healthz 200 and Envoy's health check sees
    it healthy; on the native host (the store in Envoy's process, which no health check
    watches) a fresh key runs under the store's lock (`degraded` does not move)."""
    if not h.native():
        return healthz(store_port) == 200 and hosts_healthy(st.envoy)
    degraded = st.envoy.counter("degraded")
    return st.post(h.new_key("store-back")).status == 201 and st.envoy.counter("degraded") == degraded


def healthz(port: int) -> int:
    try:
        return h.http_get_status(port, "/healthz", timeout=1.5)[0]
    except OSError:
        return 0


def spawn_idemstore(sub: Path, s: sn.SentinelSet, name: str, password_via: str = "file",
                    scheme: str | None = None, extra: list[str] | None = None) -> tuple[h.Proc, int]:
    """idemstore on the sentinels (`--redis-sentinel`, `--redis-sentinel-master`), the password
    (the nodes' and the sentinels' own, the same here) from `s.password_file`
    (`--redis-password-file`, `--redis-sentinel-password-file`) or from the environment
    (IDEMSTORE_REDIS_PASSWORD, IDEMSTORE_REDIS_SENTINEL_PASSWORD), `extra` flags (the TLS
    ones); not waited for."""
    port = h.free_port()
    argv = [h.idemstore_bin(), "--listen", f"{h.LOOPBACK}:{port}",
            "--redis-sentinel", s.sentinel_addrs(scheme), "--redis-sentinel-master", s.name, *(extra or [])]
    env = {"RUST_LOG": "info"}
    if password_via == "file":
        argv += ["--redis-password-file", str(s.password_file),
                 "--redis-sentinel-password-file", str(s.password_file)]
    else:
        env["IDEMSTORE_REDIS_PASSWORD"] = s.password
        env["IDEMSTORE_REDIS_SENTINEL_PASSWORD"] = s.password
    proc = h.start(name, argv, sub, env=env)
    return proc, port


def with_health_check_and_access_log(store_ports: list[int], log: Path):
    def hook(config):
        res = config["static_resources"]
        res["clusters"] = [c for c in res["clusters"] if c["name"] != "idemstore"]
        res["clusters"].append(h.store_cluster(store_ports, health_check=True))
        for ln in res["listeners"]:
            hcm = ln["filter_chains"][0]["filters"][0]["typed_config"]
            hcm["access_log"] = [{
                "name": "envoy.access_loggers.file",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                    "path": str(log),
                    "log_format": {"json_format": ACCESS_LOG_FORMAT},
                },
            }]
    return hook


@pytest.fixture
def sentinel_stack(run_dir, artifacts, upstream):
    """Factory: `sentinel_stack(name, stores=2, password_via="file", scheme=None, plugin={},
    tls=False)`. With `tls`, the nodes and the sentinels run on TLS only and require client
    certificates (`secure.material`'s certificates), and the idemstores get `rediss://`
    sentinels, the CA and their client certificate (`--redis-ca-file`, `--redis-cert-file`,
    `--redis-key-file`). Everything is stopped by PID after the test, which fails on a wasm
    panic in the Envoy log."""
    made: list[SentinelStack] = []

    def make(name: str, stores: int = 2, password_via: str = "file", scheme: str | None = None,
             plugin: dict | None = None, tls: bool = False) -> SentinelStack:
        sub = run_dir / name
        n = 1
        while sub.exists():
            n += 1
            sub = run_dir / f"{name}-{n}"
        m = secure.material(sub / "pki") if tls else None
        s = sn.start_sentinels(sub / "sentinel", settle=False, tls=m.redis_tls() if m else None)
        rs = ReplicaSet(sub.name, sub, "sentinel", plugin_config({**PLUGIN, **(plugin or {})}), upstream.port)
        stack = SentinelStack(sub, s, rs, sub / "access.log", m)
        made.append(stack)
        extra = secure.redis_flags(m) if m else []   # the CA, idemstore's client certificate
        if m:
            scheme = "rediss"
        # idemstores and the Envoy start while the sentinels find each other.
        rs.stores = [spawn_idemstore(sub, s, f"idemstore-{i}", password_via, scheme, extra) for i in range(stores)]
        filters = {LISTENER: [h.wasm_filter(json.dumps(rs.plugin), artifacts["wasm"])]}
        rs.envoys.append(h.spawn_envoy(sub, "envoy", filters, upstream.port, rs.store_ports,
                                       config_hook=with_health_check_and_access_log(rs.store_ports, stack.access_log)))
        for proc, port in rs.stores:
            h.await_idemstore(proc, port)
        h.await_envoy(rs.envoys[0])
        s.wait_settled(s.first_master, [s.first_replica])
        h.wait_for(lambda: hosts_healthy(stack.envoy), "idemstores healthy in Envoy", stack.envoy.proc, timeout=10)
        return stack

    yield make
    panics = []
    for stack in reversed(made):
        stack.rs.stop()
        stack.sentinels.stop()
        panics += stack.rs.panics()
    if panics:
        pytest.fail("wasm panic or trap in the Envoy log:\n" + "\n".join(panics[:20]), pytrace=False)


# --------------------------------------------------------------------------------------------
# the load: client threads, fresh keys each sent at least twice
# --------------------------------------------------------------------------------------------


@dataclass
class Sent:
    id: str
    key: str
    seq: int                # 0: the key's first request; 1: its immediate retry; 2+: a later retry
    start: float = 0.0
    done: float = 0.0
    status: int = 0
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    error: str | None = None
    outcome: str | None = None   # the filter's, from the access log

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k == name), None)

    @property
    def original(self) -> bool:
        """An execution's own answer: 2xx, not a replay."""
        return self.error is None and 200 <= self.status < 300 and self.header(REPLAY) is None

    def __repr__(self) -> str:
        return (f"Sent({self.key} seq={self.seq} status={self.status} outcome={self.outcome} error={self.error!r} "
                f"replay={self.header(REPLAY)} {(self.done - self.start) * 1000:.0f}ms body={self.body[:160]!r})")


class Load:
    """`threads` clients; each sends a fresh key, at once its retry, and about every other round
    a retry of one of its keys answered at least `retry_age` s ago; a round every `period` s."""

    def __init__(self, port: int, prefix: str, threads: int = 4, period: float = 0.02,
                 retry_age: float = 0.3, sleep_ms: int = 5, seed: int = 27):
        self.port, self.prefix, self.threads, self.period = port, prefix, threads, period
        self.retry_age, self.sleep_ms, self.seed = retry_age, sleep_ms, seed
        self.sent: list[Sent] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._workers: list[threading.Thread] = []
        self.t0 = 0.0

    def send(self, key: str, seq: int) -> Sent:
        x = Sent(uuid.uuid4().hex, key, seq)
        with self._lock:
            self.sent.append(x)
        hdrs = [("idempotency-key", key), ("content-type", "application/json"),
                ("x-test-sleep-ms", str(self.sleep_ms)), (DRILL_ID, x.id)]
        x.start = time.monotonic()
        try:
            r = h.request(self.port, "POST", "/orders", body_for(key), hdrs, timeout=10)
            x.status, x.headers, x.body = r.status, r.headers, r.body
        except Exception as e:  # noqa: BLE001 - recorded, asserted on
            x.error = repr(e)
        x.done = time.monotonic()
        return x

    def _run(self, i: int) -> None:
        rng = random.Random(self.seed + i)
        answered: list[tuple[float, str]] = []
        n = 0
        tick = time.monotonic()
        while not self._stop.is_set():
            key = f"{self.prefix}-{i}-{n:05d}"
            n += 1
            first = self.send(key, 0)
            self.send(key, 1)
            if first.original:
                answered.append((first.done, key))
            old = [k for t, k in answered if t <= time.monotonic() - self.retry_age]
            if old and rng.random() < 0.5:
                self.send(rng.choice(old), 2)
            tick += self.period
            wait = tick - time.monotonic()
            if wait > 0:
                self._stop.wait(wait)
            else:
                tick = time.monotonic()

    def start(self) -> None:
        self.t0 = time.monotonic()
        self._workers = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.threads)]
        for t in self._workers:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._workers:
            t.join(15)
        assert not any(t.is_alive() for t in self._workers), "a load thread is stuck"

    def by_key(self) -> dict[str, list[Sent]]:
        out = defaultdict(list)
        for x in self.sent:
            out[x.key].append(x)
        return out


class Poll:
    """Polls `check()` every `interval` s in a thread, keeping (time, value) samples."""

    def __init__(self, check, interval: float = 0.02):
        self.check, self.interval = check, interval
        self.samples: list[tuple[float, object]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                value = self.check()
            except Exception as e:  # noqa: BLE001 - a sample like any other
                value = e
            self.samples.append((time.monotonic(), value))
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)

    def first(self, pred, after: float = 0.0) -> float | None:
        return next((t for t, v in self.samples if t >= after and pred(v)), None)

    def last(self, pred) -> float | None:
        return next((t for t, v in reversed(self.samples) if pred(v)), None)


def store_keys_of(executions: list[dict]) -> dict[str, str]:
    """Client key -> store key, from the header the filter gave the upstream."""
    out = {}
    for ex in executions:
        for name, value in ex.get("headers", []):
            if name == STORE_KEY_HEADER:
                out[ex["key"]] = value
    return out


def record_key(store_key: str) -> str:
    return f"idem:{{{store_key}}}:r"


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.2f}s"


# --------------------------------------------------------------------------------------------
# the drill
# --------------------------------------------------------------------------------------------


def test_sentinel_master_killed_under_load(sentinel_stack, upstream, run_dir, note):
    """The master is SIGKILLed 1.5 s into a steady load (4 client threads, each key sent at
    least twice) over one Envoy and two idemstores on three sentinels. Every request is
    answered: a 2xx execution, a byte-exact replay of one of its key's executions, a `503` +
    `retry-after` to a retry of a key run before the outage (its answer is in the store, which
    cannot be read), or a `409` for a key whose lock a store call cut by the kill left behind.
    `degraded` counts exactly the requests that ran without the store's lock (upstream
    executions = executed + degraded), none before the kill and none once Envoy sees the
    idemstores healthy again; each key ran once except where the kill lost a guarded record
    (bounded by the requests in flight at the kill). idemstore's `/healthz` is 503 without a
    master and 200 after the failover. Records stored (and WAIT-ed onto the replica) before the
    kill are replayed by the promoted replica, and a burst after the failover runs each key once
    with its records on the new master."""
    st = sentinel_stack("sentinel-failover", stores=2)
    s, rs = st.sentinels, st.rs
    old_master = s.first_master
    base = totals(rs)

    # Records before the kill, replicated.
    pre_spec = burst.BurstSpec(keys=40, duplicates=3, sleep_ms=(5, 20), keys_in_flight=20, seed=3)
    pre, pre_check = fire(rs, upstream, pre_spec, rs.run_dir, "before-kill")
    assert_exactly_once(pre_check, pre_spec.keys, pre_spec.duplicates)
    assert wait_totals(rs, "stored", base["stored"] + pre_spec.keys) == base["stored"] + pre_spec.keys
    pre_skeys = store_keys_of(upstream.executions(key_prefix=pre.prefix, headers=True))
    assert len(pre_skeys) == pre_spec.keys
    assert all(s.cmd(old_master, "EXISTS", record_key(sk)) == 1 for sk in pre_skeys.values())
    s.wait_replicated(old_master, 1000)

    # The load, the kill 1.5 s in; it runs until 1.5 s after Envoy has every idemstore healthy.
    load = Load(st.port, f"S{uuid.uuid4().hex[:10]}")
    before = totals(rs)
    wall = time.time() - time.monotonic()   # the upstream stamps executions with time.time()
    stores = rs.store_ports
    with Poll(lambda: [healthz(p) for p in stores]) as health, Poll(lambda: hosts_healthy(st.envoy)) as envoy_ok:
        load.start()
        try:
            time.sleep(max(0.0, load.t0 + 1.5 - time.monotonic()))  # 1.5 s of load before the kill
            killed = s.kill(old_master)
            new_master, failover_s = s.wait_failover(old_master, timeout=20)
            h.wait_for(lambda: envoy_ok.first(bool, after=killed + failover_s), "Envoy sees the idemstores healthy",
                       st.envoy.proc, timeout=15, interval=0.02)
            back = envoy_ok.first(bool, after=killed + failover_s)
            time.sleep(max(0.0, back + 1.5 - time.monotonic()))
        finally:
            load.stop()
        after = wait_settled(rs)
    failed_over = killed + failover_s
    assert new_master == s.first_replica, s.describe()

    # idemstore's /healthz: 503 without a master, 200 again after the failover.
    healthz_down, healthz_back = {}, {}
    for i, port in enumerate(stores):
        down = health.first(lambda v, i=i: isinstance(v, list) and v[i] != 200, after=killed)
        assert down is not None, f"idemstore-{i} never answered /healthz other than 200 without a master"
        codes = {v[i] for t, v in health.samples if isinstance(v, list) and killed <= t < failed_over}
        assert codes <= {200, 503}, codes
        up = health.first(lambda v, i=i: isinstance(v, list) and v[i] == 200, after=down)
        assert up is not None, f"idemstore-{i} /healthz never 200 again"
        healthz_down[i], healthz_back[i] = down - killed, up - killed
    envoy_unhealthy = envoy_ok.first(lambda v: v is False, after=killed)

    # Every request answered, classified with the filter's own outcome.
    outcomes = st.outcomes({x.id for x in load.sent})
    for x in load.sent:
        x.outcome = outcomes[x.id]
    by_key = load.by_key()
    execs = upstream.executions(key_prefix=load.prefix, headers=True)
    skeys = store_keys_of(execs)
    per_key_execs = defaultdict(list)
    for ex in execs:
        per_key_execs[ex["key"]].append(ex)
    first_start = {k: min(x.start for x in v) for k, v in by_key.items()}
    failures, withheld, conflicts = [], [], []
    executed_answers = 0
    for key, sent in by_key.items():
        originals = [x for x in sent if x.original]
        executed_answers += len(originals)
        for x in sent:
            if x.error is not None:
                failures.append(f"transport error: {x!r}")
            elif x.original:
                if x.header("x-upstream-id") not in {ex["id"] for ex in per_key_execs[key]}:
                    failures.append(f"an original that is no execution of its key: {x!r}")
                elif x.outcome not in ("executed", "degraded"):
                    failures.append(f"an execution with outcome {x.outcome!r}: {x!r}")
            elif x.status == 503 and b"already processed" in x.body:
                # A retry in the outage of a key this Envoy ran before it: not run again.
                assert_problem(h.Response(x.status, x.headers, x.body), 503, key)
                if x.header("retry-after") is None or x.outcome != "unavailable" \
                        or not any(o.start < x.start for o in originals) or not killed - 0.05 <= x.start:
                    failures.append(f"a 503 that is not a withheld retry in the outage: {x!r}")
                withheld.append(x)
            elif x.status == 409 and first_start[key] < failed_over:
                # A lock the kill orphaned (a begin or release cut by it): duplicates wait and
                # are told to retry until its TTL.
                assert_problem(h.Response(x.status, x.headers, x.body), 409, key)
                conflicts.append(x)
            elif x.header(REPLAY) == "true":
                if not any(burst.not_replay_of(x, o) is None for o in originals):
                    failures.append(f"a replay of no execution of its key: {x!r}")
            else:
                failures.append(f"unexpected answer: {x!r}")
    requests = len(load.sent)
    assert not failures, f"{len(failures)} bad answers of {requests}:\n" + "\n".join(failures[:20])
    assert executed_answers == len(execs), (executed_answers, len(execs))
    assert all(len(v) >= 2 for v in by_key.values())

    # `degraded` counts exactly the requests that ran without the store's lock.
    delta = {k: after[k] - before[k] for k in after}
    assert delta["executed"] + delta["degraded"] == len(execs), (delta, len(execs))
    degraded = [x for x in load.sent if x.outcome == "degraded"]
    assert len(degraded) == delta["degraded"] > 0, (len(degraded), delta)
    assert delta["unavailable"] == len(withheld), (delta, len(withheld))
    # None before the kill, none once Envoy had the idemstores healthy again (with their master).
    assert all(x.start >= killed - 0.05 for x in degraded), [x for x in degraded if x.start < killed][:5]
    late = [x for x in degraded if x.start > back + 0.1]
    assert not late, f"degraded after Envoy saw the idemstores healthy at {back - killed:+.2f}s: {late[:5]}"
    guarded_again = min((x.done for x in load.sent if x.outcome == "executed" and x.start > killed + 0.05),
                        default=None)
    assert guarded_again is not None, "no request ran under the store's lock after the kill"

    # Executions per key. With one Envoy and its local lock a key runs once, unless its record
    # was committed to the old master and lost with it (asynchronous replication) or an
    # execution in the outage was not handed back before a retry reached the new master.
    runs = Counter(len(per_key_execs[k]) for k in by_key)
    twice = {k: len(per_key_execs[k]) for k in by_key if len(per_key_execs[k]) > 1}
    around_kill = sum(1 for x in load.sent if x.start <= killed + 0.05 and x.done >= killed - 0.05)
    # Which execution each record holds (the stored, guarded one); executions without one.
    unrecorded = 0
    missing = [k for k in by_key if not skeys.get(k)]
    assert not missing, f"the upstream never saw {missing[:5]}"
    ordered = list(by_key)
    records = {}
    for i in range(0, len(ordered), 500):
        chunk = ordered[i:i + 500]
        records.update(zip(chunk, s.cmd(new_master, "MGET", *(record_key(skeys[k]) for k in chunk), timeout=5)))
    for k in by_key:
        record = records[k] or b""
        stored = [ex for ex in per_key_execs[k] if f'"id": "{ex["id"]}"'.encode() in record
                  or f'"id":"{ex["id"]}"'.encode() in record]
        assert len(stored) <= 1, (k, record[:300])
        unrecorded += len(per_key_execs[k]) - len(stored)
    # Hand-backs go on after the load (in batches): counted up to now, after the records were read.
    handed_back = rs.counter_total("handed_back") - before["handed_back"]
    lost = unrecorded - delta["degraded"]
    assert len(twice) <= around_kill + delta["commit_failed"], (twice, around_kill, delta)
    assert -handed_back <= lost <= around_kill + delta["commit_failed"], (lost, around_kill, delta)

    # The measurements.
    first_degraded = min(x.start for x in degraded) - killed
    last_degraded = max(x.start for x in degraded) - killed
    outcome_counts = Counter(x.outcome for x in load.sent)
    slowest = max(x.done - x.start for x in load.sent)
    lines = [
        f"sentinel master killed: {requests} requests ({len(by_key)} keys, each sent 2+ times) over "
        f"{load.sent[-1].done - load.t0:.1f}s, 1 envoy x {len(stores)} idemstores, 1 master + 1 replica + "
        f"3 sentinels (down-after-milliseconds {sn.DOWN_AFTER_MS}, quorum {sn.QUORUM})",
        f"  failover (kill -> replica is master and all 3 sentinels report it): {failover_s:.2f}s; idemstore "
        f"/healthz not 200 after {', '.join(ms(v) for v in healthz_down.values())}, 200 again after "
        f"{', '.join(ms(v) for v in healthz_back.values())}; Envoy health check: unhealthy after "
        f"{ms(envoy_unhealthy - killed if envoy_unhealthy else None)}, healthy after {ms(back - killed)}",
        f"  first request executed under the store's lock again: answered {ms(guarded_again - killed)} after "
        f"the kill ({guarded_again - failed_over:+.2f}s from the failover); degraded requests started "
        f"from {first_degraded:+.2f}s to {last_degraded:+.2f}s after the kill",
        f"  outcomes {dict(outcome_counts)}; degraded {delta['degraded']} ({delta['degraded'] / requests:.1%}), "
        f"local replays {delta['local_replays']}, handed back {handed_back}; 503 withheld retries "
        f"{len(withheld)}; 409 (lock orphaned by the kill) {len(conflicts)}",
        f"  executions per key {dict(sorted(runs.items()))}: {len(twice)} keys ran twice or more; executions "
        f"without their record {unrecorded} = degraded {delta['degraded']} {lost:+d} (guarded records the kill "
        f"lost, of {around_kill} requests in flight at it); commit_failed {delta['commit_failed']}; slowest "
        f"answer {slowest * 1000:.0f} ms",
    ]
    with open(run_dir / "sentinel_failover.txt", "a") as f:
        f.write("\n".join(lines) + "\n")
    for line in lines:
        note(line)

    # Records stored before the kill: on the promoted replica, replayed, not run again.
    assert all(s.cmd(new_master, "EXISTS", record_key(sk)) == 1 for sk in pre_skeys.values())
    retry = burst.run_burst(rs.ports(), burst.BurstSpec(keys=pre_spec.keys, duplicates=2, sleep_ms=(0, 0),
                                                        keys_in_flight=20), prefix=pre.prefix)
    bad = burst.replays_of_originals(retry, pre)
    assert not bad, "\n".join(bad[:20])
    assert upstream.count(key_prefix=pre.prefix) == pre_spec.keys

    # After the failover: exactly once again, the records on the new master.
    post_before = totals(rs)
    post_spec = burst.BurstSpec(keys=40, duplicates=5, sleep_ms=(10, 50), keys_in_flight=20, seed=9)
    post, post_check = fire(rs, upstream, post_spec, rs.run_dir, "after-failover")
    assert_exactly_once(post_check, post_spec.keys, post_spec.duplicates)
    want = post_before["stored"] + post_spec.keys
    assert wait_totals(rs, "stored", want) == want
    d = {k: v - post_before[k] for k, v in totals(rs).items()}
    assert d["degraded"] == 0 and d["store_errors"] == 0, d
    post_skeys = store_keys_of(upstream.executions(key_prefix=post.prefix, headers=True))
    assert all(s.cmd(new_master, "EXISTS", record_key(sk)) == 1 for sk in post_skeys.values())

    # The password reached no log.
    for proc, _ in rs.stores:
        assert s.password not in proc.log_text(), proc.log


# --------------------------------------------------------------------------------------------
# the old master back as a replica, then a manual failover back to it
# --------------------------------------------------------------------------------------------


def guarded(st: SentinelStack, upstream, label: str) -> tuple[str, h.Response]:
    """A fresh key: executed under the store's lock (counted `executed`, not `degraded`), its
    retry replayed; returns (key, first answer)."""
    before = st.envoy.counters()
    key = h.new_key(label)
    first = st.post(key)
    assert_executed(first, 201)
    assert st.envoy.wait_counter("stored", before.get("stored", 0) + 1) == before.get("stored", 0) + 1
    assert_replay_of(st.post(key), first)
    after = st.envoy.counters()
    assert after.get("executed", 0) - before.get("executed", 0) == 1, (before, after)
    assert after.get("degraded", 0) == before.get("degraded", 0), (before, after)
    assert upstream.count(key=key) == 1
    return key, first


def store_key_of(upstream, key: str) -> str:
    ex = upstream.executions(key=key, headers=True)
    assert ex, key
    return next(v for name, v in ex[0]["headers"] if name == STORE_KEY_HEADER)


def where_recorded(s: sn.SentinelSet, store_key: str, nodes: list[int], timeout: float = 2.0) -> list[int]:
    """The nodes holding the record of `store_key` (the commit lands after the answer: polled
    until one has it)."""
    def holders():
        return [p for p in nodes if s.cmd(p, "EXISTS", record_key(store_key)) == 1]
    try:
        return h.wait_for(holders, f"record {store_key[:12]} on {nodes}", timeout=timeout, interval=0.01)
    except h.HarnessError:
        return []


# How soon after the sentinels name a new master idemstore must write there. A client that
# subscribes to the sentinels' +switch-master, or asks them every second, is within it.
FOLLOW_BOUND_S = 2.0


def test_sentinel_old_master_returns_and_fails_back(sentinel_stack, upstream, note):
    """One idemstore whose sentinels are given as `redis://` URLs and whose passwords come from
    IDEMSTORE_REDIS_PASSWORD and IDEMSTORE_REDIS_SENTINEL_PASSWORD. The master (a) is killed,
    no load: idemstore follows the failover to b (`/healthz` 200 again, a fresh key executed
    under the store's lock, its record on b, records written before replayed). a is started
    again as a replica of b. Then a manual failover (`SENTINEL FAILOVER`) moves the master back
    to a under a light load; b stays up (Sentinel demotes a reachable old master only when it
    converts it, seconds later) and whatever is written to b after a's promotion is discarded
    when b resyncs from a. idemstore must follow within FOLLOW_BOUND_S of the sentinels naming
    a (fresh keys' records on a), every request is answered, and a key runs twice only if its
    first execution was recorded on b before idemstore could follow. On the native host the
    module's store follows instead, its passwords from the files (the harness gives the module
    no idemstore's environment: `harness.native_store_of`)."""
    st = sentinel_stack("sentinel-failback", stores=1, password_via="file" if h.native() else "env",
                        scheme="redis")
    s = st.sentinels
    a, b = s.first_master, s.first_replica
    (store, store_port), = st.rs.stores

    keys: dict[str, h.Response] = {}
    for i in range(5):
        k, r = guarded(st, upstream, f"fb-a{i}")
        keys[k] = r
    s.wait_replicated(a, 1000)

    # Failover 1: a killed, b promoted; idemstore follows.
    killed = s.kill(a)
    promoted, failover_s = s.wait_failover(a, timeout=20)
    assert promoted == b
    h.wait_for(lambda: store_back(st, store_port), "idemstore back on the new master", store, timeout=15,
               interval=0.02)
    back_s = time.monotonic() - killed
    for k, r in keys.items():
        assert_replay_of(st.post(k), r)
    for i in range(5):
        k, r = guarded(st, upstream, f"fb-b{i}")
        keys[k] = r
        assert where_recorded(s, store_key_of(upstream, k), [b]) == [b], k

    # a back, as a replica of b.
    t = time.monotonic()
    s.restart(a, replicaof=b)
    settle_s = s.wait_settled(b, [a], timeout=30)
    s.wait_replicated(b, 1000)
    rejoin_s = time.monotonic() - t

    # Failover 2, manual, under a light load: back to a. Fresh keys every 0.1 s show where
    # idemstore writes.
    load = Load(st.port, f"F{uuid.uuid4().hex[:10]}", threads=2, period=0.02)
    before = totals(st.rs)
    probe_prefix = f"P{uuid.uuid4().hex[:10]}"
    probes: list[tuple[float, list[int]]] = []
    load.start()
    try:
        time.sleep(max(0.0, load.t0 + 0.5 - time.monotonic()))
        started = time.monotonic()
        s.failover()
        h.wait_for(lambda: s.agreed_master() == a and s.role(a) == "master", "manual failover to a",
                   timeout=20, interval=0.01)
        switched = time.monotonic()
        manual_s = switched - started
        deadline = switched + FOLLOW_BOUND_S + 3.0
        while time.monotonic() < deadline:
            k = f"{probe_prefix}-{len(probes):04d}"
            sent_at = time.monotonic()
            assert st.post(k).status == 201
            probes.append((sent_at, where_recorded(s, store_key_of(upstream, k), [a, b])))
            if probes[-1][1] == [a]:
                break
            time.sleep(0.1)
        time.sleep(1.0)  # one more second of load after it
    finally:
        load.stop()
    b_role, b_role_at = s.role(b), time.monotonic() - switched
    after = wait_settled(st.rs)
    followed = next((t0 for t0, where in probes if where == [a]), None)
    follow_s = None if followed is None else followed - switched
    on_b = sum(1 for _, where in probes if where == [b])

    outcomes = st.outcomes({x.id for x in load.sent})
    for x in load.sent:
        x.outcome = outcomes[x.id]
    bad = [x for x in load.sent if x.error is not None or not (
        x.original or x.header(REPLAY) == "true"
        or (x.status == 503 and b"already processed" in x.body) or x.status == 409)]
    execs = upstream.executions(key_prefix=load.prefix)
    probe_execs = upstream.count(key_prefix=probe_prefix)
    delta = {k: after[k] - before[k] for k in after}
    by_key = load.by_key()
    per_key = Counter(ex["key"] for ex in execs)
    twice = {k: n for k, n in per_key.items() if n > 1}
    first_done = {k: min(x.done for x in v if x.original) for k, v in by_key.items() if any(x.original for x in v)}
    late_twice = {k: round(first_done[k] - switched, 2) for k in twice if first_done[k] > switched + FOLLOW_BOUND_S}
    outcome_counts = Counter(x.outcome for x in load.sent)
    note(f"sentinel failback: kill -> replica promoted {failover_s:.2f}s, idemstore healthy and guarding "
         f"{back_s:.2f}s; old master back as a replica, sentinels agree in {settle_s:.2f}s ({rejoin_s:.2f}s "
         f"with the restart)")
    note(f"  manual SENTINEL FAILOVER back to it: sentinels agree {manual_s:.2f}s after the command; the old "
         f"master still a {b_role} {b_role_at:.1f}s after that; idemstore writing to the new master "
         f"{ms(follow_s)} after the switch ({on_b} probe records written to the "
         f"old one meanwhile); {len(load.sent)} requests: outcomes {dict(outcome_counts)}, keys run twice "
         f"{len(twice)} ({len(late_twice)} first run > {FOLLOW_BOUND_S}s after the switch)")

    assert not bad, bad[:20]
    assert delta["executed"] + delta["degraded"] == len(execs) + probe_execs, (delta, len(execs), probe_execs)
    assert probe_execs == len(probes)
    if follow_s is None or follow_s > FOLLOW_BOUND_S:
        # What it cost: once the sentinels convert b (seconds later), the records written there
        # are gone, and the probes' retries run again.
        demoted = h.wait_for(lambda: s.role(b) == "slave" and time.monotonic(), f"{b} converted to a replica",
                             timeout=40, interval=0.05)
        h.wait_for(lambda: store_back(st, store_port), "idemstore on a", store, timeout=15, interval=0.02)
        probe_keys = [f"{probe_prefix}-{i:04d}" for i, (_, where) in enumerate(probes) if where == [b]]
        rerun = 0
        for k in probe_keys:
            r = st.post(k)
            assert r.status == 201, r
            rerun += r.header(REPLAY) is None
        note(f"  the old master converted to a replica {demoted - switched:.1f}s after the switch: {rerun} of "
             f"{len(probe_keys)} probe keys recorded on it ran again on retry")
        b_role = f"replica since {demoted - switched:.1f}s after the switch; {rerun} of {len(probe_keys)} probe keys " \
                 f"recorded on it ran again on retry"
    for k, r in keys.items():   # written before the manual failover: on a too
        assert_replay_of(st.post(k), r)
        assert upstream.count(key=k) == 1, k
    assert s.password not in store.log_text()
    assert follow_s is not None and follow_s <= FOLLOW_BOUND_S, (
        f"idemstore kept writing to the demoted master {b} for {ms(follow_s)} after the sentinels named {a} "
        f"(probes, seconds after the switch and the nodes holding their record: "
        f"{[(round(t0 - switched, 2), w) for t0, w in probes]}); what it writes there is discarded when the "
        f"sentinels convert {b} to a replica of {a} (seconds later: {b_role})")
    assert not late_twice, f"keys run twice whose first run came after idemstore should have followed: {late_twice}"


# --------------------------------------------------------------------------------------------
# everything over TLS: nodes, replication, sentinels, idemstore's links
# --------------------------------------------------------------------------------------------


def answers(port: int, access: rc.Access) -> bool:
    """Whether `port` answers PING (after AUTH) to a client connecting as `access`."""
    try:
        return rc.command(port, "PING", timeout=1.0, access=access) == "PONG"
    except (OSError, ValueError, rc.RedisError):   # ssl.SSLError and a closed connection are OSErrors
        return False


def test_sentinel_over_tls_master_killed(sentinel_stack, upstream, note):
    """The Sentinel drill with everything on TLS: master, replica and three sentinels listen on
    TLS only and require a client certificate (plain TCP and TLS without a certificate get no
    answer), replication and the sentinels' own links are TLS, AUTH on every node and sentinel.
    One idemstore is given `--redis-sentinel rediss://...` with the CA, its client certificate
    and the two password files, behind one health-checking filter Envoy. Keys stored before the
    kill (WAIT-ed onto the replica) replay after the master is SIGKILLed and the replica
    promoted, without running again; fresh keys run exactly once under the store's lock (never
    `degraded`) with their records on the new master; `/healthz` is not 200 without a master
    and 200 again after the failover. The failover and idemstore's recovery are noted."""
    t0 = time.monotonic()
    st = sentinel_stack("sentinel-tls", stores=1, tls=True)
    up_s = time.monotonic() - t0
    s, m = st.sentinels, st.pki
    a, b = s.first_master, s.first_replica
    (store, store_port), = st.rs.stores
    assert store.argv[store.argv.index("--redis-sentinel") + 1] == s.sentinel_addrs("rediss")

    # TLS only, client certificates required, on every node and sentinel.
    no_cert = ssl.create_default_context(cafile=str(m.ca))
    for port in [a, b, *s.sentinel_ports]:
        assert answers(port, s.access), port
        assert not answers(port, rc.Access(password=s.password)), f"{port} answers plain TCP"
        assert not answers(port, rc.Access(tls=no_cert, password=s.password)), \
            f"{port} answers a TLS client without a certificate"

    # A few keys, stored under the lock, on the master and (WAIT) on the replica.
    keys: dict[str, h.Response] = {}
    for i in range(4):
        k, r = guarded(st, upstream, f"tls-a{i}")
        keys[k] = r
    skeys = {k: store_key_of(upstream, k) for k in keys}
    assert all(where_recorded(s, sk, [a]) == [a] for sk in skeys.values())
    s.wait_replicated(a, 1000)
    assert all(s.cmd(b, "EXISTS", record_key(sk)) == 1 for sk in skeys.values()), s.describe()

    # The master SIGKILLed; the replica promoted; idemstore and Envoy back.
    with Poll(lambda: healthz(store_port)) as health, Poll(lambda: hosts_healthy(st.envoy), 0.05) as envoy_ok:
        killed = s.kill(a)
        promoted, failover_s = s.wait_failover(a, timeout=20)
        assert promoted == b, s.describe()

        def recovered():
            down = health.first(lambda v: v != 200, after=killed)
            return (down is not None and health.first(lambda v: v == 200, after=down) is not None
                    and hosts_healthy(st.envoy))
        h.wait_for(recovered, "idemstore /healthz down and back to 200, healthy in Envoy", store,
                   timeout=15, interval=0.02)
        back_s = time.monotonic() - killed
        k, r = guarded(st, upstream, "tls-b0")     # the first fresh key after the failover
        guarded_s = time.monotonic() - killed
    down = health.first(lambda v: v != 200, after=killed)
    up = health.first(lambda v: v == 200, after=down)
    codes = {v for t, v in health.samples if killed <= t < up}
    assert codes <= {200, 503}, codes
    unhealthy = envoy_ok.first(lambda v: v is False, after=killed)

    # Stored before the kill: replayed by the promoted replica, not run again.
    for key, first in keys.items():
        assert_replay_of(st.post(key), first)
        assert upstream.count(key=key) == 1, key
    # Fresh keys: once each, under the store's lock, recorded on the new master.
    fresh = {k: r}
    for i in range(1, 4):
        key, first = guarded(st, upstream, f"tls-b{i}")
        fresh[key] = first
    for key in fresh:
        assert where_recorded(s, store_key_of(upstream, key), [b]) == [b], key
        assert upstream.count(key=key) == 1, key
    counters = st.envoy.counters()
    assert counters.get("degraded", 0) == 0, counters
    assert healthz(store_port) == 200
    assert s.password not in store.log_text()

    note(f"sentinel over TLS (nodes, replication and 3 sentinels TLS-only with client certificates required, AUTH; "
         f"idemstore on rediss:// sentinels with its client certificate): stack up in {up_s:.1f}s")
    note(f"  kill -> replica promoted and all 3 sentinels report it: {failover_s:.2f}s (down-after-milliseconds "
         f"{sn.DOWN_AFTER_MS}); idemstore /healthz not 200 after {ms(down - killed)}, 200 again after "
         f"{ms(up - killed)}; Envoy health check unhealthy after {ms(unhealthy - killed if unhealthy else None)}, "
         f"healthy again by {back_s:.2f}s; first fresh key executed under the store's lock {guarded_s:.2f}s "
         f"after the kill; {len(keys)} keys stored before the kill replayed, {len(fresh)} fresh keys once each")
