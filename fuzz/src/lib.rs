//! Structured inputs shared by the fuzz targets: header names biased towards the ones the filter
//! treats specially, byte strings that can be long without a long fuzz input, records.

use arbitrary::Arbitrary;
use idempotency_filter::record::Record;

/// A header name: mostly one the filter cares about, sometimes anything.
#[derive(Arbitrary, Debug, Clone)]
pub enum Name {
    ContentType,
    Location,
    Etag,
    Link,
    SetCookie,
    ContentLength,
    Date,
    Status,
    UpstreamServiceTime,
    Upper,
    Any(String),
}

impl Name {
    pub fn name(&self) -> String {
        match self {
            Name::ContentType => "content-type",
            Name::Location => "location",
            Name::Etag => "etag",
            Name::Link => "link",
            Name::SetCookie => "set-cookie",
            Name::ContentLength => "content-length",
            Name::Date => "date",
            Name::Status => ":status",
            Name::UpstreamServiceTime => "x-envoy-upstream-service-time",
            Name::Upper => "Location",
            Name::Any(s) => return s.clone(),
        }
        .to_string()
    }
}

/// Bytes: raw, text, or `len` copies of one byte (a long value from a short input).
#[derive(Arbitrary, Debug, Clone)]
pub enum Bytes {
    Raw(Vec<u8>),
    Text(String),
    Fill { byte: u8, len: u16 },
    Json,
}

impl Bytes {
    pub fn to_vec(&self) -> Vec<u8> {
        match self {
            Bytes::Raw(b) => b.clone(),
            Bytes::Text(s) => s.as_bytes().to_vec(),
            Bytes::Fill { byte, len } => vec![*byte; usize::from(*len)],
            Bytes::Json => b"{\"id\":\"ord_1\"}".to_vec(),
        }
    }

    pub fn to_string_lossy(&self) -> String {
        String::from_utf8_lossy(&self.to_vec()).into_owned()
    }
}

/// An HTTP status: mostly 2xx, or any number.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Status {
    Success(u8),
    Any(u16),
}

impl Status {
    pub fn code(self) -> u16 {
        match self {
            Status::Success(n) => 200 + u16::from(n % 100),
            Status::Any(n) => n,
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
        Record { status: self.status.code(), headers, body: self.body.to_vec() }
    }
}
