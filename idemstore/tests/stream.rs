//! The store stream over a real socket: a tonic client of `idemstore.v1.Store/Stream` on the
//! router idemstore serves (the HTTP API's listener).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::client::{serve, serve_store, Client, Version};
use idem_protocol as proto;
use idemstore::backend::memory::MemoryBackend;
use idemstore::backend::{self, Attempt, Backend, BackendError, CommitOutcome, Hold, ReleaseOutcome};
use idemstore::http::{Options, SecretCheck, PATH_METRICS};
use idemstore::secret::Secret;
use idemstore::store::Store;
use proto::stream::{Answer, Begin, Begun, Call, Commit, Op, Outcome, Release};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codegen::http::uri::PathAndQuery;

/// An open stream: calls in, answers out.
struct Stream {
    calls: mpsc::Sender<Call>,
    answers: tonic::Streaming<Answer>,
}

async fn open(addr: SocketAddr, secret: Option<&str>) -> Result<Stream, tonic::Status> {
    let channel =
        tonic::transport::Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
    let mut client = tonic::client::Grpc::new(channel);
    client.ready().await.unwrap();
    let (calls, rx) = mpsc::channel(16);
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    if let Some(s) = secret {
        request.metadata_mut().insert(proto::HEADER_SECRET, s.parse().unwrap());
    }
    let codec = tonic_prost::ProstCodec::<Call, Answer>::default();
    let answers = client.streaming(request, PathAndQuery::from_static(proto::stream::PATH), codec).await?;
    Ok(Stream { calls, answers: answers.into_inner() })
}

impl Stream {
    async fn send(&self, id: u64, op: Op) {
        self.calls.send(Call { id, op: Some(op) }).await.unwrap();
    }

    async fn next(&mut self) -> Answer {
        tokio::time::timeout(Duration::from_secs(5), self.answers.message()).await.unwrap().unwrap().unwrap()
    }
}

fn begin(key: &str, hash: &str, wait_ms: u64) -> Op {
    Op::Begin(Begin {
        key: key.into(),
        body_hash: hash.into(),
        lock_ttl_ms: 30_000,
        wait_ms,
        ..Begin::default()
    })
}

fn begun(a: &Answer) -> &Begun {
    match &a.outcome {
        Some(Outcome::Begun(b)) => b,
        other => panic!("not a begin answer: {other:?}"),
    }
}

#[tokio::test]
async fn calls_are_answered_by_id_and_a_waiting_begin_holds_up_nothing() {
    let mut s = open(serve(8 * 1024 * 1024).await, None).await.unwrap();
    let (key, hash) = (common::key(), common::hash('a'));
    s.send(1, begin(&key, &hash, 5000)).await;
    let first = s.next().await;
    assert_eq!((first.id, begun(&first).outcome.as_str()), (1, "locked"));
    let token = begun(&first).token.clone();
    // A duplicate waits for the lock on the stream; the commit sent after it is answered first.
    s.send(2, begin(&key, &hash, 5000)).await;
    let record = vec![0u8, 255, 7];
    let commit =
        Commit { key: key.clone(), token, body_hash: hash.clone(), retention_s: 60, record: record.clone() };
    s.send(3, Op::Commit(commit)).await;
    let a = s.next().await;
    let b = s.next().await;
    let (committed, waited) = if a.id == 3 { (a, b) } else { (b, a) };
    assert_eq!(committed.outcome, Some(Outcome::Committed("stored".into())));
    assert_eq!(waited.id, 2);
    assert_eq!(begun(&waited).outcome, "record");
    assert_eq!(begun(&waited).record, record);
    assert!(begun(&waited).ttl_ms > 0);
    // Another body under the key.
    s.send(4, begin(&key, &common::hash('b'), 0)).await;
    assert_eq!(begun(&s.next().await).outcome, "mismatch");
}

#[tokio::test]
async fn a_malformed_call_is_a_failure_and_the_stream_goes_on() {
    let mut s = open(serve(1024).await, None).await.unwrap();
    s.send(9, begin("not-hex", &common::hash('a'), 0)).await;
    let a = s.next().await;
    assert_eq!(a.id, 9);
    match a.outcome {
        Some(Outcome::Failure(f)) => assert!(f.bad_request && f.reason.contains("key"), "{f:?}"),
        other => panic!("{other:?}"),
    }
    let big = Commit {
        key: common::key(),
        token: "t".repeat(32),
        body_hash: common::hash('a'),
        retention_s: 60,
        record: vec![1; 2048],
    };
    s.send(10, Op::Commit(big)).await;
    assert!(matches!(s.next().await.outcome, Some(Outcome::Failure(f)) if f.bad_request));
    s.calls.send(Call { id: 11, op: None }).await.unwrap();
    assert!(matches!(s.next().await.outcome, Some(Outcome::Failure(_))));
    let (key, hash) = (common::key(), common::hash('c'));
    s.send(12, begin(&key, &hash, 0)).await;
    let locked = s.next().await;
    assert_eq!(begun(&locked).outcome, "locked");
    let release = Release { key, token: begun(&locked).token.clone(), in_doubt: false };
    s.send(13, Op::Release(release)).await;
    assert_eq!(s.next().await.outcome, Some(Outcome::Released("released".into())));
}

#[tokio::test]
async fn the_secret_is_the_streams_metadata() {
    let secret = Secret::new("s3cret-s3cret-s3cret").unwrap();
    let options = Options { secret: Some(Arc::new(SecretCheck::new(secret))), ..Options::new(1024) };
    let addr = serve_store(Arc::new(Store::new(MemoryBackend::new(100))), options).await;
    for secret in [None, Some("wrong-wrong-wrong-wrong")] {
        let refused = match open(addr, secret).await {
            Err(status) => status,
            Ok(mut s) => s.answers.message().await.unwrap_err(),
        };
        assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{secret:?}: {refused:?}");
    }
    let mut s = open(addr, Some("s3cret-s3cret-s3cret")).await.unwrap();
    s.send(1, begin(&common::key(), &common::hash('a'), 0)).await;
    assert_eq!(begun(&s.next().await).outcome, "locked");
}

fn begin_hold(key: &str, hash: &str, retention_s: u64, supersede: &str) -> Op {
    Op::Begin(Begin {
        key: key.into(),
        body_hash: hash.into(),
        lock_ttl_ms: 30_000,
        hold: true,
        retention_s,
        supersede: supersede.into(),
        ..Begin::default()
    })
}

/// The hold on the stream: a trace, an in-doubt release, `in-doubt` with the first attempt's
/// token, start and running time in `Begun`; the right supersede locks again.
#[tokio::test]
async fn in_doubt_on_the_stream() {
    let mut s = open(serve(1024).await, None).await.unwrap();
    let (key, hash) = (common::key(), common::hash('a'));
    let before = idemstore::backend::now_ms();
    s.send(1, begin_hold(&key, &hash, 60, "")).await;
    let locked = s.next().await;
    assert_eq!(begun(&locked).outcome, "locked");
    let first = begun(&locked).token.clone();
    s.send(2, Op::Release(Release { key: key.clone(), token: first.clone(), in_doubt: true })).await;
    assert_eq!(s.next().await.outcome, Some(Outcome::Released("released".into())));
    s.send(3, begin_hold(&key, &hash, 60, "")).await;
    let doubt = s.next().await;
    let b = begun(&doubt);
    assert_eq!((b.outcome.as_str(), b.token.as_str()), ("in-doubt", first.as_str()));
    assert!(b.started_ms >= before && b.started_ms <= idemstore::backend::now_ms(), "{b:?}");
    assert!(b.running_ms > 29_000 && b.running_ms <= 30_000, "{b:?}");
    // Without a hold the trace is not read: a plain begin would lock. With the right supersede:
    s.send(4, begin_hold(&key, &hash, 60, &first)).await;
    let again = s.next().await;
    assert_eq!(begun(&again).outcome, "locked");
    assert_ne!(begun(&again).token, first);
}

/// The hold's fields are checked as the HTTP headers are: with `hold`, `retention_s` in range
/// and `supersede` empty or a token; without it, no `supersede`. Each a `bad_request` failure,
/// and the stream goes on.
#[tokio::test]
async fn hold_fields_are_validated() {
    let mut s = open(serve(1024).await, None).await.unwrap();
    let (key, hash) = (common::key(), common::hash('a'));
    let long = "t".repeat(proto::MAX_TOKEN_LEN + 1);
    let cases = [
        (begin_hold(&key, &hash, 0, ""), "retention_s"),
        (begin_hold(&key, &hash, proto::MAX_RETENTION_S + 1, ""), "retention_s"),
        (begin_hold(&key, &hash, 60, "a b"), "supersede"),
        (begin_hold(&key, &hash, 60, &long), "supersede"),
        (
            Op::Begin(Begin {
                key: key.clone(),
                body_hash: hash.clone(),
                lock_ttl_ms: 30_000,
                supersede: "tok".into(),
                ..Begin::default()
            }),
            "supersede",
        ),
    ];
    for (id, (op, field)) in cases.into_iter().enumerate() {
        s.send(id as u64, op).await;
        match s.next().await.outcome {
            Some(Outcome::Failure(f)) => assert!(f.bad_request && f.reason.contains(field), "{f:?}"),
            other => panic!("{field}: {other:?}"),
        }
    }
    // Not done: the key is free. The largest retention and a supersede of nothing are fine.
    s.send(10, begin_hold(&key, &hash, proto::MAX_RETENTION_S, "no-such-token")).await;
    assert_eq!(begun(&s.next().await).outcome, "locked");
    // Without hold, retention_s is not read.
    let other = common::key();
    s.send(
        11,
        Op::Begin(Begin {
            key: other,
            body_hash: hash,
            lock_ttl_ms: 1000,
            retention_s: 0,
            ..Begin::default()
        }),
    )
    .await;
    assert_eq!(begun(&s.next().await).outcome, "locked");
}

/// A backend that fails every call, as Redis down would.
#[derive(Debug, Clone)]
struct Down;

impl Backend for Down {
    async fn try_begin(
        &self,
        _: &str,
        _: &str,
        _: &str,
        _: Duration,
        _: Option<Hold<'_>>,
    ) -> backend::Result<Attempt> {
        Err(BackendError::Unavailable("down".into()))
    }

    async fn commit(&self, _: backend::Commit<'_>) -> backend::Result<CommitOutcome> {
        Err(BackendError::Unavailable("down".into()))
    }

    async fn release(&self, _: &str, _: &str, _: bool) -> backend::Result<ReleaseOutcome> {
        Err(BackendError::Unavailable("down".into()))
    }

    async fn health(&self) -> backend::Result<()> {
        Err(BackendError::Unavailable("down".into()))
    }
}

/// The `/metrics` exposition of the idemstore at `addr`, without the histograms' buckets and
/// sums (their values are times).
async fn counted(addr: SocketAddr) -> Vec<String> {
    let reply = Client::new(addr, Version::H1).await.call("GET", PATH_METRICS, &[], Bytes::new()).await;
    let text = String::from_utf8(reply.body.to_vec()).unwrap();
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.contains("_bucket{") && !l.contains("_sum"))
        .map(str::to_owned)
        .collect()
}

fn has_all(lines: &[String], expected: &[&str]) {
    for line in expected {
        assert!(lines.iter().any(|l| l == line), "missing {line:?} in:\n{}", lines.join("\n"));
    }
}

/// Each call on the stream counts as its HTTP twin would: requests by op and outcome, their
/// durations, refusals by reason, in-doubt releases, backend errors by reason.
#[tokio::test]
async fn calls_count_in_the_metrics_as_their_http_twins() {
    let addr = serve(1024).await;
    let mut s = open(addr, None).await.unwrap();
    let (key, hash) = (common::key(), common::hash('a'));
    s.send(1, begin(&key, &hash, 0)).await;
    let token = begun(&s.next().await).token.clone();
    s.send(2, begin(&key, &hash, 0)).await;
    assert_eq!(begun(&s.next().await).outcome, "busy");
    let commit =
        Commit { key: key.clone(), token, body_hash: hash.clone(), retention_s: 60, record: vec![1] };
    s.send(3, Op::Commit(commit.clone())).await;
    assert_eq!(s.next().await.outcome, Some(Outcome::Committed("stored".into())));
    s.send(4, Op::Commit(commit)).await;
    assert_eq!(s.next().await.outcome, Some(Outcome::Committed("exists".into())));
    s.send(5, begin(&key, &hash, 0)).await;
    assert_eq!(begun(&s.next().await).outcome, "record");
    s.send(6, begin(&key, &common::hash('b'), 0)).await;
    assert_eq!(begun(&s.next().await).outcome, "mismatch");
    let other = common::key();
    s.send(7, begin_hold(&other, &hash, 60, "")).await;
    let held = begun(&s.next().await).token.clone();
    s.send(8, Op::Release(Release { key: other.clone(), token: "t".repeat(32), in_doubt: false })).await;
    assert_eq!(s.next().await.outcome, Some(Outcome::Released("not-owner".into())));
    s.send(9, Op::Release(Release { key: other, token: held, in_doubt: true })).await;
    assert_eq!(s.next().await.outcome, Some(Outcome::Released("released".into())));
    s.send(10, begin("not-hex", &hash, 0)).await;
    s.calls.send(Call { id: 11, op: None }).await.unwrap();
    let big = Commit { key, token: "t".repeat(32), body_hash: hash, retention_s: 60, record: vec![1; 2048] };
    s.send(12, Op::Commit(big)).await;
    for _ in 10..=12 {
        assert!(matches!(s.next().await.outcome, Some(Outcome::Failure(f)) if f.bad_request));
    }
    has_all(
        &counted(addr).await,
        &[
            "idemstore_requests_total{op=\"begin\",outcome=\"locked\"} 2",
            "idemstore_requests_total{op=\"begin\",outcome=\"busy\"} 1",
            "idemstore_requests_total{op=\"begin\",outcome=\"record\"} 1",
            "idemstore_requests_total{op=\"begin\",outcome=\"mismatch\"} 1",
            "idemstore_requests_total{op=\"begin\",outcome=\"error\"} 0",
            "idemstore_requests_total{op=\"begin\",outcome=\"cancelled\"} 0",
            "idemstore_requests_total{op=\"commit\",outcome=\"stored\"} 1",
            "idemstore_requests_total{op=\"commit\",outcome=\"exists\"} 1",
            "idemstore_requests_total{op=\"release\",outcome=\"released\"} 1",
            "idemstore_requests_total{op=\"release\",outcome=\"not-owner\"} 1",
            "idemstore_request_duration_seconds_count{op=\"begin\"} 5",
            "idemstore_request_duration_seconds_count{op=\"commit\"} 2",
            "idemstore_request_duration_seconds_count{op=\"release\"} 2",
            "idemstore_rejected_total{reason=\"secret\"} 0",
            "idemstore_rejected_total{reason=\"invalid\"} 2",
            "idemstore_rejected_total{reason=\"too_large\"} 1",
            "idemstore_in_doubt_releases_total 1",
            "idemstore_commit_batches_total 0",
            "idemstore_begin_wait_seconds_count 1",
            "idemstore_waiters 0",
        ],
    );

    // The backend down: each call an error, by reason, and a failure that is not the caller's.
    let addr = serve_store(Arc::new(Store::new(Down)), Options::new(1024)).await;
    let mut s = open(addr, None).await.unwrap();
    let (key, hash, token) = (common::key(), common::hash('a'), "t".repeat(32));
    s.send(1, begin(&key, &hash, 0)).await;
    let commit =
        Commit { key: key.clone(), token: token.clone(), body_hash: hash, retention_s: 60, record: vec![1] };
    s.send(2, Op::Commit(commit)).await;
    s.send(3, Op::Release(Release { key, token, in_doubt: true })).await;
    for _ in 1..=3 {
        assert!(matches!(s.next().await.outcome, Some(Outcome::Failure(f)) if !f.bad_request));
    }
    has_all(
        &counted(addr).await,
        &[
            "idemstore_requests_total{op=\"begin\",outcome=\"error\"} 1",
            "idemstore_requests_total{op=\"commit\",outcome=\"error\"} 1",
            "idemstore_requests_total{op=\"release\",outcome=\"error\"} 1",
            "idemstore_backend_errors_total{op=\"begin\",reason=\"unavailable\"} 1",
            "idemstore_backend_errors_total{op=\"commit\",reason=\"unavailable\"} 1",
            "idemstore_backend_errors_total{op=\"release\",reason=\"unavailable\"} 1",
            "idemstore_backend_errors_total{op=\"release\",reason=\"full\"} 0",
            "idemstore_request_duration_seconds_count{op=\"begin\"} 1",
            "idemstore_request_duration_seconds_count{op=\"commit\"} 1",
            "idemstore_request_duration_seconds_count{op=\"release\"} 1",
            "idemstore_in_doubt_releases_total 1",
            "idemstore_rejected_total{reason=\"invalid\"} 0",
        ],
    );
}
