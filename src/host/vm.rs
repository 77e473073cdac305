//! One VM's coordinator and the host calls that carry out its [`Command`]s: a function per
//! command, each making only the calls that command needs. Nothing is decided here: a failed
//! call is logged, and reported back to the coordinator when the command says so ([`Report`]).

use log::Level;
use std::cell::{Cell, RefCell};
use std::fmt;
use std::rc::Rc;
use std::time::Duration;

use super::calls::{GrpcStream, HostCalls, HttpCall, LocalReply, Map, MetricKind};
use crate::config::Config;
use crate::http::grpc::{HOP_HEADER, HOP_PATH, RECORD_CONTENT_TYPE};
use crate::request::metrics::{Metric, LOCAL_RECORDS, OUTCOME_PROPERTY, STORE_LATENCY, STREAM_CALLS};
use crate::request::problem::{LocalResponse, INSTANCE_PROPERTY};
use crate::store::client::CallKind;
use crate::worker::command::{Command, Dispatch};
use crate::worker::coordinator::Coordinator;
use idem_protocol::stream::{METHOD, SERVICE};

/// What one root context shares with the streams it creates (same VM, same thread).
pub struct Vm<H> {
    host: H,
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

/// What a command's host call tells the coordinator back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Report {
    /// [`Coordinator::on_respond_failed`].
    RespondFailed { stream: u32 },
    /// [`Coordinator::on_wake_failed`].
    WakeFailed,
    /// [`Coordinator::on_dispatched`]: the callout's token, `None` if it was not sent.
    Dispatched { job: u64, token: Option<u32> },
    /// [`Coordinator::on_stream_opened`]: the stream's token, `None` if it was not opened.
    StreamOpened { token: Option<u32> },
    /// [`Coordinator::on_stream_send_failed`].
    StreamSendFailed { token: u32 },
}

impl<H: HostCalls> Vm<H> {
    /// Defines the filter's metrics and registers the worker's wake-up queue `queue_name`
    /// (unique to this worker: see `contexts.rs`): the VM of root context `root_id`, or why not.
    pub fn new(host: H, root_id: u32, cfg: Config, queue_name: &str) -> Result<Vm<H>, String> {
        let define = |kind, name: &str| {
            host.define_metric(kind, name).map_err(|s| format!("cannot define metric {name}: {s:?}"))
        };
        let metrics =
            Metric::ALL.iter().map(|m| define(MetricKind::Counter, m.name())).collect::<Result<_, _>>()?;
        let latency = STORE_LATENCY
            .iter()
            .map(|(_, name)| define(MetricKind::Histogram, name))
            .collect::<Result<_, _>>()?;
        let local_records = define(MetricKind::Gauge, LOCAL_RECORDS)?;
        let stream_calls = define(MetricKind::Gauge, STREAM_CALLS)?;
        let queue = host
            .register_shared_queue(queue_name)
            .map_err(|s| format!("cannot register shared queue: {s:?}"))?;
        Ok(Vm {
            host,
            root_id,
            queue,
            metrics,
            latency,
            local_records,
            stream_calls,
            coordinator: RefCell::new(Coordinator::new(Rc::new(cfg))),
            current: Cell::new(root_id),
        })
    }

    #[cfg(any(test, feature = "native"))]
    pub fn host(&self) -> &H {
        &self.host
    }

    /// Context `id`'s callback runs now.
    pub fn enter(&self, id: u32) {
        self.current.set(id);
    }

    /// Runs `event` on the coordinator, then carries out every command it (and what the host
    /// reports back) produces. No borrow is held while Envoy is called.
    pub fn run<T>(&self, event: impl FnOnce(&mut Coordinator) -> T) -> Option<T> {
        let out = event(&mut *self.coordinator.try_borrow_mut().ok()?);
        // The borrow ends inside the closure, before the command is carried out.
        while let Some(command) = self.coordinator.try_borrow_mut().ok().and_then(|mut c| c.poll()) {
            if let Some(report) = self.carry_out(command) {
                self.report(report);
            }
        }
        Some(out)
    }

    fn report(&self, report: Report) {
        let Ok(mut c) = self.coordinator.try_borrow_mut() else { return };
        let env = self.host.env();
        match report {
            Report::RespondFailed { stream } => c.on_respond_failed(stream),
            Report::WakeFailed => c.on_wake_failed(env),
            Report::Dispatched { job, token } => c.on_dispatched(job, token, env),
            Report::StreamOpened { token } => c.on_stream_opened(token, env),
            Report::StreamSendFailed { token } => c.on_stream_send_failed(token, env),
        }
    }

    /// The wasm filter's local answer passes its own response-headers callback too: gives it
    /// back the content type Envoy changed (see `Coordinator::take_restore`). The native host
    /// sends its answers as they are, so has nothing to give back.
    #[cfg_attr(all(feature = "native", not(test)), allow(dead_code))]
    pub fn restore_content_type(&self, stream: u32) {
        let restore = self.coordinator.try_borrow_mut().ok().and_then(|mut c| c.take_restore(stream));
        if let Some(content_type) = restore {
            if let Err(s) =
                self.host.set_header(Map::ResponseHeaders, "content-type", content_type.as_deref())
            {
                self.log(Level::Debug, format_args!("cannot set the content type of a local answer: {s:?}"));
            }
        }
    }

    /// The host calls `command` needs, and what they tell the coordinator back.
    pub fn carry_out(&self, command: Command) -> Option<Report> {
        match command {
            Command::Respond { stream, response } => return self.respond(stream, &response),
            Command::Resume { stream } => self.resume(stream),
            Command::Hop { stream, record, body_len, fallback, instance, refusal } => {
                self.hop(stream, &record, body_len, &fallback, &instance, &refusal);
            }
            Command::SetResponseHeader { name, value, .. } => {
                self.set_header(Map::ResponseHeaders, &name, Some(&value), Level::Warn);
            }
            Command::RemoveResponseHeader { name, .. } => {
                self.set_header(Map::ResponseHeaders, &name, None, Level::Debug);
            }
            Command::SetRequestHeader { name, value, .. } => {
                self.set_header(Map::RequestHeaders, &name, Some(&value), Level::Warn);
            }
            Command::RemoveRequestHeader { name, .. } => {
                self.set_header(Map::RequestHeaders, &name, None, Level::Warn);
            }
            Command::AddResponseTrailers { trailers, .. } => self.add_trailers(&trailers),
            Command::Instance { stream, instance } => self.instance(stream, &instance),
            Command::Outcome { stream, outcome } => self.outcome(stream, outcome),
            Command::Count(metric) => self.count(metric, 1),
            Command::Add { metric, n } => self.count(metric, n),
            Command::LocalRecords(n) => self.local_records(n),
            Command::StreamCalls(delta) => self.stream_calls(delta),
            Command::Tick { period_ms } => self.tick(period_ms),
            Command::Latency { kind, micros } => self.latency(kind, micros),
            Command::Wake => return self.wake(),
            Command::Dispatch(d) => return Some(self.dispatch(&d)),
            Command::OpenStream { service, metadata } => return Some(self.open_stream(&service, &metadata)),
            Command::StreamSend { token, message } => return self.stream_send(token, &message),
            Command::CancelStream { token } => self.cancel_stream(token),
        }
        None
    }

    fn log(&self, level: Level, message: fmt::Arguments<'_>) {
        self.host.log(level, message);
    }

    /// Also from a root callback (a store answer): the answer is for `stream`.
    fn respond(&self, stream: u32, r: &LocalResponse) -> Option<Report> {
        let _ = self.host.set_effective_context(stream);
        let trailers = self.coordinator.try_borrow().ok().and_then(|c| c.answer_trailers(stream));
        let reply = LocalReply {
            status: r.status,
            headers: &r.headers,
            body: Some(&r.body),
            trailers: trailers.as_deref(),
        };
        let Err(s) = self.host.send_local_response(reply) else { return None };
        self.log(Level::Warn, format_args!("cannot send local response {}: {s:?}", r.status));
        Some(Report::RespondFailed { stream })
    }

    fn resume(&self, stream: u32) {
        let _ = self.host.set_effective_context(stream);
        if let Err(s) = self.host.resume_request() {
            self.log(Level::Warn, format_args!("cannot resume request: {s:?}"));
        }
    }

    /// The second hop of a gRPC replay (see `request::machine::hop`), or `fallback` if a step
    /// fails: the request never goes on as it is.
    fn hop(
        &self,
        stream: u32,
        record: &[u8],
        body_len: usize,
        fallback: &LocalResponse,
        instance: &str,
        refusal: &str,
    ) {
        // Never another stream's body: a stream Envoy no longer knows needs nothing.
        if self.host.set_effective_context(stream).is_err() {
            return;
        }
        let Err(step) = self.hop_steps(record, body_len) else { return };
        self.log(Level::Warn, format_args!("cannot re-route a gRPC replay ({step}): {refusal}"));
        self.set_instance(instance);
        let reply =
            LocalReply { status: fallback.status, headers: &fallback.headers, body: None, trailers: None };
        if let Err(s) = self.host.send_local_response(reply) {
            self.log(Level::Warn, format_args!("cannot send local response: {s:?}"));
        }
    }

    /// The hop's calls on the current stream: the step that failed, if one did (then the
    /// request has not been resumed).
    fn hop_steps(&self, record: &[u8], body_len: usize) -> Result<(), &'static str> {
        let host = &self.host;
        let headers = Map::RequestHeaders;
        host.set_header(headers, HOP_HEADER, Some("1")).map_err(|_| "marking it")?;
        host.set_header(headers, ":path", Some(HOP_PATH)).map_err(|_| "its path")?;
        host.set_header(headers, "content-type", Some(RECORD_CONTENT_TYPE))
            .map_err(|_| "its content type")?;
        host.set_header(headers, "content-length", None).map_err(|_| "its length")?;
        host.set_request_body(0, body_len, record).map_err(|_| "its body")?;
        host.call_foreign_function("clear_route_cache").map_err(|_| "clearing the route")?;
        host.resume_request().map_err(|_| "resuming it")
    }

    /// Sets (or removes, `None`) a header of the current stream, in its own callback; a
    /// failure is logged at `level`.
    fn set_header(&self, map: Map, name: &str, value: Option<&str>, level: Level) {
        if let Err(s) = self.host.set_header(map, name, value) {
            let verb = if value.is_some() { "set" } else { "remove" };
            let which = if map == Map::RequestHeaders { "request" } else { "response" };
            self.log(level, format_args!("cannot {verb} {which} header {name}: {s:?}"));
        }
    }

    /// Each trailer, whether or not the ones before it could be added.
    fn add_trailers(&self, trailers: &[(String, String)]) {
        for (name, value) in trailers {
            if let Err(s) = self.host.add_header(Map::ResponseTrailers, name, value) {
                self.log(Level::Warn, format_args!("cannot add trailer {name}: {s:?}"));
            }
        }
    }

    fn instance(&self, stream: u32, instance: &str) {
        let _ = self.host.set_effective_context(stream);
        self.set_instance(instance);
    }

    /// On the current stream.
    fn set_instance(&self, instance: &str) {
        if let Err(s) = self.host.set_property(&[INSTANCE_PROPERTY], instance.as_bytes()) {
            self.log(Level::Debug, format_args!("cannot set {INSTANCE_PROPERTY}: {s:?}"));
        }
    }

    fn outcome(&self, stream: u32, outcome: &str) {
        let _ = self.host.set_effective_context(stream);
        if let Err(s) = self.host.set_property(&[OUTCOME_PROPERTY], outcome.as_bytes()) {
            self.log(Level::Debug, format_args!("cannot set {OUTCOME_PROPERTY}: {s:?}"));
        }
    }

    /// Metrics are best effort: a failed update is dropped silently.
    fn count(&self, metric: Metric, n: u64) {
        if let Some(&id) = self.metrics.get(metric.index()) {
            let _ = self.host.increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    fn local_records(&self, n: u64) {
        let _ = self.host.record_metric(self.local_records, n);
    }

    fn stream_calls(&self, delta: i64) {
        let _ = self.host.increment_metric(self.stream_calls, delta);
    }

    fn latency(&self, kind: CallKind, micros: u64) {
        let id = STORE_LATENCY.iter().position(|(k, _)| *k == kind).and_then(|i| self.latency.get(i));
        if let Some(&id) = id {
            let _ = self.host.record_metric(id, micros);
        }
    }

    fn tick(&self, period_ms: u64) {
        let _ = self.host.set_tick_period(Duration::from_millis(period_ms));
    }

    fn wake(&self) -> Option<Report> {
        let Err(s) = self.host.enqueue_shared_queue(self.queue, b"1") else { return None };
        self.log(Level::Error, format_args!("cannot wake the root context: {s:?}"));
        Some(Report::WakeFailed)
    }

    fn dispatch(&self, d: &Dispatch) -> Report {
        // Envoy registers a callout with the effective context: make sure it is the root.
        let _ = self.host.set_effective_context(self.root_id);
        let headers = d.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        let timeout = Duration::from_millis(d.timeout_ms);
        let call = HttpCall { cluster: &d.cluster, headers, body: d.body.as_deref(), timeout };
        let token = match self.host.dispatch_http_call(call) {
            Ok(token) => Some(token),
            Err(s) => {
                self.log(Level::Warn, format_args!("dispatch to {} failed: {s:?}", d.cluster));
                None
            }
        };
        Report::Dispatched { job: d.job, token }
    }

    fn open_stream(&self, service: &str, metadata: &[(String, String)]) -> Report {
        // Envoy registers the stream with the effective context, and delivers its messages
        // there: the root.
        let _ = self.host.set_effective_context(self.root_id);
        let metadata = metadata.iter().map(|(n, v)| (n.as_str(), v.as_bytes())).collect();
        let stream = GrpcStream { service, grpc_service: SERVICE, method: METHOD, metadata };
        let token = match self.host.open_grpc_stream(stream) {
            Ok(token) => Some(token),
            Err(s) => {
                self.log(Level::Warn, format_args!("cannot open the store stream: {s:?}"));
                None
            }
        };
        Report::StreamOpened { token }
    }

    /// As the root, also from a stream callback: the current context is effective again after.
    fn stream_send(&self, token: u32, message: &[u8]) -> Option<Report> {
        let _ = self.host.set_effective_context(self.root_id);
        let sent = self.host.grpc_send(token, message);
        let _ = self.host.set_effective_context(self.current.get());
        let Err(s) = sent else { return None };
        self.log(Level::Warn, format_args!("cannot send on the store stream: {s:?}"));
        Some(Report::StreamSendFailed { token })
    }

    fn cancel_stream(&self, token: u32) {
        let _ = self.host.set_effective_context(self.root_id);
        let cancelled = self.host.grpc_cancel(token);
        let _ = self.host.set_effective_context(self.current.get());
        if let Err(s) = cancelled {
            self.log(Level::Debug, format_args!("cannot cancel the store stream: {s:?}"));
        }
    }
}
