//! The filter's decoding of answers on the store stream (`store::stream`: protobuf bytes -> the
//! call's id and an outcome or `CalloutFault`), for `begin`, `commit` and `release`. Never
//! panics, and:
//!
//! * bytes that are no `Answer`, or one without an outcome, are `None` (the stream is reset);
//! * a `locked` answer's token is well formed; a `busy` answer's time left is absent or in
//!   1 ..= the longest lock TTL; a record's lifetime is absent or in 1 ..= the longest
//!   retention;
//! * a replay is exactly the record its bytes decode to;
//! * an answer of one kind is never read as another's outcome (a `Committed` is no `begin`);
//! * what decodes, encoded again, decodes the same.

#![no_main]

use idem_protocol as proto;
use idem_protocol::stream::{Answer as Wire, Outcome};
use idempotency_filter::store::client::{BeginAnswer, CalloutFault, LockToken};
use idempotency_filter::store::record::Record;
use idempotency_filter::store::stream::decode;
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let Some((id, answer)) = decode(data) else {
        // Only bytes prost refuses, or an answer without an outcome.
        if let Ok(w) = Wire::decode(data) {
            assert!(w.outcome.is_none(), "{w:?}");
        }
        return;
    };
    let wire = Wire::decode(data).expect("decoded once");
    assert_eq!(wire.id, id);
    let again = decode(&wire.encode_to_vec()).expect("re-encoded");
    assert_eq!(again, (id, answer.clone()));
    let begin = answer.begin();
    match (&wire.outcome, &begin) {
        (Some(Outcome::Begun(b)), Ok(BeginAnswer::Locked { token: LockToken::Store(t) })) => {
            assert!(proto::is_token(t.as_bytes()) && *t == b.token);
        }
        (Some(Outcome::Begun(b)), Ok(BeginAnswer::Replay(r))) => {
            assert_eq!(Ok(r.clone()), Record::decode(&b.record).map_err(|_| ()));
        }
        (Some(Outcome::Begun(_)), Ok(BeginAnswer::Busy { lock_ms })) => {
            assert!(lock_ms.is_none_or(|ms| (1..=proto::MAX_LOCK_TTL_MS).contains(&ms)));
        }
        (Some(Outcome::Begun(_)), _) => {}
        (Some(Outcome::Failure(f)), Err(CalloutFault::Status(s))) => {
            assert_eq!(*s, if f.bad_request { 400 } else { 503 });
        }
        (_, Err(_)) => {}
        (other, ok) => panic!("{other:?} read as a begin: {ok:?}"),
    }
    if let Some(ttl) = answer.record_ttl_ms() {
        assert!((1..=proto::MAX_RETENTION_S * 1000).contains(&ttl));
    }
    if answer.commit().is_ok() {
        assert!(matches!(wire.outcome, Some(Outcome::Committed(_))));
    }
    if answer.release().is_ok() {
        assert!(matches!(wire.outcome, Some(Outcome::Released(_))));
    }
});
