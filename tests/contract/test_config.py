"""An invalid plugin configuration is refused and the log names the key."""

from __future__ import annotations

import pytest

from support import harness as h

# (plugin configuration, words that the refusal line must contain)
INVALID = {
    "retention_too_large": ({"store_cluster": "idemstore", "retention_seconds": 999999999},
                            ["retention_seconds", "604800"]),
    "retention_zero": ({"store_cluster": "idemstore", "retention_seconds": 0}, ["retention_seconds"]),
    "unknown_key": ({"store_cluster": "idemstore", "foo": 1}, ["foo"]),
    "wrong_type": ({"store_cluster": "idemstore", "lock_ttl_ms": "x"}, ["lock_ttl_ms"]),
    "missing_store_cluster": ({}, ["store_cluster"]),
    "bad_failure_mode": ({"store_cluster": "idemstore", "failure_mode": "sideways"}, ["failure_mode"]),
    "mismatch_status_not_409_or_422": ({"store_cluster": "idemstore", "mismatch_status": 400},
                                       ["mismatch_status", "422 or 409"]),
    "not_json": ("{store_cluster: idemstore", []),
    # detached_timeout_ms is 1 .. lock_ttl_ms (a detached call must not outlive its lock)
    "detached_timeout_above_lock_ttl": ({"store_cluster": "idemstore", "detached_execution": True,
                                         "lock_ttl_ms": 1000, "detached_timeout_ms": 1001},
                                        ["detached_timeout_ms"]),
    "detached_timeout_above_default_lock_ttl": ({"store_cluster": "idemstore", "detached_timeout_ms": 30001},
                                                ["detached_timeout_ms"]),
    "detached_timeout_zero": ({"store_cluster": "idemstore", "detached_timeout_ms": 0}, ["detached_timeout_ms"]),
    "detached_execution_wrong_type": ({"store_cluster": "idemstore", "detached_execution": "yes"},
                                      ["detached_execution"]),
    "store_key_header_wrong_type": ({"store_cluster": "idemstore", "store_key_header": 5}, ["store_key_header"]),
    "store_key_header_not_a_name": ({"store_cluster": "idemstore", "store_key_header": "x key"},
                                    ["store_key_header"]),
    "store_key_header_is_the_key_header": ({"store_cluster": "idemstore", "store_key_header": "idempotency-key"},
                                           ["store_key_header"]),
    # Cookies and hop-by-hop headers are never stored, even when a config asks for them.
    "replay_headers_set_cookie": ({"store_cluster": "idemstore", "replay_headers": ["location", "set-cookie"]},
                                  ["replay_headers", "set-cookie"]),
    "replay_headers_connection": ({"store_cluster": "idemstore", "replay_headers": ["connection"]},
                                  ["replay_headers", "connection"]),
    "replay_headers_transfer_encoding": ({"store_cluster": "idemstore", "replay_headers": ["transfer-encoding"]},
                                         ["replay_headers", "transfer-encoding"]),
    "replay_headers_upper_case": ({"store_cluster": "idemstore", "replay_headers": ["Location"]}, ["replay_headers"]),
    "replay_headers_not_a_list": ({"store_cluster": "idemstore", "replay_headers": "location"}, ["replay_headers"]),
    "methods_empty": ({"store_cluster": "idemstore", "methods": []}, ["methods"]),
    "methods_lower_case": ({"store_cluster": "idemstore", "methods": ["post"]}, ["methods"]),
    "max_key_length_zero": ({"store_cluster": "idemstore", "max_key_length": 0}, ["max_key_length", "4096"]),
    "max_body_bytes_huge": ({"store_cluster": "idemstore", "max_body_bytes": 2**40}, ["max_body_bytes"]),
    "lock_ttl_negative": ({"store_cluster": "idemstore", "lock_ttl_ms": -1}, ["lock_ttl_ms"]),
    "store_timeout_fraction": ({"store_cluster": "idemstore", "store_timeout_ms": 1.5}, ["store_timeout_ms"]),
    "lock_wait_null": ({"store_cluster": "idemstore", "lock_wait_ms": None}, ["lock_wait_ms"]),
    "require_key_string": ({"store_cluster": "idemstore", "require_key": "true"}, ["require_key"]),
    "replay_header_not_a_name": ({"store_cluster": "idemstore", "replay_header": "x replay"}, ["replay_header"]),
    "subject_header_not_a_name": ({"store_cluster": "idemstore", "subject": {"header": "X User"}},
                                  ["subject.header"]),
    "subject_metadata_without_path": ({"store_cluster": "idemstore", "subject": {"metadata": {"filter": "f"}}},
                                      ["subject.metadata.path"]),
    "store_cluster_empty": ({"store_cluster": ""}, ["store_cluster"]),
    "top_level_list": (["store_cluster", "idemstore"], []),
    # The record cache.
    "record_cache_entries_too_many": ({"store_cluster": "idemstore", "record_cache_entries": 100001},
                                      ["record_cache_entries", "0 to 100000"]),
    "breaker_failures_zero": ({"store_cluster": "idemstore", "breaker_failures": 0}, ["breaker_failures", "1 to 1000"]),
    "breaker_open_ms_too_long": ({"store_cluster": "idemstore", "breaker_open_ms": 60001},
                                 ["breaker_open_ms", "0 to 60000"]),
    "local_fallback_not_bool": ({"store_cluster": "idemstore", "local_fallback": "yes"}, ["local_fallback"]),
    "local_record_entries_too_many": ({"store_cluster": "idemstore", "local_record_entries": 1000001},
                                      ["local_record_entries", "0 to 1000000"]),
    "record_cache_bytes_negative": ({"store_cluster": "idemstore", "record_cache_bytes": -1},
                                    ["record_cache_bytes"]),
    # Inbox mode.
    "inbox_without_mode": ({"store_cluster": "idemstore", "inbox": {"missing_id": "pass"}}, ["inbox", "mode"]),
    "mode_unknown": ({"store_cluster": "idemstore", "mode": "outbox"}, ["mode", "inbox"]),
    "inbox_message_id_unknown_form": ({"store_cluster": "idemstore", "mode": "inbox",
                                       "inbox": {"message_id": {"kafka_key": True}}}, ["inbox.message_id"]),
    "inbox_message_id_unknown_name": ({"store_cluster": "idemstore", "mode": "inbox",
                                       "inbox": {"message_id": "amqp"}}, ["inbox.message_id"]),
    "inbox_duplicate_status_500": ({"store_cluster": "idemstore", "mode": "inbox",
                                    "inbox": {"duplicate_status": 500}}, ["inbox.duplicate_status", "200 to 299"]),
    "inbox_missing_id_drop": ({"store_cluster": "idemstore", "mode": "inbox", "inbox": {"missing_id": "drop"}},
                              ["inbox.missing_id"]),
    "inbox_json_pointer_without_slash": ({"store_cluster": "idemstore", "mode": "inbox",
                                          "inbox": {"message_id": {"json_pointer": "message/messageId"}}},
                                         ["inbox.message_id.json_pointer"]),
    "inbox_header_upper_case": ({"store_cluster": "idemstore", "mode": "inbox",
                                 "inbox": {"message_id": {"header": "X-Message-Id"}}}, ["inbox.message_id.header"]),
    "inbox_unknown_key": ({"store_cluster": "idemstore", "mode": "inbox", "inbox": {"retries": 3}},
                          ["inbox.retries"]),
    "inbox_with_require_key": ({"store_cluster": "idemstore", "mode": "inbox", "require_key": True},
                               ["require_key", "inbox"]),
    "inbox_with_subject": ({"store_cluster": "idemstore", "mode": "inbox", "subject": {"header": "x-user"}},
                           ["subject", "inbox"]),
    # The record (format v2) and the fingerprint.
    "lock_wait_negative": ({"store_cluster": "idemstore", "lock_wait_ms": -1}, ["lock_wait_ms", "0 to 60000"]),
    "fingerprint_headers_upper_case": ({"store_cluster": "idemstore", "fingerprint_headers": ["X-Tenant"]},
                                       ["fingerprint_headers"]),
    "fingerprint_headers_the_key": ({"store_cluster": "idemstore", "fingerprint_headers": ["idempotency-key"]},
                                    ["fingerprint_headers"]),
    "fingerprint_json_not_an_object": ({"store_cluster": "idemstore", "fingerprint_json": True},
                                       ["fingerprint_json"]),
    "fingerprint_json_bad_pointer": ({"store_cluster": "idemstore", "fingerprint_json": {"ignore": ["sent_at"]}},
                                     ["fingerprint_json.ignore", "RFC 6901"]),
    "fingerprint_json_unknown_key": ({"store_cluster": "idemstore", "fingerprint_json": {"sorted": True}},
                                     ["fingerprint_json.sorted"]),
    "store_statuses_1xx": ({"store_cluster": "idemstore", "store_statuses": ["1xx"]}, ["store_statuses", "2xx"]),
    "store_statuses_empty": ({"store_cluster": "idemstore", "store_statuses": []}, ["store_statuses"]),
    "store_content_types_not_a_media_type": ({"store_cluster": "idemstore", "store_content_types": ["json"]},
                                             ["store_content_types"]),
    "store_content_types_with_parameters": ({"store_cluster": "idemstore",
                                             "store_content_types": ["text/plain; charset=utf-8"]},
                                            ["store_content_types"]),
    "record_too_large_unknown": ({"store_cluster": "idemstore", "record_too_large": "truncate"},
                                 ["record_too_large", "omit_body"]),
    "body_omitted_header_is_the_replay_header": ({"store_cluster": "idemstore",
                                                  "body_omitted_header": "x-idempotent-replay"},
                                                 ["body_omitted_header", "replay_header"]),
    "inbox_with_store_statuses": ({"store_cluster": "idemstore", "mode": "inbox", "store_statuses": ["4xx"]},
                                  ["store_statuses", "inbox"]),
    "inbox_with_fingerprint_headers": ({"store_cluster": "idemstore", "mode": "inbox",
                                        "fingerprint_headers": ["x-tenant"]}, ["fingerprint_headers", "inbox"]),
    "unknown_outcome_unknown": ({"store_cluster": "idemstore", "unknown_outcome": "retry"},
                                ["unknown_outcome", "run_again"]),
    "outcome_lookup_without_store_key_header": ({"store_cluster": "idemstore",
                                                 "outcome_lookup": {"path": "/orders/by-key/{key}"}},
                                                ["outcome_lookup", "store_key_header"]),
    "outcome_lookup_without_key": ({"store_cluster": "idemstore", "store_key_header": "x-k",
                                    "outcome_lookup": {"path": "/orders/lookup"}}, ["outcome_lookup.path", "{key}"]),
    "outcome_lookup_relative": ({"store_cluster": "idemstore", "store_key_header": "x-k",
                                 "outcome_lookup": {"path": "orders/{key}"}}, ["outcome_lookup.path"]),
}

READY_DEADLINE = 15.0


def ready(envoy_admin: int) -> bool:
    try:
        return h.http_get_status(envoy_admin, "/ready")[1].strip() == b"LIVE"
    except OSError:
        return False


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_config_is_refused(case, run_dir, artifacts, upstream):
    cfg, words = INVALID[case]
    admin = h.free_port()
    port = h.free_port()
    config = h.envoy_config(admin, [h.listener("default", port, [h.wasm_filter(cfg, artifacts["wasm"])])],
                            upstream.port, h.free_port())
    proc = h.launch_envoy(run_dir / "config", f"envoy-{case}", config)
    try:
        log = h.envoy_refused(proc, admin, READY_DEADLINE)
        lines = [ln for ln in log.splitlines() if h.is_filter_log_line(ln)]
        if words:
            hits = [ln for ln in lines if all(w in ln for w in words)]
            assert hits, f"no filter log line names {words}\n{proc.describe(60)}"
    finally:
        proc.stop()


def assert_config_serves(run_dir, artifacts, upstream, name: str, cfg: dict) -> None:
    """An Envoy with this plugin configuration becomes ready and serves a request."""
    admin = h.free_port()
    port = h.free_port()
    config = h.envoy_config(admin, [h.listener("default", port, [h.wasm_filter(cfg, artifacts["wasm"])])],
                            upstream.port, h.free_port())
    proc = h.launch_envoy(run_dir / "config", name, config)
    try:
        h.wait_for(lambda: ready(admin), "envoy ready", proc, timeout=READY_DEADLINE)
        resp = h.request(port, "GET", "/orders")
        assert resp.status == 201, resp
    finally:
        proc.stop()


def test_valid_config_starts(run_dir, artifacts, upstream):
    """The control for the test above: the same Envoy with a valid config serves."""
    cfg = {"store_cluster": "idemstore", "retention_seconds": 604800, "lock_ttl_ms": 1000,
           "methods": ["POST"], "failure_mode": "open", "subject": {"header": "x-user"}}
    assert_config_serves(run_dir, artifacts, upstream, "envoy-valid", cfg)


def test_valid_inbox_config_starts(run_dir, artifacts, upstream):
    """Every inbox key at once is accepted (a GET is not guarded, so it reaches the upstream)."""
    cfg = {"store_cluster": "idemstore", "mode": "inbox", "retention_seconds": 604800,
           "inbox": {"message_id": {"json_pointer": "/message/messageId"}, "missing_id": "pass",
                     "duplicate_status": 204}}
    assert_config_serves(run_dir, artifacts, upstream, "envoy-valid-inbox", cfg)


def test_valid_detached_config_starts(run_dir, artifacts, upstream):
    """The boundary: detached_timeout_ms equal to lock_ttl_ms is accepted."""
    cfg = {"store_cluster": "idemstore", "lock_ttl_ms": 1000, "detached_execution": True,
           "detached_timeout_ms": 1000, "store_key_header": "x-idempotency-store-key"}
    h.skip_on_native(h.native_refusal(cfg) or "refuses this configuration")
    assert_config_serves(run_dir, artifacts, upstream, "envoy-valid-detached", cfg)
