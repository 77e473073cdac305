"""Multi-replica stacks, as production runs them: N filter Envoys and M idemstores on one Redis.

Every Envoy replica is its own process (own admin port, ``--concurrency 2``,
``--disable-hot-restart``) with the filter on listener ``idem``; its ``idemstore`` cluster lists
ALL idemstore endpoints (h2c, round-robin). The counting upstream (``upstream.py``) is shared.
Optionally a plain Envoy (no wasm) sits between the filter Envoys and the idemstores and delays
one store path (``POST /v1/commit`` by default) with ``envoy.filters.http.fault``.

Stdlib only, so a benchmark can import it as well as the tests::

    from support import harness as h, replicas   # with tests/ on sys.path
    up_proc, up_port = h.start_upstream(run_dir)
    rs = replicas.start_replica_set(run_dir / "burst", up_port, envoys=3, stores=2,
                                    backend="redis", plugin={"lock_wait_ms": 300})
    try:
        resp = rs.post(1, "/orders", "{}", key="k-1")    # through replica 1
        rs.counter(1, "executed"), rs.counter_total("replayed")
    finally:
        rs.stop()

In pytest, the ``replica_set`` fixture (conftest.py) is a factory with the same arguments that
stops everything at the end of the test and fails it on a wasm panic in any replica's log.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from . import harness as h
from .checks import PANIC
from . import redis_cluster

LISTENER = "idem"
STORE_CLUSTER = "idemstore"


HTTP_FAULT = "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault"


def plugin_config(overrides: dict | None = None) -> dict:
    cfg = {"store_cluster": STORE_CLUSTER}
    cfg.update(overrides or {})
    return cfg


@dataclass
class ReplicaSet:
    name: str
    run_dir: Path
    backend: str
    plugin: dict
    upstream_port: int
    envoys: list[h.Envoy] = field(default_factory=list)
    stores: list[tuple[h.Proc, int]] = field(default_factory=list)
    redis: h.Proc | None = None
    redis_port: int | None = None
    proxy: h.Envoy | None = None  # the store-path delaying proxy, when asked for
    cluster: redis_cluster.RedisCluster | None = None  # backend "cluster" (or "redis" under IDEM_SECURE_STORE)

    # --- addressing ---------------------------------------------------------------------

    def port(self, replica: int) -> int:
        """The filter listener of Envoy replica `replica`."""
        return self.envoys[replica].port(LISTENER)

    def ports(self) -> list[int]:
        return [self.port(i) for i in range(len(self.envoys))]

    @property
    def store_ports(self) -> list[int]:
        return [port for _, port in self.stores]

    def post(self, replica: int, path: str, body: bytes | str = b"{}", key: str | None = None,
             headers: list | None = None, **kw) -> h.Response:
        hdrs = list(headers or [])
        if key is not None:
            hdrs.append(("Idempotency-Key", key))
        hdrs.append(("content-type", "application/json"))
        return h.request(self.port(replica), "POST", path, body, hdrs, **kw)

    # --- stats --------------------------------------------------------------------------

    def counter(self, replica: int, name: str) -> int:
        return self.envoys[replica].counter(name)

    def counters(self, replica: int) -> dict[str, int]:
        return self.envoys[replica].counters()

    def counter_total(self, name: str, alive_only: bool = True) -> int:
        return sum(e.counter(name) for e in self.envoys if not alive_only or e.proc.alive())

    def wait_counter(self, replica: int, name: str, at_least: int, timeout: float = 5.0) -> int:
        return self.envoys[replica].wait_counter(name, at_least, timeout)

    def store_requests(self, replica: int) -> dict[int, int]:
        """Requests Envoy replica `replica` sent to each endpoint of its idemstore cluster
        (admin /clusters `rq_total`), by endpoint port."""
        status, body = h.http_get_status(self.envoys[replica].admin_port, "/clusters", timeout=5)
        if status != 200:
            raise h.HarnessError(f"admin /clusters answered {status}")
        out: dict[int, int] = {}
        for line in body.decode().splitlines():
            parts = line.split("::")
            if len(parts) == 4 and parts[0] == STORE_CLUSTER and parts[2] == "rq_total":
                out[int(parts[1].rsplit(":", 1)[1])] = int(parts[3])
        return out

    # --- processes ----------------------------------------------------------------------

    def processes(self) -> list[h.Proc]:
        procs = [e.proc for e in self.envoys]
        if self.proxy is not None:
            procs.append(self.proxy.proc)
        procs += [p for p, _ in self.stores]
        if self.redis is not None:
            procs.append(self.redis)
        if self.cluster is not None:
            procs += self.cluster.procs()
        return procs

    def panics(self) -> list[str]:
        """Wasm panics or traps in any filter Envoy's log."""
        bad = []
        for e in self.envoys:
            bad += [f"{e.proc.name}: {ln}" for ln in e.log_text().splitlines() if PANIC.search(ln)]
        return bad

    def describe(self) -> str:
        stores = ", ".join(f"{p.name}:{port}" for p, port in self.stores)
        envoys = ", ".join(f"{e.proc.name} listener {e.port(LISTENER)} admin {e.admin_port}" for e in self.envoys)
        proxy = f"; delay proxy admin {self.proxy.admin_port}" if self.proxy else ""
        return f"{self.name} ({self.backend}): envoys [{envoys}]; stores [{stores}]{proxy}"

    def stop(self) -> None:
        """Stops every process it started, by PID: Envoys first, then proxy, stores and Redis."""
        for proc in self.processes():
            proc.stop(timeout=10)


def delay_proxy_config(admin_port: int, port: int, store_ports: list[int], delay_ms: int,
                       delayed_path: str = "/v1/commit") -> dict:
    """A plain Envoy in front of idemstore: h2c in, h2c out; `delayed_path` is held `delay_ms`
    by the fault filter (100 %), every other path passes undelayed."""
    delay = {
        "@type": HTTP_FAULT,
        "delay": {"fixed_delay": f"{delay_ms / 1000:.3f}s", "percentage": {"numerator": 100, "denominator": "HUNDRED"}},
    }
    routes = [
        {"name": "delayed", "match": {"path": delayed_path},
         "route": {"cluster": STORE_CLUSTER, "timeout": "120s"},
         "typed_per_filter_config": {"envoy.filters.http.fault": delay}},
        {"name": "direct", "match": {"prefix": "/"}, "route": {"cluster": STORE_CLUSTER, "timeout": "120s"}},
    ]
    # No fault at the filter level: only the route's per-filter config injects one.
    fault = {"name": "envoy.filters.http.fault", "typed_config": {"@type": HTTP_FAULT}}
    # Toward idemstores on TLS (IDEM_SECURE_STORE) the proxy holds the client certificate; the
    # filter Envoys reach the proxy itself in h2c.
    upstream = h.static_cluster(STORE_CLUSTER, store_ports, http2=True, connect_timeout="0.25s",
                                transport_socket=h.store_transport_socket(store_ports))
    return {
        "admin": {"address": {"socket_address": {"address": h.LOOPBACK, "port_value": admin_port}}},
        "static_resources": {
            "listeners": [h.listener("storeproxy", port, [fault], routes)],
            "clusters": [upstream],
        },
    }


def patch_store_cluster(config: dict, patch: dict) -> None:
    """Merges `patch` into the `idemstore` cluster of a rendered filter Envoy config."""
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == STORE_CLUSTER:
            patch = dict(patch)
            h2 = patch.pop("http2_protocol_options", None)
            cluster.update(patch)
            if h2 is not None:
                protocol = cluster["typed_extension_protocol_options"]
                opts = protocol["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
                opts["explicit_http_config"]["http2_protocol_options"] = h2


def start_replica_set(run_dir: Path, upstream_port: int, *, envoys: int = 3, stores: int = 2,
                      backend: str = "redis", plugin: dict | None = None, wasm: str | None = None,
                      delay_path: str | None = None, delay_ms: int = 0, name: str = "replicas",
                      log_level: str = "info", concurrency: int = 2, ready_timeout: float = 45.0,
                      store_cluster: dict | None = None) -> ReplicaSet:
    """Start Redis (backend "redis"), `stores` idemstores, optionally the delaying proxy, and
    `envoys` filter Envoys (plugin config `plugin` over {"store_cluster": "idemstore"}).

    backend "cluster" starts a 6-node Redis Cluster (3 masters, 3 replicas; `rs.cluster`) and
    gives every idemstore all six nodes as `--redis-cluster` seeds.
    Under IDEM_SECURE_STORE (`harness.secure_store`) backend "redis" runs on a Redis Cluster over
    TLS instead (`rs.cluster`, client certificates required, the documented ACL user with a key
    prefix; support/secure.py), and the idemstores' listeners on mutual TLS.
    backend "memory" means in-memory idemstores: each keeps its own state, so only `stores=1`
    gives the guarantee (the function does not refuse more: a test may want to show why).
    `store_cluster` is merged into the filter Envoys' `idemstore` cluster (e.g.
    {"circuit_breakers": {...}}; an "http2_protocol_options" entry replaces the h2 options).
    Processes of one kind start together and are then awaited; on any failure everything
    started so far is stopped before the error is raised.
    """
    if backend not in ("redis", "memory", "cluster"):
        raise ValueError(f"unknown backend {backend!r}")
    wasm = wasm or h.wasm_path()
    rs = ReplicaSet(name, run_dir, backend, plugin_config(plugin), upstream_port)
    try:
        if backend == "redis" and h.secure_store():
            from . import secure  # cryptography: only for the secured stores

            rs.cluster, redis_args, material = secure.start_tls_cluster(run_dir)
            rs.stores = [secure.spawn_store(run_dir, material, redis_args, name=f"idemstore-{i}")
                         for i in range(stores)]
        elif backend == "cluster":
            rs.cluster = redis_cluster.start_cluster(run_dir / "cluster")
            rs.stores = [redis_cluster.spawn_idemstore(run_dir, rs.cluster.urls(), name=f"idemstore-{i}")
                         for i in range(stores)]
        else:
            redis_url = None
            if backend == "redis":
                rs.redis, rs.redis_port = h.start_redis(run_dir)
                redis_url = f"redis://{h.LOOPBACK}:{rs.redis_port}"
            rs.stores = [h.spawn_idemstore(run_dir, redis_url, name=f"idemstore-{i}") for i in range(stores)]
        for proc, port in rs.stores:
            h.await_idemstore(proc, port)
        store_targets = rs.store_ports
        if delay_path is not None:
            admin, port = h.free_port(), h.free_port()
            config = delay_proxy_config(admin, port, rs.store_ports, delay_ms, delay_path)
            rs.proxy = h.spawn_envoy_config(run_dir, "storeproxy", config, admin, {"storeproxy": port},
                                            log_level=log_level, concurrency=concurrency)
            h.await_envoy(rs.proxy, ready_timeout)
            store_targets = [port]
        filters = {LISTENER: [h.wasm_filter(rs.plugin, wasm)]}
        hook = (lambda config: patch_store_cluster(config, store_cluster)) if store_cluster else None
        for i in range(envoys):
            rs.envoys.append(h.spawn_envoy(run_dir, f"envoy-{i}", filters, upstream_port, store_targets,
                                           log_level=log_level, concurrency=concurrency, config_hook=hook))
        for e in rs.envoys:
            h.await_envoy(e, ready_timeout)
    except BaseException:
        rs.stop()
        raise
    return rs


class ReplicaSets:
    """Starts replica sets under one run directory and stops them all at `close()`."""

    def __init__(self, run_dir: Path, upstream_port: int, wasm: str | None = None):
        self.run_dir = run_dir
        self.upstream_port = upstream_port
        self.wasm = wasm
        self.made: list[ReplicaSet] = []

    def __call__(self, name: str = "replicas", **kw) -> ReplicaSet:
        sub = self.run_dir / name
        n = 1
        while sub.exists():
            n += 1
            sub = self.run_dir / f"{name}-{n}"
        kw.setdefault("wasm", self.wasm)
        rs = start_replica_set(sub, self.upstream_port, name=sub.name, **kw)
        self.made.append(rs)
        return rs

    def close(self) -> list[str]:
        """Stops everything; returns wasm panic lines found in the filter Envoys' logs."""
        panics = []
        for rs in reversed(self.made):
            rs.stop()
            panics += rs.panics()
        self.made.clear()
        return panics


# --------------------------------------------------------------------------------------------
# the filter's counters summed over a set's live Envoys (test_replicas.py, test_redis_cluster.py)
# --------------------------------------------------------------------------------------------

COUNTERS = ("executed", "replayed", "stored", "conflicted", "degraded", "store_errors", "commit_failed",
            "released", "unavailable", "store_skipped", "local_locks", "local_replays", "handed_back")


def totals(rs) -> dict[str, int]:
    out = dict.fromkeys(COUNTERS, 0)
    for i, e in enumerate(rs.envoys):
        if e.proc.alive():
            for name, value in rs.counters(i).items():
                if name in out:
                    out[name] += value
    return out


def wait_totals(rs, name: str, at_least: int, timeout: float = 10.0) -> int:
    """Commits land after the responses: poll the summed counter."""
    return h.poll_until(lambda: rs.counter_total(name), at_least, timeout, interval=0.05)


def wait_settled(rs, names=("stored", "commit_failed", "released", "handed_back"), quiet: float = 0.5,
                 timeout: float = 10.0) -> dict[str, int]:
    """Commits and hand-backs land after the answers: until the summed counters stop moving for
    `quiet` s; then the set's totals."""
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        now = {n: rs.counter_total(n) for n in names}
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
        time.sleep(0.05)
    return totals(rs)
