//! One worker's VM: the requests it runs at once and what they share. The [`coordinator`] takes
//! Envoy's events, keeps the live streams and their machines, and turns the machines' effects
//! into commands for the host; [`callouts`] owns the calls in flight (outbox, wake-up, dispatch,
//! commit batching), over HTTP callouts or the [`store_stream`], each call a [`job`] both carry;
//! [`store_path`] decides who answers a store call: the [`record_cache`], the
//! [`breaker`], the local fallback ([`fallback`] over the process-wide [`local_store`]) or the
//! network. Pure: the host is behind the small traits of [`env`]. May use `request`, `store`,
//! `config` and `http`.

pub mod breaker;
pub mod callouts;
pub mod command;
pub mod coordinator;
pub mod env;
pub mod fallback;
pub mod job;
pub mod local_store;
pub mod record_cache;
pub mod store_path;
pub mod store_stream;
