"""The native host's store on every backend idemstore has, configured through the `store` key
as docs/native.md lists it: a Redis Cluster, Sentinel (and its failover, measured), and one
Redis over TLS with a client certificate as the least-privilege ACL user of docs/security.md,
under a key prefix. Each: keys run once, retries replay, a different body is a 422, and the
records sit where idemstore would put them.
"""

from __future__ import annotations

import threading
import time

import pytest

from support import harness as h
from support import redis_cluster as rc
from support import secure
from support import sentinel as sn
from support.checks import assert_executed, assert_problem, assert_replay_of
from support.harness import new_key

JSON = ("content-type", "application/json")


def start_native(run_dir, name: str, upstream_port: int, config: dict) -> h.Envoy:
    admin, port = h.free_port(), h.free_port()
    cfg = {"admin": {"address": {"socket_address": {"address": h.LOOPBACK, "port_value": admin}}},
           "static_resources": {"listeners": [h.listener("main", port, [h.native_filter(config)])],
                                "clusters": [h.static_cluster("upstream", upstream_port)]}}
    return h.await_envoy(h.spawn_envoy_config(run_dir, name, cfg, admin, {"main": port}, env=h.native_env()))


def post(envoy: h.Envoy, key: str, body: bytes = b'{"n":1}') -> h.Response:
    return h.request(envoy.port("main"), "POST", "/orders", body, [("Idempotency-Key", key), JSON], timeout=10)


def run_once_and_replay(envoy: h.Envoy, upstream: h.Upstream, keys: list[str]) -> None:
    for key in keys:
        first = post(envoy, key)
        assert_executed(first)
        assert_replay_of(post(envoy, key), first)
        assert_problem(post(envoy, key, b'{"n":2}'), 422, key, code="key-reused")
        assert upstream.count(key=key) == 1


def test_redis_cluster(run_dir, upstream):
    cluster = rc.start_cluster(run_dir / "native-cluster", masters=3, replicas=0)
    envoy = None
    try:
        envoy = start_native(run_dir / "native-cluster", "envoy-cluster", upstream.port,
                             {"store": {"redis_cluster": cluster.urls()}})
        keys = [new_key("ncl") for _ in range(12)]
        run_once_and_replay(envoy, upstream, keys)
        # The records are spread over the masters, as idemstore's would be.
        holders = {p for p in cluster.master_ports() if rc.command(p, "DBSIZE") > 0}
        assert len(holders) >= 2, holders
        assert "configured; store: redis-cluster" in envoy.log_text()
    finally:
        if envoy is not None:
            envoy.stop()
        cluster.stop()


def test_sentinel_and_its_failover(run_dir, upstream, note):
    """Through the sentinels, with the master's password from a file; then the master is killed
    under load: requests fail open (degraded, each key still once in this Envoy) until the
    sentinels promote the replica and the client follows them; records written before the
    kill (and replicated) replay after it."""
    s = sn.start_sentinels(run_dir / "native-sentinel")
    envoy = None
    try:
        envoy = start_native(run_dir / "native-sentinel", "envoy-sentinel", upstream.port, {"store": {
            "redis_sentinel": [f"redis://{h.LOOPBACK}:{p}" for p in s.sentinel_ports],
            "sentinel_master": s.name, "password_file": str(s.password_file),
            "sentinel_password_file": str(s.password_file), "timeout_ms": 300}})
        before_keys = [new_key("nsn") for _ in range(4)]
        run_once_and_replay(envoy, upstream, before_keys)
        s.wait_replicated(s.first_master)
        results: list[tuple[float, str, h.Response]] = []
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                key = new_key("nsn-load")
                t0 = time.monotonic()
                try:
                    results.append((t0, key, post(envoy, key)))
                except OSError:
                    pass

        threads = [threading.Thread(target=load) for _ in range(2)]
        for t in threads:
            t.start()
        h.wait_for(lambda: len(results) >= 20, "load before the kill", timeout=10)
        killed = s.kill(s.first_master)
        promoted, took = s.wait_failover(s.first_master)
        h.wait_for(lambda: any(t0 > killed + took for t0, _, _ in results), "load after the promotion", timeout=10)
        stop.set()
        for t in threads:
            t.join(15)
        # The first new key the store guards again (no `degraded` moved for it) after the kill.
        h.wait_for(lambda: _guarded(envoy), "a key guarded after the failover", timeout=20)
        back = time.monotonic() - killed
        assert all(r.status == 201 for _, _, r in results), [r for _, _, r in results if r.status != 201][:3]
        assert all(upstream.count(key=k) == 1 for _, k, _ in results)
        for key in before_keys:
            assert post(envoy, key).header("x-idempotent-replay") == "true"
        degraded = envoy.counter("idempotency.degraded")
        note(f"native Sentinel failover: master killed under load, replica promoted and agreed by the sentinels "
             f"{took:.2f}s later; {len(results)} requests all 201, each key once; degraded {degraded}; a key "
             f"guarded again {back:.2f}s after the kill; the 4 keys stored before the kill replay")
    finally:
        if envoy is not None:
            envoy.stop()
        s.stop()


def _guarded(envoy: h.Envoy) -> bool:
    degraded = envoy.counter("idempotency.degraded")
    key = new_key("nsn-probe")
    first = post(envoy, key)
    return (first.status == 201 and envoy.counter("idempotency.degraded") == degraded
            and post(envoy, key).header("x-idempotent-replay") == "true")


def test_tls_acl_user_and_key_prefix(run_dir, upstream):
    """rediss:// with the CA and a client certificate, the ACL user of docs/security.md (its
    password from a file), and a key prefix: every key the module writes is under it."""
    d = run_dir / "native-tls"
    m = secure.material(d / "pki")
    redis, port = secure.start_tls_redis(d, m)
    envoy = None
    try:
        password = secure.new_password()
        secure.create_acl_user(port, password, prefix="nat:")
        pw = secure.write_password(d / "pw", password)
        envoy = start_native(d, "envoy-tls", upstream.port, {"store": {
            "redis": secure.redis_url(port), "ca_file": str(m.ca), "cert_file": str(m.store_client.cert),
            "key_file": str(m.store_client.key), "password_file": str(pw), "key_prefix": "nat:"}})
        run_once_and_replay(envoy, upstream, [new_key("ntls") for _ in range(3)])
        keys = [k.decode() if isinstance(k, bytes) else k for k in rc.command(port, "KEYS", "*")]
        assert keys and all(k.startswith("nat:") for k in keys), keys
        assert envoy.counter("idempotency.degraded") == 0
    finally:
        if envoy is not None:
            envoy.stop()
        redis.stop()


@pytest.mark.parametrize("store, says", [
    ({"redis": "rediss://127.0.0.1:1", "ca_file": "/nonexistent/ca.pem"}, "--redis-ca-file"),
    ({"redis": "not a url"}, "`store.redis`"),
])
def test_bad_backend_settings_are_refused(run_dir, upstream, store, says):
    admin, port = h.free_port(), h.free_port()
    cfg = {"admin": {"address": {"socket_address": {"address": h.LOOPBACK, "port_value": admin}}},
           "static_resources": {"listeners": [h.listener("main", port, [h.native_filter({"store": store})])],
                                "clusters": [h.static_cluster("upstream", upstream.port)]}}
    envoy = h.spawn_envoy_config(run_dir / "native-tls", "envoy-bad", cfg, admin, {"main": port}, env=h.native_env())
    try:
        h.wait_for(lambda: envoy.proc.popen.poll() is not None, "Envoy to refuse the configuration", timeout=20)
        log = envoy.log_text()
        assert "idempotency filter refused its configuration" in log and says in log, h.tail(envoy.proc.log)
    finally:
        envoy.stop()
