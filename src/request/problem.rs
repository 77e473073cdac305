//! Every answer the filter makes itself: RFC 9457 `application/problem+json`. None of them
//! echoes the client's key. Besides `type`, each carries a stable `code` (e.g. `key-reused`)
//! that clients can switch on.

use serde::Serialize;

use crate::http::grpc;
use crate::request::fingerprint::Differs;
use crate::request::inbox::IdError;
use crate::request::key::KeyError;

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
    code: &'a str,
    title: &'a str,
    status: u32,
    detail: &'a str,
    /// `key-reused`: what differed (`body`, `target` or `header`).
    #[serde(skip_serializing_if = "Option::is_none")]
    differs: Option<&'a str>,
    /// `key-reused` on a header: its name (from the configuration, never the client's value).
    #[serde(skip_serializing_if = "Option::is_none")]
    header: Option<&'a str>,
}

const TYPE_BASE: &str = "https://idempotency-filter.dev/problems/";

/// `slug` names the `type`; `code` is the same word but where an older `type` said otherwise.
fn problem(status: u32, slug: &str, title: &str, detail: &str) -> LocalResponse {
    problem_with(Body {
        kind: format!("{TYPE_BASE}{slug}"),
        code: slug,
        title,
        status,
        detail,
        differs: None,
        header: None,
    })
}

fn problem_with(body: Body<'_>) -> LocalResponse {
    LocalResponse {
        status: body.status,
        headers: vec![("content-type".into(), "application/problem+json".into())],
        // Serializing a struct of strings cannot fail; an empty body is the harmless fallback.
        body: serde_json::to_vec(&body).unwrap_or_default(),
    }
}

/// `retry-after` in whole seconds, at least 1.
fn retry_after(mut r: LocalResponse, ms: u64) -> LocalResponse {
    r.headers.push(("retry-after".into(), ms.div_ceil(1000).max(1).to_string()));
    r
}

pub fn missing_key() -> LocalResponse {
    problem(
        400,
        "missing-key",
        "Idempotency-Key required",
        "This request must carry an Idempotency-Key header.",
    )
}

/// A request that arrives with the header only the filter sets on a gRPC replay it re-routes.
pub fn hop_header() -> LocalResponse {
    problem(
        400,
        "internal-header",
        "Internal header",
        "The x-idempotency-grpc-replay header is set by the idempotency filter only.",
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

/// Inbox mode: another delivery of the same message is still being handled; its lock lives
/// `lock_ms` more.
pub fn message_in_flight(lock_ms: u64) -> LocalResponse {
    let r = problem(
        409,
        "message-in-flight",
        "Message in flight",
        "Another delivery of this message is still being processed; redeliver it later.",
    );
    retry_after(r, lock_ms)
}

pub fn body_too_large(max: usize) -> LocalResponse {
    problem(
        413,
        "body-too-large",
        "Request body too large",
        &format!("A request with an Idempotency-Key may carry at most {max} bytes of body."),
    )
}

/// The key's record answers another request: `what` differed.
pub fn key_reused(what: &Differs) -> LocalResponse {
    let (differs, header, detail) = match what {
        Differs::Body => {
            ("body", None, "This Idempotency-Key was already used with a different request body.".to_string())
        }
        Differs::Target => (
            "target",
            None,
            "This Idempotency-Key was already used with a different request target (method, path or query)."
                .to_string(),
        ),
        Differs::Header(name) => (
            "header",
            Some(name.as_str()),
            format!(
                "This Idempotency-Key was already used with a different value of the request header {name}."
            ),
        ),
    };
    problem_with(Body {
        kind: format!("{TYPE_BASE}key-reused"),
        code: "key-reused",
        title: "Idempotency-Key reused",
        status: 422,
        detail: &detail,
        differs: Some(differs),
        header,
    })
}

/// The original request still runs; its lock lives `lock_ms` more.
pub fn in_flight(lock_ms: u64) -> LocalResponse {
    let r = problem_with(Body {
        kind: format!("{TYPE_BASE}in-flight"),
        code: "request-in-flight",
        title: "Request in flight",
        status: 409,
        detail:
            "A request with this Idempotency-Key is still being processed; retry later with the same key.",
        differs: None,
        header: None,
    });
    retry_after(r, lock_ms)
}

/// The stored answer is in a content coding this retry does not accept.
pub fn encoding_not_acceptable(coding: &str) -> LocalResponse {
    // The coding comes from the stored answer's header, visible ASCII; cut to keep it short.
    let coding: String = coding.chars().take(32).collect();
    problem(
        406,
        "encoding-not-acceptable",
        "Stored answer's encoding not acceptable",
        &format!(
            "The answer to this Idempotency-Key was stored {coding}-coded, and this request does not accept \
             {coding} (Accept-Encoding); retry with the same key and Accept-Encoding: {coding}."
        ),
    )
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

/// A retry of a request this Envoy already ran, while the store that holds its answer fails: it
/// must not run again, and its answer cannot be read yet (the local fallback's marker).
pub fn answer_withheld(retry_ms: u64) -> LocalResponse {
    let r = problem(
        503,
        "store-unavailable",
        "Idempotency store unavailable",
        "A request with this Idempotency-Key was already processed; its stored response cannot be read while the idempotency store is unavailable. Retry later with the same key.",
    );
    retry_after(r, retry_ms)
}

pub fn store_unavailable() -> LocalResponse {
    problem(
        503,
        "store-unavailable",
        "Idempotency store unavailable",
        "The request was not processed because its idempotency could not be guaranteed; retry with the same key.",
    )
}

/// A trailers-only gRPC answer: `code` with `message` (percent-encoded as gRPC wants), and
/// `extra` metadata.
pub fn grpc_status(code: u8, message: &str, extra: Vec<(String, String)>) -> LocalResponse {
    let mut headers = vec![
        ("content-type".to_string(), "application/grpc".to_string()),
        ("grpc-status".to_string(), code.to_string()),
        ("grpc-message".to_string(), grpc::percent_encode(message)),
    ];
    headers.extend(extra);
    LocalResponse { status: 200, headers, body: Vec::new() }
}

/// One of the filter's HTTP answers (a problem, see [`crate::request::problem`]) in gRPC terms:
/// the status the table in docs/grpc.md gives, `grpc-message` `<code>: <detail>` from the
/// problem, `grpc-retry-pushback-ms` from `pushback_ms` (else from `retry-after`). An answer
/// that already is gRPC is left as it is.
pub fn grpc(r: LocalResponse, pushback_ms: Option<u64>) -> LocalResponse {
    if r.headers.iter().any(|(n, _)| n == "grpc-status") {
        return r;
    }
    let code = match r.status {
        400 => grpc::INVALID_ARGUMENT,
        406 | 422 => grpc::FAILED_PRECONDITION,
        409 | 502 | 503 => grpc::UNAVAILABLE,
        413 => grpc::RESOURCE_EXHAUSTED,
        504 => grpc::DEADLINE_EXCEEDED,
        _ => grpc::UNKNOWN,
    };
    let problem: Option<serde_json::Value> = serde_json::from_slice(&r.body).ok();
    let field = |name: &str| problem.as_ref().and_then(|p| p.get(name)).and_then(|v| v.as_str());
    let message = match (field("code"), field("detail")) {
        (Some(c), Some(d)) => format!("{c}: {d}"),
        _ => format!("idempotency filter answered {}", r.status),
    };
    let retry_after_ms = r
        .headers
        .iter()
        .find(|(n, _)| n == "retry-after")
        .and_then(|(_, v)| v.parse::<u64>().ok())
        .map(|s| s.saturating_mul(1000));
    let mut extra: Vec<(String, String)> =
        r.headers.into_iter().filter(|(n, _)| n != "content-type" && n != "retry-after").collect();
    if let Some(ms) = pushback_ms.or(retry_after_ms) {
        extra.push(("grpc-retry-pushback-ms".to_string(), ms.to_string()));
    }
    grpc_status(code, &message, extra)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_are_rfc9457() {
        for (r, status, code) in [
            (missing_key(), 400, "missing-key"),
            (invalid_key(KeyError::Empty), 400, "invalid-key"),
            (body_too_large(10), 413, "body-too-large"),
            (key_reused(&Differs::Body), 422, "key-reused"),
            (in_flight(1), 409, "request-in-flight"),
            (store_unavailable(), 503, "store-unavailable"),
            (upstream_failed(), 502, "upstream-failed"),
            (upstream_timeout(5), 504, "upstream-timeout"),
            (missing_message_id(), 400, "missing-message-id"),
            (invalid_message_id(IdError::Empty), 400, "invalid-message-id"),
            (message_in_flight(1), 409, "message-in-flight"),
            (encoding_not_acceptable("gzip"), 406, "encoding-not-acceptable"),
        ] {
            assert_eq!(r.status, status);
            assert_eq!(r.headers[0], ("content-type".into(), "application/problem+json".into()));
            let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            assert_eq!(v["status"], status);
            assert_eq!(v["code"], code);
            assert!(v["type"].as_str().unwrap().starts_with(TYPE_BASE));
            assert!(v["title"].is_string());
            assert!(v["detail"].is_string());
        }
    }

    #[test]
    fn key_reused_says_what_differed() {
        let v = |r: LocalResponse| serde_json::from_slice::<serde_json::Value>(&r.body).unwrap();
        assert_eq!(v(key_reused(&Differs::Body))["differs"], "body");
        assert_eq!(v(key_reused(&Differs::Target))["differs"], "target");
        let h = v(key_reused(&Differs::Header("x-tenant".into())));
        assert_eq!((h["differs"].as_str(), h["header"].as_str()), (Some("header"), Some("x-tenant")));
        assert!(h["detail"].as_str().unwrap().contains("x-tenant"));
        assert_eq!(v(key_reused(&Differs::Body)).get("header"), None);
    }

    #[test]
    fn retry_after_is_the_lock_time_left_in_whole_seconds() {
        let after =
            |r: LocalResponse| r.headers.iter().find(|(n, _)| n == "retry-after").map(|(_, v)| v.clone());
        assert_eq!(after(in_flight(0)).as_deref(), Some("1"));
        assert_eq!(after(in_flight(1)).as_deref(), Some("1"));
        assert_eq!(after(in_flight(1000)).as_deref(), Some("1"));
        assert_eq!(after(in_flight(1001)).as_deref(), Some("2"));
        assert_eq!(after(message_in_flight(29_500)).as_deref(), Some("30"));
    }

    fn grpc_header<'a>(r: &'a LocalResponse, name: &str) -> Option<&'a str> {
        r.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    #[test]
    fn problems_become_statuses() {
        let cases = [
            (missing_key(), grpc::INVALID_ARGUMENT, "missing-key: "),
            (body_too_large(10), grpc::RESOURCE_EXHAUSTED, "body-too-large: "),
            (key_reused(&Differs::Body), grpc::FAILED_PRECONDITION, "key-reused: "),
            (store_unavailable(), grpc::UNAVAILABLE, "store-unavailable: "),
        ];
        for (p, code, prefix) in cases {
            let r = grpc(p, None);
            assert_eq!(r.status, 200);
            assert!(r.body.is_empty());
            assert_eq!(grpc_header(&r, "content-type"), Some("application/grpc"));
            assert_eq!(grpc_header(&r, "grpc-status"), Some(code.to_string().as_str()));
            let message = grpc_header(&r, "grpc-message").unwrap();
            assert!(message.starts_with(prefix), "{message}");
            assert!(!message.contains('%'), "{message}");
        }
        let busy = grpc(in_flight(30_000), Some(1234));
        assert_eq!(grpc_header(&busy, "grpc-status"), Some("14"));
        assert_eq!(grpc_header(&busy, "grpc-retry-pushback-ms"), Some("1234"));
        assert_eq!(grpc_header(&busy, "retry-after"), None);
        let again = grpc(busy.clone(), None);
        assert_eq!(again, busy, "a gRPC answer is left alone");
    }
}
