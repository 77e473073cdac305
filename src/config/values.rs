//! The values of the structured keys, as the filter uses them once checked.

use std::fmt;
use std::ops::RangeInclusive;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailureMode {
    /// A store fault lets the request run unguarded (counted as degraded).
    Open,
    /// A store fault answers `503`.
    Closed,
}

/// What an attempt that reached the application but whose answer never came back leaves
/// behind (`unknown_outcome`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownOutcome {
    /// The key is in doubt: its retries run nothing and get `409` `outcome-unknown` until the
    /// first attempt's late answer, `outcome_lookup` or an operator resolves it.
    Hold,
    /// The lock is released and the next retry runs again (for naturally idempotent handlers).
    RunAgain,
}

/// `outcome_lookup`: where the application answers whether an in-doubt attempt committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutcomeLookup {
    /// A path starting with `/`, with `{key}` where the store key goes.
    pub path: String,
}

impl OutcomeLookup {
    /// The path for the store key `key`.
    pub fn path_for(&self, key: &str) -> String {
        self.path.replace("{key}", key)
    }
}

/// How store calls travel to idemstore (`store_transport`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreTransport {
    /// As messages on one long-lived gRPC stream per worker (`worker::store_stream`).
    Stream,
    /// As one HTTP callout per call (commits batched): idemstore's HTTP API.
    Callout,
}

/// The shared secret sent to idemstore in `x-idem-secret`. Its `Debug` never shows the value,
/// so a logged or asserted `Config` cannot leak it.
#[derive(Clone, PartialEq, Eq)]
pub struct StoreSecret(pub(super) String);

impl StoreSecret {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for StoreSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StoreSecret(<redacted>)")
    }
}

/// Where the caller's identity comes from. Requests without one are scoped by client IP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Subject {
    ClientIp,
    /// A request header. Only safe when Envoy itself sets or overwrites it.
    Header(String),
    /// Dynamic metadata written by an earlier filter (e.g. `jwt_authn`'s payload).
    Metadata {
        filter: String,
        path: Vec<String>,
    },
    /// An Envoy property, e.g. `["connection", "uri_san_peer_certificate"]`: the peer
    /// certificate's URI SAN (a SPIFFE id under Istio mTLS), so that callers are workloads.
    Property(Vec<String>),
}

/// What the filter guards: clients' `Idempotency-Key`s, or messages a broker pushes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// The `Idempotency-Key` contract (the default).
    IdempotencyKey,
    /// The inbox: the message id of a pushed event is the key (`"mode": "inbox"`).
    Inbox(Inbox),
    /// The sending side (`"mode": "mint"`): a guarded request without a key gets a random one
    /// before the router, so that every retry and hedged attempt of it carries the same key to
    /// the guard where it arrives. No store calls.
    Mint,
    /// The replay listener (`"mode": "grpc_replay"`): answers a retry the guard re-routed to it,
    /// the record in its body, as the gRPC answer it holds, message and trailers. No store calls.
    GrpcReplay,
}

/// gRPC status codes, a bit per code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrpcStatuses(pub(super) u32);

impl Default for GrpcStatuses {
    fn default() -> Self {
        GrpcStatuses(1) // OK
    }
}

impl GrpcStatuses {
    pub fn contains(&self, code: u8) -> bool {
        code < 32 && self.0 & (1 << code) != 0
    }

    pub fn names(&self) -> Vec<&'static str> {
        (0..crate::http::grpc::NAMES.len())
            .filter(|c| self.0 & (1 << c) != 0)
            .map(|c| crate::http::grpc::NAMES[c])
            .collect()
    }
}

/// Inbox mode: exactly-once handling of messages a broker pushes over HTTP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inbox {
    pub message_id: MessageIdSource,
    pub missing_id: MissingId,
    /// Answer duplicates with this bare `2xx` (plus the replay header) instead of the stored
    /// response.
    pub duplicate_status: Option<u16>,
}

/// Where the message id is read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MessageIdSource {
    /// CloudEvents over HTTP: `ce-id` + `ce-source` (binary mode), or `id` + `source` of an
    /// `application/cloudevents+json` body (structured mode).
    CloudEvents,
    /// One request header's value.
    Header(String),
    /// A JSON pointer into the request body (RFC 6901), e.g. `/message/messageId`.
    JsonPointer(String),
}

impl MessageIdSource {
    /// True when the id may have to be read from the body.
    pub fn may_need_body(&self) -> bool {
        !matches!(self, MessageIdSource::Header(_))
    }
}

/// What a guarded request without a message id gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissingId {
    /// `400` problem.
    Reject,
    /// Runs unguarded (counted as `passthrough`).
    Pass,
}

pub const DUPLICATE_STATUS: RangeInclusive<u64> = 200..=299;

/// `fingerprint_json`: the request body is compared as JSON (see
/// [`crate::request::fingerprint::json_body_hash`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonPrint {
    /// Member order does not count (insignificant whitespace never does).
    pub canonical: bool,
    /// RFC 6901 pointers to members left out of the comparison (e.g. a timestamp the client
    /// sets on every attempt).
    pub ignore: Vec<String>,
}

/// `record_too_large`: what becomes of a kept answer whose body is over `max_record_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TooLarge {
    /// Recorded without its body: retries get the status and headers, and an empty body
    /// marked by `body_omitted_header`; the upstream runs once.
    OmitBody,
    /// Not recorded: the lock is given back and the next retry runs again.
    Release,
}
