//! The proxy-wasm glue: the only module that talks to Envoy. It feeds host events into the
//! per-request [`Stream`] machines and carries out their effects.
//!
//! Store calls are owned by the root context, not by the stream: Envoy cancels a stream's pending
//! callouts when the stream ends, and a `begin` that took the lock, or a `commit` sent after the
//! response went out, must not be lost with it. A stream therefore puts its call in the root's
//! outbox and wakes the root through a per-worker shared queue; the root dispatches it (so the
//! SDK and Envoy both register the callout under the root), receives the answer, and, if the
//! stream is still there, acts on it with `set_effective_context`.
//!
//! Only `hostcalls::` functions that return `Result` are used: the SDK's trait helpers panic on
//! an unexpected host status, and a panic traps the VM.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action as HostAction, BufferType, ContextType, LogLevel, MapType, MetricType};
use std::cell::{OnceCell, RefCell};
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::rc::Rc;
use std::time::Duration;

use crate::config::Config;
use crate::detached::{UpstreamAnswer, UpstreamCall};
use crate::machine::{Action, Effect, Step, Stream, StreamView};
use crate::metrics::{Metric, OUTCOME_PROPERTY, STORE_LATENCY};
use crate::recent::{Cached, Recent};
use crate::store::{Answer, BeginAnswer, CallKind, CalloutFault, StoreCall};
use idem_protocol::CommitOutcome;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|id| -> Box<dyn RootContext> { Box::new(Root { id, shared: None }) });
}}

/// State one root context shares with the streams it creates (same VM, same thread).
struct Shared {
    root_id: u32,
    cfg: Rc<Config>,
    queue: u32,
    wake_pending: bool,
    metrics: Vec<u32>,
    /// Histogram ids, in the order of [`STORE_LATENCY`].
    latency: Vec<u32>,
    streams: HashMap<u32, StreamEntry>,
    outbox: Vec<Job>,
    callouts: HashMap<u32, Job>,
    /// Records recently replayed by this VM, to answer their retries without a store call.
    recent: Recent,
    /// The content type a local answer must have where Envoy changes it (it drops one from an
    /// answer without a body, and labels a body without one `text/plain`), by stream: set (or
    /// removed, `None`) when the answer passes this filter's response callback.
    restore: HashMap<u32, Option<String>>,
}

struct StreamEntry {
    stream: Stream,
    /// For log lines: Envoy's `x-request-id`, cleaned (see [`request_id`]); read only for
    /// guarded requests (or at debug level), not on the pass-through path.
    request_id: Option<Rc<str>>,
    /// For log lines: the store key's prefix, kept once derived (the machine drops its key when
    /// it is done, before the effects that follow are logged).
    key_prefix: Option<String>,
    /// Envoy has destroyed the stream; the entry lives on only until its pending call (a
    /// `begin`, or a detached execution) answers.
    gone: bool,
}

/// A callout on behalf of a stream (which may be gone by the time it answers).
struct Job {
    stream: u32,
    request_id: Rc<str>,
    call: Call,
    /// 0 for the first try; see [`StoreCall::after_fault`].
    attempt: u32,
    /// When the callout was dispatched, for the latency histograms.
    sent: Option<std::time::SystemTime>,
}

enum Call {
    Store(StoreCall),
    /// Detached execution: the request itself, to the route's cluster.
    Upstream(UpstreamCall),
}

impl Job {
    /// For log lines: the request id, and the store key's prefix or the cluster of a detached
    /// call. Never the client's key: only its derived store key is known past the headers.
    fn label(&self) -> String {
        match &self.call {
            Call::Store(c) => {
                format!("request {} key {}: store {:?}", self.request_id, prefix(c.key()), c.kind())
            }
            Call::Upstream(c) => format!("request {}: detached call to {}", self.request_id, c.cluster),
        }
    }
}

type SharedRef = Rc<RefCell<Shared>>;

struct Root {
    id: u32,
    shared: Option<SharedRef>,
}

impl Root {
    fn configure(&self) -> Result<SharedRef, String> {
        let bytes = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .map_err(|s| format!("cannot read the plugin configuration: {s:?}"))?
            .unwrap_or_default();
        let cfg = Config::from_json(&bytes).map_err(|e| e.to_string())?;
        let mut metrics = Vec::with_capacity(Metric::ALL.len());
        for m in Metric::ALL {
            let id = hostcalls::define_metric(MetricType::Counter, m.name())
                .map_err(|s| format!("cannot define metric {}: {s:?}", m.name()))?;
            metrics.push(id);
        }
        let mut latency = Vec::with_capacity(STORE_LATENCY.len());
        for (_, name) in STORE_LATENCY {
            let id = hostcalls::define_metric(MetricType::Histogram, name)
                .map_err(|s| format!("cannot define metric {name}: {s:?}"))?;
            latency.push(id);
        }
        // Queue names are per VM id, and every worker runs this root: a random name keeps each
        // worker's wake-ups on its own thread, where its streams live.
        let name = format!("idempotency-outbox-{:016x}", random_u64(self.id));
        let queue = hostcalls::register_shared_queue(&name)
            .map_err(|s| format!("cannot register shared queue: {s:?}"))?;
        let recent = Recent::new(cfg.record_cache_entries, cfg.record_cache_bytes);
        Ok(Rc::new(RefCell::new(Shared {
            root_id: self.id,
            cfg: Rc::new(cfg),
            queue,
            wake_pending: false,
            metrics,
            latency,
            streams: HashMap::new(),
            outbox: Vec::new(),
            callouts: HashMap::new(),
            recent,
            restore: HashMap::new(),
        })))
    }
}

fn random_u64(seed: u32) -> u64 {
    // std's RandomState draws its keys from WASI `random_get`, which Envoy implements.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(seed);
    if let Ok(t) = hostcalls::get_current_time() {
        h.write_u128(t.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    }
    h.finish()
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        let Some(shared) = &self.shared else { return };
        let headers = hostcalls::get_map_bytes(MapType::HttpCallResponseHeaders).unwrap_or_default();
        let body = if body_size > 0 {
            hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
                .ok()
                .flatten()
                .unwrap_or_default()
        } else {
            Vec::new()
        };
        on_callout_answer(shared, token, headers, body);
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
            Ok(shared) => {
                self.shared = Some(shared);
                true
            }
            Err(e) => {
                log::error!("idempotency filter refused its configuration: {e}");
                false
            }
        }
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        while let Ok(Some(_)) = hostcalls::dequeue_shared_queue(queue_id) {}
        if let Some(shared) = &self.shared {
            flush_outbox(shared);
        }
    }

    fn create_http_context(&self, id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(HttpStream { id, shared: self.shared.clone(), passive: false }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// Dispatches every queued callout. Runs in a root callback, so the callouts belong to the root.
fn flush_outbox(shared: &SharedRef) {
    let (jobs, cfg, root_id) = match shared.try_borrow_mut() {
        Ok(mut s) => {
            s.wake_pending = false;
            (std::mem::take(&mut s.outbox), s.cfg.clone(), s.root_id)
        }
        Err(_) => return,
    };
    for mut job in jobs {
        job.sent = hostcalls::get_current_time().ok();
        // The host registers a callout with the effective context: make sure it is the root.
        let _ = hostcalls::set_effective_context(root_id);
        let result = match &job.call {
            Call::Store(call) => {
                let c = call.callout(&cfg);
                let headers = c.headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
                let timeout = Duration::from_millis(c.timeout_ms);
                hostcalls::dispatch_http_call(&cfg.store_cluster, headers, c.body.as_deref(), vec![], timeout)
            }
            Call::Upstream(c) => {
                let headers = c.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
                let timeout = Duration::from_millis(c.timeout_ms);
                hostcalls::dispatch_http_call(&c.cluster, headers, Some(&c.body), vec![], timeout)
            }
        };
        match result {
            Ok(token) => {
                if let Ok(mut s) = shared.try_borrow_mut() {
                    s.callouts.insert(token, job);
                }
            }
            Err(status) => {
                log::warn!("{}: dispatch failed: {status:?}", job.label());
                let outcome = Answered::fault(&job.call, CalloutFault::Dispatch);
                finish_callout(shared, job, outcome, Caller::Root);
            }
        }
    }
}

/// Queues a callout and gets it dispatched from the root context.
fn submit(shared: &SharedRef, job: Job, caller: Caller) {
    let wake = match shared.try_borrow_mut() {
        Ok(mut s) => {
            s.outbox.push(job);
            let wake = !s.wake_pending;
            s.wake_pending = true;
            wake.then_some(s.queue)
        }
        Err(_) => {
            // Unreachable by construction (no borrow is held while effects apply); logged,
            // because the request this belongs to would otherwise hang.
            log::error!("{} dropped: state busy", job.label());
            return;
        }
    };
    match (caller, wake) {
        // Already in a root callback: dispatch now, no wake-up needed.
        (Caller::Root, _) => flush_outbox(shared),
        (Caller::Stream, Some(queue)) => {
            if let Err(s) = hostcalls::enqueue_shared_queue(queue, Some(b"1")) {
                // Without a wake-up the calls would never leave: fail them now, so no request
                // stays paused (each one fails open or closed as configured).
                log::error!("cannot wake the root context: {s:?}");
                fail_outbox(shared);
            }
        }
        (Caller::Stream, None) => {}
    }
}

fn fail_outbox(shared: &SharedRef) {
    let jobs = match shared.try_borrow_mut() {
        Ok(mut s) => {
            s.wake_pending = false;
            std::mem::take(&mut s.outbox)
        }
        Err(_) => return,
    };
    for job in jobs {
        let outcome = Answered::fault(&job.call, CalloutFault::Dispatch);
        finish_callout(shared, job, outcome, Caller::Stream);
    }
}

fn on_callout_answer(shared: &SharedRef, token: u32, headers: Vec<(String, Vec<u8>)>, body: Vec<u8>) {
    let Some(job) = shared.try_borrow_mut().ok().and_then(|mut s| s.callouts.remove(&token)) else {
        return;
    };
    let outcome = match &job.call {
        Call::Store(c) => {
            let now = hostcalls::get_current_time().ok();
            record_latency(shared, c.kind(), job.sent, now);
            let answer = Answer { headers: &headers, body: &body };
            match c.kind() {
                CallKind::Begin => {
                    let begun = answer.begin();
                    if let (StoreCall::Begin { key, body_hash }, Ok(BeginAnswer::Replay(record))) =
                        (c, &begun)
                    {
                        remember(shared, key, body_hash, record, answer.record_ttl_ms(), job.sent, now);
                    }
                    Answered::Begin(begun)
                }
                CallKind::Commit => Answered::Commit(answer.commit()),
                CallKind::Release => Answered::Release(answer.release().map(|_| ())),
            }
        }
        Call::Upstream(_) => Answered::Upstream(UpstreamAnswer::decode(headers, body)),
    };
    finish_callout(shared, job, outcome, Caller::Root);
}

fn epoch_ms(t: std::time::SystemTime) -> u64 {
    let ms = t.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0);
    u64::try_from(ms).unwrap_or(u64::MAX)
}

/// Caches a record the store replayed, until the end of the lifetime the store gave it, counted
/// from before the `begin` was sent (so never past the record's expiry in the store).
fn remember(
    shared: &SharedRef,
    key: &str,
    body_hash: &str,
    record: &crate::record::Record,
    ttl_ms: Option<u64>,
    sent: Option<std::time::SystemTime>,
    now: Option<std::time::SystemTime>,
) {
    let (Some(ttl_ms), Some(sent), Some(now)) = (ttl_ms, sent, now) else { return };
    if let Ok(mut s) = shared.try_borrow_mut() {
        s.recent.remember(key, body_hash, record, epoch_ms(sent).saturating_add(ttl_ms), epoch_ms(now));
    }
}

/// The cache's answer to a `begin`, if it has one.
fn cached_begin(shared: &SharedRef, key: &str, body_hash: &str) -> Option<BeginAnswer> {
    let mut s = shared.try_borrow_mut().ok()?;
    if !s.recent.is_enabled() || s.recent.is_empty() {
        return None;
    }
    let now = epoch_ms(hostcalls::get_current_time().ok()?);
    match s.recent.lookup(key, body_hash, now) {
        Cached::Replay(record) => Some(BeginAnswer::Replay(record)),
        Cached::Mismatch => Some(BeginAnswer::Mismatch),
        Cached::Miss => None,
    }
}

fn record_latency(
    shared: &SharedRef,
    kind: CallKind,
    sent: Option<std::time::SystemTime>,
    now: Option<std::time::SystemTime>,
) {
    let (Some(sent), Some(now)) = (sent, now) else { return };
    let micros = now.duration_since(sent).map(|d| d.as_micros()).unwrap_or(0);
    let id = shared.try_borrow().ok().and_then(|s| {
        STORE_LATENCY.iter().position(|(k, _)| *k == kind).and_then(|i| s.latency.get(i).copied())
    });
    if let Some(id) = id {
        let _ = hostcalls::record_metric(id, u64::try_from(micros).unwrap_or(u64::MAX));
    }
}

enum Answered {
    Begin(Result<BeginAnswer, CalloutFault>),
    Commit(Result<CommitOutcome, CalloutFault>),
    Release(Result<(), CalloutFault>),
    Upstream(Result<UpstreamAnswer, CalloutFault>),
}

impl Answered {
    fn fault(call: &Call, f: CalloutFault) -> Answered {
        match call {
            Call::Store(c) => match c.kind() {
                CallKind::Begin => Answered::Begin(Err(f)),
                CallKind::Commit => Answered::Commit(Err(f)),
                CallKind::Release => Answered::Release(Err(f)),
            },
            Call::Upstream(_) => Answered::Upstream(Err(f)),
        }
    }
}

/// Acts on the end of a callout, whether it answered or could not be sent.
fn finish_callout(shared: &SharedRef, job: Job, outcome: Answered, caller: Caller) {
    let mut effects = Vec::new();
    if let Call::Store(call) = &job.call {
        let fault = match &outcome {
            Answered::Begin(Err(f)) | Answered::Commit(Err(f)) | Answered::Release(Err(f)) => Some(*f),
            _ => None,
        };
        if let Some(f) = fault {
            log::warn!("{} (try {}): {f}", job.label(), job.attempt + 1);
            effects.push(Effect::Count(Metric::StoreErrors));
            if let Some(next) = call.after_fault(job.attempt) {
                let attempt = if next.kind() == call.kind() { job.attempt + 1 } else { 0 };
                let retry = Job {
                    stream: job.stream,
                    request_id: job.request_id.clone(),
                    call: Call::Store(next),
                    attempt,
                    sent: None,
                };
                submit(shared, retry, caller);
            }
        }
    }
    let stream_alive = match outcome {
        Answered::Begin(answer) => {
            let known = shared.try_borrow().is_ok_and(|s| s.streams.contains_key(&job.stream));
            match (&job.call, answer) {
                (_, answer) if known => {
                    on_stream_answer(shared, &job, &mut effects, |s| s.on_begin_answer(answer))
                }
                // Entries outlive their pending begin, so this is not expected; never leak a lock.
                (Call::Store(call), Ok(BeginAnswer::Locked { token })) => {
                    let key = call.key().to_string();
                    effects.push(Effect::Store(StoreCall::Release { key, token }));
                    false
                }
                _ => false,
            }
        }
        Answered::Upstream(answer) => {
            if let Err(f) = &answer {
                log::warn!("{}: {f}", job.label());
            }
            on_stream_answer(shared, &job, &mut effects, |s| s.on_upstream_answer(answer))
        }
        Answered::Commit(result) => {
            match result {
                Ok(CommitOutcome::Stored | CommitOutcome::Late) => {
                    effects.push(Effect::Count(Metric::Stored))
                }
                Ok(CommitOutcome::Exists) => {
                    log::info!("{}: an earlier record was kept", job.label());
                    effects.push(Effect::Count(Metric::CommitFailed));
                }
                // Counted once, when the retry is exhausted and the lock is given back.
                Err(_) if job.attempt == 0 => {}
                Err(_) => effects.push(Effect::Count(Metric::CommitFailed)),
            }
            false
        }
        Answered::Release(_) => false,
    };
    apply(shared, job.stream, effects, caller, stream_alive);
}

/// Feeds an answer to the stream's machine (if Envoy has not destroyed it yet, the answer is
/// for the client too) and forgets a destroyed stream once nothing of it is pending.
fn on_stream_answer(
    shared: &SharedRef,
    job: &Job,
    effects: &mut Vec<Effect>,
    feed: impl FnOnce(&mut Stream) -> Vec<Effect>,
) -> bool {
    let Ok(mut s) = shared.try_borrow_mut() else { return false };
    let Some(entry) = s.streams.get_mut(&job.stream) else {
        // Entries outlive their pending calls: not expected.
        log::error!("{}: answer for an unknown stream", job.label());
        return false;
    };
    effects.extend(feed(&mut entry.stream));
    let gone = entry.gone;
    if gone && entry.stream.is_settled() {
        s.streams.remove(&job.stream);
    }
    !gone
}

fn prefix(key: &str) -> &str {
    key.get(..12).unwrap_or(key)
}

fn request_id_of(shared: &SharedRef, stream_id: u32) -> Rc<str> {
    shared
        .try_borrow()
        .ok()
        .and_then(|s| s.streams.get(&stream_id).and_then(|e| e.request_id.clone()))
        .unwrap_or_else(|| Rc::from("-"))
}

/// One debug line per counted outcome (guarded, replayed, executed, ...), to follow a request.
fn log_decision(shared: &SharedRef, stream_id: u32, m: Metric) {
    let Ok(s) = shared.try_borrow() else { return };
    let Some(entry) = s.streams.get(&stream_id) else { return };
    let key = entry.key_prefix.as_deref().unwrap_or("-");
    let request = entry.request_id.as_deref().unwrap_or("-");
    log::debug!("request {request} key {key}: {}", m.name());
}

/// `x-request-id` as a log field: a client may send its own, so anything but a short run of
/// visible ASCII is cut, and a line can never be split or forged through it.
fn request_id(raw: Option<&[u8]>) -> Rc<str> {
    let clean: String = raw
        .unwrap_or_default()
        .iter()
        .take(64)
        .map(|&b| if b.is_ascii_graphic() { b as char } else { '?' })
        .collect();
    if clean.is_empty() {
        Rc::from("-")
    } else {
        Rc::from(clean)
    }
}

/// Which kind of callback effects are applied in: the host call rules differ.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Caller {
    /// The stream's own callback.
    Stream,
    /// A root callback (a store answer, a queue wake-up).
    Root,
}

fn apply(shared: &SharedRef, stream_id: u32, effects: Vec<Effect>, caller: Caller, stream_alive: bool) {
    for effect in effects {
        match effect {
            Effect::Respond(r) => {
                if !stream_alive {
                    continue;
                }
                // Also in a stream callback: a failed wake-up finishes other streams' calls too.
                let _ = hostcalls::set_effective_context(stream_id);
                let headers: Vec<(&str, &str)> =
                    r.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
                if let Err(s) = hostcalls::send_http_response(r.status, headers, Some(&r.body)) {
                    log::warn!("cannot send local response {}: {s:?}", r.status);
                } else {
                    // A replay says what the upstream said: a 204 with a content type, or a body
                    // left out, keeps it; bytes the upstream did not label stay unlabelled.
                    let content_type = r.headers.iter().find(|(n, _)| n == "content-type").map(|(_, v)| v);
                    if r.body.is_empty() == content_type.is_some() {
                        if let Ok(mut s) = shared.try_borrow_mut() {
                            s.restore.insert(stream_id, content_type.cloned());
                        }
                    }
                }
            }
            Effect::Resume => {
                if !stream_alive {
                    continue;
                }
                let _ = hostcalls::set_effective_context(stream_id);
                if let Err(s) = hostcalls::resume_http_request() {
                    log::warn!("cannot resume request: {s:?}");
                }
            }
            // Only emitted on request headers, in the stream's own callback.
            Effect::SetRequestHeader(name, value) => {
                if let Err(s) = hostcalls::set_map_value(MapType::HttpRequestHeaders, &name, Some(&value)) {
                    log::warn!("cannot set request header {name}: {s:?}");
                }
            }
            Effect::RemoveRequestHeader(name) => {
                if let Err(s) = hostcalls::set_map_value(MapType::HttpRequestHeaders, &name, None) {
                    log::warn!("cannot remove request header {name}: {s:?}");
                }
            }
            Effect::Store(call) => {
                if let StoreCall::Begin { key, body_hash } = &call {
                    if let Some(answer) = cached_begin(shared, key, body_hash) {
                        let effects = shared.try_borrow_mut().ok().and_then(|mut s| {
                            let entry = s.streams.get_mut(&stream_id)?;
                            let mut effects = entry.stream.on_begin_answer(Ok(answer));
                            effects.push(Effect::Count(Metric::CacheHits));
                            Some(effects)
                        });
                        if let Some(effects) = effects {
                            apply(shared, stream_id, effects, caller, stream_alive);
                            continue;
                        }
                    }
                }
                let request_id = request_id_of(shared, stream_id);
                submit(
                    shared,
                    Job { stream: stream_id, request_id, call: Call::Store(call), attempt: 0, sent: None },
                    caller,
                )
            }
            Effect::Upstream(call) => {
                let request_id = request_id_of(shared, stream_id);
                let job =
                    Job { stream: stream_id, request_id, call: Call::Upstream(call), attempt: 0, sent: None };
                submit(shared, job, caller)
            }
            Effect::Count(m) => {
                if log::log_enabled!(log::Level::Debug) {
                    log_decision(shared, stream_id, m);
                }
                if let (Some(outcome), true) = (m.outcome(), stream_alive) {
                    // Filter state `wasm.idempotency_outcome`, for the access log.
                    let _ = hostcalls::set_effective_context(stream_id);
                    if let Err(s) = hostcalls::set_property(vec![OUTCOME_PROPERTY], Some(outcome.as_bytes()))
                    {
                        log::debug!("cannot set {OUTCOME_PROPERTY}: {s:?}");
                    }
                }
                if let Some(id) = shared.try_borrow().ok().and_then(|s| s.metrics.get(m.index()).copied()) {
                    let _ = hostcalls::increment_metric(id, 1);
                }
            }
        }
    }
}

struct HttpStream {
    id: u32,
    shared: Option<SharedRef>,
    /// The machine is done with this stream (e.g. not guarded): later callbacks return at once,
    /// without touching the shared state.
    passive: bool,
}

impl HttpStream {
    fn run(&mut self, f: impl FnOnce(&mut Stream, &dyn StreamView) -> Step) -> HostAction {
        if self.passive {
            return HostAction::Continue;
        }
        let Some(shared) = &self.shared else { return HostAction::Continue };
        let step = {
            let Ok(mut s) = shared.try_borrow_mut() else { return HostAction::Continue };
            let cfg = s.cfg.clone();
            let view = HostView::default();
            let entry = s.streams.entry(self.id).or_insert_with(|| StreamEntry {
                stream: Stream::new(cfg),
                request_id: None,
                key_prefix: None,
                gone: false,
            });
            let step = f(&mut entry.stream, &view);
            if entry.key_prefix.is_none() {
                entry.key_prefix = entry.stream.store_key().map(|k| prefix(k).to_string());
            }
            // Store calls (and so log lines) follow only once a store key exists, or will once
            // the body has been read (inbox mode; the headers may be gone by then).
            if entry.request_id.is_none()
                && (entry.key_prefix.is_some()
                    || entry.stream.awaits_key()
                    || log::log_enabled!(log::Level::Debug))
            {
                entry.request_id =
                    Some(request_id(view.request_header("x-request-id").first().map(Vec::as_slice)));
            }
            step
        };
        apply(shared, self.id, step.effects, Caller::Stream, true);
        // A stream the machine is done with (most of them: not guarded) is forgotten now, not at
        // its end, and its remaining callbacks cost nothing but the call into the VM.
        if let Ok(mut s) = shared.try_borrow_mut() {
            if s.streams.get(&self.id).is_some_and(|e| e.stream.is_done()) {
                s.streams.remove(&self.id);
                self.passive = true;
            }
        }
        match step.action {
            Action::Continue => HostAction::Continue,
            Action::Pause => HostAction::Pause,
        }
    }
}

impl HttpStream {
    /// Gives this stream's local answer the content type it was sent with (see
    /// `Shared::restore`).
    fn restore_local_headers(&self) {
        let Some(shared) = &self.shared else { return };
        let Some(content_type) = (match shared.try_borrow_mut() {
            Ok(mut s) if !s.restore.is_empty() => s.restore.remove(&self.id),
            _ => None,
        }) else {
            return;
        };
        let value = content_type.as_deref();
        if let Err(s) = hostcalls::set_map_value(MapType::HttpResponseHeaders, "content-type", value) {
            log::debug!("cannot set the content type of a local answer: {s:?}");
        }
    }
}

impl Context for HttpStream {
    fn on_done(&mut self) -> bool {
        if let Some(shared) = &self.shared {
            if let Ok(mut s) = shared.try_borrow_mut() {
                if !s.restore.is_empty() {
                    s.restore.remove(&self.id);
                }
            }
        }
        if self.passive {
            return true;
        }
        let Some(shared) = &self.shared else { return true };
        let effects = match shared.try_borrow_mut() {
            Ok(mut s) => match s.streams.get_mut(&self.id) {
                Some(entry) => {
                    let effects = entry.stream.on_stream_end();
                    if entry.stream.is_settled() {
                        s.streams.remove(&self.id);
                    } else {
                        entry.gone = true;
                    }
                    effects
                }
                None => Vec::new(),
            },
            Err(_) => Vec::new(),
        };
        apply(shared, self.id, effects, Caller::Stream, true);
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
        self.restore_local_headers();
        self.run(|s, v| s.on_response_headers(v, end_of_stream))
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> HostAction {
        self.run(|s, v| s.on_response_body(v, body_size, end_of_stream))
    }

    fn on_http_response_trailers(&mut self, _n: usize) -> HostAction {
        self.run(|s, _| s.on_response_trailers())
    }
}

/// Envoy's view of the current stream, read on demand; header maps are fetched once per callback.
#[derive(Default)]
struct HostView {
    request: OnceCell<Vec<(String, Vec<u8>)>>,
    response: OnceCell<Vec<(String, Vec<u8>)>>,
}

/// Headers Envoy holds one value of (pseudo-headers, and the request id it sets itself), or whose
/// first value is all the filter needs (`content-length`: Envoy refuses differing copies).
const SINGLE_VALUED: [&str; 4] = [":method", ":path", "content-length", "x-request-id"];

fn values(pairs: &[(String, Vec<u8>)], name: &str) -> Vec<Vec<u8>> {
    pairs.iter().filter(|(k, _)| k == name).map(|(_, v)| v.clone()).collect()
}

impl StreamView for HostView {
    fn request_headers(&self) -> Vec<(String, Vec<u8>)> {
        self.request
            .get_or_init(|| hostcalls::get_map_bytes(MapType::HttpRequestHeaders).unwrap_or_default())
            .clone()
    }

    fn request_header(&self, name: &str) -> Vec<Vec<u8>> {
        if let Some(pairs) = self.request.get() {
            return values(pairs, name);
        }
        // One value lookup instead of copying the whole header map into the VM: most requests
        // are decided (method not guarded, no key) with two of them. Envoy's lookup returns the
        // first value only, so a header that is present and may repeat (`idempotency-key`:
        // two of them are a 400) is read from the whole map.
        match hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name) {
            Ok(None) => Vec::new(),
            Ok(Some(v)) if SINGLE_VALUED.contains(&name) => vec![v],
            _ => values(
                self.request.get_or_init(|| {
                    hostcalls::get_map_bytes(MapType::HttpRequestHeaders).unwrap_or_default()
                }),
                name,
            ),
        }
    }

    fn response_header(&self, name: &str) -> Vec<Vec<u8>> {
        let pairs = self
            .response
            .get_or_init(|| hostcalls::get_map_bytes(MapType::HttpResponseHeaders).unwrap_or_default());
        values(pairs, name)
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        hostcalls::get_property(path.to_vec()).ok().flatten()
    }

    fn request_body(&self, start: usize, len: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::HttpRequestBody, start, len).ok().map(Option::unwrap_or_default)
    }

    fn response_body(&self, start: usize, len: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::HttpResponseBody, start, len).ok().map(Option::unwrap_or_default)
    }
}
