//! The store key: how the filter turns a request's scope and its client key into the 64-hex key
//! it sends the store, shared so that idemstore's operator tools (`idemstore records`) derive
//! exactly the key the filter derived.
//!
//! SHA-256 over `idempotency-key/v1` then four fields, each as its length (8 bytes, big endian)
//! and its bytes: the **subject**, the **method**, the **route** and the **client key**. The
//! length prefixes keep a field from bleeding into its neighbour; the client's key is never sent
//! to the store or logged, only this digest of it.
//!
//! What the filter puts in each field (its `src/request/machine/mod.rs`, with `src/request/key.rs`):
//!
//! - subject: `id:<caller>` (the configured `subject` header or metadata value, when present and
//!   UTF-8), `idx:<hex of its bytes>` (when it is not UTF-8, e.g. a numeric JWT claim), else
//!   `anon:<client IP>` (`source.address` without its port); in inbox mode `inbox:<source>`;
//! - method: upper case (`post` and `POST` share records);
//! - route: the Envoy route's `name` (`xds.route_name`), else the path without its query;
//! - client key: the `Idempotency-Key` value as parsed (`"abc"` and `abc` are the same key); in
//!   inbox mode, the message id.

use sha2::{Digest, Sha256};

/// The domain tag hashed before the fields: a new derivation would change it.
pub const STORE_KEY_TAG: &[u8] = b"idempotency-key/v1";

/// The prefixes a subject the filter derives starts with (see the module doc).
pub const SUBJECT_PREFIXES: [&str; 4] = ["id:", "idx:", "anon:", "inbox:"];

/// The store key: lowercase hex SHA-256 of the length-prefixed scope and key.
pub fn store_key(subject: &str, method: &str, route: &str, client_key: &str) -> String {
    store_key_bytes(subject.as_bytes(), method, route, client_key.as_bytes())
}

/// [`store_key`] over exact bytes: a message id or source read from a header need not be UTF-8,
/// and two ids that differ in any byte must stay two records.
pub fn store_key_bytes(subject: &[u8], method: &str, route: &str, client_key: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(STORE_KEY_TAG);
    for field in [subject, method.as_bytes(), route.as_bytes(), client_key] {
        h.update((field.len() as u64).to_be_bytes());
        h.update(field);
    }
    hex(&h.finalize())
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 0xf) as usize] as char);
    }
    s
}

/// True for a subject of a form the filter derives (one of [`SUBJECT_PREFIXES`]): any other
/// subject cannot name a key the filter made.
pub fn is_filter_subject(subject: &[u8]) -> bool {
    SUBJECT_PREFIXES.iter().any(|p| subject.starts_with(p.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_derivation_is_pinned() {
        // A change here changes every store key: records written before it would never replay.
        assert_eq!(
            store_key("anon:127.0.0.1", "POST", "orders", "k-1"),
            "96ae87827326424677ff75f552af5530dad7867ac12f13e6e618fdafb7561b46"
        );
    }

    #[test]
    fn fields_are_length_prefixed() {
        assert_ne!(store_key("ab", "c", "r", "k"), store_key("a", "bc", "r", "k"));
        assert_eq!(store_key("s", "POST", "r", "k"), store_key_bytes(b"s", "POST", "r", b"k"));
        assert_eq!(hex(&[0, 0x0f, 0xa5, 0xff]), "000fa5ff");
    }

    #[test]
    fn subject_forms() {
        for ok in ["id:alice", "idx:00ff", "anon:10.0.0.1", "anon:::1", "inbox:/orders"] {
            assert!(is_filter_subject(ok.as_bytes()), "{ok}");
        }
        for bad in ["alice", "", "ID:alice", "anon", "10.0.0.1"] {
            assert!(!is_filter_subject(bad.as_bytes()), "{bad}");
        }
    }
}
