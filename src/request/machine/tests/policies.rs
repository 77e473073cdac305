//! Per-route policies (`routes`), the published policy (`policy_url`) and `expiry_header`.

use super::*;
use crate::store::client::LockTerms;

const ROUTES: &str = r#","policy_url":"https://api.example.com/idem","expiry_header":"idempotency-expires",
    "routes":{"payments":{"require_key":true,"store_statuses":["2xx","4xx"],"retention_seconds":604800,
    "lock_ttl_ms":60000,"lock_wait_ms":0}}"#;

const NOW_MS: u64 = 1_796_000_000_123;

fn on_route(route: &str, key: Option<&str>) -> MockView {
    let mut v = MockView::post(key);
    v.prop("xds.route_name", route);
    v.now_ms = Some(NOW_MS);
    v
}

fn header(effects: &[Effect], name: &str) -> Option<String> {
    let r = answered(effects)?;
    r.headers.into_iter().find(|(n, _)| n == name).map(|(_, v)| v)
}

#[test]
fn each_route_goes_by_its_own_policy() {
    let mut payments = Machine::new(cfg(ROUTES));
    let step = payments.on_request_headers(&on_route("payments", None), true);
    assert_eq!(respond_status(&step.effects), Some(400), "payments requires a key");
    assert_eq!(
        header(&step.effects, "link").as_deref(),
        Some(r#"<https://api.example.com/idem>; rel="describedby""#)
    );
    let mut orders = Machine::new(cfg(ROUTES));
    let step = orders.on_request_headers(&on_route("orders", None), true);
    assert_eq!(step, Step::go(vec![Effect::Count(Metric::Passthrough)]), "orders: the defaults");
    // The route's lock terms go with its `begin`, its retention with its commit.
    let mut keyed = Machine::new(cfg(ROUTES));
    let step = keyed.on_request_headers(&on_route("payments", Some("k1")), true);
    let begin = step.effects.iter().find_map(|e| match e {
        Effect::Store(StoreCall::Begin { lock, .. }) => Some(*lock),
        _ => None,
    });
    assert_eq!(begin, Some(LockTerms { ttl_ms: 60_000, wait_ms: 0 }));
    keyed.on_begin_answer(Ok(BeginAnswer::Locked { token: "t1".into() }));
    let mut v = on_route("payments", Some("k1"));
    v.resp(":status", "404").resp("content-type", "application/json").resp("content-length", "0");
    let step = keyed.on_response_headers(&v, true);
    let expires = "Mon, 07 Dec 2026 00:53:20 GMT";
    assert_eq!(headers::http_date(NOW_MS + 604_800_000).as_deref(), Some(expires));
    assert!(
        step.effects.contains(&Effect::SetResponseHeader("idempotency-expires".into(), expires.into())),
        "{step:?}"
    );
    let retention = step.effects.iter().find_map(|e| match e {
        Effect::Store(StoreCall::Commit { retention_s, .. }) => Some(*retention_s),
        _ => None,
    });
    assert_eq!(retention, Some(604_800), "a 404 kept on payments, for its retention");
}

#[test]
fn a_route_without_a_policy_or_a_name_has_the_defaults() {
    for view in [on_route("search", Some("k1")), MockView::post(Some("k1"))] {
        let mut s = Machine::new(cfg(ROUTES));
        let step = s.on_request_headers(&view, true);
        let begin = step.effects.iter().find_map(|e| match e {
            Effect::Store(StoreCall::Begin { lock, .. }) => Some(*lock),
            _ => None,
        });
        assert_eq!(begin, Some(LockTerms { ttl_ms: 30_000, wait_ms: 5_000 }));
    }
}

#[test]
fn no_expiry_on_an_answer_not_kept_nor_when_off() {
    let (mut s, _) = executing(r#","expiry_header":"idempotency-expires""#);
    let mut v = MockView { now_ms: Some(NOW_MS), ..MockView::default() };
    v.resp(":status", "500").resp("content-length", "0");
    let step = s.on_response_headers(&v, true);
    assert!(!step.effects.iter().any(|e| matches!(e, Effect::SetResponseHeader(..))), "{step:?}");
    let (mut off, _) = executing("");
    v.response.clear();
    v.resp(":status", "201").resp("content-length", "0");
    let step = off.on_response_headers(&v, true);
    assert!(!step.effects.iter().any(|e| matches!(e, Effect::SetResponseHeader(..))), "{step:?}");
}

#[test]
fn a_replay_tells_when_its_record_expires() {
    let replay = |extra: &str, expires_ms: Option<u64>| {
        let mut s = Machine::new(cfg(extra));
        let mut v = MockView::post(Some("k1"));
        v.request_body = b"{}".to_vec();
        s.on_request_headers(&v, false);
        s.on_request_body(&v, 2, true);
        let record = Record { status: 201, expires_ms, ..Record::default() };
        s.on_begin_answer(Ok(BeginAnswer::Replay(record)))
    };
    let on = r#","expiry_header":"idempotency-expires""#;
    let effects = replay(on, Some(NOW_MS));
    assert_eq!(header(&effects, "idempotency-expires").as_deref(), Some("Mon, 30 Nov 2026 00:53:20 GMT"));
    assert_eq!(header(&effects, "x-idempotent-replay").as_deref(), Some("true"));
    assert_eq!(header(&replay(on, None), "idempotency-expires"), None, "not known: not said");
    assert_eq!(header(&replay("", Some(NOW_MS)), "idempotency-expires"), None, "off by default");
}

#[test]
fn a_detached_execution_s_answer_tells_its_expiry_too() {
    let (mut s, _, _) = super::detached::detached_locked_with(r#","expiry_header":"idempotency-expires""#);
    let effects = s.on_upstream_answer(Ok(answer("201", Some("application/json"), b"{}")), Some(NOW_MS));
    assert_eq!(header(&effects, "idempotency-expires").as_deref(), Some("Tue, 01 Dec 2026 00:53:20 GMT"));
    let (mut s, _, _) = super::detached::detached_locked_with(r#","expiry_header":"idempotency-expires""#);
    let effects = s.on_upstream_answer(Ok(answer("500", Some("application/json"), b"{}")), Some(NOW_MS));
    assert_eq!(header(&effects, "idempotency-expires").as_deref(), None, "not kept");
}
