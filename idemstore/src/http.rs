//! Routes, header parsing and answers of the wire protocol in `idem-protocol`.
//!
//! What a request must get past before the backend sees it, in order:
//!
//! 1. the HTTP codec's own limits, which `axum::serve` (0.8) does not let us tune: HTTP/1.1
//!    requests with more than 100 headers, or a head larger than hyper's read buffer
//!    (8 KiB + 400 KiB), are refused (`431`) or the connection is closed; h2c advertises and
//!    enforces a header list of at most 16 KiB and 200 concurrent streams. The protocol's own
//!    headers take well under 1 KiB;
//! 2. the shared secret, when configured ([`Options::secret`]): every path but
//!    [`proto::PATH_HEALTH`] and [`PATH_METRICS`] needs `x-idem-secret`, else `401` before
//!    anything else happens,
//!    even routing (so an unknown path without the secret is `401`, not `404`);
//! 3. routing: an unknown path is `404`, a known path with another method `405`;
//! 4. the body: none at all on `begin` and `release` (`413`), at most
//!    [`Options::max_body_bytes`] on `commit` and `commits` (`413`, nothing stored);
//! 5. every protocol header, each exactly once and well-formed, else `400` naming it (the
//!    optional ones, `x-idem-deadline-ms`, `x-idem-hold` and `x-idem-in-doubt`, at most once;
//!    `x-idem-hold: 1` makes `x-idem-retention-s` required and allows `x-idem-supersede`,
//!    which without it is refused); `commit`
//!    also needs a non-empty record, `commits` a well-formed body ([`proto::decode_batch`]:
//!    1 to [`proto::MAX_BATCH_ITEMS`] items, each checked as `commit` checks its headers), else
//!    `400` naming the first bad item and nothing is committed.
//!
//! The operator's routes under `/v1/admin/` ([`crate::admin`]) pass the same secret check and
//! validate their store key (`400`).
//!
//! Each refusal counts in `idemstore_rejected_total` by its reason; a request past them counts
//! in `idemstore_requests_total` and `idemstore_request_duration_seconds` (see
//! [`crate::metrics`]), served by `GET /metrics` on the same listener. Each item of a `commits`
//! counts there as the `commit` it stands for.
//!
//! Owns the router ([`router`]), the secret check ([`SecretCheck`]) and the protocol's handlers.
//! Uses [`crate::admin`] (the operator's routes it mounts), [`crate::stream`] (the store
//! stream it mounts), [`crate::error`] (the failure answers), [`crate::store`],
//! [`crate::metrics`], [`crate::secret`], [`crate::backend`] and [`crate::millis`]; nothing
//! uses it but the binary and the tests.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use idem_protocol as proto;

use crate::admin;
use crate::backend::{Backend, BackendError, Commit, Hold};
use crate::error::{refused, Error};
use crate::metrics::{self, Op, Outcome, Rejection};
use crate::millis::{ceil_millis, give_up_at, running_millis};
use crate::secret::Secret;
use crate::store::{Begin, Observer, Store};
use crate::stream::StreamService;

/// Where idemstore serves its Prometheus metrics, on the same listener as the protocol.
pub const PATH_METRICS: &str = "/metrics";

/// How the HTTP layer protects the store.
#[derive(Debug, Clone)]
pub struct Options {
    /// Largest record `commit` accepts, and largest body (all its items) `commits` accepts;
    /// larger bodies get `413`.
    pub max_body_bytes: usize,
    /// Required in `x-idem-secret` on every request but `GET /healthz` and `GET /metrics`,
    /// which stay open. The health check tells nothing but that this process and its backend
    /// answer, and Envoy's active health checker would otherwise need the secret in its own
    /// config too (one more copy to keep and rotate) for no gain. The metrics tell counts and
    /// timings, never a key, token or record, and a Prometheus scraper should not need the
    /// store's secret; they are on the same listener, so whatever can reach the port can read
    /// them: keep the listener private (as the protocol needs anyway).
    pub secret: Option<Arc<SecretCheck>>,
}

impl Options {
    pub fn new(max_body_bytes: usize) -> Self {
        Self { max_body_bytes, secret: None }
    }

    pub fn with_secret(mut self, secret: Secret) -> Self {
        self.secret = Some(Arc::new(SecretCheck::new(secret)));
        self
    }
}

/// The secret and the count of requests refused for lacking it.
#[derive(Debug)]
pub struct SecretCheck {
    secret: Secret,
    refused: AtomicU64,
    /// When the last refusal was logged: at most one line a second, so a prober cannot fill
    /// the log; each line carries the running count.
    logged: Mutex<Option<Instant>>,
}

/// Refusals logged at most this often; the count covers the ones in between.
const REFUSAL_LOG_PERIOD: Duration = Duration::from_secs(1);

impl SecretCheck {
    pub fn new(secret: Secret) -> Self {
        Self { secret, refused: AtomicU64::new(0), logged: Mutex::new(None) }
    }

    /// Requests refused with `401` so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// `None` when `headers` carry the secret (exactly once), else why not, for the log.
    fn check(&self, headers: &HeaderMap) -> Option<&'static str> {
        let mut values = headers.get_all(proto::HEADER_SECRET).iter();
        match (values.next(), values.next()) {
            (None, _) => Some("missing"),
            (Some(_), Some(_)) => Some("repeated"),
            (Some(v), None) if self.secret.matches(v.as_bytes()) => None,
            (Some(_), None) => Some("wrong"),
        }
    }

    fn refuse(&self, why: &str, path: &str) -> Response {
        let refused = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        let now = Instant::now();
        let mut logged = self.logged.lock().unwrap_or_else(PoisonError::into_inner);
        if logged.is_none_or(|at| now.duration_since(at) >= REFUSAL_LOG_PERIOD) {
            *logged = Some(now);
            // Never the presented value: a near miss would be half the secret. At most one
            // line a second; `refused_total` counts every refusal since the start.
            tracing::warn!(
                reason = why,
                path,
                refused_total = refused,
                "refused a request: bad x-idem-secret"
            );
        }
        if path == proto::stream::PATH {
            // A gRPC client reads a status, not an HTTP 401.
            return tonic::Status::unauthenticated("missing or wrong x-idem-secret")
                .into_http::<axum::body::Body>()
                .into_response();
        }
        (StatusCode::UNAUTHORIZED, "missing or wrong x-idem-secret").into_response()
    }
}

/// The secret check and what it needs to count refusals.
struct Gate<B> {
    secret: Arc<SecretCheck>,
    store: Arc<Store<B>>,
}

impl<B> Clone for Gate<B> {
    fn clone(&self) -> Self {
        Self { secret: Arc::clone(&self.secret), store: Arc::clone(&self.store) }
    }
}

/// The secret check, in front of routing (see the module doc for why before it).
async fn authorize<B: Backend>(State(gate): State<Gate<B>>, request: Request, next: Next) -> Response {
    let path = request.uri().path();
    if path == proto::PATH_HEALTH || path == PATH_METRICS {
        return next.run(request).await;
    }
    match gate.secret.check(request.headers()) {
        None => next.run(request).await,
        Some(why) => {
            gate.store.observer().reject(Rejection::Secret);
            gate.secret.refuse(why, path)
        }
    }
}

pub fn router<B: Backend>(store: Arc<Store<B>>, options: Options) -> Router {
    // `begin` and `release` take no body: one would be a client bug or a way to make us buffer.
    // `commit` and `commits` get the router-wide limit below.
    let no_body = || DefaultBodyLimit::max(0);
    let router = Router::new()
        .route(proto::PATH_BEGIN, post(begin::<B>).layer(no_body()))
        .route(proto::PATH_COMMIT, post(commit::<B>))
        .route(proto::PATH_COMMITS, post(commits::<B>))
        .route(proto::PATH_RELEASE, post(release::<B>).layer(no_body()))
        .route(proto::PATH_HEALTH, get(health::<B>))
        // The store stream (gRPC over the same h2c listener), behind the same gate.
        .route_service(proto::stream::PATH, StreamService::new(Arc::clone(&store), options.max_body_bytes))
        .route(PATH_METRICS, get(scrape::<B>))
        // The operator's routes (`idemstore records --url`), behind the secret like the protocol.
        .route(admin::PATH_RECORDS, get(admin::find_records::<B>).layer(no_body()))
        .route(
            &format!("{}/{{key}}", admin::PATH_RECORDS),
            get(admin::get_record::<B>).delete(admin::delete_record::<B>).layer(no_body()),
        )
        .route(
            &format!("{}/{{key}}/{}", admin::PATH_RECORDS, admin::RESOLVE),
            post(admin::resolve_record::<B>),
        )
        .route(admin::PATH_COUNTS, get(admin::get_counts::<B>).layer(no_body()))
        .layer(DefaultBodyLimit::max(options.max_body_bytes))
        .with_state(Arc::clone(&store));
    match options.secret {
        Some(secret) => router.layer(middleware::from_fn_with_state(Gate { secret, store }, authorize::<B>)),
        None => router,
    }
}

/// The single value of header `name`; missing or repeated is a bad request.
fn header<'a>(headers: &'a HeaderMap, name: &str) -> Result<&'a [u8], Error> {
    let mut values = headers.get_all(name).iter();
    match (values.next(), values.next()) {
        (Some(v), None) => Ok(v.as_bytes()),
        (None, _) => Err(Error::BadRequest(format!("missing header {name}"))),
        (Some(_), Some(_)) => Err(Error::BadRequest(format!("repeated header {name}"))),
    }
}

fn checked<'a>(
    headers: &'a HeaderMap,
    name: &str,
    valid: fn(&[u8]) -> bool,
    what: &str,
) -> Result<&'a str, Error> {
    let value = header(headers, name)?;
    let invalid = || Error::BadRequest(format!("header {name} must be {what}"));
    if !valid(value) {
        return Err(invalid());
    }
    std::str::from_utf8(value).map_err(|_| invalid())
}

fn hex64<'a>(headers: &'a HeaderMap, name: &str) -> Result<&'a str, Error> {
    checked(headers, name, proto::is_hex64, "64 lowercase hex characters")
}

fn token(headers: &HeaderMap) -> Result<&str, Error> {
    checked(headers, proto::HEADER_TOKEN, proto::is_token, "a lock token")
}

/// An optional `0`/`1` header: absent is `false`; repeated or anything else is a bad request.
fn flag(headers: &HeaderMap, name: &str) -> Result<bool, Error> {
    if headers.get(name).is_none() {
        return Ok(false);
    }
    match header(headers, name)? {
        b"0" => Ok(false),
        b"1" => Ok(true),
        _ => Err(Error::BadRequest(format!("header {name} must be 0 or 1"))),
    }
}

fn bounded(headers: &HeaderMap, name: &str, max: u64) -> Result<u64, Error> {
    within(headers, name, 1, max)
}

/// A decimal header value in `min..=max`; the refusal names the header and the range.
fn within(headers: &HeaderMap, name: &str, min: u64, max: u64) -> Result<u64, Error> {
    proto::parse_in(header(headers, name)?, min..=max)
        .ok_or_else(|| Error::BadRequest(format!("header {name} must be an integer in {min}..={max}")))
}

fn answer(outcome: &'static str) -> Response {
    let mut response = StatusCode::OK.into_response();
    response
        .headers_mut()
        .insert(HeaderName::from_static(proto::HEADER_OUTCOME), HeaderValue::from_static(outcome));
    response
}

/// `begin`'s validated headers.
struct BeginArgs<'a> {
    key: &'a str,
    body_hash: &'a str,
    lock_ttl: Duration,
    wait: Duration,
    /// When the caller gives up, on this host's monotonic clock.
    give_up: Option<tokio::time::Instant>,
    /// `x-idem-hold: 1`: its retention and the token it supersedes.
    hold: Option<(Duration, Option<&'a str>)>,
}

impl BeginArgs<'_> {
    fn hold(&self) -> Option<Hold<'_>> {
        self.hold.map(|(retention, supersede)| Hold { retention, supersede })
    }
}

/// The body is always empty (the route's limit is 0), but must be read for the limit to apply
/// to bodies without a `content-length`; it is checked before the headers, as an extractor.
fn begin_args(headers: &HeaderMap, body: Result<Bytes, BytesRejection>) -> Result<BeginArgs<'_>, Error> {
    body?;
    Ok(BeginArgs {
        key: hex64(headers, proto::HEADER_KEY)?,
        body_hash: hex64(headers, proto::HEADER_BODY_HASH)?,
        lock_ttl: Duration::from_millis(bounded(headers, proto::HEADER_LOCK_TTL_MS, proto::MAX_LOCK_TTL_MS)?),
        // 0: a single attempt, `busy` at once if the lock is held.
        wait: Duration::from_millis(within(headers, proto::HEADER_WAIT_MS, 0, proto::MAX_WAIT_MS)?),
        give_up: give_up(headers)?,
        hold: hold(headers)?,
    })
}

/// `x-idem-hold` (optional, `0` or `1`); with `1`, `x-idem-retention-s` (required) and
/// `x-idem-supersede` (optional, a token). Without it, `x-idem-retention-s` is not read and
/// `x-idem-supersede` is refused: superseding needs the trace's rules.
fn hold(headers: &HeaderMap) -> Result<Option<(Duration, Option<&str>)>, Error> {
    if !flag(headers, proto::HEADER_HOLD)? {
        if headers.get(proto::HEADER_SUPERSEDE).is_some() {
            let why = format!("header {} needs {}: 1", proto::HEADER_SUPERSEDE, proto::HEADER_HOLD);
            return Err(Error::BadRequest(why));
        }
        return Ok(None);
    }
    let retention = Duration::from_secs(bounded(headers, proto::HEADER_RETENTION_S, proto::MAX_RETENTION_S)?);
    let supersede = if headers.get(proto::HEADER_SUPERSEDE).is_some() {
        Some(checked(headers, proto::HEADER_SUPERSEDE, proto::is_token, "a lock token")?)
    } else {
        None
    };
    Ok(Some((retention, supersede)))
}

/// `x-idem-deadline-ms` (optional), the caller's wall-clock deadline, as an instant on this
/// host's monotonic clock: the time left is read against this host's wall clock once, here.
/// Clocks that disagree by more than a callout's timeout make calls expire early (this clock
/// ahead) or lock late (behind): the `expired` outcome count shows the first.
fn give_up(headers: &HeaderMap) -> Result<Option<tokio::time::Instant>, Error> {
    if headers.get(proto::HEADER_DEADLINE_MS).is_none() {
        return Ok(None);
    }
    let deadline_ms = within(headers, proto::HEADER_DEADLINE_MS, 1, u64::MAX)?;
    Ok(Some(give_up_at(deadline_ms)))
}

async fn begin<B: Backend>(
    State(store): State<Arc<Store<B>>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let started = Instant::now();
    let args = match begin_args(&headers, body) {
        Ok(args) => args,
        Err(e) => return refused(&store, e),
    };
    let timer = store.observer().timer(Op::Begin, started);
    let begun = match store
        .begin_with(args.key, args.body_hash, args.lock_ttl, args.wait, args.give_up, args.hold())
        .await
    {
        Ok(begun) => begun,
        Err(e) => {
            timer.failed(&e);
            return Error::from(e).into_response();
        }
    };
    let outcome = match &begun {
        Begin::Record(..) => proto::BeginOutcome::Record,
        Begin::Mismatch => proto::BeginOutcome::Mismatch,
        Begin::Busy { .. } => proto::BeginOutcome::Busy,
        Begin::Locked { .. } => proto::BeginOutcome::Locked,
        Begin::Expired => proto::BeginOutcome::Expired,
        Begin::InDoubt { .. } => proto::BeginOutcome::InDoubt,
    };
    let mut response = answer(outcome.as_str());
    match begun {
        Begin::Record(bytes, ttl) => {
            response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
            // Whole milliseconds, rounded down, so a cache sized by it never outlives the record.
            if let Some(ms) = ttl.and_then(|t| u64::try_from(t.as_millis()).ok()).filter(|ms| *ms > 0) {
                response
                    .headers_mut()
                    .insert(HeaderName::from_static(proto::HEADER_TTL_MS), HeaderValue::from(ms));
            }
            *response.body_mut() = bytes.into();
        }
        Begin::Locked { token } => match HeaderValue::try_from(token) {
            Ok(token) => {
                response.headers_mut().insert(HeaderName::from_static(proto::HEADER_TOKEN), token);
            }
            Err(_) => {
                let e = BackendError::Unavailable("minted an invalid token".into());
                timer.failed(&e);
                return Error::from(e).into_response();
            }
        },
        Begin::Busy { remaining } => {
            if let Some(remaining) = remaining {
                response.headers_mut().insert(
                    HeaderName::from_static(proto::HEADER_LOCK_REMAINING_MS),
                    HeaderValue::from(ceil_millis(remaining)),
                );
            }
        }
        Begin::InDoubt { token, started_ms, running } => {
            let Ok(token) = HeaderValue::try_from(token) else {
                let e = BackendError::Unavailable("an in-doubt trace with an invalid token".into());
                timer.failed(&e);
                return Error::from(e).into_response();
            };
            let headers = response.headers_mut();
            headers.insert(HeaderName::from_static(proto::HEADER_TOKEN), token);
            headers.insert(HeaderName::from_static(proto::HEADER_STARTED_MS), HeaderValue::from(started_ms));
            headers.insert(
                HeaderName::from_static(proto::HEADER_RUNNING_MS),
                HeaderValue::from(running_millis(running)),
            );
        }
        Begin::Mismatch | Begin::Expired => {}
    }
    timer.answered(Outcome::Begin(outcome));
    response
}

/// `commit`'s validated headers and record.
fn commit_args(headers: &HeaderMap, body: Result<Bytes, BytesRejection>) -> Result<Commit<'_>, Error> {
    let record = body?;
    let args = Commit {
        key: hex64(headers, proto::HEADER_KEY)?,
        token: token(headers)?,
        body_hash: hex64(headers, proto::HEADER_BODY_HASH)?,
        retention: Duration::from_secs(bounded(headers, proto::HEADER_RETENTION_S, proto::MAX_RETENTION_S)?),
        record,
    };
    if args.record.is_empty() {
        // The filter's records always start with a magic: an empty one could only be a bug,
        // and would be replayed as garbage to every retry of the key.
        return Err(Error::BadRequest("the record (request body) must not be empty".into()));
    }
    Ok(args)
}

async fn commit<B: Backend>(
    State(store): State<Arc<Store<B>>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let started = Instant::now();
    let args = match commit_args(&headers, body) {
        Ok(args) => args,
        Err(e) => return refused(&store, e),
    };
    let timer = store.observer().timer(Op::Commit, started);
    match store.commit(args).await {
        Ok(outcome) => {
            timer.answered(Outcome::Commit(outcome));
            answer(outcome.as_str())
        }
        Err(e) => {
            timer.failed(&e);
            Error::from(e).into_response()
        }
    }
}

/// `commits`' validated retention and body; the items are decoded from the body by the caller,
/// as they borrow it.
fn commits_args(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<(Duration, Bytes), Error> {
    let body = body?;
    let retention = Duration::from_secs(bounded(headers, proto::HEADER_RETENTION_S, proto::MAX_RETENTION_S)?);
    Ok((retention, body))
}

/// Many commits in one call: every item is validated before any is committed (a bad one is a
/// `400` naming it, nothing done), then all are committed at once, each as its own `commit`
/// would be, counted and timed as one. Concurrent, not one after the other: on Redis, the
/// connection pipelines the scripts, so the batch costs about one Redis round trip. An item
/// whose commit fails answers `failed` and the others stand.
///
/// Items may share a key: each is its own commit, in the order they reach the backend.
async fn commits<B: Backend>(
    State(store): State<Arc<Store<B>>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let started = Instant::now();
    let (retention, body) = match commits_args(&headers, body) {
        Ok(args) => args,
        Err(e) => return refused(&store, e),
    };
    let items = match proto::decode_batch(&body) {
        Ok(items) => items,
        Err(why) => return refused(&store, Error::BadRequest(format!("malformed batch: {why}"))),
    };
    store.observer().batch(items.len());
    // Every timer is started here, before the first await: a caller gone mid-batch counts
    // each item not yet answered as `cancelled`, as many `commit`s would.
    let pending = items.iter().enumerate().map(|(i, item)| {
        let timer = store.observer().timer(Op::Commit, started);
        let (store, record) = (&store, body.slice(item.record.clone()));
        async move {
            match store
                .commit(Commit {
                    key: item.key,
                    token: item.token,
                    body_hash: item.body_hash,
                    record,
                    retention,
                })
                .await
            {
                Ok(outcome) => {
                    timer.answered(Outcome::Commit(outcome));
                    Some(outcome)
                }
                Err(e) => {
                    timer.failed(&e);
                    e.log(&format!("store operation (batched commit, item {i})"));
                    None
                }
            }
        }
    });
    let outcomes = futures_util::future::join_all(pending).await;
    let mut response = answer(proto::BATCH_OUTCOME);
    *response.body_mut() = proto::encode_batch_answer(&outcomes).into();
    response
}

/// The body is always empty, as for `begin`.
async fn release<B: Backend>(
    State(store): State<Arc<Store<B>>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let started = Instant::now();
    let args = body.map_err(Error::from).and_then(|_| {
        Ok((hex64(&headers, proto::HEADER_KEY)?, token(&headers)?, flag(&headers, proto::HEADER_IN_DOUBT)?))
    });
    let (key, token, in_doubt) = match args {
        Ok(args) => args,
        Err(e) => return refused(&store, e),
    };
    let timer = store.observer().timer(Op::Release, started);
    if in_doubt {
        store.observer().in_doubt_release();
    }
    match store.release(key, token, in_doubt).await {
        Ok(outcome) => {
            timer.answered(Outcome::Release(outcome));
            answer(outcome.as_str())
        }
        Err(e) => {
            timer.failed(&e);
            Error::from(e).into_response()
        }
    }
}

/// `GET /metrics`: the Prometheus text exposition (version 0.0.4) of this instance's metrics
/// (see [`crate::metrics`]). Needs no secret, like `/healthz` (see [`Options::secret`]).
/// Each scrape runs the backend's health check for `idemstore_backend_up`: against Redis, one
/// `PING`, bounded by `--redis-timeout-ms`.
async fn scrape<B: Backend>(State(store): State<Arc<Store<B>>>) -> Response {
    let backend_up = store.health().await.is_ok();
    match store.observer().encode(backend_up, store.backend().usage()) {
        Ok(text) => (
            [
                (CONTENT_TYPE, HeaderValue::from_static(metrics::CONTENT_TYPE)),
                (CACHE_CONTROL, HeaderValue::from_static("no-store")),
            ],
            text,
        )
            .into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "cannot encode the metrics");
            (StatusCode::INTERNAL_SERVER_ERROR, "cannot encode the metrics").into_response()
        }
    }
}

async fn health<B: Backend>(State(store): State<Arc<Store<B>>>) -> Response {
    match store.health().await {
        Ok(()) => (StatusCode::OK, "ok").into_response(),
        // Logged by the store's health check, as a change.
        Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable").into_response(),
    }
}
