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

use std::fmt;

use crate::config::{Config, TooLarge};
use crate::headers::MediaType;

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

/// What the response headers tell, for the decision.
#[derive(Debug, Clone, Copy)]
pub struct Head<'a> {
    pub status: u16,
    pub content_type: Option<&'a [u8]>,
    /// `content-length`, when given.
    pub length: Option<u64>,
    /// An `upgrade` header, or `101`.
    pub upgrade: bool,
    /// The recorded headers fit a record (see [`crate::record::headers_fit`]).
    pub headers_fit: bool,
    /// Each header that says how to read the body ([`crate::headers::REPRESENTATION`]) is there
    /// at most once, with a value a record can keep: else a replay could not say it the same way.
    pub readable: bool,
}

impl Head<'_> {
    /// [`Head::readable`] for a response whose header values `values_of` gives.
    pub fn readable_with(values_of: impl Fn(&str) -> Vec<Vec<u8>>) -> bool {
        crate::headers::REPRESENTATION.iter().all(|name| match values_of(name).as_slice() {
            [] => true,
            [one] => crate::headers::is_valid_value(one),
            _ => false,
        })
    }
}

/// The decision on the response headers. [`Keep::Full`] may still become another decision
/// while the body streams: see [`too_large`] and [`untyped_body`].
pub fn on_head(cfg: &Config, head: &Head) -> Keep {
    let success = (200..=299).contains(&head.status);
    if cfg.inbox().is_some() {
        if !success {
            return Keep::Release;
        }
        let whole = cfg.inbox().is_some_and(|i| i.duplicate_status.is_none())
            && replayable(cfg, head)
            && head.headers_fit
            && head.readable
            && head.length.is_none_or(|n| n <= cfg.max_record_bytes as u64);
        return if whole { Keep::Full } else { Keep::StatusOnly };
    }
    if !cfg.store_statuses.contains(head.status)
        || !replayable(cfg, head)
        || !head.headers_fit
        || !head.readable
    {
        return Keep::Release;
    }
    if head.length.is_some_and(|n| n > cfg.max_record_bytes as u64) {
        return too_large(cfg);
    }
    Keep::Full
}

/// The body turned out larger than `max_record_bytes`.
pub fn too_large(cfg: &Config) -> Keep {
    if cfg.inbox().is_some() {
        return Keep::StatusOnly;
    }
    match cfg.record_too_large {
        TooLarge::OmitBody => Keep::WithoutBody,
        TooLarge::Release => Keep::Release,
    }
}

/// An answer without a content type turned out to have a body, and `store_content_types`
/// lists what may be kept: what the bytes are is unknown, so they are not.
pub fn untyped_body(cfg: &Config) -> Keep {
    if cfg.inbox().is_some() {
        Keep::StatusOnly
    } else {
        Keep::Release
    }
}

/// True when an answer without a content type may be kept only if its body is empty.
pub fn needs_empty_body(cfg: &Config, head: &Head) -> bool {
    head.content_type.is_none() && cfg.store_content_types.is_some()
}

/// Not a stream or an upgrade, and of a content type `store_content_types` allows (an answer
/// without one is judged by its body: [`needs_empty_body`]).
fn replayable(cfg: &Config, head: &Head) -> bool {
    if head.upgrade || head.status == 101 {
        return false;
    }
    let Some(ct) = head.content_type else { return true };
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

/// An entry of `store_content_types`: `type/subtype`, `type/*`, `*/*`, or a structured syntax
/// suffix such as `+json` (any `*/*+json`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MediaPattern {
    Exact(MediaType),
    AnySubtype(String),
    Any,
    Suffix(String),
}

impl MediaPattern {
    pub fn parse(s: &str) -> Option<MediaPattern> {
        if s != s.to_ascii_lowercase() || s.contains(';') || s.trim() != s {
            return None;
        }
        if let Some(suffix) = s.strip_prefix('+') {
            let ok = !suffix.is_empty() && suffix.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
            return ok.then(|| MediaPattern::Suffix(suffix.into()));
        }
        if s == "*/*" {
            return Some(MediaPattern::Any);
        }
        let media = MediaType::parse(s.as_bytes())?;
        match media.subtype.as_str() {
            "*" if media.kind != "*" => Some(MediaPattern::AnySubtype(media.kind)),
            _ if media.kind.contains('*') || media.subtype.contains('*') => None,
            _ => Some(MediaPattern::Exact(media)),
        }
    }

    pub fn matches(&self, media: &MediaType) -> bool {
        match self {
            MediaPattern::Exact(m) => m == media,
            MediaPattern::AnySubtype(kind) => *kind == media.kind,
            MediaPattern::Any => true,
            MediaPattern::Suffix(suffix) => media.subtype.rsplit_once('+').is_some_and(|(_, s)| s == suffix),
        }
    }
}

impl fmt::Display for MediaPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MediaPattern::Exact(m) => write!(f, "{}/{}", m.kind, m.subtype),
            MediaPattern::AnySubtype(kind) => write!(f, "{kind}/*"),
            MediaPattern::Any => f.write_str("*/*"),
            MediaPattern::Suffix(s) => write!(f, "+{s}"),
        }
    }
}

/// `store_statuses`: status classes (`2xx`) and single codes (`404`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusSet {
    /// `classes[n]`: the class `(n + 2)xx`, for 2xx to 5xx.
    classes: [bool; 4],
    codes: Vec<u16>,
}

impl Default for StatusSet {
    fn default() -> Self {
        StatusSet { classes: [true, false, false, false], codes: Vec::new() }
    }
}

impl StatusSet {
    pub fn empty() -> StatusSet {
        StatusSet { classes: [false; 4], codes: Vec::new() }
    }

    /// Adds `2xx`..`5xx` or a code 200..599; false for anything else.
    pub fn add(&mut self, entry: &str) -> bool {
        let b = entry.as_bytes();
        if let [c @ b'2'..=b'5', b'x' | b'X', b'x' | b'X'] = b {
            self.classes[usize::from(c - b'2')] = true;
            return true;
        }
        match entry.parse::<u16>() {
            Ok(code) if (200..=599).contains(&code) && b.len() == 3 => {
                self.codes.push(code);
                true
            }
            _ => false,
        }
    }

    pub fn contains(&self, status: u16) -> bool {
        let class = usize::from(status / 100).wrapping_sub(2);
        self.classes.get(class).copied().unwrap_or(false) || self.codes.contains(&status)
    }

    pub fn is_empty(&self) -> bool {
        !self.classes.iter().any(|c| *c) && self.codes.is_empty()
    }

    /// The entries, as the configuration takes them.
    pub fn entries(&self) -> Vec<String> {
        let classes = (0..4u16).filter(|i| self.classes[usize::from(*i)]).map(|i| format!("{}xx", i + 2));
        classes.chain(self.codes.iter().map(u16::to_string)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: &str) -> Config {
        let json = format!(r#"{{"store_cluster":"s","max_record_bytes":100{extra}}}"#);
        Config::from_json(json.as_bytes()).unwrap()
    }

    fn head(status: u16, ct: Option<&'static str>) -> Head<'static> {
        Head {
            status,
            content_type: ct.map(str::as_bytes),
            length: None,
            upgrade: false,
            headers_fit: true,
            readable: true,
        }
    }

    #[test]
    fn every_2xx_is_kept_whatever_its_type() {
        let c = cfg("");
        for ct in [
            Some("application/json"),
            Some("text/plain; charset=utf-8"),
            Some("application/xml"),
            Some("application/octet-stream"),
            Some("application/x-protobuf"),
            Some("image/png"),
            Some("nonsense"),
            None,
        ] {
            assert_eq!(on_head(&c, &head(201, ct)), Keep::Full, "{ct:?}");
        }
        for status in [199, 300, 302, 400, 404, 409, 500, 503, 0] {
            assert_eq!(on_head(&c, &head(status, Some("application/json"))), Keep::Release, "{status}");
        }
    }

    #[test]
    fn streams_and_upgrades_are_never_kept() {
        let c = cfg("");
        for ct in [
            "text/event-stream",
            "Text/Event-Stream; charset=utf-8",
            "multipart/x-mixed-replace; boundary=x",
            "application/grpc",
            "application/grpc+proto",
            "application/grpc-web+proto",
        ] {
            assert_eq!(on_head(&c, &head(200, Some(ct))), Keep::Release, "{ct}");
        }
        let mut up = head(200, None);
        up.upgrade = true;
        assert_eq!(on_head(&c, &up), Keep::Release);
    }

    #[test]
    fn too_large_omits_the_body_or_releases() {
        let c = cfg("");
        let mut big = head(201, Some("application/json"));
        big.length = Some(101);
        assert_eq!(on_head(&c, &big), Keep::WithoutBody);
        big.length = Some(100);
        assert_eq!(on_head(&c, &big), Keep::Full);
        assert_eq!(too_large(&c), Keep::WithoutBody);
        let r = cfg(r#","record_too_large":"release""#);
        big.length = Some(101);
        assert_eq!(on_head(&r, &big), Keep::Release);
        assert_eq!(too_large(&r), Keep::Release);
        let mut wide = head(201, None);
        wide.headers_fit = false;
        assert_eq!(on_head(&c, &wide), Keep::Release);
        let mut ambiguous = head(201, Some("application/json"));
        ambiguous.readable = false;
        assert_eq!(on_head(&c, &ambiguous), Keep::Release);
        assert_eq!(on_head(&cfg(r#","mode":"inbox""#), &ambiguous), Keep::StatusOnly);
    }

    #[test]
    fn store_content_types_narrows() {
        let c = cfg(r#","store_content_types":["application/json","+json","text/*"]"#);
        assert_eq!(on_head(&c, &head(201, Some("application/json; charset=utf-8"))), Keep::Full);
        assert_eq!(on_head(&c, &head(201, Some("application/problem+json"))), Keep::Full);
        assert_eq!(on_head(&c, &head(201, Some("application/vnd.api+json"))), Keep::Full);
        assert_eq!(on_head(&c, &head(201, Some("text/csv"))), Keep::Full);
        assert_eq!(on_head(&c, &head(201, Some("application/xml"))), Keep::Release);
        assert_eq!(on_head(&c, &head(201, Some("application/jsonx"))), Keep::Release);
        assert_eq!(on_head(&c, &head(201, Some("garbage"))), Keep::Release);
        assert_eq!(on_head(&c, &head(204, None)), Keep::Full);
        assert!(needs_empty_body(&c, &head(204, None)));
        assert!(!needs_empty_body(&cfg(""), &head(204, None)));
        assert_eq!(untyped_body(&c), Keep::Release);
    }

    #[test]
    fn store_statuses() {
        let c = cfg(r#","store_statuses":["2xx","404","409"]"#);
        for (status, kept) in [(200, true), (299, true), (404, true), (409, true), (400, false), (500, false)]
        {
            let k = on_head(&c, &head(status, Some("application/json")));
            assert_eq!(k == Keep::Full, kept, "{status}");
        }
        let c = cfg(r#","store_statuses":["4xx","5xx"]"#);
        assert_eq!(on_head(&c, &head(201, None)), Keep::Release);
        assert_eq!(on_head(&c, &head(422, None)), Keep::Full);
        assert_eq!(on_head(&c, &head(503, None)), Keep::Full);
        let mut s = StatusSet::empty();
        for bad in ["1xx", "6xx", "199", "600", "2x", "abc", "0404", " 404", "+404"] {
            assert!(!s.add(bad), "{bad}");
        }
        assert!(s.is_empty());
        assert!(s.add("3XX") && s.add("204"));
        assert_eq!(s.entries(), ["3xx", "204"]);
        assert!(s.contains(301) && s.contains(204) && !s.contains(200) && !s.contains(65535));
    }

    #[test]
    fn inbox_marks_any_2xx_handled() {
        let c = cfg(r#","mode":"inbox""#);
        assert_eq!(on_head(&c, &head(200, Some("text/plain"))), Keep::Full);
        assert_eq!(on_head(&c, &head(200, Some("text/event-stream"))), Keep::StatusOnly);
        assert_eq!(on_head(&c, &head(404, Some("application/json"))), Keep::Release);
        let mut big = head(200, None);
        big.length = Some(101);
        assert_eq!(on_head(&c, &big), Keep::StatusOnly);
        assert_eq!(too_large(&c), Keep::StatusOnly);
        let d = cfg(r#","mode":"inbox","inbox":{"duplicate_status":204}"#);
        assert_eq!(on_head(&d, &head(200, Some("application/json"))), Keep::StatusOnly);
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

    #[test]
    fn media_patterns() {
        for (p, shown) in [
            ("application/json", "application/json"),
            ("text/*", "text/*"),
            ("*/*", "*/*"),
            ("+json", "+json"),
            ("+xml", "+xml"),
        ] {
            assert_eq!(MediaPattern::parse(p).map(|p| p.to_string()).as_deref(), Some(shown), "{p}");
        }
        for bad in [
            "",
            "json",
            "Application/JSON",
            "application/json; charset=utf-8",
            "*/json",
            "+",
            "+j son",
            " text/*",
        ] {
            assert_eq!(MediaPattern::parse(bad), None, "{bad:?}");
        }
    }
}
