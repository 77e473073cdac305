"""Throughput of the filter, against a no-filter Envoy in the same run, driven by wrk.

The stack, all on loopback:

- upstream: an Envoy (`--concurrency 2`) answering every request itself (`direct_response`,
  201, a small JSON body with `content-type: application/json`, so answers are storable) after
  reading the whole request body (`envoy.filters.http.buffer`). Two listeners: `fast` answers at
  once; `slow` first waits 5 ms (`envoy.filters.http.fault`, fixed delay on every request);
- Redis (`redis-server`, no persistence) and idemstore on it;
- `idem`: Envoy `--concurrency 2` with the filter (default configuration but `store_cluster`),
  routes `slow` (`/slow...` -> the 5 ms upstream) and `fast` (everything else);
- `plain`: the same Envoy, same listener and routes, router only;
- `routes`: the filter Envoy again, its configuration with three route policies (`routes`
  with `payments`, `webhooks` and `orders`; the benchmarked path is on `orders`):
  measured on pass-through and unique-1k, against `idem` (one configuration for every route);
- `native`: the same filter as an Envoy dynamic module (the native host, docs/native.md:
  `libidempotency_filter.so`), the default configuration but `store: {"redis": ...}` on the
  Redis idemstore uses: the store runs in that Envoy's process, no idemstore on its path. No
  composite matcher: on pass-through the module is on the route and sees every request.
  Skipped (with a line saying so) when the module is not built.

Every front Envoy has the same routes: `slow` (/slow), `payments`, `webhooks`, `orders`,
`search` (/fast/payments, /fast/webhooks, /fast/orders, /fast/search) and `fast` (/); on
`search` the Wasm filter is disabled with Envoy's `typed_per_filter_config` (`FilterConfig`,
`disabled: true`), which the pass-through scenario `passthrough-off` measures against the
no-filter Envoy.

Scenarios (SCENARIOS below): pass-through (and on the route with the filter disabled), unique keys (1 KiB, 64 KiB, 1 MiB bodies, and 1 KiB
on one connection for the added latency), replay (fast and 5 ms upstream), duplicate bursts.
Each scenario runs wrk (`bench/load.lua`) against `plain`, `idem` and `native` alternately
(round r: in that order for even r, reversed for odd r) and reports medians over the rounds of
throughput and p50/p99 latency, the ratios idem/plain and native/plain, store calls per request
(idemstore's `idemstore_requests_total` by `op`, scraped before and after every run), Redis
script calls and commands per request (INFO: the native host's only store figure), the
filter's outcome counters (`wasmcustom.idempotency.*`, the module's `idempotency.*`) with a check
of what they say (a unique key runs once, a burst's key once, a replay never), upstream requests
per client request, and CPU time per request of every process on the target's path
(utime+stime from /proc, wrk's from its rusage; idemstore is not on the native host's path and
is not counted there). wrk, the Envoys, idemstore and Redis share the machine's cores.

A full run also measures, for "Where the time goes": the filter VMs' memory under 100,000 unique
keys on the fresh filter Envoy (first; from /proc/<pid>/smaps, as Envoy has no wasm memory stat),
Envoy's `/stats?filter=wasm`, the filter's store call latency on one connection, one store round
trip straight to idemstore, and a CPU profile of idemstore, the filter Envoy and Redis under
unique-key load (`perf record -e cpu-clock`; callgrind on idemstore where perf cannot sample).

    python3 bench/throughput.py              # full: 3 rounds x 10 s, memory, profiles, writes RESULTS.md
    python3 bench/throughput.py --quick      # 1 round x 3 s, no profiles, nothing written
    python3 bench/throughput.py --scenarios unique-1k,replay --rounds 1 --duration 3 --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from support import harness as h  # noqa: E402
from benchlib import (RedisCommands, Scenario, cpu_seconds, machine_busy_seconds, medians,  # noqa: E402
                      run_wrk as wrk_run, wait_still, wrk_bin)

BENCH = ROOT / "bench"
RESULTS = BENCH / "RESULTS.md"
UPSTREAM_BODY = '{"id":"ord_000001","status":"created","item":"book","qty":1}'
MIB = 1024 * 1024


SCENARIOS = [
    Scenario("passthrough", "POST without a key, 1 KiB", "/fast/orders", "none", 1024),
    Scenario("passthrough-off", "the same on a route with the filter disabled", "/fast/search", "none", 1024),
    Scenario("unique-1k", "a new key per request, 1 KiB", "/fast/orders", "unique", 1024),
    Scenario("unique-1k-c1", "the same on one connection (added latency)", "/fast/orders", "unique", 1024,
             threads=1, conns=1),
    Scenario("unique-64k", "a new key per request, 64 KiB", "/fast/orders", "unique", 64 * 1024),
    Scenario("replay", "8 stored keys over and over, 1 KiB", "/fast/orders", "replay", 1024, n=8),
    Scenario("replay-5ms", "8 stored keys, 5 ms upstream, 1 KiB", "/slow/orders", "replay", 1024, n=8),
    Scenario("burst", "20 duplicates per key on 20 connections, 1 KiB", "/fast/orders", "burst", 1024,
             n=20, threads=1, conns=20),
    Scenario("body-1m", "a new key per request, 1 MiB", "/fast/orders", "unique", MIB),
]
BY_NAME = {s.name: s for s in SCENARIOS}
# The scenarios also run through `routes`, the filter with three route policies.
ROUTES_SCENARIOS = ("passthrough", "unique-1k")
# The three route policies of `routes`; the benchmarked path (/fast/orders) is on `orders`, whose
# policy changes nothing a unique key or a keyless POST does (a lock wait): the figures show
# what looking the route up and switching to its configuration costs.
ROUTE_POLICIES = {
    "payments": {"require_key": True, "store_statuses": ["2xx", "4xx"], "retention_seconds": 604800},
    "webhooks": {"mode": "inbox", "inbox": {"message_id": "cloudevents"}},
    "orders": {"lock_wait_ms": 2000},
}
COMPONENTS = ["envoy", "upstream", "idemstore", "redis", "wrk"]
# The wasm filter's ways to reach idemstore (BENCH_FILTER_EXTRA may set them): the native host
# has its store in process and would refuse `store_cluster`.
WASM_ONLY_KEYS = ("store_cluster", "store_transport", "store_streams")


# --------------------------------------------------------------------------------------------
# the stack
# --------------------------------------------------------------------------------------------


def upstream_listener(name: str, port: int, delay_ms: int) -> dict:
    filters = [{
        "name": "envoy.filters.http.buffer",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
                         "max_request_bytes": 4 * MIB},
    }]
    if delay_ms:
        filters.append({
            "name": "envoy.filters.http.fault",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault",
                "delay": {"fixed_delay": f"{delay_ms / 1000:.3f}s",
                          "percentage": {"numerator": 100, "denominator": "HUNDRED"}},
            },
        })
    routes = [{
        "match": {"prefix": "/"},
        "direct_response": {"status": 201, "body": {"inline_string": UPSTREAM_BODY}},
        "response_headers_to_add": [{
            "header": {"key": "content-type", "value": "application/json"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
        }],
    }]
    lst = h.listener(name, port, filters, routes)
    lst["per_connection_buffer_limit_bytes"] = 4 * MIB
    return lst


def front_routes(filters: list[dict]) -> list[dict]:
    """The front Envoys' routes, the same for all: named routes as a real API has them (the
    filter's `routes` policies are keyed by these names), and `search`, on which the Wasm filter
    (if the chain has one) is switched off by Envoy's generic per-route filter config."""
    def to(name: str, prefix: str, cluster: str = "up_fast") -> dict:
        return {"name": name, "match": {"prefix": prefix}, "route": {"cluster": cluster, "timeout": "20s"}}

    search = to("search", "/fast/search")
    if filters:
        search["typed_per_filter_config"] = {filters[0]["name"]: {
            "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "disabled": True}}
    return [to("slow", "/slow", "up_slow"), to("payments", "/fast/payments"), to("webhooks", "/fast/webhooks"),
            to("orders", "/fast/orders"), search, to("fast", "/")]


def front_config(admin_port: int, port: int, filters: list[dict], fast_port: int, slow_port: int,
                 store_port: int) -> dict:
    routes = front_routes(filters)
    return {
        "admin": {"address": {"socket_address": {"address": h.LOOPBACK, "port_value": admin_port}}},
        "static_resources": {
            "listeners": [h.listener("edge", port, filters, routes)],
            "clusters": [
                h.static_cluster("up_fast", fast_port),
                h.static_cluster("up_slow", slow_port),
                h.store_cluster(store_port),
            ],
        },
    }


def native_module() -> str | None:
    """The native host, libidempotency_filter.so (`make build` builds it), or None."""
    try:
        return h.native_module()
    except h.HarnessError:
        return None


def floor_wasm() -> str | None:
    """bench/floor-filter's build (`make bench` builds it), or None."""
    path = Path(os.environ.get("FLOOR_WASM") or ROOT / "target/bench-floor/wasm32-wasip1/release/floor_filter.wasm")
    return str(path) if path.exists() else None


class Stack:
    def __init__(self, run_dir: Path, floor: str | None = None, native: bool = True):
        self.run_dir = run_dir
        self.procs: list[h.Proc] = []
        self.floor = floor
        self.native = native

    def start(self) -> None:
        rd = self.run_dir
        self.redis, self.redis_port = h.start_redis(rd)
        self.procs.append(self.redis)
        self.redis_cmds = RedisCommands(self.redis_port, h.LOOPBACK)
        self.store, self.store_port = h.spawn_idemstore(rd, redis_url=f"redis://{h.LOOPBACK}:{self.redis_port}")
        self.procs.append(self.store)

        up_admin, self.fast_port, self.slow_port = h.free_port(), h.free_port(), h.free_port()
        up_cfg = {
            "admin": {"address": {"socket_address": {"address": h.LOOPBACK, "port_value": up_admin}}},
            "static_resources": {"listeners": [upstream_listener("fast", self.fast_port, 0),
                                               upstream_listener("slow", self.slow_port, 5)]},
        }
        self.upstream = h.spawn_envoy_config(rd, "upstream-envoy", up_cfg, up_admin,
                                             {"fast": self.fast_port, "slow": self.slow_port})
        self.procs.append(self.upstream.proc)

        self.envoys: dict[str, h.Envoy] = {}
        # The default configuration; BENCH_FILTER_EXTRA (a JSON object) adds keys, for a paired
        # run of one choice against another (e.g. {"store_transport": "callout"}).
        extra = json.loads(os.environ.get("BENCH_FILTER_EXTRA") or "{}")
        wasm = h.wasm_filter({"store_cluster": "idemstore", **extra}, h.wasm_path())
        # `routes`: the same configuration with the three route policies of ROUTE_POLICIES.
        routed = h.wasm_filter({"store_cluster": "idemstore", **extra, "routes": ROUTE_POLICIES}, h.wasm_path())
        # `skip`: the same filter wrapped as envoy/envoy.yaml ships it (behind the composite
        # matcher, Envoy does not create it for a request without an Idempotency-Key): measured
        # on pass-through only.
        # `mint`: the filter in mint mode (the sending side of Envoy's retries), which adds a key
        # to every keyless POST and makes no store calls: measured on pass-through only.
        mint = h.wasm_filter({"mode": "mint"}, h.wasm_path())
        fronts = [("plain", []), ("idem", [wasm]), ("routes", [routed]), ("skip", [h.skip_unless_keyed(wasm)]),
                  ("mint", [mint])]
        if self.floor:
            floor = h.wasm_filter("{}", self.floor, vm_id="floor")
            floor["typed_config"]["config"]["name"] = "floor"
            floor["typed_config"]["config"]["root_id"] = "floor"
            fronts.append(("floor", [floor]))
        if self.native:
            # `native`: the module with the same configuration (BENCH_FILTER_EXTRA's keys too, but
            # the wasm filter's ways to idemstore), its store on idemstore's Redis: the same keys
            # and scripts, so the two hosts do the same store work per request. Same routes, the
            # same idle `idemstore` cluster as every front (no health check), no matcher.
            own = {k: v for k, v in extra.items() if k not in WASM_ONLY_KEYS}
            fronts.append(("native", [h.native_filter(
                {"store": {"redis": f"redis://{h.LOOPBACK}:{self.redis_port}"}, **own})]))
        for name, filters in fronts:
            admin, port = h.free_port(), h.free_port()
            cfg = front_config(admin, port, filters, self.fast_port, self.slow_port, self.store_port)
            self.envoys[name] = h.spawn_envoy_config(rd, f"envoy-{name}", cfg, admin, {"edge": port},
                                                     env=h.native_env() if name == "native" else None)
            self.procs.append(self.envoys[name].proc)

        h.await_idemstore(self.store, self.store_port)
        for e in [self.upstream, *self.envoys.values()]:
            h.await_envoy(e)
        # A request through each path, checked: storable answer, stored, replayed.
        for name, e in self.envoys.items():
            for path in ("/fast/orders", "/slow/orders"):
                r = h.request(e.port("edge"), "POST", path, "{}", headers=[("content-type", "application/json")])
                if r.status != 201 or r.header("content-type") != "application/json":
                    raise SystemExit(f"{name} {path}: unexpected answer {r}")
        for name in ("idem", "native"):
            if name in self.envoys:
                key = f"check-{secrets.token_hex(8)}"
                h.request(self.envoys[name].port("edge"), "POST", "/fast/orders", "{}",
                          headers=[("content-type", "application/json"), ("idempotency-key", key)])
                if not await_replay(self.envoys[name], "/fast/orders", "{}", key):
                    raise SystemExit(f"{name}: the filter did not replay {key}")
        if "native" in self.envoys:
            # The module says which store it runs on; on any other it would not be this bench.
            want = f"idempotency: configured; store: redis redis://{h.LOOPBACK}:{self.redis_port}"
            if want not in self.envoys["native"].log_text():
                raise SystemExit(f"envoy-native did not log {want!r}:\n{h.tail(self.envoys['native'].proc.log)}")
        # The route policies are in force: a keyless POST is refused on `payments` (require_key)
        # by `routes` only, and let through on `orders`.
        nokey = [("content-type", "application/json")]
        for name, path, status in (("routes", "/fast/payments", 400), ("idem", "/fast/payments", 201),
                                   ("routes", "/fast/orders", 201)):
            r = h.request(self.envoys[name].port("edge"), "POST", path, "{}", headers=nokey)
            if r.status != status:
                raise SystemExit(f"{name} {path} without a key: {r.status}, expected {status}: {r}")
        # On `search` the filter is not even created: its counters do not move (the module's
        # too: Envoy's per-route FilterConfig is filter-agnostic).
        for name in ("idem", "routes", "native"):
            if name not in self.envoys:
                continue
            before = self.counters(name)
            r = h.request(self.envoys[name].port("edge"), "POST", "/fast/search", "{}", headers=nokey)
            time.sleep(0.1)
            if r.status != 201 or self.counters(name) != before:
                raise SystemExit(f"{name} /fast/search (filter disabled): {r.status}, counters "
                                 f"{before} -> {self.counters(name)}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()

    def pids(self, target: str) -> dict[str, int]:
        """The processes a request to `target` runs through (wrk apart). The native host's store
        is in its Envoy: idemstore is not counted there (it idles through those runs)."""
        pids = {"envoy": self.envoys[target].proc.pid, "upstream": self.upstream.proc.pid,
                "idemstore": self.store.pid, "redis": self.redis.pid}
        if target == "native":
            del pids["idemstore"]
        return pids

    def counters(self, target: str) -> dict[str, int]:
        """The filter's outcome counters on `target` by short name: the wasm filter's
        `wasmcustom.idempotency.*`, the module's `idempotency.*` (its metrics namespace); the
        store stream's own left out, as `h.Envoy.counters` does."""
        envoy = self.envoys[target]
        if target != "native":
            return envoy.counters()
        prefix = "idempotency."
        return {k[len(prefix):]: v for k, v in envoy.stats("^" + re.escape(prefix)).items()
                if k[len(prefix):] not in h.STREAM_COUNTERS}

    def store_ops(self) -> dict[tuple[str, str], int]:
        """idemstore_requests_total by (op, outcome), plus ("waited", "") for begins that found
        the lock held (idemstore_begin_wait_seconds_count)."""
        status, body = h.http_get_status(self.store_port, "/metrics", timeout=5)
        if status != 200:
            raise SystemExit(f"idemstore /metrics answered {status}")
        text = body.decode()
        out = {}
        for m in re.finditer(r'^idemstore_requests_total\{op="([^"]+)",outcome="([^"]+)"\} (\d+)', text, re.M):
            out[(m.group(1), m.group(2))] = int(m.group(3))
        m = re.search(r"^idemstore_begin_wait_seconds_count (\d+)", text, re.M)
        out[("waited", "")] = int(m.group(1)) if m else 0
        # Commits the filter sent together (`/v1/commits`): `batched` of the commits came in
        # `batches` calls.
        for name, metric in (("batches", "idemstore_commit_batches_total"), ("batched", "idemstore_commit_batch_items_total")):
            m = re.search(rf"^{metric} (\d+)", text, re.M)
            out[(name, "")] = int(m.group(1)) if m else 0
        return out

    def settle(self, timeout: float = 3.0) -> tuple[int, int]:
        """Until Redis's command count stops moving (commits land after the answers, the native
        host's without idemstore), then idemstore's counters; returns that Redis count. Read in
        that order because a scrape of idemstore's /metrics sends Redis commands of its own."""
        wait_still(self.redis_cmds.read, timeout)
        count = self.redis_cmds.read()
        wait_still(self.store_ops, timeout)
        return count


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def wasm_memory_kib(pid: int) -> tuple[int, int, int]:
    """(VMs, linear memory KiB, resident KiB) of the process's wasm memories, from
    /proc/<pid>/smaps. V8 reserves each 32-bit wasm memory as 8 GiB of address space and makes
    the current linear memory (its pages so far; it only grows) read-write: an anonymous `rw-p`
    mapping directly followed by the rest of the reservation, an anonymous `---p` mapping of at
    least 4 GiB."""
    maps: list[dict] = []
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                parts = line.split()
                if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    maps.append({"lo": lo, "hi": hi, "perms": parts[1], "anon": len(parts) < 6, "rss": 0})
                elif parts[0] == "Rss:" and maps:
                    maps[-1]["rss"] = int(parts[1])
    except OSError:
        return 0, 0, 0
    count = size = rss = 0
    for prev, m in zip(maps, maps[1:]):
        if (m["anon"] and m["perms"] == "---p" and m["hi"] - m["lo"] >= 4 << 30
                and prev["anon"] and prev["perms"] == "rw-p" and prev["hi"] == m["lo"]):
            count += 1
            size += (prev["hi"] - prev["lo"]) // 1024
            rss += prev["rss"]
    return count, size, rss


# --------------------------------------------------------------------------------------------
# one wrk run
# --------------------------------------------------------------------------------------------


# The fronts whose filter outcome counters are read around each run (and checked).
FILTER_FRONTS = ("idem", "routes", "native")


@dataclass
class Run:
    target: str
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    requests: int
    errors: int
    non2xx: int
    cpu: dict[str, float]
    seconds: float = 0.0
    machine_busy: float = 0.0
    store: dict[str, int] = field(default_factory=dict)
    store_outcomes: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    upstream_rq: int = 0
    # Redis commands (those inside the store's scripts included) and script calls.
    redis_cmds: int = 0
    redis_scripts: int = 0


def await_replay(envoy: h.Envoy, path: str, body: str, key: str, timeout: float = 5.0) -> bool:
    """Whether `key`, sent once, is replayed within `timeout`: its record is stored. Asked of
    the answers, not of the `stored` counter: the native host counts a commit when the store's
    answer reaches the worker, with the worker's next stream (Envoy's scheduler is a stream's),
    so on an idle Envoy that counter trails the store."""
    deadline = time.monotonic() + timeout
    while True:
        r = h.request(envoy.port("edge"), "POST", path, body,
                      headers=[("content-type", "application/json"), ("idempotency-key", key)])
        if r.header("x-idempotent-replay") == "true":
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def upstream_requests(envoy: h.Envoy) -> int:
    s = envoy.stats(r"^cluster\.up_(fast|slow)\.upstream_rq_total$")
    return sum(s.values())


def run_wrk(stack: Stack, target: str, sc: Scenario, duration: float, seed: str, log: Path) -> Run:
    envoy = stack.envoys[target]
    pids = stack.pids(target)
    cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
    busy0 = machine_busy_seconds()
    ops0 = stack.store_ops()
    redis0 = stack.redis_cmds.read()
    out0 = stack.counters(target) if target in FILTER_FRONTS else {}
    up0 = upstream_requests(envoy)
    figures, wrk_cpu = wrk_run(f"http://{h.LOOPBACK}:{envoy.port('edge')}{sc.path}", sc, duration, seed, log)
    busy = machine_busy_seconds() - busy0
    redis1 = stack.settle()
    cpu = {k: cpu_seconds(pid) - cpu0[k] for k, pid in pids.items()}
    cpu["wrk"] = wrk_cpu
    run = Run(
        target=target,
        **figures,
        cpu=cpu,
        machine_busy=busy,
        upstream_rq=upstream_requests(envoy) - up0,
        redis_cmds=redis1[0] - redis0[0],
        redis_scripts=redis1[1] - redis0[1],
    )
    ops1 = stack.store_ops()
    for (op, outcome), v in ops1.items():
        d = v - ops0.get((op, outcome), 0)
        if op not in ("waited", "batches", "batched"):
            run.store[op] = run.store.get(op, 0) + d
        if d:
            run.store_outcomes[f"{op}/{outcome}" if outcome else op] = d
    if target in FILTER_FRONTS:
        out1 = stack.counters(target)
        run.outcomes = {k: v - out0.get(k, 0) for k, v in out1.items() if v - out0.get(k, 0)}
    return run


# --------------------------------------------------------------------------------------------
# scenarios
# --------------------------------------------------------------------------------------------


def replay_seed(seed: str, target: str) -> str:
    """The replay keys' seed on `target`: the native host replays keys it stored itself (the two
    hosts agree on the records, but neither's figures should lean on the other's writes)."""
    return f"{seed}-native" if target == "native" else seed


def prewarm_replay(stack: Stack, sc: Scenario, seed: str, target: str = "idem") -> None:
    """Stores the scenario's keys through `target` (the same body wrk sends), so every wrk
    request on it is a replay."""
    body = ('{"pad":"' + "x" * (sc.size - 10) + '"}') if sc.size >= 10 else "{}"
    envoy = stack.envoys[target]
    for i in range(sc.n):
        r = h.request(envoy.port("edge"), "POST", sc.path, body,
                      headers=[("content-type", "application/json"), ("idempotency-key", f"{seed}-{i}")])
        if r.status != 201:
            raise SystemExit(f"pre-warm {sc.name} on {target}: {r}")
    for i in range(sc.n):
        if not await_replay(envoy, sc.path, body, f"{seed}-{i}"):
            raise SystemExit(f"pre-warm {sc.name} on {target}: key {seed}-{i} not stored")


def run_scenario(stack: Stack, sc: Scenario, rounds: int, duration: float, warmup: float,
                 run_dir: Path, log) -> dict[str, list[Run]]:
    # The native host next to the wasm filter in every scenario, so that the two are measured
    # as close together as the alternation allows.
    targets = ["plain", "idem"] + [t for t in ("native",) if t in stack.envoys]
    if sc.name in ROUTES_SCENARIOS:
        targets.append("routes")
    if sc.mode == "none" and sc.name != "passthrough-off":
        targets += [t for t in ("skip", "mint", "floor") if t in stack.envoys]
    runs: dict[str, list[Run]] = {t: [] for t in targets}
    wrk_log = run_dir / f"wrk-{sc.name}.log"
    seed = f"{sc.name}-{secrets.token_hex(6)}"
    if sc.mode == "replay":
        for target in ("idem", "native"):
            if target in targets:
                prewarm_replay(stack, sc, replay_seed(seed, target), target)
    if warmup > 0:
        for target in targets:
            run_wrk(stack, target, sc, warmup,
                    f"w{target}-{seed}" if sc.mode != "replay" else replay_seed(seed, target), wrk_log)
    for r in range(rounds):
        order = targets if r % 2 == 0 else targets[::-1]
        for target in order:
            run_seed = replay_seed(seed, target) if sc.mode == "replay" else f"{seed}-{target}{r}"
            run = run_wrk(stack, target, sc, duration, run_seed, wrk_log)
            runs[target].append(run)
            log(f"  {sc.name:<15} round {r + 1}/{rounds} {target:<6} {run.rps:9.0f} req/s  "
                f"p50 {run.p50_ms:6.2f} ms  p99 {run.p99_ms:7.2f} ms  non-2xx {run.non2xx}  errors {run.errors}")
    return runs


@dataclass
class Summary:
    sc: Scenario
    plain: dict
    idem: dict
    ratio: float
    store_per_rq: dict[str, float]
    outcomes_per_rq: dict[str, float]
    store_outcomes_per_rq: dict[str, float]
    upstream_per_rq: dict[str, float]
    cpu_us: dict[str, dict[str, float]]
    cores: dict[str, float]
    problems: list[str]
    extra: str = ""
    floor: dict | None = None
    # The filter behind the composite matcher (pass-through only).
    skip: dict | None = None
    # The filter in mint mode (pass-through only).
    mint: dict | None = None
    # The filter with three route policies (ROUTES_SCENARIOS), and its outcomes per request.
    routes: dict | None = None
    routes_outcomes_per_rq: dict[str, float] = field(default_factory=dict)
    routes_store_outcomes_per_rq: dict[str, float] = field(default_factory=dict)
    # The native host (the module, its store in process), its outcomes per request.
    native: dict | None = None
    native_outcomes_per_rq: dict[str, float] = field(default_factory=dict)
    # Per target: Redis commands (the scripts' own included) and script calls per request; for
    # the filter fronts, what check_runs found.
    redis_per_rq: dict[str, float] = field(default_factory=dict)
    scripts_per_rq: dict[str, float] = field(default_factory=dict)
    checks: dict[str, "Check"] = field(default_factory=dict)

    @property
    def native_ratio(self) -> float:
        return self.native["rps"] / self.plain["rps"] if self.native and self.plain["rps"] else 0.0


# Outcomes that mean the store did not do its part or a request was refused: none is expected
# in any scenario here (the store is up, every request well-formed, no lock outlives its wait).
BAD_OUTCOMES = ("degraded", "unavailable", "store_errors", "commit_failed", "conflicted", "mismatched",
                "rejected", "local_locks")


@dataclass
class Check:
    """What a filter front's outcome counters and its upstream calls say over a scenario's
    runs, against what the scenario must do: a unique key runs once, a burst's key once (its
    duplicates wait and are replayed), a stored key never again; a keyless request is not
    guarded. Counted at the Envoy, so a request cut off at the end of a run counts on
    `guarded` without an answer; the bounds allow for those (at most one per connection)."""
    guarded: int = 0
    executed: int = 0
    replayed: int = 0
    upstream: int = 0
    keys: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def per_key(self) -> float | None:
        return self.executed / self.keys if self.keys else None

    def text(self) -> str:
        if self.keys:
            # Two decimals: a burst's keys are counted to within one per run (see check_runs).
            s = f"{self.per_key:.2f} executions per key ({self.executed} for {self.keys} keys)"
        elif self.guarded:
            s = f"{self.executed} executed, {self.replayed} replayed of {self.guarded} guarded"
        else:
            s = "none guarded"
        return s + ("; **" + "; ".join(self.problems) + "**" if self.problems else "")


def check_runs(sc: Scenario, runs: list[Run]) -> Check:
    c = Check()
    for r in runs:
        o = r.outcomes
        g, e, rp = o.get("guarded", 0), o.get("executed", 0), o.get("replayed", 0)
        c.guarded, c.executed, c.replayed, c.upstream = c.guarded + g, c.executed + e, c.replayed + rp, \
            c.upstream + r.upstream_rq
        bad = {k: o[k] for k in BAD_OUTCOMES if o.get(k)}
        # wrk closes its connections with requests in flight: those are left in doubt (their
        # client went away), at most one per connection.
        if o.get("in_doubt", 0) > sc.conns:
            bad["in_doubt"] = o["in_doubt"]
        if bad:
            c.problems.append(", ".join(f"{k} {v}" for k, v in bad.items()))
        # Every upstream call of a guarded scenario went under a lock.
        if sc.mode != "none" and r.upstream_rq > e:
            c.problems.append(f"{r.upstream_rq} upstream calls for {e} executions")
        if sc.mode == "none":
            if g or (sc.name == "passthrough-off" and o):
                c.problems.append("counters moved: " + ", ".join(f"{k} {v}" for k, v in sorted(o.items())))
        elif sc.mode == "unique":
            # Each key once: as many executions as keys, less the few cut off at the end.
            c.keys += g
            if e > g or rp or g - e > sc.conns:
                c.problems.append(f"{e} executed, {rp} replayed of {g} unique keys")
        elif sc.mode == "burst":
            # wrk's one thread sends each key `n` times in a row: the guarded requests hold
            # ceil(g / n) keys (one more if the last group's requests arrived out of order).
            keys = -(-g // sc.n)
            c.keys += keys
            if e > keys + 1:
                c.problems.append(f"{e} executions for {keys} keys of {sc.n} requests each")
        elif sc.mode == "replay":
            # Stored beforehand: nothing runs again, every answer is a replay.
            if e or r.upstream_rq or g - rp > sc.conns:
                c.problems.append(f"{e} executed, {r.upstream_rq} upstream calls, {rp} replayed of {g}")
    return c


def summarize(sc: Scenario, runs: dict[str, list[Run]]) -> Summary:
    plain, idem = medians(runs["plain"]), medians(runs["idem"])
    floor = medians(runs["floor"]) if runs.get("floor") else None
    skip = medians(runs["skip"]) if runs.get("skip") else None
    mint = medians(runs["mint"]) if runs.get("mint") else None
    routes = medians(runs["routes"]) if runs.get("routes") else None
    n_idem = max(1, idem["requests"])
    store: dict[str, int] = {}
    outcomes: dict[str, int] = {}
    store_outcomes: dict[str, int] = {}
    for r in runs["idem"]:
        for k, v in r.store_outcomes.items():
            store_outcomes[k] = store_outcomes.get(k, 0) + v
        for k, v in r.store.items():
            store[k] = store.get(k, 0) + v
        for k, v in r.outcomes.items():
            outcomes[k] = outcomes.get(k, 0) + v
    cpu_us = {}
    upstream_per_rq = {}
    cores = {}
    for t in runs:
        secs = max(1e-9, sum(r.seconds for r in runs[t]))
        cores[t] = sum(sum(r.cpu.values()) for r in runs[t]) / secs
        cores[t + "-machine"] = sum(r.machine_busy for r in runs[t]) / secs
        n = max(1, sum(r.requests for r in runs[t]))
        cpu_us[t] = {c: sum(r.cpu.get(c, 0.0) for r in runs[t]) / n * 1e6 for c in COMPONENTS}
        upstream_per_rq[t] = sum(r.upstream_rq for r in runs[t]) / n
    native = medians(runs["native"]) if runs.get("native") else None
    redis_per_rq = {t: sum(r.redis_cmds for r in runs[t]) / max(1, sum(r.requests for r in runs[t])) for t in runs}
    scripts_per_rq = {t: sum(r.redis_scripts for r in runs[t]) / max(1, sum(r.requests for r in runs[t])) for t in runs}
    checks = {t: check_runs(sc, runs[t]) for t in FILTER_FRONTS if runs.get(t)}
    native_outcomes = {k: v / max(1, native["requests"]) for k, v in sorted(outcomes_sum(runs["native"]).items())} \
        if native else {}
    problems = []
    for t, m in (("no filter", plain), ("filter", idem), ("three route policies", routes), ("native host", native)):
        if m and (m["non2xx"] or m["errors"]):
            problems.append(f"{t}: {m['non2xx']} non-2xx, {m['errors']} socket errors")
    for t, c in checks.items():
        if c.problems:
            problems.append(f"{t}: " + "; ".join(c.problems))
    notes = []
    routes_outcomes: dict[str, float] = {}
    routes_store: dict[str, float] = {}
    if routes:
        n_routes = max(1, routes["requests"])
        for r in runs["routes"]:
            for k, v in r.outcomes.items():
                routes_outcomes[k] = routes_outcomes.get(k, 0) + v / n_routes
            for k, v in r.store_outcomes.items():
                routes_store[k] = routes_store.get(k, 0) + v / n_routes
        notes.append(f"three route policies (`routes`; the request on route `orders`): {routes['rps']:.0f} req/s, "
                     f"**{fmt_ratio(routes['rps'] / plain['rps'])}**, p50 {routes['p50']:.2f} ms, p99 "
                     f"{routes['p99']:.2f} ms; {routes['rps'] / idem['rps'] - 1:+.1%} req/s against one policy")
    if sc.name == "passthrough-off":
        notes.append("the filter Envoy on route `search`, its Wasm filter disabled (`typed_per_filter_config`); "
                     "filter counters moved: " + (", ".join(f"{k} {v}" for k, v in sorted(outcomes_sum(runs['idem']).items()))
                                                  or "none"))
    if skip:
        notes.append(f"the filter behind the composite matcher (envoy/envoy.yaml): {skip['rps']:.0f} req/s, "
                     f"**{fmt_ratio(skip['rps'] / plain['rps'])}**, p50 {skip['p50']:.2f} ms")
    if mint:
        notes.append(f"the filter in mint mode (a key added to each request, no store call): {mint['rps']:.0f} "
                     f"req/s, **{fmt_ratio(mint['rps'] / plain['rps'])}**, p50 {mint['p50']:.2f} ms")
    if floor:
        notes.append(f"a no-op wasm filter (`bench/floor-filter`): {floor['rps']:.0f} req/s, "
                     f"**{fmt_ratio(floor['rps'] / plain['rps'])}**, p50 {floor['p50']:.2f} ms")
    extra = "; ".join(notes)
    return Summary(sc, plain, idem, idem["rps"] / plain["rps"] if plain["rps"] else 0.0,
                   {k: v / n_idem for k, v in sorted(store.items())},
                   {k: v / n_idem for k, v in sorted(outcomes.items())},
                   {k: v / n_idem for k, v in sorted(store_outcomes.items())}, upstream_per_rq, cpu_us, cores,
                   problems, extra, floor, skip, mint, routes, dict(sorted(routes_outcomes.items())),
                   dict(sorted(routes_store.items())), native, native_outcomes, redis_per_rq, scripts_per_rq,
                   checks)


def outcomes_sum(runs: list[Run]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in runs:
        for k, v in r.outcomes.items():
            out[k] = out.get(k, 0) + v
    return out


def fmt_ratio(x: float) -> str:
    return f"{x:.2f}x"


def note(s: Summary) -> str:
    if s.sc.size >= MIB:
        mb = lambda rps: rps * s.sc.size / 1e6  # noqa: E731
        return f"{mb(s.idem['rps']):.0f} MB/s vs {mb(s.plain['rps']):.0f} MB/s"
    return s.extra


def short_note(s: Summary) -> str:
    """The note for the one-line summary: MB/s, added latency, the no-op filter's ratio."""
    if s.sc.size >= MIB:
        return f" ({note(s)})"
    if s.sc.conns == 1 and s.extra:
        return f" (p50 +{s.idem['p50'] - s.plain['p50']:.2f} ms)"
    if s.floor:
        return f" (no-op wasm filter {fmt_ratio(s.floor['rps'] / s.plain['rps'])})"
    return ""


def one_line(s: Summary) -> str:
    """A scenario in the last line: its ratio, the native host's, (and the matcher-wrapped
    pass-through after them)."""
    line = f"{s.sc.name} {fmt_ratio(s.ratio)}" + short_note(s)
    if s.native:
        line += f" native {fmt_ratio(s.native_ratio)}"
        if s.sc.conns == 1:
            line += f" (p50 +{s.native['p50'] - s.plain['p50']:.2f} ms)"
    if s.skip:
        line += f", {s.sc.name}-matcher {fmt_ratio(s.skip['rps'] / s.plain['rps'])}"
    if s.mint:
        line += f", {s.sc.name}-mint {fmt_ratio(s.mint['rps'] / s.plain['rps'])}"
    if s.routes:
        line += f", {s.sc.name}-3routes {fmt_ratio(s.routes['rps'] / s.plain['rps'])}"
    return line


def store_text(s: Summary) -> str:
    if not s.store_per_rq:
        return "0"
    total = sum(s.store_per_rq.values())
    parts = " + ".join(f"{k} {v:.2f}" for k, v in s.store_per_rq.items() if v >= 0.005)
    batches, batched = s.store_outcomes_per_rq.get("batches", 0), s.store_outcomes_per_rq.get("batched", 0)
    if batches:
        parts += f"; {total - batched + batches:.2f} HTTP calls, {batched / batches:.1f} commits per batch"
    return f"{total:.2f} ({parts})" if parts else f"{total:.2f}"


def redis_text(s: Summary, front: str) -> str:
    return f"{s.scripts_per_rq.get(front, 0):.2f} ({s.redis_per_rq.get(front, 0):.1f})"


def table(summaries: list[Summary], rounds: int, duration: float) -> list[str]:
    """The scenarios: no filter, the wasm filter (`filter`) and the native host (`native`; "-"
    when it did not run)."""
    lines = [
        f"Medians of {rounds} round(s) of {duration:g} s per Envoy; ratio = filter / no filter, same run "
        "(filter: the wasm filter with idemstore; native: the native host, its store in Envoy).",
        "",
        "| scenario | what | no filter req/s | filter req/s | ratio | native req/s | native ratio "
        "| p50 no filter / filter / native (ms) | p99 no filter / filter / native (ms) | store calls per request "
        "| upstream calls per request, no filter / filter / native | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        notes = [x for x in [note(s)] + s.problems if x]
        n = s.native
        rps, ratio = (f"{n['rps']:.0f}", f"**{fmt_ratio(s.native_ratio)}**") if n else ("-", "-")
        p50, p99 = (f"{n['p50']:.2f}", f"{n['p99']:.2f}") if n else ("-", "-")
        up = f"{s.upstream_per_rq['native']:.2f}" if n else "-"
        lines.append(
            f"| {s.sc.name} | {s.sc.what} (`-t{s.sc.threads} -c{s.sc.conns}`) | {s.plain['rps']:.0f} | {s.idem['rps']:.0f} | "
            f"**{fmt_ratio(s.ratio)}** | {rps} | {ratio} | {s.plain['p50']:.2f} / {s.idem['p50']:.2f} / {p50} | "
            f"{s.plain['p99']:.2f} / {s.idem['p99']:.2f} / {p99} | {store_text(s)} | "
            f"{s.upstream_per_rq['plain']:.2f} / {s.upstream_per_rq['idem']:.2f} / {up} | {'; '.join(notes)} |")
    return lines


def outcome_table(summaries: list[Summary]) -> list[str]:
    lines = ["| scenario | filter outcomes per request (`wasmcustom.idempotency.*`; the native host's "
             "`idempotency.*`) | idemstore operations per request (`op/outcome`; `waited`: begins that found the "
             "lock held); the native host: Redis script calls per request (and commands, the scripts' own "
             "included) |",
             "|---|---|---|"]
    for s in summaries:
        o = ", ".join(f"{k} {v:.3f}" for k, v in s.outcomes_per_rq.items()) or "none"
        st = ", ".join(f"{k} {v:.3f}" for k, v in s.store_outcomes_per_rq.items()) or "none"
        lines.append(f"| {s.sc.name} | {o} | {st} |")
        if s.native:
            o = ", ".join(f"{k} {v:.3f}" for k, v in s.native_outcomes_per_rq.items()) or "none"
            lines.append(f"| {s.sc.name}, native host | {o} | {redis_text(s, 'native')} (the wasm filter's "
                         f"idemstore: {redis_text(s, 'idem')}) |")
        if s.routes:
            o = ", ".join(f"{k} {v:.3f}" for k, v in s.routes_outcomes_per_rq.items()) or "none"
            st = ", ".join(f"{k} {v:.3f}" for k, v in s.routes_store_outcomes_per_rq.items()) or "none"
            lines.append(f"| {s.sc.name}, three route policies | {o} | {st} |")
    return lines


def cpu_table(summaries: list[Summary]) -> list[str]:
    lines = [
        "| scenario | CPU µs per request, no filter: " + " / ".join(COMPONENTS) + " = total "
        "| filter: " + " / ".join(COMPONENTS) + " = total | added by the filter "
        "| cores busy (of 2), these processes / whole machine: no filter; filter |",
        "|---|---|---|---|---|",
    ]
    for s in summaries:
        p = s.cpu_us["plain"]
        for t, name in (("idem", s.sc.name), ("routes", f"{s.sc.name}, filter with three route policies"),
                        ("skip", f"{s.sc.name}, filter behind the composite matcher"),
                        ("mint", f"{s.sc.name}, filter in mint mode"),
                        ("floor", f"{s.sc.name}, no-op wasm filter instead"),
                        ("native", f"{s.sc.name}, native host (no idemstore on its path)")):
            if t not in s.cpu_us:
                continue
            i = s.cpu_us[t]
            added = {c: i[c] - p[c] for c in COMPONENTS}
            lines.append(
                f"| {name} | " + " / ".join(f"{p[c]:.0f}" for c in COMPONENTS) + f" = {sum(p.values()):.0f} | "
                + " / ".join(f"{i[c]:.0f}" for c in COMPONENTS) + f" = {sum(i.values()):.0f} | "
                + ", ".join(f"{c} {added[c]:+.0f}" for c in COMPONENTS if abs(added[c]) >= 1)
                + f" | {s.cores['plain']:.2f} / {s.cores['plain-machine']:.2f}; "
                  f"{s.cores[t]:.2f} / {s.cores[t + '-machine']:.2f} |")
    return lines


def store_round_trip_ms(store_port: int, n: int) -> dict[str, float]:
    """`begin` (a miss that locks) straight to idemstore, HTTP/1.1 keep-alive, one at a time:
    what one store round trip costs a request, for comparison with the filter's added latency."""
    import http.client

    conn = http.client.HTTPConnection(h.LOOPBACK, store_port, timeout=5)
    out = []
    try:
        base = secrets.token_hex(16)
        for i in range(n):
            t0 = time.perf_counter()
            conn.request("POST", "/v1/begin", body=b"", headers={
                "x-idem-key": f"{base}{i:032x}", "x-idem-body-hash": "ab" * 32,
                "x-idem-lock-ttl-ms": "1000", "x-idem-wait-ms": "1"})
            resp = conn.getresponse()
            resp.read()
            out.append((time.perf_counter() - t0) * 1000)
            if resp.getheader("x-idem-token") is None:
                raise SystemExit(f"begin straight to idemstore did not lock: {resp.status}")
    finally:
        conn.close()
    out.sort()
    return {"n": n, "p50": out[len(out) // 2], "p99": out[min(n - 1, int(n * 0.99))]}


# --------------------------------------------------------------------------------------------
# profiles (full runs)
# --------------------------------------------------------------------------------------------


def store_us_text(envoy: h.Envoy) -> str:
    q = urllib.parse.urlencode({"filter": r"idempotency\.store_us\."})
    return h.http_get_status(envoy.admin_port, f"/stats?{q}", timeout=5)[1].decode()


def filter_store_latency(stack: Stack, run_dir: Path, log) -> dict[str, dict[str, float]]:
    """The filter's own store call latency (`idempotency.store_us.*`) on one connection: a 7 s
    unique-1k-c1 run through `idem`, then the interval quantiles of the first stats flush after
    it (Envoy flushes every 5 s, so the interval before it holds only this run's calls)."""
    envoy = stack.envoys["idem"]
    run_wrk(stack, "idem", BY_NAME["unique-1k-c1"], 7, f"c1-{secrets.token_hex(6)}", run_dir / "wrk-c1.log")
    before = store_us_text(envoy)
    deadline = time.monotonic() + 7
    text = before
    while text == before and time.monotonic() < deadline:
        time.sleep(0.25)
        text = store_us_text(envoy)
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = re.match(r"^\S*store_us\.(\w+): (.*)$", line)
        if not m:
            continue
        q = {k: float(v) for k, v in re.findall(r"P(\d+(?:\.\d+)?)\(([\d.]+|nan),", m.group(2)) if v != "nan"}
        if q:
            out[m.group(1)] = q
    if out:
        log("  filter-side store latency on one connection: " + ", ".join(
            f"{op} p50 {q.get('50', 0):.0f} µs p99 {q.get('99', 0):.0f} µs" for op, q in out.items()))
    return out


def wasm_stats(envoy: h.Envoy) -> list[str]:
    q = urllib.parse.urlencode({"filter": "wasm"})
    status, body = h.http_get_status(envoy.admin_port, f"/stats?{q}", timeout=5)
    return [ln for ln in body.decode().splitlines() if ln and not ln.startswith("wasmcustom.")]


def memory_growth(stack: Stack, keys: int, run_dir: Path, log) -> list[tuple[int, int, int, int, int]]:
    """Unique keys through a fresh `idem` until `keys` requests were guarded; (guarded, Envoy RSS
    KiB, wasm VMs, their linear memory KiB, its resident KiB) after a 1 s warm-up and after each
    4 s chunk."""
    sc = BY_NAME["unique-1k"]
    envoy = stack.envoys["idem"]
    pid = envoy.proc.pid
    seed = f"mem-{secrets.token_hex(6)}"
    wrk_log = run_dir / "wrk-memory.log"
    base = envoy.counter("guarded")
    rows = [(0, rss_kib(pid), *wasm_memory_kib(pid))]
    run_wrk(stack, "idem", sc, 1, f"{seed}-warm", wrk_log)
    g = envoy.counter("guarded") - base
    rows.append((g, rss_kib(pid), *wasm_memory_kib(pid)))
    chunk = 0
    while g < keys:
        chunk += 1
        run_wrk(stack, "idem", sc, 4, f"{seed}-{chunk}", wrk_log)
        g = envoy.counter("guarded") - base
        rows.append((g, rss_kib(pid), *wasm_memory_kib(pid)))
        log(f"  memory: {g} keys, Envoy RSS {rows[-1][1] / 1024:.1f} MiB, "
            f"wasm linear memory {rows[-1][3] / 1024:.2f} MiB ({rows[-1][4] / 1024:.2f} MiB resident) "
            f"in {rows[-1][2]} VMs")
    return rows


def perf_available() -> bool:
    perf = shutil.which("perf")
    if not perf:
        return False
    r = subprocess.run([perf, "record", "-e", "cpu-clock", "-o", "/dev/null", "--", "true"],
                       capture_output=True, timeout=30)
    return r.returncode == 0


def perf_profile(stack: Stack, duration: float, run_dir: Path, log, front: str = "idem") -> dict[str, list[str]]:
    """perf record (cpu-clock, 999 Hz) of the processes on `front`'s path during a unique-1k
    run through it (`idem`: idemstore, the filter Envoy and Redis; `native`: its Envoy, the
    store's threads inside it, and Redis); flat reports by shared object and by symbol."""
    sc = BY_NAME["unique-1k"]
    if front == "native":
        targets = {"envoy-native": stack.envoys["native"].proc.pid, "redis, native host's run": stack.redis.pid}
    else:
        targets = {"idemstore": stack.store.pid, "envoy-idem": stack.envoys["idem"].proc.pid,
                   "redis": stack.redis.pid}
    perfs = {}
    for name, pid in targets.items():
        data = run_dir / f"perf-{name.split(',')[0]}-{front}.data"
        perfs[name] = (data, subprocess.Popen(
            ["perf", "record", "-e", "cpu-clock", "-F", "999", "-p", str(pid), "-o", str(data), "--",
             "sleep", f"{duration + 1:g}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(0.5)
    run = run_wrk(stack, front, sc, duration, f"perf-{secrets.token_hex(6)}", run_dir / "wrk-perf.log")
    log(f"  perf: unique-1k through {front} at {run.rps:.0f} req/s while recording")
    out: dict[str, list[str]] = {"_rps": [f"{run.rps:.0f}"]}
    for name, (data, p) in perfs.items():
        p.wait(timeout=duration + 60)
        r = subprocess.run(["perf", "report", "-n", "-i", str(data), "--stdio", "--no-children", "--sort", "dso,symbol",
                            "--percent-limit", "0"], capture_output=True, text=True, timeout=300)
        counts = []  # (samples, dso, symbol); percentages from the counts (the printed ones are rounded)
        for ln in r.stdout.splitlines():
            m = re.match(r"^\s*[\d.]+%\s+(\d+)\s+(\[JIT\] tid \d+|\S+)\s+\[[.k]\]\s+(.*?)(\s+-\s+-)?\s*$", ln)
            if m:
                dso = {"redis-check-rdb": "redis-server"}.get(m.group(2), m.group(2))
                if dso.startswith("[JIT]"):
                    dso = "[JIT] (V8-compiled code: the filter's wasm)"
                counts.append((int(m.group(1)), dso, m.group(3)))
        total = max(1, sum(c for c, _, _ in counts))
        samples = [(c * 100 / total, dso, sym) for c, dso, sym in counts]
        by_dso: dict[str, float] = {}
        by_group: dict[str, float] = {}
        for pct_, dso, sym in samples:
            by_dso[dso] = by_dso.get(dso, 0.0) + pct_
            g = group_of(dso, sym)
            by_group[g] = by_group.get(g, 0.0) + pct_
        out[f"{name}, by shared object"] = [f"{v:6.2f}%  {k}" for k, v in sorted(by_dso.items(), key=lambda kv: -kv[1])
                                            if v >= 0.5]
        out.setdefault("_shares", {})[name] = {"dso": by_dso, "group": by_group}
        if name in ("idemstore", "envoy-native"):
            out[f"{name}, by crate (Rust symbols by their first path segment; kernel and libc apart)"] = [
                f"{v:6.2f}%  {k}" for k, v in sorted(by_group.items(), key=lambda kv: -kv[1]) if v >= 0.5]
        out[f"{name}, top symbols ({total} samples)"] = [shorten(f"{pct_:6.2f}%  {dso}  {sym}")
                                                        for pct_, dso, sym in samples[:20]]
    return out


def group_of(dso: str, sym: str) -> str:
    if dso.startswith("[kernel"):
        return "kernel"
    # The native host's module is Rust code too: by crate, as idemstore.
    if (dso.startswith("lib") and not dso.startswith("libidempotency_filter")) or dso.startswith("[vdso"):
        return dso
    s = sym.lstrip("<&*( ")
    s = re.sub(r"^(dyn |mut |const )+", "", s)
    m = re.match(r"([A-Za-z_][A-Za-z0-9_]*)::", s)
    return f"{dso}: {m.group(1)}" if m else f"{dso}: other"


def shorten(line: str, width: int = 150) -> str:
    line = re.sub(r"\s+", " ", line.strip())
    return line if len(line) <= width else line[:width - 3] + "..."


def callgrind_profile(stack: Stack, requests: int, run_dir: Path, log) -> dict[str, list[str]]:
    """When perf cannot sample: a second idemstore under callgrind, on the same Redis, driven
    with begin + commit pairs straight over HTTP/1.1 (a unique request's two store calls)."""
    import http.client

    out_file = run_dir / "callgrind.out.idemstore"
    port = h.free_port()
    proc = h.start("idemstore-callgrind",
                   ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}", h.idemstore_bin(),
                    "--listen", f"{h.LOOPBACK}:{port}", "--redis", f"redis://{h.LOOPBACK}:{stack.redis_port}"],
                   run_dir)
    try:
        h.await_ready(proc, lambda: h.http_get_status(port, "/healthz")[0] == 200, "idemstore under callgrind",
                      timeout=120)
        conn = http.client.HTTPConnection(h.LOOPBACK, port, timeout=30)
        for i in range(requests):
            key = f"{i:064x}"
            conn.request("POST", "/v1/begin", headers={"x-idem-key": key, "x-idem-body-hash": "ab" * 32,
                                                       "x-idem-lock-ttl-ms": "30000", "x-idem-wait-ms": "1"})
            resp = conn.getresponse()
            resp.read()
            token = resp.getheader("x-idem-token") or ""
            conn.request("POST", "/v1/commit", body=b"IDR1\x00\xc9\x00\x00" + UPSTREAM_BODY.encode(),
                         headers={"x-idem-key": key, "x-idem-token": token, "x-idem-body-hash": "ab" * 32,
                                  "x-idem-retention-s": "60", "content-type": "application/octet-stream"})
            conn.getresponse().read()
        conn.close()
    finally:
        proc.stop(timeout=60)
    r = subprocess.run(["callgrind_annotate", str(out_file)], capture_output=True, text=True, timeout=300)
    rows = [shorten(ln) for ln in r.stdout.splitlines() if re.match(r"^\s*[\d,]+ \(", ln)]
    log(f"  callgrind: {requests} begin+commit pairs")
    return {"idemstore under callgrind, top functions by instructions": rows[:30]}


# --------------------------------------------------------------------------------------------
# RESULTS.md
# --------------------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    def first_line(argv: list[str], pattern: str | None = None) -> str:
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return "?"
        text = (r.stdout + r.stderr).strip()
        if pattern:
            m = re.search(pattern, text)
            return m.group(1) if m else text.splitlines()[0] if text else "?"
        return text.splitlines()[0] if text else "?"

    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "machine": f"{os.cpu_count()} CPUs ({cpu}), {platform.system()} {platform.release()}",
        "envoy": first_line([h.envoy_bin(), "--version"], r"version: (\S+)"),
        "rustc": first_line(["rustc", "--version"]),
        "redis": first_line([h.redis_bin(), "--version"]),
        "wrk": first_line([wrk_bin(), "-v"]),
    }


def replace_section(text: str, title: str, section: str, before: str = "## Latency") -> str:
    start = text.find(title + "\n")
    if start < 0:
        at = text.find(before)
        if at < 0:
            return text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
        return text[:at] + section.rstrip("\n") + "\n\n" + text[at:]
    end = text.find("\n## ", start + 1)
    return text[:start] + section.rstrip("\n") + "\n" + ("" if end < 0 else text[end:])


def write_results(sections: list[tuple[str, str]]) -> None:
    head = "# Benchmark results\n\nWritten by `make bench`; each section by the script it names.\n\n"
    text = RESULTS.read_text() if RESULTS.exists() else head
    for title, section in sections:
        # The goals come first; the native host's after the throughput; a new section otherwise
        # goes before the latency one.
        before = {"## Goals": "## Throughput", "## Native host": "## Where the time goes"}.get(title, "## Latency")
        text = replace_section(text, title, section, before)
    RESULTS.write_text(text.rstrip("\n") + "\n")


def throughput_section(summaries, rounds, duration, vers, started, load) -> str:
    lines = [
        "## Throughput",
        "",
        f"`bench/throughput.py` (`make bench`), {started} UTC. Machine: {vers['machine']}.",
        f"Envoy {vers['envoy']}, {vers['rustc']}, {vers['redis']}, {vers['wrk']}.",
        f"Load average before the run: {load}.",
        "",
        "The filter Envoy, the native host's Envoy and the no-filter Envoy (same listener, routes and",
        "clusters; router only) run side by side (`--concurrency 2` each), in front of an upstream Envoy",
        "that answers `201` JSON itself (`direct_response`) after reading the body, at once or after",
        "5 ms (fault filter), and idemstore on Redis (the native host's store is in its Envoy, on the same",
        "Redis). wrk (`bench/load.lua`) drives them alternately. **wrk, the Envoys, idemstore and Redis",
        "share these 2 cores**: a ratio is what the filter's whole path (VM, store streams, idemstore,",
        "Redis; for the native host the module and Redis) costs the machine, not the filter Envoy alone.",
        "The filter runs as shipped: `store_transport: stream` (each worker's store calls as messages on",
        "its store streams); `BENCH_FILTER_EXTRA='{\"store_transport\": \"callout\"}'` runs it on HTTP",
        "callouts.",
        "",
        *table(summaries, rounds, duration),
        "",
        "How each scenario is driven (wrk 4.1, `--latency`, closed loop, keep-alive connections):",
        "",
        "- passthrough: `POST` with a 1 KiB JSON body and no `Idempotency-Key` (the guarded method",
        "  without a key: the filter lets it through).",
        "- passthrough-off: the same on route `search` (`/fast/search`), on which the filter Envoy's",
        "  Wasm filter is disabled by Envoy's per-route `FilterConfig` (`disabled: true` in",
        "  `typed_per_filter_config`, keyed by the filter's name): Envoy does not create the filter.",
        "- three route policies (passthrough and unique-1k): a third Envoy, the filter's configuration",
        "  with `routes` (`payments`: require_key, 2xx and 4xx kept, 7 days; `webhooks`: inbox mode;",
        "  `orders`: lock_wait_ms 2000), the requests on `orders`, next to the filter with one",
        "  configuration for every route.",
        "- unique-1k / unique-64k / body-1m: a new key per request, `<seed>-<thread>-<counter>`, the",
        "  seed random per run; each request is `begin` (miss, lock), the upstream, `commit`.",
        "- unique-1k-c1: unique-1k on one connection (`-t1 -c1`): latency without queueing, so the",
        "  p50 difference is the latency the filter adds (its throughput ratio is just the inverse).",
        "- replay / replay-5ms: 8 keys stored beforehand through the filter with the same body, then",
        "  requested round-robin: every filtered request is a replay (the first of each key on each",
        "  worker from the store, the rest from that VM's record cache); the no-filter Envoy sends",
        "  every one to the upstream (on `replay-5ms` the upstream waits 5 ms first).",
        "- burst: wrk with one thread and 20 connections; the thread uses each key for 20",
        "  consecutive requests, which leave on the 20 connections at about the same time (the first",
        "  key's 20 at exactly the same moment; afterwards a key's 20 requests go out as the previous",
        "  key's answers come back, so most wait on the lock of a running original and are woken by",
        "  its commit). One execution per 20 requests; the no-filter Envoy executes all 20.",
        "- store calls per request: deltas of idemstore's `idemstore_requests_total` by `op` over",
        "  the filtered runs, divided by the requests wrk completed (a commit sent in a `/v1/commits`",
        "  batch counts as one; the HTTP calls follow); upstream calls per request:",
        "  `cluster.up_*.upstream_rq_total` of each Envoy, no filter / filter.",
        "",
        *outcome_table(summaries),
        "",
        "CPU time per request of each process (utime + stime from `/proc/<pid>/stat` over each run,",
        "wrk's from its rusage), summed over the rounds; `envoy` is the Envoy under test, `upstream`",
        "the answering Envoy. Cores busy: these processes' CPU seconds per second of load, and the",
        "whole machine's (`/proc/stat`; wrk's run only, not the settling after it): in a saturated",
        "run a gap between the two is load from something else, i.e. noise (in lightly loaded runs",
        "the two tick-based clocks disagree; compare them only near 2).",
        "",
        *cpu_table(summaries),
    ]
    return "\n".join(lines) + "\n"


def native_section(summaries: list[Summary], log_lines: list[str]) -> str:
    lines = [
        "## Native host",
        "",
        "The native host (`native`: `libidempotency_filter.so`, an Envoy dynamic module, docs/native.md) in the",
        "same run as the sections above: the same routes and configuration as the filter Envoy, `store:",
        "{\"redis\": ...}` on the Redis idemstore uses (the store's threads in Envoy's process; no idemstore on",
        "its path, so its CPU is that Envoy's, the upstream's, Redis's and wrk's), no composite matcher. Each",
        "scenario drives it in turn with the no-filter Envoy and the wasm filter (`filter`). Added = with minus",
        "without the filter. Check: what the front's outcome counters and upstream calls say over the",
        "scenario's runs (a unique key executes once, a burst's key once, a stored key never again; any",
        "`degraded`, `store_errors`, `conflicted`... is named in bold).",
        "",
        *native_table(summaries),
        "",
    ]
    if log_lines:
        lines += [f"The native Envoy's log had {len(log_lines)} error, critical or module warning line(s); the first:",
                  "", "```", *[shorten(ln, 200) for ln in log_lines[:10]], "```", ""]
    else:
        lines += ["The native Envoy's log had no error, critical or module warning line.", ""]
    return "\n".join(lines) + "\n"


PEER = BENCH / "peer" / "run.py"
PEER_SCENARIOS = ["unique-1k", "unique-1k-c1", "replay", "burst"]


def run_peer(rounds: int, duration: float, run_dir: Path, log) -> dict | None:
    """bench/peer/run.py (the idempotency middleware a team would put in the app) with the same
    rounds and duration, right after the filter's scenarios; None when Node.js is missing."""
    if not (shutil.which("node") and shutil.which("npm")):
        log("node/npm not found: no peer comparison (bench/peer needs Node.js)")
        return None
    out = run_dir / "peer.json"
    cmd = [sys.executable, str(PEER), "--rounds", str(rounds), "--duration", f"{duration:g}",
           "--scenarios", ",".join(PEER_SCENARIOS), "--json", str(out)]
    log("peer: " + " ".join(cmd[1:]))
    with open(run_dir / "peer.log", "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=3600).returncode
    if rc != 0 or not out.exists():
        log(f"peer run failed (rc {rc}, see {run_dir / 'peer.log'})")
        return None
    return json.loads(out.read_text())


def added_cpu_us(s: Summary, front: str = "idem") -> float:
    """CPU µs per request of every process on `front`'s path, minus without the filter."""
    return sum(s.cpu_us[front].values()) - sum(s.cpu_us["plain"].values())


def added_p50_ms(s: Summary, front: str = "idem") -> float:
    m = s.native if front == "native" else s.idem
    return m["p50"] - s.plain["p50"]


def by_process(s: Summary, front: str = "idem") -> str:
    """Added CPU µs per request by process, largest first."""
    added = {c: s.cpu_us[front][c] - s.cpu_us["plain"][c] for c in COMPONENTS}
    return ", ".join(f"{c} {added[c]:+.0f}" for c in sorted(COMPONENTS, key=lambda c: -added[c])
                     if front != "native" or c != "idemstore")


def native_table(summaries: list[Summary]) -> list[str]:
    """Per scenario, the native host next to the wasm filter, both against the no-filter Envoy
    of the same run."""
    lines = [
        "| scenario | ratio: filter / native | added p50 (ms): filter / native | added CPU µs per request, all "
        "processes: filter / native | native's added CPU by process (µs) | Redis script calls (commands) per "
        "request: filter (through idemstore) / native | check: filter / native |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        if not s.native:
            continue
        checks = " / ".join(s.checks[t].text() if t in s.checks else "-" for t in ("idem", "native"))
        lines.append(
            f"| {s.sc.name} | {fmt_ratio(s.ratio)} / **{fmt_ratio(s.native_ratio)}** | "
            f"{added_p50_ms(s):+.2f} / {added_p50_ms(s, 'native'):+.2f} | "
            f"{added_cpu_us(s):+.0f} / {added_cpu_us(s, 'native'):+.0f} | {by_process(s, 'native')} | "
            f"{redis_text(s, 'idem')} / {redis_text(s, 'native')} | {checks} |")
    return lines


# The native host's goals, set against the wasm filter's figures of the full run of 2026-12-04
# (the second column): (figure, that figure, the goal).
NATIVE_GOALS = [
    ("unique-1k", "0.34x", ">= 0.65x"),
    ("CPU per unique request, all processes", "+335 µs", "<= +130 µs"),
    ("added p50, one connection", "+0.46 ms", "<= +0.15 ms, below the peer's"),
    ("burst (20 duplicates per key)", "0.48x", ">= 0.75x"),
    ("replay", "1.55x", ">= 2x"),
    ("pass-through with the filter on the route", "0.89x (matcher)", ">= 0.97x without a matcher"),
]


def native_goals(summaries: list[Summary], peer: dict | None) -> list[str]:
    """NATIVE_GOALS against this run: the native host's figure (met or missed), the wasm
    filter's in the same run beside it, and for each miss where the native host's time goes."""
    by = {s.sc.name: s for s in summaries if s.native}
    peer_c1 = {p["name"]: p for p in peer["scenarios"]}.get("unique-1k-c1") if peer else None

    def ratio(name: str, want: float):
        s = by.get(name)
        if not s:
            return None
        return (fmt_ratio(s.ratio), fmt_ratio(s.native_ratio), s.native_ratio >= want,
                f"by process (µs per request): {by_process(s, 'native')}")

    def cpu():
        s = by.get("unique-1k")
        if not s:
            return None
        n = added_cpu_us(s, "native")
        return (f"{added_cpu_us(s):+.0f} µs", f"{n:+.0f} µs", n <= 130, f"by process (µs): {by_process(s, 'native')}")

    def p50():
        s = by.get("unique-1k-c1")
        if not s:
            return None
        n = added_p50_ms(s, "native")
        theirs = peer_c1["added_p50_ms"] if peer_c1 else None
        text = f"{n:+.2f} ms" + (f" (peer {theirs:+.2f} ms)" if theirs is not None else " (peer not run)")
        ok = n <= 0.15 and (theirs is None or n < theirs)
        return (f"{added_p50_ms(s):+.2f} ms", text, ok,
                f"p50 {s.plain['p50']:.2f} -> {s.native['p50']:.2f} ms on one connection; the `begin` is one Redis "
                "script call from the module's store threads, and the answer a commit on the worker's scheduler")

    def passthrough():
        s = by.get("passthrough")
        if not s:
            return None
        wasm = f"{fmt_ratio(s.skip['rps'] / s.plain['rps'])} (matcher)" if s.skip else f"{fmt_ratio(s.ratio)} (on the route)"
        return (wasm, fmt_ratio(s.native_ratio), s.native_ratio >= 0.97,
                f"the native Envoy spends {envoy_added_us(s, 'native'):+.0f} µs of CPU per request over the "
                "no-filter Envoy, the module's hooks for a keyless POST")

    measured = [ratio("unique-1k", 0.65), cpu(), p50(), ratio("burst", 0.75), ratio("replay", 2.0), passthrough()]
    rows = ["| figure | wasm, goal set against | native goal | wasm, this run | native, this run | |",
            "|---|---|---|---|---|---|"]
    misses = []
    for (figure, before, target), m in zip(NATIVE_GOALS, measured):
        if m is None:
            rows.append(f"| {figure} | {before} | {target} | - | not measured | - |")
            continue
        wasm, native, ok, why = m
        rows.append(f"| {figure} | {before} | {target} | {wasm} | {native} | {'met' if ok else '**missed**'} |")
        if not ok:
            misses.append(f"- {figure} ({native}, goal {target}): {why}.")
    return rows + ([""] + ["Where the native host's time goes, for each goal missed:", "", *misses] if misses else [])


def native_log(envoy: h.Envoy) -> list[str]:
    """The native Envoy's log lines that say something went wrong: Envoy's errors and
    criticals, and every warning of the module (`idempotency:`) or its component
    (`dynamic_modules`); a caught panic logs one such line and leaves its stream unguarded."""
    out = []
    for line in envoy.log_text().splitlines():
        if ("[error]" in line or "[critical]" in line or "panic" in line
                or ("[warning]" in line and ("idempotency" in line or "dynamic_modules" in line))):
            out.append(line)
    return out


def peer_section(summaries: list[Summary], peer: dict) -> str:
    by = {s.sc.name: s for s in summaries}
    ps = {p["name"]: p for p in peer["scenarios"]}
    c = peer["contract"]
    lines = [
        "## Peer: idempotency inside the app",
        "",
        f"The same wrk scenarios (`bench/load.lua`), right after the filter's in the same `make bench` run "
        f"({peer['rounds']} rounds x {peer['duration_s']:g} s, medians), against {peer['peer']} "
        f"(`bench/peer/`: {', '.join(f'{k} {v}' for k, v in peer['versions'].items() if k not in ('cpu', 'cores'))}), "
        "compared with the same app without the middleware. Added = with minus without; CPU µs per request of "
        "every process (filter side: the filter Envoy, the upstream Envoy, idemstore, Redis, wrk; peer side: the "
        "Node app, Redis, wrk).",
        "",
        "| scenario | filter: added p50 / p99 (ms) | filter: added CPU µs per request | peer: added p50 / p99 (ms) "
        "| peer: added CPU µs per request | contract (peer) |",
        "|---|---|---|---|---|---|",
    ]
    for name in PEER_SCENARIOS:
        f, q = by.get(name), ps.get(name)
        if not f or not q:
            continue
        ke = q.get("key_executions", {}).get("peer")
        if not ke:
            contract = "-"
        elif ke["multi"] == 0:
            contract = f"each of {ke['keys']} keys ran once"
        else:
            contract = f"**{ke['multi']} of {ke['keys']} keys ran more than once** (up to {ke['max']} times)"
        lines.append(
            f"| {name} | {f.idem['p50'] - f.plain['p50']:+.2f} / {f.idem['p99'] - f.plain['p99']:+.2f} "
            f"| {added_cpu_us(f):+.0f} | {q['added_p50_ms']:+.2f} / {q['added_p99_ms']:+.2f} "
            f"| {q['added_cpu_us']['total']:+.0f} | {contract} |")
    trials = c.get("concurrent", {}).get("trials", [])
    other, replay, scope = c.get("other_body", {}), c.get("replay", {}), c.get("scope", {})
    lines += [
        "",
        "The contract, checked on the peer in the same run (`bench/peer/run.py`; the filter's answers to",
        "the same cases are asserted by the contract tests: one execution, `422`, `x-idempotent-replay`,",
        "records scoped by caller):",
        "",
        f"- {c.get('concurrent', {}).get('n', 20)} concurrent duplicates of one key, {len(trials)} trials: "
        f"executions {[t['executions'] for t in trials]}, distinct order ids returned "
        f"{[t['distinct_ids_in_201s'] for t in trials]} (the filter: 1 and 1).",
        f"- the same key with another body: `{other.get('status')}` (first answer replayed: "
        f"{other.get('replayed_first_answer')}; the filter: `422`).",
        f"- a replay: same body {replay.get('same_body')}; replay header: "
        f"{', '.join(replay.get('replay_headers', {})) or 'none'} (the filter: `x-idempotent-replay: true`).",
        f"- another caller with the same key and body got the first caller's answer: "
        f"{scope.get('bob_got_alices_answer')}; the stored record holds the request's `Authorization` "
        f"header: {scope.get('stored_authorization_header')} (the filter scopes by caller and stores "
        "no request header).",
    ]
    return "\n".join(lines) + "\n"


def goals_section(summaries: list[Summary], peer: dict | None, rtt: dict | None = None,
                  filter_lat: dict | None = None) -> str:
    """The performance goals set for the store stream (2026-12-04) against this run's figures,
    and for each one missed where its time goes."""
    by = {s.sc.name: s for s in summaries}
    rows = []
    misses = []

    def goal(target: str, measured: float | None, text: str, ok, why=None) -> None:
        if measured is None:
            rows.append(f"| {target} | not measured | - |")
        elif ok(measured):
            rows.append(f"| {target} | {text} | met |")
        else:
            rows.append(f"| {target} | {text} | **missed** |")
            if why:
                misses.append(f"- {target}: {why()}")

    def by_process(s: Summary) -> str:
        added = {c: s.cpu_us["idem"][c] - s.cpu_us["plain"][c] for c in COMPONENTS}
        return ", ".join(f"{c} {added[c]:+.0f}" for c in sorted(COMPONENTS, key=lambda c: -added[c]))

    u = by.get("unique-1k")
    c1 = by.get("unique-1k-c1")
    pt = by.get("passthrough")
    ops = sum(u.store_per_rq.values()) if u else 0
    envoy_why = (lambda: f"{envoy_added_us(u):+.0f} µs: {ops:.2f} store messages per request on the workers' "
                         "streams, and the VM's own work on the request's path: its callbacks for the request and "
                         "the response, copying the body in and the record out, SHA-256, the record, the local "
                         "fallback's mirror writes to shared data (the filter in mint mode, which makes no store "
                         f"call, costs {envoy_added_us(pt, 'mint') if pt and pt.mint else float('nan'):+.0f} µs "
                         "on pass-through; see Profiles).")
    goal("unique-1k >= 0.40x", u.ratio if u else None, f"{u.ratio:.2f}x" if u else "", lambda x: x >= 0.40,
         lambda: f"every request costs {added_cpu_us(u):+.0f} µs of CPU on this 2-core machine, by process (µs): "
                 f"{by_process(u)} (see Unique key, Profiles).")
    goal("CPU per unique request, all processes <= +200 µs", added_cpu_us(u) if u else None,
         f"{added_cpu_us(u):+.0f} µs" if u else "", lambda x: x <= 200, lambda: f"by process (µs): {by_process(u)}.")
    env = envoy_added_us(u) if u else None
    goal("Envoy CPU per unique request <= +110 µs", env, f"{env:+.0f} µs" if env is not None else "",
         lambda x: x <= 110, envoy_why)
    per_op = u.cpu_us["idem"]["idemstore"] / ops if u and ops else None
    goal("idemstore CPU per store operation <= 25 µs", per_op, f"{per_op:.0f} µs" if per_op else "",
         lambda x: x <= 25,
         lambda: "each operation is a message read off the stream, a task, a Redis script call on the "
                 "multiplexed connection and an answer written back; most of idemstore's samples are the "
                 "kernel's (socket reads and writes, wake-ups) and h2/tokio (see Profiles).")
    add = c1.idem["p50"] - c1.plain["p50"] if c1 else None
    begin_p50 = (filter_lat or {}).get("begin", {}).get("50")
    goal("added p50 on one connection <= 0.35 ms", add, f"+{add:.2f} ms" if add is not None else "",
         lambda x: x <= 0.35,
         lambda: (f"the `begin` on the stream takes {begin_p50 / 1000:.2f} ms at p50 (the filter's histogram) "
                  if begin_p50 else "the `begin` is one store round trip ")
                 + (f"and {rtt['p50']:.2f} ms straight to idemstore over HTTP/1.1; " if rtt else "; ")
                 + "the rest is the filter's own work on the request's path (buffering and hashing the body, "
                   "resuming the request) (see Added latency).")
    b = by.get("burst")
    goal("burst (20 duplicates per key) >= 0.60x", b.ratio if b else None, f"{b.ratio:.2f}x" if b else "",
         lambda x: x >= 0.60,
         lambda: f"by process (µs): {by_process(b)}; most duplicates wait on the store for the original's "
                 "commit and are replayed from its answer.")
    # Not worse than before the store stream (the figures measured on HTTP callouts before it).
    for name, before in (("replay", 1.68), ("replay-5ms", 15.0), ("body-1m", 0.42)):
        s = by.get(name)
        goal(f"{name} not worse than {before:g}x", s.ratio if s else None, f"{s.ratio:.2f}x" if s else "",
             lambda x, before=before: x >= before * 0.95,
             lambda s=s: f"by process (µs): {by_process(s)}; this run's no-filter figure moves between runs on "
                         "this shared 2-core machine.")
    skip = pt.skip["rps"] / pt.plain["rps"] if pt and pt.skip else None
    goal("pass-through (behind the composite matcher) not worse than 1.12x", skip,
         f"{skip:.2f}x" if skip else "", lambda x: x >= 1.12 * 0.95,
         lambda: f"the VM is not entered, but the filter Envoy spends {envoy_added_us(pt, 'skip'):+.0f} µs of CPU "
                 "per request over the no-filter Envoy (the matcher reads two headers); a ratio above 1 is this "
                 "machine's noise between two identical paths.")
    if peer:
        ps = {p["name"]: p for p in peer["scenarios"]}
        f, q = by.get("unique-1k-c1"), ps.get("unique-1k-c1")
        if f and q:
            mine = f.idem["p50"] - f.plain["p50"]
            goal("added p50 per unique request below the peer's", mine,
                 f"{mine:+.2f} ms vs {q['added_p50_ms']:+.2f} ms", lambda x, q=q: x < q["added_p50_ms"],
                 lambda mine=mine: f"of the filter's {mine:+.2f} ms, the `begin` is one message to idemstore and "
                                   "its Redis script (see Added latency); the peer adds one Redis round trip inside "
                                   "the app's process, and its figure on one connection moves widely between runs.")
        f, q = by.get("unique-1k"), ps.get("unique-1k")
        if f and q:
            mine = added_cpu_us(f)
            theirs = q["added_cpu_us"]["total"]
            goal("CPU per unique request within 2x of the peer's", mine, f"{mine:+.0f} µs vs {theirs:+.0f} µs",
                 lambda x, theirs=theirs: x <= 2 * theirs,
                 lambda f=f: "the peer works inside the app's process with one Redis client; a request through the "
                             "filter crosses the filter Envoy's VM, a message to idemstore and its Redis script, "
                             f"and back (by process, µs: {by_process(f)}). What that buys is in the contract "
                             "column: the peer ran burst keys and concurrent duplicates more than once.")
    lines = ["## Goals", "", "The performance goals for this machine (set for the store stream, 2026-12-04), "
             "against the figures of this run (sections below).", "",
             "| goal | measured | |", "|---|---|---|", *rows, ""]
    if misses:
        lines += ["Where the time goes, for each goal missed:", "", *misses, ""]
    return "\n".join(lines) + "\n"


def envoy_added_us(s, front: str = "idem") -> float:
    """CPU µs per request the `front` Envoy spends above the no-filter Envoy, in one scenario."""
    return s.cpu_us[front]["envoy"] - s.cpu_us["plain"]["envoy"]


def analysis_section(summaries, stats_lines, mem_rows, profile, profiler_note, rtt, filter_lat) -> str:
    by = {s.sc.name: s for s in summaries}
    lines = ["## Where the time goes", ""]
    c1 = by.get("unique-1k-c1")
    if c1:
        lines += [
            f"**Added latency.** On one connection (no queueing) the filter adds "
            f"{c1.idem['p50'] - c1.plain['p50']:.2f} ms at p50 to a unique 1 KiB request",
            f"({c1.plain['p50']:.2f} -> {c1.idem['p50']:.2f} ms; p99 {c1.plain['p99']:.2f} -> {c1.idem['p99']:.2f} ms); "
            f"one store round trip (`begin`, a miss that locks, straight to idemstore over HTTP/1.1",
            f"keep-alive, {rtt['n']} in a row) takes {rtt['p50']:.2f} ms at p50.",
        ]
        if filter_lat:
            lines += [
                "The filter's own histograms (`idempotency.store_us.*`, one flush interval of a 7 s run on one",
                "connection) put a store call, as the filter sees it on its store stream, at "
                + "; ".join(f"`{op}` p50 {q.get('50', 0) / 1000:.2f} ms, p99 {q.get('99', 0) / 1000:.2f} ms"
                            for op, q in filter_lat.items()) + ".",
                "The `commit` is sent after the answer, but on one busy connection it overlaps the next",
                "request's `begin`.",
            ]
        lines += [""]
    u = by.get("unique-1k")
    if u:
        p, i = u.cpu_us["plain"], u.cpu_us["idem"]
        added = {c: i[c] - p[c] for c in COMPONENTS}
        total_added = sum(added.values())
        lines += [
            f"**Unique key, 1 KiB.** The filtered path costs the machine {sum(i.values()):.0f} µs of CPU per request",
            f"against {sum(p.values()):.0f} µs without the filter (+{total_added:.0f} µs): with the cores equally busy in",
            f"both runs ({u.cores['plain']:.2f} and {u.cores['idem']:.2f} cores), that predicts a ratio of "
            f"{sum(p.values()) / max(1e-9, sum(i.values())):.2f}; measured {fmt_ratio(u.ratio)}. The added CPU per request by process: "
            + ", ".join(f"{c} {added[c]:+.0f} µs" for c in sorted(COMPONENTS, key=lambda c: -added[c])) + ".",
            f"Store calls per request: {store_text(u)}, so idemstore spends {i['idemstore'] / max(0.01, sum(u.store_per_rq.values())):.0f} µs",
            f"and Redis {i['redis'] / max(0.01, sum(u.store_per_rq.values())):.0f} µs of CPU per store call. "
            f"p50 latency {u.plain['p50']:.2f} -> {u.idem['p50']:.2f} ms at {u.sc.conns} connections (closed loop:",
            "latency there is mostly the lower throughput). CPU per request is not purely additive: at a",
            "lower request rate every process handles fewer events per wake-up (the upstream Envoy does",
            "the same work in both runs but is charged more per request in the filtered one).",
            "",
        ]
    env = [(n, by[n]) for n in ("passthrough", "replay", "unique-1k", "unique-64k", "body-1m") if n in by]
    if env:
        added = {n: envoy_added_us(x) for n, x in env}
        lines += ["**The filter Envoy's own cost**, CPU µs per request above the no-filter Envoy: "
                  + ", ".join(f"{n} {v:+.0f}" for n, v in added.items()) + "."]
        if "unique-1k" in added and "unique-64k" in added:
            slope = (added["unique-64k"] - added["unique-1k"]) / 63  # µs per KiB
            lines += [f"From 1 KiB to 64 KiB the body costs {slope:.2f} µs per KiB in the filter Envoy (buffering,",
                      f"copying into the VM, SHA-256): {1024 / max(0.001, slope):.0f} MB/s per core."]
        lines += [""]
    pt = by.get("passthrough")
    if pt:
        lines += [
            f"**Pass-through.** {fmt_ratio(pt.ratio)}; the filter Envoy spends "
            f"{envoy_added_us(pt):+.0f} µs per request more than the no-filter",
            "Envoy although the filter only looks at two headers: Envoy enters the VM for every header",
            "and body callback of the request and of the response, whether the filter has work or not.",
        ]
        if pt.floor:
            fl = pt.floor["rps"] / pt.plain["rps"]
            lines += [
                "A filter that does nothing but one header lookup (`bench/floor-filter`: the same SDK, proxy-wasm",
                f"0.2.5, and the same V8 VM settings) runs at {fmt_ratio(fl)} in the same run, with "
                f"{envoy_added_us(pt, 'floor'):+.0f} µs of Envoy CPU per request:",
                "that is the floor of a Rust proxy-wasm filter on this path here; the idempotency filter's own",
                f"pass-through work is the gap between {fmt_ratio(fl)} and {fmt_ratio(pt.ratio)}.",
            ]
        if pt.skip:
            lines += [
                f"Behind the composite matcher (as envoy/envoy.yaml ships it: `ExtensionWithMatcher` around Envoy's "
                f"`composite` filter) the same requests run at {fmt_ratio(pt.skip['rps'] / pt.plain['rps'])}, "
                f"{envoy_added_us(pt, 'skip'):+.0f} µs of Envoy CPU per request:",
                "the filter is created only when the matcher's `ExecuteFilterAction` fires (a request with an",
                "Idempotency-Key and a guarded method), so these requests get no VM context at all. The first",
                "wrapper, a `SkipFilter` action around the filter itself, saved almost nothing, as Envoy still",
                "created the filter for every stream. envoyproxy/envoy#16716 reported the composite filter",
                "refusing Wasm filters (their access logger); that no longer holds on Envoy 1.40.",
            ]
        lines += [""]
    b = by.get("body-1m")
    if b:
        added_s = envoy_added_us(b) / 1e6
        lines += [
            f"**1 MiB body.** {note(b)} through the filter vs without ({fmt_ratio(b.ratio)}); the filter Envoy spends "
            f"{added_s * 1000:.2f} ms more CPU per request,",
            "so everything it adds for a 1 MiB body (buffering, copying each chunk into the VM, SHA-256, the",
            f"store calls, the record's commit on a callout above 64 KiB) runs at {b.sc.size / max(1e-9, added_s) / 1e6:.0f} MB/s "
            "per core: the in-VM SHA-256 alone is at least that fast.",
            "",
        ]
    r5, r = by.get("replay-5ms"), by.get("replay")
    if r5:
        lines += [
            f"**Replay.** With a 5 ms upstream the edge answers {fmt_ratio(r5.ratio)} the requests of the",
            f"no-filter Envoy (p50 {r5.plain['p50']:.2f} -> {r5.idem['p50']:.2f} ms)"
            + (f"; with the fast upstream {fmt_ratio(r.ratio)}, the filter Envoy spending "
               f"{envoy_added_us(r):+.0f} µs per request against proxying it" if r else "") + ".",
            f"Store calls per replayed request: {store_text(r or r5)}. Each worker's VM asks the store once",
            "per key and answers the retries after that from its record cache (`record_cache_entries`),",
            "until the lifetime the store reported for the record runs out.",
            "",
        ]
    lines += ["### Envoy's wasm stats", "",
              "`/stats?filter=wasm` of the filter Envoy after the scenarios (the filter's own",
              "`wasmcustom.*` counters left out):", "", "```", *stats_lines, "```", ""]
    if not any("memory" in ln for ln in stats_lines):
        lines += ["Envoy 1.40 exposes no wasm memory statistic (only the VM counts above). The filter",
                  "VMs' memory is read from `/proc/<pid>/smaps` instead: V8 reserves 8 GiB of address",
                  "space per wasm memory and makes the linear memory (as far as the module has grown it;",
                  "it never shrinks) a read-write mapping at the start of that reservation. The table",
                  "sums those mappings over the Envoy's VMs, with Envoy's RSS beside them.", ""]
    if mem_rows:
        lines += ["### Filter VM memory under unique keys", "",
                  "A fresh filter Envoy, unique-key 1 KiB requests (`-t2 -c16`):", "",
                  "| keys guarded | Envoy RSS (MiB) | wasm VMs | their linear memory (MiB) | of it resident (MiB) |",
                  "|---|---|---|---|---|"]
        for g, rss, n, size, res in mem_rows:
            lines.append(f"| {g} | {rss / 1024:.1f} | {n} | {size / 1024:.2f} | {res / 1024:.2f} |")
        first, last = mem_rows[0], mem_rows[-1]
        lines += ["", f"From {first[0]} to {last[0]} keys: Envoy RSS {(last[1] - first[1]) / 1024:+.1f} MiB, "
                  f"the VMs' linear memory {(last[3] - first[3]) / 1024:+.2f} MiB.", ""]
    shares = profile.get("_shares") if profile else None
    if shares:
        def top(d: dict, n: int) -> str:
            return ", ".join(f"{k} {v:.0f}%" for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n])
        lines += ["**Profiles** (below; unique-1k through the filter, then through the native host). Shares of "
                  "each process's samples:"]
        for name in ("envoy-idem", "idemstore", "redis", "envoy-native", "redis, native host's run"):
            if name in shares:
                d = shares[name]["group" if name == "idemstore" else "dso"]
                lines += [f"- {name}: {top(d, 6)}."]
        lines += ["", "In a VM, cpu-clock samples land where interrupts are re-enabled, so kernel scheduler",
                  "symbols (`finish_task_switch`, `_raw_spin_unlock_irqrestore`) stand for context switches and",
                  "wake-ups: a large kernel share means many small reads, writes and thread hand-offs per request.",
                  ""]
    if profile:
        lines += ["### Profiles", "", profiler_note, ""]
        for k, rows in profile.items():
            if k.startswith("_") or not isinstance(rows, list):
                continue
            lines += [f"{k}:", "", "```", *rows, "```", ""]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one round of 3 s, no profiles, nothing written")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--duration", type=float, help="seconds per wrk run")
    ap.add_argument("--warmup", type=float, help="seconds of unmeasured load per Envoy per scenario")
    ap.add_argument("--scenarios", help="comma-separated: " + ",".join(BY_NAME))
    ap.add_argument("--no-write", action="store_true", help="do not touch bench/RESULTS.md")
    ap.add_argument("--no-profile", action="store_true", help="skip wasm memory and CPU profiles")
    ap.add_argument("--memory-keys", type=int, default=100_000)
    ap.add_argument("--profiler", choices=["auto", "perf", "callgrind"], default="auto",
                    help="auto: perf if `perf record -e cpu-clock` works, else callgrind")
    ap.add_argument("--callgrind-requests", type=int, default=2000)
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    duration = args.duration or (3.0 if args.quick else 10.0)
    warmup = args.warmup if args.warmup is not None else (0.0 if args.quick else 2.0)
    profile_on = not (args.quick or args.no_profile)
    write = not (args.quick or args.no_write)
    names = args.scenarios.split(",") if args.scenarios else list(BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}; known: {', '.join(BY_NAME)}")
    wrk_bin()

    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    run_dir = BENCH / ".runs" / (time.strftime("%Y%m%d-%H%M%S") + ("-quick" if args.quick else "-throughput"))
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True)

    log(f"run dir {run_dir}; load average {load}")
    floor = floor_wasm() if not args.quick and "passthrough" in names else None
    if not args.quick and "passthrough" in names and not floor:
        log("bench/floor-filter is not built (make bench builds it): pass-through without the no-op filter baseline")
    native = native_module()
    if not native:
        log("the native host is not built (make build builds target/release/libidempotency_filter.so): "
            "no native column")
    stack = Stack(run_dir, floor, native=bool(native))
    summaries: list[Summary] = []
    mem_rows: list = []
    profile: dict = {}
    profiler_note = ""
    stats_lines: list[str] = []
    rtt = {"n": 0, "p50": 0.0, "p99": 0.0}
    filter_lat: dict = {}
    native_lines: list[str] = []
    try:
        stack.start()
        log("stack up: upstream Envoy, redis, idemstore, Envoys " + ", ".join(stack.envoys))
        if profile_on and args.memory_keys > 0:
            mem_rows = memory_growth(stack, args.memory_keys, run_dir, log)
        if args.quick:
            # One short unmeasured run through the filter: the VMs' first calls (V8 tiers the wasm
            # up); the native host's store threads connect to Redis.
            for target in [t for t in FILTER_FRONTS if t in stack.envoys]:
                run_wrk(stack, target, BY_NAME["unique-1k"], 1, f"warm-{target}-{secrets.token_hex(6)}",
                        run_dir / "wrk-warm.log")
        all_runs: dict[str, dict] = {}
        for name in names:
            runs = run_scenario(stack, BY_NAME[name], rounds, duration, warmup, run_dir, log)
            summaries.append(summarize(BY_NAME[name], runs))
            all_runs[name] = {t: [asdict(r) for r in rs] for t, rs in runs.items()}
        # Every run's figures (req/s, p50/p90/p99, CPU...), for comparisons across runs.
        (run_dir / "runs.json").write_text(json.dumps(all_runs, indent=1) + "\n")
        stats_lines = wasm_stats(stack.envoys["idem"])
        if "native" in stack.envoys:
            native_lines = native_log(stack.envoys["native"])
            log(f"envoy-native's log: {len(native_lines)} error, critical or module warning line(s)"
                + "".join(f"\n    {ln}" for ln in native_lines[:10]))
        if profile_on:
            filter_lat = filter_store_latency(stack, run_dir, log)
        rtt = store_round_trip_ms(stack.store_port, 300)
        log(f"one store round trip (begin straight to idemstore): p50 {rtt['p50']:.2f} ms, p99 {rtt['p99']:.2f} ms")
        for s in summaries:
            if s.sc.conns == 1:
                s.extra = (f"p50 +{s.idem['p50'] - s.plain['p50']:.2f} ms; one store round trip "
                           f"p50 {rtt['p50']:.2f} ms")
        if profile_on:
            use = args.profiler
            if use == "auto":
                use = "perf" if perf_available() else "callgrind"
            if use == "perf":
                profile = perf_profile(stack, duration, run_dir, log)
                profiler_note = (f"`perf record -e cpu-clock -F 999 -p <pid>` of each process during {duration:g} s of "
                                 f"unique-1k through the filter ({profile['_rps'][0]} req/s while recording; perf "
                                 "adds its own load). Flat, by shared object, then by shared object and symbol. "
                                 "The wasm code V8 compiled has no symbols (`[JIT]`); Envoy's binary is stripped, "
                                 "so its samples are addresses (V8's runtime and builtins are inside it).")
                if "native" in stack.envoys:
                    # The native host's Envoy (the module's hooks and its store's threads) and
                    # Redis, in a second recording of the same length through `native`.
                    nat = perf_profile(stack, duration, run_dir, log, front="native")
                    profile.update({k: v for k, v in nat.items() if not k.startswith("_")})
                    profile.setdefault("_shares", {}).update(nat.get("_shares", {}))
                    profiler_note += (f" `envoy-native` and `redis, native host's run`: the same during {duration:g} s "
                                      f"of unique-1k through the native host ({nat['_rps'][0]} req/s while recording; "
                                      "the module keeps its symbols).")
            else:
                profile = callgrind_profile(stack, args.callgrind_requests, run_dir, log)
                profiler_note = (f"`perf` cannot sample here: `valgrind --tool=callgrind` on a second idemstore "
                                 f"(same Redis), {args.callgrind_requests} begin + commit pairs over HTTP/1.1; "
                                 "instructions by function (`callgrind_annotate`).")
    finally:
        stack.stop()
    peer = run_peer(rounds, duration, run_dir, log) if write else None

    elapsed = time.monotonic() - t0
    text = "\n".join(table(summaries, rounds, duration)) + "\n\n" + "\n".join(outcome_table(summaries)) + \
        "\n\n" + "\n".join(cpu_table(summaries))
    if native:
        text += "\n\n" + "\n".join(native_table(summaries)) + "\n\n" + "\n".join(native_goals(summaries, peer))
    print(text)
    if write:
        vers = versions()
        goals = goals_section(summaries, peer, rtt, filter_lat)
        if native:
            goals += "\n".join(["### The native host", "",
                                 "The native host's goals, set against the wasm filter's figures of the full run "
                                 "of 2026-12-04, against this run (the wasm filter's figure of this run beside it; "
                                 "see Native host below).", "", *native_goals(summaries, peer), ""])
        sections = [("## Goals", goals),
                    ("## Throughput", throughput_section(summaries, rounds, duration, vers, started, load))]
        if native:
            sections.append(("## Native host", native_section(summaries, native_lines)))
        if peer:
            sections.append(("## Peer: idempotency inside the app", peer_section(summaries, peer)))
        write_results([
            *sections,
            ("## Where the time goes", analysis_section(summaries, stats_lines, mem_rows, profile, profiler_note, rtt,
                                                       filter_lat)),
        ])
        log(f"wrote {RESULTS.relative_to(ROOT)}")
    label = "bench-quick" if args.quick else "bench"
    print(f"{label}: " + ", ".join(one_line(s) for s in summaries)
        + f" [filter/no-filter throughput, {elapsed:.0f} s]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
