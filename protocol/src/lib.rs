//! The wire protocol between the filter and `idemstore`.
//!
//! Four operations, each one HTTP/1.1 or h2c `POST` round trip: `begin`, `commit`, `release`
//! and `commits` (many `commit`s in one call); the store's health check, `GET /healthz`
//! ([`PATH_HEALTH`]), is not one of them. Small scalars travel in headers; the only large value,
//! the stored response, travels raw in the body (never base64). The record body is opaque to
//! the store: it keeps the bytes the filter sent and returns them.
//!
//! | operation | request headers | request body | answer (`200`, outcome header) | answer body |
//! |---|---|---|---|---|
//! | `POST /v1/begin` | key, body-hash, lock-ttl-ms, wait-ms, deadline-ms (optional), hold + retention-s + supersede (optional) | none | `record` (+ttl-ms), `locked` (+token), `busy` (+lock-remaining-ms), `mismatch`, `expired`, `in-doubt` (+token, started-ms, running-ms) | the record for `record` |
//! | `POST /v1/commit` | key, token, body-hash, retention-s | the record | `stored`, `late`, `exists` | none |
//! | `POST /v1/release` | key, token, in-doubt (optional) | none | `released`, `not-owner` | none |
//! | `POST /v1/commits` | retention-s | 1 to [`MAX_BATCH_ITEMS`] commits ([`encode_batch_item`]) | `batch` | one outcome per line, in order ([`BATCH_FAILED`] for one not done) |
//!
//! `commits` is `commit` for many records in one round trip: a filter that has commits waiting
//! while one is in flight sends them together. Each item is committed as its own `commit` would
//! be (one fails, the others stand); a malformed item makes the whole call a `400`, nothing done.
//!
//! **Attempts whose outcome is unknown.** A `begin` with [`HEADER_HOLD`] leaves a *trace* of
//! the attempt it locks for (its token, start time, lock TTL and body hash), kept for
//! [`HEADER_RETENTION_S`] (at least the lock TTL): it outlives an Envoy that dies mid-attempt.
//! A `commit` (stored or late) and a plain `release` (the attempt never reached the
//! application) clear it; a `release` with [`HEADER_IN_DOUBT`] (the attempt was sent and no
//! answer came back) drops the lock and keeps it. A later `begin` with `hold` that finds a trace
//! and no lock answers `in-doubt` (or `mismatch`, for another body hash) instead of locking:
//! the key will not run again until the first attempt's own late `commit` (its token), a
//! `begin` that supersedes that token ([`HEADER_SUPERSEDE`]: the application said the first
//! attempt never committed), or an operator clears it. A `begin` without `hold` ignores traces
//! and leaves none.
//!
//! Any other status, or a `200` without a known outcome, is a store fault: the filter fails
//! open (or closed, by configuration) and counts it.
//!
//! When idemstore is given a shared secret, every request but `GET /healthz` carries it in
//! [`HEADER_SECRET`]; without it, or with another value, the store answers `401` and does nothing
//! else. Every header value is validated before the store touches its backend: a missing,
//! repeated or malformed one is a `400` that names the header.
//!
//! The store key itself, how the filter derives it from the request ([`store_key`]), lives
//! here too, so that idemstore's operator tools derive the same key ([`key`]). That module uses
//! nothing of this root, which re-exports it: the uses go one way.

pub mod key;
pub mod stream;

pub use key::{hex, store_key, store_key_bytes};

pub const PATH_BEGIN: &str = "/v1/begin";
pub const PATH_COMMIT: &str = "/v1/commit";
pub const PATH_RELEASE: &str = "/v1/release";
pub const PATH_COMMITS: &str = "/v1/commits";
pub const PATH_HEALTH: &str = "/healthz";

/// The derived store key: 64 lowercase hex characters (SHA-256). Never the client's key.
pub const HEADER_KEY: &str = "x-idem-key";
/// SHA-256 of the request body, 64 lowercase hex characters.
pub const HEADER_BODY_HASH: &str = "x-idem-body-hash";
/// Lock time-to-live in milliseconds.
pub const HEADER_LOCK_TTL_MS: &str = "x-idem-lock-ttl-ms";
/// How long `begin` may wait for a held lock, in milliseconds (long-poll on the store side),
/// `0..=`[`MAX_WAIT_MS`]: `0` is one attempt, answering `busy` at once if the lock is held.
pub const HEADER_WAIT_MS: &str = "x-idem-wait-ms";
/// On `begin`: when the caller gives up on this call, in milliseconds since the Unix epoch (the
/// caller's clock: the filter sends its send time plus the callout's timeout). Optional. A store
/// that reaches the call only after it takes no lock and answers `expired`: a lock taken for a
/// call nobody waits for would hold the key until its TTL (a frozen store, thawed, works through
/// calls queued while it was frozen). It also never waits past it.
pub const HEADER_DEADLINE_MS: &str = "x-idem-deadline-ms";
/// Record lifetime in seconds.
pub const HEADER_RETENTION_S: &str = "x-idem-retention-s";
/// On a `record` answer: how long the record still lives, in whole milliseconds. Optional (absent
/// when the store does not know): the filter caches a replayed record only when it is given, and
/// never beyond it.
pub const HEADER_TTL_MS: &str = "x-idem-ttl-ms";
/// On a `busy` answer: how long the lock holder's lock still lives, in whole milliseconds
/// rounded up, at least 1. Optional (absent when the store does not know): the filter turns it
/// into the 409's `retry-after`.
pub const HEADER_LOCK_REMAINING_MS: &str = "x-idem-lock-remaining-ms";
/// On `begin`: `1` to keep a trace of the attempt and answer `in-doubt` for a key whose earlier
/// attempt's outcome is unknown (see the crate root); absent or `0`: neither. With it,
/// [`HEADER_RETENTION_S`] is how long the trace lives (at least the lock TTL).
pub const HEADER_HOLD: &str = "x-idem-hold";
/// On `begin` with `hold`: the token of an in-doubt attempt whose trace this `begin` clears
/// first (the application answered that it never committed). Optional.
pub const HEADER_SUPERSEDE: &str = "x-idem-supersede";
/// On `release`: `1` when the attempt was sent and its outcome is unknown: the lock is dropped
/// and the attempt's trace kept, so the key is in doubt. Absent or `0`: the trace goes too.
pub const HEADER_IN_DOUBT: &str = "x-idem-in-doubt";
/// On an `in-doubt` answer: when the first attempt began, in milliseconds since the Unix epoch
/// (the store's clock).
pub const HEADER_STARTED_MS: &str = "x-idem-started-ms";
/// On an `in-doubt` answer: how long the first attempt may still be running (until its start
/// plus its lock TTL), in whole milliseconds rounded up; `0`: it can no longer be.
pub const HEADER_RUNNING_MS: &str = "x-idem-running-ms";
/// The lock owner's token: returned by `begin` on `locked` (and on `in-doubt`, the in-doubt
/// attempt's), sent back by `commit`/`release`.
pub const HEADER_TOKEN: &str = "x-idem-token";
/// The operation's outcome, one of the outcome enums' wire names.
pub const HEADER_OUTCOME: &str = "x-idem-outcome";
/// The shared secret idemstore may require on every request but its health check (see
/// [`is_secret`] for its form). Sent by the filter when `store_secret` is configured.
pub const HEADER_SECRET: &str = "x-idem-secret";

pub const MAX_LOCK_TTL_MS: u64 = 3_600_000;
pub const MAX_WAIT_MS: u64 = 60_000;
pub const MAX_RETENTION_S: u64 = 604_800;
pub const MAX_TOKEN_LEN: usize = 64;
pub const MAX_SECRET_LEN: usize = 256;
/// Commits in one `commits` call at most.
pub const MAX_BATCH_ITEMS: usize = 64;
/// The outcome header of a `commits` answer (each item's outcome is in the body).
pub const BATCH_OUTCOME: &str = "batch";
/// A `commits` item's outcome when the store could not commit it (as a `commit` answered `503`).
pub const BATCH_FAILED: &str = "failed";

macro_rules! wire_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $wire:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum $name { $($(#[$vmeta])* $variant),+ }

        impl $name {
            pub fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $wire),+ }
            }

            pub fn parse(s: &[u8]) -> Option<Self> {
                match s { $(x if x == $wire.as_bytes() => Some(Self::$variant),)+ _ => None }
            }
        }
    };
}

wire_enum!(
    /// What `begin` found.
    BeginOutcome {
        /// A record with the same body hash: the body is the record, replay it.
        Record => "record",
        /// No record, the lock is now held by the caller: the token header is set.
        Locked => "locked",
        /// Another request holds the lock and still did after the wait.
        Busy => "busy",
        /// A record exists for this key but for a different request body.
        Mismatch => "mismatch",
        /// The call came past its deadline (`x-idem-deadline-ms`): nothing was looked up or
        /// locked.
        Expired => "expired",
        /// (`hold` only) An earlier attempt with this body hash began and its outcome is
        /// unknown: no lock was taken. The token header is that attempt's; the started and
        /// running headers say when it began and how long it may still run.
        InDoubt => "in-doubt",
    }
);

wire_enum!(
    /// What `commit` did. Whatever the outcome, a lock the token owned is released.
    CommitOutcome {
        /// The token owned the lock and the record is stored.
        Stored => "stored",
        /// The lock had expired (or was taken over) but no record existed: stored anyway.
        Late => "late",
        /// A record already existed and was kept: the first stored record wins.
        Exists => "exists",
    }
);

wire_enum!(
    /// What `release` did.
    ReleaseOutcome {
        Released => "released",
        /// The lock had expired or belongs to another token; nothing was deleted.
        NotOwner => "not-owner",
    }
);

/// True for a lower-case RFC 9110 token, not a pseudo-header: the only form Envoy presents header
/// names in, and the only one a record holds (the filter writes records; idemstore's operator
/// tools write one too).
pub fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name.bytes().all(|b| {
            b.is_ascii_lowercase()
                || b.is_ascii_digit()
                || matches!(
                    b,
                    b'!' | b'#'
                        | b'$'
                        | b'%'
                        | b'&'
                        | b'\''
                        | b'*'
                        | b'+'
                        | b'-'
                        | b'.'
                        | b'^'
                        | b'_'
                        | b'`'
                        | b'|'
                        | b'~'
                )
        })
}

/// True for 64 lowercase hex characters: the form of store keys and body hashes.
pub fn is_hex64(s: &[u8]) -> bool {
    s.len() == 64 && s.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// True for a lock token as the store mints them: 1 to 64 characters of `[A-Za-z0-9_-]`.
pub fn is_token(s: &[u8]) -> bool {
    !s.is_empty()
        && s.len() <= MAX_TOKEN_LEN
        && s.iter().all(|b| b.is_ascii_alphanumeric() || *b == b'-' || *b == b'_')
}

/// True for a shared secret both sides accept: 1 to 256 visible ASCII characters (`%x21-7E`).
/// No spaces, so that no proxy or HTTP library can trim or fold the header value into another
/// secret; ASCII, so that it is the same bytes in an Envoy config, a file and a header.
pub fn is_secret(s: &[u8]) -> bool {
    !s.is_empty() && s.len() <= MAX_SECRET_LEN && s.iter().all(|b| matches!(b, 0x21..=0x7e))
}

/// Parses a decimal header value into `1..=max` (see [`parse_in`]).
pub fn parse_bounded(s: &[u8], max: u64) -> Option<u64> {
    parse_in(s, 1..=max)
}

/// Parses a decimal header value into `range`: ASCII digits only (no sign, no spaces, no
/// empty value), at most 20 of them; leading zeros are allowed.
pub fn parse_in(s: &[u8], range: std::ops::RangeInclusive<u64>) -> Option<u64> {
    if s.is_empty() || s.len() > 20 || !s.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n = std::str::from_utf8(s).ok()?.parse::<u64>().ok()?;
    range.contains(&n).then_some(n)
}

/// Appends one `commits` item: `<key> <token> <body-hash> <record length>\n` then the record.
pub fn encode_batch_item(out: &mut Vec<u8>, key: &str, token: &str, body_hash: &str, record: &[u8]) {
    out.reserve(key.len() + token.len() + body_hash.len() + 24 + record.len());
    for part in [key, " ", token, " ", body_hash, " ", &record.len().to_string(), "\n"] {
        out.extend_from_slice(part.as_bytes());
    }
    out.extend_from_slice(record);
}

/// One item of a `commits` body, validated; `record` is its range in the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchItem<'a> {
    pub key: &'a str,
    pub token: &'a str,
    pub body_hash: &'a str,
    pub record: std::ops::Range<usize>,
}

/// Splits a `commits` body into its items, each checked as `commit` checks its headers (key and
/// body hash 64 lowercase hex, a token, a record not empty); the reason of the first bad one.
pub fn decode_batch(body: &[u8]) -> Result<Vec<BatchItem<'_>>, String> {
    let mut items = Vec::new();
    let mut at = 0;
    while at < body.len() {
        let n = items.len();
        if n == MAX_BATCH_ITEMS {
            return Err(format!("more than {MAX_BATCH_ITEMS} items"));
        }
        let end = body[at..]
            .iter()
            .take(64 + 1 + MAX_TOKEN_LEN + 1 + 64 + 1 + 20 + 1)
            .position(|b| *b == b'\n')
            .ok_or_else(|| format!("item {n}: no item line"))?;
        let line = std::str::from_utf8(&body[at..at + end]).map_err(|_| format!("item {n}: not ASCII"))?;
        let mut parts = line.split(' ');
        let (Some(key), Some(token), Some(body_hash), Some(len), None) =
            (parts.next(), parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(format!("item {n}: not `key token body-hash length`"));
        };
        if !is_hex64(key.as_bytes()) || !is_hex64(body_hash.as_bytes()) {
            return Err(format!("item {n}: key and body hash must be 64 lowercase hex characters"));
        }
        if !is_token(token.as_bytes()) {
            return Err(format!("item {n}: malformed token"));
        }
        let len = parse_bounded(len.as_bytes(), u64::MAX)
            .and_then(|l| usize::try_from(l).ok())
            .ok_or_else(|| format!("item {n}: the record length must be a positive number"))?;
        let start = at + end + 1;
        let stop = start
            .checked_add(len)
            .filter(|s| *s <= body.len())
            .ok_or_else(|| format!("item {n}: cut short"))?;
        items.push(BatchItem { key, token, body_hash, record: start..stop });
        at = stop;
    }
    if items.is_empty() {
        return Err("no items".to_string());
    }
    Ok(items)
}

/// The body of a `commits` answer: each item's outcome (`None`: not done), in order.
pub fn encode_batch_answer(outcomes: &[Option<CommitOutcome>]) -> Vec<u8> {
    let words: Vec<&str> = outcomes.iter().map(|o| o.map_or(BATCH_FAILED, CommitOutcome::as_str)).collect();
    words.join("\n").into_bytes()
}

/// Reads a `commits` answer for `n` items: `None` if it is not one outcome per item.
pub fn decode_batch_answer(body: &[u8], n: usize) -> Option<Vec<Option<CommitOutcome>>> {
    let outcomes: Option<Vec<_>> = body
        .split(|b| *b == b'\n')
        .map(|w| if w == BATCH_FAILED.as_bytes() { Some(None) } else { CommitOutcome::parse(w).map(Some) })
        .collect();
    outcomes.filter(|o| o.len() == n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_round_trip() {
        for o in [
            BeginOutcome::Record,
            BeginOutcome::Locked,
            BeginOutcome::Busy,
            BeginOutcome::Mismatch,
            BeginOutcome::Expired,
            BeginOutcome::InDoubt,
        ] {
            assert_eq!(BeginOutcome::parse(o.as_str().as_bytes()), Some(o));
        }
        assert_eq!(BeginOutcome::parse(b"RECORD"), None);
        assert_eq!(CommitOutcome::parse(b"late"), Some(CommitOutcome::Late));
        assert_eq!(ReleaseOutcome::parse(b"not-owner"), Some(ReleaseOutcome::NotOwner));
    }

    #[test]
    fn batches_round_trip() {
        let (k1, k2, h) = ("a".repeat(64), "b".repeat(64), "c".repeat(64));
        let mut body = Vec::new();
        encode_batch_item(&mut body, &k1, "tok-1", &h, b"record one\n with a newline");
        encode_batch_item(&mut body, &k2, "t2", &h, &[0, 255, b' ', b'\n']);
        let items = decode_batch(&body).unwrap();
        assert_eq!(items.len(), 2);
        assert_eq!((items[0].key, items[0].token, items[0].body_hash), (k1.as_str(), "tok-1", h.as_str()));
        assert_eq!(&body[items[0].record.clone()], b"record one\n with a newline");
        assert_eq!((items[1].key, items[1].token), (k2.as_str(), "t2"));
        assert_eq!(&body[items[1].record.clone()], &[0, 255, b' ', b'\n']);

        let answer = encode_batch_answer(&[Some(CommitOutcome::Stored), None, Some(CommitOutcome::Exists)]);
        assert_eq!(answer, b"stored\nfailed\nexists");
        assert_eq!(
            decode_batch_answer(&answer, 3),
            Some(vec![Some(CommitOutcome::Stored), None, Some(CommitOutcome::Exists)])
        );
        assert_eq!(decode_batch_answer(&answer, 2), None);
        assert_eq!(decode_batch_answer(b"stored\nmaybe", 2), None);
        assert_eq!(decode_batch_answer(b"", 1), None);
    }

    #[test]
    fn bad_batches_are_refused_with_the_item() {
        let (k, h) = ("a".repeat(64), "c".repeat(64));
        let mut one = Vec::new();
        encode_batch_item(&mut one, &k, "t", &h, b"r");
        assert!(decode_batch(b"").unwrap_err().contains("no items"));
        let cut = &one[..one.len() - 1];
        assert!(decode_batch(cut).unwrap_err().contains("item 0: cut short"));
        let mut two = one.clone();
        two.extend_from_slice(format!("{k} t {h} 0\n").as_bytes());
        assert!(decode_batch(&two).unwrap_err().contains("item 1: the record length"));
        for bad in [
            format!("{} t {h} 1\nr", "A".repeat(64)),
            format!("{k} bad.token {h} 1\nr"),
            format!("{k} t {h} +1\nr"),
            format!("{k} t {h}\nr"),
            format!("{k} t {h} 1 extra\nr"),
            format!("{k} t {h} 1"),
        ] {
            assert!(decode_batch(bad.as_bytes()).is_err(), "{bad}");
        }
        let mut full = Vec::new();
        for _ in 0..MAX_BATCH_ITEMS {
            encode_batch_item(&mut full, &k, "t", &h, b"r");
        }
        assert_eq!(decode_batch(&full).unwrap().len(), MAX_BATCH_ITEMS);
        encode_batch_item(&mut full, &k, "t", &h, b"r");
        assert!(decode_batch(&full).unwrap_err().contains("more than"));
    }

    #[test]
    fn validators() {
        assert!(is_hex64(&[b'a'; 64]));
        assert!(!is_hex64(&[b'A'; 64]));
        assert!(!is_hex64(&[b'a'; 63]));
        // The store key (see `key`) always has that form.
        assert!(is_hex64(store_key("s", "POST", "r", "k").as_bytes()));
        assert!(is_token(b"abc-DEF_1"));
        assert!(!is_token(b""));
        assert!(!is_token(b"a b"));
        assert_eq!(parse_bounded(b"30000", MAX_LOCK_TTL_MS), Some(30000));
        assert_eq!(parse_bounded(b"0", 10), None);
        assert_eq!(parse_bounded(b"11", 10), None);
        assert_eq!(parse_bounded(b"-1", 10), None);
        assert_eq!(parse_bounded(b"99999999999999999999999", u64::MAX), None);
        assert_eq!(parse_bounded(b"+5", 10), None);
        assert_eq!(parse_bounded(b" 5", 10), None);
        assert_eq!(parse_bounded(b"10", 10), Some(10));
        assert_eq!(parse_bounded(b"1", 10), Some(1));
        assert!(is_secret(b"s3cr3t!~"));
        assert!(is_secret(&[b'x'; MAX_SECRET_LEN]));
        assert!(!is_secret(&[b'x'; MAX_SECRET_LEN + 1]));
        assert!(!is_secret(b""));
        assert!(!is_secret(b"two words"));
        assert!(!is_secret(b"tab\t"));
        assert!(!is_secret("caf\u{e9}".as_bytes()));
    }

    #[test]
    fn parse_in_ranges() {
        // Zero, when the range has it: the wait header's "no waiting".
        assert_eq!(parse_in(b"0", 0..=MAX_WAIT_MS), Some(0));
        assert_eq!(parse_in(b"000", 0..=MAX_WAIT_MS), Some(0));
        assert_eq!(parse_in(b"60000", 0..=MAX_WAIT_MS), Some(MAX_WAIT_MS));
        assert_eq!(parse_in(b"60001", 0..=MAX_WAIT_MS), None);
        assert_eq!(parse_in(b"0", 1..=10), None);
        // Both bounds are inclusive; a range not starting at 0 or 1 works the same.
        assert_eq!(parse_in(b"5", 5..=7), Some(5));
        assert_eq!(parse_in(b"7", 5..=7), Some(7));
        assert_eq!(parse_in(b"4", 5..=7), None);
        assert_eq!(parse_in(b"8", 5..=7), None);
        // The full u64 range, and one past it.
        assert_eq!(parse_in(b"18446744073709551615", 0..=u64::MAX), Some(u64::MAX));
        assert_eq!(parse_in(b"18446744073709551616", 0..=u64::MAX), None);
        // An empty range accepts nothing.
        let empty = std::ops::RangeInclusive::new(1, 0);
        assert_eq!(parse_in(b"0", empty.clone()), None);
        assert_eq!(parse_in(b"1", empty), None);
        // Strict decimal: no sign, space, empty value, fraction, exponent, hex or non-ASCII
        // digit, and at most 20 characters even with leading zeros.
        for bad in [
            &b""[..],
            b"-0",
            b"-1",
            b"+0",
            b"+1",
            b" 0",
            b"0 ",
            b"1.0",
            b"1e3",
            b"0x1",
            "\u{661}".as_bytes(),
            b"000000000000000000001",
        ] {
            assert_eq!(parse_in(bad, 0..=u64::MAX), None, "{:?}", String::from_utf8_lossy(bad));
        }
        assert_eq!(parse_in(b"00000000000000000001", 0..=u64::MAX), Some(1));
        // parse_bounded is parse_in over 1..=max.
        for s in [&b"0"[..], b"1", b"10", b"11", b"", b"+1"] {
            assert_eq!(parse_bounded(s, 10), parse_in(s, 1..=10));
        }
    }
}
