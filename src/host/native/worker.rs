//! One worker's coordinator for one filter configuration ([`Worker`]), kept in a thread-local
//! map: driven by the worker's hooks, and by a store thread when no stream of the worker can be
//! woken (`link.rs`), each holding the worker's baton; [`Hook`] is a hook's hold.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use super::baton::{Baton, Held};
use super::calls::{NativeCalls, ROOT};
use super::env::{random_bytes, At, NativeEnv};
use super::link::{DrainHere, Event, Link, Queued};
use super::module::{log, FilterConfig, Shared};
use crate::config::Config;
use crate::host::calls::HostCalls;
use crate::host::vm::Vm;

/// One worker's coordinator for one configuration: touched by its Envoy worker thread in hooks,
/// and by a store thread when none of the worker's streams can be woken (see `link.rs`), each
/// holding the `baton`.
pub struct Worker {
    pub vm: Vm<NativeCalls>,
    pub link: Arc<Link>,
    shared: Arc<Shared>,
    next_stream: Cell<u32>,
    baton: Baton,
}

// SAFETY: every use of the worker's state (the coordinator, its host calls' cells, the stream
// pointers) holds the baton, whose lock orders one thread's uses before the next's; a thread
// other than the worker's touches no stream (`NativeCalls::set_elsewhere`) and records no
// histogram (Envoy keeps those per worker thread).
unsafe impl Send for Worker {}
// SAFETY: as above.
unsafe impl Sync for Worker {}

thread_local! {
    static WORKERS: RefCell<HashMap<u64, Arc<Worker>>> = RefCell::new(HashMap::new());
}

fn seed() -> u64 {
    random_bytes().map_or(0, |b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
}

impl Worker {
    pub fn of(cfg: &FilterConfig) -> Option<Arc<Worker>> {
        WORKERS.with(|workers| {
            let mut workers = workers.try_borrow_mut().ok()?;
            // Configurations destroyed since (a reload) leave their workers behind until here.
            workers.retain(|_, w| !w.shared.closed.load(Ordering::Acquire));
            if let Some(w) = workers.get(&cfg.serial) {
                return Some(Arc::clone(w));
            }
            let w = Arc::new(Worker::new(cfg)?);
            let weak: Weak<dyn DrainHere> = Arc::downgrade(&w) as Weak<dyn DrainHere>;
            w.link.serve(weak);
            workers.insert(cfg.serial, Arc::clone(&w));
            Some(w)
        })
    }

    fn new(cfg: &FilterConfig) -> Option<Worker> {
        let config = Config::from_json(&cfg.json).ok()?;
        let link = Arc::new(Link::default());
        let calls = NativeCalls::new(Arc::clone(&cfg.shared), Arc::clone(&link));
        let vm = match Vm::new(calls, ROOT, config, "outbox") {
            Ok(vm) => vm,
            Err(e) => {
                log(log::Level::Error, format_args!("cannot start on this worker: {e}"));
                return None;
            }
        };
        vm.run(|c| c.set_up(&NativeEnv, seed()));
        let baton = Baton::default();
        Some(Worker { vm, link, shared: Arc::clone(&cfg.shared), next_stream: Cell::new(1), baton })
    }

    /// The worker's thread takes the baton for a hook; see [`Hook`].
    pub fn hook(&self) -> Hook<'_> {
        let held = self.baton.take();
        if held.outermost {
            self.vm.host().record_deferred();
        }
        Hook { worker: self, held }
    }

    pub fn new_stream(&self) -> u32 {
        let id = self.next_stream.get();
        self.next_stream.set(id.checked_add(1).filter(|n| *n != ROOT).unwrap_or(1));
        id
    }

    /// What the store's threads handed this worker, into the coordinator; `scheduled` is the
    /// stream whose scheduled event runs now.
    pub fn drain(&self, scheduled: Option<u32>) {
        if scheduled.is_none() && !self.link.pending() {
            return;
        }
        for Queued { at_us, event } in self.link.take(scheduled) {
            self.vm.enter(ROOT);
            let _ = self.vm.host().set_effective_context(ROOT);
            let at = At(at_us);
            match event {
                Event::Message { token, bytes } => self.vm.run(|c| c.on_stream_message(token, &bytes, &at)),
                Event::Tick => self.vm.run(|c| c.on_tick(&at)),
                Event::Wake => self.vm.run(|c| c.on_queue_ready(&at)),
            };
        }
    }

    /// Queued events, run on this thread, not the worker's (see `link.rs`).
    fn drain_elsewhere(&self) {
        let _open = self.shared.open.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        if self.shared.closed.load(Ordering::Acquire) {
            // Envoy destroyed the configuration: its metrics are gone, and so are its streams.
            let _ = self.link.take(None);
            return;
        }
        let _held = self.baton.take();
        // A stream that paused while this thread waited for the baton carries them (its
        // scheduler took the queue when it registered), and may be what they are for.
        if !self.link.unwakeable() {
            return;
        }
        self.vm.host().set_elsewhere(true);
        while self.link.pending() {
            self.drain(None);
        }
        self.vm.host().set_elsewhere(false);
    }

    /// Stream `id`'s hook runs now.
    pub fn enter(&self, id: u32) {
        self.vm.enter(id);
        let _ = self.vm.host().set_effective_context(id);
    }
}

impl DrainHere for Worker {
    fn drain_here(&self) -> bool {
        if self.baton.held_here() {
            return false;
        }
        self.drain_elsewhere();
        true
    }
}

/// A hook on the worker's thread holds the baton; as the outermost one ends, events that no
/// stream can carry any more (its last stream just ended, or never paused) run here, before
/// `held` hands the baton back.
pub struct Hook<'a> {
    worker: &'a Worker,
    held: Held<'a>,
}

impl Drop for Hook<'_> {
    fn drop(&mut self) {
        if self.held.outermost {
            let w = self.worker;
            while w.link.pending() && w.link.unwakeable() {
                w.drain(None);
            }
        }
    }
}
