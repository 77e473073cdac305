//! Inbox mode: messages keyed by their id.

use super::*;

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
    let Some(r) = answered(&step.effects) else { panic!() };
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
        assert_eq!(s.on_stream_end(&MockView::default()), vec![]);
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
        let Some(r) = answered(&step.effects) else { panic!() };
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
    // A delivery whose answer was lost (the broker gave up on it): in doubt, as any route's.
    let (mut s, key) = inbox_executing(INBOX);
    assert_eq!(s.on_stream_end(&MockView::default()), in_doubt_of(&key));
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
    let [Effect::Refuse(p), Effect::Count(Metric::Conflicted)] = effects.as_slice() else {
        panic!("{effects:?}")
    };
    assert_eq!((p.code, p.status), (Code::MessageInFlight, Some(409)));
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
    let effects = s.on_upstream_answer(Ok(answer("200", Some("text/plain"), b"ok")), None);
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
                    Event::ResponseHeaders { headers, details: None, end_of_stream: next(3) == 0 }
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
