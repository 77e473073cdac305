"""Process and HTTP plumbing for the end-to-end suite (stdlib only).

Processes are started in their own process group with their output in log files under the
run directory, waited for by polling with a deadline, and stopped by PID (terminate, then kill
after a timeout). Nothing here ever kills by name.
"""

from __future__ import annotations

import atexit
import http.client
import itertools
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent  # tests/support/: these helpers and the helper scripts
TESTS = SUPPORT.parent
ROOT = TESTS.parent
LOOPBACK = "127.0.0.1"

_LIVE: list["Proc"] = []
_LIVE_LOCK = threading.Lock()
# The log of every Envoy started through `start` in this process (the session's panic check).
_ENVOY_LOGS: list[Path] = []
_BASE_IDS = itertools.count(int(os.environ.get("IDEM_TEST_BASE_ID", "0")) or (os.getpid() % 20000) * 10 + 1000)


class HarnessError(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------
# ports and artifacts
# --------------------------------------------------------------------------------------------

_used_ports: set[int] = set()


def free_port(host: str = LOOPBACK) -> int:
    """A loopback port that was free a moment ago (bind to port 0, read, close)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _used_ports:
            _used_ports.add(port)
            return port
    raise HarnessError("no free port")


def artifact(env: str, default: Path | str, what: str) -> str:
    value = os.environ.get(env) or str(default)
    path = Path(value)
    if not path.is_absolute():
        path = ROOT / path
    if not path.exists():
        raise HarnessError(f"{what} not found at {path} (set {env}, or run `make build` / `make envoy`)")
    return str(path)


def envoy_bin() -> str:
    return artifact("ENVOY_BIN", ".tools/envoy-1.40.0/envoy/_bin/envoy", "envoy binary")


def wasm_path() -> str:
    return artifact("FILTER_WASM", "target/wasm32-wasip1/release/idempotency_filter.wasm", "filter wasm")


def native_module() -> str:
    """The native host, `libidempotency_filter.so` (an Envoy dynamic module; `make build`)."""
    return artifact("FILTER_MODULE", "target/release/libidempotency_filter.so", "filter dynamic module")


def native_env() -> dict[str, str]:
    """What an Envoy that loads the native host needs: the module's folder to search."""
    return {"ENVOY_DYNAMIC_MODULES_SEARCH_PATH": str(Path(native_module()).parent)}


def native_filter(config: dict | str, name: str = "idempotency") -> dict:
    """The native host as an HTTP filter, with `config` (the same JSON as the wasm filter's) as
    its `filter_config`. Its metrics are `idempotency.<name>` (the module's namespace)."""
    value = config if isinstance(config, str) else json.dumps(config)
    return {
        "name": "idempotency",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
            "dynamic_module_config": {"name": "idempotency_filter", "do_not_close": True,
                                      "metrics_namespace": "idempotency"},
            "filter_name": name,
            "filter_config": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": value},
        },
    }


def idemstore_bin() -> str:
    return artifact("IDEMSTORE_BIN", "target/release/idemstore", "idemstore binary")


# --------------------------------------------------------------------------------------------
# the host the suite runs the filter in (IDEM_HOST)
# --------------------------------------------------------------------------------------------

HOSTS = ("wasm", "native")
WASM_FILTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
MODULE_FILTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter"
# The reason of every skip of a test that checks idemstore itself (its metrics, logs, `/v1`).
NO_IDEMSTORE = "native host: no idemstore in the path"


def host() -> str:
    """The host the suite's filters run in (`IDEM_HOST`): `wasm` (the default: the filter in
    Envoy's V8, its store idemstore, reached through the store cluster) or `native` (the
    dynamic module, `native_filter`, with the store in Envoy's process). Under `native`,
    `wasm_filter` builds the module's filter, every Envoy launched here gets `native_env()`, a
    plugin configuration's `store_cluster` becomes the `store` of the idemstore that cluster
    points at (`for_native`), and `Envoy.counter`/`counters` read `idempotency.<name>`."""
    value = os.environ.get("IDEM_HOST") or "wasm"
    if value not in HOSTS:
        raise ValueError(f"IDEM_HOST={value!r}: one of {', '.join(HOSTS)}")
    if value == "native" and store_transport() == "callout":
        raise ValueError("IDEM_HOST=native with IDEM_STORE_TRANSPORT=callout: the native host has no store "
                         "transport (its store runs in Envoy's process)")
    return value


def native() -> bool:
    return host() == "native"


def skip(reason: str):
    """pytest.skip, for the harness's own skips (pytest is imported only when one happens)."""
    import pytest

    pytest.skip(reason)


def skip_on_native(reason: str) -> None:
    """Skips the calling test (or fixture) under IDEM_HOST=native; `reason` starts `native host:`."""
    if native():
        skip(reason if reason.startswith("native host") else f"native host: {reason}")


def filter_stat_prefix() -> str:
    """The filter's counters' prefix in /stats: `wasmcustom.idempotency.` (the wasm filter's
    custom metrics) or `idempotency.` (the module's `metrics_namespace`)."""
    return "idempotency." if native() else "wasmcustom.idempotency."


def filter_stats_regex() -> str:
    """A /stats filter matching the filter's counters and nothing else."""
    return "^" + re.escape(filter_stat_prefix())


def filter_stat(name: str) -> str:
    return filter_stat_prefix() + name


def filter_name() -> str:
    """The `name` the suite's filter has in `http_filters` (what `typed_per_filter_config` keys on)."""
    return "idempotency" if native() else "envoy.filters.http.wasm"


def filter_log_component() -> str:
    """The Envoy log component of the filter's lines: `wasm`, or `dynamic_modules` (the
    module's lines, each prefixed `idempotency:`)."""
    return "dynamic_modules" if native() else "wasm"


def is_filter_log_line(line: str) -> bool:
    """A log line of the filter (on the wasm host: any line mentioning wasm, as Envoy's own
    lines about the plugin do)."""
    if native():
        return "[dynamic_modules]" in line and "idempotency:" in line
    return "wasm" in line.lower()


# The `subject.property` paths the native host reads (src/host/native/view.rs `attribute`).
NATIVE_ATTRIBUTES = {
    ("xds", "route_name"), ("xds", "cluster_name"), ("response", "code_details"), ("response", "code"),
    ("upstream", "request_attempt_count"), ("upstream", "local_address"), ("upstream", "address"),
    ("source", "address"), ("destination", "address"), ("request", "id"), ("request", "path"),
    ("connection", "requested_server_name"), ("connection", "uri_san_peer_certificate"),
    ("connection", "subject_peer_certificate"), ("connection", "dns_san_peer_certificate"),
}


def native_refusal(cfg) -> str | None:
    """Why the native host refuses the plugin configuration `cfg` at load, as
    src/host/native/module.rs `unsupported` does (docs/native.md, "Not yet"), or None."""
    if not isinstance(cfg, dict):
        return None
    routes = cfg.get("routes") if isinstance(cfg.get("routes"), dict) else {}
    for route, c in [("", cfg)] + [(r, p) for r, p in routes.items() if isinstance(p, dict)]:
        at = f" (route {route!r})" if route else ""
        subject = c.get("subject") if isinstance(c.get("subject"), dict) else {}
        what = None
        if "metadata" in subject:
            what = "`subject.metadata`"
        elif "property" in subject and tuple(subject["property"] or ()) not in NATIVE_ATTRIBUTES:
            what = f"`subject.property` {subject['property']}"
        elif c.get("detached_execution") is True:
            what = "`detached_execution`"
        elif c.get("outcome_lookup") is not None:
            what = "`outcome_lookup`"
        if what:
            return f"native host: refuses {what}{at} at load (docs/native.md, Not yet)"
    return None


# idemstore's flags -> the native host's `store` keys (docs/native.md, "The `store` key").
_STORE_FLAGS = {
    "--redis": "redis", "--redis-cluster": "redis_cluster", "--redis-sentinel": "redis_sentinel",
    "--redis-sentinel-master": "sentinel_master", "--redis-ca-file": "ca_file",
    "--redis-cert-file": "cert_file", "--redis-key-file": "key_file", "--redis-username": "username",
    "--redis-password-file": "password_file", "--redis-sentinel-username": "sentinel_username",
    "--redis-sentinel-password-file": "sentinel_password_file", "--key-prefix": "key_prefix",
    "--redis-timeout-ms": "timeout_ms", "--memory-max-keys": "memory_max_keys",
    "--memory-max-bytes": "memory_max_bytes",
}
_LIST_KEYS = {"redis_cluster", "redis_sentinel"}
_INT_KEYS = {"timeout_ms", "memory_max_keys", "memory_max_bytes"}
# idemstore's own service (its listener's TLS, its secret, its threads): nothing of the store.
_SERVICE_FLAGS = {"--listen", "--tls-cert-file", "--tls-key-file", "--tls-client-ca-file", "--secret",
                  "--secret-file", "--worker-threads", "--max-body-bytes"}

# idemstore's port -> the `store` the native host runs for the same backend, or why there is none.
_IDEMSTORES: dict[int, dict | str] = {}


def native_store_of(argv: list[str], env: dict | None = None) -> tuple[int, dict | str] | None:
    """(port, `store`) for an idemstore command line: its backend and Redis flags as the native
    host's `store` keys (a string saying why where one cannot map); None for a command that
    serves no store (a tool: `idemstore records ...`)."""
    args = list(argv[1:])
    if not args or not args[0].startswith("--"):
        return None
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args):
        flag, eq, value = args[i].partition("=")
        if not eq:
            value = None
            if flag != "--redis-tls-insecure" and i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
                i += 1
        pairs.append((flag, value))
        i += 1
    listen = dict(pairs).get("--listen") or "127.0.0.1:8380"
    port = int(listen.rsplit(":", 1)[1])
    store: dict = {}
    for flag, value in pairs:
        if flag in _SERVICE_FLAGS:
            continue
        if flag == "--redis-tls-insecure":
            store["tls_insecure"] = True
        elif flag in _STORE_FLAGS and value is not None:
            key = _STORE_FLAGS[flag]
            store[key] = value.split(",") if key in _LIST_KEYS else int(value) if key in _INT_KEYS else value
        else:
            return port, f"idemstore's {flag} has no `store` key"
    if env and env.get("IDEMSTORE_REDIS_PASSWORD"):
        return port, "idemstore's password comes from its environment (IDEMSTORE_REDIS_PASSWORD)"
    if not any(k in store for k in ("redis", "redis_cluster", "redis_sentinel")):
        store["memory"] = True
    return port, store


def register_idemstore(argv: list[str], env: dict | None = None) -> None:
    found = native_store_of(argv, env)
    if found is not None:
        _IDEMSTORES[found[0]] = found[1]


def native_store(ports: int | list[int]) -> dict:
    """The `store` the native host runs for a store cluster of these idemstore ports: the
    backend of the idemstores there (all the same one); for ports no idemstore of this run
    listens on (a store that is down), a Redis on the same port, where nothing answers either."""
    ports = list(ports) if isinstance(ports, (list, tuple)) else [ports]
    found = [_IDEMSTORES.get(p) for p in ports]
    if all(f is None for f in found):
        return {"redis": f"redis://{LOOPBACK}:{ports[0]}"}
    reasons = [f for f in found if isinstance(f, str)]
    if reasons:
        raise HarnessError(f"native host: the store cluster's idemstore cannot be mapped: {reasons[0]}")
    stores = {json.dumps(f, sort_keys=True) for f in found}
    if len(stores) != 1:
        raise HarnessError(f"native host: the store cluster's idemstores {ports} have different backends")
    return json.loads(stores.pop())


def _cluster_ports(config: dict) -> dict[str, list[int]]:
    """Cluster name -> its STATIC endpoints' ports, for the clusters of a rendered config."""
    out: dict[str, list[int]] = {}
    for c in (config.get("static_resources") or {}).get("clusters") or []:
        ports = []
        for group in (c.get("load_assignment") or {}).get("endpoints") or []:
            for ep in group.get("lb_endpoints") or []:
                sock = ep.get("endpoint", {}).get("address", {}).get("socket_address")
                if sock and "port_value" in sock:
                    ports.append(int(sock["port_value"]))
        out[c.get("name", "")] = ports
    return out


def native_plugin_config(value, clusters: dict[str, list[int]]):
    """A plugin configuration (dict or JSON text) for the native host: `store_cluster` (and
    `store_transport`) replaced by the `store` of that cluster's idemstore (`native_store`).
    A configuration that is not a JSON object, or whose cluster is not among `clusters`, is
    left as it is: the module refuses it as it should."""
    cfg = value
    if isinstance(value, str):
        try:
            cfg = json.loads(value)
        except ValueError:
            return value
    if not isinstance(cfg, dict) or not isinstance(cfg.get("store_cluster"), str) \
            or cfg["store_cluster"] not in clusters or "store" in cfg:
        return value
    ports = clusters[cfg["store_cluster"]]
    out = {k: v for k, v in cfg.items() if k not in ("store_cluster", "store_transport")}
    out["store"] = native_store(ports)
    return json.dumps(out) if isinstance(value, str) else out


def _walk_filters(node, visit) -> None:
    """Calls visit(d) for every dict with a `typed_config` under `node` (nested ones too)."""
    if isinstance(node, dict):
        if isinstance(node.get("typed_config"), dict):
            visit(node)
        for v in list(node.values()):
            _walk_filters(v, visit)
    elif isinstance(node, list):
        for v in node:
            _walk_filters(v, visit)


def _filter_value(tc: dict):
    """The plugin configuration text of a module filter's typed_config."""
    return (tc.get("filter_config") or {}).get("value")


def for_native(config: dict, leave_out_refused: bool = False) -> tuple[dict, dict[str, str]]:
    """A rendered Envoy config for the native host (a copy): every idempotency wasm filter
    (`root_id: idempotency`, e.g. in a shipped YAML) replaced by the module's filter under the
    same `name`, and each module filter's `store_cluster` by the `store` of that cluster's
    idemstore (`native_plugin_config`). Returns the config and {listener name: why the native
    host refuses it} for the listeners with such a filter that it refuses (`native_refusal`),
    which `leave_out_refused` leaves out of the config. A filter written for the module (a
    `store`, no `store_cluster`) is left as it is, refused or not: a test of the module's
    refusals sees them."""
    config = json.loads(json.dumps(config))
    clusters = _cluster_ports(config)
    carried: list[dict] = []  # the typed configs made or changed here

    def visit(d: dict) -> None:
        tc = d["typed_config"]
        if tc.get("@type") == WASM_FILTER_TYPE and (tc.get("config") or {}).get("root_id") == "idempotency":
            value = ((tc["config"].get("configuration") or {}).get("value")) or ""
            d["typed_config"] = native_filter(value)["typed_config"]
            tc = d["typed_config"]
            carried.append(tc)
        if tc.get("@type") == MODULE_FILTER_TYPE and isinstance(_filter_value(tc), str):
            value = native_plugin_config(_filter_value(tc), clusters)
            if value != _filter_value(tc):
                tc["filter_config"]["value"] = value
                carried.append(tc)

    _walk_filters(config, visit)
    refused: dict[str, str] = {}
    res = config.get("static_resources") or {}
    for ln in res.get("listeners") or []:
        reason = _refusal(ln, lambda tc: any(tc is c for c in carried))
        if reason:
            refused[ln.get("name", "")] = reason
    if leave_out_refused and refused:
        res["listeners"] = [ln for ln in res["listeners"] if ln.get("name", "") not in refused]
    return config, refused


def _refusal(node, among=lambda tc: True) -> str | None:
    """Why the native host refuses a module filter under `node` (`among` those), or None."""
    reasons: list[str] = []

    def visit(d: dict) -> None:
        tc = d["typed_config"]
        if tc.get("@type") == MODULE_FILTER_TYPE and isinstance(_filter_value(tc), str) and among(tc):
            try:
                reason = native_refusal(json.loads(_filter_value(tc)))
            except ValueError:
                reason = None
            if reason:
                reasons.append(reason)

    _walk_filters(node, visit)
    return reasons[0] if reasons else None


def host_listener(listener_config: dict, clusters: list[dict]) -> dict:
    """A listener delivered outside the bootstrap (an LDS file), for the suite's host: under
    IDEM_HOST=native its filters as `for_native` makes them, with `clusters` (the bootstrap's)
    naming the store clusters; unchanged on the wasm host."""
    if not native():
        return listener_config
    config, _ = for_native({"static_resources": {"listeners": [listener_config], "clusters": clusters}})
    return config["static_resources"]["listeners"][0]




def redis_bin() -> str:
    value = os.environ.get("REDIS_SERVER") or shutil.which("redis-server")
    if not value:
        raise HarnessError("redis-server not found (apt-get install redis-server, or set REDIS_SERVER)")
    return value


# --------------------------------------------------------------------------------------------
# processes
# --------------------------------------------------------------------------------------------


def tail(path: Path | str, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    return "\n".join(data.splitlines()[-lines:])


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen
    stopped: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def returncode(self) -> int | None:
        return self.popen.poll()

    def log_text(self) -> str:
        try:
            return self.log.read_text("utf-8", "replace")
        except OSError:
            return ""

    def tail(self, lines: int = 40) -> str:
        return tail(self.log, lines)

    def describe(self, lines: int = 40) -> str:
        state = "running" if self.alive() else f"exited {self.returncode()}"
        return f"--- {self.name} (pid {self.pid}, {state}) log {self.log} (last {lines} lines):\n{self.tail(lines)}"

    def stop(self, timeout: float = 5.0) -> int | None:
        """Terminate by PID, then kill after `timeout` seconds."""
        if not self.stopped:
            self.stopped = True
            if self.popen.poll() is None:
                try:
                    self.popen.send_signal(signal.SIGTERM)
                    self.popen.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.popen.kill()
                    self.popen.wait(timeout)
                except ProcessLookupError:
                    pass
            with _LIVE_LOCK:
                if self in _LIVE:
                    _LIVE.remove(self)
        return self.popen.poll()

    def kill(self) -> None:
        """SIGKILL by PID, for fault injection."""
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(10)
        self.stopped = True
        with _LIVE_LOCK:
            if self in _LIVE:
                _LIVE.remove(self)


def start(name: str, argv: list[str], run_dir: Path, env: dict | None = None, cwd: Path | None = None) -> Proc:
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / f"{name}.log"
    n = 1
    while log.exists():
        n += 1
        log = run_dir / f"{name}-{n}.log"
    out = open(log, "wb")
    out.write(("$ " + " ".join(argv) + "\n").encode())
    out.flush()
    # The services read IDEMSTORE_* variables as flags: only the harness's arguments count.
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("IDEMSTORE_") or k == "IDEMSTORE_BIN"}
    if env:
        full_env.update(env)
    popen = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=str(cwd or ROOT),
        env=full_env,
        start_new_session=True,
    )
    out.close()
    proc = Proc(name, argv, log, popen)
    with _LIVE_LOCK:
        _LIVE.append(proc)
        if _is_envoy(argv[0]):
            _ENVOY_LOGS.append(log)
        elif _is_idemstore(argv[0]):
            # What a native host's `store` is for a store cluster toward it (`native_store`).
            register_idemstore(argv, env)
    return proc


def _is_envoy(program: str) -> bool:
    try:
        return os.path.realpath(program) == os.path.realpath(envoy_bin())
    except HarnessError:
        return False


def _is_idemstore(program: str) -> bool:
    try:
        return os.path.realpath(program) == os.path.realpath(idemstore_bin())
    except HarnessError:
        return False


def live_processes() -> list[Proc]:
    with _LIVE_LOCK:
        return list(_LIVE)


def envoy_logs() -> list[Path]:
    """The log file of every Envoy this process started (running or stopped), in start order."""
    with _LIVE_LOCK:
        return list(_ENVOY_LOGS)


@atexit.register
def _stop_all() -> None:
    for proc in reversed(live_processes()):
        try:
            proc.stop(timeout=3)
        except Exception:  # pragma: no cover - best effort at exit
            pass


def wait_for(check, what: str, proc: Proc | None = None, timeout: float = 20.0, interval: float = 0.05):
    """Poll `check()` until it returns a truthy value; fail with the process log tail."""
    deadline = time.monotonic() + timeout
    last_err: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise HarnessError(f"{what}: {proc.name} exited with {proc.returncode()}\n{proc.describe(60)}")
        try:
            value = check()
            if value:
                return value
        except Exception as e:  # noqa: BLE001 - polling
            last_err = e
        time.sleep(interval)
    extra = f"\n{proc.describe(60)}" if proc is not None else ""
    raise HarnessError(f"timed out after {timeout}s waiting for {what} (last error: {last_err!r}){extra}")


def await_ready(proc: Proc, check, what: str, timeout: float = 20.0):
    """wait_for(), but a process that never becomes ready is stopped before the error."""
    try:
        return wait_for(check, what, proc, timeout=timeout)
    except HarnessError:
        proc.stop()
        raise


def poll_until(read, at_least: int, timeout: float, interval: float = 0.02) -> int:
    """Polls `read()` until it returns at least `at_least` or `timeout` passes; returns the last value
    (commits, and so their counters, land after the responses)."""
    deadline = time.monotonic() + timeout
    value = read()
    while value < at_least and time.monotonic() < deadline:
        time.sleep(interval)
        value = read()
    return value


def in_thread(fn, delay: float = 0.0):
    """Runs fn() in a daemon thread after `delay` seconds; returns (thread, out) with out["resp"]
    or out["error"], for `joined`."""
    out: dict = {}

    def run():
        time.sleep(delay)
        try:
            out["resp"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by joined()
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def joined(t: threading.Thread, out: dict, timeout: float = 30.0):
    """The result of an `in_thread` call, re-raising its exception."""
    t.join(timeout)
    assert not t.is_alive(), "request thread still running"
    if "error" in out:
        raise out["error"]
    return out["resp"]


def tcp_accepts(port: int, host: str = LOOPBACK) -> bool:
    with socket.create_connection((host, port), timeout=0.5):
        return True


def http_connection(port: int, host: str = LOOPBACK, timeout: float = 1.0,
                    source_address: tuple[str, int] | None = None) -> http.client.HTTPConnection:
    """An HTTP/1.1 connection to `port`: HTTPS with a client certificate when an idemstore with
    a TLS listener serves there (`serve_tls`), plain otherwise."""
    tls = store_tls(port)
    if tls is not None:
        return http.client.HTTPSConnection(host, port, timeout=timeout, source_address=source_address,
                                           context=tls.ssl_context())
    return http.client.HTTPConnection(host, port, timeout=timeout, source_address=source_address)


def http_get_status(port: int, path: str, host: str = LOOPBACK, timeout: float = 1.0) -> tuple[int, bytes]:
    conn = http_connection(port, host, timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def redis_ping(port: int, host: str = LOOPBACK) -> bool:
    with socket.create_connection((host, port), timeout=0.5) as s:
        s.sendall(b"PING\r\n")
        return s.recv(64).startswith(b"+PONG")


# --------------------------------------------------------------------------------------------
# the services
# --------------------------------------------------------------------------------------------


def start_redis(run_dir: Path, port: int | None = None) -> tuple[Proc, int]:
    """redis-server on `port` (default: a free one; a given one: e.g. the port of a Redis that
    was killed, which the native host's `store` still names), without persistence."""
    port = port or free_port()
    data = run_dir / f"redis-{port}"
    data.mkdir(parents=True, exist_ok=True)
    proc = start(
        "redis",
        [redis_bin(), "--port", str(port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no",
         "--dir", str(data), "--daemonize", "no", "--protected-mode", "no"],
        run_dir,
    )
    await_ready(proc, lambda: redis_ping(port), "redis PING")
    return proc, port


def spawn_idemstore(run_dir: Path, redis_url: str | None = None, port: int | None = None,
                    name: str = "idemstore") -> tuple[Proc, int]:
    """Start idemstore without waiting for it (see `await_idemstore`)."""
    port = port or free_port()
    argv = [idemstore_bin(), "--listen", f"{LOOPBACK}:{port}"]
    if redis_url:
        argv += ["--redis", redis_url]
    proc = start(name, argv, run_dir, env={"RUST_LOG": os.environ.get("IDEMSTORE_LOG", "info")})
    return proc, port


def await_idemstore(proc: Proc, port: int, timeout: float = 20.0) -> None:
    await_ready(proc, lambda: http_get_status(port, "/healthz")[0] == 200, f"{proc.name} /healthz", timeout)


def start_idemstore(run_dir: Path, redis_url: str | None = None, port: int | None = None,
                    name: str = "idemstore") -> tuple[Proc, int]:
    proc, port = spawn_idemstore(run_dir, redis_url, port, name)
    await_idemstore(proc, port)
    return proc, port


# --------------------------------------------------------------------------------------------
# idemstores behind TLS (IDEM_SECURE_STORE; support/secure.py starts them)
# --------------------------------------------------------------------------------------------


def secure_store() -> bool:
    """`IDEM_SECURE_STORE=1`: the standard stacks (`stack.start_backend`) and the replica sets
    (`replicas.start_replica_set`, backend "redis") run their stores secured: idemstore's listener
    on TLS requiring client certificates, and its Redis on TLS only with the documented ACL user
    and a key prefix (support/secure.py). `make e2e` runs the callout pass that way."""
    value = os.environ.get("IDEM_SECURE_STORE") or "0"
    if value not in ("0", "1"):
        raise ValueError(f"IDEM_SECURE_STORE={value!r}: 0 or 1")
    return value == "1"


@dataclass(frozen=True)
class StoreTls:
    """What a client of an idemstore whose listener speaks TLS and requires client certificates
    needs: the CA that signed idemstore's certificate, and a client certificate it accepts."""
    ca: Path
    cert: Path
    key: Path

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca))
        ctx.load_cert_chain(str(self.cert), str(self.key))
        return ctx

    def transport_socket(self) -> dict:
        """The store cluster's: idemstore's certificate (and its IP SAN) verified, the client
        certificate sent. (Envoy offers ALPN h2 itself on an HTTP/2 cluster.)"""
        from . import pki  # cryptography: only where TLS stores are made

        return pki.upstream_tls(self.ca, pki.Cert(self.cert, self.key))


# port -> the TLS of the idemstore listening there: every client the harness makes for that port
# (readiness, /metrics, `request`, the Envoys' store cluster) speaks TLS with the client
# certificate; everything else stays plain. Ports are never reused within a run (`free_port`).
_TLS_STORES: dict[int, StoreTls] = {}


def serve_tls(port: int, tls: StoreTls) -> None:
    _TLS_STORES[port] = tls


def store_tls(port: int) -> StoreTls | None:
    return _TLS_STORES.get(port)


def store_transport_socket(ports: int | list[int]) -> dict | None:
    """The transport socket a cluster of these idemstore ports needs: TLS if they serve TLS
    (all of them, with one CA and client certificate), None if none does."""
    tls = {store_tls(p) for p in (ports if isinstance(ports, (list, tuple)) else [ports])}
    if tls == {None}:
        return None
    if len(tls) != 1:
        raise HarnessError(f"store ports {ports} mix TLS and plain idemstores, or several CAs")
    return tls.pop().transport_socket()


def start_upstream(run_dir: Path, port: int | None = None) -> tuple[Proc, int]:
    """The counting upstream on `port` (default: a free one)."""
    port = port or free_port()
    proc = start("upstream", [sys.executable, str(SUPPORT / "upstream.py"), "--port", str(port), "--quiet"], run_dir)
    await_ready(proc, lambda: http_get_status(port, "/__health")[0] == 200, "upstream /__health")
    return proc, port


# --------------------------------------------------------------------------------------------
# Envoy configuration (rendered as JSON, which is YAML)
# --------------------------------------------------------------------------------------------

DEFAULT_ROUTES = [
    {"name": "orders", "match": {"prefix": "/orders"}, "route": {"cluster": "upstream", "timeout": "20s"}},
    {"name": "payments", "match": {"prefix": "/payments"}, "route": {"cluster": "upstream", "timeout": "20s"}},
    # no name: the filter scopes records by the path without its query string
    {"match": {"prefix": "/"}, "route": {"cluster": "upstream", "timeout": "20s"}},
]


# The store stream's counters and gauge (`store_transport: stream`), not outcomes of requests.
STREAM_COUNTERS = ("store_streams_opened", "store_stream_resets", "store_stream_calls")


def store_idle(envoy: "Envoy", cluster: str = "idemstore") -> bool:
    """No store call in flight: no callout to `cluster`, none on a store stream (whose streams,
    one per worker, are active requests of the cluster while they live)."""
    if native():
        # The module's store calls are tasks on its threads: `store_stream_calls` in flight.
        return envoy.counter("store_stream_calls") == 0
    s = envoy.stats(rf"^(cluster\.{cluster}\.upstream_rq_active|wasmcustom\.idempotency\.store_stream.*)$")
    streams = s.get("wasmcustom.idempotency.store_streams_opened", 0) - s.get("wasmcustom.idempotency.store_stream_resets", 0)
    return (s.get(f"cluster.{cluster}.upstream_rq_active", 0) <= max(streams, 0)
            and s.get("wasmcustom.idempotency.store_stream_calls", 0) == 0)


def store_transport() -> str | None:
    """The `store_transport` the suite runs on (`IDEM_STORE_TRANSPORT`: `stream` or `callout`),
    given to every filter configuration with a store that does not name one; unset: the
    filter's default (`stream`). `make e2e` runs the contract, drill and replica tests on both."""
    value = os.environ.get("IDEM_STORE_TRANSPORT") or None
    if value not in (None, "stream", "callout"):
        raise ValueError(f"IDEM_STORE_TRANSPORT={value!r}: stream or callout")
    return value


def streams() -> bool:
    """Whether the suite's filters send store calls on the store stream (the default)."""
    return store_transport() != "callout"


def wasm_filter(plugin_config: dict | str, wasm: str, vm_id: str = "idempotency",
                failure_policy: str = "FAIL_RELOAD") -> dict:
    """The filter with `plugin_config`: the wasm filter (`wasm` in V8, its own VM `vm_id`), or
    under IDEM_HOST=native the module's filter (`native_filter`) with the same configuration,
    whose `store_cluster` becomes a `store` when its Envoy is launched (`for_native`)."""
    if native():
        return native_filter(plugin_config)
    transport = store_transport()
    if isinstance(plugin_config, dict) and transport and "store_cluster" in plugin_config:
        plugin_config = {"store_transport": transport, **plugin_config}
    value = plugin_config if isinstance(plugin_config, str) else json.dumps(plugin_config)
    return {
        "name": "envoy.filters.http.wasm",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": "idempotency",
                "root_id": "idempotency",
                "allow_on_headers_stop_iteration": True,
                "failure_policy": failure_policy,
                "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": value},
                "vm_config": {
                    "vm_id": vm_id,
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": {"local": {"filename": wasm}},
                },
            },
        },
    }


# What the shipped configurations wrap the filter in (envoy/envoy.yaml): Envoy's composite filter
# creates the filter only for a request with an Idempotency-Key and a method it guards (in any
# case, as the filter matches methods), or with the gRPC replay hop's header (the filter refuses
# it); the filter never sees (nor counts) the others, and they cost no VM context.
def skip_unless_keyed(wasm: dict, methods: tuple[str, ...] = ("POST", "PATCH")) -> dict:
    def header(name: str, match: dict) -> dict:
        return {"single_predicate": {
            "input": {"name": name, "typed_config": {
                "@type": "type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput",
                "header_name": name}},
            "value_match": match}}

    present = {"safe_regex": {"google_re2": {}, "regex": ".*"}}
    by_method = [header(":method", {"exact": m, "ignore_case": True}) for m in methods]
    return {
        "name": wasm["name"],
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.common.matching.v3.ExtensionWithMatcher",
            "extension_config": {"name": "envoy.filters.http.composite", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.composite.v3.Composite"}},
            "xds_matcher": {"matcher_list": {"matchers": [{
                "predicate": {"or_matcher": {"predicate": [
                    {"and_matcher": {"predicate": [
                        header("idempotency-key", present),
                        {"or_matcher": {"predicate": by_method}} if len(by_method) > 1 else by_method[0]]}},
                    header("x-idempotency-grpc-replay", present)]}},
                "on_match": {"action": {"name": "guard", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.composite.v3.ExecuteFilterAction",
                    "typed_config": wasm}}},
            }]}},
        },
    }


ROUTER = {
    "name": "envoy.filters.http.router",
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
}


def listener(name: str, port: int, http_filters: list[dict], routes: list[dict] | None = None,
             virtual_host: dict | None = None, transport_socket: dict | None = None) -> dict:
    """A listener on loopback with one HTTP connection manager: `http_filters` then the router,
    one virtual host (`*`) with `routes` (default DEFAULT_ROUTES). `virtual_host` adds fields
    to that virtual host (e.g. `retry_policy`, `hedge_policy`); `transport_socket` goes on the
    filter chain (e.g. `pki.downstream_tls(...)` for TLS or mTLS)."""
    vhost = {"name": name, "domains": ["*"], "routes": routes or DEFAULT_ROUTES}
    vhost.update(virtual_host or {})
    chain: dict = {}
    if transport_socket is not None:
        chain["transport_socket"] = transport_socket
    return {
        "name": name,
        "address": {"socket_address": {"address": LOOPBACK, "port_value": port}},
        "per_connection_buffer_limit_bytes": 2097152,
        "filter_chains": [{
            **chain,
            "filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                    "stat_prefix": name,
                    "codec_type": "AUTO",
                    # An edge proxy: the client's address is the connection's, never a header
                    # the client sent (the default subject, anon:<ip>, depends on it).
                    "use_remote_address": True,
                    "route_config": {
                        "name": f"{name}_routes",
                        "virtual_hosts": [vhost],
                    },
                    "http_filters": http_filters + [ROUTER],
                },
            }],
        }],
    }


def static_cluster(name: str, port: int | list[int], http2: bool = False, connect_timeout: str = "1s",
                   lb_policy: str = "ROUND_ROBIN", transport_socket: dict | None = None) -> dict:
    """A STATIC cluster on loopback: one endpoint, or one per port of a list (load-balanced);
    `transport_socket` e.g. `pki.upstream_tls(...)` (TLS, with a client certificate for mTLS)."""
    ports = port if isinstance(port, (list, tuple)) else [port]
    c = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": connect_timeout,
        "lb_policy": lb_policy,
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": LOOPBACK, "port_value": p}}}}
                for p in ports]}],
        },
    }
    if http2:
        c["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    if transport_socket is not None:
        c["transport_socket"] = transport_socket
    return c


# The second hop of a gRPC replay (docs/grpc.md): a retry the guard re-routes (it sets
# x-idempotency-grpc-replay) goes to an Envoy internal listener whose filter, in
# `"mode": "grpc_replay"`, answers the stored message and adds the stored trailers. Every Envoy
# that guards gRPC calls has the four parts: the bootstrap extension, the route (first in its
# virtual host), the internal listener and its cluster.
REPLAY_NAME = "idempotency_grpc_replay"
INTERNAL_LISTENER_EXTENSION = {
    "name": "envoy.bootstrap.internal_listener",
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener"},
}
REPLAY_ROUTE = {
    "name": REPLAY_NAME,
    "match": {"path": "/idempotency.filter.v1.GrpcReplay/Replay",
              "headers": [{"name": "x-idempotency-grpc-replay", "present_match": True}]},
    "route": {"cluster": REPLAY_NAME, "timeout": "10s"},
}


# The most a record holds besides its message (src/store/record.rs, MAX_FRAMING): the replay
# filter reads its own max_record_bytes (default 1 MiB) plus this.
RECORD_FRAMING = 2_139_948
DEFAULT_MAX_RECORD_BYTES = 1048576


def replay_buffer_limit(max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> int:
    """The replay listener's and cluster's buffer limit: what the replay filter reads, rounded up
    to 256 KiB (3.25 MiB with the default max_record_bytes)."""
    step = 256 * 1024
    return -(-(max_record_bytes + RECORD_FRAMING) // step) * step


def replay_listener(wasm: str, max_record_bytes: int | None = None) -> dict:
    """The internal listener of the second hop, with the filter in `grpc_replay` mode (reading
    records of up to `max_record_bytes`: at least the guards')."""
    cfg = {"mode": "grpc_replay"} if max_record_bytes is None else \
        {"mode": "grpc_replay", "max_record_bytes": max_record_bytes}
    replay = wasm_filter(cfg, wasm, vm_id="idempotency_grpc_replay")
    if not native():
        replay["typed_config"]["config"]["name"] = REPLAY_NAME
    return {
        "name": REPLAY_NAME,
        "internal_listener": {},
        "per_connection_buffer_limit_bytes": replay_buffer_limit(max_record_bytes or DEFAULT_MAX_RECORD_BYTES),
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": REPLAY_NAME,
                "route_config": {"name": REPLAY_NAME, "virtual_hosts": [{
                    "name": REPLAY_NAME, "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "direct_response": {"status": 404}}]}]},
                "http_filters": [replay, ROUTER],
            },
        }]}],
    }


def replay_cluster(max_record_bytes: int | None = None) -> dict:
    return {
        "name": REPLAY_NAME,
        "connect_timeout": "1s",
        "per_connection_buffer_limit_bytes": replay_buffer_limit(max_record_bytes or DEFAULT_MAX_RECORD_BYTES),
        "load_assignment": {"cluster_name": REPLAY_NAME, "endpoints": [{"lb_endpoints": [{"endpoint": {
            "address": {"envoy_internal_address": {"server_listener_name": REPLAY_NAME}}}}]}]},
        "transport_socket": {
            "name": "envoy.transport_sockets.internal_upstream",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.internal_upstream.v3.InternalUpstreamTransport",
                "transport_socket": {"name": "envoy.transport_sockets.raw_buffer", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer"}},
            },
        },
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
    }


def add_grpc_replay(config: dict, wasm: str, max_record_bytes: int | None = None) -> dict:
    """Adds the second hop to a rendered config: the extension, the internal listener and its
    cluster (for guards keeping up to `max_record_bytes`), and the route first in every virtual
    host of every listener. Returns `config`."""
    config.setdefault("bootstrap_extensions", []).append(INTERNAL_LISTENER_EXTENSION)
    res = config["static_resources"]
    for ln in res["listeners"]:
        for chain in ln.get("filter_chains", []):
            for f in chain.get("filters", []):
                rc = f.get("typed_config", {}).get("route_config")
                for vh in (rc or {}).get("virtual_hosts", []):
                    vh["routes"] = [REPLAY_ROUTE] + vh["routes"]
    res["listeners"].append(replay_listener(wasm, max_record_bytes))
    res["clusters"].append(replay_cluster(max_record_bytes))
    return config


def store_health_check() -> dict:
    """The active health check envoy/envoy.yaml puts on its `idemstore` cluster (test_drills.py
    checks that the two agree): GET /healthz every second (every 250 ms while unhealthy),
    unhealthy after two failures (a 503 too: idemstore's answer when its Redis is down), healthy
    again after one success."""
    return {
        "timeout": "0.5s",
        "interval": "1s",
        "unhealthy_interval": "0.25s",
        "no_traffic_interval": "1s",
        "unhealthy_threshold": 2,
        "healthy_threshold": 1,
        "http_health_check": {
            "path": "/healthz",
            "codec_client_type": "HTTP2",
            "retriable_statuses": [{"start": 503, "end": 504}],
        },
    }


def store_cluster(ports: int | list[int], name: str = "idemstore", health_check: bool = False) -> dict:
    """The filter's store cluster as envoy/envoy.yaml ships it: h2c, limits sized for bursts.
    `health_check=True` adds the shipped active health check, panic threshold 0 (with no
    healthy idemstore, store calls fail at once and the filter fails open, instead of going to
    an idemstore that is known to be broken) and no update merge window (a health change
    reaches the workers at once, not up to 1 s later); off by default, as the suite ran before
    it. Toward idemstores serving TLS (`serve_tls`) it carries their client certificate."""
    c = static_cluster(name, ports, http2=True, connect_timeout="0.25s")
    opts = c["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    # As shipped: HTTP/2 pings find a store that stopped answering on a quiet connection.
    opts["explicit_http_config"]["http2_protocol_options"] = {
        "max_concurrent_streams": 100,
        "connection_keepalive": {"interval": "5s", "timeout": "2s"},
    }
    c["circuit_breakers"] = {"thresholds": [{
        "priority": "DEFAULT", "max_connections": 1000,
        "max_pending_requests": 100000, "max_requests": 100000,
    }]}
    if health_check:
        c["health_checks"] = [store_health_check()]
        c["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}, "update_merge_window": "0s"}
        c["close_connections_on_host_health_failure"] = True
    # idemstores with a TLS listener (IDEM_SECURE_STORE): mutual TLS, HTTP/2 all the same.
    tls = store_transport_socket(ports)
    if tls is not None:
        c["transport_socket"] = tls
        # The connect timeout covers the TLS handshake too: 0.25 s failed handshakes on a
        # loaded 2-core machine (as the shipped config's TLS block says).
        c["connect_timeout"] = "1s"
    return c


def envoy_config(admin_port: int, listeners: list[dict], upstream_port: int,
                 idemstore_port: int | list[int]) -> dict:
    """Clusters `upstream` (HTTP/1.1) and `idemstore` (h2c; every port of a list, round-robin)."""
    return {
        "admin": {"address": {"socket_address": {"address": LOOPBACK, "port_value": admin_port}}},
        "static_resources": {
            "listeners": listeners,
            "clusters": [
                static_cluster("upstream", upstream_port),
                store_cluster(idemstore_port),
            ],
        },
    }


@dataclass
class Envoy:
    proc: Proc
    admin_port: int
    ports: dict[str, int] = field(default_factory=dict)
    config_path: Path | None = None
    # Listeners left out on the native host (`for_native`): name -> why it refuses their filter.
    left_out: dict[str, str] = field(default_factory=dict)

    def port(self, listener_name: str) -> int:
        """The listener's port; a listener left out on the native host skips the test."""
        if listener_name in self.left_out:
            skip(f"{self.left_out[listener_name]} (listener {listener_name!r})")
        return self.ports[listener_name]

    def stats(self, filter_regex: str) -> dict[str, int]:
        q = urllib.parse.urlencode({"filter": filter_regex})
        status, body = http_get_status(self.admin_port, f"/stats?{q}", timeout=5)
        if status != 200:
            raise HarnessError(f"admin /stats answered {status}")
        out: dict[str, int] = {}
        for line in body.decode().splitlines():
            name, sep, value = line.partition(": ")
            if sep:
                try:
                    out[name.strip()] = int(value.strip())
                except ValueError:
                    pass
        return out

    def counter(self, name: str) -> int:
        """The filter's counter `name` (`wasmcustom.idempotency.<name>`, on the native host
        `idempotency.<name>`: `filter_stat`), or a full stat name; a missing counter is 0."""
        full = name if "." in name else filter_stat(name)
        return self.stats("^" + full.replace(".", r"\.") + "$").get(full, 0)

    def counters(self) -> dict[str, int]:
        """The filter's counters of what requests did, by short name. The store stream's own
        (`STREAM_COUNTERS`: a stream per worker, opened when it is first needed) are left out,
        so that tests compare outcomes whatever the transport; `counter()` reads them."""
        return {k.rsplit(".", 1)[1]: v for k, v in self.stats(filter_stats_regex()).items()
                if k.rsplit(".", 1)[1] not in STREAM_COUNTERS}

    def wait_counter(self, name: str, at_least: int, timeout: float = 5.0) -> int:
        """Polls `counter(name)` until it reaches `at_least` or `timeout` passes; returns the last value."""
        return poll_until(lambda: self.counter(name), at_least, timeout)

    def log_text(self) -> str:
        return self.proc.log_text()

    def stop(self) -> int | None:
        return self.proc.stop(timeout=10)


def write_config(run_dir: Path, name: str, config: dict) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / f"{name}.yaml"
    n = 1
    while path.exists():
        n += 1
        path = run_dir / f"{name}-{n}.yaml"
    path.write_text(json.dumps(config, indent=2))
    return path


def launch_envoy(run_dir: Path, name: str, config: dict, log_level: str = "info",
                 concurrency: int = 2, env: dict | None = None) -> Proc:
    """Launch an Envoy from a rendered config, not waiting. Under IDEM_HOST=native the config
    is `for_native`'s (the filter the module, its `store` that of its store cluster's
    idemstore) and the environment has `native_env()`."""
    if native():
        config, _ = for_native(config)
        env = {**native_env(), **(env or {})}
    path = write_config(run_dir, name, config)
    argv = [envoy_bin(), "-c", str(path), "--base-id", str(next(_BASE_IDS)), "--disable-hot-restart",
            "--concurrency", str(concurrency), "-l", log_level]
    # IDEM_ENVOY_COMPONENT_LOG=dynamic_modules:debug,wasm:debug: a debugging aid.
    if os.environ.get("IDEM_ENVOY_COMPONENT_LOG"):
        argv += ["--component-log-level", os.environ["IDEM_ENVOY_COMPONENT_LOG"]]
    return start(name, argv, run_dir, env=env)


def spawn_envoy(run_dir: Path, name: str, listener_filters: dict[str, list[dict]], upstream_port: int,
                idemstore_port: int | list[int], log_level: str = "info", concurrency: int = 2,
                routes: list[dict] | None = None, config_hook=None) -> Envoy:
    """Launch an Envoy with one listener per entry (name -> http filters before the router),
    without waiting for it: several can start at once, then `await_envoy` each.
    `config_hook(config)` may edit the rendered config in place before it is written."""
    admin_port = free_port()
    ports = {ln: free_port() for ln in listener_filters}
    listeners = [listener(ln, ports[ln], filters, routes) for ln, filters in listener_filters.items()]
    config = envoy_config(admin_port, listeners, upstream_port, idemstore_port)
    if config_hook is not None:
        config_hook(config)
    return spawn_envoy_config(run_dir, name, config, admin_port, ports, log_level, concurrency)


def spawn_envoy_with(run_dir: Path, name: str, listeners: dict[str, dict], clusters: list[dict],
                     log_level: str = "info", concurrency: int = 2) -> Envoy:
    """Launch an Envoy from listener specs and clusters given in full, without waiting for it
    (then `await_envoy`): for Envoys that are not the filter-in-front-of-`upstream` shape of
    `spawn_envoy` (a client-side proxy with a retry policy in front of another Envoy, TLS
    listeners, clusters to other Envoys). Each listener spec is `listener()`'s keyword
    arguments, its port picked here: `filters` (HTTP filters before the router, default none),
    `routes`, `virtual_host`, `transport_socket`. `clusters` are used as they are (e.g.
    `static_cluster`, `store_cluster`)."""
    admin_port = free_port()
    ports = {ln: free_port() for ln in listeners}
    config = {
        "admin": {"address": {"socket_address": {"address": LOOPBACK, "port_value": admin_port}}},
        "static_resources": {
            "listeners": [listener(ln, ports[ln], spec.get("filters", []), spec.get("routes"),
                                   spec.get("virtual_host"), spec.get("transport_socket"))
                          for ln, spec in listeners.items()],
            "clusters": clusters,
        },
    }
    return spawn_envoy_config(run_dir, name, config, admin_port, ports, log_level, concurrency)


def launch_envoy_file(run_dir: Path, name: str, path: Path, log_level: str = "info",
                      concurrency: int = 2, extra_args: list[str] | None = None,
                      env: dict | None = None) -> Proc:
    """Launch an Envoy from a config file as it is (e.g. a shipped YAML with its ports rewritten).
    `extra_args` go on its command line (e.g. `--file-flush-interval-msec 100`: Envoy writes
    file and stdout access logs every 10 s by default). Under IDEM_HOST=native the file is
    `native_config_file`'s and the environment has `native_env()`."""
    if native():
        path, env = native_config_file(path), {**native_env(), **(env or {})}
    argv = [envoy_bin(), "-c", str(path), "--base-id", str(next(_BASE_IDS)), "--disable-hot-restart",
            "--concurrency", str(concurrency), "-l", log_level] + list(extra_args or [])
    return start(name, argv, run_dir, env=env)


def _native_file_config(path: Path) -> tuple[dict, dict[str, str]]:
    import yaml  # PyYAML: only for config files launched on the native host

    return for_native(yaml.safe_load(Path(path).read_text()))


def file_refusal(path: Path) -> str | None:
    """Under IDEM_HOST=native: why the native host refuses the filter of the config file at
    `path` (e.g. the shipped envoy.yaml's `outcome_lookup`), naming the file; else None."""
    if not native():
        return None
    refused = _native_file_config(path)[1]
    return f"{next(iter(refused.values()))}: {Path(path).name}" if refused else None


def native_config_file(path: Path) -> Path:
    """For IDEM_HOST=native: the config file at `path` as `for_native` makes it, written beside
    it (`<name>.native.json`). A config whose filter the native host refuses skips the test
    with the reason (`file_refusal`)."""
    reason = file_refusal(path)
    if reason:
        skip(reason)
    out = Path(path).with_name(Path(path).stem + ".native.json")
    out.write_text(json.dumps(_native_file_config(path)[0], indent=2))
    return out


SHIPPED_ENVOY_YAML = ROOT / "envoy" / "envoy.yaml"


def shipped_envoy_yaml(admin: int, listen: int, app: int, store: int, wasm: str,
                       path: Path = SHIPPED_ENVOY_YAML) -> str:
    """envoy/envoy.yaml as shipped, with its four ports (admin 9901, listener 10000, app 8081,
    idemstore 8380) and the wasm path (the guard's and the gRPC replay listener's) rewritten,
    and the suite's `store_transport` (if any) added to the guard's configuration."""
    text = path.read_text()
    for old, new in ((9901, admin), (10000, listen), (8081, app), (8380, store)):
        text, n = re.subn(rf"port_value: {old}\b", f"port_value: {new}", text)
        assert n == 1, f"port {old} appears {n} times in {path}"
    text, n = re.subn(r"filename: \S*idempotency_filter\.wasm", f"filename: {wasm}", text)
    assert n == 2, f"the wasm path appears {n} times in {path} (the guard, the gRPC replay listener)"
    if store_transport():
        text, n = re.subn(r'"store_cluster": "idemstore"',
                          f'"store_cluster": "idemstore", "store_transport": "{store_transport()}"', text)
        assert n == 1, f"the guard's configuration appears {n} times in {path}"
    return text


def envoy_refused(proc: Proc, admin_port: int, timeout: float = 15.0) -> str:
    """For an Envoy launched with a static configuration it must refuse (e.g. a plugin
    configuration the filter rejects): waits until it exits, failing if it became ready first
    or had not exited non-zero within `timeout`. Measured with Envoy 1.40.0: a refused static
    filter config makes Envoy exit with status 1. Returns its log."""

    def ready() -> bool:
        try:
            return http_get_status(admin_port, "/ready")[1].strip() == b"LIVE"
        except OSError:
            return False

    deadline = time.monotonic() + timeout
    became_ready = False
    while time.monotonic() < deadline and proc.alive():
        if ready():
            became_ready = True
            break
        time.sleep(0.1)
    code = proc.returncode()
    assert not became_ready, f"Envoy became ready with an invalid config\n{proc.describe(60)}"
    assert code is not None and code != 0, f"Envoy did not exit (code {code})\n{proc.describe(60)}"
    return proc.log_text()


def spawn_envoy_config(run_dir: Path, name: str, config: dict, admin_port: int, ports: dict[str, int],
                       log_level: str = "info", concurrency: int = 2, env: dict | None = None) -> Envoy:
    """Launch an Envoy from a full config (its admin and listener ports given), not waiting.
    Under IDEM_HOST=native the listeners whose filter the native host refuses are left out
    (`for_native`): `Envoy.port` of one skips the test with the reason."""
    left_out: dict[str, str] = {}
    if native():
        config, left_out = for_native(config, leave_out_refused=True)
    proc = launch_envoy(run_dir, name, config, log_level=log_level, concurrency=concurrency, env=env)
    return Envoy(proc, admin_port, dict(ports), Path(proc.argv[2]), left_out)


def await_envoy(envoy: Envoy, timeout: float = 30.0) -> Envoy:
    """Until admin /ready says LIVE and every listener accepts; a failure stops the process."""
    proc, admin_port = envoy.proc, envoy.admin_port
    await_ready(proc, lambda: http_get_status(admin_port, "/ready")[1].strip() == b"LIVE",
                f"{proc.name} admin /ready LIVE", timeout=timeout)
    for ln, port in envoy.ports.items():
        if ln in envoy.left_out:  # not in its config (`for_native`)
            continue
        await_ready(proc, lambda p=port: tcp_accepts(p), f"{proc.name} listener {ln} on {port}", timeout=timeout)
    return envoy


def start_envoy(run_dir: Path, name: str, listener_filters: dict[str, list[dict]], upstream_port: int,
                idemstore_port: int | list[int], timeout: float = 30.0, log_level: str = "info") -> Envoy:
    """Start an Envoy with one listener per entry (name -> http filters before the router)."""
    envoy = spawn_envoy(run_dir, name, listener_filters, upstream_port, idemstore_port, log_level=log_level)
    return await_envoy(envoy, timeout)


# --------------------------------------------------------------------------------------------
# HTTP client
# --------------------------------------------------------------------------------------------


@dataclass
class Response:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    elapsed: float = 0.0

    def header(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    def header_all(self, name: str) -> list[str]:
        name = name.lower()
        return [v for k, v in self.headers if k.lower() == name]

    def json(self):
        return json.loads(self.body)

    def __repr__(self) -> str:
        body = self.body[:300]
        return f"Response({self.status}, headers={self.headers!r}, body={body!r}{'...' if len(self.body) > 300 else ''})"


def _start_request(port, method, path, headers, source, timeout, host) -> http.client.HTTPConnection:
    """A fresh connection with the request line and `headers` sent, the body still to come."""
    conn = http_connection(port, host, timeout, (source, 0) if source else None)
    try:
        conn.connect()
        # http.client writes the headers and the body separately: without TCP_NODELAY the body
        # can wait for the proxy's delayed ACK (about 40 ms), as with most HTTP clients' defaults
        # it does not (curl, urllib3, Go and Java set it).
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        if not any(n.lower() == "host" for n, _ in headers):
            conn.putheader("host", f"{host}:{port}")
        for name, value in headers:
            conn.putheader(name, value)
    except BaseException:
        conn.close()
        raise
    return conn


def request(port: int, method: str, path: str, body: bytes | str | list[bytes] | None = b"",
            headers: list[tuple[str, str | bytes]] | dict | None = None, source: str | None = None,
            timeout: float = 30.0, host: str = LOOPBACK) -> Response:
    """One request on a fresh connection, headers sent exactly as given (duplicates, raw bytes).

    A `host` header among `headers` replaces the default `host: <host>:<port>`.
    `source` binds the client socket to that local address (e.g. "127.0.0.2"). A list body is
    sent with `transfer-encoding: chunked`, one chunk per item.
    """
    if isinstance(body, list):
        return _request_chunked(port, method, path, body, headers, source, timeout, host)
    if isinstance(body, str):
        body = body.encode()
    if isinstance(headers, dict):
        headers = list(headers.items())
    headers = list(headers or [])
    t0 = time.monotonic()
    conn = _start_request(port, method, path, headers, source, timeout, host)
    try:
        if body is not None and not any(n.lower() == "content-length" for n, _ in headers):
            conn.putheader("content-length", str(len(body)))
        try:
            conn.endheaders(body or None)
        except (BrokenPipeError, ConnectionResetError):
            # The proxy may answer (e.g. 413) and close before the whole body is sent: the
            # answer is still in the socket's receive buffer.
            pass
        resp = conn.getresponse()
        data = resp.read()
        return Response(resp.status, [(k.lower(), v) for k, v in resp.getheaders()], data, time.monotonic() - t0)
    finally:
        conn.close()


def _request_chunked(port, method, path, chunks, headers, source, timeout, host) -> Response:
    if isinstance(headers, dict):
        headers = list(headers.items())
    headers = list(headers or [])
    t0 = time.monotonic()
    conn = _start_request(port, method, path, headers, source, timeout, host)
    try:
        conn.putheader("transfer-encoding", "chunked")
        conn.endheaders(iter(chunks), encode_chunked=True)
        resp = conn.getresponse()
        data = resp.read()
        return Response(resp.status, [(k.lower(), v) for k, v in resp.getheaders()], data, time.monotonic() - t0)
    finally:
        conn.close()


def store_key(client_key: str, route: str = "orders", subject: str = "anon:127.0.0.1",
              method: str = "POST") -> str:
    """The filter's store key (docs/configuration.md, "Keys and scope"): SHA-256 over the
    length-prefixed subject, method, route and client key."""
    d = hashlib.sha256(b"idempotency-key/v1")
    for f in (subject, method, route, client_key):
        b = f.encode()
        d.update(len(b).to_bytes(8, "big"))
        d.update(b)
    return d.hexdigest()


def new_key(prefix: str = "k") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Upstream:
    """Client for the counting upstream's control endpoints."""

    def __init__(self, proc: Proc, port: int):
        self.proc = proc
        self.port = port

    def _get(self, endpoint: str, **query) -> dict:
        q = urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
        status, body = http_get_status(self.port, f"{endpoint}?{q}" if q else endpoint, timeout=5)
        if status != 200:
            raise HarnessError(f"upstream {endpoint} answered {status}")
        return json.loads(body)

    def count(self, key: str | None = None, path: str | None = None, method: str | None = None,
              key_prefix: str | None = None) -> int:
        return self._get("/__counts", key=key, path=path, method=method, key_prefix=key_prefix)["count"]

    def executions(self, key: str | None = None, path: str | None = None,
                   key_prefix: str | None = None, headers: bool = False) -> list[dict]:
        """Executions matching the filters; `headers=True` adds each one's received request
        headers (`[name, value]` pairs, names lower-cased, in order) and HTTP `version`."""
        return self._get("/__executions", key=key, path=path, key_prefix=key_prefix,
                         headers="1" if headers else None)["executions"]

    def reset(self) -> None:
        conn = http.client.HTTPConnection(LOOPBACK, self.port, timeout=5)
        try:
            conn.request("POST", "/__reset", body=b"")
            conn.getresponse().read()
        finally:
            conn.close()
