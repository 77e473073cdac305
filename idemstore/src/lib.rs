//! `idemstore`: the store-and-lock service behind the idempotency filter.
//!
//! The HTTP layer ([`http`]) speaks the wire protocol of `idem-protocol`; [`store::Store`]
//! adds the server-side long-poll on top of one atomic [`backend::Backend`] attempt. Those two,
//! the backends and the wake-ups ([`backend`], [`store`], [`waiters`]), the protocol's
//! milliseconds ([`millis`]) and one store-stream call to its answer (`idem_store::calls`) are
//! the `idem-store` crate (`store/`), which a host running the store's client in Envoy's own
//! process shares; they are re-exported here under the paths they have always had, and
//! [`store::Store`] is idem-store's observed by this instance's [`metrics`].
//!
//! | module | owns | uses |
//! |---|---|---|
//! | [`http`] | the router: the protocol's routes, `/healthz`, `/metrics`, the secret check, header and body validation | `admin`, `stream`, `error`, `store`, `metrics`, `secret`, `backend`, `millis` |
//! | [`stream`] | the store stream: one gRPC stream per filter worker, each call its own task, served by idem-store's `calls` | `store`, `backend`, idem-store's `calls` |
//! | [`tools`] | `idemstore records`: the operator's command line, on Redis (Cluster) directly or through `admin`'s routes | `admin`, `answer`, `secret`, `backend` |
//! | [`admin`] | the operator's routes under `/v1/admin/`, and the lookups and reports `idemstore records` shares with them | `answer`, `error`, `store`, `backend` |
//! | [`error`] | what a route answers when it fails, and the count of refusals | `store`, `metrics`, `backend` |
//! | [`store`] | idem-store's operations over a backend, with the `begin` long-poll, as idemstore's `Store`: observed by [`metrics::Metrics`] | `metrics`, idem-store's `store` |
//! | [`metrics`] | the Prometheus metrics of one instance, the store's [`store::Observer`] (a `begin`'s wait, a stream call's end) | `backend`, idem-store's `store` |
//! | [`backend`] | (idem-store's) the [`backend::Backend`] interface and its implementations: [`backend::memory`], [`backend::redis`] with [`backend::pubsub`] and [`backend::sentinel`]; how Redis is reached ([`backend::access`]: TLS, credentials, key prefix) | `waiters` |
//! | [`waiters`] | (idem-store's) per-key wake-ups for `begin` calls waiting on a held lock | nothing |
//! | [`millis`] | (idem-store's) durations in the protocol's whole milliseconds, a caller's deadline on this host's clock | nothing |
//! | [`answer`] | the filter's record of an answer (`IDR2`), as an operator writes one to resolve a key in doubt | nothing |
//! | [`secret`] | the shared secret: its form, its file, constant-time comparison | nothing |
//! | [`tls`] | the listener over TLS: certificates, client certificates, reloads | nothing |
//!
//! Each module uses only modules below it in this table: the uses go one way, with no circle
//! (`store` and `metrics` both use idem-store's `store`, which uses neither: it calls the
//! observer through its trait, as idem-store's `calls` does; idem-store's own modules are in
//! `store/src/lib.rs`).
//! The binary (`main.rs`) uses `http`, `tools`, `store`, `backend`, `secret` and `tls`.

pub mod admin;
pub mod answer;
pub mod error;
pub mod http;
pub mod metrics;
pub mod secret;
pub mod stream;
pub mod tls;
pub mod tools;

pub use idem_store::{backend, millis, waiters};

/// idem-store's operations over a backend, with the `begin` long-poll (`store/src/store.rs`),
/// as idemstore runs them: counted in this instance's [`crate::metrics`].
pub mod store {
    pub use idem_store::store::{new_token, Answered, Begin, Observer, Op, Rejected};

    /// The store of one idemstore instance: idem-store's, observed by its Prometheus metrics
    /// (the `begin` waits, and the stream's calls as idem-store's `calls` serves them; the HTTP
    /// layer counts its requests through
    /// [`Store::observer`](idem_store::store::Store::observer)).
    pub type Store<B> = idem_store::store::Store<B, crate::metrics::Metrics>;
}
