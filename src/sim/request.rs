//! A simulated host for the state machine: a scripted [`StreamView`] and a [`Driver`] that feeds
//! a [`Machine`] events and checks, after every step, the invariants any event sequence must keep.
//! Shared by the machine's unit tests and the `machine` fuzz target (`fuzz/`); test support only,
//! the filter itself never uses it. No proxy-wasm here.
//!
//! The invariants:
//!
//! * at most one local answer (`Respond` or `Refuse`), and at most one execution (`Resume` or `Upstream`);
//!   never a local answer and a `Resume` for the same stream, never an execution after a local
//!   answer, nothing of the three after the stream ended;
//! * at most one `begin`, with a well-formed store key and body hash;
//! * every lock the store grants (a `locked` answer to the pending `begin`) ends in exactly one
//!   commit or release naming its key and token, and no commit or release names anything else;
//! * a committed record decodes, has a status `store_statuses` keeps (any `2xx` in inbox mode),
//!   fits `max_record_bytes`, and says which request it answers (outside inbox mode);
//! * an answer to a call that is not pending changes nothing;
//! * once the pending calls are answered, the stream is settled ([`Machine::is_settled`]).

use std::collections::HashMap;
use std::rc::Rc;

use crate::config::Config;
use crate::request::detached::UpstreamAnswer;
use crate::request::machine::{Effect, Machine, StreamView};
use crate::store::client::{BeginAnswer, CalloutFault, LockToken, StoreCall};
use crate::store::record::Record;

/// A scripted host: headers, properties (`"source.address"`: the path joined with dots) and
/// bodies the caller sets.
#[derive(Debug, Clone, Default)]
pub struct MockView {
    pub request: Vec<(String, Vec<u8>)>,
    pub response: Vec<(String, Vec<u8>)>,
    pub props: HashMap<String, Vec<u8>>,
    pub request_body: Vec<u8>,
    pub response_chunk: Vec<u8>,
    pub response_trailers: Vec<(String, Vec<u8>)>,
    /// Random draws so far (see `random_bytes`).
    pub draws: std::cell::Cell<u8>,
    /// The wall clock (`None`: the host cannot tell).
    pub now_ms: Option<u64>,
}

impl MockView {
    /// `POST /orders?x=1` from `127.0.0.1:40000`, with the given `Idempotency-Key`.
    pub fn post(key: Option<&str>) -> MockView {
        let mut v = MockView::default();
        v.req(":method", "POST").req(":path", "/orders?x=1");
        if let Some(k) = key {
            v.req("idempotency-key", k);
        }
        v.prop("source.address", "127.0.0.1:40000");
        v
    }

    pub fn req(&mut self, name: &str, value: &str) -> &mut Self {
        self.request.push((name.into(), value.as_bytes().to_vec()));
        self
    }

    pub fn resp(&mut self, name: &str, value: &str) -> &mut Self {
        self.response.push((name.into(), value.as_bytes().to_vec()));
        self
    }

    pub fn prop(&mut self, path: &str, value: &str) -> &mut Self {
        self.props.insert(path.into(), value.as_bytes().to_vec());
        self
    }
}

impl StreamView for MockView {
    fn now_ms(&self) -> Option<u64> {
        self.now_ms
    }
    fn request_headers(&self) -> Vec<(String, Vec<u8>)> {
        self.request.clone()
    }
    fn request_header(&self, name: &str) -> Vec<Vec<u8>> {
        self.request.iter().filter(|(n, _)| n == name).map(|(_, v)| v.clone()).collect()
    }
    fn response_header(&self, name: &str) -> Vec<Vec<u8>> {
        self.response.iter().filter(|(n, _)| n == name).map(|(_, v)| v.clone()).collect()
    }
    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.props.get(&path.join(".")).cloned()
    }
    fn response_trailers(&self) -> Vec<(String, Vec<u8>)> {
        self.response_trailers.clone()
    }
    fn request_body(&self, start: usize, len: usize) -> Option<Vec<u8>> {
        self.request_body.get(start..start.checked_add(len)?).map(<[u8]>::to_vec)
    }
    fn response_body(&self, start: usize, len: usize) -> Option<Vec<u8>> {
        self.response_chunk.get(start..start.checked_add(len)?).map(<[u8]>::to_vec)
    }
    /// Not random: a different value each call (1, 2, ... in every byte).
    fn random_bytes(&self) -> Option<[u8; 16]> {
        self.draws.set(self.draws.get().wrapping_add(1));
        Some([self.draws.get(); 16])
    }
}

/// One thing the host tells the machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    RequestHeaders {
        end_of_stream: bool,
    },
    /// `buffered` bytes of [`MockView::request_body`] are buffered so far.
    RequestBody {
        buffered: usize,
        end_of_stream: bool,
    },
    RequestTrailers,
    /// The store's answer to `begin`. A `Locked` answer gets a fresh token from the driver.
    BeginAnswer(Result<BeginAnswer, CalloutFault>),
    /// The response headers become `headers`; `details`: Envoy's `response.code_details` for
    /// them (`via_upstream` for the upstream's own, a reason for Envoy's reply; `None`: not told).
    ResponseHeaders {
        headers: Vec<(String, Vec<u8>)>,
        details: Option<String>,
        end_of_stream: bool,
    },
    /// The next response body chunk.
    ResponseBody {
        chunk: Vec<u8>,
        end_of_stream: bool,
    },
    ResponseTrailers,
    /// The answer to a detached execution, or to an `outcome_lookup`.
    UpstreamAnswer(Result<UpstreamAnswer, CalloutFault>),
    /// The stream is over (complete, reset, or the client went away).
    StreamEnd,
}

/// How often each effect that matters was seen: for checking that a sample reaches every path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    pub responds: u32,
    pub resumes: u32,
    pub upstreams: u32,
    pub begins: u32,
    pub commits: u32,
    pub releases: u32,
    /// Releases that left the key in doubt.
    pub in_doubt: u32,
    pub lookups: u32,
}

/// A lock the store granted, and how many commits or releases named it.
#[derive(Debug)]
struct Lock {
    token: String,
    ends: u32,
}

/// Feeds a [`Machine`] events and checks the invariants (see the module docs) after each.
pub struct Driver {
    pub stream: Machine,
    pub view: MockView,
    cfg: Rc<Config>,
    trace: Vec<Event>,
    responded: bool,
    executed: bool,
    resumed: bool,
    ended: bool,
    /// The store key and body hash of the `begin` the stream sent.
    begun: Option<(String, String)>,
    begin_pending: bool,
    upstream_pending: bool,
    locks: Vec<Lock>,
    /// The store said the key is in doubt: the attempt's token and how long it may still run.
    in_doubt: Option<(String, u64)>,
    /// A lookup is pending; then whether the last one said `404`.
    looking: bool,
    lookup_absent: bool,
    /// The `begin` that superseded the in-doubt attempt is pending, or was granted its lock.
    superseding: bool,
    /// Commits made under the in-doubt attempt's token (a lookup's answer).
    in_doubt_commits: u32,
    pub tally: Tally,
}

impl Driver {
    pub fn new(cfg: Rc<Config>, view: MockView) -> Driver {
        Driver {
            stream: Machine::new(Rc::clone(&cfg)),
            view,
            cfg,
            trace: Vec::new(),
            responded: false,
            executed: false,
            resumed: false,
            ended: false,
            begun: None,
            begin_pending: false,
            upstream_pending: false,
            locks: Vec::new(),
            in_doubt: None,
            looking: false,
            lookup_absent: false,
            superseding: false,
            in_doubt_commits: 0,
            tally: Tally::default(),
        }
    }

    /// Delivers one event; `Err` names the broken invariant, with the events so far.
    pub fn step(&mut self, event: Event) -> Result<(), String> {
        self.trace.push(event.clone());
        let mut stray = false;
        let effects = match event {
            Event::RequestHeaders { end_of_stream } => {
                self.stream.on_request_headers(&self.view, end_of_stream).effects
            }
            Event::RequestBody { buffered, end_of_stream } => {
                self.stream.on_request_body(&self.view, buffered, end_of_stream).effects
            }
            Event::RequestTrailers => self.stream.on_request_trailers().effects,
            Event::BeginAnswer(answer) => {
                let answer = match answer {
                    Ok(BeginAnswer::Locked { .. }) if self.begin_pending => {
                        let token = format!("t{}", self.locks.len() + 1);
                        self.locks.push(Lock { token: token.clone(), ends: 0 });
                        Ok(BeginAnswer::Locked { token: token.into() })
                    }
                    Ok(BeginAnswer::InDoubt { token, started_ms, running_ms }) if self.begin_pending => {
                        self.in_doubt = Some((token.to_string(), running_ms));
                        Ok(BeginAnswer::InDoubt { token, started_ms, running_ms })
                    }
                    other => other,
                };
                stray = !self.begin_pending;
                self.begin_pending = false;
                self.stream.on_begin_answer(answer)
            }
            Event::ResponseHeaders { headers, details, end_of_stream } => {
                self.view.response = headers;
                match details {
                    Some(d) => self.view.props.insert("response.code_details".into(), d.into_bytes()),
                    None => self.view.props.remove("response.code_details"),
                };
                self.stream.on_response_headers(&self.view, end_of_stream).effects
            }
            Event::ResponseBody { chunk, end_of_stream } => {
                let len = chunk.len();
                self.view.response_chunk = chunk;
                self.stream.on_response_body(&self.view, len, end_of_stream).effects
            }
            Event::ResponseTrailers => self.stream.on_response_trailers(&self.view).effects,
            Event::UpstreamAnswer(answer) => {
                stray = !self.upstream_pending;
                self.upstream_pending = false;
                if std::mem::take(&mut self.looking) {
                    self.lookup_absent = matches!(&answer, Ok(a) if a.status == 404);
                }
                self.stream.on_upstream_answer(answer, self.view.now_ms)
            }
            Event::StreamEnd => {
                let effects = self.stream.on_stream_end(&self.view);
                self.ended = true;
                effects
            }
        };
        if stray && !effects.is_empty() {
            return self.violation(format!("an answer to no pending call had effects: {effects:?}"));
        }
        for effect in &effects {
            self.check(effect)?;
        }
        Ok(())
    }

    /// Ends the stream, answers what is still pending (`begin` with a lock, a detached call with
    /// a `201`), then checks that the stream is settled and every lock was given back once.
    pub fn finish(&mut self) -> Result<(), String> {
        self.step(Event::StreamEnd)?;
        if self.begin_pending {
            self.step(Event::BeginAnswer(Ok(BeginAnswer::Locked { token: "".into() })))?;
        }
        if self.upstream_pending {
            let answer = UpstreamAnswer { status: 201, headers: vec![], body: vec![], trailers: vec![] };
            self.step(Event::UpstreamAnswer(Ok(answer)))?;
        }
        if !self.stream.is_settled() {
            return self.violation("not settled once every call was answered".into());
        }
        if let Some(lock) = self.locks.iter().find(|l| l.ends != 1) {
            return self
                .violation(format!("lock {} was committed or released {} times", lock.token, lock.ends));
        }
        Ok(())
    }

    fn check(&mut self, effect: &Effect) -> Result<(), String> {
        match effect {
            // A gRPC replay's second hop answers the stream as a local answer would.
            Effect::Respond(_) | Effect::Refuse(_) | Effect::Hop { .. } => {
                if self.responded {
                    return self.violation("a second local answer".into());
                }
                if self.resumed {
                    return self.violation("a local answer after the request was resumed".into());
                }
                if self.ended {
                    return self.violation("a local answer after the stream ended".into());
                }
                self.responded = true;
                self.tally.responds += 1;
            }
            Effect::Lookup(_) => {
                if self.in_doubt.is_none() || self.executed || self.responded || self.upstream_pending {
                    return self.violation("a lookup but for an in-doubt key's retry".into());
                }
                self.looking = true;
                self.upstream_pending = true;
                self.tally.lookups += 1;
            }
            Effect::Resume | Effect::Upstream(_) => {
                if self.in_doubt.is_some() && !self.superseding {
                    return self.violation(format!("an in-doubt key ran again: {effect:?}"));
                }
                if self.executed {
                    return self.violation(format!("a second execution: {effect:?}"));
                }
                if self.responded {
                    return self.violation(format!("an execution after a local answer: {effect:?}"));
                }
                if self.ended {
                    return self.violation(format!("an execution after the stream ended: {effect:?}"));
                }
                self.executed = true;
                match effect {
                    Effect::Resume => self.tally.resumes += 1,
                    _ => self.tally.upstreams += 1,
                }
                self.resumed = matches!(effect, Effect::Resume);
                self.upstream_pending = matches!(effect, Effect::Upstream(_));
            }
            Effect::Store(StoreCall::Begin { key, body_hash, hold, .. }) => {
                let supersede = hold.as_ref().and_then(|h| h.supersede.as_deref());
                match (&self.begun, supersede, &self.in_doubt) {
                    (None, None, _) => {}
                    // Only once the application said `404` of an attempt that can no longer run.
                    (Some(begun), Some(token), Some((in_doubt, 0)))
                        if self.lookup_absent
                            && !self.superseding
                            && token == in_doubt
                            && *begun == (key.clone(), body_hash.clone()) =>
                    {
                        self.superseding = true;
                    }
                    _ => return self.violation(format!("a second begin, or one superseding {supersede:?}")),
                }
                if !idem_protocol::is_hex64(key.as_bytes()) || !idem_protocol::is_hex64(body_hash.as_bytes())
                {
                    return self.violation(format!("a malformed begin: {key:?} {body_hash:?}"));
                }
                self.begun = Some((key.clone(), body_hash.clone()));
                self.begin_pending = true;
                if self.superseding {
                    // A fresh attempt: what the machine does with its lock is checked as a first's.
                    self.in_doubt = None;
                }
                self.tally.begins += 1;
            }
            Effect::Store(StoreCall::Commit { key, token, body_hash, record, .. }) => {
                if self.begun.as_ref() != Some(&(key.clone(), body_hash.clone())) {
                    return self
                        .violation(format!("a commit for another key or body: {key:?} {body_hash:?}"));
                }
                let kept_status = |status: u16| match self.cfg.inbox() {
                    Some(_) => (200..=299).contains(&status),
                    None => self.cfg.store_statuses.contains(status),
                };
                // A gRPC answer (trailers) is kept by its `grpc-status`, an HTTP 200.
                let kept = |r: &Record| match &r.trailers {
                    Some(t) => {
                        r.status == 200
                            && t.iter().filter(|(n, _)| n == "grpc-status").count() == 1
                            && t.iter().any(|(n, v)| {
                                n == "grpc-status"
                                    && crate::http::grpc::parse_status(v.as_bytes())
                                        .is_some_and(|c| self.cfg.store_grpc_statuses.contains(c))
                            })
                    }
                    None => kept_status(r.status),
                };
                match Record::decode(record) {
                    Ok(r)
                        if kept(&r)
                            && r.body.len() <= self.cfg.max_record_bytes
                            && (!r.body_omitted || r.body.is_empty())
                            && r.print.is_some() == self.cfg.inbox().is_none() => {}
                    other => {
                        return self.violation(format!("a commit of a record that cannot replay: {other:?}"))
                    }
                }
                match &self.in_doubt {
                    // The lookup's answer, committed as the in-doubt attempt's own late commit.
                    Some((t, _)) if *t == token.to_string() => {
                        self.in_doubt_commits += 1;
                        if self.in_doubt_commits > 1 || self.executed {
                            return self.violation("a second commit under the in-doubt token".into());
                        }
                    }
                    _ => self.end_lock(key, token)?,
                }
                self.tally.commits += 1;
            }
            Effect::Store(StoreCall::Release { key, token, in_doubt }) => {
                // In doubt only what went to the application.
                if *in_doubt && !self.executed {
                    return self.violation("an attempt left in doubt that never ran".into());
                }
                self.end_lock(key, token)?;
                self.tally.releases += 1;
                self.tally.in_doubt += u32::from(*in_doubt);
            }
            Effect::SetRequestHeader(..)
            | Effect::RemoveRequestHeader(_)
            | Effect::AddResponseTrailers(_)
            | Effect::RemoveResponseHeader(_)
            | Effect::SetResponseHeader(..)
            | Effect::Count(_) => {}
        }
        Ok(())
    }

    fn end_lock(&mut self, key: &str, token: &LockToken) -> Result<(), String> {
        let token = token.to_string();
        if self.begun.as_ref().map(|(k, _)| k.as_str()) != Some(key) {
            return self.violation(format!("a commit or release for another key: {key:?}"));
        }
        let Some(lock) = self.locks.iter_mut().find(|l| l.token == token) else {
            return self.violation(format!("a commit or release of a lock never granted: {token:?}"));
        };
        lock.ends += 1;
        if lock.ends > 1 {
            return self.violation(format!("lock {token} committed or released twice"));
        }
        Ok(())
    }

    fn violation(&self, what: String) -> Result<(), String> {
        Err(format!("{what}\n  events: {:#?}", self.trace))
    }
}
