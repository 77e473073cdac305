//! The worker's store stream (`store_transport: stream`): one long-lived gRPC stream to the
//! store cluster over which the worker's store calls travel as messages, answered by id in
//! any order (`store::stream` is the wire).
//!
//! The stream belongs to the root context: Envoy registers it with the context that opens it,
//! and delivers its messages there, so it is opened only in a root callback. A call may go
//! out from a stream callback once the stream is open (the host sends it as the root).
//!
//! Its failures end calls as a callout's do, so that everything after (breaker, local
//! fallback, `failure_mode`, the commit's retry) is unchanged:
//! * the stream closes or resets: every call in flight on it fails as a reset callout;
//! * a call's answer does not come by its deadline (its callout's timeout): it fails as a
//!   timed-out callout, swept on the root's tick; and if nothing at all came on the stream
//!   since that call went out, the stream is silent (a frozen store keeps the connection open)
//!   and is replaced: new calls go on another, the others on it keep their own deadlines (a
//!   store that is only slow still answers them), then it is reset;
//! * bytes that are no answer: the stream is not to be trusted: it is reset at once and every
//!   call on it fails.
//!
//! After a stream failed, the next opens at once; if that one fails before anything was heard
//! on it, the one after waits a backoff (doubling up to half a second, with jitter), and calls meanwhile fail at
//! once as a refused callout does. An answer after its call's deadline, or on a replaced
//! stream, is dropped: its call has already ended.

use std::collections::{HashMap, VecDeque};
use std::rc::Rc;

use crate::config::Config;
use crate::request::metrics::Metric;
use crate::store::client::CalloutFault;
use crate::store::stream::{self as wire, Answered};
use crate::worker::command::Command;
use crate::worker::job::{Call, Job};

/// The root's tick while calls are in flight: deadlines are swept this often.
pub const SWEEP_MS: u64 = 50;
/// The backoff after the first failed reopen, doubled after each, up to [`MAX_BACKOFF_MS`]; each
/// wait is drawn between half and all of it.
const FIRST_BACKOFF_MS: u64 = 25;
const MAX_BACKOFF_MS: u64 = 500;
/// The gRPC status of a refused secret.
const UNAUTHENTICATED: u32 = 16;

enum State {
    /// No stream; the next may open at this time (milliseconds since the Unix epoch).
    Closed { reopen_at_ms: u64 },
    /// Asked the host to open one ([`Command::OpenStream`]), token not yet known.
    Opening,
    Open {
        token: u32,
        /// When something last came on it (its opening counts).
        heard_ms: u64,
    },
}

/// One of the worker's streams (`store_streams` of them, so that a worker's calls spread over
/// several idemstores: Envoy picks the host of each stream as it opens).
struct Lane {
    state: State,
    /// Opens that failed in a row, without anything heard on them.
    failures: u32,
    /// Calls for the stream being opened, sent once it is.
    waiting: Vec<(u64, Job)>,
}

impl Lane {
    /// Closed, and may open again at `now_ms`.
    fn may_reopen(&self, now_ms: u64) -> bool {
        matches!(self.state, State::Closed { reopen_at_ms } if now_ms >= reopen_at_ms)
    }
}

struct Flight {
    job: Job,
    /// The stream it went on.
    token: u32,
    sent_ms: u64,
    deadline_ms: u64,
}

/// How a call on the stream ended.
pub enum Ended {
    Answered(Job, Answered),
    Failed(Job, CalloutFault),
}

pub struct StoreStream {
    cfg: Rc<Config>,
    lanes: Vec<Lane>,
    /// The lane the next call tries first (round robin).
    next_lane: usize,
    /// Lanes asked to open, in the order of their [`Command::OpenStream`]s.
    opening: VecDeque<usize>,
    next_id: u64,
    flights: HashMap<u64, Flight>,
    /// Streams given up as silent: no new call goes there, the calls on them keep their own
    /// deadlines (a store that is only slow still answers them), then they are reset.
    draining: Vec<u32>,
    /// A stream may still be opened in this root callback: at most one is. Envoy answers an open
    /// that finds no healthy host inside the call, and a second such open in the same call into
    /// the VM never returned (measured: the worker's VM stopped answering).
    may_open: bool,
    rng: u64,
}

impl StoreStream {
    pub fn new(cfg: Rc<Config>, seed: u64) -> StoreStream {
        let lanes = (0..cfg.store_streams.max(1))
            .map(|_| Lane { state: State::Closed { reopen_at_ms: 0 }, failures: 0, waiting: Vec::new() })
            .collect();
        StoreStream {
            cfg,
            lanes,
            next_lane: 0,
            opening: VecDeque::new(),
            next_id: 1,
            flights: HashMap::new(),
            draining: Vec::new(),
            may_open: true,
            rng: seed | 1,
        }
    }

    /// A root callback begins: it may open one stream.
    pub fn new_callback(&mut self) {
        self.may_open = true;
    }

    /// A call can go at once, from any callback: a stream is open.
    pub fn can_send(&self) -> bool {
        self.lanes.iter().any(|l| matches!(l.state, State::Open { .. }))
    }

    /// Sends `job` (a store call that [`wire::fits`]) on the next stream in turn; `root`: in a
    /// root callback, where a stream may be opened. Gives the job back if it cannot go now (every
    /// stream backing off after failed opens, or none open outside a root callback).
    pub fn send(&mut self, job: Job, now_ms: u64, root: bool, out: &mut VecDeque<Command>) -> Option<Job> {
        let n = self.lanes.len();
        let start = self.next_lane;
        self.next_lane = (start + 1) % n;
        let may_open = self.may_open;
        let usable = |lane: &Lane| match lane.state {
            State::Open { .. } => true,
            State::Opening => root,
            State::Closed { .. } => root && may_open && lane.may_reopen(now_ms),
        };
        let Some(pick) = (0..n).map(|k| (start + k) % n).find(|&i| usable(&self.lanes[i])) else {
            return Some(job);
        };
        if matches!(self.lanes[pick].state, State::Closed { .. }) && !self.open(pick, out) {
            return Some(job);
        }
        let id = self.next_id;
        self.next_id += 1;
        match self.lanes[pick].state {
            State::Open { token, .. } => self.transmit(token, id, job, now_ms, out),
            _ => self.lanes[pick].waiting.push((id, job)),
        }
        None
    }

    /// A stream is closed and may reopen now: the next root callback should open it
    /// ([`Self::open_due`]), so that calls sent from stream callbacks, which only go on open
    /// streams, spread over all of them again.
    pub fn wants_open(&self, now_ms: u64) -> bool {
        self.lanes.iter().any(|l| l.may_reopen(now_ms))
    }

    /// In a root callback: opens a closed stream that may reopen (one a callback), once the
    /// worker has used its streams (an Envoy that guards nothing opens none).
    pub fn open_due(&mut self, now_ms: u64, out: &mut VecDeque<Command>) {
        if self.next_id == 1 {
            return;
        }
        let due = self.lanes.iter().position(|l| l.may_reopen(now_ms));
        if let (Some(i), true) = (due, self.may_open) {
            self.open(i, out);
        }
    }

    /// Asks the host to open lane `i`'s stream; `false` if it cannot be named.
    fn open(&mut self, i: usize, out: &mut VecDeque<Command>) -> bool {
        self.may_open = false;
        let Some(service) = wire::grpc_service(&self.cfg.store_cluster) else {
            log::warn!("cannot open the store stream: the store cluster's name is too long");
            return false;
        };
        self.lanes[i].state = State::Opening;
        self.opening.push_back(i);
        let mut metadata = Vec::new();
        if let Some(secret) = &self.cfg.store_secret {
            metadata.push((idem_protocol::HEADER_SECRET.to_string(), secret.as_str().to_string()));
        }
        out.push_back(Command::OpenStream { service, metadata });
        true
    }

    fn transmit(&mut self, token: u32, id: u64, job: Job, now_ms: u64, out: &mut VecDeque<Command>) {
        let Call::Store(call) = &job.call else { return };
        let message = wire::encode(call, id, &self.cfg, Some(now_ms));
        let deadline_ms = now_ms.saturating_add(wire::timeout_ms(call, &self.cfg));
        self.flights.insert(id, Flight { job, token, sent_ms: now_ms, deadline_ms });
        out.push_back(Command::StreamSend { token, message });
    }

    /// The host carried out the oldest [`Command::OpenStream`] not yet reported: `token` is
    /// Envoy's, `None` if it refused. Returns the calls that were waiting for it, if they
    /// cannot go.
    pub fn opened(&mut self, token: Option<u32>, now_ms: u64, out: &mut VecDeque<Command>) -> Vec<Ended> {
        let Some(i) = self.opening.pop_front() else { return vec![] };
        let waiting = std::mem::take(&mut self.lanes[i].waiting);
        match token {
            Some(token) => {
                self.lanes[i].state = State::Open { token, heard_ms: now_ms };
                for (id, job) in waiting {
                    self.transmit(token, id, job, now_ms, out);
                }
                vec![]
            }
            None => {
                log::warn!("cannot open the store stream to {}", self.cfg.store_cluster);
                self.back_off(i, now_ms);
                waiting
                    .into_iter()
                    .map(|(_, job)| Ended::Failed(Job { sent_us: None, ..job }, CalloutFault::Dispatch))
                    .collect()
            }
        }
    }

    fn lane_of(&self, token: u32) -> Option<usize> {
        self.lanes.iter().position(|l| matches!(l.state, State::Open { token: t, .. } if t == token))
    }

    /// A message came on stream `token`: the call it answers, if still in flight; every call
    /// on the stream, failed, if it is no answer (the stream is reset).
    pub fn message(
        &mut self,
        token: u32,
        bytes: &[u8],
        now_ms: u64,
        out: &mut VecDeque<Command>,
    ) -> Vec<Ended> {
        let lane = self.lane_of(token);
        if lane.is_none() && !self.draining.contains(&token) {
            return vec![];
        }
        let Some((id, answer)) = wire::decode(bytes) else {
            log::warn!("the store stream carried {} bytes that are no answer: resetting it", bytes.len());
            out.push_back(Command::CancelStream { token });
            return self.end_stream(token, now_ms, CalloutFault::Garbage("not a stream answer"), out);
        };
        if let Some(i) = lane {
            self.lanes[i].state = State::Open { token, heard_ms: now_ms };
            self.lanes[i].failures = 0;
        }
        let ended = match self.flights.get(&id) {
            Some(f) if f.token == token => {
                self.flights.remove(&id).map(|f| vec![Ended::Answered(f.job, answer)]).unwrap_or_default()
            }
            // Its call ended at its deadline.
            _ => {
                log::debug!("store stream: answer {id} came after its call ended");
                vec![]
            }
        };
        self.drained(out);
        ended
    }

    /// Stream `token` closed (the store ended it, the connection reset, it never connected):
    /// every call in flight on it fails as reset.
    pub fn closed(
        &mut self,
        token: u32,
        status: u32,
        now_ms: u64,
        out: &mut VecDeque<Command>,
    ) -> Vec<Ended> {
        if self.lane_of(token).is_none() && !self.draining.contains(&token) {
            return vec![];
        }
        match status {
            // idemstore's only refusal of a stream: its shared secret was missing or wrong.
            UNAUTHENTICATED => log::warn!(
                "the store stream closed: store refused the secret (gRPC UNAUTHENTICATED, the stream's 401): \
                 check store_secret / store_secret_env against idemstore's --secret"
            ),
            _ => log::warn!("the store stream closed (gRPC status {status})"),
        }
        self.end_stream(token, now_ms, CalloutFault::Reset, out)
    }

    /// The host could not send on stream `token`: it is reset, and its calls fail as reset.
    pub fn send_failed(&mut self, token: u32, now_ms: u64, out: &mut VecDeque<Command>) -> Vec<Ended> {
        if self.lane_of(token).is_none() {
            return vec![];
        }
        log::warn!("cannot send on the store stream: resetting it");
        out.push_back(Command::CancelStream { token });
        self.end_stream(token, now_ms, CalloutFault::Reset, out)
    }

    /// The root's tick: calls past their deadline fail as timed out. A stream on which nothing
    /// came since the oldest of them went out is silent: no new call goes there, and it is reset
    /// once the calls on it have ended.
    pub fn sweep(&mut self, now_ms: u64, out: &mut VecDeque<Command>) -> Vec<Ended> {
        let late: Vec<u64> =
            self.flights.iter().filter(|(_, f)| f.deadline_ms <= now_ms).map(|(&id, _)| id).collect();
        let mut ended = Vec::new();
        let mut oldest: HashMap<u32, u64> = HashMap::new();
        for id in late {
            if let Some(f) = self.flights.remove(&id) {
                let at = oldest.entry(f.token).or_insert(f.sent_ms);
                *at = (*at).min(f.sent_ms);
                ended.push(Ended::Failed(f.job, CalloutFault::Timeout));
            }
        }
        for i in 0..self.lanes.len() {
            let State::Open { token, heard_ms } = self.lanes[i].state else { continue };
            if oldest.get(&token).is_some_and(|&sent| heard_ms <= sent) {
                log::warn!(
                    "nothing came on the store stream for {} ms: new calls go on another",
                    now_ms.saturating_sub(heard_ms)
                );
                out.push_back(Command::Count(Metric::StoreStreamResets));
                self.draining.push(token);
                self.back_off(i, now_ms);
            }
        }
        self.drained(out);
        ended
    }

    /// Resets the silent streams no call is on any more.
    fn drained(&mut self, out: &mut VecDeque<Command>) {
        if self.draining.is_empty() {
            return;
        }
        let flights = &self.flights;
        self.draining.retain(|&token| {
            let busy = flights.values().any(|f| f.token == token);
            if !busy {
                out.push_back(Command::CancelStream { token });
            }
            busy
        });
    }

    /// Stream `token` is gone, with every call in flight on it.
    fn end_stream(
        &mut self,
        token: u32,
        now_ms: u64,
        fault: CalloutFault,
        out: &mut VecDeque<Command>,
    ) -> Vec<Ended> {
        if let Some(i) = self.lane_of(token) {
            out.push_back(Command::Count(Metric::StoreStreamResets));
            self.back_off(i, now_ms);
        }
        self.draining.retain(|&t| t != token);
        let mut ids: Vec<u64> =
            self.flights.iter().filter(|(_, f)| f.token == token).map(|(&id, _)| id).collect();
        ids.sort_unstable();
        ids.into_iter()
            .filter_map(|id| self.flights.remove(&id))
            .map(|f| Ended::Failed(f.job, fault))
            .collect()
    }

    /// Lane `i`'s stream is gone: the next opens at once after a stream that worked, after a
    /// backoff after one that did not.
    fn back_off(&mut self, i: usize, now_ms: u64) {
        let wait_ms = match self.lanes[i].failures {
            0 => 0,
            n => {
                let full = FIRST_BACKOFF_MS.saturating_mul(1 << (n - 1).min(10)).min(MAX_BACKOFF_MS);
                full / 2 + self.random() % (full / 2 + 1)
            }
        };
        let lane = &mut self.lanes[i];
        lane.failures = lane.failures.saturating_add(1);
        lane.state = State::Closed { reopen_at_ms: now_ms.saturating_add(wait_ms) };
    }

    fn random(&mut self) -> u64 {
        // xorshift64: jitter only, so that workers do not reopen in step.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    /// The tick this stream needs: deadlines to sweep while calls are in flight. It keeps
    /// running while a stream is open, rather than being set and cleared around every call
    /// (on a quiet worker that was two timer changes per call).
    pub fn tick_ms(&self) -> u64 {
        if self.flights.is_empty() && !self.can_send() {
            0
        } else {
            SWEEP_MS
        }
    }

    /// Calls sent or waiting to be.
    pub fn pending(&self) -> usize {
        self.flights.len() + self.lanes.iter().map(|l| l.waiting.len()).sum::<usize>()
    }

    /// Whether call `id` waits for its answer.
    #[cfg(any(test, feature = "sim"))]
    pub fn awaits(&self, id: u64) -> bool {
        self.flights.contains_key(&id)
    }

    /// The keys of the calls waiting for the oldest stream asked to open.
    #[cfg(any(test, feature = "sim"))]
    pub fn waiting_keys(&self) -> Vec<String> {
        let Some(&i) = self.opening.front() else { return vec![] };
        self.lanes[i]
            .waiting
            .iter()
            .filter_map(|(_, job)| match &job.call {
                Call::Store(c) => Some(c.key().to_string()),
                _ => None,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::client::StoreCall;
    use idem_protocol::stream as pb;
    use prost::Message as _;

    fn stream() -> StoreStream {
        let cfg = Config::from_json(
            br#"{"store_cluster":"idemstore","store_timeout_ms":700,"lock_wait_ms":300,"store_streams":1}"#,
        )
        .unwrap();
        StoreStream::new(Rc::new(cfg), 42)
    }

    fn begin(key: &str) -> Job {
        Job::new(
            7,
            Rc::from("-"),
            Call::Store(StoreCall::Begin {
                key: key.into(),
                body_hash: "h".into(),
                lock: crate::store::client::LockTerms { ttl_ms: 30_000, wait_ms: 300 },
                hold: None,
            }),
        )
    }

    fn sent(out: &mut VecDeque<Command>) -> Vec<(u32, u64)> {
        out.drain(..)
            .filter_map(|c| match c {
                Command::StreamSend { token, message } => {
                    Some((token, pb::Call::decode(message.as_slice()).unwrap().id))
                }
                _ => None,
            })
            .collect()
    }

    fn locked(id: u64) -> Vec<u8> {
        let begun = pb::Begun { outcome: "locked".into(), token: "tok".into(), ..pb::Begun::default() };
        pb::Answer { id, outcome: Some(pb::Outcome::Begun(begun)) }.encode_to_vec()
    }

    fn faults(ended: &[Ended]) -> Vec<CalloutFault> {
        ended
            .iter()
            .map(|e| match e {
                Ended::Failed(_, f) => *f,
                Ended::Answered(..) => panic!("an answer"),
            })
            .collect()
    }

    /// Opens the stream as token `token` at `now` with one call; returns its id.
    fn open(s: &mut StoreStream, token: u32, now: u64, out: &mut VecDeque<Command>) -> u64 {
        s.new_callback();
        assert!(s.send(begin("a"), now, true, out).is_none());
        assert!(matches!(out.pop_front(), Some(Command::OpenStream { .. })));
        assert!(s.opened(Some(token), now, out).is_empty());
        sent(out)[0].1
    }

    #[test]
    fn calls_wait_for_the_stream_to_open_and_answers_find_them_by_id_in_any_order() {
        let (mut s, mut out) = (stream(), VecDeque::new());
        assert!(s.send(begin("a"), 1000, false, &mut out).is_some(), "no stream outside the root");
        s.new_callback();
        assert!(s.send(begin("a"), 1000, true, &mut out).is_none());
        s.new_callback();
        assert!(s.send(begin("b"), 1000, true, &mut out).is_none());
        assert_eq!(out.iter().filter(|c| matches!(c, Command::OpenStream { .. })).count(), 1);
        out.clear();
        s.opened(Some(5), 1000, &mut out);
        let ids = sent(&mut out);
        assert_eq!(ids, [(5, 1), (5, 2)]);
        assert!(s.send(begin("c"), 1001, false, &mut out).is_none(), "open: from a stream callback too");
        assert!(
            matches!(&s.message(5, &locked(2), 1002, &mut out)[..], [Ended::Answered(j, _)] if j.stream == 7)
        );
        assert!(s.message(5, &locked(2), 1003, &mut out).is_empty(), "answered once");
        assert!(s.message(9, &locked(1), 1003, &mut out).is_empty(), "another stream's");
        assert_eq!(s.pending(), 2);
    }

    #[test]
    fn a_reset_fails_every_call_on_the_stream_and_the_next_opens_at_once_then_backs_off() {
        let (mut s, mut out) = (stream(), VecDeque::new());
        open(&mut s, 5, 1000, &mut out);
        s.new_callback();
        s.send(begin("b"), 1000, true, &mut out);
        s.message(5, &locked(1), 1001, &mut out);
        out.clear();
        assert_eq!(faults(&s.closed(5, 14, 1002, &mut out)), [CalloutFault::Reset]);
        assert!(out.contains(&Command::Count(Metric::StoreStreamResets)));
        assert!(s.closed(5, 14, 1002, &mut out).is_empty(), "once");
        out.clear();
        // It had worked: the next opens at once; that one fails before anything came on it.
        open(&mut s, 6, 1002, &mut out);
        assert_eq!(faults(&s.closed(6, 14, 1003, &mut out)), [CalloutFault::Reset]);
        out.clear();
        // Now a backoff (12..=25 ms): calls fail at once meanwhile, as a refused callout does.
        s.new_callback();
        assert!(s.send(begin("c"), 1003, true, &mut out).is_some());
        out.clear();
        s.new_callback();
        assert!(s.send(begin("c"), 1003 + 25, true, &mut out).is_none());
        assert!(matches!(out.pop_front(), Some(Command::OpenStream { .. })));
        assert!(!faults(&s.opened(None, 1030, &mut out)).is_empty(), "a refused open fails its calls");
    }

    #[test]
    fn backoff_doubles_up_to_half_a_second_with_jitter() {
        let (mut s, mut out) = (stream(), VecDeque::new());
        let mut now = 1_000_000;
        let mut waits = Vec::new();
        for token in 1..12 {
            let mut t = now;
            s.new_callback();
            while s.send(begin("a"), t, true, &mut out).is_some() {
                t += 1;
            }
            waits.push(t - now);
            s.opened(Some(token), t, &mut out);
            s.closed(token, 14, t, &mut out);
            now = t;
            out.clear();
        }
        assert_eq!(waits[..2], [0, 0], "{waits:?}");
        for (i, w) in waits.iter().enumerate().skip(2) {
            let full = (25u64 << (i - 2)).min(500);
            assert!((full / 2..=full).contains(w), "wait {i}: {w} ms, {waits:?}");
        }
    }

    #[test]
    fn a_silent_stream_takes_no_new_call_and_is_reset_once_its_calls_timed_out() {
        let (mut s, mut out) = (stream(), VecDeque::new());
        open(&mut s, 5, 1000, &mut out);
        s.new_callback();
        s.send(begin("b"), 1500, true, &mut out);
        out.clear();
        assert!(s.sweep(1999, &mut out).is_empty(), "the begin's deadline is 700 + 300 ms");
        // Nothing came on the stream since the first call went out: it is silent. The second
        // call keeps its own deadline there (a slow store still answers it).
        assert_eq!(faults(&s.sweep(2000, &mut out)), [CalloutFault::Timeout]);
        assert_eq!(out.drain(..).collect::<Vec<_>>(), [Command::Count(Metric::StoreStreamResets)]);
        // New calls open another stream.
        s.new_callback();
        assert!(s.send(begin("c"), 2001, true, &mut out).is_none());
        assert!(matches!(out.pop_front(), Some(Command::OpenStream { .. })));
        s.opened(Some(6), 2001, &mut out);
        assert_eq!(sent(&mut out), [(6, 3)]);
        // The slow store answers the second call on the old stream; then it is reset.
        assert!(matches!(&s.message(5, &locked(2), 2100, &mut out)[..], [Ended::Answered(..)]));
        assert_eq!(out.pop_front(), Some(Command::CancelStream { token: 5 }));
        assert!(s.message(5, &locked(1), 2101, &mut out).is_empty(), "a reset stream's answer");
        assert_eq!(s.pending(), 1);
    }

    #[test]
    fn a_silent_streams_last_call_timing_out_resets_it() {
        let (mut s, mut out) = (stream(), VecDeque::new());
        open(&mut s, 5, 1000, &mut out);
        s.new_callback();
        s.send(begin("b"), 1500, true, &mut out);
        s.sweep(2000, &mut out);
        out.clear();
        assert_eq!(faults(&s.sweep(2500, &mut out)), [CalloutFault::Timeout]);
        assert_eq!(out.pop_front(), Some(Command::CancelStream { token: 5 }));
        assert_eq!(s.pending(), 0);
    }

    #[test]
    fn calls_take_the_streams_in_turn() {
        let cfg = Config::from_json(br#"{"store_cluster":"idemstore","store_streams":2}"#).unwrap();
        let (mut s, mut out) = (StoreStream::new(Rc::new(cfg), 1), VecDeque::new());
        s.new_callback();
        s.send(begin("a"), 1000, true, &mut out);
        s.new_callback();
        s.send(begin("b"), 1000, true, &mut out);
        assert_eq!(out.iter().filter(|c| matches!(c, Command::OpenStream { .. })).count(), 2);
        out.clear();
        s.opened(Some(5), 1000, &mut out);
        s.opened(Some(7), 1000, &mut out);
        assert_eq!(sent(&mut out), [(5, 1), (7, 2)]);
        for key in ["c", "d", "e"] {
            s.send(begin(key), 1001, false, &mut out);
        }
        assert_eq!(sent(&mut out), [(5, 3), (7, 4), (5, 5)]);
        // One resets: its calls fail, the other takes every call until it is back.
        assert_eq!(faults(&s.closed(5, 14, 1002, &mut out)).len(), 3);
        out.clear();
        for key in ["f", "g"] {
            s.send(begin(key), 1003, false, &mut out);
        }
        assert_eq!(sent(&mut out), [(7, 6), (7, 7)]);
        // The root opens it again when asked (a stream callback asks for a wake-up): calls
        // spread over both once more.
        assert!(s.wants_open(1003));
        s.new_callback();
        s.open_due(1003, &mut out);
        assert!(matches!(out.pop_front(), Some(Command::OpenStream { .. })));
        s.opened(Some(9), 1003, &mut out);
        assert!(!s.wants_open(1004));
        for key in ["h", "i"] {
            s.send(begin(key), 1004, false, &mut out);
        }
        let mut tokens: Vec<u32> = sent(&mut out).into_iter().map(|(t, _)| t).collect();
        tokens.sort_unstable();
        assert_eq!(tokens, [7, 9]);
    }

    #[test]
    fn a_worker_that_never_called_the_store_opens_nothing() {
        let (mut s, mut out) = (stream(), VecDeque::new());
        s.open_due(1000, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn a_slow_call_on_a_stream_that_answers_others_only_times_out() {
        let (mut s, mut out) = (stream(), VecDeque::new());
        open(&mut s, 5, 1000, &mut out);
        s.new_callback();
        s.send(begin("b"), 1100, true, &mut out);
        s.message(5, &locked(2), 1200, &mut out);
        out.clear();
        assert_eq!(faults(&s.sweep(2000, &mut out)), [CalloutFault::Timeout]);
        assert!(out.is_empty(), "kept: {out:?}");
        assert!(s.can_send());
        assert!(s.message(5, &locked(1), 2100, &mut out).is_empty(), "an answer after its deadline");
    }

    #[test]
    fn bytes_that_are_no_answer_replace_the_stream() {
        let (mut s, mut out) = (stream(), VecDeque::new());
        open(&mut s, 5, 1000, &mut out);
        out.clear();
        let ended = s.message(5, b"\xff\xff", 1001, &mut out);
        assert_eq!(faults(&ended), [CalloutFault::Garbage("not a stream answer")]);
        assert_eq!(out.pop_front(), Some(Command::CancelStream { token: 5 }));
        assert!(!s.can_send());
    }
}
