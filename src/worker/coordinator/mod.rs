//! The per-worker coordinator: the streams of one VM and the events Envoy sends for them. Envoy
//! events go in (a stream callback, a queue wake-up, a dispatched callout, its answer, the end
//! of a stream, the root's tick); [`Command`]s come out, which the host carries out in order
//! ([`Coordinator::poll`]) and nothing else. It keeps each live stream's machine and turns the
//! machine's effects into commands; the calls in flight are [`callouts`]'s, and who answers a
//! store call is [`store_path`]'s. No proxy-wasm here: `sim::worker` drives it through random
//! interleavings of many streams.
//!
//! The answer to a callout is fed to the stream's machine if the stream is still known, and a
//! stream Envoy has destroyed is remembered until nothing of it is pending. Failures end in the
//! machine like answers do: a callout that could not be dispatched, or a wake-up that could not
//! be sent, is a [`CalloutFault::Dispatch`], so no request stays paused.
//!
//! This file holds the streams' events and the effects turned into commands; beside it, in
//! `impl Coordinator` blocks of their own, `on_callout.rs` (callouts dispatched and answered),
//! `on_store_stream.rs` (the store stream's events), and `settle.rs` (what the end of a call,
//! however it ended, means for its stream, its lock and the store).
//!
//! [`callouts`]: crate::worker::callouts
//! [`store_path`]: crate::worker::store_path

use std::collections::{HashMap, VecDeque};
use std::rc::Rc;

use idem_protocol::CommitOutcome;

use crate::config::Config;
use crate::request::detached::UpstreamAnswer;
use crate::request::machine::{Action, Effect, Machine, Step, StreamView};
use crate::request::metrics::Metric;
use crate::request::problem::{Instances, LocalResponse, Problem};
use crate::store::client::{BeginAnswer, CallKind, CalloutFault, StoreAnswer, StoreCall};
use crate::worker::callouts::{Callback, Callouts};
use crate::worker::command::Command;
use crate::worker::env::Env;
use crate::worker::fallback::LocalAnswer;
use crate::worker::job::{key_prefix, Call, Job};
use crate::worker::store_path::{Presence, Routed, StorePath};

/// What a stream callback returns to Envoy, and whether the stream's later callbacks can skip
/// the coordinator (the machine is done with it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stepped {
    pub action: Action,
    pub done: bool,
}

struct StreamEntry {
    machine: Machine,
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

/// What a finished call concluded for its job: its answer read as its call's, or its fault (a
/// callout's, or a call's on the store stream). Not [`crate::store::stream::Answered`], the
/// store stream's undecoded answer, which becomes one of these.
enum Concluded {
    Begin(Result<BeginAnswer, CalloutFault>),
    Commit(Result<CommitOutcome, CalloutFault>),
    Release(Result<(), CalloutFault>),
    Upstream(Result<UpstreamAnswer, CalloutFault>),
}

impl Concluded {
    fn fault(call: &Call, f: CalloutFault) -> Concluded {
        match call {
            Call::Store(c) => match c.kind() {
                CallKind::Begin => Concluded::Begin(Err(f)),
                CallKind::Commit => Concluded::Commit(Err(f)),
                CallKind::Release => Concluded::Release(Err(f)),
            },
            Call::Batch(_) => Concluded::Commit(Err(f)),
            Call::Upstream(_) => Concluded::Upstream(Err(f)),
        }
    }

    fn store_fault(&self) -> Option<CalloutFault> {
        match self {
            Concluded::Begin(Err(f)) | Concluded::Commit(Err(f)) | Concluded::Release(Err(f)) => Some(*f),
            _ => None,
        }
    }
}

pub struct Coordinator {
    cfg: Rc<Config>,
    streams: HashMap<u32, StreamEntry>,
    callouts: Callouts,
    path: StorePath,
    /// The content type a local answer must have where Envoy changes it (it drops one from an
    /// answer without a body, and labels a body without one `text/plain`), by stream: set (or
    /// removed, `None`) when the answer passes this filter's response callback.
    restore: HashMap<u32, Option<String>>,
    /// gRPC replays decided in a stream callback, for the root to carry out: inside the
    /// stream's own body callback Envoy would hand over the current chunk as the body, and
    /// defers the resume (see `request::machine::hop`).
    hops: Vec<Command>,
    hop_wake: bool,
    commands: VecDeque<Command>,
    callback: Callback,
    /// The root's tick period asked for last.
    tick_ms: u64,
    /// Calls on the store stream, as last told to the host.
    streamed: usize,
    /// The `instance` of each problem this VM answers.
    instances: Instances,
}

impl Coordinator {
    pub fn new(cfg: Rc<Config>) -> Coordinator {
        Coordinator {
            callouts: Callouts::new(Rc::clone(&cfg)),
            path: StorePath::new(Rc::clone(&cfg)),
            cfg,
            streams: HashMap::new(),
            restore: HashMap::new(),
            hops: Vec::new(),
            hop_wake: false,
            commands: VecDeque::new(),
            callback: Callback::Stream,
            tick_ms: 0,
            streamed: 0,
            instances: Instances::default(),
        }
    }

    /// Prepares the shared data of the local fallback, before any request; `seed` is random
    /// per VM.
    pub fn set_up(&mut self, env: &dyn Env, seed: u64) {
        self.enter_root();
        self.path.set_up(env, seed);
        self.callouts.seed(seed);
        self.instances = Instances::new(seed);
    }

    /// The root's tick: waiters for a local lock look again, local records are handed back.
    pub fn on_tick(&mut self, env: &dyn Env) {
        self.enter_root();
        let streams = &self.streams;
        let tick = self.path.tick(env, |id| streams.get(&id).is_none_or(|e| e.gone));
        for (stream, outcome) in tick.due {
            let (effects, alive) = self.local_outcome(stream, outcome, None);
            self.apply(stream, effects, alive, env);
        }
        if let Some(n) = tick.local_records {
            self.commands.push_back(Command::LocalRecords(n as u64));
        }
        for call in tick.hand_backs {
            let job = Job { hand_back: true, ..Job::worker(Call::Store(call)) };
            self.submit(job, env);
        }
        if let (Some(stream), Some(now_ms)) = (self.callouts.stream(), env.now_ms()) {
            let ended = stream.sweep(now_ms, &mut self.commands);
            self.stream_ended(ended, env);
        }
    }

    /// The next thing for the host to do; once nothing else is left, the change in calls on the
    /// store stream, and the root's tick period if what needs it (the local fallback, calls in
    /// flight on the store stream) changed it.
    pub fn poll(&mut self) -> Option<Command> {
        if let Some(command) = self.commands.pop_front() {
            return Some(command);
        }
        let streamed = self.callouts.stream().map_or(0, |s| s.pending());
        if streamed != self.streamed {
            let delta = streamed as i64 - self.streamed as i64;
            self.streamed = streamed;
            return Some(Command::StreamCalls(delta));
        }
        let period_ms = match (self.path.tick_ms(), self.callouts.tick_ms()) {
            (0, b) => b,
            (a, 0) => a,
            (a, b) => a.min(b),
        };
        (period_ms != self.tick_ms).then(|| {
            self.tick_ms = period_ms;
            Command::Tick { period_ms }
        })
    }

    /// A root callback begins.
    fn enter_root(&mut self) {
        self.callback = Callback::Root;
        if let Some(stream) = self.callouts.stream() {
            stream.new_callback();
        }
    }

    /// Hands a call to [`Callouts`], in the callback the coordinator is in.
    fn submit(&mut self, job: Job, env: &dyn Env) {
        let ended = self.callouts.submit(job, self.callback, env, &mut self.commands);
        self.stream_ended(ended, env);
    }

    /// A store call's answer, read as its call's; a replayed record is remembered for the cache.
    fn store_answered(
        &mut self,
        call: &StoreCall,
        answer: &dyn StoreAnswer,
        sent_us: Option<u64>,
        now_us: Option<u64>,
    ) -> Concluded {
        match call {
            StoreCall::Begin { key, body_hash, .. } => {
                let mut begun = answer.begin();
                if let Ok(BeginAnswer::Replay(record)) = &mut begun {
                    let ttl_ms = answer.record_ttl_ms();
                    self.path.remember(key, body_hash, record, ttl_ms, sent_us, now_us);
                    // From when the call went out: the store said it a little later.
                    let asked_ms = sent_us.or(now_us).map(|us| us / 1000);
                    record.expires_ms = ttl_ms.zip(asked_ms).map(|(ttl, at)| at.saturating_add(ttl));
                }
                Concluded::Begin(begun)
            }
            StoreCall::Commit { .. } => Concluded::Commit(answer.commit()),
            StoreCall::Release { .. } => Concluded::Release(answer.release().map(|_| ())),
        }
    }

    /// A store call's latency, for its histogram, if it was sent and the clock can tell.
    fn latency(&mut self, kind: CallKind, sent_us: Option<u64>, now_us: Option<u64>) {
        if let (Some(sent), Some(now)) = (sent_us, now_us) {
            self.commands.push_back(Command::Latency { kind, micros: now.saturating_sub(sent) });
        }
    }

    /// A stream callback: `event` is the machine's handler for it.
    pub fn on_stream_event(
        &mut self,
        id: u32,
        view: &dyn StreamView,
        env: &dyn Env,
        event: impl FnOnce(&mut Machine, &dyn StreamView) -> Step,
    ) -> Stepped {
        self.callback = Callback::Stream;
        let cfg = &self.cfg;
        let entry = self.streams.entry(id).or_insert_with(|| StreamEntry {
            machine: Machine::new(Rc::clone(cfg)),
            request_id: None,
            key_prefix: None,
            gone: false,
        });
        let step = event(&mut entry.machine, view);
        if entry.key_prefix.is_none() {
            entry.key_prefix = entry.machine.store_key().map(|k| key_prefix(k).to_string());
        }
        // Store calls (and so log lines) follow only once a store key exists, or will once the
        // body has been read (inbox mode; the headers may be gone by then), and a refusal is a
        // log line.
        if entry.request_id.is_none()
            && (entry.key_prefix.is_some()
                || entry.machine.awaits_key()
                || step.effects.iter().any(|e| matches!(e, Effect::Refuse(_)))
                || log::log_enabled!(log::Level::Debug))
        {
            entry.request_id =
                Some(request_id(view.request_header("x-request-id").first().map(Vec::as_slice)));
        }
        self.apply(id, step.effects, true, env);
        // A stream the machine is done with (most of them: not guarded) is forgotten now, not at
        // its end, and its remaining callbacks cost nothing but the call into the VM.
        let done = self.streams.get(&id).is_some_and(|e| e.machine.is_done());
        if done {
            self.streams.remove(&id);
        }
        Stepped { action: step.action, done }
    }

    /// Envoy destroyed the stream (complete, reset, or the client went away).
    pub fn on_stream_done(&mut self, id: u32, view: &dyn StreamView, env: &dyn Env) {
        self.callback = Callback::Stream;
        if !self.restore.is_empty() {
            self.restore.remove(&id);
        }
        if !self.hops.is_empty() {
            self.hops.retain(|h| !matches!(h, Command::Hop { stream, .. } if *stream == id));
        }
        let Some(entry) = self.streams.get_mut(&id) else { return };
        let effects = entry.machine.on_stream_end(view);
        if entry.machine.is_settled() {
            self.streams.remove(&id);
        } else {
            entry.gone = true;
        }
        // Envoy wrote the stream's access log before it destroyed it: no outcome can reach it.
        self.apply(id, effects, false, env);
    }

    /// The content type to give this stream's local answer as it passes the response callback
    /// (`Some(None)`: remove it), if it needs one.
    pub fn take_restore(&mut self, stream: u32) -> Option<Option<String>> {
        if self.restore.is_empty() {
            return None;
        }
        self.restore.remove(&stream)
    }

    /// The trailers that follow this stream's local answer (the replay listener's), if any.
    pub fn answer_trailers(&self, stream: u32) -> Option<Vec<(String, String)>> {
        self.streams.get(&stream).and_then(|e| e.machine.answer_trailers()).map(<[_]>::to_vec)
    }

    pub fn on_respond_failed(&mut self, stream: u32) {
        self.restore.remove(&stream);
    }

    /// The root's wake-up: dispatch everything queued.
    pub fn on_queue_ready(&mut self, env: &dyn Env) {
        self.enter_root();
        self.hop_wake = false;
        // Those of streams that went away meanwhile were dropped (`on_stream_done`).
        self.commands.extend(std::mem::take(&mut self.hops));
        let ended = self.callouts.flush(env, &mut self.commands);
        self.stream_ended(ended, env);
    }

    /// A [`Command::Wake`] failed: without it the queued calls would never leave, so they fail
    /// now (each request fails open or closed as configured).
    pub fn on_wake_failed(&mut self, env: &dyn Env) {
        self.callback = Callback::Stream;
        self.hop_wake = false;
        for hop in std::mem::take(&mut self.hops) {
            if let Command::Hop { stream, fallback, instance, refusal, .. } = hop {
                log::warn!("cannot wake the root to re-route a gRPC replay: {refusal}");
                self.commands.push_back(Command::Instance { stream, instance });
                self.commands.push_back(Command::Respond { stream, response: fallback });
            }
        }
        for job in self.callouts.take_queued() {
            let outcome = Concluded::fault(&job.call, CalloutFault::Dispatch);
            self.finish(job, outcome, env);
        }
    }

    fn presence(&self, stream: u32) -> Presence {
        match self.streams.get(&stream) {
            None => Presence::Unknown,
            Some(e) if e.gone => Presence::Gone,
            Some(_) => Presence::Live,
        }
    }

    /// Feeds a local answer to its stream (nothing yet if it waits), then `and_count`.
    fn local_outcome(
        &mut self,
        stream: u32,
        outcome: LocalAnswer,
        and_count: Option<Metric>,
    ) -> (Vec<Effect>, bool) {
        let (mut effects, alive) = match outcome {
            LocalAnswer::Wait => (vec![], true),
            LocalAnswer::Answer(answer, metrics) => self.answer_begin(stream, answer, metrics),
        };
        effects.extend(and_count.map(Effect::Count));
        (effects, alive)
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
        let mut effects = entry.machine.on_begin_answer(answer);
        // `executed` counts what ran holding the store's lock; under the local lock it is
        // `degraded` (and `local_locks`) instead.
        if metrics.contains(&Metric::LocalLocks) {
            effects.retain(|e| *e != Effect::Count(Metric::Executed));
        }
        effects.extend(metrics.into_iter().map(Effect::Count));
        let gone = entry.gone;
        if gone && entry.machine.is_settled() {
            self.streams.remove(&stream);
        }
        (effects, !gone)
    }

    /// Turns a stream's effects into commands; what only a live stream can take is dropped for a
    /// destroyed one.
    fn apply(&mut self, stream: u32, effects: Vec<Effect>, alive: bool, env: &dyn Env) {
        for effect in effects {
            match effect {
                Effect::Respond(response) if alive => self.respond(stream, response),
                Effect::Refuse(problem) if alive => {
                    let instance = self.instances.mint();
                    let grpc = self.streams.get(&stream).is_some_and(|e| e.machine.is_grpc());
                    let response = problem.answer(grpc, &instance);
                    self.log_refusal(stream, &problem, &response, &instance);
                    self.commands.push_back(Command::Instance { stream, instance });
                    self.respond(stream, response);
                }
                Effect::Resume if alive => self.commands.push_back(Command::Resume { stream }),
                Effect::Hop { record, body_len, fallback } if alive => {
                    // Used only if the hop fails: the host then sets the instance, logs the
                    // refusal and sends it.
                    let instance = self.instances.mint();
                    let response = fallback.answer(true, &instance);
                    let refusal = self.refusal_line(stream, &fallback, &response, &instance);
                    let hop =
                        Command::Hop { stream, record, body_len, fallback: response, instance, refusal };
                    if self.callback == Callback::Root {
                        self.commands.push_back(hop);
                    } else {
                        self.hops.push(hop);
                        if !self.hop_wake {
                            self.hop_wake = true;
                            self.commands.push_back(Command::Wake);
                        }
                    }
                }
                Effect::Respond(_) | Effect::Refuse(_) | Effect::Resume | Effect::Hop { .. } => {}
                Effect::RemoveResponseHeader(name) => {
                    self.commands.push_back(Command::RemoveResponseHeader { stream, name })
                }
                Effect::SetResponseHeader(name, value) => {
                    self.commands.push_back(Command::SetResponseHeader { stream, name, value })
                }
                Effect::AddResponseTrailers(trailers) => {
                    self.commands.push_back(Command::AddResponseTrailers { stream, trailers })
                }
                Effect::SetRequestHeader(name, value) => {
                    self.commands.push_back(Command::SetRequestHeader { stream, name, value })
                }
                Effect::RemoveRequestHeader(name) => {
                    self.commands.push_back(Command::RemoveRequestHeader { stream, name })
                }
                Effect::Store(call) => {
                    let presence = self.presence(stream);
                    match self.path.route(call, stream, presence, env, &mut self.commands) {
                        Routed::Send(call) => {
                            let job = self.job(stream, Call::Store(call));
                            self.submit(job, env);
                        }
                        Routed::Answered(outcome, and_count) => {
                            let (effects, _) = self.local_outcome(stream, outcome, and_count);
                            self.apply(stream, effects, alive, env);
                        }
                        Routed::Done => {}
                    }
                }
                Effect::Upstream(call) | Effect::Lookup(call) => {
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

    fn respond(&mut self, stream: u32, response: LocalResponse) {
        // A replay says what the upstream said: a 204 with a content type, or a body left out,
        // keeps it; bytes the upstream did not label stay unlabelled.
        let content_type = response.headers.iter().find(|(n, _)| n == "content-type").map(|(_, v)| v);
        if response.body.is_empty() == content_type.is_some() {
            self.restore.insert(stream, content_type.cloned());
        }
        self.commands.push_back(Command::Respond { stream, response });
    }

    /// One line per refusal, with the `instance` the client and the access log see: what
    /// support searches for when a client quotes the problem.
    fn log_refusal(&self, stream: u32, problem: &Problem, response: &LocalResponse, instance: &str) {
        log::info!("{}", self.refusal_line(stream, problem, response, instance));
    }

    /// `request <id> key <prefix>: refused <code> (<status>), instance <uri>`.
    fn refusal_line(
        &self,
        stream: u32,
        problem: &Problem,
        response: &LocalResponse,
        instance: &str,
    ) -> String {
        let entry = self.streams.get(&stream);
        let key = entry.and_then(|e| e.key_prefix.as_deref()).unwrap_or("-");
        let request = entry.and_then(|e| e.request_id.as_deref()).unwrap_or("-");
        let code = problem.code.name();
        let status = match response.headers.iter().find(|(n, _)| n == "grpc-status") {
            Some((_, grpc)) => format!("grpc-status {grpc}"),
            None => response.status.to_string(),
        };
        format!("request {request} key {key}: refused {code} ({status}), instance {instance}")
    }

    /// A first try on behalf of `stream`.
    fn job(&self, stream: u32, call: Call) -> Job {
        let request_id =
            self.streams.get(&stream).and_then(|e| e.request_id.clone()).unwrap_or_else(|| Rc::from("-"));
        Job::new(stream, request_id, call)
    }

    /// One debug line per counted outcome (guarded, replayed, executed, ...), to follow a request.
    fn log_decision(&self, stream: u32, m: Metric) {
        let Some(entry) = self.streams.get(&stream) else { return };
        let key = entry.key_prefix.as_deref().unwrap_or("-");
        let request = entry.request_id.as_deref().unwrap_or("-");
        log::debug!("request {request} key {key}: {}", m.name());
    }

    /// Streams the coordinator still holds (guarded and not finished, or gone with a call
    /// pending), and callouts not yet answered.
    #[cfg(any(test, feature = "sim"))]
    pub fn pending(&self) -> (usize, usize) {
        (self.streams.len(), self.callouts.pending())
    }

    /// The store calls waiting for a wake-up: what [`Coordinator::on_wake_failed`] would fail.
    #[cfg(any(test, feature = "sim"))]
    pub fn queued(&self) -> impl Iterator<Item = &StoreCall> {
        self.callouts.queued()
    }

    /// Whether the store stream's call `id` waits for its answer.
    #[cfg(any(test, feature = "sim"))]
    pub fn stream_awaits(&mut self, id: u64) -> bool {
        self.callouts.stream().is_some_and(|s| s.awaits(id))
    }

    /// The keys of the calls waiting for the store stream to open.
    #[cfg(any(test, feature = "sim"))]
    pub fn stream_waiting_keys(&mut self) -> Vec<String> {
        self.callouts.stream().map(|s| s.waiting_keys()).unwrap_or_default()
    }

    /// Local records may wait to be handed back (known after the last scan).
    #[cfg(any(test, feature = "sim"))]
    pub fn hand_backs_due(&self) -> bool {
        self.path.hand_backs_due()
    }

    /// Streams wait for a local lock another request holds.
    #[cfg(any(test, feature = "sim"))]
    pub fn is_waiting(&self) -> bool {
        self.path.is_waiting()
    }
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

mod on_callout;
mod on_store_stream;
mod settle;

#[cfg(test)]
mod tests;
