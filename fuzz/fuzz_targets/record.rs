//! The stored record's wire form.
//!
//! The input is read twice. As raw bytes: `Record::decode` never panics, and what it accepts is
//! replayable (2xx, allow-listable header names, header values Envoy can send) and encodes back
//! to exactly the same bytes. As a structured record: encoding then decoding gives the record
//! back whenever it is replayable, and decoding refuses it otherwise.

#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use fuzz_common::ArbRecord;
use idempotency_filter::headers;
use idempotency_filter::record::{self, Record};
use libfuzzer_sys::fuzz_target;

/// What `decode` must accept, written from the format's description.
fn replayable(r: &Record) -> bool {
    (200..=299).contains(&r.status)
        && r.headers.len() <= record::MAX_HEADERS
        && r.headers.iter().all(|(name, value)| {
            headers::is_valid_name(name)
                && !headers::is_never_replayed(name)
                && value.len() <= record::MAX_HEADER_VALUE
                && headers::is_valid_value(value.as_bytes())
        })
}

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = Record::decode(data) {
        assert!(replayable(&r), "decoded a record that cannot replay: {r:?}");
        assert_eq!(r.encode(), data, "decode then encode is not the identity");
    }

    let Ok(arb) = ArbRecord::arbitrary_take_rest(Unstructured::new(data)) else {
        return;
    };
    let r = arb.to_record();
    let encoded = r.encode();
    match Record::decode(&encoded) {
        Ok(back) => {
            assert!(replayable(&r), "accepted a record that cannot replay: {r:?}");
            assert_eq!(back, r);
        }
        Err(e) => assert!(!replayable(&r), "refused a replayable record ({e:?}): {r:?}"),
    }
});
