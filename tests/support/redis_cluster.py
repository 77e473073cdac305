"""A real Redis Cluster on loopback for the end-to-end suite (stdlib only).

Six `redis-server`s (3 masters, 3 replicas by default), each in its own folder under the run
directory, joined by `redis-cli --cluster create ... --cluster-replicas 1 --cluster-yes`, then
awaited until every node says `cluster_state:ok`, every slot is served, every node knows every
other and every replica's link to its master is up. Stopped by PID like every other process of
the harness (`harness.start`); `kill(port)` is SIGKILL for fault drills.

    cluster = redis_cluster.start_cluster(run_dir / "cluster")
    try:
        victim = cluster.master_of_key("idem:{abc}:r")        # port of the master serving it
        cluster.wait_replicated(victim)                        # WAIT 1: its replica has it all
        cluster.kill(victim)                                   # SIGKILL by PID
        took = cluster.wait_failover(victim)                   # a replica promoted, state ok
    finally:
        cluster.stop()

Commands go over a tiny RESP2 client (`command(port, "CLUSTER", "NODES")`), one connection per
command, every wait bounded. The cluster bus of a node listens on port + 10000, so ports are
picked at most 55535 with both the port and its bus port free.

Over TLS: `start_cluster(..., tls=RedisTls(...))` starts every node with its TLS port only (plain
port 0; the cluster bus and replication over TLS too, client certificates required) and an admin
password; `command` reaches any port registered with `serve_access` (the cluster's nodes are) over
TLS with the admin's client certificate and AUTH, so every helper here works the same on either.
`support/secure.py` makes the certificates and the ACL user.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import harness as h

SLOTS = 16384
BUS_OFFSET = 10000
NODE_TIMEOUT_MS = 1000


class RedisError(RuntimeError):
    """An error reply (`-ERR ...`) from Redis."""


@dataclass(frozen=True)
class Access:
    """How the tests' own connections reach a Redis: plain TCP (the default), or TLS with `tls`
    (which verifies the server and may carry a client certificate), then AUTH when `password`
    is set (as `username`, else the default user)."""
    tls: ssl.SSLContext | None = None
    username: str | None = None
    password: str | None = None


PLAIN = Access()
# port -> how to reach it, for Redis servers that are not plain and open (`serve_access`).
_ACCESS: dict[int, Access] = {}


def serve_access(port: int, access: Access) -> None:
    """From now on `command(port, ...)` connects as `access` says (ports are never reused within
    a run: `harness.free_port`)."""
    _ACCESS[port] = access


def access_of(port: int) -> Access:
    return _ACCESS.get(port, PLAIN)


@dataclass(frozen=True)
class RedisTls:
    """A Redis that listens on TLS only: its certificate (`cert`/`key`, also its client
    certificate on the cluster bus and replication links: server and client usage), the CA
    that verifies everyone, whether clients must present a certificate, the default user's
    password (`requirepass`, also `masterauth`), and the tests' admin client certificate."""
    ca: Path
    cert: Path
    key: Path
    admin_cert: Path
    admin_key: Path
    password: str
    auth_clients: bool = True

    def server_args(self, port: int) -> list[str]:
        return ["--port", "0", "--tls-port", str(port),
                "--tls-cert-file", str(self.cert), "--tls-key-file", str(self.key),
                "--tls-ca-cert-file", str(self.ca),
                "--tls-auth-clients", "yes" if self.auth_clients else "no",
                "--requirepass", self.password, "--masterauth", self.password]

    def cluster_args(self) -> list[str]:
        return ["--tls-cluster", "yes", "--tls-replication", "yes"]

    def cli_args(self) -> list[str]:
        """redis-cli's: TLS with the admin certificate, the admin password."""
        return ["--tls", "--cacert", str(self.ca), "--cert", str(self.admin_cert), "--key", str(self.admin_key),
                "-a", self.password, "--no-auth-warning"]

    def access(self) -> Access:
        ctx = ssl.create_default_context(cafile=str(self.ca))
        ctx.load_cert_chain(str(self.admin_cert), str(self.admin_key))
        return Access(tls=ctx, password=self.password)


# --------------------------------------------------------------------------------------------
# RESP2 client and key slots
# --------------------------------------------------------------------------------------------


def _encode(args) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        if isinstance(a, str):
            a = a.encode()
        elif isinstance(a, int):
            a = str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


class _Reader:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = b""

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("connection closed by Redis")
        self.buf += chunk

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n + 2:
            self._fill()
        data, self.buf = self.buf[:n], self.buf[n + 2:]
        return data

    def reply(self):
        line = self.line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return RedisError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self.exactly(n)
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.reply() for _ in range(n)]
        raise ValueError(f"unexpected RESP line {line!r}")


def connect(port: int, access: Access | None = None, timeout: float = 2.0, host: str = h.LOOPBACK) -> socket.socket:
    """A connection to the Redis on `port`, as `access` (default: as registered for the port)
    says: TLS handshake done, AUTH answered (a refused AUTH raises `RedisError`)."""
    access = access or access_of(port)
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        sock.settimeout(timeout)
        if access.tls is not None:
            sock = access.tls.wrap_socket(sock, server_hostname=host)
        if access.password is not None:
            auth = ("AUTH", access.username, access.password) if access.username else ("AUTH", access.password)
            sock.sendall(_encode(auth))
            reply = _Reader(sock).reply()
            if isinstance(reply, RedisError):
                raise reply
    except BaseException:
        sock.close()
        raise
    return sock


def command(port: int, *args, timeout: float = 2.0, host: str = h.LOOPBACK, access: Access | None = None):
    """One command on a fresh connection (as `access`, default: as registered for the port,
    else plain); bulk strings come back as bytes, an error reply raises `RedisError`, a dead
    node `OSError`."""
    with connect(port, access, timeout, host) as s:
        s.sendall(_encode(args))
        reply = _Reader(s).reply()
    if isinstance(reply, RedisError):
        raise reply
    return reply


def ping(port: int) -> bool:
    return command(port, "PING", timeout=0.5) == "PONG"


def text(port: int, *args, timeout: float = 2.0) -> str:
    reply = command(port, *args, timeout=timeout)
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def info_fields(raw: str) -> dict[str, str]:
    out = {}
    for line in raw.splitlines():
        name, sep, value = line.partition(":")
        if sep and not line.startswith("#"):
            out[name.strip()] = value.strip()
    return out


def _crc16(data: bytes) -> int:
    """CRC16-CCITT (XMODEM), as Redis Cluster hashes keys."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
            crc &= 0xFFFF
    return crc


def key_slot(key: str | bytes) -> int:
    """The cluster slot of `key`: only the first non-empty `{...}` hash tag counts, if any."""
    k = key.encode() if isinstance(key, str) else key
    start = k.find(b"{")
    if start >= 0:
        end = k.find(b"}", start + 1)
        if end > start + 1:
            k = k[start + 1:end]
    return _crc16(k) % SLOTS


def store_record_key(store_key: str) -> str:
    """idemstore's record key for a store key (its lock key is `...:l`, same slot)."""
    return f"idem:{{{store_key}}}:r"


# --------------------------------------------------------------------------------------------
# the cluster
# --------------------------------------------------------------------------------------------


def cluster_port() -> int:
    """A free loopback port <= 55535 whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, \
                socket.socket(socket.AF_INET, socket.SOCK_STREAM) as bus:
            s.bind((h.LOOPBACK, 0))
            port = s.getsockname()[1]
            if port > 65535 - BUS_OFFSET or port in h._used_ports or port + BUS_OFFSET in h._used_ports:
                continue
            try:
                bus.bind((h.LOOPBACK, port + BUS_OFFSET))
            except OSError:
                continue
        h._used_ports.update((port, port + BUS_OFFSET))
        return port
    raise h.HarnessError("no free port pair for a cluster node")


@dataclass
class NodeView:
    """One line of `CLUSTER NODES`."""
    id: str
    port: int
    flags: set[str]
    master_id: str | None
    slots: list[tuple[int, int]]

    @property
    def is_master(self) -> bool:
        return "master" in self.flags

    @property
    def failed(self) -> bool:
        return "fail" in self.flags or "fail?" in self.flags

    def owns(self, slot: int) -> bool:
        return any(lo <= slot <= hi for lo, hi in self.slots)


def parse_nodes(raw: str) -> list[NodeView]:
    out = []
    for line in raw.splitlines():
        parts = line.split()
        if len(parts) < 8:
            continue
        addr = parts[1].split("@", 1)[0]
        port = int(addr.rsplit(":", 1)[1]) if ":" in addr else 0
        slots = []
        for s in parts[8:]:
            if s.startswith("["):
                continue  # migrating / importing marker
            lo, _, hi = s.partition("-")
            slots.append((int(lo), int(hi or lo)))
        out.append(NodeView(parts[0], port, set(parts[2].split(",")),
                            None if parts[3] == "-" else parts[3], slots))
    return out


@dataclass
class RedisCluster:
    run_dir: Path
    nodes: dict[int, h.Proc] = field(default_factory=dict)   # port -> process
    tls: RedisTls | None = None
    killed: dict[int, float] = field(default_factory=dict)   # port -> time.monotonic() of the kill
    # What a master served and who replicated it, remembered before it is killed.
    _slots_before_kill: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    _replicas_before_kill: dict[int, list[int]] = field(default_factory=dict)

    # --- addressing ---------------------------------------------------------------------

    @property
    def ports(self) -> list[int]:
        return list(self.nodes)

    def alive_ports(self) -> list[int]:
        return [p for p, proc in self.nodes.items() if proc.alive() and p not in self.killed]

    def urls(self, user: str | None = None) -> list[str]:
        """Every node, as idemstore's `--redis-cluster` takes them (`rediss://` over TLS)."""
        scheme = "rediss" if self.tls is not None else "redis"
        at = f"{user}@" if user else ""
        return [f"{scheme}://{at}{h.LOOPBACK}:{p}" for p in self.ports]

    def procs(self) -> list[h.Proc]:
        return list(self.nodes.values())

    # --- topology -----------------------------------------------------------------------

    def view(self, port: int | None = None) -> list[NodeView]:
        """`CLUSTER NODES` as node `port` (else the first live node) sees it."""
        return parse_nodes(text(port or self.alive_ports()[0], "CLUSTER", "NODES"))

    def masters(self, port: int | None = None) -> list[NodeView]:
        """Masters that serve slots and are not flagged failed, by port."""
        return sorted((n for n in self.view(port) if n.is_master and n.slots and not n.failed),
                      key=lambda n: n.port)

    def master_ports(self) -> list[int]:
        return [n.port for n in self.masters()]

    def master_of_slot(self, slot: int, port: int | None = None) -> int:
        for n in self.masters(port):
            if n.owns(slot):
                return n.port
        raise h.HarnessError(f"no live master serves slot {slot}")

    def master_of_key(self, key: str | bytes) -> int:
        return self.master_of_slot(key_slot(key))

    def slots_of(self, port: int) -> list[tuple[int, int]]:
        for n in self.view():
            if n.port == port:
                return list(n.slots)
        raise h.HarnessError(f"node {port} unknown to the cluster")

    def replica_of(self, master_port: int) -> list[int]:
        view = self.view()
        ids = {n.id: n.port for n in view}
        master_id = next(n.id for n in view if n.port == master_port)
        return [n.port for n in view if n.master_id == master_id and ids.get(n.master_id) == master_port]

    def info(self, port: int, section: str = "cluster") -> dict[str, str]:
        if section == "cluster":
            return info_fields(text(port, "CLUSTER", "INFO"))
        return info_fields(text(port, "INFO", section))

    # --- readiness ----------------------------------------------------------------------

    def healthy(self, expect_nodes: int | None = None) -> bool:
        """Every live node: cluster_state ok, all slots ok, knows `expect_nodes` nodes; every
        live replica's link to its master up."""
        for port in self.alive_ports():
            ci = self.info(port)
            if ci.get("cluster_state") != "ok" or ci.get("cluster_slots_ok") != str(SLOTS):
                return False
            if expect_nodes is not None and ci.get("cluster_known_nodes") != str(expect_nodes):
                return False
            rep = self.info(port, "replication")
            if rep.get("role") == "slave" and rep.get("master_link_status") != "up":
                return False
        return True

    def wait_healthy(self, timeout: float = 30.0, expect_nodes: int | None = None) -> float:
        t0 = time.monotonic()
        h.wait_for(lambda: self.healthy(expect_nodes), "redis cluster healthy", timeout=timeout, interval=0.1)
        return time.monotonic() - t0

    def config_set(self, name: str, value: str) -> None:
        """CONFIG SET on every live node (e.g. `cluster-require-full-coverage no`)."""
        for port in self.alive_ports():
            command(port, "CONFIG", "SET", name, value)

    # --- fault injection ----------------------------------------------------------------

    def kill(self, port: int) -> float:
        """SIGKILL node `port` by PID (its slots and replicas remembered first, for
        `wait_failover`); returns time.monotonic() right after the signal."""
        if port not in self._slots_before_kill:
            self.prepare_kill(port)
        proc = self.nodes[port]
        proc.popen.kill()
        t = time.monotonic()
        proc.kill()  # reaps, marks stopped
        self.killed[port] = t
        return t

    def wait_failover(self, dead_port: int, timeout: float = 30.0, interval: float = 0.05) -> float:
        """Until every live node sees `dead_port` failed, one of its former replicas a master
        serving all of its slots, and says cluster_state:ok; returns seconds since the kill."""
        killed_at = self.killed[dead_port]
        slots = self.slots_of_dead(dead_port)
        replicas = set(self._replicas_before_kill.get(dead_port, []))

        def done() -> bool:
            for port in self.alive_ports():
                if self.info(port).get("cluster_state") != "ok":
                    return False
                view = self.view(port)
                dead = [n for n in view if n.port == dead_port]
                if not dead or "fail" not in dead[0].flags:
                    return False
                promoted = [n for n in view if n.port in replicas and n.is_master and not n.failed]
                if not promoted or not all(any(n.owns(lo) and n.owns(hi) for n in promoted) for lo, hi in slots):
                    return False
            return True

        h.wait_for(done, f"failover of redis master {dead_port}", timeout=timeout, interval=interval)
        return time.monotonic() - killed_at

    def slots_of_dead(self, port: int) -> list[tuple[int, int]]:
        return self._slots_before_kill[port]

    def prepare_kill(self, port: int) -> None:
        """Remembers `port`'s slots and replicas (what `wait_failover` checks once it is dead)."""
        self._slots_before_kill[port] = self.slots_of(port)
        self._replicas_before_kill[port] = self.replica_of(port)

    # --- replication --------------------------------------------------------------------

    def wait_replicated(self, master_port: int, timeout_ms: int = 5000) -> int:
        """`WAIT 1 timeout_ms` on the master: blocks until a replica acknowledged every write
        the master had taken so far (on any connection). Returns the replicas that did."""
        acked = command(master_port, "WAIT", 1, timeout_ms, timeout=timeout_ms / 1000 + 2)
        if acked < 1:
            raise h.HarnessError(f"no replica of {master_port} caught up within {timeout_ms} ms")
        return acked

    def store_keys(self, port: int, pattern: str = "idem:*") -> list[str]:
        """Keys matching `pattern` held by node `port` (KEYS: test data only)."""
        return [k.decode() for k in command(port, "KEYS", pattern, timeout=5)]

    def get(self, key: str) -> bytes | None:
        """GET on the master that serves `key`."""
        return command(self.master_of_key(key), "GET", key)

    # --- lifecycle ----------------------------------------------------------------------

    def stop(self) -> None:
        for proc in self.procs():
            proc.stop(timeout=5)

    def describe(self) -> str:
        try:
            return text(self.alive_ports()[0], "CLUSTER", "NODES")
        except (OSError, IndexError, RedisError) as e:
            return f"<no cluster view: {e!r}>"


def redis_cli_bin() -> str:
    server = Path(h.redis_bin())
    sibling = server.with_name("redis-cli")
    if sibling.exists():
        return str(sibling)
    found = shutil.which("redis-cli")
    if not found:
        raise h.HarnessError("redis-cli not found (it comes with redis-server)")
    return found


def start_cluster(run_dir: Path, masters: int = 3, replicas: int = 1, timeout: float = 30.0,
                  tls: RedisTls | None = None) -> RedisCluster:
    """Start `masters * (1 + replicas)` cluster nodes, join them, wait until healthy; with `tls`
    on TLS ports only (clients, the cluster bus and replication). On any failure everything
    started is stopped before the error is raised."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cluster = RedisCluster(run_dir, tls=tls)
    count = masters * (1 + replicas)
    try:
        for _ in range(count):
            port = cluster_port()
            data = run_dir / f"node-{port}"
            data.mkdir(parents=True, exist_ok=True)
            if tls is None:
                listen = ["--port", str(port)]
            else:
                # The bus port of a TLS cluster is the TLS port + 10000, as cluster_port() keeps free.
                listen = tls.server_args(port) + tls.cluster_args()
                serve_access(port, tls.access())
            argv = [h.redis_bin(), *listen, "--bind", h.LOOPBACK, "--protected-mode", "no",
                    "--daemonize", "no", "--dir", str(data),
                    "--cluster-enabled", "yes", "--cluster-config-file", str(data / f"nodes-{port}.conf"),
                    "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                    "--appendonly", "no", "--save", "",
                    # A replica syncs at once (default: the master waits 5 s for more replicas).
                    "--repl-diskless-sync-delay", "0"]
            cluster.nodes[port] = h.start(f"redis-node-{port}", argv, run_dir)
        for port, proc in cluster.nodes.items():
            h.wait_for(lambda p=port: ping(p), f"redis node {port} PING", proc, timeout=timeout)
        create = [redis_cli_bin(), *(tls.cli_args() if tls else []),
                  "--cluster", "create", *(f"{h.LOOPBACK}:{p}" for p in cluster.ports),
                  "--cluster-replicas", str(replicas), "--cluster-yes"]
        out = subprocess.run(create, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
        (run_dir / "cluster-create.log").write_bytes(b"$ " + " ".join(create).encode() + b"\n" + out.stdout + out.stderr)
        if out.returncode != 0:
            raise h.HarnessError(f"redis-cli --cluster create failed ({out.returncode}):\n"
                                 f"{out.stdout.decode(errors='replace')[-2000:]}{out.stderr.decode(errors='replace')[-2000:]}")
        cluster.wait_healthy(timeout, expect_nodes=count)
        roles = [n for n in cluster.view() if n.is_master and n.slots]
        if len(roles) != masters:
            raise h.HarnessError(f"want {masters} masters, cluster has:\n{cluster.describe()}")
    except BaseException:
        cluster.stop()
        raise
    return cluster


def spawn_idemstore(run_dir: Path, urls: list[str], name: str = "idemstore",
                    port: int | None = None) -> tuple[h.Proc, int]:
    """idemstore on `--redis-cluster` (comma-separated seeds), not waited for
    (`harness.await_idemstore`)."""
    port = port or h.free_port()
    argv = [h.idemstore_bin(), "--listen", f"{h.LOOPBACK}:{port}", "--redis-cluster", ",".join(urls)]
    proc = h.start(name, argv, run_dir, env={"RUST_LOG": os.environ.get("IDEMSTORE_LOG", "info")})
    return proc, port
