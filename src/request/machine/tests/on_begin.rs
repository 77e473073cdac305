//! The answer to `begin`: replays, `422` (another body, target or fingerprinted header), `409`,
//! `406`, a lock to run under, store faults.

use super::*;

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
        assert_eq!(s.on_stream_end(&MockView::default()), vec![]);

        let mut s = Machine::new(cfg(r#","failure_mode":"closed""#));
        s.on_request_headers(&MockView::post(Some("k")), true);
        let effects = s.on_begin_answer(Err(fault));
        assert_eq!(respond_status(&effects), Some(503));
        assert_eq!(counts(&effects), vec![Metric::Degraded, Metric::Unavailable]);
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
    let Some(r) = answered(effects) else { panic!("{effects:?}") };
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
        let Some(r) = answered(&effects) else { panic!() };
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
