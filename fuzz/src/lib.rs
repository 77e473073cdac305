//! Structured inputs shared by the fuzz targets: header names biased towards the ones the filter
//! treats specially, byte strings that can be long without a long fuzz input, records (both
//! formats' fields: flags, the request's print).

use arbitrary::Arbitrary;
use idempotency_filter::config::MAX_FINGERPRINT_HEADERS;
use idempotency_filter::store::record::Record;
use idempotency_filter::store::record::{Digest32, RequestPrint};

/// A header name: mostly one the filter cares about, sometimes anything.
#[derive(Arbitrary, Debug, Clone)]
pub enum Name {
    ContentType,
    ContentEncoding,
    ContentRange,
    Location,
    Etag,
    Link,
    SetCookie,
    ContentLength,
    Date,
    Status,
    UpstreamServiceTime,
    Upgrade,
    AcceptEncoding,
    Tenant,
    Upper,
    Any(String),
}

impl Name {
    pub fn name(&self) -> String {
        match self {
            Name::ContentType => "content-type",
            Name::ContentEncoding => "content-encoding",
            Name::ContentRange => "content-range",
            Name::Location => "location",
            Name::Etag => "etag",
            Name::Link => "link",
            Name::SetCookie => "set-cookie",
            Name::ContentLength => "content-length",
            Name::Date => "date",
            Name::Status => ":status",
            Name::UpstreamServiceTime => "x-envoy-upstream-service-time",
            Name::Upgrade => "upgrade",
            Name::AcceptEncoding => "accept-encoding",
            Name::Tenant => "x-tenant",
            Name::Upper => "Location",
            Name::Any(s) => return s.clone(),
        }
        .to_string()
    }
}

/// Content codings and `accept-encoding` lists, as clients and upstreams write them.
pub const CODINGS: [&str; 14] = [
    "gzip",
    "br",
    "x-gzip",
    "identity",
    "gzip, br",
    "br;q=0",
    "gzip;q=0",
    "gzip;q=0.000, *",
    "*",
    "*;q=0",
    "deflate",
    "GZIP",
    "zstd;q=1.0, gzip;q=0.5",
    "",
];

/// Request bodies for `fingerprint_json`: the same document in other orders and spacings, with
/// ignored members (`/client_sent_at`, `/items/1`, `/meta/trace`, `/a~1b`) changed, and not JSON.
pub const JSON_DOCS: [&str; 10] = [
    r#"{"sku":"x","client_sent_at":"t1","items":[1,2,3],"meta":{"trace":"a","v":1},"a/b":0}"#,
    r#"{ "items" : [1, 2, 3], "a/b": 5, "meta": {"v": 1, "trace": "b"}, "sku": "x", "client_sent_at": "t2" }"#,
    r#"{"sku":"x","items":[1,9,3],"meta":{"v":1}}"#,
    r#"{"sku":"y","client_sent_at":"t1","items":[1,2,3]}"#,
    r#"{"n":1.0,"big":12345678901234567890123,"s":"\u0041"}"#,
    r#"{"n":1,"big":12345678901234567890124,"s":"A"}"#,
    r#"[{"a":1},{"a":1,"a":2}]"#,
    r#"{"a":1} trailing"#,
    "not json",
    "",
];

/// Bytes: raw, text, or `len` copies of one byte (a long value from a short input), or a value
/// the filter reads specially.
#[derive(Arbitrary, Debug, Clone)]
pub enum Bytes {
    Raw(Vec<u8>),
    Text(String),
    Fill {
        byte: u8,
        len: u16,
    },
    Json,
    /// One of [`JSON_DOCS`].
    Doc(u8),
    /// One of [`CODINGS`].
    Coding(u8),
}

impl Bytes {
    pub fn to_vec(&self) -> Vec<u8> {
        match self {
            Bytes::Raw(b) => b.clone(),
            Bytes::Text(s) => s.as_bytes().to_vec(),
            Bytes::Fill { byte, len } => vec![*byte; usize::from(*len)],
            Bytes::Json => b"{\"id\":\"ord_1\"}".to_vec(),
            Bytes::Doc(i) => JSON_DOCS[usize::from(*i) % JSON_DOCS.len()].as_bytes().to_vec(),
            Bytes::Coding(i) => CODINGS[usize::from(*i) % CODINGS.len()].as_bytes().to_vec(),
        }
    }

    pub fn to_string_lossy(&self) -> String {
        String::from_utf8_lossy(&self.to_vec()).into_owned()
    }
}

/// An HTTP status: mostly 2xx, often 4xx/5xx (kept with `store_statuses`), or any number.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Status {
    Success(u8),
    NotFound,
    Conflict,
    ServerError,
    Error(u8),
    Any(u16),
}

impl Status {
    pub fn code(self) -> u16 {
        match self {
            Status::Success(n) => 200 + u16::from(n % 100),
            Status::NotFound => 404,
            Status::Conflict => 409,
            Status::ServerError => 500,
            Status::Error(n) => 300 + u16::from(n) % 300,
            Status::Any(n) => n,
        }
    }
}

/// A digest: one byte repeated (short inputs) or any 32 bytes.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Digest {
    Fill(u8),
    Raw(Digest32),
}

impl Digest {
    pub fn bytes(self) -> Digest32 {
        match self {
            Digest::Fill(b) => [b; 32],
            Digest::Raw(d) => d,
        }
    }
}

/// A fingerprinted header name: mostly valid ones, sometimes one `decode` must refuse.
#[derive(Arbitrary, Debug, Clone)]
pub enum PrintName {
    Tenant,
    ContentType,
    AcceptLanguage,
    /// Valid, and as long as a name in a record can be (255 bytes).
    Longest,
    Upper,
    Empty,
    Any(String),
}

impl PrintName {
    /// The configuration admits names of at most 255 bytes only, and a record's print holds
    /// nothing longer (`u8` length): longer strings are cut to 255 bytes.
    pub fn name(&self) -> String {
        match self {
            PrintName::Tenant => "x-tenant".into(),
            PrintName::ContentType => "content-type".into(),
            PrintName::AcceptLanguage => "accept-language".into(),
            PrintName::Longest => "x".repeat(255),
            PrintName::Upper => "X-Tenant".into(),
            PrintName::Empty => String::new(),
            PrintName::Any(s) => {
                let mut end = s.len().min(255);
                while !s.is_char_boundary(end) {
                    end -= 1;
                }
                s[..end].to_string()
            }
        }
    }
}

/// The request's print in a record. At most `MAX_FINGERPRINT_HEADERS + 8` headers (a print
/// holds a `u8` count; the configuration admits at most `MAX_FINGERPRINT_HEADERS`).
#[derive(Arbitrary, Debug, Clone)]
pub struct ArbPrint {
    pub target: Digest,
    pub headers: Vec<(PrintName, Digest)>,
}

impl ArbPrint {
    pub fn to_print(&self) -> RequestPrint {
        RequestPrint {
            target: self.target.bytes(),
            headers: self
                .headers
                .iter()
                .take(MAX_FINGERPRINT_HEADERS + 8)
                .map(|(n, d)| (n.name(), d.bytes()))
                .collect(),
        }
    }
}

/// A record, valid or not; `repeat` appends `count` copies of one short header (past the header
/// limit).
#[derive(Arbitrary, Debug, Clone)]
pub struct ArbRecord {
    pub status: Status,
    pub headers: Vec<(Name, Bytes)>,
    pub repeat: Option<(Name, u8)>,
    pub body: Bytes,
    pub body_omitted: bool,
    pub print: Option<ArbPrint>,
    /// A gRPC answer's trailers.
    pub trailers: Option<Vec<(Name, Bytes)>>,
}

impl ArbRecord {
    pub fn to_record(&self) -> Record {
        let mut headers: Vec<(String, String)> =
            self.headers.iter().map(|(n, v)| (n.name(), v.to_string_lossy())).collect();
        if let Some((n, count)) = &self.repeat {
            for i in 0..*count {
                headers.push((n.name(), format!("v{i}")));
            }
        }
        Record {
            status: self.status.code(),
            headers,
            body: self.body.to_vec(),
            body_omitted: self.body_omitted,
            print: self.print.as_ref().map(ArbPrint::to_print),
            trailers: self
                .trailers
                .as_ref()
                .map(|t| t.iter().map(|(n, v)| (n.name(), v.to_string_lossy())).collect()),
            expires_ms: None,
        }
    }
}
