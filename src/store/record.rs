//! A stored response and its wire form.
//!
//! The store keeps the record as opaque bytes, so the encoding is the filter's alone: a magic and
//! version, the status, flags, the recorded headers with length prefixes, the request's print
//! (see [`crate::request::fingerprint`]), then the body verbatim. Binary because the body is raw bytes
//! and must not be base64'd; strict on decode because the bytes come back over the network and
//! a replay must never send something malformed.
//!
//! ```text
//! "IDR2" | status u16 | flags u8 | header count u16 | (name len u16, name, value len u32, value)*
//!        | [trailers: count u16 | (name len u16, name, value len u32, value)*]
//!        | [print: target 32 bytes | count u8 | (name len u8, name, digest 32 bytes)*] | body
//! flags: 1 the body was omitted (too large; the body part is empty), 2 a print follows,
//!        4 trailers follow (a gRPC answer: its `grpc-status` and the metadata after the message)
//! ```
//!
//! A gRPC answer's body is its length-prefixed message, as it went by.
//!
//! Records of the first format (`"IDR1"`, before the print and the flags; `2xx` only) are still
//! decoded, as records without a print: they replay as they did when they were written, until
//! they expire. No other magic decodes.

use crate::config::{MAX_FINGERPRINT_HEADERS, MAX_HEADER_NAME};
use crate::http::{grpc, headers};

const MAGIC: &[u8; 4] = b"IDR2";
const MAGIC_V1: &[u8; 4] = b"IDR1";
const FLAG_BODY_OMITTED: u8 = 1;
const FLAG_PRINT: u8 = 2;
const FLAG_TRAILERS: u8 = 4;
pub const MAX_HEADERS: usize = 64;
pub const MAX_HEADER_VALUE: usize = 16 * 1024;
/// The most a record holds besides its body: the fixed part, headers and trailers at their
/// limits, and a print of every fingerprinted header. What the replay listener reads past
/// `max_record_bytes`.
pub const MAX_FRAMING: usize = FIXED + 2 * FIELDS + PRINT;
/// Magic, status, flags.
const FIXED: usize = 4 + 2 + 1;
/// Headers (or trailers): a count, then each with its name and value lengths.
const FIELDS: usize = 2 + MAX_HEADERS * (2 + MAX_HEADER_NAME + 4 + MAX_HEADER_VALUE);
/// The target's digest and a count, then each fingerprinted header's name and digest.
const PRINT: usize = 32 + 1 + MAX_FINGERPRINT_HEADERS * (1 + 255 + 32);

pub type Digest32 = [u8; 32];

/// The parts of a request that are not its body, as digests (computed and compared by
/// `request::fingerprint`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestPrint {
    /// Method and path with query.
    pub target: Digest32,
    /// Each fingerprinted header (lower-case name) and the digest of all its values.
    pub headers: Vec<(String, Digest32)>,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Record {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// The answer's body was too large to keep: its replays carry none, and say so.
    pub body_omitted: bool,
    /// The request the record answers; `None` in inbox mode and in first-format records.
    pub print: Option<RequestPrint>,
    /// A gRPC answer's trailers, `grpc-status` among them; `None` for an HTTP answer.
    pub trailers: Option<Vec<(String, String)>>,
    /// When the store forgets the record (milliseconds since the Unix epoch), when whoever
    /// read it could tell: for `expiry_header`. Not part of the record's bytes.
    pub expires_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeError(pub &'static str);

impl Record {
    /// A record of `status` alone.
    pub fn status_only(status: u16) -> Record {
        Record { status, ..Record::default() }
    }

    pub fn encode(&self) -> Vec<u8> {
        let header_bytes: usize = self
            .headers
            .iter()
            .chain(self.trailers.iter().flatten())
            .map(|(n, v)| 6 + n.len() + v.len())
            .sum();
        let print_bytes = self
            .print
            .as_ref()
            .map_or(0, |p| 33 + p.headers.iter().map(|(n, _)| 33 + n.len()).sum::<usize>());
        let mut out = Vec::with_capacity(9 + header_bytes + print_bytes + self.body.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.status.to_be_bytes());
        let mut flags = 0;
        if self.body_omitted {
            flags |= FLAG_BODY_OMITTED;
        }
        if self.print.is_some() {
            flags |= FLAG_PRINT;
        }
        if self.trailers.is_some() {
            flags |= FLAG_TRAILERS;
        }
        out.push(flags);
        write_fields(&mut out, &self.headers);
        if let Some(trailers) = &self.trailers {
            write_fields(&mut out, trailers);
        }
        if let Some(print) = &self.print {
            out.extend_from_slice(&print.target);
            out.push(print.headers.len() as u8);
            for (name, digest) in &print.headers {
                out.push(name.len() as u8);
                out.extend_from_slice(name.as_bytes());
                out.extend_from_slice(digest);
            }
        }
        out.extend_from_slice(&self.body);
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Record, DecodeError> {
        let mut r = Reader(bytes);
        let (status, flags) = match r.take(4)? {
            m if m == MAGIC => {
                let status = r.u16()?;
                if !(200..=599).contains(&status) {
                    return Err(DecodeError("status out of range"));
                }
                let flags = r.take(1)?[0];
                if flags & !(FLAG_BODY_OMITTED | FLAG_PRINT | FLAG_TRAILERS) != 0 {
                    return Err(DecodeError("unknown flags"));
                }
                (status, flags)
            }
            m if m == MAGIC_V1 => {
                let status = r.u16()?;
                if !(200..=299).contains(&status) {
                    return Err(DecodeError("status is not 2xx"));
                }
                (status, 0)
            }
            _ => return Err(DecodeError("bad magic")),
        };
        let headers = read_fields(&mut r)?;
        let trailers = if flags & FLAG_TRAILERS != 0 {
            let trailers = read_fields(&mut r)?;
            let status = trailers.iter().find(|(n, _)| n == "grpc-status");
            if status.is_none_or(|(_, v)| grpc::parse_status(v.as_bytes()).is_none()) {
                return Err(DecodeError("trailers without a grpc-status"));
            }
            Some(trailers)
        } else {
            None
        };
        let print = if flags & FLAG_PRINT != 0 { Some(read_print(&mut r)?) } else { None };
        let body_omitted = flags & FLAG_BODY_OMITTED != 0;
        if body_omitted && !r.0.is_empty() {
            return Err(DecodeError("a body where it was omitted"));
        }
        Ok(Record { status, headers, body: r.0.to_vec(), body_omitted, print, trailers, expires_ms: None })
    }
}

fn write_fields(out: &mut Vec<u8>, fields: &[(String, String)]) {
    out.extend_from_slice(&(fields.len() as u16).to_be_bytes());
    for (name, value) in fields {
        out.extend_from_slice(&(name.len() as u16).to_be_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&(value.len() as u32).to_be_bytes());
        out.extend_from_slice(value.as_bytes());
    }
}

/// Headers or trailers: names a replay may send, values it can send as they are.
fn read_fields(r: &mut Reader<'_>) -> Result<Vec<(String, String)>, DecodeError> {
    let count = r.u16()? as usize;
    if count > MAX_HEADERS {
        return Err(DecodeError("too many headers"));
    }
    let mut fields = Vec::with_capacity(count);
    for _ in 0..count {
        let name_len = r.u16()? as usize;
        let name = std::str::from_utf8(r.take(name_len)?).map_err(|_| DecodeError("header name"))?;
        if !headers::is_valid_name(name) || headers::is_never_replayed(name) {
            return Err(DecodeError("header name"));
        }
        let value_len = r.u32()? as usize;
        if value_len > MAX_HEADER_VALUE {
            return Err(DecodeError("header value too long"));
        }
        let value = r.take(value_len)?;
        if !headers::is_valid_value(value) {
            return Err(DecodeError("header value"));
        }
        let value = std::str::from_utf8(value).map_err(|_| DecodeError("header value"))?;
        fields.push((name.to_string(), value.to_string()));
    }
    Ok(fields)
}

fn read_print(r: &mut Reader<'_>) -> Result<RequestPrint, DecodeError> {
    let target = r.digest()?;
    let count = usize::from(r.take(1)?[0]);
    if count > MAX_FINGERPRINT_HEADERS {
        return Err(DecodeError("too many fingerprinted headers"));
    }
    let mut headers = Vec::with_capacity(count);
    for _ in 0..count {
        let len = usize::from(r.take(1)?[0]);
        let name = std::str::from_utf8(r.take(len)?).map_err(|_| DecodeError("fingerprinted header name"))?;
        if !headers::is_valid_name(name) {
            return Err(DecodeError("fingerprinted header name"));
        }
        headers.push((name.to_string(), r.digest()?));
    }
    Ok(RequestPrint { target, headers })
}

/// True when response headers fit a record: as many and as long as [`Record::decode`] takes back.
/// (Fingerprinted header names fit by construction: valid names of at most 255 bytes, checked
/// by the configuration.)
/// A response whose allow-listed headers do not fit is not stored, like a body over
/// `max_record_bytes`: a record that cannot be decoded would fail every replay of its key.
pub fn headers_fit(headers: &[(String, String)]) -> bool {
    headers.len() <= MAX_HEADERS
        && headers.iter().all(|(n, v)| n.len() <= usize::from(u16::MAX) && v.len() <= MAX_HEADER_VALUE)
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.0.len() < n {
            return Err(DecodeError("truncated"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u16(&mut self) -> Result<u16, DecodeError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn digest(&mut self) -> Result<[u8; 32], DecodeError> {
        let mut d = [0u8; 32];
        d.copy_from_slice(self.take(32)?);
        Ok(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn print() -> RequestPrint {
        RequestPrint {
            target: [7; 32],
            headers: vec![("x-tenant".into(), [9; 32]), ("content-type".into(), [1; 32])],
        }
    }

    fn sample() -> Record {
        Record {
            status: 201,
            headers: vec![
                ("content-type".into(), "application/json".into()),
                ("location".into(), "/orders/1".into()),
            ],
            body: b"{\"id\":\"ord_1\"}\x00\xff".to_vec(),
            body_omitted: false,
            print: Some(print()),
            trailers: None,
            expires_ms: None,
        }
    }

    #[test]
    fn round_trip() {
        let r = sample();
        assert_eq!(Record::decode(&r.encode()), Ok(r));
        let empty = Record::status_only(204);
        assert_eq!(Record::decode(&empty.encode()), Ok(empty));
        let every_byte = Record { body: (0..=255).collect(), print: None, ..sample() };
        assert_eq!(Record::decode(&every_byte.encode()), Ok(every_byte));
        let omitted = Record { body: vec![], body_omitted: true, ..sample() };
        assert_eq!(Record::decode(&omitted.encode()), Ok(omitted));
        for status in [200, 303, 404, 409, 500, 599] {
            let r = Record::status_only(status);
            assert_eq!(Record::decode(&r.encode()), Ok(r));
        }
    }

    #[test]
    fn the_largest_framing_is_max_framing() {
        let name = |i: usize| format!("x-{i:0>254}");
        let fields = |n: usize| (0..n).map(|i| (name(i), "v".repeat(MAX_HEADER_VALUE))).collect::<Vec<_>>();
        let print = RequestPrint {
            target: [0; 32],
            headers: (0..MAX_FINGERPRINT_HEADERS).map(|i| (format!("x-{i:0>253}"), [0; 32])).collect(),
        };
        let largest = Record {
            headers: fields(MAX_HEADERS),
            trailers: Some(fields(MAX_HEADERS)),
            print: Some(print),
            ..Record::status_only(200)
        };
        assert_eq!(largest.encode().len(), MAX_FRAMING);
        // tests/support/harness.py (RECORD_FRAMING) sizes the shipped replay listeners with it.
        assert_eq!(MAX_FRAMING, 2_139_948);
    }

    #[test]
    fn first_format_records_still_decode() {
        // As the previous version encoded them: no flags, no print.
        let mut v1 = b"IDR1\x00\xc9\x00\x01\x00\x0ccontent-type\x00\x00\x00\x10application/json".to_vec();
        v1.extend_from_slice(b"{\"id\":1}");
        let r = Record::decode(&v1).unwrap();
        assert_eq!(r.status, 201);
        assert_eq!(r.headers, vec![("content-type".to_string(), "application/json".to_string())]);
        assert_eq!(r.body, b"{\"id\":1}");
        assert!(!r.body_omitted);
        assert_eq!(r.print, None);
        assert!(Record::decode(b"IDR1\x01\xf4\x00\x00").is_err(), "the first format kept 2xx only");
    }

    #[test]
    fn rejects_garbage() {
        let good = sample().encode();
        for cut in 0..good.len() - sample().body.len() {
            assert!(Record::decode(&good[..cut]).is_err(), "truncated at {cut}");
        }
        assert!(Record::decode(b"").is_err());
        assert!(Record::decode(b"IDR3\x00\xc9\x00\x00\x00").is_err());
        assert!(Record::decode(b"IDR2\x00\xc7\x00\x00\x00").is_err(), "199 is never stored");
        assert!(Record::decode(b"IDR2\x02\x58\x00\x00\x00").is_err(), "600 is not a status");
        assert!(Record::decode(b"IDR2\x00\xc9\x04\x00\x00").is_err(), "unknown flag");
        assert!(Record::decode(b"IDR2\x00\xc9\x01\x00\x00x").is_err(), "a body where omitted");
        let bad_name =
            Record { headers: vec![("set-cookie".into(), "a".into())], ..Record::status_only(200) };
        assert!(Record::decode(&bad_name.encode()).is_err());
        let bad_value =
            Record { headers: vec![("location".into(), "a\r\nb".into())], ..Record::status_only(200) };
        assert!(Record::decode(&bad_value.encode()).is_err());
        let bad_print = Record {
            print: Some(RequestPrint { target: [0; 32], headers: vec![("X-Tenant".into(), [0; 32])] }),
            ..Record::status_only(200)
        };
        assert!(Record::decode(&bad_print.encode()).is_err());
    }
}
