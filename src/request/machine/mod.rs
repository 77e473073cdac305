//! The per-request state machine: events in (headers, body, store answers, response, stream end),
//! decisions out (continue or pause, and effects for the host to carry out). No proxy-wasm here:
//! the host is behind [`StreamView`], so every transition is unit-tested natively.
//!
//! ```text
//! Start ──not guarded / no key─────────────────────────────────────────▶ Done
//!   │ key ok               bad key / too large ─▶ 400 / 413 ───────────▶ Done
//!   │ inbox, id in the body ─▶ Reading ──end of body, id found──▶ Beginning
//!   ▼
//! Hashing ──end of body──▶ Beginning ──record──▶ replay (or 422 / 406) ──▶ Done
//!                            │  │ └─mismatch / busy / fault──▶ 422 / 409 / open or 503
//!                            │  └─stream gone─▶ Orphaned ──locked──▶ release
//!                            ├─locked, detached_execution─▶ Detached ──answer──▶ commit or release
//!                            ▼ locked
//!                          Executing ──kept (see `keep`)──▶ Capturing ──end──▶ commit
//!                            └──not kept / reset / client gone─────────────▶ release
//! ```
//!
//! The body hash `begin` carries is the body's fingerprint; the rest of the request's (target,
//! fingerprinted headers) is computed on the headers and written into the record, and a record
//! made for another request is answered `422` instead of replayed (see `fingerprint`).
//!
//! A unary gRPC call is guarded the same way (see `grpc`): one request message, and an answer
//! kept with its trailers when its `grpc-status` is in `store_grpc_statuses`; a call with a
//! second message either way passes, or gives its lock back. Its replay goes by a second hop
//! ([`Effect::Hop`]); the filter's refusals become gRPC statuses in the worker.
//!
//! Inbox mode (`"mode": "inbox"`) keys the same flow by the message id instead of an
//! `Idempotency-Key`: read at headers (`ce-id` + `ce-source`, a header), or, when it is in the body
//! (structured CloudEvents, a JSON pointer), by `Reading` the body first and then going on as
//! `Hashing` at its end. The body hash is a constant (the id is the identity: a redelivery may
//! differ, e.g. Pub/Sub's `deliveryAttempt`), and any `2xx` marks the message handled: what a
//! record cannot hold (a stream, too large) is stored as its status alone.

use sha2::{Digest, Sha256};
use std::rc::Rc;

use crate::config::values::{FailureMode, MissingId, Mode, Subject, UnknownOutcome};
use crate::config::Config;
use crate::http::grpc::{self, Frames};
use crate::http::headers;
use crate::request::detached::{self, UpstreamAnswer, UpstreamCall};
use crate::request::ending::{self, Ending};
use crate::request::fingerprint;
use crate::request::inbox::{self, AtHeaders, IdError, MessageId};
use crate::request::keep::{self, Head, Keep};
use crate::request::key;
use crate::request::metrics::Metric;
use crate::request::problem::{self, LocalResponse, Problem};
use crate::request::replay;
use crate::store::client::{BeginAnswer, CalloutFault, Hold, LockTerms, LockToken, StoreCall};
use crate::store::record::RequestPrint;
use crate::store::record::{self, Record};

/// What the machine may read from the host, lazily: a request that is not guarded costs one
/// header lookup.
pub trait StreamView {
    /// Every value of a request header (lower-case name; pseudo-headers like `:method` included).
    fn request_header(&self, name: &str) -> Vec<Vec<u8>>;
    /// All request headers, in order.
    fn request_headers(&self) -> Vec<(String, Vec<u8>)>;
    /// Every value of a response header (`:status` included).
    fn response_header(&self, name: &str) -> Vec<Vec<u8>>;
    /// An Envoy attribute, e.g. `["source", "address"]`.
    fn property(&self, path: &[&str]) -> Option<Vec<u8>>;
    /// `len` bytes of the request body from `start`.
    fn request_body(&self, start: usize, len: usize) -> Option<Vec<u8>>;
    /// `len` bytes of the current response body chunk from `start`.
    fn response_body(&self, start: usize, len: usize) -> Option<Vec<u8>>;
    /// 16 bytes from the host's random source (WASI `random_get`), if it can give them.
    fn random_bytes(&self) -> Option<[u8; 16]>;
    /// The response trailers, in order (read in the trailers callback).
    fn response_trailers(&self) -> Vec<(String, Vec<u8>)>;
    /// The wall clock, milliseconds since the Unix epoch, if the host can tell.
    fn now_ms(&self) -> Option<u64>;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Continue,
    /// Stop iteration (and, for bodies, buffer) until an effect resumes or answers the stream.
    Pause,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Answer the client instead of the upstream (a replay, the replay listener's answer). At
    /// most one `Respond` or `Refuse` per stream.
    Respond(LocalResponse),
    /// Refuse the request with this problem, which the coordinator gives its `instance` and
    /// sends as the request's form wants (a gRPC status for a gRPC call).
    Refuse(Problem),
    /// Let the paused request go on to the upstream.
    Resume,
    /// A store call, owned by the root context so that it outlives the stream.
    Store(StoreCall),
    /// The request itself, sent by the root context (detached execution).
    Upstream(UpstreamCall),
    /// `outcome_lookup`'s question to the application, sent by the root context like a
    /// detached execution (its answer comes back the same way); not an execution.
    Lookup(UpstreamCall),
    /// Set a request header before the request goes on, replacing any value the client sent.
    SetRequestHeader(String, String),
    RemoveRequestHeader(String),
    /// gRPC replay: send the paused request, its body (`body_len` bytes) replaced by `record`,
    /// to the replay listener (see [`grpc::HOP_HEADER`]); refuse with `fallback` if that cannot
    /// be done (never let the request go on as it is).
    Hop {
        record: Vec<u8>,
        body_len: usize,
        fallback: Problem,
    },
    /// The replay listener: add these trailers to the answer it is sending.
    AddResponseTrailers(Vec<(String, String)>),
    /// The replay listener: a header Envoy put on its local answer that the original answer
    /// did not have (`content-length`).
    RemoveResponseHeader(String),
    /// Set a header on the upstream's answer, in its headers callback (`expiry_header`).
    SetResponseHeader(String, String),
    Count(Metric),
}

impl Effect {
    /// A replay, or the problem a retry gets instead.
    fn answer(answer: Result<LocalResponse, Problem>) -> Effect {
        match answer {
            Ok(replay) => Effect::Respond(replay),
            Err(problem) => Effect::Refuse(problem),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub action: Action,
    pub effects: Vec<Effect>,
}

impl Step {
    fn go(effects: Vec<Effect>) -> Step {
        Step { action: Action::Continue, effects }
    }

    fn pause(effects: Vec<Effect>) -> Step {
        Step { action: Action::Pause, effects }
    }
}

/// A response being copied for the record while it streams to the client.
#[derive(Debug)]
struct Capture {
    /// What the headers told, for [`keep::decide`] as the body arrives.
    head: Head,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// Body bytes that went by, kept or not.
    seen: u64,
    /// Recorded without its body (too large).
    omitted: bool,
    /// A gRPC answer: its messages, counted as they go by.
    grpc: Option<Frames>,
}

/// How the request body becomes the body hash `begin` carries.
#[derive(Debug)]
enum BodyDigest {
    /// SHA-256 of the raw bytes, as they arrive.
    Raw(Sha256),
    /// `fingerprint_json`: the whole body, hashed at its end.
    Json(Vec<u8>),
    /// Inbox mode: the message id is the identity; the body is not hashed.
    Constant,
}

#[derive(Debug)]
enum State {
    Start,
    /// Inbox mode, the message id is in the body: buffering it until its end.
    Reading {
        method: String,
        route: String,
        body: Vec<u8>,
    },
    Hashing {
        key: String,
        digest: BodyDigest,
        seen: usize,
    },
    Beginning {
        key: String,
        body_hash: String,
    },
    /// The stream went away while `begin` was pending: a lock it brings back is released.
    Orphaned {
        key: String,
    },
    Executing {
        key: String,
        body_hash: String,
        token: LockToken,
    },
    /// A retry of an in-doubt key: `outcome_lookup` asks the application whether the attempt
    /// under `token` (which may still run for `running_ms`) committed; `gone`: the client went
    /// away meanwhile (a committed answer still becomes the record).
    Looking {
        key: String,
        body_hash: String,
        token: LockToken,
        running_ms: u64,
        gone: bool,
    },
    /// The filter itself sent the request (detached execution); `gone`: the client went away.
    Detached {
        key: String,
        body_hash: String,
        token: LockToken,
        gone: bool,
    },
    Capturing {
        key: String,
        body_hash: String,
        token: LockToken,
        capture: Capture,
    },
    /// The replay listener: reading the record a re-routed retry carries.
    HopReading {
        body: Vec<u8>,
    },
    /// The replay listener: the record's message is on its way; its trailers follow it.
    HopAnswering {
        trailers: Vec<(String, String)>,
    },
    /// Nothing left to do: not guarded, answered, failed open, committed or released.
    Done,
}

/// Where `outcome_lookup` asks: the route's cluster and the request's `:authority`.
#[derive(Debug, Clone)]
struct LookupAt {
    cluster: String,
    authority: String,
}

/// What a detached execution sends: captured while the request is paused.
#[derive(Debug)]
struct Detach {
    cluster: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

pub struct Machine {
    cfg: Rc<Config>,
    state: State,
    detach: Option<Detach>,
    /// The request's target and fingerprinted headers: written into its record, and compared
    /// with a record's before that is replayed. `None` in inbox mode.
    print: Option<RequestPrint>,
    /// The request's `accept-encoding` values: a replay is never sent in a coding they refuse.
    accept_encoding: Vec<Vec<u8>>,
    /// A guarded gRPC call: its request messages, counted as they go by.
    grpc: Option<Frames>,
    /// The request body's length when `begin` went out (what a gRPC replay replaces).
    request_len: usize,
    /// The Envoy route's name, when it was read to choose the route's policy.
    route_name: Option<Vec<u8>>,
    /// Where to ask about an in-doubt key (`outcome_lookup`).
    lookup_at: Option<LookupAt>,
}

impl Machine {
    pub fn new(cfg: Rc<Config>) -> Machine {
        Machine {
            cfg,
            state: State::Start,
            detach: None,
            print: None,
            accept_encoding: Vec::new(),
            grpc: None,
            request_len: 0,
            route_name: None,
            lookup_at: None,
        }
    }

    /// A guarded gRPC call: the filter's own answers to it are gRPC statuses
    /// ([`Problem::answer`]).
    pub fn is_grpc(&self) -> bool {
        self.grpc.is_some()
    }

    /// The store key, once derived: for log lines (a prefix of it, never the client's key).
    pub fn store_key(&self) -> Option<&str> {
        match &self.state {
            State::Hashing { key, .. }
            | State::Beginning { key, .. }
            | State::Orphaned { key }
            | State::Executing { key, .. }
            | State::Detached { key, .. }
            | State::Looking { key, .. }
            | State::Capturing { key, .. } => Some(key),
            State::Start
            | State::Reading { .. }
            | State::HopReading { .. }
            | State::HopAnswering { .. }
            | State::Done => None,
        }
    }

    /// True once the stream needs nothing more: not guarded, or answered, committed or released,
    /// with nothing pending. Its later callbacks can be skipped.
    pub fn is_done(&self) -> bool {
        matches!(self.state, State::Done)
    }

    /// The replay listener's answer is on its way: the trailers that follow its message.
    pub fn answer_trailers(&self) -> Option<&[(String, String)]> {
        match &self.state {
            State::HopAnswering { trailers } => Some(trailers),
            _ => None,
        }
    }

    /// True while the store key waits for the request body (inbox mode, the message id is in
    /// it): a guarded request whose request headers may no longer be readable when the key
    /// comes (`pause_on_headers: false`), so the host reads what it needs of them now.
    pub fn awaits_key(&self) -> bool {
        matches!(self.state, State::Reading { .. })
    }

    /// True once nothing this stream started is pending: the host may forget it.
    pub fn is_settled(&self) -> bool {
        !matches!(
            self.state,
            State::Orphaned { .. } | State::Beginning { .. } | State::Detached { .. } | State::Looking { .. }
        )
    }

    /// The commit of `record` under `token`, kept for the request's route's retention.
    fn commit(&self, key: String, token: LockToken, body_hash: String, record: Vec<u8>) -> Effect {
        let retention_s = self.cfg.retention_seconds;
        Effect::Store(StoreCall::Commit { key, token, body_hash, record, retention_s })
    }

    /// The attempt under `token` was sent and its answer never came back: the key is left in
    /// doubt (`unknown_outcome: hold`), or released for the next retry to run (`run_again`).
    fn lost(&self, key: String, token: LockToken) -> Vec<Effect> {
        match self.cfg.unknown_outcome {
            UnknownOutcome::Hold => vec![
                Effect::Store(StoreCall::Release { key, token, in_doubt: true }),
                Effect::Count(Metric::InDoubt),
            ],
            UnknownOutcome::RunAgain => release(key, token),
        }
    }

    /// The stream is over before its answer was complete (complete streams are done by then):
    /// the client went away while the request ran, or the answer was cut. What the request did
    /// is unknown, unless Envoy shows it never reached the application.
    pub fn on_stream_end(&mut self, view: &dyn StreamView) -> Vec<Effect> {
        match std::mem::replace(&mut self.state, State::Done) {
            State::Executing { key, token, .. } => match seen(view).at_end() {
                Ending::NeverSent => release(key, token),
                Ending::Unknown | Ending::Answered => self.lost(key, token),
            },
            State::Capturing { key, token, .. } => self.lost(key, token),
            State::Beginning { key, .. } | State::Orphaned { key } => {
                self.state = State::Orphaned { key };
                vec![]
            }
            State::Detached { key, body_hash, token, .. } => {
                self.state = State::Detached { key, body_hash, token, gone: true };
                vec![]
            }
            State::Looking { key, body_hash, token, running_ms, .. } => {
                self.state = State::Looking { key, body_hash, token, running_ms, gone: true };
                vec![]
            }
            _ => vec![],
        }
    }
}

/// What Envoy tells of how the attempt went (see [`ending`]). The application's own answer
/// (`via_upstream`, most answers) needs nothing more: the tries and the connection are read
/// only for Envoy's replies.
fn seen(view: &dyn StreamView) -> ending::Seen {
    let details = view.property(&["response", "code_details"]).and_then(|d| String::from_utf8(d).ok());
    if details.as_deref() == Some("via_upstream") {
        return ending::Seen { details, tries: None, connected: false };
    }
    ending::Seen {
        details,
        tries: view.property(&["upstream", "request_attempt_count"]).and_then(|n| ending::number(&n)),
        connected: view.property(&["upstream", "local_address"]).is_some_and(|a| !a.is_empty()),
    }
}

/// The request's `content-length`, when it declares one.
fn declared_length(view: &dyn StreamView) -> Option<u64> {
    first(view.request_header("content-length"))
        .and_then(|v| std::str::from_utf8(&v).ok().and_then(|s| s.trim().parse::<u64>().ok()))
}

fn first(values: Vec<Vec<u8>>) -> Option<Vec<u8>> {
    values.into_iter().next()
}

/// The body hash inbox mode sends with every `begin`: a constant, so that no redelivery is
/// ever a mismatch. SHA-256 of `idempotency-filter/inbox/v1` (a unit test checks it).
pub const INBOX_BODY_HASH: &str = "84a7bd94e4892ceaf6647cf9bb4cc47d439450095ff13bbef98adfac56a78701";

fn release(key: String, token: LockToken) -> Vec<Effect> {
    vec![Effect::Store(StoreCall::Release { key, token, in_doubt: false }), Effect::Count(Metric::Released)]
}

mod hop;
mod lookup;
mod on_begin;
mod on_request;
mod on_response;

#[cfg(test)]
mod tests;
