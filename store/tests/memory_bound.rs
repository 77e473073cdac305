//! The in-memory backend's memory stays bounded under a flood of unique keys: measured here,
//! not estimated, by a global allocator that counts the bytes live in this test binary.
//!
//! The backend is driven through its API directly (no HTTP), so that a million keys take
//! seconds even in a debug build (`make unit`). The tests hold [`SERIAL`]: the allocator is
//! global, and a test running alongside would be measured too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use idem_store::backend::memory::{MemoryBackend, DEFAULT_MAX_BYTES, DEFAULT_MAX_KEYS, ENTRY_COST};
use idem_store::backend::{Attempt, Backend, BackendError, Commit, CommitOutcome};

/// Counts the bytes allocated and not yet freed, and their high-water mark.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to `System` unchanged; only the counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            grew(layout.size());
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            grew(layout.size());
        }
        ptr
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            grew(new_size);
        }
        new
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

fn grew(size: usize) {
    let live = LIVE.fetch_add(size, Ordering::Relaxed) + size;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

static SERIAL: Mutex<()> = Mutex::new(());

/// Runs `test` to completion while no other test of this binary runs.
fn serially(test: impl std::future::Future<Output = ()>) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(test);
}

/// Heap bytes live now, and the most live since the last call, both above `base`.
fn measure(base: usize) -> (usize, usize) {
    let live = LIVE.load(Ordering::Relaxed);
    let peak = PEAK.swap(live, Ordering::Relaxed);
    (live.saturating_sub(base), peak.saturating_sub(base))
}

fn baseline() -> usize {
    let live = LIVE.load(Ordering::Relaxed);
    PEAK.store(live, Ordering::Relaxed);
    live
}

const HASH: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
const TOKEN: &str = "0123456789abcdef0123456789abcdef";
const TTL: Duration = Duration::from_secs(30);
const DAY: Duration = Duration::from_secs(86_400);
const MIB: usize = 1024 * 1024;

fn key(i: usize) -> String {
    format!("{i:064x}")
}

/// A record as the HTTP layer hands it over: its own allocation of `len` bytes.
fn record(len: usize) -> Bytes {
    Bytes::from(vec![b'r'; len])
}

async fn begin_and_commit(backend: &MemoryBackend, i: usize, record: Bytes) -> Result<(), BackendError> {
    let key = key(i);
    assert_eq!(backend.try_begin(&key, HASH, TOKEN, TTL, None).await?, Attempt::Locked);
    assert_eq!(
        backend.commit(Commit { key: &key, token: TOKEN, body_hash: HASH, record, retention: DAY }).await?,
        CommitOutcome::Stored
    );
    Ok(())
}

/// One million unique keys, each a `begin` and a `commit` of a 200-byte record, with the
/// default limits: the heap they take stays under the backend's own accounting, which is
/// exactly `keys * (ENTRY_COST + record)`; a flood of new keys after that is refused and
/// takes nothing.
#[test]
fn a_million_unique_keys_stay_within_the_stated_bound() {
    serially(a_million_unique_keys());
}

async fn a_million_unique_keys() {
    const KEYS: usize = 1_000_000;
    const RECORD: usize = 200;
    const FLOOD: usize = 100_000;
    /// The stated bound: 840,000,000 bytes (801 MiB) for a million keys.
    const BOUND: usize = KEYS * (ENTRY_COST + RECORD);
    assert_eq!(KEYS, DEFAULT_MAX_KEYS, "the default limit is the one under test");
    const { assert!(BOUND <= DEFAULT_MAX_BYTES, "the default byte budget lets the default key count fill") };

    let base = baseline();
    let backend = MemoryBackend::new(DEFAULT_MAX_KEYS);
    let started = Instant::now();
    for i in 0..KEYS {
        begin_and_commit(&backend, i, record(RECORD)).await.unwrap();
    }
    let filled = started.elapsed();
    let (live, peak) = measure(base);
    let accounted = backend.accounted_bytes();
    eprintln!(
        "{KEYS} keys of {RECORD}-byte records in {filled:.1?}: heap live {live} B ({} B a key), \
         peak {peak} B ({} B a key); accounted {accounted} B; stated bound {BOUND} B",
        live / KEYS,
        peak / KEYS,
    );
    assert_eq!(backend.len(), KEYS);
    assert_eq!(accounted, BOUND);
    assert!(live <= accounted, "the accounting must bound the heap: live {live} > accounted {accounted}");
    assert!(peak <= BOUND, "even while the map grows: peak {peak} > bound {BOUND}");

    // The flood goes on: every new key is refused, and the heap does not move.
    let started = Instant::now();
    for i in KEYS..KEYS + FLOOD {
        let refused = backend.try_begin(&key(i), HASH, TOKEN, TTL, None).await;
        assert_eq!(refused, Err(BackendError::Full));
    }
    let flooded = started.elapsed();
    let (after, peak) = measure(base);
    eprintln!("{FLOOD} more unique keys refused in {flooded:.1?}: heap live {after} B, peak {peak} B");
    assert_eq!(backend.len(), KEYS);
    assert!(after <= live + 64 * 1024, "refused keys took memory: {live} -> {after}");
    assert!(peak <= BOUND);
    // Stored keys are still served while full.
    let replay = backend.try_begin(&key(0), HASH, TOKEN, TTL, None).await.unwrap();
    assert!(matches!(replay, Attempt::Record(bytes, Some(_)) if bytes == record(RECORD)));

    drop(backend);
    let (left, _) = measure(base);
    assert!(left < 64 * 1024, "the backend's memory is returned when it is dropped: {left} B left");
}

/// `max_keys` alone would let a million 8 MiB records in; the byte budget stops large records
/// at the budget, whatever their number. Records arriving as slices of a larger buffer (as
/// hyper's read buffers hand them over) are copied, not kept with their whole buffer.
#[test]
fn the_byte_budget_bounds_large_records_and_buffers() {
    serially(byte_budget());
}

async fn byte_budget() {
    const BUDGET: usize = 64 * MIB;
    let base = baseline();
    let backend = MemoryBackend::with_limits(DEFAULT_MAX_KEYS, BUDGET);
    let mut stored = 0;
    for i in 0..1_000 {
        match begin_and_commit(&backend, i, record(MIB)).await {
            Ok(()) => stored += 1,
            Err(BackendError::Full) => {}
            Err(e) => panic!("{e}"),
        }
    }
    let (live, peak) = measure(base);
    eprintln!("1 MiB records under a {BUDGET} B budget: {stored} stored, heap live {live} B, peak {peak} B");
    assert_eq!(stored, BUDGET / (MIB + ENTRY_COST));
    assert!(backend.accounted_bytes() <= BUDGET);
    assert!(live <= BUDGET, "live {live} > budget {BUDGET}");
    // A refused commit left its lock alone: its owner can release it (the filter does).
    assert!(matches!(backend.try_begin(&key(999), HASH, "other", TTL, None).await, Ok(Attempt::Held { .. })));
    drop(backend);

    let base = baseline();
    let backend = MemoryBackend::new(DEFAULT_MAX_KEYS);
    for i in 0..1_000 {
        let buffer = Bytes::from(vec![b'b'; 16 * 1024]);
        begin_and_commit(&backend, i, buffer.slice(..200)).await.unwrap();
    }
    let (live, _) = measure(base);
    eprintln!("1000 records of 200 B sliced from 16 KiB buffers: heap live {live} B");
    assert!(live <= backend.accounted_bytes(), "a stored slice kept its buffer: live {live} B");
}
