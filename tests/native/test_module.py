"""The native host (`libidempotency_filter.so`, an Envoy dynamic module) loaded into the real
Envoy 1.40: it loads and says so, refuses what it must refuse, and guards requests with the
store in Envoy's own process (in memory, and on a real Redis), with its metrics in `/stats`,
its filter state in the access log, and a clean exit when Envoy stops under load.

One Envoy (`envoy-native`, two workers) with two listeners, `memory` (`store: {"memory": true}`)
and `redis` (`store: {"redis": "redis://..."}`), in front of the counting upstream.
"""

from __future__ import annotations

import re
import signal
import threading
import time

import pytest

from support import harness as h
from support.checks import assert_executed, assert_problem, assert_replay_of
from support.harness import new_key

JSON = {"content-type": "application/json"}
ACCESS_LOG = ("outcome=%FILTER_STATE(wasm.idempotency_outcome:PLAIN)% "
              "instance=%FILTER_STATE(wasm.idempotency_instance:PLAIN)% path=%REQ(:PATH)%\n")


def with_access_log(listener: dict, path: str) -> dict:
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["access_log"] = [{
        "name": "envoy.access_loggers.file",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": path,
            "log_format": {"text_format_source": {"inline_string": ACCESS_LOG}},
        },
    }]
    return listener


def native_envoy(run_dir, name: str, listeners: dict[str, dict], upstream_port: int,
                 wait: bool = True, concurrency: int = 2) -> h.Envoy:
    admin = h.free_port()
    ports = {ln: h.free_port() for ln in listeners}
    config = {
        "admin": {"address": {"socket_address": {"address": h.LOOPBACK, "port_value": admin}}},
        "static_resources": {
            "listeners": [with_access_log(h.listener(ln, ports[ln], [h.native_filter(cfg)]),
                                          str(run_dir / f"{name}-{ln}-access.log"))
                          for ln, cfg in listeners.items()],
            "clusters": [h.static_cluster("upstream", upstream_port)],
        },
    }
    envoy = h.spawn_envoy_config(run_dir, name, config, admin, ports, concurrency=concurrency,
                                 env=h.native_env())
    return h.await_envoy(envoy) if wait else envoy


@pytest.fixture(scope="module")
def redis(run_dir):
    proc, port = h.start_redis(run_dir / "native")
    yield port
    proc.stop()


@pytest.fixture(scope="module")
def envoy(run_dir, upstream, redis):
    listeners = {
        "memory": {"store": {"memory": True}, "lock_wait_ms": 2000},
        "redis": {"store": {"redis": f"redis://{h.LOOPBACK}:{redis}"}, "lock_wait_ms": 2000},
    }
    e = native_envoy(run_dir / "native", "envoy-native", listeners, upstream.port)
    yield e
    e.stop()


def counter(envoy: h.Envoy, name: str) -> int:
    return envoy.counter(f"idempotency.{name}")


def test_the_module_loads_and_says_which_abi(envoy):
    log = envoy.log_text()
    assert "Dynamic module ABI version v0.2.0 matched" in log, h.tail(envoy.proc.log)
    assert "idempotency: configured; store: memory" in log
    assert f"idempotency: configured; store: redis redis://{h.LOOPBACK}" in log


@pytest.mark.parametrize("listener", ["memory", "redis"])
def test_first_executes_retries_replay(envoy, upstream, listener):
    key = new_key()
    port = envoy.port(listener)
    first = h.request(port, "POST", "/orders", b'{"item":"book"}', {"idempotency-key": key, **JSON})
    assert_executed(first)
    for _ in range(3):
        assert_replay_of(h.request(port, "POST", "/orders", b'{"item":"book"}',
                                   {"idempotency-key": key, **JSON}), first)
    assert upstream.count(key=key) == 1
    other = h.request(port, "POST", "/orders", b'{"item":"pen"}', {"idempotency-key": key, **JSON})
    assert_problem(other, 422, key, code="key-reused")
    assert upstream.count(key=key) == 1


@pytest.mark.parametrize("listener", ["memory", "redis"])
def test_concurrent_duplicates_run_once(envoy, upstream, listener):
    key = new_key()
    port = envoy.port(listener)
    out: dict[int, h.Response] = {}

    def send(i: int) -> None:
        out[i] = h.request(port, "POST", "/orders", b"{}",
                           {"idempotency-key": key, "x-test-sleep-ms": "300", **JSON}, timeout=10)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    statuses = sorted(r.status for r in out.values())
    assert len(out) == 20 and statuses == [201] * 20, statuses
    assert sum(1 for r in out.values() if r.header("x-idempotent-replay") == "true") == 19
    assert upstream.count(key=key) == 1


def test_metrics_are_the_modules(envoy, upstream):
    before = counter(envoy, "guarded")
    key = new_key()
    h.request(envoy.port("memory"), "POST", "/orders", b"{}", {"idempotency-key": key, **JSON})
    h.request(envoy.port("memory"), "POST", "/orders", b"{}", {"idempotency-key": key, **JSON})
    assert h.poll_until(lambda: counter(envoy, "guarded"), before + 2, 5) >= before + 2
    stats = envoy.stats(r"^idempotency\.")
    for name in ("executed", "replayed", "stored", "store_stream_calls", "local_records"):
        assert f"idempotency.{name}" in stats, sorted(stats)

    # The store latency histograms, once Envoy has flushed its stats (every 5 s by default).
    def histogram() -> str:
        return h.http_get_status(envoy.admin_port, "/stats?filter=store_us.begin", timeout=5)[1].decode()

    h.wait_for(lambda: "idempotency.store_us.begin: P0(" in histogram(), "the begin latency histogram", timeout=15)


def test_outcome_and_instance_in_the_access_log(envoy, run_dir):
    key = new_key()
    port = envoy.port("memory")
    h.request(port, "POST", "/orders/log", b"{}", {"idempotency-key": key, **JSON})
    h.request(port, "POST", "/orders/log", b"{}", {"idempotency-key": key, **JSON})
    refused = h.request(port, "POST", "/orders/log", b'{"x":1}', {"idempotency-key": key, **JSON})
    problem = assert_problem(refused, 422, key, code="key-reused")
    log = run_dir / "native" / "envoy-native-memory-access.log"

    def lines() -> list[str]:
        return [ln for ln in log.read_text().splitlines() if "path=/orders/log" in ln] if log.exists() else []

    h.wait_for(lambda: len(lines()) >= 3, "three access log lines", timeout=15)
    assert [ln.split()[0] for ln in lines()[:3]] == ["outcome=executed", "outcome=replayed", "outcome=mismatch"]
    assert f"instance={problem['instance']}" in lines()[2]


@pytest.mark.parametrize("config, says", [
    ({"store": {"memory": True, "redis": "redis://127.0.0.1:1"}}, "needs exactly one of"),
    ({"store": {"memory": True, "bogus": 1}}, "unknown field"),
    ({"store_cluster": "idemstore"}, "the native host runs the store in Envoy"),
    ({"store": {"memory": True}, "lock_ttl_ms": 1}, "lock_ttl_ms"),
    ({"store": {"memory": True}, "detached_execution": True}, "`detached_execution` is not supported"),
    ({"store": {"memory": True}, "routes": {"orders": {"subject": {"metadata": {"filter": "a", "path": ["s"]}}}}},
     '`subject.metadata` (route "orders") is not supported'),
    ({"store": {"redis": "redis://127.0.0.1:1", "password_file": "/nonexistent/pw"}}, "--redis-password-file"),
])
def test_a_bad_configuration_is_refused_with_a_reason(run_dir, upstream, config, says):
    envoy = native_envoy(run_dir / "native-refused", "envoy-refused", {"api": config}, upstream.port, wait=False)
    try:
        h.wait_for(lambda: envoy.proc.popen.poll() is not None, "Envoy to refuse the configuration", timeout=20)
        assert envoy.proc.popen.returncode != 0
        log = envoy.log_text()
        assert "idempotency filter refused its configuration" in log and says in log, h.tail(envoy.proc.log)
    finally:
        envoy.stop()


def test_an_unknown_filter_name_is_refused(run_dir, upstream):
    admin, port = h.free_port(), h.free_port()
    f = h.native_filter({"store": {"memory": True}}, name="something_else")
    config = {"admin": {"address": {"socket_address": {"address": h.LOOPBACK, "port_value": admin}}},
              "static_resources": {"listeners": [h.listener("api", port, [f])],
                                   "clusters": [h.static_cluster("upstream", upstream.port)]}}
    envoy = h.spawn_envoy_config(run_dir / "native-refused", "envoy-name", config, admin, {"api": port},
                                 env=h.native_env())
    try:
        h.wait_for(lambda: envoy.proc.popen.poll() is not None, "Envoy to refuse the filter", timeout=20)
        assert 'unknown filter_name "something_else"' in envoy.log_text()
    finally:
        envoy.stop()


def test_envoy_stops_cleanly_under_load(run_dir, upstream, redis):
    """SIGTERM while requests wait on the store and on locks: the store's threads must not wake
    a worker that is gone (the scheduler shutdown race). Ten rounds, each exits 0."""
    for round_ in range(10):
        envoy = native_envoy(run_dir / "native-stop", f"envoy-stop-{round_}",
                             {"api": {"store": {"redis": f"redis://{h.LOOPBACK}:{redis}"}}}, upstream.port)
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                try:
                    h.request(envoy.port("api"), "POST", "/orders", b"{}",
                              {"idempotency-key": new_key("s")[:12], "x-test-sleep-ms": "20", **JSON}, timeout=2)
                except Exception:
                    pass

        threads = [threading.Thread(target=load) for _ in range(8)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        envoy.proc.popen.send_signal(signal.SIGTERM)
        try:
            code = envoy.proc.popen.wait(20)
        finally:
            stop.set()
            for t in threads:
                t.join(5)
        assert code == 0, (round_, h.tail(envoy.proc.log))
        assert "panic" not in envoy.log_text()


def test_the_shipped_native_yaml(run_dir, upstream, redis):
    """envoy/native.yaml as shipped (its ports rewritten): orders replays, payments requires a
    key, search is not guarded, and the gRPC replay listener's configuration loads."""
    admin, listen = h.free_port(), h.free_port()
    text = (h.ROOT / "envoy" / "native.yaml").read_text()
    for old, new in ((9901, admin), (10000, listen), (8081, upstream.port), (6379, redis)):
        text, n = re.subn(rf"\b{old}\b", str(new), text)
        assert n >= 1, f"{old} is not in envoy/native.yaml"
    path = run_dir / "native-shipped" / "native.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    proc = h.launch_envoy_file(run_dir / "native-shipped", "envoy-native-shipped", path, env=h.native_env())
    envoy = h.await_envoy(h.Envoy(proc, admin, {"main": listen}))
    try:
        key = new_key()
        first = h.request(listen, "POST", "/orders", b'{"item":"book"}', {"idempotency-key": key, **JSON})
        assert_executed(first)
        assert_replay_of(h.request(listen, "POST", "/orders", b'{"item":"book"}',
                                   {"idempotency-key": key, **JSON}), first)
        assert_problem(h.request(listen, "POST", "/payments", b"{}", JSON), 400, code="missing-key")
        searched = h.request(listen, "POST", "/search", b"{}", {"idempotency-key": key, **JSON})
        assert searched.status == 201 and searched.header("x-idempotent-replay") is None
        assert upstream.count(key=key) == 2
        assert envoy.counter("idempotency.guarded") == 2
    finally:
        envoy.stop()


def test_an_envoy_without_a_callback_the_module_calls_refuses_it(run_dir, upstream):
    """Another Envoy than 1.40 may lack a callback the bindings call: the module says so in one
    line at load and Envoy refuses to start, rather than crashing on the first call. (The
    missing callback is named through IDEMPOTENCY_MODULE_REQUIRE: there is one Envoy here.)"""
    admin, port = h.free_port(), h.free_port()
    config = {"admin": {"address": {"socket_address": {"address": h.LOOPBACK, "port_value": admin}}},
              "static_resources": {"listeners": [h.listener("api", port, [h.native_filter({"store": {"memory": True}})])],
                                   "clusters": [h.static_cluster("upstream", upstream.port)]}}
    env = {**h.native_env(), "IDEMPOTENCY_MODULE_REQUIRE": "envoy_dynamic_module_callback_from_envoy_9_99"}
    envoy = h.spawn_envoy_config(run_dir / "native-refused", "envoy-abi", config, admin, {"api": port}, env=env)
    try:
        h.wait_for(lambda: envoy.proc.popen.poll() is not None, "Envoy to refuse the module", timeout=20)
        assert envoy.proc.popen.returncode != 0
        log = envoy.log_text()
        lines = [ln for ln in log.splitlines() if "built for Envoy 1.40" in ln]
        assert len(lines) == 1 and "envoy_dynamic_module_callback_from_envoy_9_99" in lines[0], log[-3000:]
        assert "on_program_init returned null" in log
    finally:
        envoy.stop()


@pytest.mark.parametrize("listener", ["memory"])
def test_a_body_in_many_chunks_hashes_as_one(envoy, upstream, listener):
    """The module reads each new body chunk once (buffered + received): a 600 KB body sent in
    60 chunks, then in one piece, is one request; a change in its last byte is another."""
    key = new_key()
    port = envoy.port(listener)
    body = bytes(range(256)) * 2400
    chunks = [body[i:i + 10_240] for i in range(0, len(body), 10_240)]
    first = h.request(port, "POST", "/orders", chunks, {"idempotency-key": key, **JSON})
    assert_executed(first)
    assert_replay_of(h.request(port, "POST", "/orders", body, {"idempotency-key": key, **JSON}), first)
    assert_problem(h.request(port, "POST", "/orders", body[:-1] + b"x", {"idempotency-key": key, **JSON}), 422, key,
                   code="key-reused")
    assert upstream.count(key=key) == 1
