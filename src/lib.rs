//! Idempotency-Key filter for Envoy (and, in inbox mode, exactly-once for pushed messages).
//!
//! Folders by layer, each using only the layers above it in this list:
//!
//! * [`http`]: facts of HTTP itself (header names and values, media types, codings).
//! * [`config`]: the plugin configuration, parsed and validated once at load.
//! * [`store`]: the store client (the calls to idemstore and their answers) and the record codec.
//! * [`request`]: the per-request state machine and the rules it decides by (keys, fingerprint,
//!   what is kept, replays, problems, inbox ids, detached execution) and what it counts.
//! * [`worker`]: the per-worker coordinator: the streams of one VM, the callouts they start, and
//!   who answers a store call (record cache, breaker, local fallback, the network).
//! * `host`: the glue to Envoy, the only code that talks to it; a folder per host (`wasm`:
//!   proxy-wasm; `native`: an Envoy dynamic module, the `native` feature).
//!
//! Everything but `host` is pure and unit-tested natively; of `host`, the unit tests build the
//! part that carries out the coordinator's commands, over a fake host. `sim` (tests and the
//! `sim` feature `fuzz/` turns on, never in the filter) holds the simulated hosts that drive the
//! machine and the coordinator through random event sequences and check their invariants.

pub mod config;
pub mod http;
pub mod request;
pub mod store;
pub mod worker;

#[cfg(any(target_arch = "wasm32", test, feature = "native"))]
mod host;

#[cfg(any(test, feature = "sim"))]
pub mod sim;
