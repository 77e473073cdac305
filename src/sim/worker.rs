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
//! Test support only (unit tests and `fuzz/`); the filter never uses it. No proxy-wasm here.

use std::cell::Cell;
use std::collections::HashMap;
use std::rc::Rc;

use idem_protocol as proto;
use idem_protocol::CommitOutcome;

use crate::config::Config;
use crate::request::machine::Action;
use crate::request::metrics::Metric;
use crate::sim::memory::MemoryData;
use crate::sim::request::MockView;
use crate::store::client::StoreCall;
use crate::store::record::Record;
use crate::worker::command::{Command, Dispatch};
use crate::worker::coordinator::{Coordinator, Stepped};
use crate::worker::env::Clock;
use crate::worker::env::SharedData;

/// Configurations a run picks from (each with `store_key_header`, through which the simulation
/// learns every stream's store key).
pub const CONFIGS: [&str; 4] = [
    r#"{"store_cluster":"idemstore","store_key_header":"x-store-key","local_record_entries":256,"retention_seconds":3,"store_timeout_ms":300,"lock_wait_ms":200}"#,
    r#"{"store_cluster":"idemstore","store_key_header":"x-store-key","local_record_entries":256,"retention_seconds":2,"failure_mode":"closed"}"#,
    r#"{"store_cluster":"idemstore","store_key_header":"x-store-key","local_record_entries":256,"retention_seconds":1,"detached_execution":true,"lock_wait_ms":0}"#,
    r#"{"store_cluster":"idemstore","store_key_header":"x-store-key","local_record_entries":256,"retention_seconds":4,"record_cache_entries":0,"breaker_failures":1,"breaker_open_ms":300}"#,
];

const CLIENT_KEYS: [&str; 3] = ["order-1", "order-2", "order-3"];
const BODIES: [&str; 2] = ["{\"qty\":1}", "{\"qty\":2}"];

/// How often each path was taken, summed over runs: to check that a sample reaches them all.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    pub streams: u32,
    pub executions: u32,
    pub replays: u32,
    pub cache_hits: u32,
    pub local_answers: u32,
    pub locks: u32,
    pub commits: u32,
    /// `commits` callouts answered (first tries of commits held while one was in flight).
    pub batches: u32,
    pub releases: u32,
    pub faults: u32,
    pub dispatch_failures: u32,
    pub wake_failures: u32,
    pub ended_early: u32,
    pub answers_after_end: u32,
    pub expired_records: u32,
    pub expired_begins: u32,
    pub skipped_begins: u32,
    pub local_locks: u32,
    pub local_replays: u32,
    pub handed_back: u32,
    pub hand_backs_dropped: u32,
    pub other_replica_records: u32,
    /// Records whose commit failed, kept locally and handed back under their store lock.
    pub kept_handed_back: u32,
    /// Retries answered `503` from a marker of a record this Envoy sent the store.
    pub withheld: u32,
}

impl Tally {
    pub fn add(&mut self, o: &Tally) {
        let pairs = [
            (&mut self.streams, o.streams),
            (&mut self.executions, o.executions),
            (&mut self.replays, o.replays),
            (&mut self.cache_hits, o.cache_hits),
            (&mut self.local_answers, o.local_answers),
            (&mut self.locks, o.locks),
            (&mut self.commits, o.commits),
            (&mut self.batches, o.batches),
            (&mut self.releases, o.releases),
            (&mut self.faults, o.faults),
            (&mut self.dispatch_failures, o.dispatch_failures),
            (&mut self.wake_failures, o.wake_failures),
            (&mut self.ended_early, o.ended_early),
            (&mut self.answers_after_end, o.answers_after_end),
            (&mut self.expired_records, o.expired_records),
            (&mut self.expired_begins, o.expired_begins),
            (&mut self.skipped_begins, o.skipped_begins),
            (&mut self.local_locks, o.local_locks),
            (&mut self.local_replays, o.local_replays),
            (&mut self.handed_back, o.handed_back),
            (&mut self.other_replica_records, o.other_replica_records),
            (&mut self.kept_handed_back, o.kept_handed_back),
            (&mut self.withheld, o.withheld),
        ];
        for (sum, n) in pairs {
            *sum += n;
        }
    }

    /// Every counted path was taken at least `n` times.
    pub fn all_at_least(&self, n: u32) -> bool {
        [
            self.streams,
            self.executions,
            self.replays,
            self.cache_hits,
            self.local_answers,
            self.locks,
            self.commits,
            self.releases,
            self.faults,
            self.dispatch_failures,
            self.wake_failures,
            self.ended_early,
            self.answers_after_end,
            self.expired_records,
            self.expired_begins,
            self.skipped_begins,
            self.local_locks,
            self.local_replays,
            self.handed_back,
            self.other_replica_records,
            self.withheld,
        ]
        .iter()
        .all(|&v| v >= n)
    }
}

/// The run's choices: from a fuzzer's input while it lasts, then from xorshift64 (small, seeded,
/// the same everywhere).
pub struct Rng {
    state: u64,
    input: Vec<u8>,
    at: usize,
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng { state: seed | 1, input: Vec::new(), at: 0 }
    }

    /// Choices read from `input`, two bytes each, so that a fuzzer steers the run.
    pub fn from_input(input: &[u8]) -> Rng {
        let seed = input
            .iter()
            .fold(0x9e37_79b9_7f4a_7c15_u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        Rng { state: seed | 1, input: input.to_vec(), at: 0 }
    }

    pub fn below(&mut self, n: u64) -> u64 {
        if let Some(pair) = self.input.get(self.at..self.at + 2) {
            self.at += 2;
            return u64::from(u16::from_le_bytes([pair[0], pair[1]])) % n.max(1);
        }
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        self.state % n.max(1)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// A simulated host environment: a clock the caller sets (microseconds since the epoch) and the
/// process's shared data in memory. Also the coordinator's unit tests' host.
pub struct SimEnv(pub Cell<u64>, pub MemoryData);

impl SimEnv {
    pub fn at(now_us: u64) -> SimEnv {
        SimEnv(Cell::new(now_us), MemoryData::default())
    }
}

impl Clock for SimEnv {
    fn now_us(&self) -> Option<u64> {
        Some(self.0.get())
    }
}

impl SharedData for SimEnv {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.1.get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> bool {
        self.1.set(key, value, cas)
    }
}

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
    /// The response the upstream (or the filter's local answer) gives.
    response: Option<Message>,
}

enum Stored {
    Lock { token: String, expires_us: u64 },
    Record { body_hash: String, bytes: Vec<u8>, expires_us: u64 },
}

/// A lock the filter learned it holds, and what it did with it.
struct Granted {
    key: String,
    /// Commit or release calls that named it: `true` if the filter got their answer.
    ends: Vec<(bool, bool)>,
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
    next_token: u32,
    store: HashMap<String, Stored>,
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

/// The commits of a `commits` callout: key, token, body hash, record.
type Item = (String, String, String, Vec<u8>);

fn batch_items(call: &Dispatch) -> Vec<Item> {
    if header(&call.headers, ":path") != Some(proto::PATH_COMMITS) {
        return vec![];
    }
    let body = call.body.as_deref().unwrap_or_default();
    proto::decode_batch(body)
        .map(|items| {
            items
                .into_iter()
                .map(|i| (i.key.into(), i.token.into(), i.body_hash.into(), body[i.record].to_vec()))
                .collect()
        })
        .unwrap_or_default()
}

/// Every store key a callout concerns.
fn call_keys(call: &Dispatch) -> Vec<String> {
    match batch_items(call) {
        items if !items.is_empty() => items.into_iter().map(|(key, ..)| key).collect(),
        _ => vec![call_key(call).to_string()],
    }
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
    list.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect()
}

impl World {
    pub fn new(mut rng: Rng) -> World {
        let json = CONFIGS[rng.below(CONFIGS.len() as u64) as usize];
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
            next_token: 1,
            store: HashMap::new(),
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
        let local = crate::worker::local_store::LocalStore::new(
            self.cfg.local_record_entries,
            self.cfg.local_record_bytes,
            self.cfg.lock_ttl_ms,
            self.cfg.retention_seconds * 1000,
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
            } else if !self.in_flight.is_empty() {
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
        view.req("x-request-id", &format!("req-{id}")).prop("xds.cluster_name", "app");
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
                self.after_request_step(i, stepped, false);
            }
            Phase::RequestBody => {
                let len = self.streams[i].view.request_body.len();
                let stepped = self.step(i, |c, v, clock| {
                    c.on_stream_event(id, v, clock, |s, v| s.on_request_body(v, len, true))
                })?;
                self.after_request_step(i, stepped, true);
            }
            Phase::Waiting => {}
            Phase::ResponseHeaders => {
                let (headers, _) = self.streams[i].response.clone().unwrap_or_default();
                self.streams[i].view.response = headers;
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
    fn after_request_step(&mut self, i: usize, stepped: Option<Stepped>, last: bool) {
        let s = &mut self.streams[i];
        if let Some(st) = stepped {
            s.passive = st.done;
        }
        if s.answered || s.executed {
            return;
        }
        let paused = stepped.is_some_and(|st| st.action == Action::Pause);
        s.phase = match (last, paused) {
            (false, _) => Phase::RequestBody,
            (true, true) => Phase::Waiting,
            (true, false) => Phase::ResponseHeaders,
        };
        if s.phase == Phase::ResponseHeaders {
            self.execute_routed(i);
        }
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
        self.coord.on_stream_done(id, &self.clock);
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
        self.scope = Scope::Keys(vec![]);
        self.coord.on_queue_ready(&self.clock);
        self.commands()
    }

    /// The routed upstream runs the request: its answer names the request it ran.
    fn execute_routed(&mut self, i: usize) {
        self.executions += 1;
        self.tally.executions += 1;
        // Mostly kept; a 500 is not, and its lock is released.
        let status = ["201", "200", "201", "500"][self.rng.below(4) as usize];
        let s = &mut self.streams[i];
        s.executed = true;
        let body = format!("exec {} of {} {}", self.executions, s.client_key, s.body).into_bytes();
        s.response = Some((pairs(&[(":status", status), ("content-type", "text/plain")]), body));
    }

    /// Carries out the coordinator's commands, as the host's loop does.
    fn commands(&mut self) -> Result<(), String> {
        while let Some(command) = self.coord.poll() {
            self.carry_out(command)?;
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
            Command::Respond { stream, response } => {
                let i = self.addressed(stream, "a local answer", true)?;
                let s = &self.streams[i];
                if s.answered || s.executed {
                    return self.violation(format!("a second answer for stream {stream}: {response:?}"));
                }
                let replay = response.headers.iter().any(|(n, v)| n == "x-idempotent-replay" && v == "true");
                if replay {
                    let expected = format!("of {} {}", s.client_key, s.body);
                    let body = String::from_utf8_lossy(&response.body);
                    if !body.ends_with(&expected) && !body.ends_with(&format!("{expected} elsewhere")) {
                        return self.violation(format!("stream {stream} ({expected}) replayed {body:?}"));
                    }
                    self.tally.replays += 1;
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
                self.execute_routed(i);
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
            Command::Outcome { stream, .. } => {
                self.addressed(stream, "an outcome", false)?;
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
            Command::Count(_) | Command::Add { .. } | Command::LocalRecords(_) | Command::Latency { .. } => {}
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
                            StoreCall::Release { key, token } => {
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

    /// Answers one callout in flight, chosen at random, sometimes with a fault.
    fn answer_one(&mut self) -> Result<(), String> {
        if self.in_flight.is_empty() {
            return Ok(());
        }
        let InFlight { token, call } =
            self.in_flight.swap_remove(self.rng.below(self.in_flight.len() as u64) as usize);
        // 0: processed, answered; 1: not processed, reset; 2: processed, answer timed out;
        // 3: processed, garbage answer.
        let fault = if self.rng.chance(self.fault_rate) { 1 + self.rng.below(3) } else { 0 };
        if fault > 0 {
            self.tally.faults += 1;
        }
        let items = batch_items(&call);
        if !items.is_empty() {
            return self.answer_batch(token, items, fault);
        }
        self.note_end(&call, fault == 0)?;
        let key = call_key(&call).to_string();
        let (headers, body) = if call.cluster == self.cfg.store_cluster {
            let (headers, body) =
                if fault == 1 { (vec![], vec![]) } else { self.store_answers(&call, fault == 0)? };
            match fault {
                2 => (pairs(&[(":status", "504")]), vec![]),
                3 => (pairs(&[(":status", "200")]), vec![]),
                _ => (headers, body),
            }
        } else {
            match fault {
                0 | 3 => self.execute_detached(&call),
                1 => (vec![], vec![]),
                _ => {
                    self.execute_detached(&call);
                    (pairs(&[(":status", "504")]), vec![])
                }
            }
        };
        self.trace.push(format!("answer {token} (fault {fault})"));
        if self.streams.iter().any(|s| s.ended && s.store_key.as_deref() == Some(&key)) {
            self.tally.answers_after_end += 1;
        }
        self.callback = Callback::Root;
        self.scope = Scope::Keys(vec![key]);
        self.coord.on_callout_answer(token, headers, body, &self.clock);
        self.commands()
    }

    /// Answers a `commits` callout: each commit as idemstore would, one now and then not done
    /// (`failed`), or the whole call faulted.
    fn answer_batch(&mut self, token: u32, items: Vec<Item>, fault: u64) -> Result<(), String> {
        let mut outcomes = Vec::new();
        for (key, lock, body_hash, record) in &items {
            // Not done: neither processed nor a lock ended (the filter tries it again).
            let failed = fault == 1 || fault == 0 && self.rng.chance(self.fault_rate);
            self.note_lock_end(true, key, lock, fault == 0 && !failed)?;
            if failed {
                outcomes.push(None);
                continue;
            }
            let retention_us = self.cfg.retention_seconds * 1_000_000;
            outcomes.push(Some(self.commit_one(key, lock, body_hash, record.clone(), retention_us)));
        }
        let (headers, body) = match fault {
            0 => (pairs(&[(":status", "200"), (proto::HEADER_OUTCOME, proto::BATCH_OUTCOME)]), {
                proto::encode_batch_answer(&outcomes)
            }),
            1 => (vec![], vec![]),
            2 => (pairs(&[(":status", "504")]), vec![]),
            _ => (pairs(&[(":status", "200")]), vec![]),
        };
        self.tally.batches += 1;
        self.trace.push(format!("answer {token} (fault {fault}): {} commits", items.len()));
        self.callback = Callback::Root;
        self.scope = Scope::Keys(items.into_iter().map(|(key, ..)| key).collect());
        self.coord.on_callout_answer(token, headers, body, &self.clock);
        self.commands()
    }

    /// Another Envoy (no shared data with this one) runs a key some stream here also sends and
    /// stores its record first, as if its store calls had all worked: this VM's local record of
    /// the key, if any, then races it back to the store (`exists`), and replays here must carry
    /// one of the key's executions.
    fn other_replica_runs(&mut self) {
        let Some(i) = self.pick(|s| s.store_key.is_some()) else { return };
        let (key, client_key, body) = {
            let s = &self.streams[i];
            (s.store_key.clone().unwrap_or_default(), s.client_key, s.body)
        };
        let now = self.clock.0.get();
        if self.store.get(&key).is_some_and(|st| match st {
            Stored::Lock { expires_us, .. } | Stored::Record { expires_us, .. } => *expires_us > now,
        }) {
            return;
        }
        self.executions += 1;
        self.tally.executions += 1;
        let print = crate::store::record::RequestPrint::of(b"POST", b"/orders?x=1", &[], &|_| vec![]);
        let record = Record {
            status: 201,
            headers: vec![("content-type".into(), "text/plain".into())],
            body: format!("exec {} of {client_key} {body} elsewhere", self.executions).into_bytes(),
            body_omitted: false,
            print: Some(print),
        };
        let body_hash = crate::request::key::hex(&sha2::Digest::finalize(
            <sha2::Sha256 as sha2::Digest>::new_with_prefix(body),
        ));
        let retention_us = self.cfg.retention_seconds * 1_000_000;
        self.store.insert(
            key,
            Stored::Record { body_hash, bytes: record.encode(), expires_us: now + retention_us },
        );
        self.tally.other_replica_records += 1;
        self.trace.push(format!("another replica stored {client_key} {body}"));
    }

    /// The detached call reaches the upstream, which runs it.
    fn execute_detached(&mut self, call: &Dispatch) -> Message {
        self.executions += 1;
        self.tally.executions += 1;
        let body = call.body.clone().unwrap_or_default();
        let key = header(&call.headers, "idempotency-key").unwrap_or_default();
        let text = format!("exec {} of {} {}", self.executions, key, String::from_utf8_lossy(&body));
        (pairs(&[(":status", "201"), ("content-type", "text/plain")]), text.into_bytes())
    }

    /// A commit or release the filter sent (or tried to): it must name a lock the filter was
    /// granted, for its key, not yet ended. `answered`: the filter reads the store's answer.
    fn note_end(&mut self, call: &Dispatch, answered: bool) -> Result<(), String> {
        for (key, token, ..) in batch_items(call) {
            self.note_lock_end(true, &key, &token, answered)?;
        }
        let path = header(&call.headers, ":path").unwrap_or_default();
        let token = header(&call.headers, proto::HEADER_TOKEN).unwrap_or_default();
        let ends = match path {
            proto::PATH_COMMIT => Some(true),
            proto::PATH_RELEASE => Some(false),
            _ => None,
        };
        match ends {
            Some(commit) if call.cluster == self.cfg.store_cluster => {
                self.note_lock_end(commit, call_key(call), token, answered)
            }
            _ => Ok(()),
        }
    }

    fn note_lock_end(&mut self, commit: bool, key: &str, token: &str, answered: bool) -> Result<(), String> {
        if commit && token == crate::worker::fallback::HAND_BACK_TOKEN {
            // A local record handed back: it ends no lock of the store's.
            return Ok(());
        }
        match self.granted.get_mut(token) {
            Some(g) if g.key == key && !g.ends.iter().any(|&(_, answered)| answered) => {
                if commit && answered && g.ends.len() >= 2 && g.ends.iter().all(|&(c, _)| c) {
                    self.tally.kept_handed_back += 1;
                }
                g.ends.push((commit, answered));
                Ok(())
            }
            Some(g) => {
                let what =
                    format!("commit or release of lock {token} ({}) for key {key}: ends {:?}", g.key, g.ends);
                self.violation(what)
            }
            None => self.violation(format!("commit or release of a lock never granted: {token}")),
        }
    }

    /// What idemstore does with one commit (the lock ends whoever holds it).
    fn commit_one(
        &mut self,
        key: &str,
        token: &str,
        body_hash: &str,
        bytes: Vec<u8>,
        retention_us: u64,
    ) -> CommitOutcome {
        let now = self.clock.0.get();
        self.expire(key);
        let owned = matches!(self.store.get(key), Some(Stored::Lock { token: t, .. }) if *t == token);
        if matches!(self.store.get(key), Some(Stored::Record { .. })) {
            return CommitOutcome::Exists;
        }
        let stored =
            Stored::Record { body_hash: body_hash.to_string(), bytes, expires_us: now + retention_us };
        self.store.insert(key.to_string(), stored);
        self.tally.commits += 1;
        if owned {
            CommitOutcome::Stored
        } else {
            CommitOutcome::Late
        }
    }

    /// Forgets what the store holds for `key` if it has expired.
    fn expire(&mut self, key: &str) {
        let now = self.clock.0.get();
        let live = match self.store.get(key) {
            Some(Stored::Lock { expires_us, .. } | Stored::Record { expires_us, .. }) => *expires_us > now,
            None => return,
        };
        if !live {
            if matches!(self.store.get(key), Some(Stored::Record { .. })) {
                self.tally.expired_records += 1;
            }
            self.store.remove(key);
        }
    }

    /// What idemstore does with a call, and its answer. `delivered`: the filter will read the
    /// answer (a lock it grants is then the filter's to end).
    fn store_answers(&mut self, call: &Dispatch, delivered: bool) -> Result<Message, String> {
        let now = self.clock.0.get();
        let h = |name| header(&call.headers, name).unwrap_or_default().to_string();
        let key = h(proto::HEADER_KEY);
        self.expire(&key);
        let outcome = |o: &str| vec![(":status", "200".to_string()), (proto::HEADER_OUTCOME, o.to_string())];
        let late =
            h(proto::HEADER_DEADLINE_MS).parse::<u64>().is_ok_and(|deadline_ms| now / 1000 >= deadline_ms);
        let (headers, body) = match h(":path").as_str() {
            // Past the deadline the filter gave it: no lookup, no lock.
            proto::PATH_BEGIN if late => {
                self.tally.expired_begins += 1;
                (outcome("expired"), vec![])
            }
            proto::PATH_BEGIN => match self.store.get(&key) {
                Some(Stored::Record { body_hash, bytes, expires_us })
                    if *body_hash == h(proto::HEADER_BODY_HASH) =>
                {
                    let mut headers = outcome("record");
                    headers.push((proto::HEADER_TTL_MS, ((expires_us - now) / 1000).to_string()));
                    (headers, bytes.clone())
                }
                Some(Stored::Record { .. }) => (outcome("mismatch"), vec![]),
                Some(Stored::Lock { .. }) => (outcome("busy"), vec![]),
                None => {
                    self.next_lock += 1;
                    let token = format!("tok{}", self.next_lock);
                    let ttl_us = h(proto::HEADER_LOCK_TTL_MS).parse::<u64>().unwrap_or(0) * 1000;
                    self.store
                        .insert(key.clone(), Stored::Lock { token: token.clone(), expires_us: now + ttl_us });
                    if delivered {
                        self.tally.locks += 1;
                        self.granted.insert(token.clone(), Granted { key: key.clone(), ends: vec![] });
                    }
                    let mut headers = outcome("locked");
                    headers.push((proto::HEADER_TOKEN, token));
                    (headers, vec![])
                }
            },
            path @ (proto::PATH_COMMIT | proto::PATH_RELEASE) => {
                let commit = path == proto::PATH_COMMIT;
                let token = h(proto::HEADER_TOKEN);
                let owned =
                    matches!(self.store.get(&key), Some(Stored::Lock { token: t, .. }) if *t == token);
                if !commit {
                    if owned {
                        self.store.remove(&key);
                        self.tally.releases += 1;
                    }
                    (outcome(if owned { "released" } else { "not-owner" }), vec![])
                } else {
                    let retention_us = h(proto::HEADER_RETENTION_S).parse::<u64>().unwrap_or(0) * 1_000_000;
                    let bytes = call.body.clone().unwrap_or_default();
                    let done =
                        self.commit_one(&key, &token, &h(proto::HEADER_BODY_HASH), bytes, retention_us);
                    (outcome(done.as_str()), vec![])
                }
            }
            other => return self.violation(format!("a store call to {other}")),
        };
        Ok((headers.into_iter().map(|(n, v)| (n.to_string(), v.into_bytes())).collect(), body))
    }
}

/// The store key a callout concerns: the store's key header, or the one a detached call carries.
fn call_key(call: &Dispatch) -> &str {
    header(&call.headers, proto::HEADER_KEY).or(header(&call.headers, "x-store-key")).unwrap_or_default()
}

fn describe(call: &Dispatch) -> String {
    let path = header(&call.headers, ":path").unwrap_or("?");
    let key = call_key(call);
    format!("{} {path} key {}", call.cluster, key.get(..8).unwrap_or(key))
}
