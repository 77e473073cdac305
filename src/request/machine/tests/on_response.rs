//! The answer's phase: what is kept and committed, what releases the lock, streams that end early.

use super::detached::detached_locked_with;
use super::*;

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
    let [Effect::Store(StoreCall::Commit { key: k, token, body_hash, record, .. })] = step.effects.as_slice()
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
    assert_eq!(s.on_stream_end(&MockView::default()), vec![], "committed: nothing left to release");
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
        assert_eq!(s.on_stream_end(&MockView::default()), vec![]);
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
        let effects = s.on_upstream_answer(UpstreamAnswer::decode(headers, b"{}".to_vec()), None);
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

#[test]
fn response_trailers_end_the_capture() {
    let (mut s, _) = executing("");
    let mut v = MockView::default();
    v.resp(":status", "200").resp("content-type", "application/json");
    s.on_response_headers(&v, false);
    v.response_chunk = b"{}".to_vec();
    s.on_response_body(&v, 2, false);
    let step = s.on_response_trailers(&v);
    assert!(matches!(step.effects.as_slice(), [Effect::Store(StoreCall::Commit { .. })]));
}

#[test]
fn client_gone_or_an_answer_cut_leaves_the_key_in_doubt() {
    let (mut s, key) = executing("");
    assert_eq!(s.on_stream_end(&MockView::default()), in_doubt_of(&key), "client gone before any response");

    let (mut s, key) = executing("");
    let mut v = MockView::default();
    v.resp(":status", "200").resp("content-type", "application/json");
    s.on_response_headers(&v, false);
    assert_eq!(s.on_stream_end(&MockView::default()), in_doubt_of(&key), "answer cut mid-body");
    assert_eq!(s.on_stream_end(&MockView::default()), vec![]);

    // `run_again`: released, as before.
    let (mut s, key) = executing(r#","unknown_outcome":"run_again""#);
    assert_eq!(s.on_stream_end(&MockView::default()), release_of(&key));
}

#[test]
fn stream_ending_while_begin_is_pending_releases_a_late_lock() {
    let mut s = Machine::new(cfg(""));
    let key = begin_call(&s.on_request_headers(&MockView::post(Some("k")), true).effects).0;
    assert_eq!(s.on_stream_end(&MockView::default()), vec![]);
    assert!(!s.is_settled(), "the entry must outlive the stream until begin answers");
    let effects = s.on_begin_answer(Ok(BeginAnswer::Locked { token: "t1".into() }));
    assert_eq!(effects, release_of(&key), "no Resume for a stream that is gone");
    assert!(s.is_settled());

    for answer in
        [Ok(BeginAnswer::Busy { lock_ms: None }), Ok(BeginAnswer::Mismatch), Err(CalloutFault::Timeout)]
    {
        let mut s = Machine::new(cfg(""));
        s.on_request_headers(&MockView::post(Some("k")), true);
        s.on_stream_end(&MockView::default());
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
