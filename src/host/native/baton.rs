//! Who may touch a worker's coordinator now: its Envoy worker thread, in a hook, or a store
//! thread, when no stream of that worker can be woken (see `link.rs`). Re-entrant, as hooks
//! are: a local answer sent from one hook runs another hook of the same stream inside it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

/// This thread's number (0: none).
fn this_thread() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static ID: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    ID.with(|id| *id)
}

#[derive(Default)]
struct Holder {
    thread: u64,
    depth: u32,
}

#[derive(Default)]
pub struct Baton {
    holder: Mutex<Holder>,
    free: Condvar,
}

/// The baton, held until dropped.
pub struct Held<'a> {
    baton: &'a Baton,
    /// The outermost hold on this thread: the one that hands the baton back.
    pub outermost: bool,
}

impl Baton {
    fn lock(&self) -> MutexGuard<'_, Holder> {
        // A thread that panicked holding the lock leaves a whole `Holder` behind.
        self.holder.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes the baton, waiting while another thread holds it (a hook or a drain: microseconds).
    pub fn take(&self) -> Held<'_> {
        let me = this_thread();
        let mut holder = self.lock();
        if holder.thread == me {
            holder.depth += 1;
            return Held { baton: self, outermost: false };
        }
        while holder.thread != 0 {
            holder = self.free.wait(holder).unwrap_or_else(PoisonError::into_inner);
        }
        holder.thread = me;
        holder.depth = 1;
        Held { baton: self, outermost: true }
    }

    /// Whether this thread holds the baton.
    pub fn held_here(&self) -> bool {
        self.lock().thread == this_thread()
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let mut holder = self.baton.lock();
        holder.depth = holder.depth.saturating_sub(1);
        if holder.depth == 0 {
            holder.thread = 0;
            self.baton.free.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn one_thread_at_a_time_and_reentrant() {
        let baton = Arc::new(Baton::default());
        let count = Arc::new(AtomicU64::new(0));
        let outer = baton.take();
        assert!(outer.outermost && baton.held_here());
        let inner = baton.take();
        assert!(!inner.outermost);
        let (b, c) = (Arc::clone(&baton), Arc::clone(&count));
        let other = std::thread::spawn(move || {
            let held = b.take();
            assert!(held.outermost && b.held_here());
            c.load(Ordering::SeqCst)
        });
        count.store(1, Ordering::SeqCst);
        drop(inner);
        // Still held by this thread: the other waits for the outermost release.
        count.store(2, Ordering::SeqCst);
        drop(outer);
        assert_eq!(other.join().ok(), Some(2));
        assert!(!baton.held_here());
    }
}
