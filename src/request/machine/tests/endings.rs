//! How a guarded attempt ends: the application's answer (today's rules), Envoy's reply for a
//! request that never reached it (released), or one for a request whose answer was lost (in
//! doubt under `unknown_outcome: hold`); and what a retry of an in-doubt key gets.

use super::*;

/// Envoy's own reply to a stream that was `executing`, with these code details, after one try
/// of the router (none for the replies made before it).
fn envoy_reply(s: &mut Machine, status: &str, details: &str) -> Vec<Effect> {
    let tries: u64 = if details.starts_with("upstream_") || details == "response_timeout" { 1 } else { 0 };
    let mut v = MockView::default();
    v.resp(":status", status).resp("content-type", "text/plain").prop("response.code_details", details);
    v.props.insert("upstream.request_attempt_count".into(), tries.to_le_bytes().to_vec());
    s.on_response_headers(&v, false).effects
}

#[test]
fn a_lost_answer_leaves_the_key_in_doubt() {
    for (status, details) in [
        ("504", "response_timeout"),
        ("504", "upstream_per_try_timeout"),
        ("503", "upstream_reset_before_response_started{remote_reset}"),
        ("503", "upstream_reset_before_response_started{connection_termination}"),
    ] {
        let (mut s, key) = executing("");
        assert_eq!(envoy_reply(&mut s, status, details), in_doubt_of(&key), "{details}");
        assert!(s.is_done());
    }
}

#[test]
fn a_request_that_never_reached_the_application_is_released() {
    // Even where 5xx answers are kept: Envoy's reply is not the application's answer.
    for extra in ["", r#","store_statuses":["2xx","5xx"]"#] {
        for (status, details) in [
            ("503", "upstream_reset_before_response_started{remote_connection_failure|delayed_connect_error:_Connection_refused}"),
            ("503", "no_healthy_upstream"),
            ("503", "upstream_reset_before_response_started{overflow}"),
            ("413", "request_payload_too_large"),
        ] {
            let (mut s, key) = executing(extra);
            assert_eq!(envoy_reply(&mut s, status, details), release_of(&key), "{details} {extra}");
        }
    }
}

#[test]
fn the_applications_own_answers_follow_the_usual_rules() {
    // Its 503 (via_upstream): released, as not kept.
    let (mut s, key) = executing("");
    assert_eq!(envoy_reply(&mut s, "503", "via_upstream"), release_of(&key));
    // Its 201: captured, then committed.
    let (mut s, _) = executing("");
    let mut v = MockView::default();
    v.resp(":status", "201")
        .resp("content-type", "application/json")
        .prop("response.code_details", "via_upstream");
    assert_eq!(s.on_response_headers(&v, true).effects.len(), 1, "a commit");
}

#[test]
fn run_again_releases_what_hold_keeps_in_doubt() {
    let (mut s, key) = executing(r#","unknown_outcome":"run_again""#);
    assert_eq!(envoy_reply(&mut s, "504", "response_timeout"), release_of(&key));
}

#[test]
fn begins_ask_the_store_to_hold_under_hold_only() {
    let hold_of = |extra: &str| {
        let mut s = Machine::new(cfg(extra));
        let mut v = MockView::post(Some("k1"));
        v.request_body = b"{}".to_vec();
        s.on_request_headers(&v, false);
        let step = s.on_request_body(&v, 2, true);
        step.effects.into_iter().find_map(|e| match e {
            Effect::Store(StoreCall::Begin { hold, .. }) => Some(hold),
            _ => None,
        })
    };
    assert_eq!(hold_of(""), Some(Some(Hold { retention_s: 86_400, supersede: None })));
    assert_eq!(hold_of(r#","retention_seconds":60"#), Some(Some(Hold { retention_s: 60, supersede: None })));
    assert_eq!(hold_of(r#","unknown_outcome":"run_again""#), Some(None));
}

fn beginning(extra: &str) -> Machine {
    let mut s = Machine::new(cfg(extra));
    let mut v = MockView::post(Some("k1"));
    v.request_body = b"{}".to_vec();
    s.on_request_headers(&v, false);
    s.on_request_body(&v, 2, true);
    s
}

#[test]
fn a_retry_of_an_in_doubt_key_runs_nothing_and_gets_409() {
    let mut s = beginning("");
    let effects =
        s.on_begin_answer(Ok(BeginAnswer::InDoubt { token: "t0".into(), started_ms: 1, running_ms: 2_500 }));
    let [Effect::Refuse(p), Effect::Count(Metric::OutcomeUnknown)] = effects.as_slice() else {
        panic!("{effects:?}")
    };
    assert_eq!((p.code, p.status, p.retry_after_ms), (Code::OutcomeUnknown, Some(409), Some(2_500)));
    assert!(s.is_done());
    // Once the first attempt can no longer be running: no retry-after.
    let mut s = beginning("");
    let effects =
        s.on_begin_answer(Ok(BeginAnswer::InDoubt { token: "t0".into(), started_ms: 1, running_ms: 0 }));
    let [Effect::Refuse(p), _] = effects.as_slice() else { panic!("{effects:?}") };
    assert_eq!(p.retry_after_ms, None);
}

const LOOKUP: &str = r#","store_key_header":"x-store-key","outcome_lookup":{"path":"/orders/by-key/{key}"}"#;

fn looking(running_ms: u64) -> (Machine, String, UpstreamCall) {
    let mut s = Machine::new(cfg(LOOKUP));
    let mut v = MockView::post(Some("k1"));
    v.request_body = b"{}".to_vec();
    v.prop("xds.cluster_name", "app").req(":authority", "shop.example");
    s.on_request_headers(&v, false);
    let (key, _) = begin_call(&s.on_request_body(&v, 2, true).effects);
    let effects =
        s.on_begin_answer(Ok(BeginAnswer::InDoubt { token: "t0".into(), started_ms: 1, running_ms }));
    let [Effect::Lookup(call)] = effects.as_slice() else { panic!("{effects:?}") };
    assert!(!s.is_done() && !s.is_settled());
    (s, key, call.clone())
}

fn app_answer(status: &str, body: &[u8]) -> UpstreamAnswer {
    UpstreamAnswer {
        status: status.parse().unwrap(),
        headers: vec![
            (":status".into(), status.as_bytes().to_vec()),
            ("content-type".into(), b"application/json".to_vec()),
            ("x-envoy-upstream-service-time".into(), b"1".to_vec()),
        ],
        body: body.to_vec(),
        trailers: vec![],
    }
}

#[test]
fn the_lookup_asks_the_routes_cluster_with_the_store_key() {
    let (_, key, call) = looking(0);
    assert_eq!(call.cluster, "app");
    assert!(call.headers.contains(&(":method".into(), "GET".into())));
    assert!(call.headers.contains(&(":path".into(), format!("/orders/by-key/{key}"))));
    assert!(call.headers.contains(&(":authority".into(), "shop.example".into())));
    assert!(call.headers.contains(&("x-store-key".into(), key.clone())));
}

#[test]
fn a_2xx_lookup_becomes_the_record_and_is_replayed() {
    let (mut s, key, _) = looking(5_000);
    let effects = s.on_upstream_answer(Ok(app_answer("200", br#"{"id":"ord_1"}"#)), None);
    let [Effect::Store(StoreCall::Commit { key: k, token, record, .. }), Effect::Respond(r), Effect::Count(Metric::ResolvedByLookup)] =
        effects.as_slice()
    else {
        panic!("{effects:?}")
    };
    assert_eq!((k, token), (&key, &LockToken::from("t0")), "committed as the first attempt's late commit");
    assert_eq!(Record::decode(record).unwrap().body, br#"{"id":"ord_1"}"#);
    assert_eq!((r.status, r.body.as_slice()), (200, br#"{"id":"ord_1"}"#.as_slice()));
    assert!(r.headers.contains(&("x-idempotent-replay".into(), "true".into())));
    assert!(s.is_done());
}

#[test]
fn a_404_runs_the_retry_only_once_the_first_attempt_cannot_be_running() {
    // Still possibly running: 409, nothing runs.
    let (mut s, _, _) = looking(4_000);
    let effects = s.on_upstream_answer(Ok(app_answer("404", b"")), None);
    assert_eq!(respond_status(&effects), Some(409));
    assert_eq!(counts(&effects), vec![Metric::OutcomeUnknown]);
    // No longer: the store is asked for the lock, superseding the first attempt.
    let (mut s, key, _) = looking(0);
    let effects = s.on_upstream_answer(Ok(app_answer("404", b"")), None);
    let [Effect::Store(StoreCall::Begin { key: k, hold: Some(hold), .. }), Effect::Count(Metric::ResolvedToRun)] =
        effects.as_slice()
    else {
        panic!("{effects:?}")
    };
    assert_eq!((k, hold.supersede.as_deref()), (&key, Some("t0")));
    let effects = s.on_begin_answer(Ok(BeginAnswer::Locked { token: "t2".into() }));
    assert_eq!(effects, vec![Effect::Resume, Effect::Count(Metric::Executed)]);
}

#[test]
fn anything_else_from_the_lookup_leaves_the_key_in_doubt() {
    for answer in [Ok(app_answer("500", b"")), Ok(app_answer("302", b"")), Err(CalloutFault::Timeout)] {
        let (mut s, _, _) = looking(0);
        let effects = s.on_upstream_answer(answer.clone(), None);
        assert_eq!(respond_status(&effects), Some(409), "{answer:?}");
        assert_eq!(counts(&effects), vec![Metric::OutcomeUnknown]);
    }
    // The client went away: a committed answer still becomes the record; a 404 runs nothing.
    let (mut s, _, _) = looking(0);
    s.on_stream_end(&MockView::default());
    let effects = s.on_upstream_answer(Ok(app_answer("201", b"{}")), None);
    assert!(matches!(effects.first(), Some(Effect::Store(StoreCall::Commit { .. }))), "{effects:?}");
    let (mut s, _, _) = looking(0);
    s.on_stream_end(&MockView::default());
    assert_eq!(s.on_upstream_answer(Ok(app_answer("404", b"")), None), vec![]);
}

#[test]
fn lookup_configuration_is_checked() {
    let bad =
        |extra: &str| Config::from_json(format!(r#"{{"store_cluster":"s"{extra}}}"#).as_bytes()).unwrap_err();
    assert_eq!(bad(r#","outcome_lookup":{"path":"/x/{key}"}"#).key, "outcome_lookup");
    let with_header = r#","store_key_header":"x-k""#;
    assert_eq!(
        bad(&format!(r#"{with_header},"outcome_lookup":{{"path":"x/{{key}}"}}"#)).key,
        "outcome_lookup.path"
    );
    assert_eq!(bad(&format!(r#"{with_header},"outcome_lookup":{{"path":"/x"}}"#)).key, "outcome_lookup.path");
    assert_eq!(bad(&format!(r#"{with_header},"outcome_lookup":{{}}"#)).key, "outcome_lookup.path");
    assert_eq!(
        bad(&format!(r#"{with_header},"outcome_lookup":{{"path":"/x/{{key}}","verb":"GET"}}"#)).key,
        "outcome_lookup.verb"
    );
    assert_eq!(bad(r#","unknown_outcome":"maybe""#).key, "unknown_outcome");
}
