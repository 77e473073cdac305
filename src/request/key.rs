//! The client's `Idempotency-Key` and the store key derived from it.
//!
//! The client's key is never sent to the store or logged: the store key is SHA-256 over the
//! length-prefixed subject, method, route and client key, so two callers (or two routes) that
//! pick the same key get two records, and no field can bleed into its neighbour. The derivation
//! itself is `idem_protocol::key`, shared with idemstore's operator tools.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyError {
    Empty,
    TooLong {
        max: usize,
    },
    /// Outside visible ASCII, or a structured-field string that is not well formed.
    InvalidCharacter,
    /// More than one `Idempotency-Key` header, or a comma-separated list.
    Multiple,
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::Empty => f.write_str("The Idempotency-Key header is empty."),
            KeyError::TooLong { max } => {
                write!(f, "The Idempotency-Key is longer than {max} characters.")
            }
            KeyError::InvalidCharacter => f.write_str(
                "The Idempotency-Key must be visible ASCII characters, or a quoted structured-field string.",
            ),
            KeyError::Multiple => f.write_str("Send exactly one Idempotency-Key header with one key."),
        }
    }
}

/// Parses the values of every `Idempotency-Key` header of a request. `Ok(None)`: no key.
///
/// Accepted: a token of visible ASCII (`%x21-7E`, no comma, not starting with `"`), or an RFC 8941
/// sf-string (`"abc"` means `abc`; `\"` and `\\` escapes; spaces allowed inside).
pub fn parse_client_key(values: &[&[u8]], max_len: usize) -> Result<Option<String>, KeyError> {
    let value = match values {
        [] => return Ok(None),
        [one] => *one,
        _ => return Err(KeyError::Multiple),
    };
    let value = trim_ows(value);
    let key = match value.first() {
        None => return Err(KeyError::Empty),
        Some(b'"') => parse_sf_string(value)?,
        Some(_) => parse_token(value)?,
    };
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > max_len {
        return Err(KeyError::TooLong { max: max_len });
    }
    Ok(Some(key))
}

fn trim_ows(mut v: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = v {
        v = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = v {
        v = rest;
    }
    v
}

fn parse_token(v: &[u8]) -> Result<String, KeyError> {
    if v.contains(&b',') {
        return Err(KeyError::Multiple);
    }
    if !v.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(KeyError::InvalidCharacter);
    }
    String::from_utf8(v.to_vec()).map_err(|_| KeyError::InvalidCharacter)
}

fn parse_sf_string(v: &[u8]) -> Result<String, KeyError> {
    let mut out = String::with_capacity(v.len());
    let mut bytes = v.iter().skip(1);
    loop {
        match bytes.next() {
            None => return Err(KeyError::InvalidCharacter),
            Some(b'"') => break,
            Some(b'\\') => match bytes.next() {
                Some(&c @ (b'"' | b'\\')) => out.push(c as char),
                _ => return Err(KeyError::InvalidCharacter),
            },
            Some(&c) if (0x20..=0x7e).contains(&c) => out.push(c as char),
            Some(_) => return Err(KeyError::InvalidCharacter),
        }
    }
    match bytes.next() {
        None => Ok(out),
        Some(b',') => Err(KeyError::Multiple),
        Some(_) => Err(KeyError::InvalidCharacter),
    }
}

// The store key's derivation is shared with idemstore (its operator tools derive the same key
// from a request's subject, method, route and client key): `idem_protocol::key`.
pub use idem_protocol::key::{hex, store_key, store_key_bytes};

/// The route part of the scope when the Envoy route has no name: the path without its query.
pub fn route_from_path(path: &str) -> &str {
    let end = path.find(['?', '#']).unwrap_or(path.len());
    &path[..end]
}

/// `anon:<ip>` from Envoy's `source.address` (`ip:port` or `[v6]:port`): a retry on a new
/// connection has a new port but the same caller.
pub fn anonymous_subject(source_address: &str) -> String {
    let ip = if let Some(rest) = source_address.strip_prefix('[') {
        rest.split(']').next().unwrap_or(rest)
    } else if source_address.matches(':').count() == 1 {
        source_address.split(':').next().unwrap_or(source_address)
    } else {
        source_address
    };
    format!("anon:{ip}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: &[u8]) -> Result<Option<String>, KeyError> {
        parse_client_key(&[v], 255)
    }

    #[test]
    fn tokens_and_sf_strings_are_the_same_key() {
        assert_eq!(parse(b"abc"), Ok(Some("abc".into())));
        assert_eq!(parse(b"\"abc\""), Ok(Some("abc".into())));
        assert_eq!(parse(b" abc "), Ok(Some("abc".into())));
        assert_eq!(parse(b"\"a \\\"b\\\\\""), Ok(Some("a \"b\\".into())));
        assert_eq!(
            parse(b"8e5a3b1c-0d2f-4a51-9b7e-3c1d2e4f5a6b"),
            Ok(Some("8e5a3b1c-0d2f-4a51-9b7e-3c1d2e4f5a6b".into()))
        );
        assert_eq!(parse_client_key(&[], 255), Ok(None));
    }

    #[test]
    fn malformed_keys() {
        assert_eq!(parse(b""), Err(KeyError::Empty));
        assert_eq!(parse(b"  "), Err(KeyError::Empty));
        assert_eq!(parse(b"\"\""), Err(KeyError::Empty));
        assert_eq!(parse(&[b'a'; 256]), Err(KeyError::TooLong { max: 255 }));
        assert!(parse(&[b'a'; 255]).unwrap().is_some());
        assert_eq!(parse(b"a\x01b"), Err(KeyError::InvalidCharacter));
        assert_eq!(parse(b"a\x00b"), Err(KeyError::InvalidCharacter));
        assert_eq!(parse("caf\u{e9}".as_bytes()), Err(KeyError::InvalidCharacter));
        assert_eq!(parse(b"a b"), Err(KeyError::InvalidCharacter));
        assert_eq!(parse(b"a,b"), Err(KeyError::Multiple));
        assert_eq!(parse(b"\"a\", \"b\""), Err(KeyError::Multiple));
        assert_eq!(parse(b"\"abc"), Err(KeyError::InvalidCharacter));
        assert_eq!(parse(b"\"abc\"x"), Err(KeyError::InvalidCharacter));
        assert_eq!(parse(b"\"a\\nb\""), Err(KeyError::InvalidCharacter));
        assert_eq!(parse(b"\"a\x7fb\""), Err(KeyError::InvalidCharacter));
        assert_eq!(parse_client_key(&[b"a", b"a"], 255), Err(KeyError::Multiple));
        // The length limit applies to the key, not its quoting.
        let mut quoted = vec![b'"'];
        quoted.extend([b'a'; 255]);
        quoted.push(b'"');
        assert!(parse(&quoted).unwrap().is_some());
    }

    #[test]
    fn store_key_scopes_every_field() {
        let k = store_key("anon:127.0.0.1", "POST", "orders", "abc");
        assert_eq!(k.len(), 64);
        assert!(idem_protocol::is_hex64(k.as_bytes()));
        assert_eq!(k, store_key("anon:127.0.0.1", "POST", "orders", "abc"));
        assert_ne!(k, store_key("anon:127.0.0.2", "POST", "orders", "abc"));
        assert_ne!(k, store_key("anon:127.0.0.1", "PATCH", "orders", "abc"));
        assert_ne!(k, store_key("anon:127.0.0.1", "POST", "payments", "abc"));
        assert_ne!(k, store_key("anon:127.0.0.1", "POST", "orders", "abd"));
        assert_eq!(k, store_key_bytes(b"anon:127.0.0.1", "POST", "orders", b"abc"));
        assert_ne!(store_key_bytes(b"s", "POST", "r", b"\xff"), store_key_bytes(b"s", "POST", "r", b"\xfe"));
        // Length prefixes: moving a boundary changes the key.
        assert_ne!(store_key("ab", "c", "r", "k"), store_key("a", "bc", "r", "k"));
    }

    #[test]
    fn scope_parts() {
        assert_eq!(route_from_path("/things/a?x=1"), "/things/a");
        assert_eq!(route_from_path("/things/a#f"), "/things/a");
        assert_eq!(route_from_path("/things/a"), "/things/a");
        assert_eq!(anonymous_subject("127.0.0.1:53412"), "anon:127.0.0.1");
        assert_eq!(anonymous_subject("[::1]:8080"), "anon:::1");
        assert_eq!(anonymous_subject("10.0.0.1"), "anon:10.0.0.1");
    }
}
