//! The glue to Envoy: the only module that talks to it. It turns Envoy's callbacks into
//! [`Coordinator`] events and carries out the [`Command`]s that come back; every decision is in
//! the coordinator and the per-request machines behind it. One folder per host; what they share
//! is here.
//!
//! * `vm`: one worker's coordinator, and a function per command that carries it out.
//! * `calls`: the host calls those functions make, behind [`calls::HostCalls`]; each host
//!   implements it, and `fake` records the calls for the unit tests and fails the ones it is
//!   told to.
//! * `wasm` (wasm32 only): the proxy-wasm host: the root and stream contexts, `HostCalls` over
//!   proxy-wasm, what the core reads from Envoy.
//!
//! Only calls that return `Result` are used: a panic in a host traps the VM (wasm) or aborts
//! Envoy. Natively (the unit tests) only `calls` and `vm` are built, over the fake: nothing links
//! a host's imports.
//!
//! [`Coordinator`]: crate::worker::coordinator::Coordinator
//! [`Command`]: crate::worker::command::Command

mod calls;
mod vm;

#[cfg(target_arch = "wasm32")]
mod wasm;

#[cfg(any(test, feature = "native"))]
mod native;

#[cfg(all(feature = "native", target_arch = "wasm32"))]
compile_error!("the `native` feature builds the Envoy dynamic module: not for wasm32");

#[cfg(test)]
mod fake;
#[cfg(test)]
mod tests;
