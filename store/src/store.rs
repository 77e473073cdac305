//! The protocol's store operations as a server's routes call them (idemstore's HTTP layer, and
//! a store-stream call in [`crate::calls`]): [`Store::begin`] (and
//! [`Store::begin_with`]), [`Store::commit`] and [`Store::release`],
//! plus [`Store::health`], over one backend, with the `begin` long-poll: a lock held elsewhere
//! is waited on, woken by [`Waiters`] and re-checked with backoff. A `commits` call is one
//! [`Store::commit`] per item (the HTTP layer's loop); the operator's lookups, deletes and
//! resolutions go to [`Store::backend`] directly.
//!
//! Owns the lock tokens ([`new_token`]) and the waiters of one instance, and tells its
//! [`Observer`] (idemstore's Prometheus metrics) when a `begin` waits; the [`Observer`] trait
//! also names what a served call tells ([`crate::calls`] calls it). Uses [`crate::backend`] and
//! [`crate::waiters`], never a server.

use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use idem_protocol::BeginOutcome;

use crate::backend::{Attempt, Backend, BackendError, Commit, CommitOutcome, Hold, ReleaseOutcome, Result};
use crate::waiters::{RemoteWakeups, Waiters};

/// First re-check delay for a held lock; doubles up to [`MAX_RECHECK`]. Commits and releases
/// wake waiters at once (through this instance directly, through others by Redis pub/sub);
/// re-checks are the fallback for wake-ups that cannot arrive (the subscription down).
const MIN_RECHECK: Duration = Duration::from_millis(20);
/// Bounds how late a waiter notices a holder finishing when no wake-up reaches it.
const MAX_RECHECK: Duration = Duration::from_millis(250);

/// The answer to `begin` after any waiting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Begin {
    /// The record's bytes and remaining lifetime (see [`Attempt::Record`]).
    Record(Bytes, Option<Duration>),
    Mismatch,
    Locked {
        token: String,
    },
    /// Another request still held the lock at the last attempt (the wait was `0`, ran out, or
    /// was cut short by [`Store::stop_waiting`]); `remaining` is how long that lock still
    /// lived then, as the backend told (`None`: unknown).
    Busy {
        remaining: Option<Duration>,
    },
    /// The caller had given up on the call before it could be served (see
    /// [`Store::begin_with`]): nothing was looked up or locked.
    Expired,
    /// (with a hold) An earlier attempt's outcome is unknown (see [`Attempt::InDoubt`]):
    /// final, like [`Begin::Mismatch`]; no lock was taken.
    InDoubt {
        token: String,
        started_ms: u64,
        running: Duration,
    },
}

/// A store operation a call names, once past validation (what a backend failure or a cancelled
/// call is counted under).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Begin,
    Commit,
    Release,
}

/// How a call past validation was answered: the protocol's outcome, which names its [`Op`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answered {
    Begin(BeginOutcome),
    Commit(CommitOutcome),
    Release(ReleaseOutcome),
}

impl Answered {
    pub fn op(self) -> Op {
        match self {
            Self::Begin(_) => Op::Begin,
            Self::Commit(_) => Op::Commit,
            Self::Release(_) => Op::Release,
        }
    }
}

/// Why a call was refused before the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejected {
    /// A field missing, out of range or malformed, or a call without an operation.
    Invalid,
    /// A commit's record over the host's limit.
    TooLarge,
}

/// What a [`Store`] and the calls served over it ([`crate::calls`]) tell their owner, the part
/// of their work no caller sees: idemstore counts it in its Prometheus metrics; [`NoObserver`]
/// for a user that counts nothing. A trait, so that this crate needs no metrics library and
/// each host keeps its own.
///
/// The store itself tells of a `begin`'s wait. A served call tells how it ended, exactly once
/// if it got past validation (answered, failed or cancelled, with the time since it arrived),
/// or that it was refused; every such method does nothing unless the observer counts it, so a
/// host that serves no calls implements only the waits.
pub trait Observer {
    /// The observer of a new store over `backend`, made by [`Store::new`] and
    /// [`Store::with_recheck`] (idemstore's metrics export the in-memory backend's gauges, for
    /// that backend only).
    fn for_backend<B: Backend>(backend: &B) -> Self;

    /// A `begin` found the lock held and waits for it (once per call, whatever its re-checks).
    fn wait_started(&self);

    /// That wait is over after `waited`: answered, or the call dropped mid-wait.
    fn wait_ended(&self, waited: Duration);

    /// A call was refused before the backend.
    fn call_rejected(&self, _why: Rejected) {}

    /// A call past validation answered `outcome`, `elapsed` after it arrived (a `begin`'s wait
    /// included).
    fn call_answered(&self, _outcome: Answered, _elapsed: Duration) {}

    /// The backend failed a call past validation (or refused it: the in-memory backend full).
    fn call_failed(&self, _op: Op, _error: &BackendError, _elapsed: Duration) {}

    /// A call past validation was dropped before its answer (its caller gone, its task ended);
    /// the backend may have done the operation all the same.
    fn call_cancelled(&self, _op: Op, _elapsed: Duration) {}

    /// A release past validation keeps the attempt's trace (in doubt: sent, and no answer came
    /// back); it also ends as any call does.
    fn in_doubt_release(&self) {}
}

/// An [`Observer`] that counts nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoObserver;

impl Observer for NoObserver {
    fn for_backend<B: Backend>(_: &B) -> Self {
        Self
    }

    fn wait_started(&self) {}

    fn wait_ended(&self, _: Duration) {}
}

/// The operations of one instance over its backend `B`, observed by `O`: none by default
/// (`Store<B>`); idemstore's is `Store<B, Metrics>` (`idemstore::store::Store`).
#[derive(Debug)]
pub struct Store<B, O = NoObserver> {
    backend: B,
    waiters: Arc<Waiters>,
    stopping: watch::Sender<bool>,
    recheck: (Duration, Duration),
    /// `begin` calls parked on a held lock right now.
    parked: AtomicUsize,
    remote: watch::Receiver<RemoteWakeups>,
    /// Forwards other instances' wake-ups to `waiters`; aborted with the store.
    remote_task: Option<JoinHandle<()>>,
    observer: O,
}

impl<B: Backend, O: Observer> Store<B, O> {
    pub fn new(backend: B) -> Self {
        Self::with_recheck(backend, MIN_RECHECK, MAX_RECHECK)
    }

    /// `min`..`max` bound the re-check delay while a lock is held elsewhere (tests widen
    /// them to tell a wake-up from a re-check).
    ///
    /// Starts listening for other instances' wake-ups when the backend has them (Redis), so
    /// call it within a tokio runtime.
    pub fn with_recheck(backend: B, min: Duration, max: Duration) -> Self {
        let waiters = Arc::new(Waiters::default());
        let (status, remote) = watch::channel(RemoteWakeups::default());
        let remote_task = backend.spawn_remote_wakeups(Arc::downgrade(&waiters), status);
        let observer = O::for_backend(&backend);
        Self {
            backend,
            waiters,
            stopping: watch::Sender::new(false),
            recheck: (min, max.max(min)),
            parked: AtomicUsize::new(0),
            remote,
            remote_task,
            observer,
        }
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// This store's [`Observer`] (idemstore's: its Prometheus metrics, which its HTTP layer
    /// counts requests in too).
    pub fn observer(&self) -> &O {
        &self.observer
    }

    pub fn waiters(&self) -> &Waiters {
        &self.waiters
    }

    /// Whether wake-ups from other idemstore instances reach this one (never, in memory).
    pub fn remote_wakeups(&self) -> watch::Receiver<RemoteWakeups> {
        self.remote.clone()
    }

    /// `begin` calls waiting on a held lock right now, between two attempts.
    pub fn parked(&self) -> usize {
        self.parked.load(Ordering::Relaxed)
    }

    /// Becomes `true` at [`Store::stop_waiting`]: what a long-lived stream ends on.
    pub fn stopping(&self) -> watch::Receiver<bool> {
        self.stopping.subscribe()
    }

    /// Ends every pending wait with `busy`, so a shutdown does not sit out long-polls.
    pub fn stop_waiting(&self) {
        self.stopping.send_replace(true);
    }

    /// Record, fresh lock or mismatch; when another request holds the lock, waits up to
    /// `wait` for it to commit or release and tries again, answering `busy` at the deadline
    /// with the holder's remaining lock time from the last attempt. A zero `wait` is a single
    /// attempt: `busy` at once if the lock is held.
    pub async fn begin(
        &self,
        key: &str,
        body_hash: &str,
        lock_ttl: Duration,
        wait: Duration,
    ) -> Result<Begin> {
        self.begin_with(key, body_hash, lock_ttl, wait, None, None).await
    }

    /// [`Store::begin`] for a caller that gives up at `give_up`: no attempt is made at or after
    /// it (the answer is [`Begin::Expired`]) and no wait lasts past it, so a call served late (a
    /// store frozen, then thawed, works through what was queued meanwhile) never takes a lock
    /// nobody waits for. With `hold`, it keeps a trace of the attempt it locks for and answers
    /// [`Begin::InDoubt`] for an earlier attempt's (see [`crate::backend`]). A wait for a held
    /// lock ends as usual; a release that keeps its trace (`in_doubt`) wakes the waiters, and
    /// their next attempt finds the key in doubt.
    pub async fn begin_with(
        &self,
        key: &str,
        body_hash: &str,
        lock_ttl: Duration,
        wait: Duration,
        give_up: Option<Instant>,
        hold: Option<Hold<'_>>,
    ) -> Result<Begin> {
        let started = Instant::now();
        let deadline = match give_up {
            Some(g) => (started + wait).min(g),
            None => started + wait,
        };
        let token = new_token();
        // Subscribed before the first attempt, so a commit landing between our attempt and
        // our sleep still wakes us.
        let subscription = self.waiters.subscribe(key);
        let mut stopping = self.stopping.subscribe();
        let (mut recheck, max_recheck) = self.recheck;
        // Set at the first attempt that finds the lock held; the observer counts the wait
        // until this call returns or is dropped.
        let mut waiting = None;
        loop {
            if give_up.is_some_and(|g| Instant::now() >= g) {
                return Ok(Begin::Expired);
            }
            let mut woken = pin!(subscription.notify().notified());
            woken.as_mut().enable();
            let remaining = match self.backend.try_begin(key, body_hash, &token, lock_ttl, hold).await? {
                Attempt::Record(bytes, ttl) => return Ok(Begin::Record(bytes, ttl)),
                Attempt::Mismatch => return Ok(Begin::Mismatch),
                Attempt::Locked => return Ok(Begin::Locked { token }),
                Attempt::InDoubt { token, started_ms, running } => {
                    return Ok(Begin::InDoubt { token, started_ms, running })
                }
                Attempt::Held { remaining } => remaining,
            };
            waiting.get_or_insert_with(|| Waiting::new(&self.observer));
            let now = Instant::now();
            // Every pass makes a fresh attempt first, so the deadline and a shutdown both
            // answer with the holder's remaining time as last seen, not a stale one.
            if now >= deadline || *stopping.borrow_and_update() {
                return Ok(Begin::Busy { remaining });
            }
            // Never sleep past the deadline, nor past the holder's expiry (then the lock is
            // ours to take); at least 1 ms so an expiring lock cannot make us spin.
            let mut nap = recheck.min(deadline - now);
            if let Some(ttl) = remaining {
                nap = nap.min(ttl);
            }
            let nap = nap.max(Duration::from_millis(1));
            let _parked = Parked::new(&self.parked);
            tokio::select! {
                () = woken => {}
                () = tokio::time::sleep(nap) => recheck = (recheck * 2).min(max_recheck),
                _ = stopping.changed() => {}
            }
        }
    }

    pub async fn commit(&self, commit: Commit<'_>) -> Result<CommitOutcome> {
        let key = commit.key;
        let outcome = self.backend.commit(commit).await;
        // Woken even on error: a waiter re-checking costs one attempt, a missed wake-up
        // costs it the rest of its wait.
        self.waiters.wake(key);
        outcome
    }

    /// Drops the lock `token` owns; unless `in_doubt`, its trace too (see [`crate::backend`]).
    pub async fn release(&self, key: &str, token: &str, in_doubt: bool) -> Result<ReleaseOutcome> {
        let outcome = self.backend.release(key, token, in_doubt).await;
        self.waiters.wake(key);
        outcome
    }

    pub async fn health(&self) -> Result<()> {
        let health = self.backend.health().await;
        crate::backend::health_checked(&health);
        health
    }
}

impl<B, O> Drop for Store<B, O> {
    fn drop(&mut self) {
        if let Some(task) = &self.remote_task {
            task.abort();
        }
    }
}

/// A `begin` waiting for a held lock, from the first attempt that found it held: told to the
/// observer when it starts and when it is dropped (answered or abandoned). Timed on `std`'s
/// clock, as idemstore's metrics always timed it (tokio's differs only when a test pauses it).
struct Waiting<'a, O: Observer> {
    observer: &'a O,
    started: std::time::Instant,
}

impl<'a, O: Observer> Waiting<'a, O> {
    fn new(observer: &'a O) -> Self {
        observer.wait_started();
        Self { observer, started: std::time::Instant::now() }
    }
}

impl<O: Observer> Drop for Waiting<'_, O> {
    fn drop(&mut self) {
        self.observer.wait_ended(self.started.elapsed());
    }
}

/// Counts a `begin` as parked while alive, even if the call is dropped mid-wait.
struct Parked<'a>(&'a AtomicUsize);

impl<'a> Parked<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Self(count)
    }
}

impl Drop for Parked<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// 128 random bits as 32 lowercase hex characters: valid under `is_token`.
pub fn new_token() -> String {
    format!("{:032x}", rand::random::<u128>())
}
