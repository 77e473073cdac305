//! The native host: the filter as an Envoy dynamic module (`envoy.filters.http.dynamic_modules`,
//! Envoy 1.40, ABI v0.2.0), built with the `native` feature into
//! `target/release/libidempotency_filter.so`. The same core as the wasm filter (the coordinator
//! and its request machines, through the same [`Vm`](crate::host::vm::Vm)), with the store in
//! Envoy's process: idemstore's backends on the module's own threads (`store`).
//!
//! * `abi`: the hand-written bindings to Envoy 1.40's module ABI, each checked in the real binary.
//! * `module`: the hooks Envoy calls; configurations and streams. `worker`: each worker's
//!   coordinator for a configuration, and who may drive it.
//! * `calls`: `HostCalls` over the ABI (the store stream served in process); `view`: the
//!   core's `StreamView`; `env`: the clock and the process-wide shared data; `metrics`.
//! * `link`: how the store's threads hand a worker its answers (the stream schedulers, or the
//!   store's thread itself when no stream can be woken), and why that is safe at shutdown;
//!   `baton`: who may touch a worker's coordinator now.
//! * `trace`: the store's `tracing` lines into Envoy's log.
//! * `settings`: the `store` key, checked (pure; unit-tested without the feature).

mod settings;

// Pure (std only): unit-tested without the feature too.
#[cfg_attr(not(feature = "native"), allow(dead_code))]
mod baton;

#[cfg(feature = "native")]
mod abi;
#[cfg(feature = "native")]
mod calls;
#[cfg(feature = "native")]
mod env;
#[cfg(feature = "native")]
mod link;
#[cfg(feature = "native")]
mod metrics;
#[cfg(feature = "native")]
mod module;
#[cfg(feature = "native")]
mod store;
#[cfg(feature = "native")]
mod trace;
#[cfg(feature = "native")]
mod view;
#[cfg(feature = "native")]
mod worker;
