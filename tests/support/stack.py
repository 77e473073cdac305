"""The suite's standard stack: the plugin configuration per listener, the backends, and starting
idemstore (in memory or on Redis) and a filter Envoy with one listener per configuration. The
session-scoped `stack` fixture (conftest.py) is built from these; tests that need their own
Envoy or store use `start_backend`, `start_filter_envoy` and `plugin_config` directly."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from . import harness as h

# Listener name -> plugin configuration (store_cluster added). Each listener has the routes
# `orders` (/orders), `payments` (/payments) and an unnamed one (/).
LISTENERS: dict[str, dict] = {
    "default": {},
    "require": {"require_key": True},
    "short": {"retention_seconds": 2, "lock_wait_ms": 1000},
    "subject_header": {"subject": {"header": "x-user"}},
    "closed": {"failure_mode": "closed"},
    # The subject from dynamic metadata, as jwt_authn would write it (here header_to_metadata
    # copies x-user into namespace `auth`, key `sub`, and removes the header).
    "subject_metadata": {"subject": {"metadata": {"filter": "auth", "path": ["sub"]}}},
    # Record format v2 (test_record.py): no lock wait (a duplicate in flight is a 409 at
    # once, retry-after from the lock's time left), other statuses kept, the fingerprint
    # widened to a header and compared as JSON, content types narrowed, and the old release
    # of answers too large to record.
    "strict": {"lock_wait_ms": 0, "lock_ttl_ms": 10000},
    "statuses": {"store_statuses": ["2xx", "4xx"]},
    "fingerprint": {"fingerprint_headers": ["x-tenant"],
                    "fingerprint_json": {"canonical": True, "ignore": ["/client_sent_at"]}},
    "json_only": {"store_content_types": ["application/json", "+json"]},
    "release_large": {"record_too_large": "release", "max_record_bytes": 65536},
}

# HTTP filters that run before the idempotency filter on some listeners.
PRE_FILTERS: dict[str, list[dict]] = {
    "subject_metadata": [{
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
            "request_rules": [{
                "header": "x-user",
                "on_header_present": {"metadata_namespace": "auth", "key": "sub", "type": "STRING"},
                "remove": True,
            }],
        },
    }],
}

BACKENDS = ["memory", "redis"]
# The stacks the contract tests run against: each backend, and once more with the filter wrapped
# as envoy/envoy.yaml ships it (`harness.skip_unless_keyed`: Envoy's composite filter creates the
# filter only for requests with a key and a guarded method) on every listener but `require` (with
# `require_key` the filter must see requests without a key to refuse them).
ALL_STACKS = {"memory": ("memory", False), "redis": ("redis", False), "redis-matcher": ("redis", True)}


def chosen_stacks() -> dict[str, tuple[str, bool]]:
    """The stacks of this run: all, or those `IDEM_STACKS` names (comma-separated); `make e2e`'s
    second pass leaves out `memory`, whose backend is the same on either store transport."""
    names = [n for n in (os.environ.get("IDEM_STACKS") or "").split(",") if n]
    unknown = [n for n in names if n not in ALL_STACKS]
    if unknown:
        raise ValueError(f"IDEM_STACKS: unknown stacks {unknown}; known: {list(ALL_STACKS)}")
    return {n: ALL_STACKS[n] for n in names} if names else dict(ALL_STACKS)


STACKS = chosen_stacks()
UNWRAPPABLE = {"require"}


def plugin_config(**overrides) -> dict:
    cfg = {"store_cluster": "idemstore"}
    cfg.update(overrides)
    return cfg


@dataclass
class Stack:
    backend: str
    envoy: h.Envoy
    upstream: h.Upstream
    idemstore: h.Proc
    idemstore_port: int
    redis: h.Proc | None = None
    # The filter behind the composite matcher (requests it is not created for count no `passthrough`).
    matcher: bool = False

    def port(self, listener: str = "default") -> int:
        return self.envoy.port(listener)

    def post(self, path: str, body: bytes | str = b"{}", key: str | bytes | None = None,
             listener: str = "default", headers: list | None = None, **kw) -> h.Response:
        hdrs = list(headers or [])
        if key is not None:
            hdrs.append(("Idempotency-Key", key))
        hdrs.append(("content-type", "application/json"))
        return h.request(self.port(listener), "POST", path, body, hdrs, **kw)

    def counter(self, name: str) -> int:
        return self.envoy.counter(name)

    def wait_counter(self, name: str, at_least: int, timeout: float = 5.0) -> int:
        return self.envoy.wait_counter(name, at_least, timeout)


def start_backend(run_dir: Path, backend: str, name: str | None = None) -> tuple[h.Proc, int, h.Proc | None]:
    """idemstore in memory or on its own Redis, started and healthy. Under IDEM_SECURE_STORE
    (`harness.secure_store`) secured instead (support/secure.py): idemstore's listener on
    mutual TLS, which every Envoy's store cluster toward it then speaks, and its Redis on TLS
    only, as the documented ACL user, keys under the prefix `e2e:`."""
    sub = run_dir / (name or backend)
    if h.secure_store():
        from . import secure  # cryptography: only for the secured stores

        return secure.start_backend(sub, backend)
    redis = None
    redis_url = None
    if backend == "redis":
        redis, rport = h.start_redis(sub)
        redis_url = f"redis://127.0.0.1:{rport}"
    try:
        store, sport = h.start_idemstore(sub, redis_url)
    except h.HarnessError:
        if redis is not None:
            redis.stop()
        raise
    return store, sport, redis


def start_filter_envoy(run_dir: Path, name: str, listeners: dict[str, dict], upstream_port: int,
                       idemstore_port: int, wasm: str, matcher: bool = False) -> h.Envoy:
    def wrap(ln: str, f: dict) -> dict:
        return h.skip_unless_keyed(f) if matcher and ln not in UNWRAPPABLE else f

    filters = {ln: PRE_FILTERS.get(ln, []) + [wrap(ln, h.wasm_filter(plugin_config(**cfg), wasm))]
               for ln, cfg in listeners.items()}
    return h.start_envoy(run_dir, name, filters, upstream_port, idemstore_port)


# The mode Istio can configure (test_istio_mode.py, test_inbox.py): no pause on headers, a buffer
# filter after the idempotency filter.
BUFFER_BYTES = 1048576 + 65536  # max_body_bytes plus room, so the filter's 413 comes first


def istio_filters(wasm: str, buffer_filter: bool = True, **cfg) -> list[dict]:
    f = h.wasm_filter(plugin_config(pause_on_headers=False, **cfg), wasm)
    if not h.native():  # the module has no such Envoy setting: `pause_on_headers` is all
        f["typed_config"]["config"]["allow_on_headers_stop_iteration"] = False
    buffer = {
        "name": "envoy.filters.http.buffer",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
            "max_request_bytes": BUFFER_BYTES,
        },
    }
    return [f, buffer] if buffer_filter else [f]
