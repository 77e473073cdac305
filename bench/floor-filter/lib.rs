//! A proxy-wasm HTTP filter that looks up one request header and lets everything through: what
//! the VM crossings of a Rust proxy-wasm filter cost Envoy per request, with no work of its own.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
}}

struct Root;

impl Context for Root {}

impl RootContext for Root {
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Floor))
    }
}

struct Floor;

impl Context for Floor {}

impl HttpContext for Floor {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let _ = self.get_http_request_header("idempotency-key");
        Action::Continue
    }
}
