//! Records this VM recently replayed, so that a key retried over and over is answered without a
//! store round trip. Sound because a stored record never changes: the first commit wins and
//! nothing rewrites it, so the only thing a cached copy can miss is the record's expiry, and an
//! entry never outlives the lifetime the store reported for it (measured from before the `begin`
//! was sent). Bounded in entries and bytes; the oldest entries go first.
//!
//! Each worker's VM has its own cache: a record replayed on one worker still costs the others one
//! `begin` each. Only records the store returned are cached (the keys clients actually retry), not
//! every record committed, so unique keys leave the cache untouched.

use std::collections::{HashMap, VecDeque};

use crate::store::record::Record;

/// What the cache knows about a key and request body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cached {
    /// The record stored for this key and body.
    Replay(Record),
    /// A record stored for this key with another body (the store would answer `mismatch`).
    Mismatch,
    /// Nothing live: ask the store.
    Miss,
}

#[derive(Debug)]
struct CachedRecord {
    body_hash: String,
    record: Record,
    /// Milliseconds since the Unix epoch (the host's clock).
    expires_ms: u64,
    cost: usize,
    /// Which insertion of this key the queue entry refers to (a key may be re-inserted).
    generation: u64,
}

#[derive(Debug)]
pub struct RecordCache {
    entries: HashMap<String, CachedRecord>,
    /// Insertion order, for eviction; stale positions (of a key since re-inserted or removed)
    /// are skipped when they reach the front.
    order: VecDeque<(String, u64)>,
    bytes: usize,
    max_entries: usize,
    max_bytes: usize,
    next_generation: u64,
}

/// Accounted per entry besides the record's header and body bytes: the key and body hash
/// (64 bytes each, twice for the key: map and queue) and the map, queue and `Vec` overheads.
const ENTRY_OVERHEAD: usize = 320;

impl RecordCache {
    /// `max_entries == 0` (or `max_bytes == 0`) disables the cache.
    pub fn new(max_entries: usize, max_bytes: usize) -> RecordCache {
        RecordCache {
            entries: HashMap::new(),
            order: VecDeque::new(),
            bytes: 0,
            max_entries,
            max_bytes,
            next_generation: 0,
        }
    }

    pub fn is_enabled(&self) -> bool {
        self.max_entries > 0 && self.max_bytes > 0
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The bytes accounted against `max_bytes`.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn lookup(&mut self, key: &str, body_hash: &str, now_ms: u64) -> Cached {
        let Some(entry) = self.entries.get(key) else {
            return Cached::Miss;
        };
        if entry.expires_ms <= now_ms {
            self.remove(key);
            return Cached::Miss;
        }
        if entry.body_hash == body_hash {
            Cached::Replay(Record { expires_ms: Some(entry.expires_ms), ..entry.record.clone() })
        } else {
            Cached::Mismatch
        }
    }

    /// Keeps `record` (as the store returned it for `key` and `body_hash`) until `expires_ms`.
    pub fn remember(&mut self, key: &str, body_hash: &str, record: &Record, expires_ms: u64, now_ms: u64) {
        if !self.is_enabled() || expires_ms <= now_ms {
            return;
        }
        let print = record
            .print
            .as_ref()
            .map_or(0, |p| 32 + p.headers.iter().map(|(n, _)| n.len() + 56).sum::<usize>());
        let cost = ENTRY_OVERHEAD
            + print
            + record.body.len()
            + record.headers.iter().map(|(n, v)| n.len() + v.len() + 48).sum::<usize>();
        // One record may not push out everything else.
        if cost > self.max_bytes / 4 {
            return;
        }
        self.remove(key);
        while self.entries.len() >= self.max_entries || self.bytes + cost > self.max_bytes {
            if !self.evict_oldest() {
                break;
            }
        }
        let generation = self.next_generation;
        self.next_generation += 1;
        self.bytes += cost;
        self.order.push_back((key.to_string(), generation));
        let entry = CachedRecord {
            body_hash: body_hash.to_string(),
            record: record.clone(),
            expires_ms,
            cost,
            generation,
        };
        self.entries.insert(key.to_string(), entry);
        // Stale queue positions pile up when keys are re-inserted: compact now and then.
        if self.order.len() > 2 * self.max_entries.max(16) {
            let entries = &self.entries;
            self.order.retain(|(k, g)| entries.get(k).is_some_and(|e| e.generation == *g));
        }
    }

    fn remove(&mut self, key: &str) {
        if let Some(e) = self.entries.remove(key) {
            self.bytes -= e.cost;
        }
    }

    /// Drops the oldest live entry; false when there is none.
    fn evict_oldest(&mut self) -> bool {
        while let Some((key, generation)) = self.order.pop_front() {
            if self.entries.get(&key).is_some_and(|e| e.generation == generation) {
                self.remove(&key);
                return true;
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(body: &str) -> Record {
        Record {
            status: 201,
            headers: vec![("content-type".into(), "application/json".into())],
            body: body.as_bytes().to_vec(),
            ..Record::default()
        }
    }

    /// `record`, as a replay from the cache tells it: with its expiry.
    fn until(record: Record, expires_ms: u64) -> Record {
        Record { expires_ms: Some(expires_ms), ..record }
    }

    const H1: &str = "h1";
    const H2: &str = "h2";

    #[test]
    fn replays_until_expiry_then_misses() {
        let mut c = RecordCache::new(10, 1 << 20);
        assert_eq!(c.lookup("k", H1, 0), Cached::Miss);
        c.remember("k", H1, &record("{}"), 1_000, 0);
        assert_eq!(c.lookup("k", H1, 999), Cached::Replay(until(record("{}"), 1_000)));
        assert_eq!(c.lookup("k", H2, 999), Cached::Mismatch);
        assert_eq!(c.lookup("k", H1, 1_000), Cached::Miss, "expired exactly at its expiry");
        assert!(c.is_empty());
        assert_eq!(c.bytes(), 0);
    }

    #[test]
    fn already_expired_or_disabled_is_not_kept() {
        let mut c = RecordCache::new(10, 1 << 20);
        c.remember("k", H1, &record("{}"), 5, 5);
        assert!(c.is_empty());
        for mut off in [RecordCache::new(0, 1 << 20), RecordCache::new(10, 0)] {
            assert!(!off.is_enabled());
            off.remember("k", H1, &record("{}"), 1_000, 0);
            assert_eq!(off.lookup("k", H1, 1), Cached::Miss);
        }
    }

    #[test]
    fn bounded_in_entries_oldest_first() {
        let mut c = RecordCache::new(3, 1 << 20);
        for k in ["a", "b", "c", "d"] {
            c.remember(k, H1, &record(k), 1_000, 0);
        }
        assert_eq!(c.len(), 3);
        assert_eq!(c.lookup("a", H1, 1), Cached::Miss);
        assert_eq!(c.lookup("d", H1, 1), Cached::Replay(until(record("d"), 1_000)));
    }

    #[test]
    fn bounded_in_bytes() {
        let body = "x".repeat(1000);
        let one = ENTRY_OVERHEAD + body.len() + "content-type".len() + "application/json".len() + 48;
        let mut c = RecordCache::new(100, 5 * one);
        for i in 0..20 {
            c.remember(&format!("k{i}"), H1, &record(&body), 1_000, 0);
            assert!(c.bytes() <= 5 * one);
        }
        assert_eq!(c.len(), 5);
        assert_eq!(c.lookup("k19", H1, 1), Cached::Replay(until(record(&body), 1_000)));
        assert_eq!(c.lookup("k14", H1, 1), Cached::Miss);
        // A record bigger than a quarter of the budget is never cached.
        c.remember("big", H1, &record(&"y".repeat(2 * one)), 1_000, 0);
        assert_eq!(c.lookup("big", H1, 1), Cached::Miss);
        assert_eq!(c.len(), 5);
    }

    #[test]
    fn reinserting_a_key_keeps_the_accounting_exact() {
        let mut c = RecordCache::new(4, 1 << 20);
        for round in 0..1_000u64 {
            c.remember("hot", H1, &record("{}"), 10_000 + round, round);
            c.remember(&format!("cold{}", round % 7), H1, &record("{}"), 10_000, round);
            assert!(c.len() <= 4);
            assert!(c.order.len() <= 2 * 16 + 2, "stale queue positions are compacted");
        }
        let live: usize = c.entries.values().map(|e| e.cost).sum();
        assert_eq!(c.bytes(), live);
        assert_eq!(c.lookup("hot", H1, 5_000), Cached::Replay(until(record("{}"), 10_999)));
    }
}
