//! Detached execution: the filter sends the locked request itself.

use super::*;

/// A detached stream that has taken the lock: returns the stream, the store key and the call.
fn detached_locked() -> (Machine, String, UpstreamCall) {
    detached_locked_with("")
}

pub(super) fn detached_locked_with(extra: &str) -> (Machine, String, UpstreamCall) {
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
    let effects = s.on_upstream_answer(Ok(answer("201", Some("application/json"), b"{\"id\":9}")), None);
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
    assert_eq!(s.on_stream_end(&MockView::default()), vec![]);
}

#[test]
fn detached_answer_after_the_client_left_is_still_committed() {
    let (mut s, _, _) = detached_locked();
    assert_eq!(s.on_stream_end(&MockView::default()), vec![], "the call goes on");
    assert!(!s.is_settled());
    let effects = s.on_upstream_answer(Ok(answer("200", Some("application/json"), b"{}")), None);
    assert!(matches!(
        effects.as_slice(),
        [Effect::Store(StoreCall::Commit { .. }), Effect::Count(Metric::CommittedAfterGone)]
    ));
    assert!(s.is_settled());
}

#[test]
fn detached_failures_release_the_lock_or_leave_it_in_doubt() {
    let (mut s, key, _) = detached_locked();
    let effects = s.on_upstream_answer(Ok(answer("500", Some("application/json"), b"{}")), None);
    assert_eq!(respond_status(&effects), Some(500));
    assert_eq!(effects[1..], release_of(&key)[..]);

    let (mut s, key, _) = detached_locked();
    let effects = s.on_upstream_answer(Ok(answer("200", Some("text/event-stream"), b"data: hi\n\n")), None);
    assert_eq!(respond_status(&effects), Some(200));
    assert_eq!(effects[1..], release_of(&key)[..]);

    // Not a failure: a text answer is kept, and one too large without its body.
    let (mut s, _, _) = detached_locked();
    let effects = s.on_upstream_answer(Ok(answer("200", Some("text/plain"), b"hi")), None);
    let [_, Effect::Store(StoreCall::Commit { record, .. })] = &effects[..] else { panic!("{effects:?}") };
    assert_eq!(Record::decode(record).unwrap().body, b"hi");
    let (mut s, _, _) = detached_locked();
    let effects = s.on_upstream_answer(Ok(answer("200", Some("text/plain"), &[b'x'; 51])), None);
    let [_, Effect::Store(StoreCall::Commit { record, .. })] = &effects[..] else { panic!("{effects:?}") };
    assert!(Record::decode(record).unwrap().body_omitted);

    // A reset or a timeout after the call went out: the key is in doubt (the client, if still
    // there, gets 502 / 504); `run_again` releases it.
    let (mut s, key, _) = detached_locked();
    let effects = s.on_upstream_answer(Err(CalloutFault::Reset), None);
    assert_eq!(respond_status(&effects), Some(502));
    assert_eq!(effects[1..], in_doubt_of(&key)[..]);

    let (mut s, key, _) = detached_locked();
    let effects = s.on_upstream_answer(Err(CalloutFault::Timeout), None);
    assert_eq!(respond_status(&effects), Some(504));
    assert_eq!(effects[1..], in_doubt_of(&key)[..]);

    let (mut s, key, _) = detached_locked();
    s.on_stream_end(&MockView::default());
    assert_eq!(s.on_upstream_answer(Err(CalloutFault::Reset), None), in_doubt_of(&key));

    // Never dispatched: released.
    let (mut s, key, _) = detached_locked();
    s.on_stream_end(&MockView::default());
    assert_eq!(s.on_upstream_answer(Err(CalloutFault::Dispatch), None), release_of(&key));
}

#[test]
fn without_a_cluster_the_request_is_routed_normally() {
    let mut s = Machine::new(cfg(DETACHED));
    s.on_request_headers(&MockView::post(Some("k")), true);
    let effects = s.on_begin_answer(Ok(BeginAnswer::Locked { token: "t".into() }));
    assert_eq!(effects, vec![Effect::Resume, Effect::Count(Metric::Executed)]);
}
