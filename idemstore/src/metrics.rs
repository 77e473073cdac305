//! Prometheus metrics of one idemstore, served by `GET /metrics` (see [`crate::http`]) in the
//! Prometheus text exposition format, version 0.0.4, encoded by `prometheus-client`.
//!
//! | metric | type | labels | meaning |
//! |---|---|---|---|
//! | `idemstore_requests_total` | counter | `op`, `outcome` | operations that got past validation, by how they ended |
//! | `idemstore_request_duration_seconds` | histogram | `op` | time to answer them, a `begin`'s lock wait included |
//! | `idemstore_begin_wait_seconds` | histogram | | time `begin`s that found the lock held spent waiting |
//! | `idemstore_waiters` | gauge | | `begin`s waiting for a held lock now |
//! | `idemstore_backend_errors_total` | counter | `op`, `reason` | backend failures answered `503` |
//! | `idemstore_rejected_total` | counter | `reason` | requests refused before the backend |
//! | `idemstore_backend_up` | gauge | | whether the backend answered its health check at the scrape |
//! | `idemstore_commit_batches_total` | counter | | `commits` calls that got past validation (each item also counts as a `commit` above) |
//! | `idemstore_commit_batch_items_total` | counter | | the items of those calls |
//! | `idemstore_in_doubt_releases_total` | counter | | releases that got past validation asking to keep the attempt's trace (`x-idem-in-doubt: 1`: sent, and no answer came back); each also counts in `requests_total` |
//! | `idemstore_memory_keys`, `_bytes`, `_max_keys`, `_max_bytes` | gauge | | in-memory backend only |
//!
//! Every series a request can touch is created when the store is, and its handle kept: the
//! hot path adds to an atomic (a histogram takes a short mutex), never builds or looks up a
//! label set, and every series is exported from the start, at zero.
//!
//! Uses only [`crate::backend`] (a backend error's reason, the in-memory backend's usage) and
//! [`crate::store`]'s [`Observer`] (what the store tells of a `begin`'s wait, and idem-store's
//! `calls` of each store-stream call); the store owns one [`Metrics`] as its observer, the HTTP
//! layer counts and times requests through it ([`Metrics::timer`], [`Metrics::reject`]), into the
//! same series as the stream's calls.

use std::time::{Duration, Instant};

use idem_protocol::{BeginOutcome, CommitOutcome, ReleaseOutcome};
use prometheus_client::encoding::{prometheus_text, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::backend::{Backend, BackendError, Usage};
use crate::store::{Answered, Observer, Op as StoreOp, Rejected};

/// `Content-Type` of `/metrics`: `text/plain; version=0.0.4; charset=utf-8`.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// Upper bounds of the duration buckets, in seconds: 100 µs (an in-memory answer) to 60 s
/// (the longest wait a `begin` may ask for); 5 s is the filter's default `lock_wait_ms`, 1 s
/// its default `store_timeout_ms`.
pub const BUCKETS: [f64; 18] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0,
];

/// A protocol operation: the `op` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Begin,
    Commit,
    Release,
}

impl Op {
    pub const ALL: [Self; 3] = [Self::Begin, Self::Commit, Self::Release];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Begin => "begin",
            Self::Commit => "commit",
            Self::Release => "release",
        }
    }

    /// Every way this operation can end: the `outcome` label values.
    pub fn outcomes(self) -> &'static [Outcome] {
        use Outcome::{Cancelled, Error};
        match self {
            Self::Begin => &[
                Outcome::Begin(BeginOutcome::Locked),
                Outcome::Begin(BeginOutcome::Record),
                Outcome::Begin(BeginOutcome::Mismatch),
                Outcome::Begin(BeginOutcome::Busy),
                Outcome::Begin(BeginOutcome::Expired),
                Outcome::Begin(BeginOutcome::InDoubt),
                Error,
                Cancelled,
            ],
            Self::Commit => &[
                Outcome::Commit(CommitOutcome::Stored),
                Outcome::Commit(CommitOutcome::Late),
                Outcome::Commit(CommitOutcome::Exists),
                Error,
                Cancelled,
            ],
            Self::Release => &[
                Outcome::Release(ReleaseOutcome::Released),
                Outcome::Release(ReleaseOutcome::NotOwner),
                Error,
                Cancelled,
            ],
        }
    }
}

/// How an operation that got past validation ended: the `outcome` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Begin(BeginOutcome),
    Commit(CommitOutcome),
    Release(ReleaseOutcome),
    /// The backend failed (or refused: the in-memory backend full); answered `503`.
    Error,
    /// The caller went away (connection closed, h2 stream reset) before the answer; the
    /// backend may have done the operation all the same.
    Cancelled,
}

impl Outcome {
    /// The protocol's wire name (`not-owner` included), `error` or `cancelled`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Begin(o) => o.as_str(),
            Self::Commit(o) => o.as_str(),
            Self::Release(o) => o.as_str(),
            Self::Error => "error",
            Self::Cancelled => "cancelled",
        }
    }
}

/// Why a request was refused before the backend: the `reason` label of
/// `idemstore_rejected_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// `401`: missing, repeated or wrong `x-idem-secret`.
    Secret,
    /// `400`: a missing, repeated or malformed protocol header, an empty record, a malformed
    /// `commits` body, or a body that could not be read.
    Invalid,
    /// `413`: a body on `begin`/`release`, or a record (a `commits` body) over
    /// `--max-body-bytes`.
    TooLarge,
}

impl Rejection {
    pub const ALL: [Self; 3] = [Self::Secret, Self::Invalid, Self::TooLarge];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Secret => "secret",
            Self::Invalid => "invalid",
            Self::TooLarge => "too_large",
        }
    }
}

/// The `reason` label of `idemstore_backend_errors_total`.
fn backend_reason(e: &BackendError) -> &'static str {
    match e {
        BackendError::Unavailable(_) => "unavailable",
        BackendError::Refused(_) => "refused",
        BackendError::Full => "full",
    }
}

const BACKEND_REASONS: [&str; 3] = ["unavailable", "refused", "full"];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    op: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    op: &'static str,
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpReasonLabels {
    op: &'static str,
    reason: &'static str,
}

/// The handles one operation's requests touch.
#[derive(Debug)]
struct OpSeries {
    /// Parallel to [`Op::outcomes`].
    outcomes: Vec<(Outcome, Counter)>,
    duration: Histogram,
    /// Parallel to [`BACKEND_REASONS`].
    backend_errors: [Counter; BACKEND_REASONS.len()],
}

impl OpSeries {
    /// One operation ended `outcome` after `elapsed`: counted, and its duration observed.
    fn ended(&self, outcome: Outcome, elapsed: Duration) {
        // At most eight entries (`begin`'s): cheaper than any map, and nothing to allocate.
        if let Some((_, counter)) = self.outcomes.iter().find(|(o, _)| *o == outcome) {
            counter.inc();
        }
        self.duration.observe(seconds(elapsed));
    }

    /// The backend failed one operation after `elapsed`: a backend error by reason, and `error`.
    fn failed(&self, e: &BackendError, elapsed: Duration) {
        let reason = backend_reason(e);
        if let Some(i) = BACKEND_REASONS.iter().position(|r| *r == reason) {
            self.backend_errors[i].inc();
        }
        self.ended(Outcome::Error, elapsed);
    }
}

#[derive(Debug)]
struct MemoryGauges {
    keys: Gauge,
    bytes: Gauge,
    max_keys: Gauge,
    max_bytes: Gauge,
}

/// The registry and the handles of every series; one per [`crate::store::Store`], its observer.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Indexed by `Op as usize`.
    ops: [OpSeries; 3],
    /// Indexed by `Rejection as usize`.
    rejected: [Counter; 3],
    begin_wait: Histogram,
    waiters: Gauge,
    backend_up: Gauge,
    commit_batches: Counter,
    commit_batch_items: Counter,
    in_doubt_releases: Counter,
    memory: Option<MemoryGauges>,
}

fn histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

impl Metrics {
    /// `memory`: export the in-memory backend's gauges too.
    pub fn new(memory: bool) -> Self {
        let mut registry = Registry::with_prefix("idemstore");

        let requests = Family::<OutcomeLabels, Counter>::default();
        let durations = Family::<OpLabels, Histogram>::new_with_constructor(histogram as fn() -> Histogram);
        let backend_errors = Family::<OpReasonLabels, Counter>::default();
        let ops = Op::ALL.map(|op| OpSeries {
            outcomes: op
                .outcomes()
                .iter()
                .map(|&outcome| {
                    let labels = OutcomeLabels { op: op.as_str(), outcome: outcome.as_str() };
                    (outcome, requests.get_or_create_owned(&labels))
                })
                .collect(),
            duration: durations.get_or_create_owned(&OpLabels { op: op.as_str() }),
            backend_errors: BACKEND_REASONS.map(|reason| {
                backend_errors.get_or_create_owned(&OpReasonLabels { op: op.as_str(), reason })
            }),
        });
        registry.register(
            "requests",
            "Operations that got past validation, by how they ended: the protocol's outcome, \
             error (backend failure, answered 503) or cancelled (the caller went away first)",
            requests,
        );
        registry.register_with_unit(
            "request_duration",
            "Time to answer an operation that got past validation, a begin's wait for a held lock \
             included",
            Unit::Seconds,
            durations,
        );
        let begin_wait = histogram();
        registry.register_with_unit(
            "begin_wait",
            "Time a begin that found the lock held spent waiting for it, from that first attempt \
             to its answer (or the caller going away)",
            Unit::Seconds,
            begin_wait.clone(),
        );
        let waiters = Gauge::default();
        registry.register("waiters", "Begins waiting for a held lock now", waiters.clone());
        registry.register(
            "backend_errors",
            "Backend failures answered 503: unavailable (unreachable, timed out, unexpected reply) \
             or full (the in-memory backend's limits)",
            backend_errors,
        );

        let rejected_family = Family::<ReasonLabels, Counter>::default();
        let rejected = Rejection::ALL
            .map(|reason| rejected_family.get_or_create_owned(&ReasonLabels { reason: reason.as_str() }));
        registry.register(
            "rejected",
            "Requests refused before the backend: secret (401), invalid (400), too_large (413)",
            rejected_family,
        );

        let backend_up = Gauge::default();
        registry.register(
            "backend_up",
            "1 if the backend answered its health check at this scrape, else 0",
            backend_up.clone(),
        );

        let commit_batches = Counter::default();
        registry.register(
            "commit_batches",
            "Commits calls (several commits in one request) that got past validation; each of their \
             items also counts in requests_total as a commit",
            commit_batches.clone(),
        );
        let commit_batch_items = Counter::default();
        registry.register(
            "commit_batch_items",
            "Items of the commits calls counted in commit_batches",
            commit_batch_items.clone(),
        );

        let in_doubt_releases = Counter::default();
        registry.register(
            "in_doubt_releases",
            "Releases that got past validation keeping the attempt's trace (x-idem-in-doubt: 1, the \
             attempt was sent and no answer came back); each also counts in requests_total",
            in_doubt_releases.clone(),
        );

        let memory = memory.then(|| {
            let gauges = MemoryGauges {
                keys: Gauge::default(),
                bytes: Gauge::default(),
                max_keys: Gauge::default(),
                max_bytes: Gauge::default(),
            };
            registry.register(
                "memory_keys",
                "In-memory backend: keys holding a record or a lock, plus traces of attempts, expired ones \
                 until swept",
                gauges.keys.clone(),
            );
            registry.register_with_unit(
                "memory",
                "In-memory backend: bytes accounted against --memory-max-bytes (a fixed cost per key \
                 plus the records)",
                Unit::Bytes,
                gauges.bytes.clone(),
            );
            registry.register(
                "memory_max_keys",
                "In-memory backend: --memory-max-keys",
                gauges.max_keys.clone(),
            );
            registry.register_with_unit(
                "memory_max",
                "In-memory backend: --memory-max-bytes",
                Unit::Bytes,
                gauges.max_bytes.clone(),
            );
            gauges
        });

        Self {
            registry,
            ops,
            rejected,
            begin_wait,
            waiters,
            backend_up,
            commit_batches,
            commit_batch_items,
            in_doubt_releases,
            memory,
        }
    }

    /// Starts timing an operation that got past validation, from `started` (the request's
    /// arrival). Dropped without an answer, it counts as `cancelled`.
    pub fn timer(&self, op: Op, started: Instant) -> Timer<'_> {
        Timer { series: &self.ops[op as usize], started, open: true }
    }

    /// Counts a `commits` call that got past validation, with its `items` (each also timed as a
    /// `commit` of its own, [`Self::timer`]).
    pub fn batch(&self, items: usize) {
        self.commit_batches.inc();
        self.commit_batch_items.inc_by(u64::try_from(items).unwrap_or(u64::MAX));
    }

    /// Counts a request refused before the backend.
    pub fn reject(&self, reason: Rejection) {
        self.rejected[reason as usize].inc();
    }

    /// The exposition text, with the scrape-time gauges set from `backend_up` and `usage`.
    pub fn encode(&self, backend_up: bool, usage: Option<Usage>) -> Result<String, std::fmt::Error> {
        self.backend_up.set(i64::from(backend_up));
        if let (Some(gauges), Some(usage)) = (&self.memory, usage) {
            let gauge = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
            gauges.keys.set(gauge(usage.keys));
            gauges.bytes.set(gauge(usage.bytes));
            gauges.max_keys.set(gauge(usage.max_keys));
            gauges.max_bytes.set(gauge(usage.max_bytes));
        }
        let mut text = String::with_capacity(8 * 1024);
        prometheus_text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

/// Times one operation: [`Timer::answered`] or [`Timer::failed`] records its outcome and
/// duration; dropped before either (the request's future dropped), it records `cancelled`.
#[derive(Debug)]
pub struct Timer<'a> {
    series: &'a OpSeries,
    started: Instant,
    open: bool,
}

impl Timer<'_> {
    /// The operation answered `outcome`, which must be one of its [`Op::outcomes`].
    pub fn answered(mut self, outcome: Outcome) {
        self.close(outcome);
    }

    /// The backend failed: `error`, and a backend error by reason.
    pub fn failed(mut self, e: &BackendError) {
        self.open = false;
        self.series.failed(e, self.started.elapsed());
    }

    fn close(&mut self, outcome: Outcome) {
        self.open = false;
        self.series.ended(outcome, self.started.elapsed());
    }
}

impl Drop for Timer<'_> {
    fn drop(&mut self) {
        if self.open {
            self.close(Outcome::Cancelled);
        }
    }
}

impl From<StoreOp> for Op {
    fn from(op: StoreOp) -> Self {
        match op {
            StoreOp::Begin => Self::Begin,
            StoreOp::Commit => Self::Commit,
            StoreOp::Release => Self::Release,
        }
    }
}

impl From<Answered> for Outcome {
    fn from(answered: Answered) -> Self {
        match answered {
            Answered::Begin(o) => Self::Begin(o),
            Answered::Commit(o) => Self::Commit(o),
            Answered::Release(o) => Self::Release(o),
        }
    }
}

impl From<Rejected> for Rejection {
    fn from(why: Rejected) -> Self {
        match why {
            Rejected::Invalid => Self::Invalid,
            Rejected::TooLarge => Self::TooLarge,
        }
    }
}

/// A `begin` waiting for a held lock: counted in `idemstore_waiters` while it waits, its wait
/// observed in `idemstore_begin_wait_seconds` when it ends (answered or abandoned). A call served
/// by idem-store (the store stream's) counts in the same series as its HTTP twin's [`Timer`]
/// and [`Metrics::reject`].
impl Observer for Metrics {
    /// The in-memory backend's gauges for that backend only.
    fn for_backend<B: Backend>(backend: &B) -> Self {
        Self::new(backend.usage().is_some())
    }

    fn wait_started(&self) {
        self.waiters.inc();
    }

    fn wait_ended(&self, waited: Duration) {
        self.waiters.dec();
        self.begin_wait.observe(seconds(waited));
    }

    fn call_rejected(&self, why: Rejected) {
        self.reject(why.into());
    }

    fn call_answered(&self, outcome: Answered, elapsed: Duration) {
        self.ops[Op::from(outcome.op()) as usize].ended(outcome.into(), elapsed);
    }

    fn call_failed(&self, op: StoreOp, error: &BackendError, elapsed: Duration) {
        self.ops[Op::from(op) as usize].failed(error, elapsed);
    }

    fn call_cancelled(&self, op: StoreOp, elapsed: Duration) {
        self.ops[Op::from(op) as usize].ended(Outcome::Cancelled, elapsed);
    }

    /// Counts a release that got past validation and keeps the attempt's trace (in doubt).
    fn in_doubt_release(&self) {
        self.in_doubt_releases.inc();
    }
}

fn seconds(d: Duration) -> f64 {
    d.as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names, types and label sets are an interface (dashboards, alerts): any change must
    /// show here.
    #[test]
    fn exposition_names_are_stable() {
        let text = Metrics::new(true)
            .encode(true, Some(Usage { keys: 3, bytes: 7, max_keys: 10, max_bytes: 99 }))
            .unwrap();
        for line in [
            "# TYPE idemstore_requests_total counter",
            "# TYPE idemstore_request_duration_seconds histogram",
            "# TYPE idemstore_begin_wait_seconds histogram",
            "# TYPE idemstore_waiters gauge",
            "# TYPE idemstore_backend_errors_total counter",
            "# TYPE idemstore_rejected_total counter",
            "# TYPE idemstore_backend_up gauge",
            "# TYPE idemstore_commit_batches_total counter",
            "# TYPE idemstore_commit_batch_items_total counter",
            "# TYPE idemstore_in_doubt_releases_total counter",
            "# TYPE idemstore_memory_keys gauge",
            "# TYPE idemstore_memory_bytes gauge",
            "# TYPE idemstore_memory_max_keys gauge",
            "# TYPE idemstore_memory_max_bytes gauge",
            "idemstore_requests_total{op=\"begin\",outcome=\"locked\"} 0",
            "idemstore_requests_total{op=\"begin\",outcome=\"in-doubt\"} 0",
            "idemstore_requests_total{op=\"release\",outcome=\"not-owner\"} 0",
            "idemstore_requests_total{op=\"commit\",outcome=\"cancelled\"} 0",
            "idemstore_request_duration_seconds_bucket{op=\"begin\",le=\"0.0001\"} 0",
            "idemstore_request_duration_seconds_bucket{op=\"release\",le=\"+Inf\"} 0",
            "idemstore_request_duration_seconds_count{op=\"commit\"} 0",
            "idemstore_begin_wait_seconds_bucket{le=\"5\"} 0",
            "idemstore_begin_wait_seconds_count 0",
            "idemstore_backend_errors_total{op=\"begin\",reason=\"full\"} 0",
            "idemstore_backend_errors_total{op=\"commit\",reason=\"unavailable\"} 0",
            "idemstore_rejected_total{reason=\"secret\"} 0",
            "idemstore_rejected_total{reason=\"too_large\"} 0",
            "idemstore_waiters 0",
            "idemstore_backend_up 1",
            "idemstore_commit_batches_total 0",
            "idemstore_commit_batch_items_total 0",
            "idemstore_in_doubt_releases_total 0",
            "idemstore_memory_keys 3",
            "idemstore_memory_bytes 7",
            "idemstore_memory_max_keys 10",
            "idemstore_memory_max_bytes 99",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in:\n{text}");
        }
        assert!(!text.contains("# EOF"), "0.0.4 has no EOF marker");
        // Every (op, outcome) pair exists from the start.
        let pairs: usize = Op::ALL.iter().map(|op| op.outcomes().len()).sum();
        assert_eq!(text.lines().filter(|l| l.starts_with("idemstore_requests_total{")).count(), pairs);
    }

    #[test]
    fn memory_gauges_only_for_the_memory_backend() {
        let text = Metrics::new(false).encode(false, None).unwrap();
        assert!(!text.contains("idemstore_memory"), "{text}");
        assert!(text.lines().any(|l| l == "idemstore_backend_up 0"));
    }

    #[test]
    fn timers_count_outcomes_errors_and_cancellations() {
        let metrics = Metrics::new(false);
        let now = Instant::now();
        metrics.timer(Op::Begin, now).answered(Outcome::Begin(BeginOutcome::Locked));
        metrics.timer(Op::Commit, now).failed(&BackendError::Full);
        drop(metrics.timer(Op::Release, now));
        metrics.timer(Op::Begin, now).answered(Outcome::Begin(BeginOutcome::InDoubt));
        metrics.in_doubt_release();
        metrics.batch(3);
        metrics.batch(64);
        metrics.wait_started();
        assert_eq!(metrics.waiters.get(), 1);
        metrics.wait_ended(Duration::from_millis(3));
        assert_eq!(metrics.waiters.get(), 0);
        let text = metrics.encode(true, None).unwrap();
        for line in [
            "idemstore_requests_total{op=\"begin\",outcome=\"locked\"} 1",
            "idemstore_requests_total{op=\"commit\",outcome=\"error\"} 1",
            "idemstore_backend_errors_total{op=\"commit\",reason=\"full\"} 1",
            "idemstore_requests_total{op=\"release\",outcome=\"cancelled\"} 1",
            "idemstore_requests_total{op=\"begin\",outcome=\"in-doubt\"} 1",
            "idemstore_in_doubt_releases_total 1",
            "idemstore_request_duration_seconds_count{op=\"begin\"} 2",
            "idemstore_request_duration_seconds_count{op=\"commit\"} 1",
            "idemstore_request_duration_seconds_count{op=\"release\"} 1",
            "idemstore_begin_wait_seconds_count 1",
            "idemstore_commit_batches_total 2",
            "idemstore_commit_batch_items_total 67",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in:\n{text}");
        }
    }

    /// A store-stream call told through the [`Observer`] counts exactly as the same request
    /// timed over HTTP: the same series, by the same labels, and one duration each.
    #[test]
    fn observed_calls_count_as_timed_requests() {
        let (timed, observed) = (Metrics::new(false), Metrics::new(false));
        let now = Instant::now();
        let answers = [
            Answered::Begin(BeginOutcome::Locked),
            Answered::Begin(BeginOutcome::InDoubt),
            Answered::Commit(CommitOutcome::Late),
            Answered::Release(ReleaseOutcome::NotOwner),
        ];
        for answered in answers {
            timed.timer(Op::from(answered.op()), now).answered(answered.into());
            observed.call_answered(answered, Duration::ZERO);
        }
        let refused = BackendError::Refused("acl".into());
        for (op, e) in [(StoreOp::Begin, &BackendError::Full), (StoreOp::Release, &refused)] {
            timed.timer(op.into(), now).failed(e);
            observed.call_failed(op, e, Duration::ZERO);
        }
        drop(timed.timer(Op::Commit, now));
        observed.call_cancelled(StoreOp::Commit, Duration::ZERO);
        timed.reject(Rejection::Invalid);
        timed.reject(Rejection::TooLarge);
        observed.call_rejected(Rejected::Invalid);
        observed.call_rejected(Rejected::TooLarge);
        timed.in_doubt_release();
        observed.in_doubt_release();
        // Durations differ by the clock; their counts may not. A family's series come in no set
        // order.
        let counts = |m: &Metrics| -> Vec<String> {
            let text = m.encode(true, None).unwrap();
            let mut lines: Vec<String> = text
                .lines()
                .filter(|l| !l.contains("_bucket{") && !l.contains("_sum"))
                .map(str::to_owned)
                .collect();
            lines.sort();
            lines
        };
        let counted = counts(&observed);
        assert_eq!(counts(&timed), counted);
        for line in [
            "idemstore_requests_total{op=\"begin\",outcome=\"in-doubt\"} 1",
            "idemstore_requests_total{op=\"commit\",outcome=\"cancelled\"} 1",
            "idemstore_backend_errors_total{op=\"release\",reason=\"refused\"} 1",
            "idemstore_request_duration_seconds_count{op=\"begin\"} 3",
            "idemstore_rejected_total{reason=\"too_large\"} 1",
            "idemstore_in_doubt_releases_total 1",
        ] {
            assert!(counted.iter().any(|l| l == line), "missing {line:?} in:\n{}", counted.join("\n"));
        }
    }
}
