//! Who answers a store call a request's machine asks for: the worker's record cache (a retry of
//! a record the store replayed lately), the breaker (a `begin` skipped while the store times
//! out), the local fallback (a `begin` the store could not answer, and the commit or release of
//! a local lock), or the store over the network. While the store answers, what this worker does
//! with it is mirrored in the local store (see `fallback`), and the local records made in an
//! outage are handed back once it answers again.
//!
//! The root tick the fallback needs is [`StorePath::tick_ms`], asked for by the coordinator.

use std::collections::VecDeque;
use std::rc::Rc;

use crate::config::Config;
use crate::request::metrics::Metric;
use crate::store::client::{BeginAnswer, CalloutFault, LockToken, StoreCall};
use crate::store::record::Record;
use crate::worker::breaker::{Breaker, Gate};
use crate::worker::command::Command;
use crate::worker::env::{Clock, Env};
use crate::worker::fallback::{Fallback, LocalAnswer, HAND_BACK_TOKEN};
use crate::worker::record_cache::{Cached, RecordCache};

/// Whether the stream a call is for is still known to the coordinator, and still has a client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presence {
    /// Forgotten: nothing can be answered for it.
    Unknown,
    Live,
    /// Envoy destroyed it; its entry waits for a pending call.
    Gone,
}

/// Where a stream's store call went.
pub enum Routed {
    /// To the store: the caller sends it.
    Send(StoreCall),
    /// A `begin` answered without the store (the record cache, the local fallback): the outcome
    /// for the stream, then one more thing to count.
    Answered(LocalAnswer, Option<Metric>),
    /// Carried out here: the commit or release of a local lock.
    Done,
}

/// What the root's tick found.
#[derive(Default)]
pub struct Tick {
    /// Streams waiting for a local lock, with their answer now.
    pub due: Vec<(u32, LocalAnswer)>,
    /// Local records to commit to the store.
    pub hand_backs: Vec<StoreCall>,
    /// How many local records there are, when scanned.
    pub local_records: Option<usize>,
}

pub struct StorePath {
    cfg: Rc<Config>,
    /// Records recently replayed by this VM, to answer their retries without a store call.
    cache: RecordCache,
    /// Skips `begin`s while the store times out.
    breaker: Breaker,
    /// The local lock and records, while the store fails (`local_fallback`).
    fallback: Option<Fallback>,
}

impl StorePath {
    pub fn new(cfg: Rc<Config>) -> StorePath {
        StorePath {
            cache: RecordCache::new(cfg.record_cache_entries, cfg.record_cache_bytes),
            breaker: Breaker::new(cfg.breaker_failures, cfg.breaker_open_ms),
            fallback: Fallback::new(&cfg),
            cfg,
        }
    }

    /// Prepares the local fallback's shared data; `seed` is random per VM. Without it (the host
    /// refused) there is no local fallback.
    pub fn set_up(&mut self, env: &dyn Env, seed: u64) {
        if let Some(f) = &mut self.fallback {
            if !f.set_up(env, seed) {
                log::warn!("cannot set up the shared data: no local fallback while the store fails");
                self.fallback = None;
            }
        }
    }

    /// A store call `stream`'s machine asks for: sent, answered here, or carried out here.
    pub fn route(
        &mut self,
        call: StoreCall,
        stream: u32,
        presence: Presence,
        env: &dyn Env,
        out: &mut VecDeque<Command>,
    ) -> Routed {
        match call {
            StoreCall::Commit { key, token: LockToken::Local(owner), body_hash, record, .. } => {
                if let Some(f) = &mut self.fallback {
                    for (metric, n) in f.commit(env, &key, owner, &body_hash, &record, env.now_ms()) {
                        out.push_back(Command::Add { metric, n });
                    }
                }
                Routed::Done
            }
            // An attempt run under the local lock in an outage is released even when its answer
            // was lost: an in-doubt mark here would be this Envoy's alone, unseen by the others
            // and gone with it (docs/operations.md, "When the outcome is unknown").
            StoreCall::Release { key, token: LockToken::Local(owner), .. } => {
                if let Some(f) = &mut self.fallback {
                    f.release(env, &key, owner, env.now_ms());
                }
                Routed::Done
            }
            call => {
                match (&call, &mut self.fallback) {
                    (StoreCall::Commit { key, token: LockToken::Store(token), body_hash, .. }, Some(f)) => {
                        f.sent(env, key, token, body_hash, env.now_ms())
                    }
                    (StoreCall::Release { key, token: LockToken::Store(token), .. }, Some(f)) => {
                        f.released(env, key, token, env.now_ms())
                    }
                    _ => {}
                }
                if let (StoreCall::Begin { key, body_hash, .. }, Presence::Live | Presence::Gone) =
                    (&call, presence)
                {
                    if let Some(answer) = self.cached_begin(key, body_hash, env) {
                        return Routed::Answered(
                            LocalAnswer::Answer(Ok(answer), vec![Metric::CacheHits]),
                            None,
                        );
                    }
                    if self.skips_begin(env) {
                        let fault = CalloutFault::Skipped;
                        let outcome = self.begin_failed(stream, key, body_hash, fault, presence, env);
                        return Routed::Answered(outcome, Some(Metric::StoreSkipped));
                    }
                }
                Routed::Send(call)
            }
        }
    }

    /// The store could not answer `stream`'s `begin`: the local fallback's answer (for a stream
    /// that still has its client), or the fault.
    pub fn begin_failed(
        &mut self,
        stream: u32,
        key: &str,
        body_hash: &str,
        fault: CalloutFault,
        presence: Presence,
        env: &dyn Env,
    ) -> LocalAnswer {
        match &mut self.fallback {
            Some(f) if presence == Presence::Live => {
                f.begin(env, stream, key, body_hash, fault, env.now_ms())
            }
            _ => LocalAnswer::Answer(Err(fault), vec![]),
        }
    }

    /// The store granted `stream` its lock: mirrored in the local store (`None`: go on under
    /// it), unless that holds this key's answer already (a record made here in an outage, not
    /// yet handed back) or runs it (the stream waits). Then the local outcome, and the call that
    /// gives the store's lock back: the local record handed back under it, or a release.
    pub fn adopt(
        &mut self,
        stream: u32,
        key: &str,
        body_hash: &str,
        token: &LockToken,
        env: &dyn Env,
    ) -> Option<(LocalAnswer, StoreCall)> {
        let (Some(f), LockToken::Store(store_token)) = (&mut self.fallback, token) else { return None };
        let outcome = f.adopt(env, stream, key, body_hash, store_token, env.now_ms())?;
        let (key, token) = (key.to_string(), token.clone());
        let call = match &outcome {
            LocalAnswer::Answer(Ok(BeginAnswer::Replay(record)), _) => {
                let (retention_s, _) = self.cfg.longest_terms();
                StoreCall::Commit {
                    key,
                    token,
                    body_hash: body_hash.to_string(),
                    record: record.encode(),
                    retention_s,
                }
            }
            _ => StoreCall::Release { key, token, in_doubt: false },
        };
        Some((outcome, call))
    }

    /// A store call failed with `fault` on try `attempt`: what to send next, if anything. A
    /// commit whose retry failed too keeps its record here rather than losing it (the store's
    /// lock is left to its hand-back); else see [`StoreCall::after_fault`].
    pub fn after_fault(
        &mut self,
        call: &StoreCall,
        attempt: u32,
        env: &dyn Env,
        out: &mut VecDeque<Command>,
    ) -> Option<StoreCall> {
        let kept = match (call, &mut self.fallback) {
            (StoreCall::Commit { key, token: LockToken::Store(token), body_hash, record, .. }, Some(f))
                if attempt > 0 =>
            {
                let (kept, dropped) = f.keep(env, key, token, body_hash, record, env.now_ms());
                for (metric, n) in dropped {
                    out.push_back(Command::Add { metric, n });
                }
                kept
            }
            _ => false,
        };
        let next = call.after_fault(attempt).filter(|_| !kept)?;
        if let (StoreCall::Release { key, token: LockToken::Store(token), .. }, Some(f)) =
            (&next, &mut self.fallback)
        {
            f.released(env, key, token, env.now_ms());
        }
        Some(next)
    }

    /// The store answered a call: it is back, so hand-backs resume soon.
    pub fn store_answered(&mut self) {
        if let Some(f) = &mut self.fallback {
            f.store_answered();
        }
    }

    /// The store took a commit: its lock's mirror ends (the record's marker stays).
    pub fn committed(&mut self, call: &StoreCall) {
        if let (Some(f), StoreCall::Commit { token: LockToken::Store(token), .. }) =
            (&mut self.fallback, call)
        {
            f.forget(token);
        }
    }

    /// A hand-back of `key` ended (`ok`: the store has the record); else it is offered again.
    pub fn handed_back(&mut self, key: &str, ok: bool, env: &dyn Env) {
        if let Some(f) = &mut self.fallback {
            f.handed_back(env, key, ok, env.now_ms());
        }
    }

    /// Tells the breaker how a store call ended (`fault`: how it failed).
    pub fn observe(&mut self, fault: Option<CalloutFault>, clock: &dyn Clock) {
        // Only what costs a request its wait counts: an answer, or a timeout (a store that hangs).
        // A fast failure (reset, refused, no healthy host, garbage) fails open at once anyway.
        let timed_out = matches!(fault, Some(CalloutFault::Timeout));
        if timed_out || fault.is_none() {
            let now_ms = if timed_out { clock.now_ms() } else { None };
            if self.breaker.record(!timed_out, now_ms) {
                log::warn!(
                    "store timed out {} times in a row: begins skip it for {} ms, then one probes it",
                    self.cfg.breaker_failures,
                    self.cfg.breaker_open_ms
                );
            }
        }
    }

    /// Caches a record the store replayed, until the end of the lifetime the store gave it,
    /// counted from before the `begin` was sent (so never past the record's expiry in the store).
    pub fn remember(
        &mut self,
        key: &str,
        body_hash: &str,
        record: &Record,
        ttl_ms: Option<u64>,
        sent_us: Option<u64>,
        now_us: Option<u64>,
    ) {
        let (Some(ttl_ms), Some(sent), Some(now)) = (ttl_ms, sent_us, now_us) else { return };
        self.cache.remember(key, body_hash, record, (sent / 1000).saturating_add(ttl_ms), now / 1000);
    }

    /// The root's tick: waiters for a local lock look again, local records are handed back
    /// (`gone`: streams that no longer need an answer for a client). The caller asks for the
    /// next tick ([`Self::tick_ms`]) once it has carried this out.
    pub fn tick(&mut self, env: &dyn Env, gone: impl Fn(u32) -> bool) -> Tick {
        let Some(now_ms) = env.now_ms() else { return Tick::default() };
        let Some(scan_due) = self.fallback.as_ref().map(|f| f.scan_due(now_ms)) else {
            return Tick::default();
        };
        // With the breaker open, a scan due once its interval is over is the probe (no request
        // may come to probe it).
        let scan = self.breaker.is_closed() || scan_due && !self.skips_begin(env);
        let Some(f) = &mut self.fallback else { return Tick::default() };
        let due = f.due(env, now_ms, gone);
        let (claimed, local_records) = if scan { f.hand_backs(env, now_ms) } else { (vec![], None) };
        // A local record's route is not known any more: kept as long as the longest route's.
        let (retention_s, _) = self.cfg.longest_terms();
        // Under the store's lock it was made under, if any: the commit ends that lock too.
        let hand_backs = claimed
            .into_iter()
            .map(|h| StoreCall::Commit {
                key: h.key,
                token: LockToken::Store(if h.token.is_empty() {
                    HAND_BACK_TOKEN.to_string()
                } else {
                    h.token
                }),
                body_hash: h.body_hash,
                record: h.record,
                retention_s,
            })
            .collect();
        Tick { due, hand_backs, local_records }
    }

    /// The tick the local fallback needs now (0: none).
    pub fn tick_ms(&self) -> u64 {
        self.fallback.as_ref().map_or(0, Fallback::tick_ms)
    }

    /// The cache's answer to a `begin`, if it has one.
    fn cached_begin(&mut self, key: &str, body_hash: &str, clock: &dyn Clock) -> Option<BeginAnswer> {
        if !self.cache.is_enabled() || self.cache.is_empty() {
            return None;
        }
        match self.cache.lookup(key, body_hash, clock.now_ms()?) {
            Cached::Replay(record) => Some(BeginAnswer::Replay(record)),
            Cached::Mismatch => Some(BeginAnswer::Mismatch),
            Cached::Miss => None,
        }
    }

    /// Whether a `begin` skips the store, the breaker being open (or its probe out).
    fn skips_begin(&mut self, clock: &dyn Clock) -> bool {
        if self.breaker.is_closed() {
            return false;
        }
        match self.breaker.gate(clock.now_ms()) {
            Gate::Skip => true,
            Gate::Probe => {
                log::info!("probing the store with one begin");
                false
            }
            Gate::Call => false,
        }
    }

    #[cfg(test)]
    pub fn breaker_is_closed(&self) -> bool {
        self.breaker.is_closed()
    }

    /// Local records may wait to be handed back (known after the last scan).
    #[cfg(any(test, feature = "sim"))]
    pub fn hand_backs_due(&self) -> bool {
        self.fallback.as_ref().is_some_and(Fallback::hand_back_due)
    }

    /// Streams wait for a local lock another request holds.
    #[cfg(any(test, feature = "sim"))]
    pub fn is_waiting(&self) -> bool {
        self.fallback.as_ref().is_some_and(Fallback::is_waiting)
    }
}
