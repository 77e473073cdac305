//! What a retry gets from its key's record: the stored answer, or the reason it cannot have it.
//!
//! In order: a record made for another request (target or a fingerprinted header differs) is a
//! `422`, never a replay; an answer recorded without its body replays its status and headers
//! with an empty body and `body_omitted_header`; an answer in a content coding the retry does not
//! accept is a `406` problem (the upstream does not run again: the retry can ask once more with
//! that coding, and gets the stored bytes); anything else replays as stored. Every replay carries
//! `replay_header`.

use crate::config::Config;
use crate::http::headers;
use crate::request::metrics::Metric;
use crate::request::problem::{self, LocalResponse, Problem};
use crate::store::record::Record;
use crate::store::record::RequestPrint;

/// The answer for a retry whose request has `print` and these `accept-encoding` values (its
/// replay, or the problem it gets instead), and the counter it goes on.
pub fn answer(
    cfg: &Config,
    record: Record,
    print: Option<&RequestPrint>,
    accept_encoding: &[Vec<u8>],
) -> (Result<LocalResponse, Problem>, Metric) {
    let replayed = marker(cfg);
    // Until when a retry of it is safe: when the store forgets the record, if that is known.
    let expiry = expiry(cfg, record.expires_ms);
    if let Some(status) = cfg.inbox().and_then(|i| i.duplicate_status) {
        let mut headers = vec![replayed];
        headers.extend(expiry);
        return (
            Ok(LocalResponse { status: u32::from(status), headers, body: Vec::new() }),
            Metric::Replayed,
        );
    }
    if let Some(refusal) = made_for_another(cfg, &record, print) {
        return (Err(refusal), Metric::Mismatched);
    }
    let mut headers = record.headers;
    if record.body_omitted {
        // No bytes to read: nothing may say how to read them.
        headers.retain(|(n, _)| n != "content-encoding" && n != "content-range");
        headers.push(replayed);
        headers.push((cfg.body_omitted_header.clone(), "true".to_string()));
        headers.extend(expiry);
        return (
            Ok(LocalResponse { status: u32::from(record.status), headers, body: Vec::new() }),
            Metric::Replayed,
        );
    }
    let coding = headers.iter().find(|(n, _)| n == "content-encoding");
    if let Some(refused) = coding.and_then(|(_, v)| headers::refused_coding(accept_encoding, v.as_bytes())) {
        return (Err(problem::encoding_not_acceptable(cfg, &refused)), Metric::Rejected);
    }
    headers.push(replayed);
    headers.extend(expiry);
    (Ok(LocalResponse { status: u32::from(record.status), headers, body: record.body }), Metric::Replayed)
}

/// The header that marks a replay, HTTP or gRPC: `replay_header` (the marker the filter adds)
/// with the value `true`. Not `replay_headers`, the upstream's headers a record keeps.
pub fn marker(cfg: &Config) -> (String, String) {
    (cfg.replay_header.clone(), "true".to_string())
}

/// `expiry_header` with the moment (`expires_ms`, since the Unix epoch) a record expires, when
/// the header is configured and the moment known: on replays, and on the first answer.
pub fn expiry(cfg: &Config, expires_ms: Option<u64>) -> Option<(String, String)> {
    let name = cfg.expiry_header.as_ref()?;
    Some((name.clone(), headers::http_date(expires_ms?)?))
}

/// The `key-reused` problem for a retry whose request is not the one `record` was made for, if
/// it is not.
pub fn made_for_another(cfg: &Config, record: &Record, print: Option<&RequestPrint>) -> Option<Problem> {
    let what = record.print.as_ref()?.differs_from(print?)?;
    Some(problem::key_reused(cfg, &what))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::fingerprint::Differs;
    use crate::request::problem::Code;

    fn cfg(extra: &str) -> Config {
        Config::from_json(format!(r#"{{"store_cluster":"s"{extra}}}"#).as_bytes()).unwrap()
    }

    fn print(target: u8) -> RequestPrint {
        RequestPrint { target: [target; 32], headers: vec![("x-tenant".into(), [1; 32])] }
    }

    fn record(headers: &[(&str, &str)], body: &[u8]) -> Record {
        Record {
            status: 201,
            headers: headers.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect(),
            body: body.to_vec(),
            body_omitted: false,
            print: Some(print(1)),
            trailers: None,
            expires_ms: None,
        }
    }

    fn header<'a>(r: &'a LocalResponse, name: &str) -> Option<&'a str> {
        r.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    #[test]
    fn replays_exactly_with_the_replay_header() {
        let body: Vec<u8> = (0..=255).collect();
        let rec = record(&[("content-type", "application/octet-stream"), ("location", "/o/1")], &body);
        let (r, m) = answer(&cfg(""), rec, Some(&print(1)), &[]);
        assert_eq!(m, Metric::Replayed);
        let r = r.unwrap();
        assert_eq!((r.status, r.body.as_slice()), (201, body.as_slice()));
        assert_eq!(
            r.headers,
            vec![
                ("content-type".into(), "application/octet-stream".into()),
                ("location".into(), "/o/1".into()),
                ("x-idempotent-replay".into(), "true".into())
            ]
        );
    }

    #[test]
    fn another_request_is_422_never_a_replay() {
        let (r, m) = answer(&cfg(""), record(&[], b"{}"), Some(&print(2)), &[]);
        assert_eq!((r, m), (Err(problem::key_reused(&cfg(""), &Differs::Target)), Metric::Mismatched));
        let mut other = print(1);
        other.headers[0].1 = [2; 32];
        let (r, _) = answer(&cfg(""), record(&[], b"{}"), Some(&other), &[]);
        assert_eq!(r, Err(problem::key_reused(&cfg(""), &Differs::Header("x-tenant".into()))));
        // A record without a print (the first format) replays as it did.
        let old = Record { print: None, ..record(&[], b"{}") };
        assert_eq!(answer(&cfg(""), old, Some(&print(2)), &[]).1, Metric::Replayed);
    }

    #[test]
    fn omitted_bodies_replay_empty_and_say_so() {
        let rec = Record {
            body_omitted: true,
            body: vec![],
            ..record(&[("content-type", "application/json"), ("content-encoding", "gzip")], b"")
        };
        let (r, m) = answer(&cfg(""), rec, Some(&print(1)), &[]);
        let r = r.unwrap();
        assert_eq!((r.status, m), (201, Metric::Replayed));
        assert!(r.body.is_empty());
        assert_eq!(header(&r, "x-idempotent-body-omitted"), Some("true"));
        assert_eq!(header(&r, "x-idempotent-replay"), Some("true"));
        assert_eq!(header(&r, "content-type"), Some("application/json"));
        assert_eq!(header(&r, "content-encoding"), None, "no bytes to decode");
    }

    #[test]
    fn a_coding_the_retry_refuses_is_406() {
        let rec =
            || record(&[("content-type", "application/json"), ("content-encoding", "gzip")], b"\x1f\x8b");
        let (r, m) = answer(&cfg(""), rec(), Some(&print(1)), &[b"gzip, br".to_vec()]);
        let r = r.unwrap();
        assert_eq!((r.status, m), (201, Metric::Replayed));
        assert_eq!(header(&r, "content-encoding"), Some("gzip"));
        assert_eq!(r.body, b"\x1f\x8b");
        for accept in [vec![], vec![b"br".to_vec()], vec![b"gzip;q=0".to_vec()]] {
            let (r, m) = answer(&cfg(""), rec(), Some(&print(1)), &accept);
            let p = r.unwrap_err();
            assert_eq!(
                (p.code, p.status, m),
                (Code::EncodingNotAcceptable, Some(406), Metric::Rejected),
                "{accept:?}"
            );
        }
        // A mismatch is said first: the stored bytes are not this request's either way.
        assert_eq!(answer(&cfg(""), rec(), Some(&print(2)), &[]).0.unwrap_err().code, Code::KeyReused);
    }

    #[test]
    fn inbox_duplicate_status_is_bare() {
        let c = cfg(r#","mode":"inbox","inbox":{"duplicate_status":202}"#);
        let (r, m) = answer(&c, Record::status_only(200), None, &[]);
        let r = r.unwrap();
        assert_eq!((r.status, m), (202, Metric::Replayed));
        assert_eq!(r.headers, vec![("x-idempotent-replay".into(), "true".into())]);
    }
}
