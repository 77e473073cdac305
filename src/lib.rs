//! Idempotency-Key filter for Envoy (and, in inbox mode, exactly-once for pushed messages).
//!
//! The pure core (everything but `host`) has no proxy-wasm dependency and is unit-tested
//! natively: [`machine`] decides for one request, [`coordinator`] for the requests of one VM;
//! `host` (wasm32 only) turns Envoy's callbacks into their events and carries out the commands
//! they return. [`sim`] and [`coordinator_sim`] are test support: simulated hosts that drive the
//! machine and the coordinator and check their invariants (unit tests and `fuzz/`).

pub mod breaker;
pub mod config;
pub mod coordinator;
pub mod coordinator_sim;
pub mod detached;
pub mod fallback;
pub mod fingerprint;
pub mod headers;
pub mod inbox;
pub mod keep;
pub mod key;
pub mod local;
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
