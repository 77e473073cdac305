//! The host calls the filter makes to carry out commands, behind [`HostCalls`]: over proxy-wasm
//! in Envoy (`envoy.rs`, wasm32 only), over a recording fake in the unit tests (`fake.rs`).
//!
//! Each call is one proxy-wasm call and decides nothing; what a failure means is the caller's
//! business (`vm.rs`). Every call but [`HostCalls::log`] and [`HostCalls::env`] can fail, with
//! the host's status.

use std::fmt;
use std::time::Duration;

use crate::worker::env::Env;

/// A status other than `Ok`, as proxy-wasm numbers it (1 `NotFound`, 2 `BadArgument`, ...).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Status(pub u32);

impl fmt::Debug for Status {
    /// proxy-wasm's name of the status (as its `Status` prints), else its number.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.0 {
            1 => "NotFound",
            2 => "BadArgument",
            3 => "SerializationFailure",
            4 => "ParseFailure",
            7 => "Empty",
            8 => "CasMismatch",
            10 => "InternalFailure",
            n => return write!(f, "Status({n})"),
        };
        f.write_str(name)
    }
}

/// The current stream's header maps the filter writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Map {
    RequestHeaders,
    ResponseHeaders,
    ResponseTrailers,
}

/// The kinds of metric the filter defines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

/// A local response: `body` `None` sends none (not even an empty one).
pub struct LocalReply<'a> {
    pub status: u32,
    pub headers: &'a [(String, String)],
    pub body: Option<&'a [u8]>,
    /// Trailers after the body (the replay listener's answer). A host whose local reply cannot
    /// carry them leaves them to the machine, which adds them as the reply passes its response
    /// callback (the wasm one).
    #[cfg_attr(all(not(feature = "native"), not(test)), allow(dead_code))]
    pub trailers: Option<&'a [(String, String)]>,
}

/// An HTTP callout: to `cluster`, given up after `timeout`.
// The native host makes no callouts yet and serves the store stream in process.
#[cfg_attr(all(feature = "native", not(test)), allow(dead_code))]
pub struct HttpCall<'a> {
    pub cluster: &'a str,
    pub headers: Vec<(&'a str, &'a str)>,
    pub body: Option<&'a [u8]>,
    pub timeout: Duration,
}

/// A gRPC stream: to `service` (Envoy's serialized `GrpcService`), `grpc_service`/`method`.
#[cfg_attr(all(feature = "native", not(test)), allow(dead_code))]
pub struct GrpcStream<'a> {
    pub service: &'a str,
    pub grpc_service: &'a str,
    pub method: &'a str,
    pub metadata: Vec<(&'a str, &'a [u8])>,
}

/// What the filter asks of Envoy, one call each. Calls on "the current stream" go to the
/// effective context ([`HostCalls::set_effective_context`]).
pub trait HostCalls {
    /// Makes `context` the one the following calls are for; fails for a context Envoy no longer
    /// knows.
    fn set_effective_context(&self, context: u32) -> Result<(), Status>;

    /// Answers the current stream with a local response.
    fn send_local_response(&self, reply: LocalReply<'_>) -> Result<(), Status>;

    /// Lets the current stream's paused request go on.
    fn resume_request(&self) -> Result<(), Status>;

    /// Replaces every value of `name` in `map` with `value`, or removes them (`None`).
    fn set_header(&self, map: Map, name: &str, value: Option<&str>) -> Result<(), Status>;

    /// Adds a value of `name` to `map`.
    fn add_header(&self, map: Map, name: &str, value: &str) -> Result<(), Status>;

    /// Replaces `size` bytes of the current request's body from `start` with `value`.
    fn set_request_body(&self, start: usize, size: usize, value: &[u8]) -> Result<(), Status>;

    /// Calls Envoy's foreign function `name` without arguments, its results dropped.
    fn call_foreign_function(&self, name: &str) -> Result<(), Status>;

    /// Sets the current stream's filter state at `path`.
    fn set_property(&self, path: &[&str], value: &[u8]) -> Result<(), Status>;

    /// Sends an HTTP callout from the effective context: its token.
    fn dispatch_http_call(&self, call: HttpCall<'_>) -> Result<u32, Status>;

    /// Opens a gRPC stream from the effective context: its token.
    fn open_grpc_stream(&self, stream: GrpcStream<'_>) -> Result<u32, Status>;

    /// Sends `message` on the open gRPC stream `token` (its context must be the effective one).
    fn grpc_send(&self, token: u32, message: &[u8]) -> Result<(), Status>;

    /// Resets the gRPC stream `token`; no callback of it follows.
    fn grpc_cancel(&self, token: u32) -> Result<(), Status>;

    /// Registers the shared queue `name`: its id.
    fn register_shared_queue(&self, name: &str) -> Result<u32, Status>;

    /// Enqueues `value` on the shared queue `queue`.
    fn enqueue_shared_queue(&self, queue: u32, value: &[u8]) -> Result<(), Status>;

    /// Defines the metric `name`: its id.
    fn define_metric(&self, kind: MetricKind, name: &str) -> Result<u32, Status>;

    /// Adds `offset` to a counter or a gauge.
    fn increment_metric(&self, id: u32, offset: i64) -> Result<(), Status>;

    /// Sets a gauge, or records a value in a histogram.
    fn record_metric(&self, id: u32, value: u64) -> Result<(), Status>;

    /// Calls the root context's `on_tick` every `period` (zero: stop).
    fn set_tick_period(&self, period: Duration) -> Result<(), Status>;

    /// A line in Envoy's log.
    fn log(&self, level: log::Level, message: fmt::Arguments<'_>);

    /// The clock and the shared data, for the coordinator.
    fn env(&self) -> &dyn Env;
}
