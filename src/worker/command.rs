//! What the worker asks the host to do: the [`Command`]s the coordinator returns, carried out
//! by the host in order and nothing else, and the callouts among them ([`Dispatch`]).
//!
//! [`Coordinator`]: crate::worker::coordinator::Coordinator
//! [`Coordinator::poll`]: crate::worker::coordinator::Coordinator::poll
//! [`Coordinator::on_tick`]: crate::worker::coordinator::Coordinator::on_tick
//! [`Coordinator::on_respond_failed`]: crate::worker::coordinator::Coordinator::on_respond_failed
//! [`Coordinator::on_queue_ready`]: crate::worker::coordinator::Coordinator::on_queue_ready
//! [`Coordinator::on_wake_failed`]: crate::worker::coordinator::Coordinator::on_wake_failed
//! [`Coordinator::on_dispatched`]: crate::worker::coordinator::Coordinator::on_dispatched
//! [`Coordinator::on_stream_opened`]: crate::worker::coordinator::Coordinator::on_stream_opened
//! [`Coordinator::on_stream_send_failed`]: crate::worker::coordinator::Coordinator::on_stream_send_failed

use crate::request::metrics::Metric;
use crate::request::problem::LocalResponse;
use crate::store::client::CallKind;

/// What the host does, in the order [`Coordinator::poll`] returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Answer the client instead of the upstream. On failure, tell
    /// [`Coordinator::on_respond_failed`].
    Respond {
        stream: u32,
        response: LocalResponse,
    },
    /// Let the paused request go on to the upstream.
    Resume {
        stream: u32,
    },
    /// A gRPC replay's second hop: mark the paused request with `grpc::HOP_HEADER` and the
    /// record content type, replace its body (`body_len` bytes) with `record`, clear the route
    /// cache and resume it. If any step fails, answer `fallback` instead (a problem with this
    /// `instance`, set as for [`Command::Instance`], and `refusal`, its log line): the request
    /// must never go on as it is.
    Hop {
        stream: u32,
        record: Vec<u8>,
        body_len: usize,
        fallback: LocalResponse,
        instance: String,
        refusal: String,
    },
    /// Only in the stream's own response-headers callback (the replay listener).
    RemoveResponseHeader {
        stream: u32,
        name: String,
    },
    /// Only in the stream's own response-headers callback (`expiry_header`).
    SetResponseHeader {
        stream: u32,
        name: String,
        value: String,
    },
    /// Only in the stream's own response-body callback (the replay listener).
    AddResponseTrailers {
        stream: u32,
        trailers: Vec<(String, String)>,
    },
    /// Only in the stream's own request-header callback.
    SetRequestHeader {
        stream: u32,
        name: String,
        value: String,
    },
    RemoveRequestHeader {
        stream: u32,
        name: String,
    },
    /// Set the filter state the access log reads for a refusal's `instance`
    /// (`problem::INSTANCE_PROPERTY`), before the refusal is sent.
    Instance {
        stream: u32,
        instance: String,
    },
    /// Set the filter state the access log reads (`metrics::OUTCOME_PROPERTY`).
    Outcome {
        stream: u32,
        outcome: &'static str,
    },
    Count(Metric),
    /// Add `n` to a counter.
    Add {
        metric: Metric,
        n: u64,
    },
    /// Set the gauge of local records (`metrics::LOCAL_RECORDS`).
    LocalRecords(u64),
    /// Add to the gauge of calls in flight on the store streams (`metrics::STREAM_CALLS`).
    StreamCalls(i64),
    /// Call [`Coordinator::on_tick`] every this many milliseconds (0: stop).
    Tick {
        period_ms: u64,
    },
    /// A store call's latency, for its histogram.
    Latency {
        kind: CallKind,
        micros: u64,
    },
    /// Enqueue on the worker's shared queue, so that the root's [`Coordinator::on_queue_ready`]
    /// runs; on failure, tell [`Coordinator::on_wake_failed`]. Only in stream callbacks.
    Wake,
    /// Send a callout from the root context and tell [`Coordinator::on_dispatched`] its token.
    Dispatch(Dispatch),
    /// Open the store stream (gRPC `idem_protocol::stream::PATH`) to `service` (Envoy's
    /// `GrpcService`, serialized: `store::stream::grpc_service`) with this metadata, and tell
    /// [`Coordinator::on_stream_opened`] its token. Only in root callbacks.
    OpenStream {
        service: String,
        metadata: Vec<(String, String)>,
    },
    /// Send a message on the store stream `token` (as the root context, also from a stream
    /// callback); on failure, tell [`Coordinator::on_stream_send_failed`].
    StreamSend {
        token: u32,
        message: Vec<u8>,
    },
    /// Reset the store stream `token`: the worker gave up on it.
    CancelStream {
        token: u32,
    },
}

/// A callout to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dispatch {
    pub job: u64,
    pub cluster: String,
    /// Pseudo-headers first.
    pub headers: Vec<(String, String)>,
    pub body: Option<Vec<u8>>,
    pub timeout_ms: u64,
}
