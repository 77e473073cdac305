//! `idemstore`: the store-and-lock service behind the idempotency filter.
//!
//! The HTTP layer ([`http`]) speaks the wire protocol of `idem-protocol`; [`store::Store`]
//! adds the server-side long-poll on top of one atomic [`backend::Backend`] attempt.
//!
//! | module | owns | uses |
//! |---|---|---|
//! | [`http`] | the router: the protocol's routes, `/healthz`, `/metrics`, the secret check, header and body validation | `admin`, `stream`, `error`, `store`, `metrics`, `secret`, `backend`, `millis` |
//! | [`stream`] | the store stream: one gRPC stream per filter worker, each call its own task | `store`, `metrics`, `backend`, `millis` |
//! | [`tools`] | `idemstore records`: the operator's command line, on Redis (Cluster) directly or through `admin`'s routes | `admin`, `answer`, `secret`, `backend` |
//! | [`admin`] | the operator's routes under `/v1/admin/`, and the lookups and reports `idemstore records` shares with them | `answer`, `error`, `store`, `backend` |
//! | [`error`] | what a route answers when it fails, and the count of refusals | `store`, `metrics`, `backend` |
//! | [`store`] | the protocol's operations over a backend, with the `begin` long-poll | `backend`, `metrics`, `waiters` |
//! | [`metrics`] | the Prometheus metrics of one instance | `backend` |
//! | [`backend`] | the [`backend::Backend`] interface and its implementations: [`backend::memory`], [`backend::redis`] with [`backend::pubsub`] and [`backend::sentinel`]; how Redis is reached ([`backend::access`]: TLS, credentials, key prefix) | `waiters` |
//! | [`waiters`] | per-key wake-ups for `begin` calls waiting on a held lock | nothing |
//! | [`millis`] | durations in the protocol's whole milliseconds, a caller's deadline on this host's clock | nothing |
//! | [`answer`] | the filter's record of an answer (`IDR2`), as an operator writes one to resolve a key in doubt | nothing |
//! | [`secret`] | the shared secret: its form, its file, constant-time comparison | nothing |
//! | [`tls`] | the listener over TLS: certificates, client certificates, reloads | nothing |
//!
//! Each module uses only modules below it in this table: the uses go one way, with no circle
//! (in [`backend`], `redis` uses `pubsub`, `redis_error`, `sentinel` and `access`, `pubsub`
//! uses `redis_error` and `sentinel`, `redis_error` uses `sentinel`, and both implementations use
//! the interface in `backend` itself, which uses none of them).
//! The binary (`main.rs`) uses `http`, `tools`, `store`, `backend`, `secret` and `tls`.

pub mod admin;
pub mod answer;
pub mod backend;
pub mod error;
pub mod http;
pub mod metrics;
pub mod millis;
pub mod secret;
pub mod store;
pub mod stream;
pub mod tls;
pub mod tools;
pub mod waiters;
