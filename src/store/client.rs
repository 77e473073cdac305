//! The filter's side of the store protocol (`idem_protocol`): the callout each store call
//! becomes, and strict decoding of the answers. Anything unexpected is a [`CalloutFault`].

use idem_protocol as proto;
use idem_protocol::{BeginOutcome, CommitOutcome, ReleaseOutcome};

use crate::config::values::UnknownOutcome;
use crate::config::Config;
use crate::store::record::Record;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreCall {
    Begin {
        key: String,
        body_hash: String,
        lock: LockTerms,
        /// `unknown_outcome: hold`: the store keeps a trace of the attempt (see [`Hold`]).
        hold: Option<Hold>,
    },
    /// `retention_s`: how long the store keeps the record (the route's `retention_seconds`).
    Commit { key: String, token: LockToken, body_hash: String, record: Vec<u8>, retention_s: u64 },
    /// `in_doubt`: the attempt was sent and its answer never came back: the store drops the
    /// lock and keeps the attempt's trace, so the key is in doubt (`unknown_outcome: hold`).
    /// Otherwise it never reached the application, and the trace goes too.
    Release { key: String, token: LockToken, in_doubt: bool },
}

/// What a `begin` under `unknown_outcome: hold` asks of the store besides the lock: keep a trace
/// of the attempt for `retention_s` (the route's `retention_seconds`), answer `in-doubt` for a
/// key an earlier attempt left in doubt, and first clear the trace of the attempt `supersede`
/// names (the application answered that it never committed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    pub retention_s: u64,
    pub supersede: Option<String>,
}

impl Hold {
    /// The terms of a route's `begin`: `None` under `unknown_outcome: run_again`.
    pub fn of(cfg: &Config) -> Option<Hold> {
        (cfg.unknown_outcome == UnknownOutcome::Hold)
            .then_some(Hold { retention_s: cfg.retention_seconds, supersede: None })
    }
}

/// The lock a `begin` asks for: its TTL and how long to wait for another holder's. They are
/// the request's route's (`routes`), so each call carries them rather than the worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LockTerms {
    pub ttl_ms: u64,
    pub wait_ms: u64,
}

impl LockTerms {
    pub fn of(cfg: &Config) -> LockTerms {
        LockTerms { ttl_ms: cfg.lock_ttl_ms, wait_ms: cfg.lock_wait_ms }
    }
}

/// The lock a `begin` granted, which the machine gives back with its commit or release.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LockToken {
    /// The store's lock: its token, sent back with the commit or release.
    Store(String),
    /// A lock of this Envoy's local fallback, taken while the store failed (`worker::fallback`):
    /// its owner in the local store. Its commit and release stay in this Envoy; the worker
    /// never sends it to the store.
    Local(u64),
}

/// As sent to the store, and in log lines.
impl std::fmt::Display for LockToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LockToken::Store(token) => f.write_str(token),
            LockToken::Local(owner) => write!(f, "local-{owner:016x}"),
        }
    }
}

/// A store token, in tests.
#[cfg(any(test, feature = "sim"))]
impl From<&str> for LockToken {
    fn from(token: &str) -> LockToken {
        LockToken::Store(token.to_string())
    }
}

#[cfg(any(test, feature = "sim"))]
impl From<String> for LockToken {
    fn from(token: String) -> LockToken {
        LockToken::Store(token)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallKind {
    Begin,
    Commit,
    Release,
}

/// An HTTP callout to the store cluster.
#[derive(Clone, PartialEq, Eq)]
pub struct Callout {
    pub headers: Vec<(&'static str, String)>,
    pub body: Option<Vec<u8>>,
    pub timeout_ms: u64,
}

/// Shows every header but the shared secret's value.
impl std::fmt::Debug for Callout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let headers: Vec<(&str, &str)> = self
            .headers
            .iter()
            .map(|(n, v)| (*n, if *n == proto::HEADER_SECRET { "<redacted>" } else { v.as_str() }))
            .collect();
        f.debug_struct("Callout")
            .field("headers", &headers)
            .field("body", &self.body.as_ref().map(Vec::len))
            .field("timeout_ms", &self.timeout_ms)
            .finish()
    }
}

impl StoreCall {
    pub fn kind(&self) -> CallKind {
        match self {
            StoreCall::Begin { .. } => CallKind::Begin,
            StoreCall::Commit { .. } => CallKind::Commit,
            StoreCall::Release { .. } => CallKind::Release,
        }
    }

    pub fn key(&self) -> &str {
        match self {
            StoreCall::Begin { key, .. } | StoreCall::Commit { key, .. } | StoreCall::Release { key, .. } => {
                key
            }
        }
    }

    /// A commit's retention.
    pub fn retention_s(&self) -> Option<u64> {
        match self {
            StoreCall::Commit { retention_s, .. } => Some(*retention_s),
            StoreCall::Begin { .. } | StoreCall::Release { .. } => None,
        }
    }

    /// What to send when this call failed on its `attempt`-th try (0 first). A failed commit is
    /// tried once more (safe: if the first one did land, the second finds the record and keeps
    /// it), then its lock is released, so that duplicates run again instead of waiting out the
    /// lock's TTL. A failed release is left to the TTL; a failed begin is the request's to handle.
    pub fn after_fault(&self, attempt: u32) -> Option<StoreCall> {
        match self {
            StoreCall::Commit { .. } if attempt == 0 => Some(self.clone()),
            StoreCall::Commit { key, token, .. } => {
                Some(StoreCall::Release { key: key.clone(), token: token.clone(), in_doubt: false })
            }
            StoreCall::Begin { .. } | StoreCall::Release { .. } => None,
        }
    }

    /// The callout, sent at `sent_ms` (milliseconds since the Unix epoch, when the host can
    /// tell): a `begin` carries when the filter will give up on it (see
    /// [`proto::HEADER_DEADLINE_MS`]).
    pub fn callout(&self, cfg: &Config, sent_ms: Option<u64>) -> Callout {
        let mut headers = vec![
            (":method", "POST".to_string()),
            (":authority", cfg.store_cluster.clone()),
            (proto::HEADER_KEY, self.key().to_string()),
        ];
        if let Some(secret) = &cfg.store_secret {
            headers.push((proto::HEADER_SECRET, secret.as_str().to_string()));
        }
        let (path, body, timeout_ms) = match self {
            StoreCall::Begin { body_hash, lock, hold, .. } => {
                headers.push((proto::HEADER_BODY_HASH, body_hash.clone()));
                headers.push((proto::HEADER_LOCK_TTL_MS, lock.ttl_ms.to_string()));
                headers.push((proto::HEADER_WAIT_MS, lock.wait_ms.to_string()));
                if let Some(hold) = hold {
                    headers.push((proto::HEADER_HOLD, "1".to_string()));
                    headers.push((proto::HEADER_RETENTION_S, hold.retention_s.to_string()));
                    if let Some(token) = &hold.supersede {
                        headers.push((proto::HEADER_SUPERSEDE, token.clone()));
                    }
                }
                // The store may hold the call for the whole wait before it answers.
                let timeout_ms = cfg.store_timeout_ms + lock.wait_ms;
                if let Some(sent) = sent_ms {
                    headers.push((proto::HEADER_DEADLINE_MS, sent.saturating_add(timeout_ms).to_string()));
                }
                (proto::PATH_BEGIN, None, timeout_ms)
            }
            StoreCall::Commit { token, body_hash, record, retention_s, .. } => {
                headers.push((proto::HEADER_TOKEN, token.to_string()));
                headers.push((proto::HEADER_BODY_HASH, body_hash.clone()));
                headers.push((proto::HEADER_RETENTION_S, retention_s.to_string()));
                headers.push(("content-type", "application/octet-stream".to_string()));
                (proto::PATH_COMMIT, Some(record.clone()), cfg.store_timeout_ms)
            }
            StoreCall::Release { token, in_doubt, .. } => {
                headers.push((proto::HEADER_TOKEN, token.to_string()));
                if *in_doubt {
                    headers.push((proto::HEADER_IN_DOUBT, "1".to_string()));
                }
                (proto::PATH_RELEASE, None, cfg.store_timeout_ms)
            }
        };
        headers.insert(1, (":path", path.to_string()));
        Callout { headers, body, timeout_ms }
    }
}

/// Commits sent together (`commits`): at most this many bytes of records per call, below
/// idemstore's default body limit (8 MiB) with room to spare; a bigger record goes alone.
pub const MAX_BATCH_BYTES: usize = 1024 * 1024;

/// One `commits` callout for these commits (each a [`StoreCall::Commit`], all with the same
/// retention, the first's; anything else is left out, as no caller sends one).
pub fn batch_callout(cfg: &Config, commits: &[&StoreCall]) -> Callout {
    let mut headers = vec![
        (":method", "POST".to_string()),
        (":path", proto::PATH_COMMITS.to_string()),
        (":authority", cfg.store_cluster.clone()),
    ];
    if let Some(secret) = &cfg.store_secret {
        headers.push((proto::HEADER_SECRET, secret.as_str().to_string()));
    }
    let retention_s = commits.iter().find_map(|c| c.retention_s()).unwrap_or(cfg.retention_seconds);
    headers.push((proto::HEADER_RETENTION_S, retention_s.to_string()));
    headers.push(("content-type", "application/octet-stream".to_string()));
    let mut body = Vec::new();
    for call in commits {
        if let StoreCall::Commit { key, token, body_hash, record, .. } = call {
            proto::encode_batch_item(&mut body, key, &token.to_string(), body_hash, record);
        }
    }
    Callout { headers, body: Some(body), timeout_ms: cfg.store_timeout_ms }
}

/// Why an HTTP callout gave no usable answer: a store call, or a detached execution's call to
/// the upstream (see `request::detached`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CalloutFault {
    /// The callout could not be dispatched (unknown cluster, host error).
    Dispatch,
    /// The connection was reset (or, for a store call, refused): the answer has no headers.
    Reset,
    /// An upstream call whose connection could not be made: nothing was sent.
    Refused,
    /// Envoy's callout timeout fired (`:status 504`).
    Timeout,
    /// The store answered with a non-200 status.
    Status(u16),
    /// An answer that does not follow the protocol.
    Garbage(&'static str),
    /// Not sent: the store failed recently (see `worker::breaker`).
    Skipped,
}

impl std::fmt::Display for CalloutFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CalloutFault::Dispatch => f.write_str("callout could not be dispatched"),
            CalloutFault::Reset => f.write_str("connection reset or refused"),
            CalloutFault::Refused => f.write_str("connection refused or not made: nothing was sent"),
            CalloutFault::Timeout => f.write_str("timed out"),
            // idemstore's only 401: its shared secret was missing or wrong.
            CalloutFault::Status(401) => f.write_str(
                "store refused the secret (401): check store_secret / store_secret_env against idemstore's --secret",
            ),
            CalloutFault::Status(s) => write!(f, "answered status {s}"),
            CalloutFault::Garbage(what) => write!(f, "answered garbage: {what}"),
            CalloutFault::Skipped => f.write_str("not sent: the store failed recently (breaker open)"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BeginAnswer {
    Replay(Record),
    Locked {
        token: LockToken,
    },
    /// The lock is still held; `lock_ms`: how long it still lives, when the store says.
    Busy {
        lock_ms: Option<u64>,
    },
    Mismatch,
    /// The store holds a record for this key and body (this Envoy sent it) but cannot be read
    /// now: the local fallback's answer for a retry in an outage, which must not run again.
    Withheld,
    /// An earlier attempt with this body reached the application and its outcome is unknown
    /// (`unknown_outcome: hold`): nothing was locked. `token`: that attempt's (a late commit
    /// under it resolves the key); it began at `started_ms` (the store's clock) and may still be
    /// running for `running_ms`.
    InDoubt {
        token: LockToken,
        started_ms: u64,
        running_ms: u64,
    },
}

/// An `in-doubt` answer, read strictly: a token the store could have minted, a start time and
/// a time left the store must give.
pub fn in_doubt(
    token: &[u8],
    started_ms: Option<u64>,
    running_ms: Option<u64>,
) -> Result<BeginAnswer, CalloutFault> {
    if !proto::is_token(token) {
        return Err(CalloutFault::Garbage("bad token"));
    }
    let (Some(started_ms), Some(running_ms)) = (started_ms, running_ms) else {
        return Err(CalloutFault::Garbage("in-doubt without its times"));
    };
    let token = LockToken::Store(String::from_utf8_lossy(token).into_owned());
    Ok(BeginAnswer::InDoubt { token, started_ms, running_ms })
}

/// What a store call's answer says, however it came: an HTTP callout's ([`Answer`]) or a message
/// on the store stream (`store::stream::Answered`). Each reads strictly, to a [`CalloutFault`].
pub trait StoreAnswer {
    fn begin(&self) -> Result<BeginAnswer, CalloutFault>;
    /// How long a `record` answer's record still lives in the store, when it says.
    fn record_ttl_ms(&self) -> Option<u64>;
    fn commit(&self) -> Result<CommitOutcome, CalloutFault>;
    fn release(&self) -> Result<ReleaseOutcome, CalloutFault>;
}

impl StoreAnswer for Answer<'_> {
    fn begin(&self) -> Result<BeginAnswer, CalloutFault> {
        Answer::begin(self)
    }
    fn record_ttl_ms(&self) -> Option<u64> {
        Answer::record_ttl_ms(self)
    }
    fn commit(&self) -> Result<CommitOutcome, CalloutFault> {
        Answer::commit(self)
    }
    fn release(&self) -> Result<ReleaseOutcome, CalloutFault> {
        Answer::release(self)
    }
}

/// A store answer as the host received it.
pub struct Answer<'a> {
    pub headers: &'a [(String, Vec<u8>)],
    pub body: &'a [u8],
}

impl Answer<'_> {
    fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_slice())
    }

    /// The outcome header of a well-formed `200`, or the fault.
    fn outcome(&self) -> Result<&[u8], CalloutFault> {
        if self.headers.is_empty() {
            return Err(CalloutFault::Reset);
        }
        let status = self
            .header(":status")
            .and_then(|s| std::str::from_utf8(s).ok())
            .and_then(|s| s.parse::<u16>().ok())
            .ok_or(CalloutFault::Garbage("no status"))?;
        match status {
            200 => self.header(proto::HEADER_OUTCOME).ok_or(CalloutFault::Garbage("no outcome")),
            504 => Err(CalloutFault::Timeout),
            other => Err(CalloutFault::Status(other)),
        }
    }

    pub fn begin(&self) -> Result<BeginAnswer, CalloutFault> {
        let outcome = BeginOutcome::parse(self.outcome()?).ok_or(CalloutFault::Garbage("unknown outcome"))?;
        Ok(match outcome {
            BeginOutcome::Record => {
                BeginAnswer::Replay(Record::decode(self.body).map_err(|e| CalloutFault::Garbage(e.0))?)
            }
            BeginOutcome::Locked => {
                let token = self.header(proto::HEADER_TOKEN).ok_or(CalloutFault::Garbage("no token"))?;
                if !proto::is_token(token) {
                    return Err(CalloutFault::Garbage("bad token"));
                }
                BeginAnswer::Locked { token: LockToken::Store(String::from_utf8_lossy(token).into_owned()) }
            }
            // Optional and advisory (the 409's `retry-after`): absent or malformed is `None`.
            BeginOutcome::Busy => BeginAnswer::Busy {
                lock_ms: self
                    .header(proto::HEADER_LOCK_REMAINING_MS)
                    .and_then(|v| proto::parse_bounded(v, proto::MAX_LOCK_TTL_MS)),
            },
            BeginOutcome::Mismatch => BeginAnswer::Mismatch,
            // The store reached the call past the deadline it carried: for the filter, a
            // timeout (nothing was locked).
            BeginOutcome::Expired => return Err(CalloutFault::Timeout),
            BeginOutcome::InDoubt => {
                let number =
                    |name: &str, max: u64| self.header(name).and_then(|v| proto::parse_in(v, 0..=max));
                in_doubt(
                    self.header(proto::HEADER_TOKEN).unwrap_or_default(),
                    number(proto::HEADER_STARTED_MS, u64::MAX),
                    number(proto::HEADER_RUNNING_MS, proto::MAX_LOCK_TTL_MS),
                )?
            }
        })
    }

    /// How long a `record` answer's record still lives in the store, when it says. Absent or
    /// malformed is `None` (the record is replayed but not cached), not a fault: failing the
    /// `begin` over it would run the request again.
    pub fn record_ttl_ms(&self) -> Option<u64> {
        let max_ms = proto::MAX_RETENTION_S * 1000;
        self.header(proto::HEADER_TTL_MS).and_then(|v| proto::parse_bounded(v, max_ms))
    }

    pub fn commit(&self) -> Result<CommitOutcome, CalloutFault> {
        CommitOutcome::parse(self.outcome()?).ok_or(CalloutFault::Garbage("unknown outcome"))
    }

    /// A `commits` answer for `n` items: each item's outcome (one the store did not do is a
    /// `503`, as its own `commit` would have answered), or the fault of the whole call.
    pub fn commits(&self, n: usize) -> Result<Vec<Result<CommitOutcome, CalloutFault>>, CalloutFault> {
        if self.outcome()? != proto::BATCH_OUTCOME.as_bytes() {
            return Err(CalloutFault::Garbage("unknown outcome"));
        }
        let outcomes =
            proto::decode_batch_answer(self.body, n).ok_or(CalloutFault::Garbage("bad batch answer"))?;
        Ok(outcomes.into_iter().map(|o| o.ok_or(CalloutFault::Status(503))).collect())
    }

    pub fn release(&self) -> Result<ReleaseOutcome, CalloutFault> {
        ReleaseOutcome::parse(self.outcome()?).ok_or(CalloutFault::Garbage("unknown outcome"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        Config::from_json(br#"{"store_cluster":"idemstore","store_timeout_ms":700,"lock_wait_ms":300}"#)
            .unwrap()
    }

    type Headers = Vec<(String, Vec<u8>)>;

    fn answer(status: &str, outcome: Option<&str>, extra: &[(&str, &str)]) -> Headers {
        let mut h = vec![(":status".to_string(), status.as_bytes().to_vec())];
        if let Some(o) = outcome {
            h.push((proto::HEADER_OUTCOME.to_string(), o.as_bytes().to_vec()));
        }
        for (n, v) in extra {
            h.push((n.to_string(), v.as_bytes().to_vec()));
        }
        h
    }

    #[test]
    fn callouts() {
        let k = "a".repeat(64);
        let begin = StoreCall::Begin {
            key: k.clone(),
            body_hash: "b".repeat(64),
            lock: LockTerms { ttl_ms: 30_000, wait_ms: 300 },
            hold: None,
        }
        .callout(&cfg(), None);
        assert_eq!(begin.timeout_ms, 1000);
        assert!(begin.headers.contains(&(":path", "/v1/begin".into())));
        assert!(begin.headers.contains(&(proto::HEADER_WAIT_MS, "300".into())));
        assert!(begin.headers.contains(&(proto::HEADER_LOCK_TTL_MS, "30000".into())));
        assert!(!begin.headers.iter().any(|(n, _)| *n == proto::HEADER_DEADLINE_MS));
        let sent = StoreCall::Begin {
            key: k.clone(),
            body_hash: "b".repeat(64),
            lock: LockTerms { ttl_ms: 30_000, wait_ms: 300 },
            hold: None,
        }
        .callout(&cfg(), Some(5_000));
        assert!(sent.headers.contains(&(proto::HEADER_DEADLINE_MS, "6000".into())), "sent + 700 + 300");
        let commit = StoreCall::Commit {
            key: k.clone(),
            token: "t".into(),
            body_hash: "b".repeat(64),
            record: vec![1, 2],
            retention_s: 86_400,
        }
        .callout(&cfg(), None);
        assert_eq!(commit.timeout_ms, 700);
        assert_eq!(commit.body, Some(vec![1, 2]));
        assert!(commit.headers.contains(&(proto::HEADER_RETENTION_S, "86400".into())));
        let release = StoreCall::Release { key: k, token: "t".into(), in_doubt: false }.callout(&cfg(), None);
        assert!(release.headers.contains(&(":path", "/v1/release".into())));
        assert!(release.headers.contains(&(proto::HEADER_TOKEN, "t".into())));
    }

    #[test]
    fn commits_go_in_one_callout_and_their_answers_come_back_in_order() {
        let commit = |k: char, record: &[u8]| StoreCall::Commit {
            key: k.to_string().repeat(64),
            token: format!("t{k}").into(),
            body_hash: "b".repeat(64),
            record: record.to_vec(),
            retention_s: 86_400,
        };
        let (one, two) = (commit('a', b"r1"), commit('c', b"r\n2"));
        let c = batch_callout(&cfg(), &[&one, &two]);
        assert!(c.headers.contains(&(":path", proto::PATH_COMMITS.into())));
        assert!(c.headers.contains(&(proto::HEADER_RETENTION_S, "86400".into())));
        assert_eq!(c.timeout_ms, 700);
        let body = c.body.unwrap();
        let items = proto::decode_batch(&body).unwrap();
        assert_eq!(items.len(), 2);
        assert_eq!((items[1].key, items[1].token), ("c".repeat(64).as_str(), "tc"));
        assert_eq!(&body[items[1].record.clone()], b"r\n2");

        let h = answer("200", Some("batch"), &[]);
        let a = Answer { headers: &h, body: b"stored\nfailed" };
        assert_eq!(a.commits(2), Ok(vec![Ok(CommitOutcome::Stored), Err(CalloutFault::Status(503))]));
        assert_eq!(a.commits(3), Err(CalloutFault::Garbage("bad batch answer")));
        let wrong = answer("200", Some("stored"), &[]);
        assert_eq!(
            Answer { headers: &wrong, body: b"stored" }.commits(1),
            Err(CalloutFault::Garbage("unknown outcome"))
        );
        let timeout = answer("504", None, &[]);
        assert_eq!(Answer { headers: &timeout, body: b"" }.commits(1), Err(CalloutFault::Timeout));
    }

    #[test]
    fn callouts_carry_the_secret_when_configured() {
        let k = "a".repeat(64);
        let calls = [
            StoreCall::Begin {
                key: k.clone(),
                body_hash: "b".repeat(64),
                lock: LockTerms { ttl_ms: 30_000, wait_ms: 300 },
                hold: None,
            },
            StoreCall::Commit {
                key: k.clone(),
                token: "t".into(),
                body_hash: "b".repeat(64),
                record: vec![1],
                retention_s: 86_400,
            },
            StoreCall::Release { key: k, token: "t".into(), in_doubt: false },
        ];
        let with = Config::from_json(br#"{"store_cluster":"idemstore","store_secret":"s3cret!"}"#).unwrap();
        for call in &calls {
            let plain = call.callout(&cfg(), None);
            assert!(plain.headers.iter().all(|(n, _)| *n != proto::HEADER_SECRET), "{call:?}");
            let c = call.callout(&with, None);
            let sent: Vec<&str> = c
                .headers
                .iter()
                .filter(|(n, _)| *n == proto::HEADER_SECRET)
                .map(|(_, v)| v.as_str())
                .collect();
            assert_eq!(sent, ["s3cret!"], "{call:?}: exactly once");
            let debug = format!("{c:?}");
            assert!(!debug.contains("s3cret!") && debug.contains("<redacted>"), "{debug}");
            // Everything else is the same callout.
            let rest: Vec<_> =
                c.headers.iter().filter(|(n, _)| *n != proto::HEADER_SECRET).cloned().collect();
            assert_eq!(rest, call.callout(&Config { store_secret: None, ..with.clone() }, None).headers);
        }
    }

    #[test]
    fn a_refused_secret_says_so() {
        let text = CalloutFault::Status(401).to_string();
        assert!(text.contains("store refused the secret (401)"), "{text}");
        assert_eq!(CalloutFault::Status(503).to_string(), "answered status 503");
    }

    #[test]
    fn failed_commit_is_retried_once_then_released() {
        let commit = StoreCall::Commit {
            key: "k".into(),
            token: "t".into(),
            body_hash: "h".into(),
            record: vec![1],
            retention_s: 86_400,
        };
        assert_eq!(commit.after_fault(0), Some(commit.clone()));
        let release = StoreCall::Release { key: "k".into(), token: "t".into(), in_doubt: false };
        assert_eq!(commit.after_fault(1), Some(release.clone()));
        assert_eq!(release.after_fault(0), None);
        assert_eq!(
            StoreCall::Begin {
                key: "k".into(),
                body_hash: "h".into(),
                lock: LockTerms { ttl_ms: 30_000, wait_ms: 300 },
                hold: None,
            }
            .after_fault(0),
            None
        );
    }

    #[test]
    fn begin_answers() {
        let rec = Record { status: 201, body: b"{}".to_vec(), ..Record::default() };
        let enc = rec.encode();
        let h = answer("200", Some("record"), &[]);
        assert_eq!(Answer { headers: &h, body: &enc }.begin(), Ok(BeginAnswer::Replay(rec)));
        let h = answer("200", Some("locked"), &[(proto::HEADER_TOKEN, "tok1")]);
        assert_eq!(
            Answer { headers: &h, body: b"" }.begin(),
            Ok(BeginAnswer::Locked { token: "tok1".into() })
        );
        let h = answer("200", Some("busy"), &[]);
        assert_eq!(Answer { headers: &h, body: b"" }.begin(), Ok(BeginAnswer::Busy { lock_ms: None }));
        for (left, expected) in [("2500", Some(2500)), ("0", None), ("x", None), ("3600001", None)] {
            let h = answer("200", Some("busy"), &[(proto::HEADER_LOCK_REMAINING_MS, left)]);
            assert_eq!(
                Answer { headers: &h, body: b"" }.begin(),
                Ok(BeginAnswer::Busy { lock_ms: expected })
            );
        }
        let h = answer("200", Some("mismatch"), &[]);
        assert_eq!(Answer { headers: &h, body: b"" }.begin(), Ok(BeginAnswer::Mismatch));
    }

    #[test]
    fn record_lifetime_is_optional_and_never_a_fault() {
        let rec = Record { status: 201, body: b"{}".to_vec(), ..Record::default() };
        let enc = rec.encode();
        for (ttl, expected) in [
            (Some("86399000"), Some(86_399_000)),
            (Some("1"), Some(1)),
            (None, None),
            (Some("0"), None),
            (Some("-5"), None),
            (Some("soon"), None),
            (Some("604800001"), None),
        ] {
            let extra: Vec<(&str, &str)> = ttl.map(|t| (proto::HEADER_TTL_MS, t)).into_iter().collect();
            let h = answer("200", Some("record"), &extra);
            let a = Answer { headers: &h, body: &enc };
            assert_eq!(a.record_ttl_ms(), expected, "{ttl:?}");
            assert_eq!(a.begin(), Ok(BeginAnswer::Replay(rec.clone())), "{ttl:?}");
        }
    }

    #[test]
    fn faults() {
        let cases: Vec<(Headers, &[u8], CalloutFault)> = vec![
            (vec![], b"", CalloutFault::Reset),
            (answer("504", None, &[]), b"", CalloutFault::Timeout),
            (answer("503", None, &[]), b"", CalloutFault::Status(503)),
            (answer("401", None, &[]), b"missing or wrong x-idem-secret", CalloutFault::Status(401)),
            (answer("abc", None, &[]), b"", CalloutFault::Garbage("no status")),
            (answer("200", None, &[]), b"", CalloutFault::Garbage("no outcome")),
            (answer("200", Some("what"), &[]), b"", CalloutFault::Garbage("unknown outcome")),
            (answer("200", Some("locked"), &[]), b"", CalloutFault::Garbage("no token")),
            (
                answer("200", Some("locked"), &[(proto::HEADER_TOKEN, "a b")]),
                b"",
                CalloutFault::Garbage("bad token"),
            ),
            (answer("200", Some("record"), &[]), b"junk", CalloutFault::Garbage("bad magic")),
        ];
        for (h, body, fault) in cases {
            assert_eq!(Answer { headers: &h, body }.begin(), Err(fault));
        }
        let h = answer("200", Some("stored"), &[]);
        assert_eq!(Answer { headers: &h, body: b"" }.commit(), Ok(CommitOutcome::Stored));
        let h = answer("200", Some("released"), &[]);
        assert_eq!(Answer { headers: &h, body: b"" }.release(), Ok(ReleaseOutcome::Released));
        assert!(Answer { headers: &h, body: b"" }.commit().is_err());
    }
}
