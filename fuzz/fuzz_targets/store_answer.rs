//! The filter's decoding of store answers (`store::Answer`: status + headers + body -> outcome or
//! `CalloutFault`), for `begin`, `commit` and `release`. Never panics, and:
//!
//! * no headers is a reset; a first `:status` that is not a number is garbage; `504` is a
//!   timeout; any other non-200 status is `Status(that status)`;
//! * an outcome is only ever read from a `200` whose first outcome header is its wire name;
//! * a `locked` answer carries the first token header, and that token is well formed;
//! * a replay is exactly the record the body decodes to;
//! * a `busy` answer carries how long the holder's lock still lives when the first
//!   `x-idem-lock-remaining-ms` header is a decimal in 1 ..= the longest lock TTL, and nothing
//!   otherwise (absent, garbage, zero, too long): never a fault;
//! * a record's lifetime (`x-idem-ttl-ms`, for the filter's cache) is read from the first such
//!   header when it is a decimal in 1 ..= the longest retention, and is otherwise absent: never
//!   a fault, never zero, never longer than any record can live.

#![no_main]

use arbitrary::Arbitrary;
use fuzz_common::{ArbRecord, Bytes, Name};
use idem_protocol as proto;
use idem_protocol::{BeginOutcome, CommitOutcome, ReleaseOutcome};
use idempotency_filter::store::client::{Answer, BeginAnswer, CalloutFault};
use idempotency_filter::store::record::Record;
use libfuzzer_sys::fuzz_target;

const WIRE_NAMES: [&str; 9] =
    ["record", "locked", "busy", "mismatch", "stored", "late", "exists", "released", "not-owner"];

#[derive(Arbitrary, Debug)]
enum StatusValue {
    Code(u16),
    Ok200,
    Timeout504,
    Raw(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
enum Header {
    Status(StatusValue),
    Outcome(u8),
    RawOutcome(Vec<u8>),
    Token(Bytes),
    GoodToken(u8, u8),
    Ttl(Bytes),
    GoodTtl(u64),
    LockRemaining(Bytes),
    GoodLockRemaining(u64),
    Other(Name, Bytes),
}

#[derive(Arbitrary, Debug)]
enum Body {
    Record(ArbRecord),
    Raw(Bytes),
}

#[derive(Arbitrary, Debug)]
struct Input {
    headers: Vec<Header>,
    body: Body,
}

fn header_pair(h: &Header) -> (String, Vec<u8>) {
    match h {
        Header::Status(s) => {
            let v = match s {
                StatusValue::Code(c) => c.to_string().into_bytes(),
                StatusValue::Ok200 => b"200".to_vec(),
                StatusValue::Timeout504 => b"504".to_vec(),
                StatusValue::Raw(b) => b.clone(),
            };
            (":status".into(), v)
        }
        Header::Outcome(i) => {
            (proto::HEADER_OUTCOME.into(), WIRE_NAMES[usize::from(*i) % WIRE_NAMES.len()].as_bytes().to_vec())
        }
        Header::RawOutcome(b) => (proto::HEADER_OUTCOME.into(), b.clone()),
        Header::Token(b) => (proto::HEADER_TOKEN.into(), b.to_vec()),
        Header::GoodToken(c, n) => {
            let alphabet = b"abcXYZ019-_";
            let c = alphabet[usize::from(*c) % alphabet.len()];
            (proto::HEADER_TOKEN.into(), vec![c; usize::from(*n % 70) + 1])
        }
        Header::Ttl(b) => (proto::HEADER_TTL_MS.into(), b.to_vec()),
        Header::GoodTtl(n) => (proto::HEADER_TTL_MS.into(), (n % (MAX_TTL_MS + 2)).to_string().into_bytes()),
        Header::LockRemaining(b) => (proto::HEADER_LOCK_REMAINING_MS.into(), b.to_vec()),
        Header::GoodLockRemaining(n) => (
            proto::HEADER_LOCK_REMAINING_MS.into(),
            (n % (proto::MAX_LOCK_TTL_MS + 2)).to_string().into_bytes(),
        ),
        Header::Other(n, v) => (n.name(), v.to_vec()),
    }
}

const MAX_TTL_MS: u64 = proto::MAX_RETENTION_S * 1000;

/// The first header `name` as a decimal in `1..=max`, written independently of
/// `idem_protocol::parse_bounded`.
fn decimal(headers: &[(String, Vec<u8>)], name: &str, max: u64) -> Option<u64> {
    first(headers, name)
        .filter(|v| !v.is_empty() && v.len() <= 20 && v.iter().all(u8::is_ascii_digit))
        .and_then(|v| std::str::from_utf8(v).ok()?.parse::<u64>().ok())
        .filter(|n| (1..=max).contains(n))
}

/// As [`decimal`], zero allowed.
fn decimal0(headers: &[(String, Vec<u8>)], name: &str, max: u64) -> Option<u64> {
    first(headers, name)
        .filter(|v| !v.is_empty() && v.len() <= 20 && v.iter().all(u8::is_ascii_digit))
        .and_then(|v| std::str::from_utf8(v).ok()?.parse::<u64>().ok())
        .filter(|n| *n <= max)
}

fn first<'a>(headers: &'a [(String, Vec<u8>)], name: &str) -> Option<&'a [u8]> {
    headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_slice())
}

fuzz_target!(|input: Input| {
    let headers: Vec<(String, Vec<u8>)> = input.headers.iter().map(header_pair).collect();
    let body = match &input.body {
        Body::Record(r) => r.to_record().encode(),
        Body::Raw(b) => b.to_vec(),
    };
    let answer = Answer { headers: &headers, body: &body };
    let ttl = answer.record_ttl_ms();
    assert!(ttl.is_none_or(|ms| (1..=MAX_TTL_MS).contains(&ms)), "{ttl:?}");
    assert_eq!(ttl, decimal(&headers, proto::HEADER_TTL_MS, MAX_TTL_MS));
    let begin = answer.begin();
    let commit = answer.commit();
    let release = answer.release();
    for fault in [begin.as_ref().err(), commit.as_ref().err(), release.as_ref().err()].into_iter().flatten() {
        assert!(!fault.to_string().is_empty());
    }

    // What the status alone decides.
    let status = first(&headers, ":status")
        .and_then(|s| std::str::from_utf8(s).ok())
        .and_then(|s| s.parse::<u16>().ok());
    let expected = if headers.is_empty() {
        Some(CalloutFault::Reset)
    } else {
        match status {
            None => Some(CalloutFault::Garbage("no status")),
            Some(200) => None,
            Some(504) => Some(CalloutFault::Timeout),
            Some(other) => Some(CalloutFault::Status(other)),
        }
    };
    if let Some(fault) = expected {
        assert_eq!(begin.as_ref().err(), Some(&fault));
        assert_eq!(commit.err(), Some(fault));
        assert_eq!(release.err(), Some(fault));
        return;
    }
    let outcome = first(&headers, proto::HEADER_OUTCOME);
    if outcome.is_none() {
        let fault = CalloutFault::Garbage("no outcome");
        assert_eq!(
            (begin.as_ref().err(), commit.err(), release.err()),
            (Some(&fault), Some(fault), Some(fault))
        );
        return;
    }
    let outcome = outcome.unwrap_or_default();

    match &begin {
        Ok(a) => {
            let wire = match a {
                BeginAnswer::Replay(r) => {
                    assert!((200..=599).contains(&r.status));
                    assert_eq!(Record::decode(&body).as_ref(), Ok(r));
                    BeginOutcome::Record
                }
                BeginAnswer::Locked { token } => {
                    assert!(proto::is_token(token.to_string().as_bytes()), "{token:?}");
                    assert_eq!(first(&headers, proto::HEADER_TOKEN), Some(token.to_string().as_bytes()));
                    BeginOutcome::Locked
                }
                BeginAnswer::Busy { lock_ms } => {
                    assert!(
                        lock_ms.is_none_or(|ms| (1..=proto::MAX_LOCK_TTL_MS).contains(&ms)),
                        "{lock_ms:?}"
                    );
                    BeginOutcome::Busy
                }
                BeginAnswer::Mismatch => BeginOutcome::Mismatch,
                BeginAnswer::InDoubt { token, started_ms, running_ms } => {
                    assert!(proto::is_token(token.to_string().as_bytes()), "{token:?}");
                    assert_eq!(first(&headers, proto::HEADER_TOKEN), Some(token.to_string().as_bytes()));
                    assert!(*running_ms <= proto::MAX_LOCK_TTL_MS, "{running_ms}");
                    assert_eq!(decimal0(&headers, proto::HEADER_STARTED_MS, u64::MAX), Some(*started_ms));
                    assert_eq!(
                        decimal0(&headers, proto::HEADER_RUNNING_MS, proto::MAX_LOCK_TTL_MS),
                        Some(*running_ms)
                    );
                    BeginOutcome::InDoubt
                }
                BeginAnswer::Withheld => panic!("only the local fallback answers withheld, never the store"),
            };
            assert_eq!(wire.as_str().as_bytes(), outcome);
        }
        Err(CalloutFault::Garbage(_)) => {}
        Err(other) => panic!("a 200 with an outcome answered {other:?}"),
    }
    match BeginOutcome::parse(outcome) {
        None => assert_eq!(begin.as_ref().err(), Some(&CalloutFault::Garbage("unknown outcome"))),
        Some(BeginOutcome::Busy) => {
            let lock_ms = decimal(&headers, proto::HEADER_LOCK_REMAINING_MS, proto::MAX_LOCK_TTL_MS);
            assert_eq!(begin.as_ref().ok(), Some(&BeginAnswer::Busy { lock_ms }));
        }
        Some(BeginOutcome::Mismatch) => assert_eq!(begin.as_ref().ok(), Some(&BeginAnswer::Mismatch)),
        Some(BeginOutcome::Expired) => assert_eq!(begin.as_ref().err(), Some(&CalloutFault::Timeout)),
        Some(BeginOutcome::Record) => assert_eq!(begin.is_ok(), Record::decode(&body).is_ok()),
        Some(BeginOutcome::Locked) => {
            let well_formed = first(&headers, proto::HEADER_TOKEN).is_some_and(proto::is_token);
            assert_eq!(begin.is_ok(), well_formed);
        }
        Some(BeginOutcome::InDoubt) => {
            let well_formed = first(&headers, proto::HEADER_TOKEN).is_some_and(proto::is_token)
                && decimal0(&headers, proto::HEADER_STARTED_MS, u64::MAX).is_some()
                && decimal0(&headers, proto::HEADER_RUNNING_MS, proto::MAX_LOCK_TTL_MS).is_some();
            assert_eq!(begin.is_ok(), well_formed);
        }
    }
    assert_eq!(commit.ok(), CommitOutcome::parse(outcome));
    assert_eq!(release.ok(), ReleaseOutcome::parse(outcome));
});
