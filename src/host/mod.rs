//! The proxy-wasm glue: the only module that talks to Envoy. It turns Envoy's callbacks into
//! [`Coordinator`] events and carries out the [`Command`]s that come back; every decision is in
//! the coordinator and the per-request machines behind it.
//!
//! * `contexts`: the root and stream contexts, Envoy's callbacks (wasm32 only).
//! * `vm`: one VM's coordinator, and a function per command that carries it out.
//! * `calls`: the host calls those functions make, behind [`calls::HostCalls`]; `envoy`
//!   implements it over proxy-wasm (wasm32 only), `fake` records the calls for the unit tests
//!   and fails the ones it is told to.
//! * `abi` (the proxy-wasm calls without the SDK's panics) and `env` (what the core reads from
//!   Envoy), wasm32 only.
//!
//! Only calls that return `Result` are used: the SDK's trait helpers panic on an unexpected
//! host status, and a panic traps the VM. Natively (the unit tests) only `calls` and `vm` are
//! built, over the fake: nothing links proxy-wasm's imports.
//!
//! [`Coordinator`]: crate::worker::coordinator::Coordinator
//! [`Command`]: crate::worker::command::Command

mod calls;
mod vm;

#[cfg(target_arch = "wasm32")]
mod abi;
#[cfg(target_arch = "wasm32")]
mod contexts;
#[cfg(target_arch = "wasm32")]
mod env;
#[cfg(target_arch = "wasm32")]
mod envoy;

#[cfg(test)]
mod fake;
#[cfg(test)]
mod tests;
