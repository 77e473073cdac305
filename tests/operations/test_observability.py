"""Observability: each request's outcome in Envoy's access log (filter state
`wasm.idempotency_outcome`), and every documented filter metric in Envoy's Prometheus output,
the store latency histograms included."""

from __future__ import annotations

import json
import re
import uuid

import pytest

from support import harness as h
from support.checks import assert_executed, assert_problem, assert_replay_of
from support.stack import plugin_config

# The access log format the shipped configs use for the outcome (JSON lines).
ACCESS_LOG_FORMAT = {
    "start": "%START_TIME%",
    "method": "%REQ(:METHOD)%",
    "path": "%REQ(:PATH)%",
    "status": "%RESPONSE_CODE%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "idempotency": "%FILTER_STATE(wasm.idempotency_outcome:PLAIN)%",
    "duration_ms": "%DURATION%",
}

# Every counter and histogram the README documents, by its Prometheus name.
COUNTERS = ["guarded", "replayed", "executed", "stored", "mismatched", "conflicted", "rejected", "degraded",
            "unavailable", "passthrough", "released", "commit_failed", "store_errors", "detached",
            "committed_after_gone", "cache_hits", "store_skipped", "local_locks", "local_replays", "handed_back",
            "handback_dropped", "minted", "grpc_unguarded", "store_streams_opened", "store_stream_resets",
            "store_stream_calls", "in_doubt", "outcome_unknown", "in_doubt_resolved_lookup", "in_doubt_resolved_rerun"]
HISTOGRAMS = ["store_us_begin", "store_us_commit", "store_us_release"]


def with_access_log(path):
    def hook(config):
        # Histograms reach /stats/prometheus at each stats flush (5 s by default).
        config["stats_flush_interval"] = "0.5s"
        for ln in config["static_resources"]["listeners"]:
            hcm = ln["filter_chains"][0]["filters"][0]["typed_config"]
            hcm["access_log"] = [{
                "name": "envoy.access_loggers.file",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                    "path": str(path),
                    "log_format": {"json_format": ACCESS_LOG_FORMAT},
                },
            }]
    return hook


@pytest.fixture(scope="module")
def observed(run_dir, artifacts, upstream):
    sub = run_dir / "observability"
    sub.mkdir(parents=True, exist_ok=True)
    log = sub / "access.log"
    store, sport = h.start_idemstore(sub)
    filters = {
        "default": [h.wasm_filter(plugin_config(lock_wait_ms=200), artifacts["wasm"])],
        "closed": [h.wasm_filter(plugin_config(failure_mode="closed"), artifacts["wasm"])],
        "require": [h.wasm_filter(plugin_config(require_key=True), artifacts["wasm"])],
    }
    envoy = h.await_envoy(h.spawn_envoy(sub, "envoy", filters, upstream.port, sport, config_hook=with_access_log(log)))
    yield envoy, store, log
    envoy.stop()
    store.stop()


def access_entries(log, path_prefix: str) -> list[dict]:
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        doc = json.loads(line)
        if (doc.get("path") or "").startswith(path_prefix):
            out.append(doc)
    return out


def test_outcome_in_access_log(observed, upstream):
    envoy, store, log = observed
    base = f"/orders/{uuid.uuid4().hex}"
    port = envoy.port("default")
    J = ("content-type", "application/json")

    def post(path, body="{}", key=None, listener="default", extra=()):
        hdrs = [J, *extra] + ([("Idempotency-Key", key)] if key else [])
        return h.request(envoy.port(listener), "POST", path, body, hdrs)

    key = h.new_key("obs")
    first = post(f"{base}/a", key=key)
    assert_executed(first, 201)
    envoy.wait_counter("stored", 1)
    assert_replay_of(post(f"{base}/a", key=key), first)
    assert_problem(post(f"{base}/a", '{"x":1}', key=key), 422)
    assert_executed(post(f"{base}/b"), 201)  # no key
    assert_problem(post(f"{base}/c", key="bad key"), 400)
    assert_problem(post(f"{base}/d", key=None, listener="require"), 400)
    slow = h.new_key("obs-slow")
    t, out = h.in_thread(lambda: post(f"{base}/e", key=slow, extra=[("x-test-sleep-ms", "800")]))
    h.poll_until(lambda: upstream.count(path=f"{base}/e"), 1, timeout=5)
    assert_problem(post(f"{base}/e", key=slow), 409)
    assert_executed(h.joined(t, out), 201)
    assert h.request(port, "GET", f"{base}/f").status == 201  # not a guarded method
    store.stop()
    assert_executed(post(f"{base}/g", key=h.new_key("obs-down")), 201)
    assert_problem(post(f"{base}/h", key=h.new_key("obs-closed"), listener="closed"), 503)

    want = {
        ("POST", "/a", 201): ["executed", "replayed"],
        ("POST", "/a", 422): ["mismatch"],
        ("POST", "/b", 201): ["passthrough"],
        ("POST", "/c", 400): ["rejected"],
        ("POST", "/d", 400): ["rejected"],
        ("POST", "/e", 409): ["conflict"],
        ("POST", "/e", 201): ["executed"],
        ("GET", "/f", 201): [None],  # not guarded: no outcome (null in a JSON log, "-" in text)
        ("POST", "/g", 201): ["degraded"],
        ("POST", "/h", 503): ["unavailable"],
    }
    n = sum(len(v) for v in want.values())
    entries = h.wait_for(lambda: (e := access_entries(log, base)) and len(e) >= n and e, "access log lines",
                         timeout=10)
    got: dict = {}
    for e in entries:
        got.setdefault((e["method"], e["path"][len(base):], e["status"]), []).append(e["idempotency"])
    assert {k: sorted(v) for k, v in got.items()} == {k: sorted(v) for k, v in want.items()}, entries
    assert all(re.fullmatch(r"[0-9a-f-]{36}", e["request_id"]) for e in entries), entries


def prometheus(envoy) -> dict[str, float]:
    status, body = h.http_get_status(envoy.admin_port, "/stats/prometheus", timeout=5)
    assert status == 200
    out = {}
    for line in body.decode().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, _, value = line.rpartition(" ")
        out[name_labels] = float(value)
    return out


def test_every_documented_metric_in_prometheus(observed):
    envoy, _, _ = observed
    prom = prometheus(envoy)
    names = {k.split("{")[0] for k in prom}
    missing = [c for c in COUNTERS if f"idempotency_{c}" not in names]
    assert not missing, sorted(n for n in names if "idempotency" in n)
    for hname in HISTOGRAMS:
        count = [v for k, v in prom.items() if k.split("{")[0].endswith(f"idempotency_{hname}_count")]
        assert count, (hname, sorted(n for n in names if "idempotency" in n))

    def recorded(op):
        return sum(v for k, v in prometheus(envoy).items() if k.split("{")[0] == f"idempotency_store_us_{op}_count")
    # The test above sent begins and a commit; the histograms show them after the next flush.
    try:
        h.wait_for(lambda: recorded("begin") >= 5 and recorded("commit") >= 2, "store latency histograms", timeout=10)
    except h.HarnessError:
        raise AssertionError([(k, v) for k, v in prometheus(envoy).items() if "store" in k or "idempotency" in k])


def test_shipped_access_log_carries_the_outcome():
    import yaml

    doc = yaml.safe_load((h.ROOT / "envoy" / "envoy.yaml").read_text())
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    fmt = json.dumps(hcm["access_log"])
    assert "%FILTER_STATE(wasm.idempotency_outcome:PLAIN)%" in fmt, fmt
