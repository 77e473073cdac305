//! Every answer the filter makes itself: RFC 9457 `application/problem+json`. None of them
//! echoes the client's key. Besides `type`, each carries a stable `code` (e.g. `key-reused`)
//! that clients can switch on.

use serde::Serialize;

use crate::config::Config;
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

/// A problem's `type` with neither `problem_type_base` nor `policy_url`: a tag URI (RFC 4151),
/// which names the type without pretending to be a page somebody hosts (RFC 9457 allows
/// non-resolvable type URIs; clients switch on `code`).
pub const TAG_TYPE_BASE: &str = "tag:idempotency-filter,2026:problems/";

/// The `type` of the problem `code`: `problem_type_base` + code, else the `policy_url` page's
/// fragment `#code`, else the tag URI.
pub fn type_uri(cfg: &Config, code: &str) -> String {
    match (&cfg.problem_type_base, &cfg.policy_url) {
        (Some(base), _) => format!("{base}{code}"),
        (None, Some(url)) if !url.contains('#') => format!("{url}#{code}"),
        _ => format!("{TAG_TYPE_BASE}{code}"),
    }
}

fn problem(cfg: &Config, status: u32, code: &str, title: &str, detail: &str) -> LocalResponse {
    problem_with(
        cfg,
        Body { kind: type_uri(cfg, code), code, title, status, detail, differs: None, header: None },
    )
}

fn problem_with(cfg: &Config, body: Body<'_>) -> LocalResponse {
    let mut headers = vec![("content-type".into(), "application/problem+json".into())];
    headers.extend(policy_link(cfg));
    LocalResponse {
        status: body.status,
        headers,
        // Serializing a struct of strings cannot fail; an empty body is the harmless fallback.
        body: serde_json::to_vec(&body).unwrap_or_default(),
    }
}

/// `link: <policy_url>; rel="describedby"`, when the policy is published (the IETF
/// Idempotency-Key draft: error answers SHOULD point to the documentation).
pub fn policy_link(cfg: &Config) -> Option<(String, String)> {
    cfg.policy_url.as_ref().map(|url| ("link".to_string(), format!("<{url}>; rel=\"describedby\"")))
}

/// `retry-after` in whole seconds, at least 1.
fn retry_after(mut r: LocalResponse, ms: u64) -> LocalResponse {
    r.headers.push(("retry-after".into(), ms.div_ceil(1000).max(1).to_string()));
    r
}

pub fn missing_key(cfg: &Config) -> LocalResponse {
    problem(
        cfg,
        400,
        "missing-key",
        "Idempotency-Key required",
        "This request must carry an Idempotency-Key header.",
    )
}

/// A request that arrives with the header only the filter sets on a gRPC replay it re-routes.
pub fn hop_header(cfg: &Config) -> LocalResponse {
    problem(
        cfg,
        400,
        "internal-header",
        "Internal header",
        "The x-idempotency-grpc-replay header is set by the idempotency filter only.",
    )
}

pub fn invalid_key(cfg: &Config, e: KeyError) -> LocalResponse {
    problem(cfg, 400, "invalid-key", "Invalid Idempotency-Key", &e.to_string())
}

/// Inbox mode: a guarded request without a message id (`missing_id: reject`).
pub fn missing_message_id(cfg: &Config) -> LocalResponse {
    problem(
        cfg,
        400,
        "missing-message-id",
        "Message id required",
        "This endpoint takes messages with an id (CloudEvents ce-id and ce-source, or the configured header or body field).",
    )
}

/// Inbox mode: an id that is there but unusable (empty, too long, not a string, repeated).
pub fn invalid_message_id(cfg: &Config, e: IdError) -> LocalResponse {
    problem(cfg, 400, "invalid-message-id", "Invalid message id", &e.to_string())
}

/// Inbox mode: another delivery of the same message is still being handled; its lock lives
/// `lock_ms` more.
pub fn message_in_flight(cfg: &Config, lock_ms: u64) -> LocalResponse {
    let r = problem(
        cfg,
        409,
        "message-in-flight",
        "Message in flight",
        "Another delivery of this message is still being processed; redeliver it later.",
    );
    retry_after(r, lock_ms)
}

/// A retry of a key whose first attempt reached the application and whose outcome is unknown
/// (`unknown_outcome: hold`). `running_ms`: how long that attempt may still be running (then
/// `retry-after`: a retry after it may find its late answer, or `outcome_lookup`'s).
pub fn outcome_unknown(cfg: &Config, running_ms: u64) -> LocalResponse {
    let r = problem(
        cfg,
        409,
        OUTCOME_UNKNOWN,
        "Outcome unknown",
        "An earlier request with this Idempotency-Key reached the application and its answer was \
         lost (a timeout, a reset, a client that went away): it may have taken effect. It will not \
         run again with this key; its answer is replayed here once it is known.",
    );
    if running_ms > 0 {
        retry_after(r, running_ms)
    } else {
        r
    }
}

/// The `code` of [`outcome_unknown`], which gRPC answers as `ABORTED`.
pub const OUTCOME_UNKNOWN: &str = "outcome-unknown";

/// A request body over the route's `max_body_bytes`.
pub fn body_too_large(cfg: &Config) -> LocalResponse {
    let max = cfg.max_body_bytes;
    problem(
        cfg,
        413,
        "body-too-large",
        "Request body too large",
        &format!("A request with an Idempotency-Key may carry at most {max} bytes of body."),
    )
}

/// The key's record answers another request: `what` differed.
pub fn key_reused(cfg: &Config, what: &Differs) -> LocalResponse {
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
    problem_with(
        cfg,
        Body {
            kind: type_uri(cfg, "key-reused"),
            code: "key-reused",
            title: "Idempotency-Key reused",
            status: 422,
            detail: &detail,
            differs: Some(differs),
            header,
        },
    )
}

/// The original request still runs; its lock lives `lock_ms` more.
pub fn in_flight(cfg: &Config, lock_ms: u64) -> LocalResponse {
    let r = problem_with(
        cfg,
        Body {
            kind: type_uri(cfg, "request-in-flight"),
            code: "request-in-flight",
            title: "Request in flight",
            status: 409,
            detail:
                "A request with this Idempotency-Key is still being processed; retry later with the same key.",
            differs: None,
            header: None,
        },
    );
    retry_after(r, lock_ms)
}

/// The stored answer is in a content coding this retry does not accept.
pub fn encoding_not_acceptable(cfg: &Config, coding: &str) -> LocalResponse {
    // The coding comes from the stored answer's header, visible ASCII; cut to keep it short.
    let coding: String = coding.chars().take(32).collect();
    problem(
        cfg,
        406,
        "encoding-not-acceptable",
        "Stored answer's encoding not acceptable",
        &format!(
            "The answer to this Idempotency-Key was stored {coding}-coded, and this request does not accept \
             {coding} (Accept-Encoding); retry with the same key and Accept-Encoding: {coding}."
        ),
    )
}

pub fn upstream_failed(cfg: &Config) -> LocalResponse {
    problem(
        cfg,
        502,
        "upstream-failed",
        "Upstream failed",
        "The upstream reset or refused the request; retry with the same key.",
    )
}

/// A detached execution's upstream outlasted the route's `detached_timeout_ms`.
pub fn upstream_timeout(cfg: &Config) -> LocalResponse {
    let timeout_ms = cfg.detached_timeout_ms;
    problem(
        cfg,
        504,
        "upstream-timeout",
        "Upstream timed out",
        &format!("The upstream did not answer within {timeout_ms} ms; retry with the same key."),
    )
}

/// A retry of a request this Envoy already ran, while the store that holds its answer fails: it
/// must not run again, and its answer cannot be read yet (the local fallback's marker).
pub fn answer_withheld(cfg: &Config, retry_ms: u64) -> LocalResponse {
    let r = problem(
        cfg,
        503,
        "store-unavailable",
        "Idempotency store unavailable",
        "A request with this Idempotency-Key was already processed; its stored response cannot be read while the idempotency store is unavailable. Retry later with the same key.",
    );
    retry_after(r, retry_ms)
}

pub fn store_unavailable(cfg: &Config) -> LocalResponse {
    problem(
        cfg,
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
    let problem: Option<serde_json::Value> = serde_json::from_slice(&r.body).ok();
    let field = |name: &str| problem.as_ref().and_then(|p| p.get(name)).and_then(|v| v.as_str());
    let code = match r.status {
        // Not UNAVAILABLE, which clients retry on their own: nothing will change by retrying.
        409 if field("code") == Some(OUTCOME_UNKNOWN) => grpc::ABORTED,
        400 => grpc::INVALID_ARGUMENT,
        406 | 422 => grpc::FAILED_PRECONDITION,
        409 | 502 | 503 => grpc::UNAVAILABLE,
        413 => grpc::RESOURCE_EXHAUSTED,
        504 => grpc::DEADLINE_EXCEEDED,
        _ => grpc::UNKNOWN,
    };
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

    fn c() -> Config {
        Config::from_json(br#"{"store_cluster":"s"}"#).unwrap()
    }

    fn with(extra: &str) -> Config {
        Config::from_json(format!(r#"{{"store_cluster":"s"{extra}}}"#).as_bytes()).unwrap()
    }

    fn type_of(r: &LocalResponse) -> String {
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        v["type"].as_str().unwrap().to_string()
    }

    fn link_of(r: &LocalResponse) -> Option<&str> {
        r.headers.iter().find(|(n, _)| n == "link").map(|(_, v)| v.as_str())
    }

    #[test]
    fn the_type_is_the_base_then_the_policy_page_then_a_tag() {
        let plain = c();
        assert_eq!(
            type_of(&key_reused(&plain, &Differs::Body)),
            "tag:idempotency-filter,2026:problems/key-reused"
        );
        assert_eq!(type_of(&in_flight(&plain, 1)), "tag:idempotency-filter,2026:problems/request-in-flight");
        assert_eq!(link_of(&missing_key(&plain)), None);
        let page = with(r#","policy_url":"https://api.example.com/idempotency""#);
        assert_eq!(type_of(&missing_key(&page)), "https://api.example.com/idempotency#missing-key");
        let anchored = with(r#","policy_url":"https://api.example.com/docs#idempotency""#);
        assert_eq!(type_of(&missing_key(&anchored)), "tag:idempotency-filter,2026:problems/missing-key");
        let both = with(
            r#","policy_url":"https://api.example.com/idempotency","problem_type_base":"https://api.example.com/problems/""#,
        );
        assert_eq!(type_of(&store_unavailable(&both)), "https://api.example.com/problems/store-unavailable");
    }

    #[test]
    fn every_problem_links_to_the_policy() {
        let cfg = with(r#","policy_url":"https://api.example.com/idempotency""#);
        let link = Some(r#"<https://api.example.com/idempotency>; rel="describedby""#);
        for r in [
            missing_key(&cfg),
            invalid_key(&cfg, KeyError::Empty),
            body_too_large(&cfg),
            key_reused(&cfg, &Differs::Target),
            in_flight(&cfg, 1),
            message_in_flight(&cfg, 1),
            store_unavailable(&cfg),
            answer_withheld(&cfg, 1),
            upstream_failed(&cfg),
            upstream_timeout(&cfg),
            encoding_not_acceptable(&cfg, "br"),
            hop_header(&cfg),
        ] {
            assert_eq!(link_of(&r), link, "{r:?}");
            assert_eq!(link_of(&grpc(r, None)), link, "as gRPC metadata too");
        }
    }

    #[test]
    fn problems_are_rfc9457() {
        for (r, status, code) in [
            (missing_key(&c()), 400, "missing-key"),
            (invalid_key(&c(), KeyError::Empty), 400, "invalid-key"),
            (body_too_large(&c()), 413, "body-too-large"),
            (key_reused(&c(), &Differs::Body), 422, "key-reused"),
            (in_flight(&c(), 1), 409, "request-in-flight"),
            (store_unavailable(&c()), 503, "store-unavailable"),
            (upstream_failed(&c()), 502, "upstream-failed"),
            (upstream_timeout(&c()), 504, "upstream-timeout"),
            (missing_message_id(&c()), 400, "missing-message-id"),
            (invalid_message_id(&c(), IdError::Empty), 400, "invalid-message-id"),
            (message_in_flight(&c(), 1), 409, "message-in-flight"),
            (encoding_not_acceptable(&c(), "gzip"), 406, "encoding-not-acceptable"),
        ] {
            assert_eq!(r.status, status);
            assert_eq!(r.headers[0], ("content-type".into(), "application/problem+json".into()));
            let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            assert_eq!(v["status"], status);
            assert_eq!(v["code"], code);
            assert!(v["type"].as_str().unwrap().starts_with(TAG_TYPE_BASE));
            assert!(v["title"].is_string());
            assert!(v["detail"].is_string());
        }
    }

    #[test]
    fn key_reused_says_what_differed() {
        let v = |r: LocalResponse| serde_json::from_slice::<serde_json::Value>(&r.body).unwrap();
        assert_eq!(v(key_reused(&c(), &Differs::Body))["differs"], "body");
        assert_eq!(v(key_reused(&c(), &Differs::Target))["differs"], "target");
        let h = v(key_reused(&c(), &Differs::Header("x-tenant".into())));
        assert_eq!((h["differs"].as_str(), h["header"].as_str()), (Some("header"), Some("x-tenant")));
        assert!(h["detail"].as_str().unwrap().contains("x-tenant"));
        assert_eq!(v(key_reused(&c(), &Differs::Body)).get("header"), None);
    }

    #[test]
    fn retry_after_is_the_lock_time_left_in_whole_seconds() {
        let after =
            |r: LocalResponse| r.headers.iter().find(|(n, _)| n == "retry-after").map(|(_, v)| v.clone());
        assert_eq!(after(in_flight(&c(), 0)).as_deref(), Some("1"));
        assert_eq!(after(in_flight(&c(), 1)).as_deref(), Some("1"));
        assert_eq!(after(in_flight(&c(), 1000)).as_deref(), Some("1"));
        assert_eq!(after(in_flight(&c(), 1001)).as_deref(), Some("2"));
        assert_eq!(after(message_in_flight(&c(), 29_500)).as_deref(), Some("30"));
    }

    fn grpc_header<'a>(r: &'a LocalResponse, name: &str) -> Option<&'a str> {
        r.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    #[test]
    fn problems_become_statuses() {
        let cases = [
            (missing_key(&c()), grpc::INVALID_ARGUMENT, "missing-key: "),
            (body_too_large(&c()), grpc::RESOURCE_EXHAUSTED, "body-too-large: "),
            (key_reused(&c(), &Differs::Body), grpc::FAILED_PRECONDITION, "key-reused: "),
            (store_unavailable(&c()), grpc::UNAVAILABLE, "store-unavailable: "),
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
        let busy = grpc(in_flight(&c(), 30_000), Some(1234));
        assert_eq!(grpc_header(&busy, "grpc-status"), Some("14"));
        assert_eq!(grpc_header(&busy, "grpc-retry-pushback-ms"), Some("1234"));
        assert_eq!(grpc_header(&busy, "retry-after"), None);
        let again = grpc(busy.clone(), None);
        assert_eq!(again, busy, "a gRPC answer is left alone");
    }
}
