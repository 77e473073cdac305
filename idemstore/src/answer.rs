//! The filter's record of an answer, written by an operator: what `idemstore records resolve`
//! commits for a key in doubt, so that the key's retries replay it. The form is the filter's
//! (`src/store/record.rs`, the second format, `IDR2`), in its simplest case: no request print,
//! no trailers, the body kept.
//!
//! ```text
//! "IDR2" | status u16 BE | flags u8 = 0 | header count u16 BE
//!        | (name len u16 BE, name, value len u32 BE, value)* | body
//! ```
//!
//! Checked as the filter decodes it, so that what is committed always replays: a status in
//! `200..=599`; at most [`MAX_HEADERS`] headers, each name a lower-case token of at most
//! [`MAX_HEADER_NAME`] bytes that a replay may carry (not `set-cookie`, hop-by-hop or framing
//! headers, nor `content-length` or `date`), each value visible ASCII, spaces and tabs, at most
//! [`MAX_HEADER_VALUE`] bytes. A body without a `content-type` gets `application/json`.
//!
//! Owns the encoder ([`encode`]), the parser of an operator's `name: value` ([`parse_header`])
//! and the check of a record received by the admin route ([`check`]); uses nothing of this
//! crate, and the protocol's header-name rule.

use idem_protocol as proto;

/// The filter's record magic, second format.
pub const MAGIC: &[u8; 4] = b"IDR2";
/// Headers in a record at most (the filter's decoder refuses more).
pub const MAX_HEADERS: usize = 64;
/// A header value's bytes at most.
pub const MAX_HEADER_VALUE: usize = 16 * 1024;
/// A header name's bytes at most (the filter's configuration takes no longer one).
pub const MAX_HEADER_NAME: usize = 256;
/// The `content-type` a body without one gets.
pub const DEFAULT_CONTENT_TYPE: &str = "application/json";

/// Headers a replay never carries; the filter refuses a record that has one.
const NEVER_REPLAYED: [&str; 13] = [
    "set-cookie",
    "set-cookie2",
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "date",
];

fn is_name(name: &str) -> bool {
    name.len() <= MAX_HEADER_NAME && proto::is_header_name(name)
}

fn is_value(value: &[u8]) -> bool {
    value.len() <= MAX_HEADER_VALUE && value.iter().all(|&b| b == b'\t' || (0x20..0x7f).contains(&b))
}

fn check_header(name: &str, value: &str) -> Result<(), String> {
    if !is_name(name) {
        return Err(format!(
            "header name {name:?}: a lower-case HTTP token of 1 to {MAX_HEADER_NAME} characters"
        ));
    }
    if NEVER_REPLAYED.contains(&name) {
        return Err(format!("header {name}: a replay never carries it"));
    }
    if !is_value(value.as_bytes()) {
        let most = MAX_HEADER_VALUE;
        return Err(format!(
            "header {name}: the value must be visible ASCII, spaces and tabs, at most {most} bytes"
        ));
    }
    Ok(())
}

/// An operator's `name: value`: the name lower-cased, the value without the spaces around it.
pub fn parse_header(line: &str) -> Result<(String, String), String> {
    let (name, value) =
        line.split_once(':').ok_or_else(|| format!("header {line:?}: give it as 'name: value'"))?;
    let (name, value) = (name.to_ascii_lowercase(), value.trim_matches([' ', '\t']).to_owned());
    check_header(&name, &value)?;
    Ok((name, value))
}

/// The record of an answer of `status` with `headers` (as [`parse_header`] returns them) and
/// `body`; a body (not empty) without a `content-type` gets [`DEFAULT_CONTENT_TYPE`].
pub fn encode(status: u16, headers: &[(String, String)], body: &[u8]) -> Result<Vec<u8>, String> {
    if !(200..=599).contains(&status) {
        return Err(format!("status {status}: the filter replays 200 to 599"));
    }
    let mut headers = headers.to_vec();
    if !body.is_empty() && !headers.iter().any(|(n, _)| n == "content-type") {
        headers.push(("content-type".to_owned(), DEFAULT_CONTENT_TYPE.to_owned()));
    }
    if headers.len() > MAX_HEADERS {
        return Err(format!("{} headers: a record holds at most {MAX_HEADERS}", headers.len()));
    }
    let mut out = Vec::with_capacity(
        9 + body.len() + headers.iter().map(|(n, v)| 6 + n.len() + v.len()).sum::<usize>(),
    );
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&status.to_be_bytes());
    out.push(0);
    out.extend_from_slice(&u16::try_from(headers.len()).map_err(|_| "too many headers")?.to_be_bytes());
    for (name, value) in &headers {
        check_header(name, value)?;
        out.extend_from_slice(&u16::try_from(name.len()).map_err(|_| "header name too long")?.to_be_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(
            &u32::try_from(value.len()).map_err(|_| "header value too long")?.to_be_bytes(),
        );
        out.extend_from_slice(value.as_bytes());
    }
    out.extend_from_slice(body);
    Ok(out)
}

/// Checks that `record` is what [`encode`] writes (flags 0, every rule above); its status.
pub fn check(record: &[u8]) -> Result<u16, String> {
    let mut r = Reader(record);
    if r.take(4)? != MAGIC {
        return Err("not a filter record (IDR2)".to_owned());
    }
    let status = r.u16()?;
    if !(200..=599).contains(&status) {
        return Err(format!("status {status}: the filter replays 200 to 599"));
    }
    if r.take(1)? != [0] {
        return Err("flags other than 0 (a print, trailers, an omitted body)".to_owned());
    }
    let count = usize::from(r.u16()?);
    if count > MAX_HEADERS {
        return Err(format!("{count} headers: a record holds at most {MAX_HEADERS}"));
    }
    for _ in 0..count {
        let len = usize::from(r.u16()?);
        let name = std::str::from_utf8(r.take(len)?).map_err(|_| "a header name is not ASCII")?;
        let len = usize::try_from(r.u32()?).map_err(|_| "a header value too long")?;
        if len > MAX_HEADER_VALUE {
            return Err(format!("header {name}: the value is over {MAX_HEADER_VALUE} bytes"));
        }
        let value = std::str::from_utf8(r.take(len)?).map_err(|_| format!("header {name}: not ASCII"))?;
        check_header(name, value)?;
    }
    Ok(status)
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("the record is cut short".to_owned());
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u16(&mut self) -> Result<u16, String> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(name: &str, value: &str) -> (String, String) {
        (name.to_owned(), value.to_owned())
    }

    #[test]
    fn the_bytes_are_the_filters_record() {
        let record = encode(201, &[h("location", "/orders/1")], b"{\"id\":1}").unwrap();
        let mut expected = Vec::new();
        expected.extend_from_slice(b"IDR2"); // magic
        expected.extend_from_slice(&[0x00, 0xc9]); // status 201
        expected.push(0x00); // flags: no print, no trailers, body kept
        expected.extend_from_slice(&[0x00, 0x02]); // two headers
        expected.extend_from_slice(&[0x00, 0x08]); // "location"
        expected.extend_from_slice(b"location");
        expected.extend_from_slice(&[0x00, 0x00, 0x00, 0x09]); // "/orders/1"
        expected.extend_from_slice(b"/orders/1");
        expected.extend_from_slice(&[0x00, 0x0c]); // "content-type", added for the body
        expected.extend_from_slice(b"content-type");
        expected.extend_from_slice(&[0x00, 0x00, 0x00, 0x10]); // "application/json"
        expected.extend_from_slice(b"application/json");
        expected.extend_from_slice(b"{\"id\":1}"); // the body
        assert_eq!(record, expected);
        assert_eq!(check(&record), Ok(201));
        // The store reads the status from the same head.
        assert_eq!(crate::backend::record_status(&record), Some(201));
    }

    #[test]
    fn status_alone_and_a_given_content_type() {
        assert_eq!(encode(204, &[], b"").unwrap(), b"IDR2\x00\xcc\x00\x00\x00");
        let record = encode(200, &[h("content-type", "text/plain")], b"ok").unwrap();
        assert_eq!(record, b"IDR2\x00\xc8\x00\x00\x01\x00\x0ccontent-type\x00\x00\x00\x0atext/plainok");
        assert_eq!(check(&record), Ok(200));
    }

    #[test]
    fn operators_headers() {
        assert_eq!(parse_header("Location: /orders/1 "), Ok(h("location", "/orders/1")));
        assert_eq!(parse_header("x-a:b:c"), Ok(h("x-a", "b:c")));
        assert_eq!(parse_header("x-empty:"), Ok(h("x-empty", "")));
        for bad in [
            "no colon",
            ": v",
            "two words: v",
            "set-cookie: a=b",
            "Content-Length: 3",
            "x: caf\u{e9}",
            "x: a\rb",
        ] {
            assert!(parse_header(bad).is_err(), "{bad:?}");
        }
        assert!(parse_header(&format!("x: {}", "v".repeat(MAX_HEADER_VALUE))).is_ok());
        assert!(parse_header(&format!("x: {}", "v".repeat(MAX_HEADER_VALUE + 1))).is_err());
        assert!(parse_header(&format!("{}: v", "x".repeat(MAX_HEADER_NAME + 1))).is_err());
    }

    #[test]
    fn refusals() {
        assert!(encode(199, &[], b"").is_err());
        assert!(encode(600, &[], b"").is_err());
        let many: Vec<_> = (0..MAX_HEADERS).map(|i| h(&format!("x-{i}"), "v")).collect();
        assert!(encode(200, &many, b"").is_ok());
        // The default content-type is one more: over the limit.
        assert!(encode(200, &many, b"body").is_err());
        assert!(encode(200, &[h("Upper", "v")], b"").is_err());
        // What the admin route refuses: anything the encoder would not write.
        let good = encode(200, &[h("x-a", "b")], b"body").unwrap();
        assert_eq!(check(&good), Ok(200));
        assert!(check(&good[..good.len() - 4]).is_ok(), "the body is whatever follows");
        assert!(check(&good[..12]).is_err());
        assert!(check(b"IDR1\x00\xc8").is_err());
        assert!(check(b"IDR2\x00\xc8\x02\x00\x00").is_err());
        assert!(check(b"IDR2\x00\x64\x00\x00\x00").is_err());
        assert!(check(b"IDR2\x00\xc8\x00\x00\x01\x00\x0aset-cookie\x00\x00\x00\x01a").is_err());
        assert!(check(b"").is_err());
    }
}
