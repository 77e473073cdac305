//! The proxy-wasm contexts: the root (the configuration, the VM, the callouts' and the store
//! stream's answers, ticks, wake-ups) and one per stream, each callback turned into a
//! coordinator event run by the [`Vm`].

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action as HostAction, BufferType, ContextType, LogLevel, MapType};
use std::hash::{BuildHasher, Hasher};
use std::rc::Rc;

use super::abi;
use super::env::{HostEnv, HostView};
use super::envoy::Envoy;
use crate::config::Config;
use crate::host::vm::Vm;
use crate::request::machine::{Action, Machine, Step, StreamView};
use crate::worker::coordinator::Stepped;
use crate::worker::env::Clock;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|id| -> Box<dyn RootContext> { Box::new(Root { id, vm: None }) });
}}

struct Root {
    id: u32,
    vm: Option<Rc<Vm<Envoy>>>,
}

impl Root {
    fn configure(&self) -> Result<Vm<Envoy>, String> {
        let bytes = abi::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .map_err(|s| format!("cannot read the plugin configuration: {s:?}"))?
            .unwrap_or_default();
        let cfg = Config::from_json(&bytes).map_err(|e| e.to_string())?;
        if cfg.store.is_some() {
            return Err("`store` needs the native host (the Envoy dynamic module): the wasm filter \
                        reaches idemstore through `store_cluster`"
                .into());
        }
        // Queue names are per VM id, and every worker runs this root: a random name keeps each
        // worker's wake-ups on its own thread, where its streams live.
        let name = format!("idempotency-outbox-{:016x}", random_u64(self.id));
        let vm = Vm::new(Envoy, self.id, cfg, &name)?;
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
        vm.enter(self.id);
        vm.run(|c| c.on_callout_answer_with_trailers(token, headers, body, trailers, &HostEnv));
    }

    fn on_grpc_stream_message(&mut self, token: u32, size: usize) {
        let Some(vm) = &self.vm else { return };
        let message =
            abi::get_buffer(BufferType::GrpcReceiveBuffer, 0, size).ok().flatten().unwrap_or_default();
        vm.enter(self.id);
        vm.run(|c| c.on_stream_message(token, &message, &HostEnv));
    }

    fn on_grpc_stream_close(&mut self, token: u32, status: u32) {
        let Some(vm) = &self.vm else { return };
        vm.enter(self.id);
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
            vm.enter(self.id);
            vm.run(|c| c.on_tick(&HostEnv));
        }
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        while let Ok(Some(_)) = hostcalls::dequeue_shared_queue(queue_id) {}
        if let Some(vm) = &self.vm {
            vm.enter(self.id);
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
    vm: Option<Rc<Vm<Envoy>>>,
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
        vm.enter(id);
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
            vm.enter(id);
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
        if let Some(vm) = &self.vm {
            vm.restore_content_type(self.id);
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
