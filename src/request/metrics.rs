//! The filter's counters, store latency histograms and per-request outcome. Envoy shows the
//! metrics as `wasmcustom.<name>` in `/stats` and with dots replaced by underscores in
//! `/stats/prometheus`, summed across workers.

use crate::store::client::CallKind;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Metric {
    /// A guarded method with a well-formed key.
    Guarded,
    /// Answered from a stored record.
    Replayed,
    /// Sent to the upstream holding the lock.
    Executed,
    /// A record the store accepted (`stored` or `late`).
    Stored,
    /// `422`: the key was used with another body, target or fingerprinted header.
    Mismatched,
    /// `409`: the original was still running after the wait.
    Conflicted,
    /// `400` (missing or malformed key), `406` (stored coding not accepted) or `413` (body too
    /// large).
    Rejected,
    /// A guarded request whose `begin` failed: it ran unguarded (`failure_mode: open`) or got
    /// `503` (`failure_mode: closed`).
    Degraded,
    /// `503` because the store failed (`failure_mode: closed`).
    Unavailable,
    /// A guarded method without a key, let through.
    Passthrough,
    /// A lock given back without a record: a status not kept, a stream, reset, client gone.
    Released,
    /// A commit the store did not take (a fault, or an earlier record won).
    CommitFailed,
    /// Any store call that failed, timed out or answered garbage.
    StoreErrors,
    /// Executions the filter sent itself (`detached_execution`).
    Detached,
    /// Detached answers committed after the client had gone away.
    CommittedAfterGone,
    /// A `begin` answered from the VM's cache of recently replayed records (a replay or a `422`
    /// without a store call; also counted as `replayed` or `mismatched`).
    CacheHits,
    /// A `begin` not sent because the store failed recently (the breaker is open): the request
    /// fails open or closed at once (also counted as `degraded`).
    StoreSkipped,
    /// Requests that ran under the local lock while the store failed (also `degraded`).
    LocalLocks,
    /// Answers replayed from a local record (also `replayed`).
    LocalReplays,
    /// Local records the store took once it answered again.
    HandedBack,
    /// Local records pushed out by the bounds before they were handed back.
    HandBackDropped,
    /// Mint mode: an `Idempotency-Key` added to a guarded request sent without one.
    Minted,
    /// A gRPC call let through unguarded: it streams (a listed method, or a second message)
    /// or is gRPC-Web. An answer with a second message also counts (its lock is given back).
    GrpcUnguarded,
    /// Store streams opened (`store_transport: stream`): one per worker, and one more after
    /// each reset.
    StoreStreamsOpened,
    /// Store streams that closed, reset, or were given up (silent past a call's deadline, or
    /// carrying garbage): every call in flight on one failed (each also in `store_errors`).
    StoreStreamResets,
    /// An attempt that reached the application and whose answer never came back (a timeout, a
    /// reset, a client gone), left in doubt (`unknown_outcome: hold`) instead of released.
    InDoubt,
    /// A retry of an in-doubt key answered `409` `outcome-unknown`: nothing ran.
    OutcomeUnknown,
    /// An in-doubt key resolved by `outcome_lookup`: the application's answer (`2xx`) became
    /// its record and was replayed.
    ResolvedByLookup,
    /// An in-doubt key resolved by `outcome_lookup`'s `404` after the first attempt could no
    /// longer be running: the retry ran as a first attempt.
    ResolvedToRun,
}

impl Metric {
    pub const ALL: [Metric; 29] = [
        Metric::Guarded,
        Metric::Replayed,
        Metric::Executed,
        Metric::Stored,
        Metric::Mismatched,
        Metric::Conflicted,
        Metric::Rejected,
        Metric::Degraded,
        Metric::Unavailable,
        Metric::Passthrough,
        Metric::Released,
        Metric::CommitFailed,
        Metric::StoreErrors,
        Metric::Detached,
        Metric::CommittedAfterGone,
        Metric::CacheHits,
        Metric::StoreSkipped,
        Metric::LocalLocks,
        Metric::LocalReplays,
        Metric::HandedBack,
        Metric::HandBackDropped,
        Metric::Minted,
        Metric::GrpcUnguarded,
        Metric::StoreStreamsOpened,
        Metric::StoreStreamResets,
        Metric::InDoubt,
        Metric::OutcomeUnknown,
        Metric::ResolvedByLookup,
        Metric::ResolvedToRun,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Metric::Guarded => "idempotency.guarded",
            Metric::Replayed => "idempotency.replayed",
            Metric::Executed => "idempotency.executed",
            Metric::Stored => "idempotency.stored",
            Metric::Mismatched => "idempotency.mismatched",
            Metric::Conflicted => "idempotency.conflicted",
            Metric::Rejected => "idempotency.rejected",
            Metric::Degraded => "idempotency.degraded",
            Metric::Unavailable => "idempotency.unavailable",
            Metric::Passthrough => "idempotency.passthrough",
            Metric::Released => "idempotency.released",
            Metric::CommitFailed => "idempotency.commit_failed",
            Metric::StoreErrors => "idempotency.store_errors",
            Metric::Detached => "idempotency.detached",
            Metric::CommittedAfterGone => "idempotency.committed_after_gone",
            Metric::CacheHits => "idempotency.cache_hits",
            Metric::StoreSkipped => "idempotency.store_skipped",
            Metric::LocalLocks => "idempotency.local_locks",
            Metric::LocalReplays => "idempotency.local_replays",
            Metric::HandedBack => "idempotency.handed_back",
            Metric::HandBackDropped => "idempotency.handback_dropped",
            Metric::Minted => "idempotency.minted",
            Metric::GrpcUnguarded => "idempotency.grpc_unguarded",
            Metric::StoreStreamsOpened => "idempotency.store_streams_opened",
            Metric::StoreStreamResets => "idempotency.store_stream_resets",
            Metric::InDoubt => "idempotency.in_doubt",
            Metric::OutcomeUnknown => "idempotency.outcome_unknown",
            Metric::ResolvedByLookup => "idempotency.in_doubt_resolved.lookup",
            Metric::ResolvedToRun => "idempotency.in_doubt_resolved.rerun",
        }
    }

    /// What this counter says about the request itself, for Envoy's access log (the filter
    /// state `wasm.idempotency_outcome`); the last one set wins (`degraded`, then `unavailable`).
    pub fn outcome(self) -> Option<&'static str> {
        match self {
            Metric::Replayed => Some("replayed"),
            Metric::Executed => Some("executed"),
            Metric::Mismatched => Some("mismatch"),
            Metric::Conflicted => Some("conflict"),
            Metric::Rejected => Some("rejected"),
            Metric::Degraded => Some("degraded"),
            Metric::Unavailable => Some("unavailable"),
            Metric::Passthrough => Some("passthrough"),
            Metric::Detached => Some("detached"),
            Metric::Minted => Some("minted"),
            Metric::GrpcUnguarded => Some("grpc_unguarded"),
            Metric::InDoubt | Metric::OutcomeUnknown => Some("in-doubt"),
            Metric::ResolvedByLookup => Some("replayed"),
            Metric::Guarded
            | Metric::Stored
            | Metric::Released
            | Metric::CommitFailed
            | Metric::StoreErrors
            | Metric::CommittedAfterGone
            | Metric::CacheHits
            | Metric::StoreSkipped
            | Metric::LocalLocks
            | Metric::LocalReplays
            | Metric::HandedBack
            | Metric::HandBackDropped
            | Metric::StoreStreamsOpened
            | Metric::StoreStreamResets
            | Metric::ResolvedToRun => None,
        }
    }

    /// Its position in [`Metric::ALL`] (the declaration order; a unit test holds them equal).
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Histograms of store call latency in microseconds, one per operation (Envoy's histograms take
/// integers; microseconds keep a sub-millisecond `commit` visible). `begin` includes the wait
/// for a lock held by another request.
pub const STORE_LATENCY: [(CallKind, &str); 3] = [
    (CallKind::Begin, "idempotency.store_us.begin"),
    (CallKind::Commit, "idempotency.store_us.commit"),
    (CallKind::Release, "idempotency.store_us.release"),
];

pub const OUTCOME_PROPERTY: &str = "idempotency_outcome";

/// Gauge: the local records the process keeps (the local fallback), as last counted.
pub const LOCAL_RECORDS: &str = "idempotency.local_records";

/// Gauge: store calls in flight on the store streams (each worker adds its own).
pub const STREAM_CALLS: &str = "idempotency.store_stream_calls";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_has_its_own_slot_and_name() {
        for (i, m) in Metric::ALL.iter().enumerate() {
            assert_eq!(m.index(), i, "{m:?}: ALL is in declaration order");
        }
        let mut names: Vec<&str> = Metric::ALL.iter().map(|m| m.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Metric::ALL.len());
    }
}
