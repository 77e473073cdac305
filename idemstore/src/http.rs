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
//!    [`proto::PATH_HEALTH`] needs `x-idem-secret`, else `401` before anything else happens,
//!    even routing (so an unknown path without the secret is `401`, not `404`);
//! 3. routing: an unknown path is `404`, a known path with another method `405`;
//! 4. the body: none at all on `begin` and `release` (`413`), at most
//!    [`Options::max_body_bytes`] on `commit` (`413`, nothing stored);
//! 5. every protocol header, each exactly once and well-formed, else `400` naming it; `commit`
//!    also needs a non-empty record.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use idem_protocol as proto;

use crate::backend::{Backend, BackendError};
use crate::secret::Secret;
use crate::store::{Begin, Store};

/// How the HTTP layer guards the store.
#[derive(Debug, Clone)]
pub struct Options {
    /// Largest record `commit` accepts; larger bodies get `413`.
    pub max_body_bytes: usize,
    /// Required in `x-idem-secret` on every request but `GET /healthz`, which stays open: it
    /// tells nothing but that this process and its backend answer, and Envoy's active health
    /// checker would otherwise need the secret in its own config too (one more copy to keep
    /// and rotate) for no gain.
    pub secret: Option<Arc<Guard>>,
}

impl Options {
    pub fn new(max_body_bytes: usize) -> Self {
        Self { max_body_bytes, secret: None }
    }

    pub fn with_secret(mut self, secret: Secret) -> Self {
        self.secret = Some(Arc::new(Guard::new(secret)));
        self
    }
}

/// The secret and the count of requests refused for lacking it.
#[derive(Debug)]
pub struct Guard {
    secret: Secret,
    refused: AtomicU64,
    /// When the last refusal was logged: at most one line a second, so a prober cannot fill
    /// the log; each line carries the running count.
    logged: Mutex<Option<Instant>>,
}

/// Refusals logged at most this often; the count covers the ones in between.
const REFUSAL_LOG_PERIOD: Duration = Duration::from_secs(1);

impl Guard {
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
        (StatusCode::UNAUTHORIZED, "missing or wrong x-idem-secret").into_response()
    }
}

/// The secret check, in front of routing (see the module doc for why before it).
async fn authorize(State(guard): State<Arc<Guard>>, request: Request, next: Next) -> Response {
    if request.uri().path() == proto::PATH_HEALTH {
        return next.run(request).await;
    }
    match guard.check(request.headers()) {
        None => next.run(request).await,
        Some(why) => guard.refuse(why, request.uri().path()),
    }
}

pub fn router<B: Backend>(store: Arc<Store<B>>, options: Options) -> Router {
    // `begin` and `release` take no body: one would be a client bug or a way to make us buffer.
    let no_body = || DefaultBodyLimit::max(0);
    let router = Router::new()
        .route(proto::PATH_BEGIN, post(begin::<B>).layer(no_body()))
        .route(proto::PATH_COMMIT, post(commit::<B>))
        .route(proto::PATH_RELEASE, post(release::<B>).layer(no_body()))
        .route(proto::PATH_HEALTH, get(health::<B>))
        .layer(DefaultBodyLimit::max(options.max_body_bytes))
        .with_state(store);
    match options.secret {
        Some(guard) => router.layer(middleware::from_fn_with_state(guard, authorize)),
        None => router,
    }
}

/// Every failure the filter can see: it treats any non-200 as a store fault.
#[derive(Debug)]
pub enum Error {
    BadRequest(String),
    Backend(BackendError),
}

impl From<BackendError> for Error {
    fn from(e: BackendError) -> Self {
        Self::Backend(e)
    }
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        match self {
            Self::BadRequest(why) => (StatusCode::BAD_REQUEST, why).into_response(),
            Self::Backend(e) => {
                tracing::warn!(error = %e, "store operation failed");
                (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response()
            }
        }
    }
}

type Answer = Result<Response, Error>;

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

fn bounded(headers: &HeaderMap, name: &str, max: u64) -> Result<u64, Error> {
    proto::parse_bounded(header(headers, name)?, max)
        .ok_or_else(|| Error::BadRequest(format!("header {name} must be an integer in 1..={max}")))
}

fn answer(outcome: &'static str) -> Response {
    let mut response = StatusCode::OK.into_response();
    response
        .headers_mut()
        .insert(HeaderName::from_static(proto::HEADER_OUTCOME), HeaderValue::from_static(outcome));
    response
}

/// `_none` is always empty (the route's body limit is 0), but must be read for the limit to
/// apply to bodies without a `content-length`.
async fn begin<B: Backend>(State(store): State<Arc<Store<B>>>, headers: HeaderMap, _none: Bytes) -> Answer {
    let key = hex64(&headers, proto::HEADER_KEY)?;
    let body_hash = hex64(&headers, proto::HEADER_BODY_HASH)?;
    let lock_ttl = bounded(&headers, proto::HEADER_LOCK_TTL_MS, proto::MAX_LOCK_TTL_MS)?;
    let wait = bounded(&headers, proto::HEADER_WAIT_MS, proto::MAX_WAIT_MS)?;
    let begun =
        store.begin(key, body_hash, Duration::from_millis(lock_ttl), Duration::from_millis(wait)).await?;
    Ok(match begun {
        Begin::Record(bytes) => {
            let mut response = answer(proto::BeginOutcome::Record.as_str());
            response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
            *response.body_mut() = bytes.into();
            response
        }
        Begin::Mismatch => answer(proto::BeginOutcome::Mismatch.as_str()),
        Begin::Busy => answer(proto::BeginOutcome::Busy.as_str()),
        Begin::Locked { token } => {
            let mut response = answer(proto::BeginOutcome::Locked.as_str());
            let token = HeaderValue::try_from(token)
                .map_err(|_| BackendError::Unavailable("minted an invalid token".into()))?;
            response.headers_mut().insert(HeaderName::from_static(proto::HEADER_TOKEN), token);
            response
        }
    })
}

async fn commit<B: Backend>(State(store): State<Arc<Store<B>>>, headers: HeaderMap, record: Bytes) -> Answer {
    let key = hex64(&headers, proto::HEADER_KEY)?;
    let token = token(&headers)?;
    let body_hash = hex64(&headers, proto::HEADER_BODY_HASH)?;
    let retention = bounded(&headers, proto::HEADER_RETENTION_S, proto::MAX_RETENTION_S)?;
    if record.is_empty() {
        // The filter's records always start with a magic: an empty one could only be a bug,
        // and would be replayed as garbage to every retry of the key.
        return Err(Error::BadRequest("the record (request body) must not be empty".into()));
    }
    let outcome = store.commit(key, token, body_hash, record, Duration::from_secs(retention)).await?;
    Ok(answer(outcome.as_str()))
}

async fn release<B: Backend>(State(store): State<Arc<Store<B>>>, headers: HeaderMap, _none: Bytes) -> Answer {
    let key = hex64(&headers, proto::HEADER_KEY)?;
    let token = token(&headers)?;
    Ok(answer(store.release(key, token).await?.as_str()))
}

async fn health<B: Backend>(State(store): State<Arc<Store<B>>>) -> Response {
    match store.health().await {
        Ok(()) => (StatusCode::OK, "ok").into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "health check failed");
            (StatusCode::SERVICE_UNAVAILABLE, "unavailable").into_response()
        }
    }
}
