//! The callouts of one worker, from the moment a stream asks for one to its answer: the outbox
//! a stream callback fills, the wake-up that makes the root dispatch it, the calls handed to the
//! host and those in flight, and commits held while another commit is in flight, then sent
//! together (`commits`).
//!
//! Callouts are owned by the root context, not by the stream: Envoy cancels a stream's pending
//! callouts when the stream ends, and a `begin` that took the lock, or a `commit` sent after the
//! response went out, must not be lost with it. A stream callback therefore puts its call in the
//! outbox and asks for a wake-up ([`Command::Wake`], a per-worker shared queue); the root's
//! callback dispatches it ([`Command::Dispatch`]), so Envoy registers the callout under the root.
//! What an answer means is not decided here: the coordinator gets the [`Job`] back.

use std::collections::{HashMap, VecDeque};
use std::rc::Rc;

use crate::config::values::StoreTransport;
use crate::config::Config;
use crate::store::client::{self, StoreCall};
use crate::store::stream as wire;
use crate::worker::command::{Command, Dispatch};
use crate::worker::env::Clock;
use crate::worker::job::{Call, Job};
use crate::worker::store_stream::{Ended, StoreStream};

/// Sends `job` on the store stream at `sent_us` (`root`: from a root callback). One the stream
/// gives back (no stream can take it now) ends as a refused callout does, unsent: no latency.
fn send_on_stream(
    stream: &mut StoreStream,
    mut job: Job,
    sent_us: Option<u64>,
    root: bool,
    out: &mut VecDeque<Command>,
) -> Option<Ended> {
    job.sent_us = sent_us;
    stream
        .send(job, sent_us.map_or(0, |us| us / 1000), root, out)
        .map(|job| Ended::Failed(Job { sent_us: None, ..job }, client::CalloutFault::Reset))
}

/// Which kind of callback an event came in: Envoy's rules for callouts differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Callback {
    Stream,
    Root,
}

pub struct Callouts {
    cfg: Rc<Config>,
    /// Calls from stream callbacks, waiting for the root's wake-up.
    outbox: Vec<Job>,
    wake_pending: bool,
    /// Handed to the host in a [`Command::Dispatch`], token not yet known.
    dispatching: HashMap<u64, Job>,
    next_job: u64,
    /// In flight, by the token Envoy gave the callout.
    in_flight: HashMap<u32, Job>,
    /// Commit callouts in flight; while there is one, new commits are held and then go
    /// together: the store sees one call for many commits under load, and none waits when idle.
    commit_flights: usize,
    held: Vec<Job>,
    /// Off once the store answered a batch `404`/`405`: an idemstore older than `commits` (a
    /// rolling upgrade) gets every commit alone, as before, instead of a failed batch each time.
    batching: bool,
    /// With `store_transport: stream`, the store calls that fit on it go there.
    stream: Option<StoreStream>,
}

impl Callouts {
    pub fn new(cfg: Rc<Config>) -> Callouts {
        Callouts {
            outbox: Vec::new(),
            wake_pending: false,
            dispatching: HashMap::new(),
            next_job: 0,
            in_flight: HashMap::new(),
            commit_flights: 0,
            held: Vec::new(),
            batching: true,
            stream: (cfg.store_transport == StoreTransport::Stream)
                .then(|| StoreStream::new(Rc::clone(&cfg), 1)),
            cfg,
        }
    }

    /// A random seed for this VM: the stream's reopen jitter.
    pub fn seed(&mut self, seed: u64) {
        if self.stream.is_some() {
            self.stream = Some(StoreStream::new(Rc::clone(&self.cfg), seed));
        }
    }

    /// Queues a call: sent at once on an open store stream or in a root callback, else after a
    /// wake-up. Returns the calls that ended without leaving (the store stream backs off).
    pub fn submit(
        &mut self,
        job: Job,
        callback: Callback,
        clock: &dyn Clock,
        out: &mut VecDeque<Command>,
    ) -> Vec<Ended> {
        if callback == Callback::Stream && self.streams(&job) {
            if let Some(stream) = self.stream.as_mut().filter(|s| s.can_send()) {
                let sent_us = clock.now_us();
                let ended = send_on_stream(stream, job, sent_us, false, out).into_iter().collect();
                // A stream that may reopen is opened by the root (see `StoreStream::open_due`).
                if stream.wants_open(sent_us.map_or(0, |us| us / 1000)) && !self.wake_pending {
                    self.wake_pending = true;
                    out.push_back(Command::Wake);
                }
                return ended;
            }
        }
        self.outbox.push(job);
        match callback {
            Callback::Root => return self.flush(clock, out),
            Callback::Stream if !self.wake_pending => {
                self.wake_pending = true;
                out.push_back(Command::Wake);
            }
            Callback::Stream => {}
        }
        vec![]
    }

    /// The root's wake-up: sends everything queued (or holds commits for a batch). Returns the
    /// calls that ended without leaving.
    pub fn flush(&mut self, clock: &dyn Clock, out: &mut VecDeque<Command>) -> Vec<Ended> {
        self.wake_pending = false;
        let jobs = std::mem::take(&mut self.outbox);
        let mut ended = Vec::new();
        let sent_us = clock.now_us();
        if let Some(stream) = &mut self.stream {
            stream.open_due(sent_us.map_or(0, |us| us / 1000), out);
        }
        if jobs.is_empty() {
            return ended;
        }
        for job in jobs {
            if self.streams(&job) {
                if let Some(stream) = &mut self.stream {
                    ended.extend(send_on_stream(stream, job, sent_us, true, out));
                }
            } else if self.batching && job.batchable() && self.commit_flights > 0 {
                self.held.push(job);
            } else {
                self.dispatch(job, sent_us, out);
            }
        }
        ended
    }

    /// Whether `job` goes on the store stream: a store call that fits on it, when there is one.
    fn streams(&self, job: &Job) -> bool {
        // With the store in Envoy's process (`store`, the native host) every call goes on the
        // stream: there is no cluster to call, and a large record holds no other call behind it
        // (each message is a task of its own on the store's threads).
        self.stream.is_some()
            && matches!(&job.call, Call::Store(call) if self.cfg.store.is_some() || wire::fits(call))
    }

    /// The store stream, if the worker has one.
    pub fn stream(&mut self) -> Option<&mut StoreStream> {
        self.stream.as_mut()
    }

    /// The tick the calls in flight need.
    pub fn tick_ms(&self) -> u64 {
        self.stream.as_ref().map_or(0, StoreStream::tick_ms)
    }

    /// The wake-up could not be sent: the queued calls, which would never leave.
    pub fn take_queued(&mut self) -> Vec<Job> {
        self.wake_pending = false;
        std::mem::take(&mut self.outbox)
    }

    /// The host carried out a [`Command::Dispatch`]: `token` is Envoy's, `None` if it refused.
    /// Returns the job if it failed to leave.
    pub fn dispatched(
        &mut self,
        job: u64,
        token: Option<u32>,
        clock: &dyn Clock,
        out: &mut VecDeque<Command>,
    ) -> Option<Job> {
        let job = self.dispatching.remove(&job)?;
        match token {
            Some(token) => {
                self.in_flight.insert(token, job);
                None
            }
            None => {
                log::warn!("{}: dispatch failed", job.label());
                self.ended(&job, clock, out);
                Some(job)
            }
        }
    }

    /// The callout `token` answered: its job, if it is one of ours.
    pub fn answered(&mut self, token: u32, clock: &dyn Clock, out: &mut VecDeque<Command>) -> Option<Job> {
        let job = self.in_flight.remove(&token)?;
        self.ended(&job, clock, out);
        Some(job)
    }

    /// The store does not know `commits` (an idemstore older than this filter): every commit
    /// goes alone from now on.
    pub fn stop_batching(&mut self) {
        self.batching = false;
    }

    /// A callout left the worker's hands: if it was the commit in flight, the commits held
    /// meanwhile go now, as few calls as the batch limits allow.
    fn ended(&mut self, job: &Job, clock: &dyn Clock, out: &mut VecDeque<Command>) {
        if !job.commit_flight() {
            return;
        }
        self.commit_flights = self.commit_flights.saturating_sub(1);
        if self.commit_flights > 0 || self.held.is_empty() {
            return;
        }
        let sent_us = clock.now_us();
        let mut batch: Vec<Job> = Vec::new();
        let mut bytes = 0;
        let mut held = std::mem::take(&mut self.held);
        // A batch has one retention: commits of routes with different ones go in different
        // batches (stable: in order within each).
        held.sort_by_key(|job| match &job.call {
            Call::Store(call) => call.retention_s(),
            _ => None,
        });
        for job in held {
            let (size, retention_s) = match &job.call {
                Call::Store(call @ StoreCall::Commit { record, .. }) => (record.len(), call.retention_s()),
                _ => (0, None),
            };
            let other_retention = batch.first().is_some_and(|first| match &first.call {
                Call::Store(call) => call.retention_s() != retention_s,
                _ => false,
            });
            if !batch.is_empty()
                && (batch.len() == idem_protocol::MAX_BATCH_ITEMS
                    || bytes + size > client::MAX_BATCH_BYTES
                    || other_retention)
            {
                self.dispatch_batch(std::mem::take(&mut batch), sent_us, out);
                bytes = 0;
            }
            bytes += size;
            batch.push(job);
        }
        self.dispatch_batch(batch, sent_us, out);
    }

    fn dispatch_batch(&mut self, mut items: Vec<Job>, sent_us: Option<u64>, out: &mut VecDeque<Command>) {
        match items.len() {
            0 => {}
            1 => {
                if let Some(job) = items.pop() {
                    self.dispatch(job, sent_us, out);
                }
            }
            _ => self.dispatch(Job::worker(Call::Batch(items)), sent_us, out),
        }
    }

    /// Hands a callout to the host.
    fn dispatch(&mut self, mut job: Job, sent_us: Option<u64>, out: &mut VecDeque<Command>) {
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
        out.push_back(Command::Dispatch(dispatch));
    }

    /// Callouts not yet answered, wherever they are.
    #[cfg(any(test, feature = "sim"))]
    pub fn pending(&self) -> usize {
        let streamed = self.stream.as_ref().map_or(0, StoreStream::pending);
        self.outbox.len() + self.held.len() + self.dispatching.len() + self.in_flight.len() + streamed
    }

    /// The store calls waiting for a wake-up.
    #[cfg(any(test, feature = "sim"))]
    pub fn queued(&self) -> impl Iterator<Item = &StoreCall> {
        self.outbox.iter().filter_map(|job| match &job.call {
            Call::Store(call) => Some(call),
            Call::Batch(_) | Call::Upstream(_) => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn commit(bytes: usize) -> Job {
        Job::worker(Call::Store(StoreCall::Commit {
            key: "k".into(),
            token: "t".into(),
            body_hash: "h".into(),
            record: vec![0; bytes],
            retention_s: 86_400,
        }))
    }

    fn callouts(json: &str) -> Callouts {
        Callouts::new(Rc::new(Config::from_json(json.as_bytes()).unwrap()))
    }

    #[test]
    fn a_large_commit_goes_as_a_callout_to_idemstore_and_on_the_stream_to_a_store_in_process() {
        let large = commit(wire::MAX_STREAM_RECORD + 1);
        let idemstore = callouts(r#"{"store_cluster":"idemstore"}"#);
        assert!(idemstore.streams(&commit(wire::MAX_STREAM_RECORD)) && !idemstore.streams(&large));
        // The native host has no cluster to call: a callout would fail to leave.
        let in_process = callouts(r#"{"store":{"memory":true}}"#);
        assert!(in_process.streams(&commit(wire::MAX_STREAM_RECORD)) && in_process.streams(&large));
        assert!(!callouts(r#"{"store_cluster":"idemstore","store_transport":"callout"}"#).streams(&commit(1)));
    }
}
