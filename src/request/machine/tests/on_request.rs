//! The request's phase: which requests are guarded, keys, bodies, the store key and its scope.

use super::*;

#[test]
fn unguarded_methods_and_keyless_requests_pass() {
    let mut s = Machine::new(cfg(""));
    let mut v = MockView::post(Some("k"));
    v.request[0].1 = b"GET".to_vec();
    assert_eq!(s.on_request_headers(&v, true), Step::go(vec![]));
    assert!(s.is_settled());
    // The host skips a done stream's later callbacks.
    assert!(s.is_done());

    let mut s = Machine::new(cfg(""));
    assert_eq!(
        s.on_request_headers(&MockView::post(None), false),
        Step::go(vec![Effect::Count(Metric::Passthrough)])
    );
    // Nothing afterwards touches the stream.
    assert!(s.is_done());
    assert_eq!(s.on_request_body(&MockView::post(None), 5, true), Step::go(vec![]));
    assert_eq!(s.on_stream_end(&MockView::default()), vec![]);
}

#[test]
fn require_key_and_malformed_keys_get_400() {
    let mut s = Machine::new(cfg(r#","require_key":true"#));
    let step = s.on_request_headers(&MockView::post(None), false);
    assert_eq!(step.action, Action::Pause);
    assert_eq!(respond_status(&step.effects), Some(400));
    assert_eq!(counts(&step.effects), vec![Metric::Rejected]);

    for bad in ["", "a b", "\"open"] {
        let mut s = Machine::new(cfg(""));
        let step = s.on_request_headers(&MockView::post(Some(bad)), false);
        assert_eq!(respond_status(&step.effects), Some(400), "{bad:?}");
        let Some(r) = answered(&step.effects) else { panic!() };
        assert!(!String::from_utf8_lossy(&r.body).contains(bad) || bad.is_empty());
    }
    let mut s = Machine::new(cfg(""));
    let mut v = MockView::post(Some("a"));
    v.req("idempotency-key", "b");
    assert_eq!(respond_status(&s.on_request_headers(&v, false).effects), Some(400));
}

#[test]
fn declared_oversized_body_gets_413_before_buffering() {
    let mut s = Machine::new(cfg(""));
    let mut v = MockView::post(Some("k"));
    v.req("content-length", "101");
    let step = s.on_request_headers(&v, false);
    assert_eq!(respond_status(&step.effects), Some(413));
    assert_eq!(counts(&step.effects), vec![Metric::Guarded, Metric::Rejected]);
    assert!(s.is_settled());
}

#[test]
fn streamed_oversized_body_gets_413() {
    let mut s = Machine::new(cfg(""));
    let mut v = MockView::post(Some("k"));
    v.request_body = vec![b'x'; 101];
    s.on_request_headers(&v, false);
    assert_eq!(s.on_request_body(&v, 60, false), Step::pause(vec![]));
    let step = s.on_request_body(&v, 101, false);
    assert_eq!(respond_status(&step.effects), Some(413));
    assert_eq!(s.on_stream_end(&MockView::default()), vec![], "no lock was taken");
}

#[test]
fn body_is_hashed_incrementally_and_trailers_end_it() {
    let mut s = Machine::new(cfg(""));
    let mut v = MockView::post(Some("k"));
    v.request_body = b"hello world".to_vec();
    s.on_request_headers(&v, false);
    s.on_request_body(&v, 5, false);
    s.on_request_body(&v, 5, false); // no new bytes
    let step = s.on_request_body(&v, 11, false);
    assert_eq!(step, Step::pause(vec![]));
    let step = s.on_request_trailers();
    assert_eq!(step.action, Action::Pause);
    assert_eq!(begin_call(&step.effects).1, sha_hex(b"hello world"));
}

#[test]
fn headers_only_request_hashes_the_empty_body() {
    let mut s = Machine::new(cfg(""));
    let step = s.on_request_headers(&MockView::post(Some("k")), true);
    assert_eq!(step.action, Action::Pause);
    assert_eq!(counts(&step.effects), vec![Metric::Guarded]);
    assert_eq!(begin_call(&step.effects).1, sha_hex(b""));
    assert!(!s.is_settled());
}

#[test]
fn store_key_scope() {
    let key_for = |v: &MockView, extra: &str| {
        let mut s = Machine::new(cfg(extra));
        begin_call(&s.on_request_headers(v, true).effects).0
    };
    let base = MockView::post(Some("k"));
    let k = key_for(&base, "");
    assert_eq!(k, crate::request::key::store_key("anon:127.0.0.1", "POST", "/orders", "k"));
    // A new connection (port) is the same caller; the query is not part of the route.
    let mut other_port = MockView::post(Some("k"));
    other_port.prop("source.address", "127.0.0.1:50000");
    other_port.request[1].1 = b"/orders?x=2".to_vec();
    assert_eq!(key_for(&other_port, ""), k);
    let mut named = MockView::post(Some("k"));
    named.prop("xds.route_name", "orders");
    assert_eq!(key_for(&named, ""), crate::request::key::store_key("anon:127.0.0.1", "POST", "orders", "k"));
    let mut other_ip = MockView::post(Some("k"));
    other_ip.prop("source.address", "127.0.0.2:40000");
    assert_ne!(key_for(&other_ip, ""), k);
    // `"k"` and `k` are one key.
    assert_eq!(key_for(&MockView::post(Some("\"k\"")), ""), k);

    let mut alice = MockView::post(Some("k"));
    alice.req("x-user", "alice");
    let header = r#","subject":{"header":"x-user"}"#;
    assert_eq!(key_for(&alice, header), crate::request::key::store_key("id:alice", "POST", "/orders", "k"));
    // Without the header the caller is anonymous.
    assert_eq!(key_for(&base, header), k);

    let mut jwt = MockView::post(Some("k"));
    jwt.prop("metadata.filter_metadata.envoy.filters.http.jwt_authn.payload.sub", "user-1");
    let meta =
        r#","subject":{"metadata":{"filter":"envoy.filters.http.jwt_authn","path":["payload","sub"]}}"#;
    assert_eq!(key_for(&jwt, meta), crate::request::key::store_key("id:user-1", "POST", "/orders", "k"));

    // Workloads: the peer certificate's URI SAN; a caller without one is anonymous.
    let san = r#","subject":{"property":["connection","uri_san_peer_certificate"]}"#;
    let mut one = MockView::post(Some("k"));
    one.prop("connection.uri_san_peer_certificate", "spiffe://test/ns/a/sa/one");
    let mut two = MockView::post(Some("k"));
    two.prop("connection.uri_san_peer_certificate", "spiffe://test/ns/a/sa/two");
    let id = |s: &str| crate::request::key::store_key(&format!("id:{s}"), "POST", "/orders", "k");
    assert_eq!(key_for(&one, san), id("spiffe://test/ns/a/sa/one"));
    assert_eq!(key_for(&two, san), id("spiffe://test/ns/a/sa/two"));
    assert_eq!(key_for(&base, san), k);
}

#[test]
fn mint_mode_adds_a_random_key_to_keyless_guarded_requests_only() {
    let minted = |view: &MockView| {
        let mut s = Machine::new(cfg(r#","mode":"mint""#));
        let step = s.on_request_headers(view, false);
        assert_eq!(step.action, Action::Continue);
        assert!(s.is_done(), "nothing more to do for the stream");
        step.effects
    };
    let view = MockView::post(None);
    let first = minted(&view);
    let [Effect::SetRequestHeader(name, value), Effect::Count(Metric::Minted)] = first.as_slice() else {
        panic!("{first:?}")
    };
    assert_eq!(name, "idempotency-key");
    assert_eq!(value, &format!("\"{}\"", "01".repeat(16)), "128 bits from the host, as a string item");
    assert_eq!(
        crate::request::key::parse_client_key(&[value.as_bytes()], 255).unwrap().map(|k| k.len()),
        Some(32),
        "the guard takes it"
    );
    let second = minted(&view);
    assert_ne!(first, second, "every request its own key");
    // A client's key (even a malformed one) is the guard's to judge; other methods pass.
    assert!(minted(&MockView::post(Some("k1"))).is_empty());
    assert!(minted(&MockView::post(Some("not a token"))).is_empty());
    let mut get = MockView::post(None);
    get.request[0].1 = b"GET".to_vec();
    assert!(minted(&get).is_empty());
}

#[test]
fn store_key_header_is_set_for_guarded_and_removed_from_other_requests() {
    let mut s = Machine::new(cfg(DETACHED));
    let mut v = MockView::post(None);
    v.req("x-store-key", "forged");
    let step = s.on_request_headers(&v, true);
    assert_eq!(step.effects[0], Effect::RemoveRequestHeader("x-store-key".into()));
    let mut s = Machine::new(cfg(DETACHED));
    assert_eq!(
        s.on_request_headers(&MockView::post(None), true).effects,
        vec![Effect::Count(Metric::Passthrough)]
    );
}

#[test]
fn subjects_that_are_not_utf8_stay_distinct() {
    // A numeric claim reaches the filter as the 8 bytes of a double: 1000.0 and 2000.0 differ
    // only in bytes that are not UTF-8, and must still be two callers.
    let meta = r#","subject":{"metadata":{"filter":"authn","path":["uid"]}}"#;
    let key_for = |uid: f64| {
        let mut v = MockView::post(Some("k"));
        v.props.insert("metadata.filter_metadata.authn.uid".into(), uid.to_le_bytes().to_vec());
        let mut s = Machine::new(cfg(meta));
        begin_call(&s.on_request_headers(&v, true).effects).0
    };
    assert_ne!(key_for(1000.0), key_for(2000.0));
    assert_ne!(key_for(1.0), key_for(1.25));
    assert_eq!(key_for(1000.0), key_for(1000.0));
    let bytes = 1000.0f64.to_le_bytes();
    assert_eq!(
        key_for(1000.0),
        crate::request::key::store_key(&format!("idx:{}", hex(&bytes)), "POST", "/orders", "k")
    );
}

#[test]
fn methods_are_guarded_without_regard_to_case() {
    let key_for = |method: &str| {
        let mut v = MockView::post(Some("k"));
        v.request[0].1 = method.as_bytes().to_vec();
        let mut s = Machine::new(cfg(""));
        let step = s.on_request_headers(&v, true);
        assert_eq!(counts(&step.effects), vec![Metric::Guarded], "{method}");
        begin_call(&step.effects).0
    };
    // `post` shares its records with `POST`.
    assert_eq!(key_for("post"), key_for("POST"));
    assert_eq!(key_for("Patch"), crate::request::key::store_key("anon:127.0.0.1", "PATCH", "/orders", "k"));
}

#[test]
fn without_pause_on_headers_the_body_is_held_instead() {
    // Istio's mode: headers with a body go on (a buffer filter after this one holds them); the
    // body is held until the store answers.
    let mut s = Machine::new(cfg(r#","pause_on_headers":false"#));
    let mut v = MockView::post(Some("k"));
    v.request_body = b"{}".to_vec();
    let step = s.on_request_headers(&v, false);
    assert_eq!(step.action, Action::Continue);
    assert_eq!(counts(&step.effects), vec![Metric::Guarded]);
    let step = s.on_request_body(&v, 1, false);
    assert_eq!(step, Step::pause(vec![]));
    let step = s.on_request_body(&v, 2, true);
    assert_eq!(step.action, Action::Pause);
    assert_eq!(begin_call(&step.effects).1, sha_hex(b"{}"));
    let effects = s.on_begin_answer(Ok(BeginAnswer::Locked { token: "t1".into() }));
    assert_eq!(effects, vec![Effect::Resume, Effect::Count(Metric::Executed)]);
    // A request without a body still stops on its headers: nothing else has to arrive.
    let mut s = Machine::new(cfg(r#","pause_on_headers":false"#));
    assert_eq!(s.on_request_headers(&MockView::post(Some("k")), true).action, Action::Pause);
}
