//! `idem-store`: the idempotency store itself, whichever process runs it: the protocol's
//! operations ([`store::Store`]) over one atomic [`backend::Backend`] attempt, with the
//! `begin` long-poll, on Redis (standalone, Cluster, Sentinel) or in memory.
//!
//! Its own crate so that idemstore and a host that runs the store's client in Envoy's own
//! process use the same code, not a copy: the Lua scripts, the key names and the wake-ups are
//! what makes every instance agree on a key, and two copies would drift. So is one store-stream
//! call to its answer ([`calls::serve`]): the same validation and answers whichever process
//! serves the stream. Nothing here listens, speaks a transport or exports metrics: idemstore's
//! HTTP routes, the store stream's gRPC service, admin routes and Prometheus metrics stay in
//! idemstore, which counts a `begin`'s wait and each served call through [`store::Observer`].
//!
//! | module | owns | uses |
//! |---|---|---|
//! | [`calls`] | one store-stream call to its answer: validated, carried out on a [`store::Store`], counted through its observer | `store`, `backend`, `millis` |
//! | [`store`] | the protocol's operations over a backend, with the `begin` long-poll; the lock tokens; what the store and a served call tell its [`store::Observer`] | `backend`, `waiters` |
//! | [`backend`] | the [`backend::Backend`] interface and its implementations: [`backend::memory`], [`backend::redis`] with [`backend::pubsub`] and [`backend::sentinel`]; how Redis is reached ([`backend::access`]: TLS, credentials, key prefix) | `waiters` |
//! | [`waiters`] | per-key wake-ups for `begin` calls waiting on a held lock | nothing |
//! | [`millis`] | durations in the protocol's whole milliseconds, a caller's deadline on this host's clock (idemstore's HTTP routes use them too) | nothing |
//!
//! Each module uses only modules below it in this table: the uses go one way, with no circle
//! (in [`backend`], `redis` uses `pubsub`, `redis_error`, `sentinel` and `access`, `pubsub`
//! uses `redis_error` and `sentinel`, `redis_error` uses `sentinel`, and both implementations use
//! the interface in `backend` itself, which uses none of them).
//!
//! What a user brings: a tokio runtime (the Redis connections, the wake-up subscription and the
//! in-memory sweeper are tasks on it), and for idemstore's command line the `clap` feature
//! ([`backend::access::AccessArgs`] as flags). Log lines go through `tracing` under the targets
//! idemstore has always logged them under (`idemstore::backend`, `idemstore::backend::pubsub`),
//! not this crate's module paths: its operators' filters and searches name them.

pub mod backend;
pub mod calls;
pub mod millis;
pub mod store;
pub mod waiters;
