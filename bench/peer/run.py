"""Peer comparison for bench/throughput.py: idempotency inside the app, with the same wrk scenarios.

The peer is what a team would otherwise write: an Express 5 app (`bench/peer/app.js`, one Node
process) doing the bench upstream's work (read and parse the whole JSON body, answer 201 with a
small JSON order), with and without the `express-idempotency` middleware on Redis
(`express-idempotency-redis-adapter`). All on loopback:

- Redis (`redis-server` from PATH, `--save '' --appendonly no`, a free port);
- `plain`: app.js with PEER_MIDDLEWARE=0;
- `peer`: app.js with PEER_MIDDLEWARE=1 and REDIS_URL at that Redis.

Each scenario runs wrk with the project's `bench/load.lua`, invoked as bench/throughput.py does,
against `plain` and `peer` alternately (even rounds plain first, odd rounds peer first), and
reports medians of throughput and p50/p99 latency, the added latency, Redis commands per request,
and CPU µs per request of each process (node app and redis from /proc/<pid>/stat utime+stime,
wrk from its rusage). Contract checks (burst executions per key, same key with another body,
replays, concurrent duplicates, caller scoping and what the middleware stores) run on `peer` and
are reported, failures included.

    python3 bench/peer/run.py --quick                       # 1 round x 3 s
    python3 bench/peer/run.py                               # 3 rounds x 10 s
    python3 bench/peer/run.py --rounds 2 --duration 5 --scenarios unique-1k,burst --json /tmp/peer.json
    python3 bench/peer/run.py --write                       # also writes bench/peer/RESULTS.md

Installs its npm packages (`npm ci`) when bench/peer/node_modules is missing. Every process it
starts is stopped by PID at the end, errors included.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

PEER = Path(__file__).resolve().parent
ROOT = PEER.parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from support import harness as h  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from benchlib import (Scenario, cpu_seconds, machine_busy_seconds, medians, run_wrk as wrk_run,  # noqa: E402
                      wait_still, wrk_bin)

RESULTS = PEER / "RESULTS.md"
RUNS = PEER / ".runs"
COMPONENTS = ["app", "redis", "wrk"]
TARGETS = ["plain", "peer"]
OTHER_LOAD = 0.3  # cores busy outside the measured processes before a run is flagged
PACKAGES = ["express", "express-idempotency", "express-idempotency-redis-adapter", "@redis/client"]


SCENARIOS = [
    Scenario("unique-1k", "a new key per request, 1 KiB", "/fast/orders", "unique", 1024),
    Scenario("unique-1k-c1", "the same on one connection (added latency)", "/fast/orders", "unique", 1024,
             threads=1, conns=1),
    Scenario("replay", "8 stored keys over and over, 1 KiB", "/fast/orders", "replay", 1024, n=8),
    Scenario("burst", "20 duplicates per key on 20 connections, 1 KiB", "/fast/orders", "burst", 1024,
             n=20, threads=1, conns=20),
    # Not run by default: POSTs without a key (what the middleware costs requests it does not guard).
    Scenario("passthrough", "POST without a key, 1 KiB", "/fast/orders", "none", 1024),
]
BY_NAME = {s.name: s for s in SCENARIOS}
DEFAULT = ["unique-1k", "unique-1k-c1", "replay", "burst"]


def body_of(size: int) -> str:
    """The body bench/load.lua sends: a JSON object padded to exactly `size` bytes."""
    return ('{"pad":"' + "x" * (size - 10) + '"}') if size >= 10 else "{}"


# --------------------------------------------------------------------------------------------
# small clients
# --------------------------------------------------------------------------------------------


def redis_cmd(port: int, *args: str, timeout: float = 5.0):
    """One command on a fresh connection (RESP2): str for simple/bulk strings, int, None."""
    payload = f"*{len(args)}\r\n".encode() + b"".join(
        f"${len(a.encode())}\r\n".encode() + a.encode() + b"\r\n" for a in args)
    with socket.create_connection((h.LOOPBACK, port), timeout=timeout) as s:
        s.sendall(payload)
        buf = b""

        def need(n: int) -> None:
            nonlocal buf
            while len(buf) < n:
                chunk = s.recv(65536)
                if not chunk:
                    raise ConnectionError("redis closed the connection")
                buf += chunk

        while b"\r\n" not in buf:
            need(len(buf) + 1)
        line, rest = buf.split(b"\r\n", 1)
        kind, val = line[:1], line[1:].decode()
        if kind == b"+":
            return val
        if kind == b"-":
            raise RuntimeError(f"redis: {val}")
        if kind == b":":
            return int(val)
        if kind == b"$":
            n = int(val)
            if n < 0:
                return None
            buf = rest
            need(n + 2)
            return buf[:n].decode("utf-8", "replace")
        raise RuntimeError(f"unexpected redis reply {line!r}")


class RedisCounter:
    """Redis's total_commands_processed, less this script's own INFO calls."""

    def __init__(self, port: int):
        self.port = port
        self.own = 0

    def read(self) -> int:
        info = redis_cmd(self.port, "INFO", "stats")
        self.own += 1
        for line in info.splitlines():
            if line.startswith("total_commands_processed:"):
                return int(line.split(":", 1)[1]) - (self.own - 1)
        raise RuntimeError("no total_commands_processed in INFO stats")


def post(port: int, path: str, body: str, key: str | None = None, extra: list | None = None,
         timeout: float = 30.0) -> h.Response:
    hdrs = [("content-type", "application/json")]
    if key is not None:
        hdrs.append(("idempotency-key", key))
    return h.request(port, "POST", path, body, headers=hdrs + (extra or []), timeout=timeout)


def get_json(port: int, path: str):
    status, data = h.http_get_status(port, path, timeout=30)
    if status != 200:
        raise SystemExit(f"GET {path} on :{port} answered {status}: {data[:200]!r}")
    return json.loads(data)


def executions(port: int, key: str) -> int:
    return get_json(port, "/executions?key=" + urllib_quote(key))["count"]


def executions_prefix(port: int, prefix: str) -> dict:
    return get_json(port, "/executions?prefix=" + urllib_quote(prefix))


def urllib_quote(s: str) -> str:
    import urllib.parse
    return urllib.parse.quote(s, safe="")


def order_id(r: h.Response) -> str | None:
    try:
        return r.json().get("id")
    except (ValueError, AttributeError):
        return None


# --------------------------------------------------------------------------------------------
# the stack
# --------------------------------------------------------------------------------------------


def node_bin() -> str:
    path = os.environ.get("NODE") or shutil.which("node")
    if not path:
        raise SystemExit("node not found (Node.js 20): apt-get install nodejs, or set NODE")
    return path


def ensure_deps(log) -> None:
    if (PEER / "node_modules" / "express-idempotency").is_dir():
        return
    npm = shutil.which("npm")
    if not npm:
        raise SystemExit("npm not found: it installs bench/peer's packages")
    argv = [npm, "ci"] if (PEER / "package-lock.json").exists() else [npm, "install"]
    argv += ["--no-audit", "--no-fund"]
    log("installing packages: " + " ".join(argv[0:1] + argv[1:]) + " (in bench/peer)")
    subprocess.run(argv, cwd=PEER, check=True, stdin=subprocess.DEVNULL)


class Stack:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.procs: list[h.Proc] = []
        self.apps: dict[str, h.Proc] = {}
        self.ports: dict[str, int] = {}

    def start(self) -> None:
        self.redis, self.redis_port = h.start_redis(self.run_dir)
        self.procs.append(self.redis)
        self.redis_count = RedisCounter(self.redis_port)
        for target, mw in (("plain", "0"), ("peer", "1")):
            port = h.free_port()
            env = {"PEER_MIDDLEWARE": mw, "REDIS_URL": f"redis://{h.LOOPBACK}:{self.redis_port}",
                   "HOST": h.LOOPBACK, "PORT": str(port), "NODE_ENV": "production"}
            proc = h.start(f"app-{target}", [node_bin(), str(PEER / "app.js")], self.run_dir, env=env, cwd=PEER)
            self.procs.append(proc)
            self.apps[target] = proc
            self.ports[target] = port
        for target, proc in self.apps.items():
            port = self.ports[target]
            h.await_ready(proc, lambda p=port: h.http_get_status(p, "/healthz")[0] == 200, f"app {target} /healthz")
        # One request through each, checked; a keyed retry on `peer` must replay.
        for target, port in self.ports.items():
            r = post(port, "/fast/orders", "{}")
            if r.status != 201 or not (r.header("content-type") or "").startswith("application/json"):
                raise SystemExit(f"{target}: unexpected answer {r}")
        key = f"check-{secrets.token_hex(8)}"
        r1 = post(self.ports["peer"], "/fast/orders", "{}", key)
        r2 = post(self.ports["peer"], "/fast/orders", "{}", key)
        if r1.status != 201 or r2.status != 201 or order_id(r1) != order_id(r2):
            raise SystemExit(f"the middleware did not replay: {r1} then {r2}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            try:
                p.stop()
            except Exception as e:  # noqa: BLE001 - stop the others anyway
                print(f"stopping {p.name} (pid {p.pid}): {e}", file=sys.stderr)

    def pids(self, target: str) -> dict[str, int]:
        return {"app": self.apps[target].pid, "redis": self.redis.pid}

    def settle(self, timeout: float = 3.0) -> None:
        """Until Redis's command count stops moving (the middleware stores answers after sending)."""
        wait_still(self.redis_count.read, timeout)


def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


# --------------------------------------------------------------------------------------------
# one wrk run
# --------------------------------------------------------------------------------------------


@dataclass
class Run:
    target: str
    seed: str
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    requests: int
    errors: int
    non2xx: int
    cpu: dict[str, float]
    seconds: float
    machine_busy: float
    redis_cmds: int
    keys: dict = field(default_factory=dict)  # executions per key (/executions?prefix=)


def run_wrk(stack: Stack, target: str, sc: Scenario, duration: float, seed: str, log: Path,
            check_keys: bool = True) -> Run:
    pids = stack.pids(target)
    cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
    cmds0 = stack.redis_count.read()
    busy0 = machine_busy_seconds()
    figures, wrk_cpu = wrk_run(f"http://{h.LOOPBACK}:{stack.ports[target]}{sc.path}", sc, duration, seed, log)
    busy = machine_busy_seconds() - busy0
    stack.settle()
    cpu = {k: cpu_seconds(pid) - cpu0[k] for k, pid in pids.items()}
    cpu["wrk"] = wrk_cpu
    run = Run(
        target=target, seed=seed,
        **figures,
        cpu=cpu,
        machine_busy=busy,
        redis_cmds=stack.redis_count.read() - cmds0,
    )
    if check_keys and sc.mode in ("unique", "burst"):
        run.keys = executions_prefix(stack.ports[target], f"{seed}-")
    return run


# --------------------------------------------------------------------------------------------
# scenarios
# --------------------------------------------------------------------------------------------


def prewarm_replay(stack: Stack, sc: Scenario, seed: str) -> list[str]:
    """Stores the scenario's keys through `peer` (the body wrk sends), so every wrk request on
    `peer` is a replay; checks that Redis holds each with its answer."""
    keys = [f"{seed}-{i}" for i in range(sc.n)]
    for key in keys:
        r = post(stack.ports["peer"], sc.path, body_of(sc.size), key)
        if r.status != 201:
            raise SystemExit(f"pre-warm {sc.name}: {r}")
    for key in keys:
        def stored(k=key):
            raw = redis_cmd(stack.redis_port, "GET", k)
            return raw is not None and json.loads(raw).get("response") is not None
        h.wait_for(stored, f"pre-warm {sc.name}: key {key} stored with its answer", timeout=5)
    return keys


def run_scenario(stack: Stack, sc: Scenario, rounds: int, duration: float, warmup: float, run_dir: Path,
                 log) -> tuple[dict[str, list[Run]], dict]:
    runs: dict[str, list[Run]] = {t: [] for t in TARGETS}
    wrk_log = run_dir / f"wrk-{sc.name}.log"
    seed = f"{sc.name}-{secrets.token_hex(6)}"
    extra: dict = {}
    replay_keys: list[str] = []
    if sc.mode == "replay":
        replay_keys = prewarm_replay(stack, sc, seed)
    if warmup > 0:
        for target in TARGETS:
            run_wrk(stack, target, sc, warmup, f"w{target}-{seed}" if sc.mode != "replay" else seed, wrk_log,
                    check_keys=False)
    for r in range(rounds):
        order = TARGETS if r % 2 == 0 else TARGETS[::-1]
        for target in order:
            run_seed = seed if sc.mode == "replay" else f"{seed}-{target}{r}"
            run = run_wrk(stack, target, sc, duration, run_seed, wrk_log)
            runs[target].append(run)
            multi = f"  keys run >1x {run.keys['multi']}/{run.keys['keys']}" if run.keys else ""
            log(f"  {sc.name:<12} round {r + 1}/{rounds} {target:<5} {run.rps:9.0f} req/s  "
                f"p50 {run.p50_ms:6.2f} ms  p99 {run.p99_ms:7.2f} ms  non-2xx {run.non2xx}  "
                f"errors {run.errors}  redis cmds/rq {run.redis_cmds / max(1, run.requests):.2f}{multi}")
    if replay_keys:
        counts = {k: executions(stack.ports["peer"], k) for k in replay_keys}
        extra["replay_key_executions_on_peer"] = counts
    return runs, extra


@dataclass
class Summary:
    sc: Scenario
    plain: dict
    peer: dict
    ratio: float
    cpu_us: dict[str, dict[str, float]]
    cores: dict[str, float]
    redis_per_rq: dict[str, float]
    keys: dict[str, dict]
    extra: dict
    runs: dict[str, list[dict]]

    @property
    def added_cpu(self) -> dict[str, float]:
        return {c: self.cpu_us["peer"][c] - self.cpu_us["plain"][c] for c in [*COMPONENTS, "total"]}

    def problems(self) -> list[str]:
        out = []
        for t, m in (("plain", self.plain), ("peer", self.peer)):
            if m["non2xx"] or m["errors"]:
                out.append(f"{t}: {m['non2xx']} non-2xx, {m['errors']} socket errors")
        for t in TARGETS:
            # CPU the machine spent outside wrk, the app and Redis (this script's own polling is small).
            other = self.cores[t + "-machine"] - self.cores[t]
            if other > OTHER_LOAD:
                out.append(f"other load during {t}: {other:.2f} cores")
        return out


def summarize(sc: Scenario, runs: dict[str, list[Run]], extra: dict) -> Summary:
    cpu_us, cores, redis_per_rq, keys = {}, {}, {}, {}
    for t, rs in runs.items():
        n = max(1, sum(r.requests for r in rs))
        secs = max(1e-9, sum(r.seconds for r in rs))
        cpu_us[t] = {c: sum(r.cpu.get(c, 0.0) for r in rs) / n * 1e6 for c in COMPONENTS}
        cpu_us[t]["total"] = sum(cpu_us[t][c] for c in COMPONENTS)
        cores[t] = sum(sum(r.cpu.values()) for r in rs) / secs
        cores[t + "-machine"] = sum(r.machine_busy for r in rs) / secs
        redis_per_rq[t] = sum(r.redis_cmds for r in rs) / n
        if any(r.keys for r in rs):
            keys[t] = {
                "keys": sum(r.keys.get("keys", 0) for r in rs),
                "executions": sum(r.keys.get("executions", 0) for r in rs),
                "multi": sum(r.keys.get("multi", 0) for r in rs),
                "max": max((r.keys.get("max", 0) for r in rs), default=0),
                "sample": [s for r in rs for s in r.keys.get("sample", [])][:5],
            }
    plain, peer = medians(runs["plain"]), medians(runs["peer"])
    return Summary(sc, plain, peer, peer["rps"] / plain["rps"] if plain["rps"] else 0.0, cpu_us, cores,
                   redis_per_rq, keys, extra, {t: [asdict(r) for r in rs] for t, rs in runs.items()})


# --------------------------------------------------------------------------------------------
# contract checks (on `peer`)
# --------------------------------------------------------------------------------------------


def replay_marker(first: h.Response, replay: h.Response) -> dict:
    """Headers the replay carries that the first answer did not, or with another value (Date
    aside), and any header that looks like a replay marker."""
    a = {k: v for k, v in first.headers if k != "date"}
    b = {k: v for k, v in replay.headers if k != "date"}
    differ = {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
    markers = {k: v for k, v in replay.headers if "replay" in k or k in ("x-hit", "x-cache")}
    return {"differing_headers": differ, "replay_headers": markers}


def concurrent_duplicates(port: int, key: str, body: str, n: int) -> list[tuple[int, str | None]]:
    """`n` requests with one key, each on its own connection, connected first and sent together."""
    barrier = threading.Barrier(n)
    out: list = [None] * n

    def one(i: int) -> None:
        conn = http.client.HTTPConnection(h.LOOPBACK, port, timeout=30)
        try:
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            barrier.wait(10)
            conn.request("POST", "/fast/orders", body=body.encode(),
                         headers={"content-type": "application/json", "idempotency-key": key})
            resp = conn.getresponse()
            data = resp.read()
            try:
                oid = json.loads(data).get("id")
            except ValueError:
                oid = None
            out[i] = (resp.status, oid)
        except Exception as e:  # noqa: BLE001 - reported
            out[i] = (0, f"error: {e!r}")
        finally:
            conn.close()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def contract_checks(stack: Stack, log) -> dict:
    port = stack.ports["peer"]
    body_a, body_b = body_of(1024), '{"pad":"' + "y" * 1014 + '"}'
    res: dict = {}
    tag = secrets.token_hex(4)

    # (b) the same key with another body (and another path).
    k = f"contract-{tag}-body"
    r1 = post(port, "/fast/orders", body_a, k)
    r2 = post(port, "/fast/orders", body_b, k)
    r3 = post(port, "/fast/other", body_a, k)
    res["other_body"] = {
        "first_status": r1.status, "status": r2.status, "content_type": r2.header("content-type"),
        "body": r2.body.decode("utf-8", "replace")[:200],
        "replayed_first_answer": r2.body == r1.body,
        "executions": executions(port, k),
        "other_path_status": r3.status, "other_path_body": r3.body.decode("utf-8", "replace")[:200],
        "other_path_replayed_first_answer": r3.body == r1.body,
    }

    # (c) a replay: the same answer (the same id), and what marks it.
    k = f"contract-{tag}-replay"
    r1 = post(port, "/fast/orders", body_a, k)
    r2 = post(port, "/fast/orders", body_a, k)
    res["replay"] = {
        "first": [r1.status, order_id(r1)], "replay": [r2.status, order_id(r2)],
        "same_body": r1.body == r2.body, "executions": executions(port, k),
        **replay_marker(r1, r2),
    }
    # Immediate retries, one after the other: the middleware stores the answer after sending it.
    n_seq = 50
    seq = Counter()
    for i in range(n_seq):
        k = f"contract-{tag}-seq-{i}"
        a = post(port, "/fast/orders", body_a, k)
        b = post(port, "/fast/orders", body_a, k)
        if b.status == a.status == 201 and order_id(a) == order_id(b):
            seq["replayed"] += 1
        else:
            seq[f"{b.status} ({'same id' if order_id(a) == order_id(b) else 'new id' if order_id(b) else 'no id'})"] += 1
    seq_multi = sum(1 for i in range(n_seq) if executions(port, f"contract-{tag}-seq-{i}") > 1)
    res["immediate_retry"] = {"pairs": n_seq, "outcomes": dict(seq), "keys_executed_twice": seq_multi}

    # (d) 20 duplicates at once, one key each trial.
    trials = []
    for t in range(5):
        k = f"contract-{tag}-conc-{t}"
        out = concurrent_duplicates(port, k, body_a, 20)
        ids = {oid for st, oid in out if st == 201 and oid}
        trials.append({"executions": executions(port, k), "statuses": dict(Counter(st for st, _ in out)),
                       "distinct_ids_in_201s": len(ids)})
    res["concurrent"] = {"n": 20, "trials": trials}

    # (e) scoping: another caller (Authorization) with the same key and body; what is stored.
    k = f"contract-{tag}-scope"
    ra = post(port, "/fast/orders", body_a, k, [("authorization", "Bearer alice-token")])
    rb = post(port, "/fast/orders", body_a, k, [("authorization", "Bearer bob-token")])
    raw = redis_cmd(stack.redis_port, "GET", k) or ""
    res["scope"] = {
        "alice": [ra.status, order_id(ra)], "bob": [rb.status, order_id(rb)],
        "bob_got_alices_answer": rb.status == 201 and order_id(ra) == order_id(rb),
        "redis_key_is_raw_client_key": raw != "",
        "stored_authorization_header": "alice-token" in raw,
        "stored_request_body": body_a[:40] in raw,
        "record_bytes": len(raw.encode()),
    }
    log("contract checks done")
    return res


def burst_finding(summaries: list[Summary]) -> dict | None:
    s = next((x for x in summaries if x.sc.mode == "burst"), None)
    if not s or "peer" not in s.keys:
        return None
    k = s.keys["peer"]
    return {"keys": k["keys"], "executions": k["executions"], "multi": k["multi"], "max": k["max"],
            "requests": s.peer["requests"], "non2xx": s.peer["non2xx"], "sample": k["sample"],
            "plain_executions_per_key": (s.keys.get("plain", {}).get("executions", 0)
                                         / max(1, s.keys.get("plain", {}).get("keys", 0)))}


def contract_lines(c: dict, burst: dict | None) -> list[str]:
    lines = ["## Contract checks (on the peer)", ""]
    if burst:
        pct = 100 * burst["multi"] / max(1, burst["keys"])
        lines += [f"- **(a) burst** (wrk, 20 duplicates per key on 20 connections): of {burst['keys']} keys, "
                  f"**{burst['multi']} ({pct:.0f}%) ran more than once** (at most {burst['max']} times; "
                  f"{burst['executions']} executions for {burst['keys']} keys, "
                  f"{burst['executions'] / max(1, burst['keys']):.2f} per key); {burst['non2xx']} of "
                  f"{burst['requests']} answers non-2xx. "
                  + ("Contract violated: duplicates executed." if burst["multi"] else "One execution per key.")]
    else:
        lines += ["- **(a) burst**: the burst scenario was not run."]
    o = c["other_body"]
    lines += [f"- **(b) same key, another body**: `{o['status']}` (`{o['content_type']}`) `{o['body']}`; "
              f"executions of the key {o['executions']}; "
              + ("**the first answer was replayed to a different body: contract violation**"
                 if o["replayed_first_answer"] else "not replayed, not executed")
              + f". The contract (the filter) says `422`; the middleware's code is `{o['status']}`. "
              f"Same key, same body, another path: `{o['other_path_status']}`"
              + (" (the first answer replayed: violation)" if o["other_path_replayed_first_answer"] else "") + "."]
    r = c["replay"]
    marker = ", ".join(f"`{k}: {v}`" for k, v in r["replay_headers"].items()) or "none"
    differ = ", ".join(f"`{k}` {v[0]!r} -> {v[1]!r}" for k, v in r["differing_headers"].items()) or "none"
    lines += [f"- **(c) replay**: first `{r['first'][0]}` id `{r['first'][1]}`, retry `{r['replay'][0]}` id "
              f"`{r['replay'][1]}`, same body: {r['same_body']}; executions {r['executions']}. Replay marker "
              f"header: {marker}; headers that differ from the first answer (Date aside): {differ}. "
              f"(The filter adds `x-idempotent-replay: true`.)"]
    ir = c["immediate_retry"]
    lines += [f"  Immediate retry right after the first answer, {ir['pairs']} keys one after the other: "
              + ", ".join(f"{k} {v}" for k, v in ir["outcomes"].items())
              + f"; keys executed twice: {ir['keys_executed_twice']}."]
    cc = c["concurrent"]
    per = "; ".join(f"{t['executions']} executions, statuses "
                    + ", ".join(f"{k}x{v}" for k, v in sorted(t["statuses"].items()))
                    + f" ({t['distinct_ids_in_201s']} distinct ids among the 201s)"
                    for t in cc["trials"])
    worst = max(t["executions"] for t in cc["trials"])
    lines += [f"- **(d) {cc['n']} concurrent duplicates** (one key, {cc['n']} connections, sent together), "
              f"{len(cc['trials'])} trials: {per}. "
              + (f"**Up to {worst} executions of one key: contract violated.**" if worst > 1
                 else "One execution per key.")]
    s = c["scope"]
    lines += [f"- **(e) caller scope and storage**: the same key and body from another caller (another "
              f"`Authorization`): `{s['bob'][0]}` id `{s['bob'][1]}` (first caller's id `{s['alice'][1]}`)"
              + (": **the other caller got the first caller's answer**" if s["bob_got_alices_answer"] else "")
              + f". The Redis key is the client's raw key ({'yes' if s['redis_key_is_raw_client_key'] else 'no'}); "
              f"the record stores the request headers including `Authorization` "
              f"({'yes' if s['stored_authorization_header'] else 'no'}) and the request body "
              f"({'yes' if s['stored_request_body'] else 'no'}), {s['record_bytes']} bytes for a 1 KiB request."]
    return lines + [""]


# --------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------


def table(summaries: list[Summary], rounds: int, duration: float) -> list[str]:
    lines = [
        f"Medians of {rounds} round(s) of {duration:g} s per app; ratio = peer / plain, same run.",
        "",
        "| scenario | what | plain req/s | peer req/s | ratio | p50 plain / peer (ms) | p99 plain / peer (ms) "
        "| added p50 / p99 (ms) | Redis commands per request | keys run more than once (peer) | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        k = s.keys.get("peer")
        multi = f"{k['multi']} of {k['keys']}" if k else "-"
        if s.extra.get("replay_key_executions_on_peer"):
            counts = s.extra["replay_key_executions_on_peer"].values()
            multi = f"{sum(1 for c in counts if c > 1)} of {len(counts)}"
        lines.append(
            f"| {s.sc.name} | {s.sc.what} (`-t{s.sc.threads} -c{s.sc.conns}`) | {s.plain['rps']:.0f} | "
            f"{s.peer['rps']:.0f} | **{s.ratio:.2f}x** | {s.plain['p50']:.2f} / {s.peer['p50']:.2f} | "
            f"{s.plain['p99']:.2f} / {s.peer['p99']:.2f} | {s.peer['p50'] - s.plain['p50']:+.2f} / "
            f"{s.peer['p99'] - s.plain['p99']:+.2f} | {s.redis_per_rq['peer']:.2f} | {multi} | "
            f"{'; '.join(s.problems())} |")
    return lines


def cpu_table(summaries: list[Summary]) -> list[str]:
    lines = [
        "| scenario | CPU µs per request, plain: " + " / ".join(COMPONENTS) + " = total "
        "| peer: " + " / ".join(COMPONENTS) + " = total | added by the middleware "
        "| cores busy (of 2), these processes / whole machine: plain; peer |",
        "|---|---|---|---|---|",
    ]
    for s in summaries:
        p, i, a = s.cpu_us["plain"], s.cpu_us["peer"], s.added_cpu
        lines.append(
            f"| {s.sc.name} | " + " / ".join(f"{p[c]:.0f}" for c in COMPONENTS) + f" = {p['total']:.0f} | "
            + " / ".join(f"{i[c]:.0f}" for c in COMPONENTS) + f" = {i['total']:.0f} | "
            + ", ".join(f"{c} {a[c]:+.0f}" for c in COMPONENTS) + f", **total {a['total']:+.0f}**"
            + f" | {s.cores['plain']:.2f} / {s.cores['plain-machine']:.2f}; "
              f"{s.cores['peer']:.2f} / {s.cores['peer-machine']:.2f} |")
    return lines


def versions() -> dict:
    out = {"node": subprocess.run([node_bin(), "--version"], capture_output=True, text=True).stdout.strip()}
    for pkg in PACKAGES:
        try:
            out[pkg] = json.loads((PEER / "node_modules" / pkg / "package.json").read_text())["version"]
        except (OSError, ValueError, KeyError):
            out[pkg] = "?"
    try:
        out["redis"] = subprocess.run([h.redis_bin(), "--version"], capture_output=True, text=True).stdout.split()[2]
    except Exception:  # noqa: BLE001
        out["redis"] = "?"
    wrk = subprocess.run([wrk_bin(), "-v"], capture_output=True, text=True)
    out["wrk"] = ((wrk.stdout or wrk.stderr).splitlines() or ["?"])[0].split(" Copyright")[0].strip()
    out["cpu"] = platform.processor() or platform.machine()
    out["cores"] = os.cpu_count()
    return out


def results_md(text: str, contract: list[str], vers: dict, started: str, load: str, rounds: int,
               duration: float) -> str:
    return "\n".join([
        "# Peer comparison: idempotency in the app (Express + express-idempotency on Redis)",
        "",
        f"Written by `python3 bench/peer/run.py --write` ({rounds} round(s) x {duration:g} s), {started} UTC, "
        f"load average before {load}.",
        f"Node {vers['node']} (one process), express {vers['express']}, express-idempotency "
        f"{vers['express-idempotency']}, express-idempotency-redis-adapter "
        f"{vers['express-idempotency-redis-adapter']} (@redis/client {vers['@redis/client']}), "
        f"Redis {vers['redis']}, {vers['wrk']}; {vers['cores']} cores shared by wrk, the app and Redis.",
        "`plain` is the same app without the middleware. wrk runs `bench/load.lua` as bench/throughput.py does.",
        "",
        "## Throughput and CPU",
        "",
        text,
        "",
        *contract,
    ]) + "\n"


# --------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one round of 3 s")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--duration", type=float, help="seconds per wrk run")
    ap.add_argument("--warmup", type=float, help="seconds of unmeasured load per app per scenario "
                                                 "(default 0 with --quick, else 2)")
    ap.add_argument("--scenarios", help="comma-separated: " + ",".join(BY_NAME) + f" (default {','.join(DEFAULT)})")
    ap.add_argument("--json", metavar="PATH", help="write every figure as JSON to PATH")
    ap.add_argument("--write", action="store_true", help="write bench/peer/RESULTS.md")
    ap.add_argument("--no-contract", action="store_true", help="skip the contract checks")
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    duration = args.duration or (3.0 if args.quick else 10.0)
    warmup = args.warmup if args.warmup is not None else (0.0 if args.quick else 2.0)
    names = args.scenarios.split(",") if args.scenarios else list(DEFAULT)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}; known: {', '.join(BY_NAME)}")
    wrk_bin()
    node_bin()

    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    run_dir = RUNS / (time.strftime("%Y%m%d-%H%M%S") + ("-quick" if args.quick else "-peer"))
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True)

    ensure_deps(log)
    busy0 = machine_busy_seconds()
    time.sleep(1.0)
    idle_busy = machine_busy_seconds() - busy0
    log(f"run dir {run_dir}; load average {load}; {idle_busy:.2f} cores busy before the start")
    if idle_busy > OTHER_LOAD:
        log(f"warning: the machine is not quiet ({idle_busy:.2f} cores busy): figures will be noisy")
    load = f"{load} ({idle_busy:.2f} cores busy in the second before the start)"
    stack = Stack(run_dir)
    summaries: list[Summary] = []
    contract: dict = {}
    rss: dict = {}
    try:
        stack.start()
        log(f"up: redis :{stack.redis_port}, plain :{stack.ports['plain']} (pid {stack.apps['plain'].pid}), "
            f"peer :{stack.ports['peer']} (pid {stack.apps['peer'].pid})")
        if not args.no_contract:
            contract = contract_checks(stack, log)
        # One short unmeasured run on each app: V8 compiles the hot paths.
        for target in TARGETS:
            run_wrk(stack, target, BY_NAME["unique-1k"], 1, f"warm-{target}-{secrets.token_hex(6)}",
                    run_dir / "wrk-warm.log", check_keys=False)
        for name in names:
            runs, extra = run_scenario(stack, BY_NAME[name], rounds, duration, warmup, run_dir, log)
            summaries.append(summarize(BY_NAME[name], runs, extra))
        rss = {t: rss_mib(p.pid) for t, p in stack.apps.items()}
        rss["redis"] = rss_mib(stack.redis.pid)
    finally:
        stack.stop()

    elapsed = time.monotonic() - t0
    text = "\n".join(table(summaries, rounds, duration)) + "\n\n" + "\n".join(cpu_table(summaries))
    burst = burst_finding(summaries)
    clines = contract_lines(contract, burst) if contract else []
    print(text)
    print()
    print("\n".join(clines))
    vers = versions()
    if args.json:
        doc = {
            "started": started, "load_before": load, "rounds": rounds, "duration_s": duration, "warmup_s": warmup,
            "elapsed_s": elapsed, "versions": vers, "rss_mib_end": rss,
            "peer": "express-idempotency + express-idempotency-redis-adapter in an Express app, one Node process",
            "scenarios": [{
                **asdict(s.sc), "plain": s.plain, "peer": s.peer, "ratio": s.ratio,
                "added_p50_ms": s.peer["p50"] - s.plain["p50"], "added_p99_ms": s.peer["p99"] - s.plain["p99"],
                "cpu_us": s.cpu_us, "added_cpu_us": s.added_cpu, "cores": s.cores,
                "redis_cmds_per_request": s.redis_per_rq, "key_executions": s.keys, "extra": s.extra,
                "problems": s.problems(), "runs": s.runs,
            } for s in summaries],
            "contract": {**contract, "burst": burst},
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        log(f"wrote {args.json}")
    if args.write:
        RESULTS.write_text(results_md(text, clines, vers, started, load, rounds, duration))
        log(f"wrote {RESULTS.relative_to(ROOT)}")
    print("peer: " + ", ".join(f"{s.sc.name} {s.ratio:.2f}x" for s in summaries)
          + f" [peer/plain throughput, {elapsed:.0f} s]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
