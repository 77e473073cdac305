//! `idemstore`: the store-and-lock service behind the idempotency filter.
//!
//! The HTTP layer ([`http`]) speaks the wire protocol of `idem-protocol`; [`store::Store`]
//! adds the server-side long-poll on top of one atomic [`backend::Backend`] attempt.

pub mod admin;
pub mod backend;
pub mod http;
pub mod metrics;
pub mod secret;
pub mod store;
pub mod tools;
pub mod waiters;
