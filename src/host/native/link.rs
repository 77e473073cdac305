//! One worker's link with the store's threads: the events they hand it (store answers, ticks,
//! wake-ups) wait in a queue, and the worker is woken through the scheduler of one of its live
//! streams, the only way another thread can run code on an Envoy worker.
//!
//! A worker with no stream to wake (its last one ended before the answer came: a response's
//! commit is answered after the response, a client that went away leaves a release behind) is
//! not woken: the thread that brings the event runs the worker's coordinator itself, holding
//! the worker's baton as a hook would, with no stream to touch (see `worker.rs`).
//! Envoy learns of the event at once (its counters), not at the worker's next stream.
//!
//! Shutdown safety: Envoy's scheduler holds the worker's dispatcher by plain reference, so a
//! commit on a scheduler whose stream is gone (or whose worker has stopped) is a use-after-free.
//! Schedulers are committed only under this link's lock, and a stream takes its own out of the
//! link under the same lock before deleting it; Envoy destroys every stream of a worker before
//! its dispatcher. So no commit can reach a deleted scheduler or a stopped worker.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

/// How long a scheduled event may take to reach the worker before it is sent again.
const RECOMMIT: Duration = Duration::from_millis(100);

use super::abi;
use super::env::NativeEnv;
use crate::worker::env::Clock;

/// What the store's threads hand a worker, and when (µs since the Unix epoch): the worker sees
/// it only at its next hook, which on an idle worker is the next stream, maybe seconds later;
/// the coordinator takes it as of that time, so that an answer that came in time is not taken
/// for a timeout (a tick queued before it is, like every event, as of its own time).
pub struct Queued {
    pub at_us: u64,
    pub event: Event,
}

pub enum Event {
    /// An answer on the store stream `token`.
    Message { token: u32, bytes: Vec<u8> },
    /// The coordinator's tick is due.
    Tick,
    /// The coordinator asked to be woken (`Command::Wake`).
    Wake,
}

/// A stream's scheduler, owned by the stream (deleted when it is destroyed).
#[derive(Clone, Copy)]
pub struct Scheduler(pub abi::HttpFilterSchedulerModulePtr);

// SAFETY: Envoy's schedulers are made to be committed from any thread; this link only commits
// one while it is registered (see the module docs), and only its stream deletes it.
unsafe impl Send for Scheduler {}

/// A worker's coordinator, driven from the thread that brings an event when no stream of the
/// worker can be woken.
pub trait DrainHere: Send + Sync {
    /// Runs the queued events on this thread; `false` if this thread may not (it is the
    /// worker's own, inside a hook, which drains them as the hook ends).
    fn drain_here(&self) -> bool;
}

#[derive(Default)]
struct State {
    events: VecDeque<Queued>,
    /// The live streams' schedulers, by the stream's id on this worker.
    schedulers: Vec<(u32, Scheduler)>,
    /// The stream whose scheduler has an event on its way to the worker, since when.
    committed: Option<u32>,
    committed_at: Option<Instant>,
    tick_queued: bool,
    /// A thread runs the queue on the worker's behalf (see [`DrainHere`]).
    draining: bool,
}

pub struct Link {
    state: Mutex<State>,
    /// Events are waiting: read without the lock at the start of every hook.
    pending: AtomicBool,
    /// The coordinator's tick period in ms (0: none), read by the link's ticker ...
    tick_ms: AtomicU64,
    /// ... started once, and woken when a period is set again.
    ticking: AtomicBool,
    tick_set: tokio::sync::Notify,
    /// The worker this link serves, once it is made.
    worker: OnceLock<Weak<dyn DrainHere>>,
}

impl Default for Link {
    fn default() -> Self {
        Link {
            state: Mutex::new(State::default()),
            pending: AtomicBool::new(false),
            tick_ms: AtomicU64::new(0),
            ticking: AtomicBool::new(false),
            tick_set: tokio::sync::Notify::new(),
            worker: OnceLock::new(),
        }
    }
}

impl Link {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means a thread panicked while holding it: the queue is still whole.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The worker this link serves (set once, when it is made).
    pub fn serve(&self, worker: Weak<dyn DrainHere>) {
        let _ = self.worker.set(worker);
    }

    /// Queues `event` and wakes the worker (from any thread): through a stream's scheduler, or,
    /// with none, by running the worker's coordinator here.
    pub fn push(&self, event: Event) {
        let here = {
            let mut state = self.lock();
            if matches!(event, Event::Tick) {
                if state.tick_queued {
                    return;
                }
                state.tick_queued = true;
            }
            let at_us = NativeEnv.now_us().unwrap_or(0);
            state.events.push_back(Queued { at_us, event });
            self.pending.store(true, Ordering::Release);
            Self::commit(&mut state);
            Self::drain_here_due(&mut state)
        };
        if here {
            self.drain_here();
        }
    }

    /// Under the lock: whether this thread should run the queue (nothing can wake the worker,
    /// and no other thread runs it already); if so, it is marked as run.
    fn drain_here_due(state: &mut State) -> bool {
        let due = state.schedulers.is_empty() && !state.events.is_empty() && !state.draining;
        if due {
            state.draining = true;
        }
        due
    }

    /// Runs the queue on the worker's behalf until it stays empty, or leaves it to the worker's
    /// own thread (inside a hook) or to the stream that registered meanwhile.
    fn drain_here(&self) {
        loop {
            let worker = self.worker.get().and_then(Weak::upgrade);
            let drained = worker.is_some_and(|w| w.drain_here());
            let mut state = self.lock();
            state.draining = false;
            if !drained || !Self::drain_here_due(&mut state) {
                return;
            }
        }
    }

    /// Under the lock: one event on its way at a time, to the newest live stream (the one most
    /// likely to outlive the wait). One that has not arrived after [`RECOMMIT`] is taken as
    /// lost (Envoy drops a scheduled event whose stream it no longer runs) and sent again: a
    /// second drain finds an empty queue, a lost one would hold every later answer back.
    fn commit(state: &mut State) {
        if state.committed_at.is_some_and(|at| at.elapsed() >= RECOMMIT) {
            state.committed = None;
        }
        if state.committed.is_some() || state.events.is_empty() {
            return;
        }
        if let Some(&(id, Scheduler(ptr))) = state.schedulers.last() {
            // SAFETY: registered schedulers are alive (removed under this lock before deletion).
            unsafe { abi::envoy_dynamic_module_callback_http_filter_scheduler_commit(ptr, 0) };
            state.committed = Some(id);
            state.committed_at = Some(Instant::now());
        }
    }

    /// A new stream on the worker: events that waited for one go out through it.
    pub fn add_scheduler(&self, stream: u32, scheduler: Scheduler) {
        let mut state = self.lock();
        state.schedulers.push((stream, scheduler));
        Self::commit(&mut state);
    }

    /// The stream is being destroyed: its scheduler is no longer committed, and an event on
    /// its way through it (which Envoy drops with the stream) goes through another.
    pub fn remove_scheduler(&self, stream: u32) -> Option<Scheduler> {
        let mut state = self.lock();
        let at = state.schedulers.iter().position(|(id, _)| *id == stream)?;
        let (_, scheduler) = state.schedulers.remove(at);
        if state.committed == Some(stream) {
            state.committed = None;
            Self::commit(&mut state);
        }
        Some(scheduler)
    }

    /// Whether no stream can carry a wake-up (the worker's own thread drains as a hook ends).
    pub fn unwakeable(&self) -> bool {
        self.lock().schedulers.is_empty()
    }

    /// Whether events wait (a hint, without the lock).
    pub fn pending(&self) -> bool {
        self.pending.load(Ordering::Acquire)
    }

    /// The events waiting; `scheduled` is the stream whose scheduled event runs now, if one does.
    pub fn take(&self, scheduled: Option<u32>) -> VecDeque<Queued> {
        let mut state = self.lock();
        if scheduled.is_some() && state.committed == scheduled {
            state.committed = None;
        }
        state.tick_queued = false;
        self.pending.store(false, Ordering::Release);
        std::mem::take(&mut state.events)
    }

    /// Ticks every `period` from now on (zero: none). One ticker per link, on the store's
    /// threads, started the first time: the coordinator turns its tick on and off around every
    /// store call, which must cost no more than two stores.
    pub fn set_tick(self: &Arc<Self>, period: Duration, runtime: &tokio::runtime::Handle) {
        let ms = u64::try_from(period.as_millis()).unwrap_or(u64::MAX);
        self.tick_ms.store(ms, Ordering::Release);
        if !self.ticking.swap(true, Ordering::AcqRel) {
            let link = Arc::clone(self);
            runtime.spawn(async move { link.tick().await });
        } else if ms > 0 {
            self.tick_set.notify_one();
        }
    }

    async fn tick(&self) {
        loop {
            let ms = self.tick_ms.load(Ordering::Acquire);
            if ms == 0 {
                // A permit left by a `notify_one` with no waiter is taken here: no period is missed.
                self.tick_set.notified().await;
                continue;
            }
            // A new period (a shorter one: a call's deadline sweep) cuts the wait short.
            let period = Duration::from_millis(ms);
            if tokio::time::timeout(period, self.tick_set.notified()).await.is_ok() {
                continue;
            }
            if self.tick_ms.load(Ordering::Acquire) > 0 {
                self.push(Event::Tick);
            }
        }
    }
}
