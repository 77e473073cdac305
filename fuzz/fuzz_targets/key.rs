//! The client's `Idempotency-Key` and the store key derived from it.
//!
//! `parse_client_key` never panics; an accepted key is non-empty printable ASCII (visible ASCII
//! plus the space a quoted sf-string may hold) within the maximum length; a key reads the same
//! written as a token or as an sf-string. `store_key` is 64 lowercase hex characters,
//! deterministic, and differs when any scope field differs (the fields are length-prefixed).
//! The scope helpers never panic and keep their shape.
//!
//! Also the replay's content-coding check (`headers::refused_coding`, for the `406`): never
//! panics on any `accept-encoding` values and `content-encoding`; what it refuses is one of the
//! response's codings (lower-case, trimmed, never `identity` or empty) and is refused alone too;
//! no `accept-encoding` refuses the first coding, `*` alone refuses none, and a retry that lists
//! the response's codings first (without weights) is refused none.

#![no_main]

use arbitrary::Arbitrary;
use idempotency_filter::http::headers;
use idempotency_filter::request::key::{self, KeyError};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input {
    values: Vec<Vec<u8>>,
    max_len: u16,
    scope: [String; 4],
    other: [String; 4],
    /// Moves this many bytes of one scope field to the next one, for a second scope.
    shift: (u8, u8),
    path: String,
    source_address: String,
    bytes: Vec<u8>,
    accept: Vec<Coding>,
    content_encoding: Coding,
}

/// A header value of codings: a list of known ones with weights, or any bytes.
#[derive(Arbitrary, Debug)]
enum Coding {
    List(Vec<(u8, Weight)>, bool),
    Raw(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
enum Weight {
    None,
    Zero,
    One,
    Half,
    Any(String),
}

const TOKENS: [&str; 12] = [
    "gzip",
    "x-gzip",
    "GZip",
    "br",
    "deflate",
    "identity",
    "*",
    "compress",
    "x-compress",
    "zstd",
    "",
    " br ",
];

impl Coding {
    fn value(&self) -> Vec<u8> {
        match self {
            Coding::List(items, spaced) => items
                .iter()
                .take(8)
                .map(|(t, w)| {
                    let t = TOKENS[usize::from(*t) % TOKENS.len()];
                    match w {
                        Weight::None => t.to_string(),
                        Weight::Zero => format!("{t};q=0"),
                        Weight::One => format!("{t};q=1"),
                        Weight::Half => format!("{t}; Q=0.5"),
                        Weight::Any(w) => format!("{t};{w}"),
                    }
                })
                .collect::<Vec<_>>()
                .join(if *spaced { ", " } else { "," })
                .into_bytes(),
            Coding::Raw(b) => b.clone(),
        }
    }
}

/// The codings of a `content-encoding` value, as the filter reads them.
fn codings(ce: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(ce).split(',').map(|c| c.trim().to_ascii_lowercase()).collect()
}

fuzz_target!(|input: Input| {
    let max_len = usize::from(input.max_len % 4096) + 1;
    let values: Vec<&[u8]> = input.values.iter().map(Vec::as_slice).collect();
    match key::parse_client_key(&values, max_len) {
        Ok(None) => assert!(values.is_empty()),
        Ok(Some(k)) => {
            assert_eq!(values.len(), 1);
            assert!(!k.is_empty() && k.len() <= max_len, "{k:?}");
            assert!(k.bytes().all(|b| (0x20..=0x7e).contains(&b)), "{k:?}");
            // The same key as an sf-string and, when it is one, as a token.
            let quoted = format!("\"{}\"", k.replace('\\', "\\\\").replace('"', "\\\""));
            assert_eq!(key::parse_client_key(&[quoted.as_bytes()], max_len), Ok(Some(k.clone())));
            let token = !k.starts_with('"') && !k.contains(',') && !k.contains(' ');
            if token {
                assert_eq!(key::parse_client_key(&[k.as_bytes()], max_len), Ok(Some(k.clone())));
            }
        }
        Err(KeyError::Multiple) => {}
        Err(KeyError::TooLong { max }) => assert_eq!(max, max_len),
        Err(e @ (KeyError::Empty | KeyError::InvalidCharacter)) => {
            assert_eq!(values.len(), 1, "{e:?}");
        }
    }
    if values.len() > 1 {
        assert_eq!(key::parse_client_key(&values, max_len), Err(KeyError::Multiple));
    }

    let [s, m, r, k] = &input.scope;
    let sk = key::store_key(s, m, r, k);
    assert_eq!(sk.len(), 64);
    assert!(idem_protocol::is_hex64(sk.as_bytes()), "{sk}");
    assert_eq!(sk, key::store_key(s, m, r, k), "deterministic");
    let [s2, m2, r2, k2] = &input.other;
    if input.scope != input.other {
        assert_ne!(sk, key::store_key(s2, m2, r2, k2));
    }
    // The same bytes with one field boundary moved: a different scope, a different key.
    let mut shifted = input.scope.clone();
    let i = usize::from(input.shift.0 % 3);
    let n = usize::from(input.shift.1);
    if n > 0 && n <= shifted[i].len() && shifted[i].is_char_boundary(shifted[i].len() - n) {
        let tail = shifted[i].split_off(shifted[i].len() - n);
        shifted[i + 1].insert_str(0, &tail);
        let [s3, m3, r3, k3] = &shifted;
        assert_ne!(sk, key::store_key(s3, m3, r3, k3), "boundary moved at field {i}");
    }

    let route = key::route_from_path(&input.path);
    assert!(input.path.starts_with(route));
    assert!(!route.contains(['?', '#']));
    let subject = key::anonymous_subject(&input.source_address);
    assert!(subject.starts_with("anon:"));
    assert!(input.source_address.contains(&subject["anon:".len()..]));
    let h = key::hex(&input.bytes);
    assert_eq!(h.len(), 2 * input.bytes.len());
    assert!(h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')));

    let accept: Vec<Vec<u8>> = input.accept.iter().take(4).map(Coding::value).collect();
    let ce = input.content_encoding.value();
    let listed = codings(&ce);
    let refused = headers::refused_coding(&accept, &ce);
    if let Some(c) = &refused {
        assert!(!c.is_empty() && c != "identity" && c.trim() == c && *c == c.to_ascii_lowercase(), "{c:?}");
        let named =
            |l: &String| l == c || (l == "x-gzip" && c == "gzip") || (l == "x-compress" && c == "compress");
        assert!(listed.iter().any(named), "refused {c:?}, not in {listed:?}");
        assert_eq!(headers::refused_coding(&accept, c.as_bytes()).as_ref(), Some(c), "alone");
    }
    let first = listed.iter().find(|c| !c.is_empty() && *c != "identity").map(|c| match c.as_str() {
        "x-gzip" => "gzip".to_string(),
        "x-compress" => "compress".to_string(),
        _ => c.clone(),
    });
    assert_eq!(headers::refused_coding(&[], &ce), first, "no accept-encoding: no coding");
    assert_eq!(headers::refused_coding(&[b"*".to_vec()], &ce), None, "`*` accepts every coding");
    if !ce.contains(&b';') {
        let mut first_listed = vec![ce.clone()];
        first_listed.extend(accept.iter().cloned());
        assert_eq!(headers::refused_coding(&first_listed, &ce), None, "its own codings listed first");
    }
});
