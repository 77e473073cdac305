//! Idempotency-Key filter for Envoy.
//!
//! The pure core (everything but [`host`]) has no proxy-wasm dependency and is unit-tested
//! natively; `host` is the thin layer that talks to Envoy.

pub mod config;
pub mod detached;
pub mod headers;
pub mod key;
pub mod machine;
pub mod metrics;
pub mod problem;
pub mod record;
pub mod store;

#[cfg(target_arch = "wasm32")]
mod host;
