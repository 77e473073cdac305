//! What a simulated run counts, its random source and its clock and shared data.

use std::cell::Cell;

use crate::sim::memory::MemoryData;
use crate::worker::env::{Clock, SharedData};

/// How often each path was taken, summed over runs: to check that a sample reaches them all.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    pub streams: u32,
    pub executions: u32,
    pub replays: u32,
    pub cache_hits: u32,
    pub local_answers: u32,
    pub locks: u32,
    pub commits: u32,
    /// `commits` callouts answered (first tries of commits held while one was in flight).
    pub batches: u32,
    pub releases: u32,
    pub faults: u32,
    pub dispatch_failures: u32,
    pub wake_failures: u32,
    pub ended_early: u32,
    pub answers_after_end: u32,
    pub expired_records: u32,
    pub expired_begins: u32,
    pub skipped_begins: u32,
    pub local_locks: u32,
    pub local_replays: u32,
    pub handed_back: u32,
    pub hand_backs_dropped: u32,
    pub other_replica_records: u32,
    /// Records whose commit failed, kept locally and handed back under their store lock.
    pub kept_handed_back: u32,
    /// Retries answered `503` from a marker of a record this Envoy sent the store.
    pub withheld: u32,
    /// Store streams opened (`store_transport: stream`).
    pub streams_opened: u32,
    /// Answers on the store stream after their call's deadline.
    pub late_answers: u32,
    /// Attempts the store took an in-doubt release of (their keys in doubt).
    pub left_in_doubt: u32,
    /// `begin`s the store answered `in-doubt`.
    pub in_doubt_answers: u32,
    /// In-doubt traces a `begin` superseded (a lookup's `404` after the attempt's lock TTL).
    pub superseded: u32,
    /// `outcome_lookup` calls the application answered.
    pub lookups: u32,
    /// Executions of a key the VM had left in doubt, while the store failed (degraded): the local
    /// fallback does not hold in-doubt keys.
    pub degraded_in_doubt: u32,
}

impl Tally {
    pub fn add(&mut self, o: &Tally) {
        let pairs = [
            (&mut self.streams, o.streams),
            (&mut self.executions, o.executions),
            (&mut self.replays, o.replays),
            (&mut self.cache_hits, o.cache_hits),
            (&mut self.local_answers, o.local_answers),
            (&mut self.locks, o.locks),
            (&mut self.commits, o.commits),
            (&mut self.batches, o.batches),
            (&mut self.releases, o.releases),
            (&mut self.faults, o.faults),
            (&mut self.dispatch_failures, o.dispatch_failures),
            (&mut self.wake_failures, o.wake_failures),
            (&mut self.ended_early, o.ended_early),
            (&mut self.answers_after_end, o.answers_after_end),
            (&mut self.expired_records, o.expired_records),
            (&mut self.expired_begins, o.expired_begins),
            (&mut self.skipped_begins, o.skipped_begins),
            (&mut self.local_locks, o.local_locks),
            (&mut self.local_replays, o.local_replays),
            (&mut self.handed_back, o.handed_back),
            (&mut self.other_replica_records, o.other_replica_records),
            (&mut self.kept_handed_back, o.kept_handed_back),
            (&mut self.withheld, o.withheld),
            (&mut self.streams_opened, o.streams_opened),
            (&mut self.late_answers, o.late_answers),
            (&mut self.left_in_doubt, o.left_in_doubt),
            (&mut self.in_doubt_answers, o.in_doubt_answers),
            (&mut self.superseded, o.superseded),
            (&mut self.lookups, o.lookups),
            (&mut self.degraded_in_doubt, o.degraded_in_doubt),
        ];
        for (sum, n) in pairs {
            *sum += n;
        }
    }

    /// Every counted path was taken at least `n` times.
    pub fn all_at_least(&self, n: u32) -> bool {
        [
            self.streams,
            self.executions,
            self.replays,
            self.cache_hits,
            self.local_answers,
            self.locks,
            self.commits,
            self.releases,
            self.faults,
            self.dispatch_failures,
            self.wake_failures,
            self.ended_early,
            self.answers_after_end,
            self.expired_records,
            self.expired_begins,
            self.skipped_begins,
            self.local_locks,
            self.local_replays,
            self.handed_back,
            self.other_replica_records,
            self.withheld,
            self.streams_opened,
            self.late_answers,
            self.left_in_doubt,
            self.in_doubt_answers,
            self.lookups,
        ]
        .iter()
        .all(|&v| v >= n)
    }
}

/// The run's choices: from a fuzzer's input while it lasts, then from xorshift64 (small, seeded,
/// the same everywhere).
pub struct Rng {
    state: u64,
    input: Vec<u8>,
    at: usize,
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng { state: seed | 1, input: Vec::new(), at: 0 }
    }

    /// Choices read from `input`, two bytes each, so that a fuzzer steers the run.
    pub fn from_input(input: &[u8]) -> Rng {
        let seed = input
            .iter()
            .fold(0x9e37_79b9_7f4a_7c15_u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        Rng { state: seed | 1, input: input.to_vec(), at: 0 }
    }

    pub fn below(&mut self, n: u64) -> u64 {
        if let Some(pair) = self.input.get(self.at..self.at + 2) {
            self.at += 2;
            return u64::from(u16::from_le_bytes([pair[0], pair[1]])) % n.max(1);
        }
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        self.state % n.max(1)
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// A simulated host environment: a clock the caller sets (microseconds since the epoch) and the
/// process's shared data in memory. Also the coordinator's unit tests' host.
pub struct SimEnv(pub Cell<u64>, pub MemoryData);

impl SimEnv {
    pub fn at(now_us: u64) -> SimEnv {
        SimEnv(Cell::new(now_us), MemoryData::default())
    }
}

impl Clock for SimEnv {
    fn now_us(&self) -> Option<u64> {
        Some(self.0.get())
    }
}

impl SharedData for SimEnv {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.1.get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> bool {
        self.1.set(key, value, cas)
    }
}
