"""Real identity. Envoy's own JWT filter (envoy.filters.http.jwt_authn) runs
before the idempotency filter, with a JWKS generated at run time (support/jwt_tokens.py), and the
filter's subject is the verified `sub` claim read from jwt_authn's dynamic metadata.

One Envoy per backend (module scope, on the backend's idemstore and the shared counting
upstream) with these listeners:

* `jwt`: jwt_authn (`allow_missing`, `payload_in_metadata: jwt_payload`, `forward: false`),
  then the filter with `subject: {"metadata": {"filter": "envoy.filters.http.jwt_authn",
  "path": ["jwt_payload", "sub"]}}`: the configuration envoy/jwt-authn.yaml ships.
* `lenient`: the same with `allow_missing_or_failed` (what the example does NOT use).
* `claim_header`: jwt_authn `claim_to_headers` (sub -> x-jwt-sub) with a rule for `/orders`
  only, and the filter with `subject: {"header": "x-jwt-sub"}`: the header form;
  `header_only`: the same subject without jwt_authn, where the client picks its subject.
* `uid`: the subject from a numeric claim (`["jwt_payload", "uid"]`).

Plus envoy/jwt-authn.yaml itself: validated, and run with its ports, wasm path and JWKS
rewritten.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from support import harness as h
from support import jwt_tokens as jt
from support.checks import PANIC, REPLAY, assert_executed, assert_replay_of, body_json
from support.harness import new_key

ISSUER = "https://issuer.idem-e2e.test"
AUDIENCE = "idem-e2e"
JWT_FILTER = "envoy.filters.http.jwt_authn"
PAYLOAD_KEY = "jwt_payload"
SUBJECT_METADATA = {"metadata": {"filter": JWT_FILTER, "path": [PAYLOAD_KEY, "sub"]}}
CLAIM_HEADER = "x-jwt-sub"

JWT_EXAMPLE = h.ROOT / "envoy" / "jwt-authn.yaml"
ENVOY_YAML = h.ROOT / "envoy" / "envoy.yaml"
# What envoy/jwt-authn.yaml's provider expects (its tokens are signed here with a test key).
EXAMPLE_ISSUER = "https://issuer.example.com"
EXAMPLE_AUDIENCE = "orders-api"

ALICE = "user-alice"
BOB = "user-bob"


# --------------------------------------------------------------------------------------------
# tokens and configuration
# --------------------------------------------------------------------------------------------


@dataclass
class Idp:
    """The issuer's signing key (its JWKS is what jwt_authn trusts) and a forger's key with the
    same key id, which jwt_authn does not trust."""
    key: jt.SigningKey
    forger: jt.SigningKey

    def token(self, sub: str | int | None, iss: str = ISSUER, aud: str = AUDIENCE, ttl: int = 3600,
              forged: bool = False, **extra) -> str:
        signer = self.forger if forged else self.key
        return signer.sign(jt.claims(sub, iss, aud, ttl, **extra))

    def jwks(self) -> str:
        return jt.jwks(self.key)


@pytest.fixture(scope="module")
def idp() -> Idp:
    return Idp(jt.SigningKey("idp-key-1"), jt.SigningKey("idp-key-1"))


def jwt_authn(jwks: str, requires: dict, prefixes=("/",), **provider_extra) -> dict:
    """jwt_authn with one provider (ISSUER, AUDIENCE, the inline JWKS, the verified payload in
    metadata under PAYLOAD_KEY, the token not forwarded) and a rule per path prefix."""
    provider = {
        "issuer": ISSUER,
        "audiences": [AUDIENCE],
        "local_jwks": {"inline_string": jwks},
        "payload_in_metadata": PAYLOAD_KEY,
        "forward": False,
    }
    provider.update(provider_extra)
    return {
        "name": JWT_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
            "providers": {"idp": provider},
            "rules": [{"match": {"prefix": p}, "requires": requires} for p in prefixes],
        },
    }


def plugin(**cfg) -> dict:
    return {"store_cluster": "idemstore", **cfg}


# --------------------------------------------------------------------------------------------
# the stack
# --------------------------------------------------------------------------------------------


@dataclass
class Identity:
    envoy: h.Envoy
    upstream: h.Upstream

    def post(self, key: str, token: str | None = None, listener: str = "jwt", path: str = "/orders",
             headers: list | tuple = (), source: str | None = None, body: str = "{}") -> h.Response:
        hdrs = [("Idempotency-Key", key), ("content-type", "application/json"), *headers]
        if token is not None:
            hdrs.append(jt.bearer(token))
        return h.request(self.envoy.port(listener), "POST", path, body, hdrs, source=source)

    def counters(self) -> dict[str, int]:
        return self.envoy.counters()

    def jwt_stats(self, listener: str = "jwt") -> dict[str, int]:
        prefix = f"http.{listener}.jwt_authn."
        return {k[len(prefix):]: v for k, v in self.envoy.stats("^" + re.escape(prefix)).items()}

    def settle(self, stored_at_least: int) -> dict[str, int]:
        """Waits until `stored` reaches the given count (a commit finishes after the client has
        its answer), then returns all the filter's counters."""
        self.envoy.wait_counter("stored", stored_at_least)
        return self.counters()


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after.keys() | before.keys()
            if after.get(k, 0) != before.get(k, 0)}


def assert_panic_free(envoy: h.Envoy) -> None:
    panics = [line for line in envoy.log_text().splitlines() if PANIC.search(line)]
    assert not panics, "wasm panic or trap in Envoy's log:\n" + "\n".join(panics[:20])


@pytest.fixture(scope="module")
def ident(stack, run_dir, artifacts, idp) -> Identity:
    wasm = artifacts["wasm"]
    jwks = idp.jwks()
    listeners = {
        "jwt": [jwt_authn(jwks, {"allow_missing": {}}),
                h.wasm_filter(plugin(subject=SUBJECT_METADATA), wasm)],
        "lenient": [jwt_authn(jwks, {"allow_missing_or_failed": {}}),
                    h.wasm_filter(plugin(subject=SUBJECT_METADATA), wasm)],
        # A jwt_authn rule for /orders only: /payments and / reach the filter unverified.
        "claim_header": [jwt_authn(jwks, {"allow_missing": {}}, prefixes=("/orders",),
                                   claim_to_headers=[{"header_name": CLAIM_HEADER, "claim_name": "sub"}]),
                         h.wasm_filter(plugin(subject={"header": CLAIM_HEADER}), wasm)],
        # The same subject with nothing in Envoy that sets or removes the header.
        "header_only": [h.wasm_filter(plugin(subject={"header": CLAIM_HEADER}), wasm)],
        # A numeric claim as the subject.
        "uid": [jwt_authn(jwks, {"allow_missing": {}}),
                h.wasm_filter(plugin(subject={"metadata": {"filter": JWT_FILTER, "path": [PAYLOAD_KEY, "uid"]}}),
                              wasm)],
    }
    try:
        envoy = h.start_envoy(run_dir / stack.backend, "envoy-identity", listeners, stack.upstream.port,
                              stack.idemstore_port)
    except h.HarnessError as e:
        pytest.fail(str(e), pytrace=False)
    yield Identity(envoy, stack.upstream)
    envoy.stop()
    assert_panic_free(envoy)


def www_authenticate(port: int, path: str = "/orders") -> str:
    return f'Bearer realm="http://127.0.0.1:{port}{path}", error="invalid_token"'


def received_header(execution: dict, name: str) -> list[str]:
    return [v for k, v in execution["headers"] if k == name]


# --------------------------------------------------------------------------------------------
# jwt_authn metadata as the subject
# --------------------------------------------------------------------------------------------


def test_jwt_subject_separates_users_sharing_a_key(ident, idp):
    """A and B send the same Idempotency-Key and the same body: each executes once and each
    retry replays the caller's own answer; the subject is the token's `sub`, not the IP."""
    key = new_key("jwt")
    alice, bob = idp.token(ALICE), idp.token(BOB)
    before = ident.settle(0)

    a1 = ident.post(key, alice)
    assert_executed(a1, 201)
    assert ident.upstream.count(key=key) == 1
    a2 = ident.post(key, alice)
    assert_replay_of(a2, a1)
    assert ident.upstream.count(key=key) == 1

    b1 = ident.post(key, bob)
    assert_executed(b1, 201)
    assert ident.upstream.count(key=key) == 2
    assert body_json(b1)["id"] != body_json(a1)["id"], (a1, b1)
    assert b1.header("location") != a1.header("location")
    b2 = ident.post(key, bob)
    assert_replay_of(b2, b1)
    assert b2.body != a1.body

    # A's retry from another address (a new network) is still A: A's answer, not B's.
    a3 = ident.post(key, alice, source="127.0.0.2")
    assert_replay_of(a3, a1)
    # A freshly issued token for the same user is the same caller.
    assert_replay_of(ident.post(key, idp.token(ALICE, jti="second-login")), a1)
    assert ident.upstream.count(key=key) == 2

    got = delta(ident.settle(before.get("stored", 0) + 2), before)
    # Replays a worker's VM had cached (after the store replayed them once) count there too.
    assert got.pop("cache_hits", 0) <= 4 - 2, got
    assert got == {"guarded": 6, "executed": 2, "stored": 2, "replayed": 4}, got
    # forward: false: the upstream never sees the bearer token.
    executions = ident.upstream.executions(key=key, headers=True)
    assert [e["id"] for e in executions] == [body_json(a1)["id"], body_json(b1)["id"]]
    assert all(not received_header(e, "authorization") for e in executions), executions


def test_rejected_tokens_never_reach_the_filter(ident, idp):
    """A forged signature, an expired token, a wrong audience, an unknown issuer and a
    malformed token, each claiming to be A and sending A's Idempotency-Key: jwt_authn answers
    401/403 itself; the filter sees nothing (every counter unchanged) and the upstream does not
    run."""
    key = new_key("jwt-bad")
    stored = ident.counters().get("stored", 0)
    a1 = ident.post(key, idp.token(ALICE))
    assert_executed(a1, 201)
    before = ident.settle(stored + 1)
    jwt_before = ident.jwt_stats()

    cases = [
        ("forged signature", idp.token(ALICE, forged=True), 401, b"Jwt verification fails"),
        ("expired", idp.token(ALICE, ttl=-3600), 401, b"Jwt is expired"),
        ("wrong audience", idp.token(ALICE, aud="another-api"), 403, b"Audiences in Jwt are not allowed"),
        ("unknown issuer", idp.token(ALICE, iss="https://evil.test"), 401, b"Jwt issuer is not configured"),
        ("not a JWT", "not-a-jwt", 401,
         b"Jwt is not in the form of Header.Payload.Signature with two dots and 3 sections"),
    ]
    port = ident.envoy.port("jwt")
    for name, token, status, body in cases:
        r = ident.post(key, token)
        assert (r.status, r.body) == (status, body), (name, r)
        assert r.header("content-type") == "text/plain", (name, r)
        assert r.header("www-authenticate") == www_authenticate(port), (name, r)
        assert r.header(REPLAY) is None and r.header("x-upstream-id") is None, (name, r)

    assert ident.upstream.count(key=key) == 1
    assert ident.counters() == before, delta(ident.counters(), before)
    assert delta(ident.jwt_stats(), jwt_before) == {"denied": len(cases)}
    # A's record is intact: A's retry still replays A's answer.
    assert_replay_of(ident.post(key, idp.token(ALICE)), a1)
    assert ident.upstream.count(key=key) == 1


def test_without_a_token_the_caller_is_anonymous(ident, idp):
    """No token: no metadata, so the subject is anon:<client ip>. A header claiming to be A
    does not make the caller A; two unauthenticated requests from one IP share a scope, from
    two IPs they do not."""
    key = new_key("jwt-anon")
    a1 = ident.post(key, idp.token(ALICE))
    assert_executed(a1, 201)

    claims_a = [("x-user", ALICE), ("x-jwt-sub", ALICE), ("sub", ALICE), ("x-forwarded-user", ALICE)]
    n1 = ident.post(key, headers=claims_a)
    assert_executed(n1, 201)
    assert body_json(n1)["id"] != body_json(a1)["id"]
    assert ident.upstream.count(key=key) == 2

    # Another unauthenticated request with the same key from the same IP: the anon scope's
    # answer (n1), whatever it claims.
    assert_replay_of(ident.post(key), n1)
    assert_replay_of(ident.post(key, headers=[("x-user", BOB)]), n1)
    # From another IP: another anonymous caller.
    n2 = ident.post(key, source="127.0.0.2")
    assert_executed(n2, 201)
    assert ident.upstream.count(key=key) == 3
    assert_replay_of(ident.post(key, source="127.0.0.2"), n2)
    # And A is still A.
    assert_replay_of(ident.post(key, idp.token(ALICE), source="127.0.0.2"), a1)
    assert ident.upstream.count(key=key) == 3


def test_valid_token_without_sub_is_anonymous(ident, idp):
    """jwt_authn accepts a token without `sub`; the configured subject is then absent and the
    caller falls back to anon:<client ip>, the scope of unauthenticated requests from that IP.
    (A non-string `sub` is refused by jwt_authn itself.) The issuer must always set `sub`."""
    key = new_key("jwt-nosub")
    n1 = ident.post(key)
    assert_executed(n1, 201)
    assert_replay_of(ident.post(key, idp.token(None)), n1)
    assert ident.upstream.count(key=key) == 1

    r = ident.post(new_key("jwt-intsub"), idp.token(12345))
    assert (r.status, r.body) == (401, b"Jwt payload [sub] field is not a string"), r


def test_allow_missing_or_failed_runs_a_forged_token_anonymously(ident, idp):
    """Why the example uses `allow_missing`: with `allow_missing_or_failed` a forged token
    claiming A is not refused. It cannot borrow A's record (jwt_authn writes no metadata for
    it), but it runs as an anonymous request and the client is never told its token failed."""
    key = new_key("jwt-lenient")
    a1 = ident.post(key, idp.token(ALICE), listener="lenient")
    assert_executed(a1, 201)
    jwt_before = ident.jwt_stats("lenient")

    forged = ident.post(key, idp.token(ALICE, forged=True), listener="lenient")
    assert_executed(forged, 201)
    assert body_json(forged)["id"] != body_json(a1)["id"]
    # ... in the anon:<ip> scope: an unauthenticated request replays it.
    assert_replay_of(ident.post(key, listener="lenient"), forged)
    assert ident.upstream.count(key=key) == 2
    assert delta(ident.jwt_stats("lenient"), jwt_before) == {"allowed": 2}


def test_numeric_claim_subject_separates_users(ident, idp):
    """A numeric claim (here `uid`) as the subject: users 1000 and 2000 with one key are two
    callers. Envoy hands the filter a number as the 8 raw bytes of a double (1000 and 2000 differ
    only in bytes that are not UTF-8); the subject keeps them exact. Each user's retry replays
    their own answer."""
    key = new_key("uid")
    u1 = ident.post(key, idp.token(ALICE, uid=1000), listener="uid")
    assert_executed(u1, 201)
    u2 = ident.post(key, idp.token(BOB, uid=2000), listener="uid")
    assert_executed(u2, 201)
    assert_replay_of(ident.post(key, idp.token(ALICE, uid=1000), listener="uid"), u1)
    assert_replay_of(ident.post(key, idp.token(BOB, uid=2000), listener="uid"), u2)


# --------------------------------------------------------------------------------------------
# a header as the subject
# --------------------------------------------------------------------------------------------


def envoy_version() -> tuple[int, int]:
    out = subprocess.run([h.envoy_bin(), "--version"], capture_output=True, text=True, timeout=30).stdout
    m = re.search(r"/(\d+)\.(\d+)\.\d+/", out)
    assert m, out
    return int(m.group(1)), int(m.group(2))


def test_header_subject_is_safe_only_where_envoy_strips_the_header(ident, idp):
    """`subject: {"header": "x-jwt-sub"}`, the header set by jwt_authn `claim_to_headers`
    (sub -> x-jwt-sub). jwt_authn removes a client's x-jwt-sub from the requests it verifies
    (Envoy 1.40: from every request, also where no rule applies, here /payments).
    The same subject without jwt_authn in the chain (`header_only`) is whatever the client
    sends: two clients on two addresses both "are" A and share A's records."""
    ln = "claim_header"
    key = new_key("claim")
    a1 = ident.post(key, idp.token(ALICE), listener=ln)
    assert_executed(a1, 201)
    fake = ident.post(key, listener=ln, headers=[(CLAIM_HEADER, ALICE)])
    assert_executed(fake, 201)
    assert body_json(fake)["id"] != body_json(a1)["id"]
    assert_replay_of(ident.post(key, idp.token(ALICE), listener=ln, source="127.0.0.2"), a1)
    assert ident.upstream.count(key=key) == 2
    ex = ident.upstream.executions(key=key, headers=True)
    assert [received_header(e, CLAIM_HEADER) for e in ex] == [[ALICE], []], ex

    # No jwt_authn rule for /payments. Envoy 1.40 still removes the client's header (runtime
    # guard jwt_authn_sanitize_payload_headers_filter_wide, default on), so two clients claiming
    # A from two addresses are two anonymous callers. Envoy 1.36 removed it only where a rule
    # verified a token: there the header subject is the client's pick (why the README prefers
    # the metadata subject). Releases in between were not measured.
    key2 = new_key("claim-norule")
    p1 = ident.post(key2, listener=ln, path="/payments", headers=[(CLAIM_HEADER, ALICE)], source="127.0.0.1")
    p2 = ident.post(key2, listener=ln, path="/payments", headers=[(CLAIM_HEADER, ALICE)], source="127.0.0.3")
    assert_executed(p1, 201)
    version = envoy_version()
    if version >= (1, 40):
        assert_executed(p2, 201)
        ex = ident.upstream.executions(key=key2, headers=True)
        assert [received_header(e, CLAIM_HEADER) for e in ex] == [[], []], ex
    elif version <= (1, 36):
        assert_replay_of(p2, p1)
        ex = ident.upstream.executions(key=key2, headers=True)
        assert [received_header(e, CLAIM_HEADER) for e in ex] == [[ALICE]], ex

    # Nothing in Envoy removes the header: the client picks its subject.
    key3 = new_key("header-only")
    h1 = ident.post(key3, listener="header_only", headers=[(CLAIM_HEADER, ALICE)], source="127.0.0.1")
    assert_executed(h1, 201)
    assert_replay_of(ident.post(key3, listener="header_only", headers=[(CLAIM_HEADER, ALICE)],
                                source="127.0.0.3"), h1)
    assert ident.upstream.count(key=key3) == 1


# --------------------------------------------------------------------------------------------
# envoy/jwt-authn.yaml, the shipped example
# --------------------------------------------------------------------------------------------


def example_yaml(wasm: str, ports: dict[int, int] | None = None, jwks: str | None = None) -> str:
    """envoy/jwt-authn.yaml with its wasm path (the guard's and the gRPC replay listener's, and
    optionally its ports and JWKS) rewritten."""
    text = JWT_EXAMPLE.read_text()
    text, n = re.subn(r"filename: \S*idempotency_filter\.wasm", f"filename: {wasm}", text)
    assert n == 2, f"the wasm path appears {n} times in {JWT_EXAMPLE} (the guard, the gRPC replay listener)"
    for old, new in (ports or {}).items():
        text, n = re.subn(rf"port_value: {old}\b", f"port_value: {new}", text)
        assert n == 1, f"port {old} appears {n} times in {JWT_EXAMPLE}"
    if jwks is not None:
        text, n = re.subn(r"^(\s*)inline_string: '.*'$", lambda m: f"{m.group(1)}inline_string: '{jwks}'",
                          text, flags=re.M)
        assert n == 1, f"inline_string appears {n} times in {JWT_EXAMPLE}"
    return text


def test_jwt_example_validates(run_dir, artifacts):
    """`envoy --mode validate` accepts envoy/jwt-authn.yaml (the wasm path made the built one:
    validation loads the wasm and runs the filter's configuration check)."""
    path = run_dir / "jwt-authn-validate.yaml"
    path.write_text(example_yaml(artifacts["wasm"]))
    out = subprocess.run([h.envoy_bin(), "--mode", "validate", "-c", str(path), "-l", "warn"],
                         cwd=h.ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"configuration '{path}' OK" in out.stdout + out.stderr


def significant_lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_jwt_example_follows_envoy_yaml():
    """The example keeps envoy/envoy.yaml's conventions: the same idemstore cluster (and gRPC
    replay cluster after it), and the edge settings the subject depends on, in its main
    listener (the gRPC replay listener after it has a Wasm filter and a router of its own)."""
    def store_cluster(path: Path) -> list[str]:
        text = path.read_text()
        start = text.index("  - name: idemstore\n")
        return significant_lines(text[start:])

    assert store_cluster(JWT_EXAMPLE) == store_cluster(ENVOY_YAML)
    main = re.split(r"^  - name: idempotency_grpc_replay$", JWT_EXAMPLE.read_text(), flags=re.M)[0]
    lines = significant_lines(main)
    for want in ("use_remote_address: true", "failure_policy: FAIL_RELOAD", "allow_on_headers_stop_iteration: true",
                 "payload_in_metadata: jwt_payload", "forward: false", "requires: {allow_missing: {}}"):
        assert sum(line.strip() == want for line in lines) == 1, want
    # jwt_authn before the idempotency filter.
    names = [line.strip() for line in lines if line.strip().startswith("- name: envoy.filters.http.")]
    assert names == ["- name: envoy.filters.http.jwt_authn", "- name: envoy.filters.http.wasm",
                     "- name: envoy.filters.http.router"], names


@pytest.fixture(scope="module")
def example(stack, run_dir, artifacts, idp) -> h.Envoy:
    """envoy/jwt-authn.yaml as shipped, its ports, wasm path and JWKS (the test issuer's key)
    rewritten, in front of the counting upstream and the backend's idemstore."""
    sub = run_dir / stack.backend
    sub.mkdir(parents=True, exist_ok=True)
    admin, listen = h.free_port(), h.free_port()
    path = sub / "envoy-jwt-example.yaml"
    path.write_text(example_yaml(artifacts["wasm"],
                                 {9901: admin, 10000: listen, 8081: stack.upstream.port, 8380: stack.idemstore_port},
                                 idp.jwks()))
    proc = h.launch_envoy_file(sub, "envoy-jwt-example", path)
    try:
        envoy = h.await_envoy(h.Envoy(proc, admin, {"main": listen}, path))
        # The shipped health check: idemstore is used once its first check passed.
        h.wait_for(lambda: envoy.stats(r"^cluster\.idemstore\.membership_healthy$")
                   .get("cluster.idemstore.membership_healthy") == 1,
                   "idemstore healthy in the example Envoy", proc, timeout=10)
    except h.HarnessError as e:
        proc.stop()
        pytest.fail(str(e), pytrace=False)
    yield envoy
    envoy.stop()
    assert_panic_free(envoy)


def test_jwt_example_serves(example, stack, idp):
    """The shipped example end to end: A and B with one key each get their own answer, no
    token is anon:<ip>, a forged token is refused before the filter."""
    port = example.port("main")

    def post(key, token=None, **kw):
        hdrs = [("Idempotency-Key", key), ("content-type", "application/json")]
        if token is not None:
            hdrs.append(jt.bearer(token))
        return h.request(port, "POST", "/orders", '{"item":"book"}', hdrs, **kw)

    alice = idp.token(ALICE, iss=EXAMPLE_ISSUER, aud=EXAMPLE_AUDIENCE)
    bob = idp.token(BOB, iss=EXAMPLE_ISSUER, aud=EXAMPLE_AUDIENCE)
    key = new_key("example")
    a1 = post(key, alice)
    assert_executed(a1, 201)
    assert_replay_of(post(key, alice, source="127.0.0.2"), a1)
    b1 = post(key, bob)
    assert_executed(b1, 201)
    assert body_json(b1)["id"] != body_json(a1)["id"]
    assert_replay_of(post(key, bob), b1)
    n1 = post(key)
    assert_executed(n1, 201)
    assert_replay_of(post(key), n1)
    r = post(key, idp.token(ALICE, iss=EXAMPLE_ISSUER, aud=EXAMPLE_AUDIENCE, forged=True))
    assert (r.status, r.body) == (401, b"Jwt verification fails"), r
    r = post(key, idp.token(ALICE))  # the suite's issuer: not the example's
    assert (r.status, r.body) == (401, b"Jwt issuer is not configured"), r
    assert stack.upstream.count(key=key) == 3
    got = example.counters()
    assert {k: got.get(k, 0) for k in ("guarded", "executed", "replayed", "degraded")} == \
        {"guarded": 6, "executed": 3, "replayed": 3, "degraded": 0}, got
