//! Every answer the filter makes itself: RFC 9457 `application/problem+json`, or for a gRPC call
//! a status whose message is the problem's text. None of them echoes the client's key. Besides
//! `type`, each carries a stable `code` (e.g. `key-reused`) that clients switch on, whether the
//! same request may be retried (`retryable`, from the code's row in [`codes`]) and the URI of
//! this occurrence (`instance`, see [`instance`]).
//!
//! The machine decides a [`Problem`]; the coordinator gives it its instance and sends it in the
//! request's form ([`Problem::answer`]).

use serde::Serialize;

use crate::config::Config;
use crate::http::grpc;
use crate::request::fingerprint::Differs;
use crate::request::inbox::IdError;
use crate::request::key::KeyError;

pub mod codes;
pub mod instance;

pub use codes::Code;
pub use instance::{Instances, INSTANCE_PROPERTY};

/// A response the filter sends instead of the upstream's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalResponse {
    pub status: u32,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// A refusal, decided: everything but its `instance` and its form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub code: Code,
    /// The HTTP status: the code's (`key-reused`: the route's `mismatch_status`); `None` for a
    /// code only gRPC calls get.
    pub status: Option<u32>,
    pub detail: String,
    /// `key-reused`: what differed (`body`, `target` or `header`), and the header's name (from
    /// the configuration, never the client's value).
    pub differs: Option<(&'static str, Option<String>)>,
    /// What is left of a lock or a running attempt: `retry-after` in whole seconds (at least 1),
    /// and a gRPC call's `grpc-retry-pushback-ms`.
    pub retry_after_ms: Option<u64>,
    /// The gRPC status: the code's, but for the replay listener's own refusals.
    pub grpc_status: u8,
    kind: String,
    link: Option<(String, String)>,
}

#[derive(Serialize)]
struct Body<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    code: &'a str,
    title: &'a str,
    status: u32,
    detail: &'a str,
    instance: &'a str,
    retryable: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    differs: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    header: Option<&'a str>,
}

impl Problem {
    pub fn new(cfg: &Config, code: Code, detail: impl Into<String>) -> Problem {
        Problem {
            code,
            status: code.status(),
            detail: detail.into(),
            differs: None,
            retry_after_ms: None,
            grpc_status: code.grpc(),
            kind: type_uri(cfg, code.name()),
            link: policy_link(cfg),
        }
    }

    fn retry_after(self, ms: u64) -> Problem {
        Problem { retry_after_ms: Some(ms), ..self }
    }

    /// The answer to send, with this occurrence's `instance`: a gRPC status for a gRPC call (and
    /// for a code only gRPC calls get), else the problem document.
    pub fn answer(&self, grpc_call: bool, instance: &str) -> LocalResponse {
        match self.status {
            Some(status) if !grpc_call => self.http(status, instance),
            _ => self.grpc(instance),
        }
    }

    fn http(&self, status: u32, instance: &str) -> LocalResponse {
        let body = Body {
            kind: &self.kind,
            code: self.code.name(),
            title: self.code.title(),
            status,
            detail: &self.detail,
            instance,
            retryable: self.code.retryable(),
            differs: self.differs.as_ref().map(|(what, _)| *what),
            header: self.differs.as_ref().and_then(|(_, h)| h.as_deref()),
        };
        let mut headers = vec![("content-type".to_string(), "application/problem+json".to_string())];
        headers.extend(self.link.clone());
        if let Some(ms) = self.retry_after_ms {
            headers.push(("retry-after".to_string(), ms.div_ceil(1000).max(1).to_string()));
        }
        // Serializing a struct of strings cannot fail; an empty body is the harmless fallback.
        LocalResponse { status, headers, body: serde_json::to_vec(&body).unwrap_or_default() }
    }

    /// The status of the code's row, with `grpc-message` `<code>: <detail> (instance <uri>)`,
    /// the policy's `link` and `grpc-retry-pushback-ms` as metadata.
    fn grpc(&self, instance: &str) -> LocalResponse {
        let message = format!("{}: {} (instance {instance})", self.code.name(), self.detail);
        let mut extra: Vec<(String, String)> = self.link.iter().cloned().collect();
        if let Some(ms) = self.retry_after_ms {
            extra.push(("grpc-retry-pushback-ms".to_string(), ms.to_string()));
        }
        grpc_status(self.grpc_status, &message, extra)
    }
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

/// `link: <policy_url>; rel="describedby"`, when the policy is published (the IETF
/// Idempotency-Key draft: error answers SHOULD point to the documentation).
pub fn policy_link(cfg: &Config) -> Option<(String, String)> {
    cfg.policy_url.as_ref().map(|url| ("link".to_string(), format!("<{url}>; rel=\"describedby\"")))
}

pub fn missing_key(cfg: &Config) -> Problem {
    Problem::new(cfg, Code::MissingKey, "This request must carry an Idempotency-Key header.")
}

/// A request that arrives with the header only the filter sets on a gRPC replay it re-routes.
pub fn hop_header(cfg: &Config) -> Problem {
    Problem::new(
        cfg,
        Code::InternalHeader,
        "The x-idempotency-grpc-replay header is set by the idempotency filter only.",
    )
}

pub fn invalid_key(cfg: &Config, e: KeyError) -> Problem {
    Problem::new(cfg, Code::InvalidKey, e.to_string())
}

/// Inbox mode: a guarded request without a message id (`missing_id: reject`).
pub fn missing_message_id(cfg: &Config) -> Problem {
    Problem::new(
        cfg,
        Code::MissingMessageId,
        "This endpoint takes messages with an id (CloudEvents ce-id and ce-source, or the configured header or body field).",
    )
}

/// Inbox mode: an id that is there but unusable (empty, too long, not a string, repeated).
pub fn invalid_message_id(cfg: &Config, e: IdError) -> Problem {
    Problem::new(cfg, Code::InvalidMessageId, e.to_string())
}

/// Inbox mode: another delivery of the same message is still being handled; its lock lives
/// `lock_ms` more.
pub fn message_in_flight(cfg: &Config, lock_ms: u64) -> Problem {
    Problem::new(
        cfg,
        Code::MessageInFlight,
        "Another delivery of this message is still being processed; redeliver it later.",
    )
    .retry_after(lock_ms)
}

/// A retry of a key whose first attempt reached the application and whose outcome is unknown
/// (`unknown_outcome: hold`). `running_ms`: how long that attempt may still be running (then
/// `retry-after`: a retry after it may find its late answer, or `outcome_lookup`'s).
pub fn outcome_unknown(cfg: &Config, running_ms: u64) -> Problem {
    let p = Problem::new(
        cfg,
        Code::OutcomeUnknown,
        "An earlier request with this Idempotency-Key reached the application and its answer was \
         lost (a timeout, a reset, a client that went away): it may have taken effect. It will not \
         run again with this key; its answer is replayed here once it is known.",
    );
    if running_ms > 0 {
        p.retry_after(running_ms)
    } else {
        p
    }
}

/// A request body over the route's `max_body_bytes`.
pub fn body_too_large(cfg: &Config) -> Problem {
    let max = cfg.max_body_bytes;
    Problem::new(
        cfg,
        Code::BodyTooLarge,
        format!("A request with an Idempotency-Key may carry at most {max} bytes of body."),
    )
}

/// The key's record answers another request: `what` differed. Its status is the route's
/// `mismatch_status`.
pub fn key_reused(cfg: &Config, what: &Differs) -> Problem {
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
            Some(name.clone()),
            format!(
                "This Idempotency-Key was already used with a different value of the request header {name}."
            ),
        ),
    };
    Problem { differs: Some((differs, header)), ..reused(cfg, detail) }
}

/// `key-reused`, with the route's `mismatch_status`.
pub fn reused(cfg: &Config, detail: impl Into<String>) -> Problem {
    Problem { status: Some(cfg.mismatch_status), ..Problem::new(cfg, Code::KeyReused, detail) }
}

/// The original request still runs; its lock lives `lock_ms` more.
pub fn in_flight(cfg: &Config, lock_ms: u64) -> Problem {
    Problem::new(
        cfg,
        Code::RequestInFlight,
        "A request with this Idempotency-Key is still being processed; retry later with the same key.",
    )
    .retry_after(lock_ms)
}

/// The stored answer is in a content coding this retry does not accept.
pub fn encoding_not_acceptable(cfg: &Config, coding: &str) -> Problem {
    // The coding comes from the stored answer's header, visible ASCII; cut to keep it short.
    let coding: String = coding.chars().take(32).collect();
    Problem::new(
        cfg,
        Code::EncodingNotAcceptable,
        format!(
            "The answer to this Idempotency-Key was stored {coding}-coded, and this request does not accept \
             {coding} (Accept-Encoding); retry with the same key and Accept-Encoding: {coding}."
        ),
    )
}

pub fn upstream_failed(cfg: &Config) -> Problem {
    Problem::new(
        cfg,
        Code::UpstreamFailed,
        "The upstream reset or refused the request; retry with the same key.",
    )
}

/// A detached execution's upstream outlasted the route's `detached_timeout_ms`.
pub fn upstream_timeout(cfg: &Config) -> Problem {
    let timeout_ms = cfg.detached_timeout_ms;
    Problem::new(
        cfg,
        Code::UpstreamTimeout,
        format!("The upstream did not answer within {timeout_ms} ms; retry with the same key."),
    )
}

/// A retry of a request this Envoy already ran, while the store that holds its answer fails: it
/// must not run again, and its answer cannot be read yet (the local fallback's marker).
pub fn answer_withheld(cfg: &Config, retry_ms: u64) -> Problem {
    Problem::new(
        cfg,
        Code::StoreUnavailable,
        "A request with this Idempotency-Key was already processed; its stored response cannot be read while the idempotency store is unavailable. Retry later with the same key.",
    )
    .retry_after(retry_ms)
}

pub fn store_unavailable(cfg: &Config) -> Problem {
    Problem::new(
        cfg,
        Code::StoreUnavailable,
        "The request was not processed because its idempotency could not be guaranteed; retry with the same key.",
    )
}

/// A gRPC replay that could not be re-routed (the second hop failed); `status` is the replay
/// listener's own when it refuses.
pub fn replay_failed(cfg: &Config, status: u8, detail: &str) -> Problem {
    Problem { grpc_status: status, ..Problem::new(cfg, Code::ReplayFailed, detail) }
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

#[cfg(test)]
mod tests;
