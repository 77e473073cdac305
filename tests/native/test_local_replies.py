"""A replay keeps the stored content type exactly. Envoy's local reply changes it: it removes it
when the body is empty and sets `text/plain` when a body has none (Utility::prepareLocalReply);
the wasm filter gives the stored header (or its absence) back in its own response-headers
callback, which Envoy runs for a local reply too. Envoy 1.40 skips a module's encode hooks for
its own local reply, so the native host sends its answers as headers, body and trailers
(`send_response_headers`/`_data`/`_trailers`), which Envoy leaves as they are
(src/host/native/calls.rs, `send_local_response`).

The same cases as tests/contract/test_record.py `test_replay_keeps_the_content_type_exactly`,
each on its own key; the retry waits for the commit on the lock (`lock_wait_ms` 5 s).
"""

from __future__ import annotations

import pytest

from support import harness as h
from support.harness import new_key

CASES = {
    # upstream headers, the content type the upstream sends (None: none)
    "body_without_content_type": ({"x-test-no-content-type": "1", "x-test-body": "abc"}, None),
    "empty_body_with_content_type": ({"x-test-content-type": "application/json", "x-test-body": ""},
                                     "application/json"),
}


@pytest.fixture(scope="module")
def envoy(run_dir, upstream):
    admin, port = h.free_port(), h.free_port()
    config = {
        "admin": {"address": {"socket_address": {"address": h.LOOPBACK, "port_value": admin}}},
        "static_resources": {
            "listeners": [h.listener("api", port, [h.native_filter({"store": {"memory": True},
                                                                    "lock_wait_ms": 5000})])],
            "clusters": [h.static_cluster("upstream", upstream.port)],
        },
    }
    e = h.await_envoy(h.spawn_envoy_config(run_dir / "native-local-replies", "envoy-local-replies", config, admin,
                                           {"api": port}, env=h.native_env()))
    yield e
    e.stop()


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_replay_keeps_the_stored_content_type(envoy, upstream, case):
    headers, ctype = CASES[case]
    key = new_key("ct")
    headers = {"idempotency-key": key, **headers}
    first = h.request(envoy.port("api"), "POST", "/orders", b"{}", headers)
    assert first.status == 201 and first.header("x-idempotent-replay") is None, first
    assert first.header("content-type") == ctype, first
    again = h.request(envoy.port("api"), "POST", "/orders", b"{}", headers)
    assert again.header("x-idempotent-replay") == "true", again
    assert (again.status, again.body) == (first.status, first.body), again
    assert upstream.count(key=key) == 1
    assert again.header("content-type") == ctype, again
