"""Secured stores for the end-to-end suite: idemstore reaching Redis over TLS as the
documented least-privilege ACL user with a key prefix, and idemstore's own listener on TLS
requiring client certificates. `IDEM_SECURE_STORE=1` (`harness.secure_store`) makes
`stack.start_backend` and `replicas.start_replica_set` (backend "redis") use it;
`security/test_redis_access.py` uses the parts directly.

- `material(folder)`: a test CA (`pki.Pki`) and the certificates: redis-server's, the tests'
  admin certificate to Redis, idemstore's listener's, idemstore's client certificate to Redis,
  and the one Envoys (and the tests) present to idemstore. All name `localhost` and 127.0.0.1.
- `start_tls_redis`: redis-server on a TLS port only (plain port 0), client certificates
  required or not, the default user behind an admin password; registered with
  `redis_cluster.serve_access`, so `redis_cluster.command(port, ...)` reaches it as the admin.
  `start_tls_cluster`: a Redis Cluster the same way, the ACL user on every node.
- `docs_acl_line`, `acl_rules`, `create_acl_user`: the `ACL SETUSER idemstore ...` line of
  docs/security.md, run as written (only the password and the key prefix substituted).
- `redis_flags`, `listener_flags`, `spawn_store`: idemstore's flags for the above, and
  idemstore started with its TLS listener, registered with `harness.serve_tls` so that every
  client the harness makes for its port (readiness, /metrics, the Envoys' store cluster) speaks
  mutual TLS.

    m = secure.material(run_dir / "pki")
    redis, rport = secure.start_tls_redis(run_dir, m)
    password = secure.new_password()
    secure.create_acl_user(rport, password, prefix="e2e:")
    args = ["--redis", secure.redis_url(rport), *secure.redis_flags(
        m, password_file=secure.write_password(run_dir / "pw", password), prefix="e2e:")]
    store, sport = secure.spawn_store(run_dir, m, args)
    h.await_idemstore(store, sport)        # over TLS with m.envoy
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from . import harness as h
from . import redis_cluster as rc
from .pki import Cert, Pki

DOCS_SECURITY = h.ROOT / "docs" / "security.md"
USER = "idemstore"
# The key prefix of the secured standard stacks (every key and the wake-up channel under it).
PREFIX = "e2e:"


# --------------------------------------------------------------------------------------------
# certificates
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Material:
    pki: Pki
    redis: Cert         # redis-server's (server, and client on the cluster bus and replication)
    admin: Cert         # the tests' own connections to Redis, and redis-cli
    store: Cert         # idemstore's listener
    store_client: Cert  # idemstore's client certificate to Redis
    envoy: Cert         # what Envoys (and the tests) present to idemstore's listener

    @property
    def ca(self) -> Path:
        return self.pki.ca

    def redis_tls(self, auth_clients: bool = True, password: str | None = None) -> rc.RedisTls:
        return rc.RedisTls(self.ca, self.redis.cert, self.redis.key, self.admin.cert, self.admin.key,
                           password or new_password(), auth_clients)

    def store_tls(self) -> h.StoreTls:
        """How a client reaches idemstore's listener: the CA, the Envoys' client certificate."""
        return h.StoreTls(self.ca, self.envoy.cert, self.envoy.key)


def material(folder: Path, ca_name: str = "idem-e2e test CA") -> Material:
    pki = Pki(folder, ca_name)

    def issue(name: str, server: bool, client: bool) -> Cert:
        return pki.issue(name, dns=("localhost",), ips=(h.LOOPBACK,), server=server, client=client)

    return Material(pki, redis=issue("redis", True, True), admin=issue("redis-admin", False, True),
                    store=issue("idemstore", True, False), store_client=issue("idemstore-client", False, True),
                    envoy=issue("envoy", False, True))


def new_password() -> str:
    return "pw-" + secrets.token_urlsafe(18)


def write_password(path: Path, password: str) -> Path:
    """The password in a file only its owner reads, with the line break an editor leaves."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(password + "\n")
    path.chmod(0o600)
    return path


# --------------------------------------------------------------------------------------------
# Redis over TLS
# --------------------------------------------------------------------------------------------


def redis_url(port: int, user: str | None = USER) -> str:
    return f"rediss://{user + '@' if user else ''}{h.LOOPBACK}:{port}"


def start_tls_redis(run_dir: Path, m: Material, auth_clients: bool = True,
                    name: str = "redis-tls") -> tuple[h.Proc, int]:
    """redis-server on a TLS port only (`--port 0`), client certificates required when
    `auth_clients`; the default user needs the admin password. Awaited by a PING over TLS as
    the admin (`redis_cluster.command(port, ...)` from now on)."""
    port = h.free_port()
    tls = m.redis_tls(auth_clients)
    data = run_dir / f"redis-{port}"
    data.mkdir(parents=True, exist_ok=True)
    argv = [h.redis_bin(), *tls.server_args(port), "--bind", h.LOOPBACK, "--save", "", "--appendonly", "no",
            "--dir", str(data), "--daemonize", "no", "--protected-mode", "no"]
    proc = h.start(name, argv, run_dir)
    rc.serve_access(port, tls.access())
    h.await_ready(proc, lambda: rc.ping(port), f"{name} PING over TLS")
    return proc, port


def start_tls_cluster(run_dir: Path, prefix: str = PREFIX) -> tuple[rc.RedisCluster, list[str], Material]:
    """A 6-node Redis Cluster on TLS only (clients with certificates, the cluster bus and
    replication too), the documented ACL user (with `prefix`) on every node (ACL users are
    per node; a replica promoted later must know it too). Returns the cluster, idemstore's
    flags for it (`--redis-cluster` with every node as a `rediss://` seed, the CA, the client
    certificate, the password file, the prefix) and the certificates."""
    m = material(run_dir / "pki")
    cluster = rc.start_cluster(run_dir / "cluster", tls=m.redis_tls())
    try:
        password = new_password()
        for port in cluster.ports:
            create_acl_user(port, password, prefix)
        flags = ["--redis-cluster", ",".join(cluster.urls(user=USER)),
                 *redis_flags(m, password_file=write_password(run_dir / "redis-password", password), prefix=prefix)]
    except BaseException:
        cluster.stop()
        raise
    return cluster, flags, m


# --------------------------------------------------------------------------------------------
# the documented ACL user
# --------------------------------------------------------------------------------------------


def docs_acl_line() -> str:
    """The least-privilege line of docs/security.md, as written there (exactly one)."""
    lines = [ln.strip() for ln in DOCS_SECURITY.read_text().splitlines() if ln.startswith(f"ACL SETUSER {USER} ")]
    if len(lines) != 1:
        raise h.HarnessError(f"{DOCS_SECURITY}: want exactly one line starting `ACL SETUSER {USER} `, "
                             f"found {len(lines)}")
    return lines[0]


def _substitute(words: list[str], old: str, new: str) -> list[str]:
    if words.count(old) != 1:
        raise h.HarnessError(f"docs/security.md's ACL line has {words.count(old)} `{old}` (want one): {words}")
    return [new if w == old else w for w in words]


def acl_rules(password: str, prefix: str = "", user: str = USER, drop: tuple[str, ...] = ()) -> list[str]:
    """The docs' line as command arguments: `>PASSWORD` becomes the password, the key and
    channel patterns get `prefix` (as the docs say for --key-prefix), `user` replaces the user's
    name, and the rules in `drop` are left out (a user lacking a permission the docs grant)."""
    words = docs_acl_line().split()
    words = _substitute(words, ">PASSWORD", ">" + password)
    words = _substitute(words, "~idem:*", f"~{prefix}idem:*")
    words = _substitute(words, "&idem:wake", f"&{prefix}idem:wake")
    for rule in drop:
        words = _substitute(words, rule, "")
    words = [w for w in words if w]
    assert words[:3] == ["ACL", "SETUSER", USER], words[:3]
    return ["ACL", "SETUSER", user, *words[3:]]


def create_acl_user(port: int, password: str, prefix: str = "", user: str = USER,
                    drop: tuple[str, ...] = ()) -> list[str]:
    """Runs `acl_rules(...)` as the admin on the Redis at `port`; returns the arguments sent.
    A Redis that refuses the docs' line fails the setup, naming the line."""
    args = acl_rules(password, prefix, user, drop)
    try:
        rc.command(port, *args)
    except rc.RedisError as e:
        shown = " ".join(a if not a.startswith(">") else ">***" for a in args)
        raise h.HarnessError(f"redis-server (port {port}) refused the ACL line of docs/security.md: {e}\n"
                             f"  {shown}") from None
    return args


# --------------------------------------------------------------------------------------------
# idemstore
# --------------------------------------------------------------------------------------------


def redis_flags(m: Material, password_file: Path | None = None, prefix: str | None = None,
                ca: Path | None = None, client_cert: bool = True) -> list[str]:
    """idemstore's flags for a TLS Redis (besides the URL): the CA (`ca` instead: a wrong one),
    its client certificate unless `client_cert` is False, the password file, the key prefix."""
    flags = ["--redis-ca-file", str(ca or m.ca)]
    if client_cert:
        flags += ["--redis-cert-file", str(m.store_client.cert), "--redis-key-file", str(m.store_client.key)]
    if password_file is not None:
        flags += ["--redis-password-file", str(password_file)]
    if prefix is not None:
        flags += ["--key-prefix", prefix]
    return flags


def listener_flags(m: Material) -> list[str]:
    """idemstore's own listener on TLS, client certificates required (signed by the test CA)."""
    return ["--tls-cert-file", str(m.store.cert), "--tls-key-file", str(m.store.key),
            "--tls-client-ca-file", str(m.ca)]


def spawn_store(run_dir: Path, m: Material, redis_args: list[str] | tuple[str, ...] = (),
                name: str = "idemstore", env: dict | None = None, port: int | None = None) -> tuple[h.Proc, int]:
    """idemstore with its TLS listener (`redis_args`: its backend, none for the in-memory one),
    registered so the harness's clients and store clusters use mutual TLS; not awaited
    (`harness.await_idemstore` then speaks TLS)."""
    port = port or h.free_port()
    h.serve_tls(port, m.store_tls())
    argv = [h.idemstore_bin(), "--listen", f"{h.LOOPBACK}:{port}", *redis_args, *listener_flags(m)]
    proc = h.start(name, argv, run_dir, env={"RUST_LOG": os.environ.get("IDEMSTORE_LOG", "info"), **(env or {})})
    return proc, port


def start_backend(sub: Path, backend: str) -> tuple[h.Proc, int, h.Proc | None]:
    """`stack.start_backend` under IDEM_SECURE_STORE: idemstore's listener on mutual TLS, and for
    "redis" a TLS-only Redis requiring client certificates, idemstore logged in as the docs' ACL
    user (password from a file) with the key prefix PREFIX."""
    m = material(sub / "pki")
    redis = None
    redis_args: list[str] = []
    if backend == "redis":
        redis, rport = start_tls_redis(sub, m)
        try:
            password = new_password()
            create_acl_user(rport, password, PREFIX)
        except BaseException:
            redis.stop()
            raise
        redis_args = ["--redis", redis_url(rport),
                      *redis_flags(m, password_file=write_password(sub / "redis-password", password), prefix=PREFIX)]
    store, sport = spawn_store(sub, m, redis_args)
    try:
        h.await_idemstore(store, sport)
    except BaseException:
        if redis is not None:
            redis.stop()
        raise
    return store, sport, redis
