//! The operator's view of the store, for the bad day a wrong answer was stored or an attempt's
//! outcome is unknown: look up and delete one store key's record, lock and trace, resolve a key
//! in doubt with the answer the application gave, find store keys by a prefix (log lines show
//! the first 12 hex characters), count records, locks and keys in doubt. The reports are plain
//! JSON, the same whether `idemstore records` reads them from Redis itself or from these routes
//! of a running idemstore:
//!
//! | route | does |
//! |---|---|
//! | `GET /v1/admin/records/<store key>` | [`KeyReport`]: the record (status, size, lifetime, body hash), the lock and the trace, if any |
//! | `DELETE /v1/admin/records/<store key>` | deletes all three, [`DeleteReport`]: what was there, what was deleted |
//! | `POST /v1/admin/records/<store key>/resolve` | for a key in doubt (a trace, no lock, no record): commits the record in the body (`IDR2`, [`crate::answer`]) under the trace's token and body hash, [`ResolveReport`] |
//! | `GET /v1/admin/records?prefix=<hex>` | [`FindReport`]: store keys with that prefix (at least [`MIN_PREFIX`] characters), at most [`FIND_LIMIT`] |
//! | `GET /v1/admin/counts` | [`CountsReport`]: records, locks and keys in doubt |
//!
//! Like every route but `/healthz` and `/metrics`, they need the shared secret when idemstore
//! has one (`401` before anything else, [`crate::http`]). A store key must be 64 lowercase hex
//! characters, a prefix 8 to 64: else `400`. A record's bytes never leave the store here (the
//! answer may carry personal data): only its status, size, lifetime and request body hash.
//!
//! Owns these routes' paths, handlers and reports, and the lookups behind them ([`lookup`],
//! [`delete`], [`resolve`], [`find`], [`counts`]), which `idemstore records` also runs straight
//! on a backend ([`crate::tools`]). Uses [`crate::backend`], [`crate::store`], [`crate::answer`]
//! (the check of a record to resolve with) and [`crate::error`] (the failure answers it shares
//! with the protocol's routes); never [`crate::http`], which mounts the routes.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use crate::backend::{Backend, Commit, Inspection, Result};
use crate::error::{refused, Error};
use crate::store::Store;

/// `GET` / `DELETE` `PATH_RECORDS/<store key>`, and `GET PATH_RECORDS?prefix=<hex>`.
pub const PATH_RECORDS: &str = "/v1/admin/records";
/// `POST PATH_RECORDS/<store key>/RESOLVE`: resolve a key in doubt with the record in the body.
pub const RESOLVE: &str = "resolve";
/// `GET`: how many records, locks and keys in doubt the backend holds.
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
    /// The trace of an attempt begun with a hold (absent from an older idemstore's report).
    #[serde(default)]
    pub trace: Option<TraceReport>,
    /// A trace, no lock and no record: the attempt's outcome is unknown, and a retry (with a
    /// hold) gets `in-doubt` until the attempt commits late, an operator resolves or deletes
    /// the key, or the trace expires.
    #[serde(default)]
    pub in_doubt: bool,
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

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceReport {
    /// The attempt's lock token (a late commit by it stores its answer).
    pub token: String,
    /// When the attempt began, milliseconds since the Unix epoch (the store's clock).
    pub started_ms: u64,
    /// Its lock's TTL: it may have run until `started_ms` plus this.
    pub lock_ttl_ms: u64,
    /// How long the trace still lives; `null`: no expiry.
    pub ttl_ms: Option<u64>,
    /// SHA-256 of the attempt's request body (a retry with another body gets `422`).
    pub body_hash: String,
}

/// What a delete found (just before it) and deleted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeleteReport {
    pub store_key: String,
    pub record: Option<RecordReport>,
    pub lock: Option<LockReport>,
    #[serde(default)]
    pub trace: Option<TraceReport>,
    pub deleted_record: bool,
    pub deleted_lock: bool,
    #[serde(default)]
    pub deleted_trace: bool,
}

impl DeleteReport {
    pub fn deleted_anything(&self) -> bool {
        self.deleted_record || self.deleted_lock || self.deleted_trace
    }
}

/// What a resolve found (just before it) and did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResolveReport {
    /// The key just before: resolved only if it was in doubt.
    pub before: KeyReport,
    /// The record was committed (the key was in doubt).
    pub resolved: bool,
    /// The commit's outcome: `late` (`exists` if a record came meanwhile); `null` when not
    /// resolved.
    pub committed: Option<String>,
    /// The committed answer's status and the record's size.
    pub status: u16,
    pub bytes: usize,
    /// How long the record replays (the trace's remaining lifetime, at least a second); `null`
    /// when not resolved.
    pub retention_ms: Option<u64>,
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
    /// Keys with a trace and no lock (absent from an older idemstore's report).
    #[serde(default)]
    pub in_doubt: u64,
}

fn millis(ttl: Option<Duration>) -> Option<u64> {
    ttl.map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX))
}

fn report(store_key: &str, inspection: Inspection) -> KeyReport {
    KeyReport {
        store_key: store_key.to_owned(),
        in_doubt: inspection.in_doubt(),
        trace: inspection.trace.map(|t| TraceReport {
            token: t.token,
            started_ms: t.started_ms,
            lock_ttl_ms: millis(Some(t.lock_ttl)).unwrap_or(0),
            ttl_ms: millis(t.ttl),
            body_hash: t.body_hash,
        }),
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

/// Deletes `store_key`'s record, lock and trace, reporting what was there just before. On Redis, a
/// `begin` waiting on the lock in any idemstore instance is woken (the Redis wake-up); the route
/// also wakes this instance's own waiters.
pub async fn delete<B: Backend>(backend: &B, store_key: &str) -> Result<DeleteReport> {
    let before = lookup(backend, store_key).await?;
    let deleted = backend.delete(store_key).await?;
    if deleted.record || deleted.lock || deleted.trace {
        tracing::warn!(
            store_key,
            record = deleted.record,
            lock = deleted.lock,
            trace = deleted.trace,
            "an operator deleted what a store key held"
        );
    }
    Ok(DeleteReport {
        store_key: before.store_key,
        record: before.record,
        lock: before.lock,
        trace: before.trace,
        deleted_record: deleted.record,
        deleted_lock: deleted.lock,
        deleted_trace: deleted.trace,
    })
}

/// For a key in doubt (a trace, no lock, no record), commits `record` (checked by the caller:
/// [`crate::answer::check`], whose status it is) under the trace's token and body hash, for the
/// trace's remaining lifetime (at least a second, at most the protocol's longest retention): the
/// key's retries replay it. Anything else is reported as it is, with nothing done. Not atomic
/// with the look: a key whose in-doubt attempt commits meanwhile keeps the first record.
pub async fn resolve<B: Backend>(
    backend: &B,
    store_key: &str,
    record: Bytes,
    status: u16,
) -> Result<ResolveReport> {
    let before = report(store_key, backend.inspect(store_key).await?);
    let bytes = record.len();
    let trace = match &before.trace {
        Some(trace) if before.in_doubt => trace.clone(),
        _ => {
            return Ok(ResolveReport {
                before,
                resolved: false,
                committed: None,
                status,
                bytes,
                retention_ms: None,
            })
        }
    };
    let max = Duration::from_secs(idem_protocol::MAX_RETENTION_S);
    let retention = trace.ttl_ms.map_or(max, Duration::from_millis).clamp(Duration::from_secs(1), max);
    let outcome = backend
        .commit(Commit {
            key: store_key,
            token: &trace.token,
            body_hash: &trace.body_hash,
            record,
            retention,
        })
        .await?;
    tracing::warn!(
        store_key,
        token = trace.token,
        status,
        outcome = outcome.as_str(),
        "an operator resolved a key in doubt with an answer"
    );
    Ok(ResolveReport {
        before,
        resolved: true,
        committed: Some(outcome.as_str().to_owned()),
        status,
        bytes,
        retention_ms: millis(Some(retention)),
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
    Ok(CountsReport { records: counts.records, locks: counts.locks, in_doubt: counts.in_doubt })
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

/// `POST PATH_RECORDS/<store key>/RESOLVE`, the record (`IDR2`, [`crate::answer`]) in the body.
pub(crate) async fn resolve_record<B: Backend>(
    State(store): State<Arc<Store<B>>>,
    Path(key): Path<String>,
    body: std::result::Result<Bytes, BytesRejection>,
) -> Response {
    let checked = store_key(&key).and_then(|key| {
        let record = body?;
        let status = crate::answer::check(&record)
            .map_err(|why| Error::BadRequest(format!("the body must be an answer's record: {why}")))?;
        Ok((key, record, status))
    });
    match checked {
        Ok((key, record, status)) => {
            let resolved = resolve(store.backend(), key, record, status).await;
            store.waiters().wake(key);
            json(resolved)
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
