//! The client's `Idempotency-Key` and the store key derived from it.
//!
//! `parse_client_key` never panics; an accepted key is non-empty printable ASCII (visible ASCII
//! plus the space a quoted sf-string may hold) within the maximum length; a key reads the same
//! written as a token or as an sf-string. `store_key` is 64 lowercase hex characters,
//! deterministic, and differs when any scope field differs (the fields are length-prefixed).
//! The scope helpers never panic and keep their shape.

#![no_main]

use arbitrary::Arbitrary;
use idempotency_filter::key::{self, KeyError};
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
});
