//! The hooks Envoy calls (`envoy_dynamic_module_on_*`), each turned into a coordinator event as
//! the proxy-wasm contexts do, every one inside `catch_unwind`: a panic that crossed into Envoy
//! would abort the process.
//!
//! State: a filter configuration ([`FilterConfig`], made on the main thread) owns what every
//! worker shares ([`Shared`]: the metric ids, the store and its threads); each worker builds its
//! own [`Worker`] (`worker.rs`: a coordinator and its [`Link`]) the first time one of its
//! streams uses that configuration; a stream is a [`Filter`].

use std::cell::Cell;
use std::ffi::{c_char, c_void, CStr};
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use super::abi::{self, EnvoyBuffer, LogLevel, ModuleBuffer};
use super::env::NativeEnv;
use super::link::Scheduler;
use super::metrics::Metrics;
use super::settings::StoreSettings;
use super::store::InProcess;
use super::view::{attribute, NativeView};
use super::worker::Worker;
use crate::config::values::Subject;
use crate::config::Config;
use crate::request::machine::{Action, Machine, Step};
use crate::worker::coordinator::Stepped;

/// The `filter_name` this module answers to.
pub const FILTER_NAME: &str = "idempotency";

/// The largest record a store call may carry: idemstore's default `--max-body-bytes`.
const MAX_RECORD_BYTES: usize = 8 * 1024 * 1024;

// ---------------------------------------------------------------------------------------------
// Logging

fn level(level: log::Level) -> LogLevel {
    match level {
        log::Level::Error => LogLevel::ERROR,
        log::Level::Warn => LogLevel::WARN,
        log::Level::Info => LogLevel::INFO,
        log::Level::Debug => LogLevel::DEBUG,
        log::Level::Trace => LogLevel::TRACE,
    }
}

/// A line in Envoy's log (component `dynamic_modules`), formatted only if Envoy would keep it.
pub fn log(at: log::Level, message: fmt::Arguments<'_>) {
    let at = level(at);
    // SAFETY: plain calls with a level; the message buffer outlives the call, which copies it.
    unsafe {
        if !abi::envoy_dynamic_module_callback_log_enabled(at) {
            return;
        }
        let text = format!("idempotency: {message}");
        abi::envoy_dynamic_module_callback_log(at, ModuleBuffer::from_str(&text));
    }
}

/// The core's `log::` lines, into Envoy's log.
struct EnvoyLogger;

impl log::Log for EnvoyLogger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        // SAFETY: a plain call with a level.
        unsafe { abi::envoy_dynamic_module_callback_log_enabled(level(metadata.level())) }
    }

    fn log(&self, record: &log::Record<'_>) {
        log(record.level(), *record.args());
    }

    fn flush(&self) {}
}

static LOGGER: EnvoyLogger = EnvoyLogger;

/// Runs a hook; a panic is logged (one line, no backtrace on Envoy's stderr) and `fallback`
/// returned.
fn guard<T>(hook: &str, fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        log(log::Level::Error, format_args!("a panic in {hook} was caught; the stream goes on unguarded"));
        fallback
    })
}

// ---------------------------------------------------------------------------------------------
// Loading

/// Every Envoy callback the module calls: an Envoy without one of them is not the 1.40 the
/// bindings were written for, and the module refuses to load rather than crash on first use.
const CALLBACKS: &[&CStr] = &[
    c"envoy_dynamic_module_callback_log",
    c"envoy_dynamic_module_callback_log_enabled",
    c"envoy_dynamic_module_callback_http_filter_config_define_counter",
    c"envoy_dynamic_module_callback_http_filter_config_define_gauge",
    c"envoy_dynamic_module_callback_http_filter_config_define_histogram",
    c"envoy_dynamic_module_callback_http_filter_config_increment_counter",
    c"envoy_dynamic_module_callback_http_filter_config_increment_gauge",
    c"envoy_dynamic_module_callback_http_filter_config_decrement_gauge",
    c"envoy_dynamic_module_callback_http_filter_config_set_gauge",
    c"envoy_dynamic_module_callback_http_filter_config_record_histogram_value",
    c"envoy_dynamic_module_callback_http_get_header",
    c"envoy_dynamic_module_callback_http_get_headers_size",
    c"envoy_dynamic_module_callback_http_get_headers",
    c"envoy_dynamic_module_callback_http_set_header",
    c"envoy_dynamic_module_callback_http_add_header",
    c"envoy_dynamic_module_callback_http_send_response_headers",
    c"envoy_dynamic_module_callback_http_send_response_data",
    c"envoy_dynamic_module_callback_http_send_response_trailers",
    c"envoy_dynamic_module_callback_http_get_body_size",
    c"envoy_dynamic_module_callback_http_get_body_chunks_size",
    c"envoy_dynamic_module_callback_http_get_body_chunks",
    c"envoy_dynamic_module_callback_http_append_body",
    c"envoy_dynamic_module_callback_http_drain_body",
    c"envoy_dynamic_module_callback_http_set_filter_state_bytes",
    c"envoy_dynamic_module_callback_http_filter_get_attribute_string",
    c"envoy_dynamic_module_callback_http_filter_get_attribute_int",
    c"envoy_dynamic_module_callback_http_filter_continue_decoding",
    c"envoy_dynamic_module_callback_http_clear_route_cache",
    c"envoy_dynamic_module_callback_http_filter_scheduler_new",
    c"envoy_dynamic_module_callback_http_filter_scheduler_commit",
    c"envoy_dynamic_module_callback_http_filter_scheduler_delete",
];

extern "C" {
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}

/// glibc's `RTLD_DEFAULT`: the process's global symbols, Envoy's included.
const RTLD_DEFAULT: *mut c_void = std::ptr::null_mut();

/// More callbacks to require, comma-separated: how a test meets "an Envoy that lacks one"
/// without another Envoy build (tests/native/test_module.py).
const REQUIRE_ENV: &str = "IDEMPOTENCY_MODULE_REQUIRE";

fn missing_callbacks() -> Vec<String> {
    let extra = std::env::var(REQUIRE_ENV).unwrap_or_default();
    let extra = extra.split(',').filter(|n| !n.is_empty()).filter_map(|n| std::ffi::CString::new(n).ok());
    let names: Vec<std::ffi::CString> = CALLBACKS.iter().map(|n| (*n).to_owned()).chain(extra).collect();
    names
        .into_iter()
        // SAFETY: a lookup of a NUL-terminated name; nothing is called.
        .filter(|name| unsafe { dlsym(RTLD_DEFAULT, name.as_ptr()) }.is_null())
        .map(|name| name.to_string_lossy().into_owned())
        .collect()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> abi::AbiVersionModulePtr {
    guard("program_init", std::ptr::null(), || {
        let missing = missing_callbacks();
        if !missing.is_empty() {
            // Logging needs a callback that may be missing too: stderr is what is left.
            eprintln!(
                "idempotency filter: this module is built for Envoy 1.40 (dynamic module ABI v0.2.0); \
                 this Envoy lacks {} of its callbacks ({}): not loading",
                missing.len(),
                missing.join(", ")
            );
            return std::ptr::null();
        }
        std::panic::set_hook(Box::new(|info| log(log::Level::Error, format_args!("panic: {info}"))));
        if log::set_logger(&LOGGER).is_ok() {
            log::set_max_level(log::LevelFilter::Trace);
        }
        let _ = tracing::subscriber::set_global_default(super::trace::EnvoyTracing);
        abi::ABI_VERSION.as_ptr().cast()
    })
}

// ---------------------------------------------------------------------------------------------
// Configurations

/// Envoy's side of a filter configuration: usable from any thread (its metrics are Envoy's
/// thread-safe stats), alive until the configuration is destroyed, after its last stream.
pub struct ConfigEnvoy(pub abi::HttpFilterConfigEnvoyPtr);

// SAFETY: only the metric callbacks are called with it, which Envoy makes safe from any thread.
unsafe impl Send for ConfigEnvoy {}
// SAFETY: as above.
unsafe impl Sync for ConfigEnvoy {}

/// What every worker of one configuration shares.
pub struct Shared {
    pub envoy: ConfigEnvoy,
    pub metrics: Metrics,
    pub store: InProcess,
    pub(super) closed: AtomicBool,
    /// Held (read) by a store thread while it runs a worker's coordinator, which calls Envoy
    /// through `envoy`; taken (write) when Envoy destroys the configuration.
    pub(super) open: RwLock<()>,
}

pub struct FilterConfig {
    pub(super) serial: u64,
    /// Parsed again by each worker: a `Config` is not `Send`.
    pub(super) json: Vec<u8>,
    pub(super) shared: Arc<Shared>,
}

fn configure(envoy: abi::HttpFilterConfigEnvoyPtr, name: &[u8], json: &[u8]) -> Result<FilterConfig, String> {
    if name != FILTER_NAME.as_bytes() {
        return Err(format!(
            "unknown filter_name {:?}: this module has one filter, {FILTER_NAME:?}",
            String::from_utf8_lossy(name)
        ));
    }
    let cfg = Config::from_json(json).map_err(|e| e.to_string())?;
    let settings = cfg.store.as_ref().map(StoreSettings::parse).transpose()?;
    if settings.is_none() && !cfg.store_cluster.is_empty() {
        return Err("the native host runs the store in Envoy: configure `store` (e.g. \
                    {\"redis\": \"redis://...\"}); `store_cluster` (idemstore) is the wasm filter's"
            .into());
    }
    unsupported(&cfg)?;
    let metrics = Metrics::define(envoy)?;
    let store = InProcess::start(settings.as_ref(), MAX_RECORD_BYTES)?;
    log(log::Level::Info, format_args!("configured; store: {}", store.describe));
    static SERIAL: AtomicU64 = AtomicU64::new(1);
    let shared = Shared {
        envoy: ConfigEnvoy(envoy),
        metrics,
        store,
        closed: AtomicBool::new(false),
        open: RwLock::new(()),
    };
    Ok(FilterConfig {
        serial: SERIAL.fetch_add(1, Ordering::Relaxed),
        json: json.to_vec(),
        shared: Arc::new(shared),
    })
}

/// What the native host cannot do yet is refused at load, never silently done otherwise (a
/// subject it cannot read would scope every client of an address together).
fn unsupported(cfg: &Config) -> Result<(), String> {
    let policies = std::iter::once(("", cfg)).chain(cfg.routes.iter());
    for (route, c) in policies {
        let at = if route.is_empty() { String::new() } else { format!(" (route {route:?})") };
        let refuse =
            |what: &str| Err(format!("{what}{at} is not supported by the native host yet (docs/native.md)"));
        match &c.subject {
            Subject::Metadata { .. } => return refuse("`subject.metadata`"),
            Subject::Property(path) => {
                let path: Vec<&str> = path.iter().map(String::as_str).collect();
                if attribute(&path).is_none() {
                    return refuse(&format!("`subject.property` {path:?}"));
                }
            }
            Subject::ClientIp | Subject::Header(_) => {}
        }
        if c.detached_execution {
            return refuse("`detached_execution`");
        }
        if c.outcome_lookup.is_some() {
            return refuse("`outcome_lookup`");
        }
    }
    Ok(())
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    envoy: abi::HttpFilterConfigEnvoyPtr,
    name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> abi::HttpFilterConfigModulePtr {
    guard("config_new", std::ptr::null(), || {
        // SAFETY: Envoy's buffers, valid during this call; copied by `configure`.
        let (name, json) = unsafe { (name.as_bytes(), config.as_bytes()) };
        match configure(envoy, name, json) {
            Ok(cfg) => Box::into_raw(Box::new(cfg)).cast_const().cast(),
            Err(e) => {
                log(log::Level::Error, format_args!("idempotency filter refused its configuration: {e}"));
                std::ptr::null()
            }
        }
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: abi::HttpFilterConfigModulePtr) {
    guard("config_destroy", (), || {
        if config.is_null() {
            return;
        }
        // SAFETY: made by `config_new` with `Box::into_raw`; Envoy destroys it once.
        let cfg = unsafe { Box::from_raw(config.cast_mut().cast::<FilterConfig>()) };
        {
            // No store thread calls Envoy through this configuration any more.
            let _closing = cfg.shared.open.write().unwrap_or_else(std::sync::PoisonError::into_inner);
            cfg.shared.closed.store(true, Ordering::Release);
        }
        cfg.shared.store.stop();
    });
}

/// Per-route configurations are not used yet (the `routes` key chooses a policy by route name):
/// a `DynamicModuleFilterPerRoute` naming this module is refused.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_new(
    _name: EnvoyBuffer,
    _config: EnvoyBuffer,
) -> abi::HttpFilterPerRouteConfigModulePtr {
    log(
        log::Level::Error,
        format_args!("per-route configurations are not supported: use the filter's `routes` key"),
    );
    std::ptr::null()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_destroy(
    _config: abi::HttpFilterPerRouteConfigModulePtr,
) {
}

// ---------------------------------------------------------------------------------------------
// Streams

/// One stream. Hooks take it by shared reference: a local answer sent from one hook can run
/// another of the same stream's hooks inside it.
pub struct Filter {
    id: u32,
    worker: Option<Arc<Worker>>,
    scheduler: Cell<Option<Scheduler>>,
    /// The machine is done with the stream: later hooks return at once.
    passive: Cell<bool>,
    /// `on_stream_done` was given.
    done: Cell<bool>,
}

impl Filter {
    fn new(cfg: &FilterConfig, envoy: abi::HttpFilterEnvoyPtr) -> Filter {
        let Some(worker) = Worker::of(cfg) else {
            return Filter {
                id: 0,
                worker: None,
                scheduler: Cell::new(None),
                passive: Cell::new(true),
                done: Cell::new(true),
            };
        };
        let id = {
            let _hook = worker.hook();
            let id = worker.new_stream();
            worker.vm.host().add_stream(id, envoy);
            id
        };
        Filter {
            id,
            worker: Some(worker),
            scheduler: Cell::new(None),
            passive: Cell::new(false),
            done: Cell::new(false),
        }
    }

    /// A paused stream waits for the store's threads: its scheduler is how they wake the worker.
    /// Made on the first pause only (most streams that are not guarded never pause).
    fn wake_through(&self, w: &Worker, envoy: abi::HttpFilterEnvoyPtr) {
        if self.scheduler.get().is_some() || envoy.is_null() {
            return;
        }
        // SAFETY: the stream is live; the scheduler is deleted in `destroy`, after the link
        // has let go of it.
        let scheduler = unsafe { abi::envoy_dynamic_module_callback_http_filter_scheduler_new(envoy) };
        if !scheduler.is_null() {
            self.scheduler.set(Some(Scheduler(scheduler)));
            w.link.add_scheduler(self.id, Scheduler(scheduler));
        }
    }

    fn event(
        &self,
        envoy: abi::HttpFilterEnvoyPtr,
        event: impl FnOnce(&mut Machine, &NativeView) -> Step,
    ) -> Action {
        let Some(w) = &self.worker else { return Action::Continue };
        let _hook = w.hook();
        w.drain(None);
        if self.passive.get() {
            return Action::Continue;
        }
        let view = NativeView::new(envoy);
        w.enter(self.id);
        let id = self.id;
        let stepped = w.vm.run(|c| c.on_stream_event(id, &view, &NativeEnv, |m, _| event(m, &view)));
        let Some(Stepped { action, done }) = stepped else { return Action::Continue };
        if done {
            self.passive.set(true);
        }
        if action == Action::Pause {
            self.wake_through(w, envoy);
        }
        action
    }

    fn stream_done(&self, envoy: abi::HttpFilterEnvoyPtr) {
        let Some(w) = &self.worker else { return };
        let _hook = w.hook();
        if self.done.replace(true) {
            return;
        }
        self.passive.set(true);
        w.drain(None);
        let view = NativeView::new(envoy);
        w.enter(self.id);
        let id = self.id;
        w.vm.run(|c| c.on_stream_done(id, &view, &NativeEnv));
    }

    fn destroy(self) {
        // A stream Envoy destroys without completing it still ends in the coordinator.
        self.stream_done(std::ptr::null_mut());
        let Some(w) = &self.worker else { return };
        let _hook = w.hook();
        w.vm.host().remove_stream(self.id);
        if let Some(Scheduler(ptr)) = self.scheduler.get() {
            w.link.remove_scheduler(self.id);
            // SAFETY: ours, out of the link (no other thread commits it any more), deleted once.
            unsafe { abi::envoy_dynamic_module_callback_http_filter_scheduler_delete(ptr) };
        }
    }
}

/// The stream behind a hook's module pointer.
///
/// # Safety
/// `module` must come from `http_filter_new` and not be destroyed yet.
unsafe fn filter<'a>(module: abi::HttpFilterModulePtr) -> Option<&'a Filter> {
    module.cast::<Filter>().as_ref()
}

fn headers_status(action: Action) -> abi::HeadersStatus {
    match action {
        Action::Continue => abi::HeadersStatus::CONTINUE,
        // Not StopAllIterationAndBuffer: that would keep the body from this filter's body hook.
        Action::Pause => abi::HeadersStatus::STOP_ITERATION,
    }
}

fn body_status(action: Action) -> abi::BodyStatus {
    match action {
        Action::Continue => abi::BodyStatus::CONTINUE,
        Action::Pause => abi::BodyStatus::STOP_ITERATION_AND_BUFFER,
    }
}

fn trailers_status(action: Action) -> abi::TrailersStatus {
    match action {
        Action::Continue => abi::TrailersStatus::CONTINUE,
        Action::Pause => abi::TrailersStatus::STOP_ITERATION,
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config: abi::HttpFilterConfigModulePtr,
    envoy: abi::HttpFilterEnvoyPtr,
) -> abi::HttpFilterModulePtr {
    guard("http_filter_new", std::ptr::null(), || {
        // SAFETY: made by `config_new`; Envoy destroys it only after its last stream.
        let Some(cfg) = (unsafe { config.cast::<FilterConfig>().as_ref() }) else { return std::ptr::null() };
        Box::into_raw(Box::new(Filter::new(cfg, envoy))).cast_const().cast()
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(module: abi::HttpFilterModulePtr) {
    guard("http_filter_destroy", (), || {
        if module.is_null() {
            return;
        }
        // SAFETY: made by `http_filter_new` with `Box::into_raw`; Envoy destroys it once.
        let f = unsafe { Box::from_raw(module.cast_mut().cast::<Filter>()) };
        f.destroy();
    });
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    envoy: abi::HttpFilterEnvoyPtr,
    module: abi::HttpFilterModulePtr,
    end_of_stream: bool,
) -> abi::HeadersStatus {
    guard("request_headers", abi::HeadersStatus::CONTINUE, || {
        // SAFETY: a live stream's module pointer.
        let Some(f) = (unsafe { filter(module) }) else { return abi::HeadersStatus::CONTINUE };
        headers_status(f.event(envoy, |m, v| m.on_request_headers(v, end_of_stream)))
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    envoy: abi::HttpFilterEnvoyPtr,
    module: abi::HttpFilterModulePtr,
    end_of_stream: bool,
) -> abi::BodyStatus {
    guard("request_body", abi::BodyStatus::CONTINUE, || {
        // SAFETY: a live stream's module pointer.
        let Some(f) = (unsafe { filter(module) }) else { return abi::BodyStatus::CONTINUE };
        body_status(f.event(envoy, |m, v| m.on_request_body(v, v.request_body_size(), end_of_stream)))
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    envoy: abi::HttpFilterEnvoyPtr,
    module: abi::HttpFilterModulePtr,
) -> abi::TrailersStatus {
    guard("request_trailers", abi::TrailersStatus::CONTINUE, || {
        // SAFETY: a live stream's module pointer.
        let Some(f) = (unsafe { filter(module) }) else { return abi::TrailersStatus::CONTINUE };
        trailers_status(f.event(envoy, |m, _| m.on_request_trailers()))
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    envoy: abi::HttpFilterEnvoyPtr,
    module: abi::HttpFilterModulePtr,
    end_of_stream: bool,
) -> abi::HeadersStatus {
    guard("response_headers", abi::HeadersStatus::CONTINUE, || {
        // SAFETY: a live stream's module pointer.
        let Some(f) = (unsafe { filter(module) }) else { return abi::HeadersStatus::CONTINUE };
        headers_status(f.event(envoy, |m, v| m.on_response_headers(v, end_of_stream)))
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    envoy: abi::HttpFilterEnvoyPtr,
    module: abi::HttpFilterModulePtr,
    end_of_stream: bool,
) -> abi::BodyStatus {
    guard("response_body", abi::BodyStatus::CONTINUE, || {
        // SAFETY: a live stream's module pointer.
        let Some(f) = (unsafe { filter(module) }) else { return abi::BodyStatus::CONTINUE };
        body_status(f.event(envoy, |m, v| m.on_response_body(v, v.response_body_size(), end_of_stream)))
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    envoy: abi::HttpFilterEnvoyPtr,
    module: abi::HttpFilterModulePtr,
) -> abi::TrailersStatus {
    guard("response_trailers", abi::TrailersStatus::CONTINUE, || {
        // SAFETY: a live stream's module pointer.
        let Some(f) = (unsafe { filter(module) }) else { return abi::TrailersStatus::CONTINUE };
        trailers_status(f.event(envoy, |m, v| m.on_response_trailers(v)))
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    envoy: abi::HttpFilterEnvoyPtr,
    module: abi::HttpFilterModulePtr,
) {
    guard("stream_complete", (), || {
        // SAFETY: a live stream's module pointer.
        if let Some(f) = unsafe { filter(module) } {
            f.stream_done(envoy);
        }
    });
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    _envoy: abi::HttpFilterEnvoyPtr,
    module: abi::HttpFilterModulePtr,
    _event: u64,
) {
    guard("scheduled", (), || {
        // SAFETY: a live stream's module pointer.
        let Some(f) = (unsafe { filter(module) }) else { return };
        if let Some(w) = &f.worker {
            let _hook = w.hook();
            w.drain(Some(f.id));
        }
    });
}

// Hooks Envoy 1.40 requires that this module has no use for.

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    _envoy: abi::HttpFilterEnvoyPtr,
    _module: abi::HttpFilterModulePtr,
    _callout_id: u64,
    _result: abi::HttpCalloutResult,
    _headers: *const abi::EnvoyHttpHeader,
    _headers_size: usize,
    _body_chunks: *const EnvoyBuffer,
    _body_chunks_size: usize,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _envoy: abi::HttpFilterEnvoyPtr,
    _module: abi::HttpFilterModulePtr,
    _stream_id: u64,
    _headers: *const abi::EnvoyHttpHeader,
    _headers_size: usize,
    _end_stream: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _envoy: abi::HttpFilterEnvoyPtr,
    _module: abi::HttpFilterModulePtr,
    _stream_id: u64,
    _data: *const EnvoyBuffer,
    _data_count: usize,
    _end_stream: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _envoy: abi::HttpFilterEnvoyPtr,
    _module: abi::HttpFilterModulePtr,
    _stream_id: u64,
    _trailers: *const abi::EnvoyHttpHeader,
    _trailers_size: usize,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(
    _envoy: abi::HttpFilterEnvoyPtr,
    _module: abi::HttpFilterModulePtr,
    _stream_id: u64,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _envoy: abi::HttpFilterEnvoyPtr,
    _module: abi::HttpFilterModulePtr,
    _stream_id: u64,
    _reason: abi::HttpStreamResetReason,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _envoy: abi::HttpFilterEnvoyPtr,
    _module: abi::HttpFilterModulePtr,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _envoy: abi::HttpFilterEnvoyPtr,
    _module: abi::HttpFilterModulePtr,
) {
}

// The exports have the ABI's types (a drift between the two fails to compile).
const _: abi::OnProgramInit = envoy_dynamic_module_on_program_init;
const _: abi::OnHttpFilterConfigNew = envoy_dynamic_module_on_http_filter_config_new;
const _: abi::OnHttpFilterConfigDestroy = envoy_dynamic_module_on_http_filter_config_destroy;
const _: abi::OnHttpFilterPerRouteConfigNew = envoy_dynamic_module_on_http_filter_per_route_config_new;
const _: abi::OnHttpFilterPerRouteConfigDestroy =
    envoy_dynamic_module_on_http_filter_per_route_config_destroy;
const _: abi::OnHttpFilterNew = envoy_dynamic_module_on_http_filter_new;
const _: abi::OnHttpFilterDestroy = envoy_dynamic_module_on_http_filter_destroy;
const _: abi::OnHttpFilterRequestHeaders = envoy_dynamic_module_on_http_filter_request_headers;
const _: abi::OnHttpFilterRequestBody = envoy_dynamic_module_on_http_filter_request_body;
const _: abi::OnHttpFilterRequestTrailers = envoy_dynamic_module_on_http_filter_request_trailers;
const _: abi::OnHttpFilterResponseHeaders = envoy_dynamic_module_on_http_filter_response_headers;
const _: abi::OnHttpFilterResponseBody = envoy_dynamic_module_on_http_filter_response_body;
const _: abi::OnHttpFilterResponseTrailers = envoy_dynamic_module_on_http_filter_response_trailers;
const _: abi::OnHttpFilterStreamComplete = envoy_dynamic_module_on_http_filter_stream_complete;
const _: abi::OnHttpFilterScheduled = envoy_dynamic_module_on_http_filter_scheduled;
const _: abi::OnHttpFilterHttpCalloutDone = envoy_dynamic_module_on_http_filter_http_callout_done;
const _: abi::OnHttpFilterHttpStreamHeaders = envoy_dynamic_module_on_http_filter_http_stream_headers;
const _: abi::OnHttpFilterHttpStreamData = envoy_dynamic_module_on_http_filter_http_stream_data;
const _: abi::OnHttpFilterHttpStreamTrailers = envoy_dynamic_module_on_http_filter_http_stream_trailers;
const _: abi::OnHttpFilterHttpStreamComplete = envoy_dynamic_module_on_http_filter_http_stream_complete;
const _: abi::OnHttpFilterHttpStreamReset = envoy_dynamic_module_on_http_filter_http_stream_reset;
const _: abi::OnHttpFilterDownstreamWatermark =
    envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark;
const _: abi::OnHttpFilterDownstreamWatermark =
    envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark;
