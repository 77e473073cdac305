//! The shared secret a client must present in `x-idem-secret` (see [`crate::http`]).
//!
//! idemstore has no other authentication: anything that reaches its port can take or drop any
//! lock, store a record under any key (which every later retry of that key replays) and read
//! the record of a key it knows. Listening on loopback is the first fence; the secret is the
//! second, for stores that Envoy reaches over a network.
//!
//! Owns the secret's form (the protocol's rule, `idem_protocol::is_secret`), its reading from a
//! file and its constant-time comparison; uses no other module of idemstore.

use std::fmt;
use std::path::Path;

use idem_protocol as proto;
use subtle::ConstantTimeEq;

/// A validated secret. Its `Debug` never shows the value, so it can sit in logged structs.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// 1 to 256 visible ASCII characters ([`proto::is_secret`]), the same rule as the filter's
    /// `store_secret`: a secret the filter could not send would lock every caller out.
    pub fn new(value: &str) -> Result<Self, String> {
        if proto::is_secret(value.as_bytes()) {
            Ok(Self(value.as_bytes().to_vec()))
        } else if value.is_empty() {
            Err("the secret is empty".into())
        } else {
            Err(format!(
                "the secret must be 1 to {} visible ASCII characters (no spaces or control characters)",
                proto::MAX_SECRET_LEN
            ))
        }
    }

    /// The file's content without its trailing line break(s), which editors and
    /// `echo > file` add but nobody means as part of the secret.
    pub fn from_file(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the secret file {}: {e}", path.display()))?;
        Self::new(text.trim_end_matches(['\n', '\r'])).map_err(|e| format!("{e} (in {})", path.display()))
    }

    /// The secret itself, for a client that sends it (`idemstore records --url`).
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Compares in constant time for a given length, so response timing does not tell a
    /// prober how many leading bytes it got right. (`subtle` answers a length mismatch at once:
    /// the length is all that leaks.)
    pub fn matches(&self, presented: &[u8]) -> bool {
        self.0.as_slice().ct_eq(presented).into()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn validates_and_matches() {
        let s = Secret::new("hunter2!").unwrap();
        assert!(s.matches(b"hunter2!"));
        assert!(!s.matches(b"hunter2"));
        assert!(!s.matches(b"hunter2!!"));
        assert!(!s.matches(b""));
        assert!(Secret::new("").unwrap_err().contains("empty"));
        assert!(Secret::new("two words").is_err());
        assert!(Secret::new(&"x".repeat(257)).is_err());
        assert!(Secret::new(&"x".repeat(256)).is_ok());
        assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
    }

    #[test]
    fn file_loses_its_trailing_newline_only() {
        let dir = std::env::temp_dir().join(format!("idemstore-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("secret");
        std::fs::write(&path, "from-file\r\n").unwrap();
        assert!(Secret::from_file(&path).unwrap().matches(b"from-file"));
        std::fs::write(&path, "\n").unwrap();
        assert!(Secret::from_file(&path).unwrap_err().contains("empty"));
        std::fs::write(&path, " padded\n").unwrap();
        assert!(Secret::from_file(&path).is_err(), "inner whitespace is not trimmed away");
        assert!(Secret::from_file(&dir.join("missing")).unwrap_err().contains("cannot read"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
