use super::*;
use crate::request::detached::{UpstreamAnswer, UpstreamCall};
use crate::request::key::hex;
use crate::sim::request::{Driver, Event, MockView, Tally};
use crate::store::client::{BeginAnswer, LockToken};

fn cfg(extra: &str) -> Rc<Config> {
    let json =
        format!(r#"{{"store_cluster":"idemstore","max_body_bytes":100,"max_record_bytes":50{extra}}}"#);
    Rc::new(Config::from_json(json.as_bytes()).unwrap())
}

fn sha_hex(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

fn begin_call(effects: &[Effect]) -> (String, String) {
    for e in effects {
        if let Effect::Store(StoreCall::Begin { key, body_hash }) = e {
            return (key.clone(), body_hash.clone());
        }
    }
    panic!("no begin in {effects:?}")
}

fn respond_status(effects: &[Effect]) -> Option<u32> {
    effects.iter().find_map(|e| match e {
        Effect::Respond(r) => Some(r.status),
        _ => None,
    })
}

fn counts(effects: &[Effect]) -> Vec<Metric> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Count(m) => Some(*m),
            _ => None,
        })
        .collect()
}

/// A stream that has taken the lock with token `t1` for a request with body `{}`.
fn executing(extra: &str) -> (Machine, String) {
    let mut s = Machine::new(cfg(extra));
    let mut v = MockView::post(Some("k1"));
    v.request_body = b"{}".to_vec();
    assert_eq!(s.on_request_headers(&v, false).action, Action::Pause);
    let step = s.on_request_body(&v, 2, true);
    let (key, _) = begin_call(&step.effects);
    assert!(!s.is_done());
    let effects = s.on_begin_answer(Ok(BeginAnswer::Locked { token: "t1".into() }));
    assert_eq!(effects, vec![Effect::Resume, Effect::Count(Metric::Executed)]);
    // Executing: the response is still to be watched.
    assert!(!s.is_done());
    (s, key)
}

fn release_of(key: &str) -> Vec<Effect> {
    vec![
        Effect::Store(StoreCall::Release { key: key.into(), token: "t1".into() }),
        Effect::Count(Metric::Released),
    ]
}

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
    assert_eq!(s.on_stream_end(), vec![]);
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
        let Some(Effect::Respond(r)) = step.effects.first() else { panic!() };
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
    assert_eq!(s.on_stream_end(), vec![], "no lock was taken");
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
}

#[test]
fn begin_answers_replay_reject_or_execute() {
    let record = Record {
        status: 201,
        headers: vec![
            ("location".into(), "/orders/1".into()),
            ("content-type".into(), "application/json".into()),
        ],
        body: b"{\"id\":1}".to_vec(),
        ..Record::default()
    };
    let cases: Vec<(BeginAnswer, Option<u32>, Metric)> = vec![
        (BeginAnswer::Replay(record.clone()), Some(201), Metric::Replayed),
        (BeginAnswer::Mismatch, Some(422), Metric::Mismatched),
        (BeginAnswer::Busy { lock_ms: None }, Some(409), Metric::Conflicted),
        (BeginAnswer::Locked { token: "t".into() }, None, Metric::Executed),
    ];
    for (answer, status, metric) in cases {
        let mut s = Machine::new(cfg(""));
        s.on_request_headers(&MockView::post(Some("k")), true);
        let effects = s.on_begin_answer(Ok(answer));
        assert_eq!(respond_status(&effects), status);
        assert_eq!(counts(&effects), vec![metric]);
        assert!(s.is_settled());
        // A second answer (duplicate delivery) does nothing.
        assert_eq!(s.on_begin_answer(Ok(BeginAnswer::Busy { lock_ms: None })), vec![]);
    }
    let mut s = Machine::new(cfg(r#","replay_header":"x-replayed""#));
    s.on_request_headers(&MockView::post(Some("k")), true);
    let effects = s.on_begin_answer(Ok(BeginAnswer::Replay(record)));
    let Effect::Respond(r) = &effects[0] else { panic!() };
    assert_eq!(r.status, 201);
    assert_eq!(r.body, b"{\"id\":1}");
    assert_eq!(
        r.headers,
        vec![
            ("location".into(), "/orders/1".into()),
            ("content-type".into(), "application/json".into()),
            ("x-replayed".into(), "true".into())
        ]
    );
}

#[test]
fn store_faults_fail_open_or_closed() {
    let faults = [
        CalloutFault::Dispatch,
        CalloutFault::Reset,
        CalloutFault::Timeout,
        CalloutFault::Status(500),
        CalloutFault::Garbage("bad magic"),
    ];
    for fault in faults {
        let mut s = Machine::new(cfg(""));
        s.on_request_headers(&MockView::post(Some("k")), true);
        assert_eq!(s.on_begin_answer(Err(fault)), vec![Effect::Resume, Effect::Count(Metric::Degraded)]);
        // Ran unguarded: the response is not captured and nothing is released.
        let mut v = MockView::default();
        v.resp(":status", "201").resp("content-type", "application/json");
        assert_eq!(s.on_response_headers(&v, true), Step::go(vec![]));
        assert_eq!(s.on_stream_end(), vec![]);

        let mut s = Machine::new(cfg(r#","failure_mode":"closed""#));
        s.on_request_headers(&MockView::post(Some("k")), true);
        let effects = s.on_begin_answer(Err(fault));
        assert_eq!(respond_status(&effects), Some(503));
        assert_eq!(counts(&effects), vec![Metric::Degraded, Metric::Unavailable]);
    }
}

#[test]
fn json_2xx_is_committed_with_allow_listed_headers() {
    let (mut s, key) = executing("");
    let mut v = MockView::default();
    v.resp(":status", "201")
        .resp("content-type", "application/json")
        .resp("location", "/orders/7")
        .resp("set-cookie", "session=secret")
        .resp("x-other", "no");
    assert_eq!(s.on_response_headers(&v, false), Step::go(vec![]));
    v.response_chunk = b"{\"id\":".to_vec();
    assert_eq!(s.on_response_body(&v, 6, false), Step::go(vec![]));
    v.response_chunk = b"7}".to_vec();
    let step = s.on_response_body(&v, 2, true);
    assert_eq!(step.action, Action::Continue);
    let [Effect::Store(StoreCall::Commit { key: k, token, body_hash, record })] = step.effects.as_slice()
    else {
        panic!("{:?}", step.effects)
    };
    assert_eq!((k, token, body_hash.clone()), (&key, &LockToken::from("t1"), sha_hex(b"{}")));
    let record = Record::decode(record).unwrap();
    assert_eq!(record.status, 201);
    assert_eq!(record.body, b"{\"id\":7}");
    assert_eq!(
        record.headers,
        vec![("content-type".into(), "application/json".into()), ("location".into(), "/orders/7".into())]
    );
    assert_eq!(s.on_stream_end(), vec![], "committed: nothing left to release");
}

#[test]
fn bare_204_is_committed_at_headers() {
    let (mut s, _) = executing("");
    let mut v = MockView::default();
    v.resp(":status", "204");
    let step = s.on_response_headers(&v, true);
    let [Effect::Store(StoreCall::Commit { record, .. })] = step.effects.as_slice() else { panic!() };
    let record = Record::decode(record).unwrap();
    assert_eq!((record.status, record.headers.len(), record.body.len()), (204, 0, 0));
    assert!(record.print.is_some(), "the record says which request it answers");
}

#[test]
fn every_2xx_is_kept_byte_for_byte_with_how_to_read_it() {
    let body: Vec<u8> = (0..50u8).map(|b| b.wrapping_mul(37)).collect();
    for ct in [Some("text/plain"), Some("application/xml"), Some("application/octet-stream"), None] {
        let (mut s, _) = executing(r#","replay_headers":["location"]"#);
        let mut v = MockView::default();
        v.resp(":status", "201").resp("content-encoding", "gzip").resp("location", "/o/1");
        if let Some(ct) = ct {
            v.resp("content-type", ct);
        }
        assert_eq!(s.on_response_headers(&v, false), Step::go(vec![]), "{ct:?}");
        v.response_chunk = body.clone();
        let step = s.on_response_body(&v, body.len(), true);
        let [Effect::Store(StoreCall::Commit { record, .. })] = &step.effects[..] else { panic!("{ct:?}") };
        let record = Record::decode(record).unwrap();
        assert_eq!((record.status, &record.body), (201, &body));
        let mut expected = vec![("location".to_string(), "/o/1".to_string())];
        if let Some(ct) = ct {
            expected.push(("content-type".into(), ct.into()));
        }
        expected.push(("content-encoding".into(), "gzip".into()));
        assert_eq!(record.headers, expected, "representation headers whatever replay_headers says");
    }
}

#[test]
fn unstorable_responses_release_the_lock() {
    let cases: [&[(&str, &str)]; 7] = [
        &[(":status", "500"), ("content-type", "application/json")],
        &[(":status", "400"), ("content-type", "application/json")],
        &[(":status", "302"), ("location", "/x")],
        &[(":status", "200"), ("content-type", "text/event-stream")],
        &[(":status", "200"), ("content-type", "multipart/x-mixed-replace; boundary=b")],
        &[(":status", "200"), ("content-type", "application/grpc")],
        &[(":status", "200"), ("upgrade", "websocket")],
    ];
    for headers in cases {
        let (mut s, key) = executing("");
        let mut v = MockView::default();
        for (n, val) in headers {
            v.resp(n, val);
        }
        assert_eq!(s.on_response_headers(&v, false), Step::go(release_of(&key)), "{headers:?}");
        assert_eq!(s.on_response_body(&v, 0, true), Step::go(vec![]));
        assert_eq!(s.on_stream_end(), vec![]);
    }
}

/// Found by `fuzz/` (`machine`): a record with more headers, or longer ones, than `decode` takes
/// back was committed, and then every replay of its key failed as store garbage.
#[test]
fn headers_a_record_cannot_hold_release_the_lock() {
    let link = r#","replay_headers":["content-type","location","link"]"#;
    // With content-type and location: 64 headers fit, 65 do not.
    let too_many: Vec<String> = (0..63).map(|i| format!("</{i}>; rel=x")).collect();
    let too_long = "/".repeat(crate::store::record::MAX_HEADER_VALUE + 1);
    let cases: [(&[String], &str, bool); 4] = [
        (&too_many[..62], "/orders/1", true),
        (&too_many, "/orders/1", false),
        (&[], &too_long[1..], true),
        (&[], &too_long, false),
    ];
    for (links, location, stored) in cases {
        let (mut s, key) = executing(link);
        let mut v = MockView::default();
        v.resp(":status", "201").resp("content-type", "application/json").resp("location", location);
        for l in links {
            v.resp("link", l);
        }
        let step = s.on_response_headers(&v, true);
        if stored {
            let [Effect::Store(StoreCall::Commit { record, .. })] = step.effects.as_slice() else {
                panic!("{:?}", step.effects)
            };
            assert_eq!(Record::decode(record).unwrap().headers.len(), 2 + links.len());
        } else {
            assert_eq!(
                step,
                Step::go(release_of(&key)),
                "{} links, location of {}",
                links.len(),
                location.len()
            );
        }

        // The same answer to a detached execution.
        let (mut s, key, _) = detached_locked_with(link);
        let mut headers = vec![
            (":status".to_string(), b"201".to_vec()),
            ("content-type".to_string(), b"application/json".to_vec()),
            ("location".to_string(), location.as_bytes().to_vec()),
        ];
        headers.extend(links.iter().map(|l| ("link".to_string(), l.as_bytes().to_vec())));
        let effects = s.on_upstream_answer(UpstreamAnswer::decode(headers, b"{}".to_vec()));
        if stored {
            assert!(matches!(effects.get(1), Some(Effect::Store(StoreCall::Commit { .. }))), "{effects:?}");
        } else {
            assert_eq!(effects[1..], release_of(&key)[..]);
        }
    }
}

#[test]
fn oversized_answers_are_kept_without_their_body() {
    // Declared too large: nothing of the body is read.
    let (mut s, _) = executing("");
    let mut v = MockView::default();
    v.resp(":status", "201").resp("content-type", "application/json").resp("content-length", "51");
    v.resp("content-encoding", "gzip");
    assert_eq!(s.on_response_headers(&v, false), Step::go(vec![]));
    v.response_chunk = vec![b' '; 51];
    let [Effect::Store(StoreCall::Commit { record, .. })] = &s.on_response_body(&v, 51, true).effects[..]
    else {
        panic!()
    };
    let record = Record::decode(record).unwrap();
    assert!(record.body_omitted && record.body.is_empty());
    assert_eq!(record.status, 201);
    assert!(record.headers.contains(&("content-type".into(), "application/json".into())));

    // Found too large as it streams: what was read is dropped, the record comes at the end.
    let (mut s, _) = executing("");
    let mut v = MockView::default();
    v.resp(":status", "200").resp("content-type", "application/json");
    s.on_response_headers(&v, false);
    v.response_chunk = vec![b' '; 30];
    assert_eq!(s.on_response_body(&v, 30, false), Step::go(vec![]));
    assert_eq!(s.on_response_body(&v, 30, false), Step::go(vec![]), "over max_record_bytes");
    let [Effect::Store(StoreCall::Commit { record, .. })] = &s.on_response_body(&v, 30, true).effects[..]
    else {
        panic!()
    };
    assert!(Record::decode(record).unwrap().body_omitted);

    // `record_too_large: release`: as before, the lock goes back.
    let (mut s, key) = executing(r#","record_too_large":"release""#);
    s.on_response_headers(&v, false);
    assert_eq!(s.on_response_body(&v, 30, false), Step::go(vec![]));
    assert_eq!(s.on_response_body(&v, 30, false), Step::go(release_of(&key)));
    assert_eq!(s.on_response_body(&v, 0, true), Step::go(vec![]));
}

#[test]
fn store_content_types_and_store_statuses_narrow_or_widen_what_is_kept() {
    let json_only = r#","store_content_types":["application/json","+json"]"#;
    for (ct, kept) in [("application/json", true), ("application/problem+json", true), ("text/plain", false)]
    {
        let (mut s, key) = executing(json_only);
        let mut v = MockView::default();
        v.resp(":status", "200").resp("content-type", ct);
        let step = s.on_response_headers(&v, true);
        if kept {
            assert!(matches!(step.effects[..], [Effect::Store(StoreCall::Commit { .. })]), "{ct}");
        } else {
            assert_eq!(step, Step::go(release_of(&key)), "{ct}");
        }
    }
    // No content type: kept when the body is empty, else not.
    let (mut s, key) = executing(json_only);
    let mut v = MockView::default();
    v.resp(":status", "200");
    s.on_response_headers(&v, false);
    v.response_chunk = b"plain".to_vec();
    assert_eq!(s.on_response_body(&v, 5, true), Step::go(release_of(&key)));
    let (mut s, _) = executing(json_only);
    s.on_response_headers(&v, false);
    assert!(matches!(s.on_response_body(&v, 0, true).effects[..], [Effect::Store(StoreCall::Commit { .. })]));

    let with_404 = r#","store_statuses":["2xx","404"]"#;
    for (status, kept) in [("404", true), ("400", false), ("201", true), ("500", false)] {
        let (mut s, key) = executing(with_404);
        let mut v = MockView::default();
        v.resp(":status", status).resp("content-type", "application/json");
        let step = s.on_response_headers(&v, true);
        if kept {
            let [Effect::Store(StoreCall::Commit { record, .. })] = &step.effects[..] else {
                panic!("{status}")
            };
            assert_eq!(Record::decode(record).unwrap().status.to_string(), status);
        } else {
            assert_eq!(step, Step::go(release_of(&key)), "{status}");
        }
    }
}

/// The record a request at `path` (with `extra` headers and `body`) commits after a `201`, and
/// what a retry at `retry_path` (with its own headers and body) is then answered.
fn record_then_retry(
    config: &str,
    first: (&str, &[(&str, &str)], &[u8]),
    retry: (&str, &[(&str, &str)], &[u8]),
) -> (Vec<Effect>, (String, String), (String, String)) {
    let request = |path: &str, headers: &[(&str, &str)], body: &[u8]| {
        let mut v = MockView::post(Some("k1"));
        v.request[1].1 = path.as_bytes().to_vec();
        for (n, val) in headers {
            v.req(n, val);
        }
        v.request_body = body.to_vec();
        v
    };
    let begin = |s: &mut Machine, v: &MockView| {
        s.on_request_headers(v, false);
        begin_call(&s.on_request_body(v, v.request_body.len(), true).effects)
    };
    let mut s = Machine::new(cfg(config));
    let v = request(first.0, first.1, first.2);
    let first_begin = begin(&mut s, &v);
    s.on_begin_answer(Ok(BeginAnswer::Locked { token: "t1".into() }));
    let mut resp = MockView::default();
    resp.resp(":status", "201").resp("content-type", "text/plain");
    let step = s.on_response_headers(&resp, true);
    let [Effect::Store(StoreCall::Commit { record, .. })] = &step.effects[..] else { panic!("{step:?}") };
    let record = Record::decode(record).unwrap();

    let mut s = Machine::new(cfg(config));
    let v = request(retry.0, retry.1, retry.2);
    let retry_begin = begin(&mut s, &v);
    // The store replays by key and body hash; the machine compares the rest.
    let effects = if retry_begin == first_begin {
        s.on_begin_answer(Ok(BeginAnswer::Replay(record)))
    } else {
        s.on_begin_answer(Ok(BeginAnswer::Mismatch))
    };
    (effects, first_begin, retry_begin)
}

fn problem_of(effects: &[Effect]) -> serde_json::Value {
    let Some(Effect::Respond(r)) = effects.first() else { panic!("{effects:?}") };
    serde_json::from_slice(&r.body).unwrap()
}

#[test]
fn another_target_on_the_same_route_is_422_not_a_replay() {
    // One route name for every path: the scope (and so the key) is the same.
    let named = r#""#;
    let (effects, a, b) =
        record_then_retry(named, ("/orders?coupon=A", &[], b"{}"), ("/orders?coupon=B", &[], b"{}"));
    assert_eq!(a, b, "same key and body hash: the store would replay");
    assert_eq!(respond_status(&effects), Some(422));
    assert_eq!(counts(&effects), vec![Metric::Mismatched]);
    assert_eq!(problem_of(&effects)["differs"], "target");
    let (effects, ..) =
        record_then_retry(named, ("/orders?coupon=A", &[], b"{}"), ("/orders?coupon=A", &[], b"{}"));
    assert_eq!(counts(&effects), vec![Metric::Replayed]);
    // A body that differs is the store's mismatch.
    let (effects, ..) = record_then_retry(named, ("/orders", &[], b"{}"), ("/orders", &[], b"{ }"));
    assert_eq!(problem_of(&effects)["differs"], "body");
}

#[test]
fn fingerprinted_headers_must_repeat() {
    let c = r#","fingerprint_headers":["x-tenant","content-type"]"#;
    let t1: &[(&str, &str)] = &[("x-tenant", "t1"), ("content-type", "application/json")];
    let t2: &[(&str, &str)] = &[("x-tenant", "t2"), ("content-type", "application/json")];
    let (effects, ..) = record_then_retry(c, ("/o", t1, b"{}"), ("/o", t1, b"{}"));
    assert_eq!(counts(&effects), vec![Metric::Replayed]);
    let (effects, ..) = record_then_retry(c, ("/o", t1, b"{}"), ("/o", t2, b"{}"));
    let p = problem_of(&effects);
    assert_eq!((p["differs"].as_str(), p["header"].as_str()), (Some("header"), Some("x-tenant")));
    // Not fingerprinted: may differ.
    let (effects, ..) = record_then_retry("", ("/o", t1, b"{}"), ("/o", t2, b"{}"));
    assert_eq!(counts(&effects), vec![Metric::Replayed]);
}

#[test]
fn json_fingerprint_ignores_order_whitespace_and_ignored_members() {
    let c = r#","fingerprint_json":{"canonical":true,"ignore":["/client_sent_at"]}"#;
    let original: &[u8] = br#"{"sku":"a","qty":1,"client_sent_at":"t1"}"#;
    for (retry, replays) in [
        (&br#"{ "qty": 1, "sku": "a", "client_sent_at": "t2" }"#[..], true),
        (br#"{"sku":"a","qty":1}"#, true),
        (br#"{"sku":"a","qty":2,"client_sent_at":"t1"}"#, false),
        (br#"not json"#, false),
    ] {
        let (effects, a, b) = record_then_retry(c, ("/o", &[], original), ("/o", &[], retry));
        assert_eq!(a == b, replays, "{}", String::from_utf8_lossy(retry));
        let expected = if replays { Metric::Replayed } else { Metric::Mismatched };
        assert_eq!(counts(&effects), vec![expected], "{}", String::from_utf8_lossy(retry));
    }
    // Without the option, the bytes count.
    let (effects, ..) = record_then_retry(
        "",
        ("/o", &[], original),
        ("/o", &[], br#"{"qty":1,"sku":"a","client_sent_at":"t1"}"#),
    );
    assert_eq!(counts(&effects), vec![Metric::Mismatched]);
    // A body that is not JSON is compared as its bytes under the option too.
    let (effects, a, _) = record_then_retry(c, ("/o", &[], b"plain"), ("/o", &[], b"plain"));
    assert_eq!(a.1, sha_hex(b"idempotency-raw/v1\nplain"));
    assert_eq!(counts(&effects), vec![Metric::Replayed]);
    let (effects, ..) = record_then_retry(c, ("/o", &[], b"plain"), ("/o", &[], b"plain!"));
    assert_eq!(counts(&effects), vec![Metric::Mismatched]);
}

#[test]
fn in_flight_409_says_how_long_the_lock_lives() {
    for (lock_ms, after) in [(Some(2_500), "3"), (Some(1), "1"), (None, "1"), (Some(3_600_000), "30")] {
        let mut s = Machine::new(cfg(r#","lock_wait_ms":0"#));
        s.on_request_headers(&MockView::post(Some("k")), true);
        let effects = s.on_begin_answer(Ok(BeginAnswer::Busy { lock_ms }));
        let Some(Effect::Respond(r)) = effects.first() else { panic!() };
        assert_eq!(r.status, 409);
        assert!(r.headers.contains(&("retry-after".into(), after.into())), "{lock_ms:?}: {:?}", r.headers);
        assert_eq!(problem_of(&effects)["code"], "request-in-flight");
    }
}

#[test]
fn a_stored_coding_the_retry_does_not_accept_is_406_and_runs_nothing() {
    let gz = Record {
        status: 201,
        headers: vec![
            ("content-type".into(), "text/plain".into()),
            ("content-encoding".into(), "gzip".into()),
        ],
        body: vec![0x1f, 0x8b, 0],
        ..Record::default()
    };
    for (accept, status) in [(Some("gzip"), 201), (None, 406), (Some("br"), 406)] {
        let mut s = Machine::new(cfg(""));
        let mut v = MockView::post(Some("k"));
        if let Some(a) = accept {
            v.req("accept-encoding", a);
        }
        s.on_request_headers(&v, true);
        let effects = s.on_begin_answer(Ok(BeginAnswer::Replay(gz.clone())));
        assert_eq!(respond_status(&effects), Some(status), "{accept:?}");
        assert!(!effects.iter().any(|e| matches!(e, Effect::Resume | Effect::Upstream(_))));
        assert!(s.is_settled());
    }
}

#[test]
fn response_trailers_end_the_capture() {
    let (mut s, _) = executing("");
    let mut v = MockView::default();
    v.resp(":status", "200").resp("content-type", "application/json");
    s.on_response_headers(&v, false);
    v.response_chunk = b"{}".to_vec();
    s.on_response_body(&v, 2, false);
    let step = s.on_response_trailers();
    assert!(matches!(step.effects.as_slice(), [Effect::Store(StoreCall::Commit { .. })]));
}

#[test]
fn reset_or_client_gone_releases_the_lock() {
    let (mut s, key) = executing("");
    assert_eq!(s.on_stream_end(), release_of(&key), "upstream reset before any response");

    let (mut s, key) = executing("");
    let mut v = MockView::default();
    v.resp(":status", "200").resp("content-type", "application/json");
    s.on_response_headers(&v, false);
    assert_eq!(s.on_stream_end(), release_of(&key), "client gone mid-response");
    assert_eq!(s.on_stream_end(), vec![]);
}

#[test]
fn stream_ending_while_begin_is_pending_releases_a_late_lock() {
    let mut s = Machine::new(cfg(""));
    let key = begin_call(&s.on_request_headers(&MockView::post(Some("k")), true).effects).0;
    assert_eq!(s.on_stream_end(), vec![]);
    assert!(!s.is_settled(), "the entry must outlive the stream until begin answers");
    let effects = s.on_begin_answer(Ok(BeginAnswer::Locked { token: "t1".into() }));
    assert_eq!(effects, release_of(&key), "no Resume for a stream that is gone");
    assert!(s.is_settled());

    for answer in
        [Ok(BeginAnswer::Busy { lock_ms: None }), Ok(BeginAnswer::Mismatch), Err(CalloutFault::Timeout)]
    {
        let mut s = Machine::new(cfg(""));
        s.on_request_headers(&MockView::post(Some("k")), true);
        s.on_stream_end();
        assert_eq!(s.on_begin_answer(answer), vec![]);
        assert!(s.is_settled());
    }
}

#[test]
fn envoy_answering_while_begin_is_pending_orphans_the_call() {
    // E.g. the stream idle timeout fires while the store holds `begin`: Envoy sends a 504 local
    // reply through this filter; the request never reaches the upstream.
    let mut s = Machine::new(cfg(""));
    let key = begin_call(&s.on_request_headers(&MockView::post(Some("k")), true).effects).0;
    let mut v = MockView::default();
    v.resp(":status", "504");
    assert_eq!(s.on_response_headers(&v, true), Step::go(vec![]));
    assert_eq!(s.on_begin_answer(Ok(BeginAnswer::Locked { token: "t1".into() })), release_of(&key));
}

/// Random event sequences through the shared driver ([`crate::sim::request`]), which checks after every
/// event that the machine never answers twice, never resumes after answering, and that every lock
/// it is handed ends in exactly one commit or release. `fuzz/` runs the same driver for longer.
#[test]
fn random_event_sequences_keep_the_invariants() {
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut seen = Tally::default();
    for _ in 0..5000 {
        let mut v = MockView::post(if next(5) == 0 { None } else { Some("k") });
        v.prop("xds.cluster_name", "app");
        v.request_body = vec![b'x'; 120];
        let configs = [
            r#""#,
            r#","failure_mode":"closed""#,
            DETACHED,
            r#","fingerprint_json":{"ignore":["/a"]},"store_statuses":["2xx","404"],"fingerprint_headers":["x-t"]"#,
            r#","record_too_large":"release","store_content_types":["application/json"]"#,
        ];
        let mut d = Driver::new(cfg(configs[next(5) as usize]), v);
        for _ in 0..12 {
            let event = match next(10) {
                0 => Event::RequestHeaders { end_of_stream: next(2) == 0 },
                1 => Event::RequestBody { buffered: next(121) as usize, end_of_stream: next(2) == 0 },
                2 => Event::RequestTrailers,
                3 => Event::BeginAnswer(match next(8) {
                    0 => Ok(BeginAnswer::Busy { lock_ms: [None, Some(1), Some(90_000)][next(3) as usize] }),
                    1 => Ok(BeginAnswer::Mismatch),
                    2 => Ok(BeginAnswer::Replay(Record::status_only(200))),
                    3 => Err(CalloutFault::Reset),
                    4 => Ok(BeginAnswer::Replay(Record {
                        status: 404,
                        headers: vec![("content-encoding".into(), "gzip".into())],
                        body: b"x".to_vec(),
                        body_omitted: false,
                        print: Some(crate::store::record::RequestPrint {
                            target: [next(2) as u8; 32],
                            headers: vec![],
                        }),
                    })),
                    _ => Ok(BeginAnswer::Locked { token: "".into() }),
                }),
                4 | 5 => {
                    let mut headers = vec![(
                        ":status".to_string(),
                        ["200", "201", "204", "500", "302", "404"][next(6) as usize].as_bytes().to_vec(),
                    )];
                    if let Some(ct) =
                        [Some("application/json"), Some("text/plain"), Some("text/event-stream"), None]
                            [next(4) as usize]
                    {
                        headers.push(("content-type".into(), ct.as_bytes().to_vec()));
                    }
                    if next(4) == 0 {
                        headers.push(("content-length".into(), next(80).to_string().into_bytes()));
                    }
                    Event::ResponseHeaders { headers, end_of_stream: next(3) == 0 }
                }
                6 | 7 => {
                    Event::ResponseBody { chunk: vec![b'y'; next(41) as usize], end_of_stream: next(3) == 0 }
                }
                8 => Event::ResponseTrailers,
                9 if next(2) == 0 => Event::UpstreamAnswer(if next(4) == 0 {
                    Err(CalloutFault::Timeout)
                } else {
                    Ok(answer(["201", "500"][next(2) as usize], None, b""))
                }),
                _ => Event::StreamEnd,
            };
            if let Err(e) = d.step(event) {
                panic!("{e}");
            }
        }
        if let Err(e) = d.finish() {
            panic!("{e}");
        }
        let t = d.tally;
        for (sum, n) in [
            (&mut seen.responds, t.responds),
            (&mut seen.resumes, t.resumes),
            (&mut seen.upstreams, t.upstreams),
            (&mut seen.begins, t.begins),
            (&mut seen.commits, t.commits),
            (&mut seen.releases, t.releases),
        ] {
            *sum += n;
        }
    }
    // The sample reaches every path, so the invariants above were checked on each.
    assert!(
        [seen.responds, seen.resumes, seen.upstreams, seen.begins, seen.commits, seen.releases]
            .iter()
            .all(|&n| n >= 20),
        "{seen:?}"
    );
}

const DETACHED: &str = r#","detached_execution":true,"store_key_header":"x-store-key""#;

/// A detached stream that has taken the lock: returns the stream, the store key and the call.
fn detached_locked() -> (Machine, String, UpstreamCall) {
    detached_locked_with("")
}

fn detached_locked_with(extra: &str) -> (Machine, String, UpstreamCall) {
    let mut s = Machine::new(cfg(&format!("{DETACHED}{extra}")));
    let mut v = MockView::post(Some("k1"));
    v.req("x-request-id", "rid-1").req("content-length", "2").req("x-store-key", "forged");
    v.prop("xds.cluster_name", "app");
    v.request_body = b"{}".to_vec();
    let step = s.on_request_headers(&v, false);
    let key = begin_call(&s.on_request_body(&v, 2, true).effects).0;
    assert!(step.effects.contains(&Effect::SetRequestHeader("x-store-key".into(), key.clone())));
    let effects = s.on_begin_answer(Ok(BeginAnswer::Locked { token: "t1".into() }));
    let [Effect::Upstream(call), Effect::Count(Metric::Executed), Effect::Count(Metric::Detached)] =
        effects.as_slice()
    else {
        panic!("{effects:?}")
    };
    (s, key, call.clone())
}

fn answer(status: &str, content_type: Option<&str>, body: &[u8]) -> UpstreamAnswer {
    let mut headers = vec![(":status".to_string(), status.as_bytes().to_vec())];
    if let Some(ct) = content_type {
        headers.push(("content-type".into(), ct.as_bytes().to_vec()));
    }
    headers.push(("location".into(), b"/orders/9".to_vec()));
    UpstreamAnswer::decode(headers, body.to_vec()).unwrap()
}

#[test]
fn detached_execution_sends_the_request_itself() {
    let (s, key, call) = detached_locked();
    assert_eq!(call.cluster, "app");
    assert_eq!(call.body, b"{}");
    assert_eq!(call.timeout_ms, 15_000);
    let get =
        |n: &str| call.headers.iter().filter(|(h, _)| h == n).map(|(_, v)| v.as_str()).collect::<Vec<_>>();
    assert_eq!(get(":method"), ["POST"]);
    assert_eq!(get(":path"), ["/orders?x=1"]);
    assert_eq!(get("x-request-id"), ["rid-1"]);
    assert_eq!(get("x-store-key"), [key.as_str()], "the client's value is replaced");
    assert!(get("content-length").is_empty(), "framing is the callout's own");
    assert!(!s.is_settled(), "the answer is still to come");
}

#[test]
fn detached_answer_goes_to_the_client_and_the_store() {
    let (mut s, key, _) = detached_locked();
    let effects = s.on_upstream_answer(Ok(answer("201", Some("application/json"), b"{\"id\":9}")));
    let [Effect::Respond(r), Effect::Store(StoreCall::Commit { key: k, record, .. })] = effects.as_slice()
    else {
        panic!("{effects:?}")
    };
    assert_eq!((r.status, r.body.as_slice()), (201, b"{\"id\":9}".as_slice()));
    assert!(r.headers.contains(&("location".into(), "/orders/9".into())));
    assert_eq!(k, &key);
    let record = Record::decode(record).unwrap();
    assert_eq!(record.status, 201);
    assert!(s.is_settled());
    // The local reply passes through the filter again: nothing happens.
    let mut v = MockView::default();
    v.resp(":status", "201").resp("content-type", "application/json");
    assert_eq!(s.on_response_headers(&v, true), Step::go(vec![]));
    assert_eq!(s.on_stream_end(), vec![]);
}

#[test]
fn detached_answer_after_the_client_left_is_still_committed() {
    let (mut s, _, _) = detached_locked();
    assert_eq!(s.on_stream_end(), vec![], "the call goes on");
    assert!(!s.is_settled());
    let effects = s.on_upstream_answer(Ok(answer("200", Some("application/json"), b"{}")));
    assert!(matches!(
        effects.as_slice(),
        [Effect::Store(StoreCall::Commit { .. }), Effect::Count(Metric::CommittedAfterGone)]
    ));
    assert!(s.is_settled());
}

#[test]
fn detached_failures_release_the_lock() {
    let (mut s, key, _) = detached_locked();
    let effects = s.on_upstream_answer(Ok(answer("500", Some("application/json"), b"{}")));
    assert_eq!(respond_status(&effects), Some(500));
    assert_eq!(effects[1..], release_of(&key)[..]);

    let (mut s, key, _) = detached_locked();
    let effects = s.on_upstream_answer(Ok(answer("200", Some("text/event-stream"), b"data: hi\n\n")));
    assert_eq!(respond_status(&effects), Some(200));
    assert_eq!(effects[1..], release_of(&key)[..]);

    // Not a failure: a text answer is kept, and one too large without its body.
    let (mut s, _, _) = detached_locked();
    let effects = s.on_upstream_answer(Ok(answer("200", Some("text/plain"), b"hi")));
    let [_, Effect::Store(StoreCall::Commit { record, .. })] = &effects[..] else { panic!("{effects:?}") };
    assert_eq!(Record::decode(record).unwrap().body, b"hi");
    let (mut s, _, _) = detached_locked();
    let effects = s.on_upstream_answer(Ok(answer("200", Some("text/plain"), &[b'x'; 51])));
    let [_, Effect::Store(StoreCall::Commit { record, .. })] = &effects[..] else { panic!("{effects:?}") };
    assert!(Record::decode(record).unwrap().body_omitted);

    let (mut s, key, _) = detached_locked();
    let effects = s.on_upstream_answer(Err(CalloutFault::Reset));
    assert_eq!(respond_status(&effects), Some(502));
    assert_eq!(effects[1..], release_of(&key)[..]);

    let (mut s, key, _) = detached_locked();
    let effects = s.on_upstream_answer(Err(CalloutFault::Timeout));
    assert_eq!(respond_status(&effects), Some(504));
    assert_eq!(effects[1..], release_of(&key)[..]);

    let (mut s, key, _) = detached_locked();
    s.on_stream_end();
    assert_eq!(s.on_upstream_answer(Err(CalloutFault::Reset)), release_of(&key));
}

#[test]
fn without_a_cluster_the_request_is_routed_normally() {
    let mut s = Machine::new(cfg(DETACHED));
    s.on_request_headers(&MockView::post(Some("k")), true);
    let effects = s.on_begin_answer(Ok(BeginAnswer::Locked { token: "t".into() }));
    assert_eq!(effects, vec![Effect::Resume, Effect::Count(Metric::Executed)]);
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

// ---- inbox mode ------------------------------------------------------------------------------

const INBOX: &str = r#","mode":"inbox""#;
const INBOX_PASS: &str = r#","mode":"inbox","inbox":{"missing_id":"pass"}"#;
const PUBSUB: &str = r#","mode":"inbox","inbox":{"message_id":{"json_pointer":"/message/messageId"}}"#;

/// A binary-mode CloudEvent (`ce-id`, `ce-source`), from `127.0.0.1:40000`.
fn binary_event(id: &str, source: &str) -> MockView {
    let mut v = MockView::post(None);
    v.req("ce-id", id).req("ce-source", source).req("ce-type", "com.example.order");
    v
}

/// A structured-mode CloudEvent with `body`.
fn structured_event(body: &[u8]) -> MockView {
    let mut v = MockView::post(None);
    v.req("content-type", "application/cloudevents+json; charset=utf-8");
    v.request_body = body.to_vec();
    v
}

fn inbox_key_of(source: &[u8], id: &[u8]) -> String {
    let mut subject = b"inbox:".to_vec();
    subject.extend_from_slice(source);
    crate::request::key::store_key_bytes(&subject, "POST", "/orders", id)
}

/// An inbox stream (binary event `e1` from `/src`) that has taken the lock `t1`.
fn inbox_executing(extra: &str) -> (Machine, String) {
    let mut s = Machine::new(cfg(extra));
    let step = s.on_request_headers(&binary_event("e1", "/src"), true);
    let (key, _) = begin_call(&step.effects);
    let effects = s.on_begin_answer(Ok(BeginAnswer::Locked { token: "t1".into() }));
    assert_eq!(effects, vec![Effect::Resume, Effect::Count(Metric::Executed)]);
    (s, key)
}

fn committed_record(effects: &[Effect]) -> Record {
    let [Effect::Store(StoreCall::Commit { record, .. })] = effects else { panic!("{effects:?}") };
    Record::decode(record).unwrap()
}

#[test]
fn inbox_binary_event_is_keyed_by_source_and_id_not_the_client() {
    let key_for = |v: &MockView| {
        let mut s = Machine::new(cfg(INBOX));
        let step = s.on_request_headers(v, true);
        assert_eq!(step.action, Action::Pause);
        assert_eq!(counts(&step.effects), vec![Metric::Guarded]);
        let (key, hash) = begin_call(&step.effects);
        assert_eq!(hash, INBOX_BODY_HASH.to_string());
        key
    };
    let k = key_for(&binary_event("e1", "/src"));
    assert_eq!(k, inbox_key_of(b"/src", b"e1"));
    // Another broker replica (another address), an Idempotency-Key: the same message.
    let mut other = binary_event("e1", "/src");
    other.prop("source.address", "10.1.2.3:5555").req("idempotency-key", "whatever");
    assert_eq!(key_for(&other), k);
    assert_ne!(key_for(&binary_event("e1", "/other")), k, "the source scopes the id");
    assert_ne!(key_for(&binary_event("e2", "/src")), k);
    let mut routed = binary_event("e1", "/src");
    routed.prop("xds.route_name", "billing");
    assert_ne!(key_for(&routed), k, "each subscriber route handles an event once");
    // Without ce-id the Idempotency-Key is not a fallback.
    let mut s = Machine::new(cfg(INBOX));
    let step = s.on_request_headers(&MockView::post(Some("k")), true);
    assert_eq!(respond_status(&step.effects), Some(400));
}

#[test]
fn inbox_body_is_not_hashed_and_bodies_may_differ() {
    let hash_for = |body: &[u8]| {
        let mut s = Machine::new(cfg(INBOX));
        let mut v = binary_event("e1", "/src");
        v.request_body = body.to_vec();
        s.on_request_headers(&v, false);
        begin_call(&s.on_request_body(&v, body.len(), true).effects)
    };
    assert_eq!(hash_for(b"{\"a\":1}"), hash_for(b"{\"a\":2}"));
}

#[test]
fn inbox_structured_event_is_read_from_the_body() {
    let body = br#"{"specversion":"1.0","id":"e1","source":"/src","type":"t","data":{"n":1}}"#;
    let v = structured_event(body);
    let mut s = Machine::new(cfg(INBOX));
    assert_eq!(s.on_request_headers(&v, false), Step::pause(vec![]));
    assert_eq!(s.store_key(), None);
    assert!(s.awaits_key());
    assert_eq!(s.on_request_body(&v, 10, false), Step::pause(vec![]));
    let step = s.on_request_body(&v, body.len(), true);
    assert_eq!(step.action, Action::Pause);
    assert_eq!(counts(&step.effects), vec![Metric::Guarded]);
    assert_eq!(begin_call(&step.effects), (inbox_key_of(b"/src", b"e1"), INBOX_BODY_HASH.to_string()));
    assert!(!s.awaits_key());
    // Binary and structured deliveries of one event are one message.
    let mut s = Machine::new(cfg(INBOX));
    assert_eq!(
        begin_call(&s.on_request_headers(&binary_event("e1", "/src"), true).effects).0,
        inbox_key_of(b"/src", b"e1")
    );
    // Trailers end the body too.
    let mut s = Machine::new(cfg(INBOX));
    s.on_request_headers(&v, false);
    s.on_request_body(&v, body.len(), false);
    assert_eq!(begin_call(&s.on_request_trailers().effects).0, inbox_key_of(b"/src", b"e1"));
}

#[test]
fn inbox_pubsub_redeliveries_are_one_message() {
    let key_for = |attempt: u32| {
        let body = format!(
            r#"{{"message":{{"data":"e30=","messageId":"m-42"}},"subscription":"s","deliveryAttempt":{attempt}}}"#
        );
        let mut v = MockView::post(None);
        v.req("content-type", "application/json");
        v.request_body = body.clone().into_bytes();
        let mut s = Machine::new(cfg(PUBSUB));
        s.on_request_headers(&v, false);
        begin_call(&s.on_request_body(&v, body.len(), true).effects)
    };
    assert_eq!(key_for(1), key_for(2));
    assert_eq!(key_for(1).0, inbox_key_of(b"", b"m-42"));
}

#[test]
fn inbox_missing_id_is_rejected_or_passed() {
    // At headers.
    let mut s = Machine::new(cfg(INBOX));
    let step = s.on_request_headers(&MockView::post(None), false);
    assert_eq!(respond_status(&step.effects), Some(400));
    assert_eq!(counts(&step.effects), vec![Metric::Rejected]);
    let Some(Effect::Respond(r)) = step.effects.first() else { panic!() };
    assert!(String::from_utf8_lossy(&r.body).contains("missing-message-id"));
    let mut s = Machine::new(cfg(INBOX_PASS));
    assert_eq!(
        s.on_request_headers(&MockView::post(None), false),
        Step::go(vec![Effect::Count(Metric::Passthrough)])
    );
    assert!(s.is_settled());
    // In the body: decided at its end; `pass` lets the held request go on.
    for body in [&b"not json"[..], br#"{"id":"e1"}"#, b""] {
        let v = structured_event(body);
        let mut s = Machine::new(cfg(INBOX));
        s.on_request_headers(&v, false);
        let step = s.on_request_body(&v, body.len(), true);
        assert_eq!(respond_status(&step.effects), Some(400), "{body:?}");
        assert_eq!(step.action, Action::Pause);
        let mut s = Machine::new(cfg(INBOX_PASS));
        s.on_request_headers(&v, false);
        assert_eq!(
            s.on_request_body(&v, body.len(), true),
            Step::go(vec![Effect::Count(Metric::Passthrough)])
        );
        assert_eq!(s.on_stream_end(), vec![]);
    }
    // A structured event without a body ends at its headers.
    let mut s = Machine::new(cfg(INBOX_PASS));
    assert_eq!(
        s.on_request_headers(&structured_event(b""), true),
        Step::go(vec![Effect::Count(Metric::Passthrough)])
    );
    // A batch is not supported: a missing id.
    let mut v = binary_event("e1", "/src");
    v.req("content-type", "application/cloudevents-batch+json");
    assert_eq!(respond_status(&Machine::new(cfg(INBOX)).on_request_headers(&v, false).effects), Some(400));
}

#[test]
fn inbox_malformed_ids_get_400_even_with_pass() {
    let long = "x".repeat(256);
    for v in [binary_event("", "/src"), binary_event(&long, "/src"), {
        let mut v = binary_event("a", "/src");
        v.req("ce-id", "b");
        v
    }] {
        let mut s = Machine::new(cfg(INBOX_PASS));
        let step = s.on_request_headers(&v, false);
        assert_eq!(respond_status(&step.effects), Some(400));
        let Some(Effect::Respond(r)) = step.effects.first() else { panic!() };
        let text = String::from_utf8_lossy(&r.body);
        assert!(text.contains("invalid-message-id") && !text.contains(&long), "{text}");
    }
    let body = br#"{"id":17,"source":"/src"}"#;
    let v = structured_event(body);
    let mut s = Machine::new(cfg(INBOX_PASS));
    s.on_request_headers(&v, false);
    assert_eq!(respond_status(&s.on_request_body(&v, body.len(), true).effects), Some(400));
}

#[test]
fn inbox_oversized_bodies_get_413() {
    let v = structured_event(&[b' '; 101]);
    let mut s = Machine::new(cfg(INBOX));
    s.on_request_headers(&v, false);
    assert_eq!(respond_status(&s.on_request_body(&v, 101, false).effects), Some(413));
    let mut v = structured_event(b"{}");
    v.req("content-length", "101");
    assert_eq!(respond_status(&Machine::new(cfg(INBOX)).on_request_headers(&v, false).effects), Some(413));
}

#[test]
fn inbox_any_2xx_marks_the_message_handled() {
    // A JSON 2xx is kept whole, as in Idempotency-Key mode.
    let (mut s, _) = inbox_executing(INBOX);
    let mut v = MockView::default();
    v.resp(":status", "201").resp("content-type", "application/json").resp("location", "/o/1");
    assert_eq!(s.on_response_headers(&v, false), Step::go(vec![]));
    v.response_chunk = b"{}".to_vec();
    let r = committed_record(&s.on_response_body(&v, 2, true).effects);
    assert_eq!((r.status, r.body.as_slice()), (201, b"{}".as_slice()));
    assert_eq!(
        r.headers,
        vec![("content-type".into(), "application/json".into()), ("location".into(), "/o/1".into())]
    );
    assert_eq!(r.print, None, "the message id is the identity");
    // A stream 200 is stored as its status alone, at once.
    let (mut s, _) = inbox_executing(INBOX);
    let mut v = MockView::default();
    v.resp(":status", "200").resp("content-type", "text/event-stream");
    let step = s.on_response_headers(&v, false);
    assert_eq!(committed_record(&step.effects), Record::status_only(200));
    assert!(s.is_settled());
    // An untyped body is kept whole; one over max_record_bytes (50) as its status, at its end.
    let (mut s, _) = inbox_executing(INBOX);
    let mut v = MockView::default();
    v.resp(":status", "202");
    s.on_response_headers(&v, false);
    v.response_chunk = b"accepted".to_vec();
    let r = committed_record(&s.on_response_body(&v, 8, true).effects);
    assert_eq!((r.status, r.body.as_slice()), (202, b"accepted".as_slice()));
    let (mut s, _) = inbox_executing(INBOX);
    let mut v = MockView::default();
    v.resp(":status", "200").resp("content-type", "application/json");
    s.on_response_headers(&v, false);
    v.response_chunk = vec![b' '; 51];
    let r = committed_record(&s.on_response_body(&v, 51, false).effects);
    assert_eq!((r.status, r.body.len()), (200, 0));
    // Anything else gives the message back for the broker's redelivery.
    for status in ["500", "404", "302", "429"] {
        let (mut s, key) = inbox_executing(INBOX);
        let mut v = MockView::default();
        v.resp(":status", status).resp("content-type", "application/json");
        assert_eq!(s.on_response_headers(&v, false), Step::go(release_of(&key)), "{status}");
    }
    let (mut s, key) = inbox_executing(INBOX);
    assert_eq!(s.on_stream_end(), release_of(&key));
}

#[test]
fn inbox_duplicates_replay_or_get_the_configured_status() {
    let record = Record {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: b"{\"ok\":true}".to_vec(),
        ..Record::default()
    };
    let mut s = Machine::new(cfg(INBOX));
    s.on_request_headers(&binary_event("e1", "/src"), true);
    let effects = s.on_begin_answer(Ok(BeginAnswer::Replay(record.clone())));
    let [Effect::Respond(r), Effect::Count(Metric::Replayed)] = effects.as_slice() else {
        panic!("{effects:?}")
    };
    assert_eq!((r.status, r.body.as_slice()), (201, record.body.as_slice()));
    assert!(r.headers.contains(&("x-idempotent-replay".into(), "true".into())));

    let ds = r#","mode":"inbox","inbox":{"duplicate_status":200}"#;
    let mut s = Machine::new(cfg(ds));
    s.on_request_headers(&binary_event("e1", "/src"), true);
    let effects = s.on_begin_answer(Ok(BeginAnswer::Replay(record)));
    let [Effect::Respond(r), Effect::Count(Metric::Replayed)] = effects.as_slice() else {
        panic!("{effects:?}")
    };
    assert_eq!(
        r,
        &LocalResponse {
            status: 200,
            headers: vec![("x-idempotent-replay".into(), "true".into())],
            body: vec![]
        }
    );
    // With duplicate_status, the record is the status alone, committed at the response headers.
    let (mut s, _) = inbox_executing(ds);
    let mut v = MockView::default();
    v.resp(":status", "201").resp("content-type", "application/json");
    assert_eq!(committed_record(&s.on_response_headers(&v, false).effects).body, b"");

    // In flight after the wait: 409 in the inbox's words.
    let mut s = Machine::new(cfg(INBOX));
    s.on_request_headers(&binary_event("e1", "/src"), true);
    let effects = s.on_begin_answer(Ok(BeginAnswer::Busy { lock_ms: None }));
    let [Effect::Respond(r), Effect::Count(Metric::Conflicted)] = effects.as_slice() else {
        panic!("{effects:?}")
    };
    assert_eq!(r.status, 409);
    assert!(String::from_utf8_lossy(&r.body).contains("message-in-flight"));
}

#[test]
fn inbox_store_key_header_and_detached_execution_follow_a_body_id() {
    let extra = r#","mode":"inbox","detached_execution":true,"store_key_header":"x-store-key""#;
    let body = br#"{"id":"e1","source":"/src"}"#;
    let mut v = structured_event(body);
    v.req("x-store-key", "forged");
    v.prop("xds.cluster_name", "app");
    let mut s = Machine::new(cfg(extra));
    let step = s.on_request_headers(&v, false);
    assert_eq!(step.effects, vec![Effect::RemoveRequestHeader("x-store-key".into())]);
    let step = s.on_request_body(&v, body.len(), true);
    let key = inbox_key_of(b"/src", b"e1");
    assert!(step.effects.contains(&Effect::SetRequestHeader("x-store-key".into(), key.clone())));
    let effects = s.on_begin_answer(Ok(BeginAnswer::Locked { token: "t1".into() }));
    let [Effect::Upstream(call), ..] = effects.as_slice() else { panic!("{effects:?}") };
    assert_eq!(call.body, body);
    let sent: Vec<&str> =
        call.headers.iter().filter(|(n, _)| n == "x-store-key").map(|(_, v)| v.as_str()).collect();
    assert_eq!(sent, [key.as_str()]);
    // A detached text/plain 200 is committed as its status.
    let effects = s.on_upstream_answer(Ok(answer("200", Some("text/plain"), b"ok")));
    assert_eq!(respond_status(&effects), Some(200));
    assert_eq!(committed_record(&effects[1..]).status, 200);
}

#[test]
fn inbox_random_event_sequences_keep_the_invariants() {
    let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let configs = [
        INBOX,
        INBOX_PASS,
        PUBSUB,
        r#","mode":"inbox","inbox":{"duplicate_status":204},"detached_execution":true"#,
    ];
    let bodies: [&[u8]; 4] =
        [br#"{"id":"e1","source":"/s"}"#, br#"{"message":{"messageId":"m"}}"#, b"junk", b""];
    let mut seen = Tally::default();
    for _ in 0..8000 {
        let body = bodies[next(4) as usize];
        let mut v = match next(3) {
            0 => binary_event("e1", "/s"),
            1 => structured_event(body),
            _ => MockView::post(None),
        };
        v.prop("xds.cluster_name", "app");
        v.request_body = body.to_vec();
        let mut d = Driver::new(cfg(configs[next(4) as usize]), v);
        for _ in 0..12 {
            let event = match next(9) {
                0 => Event::RequestHeaders { end_of_stream: next(3) == 0 },
                1 => Event::RequestBody {
                    buffered: next(body.len() as u64 + 1) as usize,
                    end_of_stream: next(2) == 0,
                },
                2 => Event::RequestTrailers,
                3 => Event::BeginAnswer(match next(7) {
                    0 => Ok(BeginAnswer::Busy { lock_ms: None }),
                    1 => Ok(BeginAnswer::Replay(Record::status_only(200))),
                    2 => Err(CalloutFault::Reset),
                    _ => Ok(BeginAnswer::Locked { token: "".into() }),
                }),
                4 => {
                    let mut headers = vec![(
                        ":status".to_string(),
                        ["200", "201", "500", "204"][next(4) as usize].as_bytes().to_vec(),
                    )];
                    match next(3) {
                        0 => headers.push(("content-type".into(), b"application/json".to_vec())),
                        1 => headers.push(("content-type".into(), b"text/plain".to_vec())),
                        _ => {}
                    }
                    Event::ResponseHeaders { headers, end_of_stream: next(3) == 0 }
                }
                5 | 6 => {
                    Event::ResponseBody { chunk: vec![b'y'; next(61) as usize], end_of_stream: next(3) == 0 }
                }
                7 if next(2) == 0 => Event::UpstreamAnswer(Ok(answer(
                    ["200", "500"][next(2) as usize],
                    Some("text/plain"),
                    b"x",
                ))),
                _ => Event::StreamEnd,
            };
            if let Err(e) = d.step(event) {
                panic!("{e}");
            }
        }
        if let Err(e) = d.finish() {
            panic!("{e}");
        }
        let t = d.tally;
        seen.responds += t.responds;
        seen.resumes += t.resumes;
        seen.begins += t.begins;
        seen.commits += t.commits;
        seen.releases += t.releases;
    }
    assert!(
        [seen.responds, seen.resumes, seen.begins, seen.commits, seen.releases].iter().all(|&n| n >= 20),
        "{seen:?}"
    );
}
