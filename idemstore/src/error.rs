//! What a route answers when it fails: [`Error`] (a request refused before the backend, `400` or
//! `413`, or the backend failing, `503`) and [`refused`], which answers a refusal and counts it
//! in `idemstore_rejected_total`.
//!
//! Shared by the protocol's routes ([`crate::http`]) and the operator's ([`crate::admin`]), so
//! that neither needs the other for it. Uses [`crate::backend`] (the error it wraps),
//! [`crate::metrics`] (the refusal's reason) and [`crate::store`] (whose metrics count it);
//! never a route module.

use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::backend::{Backend, BackendError};
use crate::metrics::Rejection;
use crate::store::Store;

/// Every failure a route answers with. The filter treats any non-200 as a store fault;
/// `idemstore records --url` reports the status and the text.
#[derive(Debug)]
pub enum Error {
    /// `400`, before the backend.
    BadRequest(String),
    /// The body could not be read within its limit: `413` past it, else `400`.
    Body(BytesRejection),
    /// `503`.
    Backend(BackendError),
}

impl From<BackendError> for Error {
    fn from(e: BackendError) -> Self {
        Self::Backend(e)
    }
}

impl From<BytesRejection> for Error {
    fn from(e: BytesRejection) -> Self {
        Self::Body(e)
    }
}

impl Error {
    /// Why the request was refused before the backend, if it was.
    fn rejection(&self) -> Option<Rejection> {
        match self {
            Self::BadRequest(_) => Some(Rejection::Invalid),
            Self::Body(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => Some(Rejection::TooLarge),
            Self::Body(_) => Some(Rejection::Invalid),
            Self::Backend(_) => None,
        }
    }
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        match self {
            Self::BadRequest(why) => (StatusCode::BAD_REQUEST, why).into_response(),
            Self::Body(e) => e.into_response(),
            Self::Backend(e) => {
                e.log("store operation");
                (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response()
            }
        }
    }
}

/// Answers a request refused before the backend, counting it.
pub(crate) fn refused<B: Backend>(store: &Store<B>, e: Error) -> Response {
    if let Some(reason) = e.rejection() {
        store.observer().reject(reason);
    }
    e.into_response()
}
