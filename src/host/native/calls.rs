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
use crate::worker::env::{Clock, Env};
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

pub struct NativeCalls {
    shared: Arc<Shared>,
    link: Arc<Link>,
    streams: RefCell<HashMap<u32, abi::HttpFilterEnvoyPtr>>,
    /// The effective stream (null: the root).
    current: Cell<abi::HttpFilterEnvoyPtr>,
    next_token: Cell<u32>,
    /// The stream whose response's last frame is in its hook now: the store calls it sends
    /// hold that frame until they are answered (see `module.rs`, "Holding a response's end").
    response_end: Cell<Option<u32>>,
    /// Each held call's id, and its stream ...
    held_calls: RefCell<HashMap<u64, u32>>,
    /// ... and each held stream's calls outstanding, and since when (µs).
    held: RefCell<HashMap<u32, (usize, u64)>>,
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
            response_end: Cell::new(None),
            held_calls: RefCell::default(),
            held: RefCell::default(),
        }
    }

    pub fn add_stream(&self, id: u32, filter: abi::HttpFilterEnvoyPtr) {
        self.streams.borrow_mut().insert(id, filter);
    }

    pub fn remove_stream(&self, id: u32) {
        if self.held.borrow_mut().remove(&id).is_some() {
            self.held_calls.borrow_mut().retain(|_, s| *s != id);
        }
        let removed = self.streams.borrow_mut().remove(&id);
        if removed == Some(self.current.get()) {
            self.current.set(std::ptr::null_mut());
        }
    }

    /// Stream `id`'s response ends in the hook that runs now (`None`: the hook is over); whether
    /// the calls it sent hold that end.
    pub fn response_end(&self, id: Option<u32>) -> bool {
        let was = self.response_end.replace(id);
        was.is_some_and(|s| self.held.borrow().contains_key(&s))
    }

    /// The answer to call `id` was taken: the stream its end releases, if that was its last.
    pub fn answered(&self, id: u64) -> Option<u32> {
        let stream = self.held_calls.borrow_mut().remove(&id)?;
        let mut held = self.held.borrow_mut();
        let outstanding = held.get_mut(&stream)?;
        outstanding.0 = outstanding.0.saturating_sub(1);
        if outstanding.0 > 0 {
            return None;
        }
        held.remove(&stream);
        Some(stream)
    }

    /// Streams held since before `since_us`: their calls went unanswered (the coordinator has
    /// timed them out); their ends go on.
    pub fn overdue(&self, since_us: u64) -> Vec<u32> {
        let mut held = self.held.borrow_mut();
        let late: Vec<u32> = held.iter().filter(|(_, (_, at))| *at < since_us).map(|(s, _)| *s).collect();
        for s in &late {
            held.remove(s);
        }
        self.held_calls.borrow_mut().retain(|_, s| !late.contains(s));
        late
    }

    /// Lets stream `id`'s held response go on, if Envoy still has it.
    pub fn release(&self, id: u32) {
        if let Some(&filter) = self.streams.borrow().get(&id) {
            // SAFETY: a live stream (removed from `streams` when destroyed).
            unsafe { abi::envoy_dynamic_module_callback_http_filter_continue_encoding(filter) };
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
        let filter = self.streams.borrow().get(&context).copied().ok_or(NOT_FOUND)?;
        self.current.set(filter);
        Ok(())
    }

    fn send_local_response(&self, reply: LocalReply<'_>) -> Result<(), Status> {
        let filter = self.filter()?;
        let headers: Vec<ModuleHttpHeader> =
            reply.headers.iter().map(|(k, v)| ModuleHttpHeader::new(k.as_bytes(), v.as_bytes())).collect();
        let body = reply.body.map_or(ModuleBuffer::null(), ModuleBuffer::from_bytes);
        // SAFETY: a live stream (removed from `streams` when destroyed); every buffer outlives
        // the call, which copies them.
        unsafe {
            abi::envoy_dynamic_module_callback_http_send_response(
                filter,
                reply.status,
                headers.as_ptr(),
                headers.len(),
                body,
                ModuleBuffer::from_str("idempotency_filter"),
            );
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
        if let Some(stream) = self.response_end.get() {
            self.held_calls.borrow_mut().insert(call.id, stream);
            let now = NativeEnv.now_us().unwrap_or(0);
            self.held.borrow_mut().entry(stream).or_insert((0, now)).0 += 1;
        }
        let link = Arc::clone(&self.link);
        let answered = move |answer: idem_protocol::stream::Answer| {
            link.push(Event::Message { token, id: answer.id, bytes: answer.encode_to_vec() });
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
