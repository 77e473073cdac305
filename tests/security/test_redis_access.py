"""idemstore's way to Redis and its own listener, secured (TLS, ACL user, key prefix), with real processes:

- Redis on TLS only, client certificates required: idemstore with the test CA and its client
  certificate, logged in as the ACL user of docs/security.md (the line read from there), guards
  requests through an Envoy whose store calls (the store stream) go over mutual TLS;
- a wrong CA, no client certificate, a wrong password, an ACL user lacking a permission the docs
  grant: one log line naming the cause, `/healthz` 503 however often it is asked, and an Envoy in
  front fails open as for a store outage;
- the documented ACL line refuses what idemstore does not need; the password is in no argv and
  no log line; a key prefix keeps two deployments on one Redis apart, `idemstore records` too;
- idemstore's listener with required client certificates refuses a client without one at the
  handshake (and plain HTTP), and serves a rotated certificate without a restart while an
  Envoy's requests keep being answered.

The certificates are made at run time (support/pki.py, support/secure.py)."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import socket
import ssl
import struct
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from support import harness as h
from support import redis_cluster as rc
from support import secure
from support.checks import REPLAY, assert_executed, assert_replay_of
from support.harness import new_key
from support.stack import plugin_config

PREFIX = "acc:"
# The guard on the filter's default store transport, whatever IDEM_STORE_TRANSPORT says: the
# store stream over mutual TLS.
STREAM = plugin_config(store_transport="stream")
JSON = ("content-type", "application/json")


@dataclass
class Secured:
    """A TLS-only Redis requiring client certificates with the docs' ACL user (prefix `acc:`),
    idemstore on it (password from a file) with its listener on mutual TLS, an Envoy in front."""
    sub: Path
    m: secure.Material
    redis: h.Proc
    rport: int
    password: str
    store: h.Proc
    sport: int
    envoy: h.Envoy


@pytest.fixture(scope="module")
def secured(run_dir, artifacts, upstream):
    sub = run_dir / "redis-access"
    m = secure.material(sub / "pki")
    redis, rport = secure.start_tls_redis(sub, m)
    started: list[h.Proc] = [redis]
    try:
        password = secure.new_password()
        secure.create_acl_user(rport, password, PREFIX)
        store, sport = secure.spawn_store(sub, m, store_args(m, rport, sub / "password", password, PREFIX))
        started.append(store)
        h.await_idemstore(store, sport)
        envoy = h.start_envoy(sub, "envoy", {"default": [h.wasm_filter(STREAM, artifacts["wasm"])]},
                              upstream.port, sport)
    except h.HarnessError as e:
        for p in reversed(started):
            p.stop()
        pytest.fail(str(e), pytrace=False)
    yield Secured(sub, m, redis, rport, password, store, sport, envoy)
    envoy.stop()
    store.stop()
    redis.stop()


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def store_args(m: secure.Material, rport: int, password_path: Path | None, password: str, prefix: str | None,
               user: str = secure.USER, **flags) -> list[str]:
    """idemstore's Redis flags: `rediss://user@...`, the CA, its client certificate, the password
    written to `password_path` (None: given otherwise), the prefix; `flags` as `redis_flags`."""
    pw_file = secure.write_password(password_path, password) if password_path else None
    return ["--redis", secure.redis_url(rport, user), *secure.redis_flags(m, pw_file, prefix, **flags)]


def post(port: int, key: str, body: str = '{"item":"book"}') -> h.Response:
    return h.request(port, "POST", "/orders", body, [("Idempotency-Key", key), JSON])


def store_key(client_key: str, subject: str = "anon:127.0.0.1", method: str = "POST", route: str = "orders") -> str:
    """The filter's store key (protocol/src/key.rs): SHA-256 over the length-prefixed scope."""
    digest = hashlib.sha256(b"idempotency-key/v1")
    for field in (subject, method, route, client_key):
        data = field.encode()
        digest.update(struct.pack(">Q", len(data)))
        digest.update(data)
    return digest.hexdigest()


def scan(port: int, pattern: str) -> set[str]:
    """Every key matching `pattern` (SCAN as the admin)."""
    found: set[str] = set()
    cursor = b"0"
    while True:
        cursor, keys = rc.command(port, "SCAN", cursor, "MATCH", pattern, "COUNT", 1000)
        found.update(k.decode() for k in keys)
        if cursor == b"0":
            return found


def records(*args: str) -> subprocess.CompletedProcess:
    """`idemstore records ...` as an operator runs it, without the service's environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IDEMSTORE_")}
    return subprocess.run([h.idemstore_bin(), "records", *args], capture_output=True, text=True, timeout=60, env=env)


def record_count(flags: list[str]) -> int:
    out = records("count", *flags, "--json")
    assert out.returncode == 0, out
    return json.loads(out.stdout)["records"]


def as_user(m: secure.Material, user: str, password: str) -> rc.Access:
    """A connection as the ACL user (TLS with the admin's client certificate: Redis asks for one
    at the handshake, the user is chosen by AUTH)."""
    ctx = ssl.create_default_context(cafile=str(m.ca))
    ctx.load_cert_chain(str(m.admin.cert), str(m.admin.key))
    return rc.Access(tls=ctx, username=user, password=password)


def log_lines(proc: h.Proc) -> list[str]:
    """The process's own log lines (not the harness's `$ argv` line, which names the flags)."""
    return [ln for ln in proc.log_text().splitlines() if not ln.startswith("$ ")]


def log_time(line: str) -> float:
    """The timestamp idemstore's log line starts with, in seconds."""
    return datetime.datetime.fromisoformat(line.split()[0].replace("Z", "+00:00")).timestamp()


def healthz(port: int) -> int:
    return h.http_get_status(port, "/healthz")[0]


def http_answer(sock_factory, timeout: float = 2.0) -> bytes | Exception:
    """What comes back for `GET /healthz` on a connection `sock_factory()` opens: the bytes read
    until the peer closes (or `timeout`), or the exception the handshake, the write or the
    first read raised (TLS 1.3 reports a refused client certificate only at the first read)."""
    try:
        with sock_factory() as s:
            s.settimeout(timeout)
            s.sendall(b"GET /healthz HTTP/1.1\r\nhost: idemstore\r\nconnection: close\r\n\r\n")
            data = b""
            while True:
                try:
                    chunk = s.recv(4096)
                except socket.timeout:
                    return data
                if not chunk:
                    return data
                data += chunk
    except (OSError, ssl.SSLError) as e:
        return e


def tls_socket(port: int, ctx: ssl.SSLContext):
    def open_it():
        return ctx.wrap_socket(socket.create_connection((h.LOOPBACK, port), timeout=2), server_hostname=h.LOOPBACK)
    return open_it


def served_certificate(port: int, m: secure.Material) -> bytes:
    """The DER certificate idemstore presents on a new TLS connection (with a client certificate)."""
    with tls_socket(port, m.store_tls().ssl_context())() as s:
        return s.getpeercert(binary_form=True)


def poll_healthz(port: int, times: int = 6, interval: float = 0.2) -> list[int]:
    statuses = []
    for _ in range(times):
        statuses.append(healthz(port))
        time.sleep(interval)
    return statuses


# --------------------------------------------------------------------------------------------
# Redis on TLS only, the docs' ACL user: idemstore guards
# --------------------------------------------------------------------------------------------


def test_guarded_over_tls_redis_and_mtls_store(secured, upstream):
    """idemstore as the docs' ACL user: a guarded POST through the Envoy runs once and its retry
    replays; the store calls went over mutual TLS (handshakes counted on the store cluster); the
    record is under the prefix in Redis, where `idemstore records count` with the same flags
    (the same user) finds it. On the native host the module's store is that ACL user on the
    TLS-only Redis (client certificate required), with the same prefix."""
    s = secured
    assert h.http_get_status(s.sport, "/healthz") == (200, b"ok")
    degraded, stored = s.envoy.counter("degraded"), s.envoy.counter("stored")
    key = new_key("tls")
    first = post(s.envoy.port("default"), key)
    assert_executed(first, 201)
    assert s.envoy.wait_counter("stored", stored + 1) == stored + 1
    assert_replay_of(post(s.envoy.port("default"), key), first)
    assert upstream.count(key=key) == 1
    assert s.envoy.counter("degraded") == degraded
    if not h.native():
        # The native host has no store cluster nor stream: its store speaks to this TLS-only Redis
        # itself (the `store` of the idemstore's flags: CA, client certificate, user, password
        # file, prefix), which the record below, written as the ACL user, shows.
        assert s.envoy.counter("cluster.idemstore.ssl.handshake") >= 1
        assert s.envoy.counter("store_streams_opened") >= 1  # the default transport: the stream

    sk = store_key(key)
    held = scan(s.rport, f"*{{{sk}}}*")
    assert held == {f"{PREFIX}idem:{{{sk}}}:r"}, held
    on_redis = len(scan(s.rport, f"{PREFIX}idem:*:r"))
    flags = store_args(s.m, s.rport, s.sub / "password-tool", s.password, PREFIX)
    assert record_count(flags) == on_redis >= 1


LEAST_PRIVILEGE_REFUSED = [
    ("FLUSHALL",),
    ("CONFIG", "GET", "*"),
    ("KEYS", "*"),
    ("GET", "somekey"),
    ("GET", "idem:{0123}:r"),          # idemstore's key shape, outside this deployment's prefix
    ("SET", f"{PREFIX}other", "x"),     # inside the prefix, not idemstore's key pattern
    ("PUBLISH", "idem:wake", "x"),      # another deployment's wake-up channel
    ("ACL", "LIST"),
]


def test_docs_acl_line_refuses_what_idemstore_does_not_need(secured):
    """As the user idemstore runs as (docs/security.md's line, prefix `acc:`), idemstore's own
    commands on its keys and channel pass; anything else is refused with NOPERM."""
    s = secured
    user = as_user(s.m, secure.USER, s.password)
    assert rc.command(s.rport, "PING", access=user) == "PONG"
    assert rc.command(s.rport, "GET", f"{PREFIX}idem:{{0123}}:r", access=user) is None
    assert rc.command(s.rport, "PUBLISH", f"{PREFIX}idem:wake", "x", access=user) >= 0
    for args in LEAST_PRIVILEGE_REFUSED:
        with pytest.raises(rc.RedisError) as refused:
            rc.command(s.rport, *args, access=user)
        assert str(refused.value).startswith("NOPERM"), (args, refused.value)


# --------------------------------------------------------------------------------------------
# what cannot work: one line naming the cause, /healthz 503, the filter fails open
# --------------------------------------------------------------------------------------------

# A warning or an error in idemstore's log (tracing's level field).
PROBLEM = re.compile(r"^\S+\s+(WARN|ERROR)\b")
# case -> what names the cause in that line (case-insensitive)
BROKEN = {
    "wrong_ca": r"certificate",
    "no_client_certificate": r"certificate",
    "wrong_password": r"WRONGPASS|password",
    "missing_permission": r"NOPERM|permission",
}


# The same on the native host, where the module's store logs the cause in Envoy's log (component
# dynamic_modules) and one Envoy holds all four: the two certificate cases told apart (rustls's
# words, as measured with Envoy 1.40 and redis-server 7).
NATIVE_BROKEN = {
    "wrong_ca": r"TLS with Redis failed: .*UnknownIssuer",
    "no_client_certificate": r"TLS with Redis failed: .*CertificateRequired",
    "wrong_password": r"WRONGPASS|refused idemstore's credentials",
    "missing_permission": r"NOPERM|permission",
}


@dataclass
class Broken:
    stores: dict[str, tuple[h.Proc, int]]
    started_at: float
    envoy: h.Envoy
    passwords: list[str]


@pytest.fixture(scope="module")
def broken(secured, run_dir, artifacts, upstream):
    """One idemstore per way of getting Redis access wrong, all against the secured Redis, and an
    Envoy with a listener (and a store cluster) per idemstore."""
    s = secured
    sub = run_dir / "redis-access-broken"
    other = secure.material(sub / "other-pki", "another CA")
    pw_user, pw_given = secure.new_password(), secure.new_password()
    perm_password = secure.new_password()
    secure.create_acl_user(s.rport, pw_user, PREFIX, user="idemstore-pw")
    secure.create_acl_user(s.rport, perm_password, PREFIX, user="idemstore-noeval", drop=("+evalsha", "+eval"))
    args = {
        "wrong_ca": store_args(s.m, s.rport, sub / "pw-ca", s.password, PREFIX, ca=other.ca),
        "no_client_certificate": store_args(s.m, s.rport, sub / "pw-nocert", s.password, PREFIX, client_cert=False),
        "wrong_password": store_args(s.m, s.rport, sub / "pw-wrong", pw_given, PREFIX, user="idemstore-pw"),
        "missing_permission": store_args(s.m, s.rport, sub / "pw-perm", perm_password, PREFIX,
                                         user="idemstore-noeval"),
    }
    started_at = time.monotonic()
    stores = {case: secure.spawn_store(sub, s.m, a, name=f"idemstore-{case}") for case, a in args.items()}
    envoy = None
    try:
        # Up (listening: the TLS handshake and /healthz answer) but not healthy.
        for case, (proc, port) in stores.items():
            h.await_ready(proc, lambda p=port: healthz(p) == 503, f"{proc.name} /healthz 503", timeout=10)
        listeners = {case: {"filters": [h.wasm_filter(plugin_config(store_cluster=f"store_{case}"), artifacts["wasm"])]}
                     for case in BROKEN}
        clusters = [h.static_cluster("upstream", upstream.port)]
        clusters += [h.store_cluster(port, name=f"store_{case}") for case, (_, port) in stores.items()]
        envoy = h.await_envoy(h.spawn_envoy_with(sub, "envoy-broken", listeners, clusters))
    except h.HarnessError as e:
        for proc, _ in stores.values():
            proc.stop()
        pytest.fail(str(e), pytrace=False)
    yield Broken(stores, started_at, envoy, [s.password, pw_user, pw_given, perm_password])
    envoy.stop()
    for proc, _ in stores.values():
        proc.stop()


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_access_is_one_clear_line_and_unhealthy(broken, case, secured, upstream, note):
    """Each way of getting Redis access wrong: idemstore stays unhealthy and logs one line naming
    the cause; the filter in front fails open. On the native host the module's store is the one
    with the wrong access (the idemstore's flags as its `store`): it fails open the same way and
    one line of its own in Envoy's log names the cause."""
    proc, port = broken.stores[case]
    cause = re.compile(BROKEN[case], re.IGNORECASE)
    if not h.native():
        # Asked again and again (as a health check does), idemstore stays unhealthy...
        assert poll_healthz(port) == [503] * 6
    # ...and a filter in front fails open, as for a store outage: the request runs, counted.
    before = broken.envoy.counters()
    key = new_key(case)
    assert_executed(post(broken.envoy.port(case), key), 201)
    assert upstream.count(key=key) == 1
    after = broken.envoy.counters()
    assert after.get("degraded", 0) == before.get("degraded", 0) + 1, (before, after)
    assert after.get("stored", 0) == before.get("stored", 0)
    if h.native():
        # The module's store logged the cause once (not per store call), and no password.
        native_cause = re.compile(NATIVE_BROKEN[case], re.IGNORECASE)
        named = [ln for ln in broken.envoy.log_text().splitlines()
                 if h.is_filter_log_line(ln) and native_cause.search(ln)]
        assert len(named) == 1, "\n".join(named) or broken.envoy.proc.describe(60)
        for password in broken.passwords:
            assert password not in broken.envoy.log_text()
        note(f"redis access {case} (native host): {named[0].split('idempotency: ', 1)[1][:140]}")
        return
    # One line names the cause, once: not per health check, nor per store call; and it is the
    # only warning or error idemstore logged (no stack of retries).
    problems = [ln for ln in log_lines(proc) if PROBLEM.search(ln)]
    named = [ln for ln in problems if cause.search(ln)]
    assert len(named) == 1 and problems == named, "\n".join(problems) or proc.describe(40)
    assert proc.alive()
    for password in broken.passwords:
        assert password not in proc.log_text()
    after = log_time(named[0]) - log_time(log_lines(proc)[0])
    note(f"redis access {case}: idemstore logged once, {after * 1000:.0f} ms after its first line: "
         f"{named[0].split(' ', 1)[1][:140]}")


@pytest.mark.parametrize("case,fix", [
    ("wrong_password", lambda s, b: rc.command(s.rport, "ACL", "SETUSER", "idemstore-pw", "resetpass",
                                               ">" + b.passwords[2])),
    ("missing_permission", lambda s, b: rc.command(s.rport, "ACL", "SETUSER", "idemstore-noeval", "+evalsha", "+eval")),
], ids=["wrong_password", "missing_permission"])
def test_fixed_access_heals_without_a_restart(broken, secured, case, fix, note):
    """The log line says /healthz answers 503 "until it is fixed": fixed on the Redis side, the
    same process turns healthy."""
    h.skip_on_native("native host: idemstore's /healthz; the module has no health endpoint")
    proc, port = broken.stores[case]
    assert healthz(port) == 503
    fix(secured, broken)
    t0 = time.monotonic()
    h.wait_for(lambda: healthz(port) == 200, f"{proc.name} healthy once its ACL user is fixed", proc,
               timeout=10, interval=0.1)
    note(f"redis access {case}: /healthz 200 {time.monotonic() - t0:.2f}s after the ACL user was fixed")


# --------------------------------------------------------------------------------------------
# the password: not in argv, not in the log
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("given", ["file", "environment"])
def test_password_in_no_argv_and_no_log(secured, given, run_dir):
    """--redis-password-file (the module's idemstore, which has served requests) or
    IDEMSTORE_REDIS_PASSWORD (a second idemstore, at debug level): healthy, so the password
    was used; it is in neither /proc/<pid>/cmdline nor any line idemstore logged. On the native
    host, the module's store given the file: it stores as that user, and the password is in
    neither Envoy's command line, its configuration nor its log."""
    s = secured
    if h.native():
        # The module's store read the password from `password_file` (the idemstore's flag) and
        # has served requests as that user (test_guarded_over_tls_redis_and_mtls_store): the
        # password is not in Envoy's command line, its configuration nor its log.
        if given == "environment":
            h.skip_on_native("native host: the harness maps no idemstore whose password is in its "
                             "environment (IDEMSTORE_REDIS_PASSWORD) to a `store`")
        stored = s.envoy.counter("stored")
        assert_executed(post(s.envoy.port("default"), new_key("pw")), 201)
        assert s.envoy.wait_counter("stored", stored + 1) == stored + 1
        assert s.password.encode() not in Path(f"/proc/{s.envoy.proc.pid}/cmdline").read_bytes()
        assert s.password not in s.envoy.config_path.read_text()
        assert s.password not in s.envoy.log_text()
        return
    if given == "file":
        proc, port = s.store, s.sport
    else:
        sub = run_dir / "redis-access-env"
        proc, port = secure.spawn_store(sub, s.m, store_args(s.m, s.rport, None, s.password, PREFIX),
                                        name="idemstore-env-password",
                                        env={"IDEMSTORE_REDIS_PASSWORD": s.password, "RUST_LOG": "debug"})
    try:
        h.await_idemstore(proc, port)
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert b"rediss://idemstore@" in cmdline
        assert s.password.encode() not in cmdline
        assert s.password not in proc.log_text()
    finally:
        if proc is not s.store:
            proc.stop()


# --------------------------------------------------------------------------------------------
# a key prefix per deployment
# --------------------------------------------------------------------------------------------


def test_key_prefixes_keep_deployments_apart(secured, run_dir, artifacts, upstream):
    """Two idemstores on one Redis, prefixes `a:` and `b:`, each as an ACL user limited to its
    prefix: the same request through each runs once per deployment and replays within it; the
    records are under each prefix (and nowhere else); `idemstore records count --key-prefix`
    counts only its own."""
    s = secured
    sub = run_dir / "redis-access-prefixes"
    stores: dict[str, tuple[h.Proc, int]] = {}
    envoy = None
    try:
        flags = {}
        for name in ("a", "b"):
            password = secure.new_password()
            secure.create_acl_user(s.rport, password, f"{name}:", user=f"idemstore-{name}")
            flags[name] = store_args(s.m, s.rport, sub / f"pw-{name}", password, f"{name}:", user=f"idemstore-{name}")
            stores[name] = secure.spawn_store(sub, s.m, flags[name], name=f"idemstore-{name}")
        for proc, port in stores.values():
            h.await_idemstore(proc, port)
        listeners = {name: {"filters": [h.wasm_filter(plugin_config(store_cluster=f"store_{name}"), artifacts["wasm"])]}
                     for name in stores}
        clusters = [h.static_cluster("upstream", upstream.port)]
        clusters += [h.store_cluster(port, name=f"store_{name}") for name, (_, port) in stores.items()]
        envoy = h.await_envoy(h.spawn_envoy_with(sub, "envoy-prefixes", listeners, clusters))

        shared, only_a = new_key("both"), new_key("only-a")
        originals = {}
        for name in ("a", "b"):
            stored = envoy.counter("stored")
            originals[name] = post(envoy.port(name), shared)
            assert_executed(originals[name], 201)  # b does not see a's record
            assert envoy.wait_counter("stored", stored + 1) == stored + 1
        assert_executed(post(envoy.port("a"), only_a), 201)
        assert envoy.wait_counter("stored", 3) == 3
        for name in ("a", "b"):
            assert_replay_of(post(envoy.port(name), shared), originals[name])
        assert originals["a"].body != originals["b"].body
        assert upstream.count(key=shared) == 2 and upstream.count(key=only_a) == 1

        both, a_only = store_key(shared), store_key(only_a)
        assert scan(s.rport, f"*{{{both}}}*") == {f"a:idem:{{{both}}}:r", f"b:idem:{{{both}}}:r"}
        assert scan(s.rport, f"*{{{a_only}}}*") == {f"a:idem:{{{a_only}}}:r"}
        assert record_count(flags["a"]) == 2
        assert record_count(flags["b"]) == 1
    finally:
        if envoy is not None:
            envoy.stop()
        for proc, _ in stores.values():
            proc.stop()


# --------------------------------------------------------------------------------------------
# idemstore's own listener: client certificates required, certificates rotated
# --------------------------------------------------------------------------------------------


def test_listener_refuses_clients_without_a_certificate(secured, run_dir):
    """A TLS client without a certificate, or with one from another CA, is refused at the
    handshake and never gets an HTTP answer; plain HTTP gets none either; a client with a
    certificate of the test CA gets /healthz 200."""
    h.skip_on_native("native host: idemstore's own TLS listener; the module's store has no listener")
    s = secured
    no_cert = ssl.create_default_context(cafile=str(s.m.ca))
    other = secure.material(run_dir / "redis-access-other-client", "a stranger's CA")
    stranger = ssl.create_default_context(cafile=str(s.m.ca))
    stranger.load_cert_chain(str(other.envoy.cert), str(other.envoy.key))
    for what, ctx in (("no certificate", no_cert), ("another CA's certificate", stranger)):
        answer = http_answer(tls_socket(s.sport, ctx))
        assert isinstance(answer, Exception) or answer == b"", (what, answer)
    plain = http_answer(lambda: socket.create_connection((h.LOOPBACK, s.sport), timeout=2))
    assert isinstance(plain, Exception) or not plain.startswith(b"HTTP/"), plain
    assert h.http_get_status(s.sport, "/healthz") == (200, b"ok")


def test_listener_certificate_rotation(run_dir, artifacts, upstream, note):
    """idemstore's certificate and key files replaced by a newly issued pair (another serial):
    new connections get the new certificate without a restart, and an Envoy's guarded requests
    keep being answered and replayed throughout."""
    h.skip_on_native("native host: idemstore's own TLS listener; the module's store has no listener")
    sub = run_dir / "redis-access-rotation"
    m = secure.material(sub / "pki")
    store, sport = secure.spawn_store(sub, m, name="idemstore-rotation")  # in memory: the listener is the point
    envoy = None
    stop = threading.Event()
    results: list[tuple[int, str | None, int, str | None]] = []

    def load():
        while not stop.is_set():
            key = new_key("rotation")
            first = post(envoy.port("default"), key)
            again = post(envoy.port("default"), key)
            results.append((first.status, first.header(REPLAY), again.status, again.header(REPLAY)))

    try:
        h.await_idemstore(store, sport)
        envoy = h.start_envoy(sub, "envoy", {"default": [h.wasm_filter(STREAM, artifacts["wasm"])]},
                              upstream.port, sport)
        old = served_certificate(sport, m)
        t, out = h.in_thread(load)
        h.wait_for(lambda: len(results) >= 5, "requests through the Envoy before the rotation", timeout=10)

        rotated = m.pki.issue("idemstore-rotated", dns=("localhost",), ips=(h.LOOPBACK,), server=True)
        os.replace(rotated.key, m.store.key)
        os.replace(rotated.cert, m.store.cert)
        t_replaced = time.monotonic()
        new = h.wait_for(lambda: (c := served_certificate(sport, m)) != old and c, "the rotated certificate served",
                         store, timeout=10, interval=0.05)
        took = time.monotonic() - t_replaced
        during = len(results)
        h.wait_for(lambda: len(results) >= during + 5, "requests through the Envoy after the rotation", timeout=10)
        stop.set()
        h.joined(t, out)
        assert new == _der(m.store.cert) and _serial(new) != _serial(old)
        bad = [r for r in results if r != (201, None, 201, "true")]
        assert not bad, bad[:5]
        assert envoy.counter("degraded") == 0
        assert store.alive()
        note(f"idemstore listener certificate rotated: served on new connections {took:.2f}s after the files "
             f"were replaced; {len(results)} guarded requests (and their replays) answered throughout")
    finally:
        stop.set()
        if envoy is not None:
            envoy.stop()
        store.stop()


def _der(pem_file: Path) -> bytes:
    return x509.load_pem_x509_certificate(pem_file.read_bytes()).public_bytes(serialization.Encoding.DER)


def _serial(der: bytes) -> int:
    return x509.load_der_x509_certificate(der).serial_number
