//! What makes two requests with one key "the same request": the fingerprint.
//!
//! The store compares one value, the body hash it is sent with `begin` (so a record for another
//! body is a `mismatch` without the record leaving the store). Everything else a retry must
//! repeat, the target (method, path and query exactly as received) and the request headers
//! listed in `fingerprint_headers`, travels as digests inside the record ([`RequestPrint`]), and
//! the filter compares them before it replays: the store needs no other comparison, and a `422`
//! can say which part differed.
//!
//! The body hash is SHA-256 of the raw bytes, or, with `fingerprint_json`, of the body parsed as
//! JSON with the ignored members taken out (and, when `canonical`, member order not counting):
//! see [`json_body_hash`]. Nothing is normalized that could make two different requests one:
//! the target is compared byte for byte, and JSON numbers by their exact text.

use serde_json::Value;
use sha2::{Digest, Sha256};
use std::fmt;

use crate::config::values::JsonPrint;
use crate::store::record::{Digest32, RequestPrint};

/// Which part of a request differed from the one a record was made for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Differs {
    Body,
    Target,
    /// A header listed in `fingerprint_headers` (its name, from the configuration).
    Header(String),
}

impl fmt::Display for Differs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Differs::Body => f.write_str("body"),
            Differs::Target => f.write_str("target"),
            Differs::Header(name) => write!(f, "header {name}"),
        }
    }
}

impl RequestPrint {
    /// `header(name)`: every value of a request header, in order.
    pub fn of(
        method: &[u8],
        path: &[u8],
        names: &[String],
        header: &dyn Fn(&str) -> Vec<Vec<u8>>,
    ) -> RequestPrint {
        let mut h = Sha256::new();
        h.update(b"idempotency-target/v1");
        for field in [method, path] {
            h.update((field.len() as u64).to_be_bytes());
            h.update(field);
        }
        let headers = names.iter().map(|name| (name.clone(), header_digest(&header(name)))).collect();
        RequestPrint { target: h.finalize().into(), headers }
    }

    /// What differs between the request a record was made for (`self`) and a retry. Headers are
    /// compared where both name them: a header added to or taken from `fingerprint_headers`
    /// since the record was made does not turn its retries into `422`s.
    pub fn differs_from(&self, retry: &RequestPrint) -> Option<Differs> {
        if self.target != retry.target {
            return Some(Differs::Target);
        }
        for (name, digest) in &self.headers {
            if let Some((_, other)) = retry.headers.iter().find(|(n, _)| n == name) {
                if other != digest {
                    return Some(Differs::Header(name.clone()));
                }
            }
        }
        None
    }
}

/// A header's values, length-prefixed: absent, empty and two values are all different.
fn header_digest(values: &[Vec<u8>]) -> Digest32 {
    let mut h = Sha256::new();
    h.update(b"idempotency-header/v1");
    h.update((values.len() as u64).to_be_bytes());
    for v in values {
        h.update((v.len() as u64).to_be_bytes());
        h.update(v);
    }
    h.finalize().into()
}

/// The body hash under `fingerprint_json`: a body that parses as JSON is hashed as its value,
/// less the members `ignore` points at (array elements become `null`, so that positions do not
/// shift), serialized compactly: insignificant whitespace never counts, member order counts
/// unless `canonical`. A body that does not parse is hashed as its raw bytes, like without the
/// option (behind a tag of its own, so that no raw body can spell a JSON body's hashed text).
/// Numbers keep their exact text (`1.0` is not `1`), strings their decoded value. A body that
/// spells serde_json's number token (see [`spells_number_token`]) is hashed as raw bytes too.
pub fn json_body_hash(body: &[u8], opts: &JsonPrint) -> Digest32 {
    let parsed = serde_json::from_slice::<Value>(body).ok().filter(|_| !spells_number_token(body));
    let Some(mut doc) = parsed else {
        let mut h = Sha256::new();
        h.update(b"idempotency-raw/v1\n");
        h.update(body);
        return h.finalize().into();
    };
    for pointer in &opts.ignore {
        remove(&mut doc, pointer);
    }
    let mut text = Vec::with_capacity(body.len());
    text.extend_from_slice(b"idempotency-json/v1\n");
    write_value(&mut text, &doc, opts.canonical);
    Sha256::digest(&text).into()
}

/// The key serde_json (with `arbitrary_precision`, which keeps numbers' exact text) reads a
/// number through: its parser takes the object `{"$serde_json::private::Number":"123"}` for the
/// number `123`, so such a body would hash as another body does.
const NUMBER_TOKEN: &str = "$serde_json::private::Number";

/// Whether a JSON string in `body` (a key or a value, escaped or not) is [`NUMBER_TOKEN`]: such
/// a body is compared as bytes, never as JSON. No real document needs it.
pub fn spells_number_token(body: &[u8]) -> bool {
    // A string can only spell the token with a `$`, raw or escaped.
    if !body.contains(&b'$') && !body.windows(6).any(|w| w == b"\\u0024") {
        return false;
    }
    let mut i = 0;
    while i < body.len() {
        if body[i] != b'"' {
            i += 1;
            continue;
        }
        // A string literal: to the next quote that no backslash escapes.
        let start = i;
        i += 1;
        while i < body.len() && body[i] != b'"' {
            i += if body[i] == b'\\' { 2 } else { 1 };
        }
        let literal = body.get(start..=i).unwrap_or_default();
        i += 1;
        // Escaped, the token is at most 6 bytes a character.
        if literal.len() <= 2 + 6 * NUMBER_TOKEN.len()
            && serde_json::from_slice::<String>(literal).is_ok_and(|s| s == NUMBER_TOKEN)
        {
            return true;
        }
    }
    false
}

/// Takes out what an RFC 6901 pointer points at, if anything.
fn remove(doc: &mut Value, pointer: &str) {
    let Some((parent, last)) = pointer.rsplit_once('/') else { return };
    let Some(parent) = doc.pointer_mut(parent) else { return };
    let token = last.replace("~1", "/").replace("~0", "~");
    match parent {
        Value::Object(map) => {
            map.shift_remove(&token);
        }
        Value::Array(items) => {
            // RFC 6901 indexes: `0`, or digits without a leading zero (no sign, no `01`).
            let index = (token == "0"
                || (!token.starts_with('0') && token.bytes().all(|b| b.is_ascii_digit())))
            .then(|| token.parse::<usize>().ok())
            .flatten();
            if let Some(item) = index.and_then(|i| items.get_mut(i)) {
                *item = Value::Null;
            }
        }
        _ => {}
    }
}

fn write_value(out: &mut Vec<u8>, v: &Value, canonical: bool) {
    match v {
        Value::Object(map) => {
            let mut members: Vec<(&String, &Value)> = map.iter().collect();
            if canonical {
                members.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push(b'{');
            for (i, (k, v)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_scalar(out, &Value::String(k.clone()));
                out.push(b':');
                write_value(out, v, canonical);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_value(out, item, canonical);
            }
            out.push(b']');
        }
        scalar => write_scalar(out, scalar),
    }
}

fn write_scalar(out: &mut Vec<u8>, v: &Value) {
    // Writing a string, number, boolean or null to a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, v);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(canonical: bool, ignore: &[&str]) -> JsonPrint {
        JsonPrint { canonical, ignore: ignore.iter().map(|s| s.to_string()).collect() }
    }

    fn headers(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Vec<Vec<u8>> {
        move |name| pairs.iter().filter(|(n, _)| *n == name).map(|(_, v)| v.as_bytes().to_vec()).collect()
    }

    #[test]
    fn the_target_is_method_path_and_query_exactly() {
        let none = headers(&[]);
        let p = |m: &str, path: &str| RequestPrint::of(m.as_bytes(), path.as_bytes(), &[], &none);
        let a = p("POST", "/orders?coupon=A");
        assert_eq!(a, p("POST", "/orders?coupon=A"));
        for other in [
            p("POST", "/orders?coupon=B"),
            p("POST", "/orders"),
            p("POST", "/orders/?coupon=A"),
            p("POST", "/Orders?coupon=A"),
            p("POST", "/orders?coupon=%41"),
            p("PATCH", "/orders?coupon=A"),
        ] {
            assert_eq!(a.differs_from(&other), Some(Differs::Target), "{other:?}");
        }
        // Length prefixes: the boundary between method and path counts.
        assert_ne!(p("POST", "/a").target, p("POS", "T/a").target);
    }

    #[test]
    fn fingerprinted_headers_by_name() {
        let names = vec!["content-type".to_string(), "x-tenant".to_string()];
        let print = |pairs: &'static [(&'static str, &'static str)]| {
            RequestPrint::of(b"POST", b"/o", &names, &headers(pairs))
        };
        let a = print(&[("content-type", "application/json"), ("x-tenant", "t1")]);
        assert_eq!(a.differs_from(&print(&[("x-tenant", "t1"), ("content-type", "application/json")])), None);
        assert_eq!(
            a.differs_from(&print(&[("content-type", "application/json"), ("x-tenant", "t2")])),
            Some(Differs::Header("x-tenant".into()))
        );
        assert_eq!(
            a.differs_from(&print(&[("content-type", "application/json")])),
            Some(Differs::Header("x-tenant".into())),
            "absent is not the same as present"
        );
        let empty = print(&[("content-type", "application/json"), ("x-tenant", "")]);
        assert_ne!(empty, print(&[("content-type", "application/json")]));
        let twice = print(&[("content-type", "application/json"), ("x-tenant", "t1"), ("x-tenant", "t1")]);
        assert_eq!(a.differs_from(&twice), Some(Differs::Header("x-tenant".into())));
        // A header no longer (or not yet) fingerprinted is not compared.
        let fewer =
            RequestPrint::of(b"POST", b"/o", &names[..1], &headers(&[("content-type", "application/json")]));
        assert_eq!(a.differs_from(&fewer), None);
        assert_eq!(fewer.differs_from(&a), None);
    }

    #[test]
    fn json_canonical_ignores_order_and_whitespace_only() {
        let c = opts(true, &[]);
        let h = |b: &str| json_body_hash(b.as_bytes(), &c);
        assert_eq!(h(r#"{"a":1,"b":[1,2]}"#), h(" {\n \"b\" : [1, 2],\t\"a\":1 } "));
        assert_ne!(h(r#"{"a":1,"b":[1,2]}"#), h(r#"{"a":1,"b":[2,1]}"#), "array order counts");
        assert_ne!(h(r#"{"a":1}"#), h(r#"{"a":1.0}"#), "numbers by their exact text");
        assert_ne!(
            h(r#"{"n":12345678901234567890123}"#),
            h(r#"{"n":12345678901234567890124}"#),
            "no precision lost"
        );
        assert_ne!(h(r#"{"a":"1"}"#), h(r#"{"a":1}"#));
        assert_eq!(h(r#"{"a":"A"}"#), h(r#"{"a":"\u0041"}"#), "strings by their value");
        // Without canonical, member order counts, whitespace does not.
        let o = opts(false, &[]);
        let ho = |b: &str| json_body_hash(b.as_bytes(), &o);
        assert_ne!(ho(r#"{"a":1,"b":2}"#), ho(r#"{"b":2,"a":1}"#));
        assert_eq!(ho(r#"{"a":1,"b":2}"#), ho(r#"{ "a": 1, "b": 2 }"#));
    }

    #[test]
    fn json_ignored_members() {
        let c = opts(true, &["/client_sent_at", "/meta/trace", "/items/1", "/a~1b", "/missing/x"]);
        let h = |b: &str| json_body_hash(b.as_bytes(), &c);
        let base =
            h(r#"{"sku":"x","client_sent_at":"t1","meta":{"trace":"a","v":1},"items":[1,2,3],"a/b":0}"#);
        assert_eq!(
            base,
            h(r#"{"client_sent_at":"t2","sku":"x","meta":{"v":1,"trace":"b"},"items":[1,9,3],"a/b":5}"#)
        );
        assert_eq!(base, h(r#"{"sku":"x","meta":{"v":1},"items":[1,null,3]}"#), "absent is ignored too");
        assert_ne!(
            base,
            h(r#"{"sku":"y","client_sent_at":"t1","meta":{"trace":"a","v":1},"items":[1,2,3]}"#)
        );
        assert_ne!(base, h(r#"{"sku":"x","meta":{"v":2},"items":[1,2,3]}"#));
        assert_ne!(base, h(r#"{"sku":"x","meta":{"v":1},"items":[1,2]}"#), "positions do not shift");
    }

    #[test]
    fn a_body_that_is_not_json_is_hashed_raw() {
        let c = opts(true, &["/a"]);
        let raw_hash = |raw: &[u8]| -> Digest32 {
            Sha256::new().chain_update(b"idempotency-raw/v1\n").chain_update(raw).finalize().into()
        };
        for raw in [&b"not json"[..], b"", b"{\"a\":1", b"\xff\xfe", b"{\"a\":1} trailing"] {
            assert_eq!(json_body_hash(raw, &c), raw_hash(raw), "{raw:?}");
        }
        assert_ne!(json_body_hash(b"x", &c), json_body_hash(b"y", &c));
        // Found by fuzz/ (config): a raw body spelling a JSON body's hashed text was the same request.
        assert_ne!(json_body_hash(b"idempotency-json/v1\n{}", &c), json_body_hash(b"{}", &c));
    }

    #[test]
    fn array_indexes_are_rfc_6901() {
        let h = |ignore: &str, b: &str| json_body_hash(b.as_bytes(), &opts(true, &[ignore]));
        assert_eq!(h("/items/1", r#"{"items":[1,2]}"#), h("/items/1", r#"{"items":[1,3]}"#));
        assert_eq!(h("/items/0", r#"{"items":[1,2]}"#), h("/items/0", r#"{"items":[5,2]}"#));
        // Found by fuzz/ (config): `01` and `+1` are not indexes (serde_json's pointer agrees).
        for odd in ["/items/01", "/items/+1", "/items/-1", "/items/ 1"] {
            assert_ne!(h(odd, r#"{"items":[1,2]}"#), h(odd, r#"{"items":[1,3]}"#), "{odd}");
        }
    }

    #[test]
    fn serde_jsons_number_token_cannot_pass_for_a_number() {
        let opts = JsonPrint { canonical: true, ignore: vec![] };
        let number = json_body_hash(b"123", &opts);
        for body in [
            &br#"{"$serde_json::private::Number":"123"}"#[..],
            br#"{"\u0024serde_json::private::Number":"123"}"#,
            br#"{"a":{"$serde_json::private::Number":"123"}}"#,
        ] {
            assert!(spells_number_token(body), "{}", String::from_utf8_lossy(body));
            assert_ne!(json_body_hash(body, &opts), number, "{}", String::from_utf8_lossy(body));
            let raw: Digest32 =
                Sha256::new().chain_update(b"idempotency-raw/v1\n").chain_update(body).finalize().into();
            assert_eq!(json_body_hash(body, &opts), raw, "compared as bytes");
        }
        for body in [&br#"{"price":"$12","a\"$":"x"}"#[..], br#"["$serde_json::private::Numbe"]"#, b"{}"] {
            assert!(!spells_number_token(body), "{}", String::from_utf8_lossy(body));
        }
    }
}
