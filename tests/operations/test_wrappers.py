"""The wrappers the shipped configurations put around the filter never guard less than the filter.

Envoy's composite filter (an `ExtensionWithMatcher`) creates the filter only for the requests its
matcher selects; a request it skips is never guarded. So every matcher in a shipped
configuration (the YAML files under envoy/, and the YAML examples in README.md and docs/) is
evaluated here, as Envoy would, on requests the filter guards:

* every method of the filter's `methods` (its top level and every route policy's), in every
  spelling (`POST`, `post`, `Post`, ...: HTTP/2 carries the method as the client wrote it, and
  the filter guards `post` as `POST`), with a key: the matcher selects it;
* a request carrying the gRPC replay hop's header (`x-idempotency-grpc-replay`, which only the
  filter may set) with any method and no key, wherever the configuration has the replay route:
  the matcher selects it, so the filter refuses it before the route could take it;
* a method the filter does not guard: skipped (what the wrapper is for).

Istio's VirtualService for the mesh pair selects its retry policy by method: the same spellings
must select it. And the gRPC replay listener reads what a guard can store: its own
`max_record_bytes` is at least every guard's, and its listener's and cluster's buffer limits are
that plus a record's framing (support/harness.py `replay_buffer_limit`).

tests/contract/test_wrapper_parity.py sends the requests through the shipped envoy/envoy.yaml and
the same configuration unwrapped, end to end.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from support import harness as h

ENVOY_DIR = h.ROOT / "envoy"
DOCS = [h.ROOT / "README.md", *sorted((h.ROOT / "docs").glob("*.md"))]
DEFAULT_METHODS = ["POST", "PATCH"]
HOP_HEADER = "x-idempotency-grpc-replay"
COMPOSITE = "envoy.filters.http.composite"


def spellings(method: str) -> list[str]:
    """The spellings a client may send: as written, lower, capitalised, alternating."""
    alternating = "".join(c.lower() if i % 2 else c.upper() for i, c in enumerate(method))
    return sorted({method, method.upper(), method.lower(), method.capitalize(), alternating})


# --------------------------------------------------------------------------------------------
# Envoy's matcher, as far as the shipped wrappers use it
# --------------------------------------------------------------------------------------------


def string_match(m: dict, value: str | None) -> bool:
    """envoy.type.matcher.v3.StringMatcher (and Istio's StringMatch) on one header value."""
    if value is None:
        return False
    fold = (lambda s: s.lower()) if m.get("ignore_case") else (lambda s: s)
    if "exact" in m:
        return fold(value) == fold(m["exact"])
    if "prefix" in m:
        return fold(value).startswith(fold(m["prefix"]))
    if "suffix" in m:
        return fold(value).endswith(fold(m["suffix"]))
    if "contains" in m:
        return fold(m["contains"]) in fold(value)
    regex = m.get("safe_regex", {}).get("regex") if "safe_regex" in m else m.get("regex")
    if regex is not None:
        # RE2 and Python agree on what these patterns use ((?i), alternation, .*); a match is
        # of the whole value.
        return re.fullmatch(regex, value) is not None
    raise AssertionError(f"a string matcher this test does not know: {m}")


def predicate_matches(p: dict, headers: dict[str, str]) -> bool:
    if "and_matcher" in p:
        return all(predicate_matches(q, headers) for q in p["and_matcher"]["predicate"])
    if "or_matcher" in p:
        return any(predicate_matches(q, headers) for q in p["or_matcher"]["predicate"])
    if "not_matcher" in p:
        return not predicate_matches(p["not_matcher"], headers)
    single = p["single_predicate"]
    typed = single["input"]["typed_config"]
    assert typed["@type"].endswith("HttpRequestHeaderMatchInput"), typed
    return string_match(single["value_match"], headers.get(typed["header_name"].lower()))


def selects(wrapper: dict, headers: dict[str, str]) -> bool:
    """Whether the composite wrapper creates its filter for a request with `headers`."""
    [m] = wrapper["typed_config"]["xds_matcher"]["matcher_list"]["matchers"]
    return predicate_matches(m["predicate"], headers)


# --------------------------------------------------------------------------------------------
# the shipped configurations
# --------------------------------------------------------------------------------------------


def walk(node):
    yield node
    if isinstance(node, dict):
        for v in node.values():
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)


def yaml_docs() -> list[tuple[str, dict]]:
    """(where, document) for every YAML document shipped: the files under envoy/ and the
    ```yaml blocks of the README and docs/."""
    out = []
    for path in sorted(ENVOY_DIR.rglob("*.yaml")):
        out += [(path.relative_to(h.ROOT).as_posix(), d) for d in yaml.safe_load_all(path.read_text())
                if isinstance(d, dict)]
    for path in DOCS:
        for i, block in enumerate(re.findall(r"```yaml\n(.*?)```", path.read_text(), re.S)):
            for d in yaml.safe_load_all(block):
                if isinstance(d, (dict, list)):
                    out.append((f"{path.relative_to(h.ROOT).as_posix()} (yaml block {i + 1})",
                                {"block": d}))
    return out


def wrappers(doc: dict) -> list[dict]:
    return [n for n in walk(doc) if isinstance(n, dict) and isinstance(n.get("typed_config"), dict)
            and n["typed_config"].get("extension_config", {}).get("name") == COMPOSITE]


def wrapped_config(wrapper: dict) -> dict | None:
    """The plugin configuration of the filter the wrapper creates (None in a docs example that
    leaves it out)."""
    [m] = wrapper["typed_config"]["xds_matcher"]["matcher_list"]["matchers"]
    inner = m["on_match"]["action"]["typed_config"]["typed_config"]
    try:
        return json.loads(inner["typed_config"]["config"]["configuration"]["value"])
    except (KeyError, TypeError):
        return None


def guarded_methods(cfg: dict | None) -> list[str]:
    """Every method the filter guards on some route: the top level's and each policy's."""
    cfg = cfg or {}
    methods = set(cfg.get("methods", DEFAULT_METHODS))
    for policy in (cfg.get("routes") or {}).values():
        methods |= set(policy.get("methods", cfg.get("methods", DEFAULT_METHODS)))
    return sorted(methods)


SHIPPED = [(where, doc, w) for where, doc in yaml_docs() for w in wrappers(doc)]


def test_the_wrappers_are_found():
    """The shipped wrappers this file checks: if one moves, this says so."""
    where = sorted({w for w, _, _ in SHIPPED})
    for expected in ["envoy/envoy.yaml", "envoy/docker/envoy.yaml", "envoy/jwt-authn.yaml",
                     "envoy/mesh/server.yaml", "envoy/mesh/client.yaml"]:
        assert expected in where, where
    assert any(w.startswith("docs/configuration.md") for w in where), where


@pytest.mark.parametrize("where,doc,wrapper", SHIPPED, ids=[w for w, _, _ in SHIPPED])
def test_wrapper_selects_every_spelling_of_every_guarded_method(where, doc, wrapper):
    cfg = wrapped_config(wrapper)
    methods = guarded_methods(cfg)
    missed = [m for method in methods for m in spellings(method)
              if not selects(wrapper, {":method": m, ":path": "/orders", "idempotency-key": "k-1"})]
    assert not missed, f"{where}: the wrapper skips {missed} with a key; the filter guards them as {methods}"
    for other in ["GET", "get", "PUT", "DELETE", "OPTIONS"]:
        if other.upper() not in methods:
            assert not selects(wrapper, {":method": other, ":path": "/orders", "idempotency-key": "k-1"}), \
                f"{where}: the wrapper creates the filter for {other}, which it does not guard"


@pytest.mark.parametrize("where,doc,wrapper", SHIPPED, ids=[w for w, _, _ in SHIPPED])
def test_wrapper_sends_the_hop_header_to_the_filter(where, doc, wrapper):
    """Where the configuration routes the gRPC replay hop, a request that carries its header
    from outside meets the filter (which refuses it), whatever its method, key or path."""
    cfg = wrapped_config(wrapper) or {}
    if cfg.get("mode") == "mint":
        pytest.skip("the sending side: no replay route behind it")
    if h.REPLAY_NAME not in json.dumps(doc) and not where.startswith("docs/"):
        pytest.skip("no gRPC replay route in this configuration")
    for method in ["POST", "post", "GET", "PUT"]:
        for path in ["/idempotency.filter.v1.GrpcReplay/Replay", "/orders"]:
            request = {":method": method, ":path": path, HOP_HEADER: "1"}
            assert selects(wrapper, request), f"{where}: {request} skips the filter"


def store_key_headers(cfg: dict | None) -> set[str]:
    """Every `store_key_header` of the wrapped filter: its top level's and each policy's."""
    cfg = cfg or {}
    names = {cfg["store_key_header"]} if cfg.get("store_key_header") else set()
    for policy in (cfg.get("routes") or {}).values():
        if policy.get("store_key_header"):
            names.add(policy["store_key_header"])
    return names


@pytest.mark.parametrize("where,doc,wrapper", SHIPPED, ids=[w for w, _, _ in SHIPPED])
def test_wrapper_sends_a_client_sent_store_key_header_to_the_filter(where, doc, wrapper):
    """The filter removes a store key header a client sends (the application must only ever get
    the filter's): a request carrying it meets the filter whatever its method and key."""
    names = store_key_headers(wrapped_config(wrapper))
    if not names:
        pytest.skip("no store_key_header")
    for name in names:
        for method in ["POST", "GET", "put"]:
            request = {":method": method, ":path": "/orders", name: "0" * 64}
            assert selects(wrapper, request), f"{where}: {request} reaches the app with its store key"


def test_the_evaluator_bites():
    """The checks above fail on the wrapper as it was shipped before: methods matched exactly,
    no predicate for the hop header."""
    def header(name, match):
        return {"single_predicate": {"input": {"name": name, "typed_config": {
            "@type": "type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput",
            "header_name": name}}, "value_match": match}}

    old = {"typed_config": {"xds_matcher": {"matcher_list": {"matchers": [{"predicate": {"and_matcher": {
        "predicate": [header("idempotency-key", {"safe_regex": {"google_re2": {}, "regex": ".*"}}),
                      {"or_matcher": {"predicate": [header(":method", {"exact": "POST"}),
                                                    header(":method", {"exact": "PATCH"})]}}]}}}]}}}}
    assert selects(old, {":method": "POST", "idempotency-key": "k"})
    assert not selects(old, {":method": "post", "idempotency-key": "k"})
    assert not selects(old, {":method": "POST", HOP_HEADER: "1"})
    new = h.skip_unless_keyed({"name": "envoy.filters.http.wasm"})
    assert selects(new, {":method": "post", "idempotency-key": "k"})
    assert selects(new, {":method": "GET", HOP_HEADER: "1"})
    assert not selects(new, {":method": "get", "idempotency-key": "k"})


def test_istio_retry_route_selects_every_spelling():
    """The mesh pair's VirtualService gives the guarded methods their retry policy: every
    spelling of them (Istio's StringMatch on `method`)."""
    path = ENVOY_DIR / "istio" / "virtualservice-retries.yaml"
    [vs] = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "VirtualService"]
    [writes] = [r for r in vs["spec"]["http"] if r.get("match")]
    for method in DEFAULT_METHODS:
        for m in spellings(method):
            assert any(string_match(cond["method"], m) for cond in writes["match"]), (m, writes["match"])
    assert not any(string_match(cond["method"], "GET") for cond in writes["match"])


# --------------------------------------------------------------------------------------------
# the gRPC replay listener reads what a guard can store, and no more
# --------------------------------------------------------------------------------------------


def plugin_value(wasm: dict) -> dict:
    return json.loads(wasm["typed_config"]["config"]["configuration"]["value"])


def guard_value(node) -> dict | None:
    """The configuration of a guard: the wasm filter's, or the native host's (envoy/native.yaml)."""
    if not isinstance(node, dict):
        return None
    typed = node.get("typed_config", {})
    if node.get("name") == "envoy.filters.http.wasm" and "config" in typed:
        return plugin_value(node)
    if str(typed.get("@type", "")).endswith("dynamic_modules.v3.DynamicModuleFilter"):
        return json.loads(typed["filter_config"]["value"])
    return None


def bootstraps_with_replay() -> list[Path]:
    return [p for p in sorted(ENVOY_DIR.rglob("*.yaml"))
            if "static_resources" in p.read_text() and h.REPLAY_NAME in p.read_text()]


@pytest.mark.parametrize("path", bootstraps_with_replay(), ids=lambda p: p.relative_to(h.ROOT).as_posix())
def test_replay_listener_is_sized_to_the_guards_records(path):
    doc = yaml.safe_load(path.read_text())
    res = doc["static_resources"]
    [listener] = [ln for ln in res["listeners"] if ln["name"] == h.REPLAY_NAME]
    [cluster] = [c for c in res["clusters"] if c["name"] == h.REPLAY_NAME]
    [replay] = [guard_value(n) for n in walk(listener) if guard_value(n) is not None]
    assert replay["mode"] == "grpc_replay"
    reads = replay.get("max_record_bytes", h.DEFAULT_MAX_RECORD_BYTES)
    guards = [guard_value(n) for ln in res["listeners"] if ln["name"] != h.REPLAY_NAME
              for n in walk(ln) if guard_value(n) is not None]
    kept = [g.get("max_record_bytes", h.DEFAULT_MAX_RECORD_BYTES) for g in guards]
    kept += [p.get("max_record_bytes", g.get("max_record_bytes", h.DEFAULT_MAX_RECORD_BYTES))
             for g in guards for p in (g.get("routes") or {}).values()]
    assert kept and reads >= max(kept), (reads, kept)
    limit = h.replay_buffer_limit(reads)
    assert listener["per_connection_buffer_limit_bytes"] == limit
    assert cluster["per_connection_buffer_limit_bytes"] == limit
    assert reads + h.RECORD_FRAMING <= limit < reads + h.RECORD_FRAMING + 256 * 1024
