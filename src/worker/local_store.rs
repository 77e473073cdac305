//! The local fallback: while the store fails, a lock and a record per store key shared by every
//! worker of one Envoy process, so that duplicates reaching this Envoy still run once. They live
//! in Envoy's shared data (one map per VM id, every worker's VM sees it), behind the
//! [`SharedData`] trait, written with compare-and-swap.
//!
//! Keys are spread over stripes, shared-data entries (`idempotency/local/<stripes>/<n>`; one per
//! 16 `local_record_entries`, 16 to [`MAX_STRIPES`]), each holding
//! the locks and records of its keys, oldest first. Each stripe is bounded in entries and bytes
//! (`local_record_entries` and `local_record_bytes` divided among the stripes): a new record
//! pushes out the stripe's oldest, so the oldest records go first and memory stays bounded
//! whatever the outage's traffic. Locks expire after `lock_ttl_ms`, records after
//! `retention_seconds`. Records not yet handed back to the store are marked so; once the store
//! answers again, [`LocalStore::claim_hand_backs`] hands them out, once each.
//!
//! While the store works, the stripes mirror what this Envoy does with it, so that an outage
//! cannot make this Envoy run a key twice: a lock the store granted is mirrored as a local lock
//! (duplicates that fall back to the local store wait for it), a record sent to the store leaves
//! a marker of its body hash (a retry in an outage gets `503` instead of running again), and a
//! record the store never took becomes a local record, handed back later with the store's token.

use crate::request::key;
use crate::worker::env::SharedData;

/// At most this many stripes: each is read whole by an operation on one of its keys, and all of
/// them by a hand-back scan.
pub const MAX_STRIPES: u32 = 4096;
/// How often a write is tried again after another worker wrote the stripe first.
const ATTEMPTS: usize = 16;
/// A claimed hand-back not confirmed within this is handed out again.
const CLAIM_MS: u64 = 10_000;
const MAGIC: &[u8; 4] = b"IDL2";

/// What `begin` finds locally.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Begin {
    /// A record for this key and body: its encoded bytes.
    Replay(Vec<u8>),
    /// A record for this key made with another body.
    Mismatch,
    /// The lock is ours.
    Locked,
    /// Another request holds the lock for this long still.
    Held { remaining_ms: u64 },
    /// This Envoy sent the store a record for this key and body: it is there, but cannot be
    /// read while the store fails (the request must not run again).
    Withheld,
    /// The shared data cannot be used (not set up, or too contended): no local guarantee.
    Unavailable,
}

/// What a hand-back scan found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scan {
    /// Records claimed for this worker to hand back.
    pub claimed: Vec<HandBack>,
    /// Local records kept (all stripes).
    pub records: usize,
    /// Records not yet confirmed handed back (claimed ones included).
    pub pending: usize,
}

/// A record to keep in place of a lock ([`LocalStore::commit`]): the answer for `key` to a
/// request whose body hashes to `body_hash`, made under the local lock of `owner`, to hand back
/// under `token`: the store's lock it was made under (a commit the store did not take), or
/// empty for a local lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalCommit<'a> {
    pub key: &'a str,
    pub owner: u64,
    pub body_hash: &'a str,
    pub record: &'a [u8],
    pub token: &'a str,
}

/// A record to hand back to the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandBack {
    pub key: String,
    pub body_hash: String,
    pub record: Vec<u8>,
    /// The store's lock token the record was made under (the commit then ends that lock too);
    /// empty for a record made under a local lock.
    pub token: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HandBackState {
    Pending,
    /// Claimed by a worker at this time.
    Claimed(u64),
    Done,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    Lock {
        owner: u64,
    },
    Record {
        body_hash: [u8; 32],
        hand_back: HandBackState,
        record: Vec<u8>,
        token: String,
    },
    /// A record sent to the store (the marker of a key the store holds).
    Stored {
        body_hash: [u8; 32],
    },
}

impl Entry {
    /// A record or a marker: what the bounds push out, oldest first (locks expire instead).
    fn is_kept(&self) -> bool {
        !matches!(self, Entry::Lock { .. })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Slot {
    key: [u8; 32],
    expires_ms: u64,
    entry: Entry,
}

impl Slot {
    fn cost(&self) -> usize {
        match &self.entry {
            Entry::Lock { .. } => 49,
            Entry::Record { record, token, .. } => 96 + record.len() + token.len(),
            Entry::Stored { .. } => 73,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Stripe {
    /// Oldest first.
    slots: Vec<Slot>,
}

#[derive(Debug, Clone)]
pub struct LocalStore {
    stripes: u32,
    stripe_entries: usize,
    stripe_bytes: usize,
    lock_ttl_ms: u64,
    retention_ms: u64,
    /// Records this VM pushed out before they were handed back, not yet counted.
    dropped: std::cell::Cell<u32>,
}

fn raw32(hex: &str) -> Option<[u8; 32]> {
    let bytes = hex.as_bytes();
    if !idem_protocol::is_hex64(bytes) {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in bytes.chunks(2).enumerate() {
        let digit = |b: u8| if b.is_ascii_digit() { b - b'0' } else { b - b'a' + 10 };
        out[i] = digit(pair[0]) << 4 | digit(pair[1]);
    }
    Some(out)
}

impl LocalStore {
    /// `entries` and `bytes` bound all stripes together.
    pub fn new(entries: usize, bytes: usize, lock_ttl_ms: u64, retention_ms: u64) -> LocalStore {
        let stripes = u32::try_from(entries / 16).unwrap_or(MAX_STRIPES).clamp(16, MAX_STRIPES);
        let n = stripes as usize;
        LocalStore {
            stripes,
            stripe_entries: entries.div_ceil(n).max(1),
            stripe_bytes: (bytes / n).max(1),
            lock_ttl_ms,
            retention_ms,
            dropped: std::cell::Cell::new(0),
        }
    }

    /// Records pushed out (the bounds) before they were handed back, since the last call.
    pub fn take_dropped(&self) -> u32 {
        self.dropped.replace(0)
    }

    fn name(&self, n: u32) -> String {
        format!("idempotency/local/{}/{n}", self.stripes)
    }

    fn stripe_name(&self, key: &[u8; 32]) -> String {
        self.name(u32::from_le_bytes([key[0], key[1], key[2], key[3]]) % self.stripes)
    }

    /// The largest record a stripe can keep (a larger one is kept without its body).
    pub fn max_record_bytes(&self) -> usize {
        self.stripe_bytes.saturating_sub(96 + 64)
    }

    /// Creates the stripes that do not exist yet. Run before any other use (at configuration):
    /// a stripe is only ever written with compare-and-swap afterwards, and Envoy cannot
    /// compare-and-swap a key that does not exist.
    pub fn set_up(&self, data: &dyn SharedData) -> bool {
        let empty = encode(&Stripe::default());
        (0..self.stripes).all(|n| {
            let name = self.name(n);
            data.get(&name).is_some() || (data.set(&name, &empty, 0) && data.get(&name).is_some())
        })
    }

    /// Reads the key's stripe, lets `change` decide (`Some`: write it back), and tries again
    /// when another worker wrote the stripe in between.
    fn update<T>(
        &self,
        data: &dyn SharedData,
        key: &[u8; 32],
        now_ms: u64,
        mut change: impl FnMut(&mut Stripe) -> (T, bool),
    ) -> Option<T> {
        let name = self.stripe_name(key);
        for _ in 0..ATTEMPTS {
            let (bytes, cas) = data.get(&name)?;
            let mut stripe = decode(&bytes).unwrap_or_default();
            let before = stripe.slots.len();
            stripe.slots.retain(|s| s.expires_ms > now_ms);
            let (out, write) = change(&mut stripe);
            if !write && stripe.slots.len() == before {
                return Some(out);
            }
            let dropped = self.trim(&mut stripe);
            if data.set(&name, &encode(&stripe), cas) {
                self.dropped.set(self.dropped.get().saturating_add(dropped));
                return Some(out);
            }
        }
        None
    }

    /// Pushes out the oldest records until the stripe fits its bounds (locks stay: they expire).
    /// Counts the records pushed out before they were handed back.
    fn trim(&self, stripe: &mut Stripe) -> u32 {
        let mut dropped = 0;
        let over = |s: &Stripe| {
            s.slots.len() > self.stripe_entries
                || s.slots.iter().map(Slot::cost).sum::<usize>() > self.stripe_bytes
        };
        while over(stripe) {
            let Some(i) = stripe.slots.iter().position(|s| s.entry.is_kept()) else {
                break;
            };
            let slot = stripe.slots.remove(i);
            if let Entry::Record { hand_back: HandBackState::Pending | HandBackState::Claimed(_), .. } =
                slot.entry
            {
                dropped += 1;
            }
        }
        dropped
    }

    /// The record for `key`, or its lock for `owner`, or who holds it.
    pub fn begin(&self, data: &dyn SharedData, key: &str, body_hash: &str, owner: u64, now_ms: u64) -> Begin {
        let (Some(k), Some(h)) = (raw32(key), raw32(body_hash)) else { return Begin::Unavailable };
        let expires_ms = now_ms.saturating_add(self.lock_ttl_ms);
        let found = self.update(data, &k, now_ms, |stripe| match stripe.slots.iter().find(|s| s.key == k) {
            Some(Slot { entry: Entry::Record { body_hash, record, .. }, .. }) if *body_hash == h => {
                (Begin::Replay(record.clone()), false)
            }
            Some(Slot { entry: Entry::Stored { body_hash }, .. }) if *body_hash == h => {
                (Begin::Withheld, false)
            }
            Some(Slot { entry: Entry::Record { .. } | Entry::Stored { .. }, .. }) => (Begin::Mismatch, false),
            Some(Slot { expires_ms, .. }) => (Begin::Held { remaining_ms: expires_ms - now_ms }, false),
            None => {
                stripe.slots.push(Slot { key: k, expires_ms, entry: Entry::Lock { owner } });
                (Begin::Locked, true)
            }
        });
        match found {
            // A lock that did not fit (the stripe is all locks) was not kept.
            Some(Begin::Locked) if !self.holds(data, &k, owner) => Begin::Unavailable,
            Some(begin) => begin,
            None => Begin::Unavailable,
        }
    }

    fn holds(&self, data: &dyn SharedData, key: &[u8; 32], owner: u64) -> bool {
        let Some((bytes, _)) = data.get(&self.stripe_name(key)) else { return false };
        decode(&bytes)
            .is_some_and(|s| s.slots.iter().any(|s| s.key == *key && s.entry == Entry::Lock { owner }))
    }

    /// Stores the record for its key in place of its owner's lock (or, the lock lost, unless a
    /// record exists), to hand back under its token (see [`LocalCommit`]). `false` when the
    /// shared data could not be written.
    pub fn commit(&self, data: &dyn SharedData, commit: LocalCommit<'_>, now_ms: u64) -> bool {
        let LocalCommit { key, owner, body_hash, record, token } = commit;
        let (Some(k), Some(h)) = (raw32(key), raw32(body_hash)) else { return false };
        let slot = Slot {
            key: k,
            expires_ms: now_ms.saturating_add(self.retention_ms),
            entry: Entry::Record {
                body_hash: h,
                hand_back: HandBackState::Pending,
                record: record.to_vec(),
                token: token.to_string(),
            },
        };
        self.replace_lock(data, &k, owner, slot, now_ms)
    }

    /// Puts `slot` in place of `owner`'s lock on its key (and of a marker), unless a record of
    /// the key is kept already; `false` when the shared data could not be written.
    fn replace_lock(&self, data: &dyn SharedData, k: &[u8; 32], owner: u64, slot: Slot, now_ms: u64) -> bool {
        self.update(data, k, now_ms, |stripe| {
            let exists = stripe.slots.iter().any(|s| s.key == *k && matches!(s.entry, Entry::Record { .. }));
            stripe.slots.retain(|s| {
                !(s.key == *k
                    && (s.entry == Entry::Lock { owner } || matches!(s.entry, Entry::Stored { .. })))
            });
            if !exists {
                stripe.slots.push(slot.clone());
            }
            ((), true)
        })
        .is_some()
    }

    /// The store granted its lock on `key`: mirrors it as `owner`'s local lock, so that a
    /// duplicate which falls back to the local store meanwhile waits for it. Returns what the
    /// local store holds instead: a record made here in an outage and not yet handed back (to
    /// replay, or `Mismatch`), or a local lock another request holds (`Held`); `Locked` when the
    /// lock is mirrored, `Unavailable` when it could not be.
    pub fn adopt(&self, data: &dyn SharedData, key: &str, body_hash: &str, owner: u64, now_ms: u64) -> Begin {
        let (Some(k), Some(h)) = (raw32(key), raw32(body_hash)) else { return Begin::Unavailable };
        let expires_ms = now_ms.saturating_add(self.lock_ttl_ms);
        let lock = Slot { key: k, expires_ms, entry: Entry::Lock { owner } };
        let found = self.update(data, &k, now_ms, |stripe| {
            let i = stripe.slots.iter().position(|s| s.key == k);
            match i.map(|i| &stripe.slots[i]) {
                Some(Slot { entry: Entry::Record { body_hash, record, .. }, .. }) if *body_hash == h => {
                    (Begin::Replay(record.clone()), false)
                }
                Some(Slot { entry: Entry::Record { .. }, .. }) => (Begin::Mismatch, false),
                Some(Slot { entry: Entry::Lock { .. }, expires_ms, .. }) => {
                    (Begin::Held { remaining_ms: expires_ms - now_ms }, false)
                }
                // The store has no record after all (it expired there, or was deleted): its
                // answer wins over the marker.
                Some(Slot { entry: Entry::Stored { .. }, .. }) => {
                    if let Some(i) = i {
                        stripe.slots.remove(i);
                    }
                    stripe.slots.push(lock.clone());
                    (Begin::Locked, true)
                }
                None => {
                    stripe.slots.push(lock.clone());
                    (Begin::Locked, true)
                }
            }
        });
        found.unwrap_or(Begin::Unavailable)
    }

    /// The record made under `owner`'s mirrored lock was sent to the store: a marker takes the
    /// lock's place (kept like a record, expiring with the retention).
    pub fn sent(&self, data: &dyn SharedData, key: &str, owner: u64, body_hash: &str, now_ms: u64) {
        let (Some(k), Some(h)) = (raw32(key), raw32(body_hash)) else { return };
        let slot = Slot {
            key: k,
            expires_ms: now_ms.saturating_add(self.retention_ms),
            entry: Entry::Stored { body_hash: h },
        };
        self.replace_lock(data, &k, owner, slot, now_ms);
    }

    /// Gives `owner`'s lock on `key` back.
    pub fn release(&self, data: &dyn SharedData, key: &str, owner: u64, now_ms: u64) {
        let Some(k) = raw32(key) else { return };
        self.update(data, &k, now_ms, |stripe| {
            let before = stripe.slots.len();
            stripe.slots.retain(|s| !(s.key == k && s.entry == Entry::Lock { owner }));
            ((), stripe.slots.len() != before)
        });
    }

    /// Claims up to `limit` records not yet handed back to the store (or claimed longer ago
    /// than [`CLAIM_MS`]), and counts the records kept and those still to hand back.
    pub fn claim_hand_backs(&self, data: &dyn SharedData, limit: usize, now_ms: u64) -> Scan {
        let mut scan = Scan::default();
        for n in 0..self.stripes {
            let name = self.name(n);
            for _ in 0..ATTEMPTS {
                let Some((bytes, cas)) = data.get(&name) else { break };
                let Some(mut stripe) = decode(&bytes) else { break };
                stripe.slots.retain(|s| s.expires_ms > now_ms);
                let mut mine = Vec::new();
                let mut pending = 0;
                for slot in &mut stripe.slots {
                    let Entry::Record { body_hash, hand_back, record, token } = &mut slot.entry else {
                        continue;
                    };
                    let due = match hand_back {
                        HandBackState::Pending => true,
                        HandBackState::Claimed(at) => at.saturating_add(CLAIM_MS) <= now_ms,
                        HandBackState::Done => continue,
                    };
                    pending += 1;
                    if due && scan.claimed.len() + mine.len() < limit {
                        *hand_back = HandBackState::Claimed(now_ms);
                        mine.push(HandBack {
                            key: key::hex(&slot.key),
                            body_hash: key::hex(body_hash),
                            record: record.clone(),
                            token: token.clone(),
                        });
                    }
                }
                let kept = stripe.slots.iter().filter(|s| matches!(s.entry, Entry::Record { .. })).count();
                if mine.is_empty() || data.set(&name, &encode(&stripe), cas) {
                    scan.records += kept;
                    scan.pending += pending;
                    scan.claimed.extend(mine);
                    break;
                }
            }
        }
        scan
    }

    /// A claimed record's hand-back failed: it is offered again.
    pub fn unclaim(&self, data: &dyn SharedData, key: &str, now_ms: u64) {
        self.set_hand_back(data, key, HandBackState::Pending, now_ms);
    }

    fn set_hand_back(&self, data: &dyn SharedData, key: &str, state: HandBackState, now_ms: u64) {
        let Some(k) = raw32(key) else { return };
        self.update(data, &k, now_ms, |stripe| {
            let mut changed = false;
            for slot in stripe.slots.iter_mut().filter(|s| s.key == k) {
                if let Entry::Record { hand_back, .. } = &mut slot.entry {
                    *hand_back = state;
                    changed = true;
                }
            }
            ((), changed)
        });
    }

    /// Local locks held (not expired) across all stripes: for tests and the simulation.
    pub fn held_locks(&self, data: &dyn SharedData, now_ms: u64) -> usize {
        (0..self.stripes)
            .filter_map(|n| data.get(&self.name(n)))
            .filter_map(|(bytes, _)| decode(&bytes))
            .flat_map(|stripe| stripe.slots)
            .filter(|s| s.expires_ms > now_ms && matches!(s.entry, Entry::Lock { .. }))
            .count()
    }

    /// The store took (or already had) the record handed back for `key`.
    pub fn handed_back(&self, data: &dyn SharedData, key: &str, now_ms: u64) {
        self.set_hand_back(data, key, HandBackState::Done, now_ms);
    }
}

fn encode(stripe: &Stripe) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&(stripe.slots.len() as u32).to_le_bytes());
    for slot in &stripe.slots {
        out.extend_from_slice(&slot.key);
        out.extend_from_slice(&slot.expires_ms.to_le_bytes());
        match &slot.entry {
            Entry::Lock { owner } => {
                out.push(1);
                out.extend_from_slice(&owner.to_le_bytes());
            }
            Entry::Record { body_hash, hand_back, record, token } => {
                out.push(2);
                out.extend_from_slice(body_hash);
                let (state, at) = match hand_back {
                    HandBackState::Pending => (0, 0),
                    HandBackState::Claimed(at) => (1, *at),
                    HandBackState::Done => (2, 0),
                };
                out.push(state);
                out.extend_from_slice(&at.to_le_bytes());
                out.extend_from_slice(&(record.len() as u32).to_le_bytes());
                out.extend_from_slice(record);
                out.push(token.len().min(255) as u8);
                out.extend_from_slice(&token.as_bytes()[..token.len().min(255)]);
            }
            Entry::Stored { body_hash } => {
                out.push(3);
                out.extend_from_slice(body_hash);
            }
        }
    }
    out
}

/// Reads a stripe; anything malformed is `None` (and is then rewritten as empty).
fn decode(bytes: &[u8]) -> Option<Stripe> {
    let mut r = Reader(bytes);
    if r.take(4)? != MAGIC {
        return None;
    }
    let n = r.u32()?;
    let mut slots = Vec::new();
    for _ in 0..n {
        let key: [u8; 32] = r.take(32)?.try_into().ok()?;
        let expires_ms = r.u64()?;
        let entry = match r.take(1)?[0] {
            1 => Entry::Lock { owner: r.u64()? },
            2 => {
                let body_hash: [u8; 32] = r.take(32)?.try_into().ok()?;
                let state = r.take(1)?[0];
                let at = r.u64()?;
                let hand_back = match state {
                    0 => HandBackState::Pending,
                    1 => HandBackState::Claimed(at),
                    2 => HandBackState::Done,
                    _ => return None,
                };
                let len = r.u32()? as usize;
                let record = r.take(len)?.to_vec();
                let token_len = r.take(1)?[0] as usize;
                let token = String::from_utf8(r.take(token_len)?.to_vec()).ok()?;
                Entry::Record { body_hash, hand_back, record, token }
            }
            3 => Entry::Stored { body_hash: r.take(32)?.try_into().ok()? },
            _ => return None,
        };
        slots.push(Slot { key, expires_ms, entry });
    }
    r.0.is_empty().then_some(Stripe { slots })
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::memory::MemoryData;

    fn k(n: u32) -> String {
        key::hex(&sha2::Digest::finalize(<sha2::Sha256 as sha2::Digest>::new_with_prefix(n.to_le_bytes())))
    }

    /// Whether `key` has a record, without taking a lock as `begin` would.
    fn has_record(s: &LocalStore, data: &MemoryData, key: &str) -> bool {
        let k = raw32(key).unwrap();
        let (bytes, _) = data.get(&s.stripe_name(&k)).unwrap();
        decode(&bytes).unwrap().slots.iter().any(|s| s.key == k && matches!(s.entry, Entry::Record { .. }))
    }

    /// The record of a request that ran under the local lock of `owner`.
    fn kept<'a>(key: &'a str, owner: u64, body_hash: &'a str, record: &'a [u8]) -> LocalCommit<'a> {
        LocalCommit { key, owner, body_hash, record, token: "" }
    }

    fn store() -> (LocalStore, MemoryData) {
        let s = LocalStore::new(4096 * 4, 4096 * 2000, 1000, 60_000);
        let data = MemoryData::default();
        assert!(s.set_up(&data));
        (s, data)
    }

    #[test]
    fn one_lock_then_a_record_replayed_to_the_same_body_only() {
        let (s, data) = store();
        let (key, a, b) = (k(1), k(100), k(101));
        assert_eq!(s.begin(&data, &key, &a, 7, 0), Begin::Locked);
        assert_eq!(s.begin(&data, &key, &a, 8, 10), Begin::Held { remaining_ms: 990 });
        assert!(s.commit(&data, kept(&key, 7, &a, b"rec"), 20));
        assert_eq!(s.begin(&data, &key, &a, 8, 30), Begin::Replay(b"rec".to_vec()));
        assert_eq!(s.begin(&data, &key, &b, 8, 30), Begin::Mismatch);
        // Expired with the retention.
        assert_eq!(s.begin(&data, &key, &a, 8, 60_020), Begin::Locked);
    }

    #[test]
    fn the_stores_locks_and_records_are_mirrored() {
        let (s, data) = store();
        let (key, a, b) = (k(3), k(100), k(101));
        assert_eq!(s.adopt(&data, &key, &a, 7, 0), Begin::Locked);
        assert_eq!(s.begin(&data, &key, &a, 8, 10), Begin::Held { remaining_ms: 990 });
        s.sent(&data, &key, 7, &a, 20);
        assert_eq!(s.begin(&data, &key, &a, 8, 30), Begin::Withheld);
        assert_eq!(s.begin(&data, &key, &b, 8, 30), Begin::Mismatch);
        // The store says it has no record after all: its lock wins over the marker.
        assert_eq!(s.adopt(&data, &key, &a, 9, 40), Begin::Locked);
        // Its commit failed: the record is kept, replayed, and handed back under its token.
        s.sent(&data, &key, 9, &a, 50);
        assert!(s.commit(&data, LocalCommit { token: "tok9", ..kept(&key, 9, &a, b"rec") }, 60));
        assert_eq!(s.begin(&data, &key, &a, 8, 70), Begin::Replay(b"rec".to_vec()));
        assert_eq!(s.adopt(&data, &key, &a, 10, 70), Begin::Replay(b"rec".to_vec()));
        let claimed = s.claim_hand_backs(&data, 10, 80).claimed;
        assert_eq!(
            (claimed.len(), claimed[0].token.as_str(), claimed[0].record.as_slice()),
            (1, "tok9", &b"rec"[..])
        );
        // Markers expire with the retention.
        let other = k(4);
        assert_eq!(s.adopt(&data, &other, &a, 11, 0), Begin::Locked);
        s.sent(&data, &other, 11, &a, 0);
        assert_eq!(s.begin(&data, &other, &a, 12, 60_001), Begin::Locked);
    }

    #[test]
    fn a_released_or_expired_lock_can_be_taken() {
        let (s, data) = store();
        let (key, a) = (k(2), k(100));
        assert_eq!(s.begin(&data, &key, &a, 1, 0), Begin::Locked);
        s.release(&data, &key, 2, 1); // not the owner: nothing
        assert!(matches!(s.begin(&data, &key, &a, 2, 1), Begin::Held { .. }));
        s.release(&data, &key, 1, 2);
        assert_eq!(s.begin(&data, &key, &a, 2, 3), Begin::Locked);
        assert_eq!(s.begin(&data, &key, &a, 3, 1003), Begin::Locked, "the TTL ran out");
    }

    #[test]
    fn without_set_up_or_with_bad_keys_nothing_is_promised() {
        let s = LocalStore::new(100, 100_000, 1000, 1000);
        let data = MemoryData::default();
        assert_eq!(s.begin(&data, &k(1), &k(2), 1, 0), Begin::Unavailable);
        assert!(s.set_up(&data));
        assert_eq!(s.begin(&data, "not-hex", &k(2), 1, 0), Begin::Unavailable);
    }

    #[test]
    fn a_flood_keeps_the_bound_and_the_newest_records() {
        // 256 stripes of sixteen 40-byte records (134 bytes accounted each), by entries and bytes.
        let (entries, bytes) = (16 * 256, 2200 * 256);
        let s = LocalStore::new(entries, bytes, 1000, 60_000);
        assert_eq!(s.stripes, 256);
        let data = MemoryData::default();
        assert!(s.set_up(&data));
        let body = k(1_000_000);
        let flood = 40_000;
        for n in 0..flood {
            let key = k(n);
            assert_eq!(s.begin(&data, &key, &body, u64::from(n), 0), Begin::Locked);
            assert!(s.commit(&data, kept(&key, u64::from(n), &body, &[0u8; 40]), 0));
        }
        let dropped = s.take_dropped();
        // Encoded, a slot takes no more than it is accounted for; 8 bytes of header a stripe.
        assert!(data.bytes() <= bytes + 8 * 256, "{}", data.bytes());
        let kept = (0..flood).filter(|&n| has_record(&s, &data, &k(n))).count();
        assert!((entries * 3 / 4..=entries).contains(&kept), "{kept}");
        assert_eq!(dropped as usize, flood as usize - kept);
        // The newest are kept, the oldest went first.
        let newest = (flood - 100..flood).filter(|&n| has_record(&s, &data, &k(n))).count();
        let oldest = (0..1000).filter(|&n| has_record(&s, &data, &k(n))).count();
        assert!(newest >= 95 && oldest == 0, "{newest} {oldest}");
        assert_eq!(s.begin(&data, &k(flood - 1), &body, 1, 0), Begin::Replay(vec![0; 40]));
    }

    #[test]
    fn hand_backs_are_claimed_once_until_confirmed_or_stale() {
        let (s, data) = store();
        let body = k(100);
        for n in 0..5 {
            s.begin(&data, &k(n), &body, 1, 0);
            s.commit(&data, kept(&k(n), 1, &body, b"r"), 0);
        }
        let scan = s.claim_hand_backs(&data, 3, 10);
        let first = scan.claimed;
        assert_eq!((first.len(), scan.records, scan.pending), (3, 5, 5));
        let second = s.claim_hand_backs(&data, 10, 20).claimed;
        assert_eq!(second.len(), 2, "the claimed ones are not handed out twice");
        for h in first.iter().chain(&second) {
            assert_eq!((h.body_hash.as_str(), h.record.as_slice()), (body.as_str(), &b"r"[..]));
        }
        s.handed_back(&data, &first[0].key, 30);
        s.unclaim(&data, &first[1].key, 30);
        let scan = s.claim_hand_backs(&data, 10, 40);
        assert_eq!(
            scan.claimed.iter().map(|h| &h.key).collect::<Vec<_>>(),
            [&first[1].key],
            "unclaimed: again"
        );
        assert_eq!((scan.records, scan.pending), (5, 4));
        // Unconfirmed claims come back after CLAIM_MS; confirmed ones never.
        let again = s.claim_hand_backs(&data, 10, 40 + CLAIM_MS).claimed;
        assert_eq!(again.len(), 4);
        assert!(again.iter().all(|h| h.key != first[0].key));
    }

    #[test]
    fn a_concurrent_writer_makes_the_write_try_again() {
        struct Racing<'a> {
            inner: &'a MemoryData,
            races: std::cell::Cell<u32>,
        }
        impl SharedData for Racing<'_> {
            fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
                self.inner.get(key)
            }
            fn set(&self, key: &str, value: &[u8], cas: u32) -> bool {
                if self.races.get() > 0 {
                    // Another worker writes the same stripe first.
                    self.races.set(self.races.get() - 1);
                    let (v, c) = self.inner.get(key).unwrap();
                    assert!(self.inner.set(key, &v, c));
                }
                self.inner.set(key, value, cas)
            }
        }
        let (s, data) = store();
        let racing = Racing { inner: &data, races: std::cell::Cell::new(3) };
        assert_eq!(s.begin(&racing, &k(1), &k(2), 1, 0), Begin::Locked);
        let always = Racing { inner: &data, races: std::cell::Cell::new(u32::MAX) };
        assert_eq!(s.begin(&always, &k(3), &k(2), 1, 0), Begin::Unavailable, "bounded tries");
    }
}
