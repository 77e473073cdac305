"""A real Redis Sentinel setup on loopback for the end-to-end suite (stdlib only).

One master, one replica (`replicaof` the master) and three sentinels (`redis-server
<sentinel.conf> --sentinel`; Debian ships no `redis-sentinel` binary), each in its own folder
under the run directory. Every node and every sentinel requires the same password
(`requirepass`): the replica and a returning master authenticate with `masterauth`, the
sentinels to the nodes with `sentinel auth-pass` and to each other with `sentinel
sentinel-pass`, so AUTH is on every link idemstore and the sentinels use. The password is in
the config files and a password file (`password_file`, mode 0600), never on a command line.

Each sentinel monitors the master as `name` with quorum 2, `down-after-milliseconds`
`DOWN_AFTER_MS` and `failover-timeout` `FAILOVER_TIMEOUT_MS`. `start_sentinels` returns once all
three agree on the master, see the replica linked and each other (polled, bounded).

    s = sentinel.start_sentinels(run_dir / "sentinel")
    try:
        old = s.first_master
        s.wait_replicated(old)                  # WAIT 1: the replica has every write so far
        s.kill(old)                             # SIGKILL by PID
        new, took = s.wait_failover(old)        # the replica promoted, every sentinel says so
        s.restart(old, replicaof=new)           # back, as a replica (or `s.failover()`: manual)
        s.wait_settled(new, [old])
    finally:
        s.stop()

Processes are the harness's (`harness.start`, stopped by PID); commands go over the RESP2
client of `redis_cluster.py` with AUTH first (`command(port, password, ...)`).

Over TLS: `start_sentinels(..., tls=redis_cluster.RedisTls(...))` (`secure.material(...)`'s
`redis_tls()`: the CA, redis-server's certificate, the tests' admin certificate) runs every node
and every sentinel on a TLS port only (`port 0`, `tls-port`), client certificates required
(`tls-auth-clients yes`, unless `auth_clients` is False) and `tls-replication yes`: the replica
replicates, and the sentinels reach the nodes and each other, over TLS with redis-server's own
certificate as their client certificate (it has server and client usage). The password is
`tls.password` unless one is given. Every port is registered with
`redis_cluster.serve_access`, and `SentinelSet.cmd` connects over TLS with the admin
certificate and AUTH, so every helper here works the same on either; `sentinel_addrs("rediss")`
is idemstore's `--redis-sentinel`.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import harness as h
from . import redis_cluster as rc
from .redis_cluster import RedisError, RedisTls, _encode, _Reader, info_fields

MASTER_NAME = "idem-master"
# Not 1000: a sentinel pings and reconnects at most once a second (its ping period), and the
# link to a newly promoted master starts its down-after clock at the switch while the next
# reconnect may be up to a second away (it reuses the last failed reconnect's time to the dead
# master). With 1000 ms a sentinel now and then flags the new master down just after a failover;
# the other sentinels' votes from that failover still count for a few seconds, so that is at
# once an objective down and a second failover, to whatever replica there is (seen: back to a
# master restarted a second earlier). 1500 ms leaves the reconnect its margin.
DOWN_AFTER_MS = 1500
FAILOVER_TIMEOUT_MS = 5000
QUORUM = 2


# --------------------------------------------------------------------------------------------
# RESP with AUTH
# --------------------------------------------------------------------------------------------


def command(port: int, password: str | None, *args, timeout: float = 2.0, host: str = h.LOOPBACK,
            username: str | None = None):
    """One command on a fresh connection, `AUTH` first when a password is given (pipelined);
    bulk strings come back as bytes, an error reply raises `RedisError`, a dead node `OSError`."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.settimeout(timeout)
        payload = b""
        if password is not None:
            auth = ("AUTH", username, password) if username else ("AUTH", password)
            payload += _encode(auth)
        s.sendall(payload + _encode(args))
        reader = _Reader(s)
        if password is not None:
            ok = reader.reply()
            if isinstance(ok, RedisError):
                raise ok
        reply = reader.reply()
    if isinstance(reply, RedisError):
        raise reply
    return reply


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def pairs(flat) -> dict[str, str]:
    """A RESP2 flat list `[k1, v1, k2, v2, ...]` (SENTINEL MASTER) as a dict of strings."""
    items = [_text(x) for x in flat or []]
    return dict(zip(items[0::2], items[1::2]))


# --------------------------------------------------------------------------------------------
# the topology
# --------------------------------------------------------------------------------------------


@dataclass
class Node:
    """One redis-server of the monitored pair, restartable on its port and folder."""
    port: int
    folder: Path
    conf: Path
    proc: h.Proc | None = None


@dataclass
class SentinelSet:
    run_dir: Path
    password: str
    password_file: Path
    name: str = MASTER_NAME
    nodes: dict[int, Node] = field(default_factory=dict)            # port -> node (master, replica)
    sentinels: dict[int, h.Proc] = field(default_factory=dict)      # port -> sentinel process
    killed: dict[int, float] = field(default_factory=dict)          # port -> time.monotonic() of the kill
    first_master: int = 0
    first_replica: int = 0
    tls: RedisTls | None = None             # TLS only, every node and sentinel (None: plain TCP)
    access: rc.Access | None = None         # how `cmd` connects with TLS: the admin certificate, AUTH

    # --- addressing ---------------------------------------------------------------------

    @property
    def sentinel_ports(self) -> list[int]:
        return list(self.sentinels)

    def sentinel_addrs(self, scheme: str | None = None) -> str:
        """`--redis-sentinel`'s value: `127.0.0.1:P,...`, or `redis://127.0.0.1:P,...` with a scheme."""
        prefix = f"{scheme}://" if scheme else ""
        return ",".join(f"{prefix}{h.LOOPBACK}:{p}" for p in self.sentinel_ports)

    def node_ports(self) -> list[int]:
        return list(self.nodes)

    def alive_nodes(self) -> list[int]:
        return [p for p, n in self.nodes.items() if n.proc is not None and n.proc.alive()]

    def procs(self) -> list[h.Proc]:
        out = [n.proc for n in self.nodes.values() if n.proc is not None]
        return out + list(self.sentinels.values())

    # --- commands -----------------------------------------------------------------------

    def cmd(self, port: int, *args, timeout: float = 2.0):
        """A command to a node or a sentinel (all share the password; over TLS with the tests'
        admin certificate when the set runs on TLS)."""
        if self.access is not None:
            return rc.command(port, *args, timeout=timeout, access=self.access)
        return command(port, self.password, *args, timeout=timeout)

    def info(self, port: int, section: str = "replication") -> dict[str, str]:
        return info_fields(_text(self.cmd(port, "INFO", section)))

    def role(self, port: int) -> str:
        """`master` or `slave`, from ROLE."""
        return _text(self.cmd(port, "ROLE")[0])

    def master_addr(self, sentinel_port: int) -> tuple[str, int] | None:
        """SENTINEL GET-MASTER-ADDR-BY-NAME as one sentinel answers it."""
        reply = self.cmd(sentinel_port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.name)
        if not reply:
            return None
        return _text(reply[0]), int(reply[1])

    def reported_masters(self) -> dict[int, int | None]:
        """Sentinel port -> the master port it reports (None: it does not answer)."""
        out = {}
        for sp in self.sentinel_ports:
            try:
                addr = self.master_addr(sp)
                out[sp] = addr[1] if addr else None
            except (OSError, RedisError):
                out[sp] = None
        return out

    def master_state(self, sentinel_port: int) -> dict[str, str]:
        return pairs(self.cmd(sentinel_port, "SENTINEL", "MASTER", self.name))

    def replicas_seen(self, sentinel_port: int) -> list[dict[str, str]]:
        return [pairs(r) for r in self.cmd(sentinel_port, "SENTINEL", "REPLICAS", self.name)]

    def sentinels_seen(self, sentinel_port: int) -> list[dict[str, str]]:
        return [pairs(r) for r in self.cmd(sentinel_port, "SENTINEL", "SENTINELS", self.name)]

    # --- readiness ----------------------------------------------------------------------

    def agreed_master(self) -> int | None:
        """The master port every sentinel reports, if they agree, else None."""
        seen = set(self.reported_masters().values())
        if len(seen) == 1:
            (port,) = seen
            return port
        return None

    def settled(self, master: int, replicas: list[int]) -> bool:
        """`master` is master by its own ROLE and by every sentinel's view (flags exactly
        `master`: neither s_down nor o_down, no failover in progress), each `replicas` node is
        linked to it (INFO: master_link_status up) and every sentinel sees it as a healthy
        replica (flags `slave`, master-link-status ok) and the other two sentinels (neither
        down nor disconnected)."""
        if self.role(master) != "master":
            return False
        for rp in replicas:
            rep = self.info(rp)
            if rep.get("role") != "slave" or rep.get("master_port") != str(master) \
                    or rep.get("master_link_status") != "up":
                return False
        for sp in self.sentinel_ports:
            state = self.master_state(sp)
            if int(state.get("port", 0)) != master or state.get("flags") != "master":
                return False
            seen = {int(r["port"]): r for r in self.replicas_seen(sp)}
            for rp in replicas:
                r = seen.get(rp)
                if r is None or r.get("flags") != "slave" or r.get("master-link-status") != "ok" \
                        or int(r.get("master-port", 0)) != master:
                    return False
            # (`master_down`, this sentinel's memory of the other's vote in the last failover,
            # lingers for seconds after it: not a fault.)
            others = [s for s in self.sentinels_seen(sp)
                      if not set(s.get("flags", "").split(",")) - {"sentinel", "master_down"}]
            if len(others) != len(self.sentinels) - 1:
                return False
        return True

    def wait_settled(self, master: int, replicas: list[int], timeout: float = 30.0) -> float:
        """Polls `settled`; returns the seconds it took."""
        t0 = time.monotonic()
        h.wait_for(lambda: self.settled(master, replicas), f"sentinels settled on master {master}",
                   timeout=timeout, interval=0.1)
        return time.monotonic() - t0

    def describe(self) -> str:
        lines = []
        for sp in self.sentinel_ports:
            try:
                st = self.master_state(sp)
                reps = [(r.get("port"), r.get("flags"), r.get("master-link-status")) for r in self.replicas_seen(sp)]
                sents = [(s.get("port"), s.get("flags")) for s in self.sentinels_seen(sp)]
                lines.append(f"sentinel {sp}: master {st.get('port')} flags {st.get('flags')} "
                             f"failover-state {st.get('failover-state')}; replicas {reps}; sentinels {sents}")
            except (OSError, RedisError) as e:
                lines.append(f"sentinel {sp}: {e!r}")
        for port in self.node_ports():
            try:
                rep = self.info(port)
                lines.append(f"node {port}: role {rep.get('role')} master_port {rep.get('master_port', '-')} "
                             f"link {rep.get('master_link_status', '-')} "
                             f"connected_slaves {rep.get('connected_slaves', '-')}")
            except (OSError, RedisError) as e:
                lines.append(f"node {port}: {e!r}")
        return "\n".join(lines)

    # --- fault injection ----------------------------------------------------------------

    def kill(self, port: int) -> float:
        """SIGKILL node `port` by PID; returns time.monotonic() right after the signal."""
        proc = self.nodes[port].proc
        assert proc is not None and proc.alive(), f"node {port} is not running"
        proc.popen.kill()
        t = time.monotonic()
        proc.kill()  # reaps, marks stopped
        self.killed[port] = t
        return t

    def promoted(self, dead_port: int) -> int | None:
        """The new master once every sentinel reports the same one, not `dead_port`, and that
        node's ROLE says master; else None."""
        port = self.agreed_master()
        if port is None or port == dead_port:
            return None
        try:
            return port if self.role(port) == "master" else None
        except (OSError, RedisError):
            return None

    def wait_failover(self, dead_port: int, timeout: float = 30.0, interval: float = 0.02) -> tuple[int, float]:
        """Until a replica of `dead_port` is master by its ROLE and every sentinel reports it;
        returns (its port, seconds since the kill)."""
        killed_at = self.killed[dead_port]
        port = h.wait_for(lambda: self.promoted(dead_port), f"sentinel failover away from {dead_port}",
                          timeout=timeout, interval=interval)
        return port, time.monotonic() - killed_at

    def failover(self) -> None:
        """`SENTINEL FAILOVER`: a manual failover (the master stays up and is demoted)."""
        reply = self.cmd(self.sentinel_ports[0], "SENTINEL", "FAILOVER", self.name)
        if reply != "OK":
            raise h.HarnessError(f"SENTINEL FAILOVER answered {reply!r}")

    def restart(self, port: int, replicaof: int | None = None, timeout: float = 20.0) -> h.Proc:
        """Starts node `port` again (its folder and config file; no data: no persistence),
        optionally `--replicaof 127.0.0.1 <replicaof>`; waits for PING."""
        node = self.nodes[port]
        extra = ["--replicaof", h.LOOPBACK, str(replicaof)] if replicaof else []
        node.proc = _start_node(self.run_dir, node, extra)
        h.await_ready(node.proc, lambda: self.cmd(port, "PING") == "PONG", f"redis node {port} PING", timeout)
        self.killed.pop(port, None)
        return node.proc

    # --- replication and data -----------------------------------------------------------

    def wait_replicated(self, master_port: int, timeout_ms: int = 1000) -> int:
        """`WAIT 1 timeout_ms` on the master: until a replica acknowledged every write the
        master had taken so far. Returns the replicas that did."""
        acked = self.cmd(master_port, "WAIT", 1, timeout_ms, timeout=timeout_ms / 1000 + 2)
        if acked < 1:
            raise h.HarnessError(f"no replica of {master_port} caught up within {timeout_ms} ms")
        return acked

    def keys(self, port: int, pattern: str = "idem:*") -> list[str]:
        """Keys matching `pattern` on node `port` (KEYS: test data only)."""
        return [k.decode() for k in self.cmd(port, "KEYS", pattern, timeout=5)]

    # --- lifecycle ----------------------------------------------------------------------

    def stop(self) -> None:
        """Sentinels first (no failover while the nodes go), then the nodes, by PID."""
        for proc in self.sentinels.values():
            proc.stop(timeout=5)
        for node in self.nodes.values():
            if node.proc is not None:
                node.proc.stop(timeout=5)


def _start_node(run_dir: Path, node: Node, extra: list[str]) -> h.Proc:
    argv = [h.redis_bin(), str(node.conf), *extra]
    return h.start(f"redis-{node.port}", argv, run_dir)


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _listen(port: int, tls: RedisTls | None) -> list[str]:
    """The config lines for where a node or sentinel listens: `port`, or with `tls` that port on
    TLS only (plain port 0), client certificates as `tls.auth_clients` says, and the outgoing
    links (replication; a sentinel's to the nodes and the other sentinels) over TLS too."""
    if tls is None:
        return [f"port {port}"]
    return [
        "port 0",
        f"tls-port {port}",
        f'tls-cert-file "{tls.cert}"',
        f'tls-key-file "{tls.key}"',
        f'tls-ca-cert-file "{tls.ca}"',
        f"tls-auth-clients {'yes' if tls.auth_clients else 'no'}",
        "tls-replication yes",
    ]


def _node_conf(node: Node, password: str, tls: RedisTls | None = None) -> str:
    return "\n".join([
        *_listen(node.port, tls),
        f"bind {h.LOOPBACK}",
        "protected-mode no",
        "daemonize no",
        f'dir "{node.folder}"',
        'save ""',
        "appendonly no",
        f'requirepass "{password}"',
        f'masterauth "{password}"',
        # A replica syncs at once (default: the master waits 5 s for more replicas).
        "repl-diskless-sync-delay 0",
        "",
    ])


def _sentinel_conf(port: int, folder: Path, name: str, master_port: int, password: str,
                   down_after_ms: int, failover_timeout_ms: int, tls: RedisTls | None = None) -> str:
    return "\n".join([
        # (Over TLS a sentinel announces its TLS port to the others: `tls-replication yes`.)
        *_listen(port, tls),
        f"bind {h.LOOPBACK}",
        "protected-mode no",
        "daemonize no",
        f'dir "{folder}"',
        # The sentinel's own clients (idemstore, the tests, the other sentinels) authenticate.
        f'requirepass "{password}"',
        f'sentinel sentinel-pass "{password}"',
        f"sentinel monitor {name} {h.LOOPBACK} {master_port} {QUORUM}",
        f'sentinel auth-pass {name} "{password}"',
        f"sentinel down-after-milliseconds {name} {down_after_ms}",
        f"sentinel failover-timeout {name} {failover_timeout_ms}",
        f"sentinel parallel-syncs {name} 1",
        "",
    ])


def start_sentinels(run_dir: Path, name: str = MASTER_NAME, password: str | None = None,
                    down_after_ms: int = DOWN_AFTER_MS, failover_timeout_ms: int = FAILOVER_TIMEOUT_MS,
                    sentinels: int = 3, timeout: float = 30.0, settle: bool = True,
                    tls: RedisTls | None = None) -> SentinelSet:
    """Master, replica and `sentinels` sentinels, started and awaited (`SentinelSet.settled`;
    `settle=False`: only until each answers PING and names the master, so that the caller can
    start its clients while the sentinels find each other, about 2 s, then `wait_settled`).
    With `tls`, everything on TLS only (see the module's docstring). On any failure everything
    started is stopped before the error is raised."""
    run_dir.mkdir(parents=True, exist_ok=True)
    password = password or (tls.password if tls is not None else None) or f"pw-{os.urandom(12).hex()}"
    password_file = run_dir / "redis-password"
    _write_private(password_file, password + "\n")
    s = SentinelSet(run_dir, password, password_file, name)
    if tls is not None:
        s.tls = tls
        s.access = dataclasses.replace(tls.access(), password=password)
    try:
        for _ in range(2):
            port = h.free_port()
            folder = run_dir / f"node-{port}"
            folder.mkdir(parents=True, exist_ok=True)
            node = Node(port, folder, folder / "redis.conf")
            _write_private(node.conf, _node_conf(node, password, tls))
            s.nodes[port] = node
            if s.access is not None:
                rc.serve_access(port, s.access)
        s.first_master, s.first_replica = list(s.nodes)
        s.nodes[s.first_master].proc = _start_node(run_dir, s.nodes[s.first_master], [])
        s.nodes[s.first_replica].proc = _start_node(run_dir, s.nodes[s.first_replica],
                                                    ["--replicaof", h.LOOPBACK, str(s.first_master)])
        for port, node in s.nodes.items():
            h.wait_for(lambda p=port: s.cmd(p, "PING") == "PONG", f"redis node {port} PING", node.proc,
                       timeout=timeout)
        # The replica linked before the sentinels start: their first INFO of the master lists it.
        h.wait_for(lambda: s.info(s.first_replica).get("master_link_status") == "up",
                   "replica linked to the master", s.nodes[s.first_replica].proc, timeout=timeout)
        for _ in range(sentinels):
            port = h.free_port()
            folder = run_dir / f"sentinel-{port}"
            folder.mkdir(parents=True, exist_ok=True)
            conf = folder / "sentinel.conf"   # sentinels rewrite their config: writable, their own
            _write_private(conf, _sentinel_conf(port, folder, name, s.first_master, password,
                                                down_after_ms, failover_timeout_ms, tls))
            if s.access is not None:
                rc.serve_access(port, s.access)
            s.sentinels[port] = h.start(f"sentinel-{port}", [h.redis_bin(), str(conf), "--sentinel"], run_dir)
        for port, proc in s.sentinels.items():
            h.wait_for(lambda p=port: s.master_addr(p) == (h.LOOPBACK, s.first_master), f"sentinel {port} up",
                       proc, timeout=timeout)
        if settle:
            s.wait_settled(s.first_master, [s.first_replica], timeout=timeout)
    except BaseException:
        s.stop()
        raise
    return s
