//! The operator's view of the store, for the bad day a wrong answer was stored: look up and
//! delete one store key's record and lock, find store keys by a prefix (log lines show the first
//! 12 hex characters), count records and locks. The reports are plain JSON, the same whether
//! `idemstore records` reads them from Redis itself or from these routes of a running idemstore:
//!
//! | route | does |
//! |---|---|
//! | `GET /v1/admin/records/<store key>` | [`KeyReport`]: the record (status, size, lifetime, body hash) and the lock, if any |
//! | `DELETE /v1/admin/records/<store key>` | deletes both, [`DeleteReport`]: what was there, what was deleted |
//! | `GET /v1/admin/records?prefix=<hex>` | [`FindReport`]: store keys with that prefix (at least [`MIN_PREFIX`] characters), at most [`FIND_LIMIT`] |
//! | `GET /v1/admin/counts` | [`CountsReport`]: records and locks held |
//!
//! Like every route but `/healthz` and `/metrics`, they need the shared secret when idemstore
//! has one (`401` before anything else, [`crate::http`]). A store key must be 64 lowercase hex
//! characters, a prefix 8 to 64: else `400`. A record's bytes never leave the store here (the
//! answer may carry personal data): only its status, size, lifetime and request body hash.
//!
//! Owns these routes' paths, handlers and reports, and the lookups behind them ([`lookup`],
//! [`delete`], [`find`], [`counts`]), which `idemstore records` also runs straight on a backend
//! ([`crate::tools`]). Uses [`crate::backend`], [`crate::store`] and [`crate::error`] (the
//! failure answers it shares with the protocol's routes); never [`crate::http`], which mounts
//! the routes.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use crate::backend::{Backend, Inspection, Result};
use crate::error::{refused, Error};
use crate::store::Store;

/// `GET` / `DELETE` `PATH_RECORDS/<store key>`, and `GET PATH_RECORDS?prefix=<hex>`.
pub const PATH_RECORDS: &str = "/v1/admin/records";
/// `GET`: how many records and locks the backend holds.
pub const PATH_COUNTS: &str = "/v1/admin/counts";
/// The shortest store key prefix looked up (32 bits: a prefix names one key among millions).
pub const MIN_PREFIX: usize = 8;
/// Store keys a prefix lookup returns at most.
pub const FIND_LIMIT: usize = 10;

/// What one store key holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyReport {
    pub store_key: String,
    pub record: Option<RecordReport>,
    pub lock: Option<LockReport>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordReport {
    /// The stored answer's status; `null` when the bytes are not a record the filter wrote.
    pub status: Option<u16>,
    /// The size of the filter's record (the answer's status, headers and body).
    pub bytes: usize,
    /// How long the record still replays; `null`: no expiry.
    pub ttl_ms: Option<u64>,
    /// SHA-256 of the request body the record answers (a retry with another body gets `422`).
    pub body_hash: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockReport {
    /// How long the lock still holds the key; `null`: no expiry.
    pub ttl_ms: Option<u64>,
}

/// What a delete found (just before it) and deleted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeleteReport {
    pub store_key: String,
    pub record: Option<RecordReport>,
    pub lock: Option<LockReport>,
    pub deleted_record: bool,
    pub deleted_lock: bool,
}

impl DeleteReport {
    pub fn deleted_anything(&self) -> bool {
        self.deleted_record || self.deleted_lock
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FindReport {
    pub prefix: String,
    /// Sorted; at most [`FIND_LIMIT`].
    pub store_keys: Vec<String>,
    /// More keys have this prefix than were returned.
    pub truncated: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CountsReport {
    pub records: u64,
    pub locks: u64,
}

fn millis(ttl: Option<Duration>) -> Option<u64> {
    ttl.map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX))
}

fn report(store_key: &str, inspection: Inspection) -> KeyReport {
    KeyReport {
        store_key: store_key.to_owned(),
        record: inspection.record.map(|r| RecordReport {
            status: r.status,
            bytes: r.bytes,
            ttl_ms: millis(r.ttl),
            body_hash: r.body_hash,
        }),
        lock: inspection.lock.map(|l| LockReport { ttl_ms: millis(l.ttl) }),
    }
}

/// True for a store key prefix a lookup accepts: [`MIN_PREFIX`] to 64 lowercase hex characters.
pub fn is_prefix(s: &str) -> bool {
    (MIN_PREFIX..=64).contains(&s.len()) && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

pub async fn lookup<B: Backend>(backend: &B, store_key: &str) -> Result<KeyReport> {
    Ok(report(store_key, backend.inspect(store_key).await?))
}

/// Deletes `store_key`'s record and lock, reporting what was there just before. On Redis, a
/// `begin` waiting on the lock in any idemstore instance is woken (the Redis wake-up); the route
/// also wakes this instance's own waiters.
pub async fn delete<B: Backend>(backend: &B, store_key: &str) -> Result<DeleteReport> {
    let before = lookup(backend, store_key).await?;
    let deleted = backend.delete(store_key).await?;
    if deleted.record || deleted.lock {
        tracing::warn!(
            store_key,
            record = deleted.record,
            lock = deleted.lock,
            "an operator deleted what a store key held"
        );
    }
    Ok(DeleteReport {
        store_key: before.store_key,
        record: before.record,
        lock: before.lock,
        deleted_record: deleted.record,
        deleted_lock: deleted.lock,
    })
}

pub async fn find<B: Backend>(backend: &B, prefix: &str) -> Result<FindReport> {
    let mut keys = backend.find(prefix, FIND_LIMIT + 1).await?;
    let truncated = keys.len() > FIND_LIMIT;
    keys.truncate(FIND_LIMIT);
    Ok(FindReport { prefix: prefix.to_owned(), store_keys: keys, truncated })
}

pub async fn counts<B: Backend>(backend: &B) -> Result<CountsReport> {
    let counts = backend.counts().await?;
    Ok(CountsReport { records: counts.records, locks: counts.locks })
}

fn json<T: Serialize>(value: Result<T>) -> Response {
    let value = match value {
        Ok(value) => value,
        Err(e) => return Error::from(e).into_response(),
    };
    match serde_json::to_vec(&value) {
        Ok(body) => (
            [
                (CONTENT_TYPE, HeaderValue::from_static("application/json")),
                (CACHE_CONTROL, HeaderValue::from_static("no-store")),
            ],
            body,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

fn store_key(key: &str) -> std::result::Result<&str, Error> {
    if idem_protocol::is_hex64(key.as_bytes()) {
        Ok(key)
    } else {
        Err(Error::BadRequest("the store key must be 64 lowercase hex characters".into()))
    }
}

/// `GET PATH_RECORDS/<store key>`.
pub(crate) async fn get_record<B: Backend>(
    State(store): State<Arc<Store<B>>>,
    Path(key): Path<String>,
) -> Response {
    match store_key(&key) {
        Ok(key) => json(lookup(store.backend(), key).await),
        Err(e) => refused(&store, e),
    }
}

/// `DELETE PATH_RECORDS/<store key>`.
pub(crate) async fn delete_record<B: Backend>(
    State(store): State<Arc<Store<B>>>,
    Path(key): Path<String>,
) -> Response {
    match store_key(&key) {
        Ok(key) => {
            let deleted = delete(store.backend(), key).await;
            // Waiters here try again at once, and one takes the lock.
            store.waiters().wake(key);
            json(deleted)
        }
        Err(e) => refused(&store, e),
    }
}

/// `GET PATH_RECORDS?prefix=<hex>`: the only query it takes.
pub(crate) async fn find_records<B: Backend>(State(store): State<Arc<Store<B>>>, uri: Uri) -> Response {
    let prefix = match uri.query().and_then(|q| q.strip_prefix("prefix=")) {
        Some(p) if is_prefix(p) => p,
        _ => {
            let why = format!("give ?prefix= and {MIN_PREFIX} to 64 lowercase hex characters of a store key");
            return refused(&store, Error::BadRequest(why));
        }
    };
    json(find(store.backend(), prefix).await)
}

/// `GET PATH_COUNTS`.
pub(crate) async fn get_counts<B: Backend>(State(store): State<Arc<Store<B>>>) -> Response {
    json(counts(store.backend()).await)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes() {
        assert!(is_prefix("0123abcd"));
        assert!(is_prefix(&"a".repeat(64)));
        assert!(!is_prefix("0123abc"));
        assert!(!is_prefix(&"a".repeat(65)));
        assert!(!is_prefix("0123ABCD"));
        assert!(!is_prefix("0123abcg"));
    }
}
