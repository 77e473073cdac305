//! The store stream (`idemstore.v1.Store/Stream`, see `idem_protocol::stream`): one long-lived
//! gRPC stream per filter worker, served next to the HTTP API on the same listener, behind the
//! same secret check (the router's gate reads the stream's `x-idem-secret` metadata once).
//!
//! Every call on the stream runs as its own task, so a `begin` waiting for a lock holds up
//! nothing else; the answers go back in the order they are ready, each with its call's id. On
//! Redis, the calls of every stream share the multiplexed connection, which pipelines them.
//! Each call is served by idem-store's [`idem_store::calls::serve`], the code a host running the
//! store in Envoy's process serves it with: validated and counted (through [`crate::metrics`],
//! the store's observer) as its HTTP twin; one that is malformed or that the backend fails
//! answers a `Failure` and the stream goes on. A shutdown ends the waits (they answer `busy`)
//! and then the streams.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Bytes;
use idem_protocol as proto;
use idem_store::calls::serve;
use proto::stream::{Answer, Call};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codegen::http;
use tonic::Status;

use crate::backend::Backend;
use crate::store::Store;

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
