"""Burst client and the per-key exactly-once check (stdlib only: asyncio, raw HTTP/1.1).

A burst is many keys at once. For each key every duplicate (same `Idempotency-Key`, same body)
is fired at the same moment, on its own connection, spread round-robin over the replicas'
ports; a bounded number of keys is in flight at any time (a sliding window). The counting
upstream is told per key how long to sleep (`x-test-sleep-ms`, drawn from `sleep_ms`).

    run = burst.run_burst(rs.ports(), burst.BurstSpec(keys=200, duplicates=20))
    check = burst.check_burst(run, upstream.executions(key_prefix=run.prefix))
    assert not check.failures, check.report()

Every request and the whole burst are bounded in time; a request that does not complete is
recorded with its error (never retried), a burst past its deadline raises `BurstError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

LOOPBACK = "127.0.0.1"
REPLAY = "x-idempotent-replay"
KEPT = ("content-type", "location")


class BurstError(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------
# raw HTTP/1.1 over asyncio streams
# --------------------------------------------------------------------------------------------


@dataclass
class Reply:
    key: str
    seq: int            # which duplicate of the key
    replica: int        # index into the ports list
    start: float = 0.0  # time.monotonic() before connecting
    sent: float = 0.0   # the whole request written
    done: float = 0.0   # the whole response read (or the error)
    status: int = 0
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    error: str | None = None

    def header(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k == name:
                return v
        return None

    @property
    def latency(self) -> float:
        return self.done - self.start

    def __repr__(self) -> str:
        body = self.body[:200]
        return (f"Reply(key={self.key!r}, seq={self.seq}, replica={self.replica}, status={self.status}, "
                f"error={self.error!r}, latency={self.latency * 1000:.0f}ms, headers={self.headers!r}, body={body!r})")


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    out = []
    while True:
        line = await reader.readline()
        if not line:
            raise ConnectionError("connection closed in a chunked body")
        size = int(line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass
            return b"".join(out)
        out.append(await reader.readexactly(size))
        await reader.readline()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, list[tuple[str, str]], bytes]:
    line = await reader.readline()
    if not line:
        raise ConnectionError("connection closed before the status line")
    parts = line.decode("latin-1").split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
        raise ValueError(f"bad status line {line!r}")
    status = int(parts[1])
    headers: list[tuple[str, str]] = []
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n"):
            break
        if not line:
            raise ConnectionError("connection closed in the response headers")
        name, _, value = line.decode("latin-1").partition(":")
        headers.append((name.strip().lower(), value.strip()))
    if 100 <= status < 200:
        # Never asked for (no Expect), but skip it rather than misread it.
        return await _read_response(reader)
    fields = dict(headers)
    if status in (204, 304):
        body = b""
    elif "chunked" in fields.get("transfer-encoding", "").lower():
        body = await _read_chunked(reader)
    elif "content-length" in fields:
        body = await reader.readexactly(int(fields["content-length"]))
    else:
        body = await reader.read()  # until the server closes (we sent `connection: close`)
    return status, headers, body


async def exchange(reply: Reply, port: int, method: str, path: str, headers: list[tuple[str, str]],
                   body: bytes, timeout: float, host: str = LOOPBACK) -> Reply:
    """One request on a fresh connection (`connection: close`), filled into `reply`."""
    writer = None

    async def go():
        nonlocal writer
        reader, writer = await asyncio.open_connection(host, port)
        head = [f"{method} {path} HTTP/1.1", f"host: {host}:{port}"]
        head += [f"{k}: {v}" for k, v in headers]
        head += [f"content-length: {len(body)}", "connection: close", "", ""]
        writer.write("\r\n".join(head).encode("latin-1") + body)
        await writer.drain()
        reply.sent = time.monotonic()
        reply.status, reply.headers, reply.body = await _read_response(reader)

    reply.start = time.monotonic()
    try:
        await asyncio.wait_for(go(), timeout)
    except asyncio.TimeoutError:
        reply.error = f"no complete response within {timeout}s"
    except (OSError, ValueError, asyncio.IncompleteReadError) as e:
        reply.error = repr(e)
    finally:
        reply.done = time.monotonic()
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 2.0)
    return reply


# --------------------------------------------------------------------------------------------
# the burst
# --------------------------------------------------------------------------------------------


@dataclass
class BurstSpec:
    keys: int = 200
    duplicates: int = 20
    sleep_ms: tuple[int, int] = (50, 300)   # per key, uniform, inclusive
    keys_in_flight: int = 40                # keys whose duplicates are out at once
    path: str = "/orders"
    request_timeout: float = 30.0           # per request
    deadline: float = 300.0                 # the whole burst
    seed: int | None = None
    headers: tuple[tuple[str, str], ...] = ()  # added to every request


@dataclass
class KeyPlan:
    key: str
    body: bytes
    sleep_ms: int
    first_replica: int


@dataclass
class BurstRun:
    spec: BurstSpec
    prefix: str
    ports: list[int]
    plans: list[KeyPlan]
    replies: dict[str, list[Reply]]
    t0: float
    elapsed: float

    def all_replies(self) -> list[Reply]:
        return [r for plan in self.plans for r in self.replies.get(plan.key, [])]

    def dump(self, path: Path) -> None:
        """One line per request (times in ms from the start of the burst), for post-mortems."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            f.write("key\tseq\treplica\tstart_ms\tsent_ms\tdone_ms\tstatus\treplay\tupstream_id\terror\n")
            for plan in self.plans:
                for r in self.replies.get(plan.key, []):
                    ms = lambda t: f"{(t - self.t0) * 1000:.1f}"  # noqa: E731
                    f.write(f"{r.key}\t{r.seq}\t{r.replica}\t{ms(r.start)}\t{ms(r.sent)}\t{ms(r.done)}\t{r.status}\t"
                            f"{r.header(REPLAY) or ''}\t{r.header('x-upstream-id') or ''}\t{r.error or ''}\n")


def plan_keys(spec: BurstSpec, prefix: str, replicas: int) -> list[KeyPlan]:
    rng = random.Random(spec.seed)
    lo, hi = spec.sleep_ms
    plans = []
    for i in range(spec.keys):
        key = f"{prefix}-{i:05d}"
        body = json.dumps({"order": key, "item": f"thing-{i}", "qty": 1 + i % 7}, separators=(",", ":")).encode()
        plans.append(KeyPlan(key, body, rng.randint(lo, hi), i % max(1, replicas)))
    return plans


async def _burst(ports: list[int], spec: BurstSpec, plans: list[KeyPlan], host: str) -> tuple[dict, float, float]:
    replies: dict[str, list[Reply]] = {}
    window = asyncio.Semaphore(spec.keys_in_flight)
    n = len(ports)

    async def one_key(plan: KeyPlan) -> None:
        async with window:
            rs = [Reply(plan.key, i, (plan.first_replica + i) % n) for i in range(spec.duplicates)]
            headers = [("idempotency-key", plan.key), ("content-type", "application/json"),
                       ("x-test-sleep-ms", str(plan.sleep_ms)), *spec.headers]
            await asyncio.gather(*(exchange(r, ports[r.replica], "POST", spec.path, headers, plan.body,
                                            spec.request_timeout, host) for r in rs))
            replies[plan.key] = rs

    t0 = time.monotonic()
    tasks = [asyncio.create_task(one_key(p)) for p in plans]
    _, pending = await asyncio.wait(tasks, timeout=spec.deadline)
    if pending:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        raise BurstError(f"burst past its {spec.deadline}s deadline: {len(pending)} of {len(plans)} keys unfinished")
    for t in tasks:
        if t.exception() is not None:
            raise BurstError(f"burst task failed: {t.exception()!r}")
    return replies, t0, time.monotonic() - t0


def run_burst(ports: list[int], spec: BurstSpec | None = None, prefix: str | None = None,
              host: str = LOOPBACK) -> BurstRun:
    """Fires the burst and returns every reply; keys are `<prefix>-00000`, ... (fresh prefix
    by default, so the upstream's executions of this burst are `key_prefix=run.prefix`)."""
    spec = spec or BurstSpec()
    prefix = prefix or f"b{uuid.uuid4().hex[:12]}"
    plans = plan_keys(spec, prefix, len(ports))
    replies, t0, elapsed = asyncio.run(_burst(list(ports), spec, plans, host))
    return BurstRun(spec, prefix, list(ports), plans, replies, t0, elapsed)


# --------------------------------------------------------------------------------------------
# the check
# --------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); nan for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


@dataclass
class BurstCheck:
    keys: int = 0
    responses: int = 0
    executions: int = 0
    originals: int = 0
    replays: int = 0
    conflicts: int = 0
    server_errors: int = 0
    client_errors: int = 0
    other: int = 0
    failures: list[str] = field(default_factory=list)
    # For each replay whose request was out before the original's response arrived (it waited
    # on the lock): replay arrival minus original arrival, in ms.
    replay_delays_ms: list[float] = field(default_factory=list)
    late_replays: int = 0       # replays requested after the original's response
    elapsed: float = 0.0
    original_latency_ms: list[float] = field(default_factory=list)

    def report(self, limit: int = 20) -> str:
        lines = [self.summary()]
        lines += self.failures[:limit]
        if len(self.failures) > limit:
            lines.append(f"... and {len(self.failures) - limit} more failures")
        return "\n".join(lines)

    def summary(self) -> str:
        d = self.replay_delays_ms
        delay = (f"commit-to-replay p50 {percentile(d, 50):.1f} ms p99 {percentile(d, 99):.1f} ms (n={len(d)})"
                 if d else "no waiting replays")
        return (f"{self.keys} keys, {self.responses} responses in {self.elapsed:.1f}s: {self.executions} executions, "
                f"{self.originals} originals, {self.replays} replays ({self.late_replays} late), "
                f"{self.conflicts} 409, {self.server_errors} 5xx, {self.client_errors} transport errors, "
                f"{self.other} other; {delay}; {len(self.failures)} failures")


def _problem(r: Reply, status: int) -> str | None:
    """Why `r` is not the filter's RFC 9457 problem with `status` (None if it is)."""
    if r.status != status:
        return f"status {r.status}"
    if (r.header("content-type") or "").split(";")[0].strip() != "application/problem+json":
        return f"content-type {r.header('content-type')!r}"
    if r.header(REPLAY) is not None:
        return "a problem carries the replay header"
    try:
        doc = json.loads(r.body)
    except ValueError:
        return "body is not JSON"
    fields_ok = isinstance(doc, dict) and all(doc.get(f) for f in ("type", "title", "detail"))
    if not fields_ok or doc.get("status") != status:
        return f"not a problem document: {r.body[:200]!r}"
    if r.key.encode() in r.body:
        return "the problem echoes the raw key"
    return None


def not_original(r: Reply, plan: KeyPlan, exec_ids: set[str]) -> str | None:
    if r.status != 201:
        return f"status {r.status}"
    uid = r.header("x-upstream-id")
    if uid not in exec_ids:
        return f"x-upstream-id {uid!r} is not this key's execution {sorted(exec_ids)}"
    try:
        doc = json.loads(r.body)
    except ValueError:
        return "body is not JSON"
    if doc.get("key") != plan.key or doc.get("body") != plan.body.decode() or doc.get("id") != uid:
        return f"body is not this key's execution: {r.body[:200]!r}"
    if r.header("location") != f"/things/{uid}":
        return f"location {r.header('location')!r}"
    return None


def not_replay_of(r: Reply, original: Reply, kept=KEPT) -> str | None:
    if r.header(REPLAY) != "true":
        return f"{REPLAY} is {r.header(REPLAY)!r}"
    if r.status != original.status:
        return f"status {r.status} != original {original.status}"
    if r.body != original.body:
        return f"body {r.body[:120]!r} != original {original.body[:120]!r}"
    for name in kept:
        if r.header(name) != original.header(name):
            return f"{name} {r.header(name)!r} != original {original.header(name)!r}"
    if r.header("x-upstream-id") is not None:
        return "a replay carries x-upstream-id (not in the record)"
    return None


def check_burst(run: BurstRun, executions: list[dict], allow_conflict: bool = False) -> BurstCheck:
    """Per key: exactly one upstream execution; exactly one original (2xx without the replay
    header, the upstream's answer for this key); every other response a byte-identical replay of
    that original (status, body, content-type, location, `x-idempotent-replay: true`) or, with
    `allow_conflict`, a `409` problem. Transport errors and 5xx are failures."""
    c = BurstCheck(keys=len(run.plans), elapsed=run.elapsed)
    by_key: dict[str, list[dict]] = defaultdict(list)
    for ex in executions:
        by_key[ex["key"]].append(ex)
    planned = {p.key for p in run.plans}
    for key in sorted(set(by_key) - planned):
        c.failures.append(f"{key}: executed but not part of this burst")
    c.executions = sum(len(v) for v in by_key.values())

    for plan in run.plans:
        replies = run.replies.get(plan.key, [])
        c.responses += len(replies)
        execs = by_key.get(plan.key, [])
        if len(execs) != 1:
            c.failures.append(f"{plan.key}: {len(execs)} upstream executions (want 1): "
                              f"{[e['id'] for e in execs]}")
        ids = {e["id"] for e in execs}
        originals = [r for r in replies if r.error is None and 200 <= r.status < 300 and r.header(REPLAY) is None]
        original = originals[0] if len(originals) == 1 else None
        if original is None:
            c.failures.append(f"{plan.key}: {len(originals)} responses without the replay header (want 1): "
                              f"{originals[:3]}")
        else:
            why = not_original(original, plan, ids)
            if why:
                c.failures.append(f"{plan.key}: the original is not this key's execution ({why}): {original!r}")
            c.original_latency_ms.append(original.latency * 1000)
        for r in replies:
            if any(r is o for o in originals):
                c.originals += 1
                continue
            if r.error is not None:
                c.client_errors += 1
                c.failures.append(f"{plan.key}: transport error {r.error} (replica {r.replica})")
            elif r.status >= 500:
                c.server_errors += 1
                c.failures.append(f"{plan.key}: {r.status} from replica {r.replica}: {r!r}")
            elif r.status == 409 and allow_conflict:
                why = _problem(r, 409)
                if why:
                    c.other += 1
                    c.failures.append(f"{plan.key}: a 409 that is not the filter's problem ({why}): {r!r}")
                else:
                    c.conflicts += 1
            elif r.header(REPLAY) is not None:
                if original is None:
                    c.other += 1
                    continue  # already reported: no original to compare with
                why = not_replay_of(r, original)
                if why:
                    c.other += 1
                    c.failures.append(f"{plan.key}: not a replay of this key's original ({why}): {r!r}")
                    continue
                c.replays += 1
                if r.sent < original.done:
                    c.replay_delays_ms.append((r.done - original.done) * 1000)
                else:
                    c.late_replays += 1
            else:
                c.other += 1
                c.failures.append(f"{plan.key}: unexpected response from replica {r.replica}: {r!r}")
    return c


def original_of(replies: list[Reply]) -> Reply | None:
    """The one 2xx response without the replay header, if there is exactly one."""
    found = [r for r in replies if r.error is None and 200 <= r.status < 300 and r.header(REPLAY) is None]
    return found[0] if len(found) == 1 else None


def replays_of_originals(retry: BurstRun, first: BurstRun) -> list[str]:
    """Failures unless every response of `retry` (the same keys and bodies, i.e. the same
    prefix) is a replay of that key's original in `first`."""
    bad = []
    for plan in retry.plans:
        original = original_of(first.replies.get(plan.key, []))
        for r in retry.replies.get(plan.key, []):
            why = ("no original to compare with" if original is None
                   else r.error or not_replay_of(r, original))
            if why:
                bad.append(f"{plan.key}: {why}: {r!r}")
    return bad


def write_delays(path: Path, label: str, delays_ms: list[float]) -> str:
    """Appends one line (n, p50, p90, p99, max of the commit-to-replay delays) to `path`."""
    line = (f"{label}: n={len(delays_ms)} p50={percentile(delays_ms, 50):.1f}ms p90={percentile(delays_ms, 90):.1f}ms "
            f"p99={percentile(delays_ms, 99):.1f}ms max={max(delays_ms, default=math.nan):.1f}ms "
            f"min={min(delays_ms, default=math.nan):.1f}ms")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(line + "\n")
    return line


# --------------------------------------------------------------------------------------------
# a burst against a replica set, checked (test_replicas.py, test_redis_cluster.py)
# --------------------------------------------------------------------------------------------


def fire(rs, upstream, spec: BurstSpec, run_dir, label: str, allow_conflict: bool = False):
    run = run_burst(rs.ports(), spec)
    run.dump(run_dir / f"{label}.tsv")
    check = check_burst(run, upstream.executions(key_prefix=run.prefix), allow_conflict=allow_conflict)
    with open(run_dir / "bursts.txt", "a") as f:
        f.write(f"{label}: {check.summary()}\n")
    return run, check


def assert_exactly_once(check: BurstCheck, keys: int, duplicates: int) -> None:
    assert not check.failures, check.report()
    assert check.keys == keys
    assert check.executions == keys, check.summary()
    assert check.originals == keys, check.summary()
    assert check.replays == keys * (duplicates - 1), check.summary()
    assert check.conflicts == 0 and check.server_errors == 0 and check.client_errors == 0, check.summary()
    # The duplicates really were concurrent: nearly all were out before their original answered.
    assert len(check.replay_delays_ms) >= 0.9 * check.replays, check.summary()
