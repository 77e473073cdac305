//! The per-VM coordinator: the streams of one worker, the callouts they started, and the record
//! cache. Envoy events go in (a stream callback, a queue wake-up, a dispatched callout, its
//! answer, the end of a stream); [`Command`]s come out, which the host carries out in order
//! ([`Coordinator::poll`]) and nothing else. No proxy-wasm here: `coordinator_sim` drives it
//! through random interleavings of many streams.
//!
//! Callouts are owned by the root context, not by the stream: Envoy cancels a stream's pending
//! callouts when the stream ends, and a `begin` that took the lock, or a `commit` sent after the
//! response went out, must not be lost with it. A stream callback therefore puts its call in the
//! outbox and asks for a wake-up ([`Command::Wake`], a per-worker shared queue); the root's
//! callback dispatches it ([`Command::Dispatch`]), so Envoy registers the callout under the root.
//! The answer is fed to the stream's machine if the stream is still known, and a stream Envoy has
//! destroyed is remembered until nothing of it is pending.
//!
//! Failures end in the machine like answers do: a callout that could not be dispatched, or a
//! wake-up that could not be sent, is a [`CalloutFault::Dispatch`], so no request stays paused.

use std::collections::{HashMap, VecDeque};
use std::rc::Rc;

use idem_protocol::CommitOutcome;

use crate::worker::breaker::{Breaker, Gate};
use crate::config::Config;
use crate::request::detached::{UpstreamAnswer, UpstreamCall};
use crate::worker::fallback::{self, Fallback, Outcome, HAND_BACK_TOKEN};
use crate::worker::local_store::SharedData;
use crate::request::machine::{Action, Effect, Step, Stream, StreamView};
use crate::request::metrics::Metric;
use crate::request::problem::LocalResponse;
use crate::worker::record_cache::{Cached, Recent};
use crate::store::record::Record;
use crate::store::client::{self, Answer, BeginAnswer, CallKind, CalloutFault, StoreCall};

/// The host's clock, read only when a decision needs it.
pub trait Clock {
    /// Microseconds since the Unix epoch, if the host can tell.
    fn now_us(&self) -> Option<u64>;
}

/// What the coordinator reads from the host besides its events: the clock, and the shared data
/// every worker of the process sees (the local fallback, see `local`).
pub trait Env: Clock + SharedData {}

impl<T: Clock + SharedData + ?Sized> Env for T {}

/// What the host does, in the order [`Coordinator::poll`] returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Answer the client instead of the upstream. On failure, tell
    /// [`Coordinator::on_respond_failed`].
    Respond {
        stream: u32,
        response: LocalResponse,
    },
    /// Let the paused request go on to the upstream.
    Resume {
        stream: u32,
    },
    /// Only in the stream's own request-header callback.
    SetRequestHeader {
        stream: u32,
        name: String,
        value: String,
    },
    RemoveRequestHeader {
        stream: u32,
        name: String,
    },
    /// Set the filter state the access log reads (`metrics::OUTCOME_PROPERTY`).
    Outcome {
        stream: u32,
        outcome: &'static str,
    },
    Count(Metric),
    /// Add `n` to a counter.
    Add {
        metric: Metric,
        n: u64,
    },
    /// Set the gauge of local records (`metrics::LOCAL_RECORDS`).
    LocalRecords(u64),
    /// Call [`Coordinator::on_tick`] every this many milliseconds (0: stop).
    Tick {
        period_ms: u64,
    },
    /// A store call's latency, for its histogram.
    Latency {
        kind: CallKind,
        micros: u64,
    },
    /// Enqueue on the worker's shared queue, so that the root's [`Coordinator::on_queue_ready`]
    /// runs; on failure, tell [`Coordinator::on_wake_failed`]. Only in stream callbacks.
    Wake,
    /// Send a callout from the root context and tell [`Coordinator::on_dispatched`] its token.
    Dispatch(Dispatch),
}

/// A callout to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dispatch {
    pub job: u64,
    pub cluster: String,
    /// Pseudo-headers first.
    pub headers: Vec<(String, String)>,
    pub body: Option<Vec<u8>>,
    pub timeout_ms: u64,
}

/// What a stream callback returns to Envoy, and whether the stream's later callbacks can skip
/// the coordinator (the machine is done with it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stepped {
    pub action: Action,
    pub done: bool,
}

/// Which kind of callback an event came in: Envoy's rules for callouts differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Callback {
    Stream,
    Root,
}

struct StreamEntry {
    stream: Stream,
    /// For log lines: Envoy's `x-request-id`, cleaned (see [`request_id`]); read only for
    /// guarded requests (or at debug level), not on the pass-through path.
    request_id: Option<Rc<str>>,
    /// For log lines: the store key's prefix, kept once derived (the machine drops its key when
    /// it is done, before the effects that follow are logged).
    key_prefix: Option<String>,
    /// Envoy has destroyed the stream; the entry lives on only until its pending call (a
    /// `begin`, or a detached execution) answers.
    gone: bool,
}

/// A callout on behalf of a stream (which may be gone by the time it answers).
struct Job {
    stream: u32,
    request_id: Rc<str>,
    call: Call,
    /// 0 for the first try; see [`StoreCall::after_fault`].
    attempt: u32,
    /// When the callout was handed to the host, for the latency histograms and the cache.
    sent_us: Option<u64>,
    /// A local record's commit, handed back to the store (no stream).
    hand_back: bool,
}

enum Call {
    Store(StoreCall),
    /// First tries of commits held while another commit was in flight, sent as one `commits`.
    Batch(Vec<Job>),
    /// Detached execution: the request itself, to the route's cluster.
    Upstream(UpstreamCall),
}

impl Job {
    /// For log lines: the request id, and the store key's prefix or the cluster of a detached
    /// call. Never the client's key: only its derived store key is known past the headers.
    fn label(&self) -> String {
        match &self.call {
            Call::Store(c) => {
                format!("request {} key {}: store {:?}", self.request_id, prefix(c.key()), c.kind())
            }
            Call::Batch(items) => format!("store commits of {} requests", items.len()),
            Call::Upstream(c) => format!("request {}: detached call to {}", self.request_id, c.cluster),
        }
    }

    /// A commit's first try: it may wait for the commit in flight and go with others.
    fn batchable(&self) -> bool {
        matches!(self.call, Call::Store(StoreCall::Commit { .. })) && self.attempt == 0 && !self.hand_back
    }

    /// A callout that counts as the worker's commit in flight.
    fn commit_flight(&self) -> bool {
        self.batchable() || matches!(self.call, Call::Batch(_))
    }
}

enum Answered {
    Begin(Result<BeginAnswer, CalloutFault>),
    Commit(Result<CommitOutcome, CalloutFault>),
    Release(Result<(), CalloutFault>),
    Upstream(Result<UpstreamAnswer, CalloutFault>),
}

impl Answered {
    fn fault(call: &Call, f: CalloutFault) -> Answered {
        match call {
            Call::Store(c) => match c.kind() {
                CallKind::Begin => Answered::Begin(Err(f)),
                CallKind::Commit => Answered::Commit(Err(f)),
                CallKind::Release => Answered::Release(Err(f)),
            },
            Call::Batch(_) => Answered::Commit(Err(f)),
            Call::Upstream(_) => Answered::Upstream(Err(f)),
        }
    }

    fn store_fault(&self) -> Option<CalloutFault> {
        match self {
            Answered::Begin(Err(f)) | Answered::Commit(Err(f)) | Answered::Release(Err(f)) => Some(*f),
            _ => None,
        }
    }
}

pub struct Coordinator {
    cfg: Rc<Config>,
    streams: HashMap<u32, StreamEntry>,
    /// Calls from stream callbacks, waiting for the root's wake-up.
    outbox: Vec<Job>,
    wake_pending: bool,
    /// Handed to the host in a [`Command::Dispatch`], token not yet known.
    dispatching: HashMap<u64, Job>,
    next_job: u64,
    /// In flight, by the token Envoy gave the callout.
    callouts: HashMap<u32, Job>,
    /// Commit callouts in flight; while there is one, new commits are held and then go
    /// together: the store sees one call for many commits under load, and none waits when idle.
    commit_flights: usize,
    held: Vec<Job>,
    /// Off once the store answered a batch `404`/`405`: an idemstore older than `commits` (a
    /// rolling upgrade) gets every commit alone, as before, instead of a failed batch each time.
    batching: bool,
    /// Records recently replayed by this VM, to answer their retries without a store call.
    recent: Recent,
    /// Skips `begin`s while the store fails.
    breaker: Breaker,
    /// The local lock and records, while the store fails (`local_fallback`).
    fallback: Option<Fallback>,
    /// The root's tick period asked for last.
    tick_ms: u64,
    /// The content type a local answer must have where Envoy changes it (it drops one from an
    /// answer without a body, and labels a body without one `text/plain`), by stream: set (or
    /// removed, `None`) when the answer passes this filter's response callback.
    restore: HashMap<u32, Option<String>>,
    commands: VecDeque<Command>,
    callback: Callback,
}

impl Coordinator {
    pub fn new(cfg: Rc<Config>) -> Coordinator {
        let recent = Recent::new(cfg.record_cache_entries, cfg.record_cache_bytes);
        let breaker = Breaker::new(cfg.breaker_failures, cfg.breaker_open_ms);
        let fallback = Fallback::new(&cfg);
        Coordinator {
            cfg,
            streams: HashMap::new(),
            outbox: Vec::new(),
            wake_pending: false,
            dispatching: HashMap::new(),
            next_job: 0,
            callouts: HashMap::new(),
            commit_flights: 0,
            held: Vec::new(),
            batching: true,
            recent,
            breaker,
            fallback,
            tick_ms: 0,
            restore: HashMap::new(),
            commands: VecDeque::new(),
            callback: Callback::Stream,
        }
    }

    /// Prepares the shared data of the local fallback, before any request; `seed` is random
    /// per VM. Without it (the host refused) there is no local fallback.
    pub fn set_up(&mut self, env: &dyn Env, seed: u64) {
        self.callback = Callback::Root;
        if let Some(f) = &mut self.fallback {
            if !f.set_up(env, seed) {
                log::warn!("cannot set up the shared data: no local fallback while the store fails");
                self.fallback = None;
            }
        }
        self.retick();
    }

    /// The root's tick: waiters for a local lock look again, local records are handed back.
    pub fn on_tick(&mut self, env: &dyn Env) {
        self.callback = Callback::Root;
        let Some(now_ms) = env.now_us().map(|us| us / 1000) else { return };
        let Some(scan_due) = self.fallback.as_ref().map(|f| f.scan_due(now_ms)) else { return };
        // With the breaker open, a scan due once its interval is over is the probe (no request
        // may come to probe it).
        let scan = self.breaker.is_closed() || scan_due && !self.skips_begin(env);
        let Some(f) = &mut self.fallback else { return };
        let streams = &self.streams;
        let due = f.due(env, now_ms, |id| streams.get(&id).is_none_or(|e| e.gone));
        let (hand_backs, records) = if scan { f.hand_backs(env, now_ms) } else { (vec![], None) };
        for (stream, outcome) in due {
            let (effects, alive) = self.local_outcome(stream, outcome);
            self.apply(stream, effects, alive, env);
        }
        if let Some(n) = records {
            self.commands.push_back(Command::LocalRecords(n as u64));
        }
        for h in hand_backs {
            // Under the store's lock it was made under, if any: the commit ends that lock too.
            let token = if h.token.is_empty() { HAND_BACK_TOKEN.to_string() } else { h.token };
            let call = StoreCall::Commit { key: h.key, token, body_hash: h.body_hash, record: h.record };
            let job = Job {
                stream: 0,
                request_id: Rc::from("-"),
                call: Call::Store(call),
                attempt: 0,
                sent_us: None,
                hand_back: true,
            };
            self.submit(job, env);
        }
        self.retick();
    }

    /// Local records may wait to be handed back (known after the last scan).
    pub fn hand_backs_due(&self) -> bool {
        self.fallback.as_ref().is_some_and(Fallback::hand_back_due)
    }

    /// Asks for the tick the local fallback needs now, if it changed.
    fn retick(&mut self) {
        let period_ms = self.fallback.as_ref().map_or(0, Fallback::tick_ms);
        if period_ms != self.tick_ms {
            self.tick_ms = period_ms;
            self.commands.push_back(Command::Tick { period_ms });
        }
    }

    /// The next thing for the host to do.
    pub fn poll(&mut self) -> Option<Command> {
        self.commands.pop_front()
    }

    /// Streams the coordinator still holds (guarded and not finished, or gone with a call
    /// pending), and callouts not yet answered: for tests.
    pub fn pending(&self) -> (usize, usize) {
        (
            self.streams.len(),
            self.outbox.len() + self.held.len() + self.dispatching.len() + self.callouts.len(),
        )
    }

    /// The store calls waiting for a wake-up: what [`Coordinator::on_wake_failed`] would fail.
    pub fn queued(&self) -> impl Iterator<Item = &StoreCall> {
        self.outbox.iter().filter_map(|job| match &job.call {
            Call::Store(call) => Some(call),
            Call::Batch(_) | Call::Upstream(_) => None,
        })
    }

    /// Streams wait for a local lock another request holds.
    pub fn is_waiting(&self) -> bool {
        self.fallback.as_ref().is_some_and(Fallback::is_waiting)
    }

    /// A stream callback: `event` is the machine's handler for it.
    pub fn on_stream_event(
        &mut self,
        id: u32,
        view: &dyn StreamView,
        env: &dyn Env,
        event: impl FnOnce(&mut Stream, &dyn StreamView) -> Step,
    ) -> Stepped {
        self.callback = Callback::Stream;
        let cfg = &self.cfg;
        let entry = self.streams.entry(id).or_insert_with(|| StreamEntry {
            stream: Stream::new(Rc::clone(cfg)),
            request_id: None,
            key_prefix: None,
            gone: false,
        });
        let step = event(&mut entry.stream, view);
        if entry.key_prefix.is_none() {
            entry.key_prefix = entry.stream.store_key().map(|k| prefix(k).to_string());
        }
        // Store calls (and so log lines) follow only once a store key exists, or will once the
        // body has been read (inbox mode; the headers may be gone by then).
        if entry.request_id.is_none()
            && (entry.key_prefix.is_some()
                || entry.stream.awaits_key()
                || log::log_enabled!(log::Level::Debug))
        {
            entry.request_id =
                Some(request_id(view.request_header("x-request-id").first().map(Vec::as_slice)));
        }
        self.apply(id, step.effects, true, env);
        // A stream the machine is done with (most of them: not guarded) is forgotten now, not at
        // its end, and its remaining callbacks cost nothing but the call into the VM.
        let done = self.streams.get(&id).is_some_and(|e| e.stream.is_done());
        if done {
            self.streams.remove(&id);
        }
        Stepped { action: step.action, done }
    }

    /// Envoy destroyed the stream (complete, reset, or the client went away).
    pub fn on_stream_done(&mut self, id: u32, env: &dyn Env) {
        self.callback = Callback::Stream;
        if !self.restore.is_empty() {
            self.restore.remove(&id);
        }
        let Some(entry) = self.streams.get_mut(&id) else { return };
        let effects = entry.stream.on_stream_end();
        if entry.stream.is_settled() {
            self.streams.remove(&id);
        } else {
            entry.gone = true;
        }
        self.apply(id, effects, true, env);
    }

    /// The content type to give this stream's local answer as it passes the response callback
    /// (`Some(None)`: remove it), if it needs one.
    pub fn take_restore(&mut self, stream: u32) -> Option<Option<String>> {
        if self.restore.is_empty() {
            return None;
        }
        self.restore.remove(&stream)
    }

    pub fn on_respond_failed(&mut self, stream: u32) {
        self.restore.remove(&stream);
    }

    /// The root's wake-up: dispatch everything queued.
    pub fn on_queue_ready(&mut self, env: &dyn Env) {
        self.callback = Callback::Root;
        self.flush(env);
    }

    /// A [`Command::Wake`] failed: without it the queued calls would never leave, so they fail
    /// now (each request fails open or closed as configured).
    pub fn on_wake_failed(&mut self, env: &dyn Env) {
        self.callback = Callback::Stream;
        self.wake_pending = false;
        for job in std::mem::take(&mut self.outbox) {
            let outcome = Answered::fault(&job.call, CalloutFault::Dispatch);
            self.finish(job, outcome, env);
        }
    }

    /// The host carried out a [`Command::Dispatch`]: `token` is Envoy's, `None` if it refused.
    pub fn on_dispatched(&mut self, job: u64, token: Option<u32>, env: &dyn Env) {
        self.callback = Callback::Root;
        let Some(job) = self.dispatching.remove(&job) else { return };
        match token {
            Some(token) => {
                self.callouts.insert(token, job);
            }
            None => {
                log::warn!("{}: dispatch failed", job.label());
                if job.commit_flight() {
                    self.commit_flight_ended(env);
                }
                if matches!(job.call, Call::Batch(_)) {
                    self.batch_answered(job, Err(CalloutFault::Dispatch), env);
                    return;
                }
                let outcome = Answered::fault(&job.call, CalloutFault::Dispatch);
                self.finish(job, outcome, env);
            }
        }
    }

    /// A callout answered (with no headers: reset or refused).
    pub fn on_callout_answer(
        &mut self,
        token: u32,
        headers: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
        env: &dyn Env,
    ) {
        self.callback = Callback::Root;
        let Some(job) = self.callouts.remove(&token) else { return };
        if job.commit_flight() {
            self.commit_flight_ended(env);
        }
        let outcome = match &job.call {
            Call::Batch(items) => {
                if let (Some(sent), Some(now)) = (job.sent_us, env.now_us()) {
                    let micros = now.saturating_sub(sent);
                    self.commands.push_back(Command::Latency { kind: CallKind::Commit, micros });
                }
                let answer = Answer { headers: &headers, body: &body }.commits(items.len());
                self.batch_answered(job, answer, env);
                return;
            }
            Call::Store(c) => {
                let now_us = env.now_us();
                if let (Some(sent), Some(now)) = (job.sent_us, now_us) {
                    self.commands
                        .push_back(Command::Latency { kind: c.kind(), micros: now.saturating_sub(sent) });
                }
                let answer = Answer { headers: &headers, body: &body };
                match c.kind() {
                    CallKind::Begin => {
                        let begun = answer.begin();
                        if let (StoreCall::Begin { key, body_hash }, Ok(BeginAnswer::Replay(record))) =
                            (c, &begun)
                        {
                            self.remember(
                                key,
                                body_hash,
                                record,
                                answer.record_ttl_ms(),
                                job.sent_us,
                                now_us,
                            );
                        }
                        Answered::Begin(begun)
                    }
                    CallKind::Commit => Answered::Commit(answer.commit()),
                    CallKind::Release => Answered::Release(answer.release().map(|_| ())),
                }
            }
            Call::Upstream(_) => Answered::Upstream(UpstreamAnswer::decode(headers, body)),
        };
        self.finish(job, outcome, env);
    }

    /// Caches a record the store replayed, until the end of the lifetime the store gave it,
    /// counted from before the `begin` was sent (so never past the record's expiry in the store).
    fn remember(
        &mut self,
        key: &str,
        body_hash: &str,
        record: &Record,
        ttl_ms: Option<u64>,
        sent_us: Option<u64>,
        now_us: Option<u64>,
    ) {
        let (Some(ttl_ms), Some(sent), Some(now)) = (ttl_ms, sent_us, now_us) else { return };
        self.recent.remember(key, body_hash, record, (sent / 1000).saturating_add(ttl_ms), now / 1000);
    }

    /// The cache's answer to a `begin`, if it has one.
    fn cached_begin(&mut self, key: &str, body_hash: &str, env: &dyn Env) -> Option<BeginAnswer> {
        if !self.recent.is_enabled() || self.recent.is_empty() {
            return None;
        }
        let now_ms = env.now_us()? / 1000;
        match self.recent.lookup(key, body_hash, now_ms) {
            Cached::Replay(record) => Some(BeginAnswer::Replay(record)),
            Cached::Mismatch => Some(BeginAnswer::Mismatch),
            Cached::Miss => None,
        }
    }

    /// Whether a `begin` skips the store, the breaker being open (or its probe out).
    fn skips_begin(&mut self, env: &dyn Env) -> bool {
        if self.breaker.is_closed() {
            return false;
        }
        match self.breaker.gate(env.now_us().map(|us| us / 1000)) {
            Gate::Skip => true,
            Gate::Probe => {
                log::info!("probing the store with one begin");
                false
            }
            Gate::Call => false,
        }
    }

    fn flush(&mut self, env: &dyn Env) {
        self.wake_pending = false;
        let jobs = std::mem::take(&mut self.outbox);
        if jobs.is_empty() {
            return;
        }
        let sent_us = env.now_us();
        for job in jobs {
            if self.batching && job.batchable() && self.commit_flights > 0 {
                self.held.push(job);
            } else {
                self.dispatch(job, sent_us);
            }
        }
    }

    /// A commit callout ended: the commits held meanwhile go now, as few calls as the batch
    /// limits allow.
    fn commit_flight_ended(&mut self, env: &dyn Env) {
        self.commit_flights = self.commit_flights.saturating_sub(1);
        if self.commit_flights > 0 || self.held.is_empty() {
            return;
        }
        let sent_us = env.now_us();
        let mut batch: Vec<Job> = Vec::new();
        let mut bytes = 0;
        for job in std::mem::take(&mut self.held) {
            let size = match &job.call {
                Call::Store(StoreCall::Commit { record, .. }) => record.len(),
                _ => 0,
            };
            if !batch.is_empty()
                && (batch.len() == idem_protocol::MAX_BATCH_ITEMS || bytes + size > client::MAX_BATCH_BYTES)
            {
                self.dispatch_batch(std::mem::take(&mut batch), sent_us);
                bytes = 0;
            }
            bytes += size;
            batch.push(job);
        }
        self.dispatch_batch(batch, sent_us);
    }

    fn dispatch_batch(&mut self, mut items: Vec<Job>, sent_us: Option<u64>) {
        match items.len() {
            0 => {}
            1 => {
                if let Some(job) = items.pop() {
                    self.dispatch(job, sent_us);
                }
            }
            _ => {
                let job = Job {
                    stream: 0,
                    request_id: Rc::from("-"),
                    call: Call::Batch(items),
                    attempt: 0,
                    sent_us: None,
                    hand_back: false,
                };
                self.dispatch(job, sent_us);
            }
        }
    }

    /// A `commits` callout ended: each commit in it as if it had been sent alone (a fault of
    /// the whole call is each one's fault; its retry goes alone). The breaker hears of it once.
    fn batch_answered(
        &mut self,
        job: Job,
        answer: Result<Vec<Result<CommitOutcome, CalloutFault>>, CalloutFault>,
        env: &dyn Env,
    ) {
        let Call::Batch(items) = job.call else { return };
        if let Err(CalloutFault::Status(status @ (404 | 405))) = answer {
            log::warn!(
                "the store answered {status} to {}: an idemstore without it (older than this \
                 filter); commits go one by one from now on",
                idem_protocol::PATH_COMMITS
            );
            self.batching = false;
            for item in items {
                self.submit(item, env);
            }
            return;
        }
        self.observe(true, answer.as_ref().err().copied(), env);
        match answer {
            Ok(outcomes) => {
                for (item, outcome) in items.into_iter().zip(outcomes) {
                    self.settle(item, Answered::Commit(outcome), env);
                }
            }
            Err(fault) => {
                for item in items {
                    self.settle(item, Answered::Commit(Err(fault)), env);
                }
            }
        }
    }

    /// Hands a callout to the host.
    fn dispatch(&mut self, mut job: Job, sent_us: Option<u64>) {
        if job.commit_flight() {
            self.commit_flights += 1;
        }
        job.sent_us = sent_us;
        let id = self.next_job;
        self.next_job += 1;
        let store_callout = |c: client::Callout| Dispatch {
            job: id,
            cluster: self.cfg.store_cluster.clone(),
            headers: c.headers.into_iter().map(|(n, v)| (n.to_string(), v)).collect(),
            body: c.body,
            timeout_ms: c.timeout_ms,
        };
        let dispatch = match &mut job.call {
            Call::Store(call) => store_callout(call.callout(&self.cfg, sent_us.map(|us| us / 1000))),
            Call::Batch(items) => {
                let calls: Vec<&StoreCall> = items
                    .iter()
                    .filter_map(|j| match &j.call {
                        Call::Store(c) => Some(c),
                        _ => None,
                    })
                    .collect();
                store_callout(client::batch_callout(&self.cfg, &calls))
            }
            // The body is not needed again: whatever the answer, it is not resent.
            Call::Upstream(c) => Dispatch {
                job: id,
                cluster: c.cluster.clone(),
                headers: std::mem::take(&mut c.headers),
                body: Some(std::mem::take(&mut c.body)),
                timeout_ms: c.timeout_ms,
            },
        };
        self.dispatching.insert(id, job);
        self.commands.push_back(Command::Dispatch(dispatch));
    }

    /// Queues a callout: dispatched at once in a root callback, else after a wake-up.
    fn submit(&mut self, job: Job, env: &dyn Env) {
        self.outbox.push(job);
        match self.callback {
            Callback::Root => self.flush(env),
            Callback::Stream if !self.wake_pending => {
                self.wake_pending = true;
                self.commands.push_back(Command::Wake);
            }
            Callback::Stream => {}
        }
    }

    /// Acts on the end of a callout, whether it answered or could not be sent.
    fn finish(&mut self, job: Job, outcome: Answered, env: &dyn Env) {
        self.observe(matches!(job.call, Call::Store(_)), outcome.store_fault(), env);
        self.settle(job, outcome, env);
    }

    /// Tells the breaker how a store call ended (`fault`: how it failed).
    fn observe(&mut self, store_call: bool, fault: Option<CalloutFault>, env: &dyn Env) {
        // Only what costs a request its wait counts: an answer, or a timeout (a store that hangs).
        // A fast failure (reset, refused, no healthy host, garbage) fails open at once anyway.
        let timed_out = matches!(fault, Some(CalloutFault::Timeout));
        if store_call && (timed_out || fault.is_none()) {
            let now_ms = if timed_out { env.now_us().map(|us| us / 1000) } else { None };
            if self.breaker.record(!timed_out, now_ms) {
                log::warn!(
                    "store timed out {} times in a row: begins skip it for {} ms, then one probes it",
                    self.cfg.breaker_failures,
                    self.cfg.breaker_open_ms
                );
            }
        }
    }

    /// What the end of a callout means for its stream, its lock and the local fallback.
    fn settle(&mut self, job: Job, outcome: Answered, env: &dyn Env) {
        let mut effects = Vec::new();
        if job.hand_back {
            self.hand_back_answered(&job, &outcome, env);
            return;
        }
        if let (Some(f), Call::Store(_), None) = (&mut self.fallback, &job.call, outcome.store_fault()) {
            f.store_answered();
        }
        if let (Call::Store(call), Some(f)) = (&job.call, outcome.store_fault()) {
            log::warn!("{} (try {}): {f}", job.label(), job.attempt + 1);
            effects.push(Effect::Count(Metric::StoreErrors));
            let kept = match (call, &mut self.fallback) {
                // The commit's retry failed too: the record is kept here rather than lost.
                (StoreCall::Commit { key, token, body_hash, record }, Some(f)) if job.attempt > 0 => {
                    let (kept, dropped) =
                        f.keep(env, key, token, body_hash, record, env.now_us().map(|us| us / 1000));
                    for (metric, n) in dropped {
                        self.commands.push_back(Command::Add { metric, n });
                    }
                    self.retick();
                    kept
                }
                _ => false,
            };
            if let Some(next) = call.after_fault(job.attempt).filter(|_| !kept) {
                if let (StoreCall::Release { key, token }, Some(f)) = (&next, &mut self.fallback) {
                    f.released(env, key, token, env.now_us().map(|us| us / 1000));
                }
                let attempt = if next.kind() == call.kind() { job.attempt + 1 } else { 0 };
                let retry = Job {
                    stream: job.stream,
                    request_id: job.request_id.clone(),
                    call: Call::Store(next),
                    attempt,
                    sent_us: None,
                    hand_back: false,
                };
                self.submit(retry, env);
            }
        }
        let stream_alive = match outcome {
            Answered::Begin(answer) => match (&job.call, answer) {
                (Call::Store(StoreCall::Begin { key, body_hash }), Err(fault))
                    if self.fallback.is_some() && self.streams.contains_key(&job.stream) =>
                {
                    let (more, alive) = self.begin_unanswered(job.stream, key, body_hash, fault, env);
                    effects.extend(more);
                    alive
                }
                (Call::Store(StoreCall::Begin { key, body_hash }), Ok(BeginAnswer::Locked { token }))
                    if self.fallback.is_some() && self.streams.contains_key(&job.stream) =>
                {
                    let (more, alive) = self.adopt(job.stream, key, body_hash, token, env);
                    effects.extend(more);
                    alive
                }
                (_, answer) if self.streams.contains_key(&job.stream) => {
                    self.feed(&job, &mut effects, |s| s.on_begin_answer(answer))
                }
                // Entries outlive their pending begin, so this is not expected; never leak a lock.
                (Call::Store(call), Ok(BeginAnswer::Locked { token })) => {
                    effects.push(Effect::Store(StoreCall::Release { key: call.key().to_string(), token }));
                    false
                }
                _ => false,
            },
            Answered::Upstream(answer) => {
                if let Err(f) = &answer {
                    log::warn!("{}: {f}", job.label());
                }
                self.feed(&job, &mut effects, |s| s.on_upstream_answer(answer))
            }
            Answered::Commit(result) => {
                if let (Some(f), Call::Store(StoreCall::Commit { token, .. }), Ok(_)) =
                    (&mut self.fallback, &job.call, &result)
                {
                    f.forget(token);
                }
                match result {
                    Ok(CommitOutcome::Stored | CommitOutcome::Late) => {
                        effects.push(Effect::Count(Metric::Stored))
                    }
                    Ok(CommitOutcome::Exists) => {
                        log::info!("{}: an earlier record was kept", job.label());
                        effects.push(Effect::Count(Metric::CommitFailed));
                    }
                    // Counted once, when the retry is exhausted and the lock is given back.
                    Err(_) if job.attempt == 0 => {}
                    Err(_) => effects.push(Effect::Count(Metric::CommitFailed)),
                }
                false
            }
            Answered::Release(_) => false,
        };
        self.apply(job.stream, effects, stream_alive, env);
    }

    /// The store could not answer this stream's `begin`: the local fallback's answer, or the
    /// fault. Returns the effects and whether the stream is still there for the client.
    fn begin_unanswered(
        &mut self,
        stream: u32,
        key: &str,
        body_hash: &str,
        fault: CalloutFault,
        env: &dyn Env,
    ) -> (Vec<Effect>, bool) {
        let gone = self.streams.get(&stream).is_none_or(|e| e.gone);
        let outcome = match &mut self.fallback {
            Some(f) if !gone => f.begin(env, stream, key, body_hash, fault, env.now_us().map(|us| us / 1000)),
            _ => Outcome::Answer(Err(fault), vec![]),
        };
        let out = self.local_outcome(stream, outcome);
        self.retick();
        out
    }

    /// The store granted a stream its lock: mirrored in the local store, unless that holds
    /// this key's answer already (a record made here in an outage, not yet handed back: it goes
    /// back under this lock) or runs it (the stream waits; the store's lock is released).
    fn adopt(
        &mut self,
        stream: u32,
        key: &str,
        body_hash: &str,
        token: String,
        env: &dyn Env,
    ) -> (Vec<Effect>, bool) {
        let now_ms = env.now_us().map(|us| us / 1000);
        let local = match &mut self.fallback {
            Some(f) => f.adopt(env, stream, key, body_hash, &token, now_ms),
            None => None,
        };
        let Some(outcome) = local else {
            return self.answer_begin(stream, Ok(BeginAnswer::Locked { token }), vec![]);
        };
        let call = match &outcome {
            Outcome::Answer(Ok(BeginAnswer::Replay(record)), _) => StoreCall::Commit {
                key: key.to_string(),
                token,
                body_hash: body_hash.to_string(),
                record: record.encode(),
            },
            _ => StoreCall::Release { key: key.to_string(), token },
        };
        let hand_back = matches!(call, StoreCall::Commit { .. });
        let job = Job { hand_back, ..self.job(stream, Call::Store(call)) };
        self.submit(job, env);
        let out = self.local_outcome(stream, outcome);
        self.retick();
        out
    }

    /// Feeds a local answer to its stream (nothing yet if it waits).
    fn local_outcome(&mut self, stream: u32, outcome: Outcome) -> (Vec<Effect>, bool) {
        match outcome {
            Outcome::Wait => (vec![], true),
            Outcome::Answer(answer, metrics) => self.answer_begin(stream, answer, metrics),
        }
    }

    /// Feeds a `begin` answer the store did not give (the cache's, the local fallback's) to its
    /// stream, counted; returns the effects and whether the stream is still there for the client.
    fn answer_begin(
        &mut self,
        stream: u32,
        answer: Result<BeginAnswer, CalloutFault>,
        metrics: Vec<Metric>,
    ) -> (Vec<Effect>, bool) {
        let Some(entry) = self.streams.get_mut(&stream) else { return (vec![], false) };
        let mut effects = entry.stream.on_begin_answer(answer);
        // `executed` counts what ran holding the store's lock; under the local lock it is
        // `degraded` (and `local_locks`) instead.
        if metrics.contains(&Metric::LocalLocks) {
            effects.retain(|e| *e != Effect::Count(Metric::Executed));
        }
        effects.extend(metrics.into_iter().map(Effect::Count));
        let gone = entry.gone;
        if gone && entry.stream.is_settled() {
            self.streams.remove(&stream);
        }
        (effects, !gone)
    }

    /// A hand-back commit ended: the record stays local until the store has it.
    fn hand_back_answered(&mut self, job: &Job, outcome: &Answered, env: &dyn Env) {
        let ok = matches!(outcome, Answered::Commit(Ok(_)));
        if let (Some(f), Call::Store(call)) = (&mut self.fallback, &job.call) {
            f.handed_back(env, call.key(), ok, env.now_us().map(|us| us / 1000));
        }
        match outcome.store_fault() {
            None if ok => self.commands.push_back(Command::Count(Metric::HandedBack)),
            fault => log::info!("{}: hand-back not taken ({fault:?}), offered again", job.label()),
        }
        self.retick();
    }

    /// Feeds an answer to the stream's machine (if Envoy has not destroyed it yet, the answer is
    /// for the client too) and forgets a destroyed stream once nothing of it is pending.
    fn feed(
        &mut self,
        job: &Job,
        effects: &mut Vec<Effect>,
        event: impl FnOnce(&mut Stream) -> Vec<Effect>,
    ) -> bool {
        let Some(entry) = self.streams.get_mut(&job.stream) else {
            // Entries outlive their pending calls: not expected.
            log::error!("{}: answer for an unknown stream", job.label());
            return false;
        };
        effects.extend(event(&mut entry.stream));
        let gone = entry.gone;
        if gone && entry.stream.is_settled() {
            self.streams.remove(&job.stream);
        }
        !gone
    }

    /// Turns a stream's effects into commands; what only a live stream can take is dropped for a
    /// destroyed one.
    fn apply(&mut self, stream: u32, effects: Vec<Effect>, alive: bool, env: &dyn Env) {
        for effect in effects {
            match effect {
                Effect::Respond(response) if alive => {
                    // A replay says what the upstream said: a 204 with a content type, or a body
                    // left out, keeps it; bytes the upstream did not label stay unlabelled.
                    let content_type =
                        response.headers.iter().find(|(n, _)| n == "content-type").map(|(_, v)| v);
                    if response.body.is_empty() == content_type.is_some() {
                        self.restore.insert(stream, content_type.cloned());
                    }
                    self.commands.push_back(Command::Respond { stream, response });
                }
                Effect::Resume if alive => self.commands.push_back(Command::Resume { stream }),
                Effect::Respond(_) | Effect::Resume => {}
                Effect::SetRequestHeader(name, value) => {
                    self.commands.push_back(Command::SetRequestHeader { stream, name, value })
                }
                Effect::RemoveRequestHeader(name) => {
                    self.commands.push_back(Command::RemoveRequestHeader { stream, name })
                }
                Effect::Store(StoreCall::Commit { key, token, body_hash, record })
                    if fallback::is_local(&token) =>
                {
                    let now_ms = env.now_us().map(|us| us / 1000);
                    if let Some(f) = &mut self.fallback {
                        for (metric, n) in f.commit(env, &key, &token, &body_hash, &record, now_ms) {
                            self.commands.push_back(Command::Add { metric, n });
                        }
                    }
                    self.retick();
                }
                Effect::Store(StoreCall::Release { key, token }) if fallback::is_local(&token) => {
                    let now_ms = env.now_us().map(|us| us / 1000);
                    if let Some(f) = &mut self.fallback {
                        f.release(env, &key, &token, now_ms);
                    }
                }
                Effect::Store(call) => {
                    let now_ms = || env.now_us().map(|us| us / 1000);
                    match (&call, &mut self.fallback) {
                        (StoreCall::Commit { key, token, body_hash, .. }, Some(f)) => {
                            f.sent(env, key, token, body_hash, now_ms())
                        }
                        (StoreCall::Release { key, token }, Some(f)) => f.released(env, key, token, now_ms()),
                        _ => {}
                    }
                    if let StoreCall::Begin { key, body_hash } = &call {
                        // Answered here (the cache, or the breaker), or sent.
                        if self.streams.contains_key(&stream) {
                            if let Some(answer) = self.cached_begin(key, body_hash, env) {
                                let (effects, _) =
                                    self.answer_begin(stream, Ok(answer), vec![Metric::CacheHits]);
                                self.apply(stream, effects, alive, env);
                                continue;
                            }
                            if self.skips_begin(env) {
                                let (mut effects, _) =
                                    self.begin_unanswered(stream, key, body_hash, CalloutFault::Skipped, env);
                                effects.push(Effect::Count(Metric::StoreSkipped));
                                self.apply(stream, effects, alive, env);
                                continue;
                            }
                        }
                    }
                    let job = self.job(stream, Call::Store(call));
                    self.submit(job, env);
                }
                Effect::Upstream(call) => {
                    let job = self.job(stream, Call::Upstream(call));
                    self.submit(job, env);
                }
                Effect::Count(m) => {
                    if log::log_enabled!(log::Level::Debug) {
                        self.log_decision(stream, m);
                    }
                    if let (Some(outcome), true) = (m.outcome(), alive) {
                        self.commands.push_back(Command::Outcome { stream, outcome });
                    }
                    self.commands.push_back(Command::Count(m));
                }
            }
        }
    }

    fn job(&self, stream: u32, call: Call) -> Job {
        let request_id =
            self.streams.get(&stream).and_then(|e| e.request_id.clone()).unwrap_or_else(|| Rc::from("-"));
        Job { stream, request_id, call, attempt: 0, sent_us: None, hand_back: false }
    }

    /// One debug line per counted outcome (guarded, replayed, executed, ...), to follow a request.
    fn log_decision(&self, stream: u32, m: Metric) {
        let Some(entry) = self.streams.get(&stream) else { return };
        let key = entry.key_prefix.as_deref().unwrap_or("-");
        let request = entry.request_id.as_deref().unwrap_or("-");
        log::debug!("request {request} key {key}: {}", m.name());
    }
}

fn prefix(key: &str) -> &str {
    key.get(..12).unwrap_or(key)
}

/// `x-request-id` as a log field: a client may send its own, so anything but a short run of
/// visible ASCII is cut, and a line can never be split or forged through it.
fn request_id(raw: Option<&[u8]>) -> Rc<str> {
    let clean: String = raw
        .unwrap_or_default()
        .iter()
        .take(64)
        .map(|&b| if b.is_ascii_graphic() { b as char } else { '?' })
        .collect();
    if clean.is_empty() {
        Rc::from("-")
    } else {
        Rc::from(clean)
    }
}

#[cfg(test)]
mod tests;
