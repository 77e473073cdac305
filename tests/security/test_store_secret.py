"""idemstore's shared secret: the filter sends `store_secret` (or the environment
variable `store_secret_env` names) as `x-idem-secret`; a store that refuses it is a store fault,
so the filter fails open (counted on `degraded`) or closed, and nothing is replayed."""

from __future__ import annotations

import time

import pytest

from support import harness as h
from support.checks import assert_executed, assert_problem, assert_replay_of
from support.harness import new_key
from support.stack import plugin_config

SECRET = "e2e-Secret_0f~store!"
ENV_NAME = "IDEM_E2E_STORE_SECRET"

# Listener -> plugin configuration (store_cluster added), all on one Envoy.
LISTENERS = {
    "right": {"store_secret": SECRET},
    "wrong": {"store_secret": "not-the-secret"},
    "missing": {},
    "wrong_closed": {"store_secret": "not-the-secret", "failure_mode": "closed"},
    "env": {"store_secret_env": ENV_NAME},
}


def secret_filter(cfg: dict, wasm: str, env_keys: list[str] | None = None) -> dict:
    """The filter, with `env_keys` passed from Envoy's environment into the VM (then on a VM of
    its own: the environment is part of the VM's configuration)."""
    if not env_keys:
        return h.wasm_filter(plugin_config(**cfg), wasm)
    f = h.wasm_filter(plugin_config(**cfg), wasm, vm_id="idempotency-env")
    f["typed_config"]["config"]["vm_config"]["environment_variables"] = {"host_env_keys": env_keys}
    return f


def start_store_with_secret(run_dir, secret_file) -> tuple[h.Proc, int]:
    """idemstore on the in-memory backend, its secret from a file (with the trailing newline
    an editor leaves). /healthz needs no secret: the readiness check itself shows it."""
    port = h.free_port()
    argv = [h.idemstore_bin(), "--listen", f"{h.LOOPBACK}:{port}", "--secret-file", str(secret_file)]
    proc = h.start("idemstore-secret", argv, run_dir, env={"RUST_LOG": "info"})
    h.await_idemstore(proc, port)
    return proc, port


@pytest.fixture(scope="module")
def secret_stack(run_dir, artifacts, upstream):
    h.skip_on_native("native host: no idemstore in the path; the shared secret (`x-idem-secret`) is "
                     "idemstore's, the module's store runs in Envoy's process")
    sub = run_dir / "store-secret"
    sub.mkdir(parents=True, exist_ok=True)
    secret_file = sub / "secret"
    secret_file.write_text(SECRET + "\n")
    store, sport = start_store_with_secret(sub, secret_file)
    filters = {ln: [secret_filter(cfg, artifacts["wasm"], [ENV_NAME] if ln == "env" else None)]
               for ln, cfg in LISTENERS.items()}
    try:
        # Envoy's own environment holds the variable; host_env_keys passes it into the VM.
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(ENV_NAME, SECRET)
            envoy = h.spawn_envoy(sub, "envoy", filters, upstream.port, sport)
        h.await_envoy(envoy)
    except h.HarnessError:
        store.stop()
        raise
    yield envoy, store, upstream
    envoy.stop()
    store.stop()


def post(envoy: h.Envoy, listener: str, key: str, body: str = '{"item":"book"}') -> h.Response:
    return h.request(envoy.port(listener), "POST", "/orders", body,
                     [("Idempotency-Key", key), ("content-type", "application/json")])


@pytest.mark.parametrize("listener", ["right", "env"])
def test_right_secret_replays(secret_stack, listener):
    envoy, _, upstream = secret_stack
    degraded, stored = envoy.counter("degraded"), envoy.counter("stored")
    key = new_key()
    first = post(envoy, listener, key)
    assert_executed(first, 201)
    assert envoy.wait_counter("stored", stored + 1) == stored + 1
    assert_replay_of(post(envoy, listener, key), first)
    assert upstream.count(key=key) == 1
    assert envoy.counter("degraded") == degraded


@pytest.mark.parametrize("listener", ["wrong", "missing"])
def test_refused_secret_fails_open(secret_stack, listener):
    envoy, store, upstream = secret_stack
    before = envoy.counters()
    key = new_key()
    first = post(envoy, listener, key)
    assert_executed(first, 201)
    # The store refused both calls: the first ran under this Envoy's local lock (the local
    # fallback), the retry replays its local record; nothing reached the store.
    assert_replay_of(post(envoy, listener, key), first)
    assert upstream.count(key=key) == 1
    after = envoy.counters()
    assert after.get("degraded", 0) == before.get("degraded", 0) + 1
    assert after.get("local_replays", 0) == before.get("local_replays", 0) + 1
    assert after.get("stored", 0) == before.get("stored", 0)
    # The filter's log says why; idemstore's counts and logs the refusals, never a value.
    # (On the store stream the refusal closes the stream: "gRPC UNAUTHENTICATED, the stream's 401".)
    h.wait_for(lambda: "store refused the secret (" in envoy.log_text(), "the filter's 401 log line",
               timeout=5)
    h.wait_for(lambda: "refused a request: bad x-idem-secret" in store.log_text(), "idemstore's refusal log",
               timeout=5)
    for text in (store.log_text(), envoy.log_text()):
        assert SECRET not in text and "not-the-secret" not in text


def test_refused_secret_fails_closed(secret_stack):
    envoy, _, upstream = secret_stack
    unavailable = envoy.counter("unavailable")
    key = new_key()
    assert_problem(post(envoy, "wrong_closed", key), 503, raw_key=key)
    assert upstream.count(key=key) == 0
    assert envoy.counter("unavailable") == unavailable + 1


def test_healthz_is_open_and_the_protocol_is_not(secret_stack):
    """Straight to idemstore: the health check answers anyone, a store call without the secret
    gets 401."""
    _, store, _ = secret_stack
    port = int(store.argv[store.argv.index("--listen") + 1].rsplit(":", 1)[1])
    assert h.http_get_status(port, "/healthz") == (200, b"ok")
    headers = [("x-idem-key", "a" * 64), ("x-idem-body-hash", "b" * 64), ("x-idem-lock-ttl-ms", "1000"),
               ("x-idem-wait-ms", "1")]
    resp = h.request(port, "POST", "/v1/begin", b"", headers)
    assert resp.status == 401, resp
    resp = h.request(port, "POST", "/v1/begin", b"", headers + [("x-idem-secret", SECRET)])
    assert (resp.status, resp.header("x-idem-outcome")) == (200, "locked"), resp


READY_DEADLINE = 15.0


@pytest.mark.parametrize("case", ["unset_in_envoy", "not_passed_to_the_vm"])
def test_store_secret_env_must_resolve(case, run_dir, artifacts, upstream):
    """`store_secret_env` naming a variable the VM does not see is refused at load, naming the
    key: unset in Envoy's environment, or set there but not listed in host_env_keys. The native
    host reads Envoy's own environment (no VM, no host_env_keys): only the unset case applies."""
    if case == "not_passed_to_the_vm":
        h.skip_on_native("native host: no VM environment to pass a variable into; the module reads "
                         "Envoy's own environment")
    name = f"IDEM_E2E_SECRET_{case.upper()}"
    env_keys = [name] if case == "unset_in_envoy" else None
    if h.native():
        f = h.wasm_filter(plugin_config(store_secret_env=name), artifacts["wasm"])
    else:
        f = secret_filter({"store_secret_env": name}, artifacts["wasm"], env_keys)
    if env_keys is None:
        f["typed_config"]["config"]["vm_config"]["vm_id"] = "idempotency-noenv"
    admin, port = h.free_port(), h.free_port()
    config = h.envoy_config(admin, [h.listener("default", port, [f])], upstream.port, h.free_port())
    with pytest.MonkeyPatch.context() as mp:
        if case == "unset_in_envoy":
            mp.delenv(name, raising=False)
        else:
            mp.setenv(name, SECRET)
        proc = h.launch_envoy(run_dir / "store-secret", f"envoy-secret-env-{case}", config)
    try:
        deadline = time.monotonic() + READY_DEADLINE
        while time.monotonic() < deadline and proc.alive():
            status = None
            try:
                status = h.http_get_status(admin, "/ready")[1].strip()
            except OSError:
                pass
            assert status != b"LIVE", f"Envoy became ready\n{proc.describe(60)}"
            time.sleep(0.1)
        assert proc.returncode() not in (None, 0), proc.describe(60)
        lines = [ln for ln in proc.log_text().splitlines() if "store_secret_env" in ln and name in ln]
        assert lines, f"no log line names store_secret_env and {name}\n{proc.describe(60)}"
        assert SECRET not in proc.log_text()
    finally:
        proc.stop()
