//! Which upstream answers become records, and in what form: the one place the response side
//! decides, for routed and detached executions alike.
//!
//! An answer whose status is in `store_statuses` (default `2xx`) is kept whatever its content
//! type, its body as exact bytes, unless it cannot be replayed: a stream (`text/event-stream`,
//! `multipart/x-mixed-replace`, gRPC) or an upgrade. `store_content_types` narrows what is kept.
//! An answer too large for `max_record_bytes` is kept without its body (`record_too_large:
//! "omit_body"`, the default), so that its retries replay the status instead of running again.
//! Whatever is not kept gives the lock back, and the next retry runs.
//!
//! Inbox mode has its own rule: any `2xx` marks the message handled, kept in full when a record
//! can hold it and as its status alone when not; anything else gives the lock back.

use crate::config::values::TooLarge;
use crate::config::Config;
use crate::http::headers::MediaType;

/// What becomes of an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// Status, recorded headers and body.
    Full,
    /// Status and recorded headers; the body is left out (too large).
    WithoutBody,
    /// Inbox mode: the status alone marks the message handled.
    StatusOnly,
    /// Nothing: the lock is given back.
    Release,
}

/// What is known of an answer: its headers, and how long its body is, or is at least.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub status: u16,
    pub content_type: Option<Vec<u8>>,
    /// The body's length: declared (`content-length`), or at least this many bytes arrived;
    /// `None` while unknown.
    pub length: Option<u64>,
    /// An `upgrade` header, or `101`.
    pub upgrade: bool,
    /// The recorded headers fit a record (see [`crate::store::record::headers_fit`]).
    pub headers_fit: bool,
    /// Each header that says how to read the body ([`crate::http::headers::REPRESENTATION`]) is there
    /// at most once, with a value a record can keep: else a replay could not say it the same way.
    pub readable: bool,
}

impl Head {
    /// [`Head::readable`] for a response whose header values `values_of` gives.
    pub fn readable_with(values_of: impl Fn(&str) -> Vec<Vec<u8>>) -> bool {
        crate::http::headers::REPRESENTATION.iter().all(|name| match values_of(name).as_slice() {
            [] => true,
            [one] => crate::http::headers::is_valid_value(one),
            _ => false,
        })
    }

    /// The same answer with at least `bytes` of body.
    pub fn with_body(&self, bytes: u64) -> Head {
        Head { length: Some(self.length.unwrap_or(0).max(bytes)), ..self.clone() }
    }
}

/// What becomes of an answer, from what is known of it. Called on the response headers, and
/// again as the body arrives (with [`Head::with_body`]): [`Keep::Full`] on the headers may
/// become [`Keep::WithoutBody`] (too large) or not kept (a body without a content type where
/// `store_content_types` is set); nothing else changes once the headers are known.
pub fn decide(cfg: &Config, head: &Head) -> Keep {
    let too_large = head.length.is_some_and(|n| n > cfg.max_record_bytes as u64);
    // What the bytes are is unknown, and `store_content_types` says which may be kept.
    let untyped_body = head.content_type.is_none()
        && cfg.store_content_types.is_some()
        && head.length.is_some_and(|n| n > 0);
    let replayable = replayable(cfg, head) && !untyped_body && head.headers_fit && head.readable;
    if cfg.inbox().is_some() {
        // Any 2xx marks the message handled; in full when a record can hold (and replay) it.
        if !(200..=299).contains(&head.status) {
            return Keep::Release;
        }
        let whole = cfg.inbox().is_some_and(|i| i.duplicate_status.is_none()) && replayable && !too_large;
        return if whole { Keep::Full } else { Keep::StatusOnly };
    }
    if !cfg.store_statuses.contains(head.status) || !replayable {
        return Keep::Release;
    }
    match (too_large, cfg.record_too_large) {
        (false, _) => Keep::Full,
        (true, TooLarge::OmitBody) => Keep::WithoutBody,
        (true, TooLarge::Release) => Keep::Release,
    }
}

/// Not a stream or an upgrade, and of a content type `store_content_types` allows (an answer
/// without one is judged by its body: [`needs_empty_body`]).
fn replayable(cfg: &Config, head: &Head) -> bool {
    if head.upgrade || head.status == 101 {
        return false;
    }
    let Some(ct) = head.content_type.as_deref() else { return true };
    let Some(media) = MediaType::parse(ct) else {
        // Unparseable: keep the bytes when every type is kept, refuse a narrowed list.
        return cfg.store_content_types.is_none();
    };
    if is_stream(&media) {
        return false;
    }
    cfg.store_content_types.as_ref().is_none_or(|list| list.iter().any(|p| p.matches(&media)))
}

/// Answers that are read as they arrive, which a replay of stored bytes cannot be.
fn is_stream(media: &MediaType) -> bool {
    match (media.kind.as_str(), media.subtype.as_str()) {
        ("text", "event-stream") | ("multipart", "x-mixed-replace") => true,
        ("application", sub) => sub == "grpc" || sub.starts_with("grpc+") || sub.starts_with("grpc-web"),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: &str) -> Config {
        let json = format!(r#"{{"store_cluster":"s","max_record_bytes":100{extra}}}"#);
        Config::from_json(json.as_bytes()).unwrap()
    }

    fn head(status: u16, ct: Option<&str>, length: Option<u64>) -> Head {
        Head {
            status,
            content_type: ct.map(|c| c.as_bytes().to_vec()),
            length,
            upgrade: false,
            headers_fit: true,
            readable: true,
        }
    }

    use Keep::{Full, Release, StatusOnly, WithoutBody};

    const DEFAULT: &str = "";
    const JSON_ONLY: &str = r#","store_content_types":["application/json","+json","text/*"]"#;
    const WITH_4XX: &str = r#","store_statuses":["2xx","404","5xx"]"#;
    const RELEASE_LARGE: &str = r#","record_too_large":"release""#;
    const INBOX: &str = r#","mode":"inbox""#;
    const INBOX_BARE: &str = r#","mode":"inbox","inbox":{"duplicate_status":204}"#;

    /// Configuration, status, content type, body length: what becomes of the answer.
    type Row = (&'static str, u16, Option<&'static str>, Option<u64>, Keep);

    /// The whole decision as a table.
    #[test]
    fn what_a_response_becomes() {
        let rows: &[Row] = &[
            // Every 2xx, whatever its content type, with or without a known length.
            (DEFAULT, 201, Some("application/json"), Some(2), Full),
            (DEFAULT, 200, Some("text/plain; charset=utf-8"), None, Full),
            (DEFAULT, 201, Some("application/xml"), Some(100), Full),
            (DEFAULT, 201, Some("application/octet-stream"), Some(0), Full),
            (DEFAULT, 201, Some("nonsense"), None, Full),
            (DEFAULT, 201, None, Some(50), Full),
            (DEFAULT, 204, None, None, Full),
            (DEFAULT, 299, Some("application/json"), None, Full),
            // Other statuses are released unless listed.
            (DEFAULT, 302, None, None, Release),
            (DEFAULT, 404, Some("application/json"), None, Release),
            (DEFAULT, 500, Some("application/json"), None, Release),
            (DEFAULT, 0, None, None, Release),
            (WITH_4XX, 404, Some("application/json"), None, Full),
            (WITH_4XX, 400, Some("application/json"), None, Release),
            (WITH_4XX, 503, Some("application/json"), None, Full),
            // Streams and upgrades are never kept.
            (DEFAULT, 200, Some("text/event-stream"), None, Release),
            (DEFAULT, 200, Some("Text/Event-Stream; charset=utf-8"), None, Release),
            (DEFAULT, 200, Some("multipart/x-mixed-replace; boundary=x"), None, Release),
            (DEFAULT, 200, Some("application/grpc"), None, Release),
            (DEFAULT, 200, Some("application/grpc+proto"), None, Release),
            (DEFAULT, 200, Some("application/grpc-web+proto"), None, Release),
            (DEFAULT, 101, None, None, Release),
            // Too large: without the body, or released.
            (DEFAULT, 201, Some("application/json"), Some(100), Full),
            (DEFAULT, 201, Some("application/json"), Some(101), WithoutBody),
            (WITH_4XX, 404, None, Some(101), WithoutBody),
            (RELEASE_LARGE, 201, Some("application/json"), Some(101), Release),
            (RELEASE_LARGE, 201, Some("application/json"), Some(100), Full),
            // store_content_types narrows; no content type counts only with an empty body.
            (JSON_ONLY, 201, Some("application/json; charset=utf-8"), None, Full),
            (JSON_ONLY, 201, Some("application/problem+json"), None, Full),
            (JSON_ONLY, 201, Some("application/vnd.api+json"), None, Full),
            (JSON_ONLY, 201, Some("text/csv"), None, Full),
            (JSON_ONLY, 201, Some("application/xml"), None, Release),
            (JSON_ONLY, 201, Some("application/jsonx"), None, Release),
            (JSON_ONLY, 201, Some("garbage"), None, Release),
            (JSON_ONLY, 204, None, None, Full),
            (JSON_ONLY, 201, None, Some(0), Full),
            (JSON_ONLY, 201, None, Some(5), Release),
            // Inbox mode: any 2xx marks the message handled, whole when a record can hold it.
            (INBOX, 200, Some("text/plain"), Some(2), Full),
            (INBOX, 202, None, Some(8), Full),
            (INBOX, 200, Some("text/event-stream"), None, StatusOnly),
            (INBOX, 200, None, Some(101), StatusOnly),
            (INBOX, 302, None, None, Release),
            (INBOX, 404, Some("application/json"), None, Release),
            (INBOX, 500, Some("application/json"), None, Release),
            (INBOX_BARE, 200, Some("application/json"), Some(2), StatusOnly),
        ];
        for (extra, status, ct, length, expected) in rows {
            let got = decide(&cfg(extra), &head(*status, *ct, *length));
            assert_eq!(got, *expected, "{extra} {status} {ct:?} {length:?}");
        }
    }

    #[test]
    fn headers_a_record_cannot_carry_are_not_kept() {
        let mut h = head(201, Some("application/json"), None);
        h.headers_fit = false;
        assert_eq!(decide(&cfg(DEFAULT), &h), Release);
        let mut h = head(201, Some("application/json"), None);
        h.readable = false;
        assert_eq!(decide(&cfg(DEFAULT), &h), Release);
        assert_eq!(decide(&cfg(INBOX), &h), StatusOnly);
        let mut up = head(200, None, None);
        up.upgrade = true;
        assert_eq!(decide(&cfg(DEFAULT), &up), Release);
    }

    #[test]
    fn the_body_can_only_narrow_the_decision() {
        let c = cfg(DEFAULT);
        let h = head(201, Some("application/json"), None);
        assert_eq!(decide(&c, &h), Full);
        assert_eq!(decide(&c, &h.with_body(100)), Full);
        assert_eq!(decide(&c, &h.with_body(101)), WithoutBody);
        let declared = head(201, Some("application/json"), Some(500));
        assert_eq!(declared.with_body(10).length, Some(500), "at least what was declared");
        let untyped = head(201, None, None);
        assert_eq!(decide(&cfg(JSON_ONLY), &untyped), Full);
        assert_eq!(decide(&cfg(JSON_ONLY), &untyped.with_body(1)), Release);
        assert_eq!(decide(&cfg(DEFAULT), &untyped.with_body(1)), Full);
    }

    #[test]
    fn readable_means_once_and_recordable() {
        let of = |pairs: &'static [(&'static str, &'static [u8])]| {
            move |name: &str| pairs.iter().filter(|(n, _)| *n == name).map(|(_, v)| v.to_vec()).collect()
        };
        assert!(Head::readable_with(of(&[("content-type", b"text/plain"), ("content-encoding", b"gzip")])));
        assert!(Head::readable_with(of(&[("location", b"/a"), ("location", b"/b")])));
        assert!(!Head::readable_with(of(&[("content-type", b"text/plain"), ("content-type", b"text/html")])));
        assert!(!Head::readable_with(of(&[("content-type", b"application/json\xff")])));
        assert!(!Head::readable_with(of(&[("content-encoding", b"gzip"), ("content-encoding", b"br")])));
    }
}
