//! Every answer the filter makes itself: RFC 9457 `application/problem+json`. None of them
//! echoes the client's key.

use serde::Serialize;

use crate::inbox::IdError;
use crate::key::KeyError;

/// A response the filter sends instead of the upstream's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalResponse {
    pub status: u32,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

#[derive(Serialize)]
struct Body<'a> {
    #[serde(rename = "type")]
    kind: String,
    title: &'a str,
    status: u32,
    detail: &'a str,
}

const TYPE_BASE: &str = "https://idempotency-filter.dev/problems/";

fn problem(status: u32, slug: &str, title: &str, detail: &str) -> LocalResponse {
    let body = Body { kind: format!("{TYPE_BASE}{slug}"), title, status, detail };
    LocalResponse {
        status,
        headers: vec![("content-type".into(), "application/problem+json".into())],
        // Serializing a struct of strings cannot fail; an empty body is the harmless fallback.
        body: serde_json::to_vec(&body).unwrap_or_default(),
    }
}

pub fn missing_key() -> LocalResponse {
    problem(
        400,
        "missing-key",
        "Idempotency-Key required",
        "This request must carry an Idempotency-Key header.",
    )
}

pub fn invalid_key(e: KeyError) -> LocalResponse {
    problem(400, "invalid-key", "Invalid Idempotency-Key", &e.to_string())
}

/// Inbox mode: a guarded request without a message id (`missing_id: reject`).
pub fn missing_message_id() -> LocalResponse {
    problem(
        400,
        "missing-message-id",
        "Message id required",
        "This endpoint takes messages with an id (CloudEvents ce-id and ce-source, or the configured header or body field).",
    )
}

/// Inbox mode: an id that is there but unusable (empty, too long, not a string, repeated).
pub fn invalid_message_id(e: IdError) -> LocalResponse {
    problem(400, "invalid-message-id", "Invalid message id", &e.to_string())
}

/// Inbox mode: another delivery of the same message is still being handled.
pub fn message_in_flight() -> LocalResponse {
    let mut r = problem(
        409,
        "message-in-flight",
        "Message in flight",
        "Another delivery of this message is still being processed; redeliver it later.",
    );
    r.headers.push(("retry-after".into(), "1".into()));
    r
}

pub fn body_too_large(max: usize) -> LocalResponse {
    problem(
        413,
        "body-too-large",
        "Request body too large",
        &format!("A request with an Idempotency-Key may carry at most {max} bytes of body."),
    )
}

pub fn key_reused() -> LocalResponse {
    problem(
        422,
        "key-reused",
        "Idempotency-Key reused",
        "This Idempotency-Key was already used with a different request body.",
    )
}

pub fn in_flight() -> LocalResponse {
    let mut r = problem(
        409,
        "in-flight",
        "Request in flight",
        "A request with this Idempotency-Key is still being processed; retry later with the same key.",
    );
    r.headers.push(("retry-after".into(), "1".into()));
    r
}

pub fn upstream_failed() -> LocalResponse {
    problem(
        502,
        "upstream-failed",
        "Upstream failed",
        "The upstream reset or refused the request; retry with the same key.",
    )
}

pub fn upstream_timeout(timeout_ms: u64) -> LocalResponse {
    problem(
        504,
        "upstream-timeout",
        "Upstream timed out",
        &format!("The upstream did not answer within {timeout_ms} ms; retry with the same key."),
    )
}

pub fn store_unavailable() -> LocalResponse {
    problem(
        503,
        "store-unavailable",
        "Idempotency store unavailable",
        "The request was not processed because its idempotency could not be guaranteed; retry with the same key.",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_are_rfc9457() {
        for (r, status) in [
            (missing_key(), 400),
            (invalid_key(KeyError::Empty), 400),
            (body_too_large(10), 413),
            (key_reused(), 422),
            (in_flight(), 409),
            (store_unavailable(), 503),
            (upstream_failed(), 502),
            (upstream_timeout(5), 504),
            (missing_message_id(), 400),
            (invalid_message_id(IdError::Empty), 400),
            (message_in_flight(), 409),
        ] {
            assert_eq!(r.status, status);
            assert_eq!(r.headers[0], ("content-type".into(), "application/problem+json".into()));
            let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            assert_eq!(v["status"], status);
            assert!(v["type"].as_str().unwrap().starts_with(TYPE_BASE));
            assert!(v["title"].is_string());
            assert!(v["detail"].is_string());
        }
    }
}
