//! The store stream (`idemstore.v1.Store/Stream`, see `idem_protocol::stream`): one long-lived
//! gRPC stream per filter worker, served next to the HTTP API on the same listener, behind the
//! same secret check (the router's gate reads the stream's `x-idem-secret` metadata once).
//!
//! Every call on the stream runs as its own task, so a `begin` waiting for a lock holds up
//! nothing else; the answers go back in the order they are ready, each with its call's id. On
//! Redis, the calls of every stream share the multiplexed connection, which pipelines them.
//! Each call is validated and counted as its HTTP twin; one that is malformed or that the
//! backend fails answers a `Failure` and the stream goes on. A shutdown ends the waits (they
//! answer `busy`) and then the streams.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use idem_protocol as proto;
use proto::stream::{Answer, Begun, Call, Commit, Failure, Op, Outcome};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codegen::http;
use tonic::Status;

use crate::backend::{self, Backend, BackendError, Hold};
use crate::metrics::{Op as MetricOp, Outcome as MetricOutcome, Rejection, Timer};
use crate::millis::{ceil_millis, give_up_at, running_millis};
use crate::store::{Begin, Store};

/// Answers waiting to be written to one stream: past this, calls on it wait for the client to
/// read (HTTP/2 flow control does the rest).
const PENDING_ANSWERS: usize = 1024;

/// The tower service the router mounts at [`proto::stream::PATH`].
pub struct StreamService<B> {
    store: Arc<Store<B>>,
    max_record_bytes: usize,
}

impl<B> Clone for StreamService<B> {
    fn clone(&self) -> Self {
        Self { store: Arc::clone(&self.store), max_record_bytes: self.max_record_bytes }
    }
}

impl<B: Backend> StreamService<B> {
    pub fn new(store: Arc<Store<B>>, max_record_bytes: usize) -> Self {
        Self { store, max_record_bytes }
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

impl<B: Backend, Body> tower_service::Service<http::Request<Body>> for StreamService<B>
where
    Body: http_body::Body<Data = Bytes> + Send + 'static,
    Body::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let calls = Calls(self.clone());
        // The largest call is a commit of the largest record, plus its fields.
        let limit = self.max_record_bytes.saturating_add(64 * 1024);
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::<Answer, Call>::default())
                .max_decoding_message_size(limit)
                .max_encoding_message_size(limit);
            Ok(grpc.streaming(calls, request).await)
        })
    }
}

/// One stream: its calls in, its answers out.
struct Calls<B>(StreamService<B>);

impl<B: Backend> tonic::server::StreamingService<Call> for Calls<B> {
    type Response = Answer;
    type ResponseStream = ReceiverStream<Result<Answer, Status>>;
    type Future = BoxFuture<Result<tonic::Response<Self::ResponseStream>, Status>>;

    fn call(&mut self, request: tonic::Request<tonic::Streaming<Call>>) -> Self::Future {
        let service = self.0.clone();
        Box::pin(async move {
            let mut incoming = request.into_inner();
            let (answers, out) = mpsc::channel(PENDING_ANSWERS);
            let store = Arc::clone(&service.store);
            let mut stopping = store.stopping();
            tokio::spawn(async move {
                loop {
                    let call = tokio::select! {
                        call = incoming.message() => call,
                        _ = stopping.wait_for(|s| *s) => break,
                    };
                    match call {
                        Ok(Some(call)) => {
                            let (store, answers) = (Arc::clone(&store), answers.clone());
                            let max = service.max_record_bytes;
                            tokio::spawn(async move {
                                let answer = serve(&store, call, max).await;
                                // The stream may be gone: its calls' answers have no reader.
                                let _ = answers.send(Ok(answer)).await;
                            });
                        }
                        Ok(None) => break,
                        Err(status) => {
                            tracing::debug!(%status, "store stream ended by its client");
                            break;
                        }
                    }
                }
            });
            Ok(tonic::Response::new(ReceiverStream::new(out)))
        })
    }
}

/// One call, validated, carried out and counted as its HTTP twin.
async fn serve<B: Backend>(store: &Store<B>, call: Call, max_record_bytes: usize) -> Answer {
    let id = call.id;
    let started = Instant::now();
    let outcome = match call.op {
        Some(Op::Begin(b)) => begin(store, b, started).await,
        Some(Op::Commit(c)) => commit(store, c, max_record_bytes, started).await,
        Some(Op::Release(r)) => release(store, r, started).await,
        None => Err(bad(store, "a call without an operation")),
    };
    Answer { id, outcome: Some(outcome.unwrap_or_else(Outcome::Failure)) }
}

fn bad<B: Backend>(store: &Store<B>, reason: impl Into<String>) -> Failure {
    store.observer().reject(Rejection::Invalid);
    Failure { bad_request: true, reason: reason.into() }
}

fn failed(e: &BackendError) -> Failure {
    Failure { bad_request: false, reason: e.to_string() }
}

fn check<B: Backend>(store: &Store<B>, ok: bool, what: &str) -> Result<(), Failure> {
    if ok {
        Ok(())
    } else {
        Err(bad(store, what))
    }
}

async fn begin<B: Backend>(
    store: &Store<B>,
    b: proto::stream::Begin,
    started: Instant,
) -> Result<Outcome, Failure> {
    check(store, proto::is_hex64(b.key.as_bytes()), "key must be 64 lowercase hex characters")?;
    check(store, proto::is_hex64(b.body_hash.as_bytes()), "body_hash must be 64 lowercase hex characters")?;
    check(store, (1..=proto::MAX_LOCK_TTL_MS).contains(&b.lock_ttl_ms), "lock_ttl_ms out of range")?;
    check(store, b.wait_ms <= proto::MAX_WAIT_MS, "wait_ms out of range")?;
    // As the HTTP headers: with hold, retention_s in range and supersede empty or a token;
    // without it, retention_s is not read and a supersede is refused.
    if b.hold {
        check(store, (1..=proto::MAX_RETENTION_S).contains(&b.retention_s), "retention_s out of range")?;
        let ok = b.supersede.is_empty() || proto::is_token(b.supersede.as_bytes());
        check(store, ok, "supersede must be empty or a lock token")?;
    } else {
        check(store, b.supersede.is_empty(), "supersede needs hold")?;
    }
    let hold = b.hold.then(|| Hold {
        retention: Duration::from_secs(b.retention_s),
        supersede: (!b.supersede.is_empty()).then_some(b.supersede.as_str()),
    });
    let give_up = (b.deadline_ms > 0).then(|| give_up_at(b.deadline_ms));
    let timer = store.observer().timer(MetricOp::Begin, started);
    let lock_ttl = Duration::from_millis(b.lock_ttl_ms);
    let wait = Duration::from_millis(b.wait_ms);
    let begun = match store.begin_with(&b.key, &b.body_hash, lock_ttl, wait, give_up, hold).await {
        Ok(begun) => begun,
        Err(e) => {
            timer.failed(&e);
            return Err(failed(&e));
        }
    };
    let (outcome, answer) = match begun {
        Begin::Record(bytes, ttl) => {
            let ttl_ms = ttl.and_then(|t| u64::try_from(t.as_millis()).ok()).unwrap_or(0);
            (proto::BeginOutcome::Record, Begun { record: bytes.to_vec(), ttl_ms, ..Begun::default() })
        }
        Begin::Locked { token } => (proto::BeginOutcome::Locked, Begun { token, ..Begun::default() }),
        Begin::Busy { remaining } => {
            let lock_remaining_ms = remaining.map_or(0, ceil_millis);
            (proto::BeginOutcome::Busy, Begun { lock_remaining_ms, ..Begun::default() })
        }
        Begin::Mismatch => (proto::BeginOutcome::Mismatch, Begun::default()),
        Begin::Expired => (proto::BeginOutcome::Expired, Begun::default()),
        Begin::InDoubt { token, started_ms, running } => {
            let running_ms = running_millis(running);
            (proto::BeginOutcome::InDoubt, Begun { token, started_ms, running_ms, ..Begun::default() })
        }
    };
    timer.answered(MetricOutcome::Begin(outcome));
    Ok(Outcome::Begun(Begun { outcome: outcome.as_str().to_string(), ..answer }))
}

async fn commit<B: Backend>(
    store: &Store<B>,
    c: Commit,
    max_record_bytes: usize,
    started: Instant,
) -> Result<Outcome, Failure> {
    check(store, proto::is_hex64(c.key.as_bytes()), "key must be 64 lowercase hex characters")?;
    check(store, proto::is_token(c.token.as_bytes()), "token must be a lock token")?;
    check(store, proto::is_hex64(c.body_hash.as_bytes()), "body_hash must be 64 lowercase hex characters")?;
    check(store, (1..=proto::MAX_RETENTION_S).contains(&c.retention_s), "retention_s out of range")?;
    check(store, !c.record.is_empty(), "the record must not be empty")?;
    if c.record.len() > max_record_bytes {
        store.observer().reject(Rejection::TooLarge);
        return Err(Failure { bad_request: true, reason: "the record is over --max-body-bytes".into() });
    }
    let timer = store.observer().timer(MetricOp::Commit, started);
    let retention = Duration::from_secs(c.retention_s);
    let done = store
        .commit(backend::Commit {
            key: &c.key,
            token: &c.token,
            body_hash: &c.body_hash,
            record: Bytes::from(c.record),
            retention,
        })
        .await;
    let outcome = timed(timer, done, |o| MetricOutcome::Commit(*o))?;
    Ok(Outcome::Committed(outcome.as_str().to_string()))
}

async fn release<B: Backend>(
    store: &Store<B>,
    r: proto::stream::Release,
    started: Instant,
) -> Result<Outcome, Failure> {
    check(store, proto::is_hex64(r.key.as_bytes()), "key must be 64 lowercase hex characters")?;
    check(store, proto::is_token(r.token.as_bytes()), "token must be a lock token")?;
    let timer = store.observer().timer(MetricOp::Release, started);
    if r.in_doubt {
        store.observer().in_doubt_release();
    }
    let released = store.release(&r.key, &r.token, r.in_doubt).await;
    let outcome = timed(timer, released, |o| MetricOutcome::Release(*o))?;
    Ok(Outcome::Released(outcome.as_str().to_string()))
}

/// Records a call's result on its timer: an outcome as answered, a backend error as failed
/// (and a [`Failure`] for the caller).
fn timed<T>(
    timer: Timer<'_>,
    result: Result<T, BackendError>,
    outcome: impl FnOnce(&T) -> MetricOutcome,
) -> Result<T, Failure> {
    match result {
        Ok(value) => {
            timer.answered(outcome(&value));
            Ok(value)
        }
        Err(e) => {
            timer.failed(&e);
            Err(failed(&e))
        }
    }
}
