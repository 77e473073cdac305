//! The proxy-wasm glue: the only module that talks to Envoy. It turns Envoy's callbacks into
//! [`Coordinator`] events and carries out the [`Command`]s that come back; every decision is in
//! the coordinator and the per-request machines behind it.
//!
//! Only `hostcalls::` functions that return `Result` are used: the SDK's trait helpers panic on
//! an unexpected host status, and a panic traps the VM.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action as HostAction, BufferType, ContextType, LogLevel, MapType, MetricType};
use std::cell::{Cell, RefCell};
use std::hash::{BuildHasher, Hasher};
use std::rc::Rc;
use std::time::Duration;

use crate::config::Config;
use crate::request::machine::{Action, Machine, Step, StreamView};
use crate::request::metrics::{Metric, LOCAL_RECORDS, OUTCOME_PROPERTY, STORE_LATENCY, STREAM_CALLS};
use crate::worker::command::Command;
use crate::worker::coordinator::{Coordinator, Stepped};
use crate::worker::env::Clock;
use idem_protocol::stream::{METHOD, SERVICE};

mod abi;
mod env;
use env::{HostEnv, HostView};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|id| -> Box<dyn RootContext> { Box::new(Root { id, vm: None }) });
}}

/// What one root context shares with the streams it creates (same VM, same thread).
struct Vm {
    root_id: u32,
    queue: u32,
    /// Counter ids, in the order of [`Metric::ALL`].
    metrics: Vec<u32>,
    /// Histogram ids, in the order of [`STORE_LATENCY`].
    latency: Vec<u32>,
    /// The gauge [`LOCAL_RECORDS`].
    local_records: u32,
    /// The gauge [`STREAM_CALLS`].
    stream_calls: u32,
    coordinator: RefCell<Coordinator>,
    /// The context whose callback runs now: the effective context again after a store stream
    /// message is sent as the root's from a stream callback.
    current: Cell<u32>,
}

impl Vm {
    /// Runs `event` on the coordinator, then carries out every command it (and what the host
    /// reports back) produces. No borrow is held while Envoy is called.
    fn run<T>(&self, event: impl FnOnce(&mut Coordinator) -> T) -> Option<T> {
        let out = event(&mut *self.coordinator.try_borrow_mut().ok()?);
        // The borrow ends inside the closure, before the command is carried out.
        while let Some(command) = self.coordinator.try_borrow_mut().ok().and_then(|mut c| c.poll()) {
            self.carry_out(command);
        }
        Some(out)
    }

    fn report(&self, event: impl FnOnce(&mut Coordinator)) {
        if let Ok(mut c) = self.coordinator.try_borrow_mut() {
            event(&mut c);
        }
    }

    fn add(&self, metric: Metric, n: u64) {
        if let Some(&id) = self.metrics.get(metric.index()) {
            let _ = hostcalls::increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    fn carry_out(&self, command: Command) {
        match command {
            Command::Respond { stream, response: r } => {
                // Also from a root callback (a store answer): the answer is for this stream.
                let _ = abi::set_effective_context(stream);
                if let Err(s) = abi::send_http_response(r.status, &r.headers, Some(&r.body)) {
                    log::warn!("cannot send local response {}: {s:?}", r.status);
                    self.report(|c| c.on_respond_failed(stream));
                }
            }
            Command::Resume { stream } => {
                let _ = abi::set_effective_context(stream);
                if let Err(s) = abi::resume_http_request() {
                    log::warn!("cannot resume request: {s:?}");
                }
            }
            Command::Hop { stream, record, body_len, fallback } => {
                // Never another stream's body: a stream Envoy no longer knows needs nothing.
                if abi::set_effective_context(stream).is_err() {
                    return;
                }
                if let Err(step) = hop(&record, body_len) {
                    log::warn!("cannot re-route a gRPC replay ({step}): answering it as failed");
                    if let Err(s) = abi::send_http_response(fallback.status, &fallback.headers, None) {
                        log::warn!("cannot send local response: {s:?}");
                    }
                }
            }
            Command::SetResponseHeader { name, value, .. } => {
                if let Err(s) = abi::set_map_value(MapType::HttpResponseHeaders, &name, Some(&value)) {
                    log::warn!("cannot set response header {name}: {s:?}");
                }
            }
            Command::RemoveResponseHeader { name, .. } => {
                if let Err(s) = abi::set_map_value(MapType::HttpResponseHeaders, &name, None) {
                    log::debug!("cannot remove response header {name}: {s:?}");
                }
            }
            Command::AddResponseTrailers { trailers, .. } => {
                for (name, value) in &trailers {
                    if let Err(s) = abi::add_map_value(MapType::HttpResponseTrailers, name, value) {
                        log::warn!("cannot add trailer {name}: {s:?}");
                    }
                }
            }
            Command::SetRequestHeader { name, value, .. } => {
                if let Err(s) = abi::set_map_value(MapType::HttpRequestHeaders, &name, Some(&value)) {
                    log::warn!("cannot set request header {name}: {s:?}");
                }
            }
            Command::RemoveRequestHeader { name, .. } => {
                if let Err(s) = abi::set_map_value(MapType::HttpRequestHeaders, &name, None) {
                    log::warn!("cannot remove request header {name}: {s:?}");
                }
            }
            Command::Outcome { stream, outcome } => {
                let _ = abi::set_effective_context(stream);
                if let Err(s) = abi::set_property(&[OUTCOME_PROPERTY], outcome.as_bytes()) {
                    log::debug!("cannot set {OUTCOME_PROPERTY}: {s:?}");
                }
            }
            Command::Count(m) => self.add(m, 1),
            Command::Add { metric, n } => self.add(metric, n),
            Command::LocalRecords(n) => {
                let _ = hostcalls::record_metric(self.local_records, n);
            }
            Command::StreamCalls(delta) => {
                let _ = hostcalls::increment_metric(self.stream_calls, delta);
            }
            Command::Tick { period_ms } => {
                let _ = hostcalls::set_tick_period(Duration::from_millis(period_ms));
            }
            Command::Latency { kind, micros } => {
                let id = STORE_LATENCY.iter().position(|(k, _)| *k == kind).and_then(|i| self.latency.get(i));
                if let Some(&id) = id {
                    let _ = hostcalls::record_metric(id, micros);
                }
            }
            Command::Wake => {
                if let Err(s) = hostcalls::enqueue_shared_queue(self.queue, Some(b"1")) {
                    log::error!("cannot wake the root context: {s:?}");
                    self.report(|c| c.on_wake_failed(&HostEnv));
                }
            }
            Command::Dispatch(d) => {
                // Envoy registers a callout with the effective context: make sure it is the root.
                let _ = abi::set_effective_context(self.root_id);
                let headers = d.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
                let timeout = Duration::from_millis(d.timeout_ms);
                let token = match hostcalls::dispatch_http_call(
                    &d.cluster,
                    headers,
                    d.body.as_deref(),
                    vec![],
                    timeout,
                ) {
                    Ok(token) => Some(token),
                    Err(s) => {
                        log::warn!("dispatch to {} failed: {s:?}", d.cluster);
                        None
                    }
                };
                self.report(|c| c.on_dispatched(d.job, token, &HostEnv));
            }
            Command::OpenStream { service, metadata } => {
                // Envoy registers the stream with the effective context, and delivers its
                // messages there: the root. The SDK's call registers the token for that delivery
                // (it panics only on statuses Envoy does not give for a cluster name).
                let _ = abi::set_effective_context(self.root_id);
                let metadata = metadata.iter().map(|(n, v)| (n.as_str(), v.as_bytes())).collect();
                let token = match hostcalls::open_grpc_stream(&service, SERVICE, METHOD, metadata) {
                    Ok(token) => Some(token),
                    Err(s) => {
                        log::warn!("cannot open the store stream: {s:?}");
                        None
                    }
                };
                self.report(|c| c.on_stream_opened(token, &HostEnv));
            }
            Command::StreamSend { token, message } => {
                let _ = abi::set_effective_context(self.root_id);
                let sent = abi::grpc_send(token, &message);
                let _ = abi::set_effective_context(self.current.get());
                if let Err(s) = sent {
                    log::warn!("cannot send on the store stream: {s:?}");
                    self.report(|c| c.on_stream_send_failed(token, &HostEnv));
                }
            }
            Command::CancelStream { token } => {
                let _ = abi::set_effective_context(self.root_id);
                let cancelled = abi::grpc_cancel(token);
                let _ = abi::set_effective_context(self.current.get());
                if let Err(s) = cancelled {
                    log::debug!("cannot cancel the store stream: {s:?}");
                }
            }
        }
    }
}

/// The second hop of a gRPC replay (see `request::machine::hop`), for the current stream: the
/// step that failed, if one did (then the request has not been resumed).
fn hop(record: &[u8], body_len: usize) -> Result<(), &'static str> {
    use crate::http::grpc::{HOP_HEADER, HOP_PATH, RECORD_CONTENT_TYPE};
    let headers = MapType::HttpRequestHeaders;
    abi::set_map_value(headers, HOP_HEADER, Some("1")).map_err(|_| "marking it")?;
    abi::set_map_value(headers, ":path", Some(HOP_PATH)).map_err(|_| "its path")?;
    abi::set_map_value(headers, "content-type", Some(RECORD_CONTENT_TYPE)).map_err(|_| "its content type")?;
    abi::set_map_value(headers, "content-length", None).map_err(|_| "its length")?;
    abi::set_buffer(BufferType::HttpRequestBody, 0, body_len, record).map_err(|_| "its body")?;
    abi::call_foreign_function("clear_route_cache").map_err(|_| "clearing the route")?;
    abi::resume_http_request().map_err(|_| "resuming it")
}

struct Root {
    id: u32,
    vm: Option<Rc<Vm>>,
}

impl Root {
    fn configure(&self) -> Result<Vm, String> {
        let bytes = abi::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .map_err(|s| format!("cannot read the plugin configuration: {s:?}"))?
            .unwrap_or_default();
        let cfg = Config::from_json(&bytes).map_err(|e| e.to_string())?;
        let define = |kind, name: &str| {
            hostcalls::define_metric(kind, name).map_err(|s| format!("cannot define metric {name}: {s:?}"))
        };
        let metrics =
            Metric::ALL.iter().map(|m| define(MetricType::Counter, m.name())).collect::<Result<_, _>>()?;
        let latency = STORE_LATENCY
            .iter()
            .map(|(_, name)| define(MetricType::Histogram, name))
            .collect::<Result<_, _>>()?;
        let local_records = define(MetricType::Gauge, LOCAL_RECORDS)?;
        let stream_calls = define(MetricType::Gauge, STREAM_CALLS)?;
        // Queue names are per VM id, and every worker runs this root: a random name keeps each
        // worker's wake-ups on its own thread, where its streams live.
        let name = format!("idempotency-outbox-{:016x}", random_u64(self.id));
        let queue = hostcalls::register_shared_queue(&name)
            .map_err(|s| format!("cannot register shared queue: {s:?}"))?;
        let coordinator = RefCell::new(Coordinator::new(Rc::new(cfg)));
        let vm = Vm {
            root_id: self.id,
            queue,
            metrics,
            latency,
            local_records,
            stream_calls,
            coordinator,
            current: Cell::new(self.id),
        };
        vm.run(|c| c.set_up(&HostEnv, random_u64(self.id)));
        Ok(vm)
    }
}

fn random_u64(seed: u32) -> u64 {
    // std's RandomState draws its keys from WASI `random_get`, which Envoy implements.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(seed);
    h.write_u64(HostEnv.now_us().unwrap_or(0));
    h.finish()
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, _headers: usize, body_size: usize, trailers: usize) {
        let Some(vm) = &self.vm else { return };
        let headers = abi::get_map_bytes(MapType::HttpCallResponseHeaders).unwrap_or_default();
        let body = if body_size > 0 {
            abi::get_buffer(BufferType::HttpCallResponseBody, 0, body_size).ok().flatten().unwrap_or_default()
        } else {
            Vec::new()
        };
        let trailers = if trailers > 0 {
            abi::get_map_bytes(MapType::HttpCallResponseTrailers).unwrap_or_default()
        } else {
            Vec::new()
        };
        vm.current.set(self.id);
        vm.run(|c| c.on_callout_answer_with_trailers(token, headers, body, trailers, &HostEnv));
    }

    fn on_grpc_stream_message(&mut self, token: u32, size: usize) {
        let Some(vm) = &self.vm else { return };
        let message =
            abi::get_buffer(BufferType::GrpcReceiveBuffer, 0, size).ok().flatten().unwrap_or_default();
        vm.current.set(self.id);
        vm.run(|c| c.on_stream_message(token, &message, &HostEnv));
    }

    fn on_grpc_stream_close(&mut self, token: u32, status: u32) {
        let Some(vm) = &self.vm else { return };
        vm.current.set(self.id);
        vm.run(|c| c.on_stream_closed(token, status, &HostEnv));
    }
}

impl RootContext for Root {
    fn on_vm_start(&mut self, _size: usize) -> bool {
        if let Ok(level) = hostcalls::get_log_level() {
            proxy_wasm::set_log_level(level);
        }
        true
    }

    fn on_configure(&mut self, _size: usize) -> bool {
        match self.configure() {
            Ok(vm) => {
                self.vm = Some(Rc::new(vm));
                true
            }
            Err(e) => {
                log::error!("idempotency filter refused its configuration: {e}");
                false
            }
        }
    }

    fn on_tick(&mut self) {
        if let Some(vm) = &self.vm {
            vm.current.set(self.id);
            vm.run(|c| c.on_tick(&HostEnv));
        }
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        while let Ok(Some(_)) = hostcalls::dequeue_shared_queue(queue_id) {}
        if let Some(vm) = &self.vm {
            vm.current.set(self.id);
            vm.run(|c| c.on_queue_ready(&HostEnv));
        }
    }

    fn create_http_context(&self, id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(HttpStream { id, vm: self.vm.clone(), passive: false }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct HttpStream {
    id: u32,
    vm: Option<Rc<Vm>>,
    /// The machine is done with this stream (e.g. not guarded): later callbacks return at once.
    passive: bool,
}

impl HttpStream {
    fn run(&mut self, event: impl FnOnce(&mut Machine, &dyn StreamView) -> Step) -> HostAction {
        if self.passive {
            return HostAction::Continue;
        }
        let Some(vm) = &self.vm else { return HostAction::Continue };
        let view = HostView::default();
        let id = self.id;
        vm.current.set(id);
        let Some(Stepped { action, done }) = vm.run(|c| c.on_stream_event(id, &view, &HostEnv, event)) else {
            return HostAction::Continue;
        };
        self.passive = done;
        match action {
            Action::Continue => HostAction::Continue,
            Action::Pause => HostAction::Pause,
        }
    }
}

impl Context for HttpStream {
    fn on_done(&mut self) -> bool {
        if let Some(vm) = &self.vm {
            let id = self.id;
            vm.current.set(id);
            vm.run(|c| c.on_stream_done(id, &HostView::default(), &HostEnv));
        }
        true
    }
}

impl HttpContext for HttpStream {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> HostAction {
        self.run(|s, v| s.on_request_headers(v, end_of_stream))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> HostAction {
        self.run(|s, v| s.on_request_body(v, body_size, end_of_stream))
    }

    fn on_http_request_trailers(&mut self, _n: usize) -> HostAction {
        self.run(|s, _| s.on_request_trailers())
    }

    fn on_http_response_headers(&mut self, _n: usize, end_of_stream: bool) -> HostAction {
        // A local answer of this filter's passes here too: give it back the content type Envoy
        // changed (see `Coordinator::take_restore`).
        let id = self.id;
        let restore = self.vm.as_ref().and_then(|vm| vm.coordinator.try_borrow_mut().ok()?.take_restore(id));
        if let Some(content_type) = restore {
            let value = content_type.as_deref();
            if let Err(s) = abi::set_map_value(MapType::HttpResponseHeaders, "content-type", value) {
                log::debug!("cannot set the content type of a local answer: {s:?}");
            }
        }
        self.run(|s, v| s.on_response_headers(v, end_of_stream))
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> HostAction {
        self.run(|s, v| s.on_response_body(v, body_size, end_of_stream))
    }

    fn on_http_response_trailers(&mut self, _n: usize) -> HostAction {
        self.run(|s, v| s.on_response_trailers(v))
    }
}
