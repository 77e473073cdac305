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
//! Inbox mode (`"mode": "inbox"`) keys the same flow by the message id instead of an
//! `Idempotency-Key`: read at headers (`ce-id` + `ce-source`, a header), or, when it is in the body
//! (structured CloudEvents, a JSON pointer), by `Reading` the body first and then going on as
//! `Hashing` at its end. The body hash is a constant (the id is the identity: a redelivery may
//! differ, e.g. Pub/Sub's `deliveryAttempt`), and any `2xx` marks the message handled: what a
//! record cannot hold (a stream, too large) is stored as its status alone.

use sha2::{Digest, Sha256};
use std::rc::Rc;

use crate::config::values::{FailureMode, MissingId, Subject};
use crate::config::Config;
use crate::http::headers;
use crate::request::detached::{self, UpstreamAnswer, UpstreamCall};
use crate::request::fingerprint;
use crate::request::inbox::{self, AtHeaders, IdError, MessageId};
use crate::request::keep::{self, Head, Keep};
use crate::request::key;
use crate::request::metrics::Metric;
use crate::request::problem::{self, LocalResponse};
use crate::request::replay;
use crate::store::client::{BeginAnswer, CalloutFault, LockToken, StoreCall};
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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Continue,
    /// Stop iteration (and, for bodies, buffer) until an effect resumes or answers the stream.
    Pause,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Answer the client instead of the upstream. At most one per stream.
    Respond(LocalResponse),
    /// Let the paused request go on to the upstream.
    Resume,
    /// A store call, owned by the root context so that it outlives the stream.
    Store(StoreCall),
    /// The request itself, sent by the root context (detached execution).
    Upstream(UpstreamCall),
    /// Set a request header before the request goes on, replacing any value the client sent.
    SetRequestHeader(String, String),
    RemoveRequestHeader(String),
    Count(Metric),
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
    /// Nothing left to do: not guarded, answered, failed open, committed or released.
    Done,
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
}

impl Machine {
    pub fn new(cfg: Rc<Config>) -> Machine {
        Machine { cfg, state: State::Start, detach: None, print: None, accept_encoding: Vec::new() }
    }

    /// The store key, once derived: for log lines (a prefix of it, never the client's key).
    pub fn store_key(&self) -> Option<&str> {
        match &self.state {
            State::Hashing { key, .. }
            | State::Beginning { key, .. }
            | State::Orphaned { key }
            | State::Executing { key, .. }
            | State::Detached { key, .. }
            | State::Capturing { key, .. } => Some(key),
            State::Start | State::Reading { .. } | State::Done => None,
        }
    }

    /// True once the stream needs nothing more: not guarded, or answered, committed or released,
    /// with nothing pending. Its later callbacks can be skipped.
    pub fn is_done(&self) -> bool {
        matches!(self.state, State::Done)
    }

    /// True while the store key waits for the request body (inbox mode, the message id is in
    /// it): a guarded request whose request headers may no longer be readable when the key
    /// comes (`pause_on_headers: false`), so the host reads what it needs of them now.
    pub fn awaits_key(&self) -> bool {
        matches!(self.state, State::Reading { .. })
    }

    /// True once nothing this stream started is pending: the host may forget it.
    pub fn is_settled(&self) -> bool {
        !matches!(self.state, State::Orphaned { .. } | State::Beginning { .. } | State::Detached { .. })
    }

    pub fn on_request_headers(&mut self, view: &dyn StreamView, end_of_stream: bool) -> Step {
        if !matches!(self.state, State::Start) {
            return Step::go(vec![]);
        }
        self.state = State::Done;
        let method = first(view.request_header(":method"));
        let Some(method) = method.as_deref().and_then(|m| std::str::from_utf8(m).ok()) else {
            return Step::go(vec![]);
        };
        if !self.cfg.guards_method(method) {
            return Step::go(self.strip_store_key_header(view));
        }
        // `post` (HTTP/2 lets it through) is guarded as, and shares records with, `POST`.
        let method = method.to_ascii_uppercase();
        if self.cfg.inbox().is_some() {
            return self.inbox_headers(view, method, end_of_stream);
        }
        let values = view.request_header("idempotency-key");
        let values: Vec<&[u8]> = values.iter().map(Vec::as_slice).collect();
        let client_key = match key::parse_client_key(&values, self.cfg.max_key_length) {
            Err(e) => return reject(problem::invalid_key(e)),
            Ok(None) if self.cfg.require_key => return reject(problem::missing_key()),
            Ok(None) => {
                let mut effects = self.strip_store_key_header(view);
                effects.push(Effect::Count(Metric::Passthrough));
                return Step::go(effects);
            }
            Ok(Some(k)) => k,
        };
        let effects = vec![Effect::Count(Metric::Guarded)];
        if self.declared_too_large(view) {
            return too_large(effects, self.cfg.max_body_bytes);
        }
        let subject = self.subject(view);
        let route = route(view);
        let key = key::store_key(&subject, &method, &route, &client_key);
        let path = first(view.request_header(":path")).unwrap_or_default();
        let header = |name: &str| view.request_header(name);
        self.print = Some(RequestPrint::of(method.as_bytes(), &path, &self.cfg.fingerprint_headers, &header));
        self.guard(view, key, effects, end_of_stream)
    }

    /// Takes the request under guard with its store key: the body is read to its end, then
    /// `begin` goes out.
    fn guard(
        &mut self,
        view: &dyn StreamView,
        key: String,
        mut effects: Vec<Effect>,
        end_of_stream: bool,
    ) -> Step {
        if let Some(name) = &self.cfg.store_key_header {
            effects.push(Effect::SetRequestHeader(name.clone(), key.clone()));
        }
        if self.cfg.detached_execution {
            self.detach = self.capture_for_detach(view, Some(&key));
        }
        self.accept_encoding = view.request_header("accept-encoding");
        let digest = match (&self.cfg.fingerprint_json, self.cfg.inbox()) {
            (_, Some(_)) => BodyDigest::Constant,
            (Some(_), None) => BodyDigest::Json(Vec::new()),
            (None, None) => BodyDigest::Raw(Sha256::new()),
        };
        self.state = State::Hashing { key, digest, seen: 0 };
        if end_of_stream {
            // Without a body there is nothing Envoy must deliver while the request waits, so a
            // stop on headers works with or without `allow_on_headers_stop_iteration`.
            effects.extend(self.begin());
            return Step::pause(effects);
        }
        self.hold(effects)
    }

    /// Pauses a request with a body that the filter reads before deciding.
    fn hold(&self, effects: Vec<Effect>) -> Step {
        if self.cfg.pause_on_headers {
            Step::pause(effects)
        } else {
            // The headers go on to the buffer filter after this one, which holds them until the
            // body this filter pauses is let through (see `Config::pause_on_headers`).
            Step::go(effects)
        }
    }

    fn declared_too_large(&self, view: &dyn StreamView) -> bool {
        let declared = first(view.request_header("content-length"))
            .and_then(|v| std::str::from_utf8(&v).ok().and_then(|s| s.trim().parse::<u64>().ok()));
        declared.is_some_and(|n| n > self.cfg.max_body_bytes as u64)
    }

    /// Inbox mode, on request headers: the message id, or the body to read it from.
    fn inbox_headers(&mut self, view: &dyn StreamView, method: String, end_of_stream: bool) -> Step {
        let Some(inbox) = self.cfg.inbox() else { return Step::go(vec![]) };
        let header = |name: &str| view.request_header(name);
        match inbox::at_headers(&inbox.message_id, &header, self.cfg.max_key_length) {
            Err(e) => self.without_id(view, e),
            Ok(AtHeaders::Found(id)) => {
                let effects = vec![Effect::Count(Metric::Guarded)];
                if self.declared_too_large(view) {
                    return too_large(effects, self.cfg.max_body_bytes);
                }
                let key = inbox_key(&method, &route(view), &id);
                self.guard(view, key, effects, end_of_stream)
            }
            Ok(AtHeaders::InBody) => {
                if self.declared_too_large(view) {
                    return too_large(vec![], self.cfg.max_body_bytes);
                }
                // A client's value goes now: the id, and so the key, may never come.
                let effects = self.strip_store_key_header(view);
                if self.cfg.detached_execution {
                    self.detach = self.capture_for_detach(view, None);
                }
                // Read now: the request headers may be gone by the time the id is.
                self.accept_encoding = view.request_header("accept-encoding");
                self.state = State::Reading { method, route: route(view), body: Vec::new() };
                if end_of_stream {
                    let mut step = self.finish_reading();
                    step.effects.splice(0..0, effects);
                    return step;
                }
                self.hold(effects)
            }
        }
    }

    /// Inbox mode: no usable message id. A missing one runs unguarded or gets `400`
    /// (`inbox.missing_id`); a malformed one always gets `400`.
    fn without_id(&mut self, view: &dyn StreamView, e: IdError) -> Step {
        self.state = State::Done;
        let pass = self.cfg.inbox().is_some_and(|i| i.missing_id == MissingId::Pass);
        match e {
            IdError::Missing if pass => {
                let mut effects = self.strip_store_key_header(view);
                effects.push(Effect::Count(Metric::Passthrough));
                Step::go(effects)
            }
            IdError::Missing => reject(problem::missing_message_id()),
            e => reject(problem::invalid_message_id(e)),
        }
    }

    /// Inbox mode, the whole body read: the id from it, then `begin` (or no id: see
    /// [`Self::without_id`]).
    fn finish_reading(&mut self) -> Step {
        let State::Reading { method, route, body } = std::mem::replace(&mut self.state, State::Done) else {
            return Step::go(vec![]);
        };
        let Some(inbox) = self.cfg.inbox() else { return Step::go(vec![]) };
        let id = match inbox::from_body(&inbox.message_id, &body, self.cfg.max_key_length) {
            Ok(id) => id,
            // The headers were read and any store key header removed then: nothing to strip.
            Err(e) => return self.without_id(&NoHeaders, e),
        };
        let key = inbox_key(&method, &route, &id);
        let mut effects = vec![Effect::Count(Metric::Guarded)];
        if let Some(name) = &self.cfg.store_key_header {
            // Still the stream's own callback, and its headers are held (pause_on_headers).
            effects.push(Effect::SetRequestHeader(name.clone(), key.clone()));
            if let Some(d) = &mut self.detach {
                detached::set_header(&mut d.headers, name, &key);
            }
        }
        self.state = State::Hashing { key, digest: BodyDigest::Constant, seen: body.len() };
        effects.extend(self.begin());
        Step::pause(effects)
    }

    pub fn on_request_body(&mut self, view: &dyn StreamView, buffered: usize, end_of_stream: bool) -> Step {
        let (digest, seen, kept) = match &mut self.state {
            State::Hashing { digest, seen, .. } => (Some(digest), *seen, None),
            State::Reading { body, .. } => (None, body.len(), Some(body)),
            _ => return Step::go(vec![]),
        };
        if buffered > self.cfg.max_body_bytes {
            self.state = State::Done;
            return too_large(vec![], self.cfg.max_body_bytes);
        }
        let mut now = seen;
        if buffered > seen {
            // Envoy hands us the whole buffered body each time: read only what is new, and only
            // when something needs it (inbox mode hashes nothing).
            let hashing = matches!(digest, Some(BodyDigest::Raw(_) | BodyDigest::Json(_)));
            if hashing || kept.is_some() || self.detach.is_some() {
                let Some(chunk) = view.request_body(seen, buffered - seen) else {
                    // The host could not hand over the body: the guarantee cannot be checked.
                    return Step::pause(self.give_up());
                };
                match digest {
                    Some(BodyDigest::Raw(h)) => h.update(&chunk),
                    Some(BodyDigest::Json(body)) => body.extend_from_slice(&chunk),
                    _ => {}
                }
                if let Some(body) = kept {
                    body.extend_from_slice(&chunk);
                }
                if let Some(d) = &mut self.detach {
                    d.body.extend_from_slice(&chunk);
                }
                now += chunk.len();
            } else {
                now = buffered;
            }
        }
        if let State::Hashing { seen, .. } = &mut self.state {
            *seen = now;
        }
        if end_of_stream {
            return self.end_of_request_body();
        }
        Step::pause(vec![])
    }

    fn end_of_request_body(&mut self) -> Step {
        match self.state {
            State::Reading { .. } => self.finish_reading(),
            _ => Step::pause(self.begin()),
        }
    }

    /// Trailers end the request body.
    pub fn on_request_trailers(&mut self) -> Step {
        if matches!(self.state, State::Hashing { .. } | State::Reading { .. }) {
            return self.end_of_request_body();
        }
        Step::go(vec![])
    }

    fn begin(&mut self) -> Vec<Effect> {
        match std::mem::replace(&mut self.state, State::Done) {
            State::Hashing { key, digest, .. } => {
                let body_hash = match digest {
                    BodyDigest::Raw(hasher) => key::hex(&hasher.finalize()),
                    BodyDigest::Json(body) => match &self.cfg.fingerprint_json {
                        Some(opts) => key::hex(&fingerprint::json_body_hash(&body, opts)),
                        None => key::hex(&Sha256::digest(&body)),
                    },
                    // The id is the identity: a redelivery may differ in its body.
                    BodyDigest::Constant => INBOX_BODY_HASH.to_string(),
                };
                let call = StoreCall::Begin { key: key.clone(), body_hash: body_hash.clone() };
                self.state = State::Beginning { key, body_hash };
                vec![Effect::Store(call)]
            }
            other => {
                self.state = other;
                vec![]
            }
        }
    }

    pub fn on_begin_answer(&mut self, answer: Result<BeginAnswer, CalloutFault>) -> Vec<Effect> {
        match std::mem::replace(&mut self.state, State::Done) {
            State::Beginning { key, body_hash } => match answer {
                Ok(BeginAnswer::Replay(record)) => {
                    let (answer, metric) =
                        replay::answer(&self.cfg, record, self.print.as_ref(), &self.accept_encoding);
                    vec![Effect::Respond(answer), Effect::Count(metric)]
                }
                Ok(BeginAnswer::Mismatch) => vec![
                    Effect::Respond(problem::key_reused(&fingerprint::Differs::Body)),
                    Effect::Count(Metric::Mismatched),
                ],
                Ok(BeginAnswer::Withheld) => {
                    let retry_ms = self.cfg.breaker_open_ms.max(1000);
                    vec![
                        Effect::Respond(problem::answer_withheld(retry_ms)),
                        Effect::Count(Metric::Unavailable),
                    ]
                }
                Ok(BeginAnswer::Busy { lock_ms }) => {
                    // What the store says is left of the holder's lock; never beyond its TTL.
                    let left = lock_ms.unwrap_or(1).min(self.cfg.lock_ttl_ms);
                    let problem = match self.cfg.inbox() {
                        Some(_) => problem::message_in_flight(left),
                        None => problem::in_flight(left),
                    };
                    vec![Effect::Respond(problem), Effect::Count(Metric::Conflicted)]
                }
                Ok(BeginAnswer::Locked { token }) => match self.detach.take() {
                    Some(d) => {
                        let call = UpstreamCall {
                            cluster: d.cluster,
                            headers: d.headers,
                            body: d.body,
                            timeout_ms: self.cfg.detached_timeout_ms,
                        };
                        self.state = State::Detached { key, body_hash, token, gone: false };
                        vec![
                            Effect::Upstream(call),
                            Effect::Count(Metric::Executed),
                            Effect::Count(Metric::Detached),
                        ]
                    }
                    None => {
                        self.state = State::Executing { key, body_hash, token };
                        vec![Effect::Resume, Effect::Count(Metric::Executed)]
                    }
                },
                // The host logged and counted the fault itself.
                Err(_) => self.give_up(),
            },
            State::Orphaned { key } => match answer {
                Ok(BeginAnswer::Locked { token }) => {
                    vec![Effect::Store(StoreCall::Release { key, token }), Effect::Count(Metric::Released)]
                }
                _ => vec![],
            },
            other => {
                self.state = other;
                vec![]
            }
        }
    }

    /// The guarantee cannot be had (the store failed, or the body could not be read) before the
    /// upstream ran: it is given up (counted as degraded) by running unguarded, or by refusing.
    fn give_up(&mut self) -> Vec<Effect> {
        self.state = State::Done;
        match self.cfg.failure_mode {
            FailureMode::Open => vec![Effect::Resume, Effect::Count(Metric::Degraded)],
            FailureMode::Closed => vec![
                Effect::Respond(problem::store_unavailable()),
                Effect::Count(Metric::Degraded),
                Effect::Count(Metric::Unavailable),
            ],
        }
    }

    pub fn on_response_headers(&mut self, view: &dyn StreamView, end_of_stream: bool) -> Step {
        match std::mem::replace(&mut self.state, State::Done) {
            State::Executing { key, body_hash, token } => {
                let status = first(view.response_header(":status"))
                    .and_then(|s| std::str::from_utf8(&s).ok().and_then(|s| s.parse::<u16>().ok()))
                    .unwrap_or(0);
                let length = first(view.response_header("content-length"))
                    .and_then(|v| std::str::from_utf8(&v).ok().and_then(|s| s.trim().parse::<u64>().ok()));
                let (head, recorded) = self.answer_head(status, length, |name| view.response_header(name));
                let keep = keep::decide(&self.cfg, &head);
                let omitted = match keep {
                    Keep::Full => false,
                    Keep::WithoutBody => true,
                    Keep::StatusOnly | Keep::Release => {
                        return Step::go(self.end_without_record(key, token, body_hash, status, keep))
                    }
                };
                let capture = Capture { head, headers: recorded, body: Vec::new(), seen: 0, omitted };
                self.state = State::Capturing { key, body_hash, token, capture };
                if end_of_stream {
                    return Step::go(self.finish_capture());
                }
                Step::go(vec![])
            }
            // Envoy answered the client itself (e.g. a stream timeout): the detached call goes on.
            State::Detached { key, body_hash, token, .. } => {
                self.state = State::Detached { key, body_hash, token, gone: true };
                Step::go(vec![])
            }
            // The request never reached the upstream (Envoy answered it, e.g. a timeout while
            // `begin` was pending): whatever `begin` brings back must be given back.
            State::Beginning { key, .. } => {
                self.state = State::Orphaned { key };
                Step::go(vec![])
            }
            other => {
                self.state = other;
                Step::go(vec![])
            }
        }
    }

    pub fn on_response_body(&mut self, view: &dyn StreamView, chunk_len: usize, end_of_stream: bool) -> Step {
        let State::Capturing { capture, .. } = &mut self.state else {
            return Step::go(vec![]);
        };
        if chunk_len > 0 {
            capture.seen = capture.seen.saturating_add(chunk_len as u64);
            let mut keep = keep::decide(&self.cfg, &capture.head.with_body(capture.seen));
            if keep == Keep::Full && !capture.omitted {
                match view.response_body(0, chunk_len) {
                    Some(chunk) => capture.body.extend_from_slice(&chunk),
                    // A body the host cannot hand over is kept like one too large to keep.
                    None => keep = keep::decide(&self.cfg, &capture.head.with_body(u64::MAX)),
                }
            }
            match keep {
                Keep::Full => {}
                Keep::WithoutBody => {
                    capture.omitted = true;
                    capture.body = Vec::new();
                }
                keep => return Step::go(self.abandon_capture(keep)),
            }
        }
        if end_of_stream {
            return Step::go(self.finish_capture());
        }
        Step::go(vec![])
    }

    /// Trailers end the response body; they are not stored.
    pub fn on_response_trailers(&mut self) -> Step {
        if matches!(self.state, State::Capturing { .. }) {
            return Step::go(self.finish_capture());
        }
        Step::go(vec![])
    }

    fn finish_capture(&mut self) -> Vec<Effect> {
        match std::mem::replace(&mut self.state, State::Done) {
            State::Capturing { key, body_hash, token, capture } => {
                let record = Record {
                    status: capture.head.status,
                    headers: capture.headers,
                    body: capture.body,
                    body_omitted: capture.omitted,
                    print: self.print.clone(),
                };
                vec![Effect::Store(StoreCall::Commit { key, token, body_hash, record: record.encode() })]
            }
            other => {
                self.state = other;
                vec![]
            }
        }
    }

    /// The capture cannot become a full record after all: `keep` says what instead.
    fn abandon_capture(&mut self, keep: Keep) -> Vec<Effect> {
        match std::mem::replace(&mut self.state, State::Done) {
            State::Capturing { key, body_hash, token, capture } => {
                self.end_without_record(key, token, body_hash, capture.head.status, keep)
            }
            other => {
                self.state = other;
                vec![]
            }
        }
    }

    /// Ends a lock for an answer that gets no full record: its status alone
    /// ([`Keep::StatusOnly`]) or nothing.
    fn end_without_record(
        &self,
        key: String,
        token: LockToken,
        body_hash: String,
        status: u16,
        keep: Keep,
    ) -> Vec<Effect> {
        match keep {
            Keep::StatusOnly => {
                let record = Record::status_only(status).encode();
                vec![Effect::Store(StoreCall::Commit { key, token, body_hash, record })]
            }
            _ => release(key, token),
        }
    }

    /// The stream is over (complete, reset upstream, or the client went away).
    pub fn on_stream_end(&mut self) -> Vec<Effect> {
        match std::mem::replace(&mut self.state, State::Done) {
            State::Executing { key, token, .. } | State::Capturing { key, token, .. } => release(key, token),
            State::Beginning { key, .. } | State::Orphaned { key } => {
                self.state = State::Orphaned { key };
                vec![]
            }
            State::Detached { key, body_hash, token, .. } => {
                self.state = State::Detached { key, body_hash, token, gone: true };
                vec![]
            }
            _ => vec![],
        }
    }

    /// The answer to a detached execution: to the client if it is still there, and to the
    /// store in any case (a commit, or a release for what is not stored).
    pub fn on_upstream_answer(&mut self, answer: Result<UpstreamAnswer, CalloutFault>) -> Vec<Effect> {
        let (key, body_hash, token, gone) = match std::mem::replace(&mut self.state, State::Done) {
            State::Detached { key, body_hash, token, gone } => (key, body_hash, token, gone),
            other => {
                self.state = other;
                return vec![];
            }
        };
        let mut effects = Vec::new();
        let answer = match answer {
            Ok(a) => a,
            Err(fault) => {
                if !gone {
                    let problem = match fault {
                        CalloutFault::Timeout => problem::upstream_timeout(self.cfg.detached_timeout_ms),
                        _ => problem::upstream_failed(),
                    };
                    effects.push(Effect::Respond(problem));
                }
                effects.extend(release(key, token));
                return effects;
            }
        };
        if !gone {
            effects.push(Effect::Respond(answer.to_local_response()));
        }
        let values_of =
            |name: &str| answer.headers.iter().filter(|(n, _)| n == name).map(|(_, v)| v.clone()).collect();
        let (head, headers) = self.answer_head(answer.status, Some(answer.body.len() as u64), values_of);
        let keep = keep::decide(&self.cfg, &head);
        let omitted = match keep {
            Keep::Full => false,
            Keep::WithoutBody => true,
            Keep::StatusOnly | Keep::Release => {
                effects.extend(self.end_without_record(key, token, body_hash, answer.status, keep));
                if gone && keep == Keep::StatusOnly {
                    effects.push(Effect::Count(Metric::CommittedAfterGone));
                }
                return effects;
            }
        };
        let body = if omitted { Vec::new() } else { answer.body };
        let record =
            Record { status: answer.status, headers, body, body_omitted: omitted, print: self.print.clone() };
        effects.push(Effect::Store(StoreCall::Commit { key, token, body_hash, record: record.encode() }));
        if gone {
            effects.push(Effect::Count(Metric::CommittedAfterGone));
        }
        effects
    }

    /// The request as a detached execution will send it, or `None` to route it normally.
    /// `key`: the store key, if already known (inbox mode may learn it from the body).
    fn capture_for_detach(&self, view: &dyn StreamView, key: Option<&str>) -> Option<Detach> {
        let cluster = view.property(&["xds", "cluster_name"]).filter(|c| !c.is_empty())?;
        let cluster = String::from_utf8(cluster).ok()?;
        let mut headers = detached::forwardable_request(&view.request_headers())?;
        if let Some(name) = &self.cfg.store_key_header {
            match key {
                Some(key) => detached::set_header(&mut headers, name, key),
                None => headers.retain(|(n, _)| n != name),
            }
        }
        Some(Detach { cluster, headers, body: Vec::new() })
    }

    /// A client must not be able to hand the upstream a store key of its choosing.
    fn strip_store_key_header(&self, view: &dyn StreamView) -> Vec<Effect> {
        match &self.cfg.store_key_header {
            Some(name) if !view.request_header(name).is_empty() => {
                vec![Effect::RemoveRequestHeader(name.clone())]
            }
            _ => vec![],
        }
    }

    fn subject(&self, view: &dyn StreamView) -> String {
        let identity = match &self.cfg.subject {
            Subject::ClientIp => None,
            Subject::Header(name) => first(view.request_header(name)),
            Subject::Metadata { filter, path } => {
                let mut full: Vec<&str> = vec!["metadata", "filter_metadata", filter];
                full.extend(path.iter().map(String::as_str));
                view.property(&full)
            }
        };
        match identity {
            // Exact bytes either way, so two identities never collapse into one subject: a
            // numeric claim arrives as the 8 raw bytes of a double, rarely valid UTF-8.
            Some(id) if !id.is_empty() => match String::from_utf8(id) {
                Ok(text) => format!("id:{text}"),
                Err(e) => format!("idx:{}", key::hex(e.as_bytes())),
            },
            _ => {
                let source = view.property(&["source", "address"]).unwrap_or_default();
                key::anonymous_subject(&String::from_utf8_lossy(&source))
            }
        }
    }

    /// What [`keep::decide`] needs to know of an answer, and the headers its record would keep,
    /// from its status, body length (as far as known) and header values.
    fn answer_head(
        &self,
        status: u16,
        length: Option<u64>,
        values_of: impl Fn(&str) -> Vec<Vec<u8>>,
    ) -> (Head, Vec<(String, String)>) {
        let recorded = self.recorded_headers(&values_of);
        let head = Head {
            status,
            content_type: first(values_of("content-type")),
            length,
            upgrade: !values_of("upgrade").is_empty(),
            headers_fit: record::headers_fit(&recorded),
            readable: Head::readable_with(&values_of),
        };
        (head, recorded)
    }

    /// The response headers a record keeps: the allow-listed ones, and those that say how the
    /// body is read (see [`headers::REPRESENTATION`]).
    fn recorded_headers(&self, values_of: impl Fn(&str) -> Vec<Vec<u8>>) -> Vec<(String, String)> {
        let listed = &self.cfg.replay_headers;
        let representation =
            headers::REPRESENTATION.iter().copied().filter(|n| !listed.iter().any(|l| l == n));
        let mut out = Vec::new();
        for name in listed.iter().map(String::as_str).chain(representation) {
            for value in values_of(name) {
                // A value Envoy could not send back in a local reply is left out, not mangled.
                if headers::is_valid_value(&value) {
                    if let Ok(v) = String::from_utf8(value) {
                        out.push((name.to_string(), v));
                    }
                }
            }
        }
        out
    }
}

fn first(values: Vec<Vec<u8>>) -> Option<Vec<u8>> {
    values.into_iter().next()
}

/// The route part of the scope: the Envoy route's name, else the path without its query.
fn route(view: &dyn StreamView) -> String {
    match view.property(&["xds", "route_name"]) {
        Some(name) if !name.is_empty() => String::from_utf8_lossy(&name).into_owned(),
        _ => {
            let path = first(view.request_header(":path")).unwrap_or_default();
            key::route_from_path(&String::from_utf8_lossy(&path)).to_string()
        }
    }
}

/// Inbox mode's store key: subject `inbox:<source>` (never the client's address: a broker
/// delivers from many), the method, the route (two subscriber routes each handle an event
/// once), and the id, all exact bytes.
fn inbox_key(method: &str, route: &str, id: &MessageId) -> String {
    let mut subject = Vec::with_capacity(6 + id.source.len());
    subject.extend_from_slice(b"inbox:");
    subject.extend_from_slice(&id.source);
    key::store_key_bytes(&subject, method, route, &id.id)
}

/// The body hash inbox mode sends with every `begin`: a constant, so that no redelivery is
/// ever a mismatch. SHA-256 of `idempotency-filter/inbox/v1` (a unit test checks it).
pub const INBOX_BODY_HASH: &str = "84a7bd94e4892ceaf6647cf9bb4cc47d439450095ff13bbef98adfac56a78701";

/// A view with no request headers (for a decision after they are gone).
struct NoHeaders;

impl StreamView for NoHeaders {
    fn request_header(&self, _: &str) -> Vec<Vec<u8>> {
        Vec::new()
    }
    fn request_headers(&self) -> Vec<(String, Vec<u8>)> {
        Vec::new()
    }
    fn response_header(&self, _: &str) -> Vec<Vec<u8>> {
        Vec::new()
    }
    fn property(&self, _: &[&str]) -> Option<Vec<u8>> {
        None
    }
    fn request_body(&self, _: usize, _: usize) -> Option<Vec<u8>> {
        None
    }
    fn response_body(&self, _: usize, _: usize) -> Option<Vec<u8>> {
        None
    }
}

fn reject(response: LocalResponse) -> Step {
    Step::pause(vec![Effect::Respond(response), Effect::Count(Metric::Rejected)])
}

fn too_large(mut effects: Vec<Effect>, max: usize) -> Step {
    effects.push(Effect::Respond(problem::body_too_large(max)));
    effects.push(Effect::Count(Metric::Rejected));
    Step::pause(effects)
}

fn release(key: String, token: LockToken) -> Vec<Effect> {
    vec![Effect::Store(StoreCall::Release { key, token }), Effect::Count(Metric::Released)]
}

#[cfg(test)]
mod tests;
