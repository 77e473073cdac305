//! A simulated worker for the [`Coordinator`]: many streams, a store that keeps records and locks
//! with expiry, an upstream that counts executions, a shared queue and a clock, all driven by one
//! seeded random sequence. It carries out the coordinator's commands as the host does and checks,
//! after every event, what any interleaving must keep:
//!
//! * every lock the filter is granted ends once: one commit or release the store answered, or,
//!   after faults, a release left to the lock's TTL; no commit or release names a lock it was not
//!   granted, or comes after the lock's end;
//! * answers go to the right stream: what a store or upstream answer causes only touches streams
//!   of the answer's store key; a replay carries the answer of an execution of the same request;
//!   a stream is answered or resumed at most once, only while it waits, never after it ended;
//! * nothing is served from the record cache past the record's expiry in the store, or other than
//!   the record the store holds;
//! * with the local fallback (store faults, the breaker, deadlines the store answers `expired`):
//!   replays still carry an execution of the same request, whether this VM ran it under its
//!   local lock or another replica stored it first (the hand-back then races it), and no local
//!   lock is left once every stream ended;
//! * callouts are dispatched only from root callbacks, wake-ups asked only from stream callbacks;
//! * once every call is answered, no stream waits forever, and once every stream has ended, the
//!   coordinator holds nothing.
//!
//! Test support only (unit tests and `fuzz/`); the filter never uses it. No proxy-wasm here. The
//! simulated store and upstream are in `store`, what a run counts and its random source in
//! `tally`.

use std::collections::HashMap;
use std::rc::Rc;

use idem_protocol as proto;

use crate::config::values::StoreTransport;
use crate::config::Config;
use crate::request::machine::Action;
use crate::request::metrics::Metric;
use crate::sim::request::MockView;
use crate::store::client::StoreCall;
use crate::store::record::Record;
use crate::worker::command::{Command, Dispatch};
use crate::worker::coordinator::{Coordinator, Stepped};

mod store;
pub mod tally;
mod wire;

use store::{call_key, call_keys, describe};
use tally::{Rng, SimEnv, Tally};
use wire::WireCall;

/// Configurations a run picks from (each with `store_key_header`, through which the simulation
/// learns every stream's store key).
pub const CONFIGS: [&str; 6] = [
    r#"{"store_cluster":"idemstore","store_key_header":"x-store-key","local_record_entries":256,"retention_seconds":3,"store_timeout_ms":300,"lock_wait_ms":200}"#,
    r#"{"store_cluster":"idemstore","store_key_header":"x-store-key","local_record_entries":256,"retention_seconds":2,"failure_mode":"closed"}"#,
    r#"{"store_cluster":"idemstore","store_key_header":"x-store-key","local_record_entries":256,"retention_seconds":1,"detached_execution":true,"lock_wait_ms":0}"#,
    r#"{"store_cluster":"idemstore","store_key_header":"x-store-key","local_record_entries":256,"retention_seconds":4,"record_cache_entries":0,"breaker_failures":1,"breaker_open_ms":300}"#,
    // Streams go to the routes `orders` and `payments` (see `new_stream`): each its own terms.
    r#"{"store_cluster":"idemstore","store_key_header":"x-store-key","local_record_entries":256,"retention_seconds":3,"lock_wait_ms":200,"routes":{"payments":{"retention_seconds":1,"lock_wait_ms":0,"lock_ttl_ms":400},"orders":{"retention_seconds":5,"detached_execution":true}}}"#,
    // Keys in doubt are looked up (the application answers from what it completed); a short
    // lock TTL, so that a lookup's `404` can be believed within a run.
    r#"{"store_cluster":"idemstore","store_key_header":"x-store-key","local_record_entries":256,"retention_seconds":3,"lock_ttl_ms":200,"lock_wait_ms":100,"outcome_lookup":{"path":"/by-key/{key}"}}"#,
];

const CLIENT_KEYS: [&str; 3] = ["order-1", "order-2", "order-3"];
const BODIES: [&str; 2] = ["{\"qty\":1}", "{\"qty\":2}"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    RequestHeaders,
    RequestBody,
    /// Paused by the filter: waiting for a resume or a local answer.
    Waiting,
    ResponseHeaders,
    ResponseBody,
    Complete,
}

struct SimStream {
    id: u32,
    view: MockView,
    client_key: &'static str,
    body: &'static str,
    phase: Phase,
    /// The store key, from the `store_key_header` the filter sets.
    store_key: Option<String>,
    /// The filter is done with it: the host skips its callbacks (but not `on_done`).
    passive: bool,
    ended: bool,
    answered: bool,
    executed: bool,
    /// The response the upstream (or the filter's local answer) gives, and Envoy's
    /// `response.code_details` for it.
    response: Option<Message>,
    details: &'static str,
}

enum Stored {
    Lock { token: String, expires_us: u64 },
    Record { body_hash: String, bytes: Vec<u8>, expires_us: u64 },
}

/// The store's trace of a begun attempt under `unknown_outcome: hold` (beside its lock, and
/// outliving it): the key is in doubt while it lasts without a lock.
struct Trace {
    token: String,
    started_us: u64,
    lock_ttl_us: u64,
    body_hash: String,
    expires_us: u64,
}

/// A lock the filter learned it holds, and what it did with it.
struct Granted {
    key: String,
    /// Commit or release calls that named it: `true` if the filter got their answer.
    ends: Vec<(bool, bool)>,
    /// The store told the filter its attempt is in doubt (a release in doubt, or its lock
    /// expired with the trace left); then whether a commit under it resolved the doubt since (a
    /// lookup's answer, committed as the attempt's own late commit would be).
    in_doubt: bool,
    resolved: bool,
}

struct InFlight {
    token: u32,
    call: Dispatch,
}

/// Which callback the host is in, for the host's rules.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Callback {
    Stream(u32),
    Root,
}

/// Which streams the commands of the current event may answer or resume.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Scope {
    /// A stream callback: that stream only.
    Own(u32),
    /// A root callback: streams of the store keys whose calls concluded in it (answered, or not
    /// dispatched), and only while they wait.
    Keys(Vec<String>),
    /// A wake-up failed: the queued calls of any stream concluded, waiting ones may be answered.
    Any,
}

pub struct World {
    coord: Coordinator,
    cfg: Rc<Config>,
    clock: SimEnv,
    rng: Rng,
    streams: Vec<SimStream>,
    max_streams: usize,
    queued_wakes: u32,
    /// The root's tick period the coordinator asked for (0: none).
    tick_ms: u64,
    in_flight: Vec<InFlight>,
    /// Calls on the store streams, and the streams open now.
    wire: Vec<WireCall>,
    open_tokens: Vec<u32>,
    next_token: u32,
    store: HashMap<String, Stored>,
    traces: HashMap<String, Trace>,
    /// Keys whose attempt this VM left in doubt (an in-doubt release the store took), until a
    /// record or a superseding lock resolves them: none of them may run again but degraded.
    doubt: HashMap<String, String>,
    /// Tokens of in-doubt attempts the store named to the filter but never granted it (their
    /// `begin`'s answer was lost): the filter may commit under each once.
    unknown_in_doubt: std::collections::HashSet<String>,
    /// Each stream's last outcome (`wasm.idempotency_outcome`).
    outcomes: HashMap<u32, &'static str>,
    /// Each stream's problem `instance` (`wasm.idempotency_instance`), and every one handed out.
    instances: HashMap<u32, String>,
    every_instance: std::collections::HashSet<String>,
    /// Streams that ran their request in the current event, and what completed.
    ran_now: Vec<usize>,
    completing: Vec<(usize, String, Vec<u8>)>,
    /// What the application completed per store key (for `outcome_lookup`): the body it answered.
    completed: HashMap<String, Vec<u8>>,
    granted: HashMap<String, Granted>,
    next_lock: u32,
    executions: u32,
    /// Percent of callouts that fail (not dispatched, reset, timed out, garbage).
    fault_rate: u64,
    callback: Callback,
    scope: Scope,
    /// The last local answer given in a stream's own callback: a cache hit's, when the
    /// coordinator counts one next.
    last_own_answer: Option<(usize, u32, Vec<u8>)>,
    trace: Vec<String>,
    pub tally: Tally,
}

/// Header pairs and a body, as Envoy hands them over.
type Message = (Vec<(String, Vec<u8>)>, Vec<u8>);

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
    list.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect()
}

impl World {
    pub fn new(mut rng: Rng) -> World {
        let base = CONFIGS[rng.below(CONFIGS.len() as u64) as usize];
        let transport = ["stream", "callout"][rng.below(2) as usize];
        let json = base.replacen('{', &format!("{{\"store_transport\":\"{transport}\","), 1);
        let cfg = match Config::from_json(json.as_bytes()) {
            Ok(c) => Rc::new(c),
            Err(e) => unreachable!("the simulation's configurations are valid: {e}"),
        };
        let max_streams = 2 + rng.below(6) as usize;
        let fault_rate = [0, 10, 30][rng.below(3) as usize];
        World {
            coord: Coordinator::new(Rc::clone(&cfg)),
            cfg,
            clock: SimEnv::at(1_700_000_000_000_000),
            rng,
            streams: Vec::new(),
            max_streams,
            queued_wakes: 0,
            tick_ms: 0,
            in_flight: Vec::new(),
            wire: Vec::new(),
            open_tokens: Vec::new(),
            next_token: 1,
            store: HashMap::new(),
            traces: HashMap::new(),
            doubt: HashMap::new(),
            unknown_in_doubt: Default::default(),
            outcomes: HashMap::new(),
            instances: HashMap::new(),
            every_instance: Default::default(),
            ran_now: Vec::new(),
            completing: Vec::new(),
            completed: HashMap::new(),
            granted: HashMap::new(),
            next_lock: 0,
            executions: 0,
            fault_rate,
            callback: Callback::Root,
            scope: Scope::Keys(vec![]),
            last_own_answer: None,
            trace: Vec::new(),
            tally: Tally::default(),
        }
    }

    /// One run: `steps` random events, then every call answered and every stream ended, with the
    /// checks after each event and at the end.
    pub fn run(rng: Rng, steps: usize) -> Result<Tally, String> {
        let mut w = World::new(rng);
        w.coord.set_up(&w.clock, 7);
        w.commands()?;
        for _ in 0..steps {
            w.random_event()?;
        }
        w.drain()?;
        Ok(w.tally)
    }

    fn violation<T>(&self, what: String) -> Result<T, String> {
        let start = self.trace.len().saturating_sub(40);
        Err(format!("{what}\n  last events:\n    {}", self.trace[start..].join("\n    ")))
    }

    fn random_event(&mut self) -> Result<(), String> {
        match self.rng.below(10) {
            0 if self.streams.len() < self.max_streams => self.new_stream(),
            0..=2 => match self.pick(|s| !s.ended && s.phase != Phase::Waiting) {
                Some(i) => self.advance(i),
                None => Ok(()),
            },
            3 | 4 => self.answer_one(),
            5 if self.queued_wakes > 0 => self.queue_ready(),
            5 if self.tick_ms > 0 => self.tick(),
            6 => {
                let us = self.rng.below(700_000);
                self.clock.0.set(self.clock.0.get() + us);
                self.trace.push(format!("clock +{} ms", us / 1000));
                Ok(())
            }
            7 if self.rng.chance(30) => match self.pick(|s| !s.ended) {
                Some(i) => self.end(i),
                None => Ok(()),
            },
            8 if self.rng.chance(20) => {
                self.other_replica_runs();
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// A random stream among those `which` accepts.
    fn pick(&mut self, which: impl Fn(&SimStream) -> bool) -> Option<usize> {
        let some: Vec<usize> = (0..self.streams.len()).filter(|&i| which(&self.streams[i])).collect();
        let n = some.len() as u64;
        (n > 0).then(|| some[self.rng.below(n) as usize])
    }

    /// Answers everything, checks that no stream still waits, then ends every stream and checks
    /// that the coordinator forgot everything and every lock ended.
    fn drain(&mut self) -> Result<(), String> {
        self.fault_rate = 0;
        self.settle_calls()?;
        for i in 0..self.streams.len() {
            while self.can_advance(i) {
                self.advance(i)?;
                self.settle_calls()?;
            }
            let s = &self.streams[i];
            if !s.ended && s.phase == Phase::Waiting {
                return self.violation(format!("stream {} waits with every call answered", s.id));
            }
        }
        for i in 0..self.streams.len() {
            if !self.streams[i].ended {
                self.end(i)?;
                self.settle_calls()?;
            }
        }
        // Records kept here go back to the store (a lock whose commit failed ends that way).
        for _ in 0..60 {
            if !self.coord.hand_backs_due() {
                break;
            }
            self.clock.0.set(self.clock.0.get() + 1_100_000);
            self.tick()?;
            self.settle_calls()?;
        }
        if self.coord.hand_backs_due() {
            return self.violation("local records never handed back".into());
        }
        let now_ms = self.clock.0.get() / 1000;
        let (retention_seconds, lock_ttl_ms) = self.cfg.longest_terms();
        let local = crate::worker::local_store::LocalStore::new(
            self.cfg.local_record_entries,
            self.cfg.local_record_bytes,
            lock_ttl_ms,
            retention_seconds * 1000,
        );
        let locks = local.held_locks(&self.clock.1, now_ms);
        if locks > 0 {
            return self.violation(format!("{locks} local locks still held once every stream ended"));
        }
        let (streams, calls) = self.coord.pending();
        if streams + calls > 0 {
            return self
                .violation(format!("the coordinator still holds {streams} streams and {calls} calls"));
        }
        for (token, g) in &self.granted {
            let ended = match g.ends.iter().position(|&(_, answered)| answered) {
                Some(i) => i + 1 == g.ends.len(),
                // Given up after faults: a failed release is left to the lock's TTL, and so is a
                // record whose commits failed, kept locally, which expired before it could be
                // handed back (one that could was, above).
                None => g.ends.last().is_some_and(|&(commit, _)| !commit) || g.ends.iter().all(|&(c, _)| c),
            };
            if !ended {
                return self.violation(format!("lock {token} of {}: ends {:?}", g.key, g.ends));
            }
        }
        Ok(())
    }

    /// Answers every call, and lets the clock run for streams that wait for a local lock.
    fn settle_calls(&mut self) -> Result<(), String> {
        for _ in 0..10_000 {
            if self.queued_wakes > 0 {
                self.queue_ready()?;
            } else if !self.in_flight.is_empty() || !self.wire.is_empty() {
                self.answer_one()?;
            } else if self.coord.is_waiting() && self.tick_ms > 0 {
                self.clock.0.set(self.clock.0.get() + 50_000);
                self.tick()?;
            } else {
                return Ok(());
            }
        }
        self.violation("calls and waits never settled".into())
    }

    fn new_stream(&mut self) -> Result<(), String> {
        let id = 2 + self.streams.len() as u32;
        let client_key = CLIENT_KEYS[self.rng.below(CLIENT_KEYS.len() as u64) as usize];
        let body = BODIES[self.rng.below(BODIES.len() as u64) as usize];
        let mut view = MockView::post(Some(client_key));
        let route = ["orders", "payments"][self.rng.below(2) as usize];
        view.req("x-request-id", &format!("req-{id}"))
            .prop("xds.cluster_name", "app")
            .prop("xds.route_name", route);
        view.request_body = body.as_bytes().to_vec();
        self.streams.push(SimStream {
            id,
            view,
            client_key,
            body,
            phase: Phase::RequestHeaders,
            store_key: None,
            passive: false,
            ended: false,
            answered: false,
            executed: false,
            response: None,
            details: "via_upstream",
        });
        self.tally.streams += 1;
        self.trace.push(format!("stream {id}: {client_key} {body}"));
        Ok(())
    }

    fn can_advance(&self, i: usize) -> bool {
        let s = &self.streams[i];
        !s.ended && s.phase != Phase::Waiting
    }

    /// The stream's next Envoy callback (and `on_done` after the last).
    fn advance(&mut self, i: usize) -> Result<(), String> {
        let id = self.streams[i].id;
        self.trace.push(format!("stream {id}: {:?}", self.streams[i].phase));
        match self.streams[i].phase {
            Phase::RequestHeaders => {
                let stepped = self.step(i, |c, v, clock| {
                    c.on_stream_event(id, v, clock, |s, v| s.on_request_headers(v, false))
                })?;
                self.after_request_step(i, stepped, false)?;
            }
            Phase::RequestBody => {
                let len = self.streams[i].view.request_body.len();
                let stepped = self.step(i, |c, v, clock| {
                    c.on_stream_event(id, v, clock, |s, v| s.on_request_body(v, len, true))
                })?;
                self.after_request_step(i, stepped, true)?;
            }
            Phase::Waiting => {}
            Phase::ResponseHeaders => {
                let (headers, _) = self.streams[i].response.clone().unwrap_or_default();
                self.streams[i].view.response = headers;
                let details = self.streams[i].details;
                self.streams[i].view.prop("response.code_details", details);
                self.streams[i]
                    .view
                    .props
                    .insert("upstream.request_attempt_count".into(), 1u64.to_le_bytes().to_vec());
                if let Some(content_type) = self.coord.take_restore(id) {
                    let s = &mut self.streams[i];
                    s.view.response.retain(|(n, _)| n != "content-type");
                    if let Some(v) = content_type {
                        s.view.resp("content-type", &v);
                    }
                }
                self.step(i, |c, v, clock| {
                    c.on_stream_event(id, v, clock, |s, v| s.on_response_headers(v, false))
                })?;
                self.streams[i].phase = Phase::ResponseBody;
            }
            Phase::ResponseBody => {
                let (_, body) = self.streams[i].response.clone().unwrap_or_default();
                let len = body.len();
                self.streams[i].view.response_chunk = body;
                self.step(i, |c, v, clock| {
                    c.on_stream_event(id, v, clock, |s, v| s.on_response_body(v, len, true))
                })?;
                self.streams[i].phase = Phase::Complete;
            }
            Phase::Complete => return self.end(i),
        }
        Ok(())
    }

    /// Where a request callback leaves the stream: answered or resumed within it, paused, or on
    /// its way to the upstream once the whole request went through.
    fn after_request_step(&mut self, i: usize, stepped: Option<Stepped>, last: bool) -> Result<(), String> {
        let s = &mut self.streams[i];
        if let Some(st) = stepped {
            s.passive = st.done;
        }
        if s.answered || s.executed {
            return Ok(());
        }
        let paused = stepped.is_some_and(|st| st.action == Action::Pause);
        s.phase = match (last, paused) {
            (false, _) => Phase::RequestBody,
            (true, true) => Phase::Waiting,
            (true, false) => Phase::ResponseHeaders,
        };
        if s.phase == Phase::ResponseHeaders {
            self.execute_routed(i)?;
        }
        Ok(())
    }

    /// Runs a stream callback as the host does (skipped once the stream is passive), then its
    /// commands.
    fn step(
        &mut self,
        i: usize,
        event: impl FnOnce(&mut Coordinator, &MockView, &SimEnv) -> Stepped,
    ) -> Result<Option<Stepped>, String> {
        if self.streams[i].passive {
            return Ok(None);
        }
        self.callback = Callback::Stream(self.streams[i].id);
        self.scope = Scope::Own(self.streams[i].id);
        let view = self.streams[i].view.clone();
        let stepped = event(&mut self.coord, &view, &self.clock);
        self.commands()?;
        Ok(Some(stepped))
    }

    fn end(&mut self, i: usize) -> Result<(), String> {
        let id = self.streams[i].id;
        if self.streams[i].phase != Phase::Complete {
            self.tally.ended_early += 1;
        }
        self.trace.push(format!("stream {id}: on_done"));
        self.streams[i].ended = true;
        self.callback = Callback::Stream(id);
        self.scope = Scope::Own(id);
        self.coord.on_stream_done(id, &crate::sim::request::MockView::default(), &self.clock);
        self.commands()
    }

    fn tick(&mut self) -> Result<(), String> {
        self.trace.push("tick".into());
        self.callback = Callback::Root;
        self.scope = Scope::Any;
        self.coord.on_tick(&self.clock);
        self.commands()
    }

    fn queue_ready(&mut self) -> Result<(), String> {
        self.trace.push("queue ready".into());
        self.queued_wakes = 0;
        self.callback = Callback::Root;
        // On the store stream, a queued call fails at once while it backs off after failed
        // opens: its key may conclude here.
        let failing_fast = match self.cfg.store_transport {
            StoreTransport::Stream => self.coord.queued().map(|c| c.key().to_string()).collect(),
            StoreTransport::Callout => vec![],
        };
        self.scope = Scope::Keys(failing_fast);
        self.coord.on_queue_ready(&self.clock);
        self.commands()
    }

    /// The routed upstream runs the request: its answer names the request it ran. Mostly kept;
    /// a 500 is not, and its lock is released; Envoy's timeout replaces an answer the
    /// application completed, its reset one it did not: both leave the key in doubt.
    fn execute_routed(&mut self, i: usize) -> Result<(), String> {
        // Checked once the event's commands are carried out: its outcome may come after.
        self.ran_now.push(i);
        self.executions += 1;
        self.tally.executions += 1;
        let ending = ["201", "200", "201", "500", "timeout", "reset"][self.rng.below(6) as usize];
        let s = &mut self.streams[i];
        s.executed = true;
        let body = format!("exec {} of {} {}", self.executions, s.client_key, s.body).into_bytes();
        let key = s.store_key.clone().unwrap_or_default();
        let (status, details, completed) = match ending {
            "timeout" => ("504", "response_timeout", true),
            "reset" => ("503", "upstream_reset_before_response_started{connection_termination}", false),
            "500" => ("500", "via_upstream", false),
            status => (status, "via_upstream", true),
        };
        if completed && status != "504" {
            s.response = Some((pairs(&[(":status", status), ("content-type", "text/plain")]), body.clone()));
        } else {
            s.response =
                Some((pairs(&[(":status", status), ("content-type", "text/plain")]), b"envoy".to_vec()));
        }
        s.details = details;
        if completed {
            self.completing.push((i, key, body));
        }
        Ok(())
    }

    /// A stream runs its request: never for a key this VM left in doubt, unless it runs degraded
    /// (the store failed; the local fallback does not hold in-doubt keys).
    fn check_not_in_doubt(&mut self, i: usize) -> Result<(), String> {
        let s = &self.streams[i];
        let Some(key) = s.store_key.as_deref() else { return Ok(()) };
        if !self.doubt.contains_key(key) {
            return Ok(());
        }
        if self.outcomes.get(&s.id) == Some(&"degraded") {
            self.tally.degraded_in_doubt += 1;
            return Ok(());
        }
        self.violation(format!("stream {} ran key {} while it is in doubt", s.id, &key[..8]))
    }

    /// Carries out the coordinator's commands, as the host's loop does.
    fn commands(&mut self) -> Result<(), String> {
        while let Some(command) = self.coord.poll() {
            self.carry_out(command)?;
        }
        for i in std::mem::take(&mut self.ran_now) {
            self.check_not_in_doubt(i)?;
        }
        // The application keeps the first effect under a store key (a unique column), of the
        // executions that ran under the store's lock: one run degraded (the store failed) may be
        // for another body under the same key, which the store would have refused.
        for (i, key, body) in std::mem::take(&mut self.completing) {
            if self.outcomes.get(&self.streams[i].id) != Some(&"degraded") {
                self.completed.entry(key).or_insert(body);
            }
        }
        Ok(())
    }

    fn stream_index(&self, id: u32) -> Option<usize> {
        self.streams.iter().position(|s| s.id == id)
    }

    /// A command addressed to a stream: it must exist, not have ended, and be in the event's
    /// scope; `waits`: the command answers or resumes it.
    fn addressed(&self, id: u32, what: &str, waits: bool) -> Result<usize, String> {
        let Some(i) = self.stream_index(id) else {
            return self.violation(format!("{what} for unknown stream {id}"));
        };
        let s = &self.streams[i];
        if s.ended {
            return self.violation(format!("{what} for stream {id}, which ended"));
        }
        let waiting = !waits || s.phase == Phase::Waiting;
        let in_scope = match &self.scope {
            Scope::Own(own) => *own == id,
            Scope::Keys(keys) => waiting && s.store_key.as_ref().is_some_and(|k| keys.contains(k)),
            Scope::Any => waiting || self.callback == Callback::Stream(id),
        };
        if !in_scope {
            return self
                .violation(format!("{what} for stream {id} ({:?}) in scope {:?}", s.phase, self.scope));
        }
        Ok(i)
    }

    fn carry_out(&mut self, command: Command) -> Result<(), String> {
        match command {
            // This world sends no gRPC calls, and runs no replay listener.
            Command::Hop { stream, .. }
            | Command::AddResponseTrailers { stream, .. }
            | Command::RemoveResponseHeader { stream, .. } => {
                return self.violation(format!("a gRPC command for stream {stream}"));
            }
            Command::Respond { stream, response } => {
                let i = self.addressed(stream, "a local answer", true)?;
                let s = &self.streams[i];
                if s.answered || s.executed {
                    return self.violation(format!("a second answer for stream {stream}: {response:?}"));
                }
                let replay = response.headers.contains(&crate::request::replay::marker(&self.cfg));
                if replay {
                    let expected = format!("of {} {}", s.client_key, s.body);
                    let body = String::from_utf8_lossy(&response.body);
                    if !body.ends_with(&expected) && !body.ends_with(&format!("{expected} elsewhere")) {
                        return self.violation(format!("stream {stream} ({expected}) replayed {body:?}"));
                    }
                    self.tally.replays += 1;
                }
                if response
                    .headers
                    .iter()
                    .any(|(n, v)| n == "content-type" && v == "application/problem+json")
                {
                    let problem: Option<serde_json::Value> = serde_json::from_slice(&response.body).ok();
                    let instance = problem.as_ref().and_then(|p| p.get("instance")).and_then(|i| i.as_str());
                    if instance.is_none() || instance != self.instances.get(&stream).map(String::as_str) {
                        return self.violation(format!(
                            "stream {stream}'s problem has instance {instance:?}, its access log {:?}",
                            self.instances.get(&stream)
                        ));
                    }
                }
                if response.status == 503
                    && String::from_utf8_lossy(&response.body).contains("already processed")
                {
                    self.tally.withheld += 1;
                }
                self.last_own_answer = (self.callback == Callback::Stream(stream))
                    .then(|| (i, response.status, response.body.clone()));
                self.tally.local_answers += 1;
                self.trace.push(format!("  respond {stream}: {}", response.status));
                let mut headers = vec![(":status".to_string(), response.status.to_string().into_bytes())];
                headers.extend(response.headers.iter().map(|(n, v)| (n.clone(), v.clone().into_bytes())));
                let s = &mut self.streams[i];
                s.answered = true;
                s.response = Some((headers, response.body));
                s.phase = Phase::ResponseHeaders;
            }
            Command::Resume { stream } => {
                let i = self.addressed(stream, "a resume", true)?;
                let s = &self.streams[i];
                if s.answered || s.executed {
                    return self.violation(format!("a resume for stream {stream} in {:?}", s.phase));
                }
                self.trace.push(format!("  resume {stream}"));
                self.streams[i].phase = Phase::ResponseHeaders;
                self.execute_routed(i)?;
            }
            Command::SetResponseHeader { stream, .. } => {
                if self.callback != Callback::Stream(stream) {
                    return self
                        .violation(format!("a response header set outside stream {stream}'s callback"));
                }
            }
            Command::SetRequestHeader { stream, name, value } => {
                if self.callback != Callback::Stream(stream) {
                    return self
                        .violation(format!("a request header set outside stream {stream}'s callback"));
                }
                let i = self.addressed(stream, "a request header", false)?;
                if name == "x-store-key" {
                    self.streams[i].store_key = Some(value);
                }
            }
            Command::RemoveRequestHeader { stream, .. } => {
                if self.callback != Callback::Stream(stream) {
                    return self
                        .violation(format!("a request header removed outside stream {stream}'s callback"));
                }
            }
            Command::Instance { stream, instance } => {
                self.addressed(stream, "an instance", false)?;
                if !self.every_instance.insert(instance.clone()) {
                    return self.violation(format!("instance {instance} handed out twice"));
                }
                self.instances.insert(stream, instance);
            }
            Command::Outcome { stream, outcome } => {
                self.addressed(stream, "an outcome", false)?;
                self.outcomes.insert(stream, outcome);
            }
            Command::Count(Metric::CacheHits) => {
                let Some((i, status, body)) = self.last_own_answer.take() else {
                    return self.violation("a cache hit without a local answer".into());
                };
                self.check_cached(i, status, &body)?;
                self.tally.cache_hits += 1;
            }
            Command::Count(Metric::StoreSkipped) => self.tally.skipped_begins += 1,
            Command::Add { metric: Metric::HandBackDropped, n } => self.tally.hand_backs_dropped += n as u32,
            Command::Count(Metric::LocalLocks) => self.tally.local_locks += 1,
            Command::Count(Metric::LocalReplays) => self.tally.local_replays += 1,
            Command::Count(Metric::HandedBack) => self.tally.handed_back += 1,
            Command::Tick { period_ms } => self.tick_ms = period_ms,
            Command::Count(_)
            | Command::Add { .. }
            | Command::LocalRecords(_)
            | Command::StreamCalls(_)
            | Command::Latency { .. } => {}
            Command::Wake => {
                if self.callback == Callback::Root {
                    return self.violation("a wake-up asked from a root callback".into());
                }
                if self.rng.chance(self.fault_rate / 3) {
                    self.tally.wake_failures += 1;
                    self.trace.push("  wake failed".into());
                    self.scope = Scope::Any;
                    // The queued calls fail without leaving.
                    let queued: Vec<StoreCall> = self.coord.queued().cloned().collect();
                    for call in queued {
                        match call {
                            StoreCall::Commit { key, token, .. } => {
                                self.note_lock_end(true, &key, &token.to_string(), false)?
                            }
                            StoreCall::Release { key, token, .. } => {
                                self.note_lock_end(false, &key, &token.to_string(), false)?
                            }
                            StoreCall::Begin { .. } => {}
                        }
                    }
                    self.coord.on_wake_failed(&self.clock);
                } else {
                    self.queued_wakes += 1;
                }
            }
            Command::OpenStream { .. } => self.open_stream()?,
            Command::StreamSend { token, message } => self.stream_send(token, message)?,
            Command::CancelStream { token } => self.cancel_stream(token)?,
            Command::Dispatch(call) => {
                if self.callback != Callback::Root {
                    return self.violation(format!("a callout dispatched from a stream callback: {call:?}"));
                }
                let job = call.job;
                let token = if self.rng.chance(self.fault_rate / 3) {
                    self.tally.dispatch_failures += 1;
                    self.trace.push(format!("  dispatch failed: {}", describe(&call)));
                    self.note_end(&call, false)?;
                    if let Scope::Keys(keys) = &mut self.scope {
                        keys.extend(call_keys(&call));
                    }
                    None
                } else {
                    let token = self.next_token;
                    self.next_token += 1;
                    self.trace.push(format!("  dispatch {token}: {}", describe(&call)));
                    self.in_flight.push(InFlight { token, call });
                    Some(token)
                };
                self.coord.on_dispatched(job, token, &self.clock);
            }
        }
        Ok(())
    }

    /// An answer given in the stream's own callback, without a store call, came from the record
    /// cache: the store must hold that very record, live.
    fn check_cached(&self, i: usize, status: u32, body: &[u8]) -> Result<(), String> {
        let s = &self.streams[i];
        let Some(key) = &s.store_key else { return Ok(()) };
        let now = self.clock.0.get();
        match self.store.get(key) {
            Some(Stored::Record { bytes, expires_us, .. }) if *expires_us > now => {
                if status != 422 && Record::decode(bytes).map(|r| r.body).ok().as_deref() != Some(body) {
                    return self.violation(format!(
                        "stream {} served a cached answer the store does not hold",
                        s.id
                    ));
                }
                Ok(())
            }
            _ => self
                .violation(format!("stream {} served from the cache a record the store no longer has", s.id)),
        }
    }
}
