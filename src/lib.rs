//! Idempotency-Key filter for Envoy (and, in inbox mode, exactly-once for pushed messages).
//!
//! The pure core (everything but [`host`]) has no proxy-wasm dependency and is unit-tested
//! natively; `host` is the thin layer that talks to Envoy. [`sim`] is test support: a scripted
//! host that drives the state machine and checks its invariants (unit tests and `fuzz/`).

pub mod config;
pub mod detached;
pub mod fingerprint;
pub mod headers;
pub mod inbox;
pub mod keep;
pub mod key;
pub mod machine;
pub mod metrics;
pub mod problem;
pub mod recent;
pub mod record;
pub mod replay;
pub mod sim;
pub mod store;

#[cfg(target_arch = "wasm32")]
mod host;
