"""The deployment artefacts under envoy/ and the Dockerfiles, checked without a
container engine or a cluster.

* Every Envoy bootstrap under envoy/ (a YAML file with `static_resources`) passes
  `envoy --mode validate` with the built wasm substituted for its `filename:`. Validation loads
  the wasm and runs the filter's configuration check (the negative controls below show it), and
  resolves no DNS: the compose config's STRICT_DNS service names (`orders`, `idemstore`) are
  validated as they are, nothing else is rewritten. envoy/envoy.yaml and envoy/jwt-authn.yaml are
  validated by tests/failures/test_drills.py and tests/security/test_identity.py; this file
  covers the others and checks that none is left out.
* The second hop of gRPC replays (docs/grpc.md): every bootstrap whose filter guards
  (idempotency_key or inbox mode) has the four parts exactly as tests/contract/test_grpc.py runs
  them (support/harness.py `add_grpc_replay`): the internal listener extension, the replay route
  first in every virtual host the guard serves, the internal listener with the filter in
  `grpc_replay` mode (the guard's wasm file) and its cluster. envoy/grpc.yaml, the config for a
  gRPC service, has the settings its comments promise.
* The store cluster (the filter's `store_cluster`) of every bootstrap is what the store stream
  needs (docs/operations.md, "The store stream"): HTTP/2 with `connection_keepalive`,
  `close_connections_on_host_health_failure` where it is health-checked, a name of at most 120
  bytes; in Istio, the DestinationRule keeps TCP keepalive on idemstore's connections.
* The Istio manifests (envoy/istio/*.yaml): documents well formed; the WasmPlugin's
  `pluginConfig` accepted by the filter, rendered the way Istio renders it (JSON in a
  StringValue, no `allow_on_headers_stop_iteration`, `vmConfig.env` as host_env_keys) with the
  EnvoyFilter's buffer filter and the router after it; `store_cluster` is Istio's cluster name
  of the idemstore Service; the buffer limit covers `max_body_bytes`; the names the manifests
  share agree. envoy/istio/envoyfilter-grpc-replay.yaml gives every guard WasmPlugin's workloads
  the same four parts (the replay filter's module the WasmPlugin's image, over ECDS), and Envoy
  accepts them as the sidecar would have them.
* The docker compose demo: the services Envoy's clusters name exist with those ports, the
  mounted wasm is the config's `filename`, ports 10000 and 9901 published, Redis with its
  append-only file, idemstore on that Redis.
* envoy/Dockerfile.wasm is `FROM scratch` with the module at /plugin.wasm; idemstore/Dockerfile
  runs as a non-root user.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from support import harness as h
from support.pki import Pki

ENVOY_DIR = h.ROOT / "envoy"
ISTIO_DIR = ENVOY_DIR / "istio"
COMPOSE = ENVOY_DIR / "docker-compose.yaml"
WASM_DOCKERFILE = ENVOY_DIR / "Dockerfile.wasm"
IDEMSTORE_DOCKERFILE = h.ROOT / "idemstore" / "Dockerfile"
WASM_BUILD = "target/wasm32-wasip1/release/idempotency_filter.wasm"
DEFAULT_MAX_BODY_BYTES = 1048576  # the filter's default (README, "Configuration")

# Bootstraps another test already runs through `envoy --mode validate` (with the built wasm).
VALIDATED_ELSEWHERE = {
    "envoy/envoy.yaml": "tests/failures/test_drills.py",
    "envoy/jwt-authn.yaml": "tests/security/test_identity.py",
}


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def rel(path: Path) -> str:
    return path.relative_to(h.ROOT).as_posix()


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def bootstrap_files() -> list[Path]:
    """Every YAML file under envoy/ with a document that has `static_resources`."""
    found = []
    for path in sorted(ENVOY_DIR.rglob("*.yaml")):
        docs = load_docs(path)
        if any(isinstance(d, dict) and "static_resources" in d for d in docs):
            found.append(path)
    return found


def with_built_wasm(text: str) -> str:
    """The config with every wasm `filename:` pointing at the built filter."""
    out, n = re.subn(r"(filename:\s*)[^\s,}]+\.wasm", lambda m: m.group(1) + h.wasm_path(), text)
    assert n >= 1, "no wasm filename in the config"
    return out


def envoy_validate(path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    run_env = dict(os.environ)
    if env is not None:
        run_env.update(env)
    return subprocess.run([h.envoy_bin(), "--mode", "validate", "-c", str(path), "-l", "warn"],
                          cwd=h.ROOT, capture_output=True, text=True, timeout=120, env=run_env)


def assert_valid(out: subprocess.CompletedProcess, path: Path) -> None:
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert f"configuration '{path}' OK" in text, text


def assert_refused(out: subprocess.CompletedProcess, *needles: str) -> None:
    text = out.stdout + out.stderr
    assert out.returncode != 0, "envoy --mode validate accepted it:\n" + text
    assert "idempotency filter refused its configuration" in text, text
    for needle in needles:
        assert needle in text, text


@pytest.fixture(scope="module")
def work_dir(run_dir) -> Path:
    d = run_dir / "deploy-configs"
    d.mkdir(parents=True, exist_ok=True)
    return d


# --------------------------------------------------------------------------------------------
# every Envoy bootstrap validates
# --------------------------------------------------------------------------------------------

BOOTSTRAPS = bootstrap_files()


def test_every_envoy_bootstrap_is_validated():
    """The bootstraps under envoy/ are the known ones plus those validated here; the ones
    validated elsewhere still exist and are still named by their test."""
    names = {rel(p) for p in BOOTSTRAPS}
    for name, test_file in VALIDATED_ELSEWHERE.items():
        assert name in names, f"{name} is no Envoy bootstrap any more; update VALIDATED_ELSEWHERE"
        assert Path(name).name in (h.ROOT / test_file).read_text(), f"{test_file} no longer validates {name}"
    assert "envoy/docker/envoy.yaml" in names, sorted(names)


@pytest.mark.parametrize("path", [p for p in BOOTSTRAPS if rel(p) not in VALIDATED_ELSEWHERE], ids=rel)
def test_envoy_bootstrap_validates(path, work_dir):
    """`envoy --mode validate` accepts the bootstrap (the native host's from the built module),
    its wasm path made the built filter (for
    the compose config, /etc/envoy/idempotency_filter.wasm), and the TLS files it reads from
    /etc/idempotency/tls/ (envoy/mesh/) made at run time, since validation opens them. Nothing
    else is rewritten: validation resolves no DNS, so STRICT_DNS clusters naming compose
    services validate as they are, on a machine where those names do not resolve."""
    copy = work_dir / ("validate-" + rel(path).replace("/", "-"))
    text = path.read_text()
    # The native host (envoy/native.yaml) is found through ENVOY_DYNAMIC_MODULES_SEARCH_PATH.
    native = "dynamic_modules.v3.DynamicModuleFilter" in text
    if not native or ".wasm" in text:
        text = with_built_wasm(text)
    if TLS_DIR in text:
        tls = work_dir / "tls"
        if not (tls / "ca.pem").exists():
            pki = Pki(tls)
            pki.issue("server", dns=("localhost",), uris=("spiffe://example.org/ns/shop/sa/payments",), server=True)
            pki.issue("client", uris=("spiffe://example.org/ns/shop/sa/checkout",), client=True)
        text = text.replace(TLS_DIR, str(tls))
    copy.write_text(text)
    assert_valid(envoy_validate(copy, env=h.native_env() if native else None), copy)


# Where envoy/mesh/'s configs read their certificates and keys (ca.pem, <name>.pem, <name>.key).
TLS_DIR = "/etc/idempotency/tls"


INBOX_EXAMPLE = ENVOY_DIR / "inbox.yaml"


def hcms(listener: dict) -> list[dict]:
    """The HTTP connection managers (typed configs) of a listener's filter chains."""
    return [f["typed_config"] for chain in listener["filter_chains"] for f in chain["filters"]
            if f["name"] == "envoy.filters.network.http_connection_manager"]


def wasm_filters(hcm: dict) -> list[dict]:
    """The idempotency filter's Wasm filters of an HTTP connection manager: the filter itself,
    or behind the composite matcher (envoy/envoy.yaml) the one its ExecuteFilterAction creates."""
    out = []
    for hf in hcm.get("http_filters", []):
        if hf["name"] == "envoy.filters.http.wasm":
            wasm = hf
            if "xds_matcher" in hf["typed_config"]:
                [m] = hf["typed_config"]["xds_matcher"]["matcher_list"]["matchers"]
                wasm = m["on_match"]["action"]["typed_config"]["typed_config"]
            out.append(wasm)
    return out


def plugin_config(wasm: dict) -> dict:
    return json.loads(wasm["typed_config"]["config"]["configuration"]["value"])


def plugin_configs(doc: dict) -> list[dict]:
    """The idempotency filter's plugin configurations (parsed JSON) in a bootstrap, per listener,
    the gRPC replay listener's (`"mode": "grpc_replay"`) left out."""
    out = []
    for listener in doc["static_resources"]["listeners"]:
        for hcm in hcms(listener):
            out += [c for c in map(plugin_config, wasm_filters(hcm)) if c.get("mode") != "grpc_replay"]
    return out


def test_inbox_example(work_dir):
    """envoy/inbox.yaml (validated above like every bootstrap): every listener's filter is in
    inbox mode (CloudEvents on one, a Pub/Sub JSON pointer on the other), with envoy.yaml's
    idemstore cluster. A control shows that validation runs the inbox keys' checks: the same
    file with `duplicate_status: 500` is refused, naming the key."""
    doc = load_docs(INBOX_EXAMPLE)[0]
    configs = plugin_configs(doc)
    assert [c["mode"] for c in configs] == ["inbox", "inbox"], configs
    assert configs[0]["inbox"]["message_id"] == "cloudevents"
    assert configs[1]["inbox"]["message_id"] == {"json_pointer": "/message/messageId"}
    clusters = {c["name"]: c for c in doc["static_resources"]["clusters"]}
    shipped = {c["name"]: c for c in load_docs(ENVOY_DIR / "envoy.yaml")[0]["static_resources"]["clusters"]}
    assert clusters["idemstore"] == shipped["idemstore"]
    bad = work_dir / "validate-inbox-bad.yaml"
    bad.write_text(with_built_wasm(INBOX_EXAMPLE.read_text()).replace('"duplicate_status": 204',
                                                                      '"duplicate_status": 500'))
    assert_refused(envoy_validate(bad), "inbox.duplicate_status")


# --------------------------------------------------------------------------------------------
# gRPC replays: the second hop in every config that guards
# --------------------------------------------------------------------------------------------

GUARD_MODES = (None, "idempotency_key", "inbox")
# The bootstraps whose filter guards requests (the others: envoy/mesh/client.yaml, mint mode).
GUARDING = {"envoy/envoy.yaml", "envoy/docker/envoy.yaml", "envoy/inbox.yaml", "envoy/jwt-authn.yaml",
            "envoy/mesh/server.yaml", "envoy/grpc.yaml"}
GRPC_EXAMPLE = ENVOY_DIR / "grpc.yaml"


def canon_wasm(f: dict) -> dict:
    """A Wasm filter with its configuration parsed (JSON text compared as JSON)."""
    f = json.loads(json.dumps(f))
    cfg = f["typed_config"]["config"]
    cfg["configuration"]["value"] = json.loads(cfg["configuration"]["value"])
    return f


def canon_listener(listener: dict) -> dict:
    listener = json.loads(json.dumps(listener))
    for hcm in hcms(listener):
        hcm["http_filters"] = [canon_wasm(f) if f["name"] == "envoy.filters.http.wasm" else f
                               for f in hcm["http_filters"]]
    return listener


def guarded_hcms(doc: dict) -> list[dict]:
    """The HTTP connection managers (of socket listeners) where the filter guards requests."""
    return [hcm for ln in doc["static_resources"]["listeners"] if "internal_listener" not in ln
            for hcm in hcms(ln)
            if any(plugin_config(w).get("mode") in GUARD_MODES for w in wasm_filters(hcm))]


def guard_wasm_file(doc: dict) -> str:
    files = {w["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"]
             for hcm in guarded_hcms(doc) for w in wasm_filters(hcm)}
    assert len(files) == 1, files
    return files.pop()


def test_the_guarding_bootstraps_are_known():
    """Every bootstrap under envoy/ whose filter guards requests is in GUARDING (which the next
    test checks for the replay hop), and every one in GUARDING still guards."""
    guarding = {rel(p) for p in BOOTSTRAPS if guarded_hcms(load_docs(p)[0])}
    assert guarding == GUARDING, sorted(guarding ^ GUARDING)


@pytest.mark.parametrize("name", sorted(GUARDING))
def test_guarding_bootstrap_has_the_grpc_replay_hop(name):
    """The four parts, as support/harness.py `add_grpc_replay` gives them to the Envoys of
    tests/contract/test_grpc.py: the internal listener bootstrap extension; the replay route
    first in every virtual host of every connection manager where the filter guards; the
    internal listener `idempotency_grpc_replay` (the filter in grpc_replay mode, from the
    guard's wasm file, then the router, a 404 for anything else); its cluster."""
    doc = load_docs(h.ROOT / name)[0]
    assert h.INTERNAL_LISTENER_EXTENSION in doc.get("bootstrap_extensions", []), name
    guarded = guarded_hcms(doc)
    assert guarded, name
    for hcm in guarded:
        for vh in hcm["route_config"]["virtual_hosts"]:
            assert vh["routes"][0] == h.REPLAY_ROUTE, (name, vh["name"], vh["routes"][0])
            assert [r.get("name") for r in vh["routes"]].count(h.REPLAY_NAME) == 1, vh["name"]
    listeners = {ln["name"]: ln for ln in doc["static_resources"]["listeners"]}
    wasm = guard_wasm_file(doc)
    assert canon_listener(listeners[h.REPLAY_NAME]) == canon_listener(h.replay_listener(wasm))
    clusters = {c["name"]: c for c in doc["static_resources"]["clusters"]}
    assert clusters[h.REPLAY_NAME] == h.replay_cluster()


def test_mint_only_bootstrap_has_no_replay_hop():
    """envoy/mesh/client.yaml sends (mint mode) and never replays: none of the four parts."""
    doc = load_docs(ENVOY_DIR / "mesh" / "client.yaml")[0]
    assert [plugin_config(w).get("mode") for ln in doc["static_resources"]["listeners"]
            for hcm in hcms(ln) for w in wasm_filters(hcm)] == ["mint"]
    assert h.REPLAY_NAME not in (ENVOY_DIR / "mesh" / "client.yaml").read_text()


# --------------------------------------------------------------------------------------------
# the store cluster: what the store stream needs
# --------------------------------------------------------------------------------------------

HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
# The longest store_cluster the filter takes with `store_transport: stream` (bytes).
STREAM_CLUSTER_NAME_MAX = 120


def store_clusters(doc: dict) -> dict[str, dict]:
    """The clusters a bootstrap's filter names as its `store_cluster` (mint mode names none)."""
    clusters = {c["name"]: c for c in doc["static_resources"]["clusters"]}
    names = {c["store_cluster"] for c in plugin_configs(doc) if "store_cluster" in c}
    assert names <= set(clusters), f"store_cluster names no cluster: {sorted(names - set(clusters))}"
    return {n: clusters[n] for n in sorted(names)}


def store_stream_problems(cluster: dict) -> list[str]:
    """What a store cluster lacks for the store stream: HTTP/2 (the stream is gRPC), HTTP/2
    pings (`connection_keepalive`, a store gone quiet on an idle connection), and, when Envoy
    health-checks it, `close_connections_on_host_health_failure` (the streams leave an
    idemstore that fails its check; without it they stay on it)."""
    problems = []
    if len(cluster["name"].encode()) > STREAM_CLUSTER_NAME_MAX:
        problems.append(f"name over {STREAM_CLUSTER_NAME_MAX} bytes")
    opts = cluster.get("typed_extension_protocol_options", {}).get(HTTP_OPTIONS, {})
    h2 = opts.get("explicit_http_config", {}).get("http2_protocol_options")
    if h2 is None:
        problems.append("not HTTP/2 (explicit_http_config.http2_protocol_options)")
    else:
        keepalive = h2.get("connection_keepalive") or {}
        if not (keepalive.get("interval") and keepalive.get("timeout")):
            problems.append("no http2_protocol_options.connection_keepalive {interval, timeout}")
    if cluster.get("health_checks") and cluster.get("close_connections_on_host_health_failure") is not True:
        problems.append("health-checked without close_connections_on_host_health_failure: true")
    return problems


STORE_BOOTSTRAPS = [p for p in BOOTSTRAPS if store_clusters(load_docs(p)[0])]


def test_the_store_bootstraps_are_known():
    """The bootstraps with a store cluster are the guarding ones (the next test covers each)."""
    assert {rel(p) for p in STORE_BOOTSTRAPS} == GUARDING


@pytest.mark.parametrize("path", STORE_BOOTSTRAPS, ids=rel)
def test_store_cluster_carries_the_store_stream(path):
    """The cluster each filter names as `store_cluster` is declared as envoy/envoy.yaml's
    idemstore cluster is, for the store stream (`store_transport: stream`, the default):
    HTTP/2 with `connection_keepalive`, and `close_connections_on_host_health_failure: true`
    since it has health checks. Validation (above) shows Envoy accepts them."""
    for name, cluster in store_clusters(load_docs(path)[0]).items():
        assert store_stream_problems(cluster) == [], f"{rel(path)}: cluster {name}"


# The commented-out block that gives the store cluster a client certificate for an idemstore
# serving TLS (docs/security.md, "idemstore's listener over TLS").
STORE_TLS_START = "    # transport_socket:\n"


def uncomment_store_tls(text: str) -> str:
    """`text` with the store cluster's commented `transport_socket` block uncommented."""
    start = text.index(STORE_TLS_START)
    lines = text[start:].split("\n")
    block = []
    for line in lines:
        if not line.startswith("    # ") or (block and not line.startswith("    #   ")):
            break
        block.append(line)
    uncommented = [("    " + line[len("    # "):]) for line in block]
    return text[:start] + "\n".join(uncommented) + "\n" + "\n".join(lines[len(block):])


@pytest.mark.parametrize("path", [ENVOY_DIR / "envoy.yaml", ENVOY_DIR / "docker" / "envoy.yaml"], ids=rel)
def test_store_tls_block_validates(path, work_dir):
    """The shipped store cluster's commented TLS block, uncommented, is a transport socket of
    the idemstore cluster that Envoy accepts (with the certificate files it names made here),
    and the docs show the same block."""
    tls = work_dir / "store-tls"
    if not (tls / "ca.pem").exists():
        pki = Pki(tls)
        pki.issue("idemstore-client", client=True)
    text = uncomment_store_tls(with_built_wasm(path.read_text()))
    [cluster] = store_clusters(yaml.safe_load(text)).values()
    socket = cluster["transport_socket"]
    context = socket["typed_config"]["common_tls_context"]
    assert context["tls_certificates"][0]["certificate_chain"]["filename"].endswith("idemstore-client.pem")
    copy = work_dir / ("store-tls-" + rel(path).replace("/", "-"))
    copy.write_text(text.replace(TLS_DIR, str(tls)))
    assert_valid(envoy_validate(copy), copy)
    security = (h.ROOT / "docs" / "security.md").read_text()
    assert "certificate_chain: {filename: /etc/idempotency/tls/idemstore-client.pem}" in security


def test_store_stream_check_bites():
    """The check above on envoy/envoy.yaml's idemstore cluster passes, and fails when one
    requirement is taken away."""
    [shipped] = store_clusters(load_docs(ENVOY_DIR / "envoy.yaml")[0]).values()
    assert shipped.get("health_checks") and store_stream_problems(shipped) == []

    def without(edit) -> list[str]:
        c = json.loads(json.dumps(shipped))
        edit(c)
        return store_stream_problems(c)

    def http(c: dict) -> dict:
        return c["typed_extension_protocol_options"][HTTP_OPTIONS]["explicit_http_config"]

    assert without(lambda c: http(c)["http2_protocol_options"].pop("connection_keepalive"))
    assert without(lambda c: http(c).pop("http2_protocol_options"))
    assert without(lambda c: c.pop("close_connections_on_host_health_failure"))
    assert without(lambda c: c.update(name="c" * (STREAM_CLUSTER_NAME_MAX + 1)))


def test_grpc_example():
    """envoy/grpc.yaml (validated above like every bootstrap): admin on 127.0.0.1:9901; the
    listener `grpc` on 127.0.0.1:10001 (codec AUTO: h2c with prior knowledge), the guard not
    wrapped (it sees every call) with the configuration its comments describe, the route to
    `grpc_app` (127.0.0.1:50051 over HTTP/2, 30 s) after the replay route; envoy.yaml's
    idemstore cluster."""
    doc = load_docs(GRPC_EXAMPLE)[0]
    assert doc["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 9901}
    listeners = {ln["name"]: ln for ln in doc["static_resources"]["listeners"]}
    assert set(listeners) == {"grpc", h.REPLAY_NAME}
    grpc = listeners["grpc"]
    assert grpc["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 10001}
    [hcm] = hcms(grpc)
    assert hcm["codec_type"] == "AUTO" and hcm["use_remote_address"] is True
    window = hcm["http2_protocol_options"]["initial_stream_window_size"]
    assert window >= 4 * 1024 * 1024
    assert grpc["per_connection_buffer_limit_bytes"] > 2 * 1048576  # max_body_bytes, max_record_bytes
    assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.wasm", "envoy.filters.http.router"]
    assert "xds_matcher" not in hcm["http_filters"][0]["typed_config"]
    [guard] = wasm_filters(hcm)
    assert plugin_config(guard) == {"store_cluster": "idemstore", "replay_headers": ["content-type"],
                                    "grpc_streaming_methods": []}
    assert guard["typed_config"]["config"]["allow_on_headers_stop_iteration"] is True
    [vh] = hcm["route_config"]["virtual_hosts"]
    assert vh["routes"][1]["route"] == {"cluster": "grpc_app", "timeout": "30s"}
    clusters = {c["name"]: c for c in doc["static_resources"]["clusters"]}
    app = clusters["grpc_app"]
    [ep] = app["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert ep["endpoint"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 50051}
    opts = app["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in opts["explicit_http_config"]
    shipped = {c["name"]: c for c in load_docs(ENVOY_DIR / "envoy.yaml")[0]["static_resources"]["clusters"]}
    assert clusters["idemstore"] == shipped["idemstore"]
    assert "grpcurl -plaintext -H 'idempotency-key: " in GRPC_EXAMPLE.read_text()


# --------------------------------------------------------------------------------------------
# Istio manifests
# --------------------------------------------------------------------------------------------

CLUSTER_SCOPED = {"Namespace"}


def istio_docs() -> dict[str, list[dict]]:
    return {rel(p): load_docs(p) for p in sorted(ISTIO_DIR.glob("*.yaml"))}


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = find(docs, kind, name)
    assert len(found) == 1, f"{len(found)} {kind} {name or ''} documents"
    return found[0]


@pytest.fixture(scope="module")
def istio() -> dict:
    files = istio_docs()
    assert {"envoy/istio/wasmplugin.yaml", "envoy/istio/idemstore.yaml", GRPC_REPLAY_ISTIO} <= set(files), sorted(files)
    every = [d for docs in files.values() for d in docs]
    return {
        "files": files,
        "all": every,
        "plugin": one(files["envoy/istio/wasmplugin.yaml"], "WasmPlugin"),
        "envoyfilter": one(files["envoy/istio/wasmplugin.yaml"], "EnvoyFilter"),
        "store": files["envoy/istio/idemstore.yaml"],
    }


def test_istio_manifests_are_well_formed(istio):
    """Each document of each envoy/istio/*.yaml has apiVersion, kind and metadata.name, and a
    namespace unless the kind is cluster-scoped; no two documents share kind, namespace, name."""
    seen = set()
    for name, docs in istio["files"].items():
        assert docs, f"{name} is empty"
        for d in docs:
            where = f"{name}: {d.get('kind')} {d.get('metadata', {}).get('name')}"
            assert isinstance(d.get("apiVersion"), str) and d["apiVersion"], where
            assert isinstance(d.get("kind"), str) and d["kind"], where
            meta = d.get("metadata")
            assert isinstance(meta, dict) and isinstance(meta.get("name"), str) and meta["name"], where
            if d["kind"] not in CLUSTER_SCOPED:
                assert isinstance(meta.get("namespace"), str) and meta["namespace"], where + ": no namespace"
            key = (d["kind"], meta.get("namespace"), meta["name"])
            assert key not in seen, f"{where}: defined twice"
            seen.add(key)


def test_wasmplugin_fields(istio):
    """The WasmPlugin pulls an OCI image, runs in a phase after Istio's authentication (the
    subject comes from jwt_authn's metadata), inbound on the application's sidecar, with the
    filter's configuration in the mode Istio can run (pause_on_headers false)."""
    p = istio["plugin"]
    assert p["apiVersion"] == "extensions.istio.io/v1alpha1"
    spec = p["spec"]
    assert spec["url"].startswith("oci://"), spec["url"]
    assert spec["phase"] in ("AUTHZ", "STATS"), "AUTHN runs before jwt_authn: no subject metadata"
    assert spec["failStrategy"] in ("FAIL_OPEN", "FAIL_CLOSE", "FAIL_RELOAD")
    assert spec["imagePullPolicy"] in ("IfNotPresent", "Always")
    assert isinstance(spec.get("priority"), int)
    assert spec["pluginName"] == "idempotency"
    assert spec["selector"]["matchLabels"], "selector.matchLabels"
    assert "targetRefs" not in spec, "selector and targetRefs are exclusive"
    assert [m["mode"] for m in spec["match"]] == ["SERVER"]
    assert all(isinstance(port["number"], int) for m in spec["match"] for port in m["ports"])
    cfg = spec["pluginConfig"]
    assert isinstance(cfg, dict) and cfg.get("store_cluster")
    assert cfg["pause_on_headers"] is False, "Istio cannot set allow_on_headers_stop_iteration"
    assert cfg["subject"] == {"metadata": {"filter": "envoy.filters.http.jwt_authn", "path": ["payload", "sub"]}}
    env = {e["name"]: e for e in spec.get("vmConfig", {}).get("env", [])}
    if "store_secret_env" in cfg:
        assert env[cfg["store_secret_env"]].get("valueFrom") == "HOST", "the secret comes from the sidecar's env"


def istio_rendered_filter(plugin: dict, failure_policy: str = "FAIL_CLOSED") -> dict:
    """The Wasm HTTP filter Istio builds from a WasmPlugin (pilot/pkg/model/extensions.go): name
    <namespace>.<name>, root_id = pluginName, the pluginConfig as JSON in a StringValue,
    vmConfig.env as environment_variables (HOST -> host_env_keys, INLINE -> key_values), the V8
    runtime, and no allow_on_headers_stop_iteration (false). Rendered fail-closed whatever the
    manifest's failStrategy, so that a refused configuration fails validation."""
    spec = plugin["spec"]
    host_keys = [e["name"] for e in spec.get("vmConfig", {}).get("env", []) if e.get("valueFrom") == "HOST"]
    inline = {e["name"]: e.get("value", "") for e in spec.get("vmConfig", {}).get("env", [])
              if e.get("valueFrom", "INLINE") == "INLINE"}
    vm = {"runtime": "envoy.wasm.runtime.v8", "code": {"local": {"filename": h.wasm_path()}}}
    if host_keys or inline:
        vm["environment_variables"] = {"host_env_keys": host_keys, "key_values": inline}
    return {
        "name": f"{plugin['metadata']['namespace']}.{plugin['metadata']['name']}",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": f"{plugin['metadata']['namespace']}.{plugin['metadata']['name']}",
                "root_id": spec["pluginName"],
                "allow_on_headers_stop_iteration": False,
                "failure_policy": failure_policy,
                "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue",
                                  "value": json.dumps(spec.get("pluginConfig", {}))},
                "vm_config": vm,
            },
        },
    }


def buffer_patch(envoyfilter: dict) -> dict:
    patches = [p for p in envoyfilter["spec"]["configPatches"]
               if p["patch"]["value"].get("name") == "envoy.filters.http.buffer"]
    assert len(patches) == 1, envoyfilter
    return patches[0]


def sidecar_config(istio: dict, plugin_config: dict | None = None) -> dict:
    """An inbound listener as the sidecar would have it: the rendered filter, the EnvoyFilter's
    buffer filter, the router; and a cluster named like Istio's for idemstore."""
    plugin = json.loads(json.dumps(istio["plugin"]))
    if plugin_config is not None:
        plugin["spec"]["pluginConfig"] = plugin_config
    cfg = plugin["spec"]["pluginConfig"]
    # Validation binds no port: fixed numbers do.
    store = h.static_cluster(cfg["store_cluster"], 8380, http2=True)
    filters = [istio_rendered_filter(plugin), buffer_patch(istio["envoyfilter"])["patch"]["value"]]
    return {
        "static_resources": {
            "listeners": [h.listener("inbound", 10000, filters)],  # the router is appended
            "clusters": [h.static_cluster("upstream", 8080), store],
        },
    }


def secret_env(plugin: dict) -> dict:
    name = plugin["spec"]["pluginConfig"].get("store_secret_env")
    return {name: "test-secret-for-validation"} if name else {}


def test_plugin_config_accepted_by_the_filter(istio, work_dir):
    """A real Envoy 1.40 loads the filter with the WasmPlugin's pluginConfig as Istio renders
    it, followed by the EnvoyFilter's buffer filter, in the sidecar's environment (the
    store_secret_env variable set). Two controls show that `--mode validate` really runs the
    filter's configuration check: an out-of-range value is refused, and so is the same
    configuration when the sidecar lacks the secret's variable."""
    plugin = istio["plugin"]
    path = work_dir / "istio-sidecar.yaml"
    path.write_text(json.dumps(sidecar_config(istio), indent=2))
    assert_valid(envoy_validate(path, secret_env(plugin)), path)

    bad = dict(plugin["spec"]["pluginConfig"], retention_seconds=0)
    bad_path = work_dir / "istio-sidecar-bad.yaml"
    bad_path.write_text(json.dumps(sidecar_config(istio, bad), indent=2))
    assert_refused(envoy_validate(bad_path, secret_env(plugin)), "retention_seconds")

    name = plugin["spec"]["pluginConfig"].get("store_secret_env")
    if name:
        env = {k: v for k, v in os.environ.items() if k != name}
        out = subprocess.run([h.envoy_bin(), "--mode", "validate", "-c", str(path), "-l", "warn"],
                             cwd=h.ROOT, capture_output=True, text=True, timeout=120, env=env)
        assert_refused(out, "store_secret_env")


def service_fqdn_port(store_cluster: str) -> tuple[str, int, str]:
    m = re.fullmatch(r"outbound\|(\d+)\|([^|]*)\|([a-z0-9.-]+)", store_cluster)
    assert m, f"{store_cluster!r} is not an Istio outbound cluster name (outbound|<port>|<subset>|<host>)"
    return m.group(3), int(m.group(1)), m.group(2)


def test_store_cluster_is_the_idemstore_service(istio):
    """`store_cluster` is outbound|<port>||<service>.<namespace>.svc.cluster.local of the
    idemstore Service in idemstore.yaml, that port declared HTTP/2 for Istio (h2c to idemstore),
    its targetPort the one idemstore listens on, and the Service selecting the Deployment."""
    host, port, subset = service_fqdn_port(istio["plugin"]["spec"]["pluginConfig"]["store_cluster"])
    assert subset == ""
    svc_name, ns, tail = host.split(".", 2)
    assert tail == "svc.cluster.local", host
    svc = one(istio["store"], "Service", svc_name)
    assert svc["metadata"]["namespace"] == ns
    ports = [p for p in svc["spec"]["ports"] if p["port"] == port]
    assert len(ports) == 1, f"the Service has no port {port}: {svc['spec']['ports']}"
    sp = ports[0]
    assert sp.get("appProtocol") in ("http2", "grpc", "kubernetes.io/h2c") or \
        re.match(r"^(http2|grpc)(-|$)", sp.get("name", "")), f"port {port} not declared HTTP/2: {sp}"

    dep = one(istio["store"], "Deployment", svc_name)
    assert dep["metadata"]["namespace"] == ns
    pod = dep["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items()), "Service selects no idemstore pod"
    (c,) = pod["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    listen = env["IDEMSTORE_LISTEN"]["value"]
    assert listen.startswith("0.0.0.0:") and int(listen.rsplit(":", 1)[1]) == sp.get("targetPort", port)
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["port"] == sp.get("targetPort", port)


def test_idemstore_deployment_and_redis(istio):
    """idemstore: 2 replicas, non-root, its secret from a Secret of its namespace, on the Redis
    Service of idemstore.yaml; Redis with the append-only file (fsync every second) on a
    volume, never evicting, its port plain TCP for Istio (not the redis protocol)."""
    docs = istio["store"]
    dep = one(docs, "Deployment", "idemstore")
    ns = dep["metadata"]["namespace"]
    assert one(docs, "Namespace", ns)
    spec = dep["spec"]
    assert spec["replicas"] == 2
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"].get("runAsUser", 1) != 0
    (c,) = pod["containers"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    env = {e["name"]: e for e in c["env"]}
    ref = env["IDEMSTORE_SECRET"]["valueFrom"]["secretKeyRef"]
    secret = one(docs, "Secret", ref["name"])
    assert secret["metadata"]["namespace"] == ns and ref["key"] in secret["stringData"]

    redis_url = urlsplit(env["IDEMSTORE_REDIS"]["value"])
    assert redis_url.scheme == "redis"
    r_name, r_ns, tail = redis_url.hostname.split(".", 2)
    assert (r_ns, tail) == (ns, "svc.cluster.local"), redis_url.hostname
    r_svc = one(docs, "Service", r_name)
    (r_port,) = r_svc["spec"]["ports"]
    assert r_port["port"] == (redis_url.port or 6379)
    assert r_port.get("appProtocol") == "tcp" or r_port["name"].startswith("tcp"), r_port

    (redis,) = [d for d in docs if d["kind"] in ("StatefulSet", "Deployment") and d["metadata"]["name"] == r_name]
    labels = redis["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in r_svc["spec"]["selector"].items())
    (rc,) = redis["spec"]["template"]["spec"]["containers"]
    args = rc["args"]
    opts = dict(zip(args[::2], args[1::2]))
    assert opts["--appendonly"] == "yes"
    assert opts["--appendfsync"] in ("everysec", "always")
    assert opts["--maxmemory-policy"] == "noeviction"
    data_dir = opts["--dir"]
    assert any(m["mountPath"] == data_dir for m in rc["volumeMounts"]), "the AOF is not on the volume"
    assert rc["ports"][0]["containerPort"] == r_port.get("targetPort", r_port["port"])


def test_buffer_filter_covers_max_body_bytes(istio):
    """The EnvoyFilter puts envoy.filters.http.buffer right before the router, on the same
    workloads, namespace and port as the WasmPlugin (inbound, like its SERVER match), with
    max_request_bytes at least the filter's max_body_bytes, so the filter answers an
    oversized body itself."""
    plugin, ef = istio["plugin"], istio["envoyfilter"]
    assert ef["metadata"]["namespace"] == plugin["metadata"]["namespace"]
    assert ef["spec"]["workloadSelector"]["labels"] == plugin["spec"]["selector"]["matchLabels"]
    patch = buffer_patch(ef)
    assert patch["applyTo"] == "HTTP_FILTER"
    assert patch["patch"]["operation"] == "INSERT_BEFORE"
    match = patch["match"]
    assert match["context"] == "SIDECAR_INBOUND"
    listener = match["listener"]
    assert listener["filterChain"]["filter"]["name"] == "envoy.filters.network.http_connection_manager"
    assert listener["filterChain"]["filter"]["subFilter"]["name"] == "envoy.filters.http.router"
    ports = {p["number"] for m in plugin["spec"]["match"] for p in m["ports"]}
    assert listener["portNumber"] in ports
    typed = patch["patch"]["value"]["typed_config"]
    assert typed["@type"] == "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer"
    max_body = plugin["spec"]["pluginConfig"].get("max_body_bytes", DEFAULT_MAX_BODY_BYTES)
    assert int(typed["max_request_bytes"]) >= max_body


def test_secret_copies_agree(istio):
    """The shared secret exists in idemstore's namespace and in the WasmPlugin's (for the
    sidecar), with the same value (the same placeholder, substituted together)."""
    secrets = find(istio["all"], "Secret")
    by_ns = {s["metadata"]["namespace"]: s for s in secrets}
    plugin_ns = istio["plugin"]["metadata"]["namespace"]
    store_ns = one(istio["store"], "Deployment", "idemstore")["metadata"]["namespace"]
    assert {plugin_ns, store_ns} <= set(by_ns), sorted(by_ns)
    assert by_ns[plugin_ns]["stringData"] == by_ns[store_ns]["stringData"]


def test_istio_store_cluster_for_the_store_stream(istio):
    """Every WasmPlugin that calls the store names a cluster of at most 120 bytes (the store
    stream's limit), and idemstore's DestinationRule keeps TCP keepalive on the connections that
    carry the streams: Istio has no field for the HTTP/2 pings the Envoy configs set."""
    plugins = [d for d in find(istio["all"], "WasmPlugin") if "store_cluster" in d["spec"].get("pluginConfig", {})]
    assert plugins
    for plugin in plugins:
        name = plugin["spec"]["pluginConfig"]["store_cluster"]
        assert len(name.encode()) <= STREAM_CLUSTER_NAME_MAX, name
    host, _, _ = service_fqdn_port(istio["plugin"]["spec"]["pluginConfig"]["store_cluster"])
    [rule] = [d for d in find(istio["store"], "DestinationRule") if d["spec"]["host"] == host]
    keepalive = rule["spec"]["trafficPolicy"]["connectionPool"]["tcp"]["tcpKeepalive"]
    assert keepalive.get("time") and keepalive.get("interval") and keepalive.get("probes"), keepalive


# The second hop of gRPC replays in the sidecars (envoyfilter-grpc-replay.yaml).
GRPC_REPLAY_ISTIO = "envoy/istio/envoyfilter-grpc-replay.yaml"
WASM_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"


def guard_plugins(istio: dict) -> list[dict]:
    """The WasmPlugins that guard (every one but mint mode's)."""
    return [d for d in find(istio["all"], "WasmPlugin")
            if d["spec"].get("pluginConfig", {}).get("mode") in GUARD_MODES]


def replay_patches(envoyfilter: dict) -> dict[str, dict]:
    """The EnvoyFilter's patches by what they apply to (one of each)."""
    patches = envoyfilter["spec"]["configPatches"]
    by = {p["applyTo"]: p for p in patches}
    assert len(by) == len(patches) == 4, [p["applyTo"] for p in patches]
    return by


def replay_envoyfilter(istio: dict, plugin: dict) -> dict:
    """The replay EnvoyFilter of a guard WasmPlugin: same namespace, same workloads."""
    found = [d for d in find(istio["files"][GRPC_REPLAY_ISTIO], "EnvoyFilter")
             if d["metadata"]["namespace"] == plugin["metadata"]["namespace"]
             and d["spec"]["workloadSelector"]["labels"] == plugin["spec"]["selector"]["matchLabels"]]
    assert len(found) == 1, f"{len(found)} replay EnvoyFilters for {plugin['metadata']}"
    return found[0]


def inline_replay_listener(envoyfilter: dict, wasm: str) -> dict:
    """The EnvoyFilter's listener as Envoy runs it once istio-agent has fetched the module: the
    config_discovery filter replaced by the EXTENSION_CONFIG it names, the module a local file."""
    by = replay_patches(envoyfilter)
    listener = json.loads(json.dumps(by["LISTENER"]["patch"]["value"]))
    ext = json.loads(json.dumps(by["EXTENSION_CONFIG"]["patch"]["value"]))
    ext["typed_config"]["config"]["vm_config"]["code"] = {"local": {"filename": wasm}}
    [hcm] = hcms(listener)
    filters = hcm["http_filters"]
    [i] = [n for n, f in enumerate(filters) if "config_discovery" in f]
    assert filters[i]["name"] == ext["name"]
    assert filters[i]["config_discovery"]["type_urls"] == [WASM_TYPE]
    assert filters[i]["config_discovery"]["config_source"]["ads"] == {}
    filters[i] = {"name": "envoy.filters.http.wasm", "typed_config": ext["typed_config"]}
    return listener


def test_grpc_replay_envoyfilter_per_guard(istio):
    """Each guard WasmPlugin's workloads (namespace and selector) get one replay EnvoyFilter:
    the route first in the inbound routes of the guarded port (INSERT_FIRST with no route
    match: first in every virtual host), the internal listener and the cluster exactly as the
    Envoy configs ship them, the replay filter over ECDS with the WasmPlugin's image as its
    module (istio-agent pulls oci:// for ECDS Wasm configs) and no other difference."""
    plugins = guard_plugins(istio)
    assert {p["metadata"]["name"] for p in plugins} == {"idempotency", "idempotency-guard"}
    replays = find(istio["files"][GRPC_REPLAY_ISTIO], "EnvoyFilter")
    assert len(replays) == len(plugins)
    for plugin in plugins:
        ef = replay_envoyfilter(istio, plugin)
        assert ef["apiVersion"] == "networking.istio.io/v1alpha3"
        by = replay_patches(ef)
        route = by["HTTP_ROUTE"]
        assert route["match"]["context"] == "SIDECAR_INBOUND"
        assert set(route["match"]["routeConfiguration"]) == {"portNumber"}
        ports = {p["number"] for m in plugin["spec"]["match"] for p in m["ports"]}
        assert route["match"]["routeConfiguration"]["portNumber"] in ports
        assert route["patch"] == {"operation": "INSERT_FIRST", "value": h.REPLAY_ROUTE}
        for kind in ("LISTENER", "CLUSTER"):
            assert by[kind]["match"] == {"context": "SIDECAR_INBOUND"}
            assert by[kind]["patch"]["operation"] == "ADD"
        assert by["CLUSTER"]["patch"]["value"] == h.replay_cluster()
        assert canon_listener(inline_replay_listener(ef, "plugin.wasm")) == \
            canon_listener(h.replay_listener("plugin.wasm"))
        ext = by["EXTENSION_CONFIG"]["patch"]
        assert ext["operation"] == "ADD" and "match" not in by["EXTENSION_CONFIG"]
        assert ext["value"]["typed_config"]["@type"] == WASM_TYPE
        remote = ext["value"]["typed_config"]["config"]["vm_config"]["code"]["remote"]
        assert remote["http_uri"]["uri"] == plugin["spec"]["url"]


def test_grpc_replay_envoyfilter_accepted_by_envoy(istio, work_dir):
    """A real Envoy 1.40 accepts the EnvoyFilter's parts as a sidecar would have them, next to
    the inbound listener of the plugin test above: the bootstrap extension (Istio's bootstrap
    has it), the route first in the inbound virtual host, the internal listener with the filter
    inlined from its EXTENSION_CONFIG (the built module in place of the image) and the cluster.
    Validation runs the replay filter's configuration check."""
    for plugin in guard_plugins(istio):
        ef = replay_envoyfilter(istio, plugin)
        by = replay_patches(ef)
        config = sidecar_config(istio)
        config["bootstrap_extensions"] = [h.INTERNAL_LISTENER_EXTENSION]
        res = config["static_resources"]
        [hcm] = hcms(res["listeners"][0])
        for vh in hcm["route_config"]["virtual_hosts"]:
            vh["routes"] = [by["HTTP_ROUTE"]["patch"]["value"]] + vh["routes"]
        res["listeners"].append(inline_replay_listener(ef, h.wasm_path()))
        res["clusters"].append(by["CLUSTER"]["patch"]["value"])
        path = work_dir / f"istio-grpc-replay-{plugin['metadata']['namespace']}.yaml"
        path.write_text(json.dumps(config, indent=2))
        assert_valid(envoy_validate(path, secret_env(istio["plugin"])), path)
    # The control: the same with an unknown key in the replay filter's configuration is refused.
    replay = [ln for ln in config["static_resources"]["listeners"] if ln["name"] == h.REPLAY_NAME][0]
    [wasm] = wasm_filters(hcms(replay)[0])
    wasm["typed_config"]["config"]["configuration"]["value"] = '{"mode": "grpc_replay", "no_such_key": 1}'
    bad = work_dir / "istio-grpc-replay-bad.yaml"
    bad.write_text(json.dumps(config, indent=2))
    assert_refused(envoy_validate(bad, secret_env(istio["plugin"])), "no_such_key")


# --------------------------------------------------------------------------------------------
# docker compose
# --------------------------------------------------------------------------------------------


def mounts(service: dict) -> list[tuple[str, str]]:
    """(source, target) of each volume entry, short or long syntax."""
    out = []
    for v in service.get("volumes", []):
        if isinstance(v, str):
            parts = v.split(":")
            out.append((parts[0], parts[1]))
        else:
            out.append((v.get("source", ""), v["target"]))
    return out


def host_path(source: str) -> Path | None:
    """A bind mount's host path (relative to the compose file's directory); None for a named
    volume."""
    if not source.startswith((".", "/")):
        return None
    return (COMPOSE.parent / source).resolve()


def command(service: dict) -> list[str]:
    cmd = service.get("command", [])
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd)


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    return {k: str(v) for k, v in env.items()}


def published(service: dict) -> set[int]:
    """Container ports published on the host."""
    out = set()
    for p in service.get("ports", []):
        if isinstance(p, dict):
            out.add(int(p["target"]))
        else:
            out.add(int(str(p).rsplit(":", 1)[-1].split("/")[0]))
    return out


@pytest.fixture(scope="module")
def compose() -> dict:
    c = yaml.safe_load(COMPOSE.read_text())
    services = c["services"]
    envoy = services["envoy"]
    cmd = command(envoy)
    config_target = cmd[cmd.index("-c") + 1]
    (config_source,) = [s for s, t in mounts(envoy) if t == config_target]
    config_path = host_path(config_source)
    return {"services": services, "envoy": envoy, "config_path": config_path,
            "config": yaml.safe_load(config_path.read_text())}


def test_compose_envoy_config_and_wasm(compose):
    """The Envoy service runs the official 1.40 image on envoy/docker/envoy.yaml, with the host
    build of the filter mounted where that config's vm_config loads it from (the guard's and the
    gRPC replay listener's); it publishes the listener (10000) and admin (9901) ports, on which
    the config listens on every interface (the replay listener is internal: no port)."""
    envoy, config = compose["envoy"], compose["config"]
    assert envoy["image"] == "envoyproxy/envoy:v1.40.0"
    assert compose["config_path"] == ENVOY_DIR / "docker" / "envoy.yaml"
    filenames = re.findall(r"filename:\s*(\S+\.wasm)", compose["config_path"].read_text())
    assert filenames == ["/etc/envoy/idempotency_filter.wasm"] * 2, filenames
    sources = [s for s, t in mounts(envoy) if t == filenames[0]]
    assert [host_path(s) for s in sources] == [h.ROOT / WASM_BUILD]
    listeners = [ln for ln in config["static_resources"]["listeners"] if "internal_listener" not in ln]
    assert [ln["name"] for ln in config["static_resources"]["listeners"] if "internal_listener" in ln] == \
        [h.REPLAY_NAME]
    ports = {l["address"]["socket_address"]["port_value"] for l in listeners}
    admin = config["admin"]["address"]["socket_address"]
    assert ports == {10000} and admin["port_value"] == 9901
    assert {l["address"]["socket_address"]["address"] for l in listeners} == {"0.0.0.0"}
    assert admin["address"] == "0.0.0.0"
    assert published(envoy) == {10000, 9901}


def test_compose_services_match_envoy_clusters(compose):
    """Each cluster of the compose Envoy config names a compose service, on the port that
    service listens on (idemstore: IDEMSTORE_LISTEN; the orders app: its --port), and names it
    by DNS (STRICT_DNS or LOGICAL_DNS). The gRPC replay cluster (an internal address) aside."""
    services = compose["services"]
    listening = {
        "idemstore": int(environment(services["idemstore"])["IDEMSTORE_LISTEN"].rsplit(":", 1)[1]),
        "orders": int(command(services["orders"])[command(services["orders"]).index("--port") + 1]),
    }
    clusters = [c for c in compose["config"]["static_resources"]["clusters"] if c["name"] != h.REPLAY_NAME]
    assert {c["name"] for c in clusters} == {"app", "idemstore"}
    for c in clusters:
        assert c["type"] in ("STRICT_DNS", "LOGICAL_DNS"), c["name"]
        for group in c["load_assignment"]["endpoints"]:
            for ep in group["lb_endpoints"]:
                sa = ep["endpoint"]["address"]["socket_address"]
                assert sa["address"] in services, f"cluster {c['name']}: no compose service {sa['address']}"
                assert sa["address"] in listening, sa["address"]
                assert sa["port_value"] == listening[sa["address"]], (c["name"], sa)
    assert "0.0.0.0" in environment(services["idemstore"])["IDEMSTORE_LISTEN"]
    orders_cmd = command(services["orders"])
    assert orders_cmd[orders_cmd.index("--host") + 1] == "0.0.0.0"
    # The script it runs is demo/orders_app.py, through the mount of demo/.
    (demo_target,) = [t for s, t in mounts(services["orders"]) if host_path(s) == h.ROOT / "demo"]
    prefix = demo_target.rstrip("/") + "/"
    scripts = [h.ROOT / "demo" / a[len(prefix):] for a in orders_cmd if a.startswith(prefix)]
    assert scripts == [h.ROOT / "demo" / "orders_app.py"], orders_cmd
    build = services["idemstore"]["build"]
    assert (COMPOSE.parent / build["context"]).resolve() == h.ROOT
    assert build["dockerfile"] == rel(IDEMSTORE_DOCKERFILE)


def redis_settings(service: dict) -> dict[str, str]:
    """Redis's effective settings: the mounted config file, then the command line after it."""
    cmd = command(service)
    assert cmd[0] == "redis-server", cmd
    settings: dict[str, str] = {}
    args = cmd[1:]
    if args and not args[0].startswith("--"):
        (source,) = [s for s, t in mounts(service) if t == args[0]]
        for line in host_path(source).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                key, _, value = line.partition(" ")
                settings[key.lower()] = value.strip().strip('"')
        args = args[1:]
    for key, value in zip(args[::2], args[1::2]):
        assert key.startswith("--"), args
        settings[key[2:].lower()] = value
    return settings


def test_compose_redis_and_idemstore(compose):
    """Redis keeps the append-only file (fsync every second) on a named volume and never
    evicts; idemstore's IDEMSTORE_REDIS points at the redis service and its port."""
    services = compose["services"]
    redis = services["redis"]
    settings = redis_settings(redis)
    assert settings["appendonly"] == "yes"
    assert settings["appendfsync"] in ("everysec", "always")
    assert settings["maxmemory-policy"] == "noeviction"
    assert settings["bind"] != "127.0.0.1", "bound to the container's loopback: idemstore cannot reach it"
    data = [s for s, t in mounts(redis) if t == settings["dir"]]
    assert len(data) == 1 and host_path(data[0]) is None and data[0] in compose_volumes(), data
    url = urlsplit(environment(services["idemstore"])["IDEMSTORE_REDIS"])
    assert url.scheme == "redis" and url.hostname == "redis"
    assert (url.port or 6379) == int(settings.get("port", 6379))


def compose_volumes() -> set[str]:
    return set((yaml.safe_load(COMPOSE.read_text()).get("volumes") or {}).keys())


# --------------------------------------------------------------------------------------------
# Dockerfiles
# --------------------------------------------------------------------------------------------


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, f"{path}: dangling continuation"
    return out


def dockerignore_keeps(path: Path) -> list[str]:
    ignore = path.with_name(path.name + ".dockerignore")
    assert ignore.exists(), f"{rel(ignore)} (keeps target/ out of the build context)"
    lines = [l.strip() for l in ignore.read_text().splitlines() if l.strip() and not l.startswith("#")]
    assert lines[0] == "*", "the context starts empty and re-includes what the build copies"
    return [l[1:].rstrip("/") for l in lines if l.startswith("!")]


def test_wasm_dockerfile_layout():
    """FROM scratch, and exactly one COPY (one layer), of the built filter to /plugin.wasm:
    the layout Istio's WasmPlugin and Envoy Gateway read. The Dockerfile's ignore file lets
    that one file into the build context."""
    ins = instructions(WASM_DOCKERFILE)
    assert [a for i, a in ins if i == "FROM"] == ["scratch"]
    assert not [i for i, _ in ins if i in ("RUN", "ADD")]
    copies = [a for i, a in ins if i == "COPY"]
    assert len(copies) == 1, copies
    src, dest = copies[0].split()
    args = dict(a.split("=", 1) for i, a in ins if i == "ARG" and "=" in a)
    src = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], src)
    assert dest == "/plugin.wasm"
    assert src == WASM_BUILD
    assert WASM_BUILD in dockerignore_keeps(WASM_DOCKERFILE)


def test_idemstore_dockerfile_layout():
    """A Rust builder stage that builds idemstore from the workspace, and a runtime stage that
    runs it as a user other than root, listening on 0.0.0.0:8380 (EXPOSE 8380); everything the
    build copies is in its build context, every crate of the workspace but the filter's among
    it (cargo refuses a workspace with a member missing)."""
    ins = instructions(IDEMSTORE_DOCKERFILE)
    froms = [a for i, a in ins if i == "FROM"]
    assert len(froms) >= 2, "multi-stage"
    assert froms[0].startswith("rust:1.95"), froms[0]
    runs = " ".join(a for i, a in ins if i == "RUN")
    assert re.search(r"cargo build --release\b.*-p idemstore", runs), runs
    final = ins[max(n for n, (i, _) in enumerate(ins) if i == "FROM"):]
    users = [a for i, a in final if i == "USER"]
    assert users, "the runtime stage sets no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0", ""), users[-1]
    assert "8380" in [a for i, a in final if i == "EXPOSE"]
    envs = " ".join(a for i, a in final if i == "ENV")
    assert re.search(r"IDEMSTORE_LISTEN[= ]\"?0\.0\.0\.0:8380", envs), envs
    keeps = dockerignore_keeps(IDEMSTORE_DOCKERFILE)
    for i, a in ins:
        if i == "COPY" and "--from" not in a:
            *sources, _ = a.split()
            for s in sources:
                assert s in keeps, f"COPY {s}: not in the build context ({keeps})"
    copied = {s.rstrip("/") for i, a in ins if i == "COPY" and "--from" not in a for s in a.split()[:-1]}
    members = tomllib.loads((h.ROOT / "Cargo.toml").read_text())["workspace"]["members"]
    missing = [m for m in members if m != "." and m not in copied]
    assert not missing, f"workspace members the image build does not copy: {missing}"
