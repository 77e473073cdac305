//! [`HostCalls`] over the module ABI, for one worker of one filter configuration. Streams are
//! numbered on the worker (0 is the "root", as proxy-wasm's root context: no stream); the
//! store stream is the in-process store, whose answers come back through the worker's [`Link`].

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use prost::Message;

use super::abi::{self, HttpBodyType, HttpHeaderType, ModuleBuffer, ModuleHttpHeader};
use super::env::NativeEnv;
use super::link::{Event, Link};
use super::module::Shared;
use crate::host::calls::{GrpcStream, HostCalls, HttpCall, LocalReply, Map, MetricKind, Status};
use crate::worker::env::Env;
use idem_protocol::stream::Call;

/// The root's id: calls on it have no stream.
pub const ROOT: u32 = 0;

const NOT_FOUND: Status = Status(1);
const BAD_ARGUMENT: Status = Status(2);
const PARSE_FAILURE: Status = Status(4);
const INTERNAL_FAILURE: Status = Status(10);

/// Filter state keys as the wasm filter's (`wasm.<property>`), so one access log format reads
/// either host.
const FILTER_STATE_PREFIX: &str = "wasm.";

/// The most histogram values kept for the worker's thread (see `record_metric`).
const MAX_DEFERRED: usize = 4096;

pub struct NativeCalls {
    shared: Arc<Shared>,
    link: Arc<Link>,
    streams: RefCell<HashMap<u32, abi::HttpFilterEnvoyPtr>>,
    /// The effective stream (null: the root).
    current: Cell<abi::HttpFilterEnvoyPtr>,
    next_token: Cell<u32>,
    /// Calls come from a store thread running the coordinator for the worker (see `link.rs`):
    /// no stream may be touched, and histogram values wait for the worker's thread.
    elsewhere: Cell<bool>,
    deferred: RefCell<Vec<(u32, u64)>>,
}

fn ok(done: bool, status: Status) -> Result<(), Status> {
    if done {
        Ok(())
    } else {
        Err(status)
    }
}

impl NativeCalls {
    pub fn new(shared: Arc<Shared>, link: Arc<Link>) -> Self {
        NativeCalls {
            shared,
            link,
            streams: RefCell::default(),
            current: Cell::new(std::ptr::null_mut()),
            next_token: Cell::new(1),
            elsewhere: Cell::new(false),
            deferred: RefCell::default(),
        }
    }

    pub fn add_stream(&self, id: u32, filter: abi::HttpFilterEnvoyPtr) {
        self.streams.borrow_mut().insert(id, filter);
    }

    pub fn remove_stream(&self, id: u32) {
        let removed = self.streams.borrow_mut().remove(&id);
        if removed == Some(self.current.get()) {
            self.current.set(std::ptr::null_mut());
        }
    }

    /// Calls come from another thread than the worker's (`true`) or from it again.
    pub fn set_elsewhere(&self, elsewhere: bool) {
        self.elsewhere.set(elsewhere);
        if elsewhere {
            self.current.set(std::ptr::null_mut());
        }
    }

    /// On the worker's thread: the histogram values recorded elsewhere.
    pub fn record_deferred(&self) {
        if self.deferred.borrow().is_empty() {
            return;
        }
        for (id, value) in std::mem::take(&mut *self.deferred.borrow_mut()) {
            let _ = self.shared.metrics.record(&self.shared.envoy, id, value);
        }
    }

    /// The effective stream, or `NotFound` for the root.
    fn filter(&self) -> Result<abi::HttpFilterEnvoyPtr, Status> {
        let filter = self.current.get();
        if filter.is_null() {
            Err(NOT_FOUND)
        } else {
            Ok(filter)
        }
    }

    fn header_type(map: Map) -> HttpHeaderType {
        match map {
            Map::RequestHeaders => HttpHeaderType::REQUEST_HEADER,
            Map::ResponseHeaders => HttpHeaderType::RESPONSE_HEADER,
            Map::ResponseTrailers => HttpHeaderType::RESPONSE_TRAILER,
        }
    }
}

impl HostCalls for NativeCalls {
    fn set_effective_context(&self, context: u32) -> Result<(), Status> {
        if context == ROOT {
            self.current.set(std::ptr::null_mut());
            return Ok(());
        }
        if self.elsewhere.get() {
            return Err(NOT_FOUND);
        }
        let filter = self.streams.borrow().get(&context).copied().ok_or(NOT_FOUND)?;
        self.current.set(filter);
        Ok(())
    }

    /// Sent as headers, body and trailers, exactly as given: Envoy's local reply would label an
    /// unlabelled body `text/plain`, drop the content type of an empty one, and carry no
    /// trailers; and this module's own response callbacks do not see what it sends.
    fn send_local_response(&self, reply: LocalReply<'_>) -> Result<(), Status> {
        let filter = self.filter()?;
        let status = reply.status.to_string();
        let body = reply.body.unwrap_or_default();
        let length = body.len().to_string();
        let header = |(k, v): &(String, String)| ModuleHttpHeader::new(k.as_bytes(), v.as_bytes());
        let mut headers = Vec::with_capacity(reply.headers.len() + 2);
        headers.push(ModuleHttpHeader::new(b":status", status.as_bytes()));
        headers.extend(reply.headers.iter().map(header));
        // A gRPC answer (trailers follow) says no length.
        let sized = reply.headers.iter().any(|(k, _)| k == "content-length");
        if !body.is_empty() && reply.trailers.is_none() && !sized {
            headers.push(ModuleHttpHeader::new(b"content-length", length.as_bytes()));
        }
        let trailers: Vec<ModuleHttpHeader> = reply.trailers.unwrap_or_default().iter().map(header).collect();
        // SAFETY: a live stream (removed from `streams` when destroyed); every buffer outlives
        // the calls, which copy them.
        unsafe {
            abi::envoy_dynamic_module_callback_http_send_response_headers(
                filter,
                headers.as_ptr(),
                headers.len(),
                body.is_empty() && trailers.is_empty(),
            );
            if !body.is_empty() {
                abi::envoy_dynamic_module_callback_http_send_response_data(
                    filter,
                    ModuleBuffer::from_bytes(body),
                    trailers.is_empty(),
                );
            }
            if !trailers.is_empty() {
                abi::envoy_dynamic_module_callback_http_send_response_trailers(
                    filter,
                    trailers.as_ptr(),
                    trailers.len(),
                );
            }
        }
        Ok(())
    }

    fn resume_request(&self) -> Result<(), Status> {
        let filter = self.filter()?;
        // SAFETY: a live stream.
        unsafe { abi::envoy_dynamic_module_callback_http_filter_continue_decoding(filter) };
        Ok(())
    }

    fn set_header(&self, map: Map, name: &str, value: Option<&str>) -> Result<(), Status> {
        let filter = self.filter()?;
        // A null value removes every value of the header.
        let value = value.map_or(ModuleBuffer::null(), ModuleBuffer::from_str);
        let key = ModuleBuffer::from_str(name);
        // SAFETY: a live stream; the buffers outlive the call.
        let done = unsafe {
            abi::envoy_dynamic_module_callback_http_set_header(filter, Self::header_type(map), key, value)
        };
        ok(done, BAD_ARGUMENT)
    }

    fn add_header(&self, map: Map, name: &str, value: &str) -> Result<(), Status> {
        let filter = self.filter()?;
        let (key, value) = (ModuleBuffer::from_str(name), ModuleBuffer::from_str(value));
        // SAFETY: as `set_header`.
        let done = unsafe {
            abi::envoy_dynamic_module_callback_http_add_header(filter, Self::header_type(map), key, value)
        };
        ok(done, BAD_ARGUMENT)
    }

    /// The gRPC replay hop replaces the whole body (`start` 0): drained, then the new one.
    fn set_request_body(&self, start: usize, size: usize, value: &[u8]) -> Result<(), Status> {
        let filter = self.filter()?;
        if start != 0 {
            return Err(BAD_ARGUMENT);
        }
        let body = HttpBodyType::BUFFERED_REQUEST_BODY;
        // SAFETY: a live stream; `value` outlives the call.
        unsafe {
            ok(abi::envoy_dynamic_module_callback_http_drain_body(filter, body, size), BAD_ARGUMENT)?;
            let done = abi::envoy_dynamic_module_callback_http_append_body(
                filter,
                body,
                ModuleBuffer::from_bytes(value),
            );
            ok(done, BAD_ARGUMENT)
        }
    }

    fn call_foreign_function(&self, name: &str) -> Result<(), Status> {
        let filter = self.filter()?;
        match name {
            // SAFETY: a live stream.
            "clear_route_cache" => unsafe {
                abi::envoy_dynamic_module_callback_http_clear_route_cache(filter)
            },
            _ => return Err(NOT_FOUND),
        }
        Ok(())
    }

    fn set_property(&self, path: &[&str], value: &[u8]) -> Result<(), Status> {
        let filter = self.filter()?;
        let key = format!("{FILTER_STATE_PREFIX}{}", path.join("."));
        // SAFETY: a live stream; the buffers outlive the call.
        let done = unsafe {
            abi::envoy_dynamic_module_callback_http_set_filter_state_bytes(
                filter,
                ModuleBuffer::from_str(&key),
                ModuleBuffer::from_bytes(value),
            )
        };
        ok(done, BAD_ARGUMENT)
    }

    /// Not yet: a callout belongs to a stream here (Envoy cancels it with the stream), and the
    /// coordinator's callouts outlive theirs. The coordinator fails the call as undispatched.
    fn dispatch_http_call(&self, _call: HttpCall<'_>) -> Result<u32, Status> {
        Err(INTERNAL_FAILURE)
    }

    fn open_grpc_stream(&self, _stream: GrpcStream<'_>) -> Result<u32, Status> {
        if !self.shared.store.has_store() {
            return Err(INTERNAL_FAILURE);
        }
        let token = self.next_token.get();
        self.next_token.set(token.wrapping_add(1).max(1));
        Ok(token)
    }

    fn grpc_send(&self, token: u32, message: &[u8]) -> Result<(), Status> {
        let call = Call::decode(message).map_err(|_| PARSE_FAILURE)?;
        let link = Arc::clone(&self.link);
        let answered = move |answer: idem_protocol::stream::Answer| {
            link.push(Event::Message { token, bytes: answer.encode_to_vec() });
        };
        ok(self.shared.store.call(call, answered), INTERNAL_FAILURE)
    }

    /// The calls in flight finish on the store's threads; their answers are for a token the
    /// coordinator no longer knows, and it drops them.
    fn grpc_cancel(&self, _token: u32) -> Result<(), Status> {
        Ok(())
    }

    fn register_shared_queue(&self, _name: &str) -> Result<u32, Status> {
        Ok(1)
    }

    fn enqueue_shared_queue(&self, _queue: u32, _value: &[u8]) -> Result<(), Status> {
        self.link.push(Event::Wake);
        Ok(())
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> Result<u32, Status> {
        self.shared.metrics.find(kind, name).ok_or(NOT_FOUND)
    }

    fn increment_metric(&self, id: u32, offset: i64) -> Result<(), Status> {
        self.shared.metrics.increment(&self.shared.envoy, id, offset)
    }

    fn record_metric(&self, id: u32, value: u64) -> Result<(), Status> {
        if self.elsewhere.get() && self.shared.metrics.is_histogram(id) {
            let mut deferred = self.deferred.borrow_mut();
            // Bounded: a worker with no stream makes no new calls, so this holds a few answers.
            if deferred.len() < MAX_DEFERRED {
                deferred.push((id, value));
            }
            return Ok(());
        }
        self.shared.metrics.record(&self.shared.envoy, id, value)
    }

    fn set_tick_period(&self, period: Duration) -> Result<(), Status> {
        self.link.set_tick(period, self.shared.store.handle());
        Ok(())
    }

    fn log(&self, level: log::Level, message: fmt::Arguments<'_>) {
        super::module::log(level, message);
    }

    fn env(&self) -> &dyn Env {
        &NativeEnv
    }
}
