//! The stored record's wire form, both formats (`"IDR2"`, and the first one, `"IDR1"`, which
//! still decodes).
//!
//! The input is read twice. As raw bytes: `Record::decode` never panics, and what it accepts is
//! replayable (a status the format holds, allow-listable header names, header values Envoy can
//! send, a valid print, no body where it was omitted); it encodes to bytes that decode to the
//! same record, exactly the input again when that was an `"IDR2"` record; an `"IDR1"` record
//! decodes as its `"IDR2"` form without flags does, and the other way round. As a structured
//! record (body-omitted flag and print included): encoding then decoding gives the record back
//! whenever it is replayable, and decoding refuses it otherwise.

#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use fuzz_common::ArbRecord;
use idempotency_filter::config::MAX_FINGERPRINT_HEADERS;
use idempotency_filter::http::{grpc, headers};
use idempotency_filter::store::record::{self, Record};
use libfuzzer_sys::fuzz_target;

/// What `decode` must accept, written from the format's description (`v1`: the first format,
/// `2xx` only and without flags or print).
fn replayable(r: &Record, v1: bool) -> bool {
    let statuses = if v1 { 200..=299 } else { 200..=599 };
    let fields_ok = |fields: &[(String, String)]| {
        fields.len() <= record::MAX_HEADERS
            && fields.iter().all(|(name, value)| {
                headers::is_valid_name(name)
                    && !headers::is_never_replayed(name)
                    && value.len() <= record::MAX_HEADER_VALUE
                    && headers::is_valid_value(value.as_bytes())
            })
    };
    statuses.contains(&r.status)
        && fields_ok(&r.headers)
        // A gRPC answer's trailers: the same rules, and the first grpc-status is a code.
        && r.trailers.as_ref().is_none_or(|t| {
            fields_ok(t)
                && t.iter()
                    .find(|(n, _)| n == "grpc-status")
                    .is_some_and(|(_, v)| grpc::parse_status(v.as_bytes()).is_some())
        })
        && (!r.body_omitted || r.body.is_empty())
        && r.print.as_ref().is_none_or(|p| {
            p.headers.len() <= MAX_FINGERPRINT_HEADERS
                && p.headers.iter().all(|(name, _)| headers::is_valid_name(name) && name.len() <= 255)
        })
        && (!v1 || (r.print.is_none() && !r.body_omitted && r.trailers.is_none()))
}

fuzz_target!(|data: &[u8]| {
    let decoded = Record::decode(data);
    if let Ok(r) = &decoded {
        let v1 = data.starts_with(b"IDR1");
        assert!(v1 || data.starts_with(b"IDR2"), "decoded another magic: {r:?}");
        assert!(replayable(r, v1), "decoded a record that cannot replay: {r:?}");
        let encoded = r.encode();
        assert!(encoded.starts_with(b"IDR2"), "records are written in the current format");
        assert_eq!(Record::decode(&encoded).as_ref(), Ok(r), "decode, encode, decode is not the same record");
        if !v1 {
            assert_eq!(encoded, data, "decode then encode is not the identity");
        }
    }
    // The two formats: "IDR1" | status | rest is "IDR2" | status | flags 0 | rest.
    if data.len() >= 6 && data.starts_with(b"IDR1") {
        let status = u16::from_be_bytes([data[4], data[5]]);
        let v2 = [b"IDR2", &data[4..6], &[0][..], &data[6..]].concat();
        if (200..=299).contains(&status) {
            assert_eq!(decoded, Record::decode(&v2), "IDR1 and IDR2 without flags differ");
        } else {
            assert!(decoded.is_err(), "the first format decoded a status that is not 2xx");
        }
    }
    if data.len() >= 7 && data.starts_with(b"IDR2") && data[6] == 0 {
        let status = u16::from_be_bytes([data[4], data[5]]);
        if (200..=299).contains(&status) {
            let v1 = [b"IDR1", &data[4..6], &data[7..]].concat();
            assert_eq!(decoded, Record::decode(&v1), "IDR2 without flags and IDR1 differ");
        }
    }

    let Ok(arb) = ArbRecord::arbitrary_take_rest(Unstructured::new(data)) else {
        return;
    };
    let r = arb.to_record();
    let encoded = r.encode();
    match Record::decode(&encoded) {
        Ok(back) => {
            assert!(replayable(&r, false), "accepted a record that cannot replay: {r:?}");
            assert_eq!(back, r);
        }
        Err(e) => assert!(!replayable(&r, false), "refused a replayable record ({e:?}): {r:?}"),
    }
});
