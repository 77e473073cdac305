//! Routes, header parsing and answers of the wire protocol in `idem-protocol`.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use idem_protocol as proto;

use crate::backend::{Backend, BackendError};
use crate::store::{Begin, Store};

pub fn router<B: Backend>(store: Arc<Store<B>>, max_body_bytes: usize) -> Router {
    Router::new()
        .route(proto::PATH_BEGIN, post(begin::<B>))
        .route(proto::PATH_COMMIT, post(commit::<B>))
        .route(proto::PATH_RELEASE, post(release::<B>))
        .route(proto::PATH_HEALTH, get(health::<B>))
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(store)
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

async fn begin<B: Backend>(State(store): State<Arc<Store<B>>>, headers: HeaderMap) -> Answer {
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
    let outcome = store.commit(key, token, body_hash, record, Duration::from_secs(retention)).await?;
    Ok(answer(outcome.as_str()))
}

async fn release<B: Backend>(State(store): State<Arc<Store<B>>>, headers: HeaderMap) -> Answer {
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
