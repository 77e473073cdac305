//! [`HostCalls`] in Envoy: the stream-facing calls and the store stream's sends through `abi.rs`
//! (every status an `Err`), the rest through `proxy_wasm::hostcalls` (callouts and streams must
//! go through the SDK, which registers their tokens for its dispatch of their callbacks).

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType};
use std::fmt;
use std::time::Duration;

use super::abi;
use super::env::HostEnv;
use crate::host::calls::{GrpcStream, HostCalls, HttpCall, LocalReply, Map, MetricKind, Status};
use crate::worker::env::Env;

/// Envoy, through proxy-wasm.
pub struct Envoy;

fn status(s: proxy_wasm::types::Status) -> Status {
    Status(s as u32)
}

fn map_type(map: Map) -> MapType {
    match map {
        Map::RequestHeaders => MapType::HttpRequestHeaders,
        Map::ResponseHeaders => MapType::HttpResponseHeaders,
        Map::ResponseTrailers => MapType::HttpResponseTrailers,
    }
}

impl HostCalls for Envoy {
    fn set_effective_context(&self, context: u32) -> Result<(), Status> {
        abi::set_effective_context(context)
    }

    fn send_local_response(&self, r: LocalReply<'_>) -> Result<(), Status> {
        abi::send_http_response(r.status, r.headers, r.body)
    }

    fn resume_request(&self) -> Result<(), Status> {
        abi::resume_http_request()
    }

    fn set_header(&self, map: Map, name: &str, value: Option<&str>) -> Result<(), Status> {
        abi::set_map_value(map_type(map), name, value)
    }

    fn add_header(&self, map: Map, name: &str, value: &str) -> Result<(), Status> {
        abi::add_map_value(map_type(map), name, value)
    }

    fn set_request_body(&self, start: usize, size: usize, value: &[u8]) -> Result<(), Status> {
        abi::set_buffer(BufferType::HttpRequestBody, start, size, value)
    }

    fn call_foreign_function(&self, name: &str) -> Result<(), Status> {
        abi::call_foreign_function(name)
    }

    fn set_property(&self, path: &[&str], value: &[u8]) -> Result<(), Status> {
        abi::set_property(path, value)
    }

    fn dispatch_http_call(&self, c: HttpCall<'_>) -> Result<u32, Status> {
        hostcalls::dispatch_http_call(c.cluster, c.headers, c.body, vec![], c.timeout).map_err(status)
    }

    fn open_grpc_stream(&self, s: GrpcStream<'_>) -> Result<u32, Status> {
        hostcalls::open_grpc_stream(s.service, s.grpc_service, s.method, s.metadata).map_err(status)
    }

    fn grpc_send(&self, token: u32, message: &[u8]) -> Result<(), Status> {
        abi::grpc_send(token, message)
    }

    fn grpc_cancel(&self, token: u32) -> Result<(), Status> {
        abi::grpc_cancel(token)
    }

    fn register_shared_queue(&self, name: &str) -> Result<u32, Status> {
        hostcalls::register_shared_queue(name).map_err(status)
    }

    fn enqueue_shared_queue(&self, queue: u32, value: &[u8]) -> Result<(), Status> {
        hostcalls::enqueue_shared_queue(queue, Some(value)).map_err(status)
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> Result<u32, Status> {
        let kind = match kind {
            MetricKind::Counter => MetricType::Counter,
            MetricKind::Gauge => MetricType::Gauge,
            MetricKind::Histogram => MetricType::Histogram,
        };
        hostcalls::define_metric(kind, name).map_err(status)
    }

    fn increment_metric(&self, id: u32, offset: i64) -> Result<(), Status> {
        hostcalls::increment_metric(id, offset).map_err(status)
    }

    fn record_metric(&self, id: u32, value: u64) -> Result<(), Status> {
        hostcalls::record_metric(id, value).map_err(status)
    }

    fn set_tick_period(&self, period: Duration) -> Result<(), Status> {
        hostcalls::set_tick_period(period).map_err(status)
    }

    fn log(&self, level: log::Level, message: fmt::Arguments<'_>) {
        log::log!(level, "{message}");
    }

    fn env(&self) -> &dyn Env {
        &HostEnv
    }
}
