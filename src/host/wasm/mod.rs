//! The proxy-wasm host (wasm32 only): Envoy's V8 VM runs the filter, one VM per worker.
//!
//! * `contexts`: the root and stream contexts, Envoy's callbacks.
//! * `envoy`: [`HostCalls`](crate::host::calls::HostCalls) over proxy-wasm.
//! * `abi`: the proxy-wasm calls without the SDK's panics (the SDK's trait helpers panic on an
//!   unexpected host status, and a panic traps the VM).
//! * `env`: what the core reads from Envoy (the stream's headers, properties and bodies; the
//!   clock and the shared data).

mod abi;
mod contexts;
mod env;
mod envoy;
