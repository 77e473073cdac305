//! A stored response and its wire form.
//!
//! The store keeps the record as opaque bytes, so the encoding is the filter's alone: a magic and
//! version, the status, the allow-listed headers with length prefixes, then the body verbatim.
//! Binary because the body is raw bytes and must not be base64'd; strict on decode because the
//! bytes come back over the network and a replay must never send something malformed.
//!
//! ```text
//! "IDR1" | status u16 | header count u16 | (name len u16, name, value len u32, value)* | body
//! ```

use crate::headers;

const MAGIC: &[u8; 4] = b"IDR1";
pub const MAX_HEADERS: usize = 64;
pub const MAX_HEADER_VALUE: usize = 16 * 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeError(pub &'static str);

impl Record {
    pub fn encode(&self) -> Vec<u8> {
        let header_bytes: usize = self.headers.iter().map(|(n, v)| 6 + n.len() + v.len()).sum();
        let mut out = Vec::with_capacity(8 + header_bytes + self.body.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.status.to_be_bytes());
        out.extend_from_slice(&(self.headers.len() as u16).to_be_bytes());
        for (name, value) in &self.headers {
            out.extend_from_slice(&(name.len() as u16).to_be_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&(value.len() as u32).to_be_bytes());
            out.extend_from_slice(value.as_bytes());
        }
        out.extend_from_slice(&self.body);
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Record, DecodeError> {
        let mut r = Reader(bytes);
        if r.take(4)? != MAGIC {
            return Err(DecodeError("bad magic"));
        }
        let status = r.u16()?;
        if !(200..=299).contains(&status) {
            return Err(DecodeError("status is not 2xx"));
        }
        let count = r.u16()? as usize;
        if count > MAX_HEADERS {
            return Err(DecodeError("too many headers"));
        }
        let mut headers = Vec::with_capacity(count);
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
            headers.push((name.to_string(), value.to_string()));
        }
        Ok(Record { status, headers, body: r.0.to_vec() })
    }
}

/// True when response headers fit a record: as many and as long as [`Record::decode`] takes back.
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Record {
        Record {
            status: 201,
            headers: vec![
                ("content-type".into(), "application/json".into()),
                ("location".into(), "/orders/1".into()),
            ],
            body: b"{\"id\":\"ord_1\"}\x00\xff".to_vec(),
        }
    }

    #[test]
    fn round_trip() {
        let r = sample();
        assert_eq!(Record::decode(&r.encode()), Ok(r));
        let empty = Record { status: 204, headers: vec![], body: vec![] };
        assert_eq!(Record::decode(&empty.encode()), Ok(empty));
    }

    #[test]
    fn rejects_garbage() {
        let good = sample().encode();
        for cut in 0..good.len() - sample().body.len() {
            assert!(Record::decode(&good[..cut]).is_err(), "truncated at {cut}");
        }
        assert!(Record::decode(b"").is_err());
        assert!(Record::decode(b"IDR2\x00\xc9\x00\x00").is_err());
        assert!(Record::decode(b"IDR1\x01\xf4\x00\x00").is_err(), "500 is never stored");
        let bad_name = Record { status: 200, headers: vec![("set-cookie".into(), "a".into())], body: vec![] };
        assert!(Record::decode(&bad_name.encode()).is_err());
        let bad_value =
            Record { status: 200, headers: vec![("location".into(), "a\r\nb".into())], body: vec![] };
        assert!(Record::decode(&bad_value.encode()).is_err());
    }
}
