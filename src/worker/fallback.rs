//! What the coordinator does when the store cannot answer a `begin` (`failure_mode: open`,
//! `local_fallback`): ask the process-wide local store (`local_store`) instead. The first request with
//! a key takes the local lock and runs (counted `degraded` and `local_locks`: the store's
//! guarantee is gone, this Envoy's holds), its answer becomes a local record; duplicates on any
//! worker wait for it (polled on the root's tick, up to `lock_wait_ms`) and replay it, or get
//! `409`; once the store answers again, the local records are handed back to it (a commit each),
//! so that a retry through another Envoy replays too.
//!
//! A local lock is a [`LockToken::Local`]: the machine passes it back in its commit or release
//! like the store's, and the worker's store path sends those here instead of to the store.
//!
//! While the store answers, what this Envoy does with it is mirrored here (see `local_store`): a lock
//! the store granted ([`Fallback::adopt`]), a record sent ([`Fallback::sent`]) or not taken
//! ([`Fallback::keep`]), a lock released ([`Fallback::released`]). That costs a shared-data write
//! per lock and per record, and is what keeps one execution per key within this Envoy when the
//! store fails mid-flight, or a key it ran before the outage comes back during it.

use std::collections::HashMap;

use crate::config::values::{FailureMode, Mode};
use crate::config::Config;
use crate::request::metrics::Metric;
use crate::store::client::{BeginAnswer, CalloutFault, LockToken};
use crate::store::record::Record;
use crate::worker::env::SharedData;
use crate::worker::local_store::{Begin, HandBack, LocalCommit, LocalStore};

/// The token a hand-back of a record made under a local lock carries (it ends no store lock).
pub const HAND_BACK_TOKEN: &str = "handback";
/// How often waiters look at the lock they wait for.
const WAIT_POLL_MS: u64 = 20;
/// How often records are offered back to the store while some wait for it.
const HAND_BACK_MS: u64 = 1000;
/// Hand-backs sent per scan.
const HAND_BACK_BATCH: usize = 16;
/// After a hand-back the store did not take, the next scan waits this long, doubling up to
/// [`MAX_BACKOFF_MS`]: a store that is coming back is not flooded with commits it cannot serve
/// yet (they would slow the calls of the requests it can).
const MIN_BACKOFF_MS: u64 = 2_000;
const MAX_BACKOFF_MS: u64 = 30_000;

/// The answer a `begin` the store could not give gets, with what to count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocalAnswer {
    Answer(Result<BeginAnswer, CalloutFault>, Vec<Metric>),
    /// Another request holds the local lock: the stream waits (see [`Fallback::due`]).
    Wait,
}

#[derive(Debug, Clone)]
struct Waiter {
    stream: u32,
    key: String,
    body_hash: String,
    /// The store's failure, which the request gets if the local store cannot help after all.
    fault: CalloutFault,
    deadline_ms: u64,
}

#[derive(Debug)]
pub struct Fallback {
    store: LocalStore,
    lock_wait_ms: u64,
    waiters: Vec<Waiter>,
    /// Lock owners: this VM's random high half, a counter low.
    owner_base: u64,
    next_owner: u32,
    /// The local owner of each store lock this VM holds and mirrors, by the store's token.
    mirrored: HashMap<String, u64>,
    /// A local record may wait to be handed back.
    hand_back_due: bool,
    /// No scan before this.
    next_scan_ms: u64,
    backoff_ms: u64,
    last_failure_ms: u64,
}

impl Fallback {
    /// `None` unless the configuration asks for it (`failure_mode: open`, `local_fallback`).
    pub fn new(cfg: &Config) -> Option<Fallback> {
        // Mint mode makes no store calls: nothing to fall back from.
        if !cfg.local_fallback || cfg.failure_mode != FailureMode::Open || cfg.mode == Mode::Mint {
            return None;
        }
        // Local locks and records serve every route: they last as long as the longest route's.
        let (retention_seconds, lock_ttl_ms) = cfg.longest_terms();
        let store = LocalStore::new(
            cfg.local_record_entries,
            cfg.local_record_bytes,
            lock_ttl_ms,
            retention_seconds.saturating_mul(1000),
        );
        Some(Fallback {
            store,
            lock_wait_ms: cfg.lock_wait_ms,
            waiters: Vec::new(),
            mirrored: HashMap::new(),
            owner_base: 0,
            next_owner: 0,
            hand_back_due: false,
            next_scan_ms: 0,
            backoff_ms: 0,
            last_failure_ms: 0,
        })
    }

    /// Creates the shared data (before any request); `seed` makes this VM's lock owners unique.
    pub fn set_up(&mut self, data: &dyn SharedData, seed: u64) -> bool {
        self.owner_base = seed << 32;
        // Records of an earlier VM (a reload) may still wait to be handed back.
        self.hand_back_due = true;
        self.store.set_up(data)
    }

    /// The local answer to a `begin` the store failed with `fault`.
    pub fn begin(
        &mut self,
        data: &dyn SharedData,
        stream: u32,
        key: &str,
        body_hash: &str,
        fault: CalloutFault,
        now_ms: Option<u64>,
    ) -> LocalAnswer {
        let Some(now) = now_ms else { return LocalAnswer::Answer(Err(fault), vec![]) };
        let owner = self.owner_base | u64::from(self.next_owner);
        match self.store.begin(data, key, body_hash, owner, now) {
            Begin::Held { .. } if self.lock_wait_ms > 0 => self.wait(stream, key, body_hash, fault, now),
            found => self.answer(found, owner, fault),
        }
    }

    /// `stream` waits (up to `lock_wait_ms` from `now`) for the local lock another request
    /// holds; `fault` is what it gets if the local store cannot help after all.
    fn wait(
        &mut self,
        stream: u32,
        key: &str,
        body_hash: &str,
        fault: CalloutFault,
        now: u64,
    ) -> LocalAnswer {
        let deadline_ms = now.saturating_add(self.lock_wait_ms);
        self.waiters.push(Waiter {
            stream,
            key: key.into(),
            body_hash: body_hash.into(),
            fault,
            deadline_ms,
        });
        LocalAnswer::Wait
    }

    fn answer(&mut self, found: Begin, owner: u64, fault: CalloutFault) -> LocalAnswer {
        match found {
            Begin::Replay(bytes) => match Record::decode(&bytes) {
                Ok(record) => {
                    LocalAnswer::Answer(Ok(BeginAnswer::Replay(record)), vec![Metric::LocalReplays])
                }
                Err(_) => LocalAnswer::Answer(Err(fault), vec![]),
            },
            Begin::Mismatch => LocalAnswer::Answer(Ok(BeginAnswer::Mismatch), vec![]),
            Begin::Locked => {
                self.next_owner = self.next_owner.wrapping_add(1);
                let token = LockToken::Local(owner);
                LocalAnswer::Answer(
                    Ok(BeginAnswer::Locked { token }),
                    vec![Metric::LocalLocks, Metric::Degraded],
                )
            }
            Begin::Held { remaining_ms } => {
                LocalAnswer::Answer(Ok(BeginAnswer::Busy { lock_ms: Some(remaining_ms.max(1)) }), vec![])
            }
            Begin::Withheld => LocalAnswer::Answer(Ok(BeginAnswer::Withheld), vec![]),
            Begin::Unavailable => LocalAnswer::Answer(Err(fault), vec![]),
        }
    }

    /// The store granted `stream` its lock `token`: mirrored here, unless this Envoy already
    /// ran the key in an outage (its local record not yet handed back: replayed, or `422`) or
    /// still runs it under a local lock (the stream waits for it, as on a failed `begin`).
    /// `None`: go on with the store's lock. With `Some`, the store's lock is not needed: the
    /// caller hands the local record back under it, or releases it.
    pub fn adopt(
        &mut self,
        data: &dyn SharedData,
        stream: u32,
        key: &str,
        body_hash: &str,
        token: &str,
        now_ms: Option<u64>,
    ) -> Option<LocalAnswer> {
        let now = now_ms?;
        let owner = self.owner_base | u64::from(self.next_owner);
        match self.store.adopt(data, key, body_hash, owner, now) {
            Begin::Locked => {
                self.next_owner = self.next_owner.wrapping_add(1);
                self.mirrored.insert(token.to_string(), owner);
                None
            }
            Begin::Held { .. } if self.lock_wait_ms > 0 => {
                Some(self.wait(stream, key, body_hash, CalloutFault::Skipped, now))
            }
            found @ (Begin::Replay(_) | Begin::Mismatch | Begin::Held { .. }) => {
                Some(self.answer(found, owner, CalloutFault::Skipped))
            }
            Begin::Withheld | Begin::Unavailable => None,
        }
    }

    /// The record made under the store's lock `token` is on its way to the store.
    pub fn sent(
        &mut self,
        data: &dyn SharedData,
        key: &str,
        token: &str,
        body_hash: &str,
        now_ms: Option<u64>,
    ) {
        if let (Some(&owner), Some(now)) = (self.mirrored.get(token), now_ms) {
            self.store.sent(data, key, owner, body_hash, now);
        }
    }

    /// The store did not take the record made under its lock `token` (the commit and its retry
    /// failed): `true` if it is kept here, to replay and to hand back (the store's lock is then
    /// left to that hand-back, which ends it); `false`: the caller releases the lock.
    pub fn keep(
        &mut self,
        data: &dyn SharedData,
        key: &str,
        token: &str,
        body_hash: &str,
        record: &[u8],
        now_ms: Option<u64>,
    ) -> (bool, Vec<(Metric, u64)>) {
        let (Some(owner), Some(now)) = (self.mirrored.remove(token), now_ms) else { return (false, vec![]) };
        let kept = self.keep_record(data, LocalCommit { key, owner, body_hash, record, token }, now);
        (kept, self.dropped())
    }

    /// The store answered the commit under its lock `token`: the marker stays.
    pub fn forget(&mut self, token: &str) {
        self.mirrored.remove(token);
    }

    /// The store's lock `token` is released (or given up): its mirror goes too.
    pub fn released(&mut self, data: &dyn SharedData, key: &str, token: &str, now_ms: Option<u64>) {
        if let (Some(owner), Some(now)) = (self.mirrored.remove(token), now_ms) {
            self.store.release(data, key, owner, now);
        }
    }

    /// The waiters whose lock was given up, became a record, or waited too long; `gone` tells
    /// which streams no longer need an answer for a client (they get their fault: no lock is
    /// taken for them).
    pub fn due(
        &mut self,
        data: &dyn SharedData,
        now_ms: u64,
        gone: impl Fn(u32) -> bool,
    ) -> Vec<(u32, LocalAnswer)> {
        let mut due = Vec::new();
        for w in std::mem::take(&mut self.waiters) {
            if gone(w.stream) {
                due.push((w.stream, LocalAnswer::Answer(Err(w.fault), vec![])));
                continue;
            }
            let owner = self.owner_base | u64::from(self.next_owner);
            match self.store.begin(data, &w.key, &w.body_hash, owner, now_ms) {
                Begin::Held { .. } if now_ms < w.deadline_ms => self.waiters.push(w),
                found => {
                    let outcome = self.answer(found, owner, w.fault);
                    due.push((w.stream, outcome));
                }
            }
        }
        due
    }

    /// Keeps the record of a request that ran under the local lock of `owner` (or gives the
    /// lock up if it cannot be kept); counts what the bounds pushed out.
    pub fn commit(
        &mut self,
        data: &dyn SharedData,
        key: &str,
        owner: u64,
        body_hash: &str,
        record: &[u8],
        now_ms: Option<u64>,
    ) -> Vec<(Metric, u64)> {
        let Some(now) = now_ms else { return vec![] };
        self.keep_record(data, LocalCommit { key, owner, body_hash, record, token: "" }, now);
        self.dropped()
    }

    /// Keeps a record in place of its owner's lock, to hand back under its token (empty: made
    /// under a local lock; see [`LocalCommit`]); gives the lock up if it cannot be kept.
    fn keep_record(&mut self, data: &dyn SharedData, commit: LocalCommit<'_>, now: u64) -> bool {
        let kept = self
            .fit(commit.record)
            .is_some_and(|bytes| self.store.commit(data, LocalCommit { record: &bytes, ..commit }, now));
        if kept {
            self.hand_back_due = true;
        } else {
            self.store.release(data, commit.key, commit.owner, now);
        }
        kept
    }

    /// The record as a stripe can hold it: whole, or without its body.
    fn fit(&self, record: &[u8]) -> Option<Vec<u8>> {
        let max = self.store.max_record_bytes();
        if record.len() <= max {
            return Some(record.to_vec());
        }
        let mut r = Record::decode(record).ok()?;
        r.body.clear();
        r.body_omitted = true;
        r.headers.retain(|(n, _)| n != "content-encoding");
        let bytes = r.encode();
        (bytes.len() <= max).then_some(bytes)
    }

    /// Gives up the local lock of `owner`.
    pub fn release(&mut self, data: &dyn SharedData, key: &str, owner: u64, now_ms: Option<u64>) {
        if let Some(now) = now_ms {
            self.store.release(data, key, owner, now);
        }
    }

    fn dropped(&self) -> Vec<(Metric, u64)> {
        match self.store.take_dropped() {
            0 => vec![],
            n => vec![(Metric::HandBackDropped, u64::from(n))],
        }
    }

    /// A hand-back scan would run at `now_ms`.
    pub fn scan_due(&self, now_ms: u64) -> bool {
        self.hand_back_due && now_ms >= self.next_scan_ms
    }

    /// Local records may wait to be handed back (known after the last scan).
    #[cfg(any(test, feature = "sim"))]
    pub fn hand_back_due(&self) -> bool {
        self.hand_back_due
    }

    /// Records to hand back to the store now (at most one scan per [`HAND_BACK_MS`], and only
    /// while some may wait), and how many local records there are, when scanned.
    pub fn hand_backs(&mut self, data: &dyn SharedData, now_ms: u64) -> (Vec<HandBack>, Option<usize>) {
        if !self.scan_due(now_ms) {
            return (vec![], None);
        }
        self.next_scan_ms = now_ms.saturating_add(HAND_BACK_MS);
        let scan = self.store.claim_hand_backs(data, HAND_BACK_BATCH, now_ms);
        self.hand_back_due = scan.pending > 0;
        (scan.claimed, Some(scan.records))
    }

    /// The store answered a hand-back (`ok`: it keeps the record, or an earlier one); else it is
    /// offered again at the next scan.
    pub fn handed_back(&mut self, data: &dyn SharedData, key: &str, ok: bool, now_ms: Option<u64>) {
        let now = now_ms.unwrap_or(0);
        if ok {
            self.store.handed_back(data, key, now);
            self.backoff_ms = 0;
        } else {
            self.store.unclaim(data, key, now);
            self.hand_back_due = true;
            self.backoff_ms = (self.backoff_ms * 2).clamp(MIN_BACKOFF_MS, MAX_BACKOFF_MS);
            self.next_scan_ms = self.next_scan_ms.max(now.saturating_add(self.backoff_ms));
            self.last_failure_ms = now;
        }
    }

    /// The store answered a request's call: it is back, so hand-backs resume soon (still not
    /// sooner than [`MIN_BACKOFF_MS`] after the last one it did not take).
    pub fn store_answered(&mut self) {
        if self.backoff_ms > 0 {
            self.backoff_ms = 0;
            self.next_scan_ms = self.next_scan_ms.min(self.last_failure_ms.saturating_add(MIN_BACKOFF_MS));
        }
    }

    /// The root's tick period this needs (0: none).
    pub fn tick_ms(&self) -> u64 {
        if !self.waiters.is_empty() {
            WAIT_POLL_MS
        } else if self.hand_back_due {
            HAND_BACK_MS
        } else {
            0
        }
    }

    /// Streams wait for a local lock another request holds.
    #[cfg(any(test, feature = "sim"))]
    pub fn is_waiting(&self) -> bool {
        !self.waiters.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::memory::MemoryData;

    fn fallback(extra: &str) -> (Fallback, MemoryData) {
        let json = format!(r#"{{"store_cluster":"s","local_record_entries":256,"lock_wait_ms":100{extra}}}"#);
        let mut f = Fallback::new(&Config::from_json(json.as_bytes()).unwrap()).unwrap();
        let data = MemoryData::default();
        assert!(f.set_up(&data, 9));
        (f, data)
    }

    fn hex(c: char) -> String {
        c.to_string().repeat(64)
    }

    /// The owner of the local lock granted.
    fn token(outcome: &LocalAnswer) -> u64 {
        match outcome {
            LocalAnswer::Answer(Ok(BeginAnswer::Locked { token: LockToken::Local(owner) }), _) => *owner,
            other => panic!("not locked here: {other:?}"),
        }
    }

    #[test]
    fn only_with_failure_mode_open_and_the_key_on() {
        let cfg =
            |extra: &str| Config::from_json(format!(r#"{{"store_cluster":"s"{extra}}}"#).as_bytes()).unwrap();
        assert!(Fallback::new(&cfg("")).is_some());
        assert!(Fallback::new(&cfg(r#","failure_mode":"closed""#)).is_none());
        assert!(Fallback::new(&cfg(r#","local_fallback":false"#)).is_none());
        assert!(Fallback::new(&cfg(r#","mode":"mint""#)).is_none(), "no store, nothing to fall back from");
    }

    #[test]
    fn the_first_runs_a_duplicate_waits_then_replays() {
        let (mut f, data) = fallback("");
        let (k, b) = (hex('a'), hex('b'));
        let first = f.begin(&data, 2, &k, &b, CalloutFault::Reset, Some(0));
        let t = token(&first);
        assert!(matches!(&first, LocalAnswer::Answer(_, m) if *m == [Metric::LocalLocks, Metric::Degraded]));
        assert_eq!(f.begin(&data, 3, &k, &b, CalloutFault::Reset, Some(10)), LocalAnswer::Wait);
        assert_eq!(f.tick_ms(), WAIT_POLL_MS);
        assert!(f.due(&data, 20, |_| false).is_empty(), "still held");
        let record = Record { status: 201, body: b"made".to_vec(), ..Record::default() }.encode();
        assert!(f.commit(&data, &k, t, &b, &record, Some(30)).is_empty());
        let due = f.due(&data, 40, |_| false);
        assert_eq!(due.len(), 1);
        match &due[0] {
            (3, LocalAnswer::Answer(Ok(BeginAnswer::Replay(r)), m)) => {
                assert_eq!(r.body, b"made");
                assert_eq!(*m, [Metric::LocalReplays]);
            }
            other => panic!("{other:?}"),
        }
        // Another body: 422, no wait.
        let other = f.begin(&data, 4, &k, &hex('c'), CalloutFault::Reset, Some(50));
        assert_eq!(other, LocalAnswer::Answer(Ok(BeginAnswer::Mismatch), vec![]));
    }

    #[test]
    fn a_waiter_past_lock_wait_gets_409_and_a_gone_one_its_fault() {
        let (mut f, data) = fallback("");
        let (k, b) = (hex('a'), hex('b'));
        token(&f.begin(&data, 2, &k, &b, CalloutFault::Timeout, Some(0)));
        assert_eq!(f.begin(&data, 3, &k, &b, CalloutFault::Timeout, Some(0)), LocalAnswer::Wait);
        assert_eq!(f.begin(&data, 4, &k, &b, CalloutFault::Timeout, Some(0)), LocalAnswer::Wait);
        let due = f.due(&data, 100, |id| id == 4);
        assert!(due.contains(&(4, LocalAnswer::Answer(Err(CalloutFault::Timeout), vec![]))));
        assert!(matches!(
            due.iter().find(|(id, _)| *id == 3),
            Some((_, LocalAnswer::Answer(Ok(BeginAnswer::Busy { .. }), _)))
        ));
        assert!(!f.is_waiting());
    }

    #[test]
    fn records_are_handed_back_once_and_a_failed_one_again() {
        let (mut f, data) = fallback("");
        let b = hex('b');
        for (stream, c) in [(2, 'a'), (3, 'c')] {
            let t = token(&f.begin(&data, stream, &hex(c), &b, CalloutFault::Reset, Some(0)));
            f.commit(&data, &hex(c), t, &b, &Record::status_only(201).encode(), Some(0));
        }
        assert_eq!(f.tick_ms(), HAND_BACK_MS);
        let (claimed, records) = f.hand_backs(&data, 5_000);
        assert_eq!((claimed.len(), records), (2, Some(2)));
        assert_eq!(f.hand_backs(&data, 5_500), (vec![], None), "at most one scan a second");
        f.handed_back(&data, &claimed[0].key, true, Some(5_600));
        f.handed_back(&data, &claimed[1].key, false, Some(5_600));
        assert_eq!(f.hand_backs(&data, 6_600), (vec![], None), "backing off after a failure");
        let (again, _) = f.hand_backs(&data, 5_600 + MIN_BACKOFF_MS);
        assert_eq!(again.iter().map(|h| &h.key).collect::<Vec<_>>(), [&claimed[1].key]);
        f.handed_back(&data, &again[0].key, true, Some(7_700));
        let (none, _) = f.hand_backs(&data, 8_700);
        assert!(none.is_empty());
        assert_eq!(f.tick_ms(), 0, "nothing left to hand back");
    }

    #[test]
    fn a_record_too_large_for_its_stripe_is_kept_without_its_body() {
        let (mut f, data) = fallback(r#","local_record_bytes":16384"#);
        let (k, b) = (hex('a'), hex('b'));
        let t = token(&f.begin(&data, 2, &k, &b, CalloutFault::Reset, Some(0)));
        let big = Record { status: 201, body: vec![7; 4096], ..Record::default() }.encode();
        f.commit(&data, &k, t, &b, &big, Some(1));
        match f.begin(&data, 3, &k, &b, CalloutFault::Reset, Some(2)) {
            LocalAnswer::Answer(Ok(BeginAnswer::Replay(r)), _) => {
                assert!(r.body_omitted && r.body.is_empty())
            }
            other => panic!("{other:?}"),
        }
    }
}
