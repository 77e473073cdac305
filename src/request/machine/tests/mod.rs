//! The machine's unit tests, by phase; the helpers they share are here.

use super::*;
use crate::request::detached::{UpstreamAnswer, UpstreamCall};
use crate::request::key::hex;
use crate::request::problem::Code;
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
        if let Effect::Store(StoreCall::Begin { key, body_hash, .. }) = e {
            return (key.clone(), body_hash.clone());
        }
    }
    panic!("no begin in {effects:?}")
}

/// The first local answer among `effects`: a `Respond`, or a `Refuse` as the HTTP problem it
/// is sent as.
fn answered(effects: &[Effect]) -> Option<LocalResponse> {
    effects.iter().find_map(|e| match e {
        Effect::Respond(r) => Some(r.clone()),
        Effect::Refuse(p) => Some(p.answer(false, "urn:uuid:00000000-0000-4000-8000-000000000000")),
        _ => None,
    })
}

fn respond_status(effects: &[Effect]) -> Option<u32> {
    effects.iter().find_map(|e| match e {
        Effect::Respond(r) => Some(r.status),
        Effect::Refuse(p) => p.status,
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

fn in_doubt_of(key: &str) -> Vec<Effect> {
    vec![
        Effect::Store(StoreCall::Release { key: key.into(), token: "t1".into(), in_doubt: true }),
        Effect::Count(Metric::InDoubt),
    ]
}

fn release_of(key: &str) -> Vec<Effect> {
    vec![
        Effect::Store(StoreCall::Release { key: key.into(), token: "t1".into(), in_doubt: false }),
        Effect::Count(Metric::Released),
    ]
}

const DETACHED: &str = r#","detached_execution":true,"store_key_header":"x-store-key""#;

fn answer(status: &str, content_type: Option<&str>, body: &[u8]) -> UpstreamAnswer {
    let mut headers = vec![(":status".to_string(), status.as_bytes().to_vec())];
    if let Some(ct) = content_type {
        headers.push(("content-type".into(), ct.as_bytes().to_vec()));
    }
    headers.push(("location".into(), b"/orders/9".to_vec()));
    UpstreamAnswer::decode(headers, body.to_vec()).unwrap()
}

mod detached;
mod endings;
mod grpc;
mod inbox;
mod on_begin;
mod on_request;
mod on_response;
mod policies;
mod random;
