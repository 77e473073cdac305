"""Self-checks of the harness's host parameter (`harness.host`, IDEM_HOST): an idemstore command
line read as the native host's `store`, and a rendered config carried over to the native host
(`for_native`). Pure: no process is started (the idemstore ports are made up)."""

from __future__ import annotations

import json

import pytest

from support import harness as h

IDEMSTORE = "/bin/idemstore"


def test_idemstore_flags_map_to_store_keys():
    assert h.native_store_of([IDEMSTORE, "--listen", "127.0.0.1:40001"]) == (40001, {"memory": True})
    assert h.native_store_of([IDEMSTORE, "--listen", "127.0.0.1:40002", "--redis", "redis://127.0.0.1:6390",
                              "--worker-threads", "2"]) == (40002, {"redis": "redis://127.0.0.1:6390"})
    # The secured stacks (support/secure.py): TLS to Redis, the ACL user in the URL, its
    # password file, the key prefix; idemstore's own listener TLS is no concern of the store.
    port, store = h.native_store_of([
        IDEMSTORE, "--listen", "127.0.0.1:40003", "--redis", "rediss://idemstore@127.0.0.1:6391",
        "--redis-ca-file", "/p/ca.pem", "--redis-cert-file", "/p/c.pem", "--redis-key-file", "/p/c.key",
        "--redis-password-file", "/p/pw", "--key-prefix", "e2e:", "--tls-cert-file", "/p/s.pem",
        "--tls-key-file", "/p/s.key", "--tls-client-ca-file", "/p/ca.pem"])
    assert (port, store) == (40003, {"redis": "rediss://idemstore@127.0.0.1:6391", "ca_file": "/p/ca.pem",
                                     "cert_file": "/p/c.pem", "key_file": "/p/c.key",
                                     "password_file": "/p/pw", "key_prefix": "e2e:"})
    assert h.native_store_of([IDEMSTORE, "--listen=127.0.0.1:40004", "--redis-cluster=redis://a:1,redis://b:2",
                              "--redis-timeout-ms", "500"]) == \
        (40004, {"redis_cluster": ["redis://a:1", "redis://b:2"], "timeout_ms": 500})
    # What has no `store` key says so; a tool's command line serves no store.
    port, why = h.native_store_of([IDEMSTORE, "--listen", "127.0.0.1:40005", "--bogus", "1"])
    assert port == 40005 and "--bogus" in why
    assert "IDEMSTORE_REDIS_PASSWORD" in h.native_store_of(
        [IDEMSTORE, "--listen", "127.0.0.1:40006", "--redis", "redis://x:1"], {"IDEMSTORE_REDIS_PASSWORD": "p"})[1]
    assert h.native_store_of([IDEMSTORE, "records", "count", "--url", "redis://x:1"]) is None


def test_a_rendered_config_becomes_the_native_hosts(monkeypatch):
    monkeypatch.setenv("IDEM_HOST", "wasm")
    # As `harness.start` registers an idemstore it starts (undone after the test).
    monkeypatch.setitem(h._IDEMSTORES, *h.native_store_of(
        [IDEMSTORE, "--listen", "127.0.0.1:40010", "--redis", "redis://127.0.0.1:6392"]))
    guard = h.wasm_filter({"store_cluster": "idemstore", "store_transport": "stream", "lock_wait_ms": 1},
                          "/x.wasm")
    refused = h.wasm_filter({"store_cluster": "idemstore", "detached_execution": True}, "/x.wasm")
    dead = h.wasm_filter({"store_cluster": "deadstore"}, "/x.wasm")
    config = h.envoy_config(1, [h.listener("guard", 2, [h.skip_unless_keyed(guard)]),
                                h.listener("detached", 3, [refused]),
                                h.listener("dead", 4, [dead])], 5, 40010)
    config["static_resources"]["clusters"].append(h.store_cluster(40011, name="deadstore"))
    native, left_out = h.for_native(config, leave_out_refused=True)
    assert list(left_out) == ["detached"] and "`detached_execution`" in left_out["detached"]
    listeners = {ln["name"]: ln for ln in native["static_resources"]["listeners"]}
    assert set(listeners) == {"guard", "dead"}

    def module_config(listener: dict) -> dict:
        found = []
        h._walk_filters(listener, lambda d: found.append(d["typed_config"])
                        if d["typed_config"].get("@type") == h.MODULE_FILTER_TYPE else None)
        [tc] = found
        return json.loads(tc["filter_config"]["value"])

    # The wasm filter (inside the composite matcher too) is the module's, its store the
    # idemstore's backend; a cluster nothing listens behind is a Redis nothing answers at.
    assert module_config(listeners["guard"]) == {"lock_wait_ms": 1, "store": {"redis": "redis://127.0.0.1:6392"}}
    assert module_config(listeners["dead"]) == {"store": {"redis": "redis://127.0.0.1:40011"}}
    assert json.dumps(config).count(h.WASM_FILTER_TYPE) == 3  # the original is left as it was
    # A filter written for the module is the module's to refuse (tests/native's refusals).
    own = h.envoy_config(1, [h.listener("own", 2, [h.native_filter({"store": {"memory": True},
                                                                    "detached_execution": True})])], 5, 40010)
    assert h.for_native(own, leave_out_refused=True)[1] == {}


@pytest.mark.parametrize("cfg, refused", [
    ({"store_cluster": "s"}, None),
    ({"store_cluster": "s", "subject": {"property": ["connection", "uri_san_peer_certificate"]}}, None),
    ({"store_cluster": "s", "subject": {"property": ["metadata", "x"]}}, "`subject.property`"),
    ({"store_cluster": "s", "routes": {"a": {"subject": {"metadata": {"filter": "f", "path": ["p"]}}}}},
     "`subject.metadata` (route 'a')"),
    ({"store_cluster": "s", "routes": {"orders": {"outcome_lookup": {"path": "/x/{key}"}}}},
     "`outcome_lookup` (route 'orders')"),
])
def test_what_the_native_host_refuses(cfg, refused):
    reason = h.native_refusal(cfg)
    assert (reason is None) if refused is None else (refused in reason), reason


def test_the_host_parameter(monkeypatch):
    monkeypatch.setenv("IDEM_HOST", "native")
    monkeypatch.delenv("IDEM_STORE_TRANSPORT", raising=False)
    assert h.native() and h.filter_stat("stored") == "idempotency.stored" and h.filter_name() == "idempotency"
    assert h.wasm_filter({"store_cluster": "idemstore"}, "/x.wasm")["typed_config"]["@type"] == h.MODULE_FILTER_TYPE
    monkeypatch.setenv("IDEM_STORE_TRANSPORT", "callout")
    with pytest.raises(ValueError, match="no store transport"):
        h.host()
    monkeypatch.setenv("IDEM_HOST", "wasm")
    assert h.filter_stat("stored") == "wasmcustom.idempotency.stored"
    monkeypatch.setenv("IDEM_HOST", "v8")
    with pytest.raises(ValueError):
        h.host()
