//! Test support, never in the filter: compiled for unit tests and for `fuzz/` (the `sim`
//! feature). Simulated hosts that drive the per-request machine ([`request`]) and the worker's
//! coordinator ([`worker`]) through seeded random event sequences and check their invariants
//! after every event, and shared data in memory ([`memory`]). May use every layer but `host`.

pub mod request;
pub mod worker;

pub mod memory;
