//! A call the worker makes, from the moment a stream asks for it to its end: the [`Job`] (on
//! whose behalf, which try, when it went out) and its [`Call`] (a store call, a batch of
//! commits, a detached execution). Its own module because both carriers use it and neither
//! owns it: [`callouts`] dispatches jobs as callouts (and batches commits), [`store_stream`]
//! sends the store calls among them as messages; the coordinator gets the job back at its end.
//!
//! [`callouts`]: crate::worker::callouts
//! [`store_stream`]: crate::worker::store_stream

use std::rc::Rc;

use crate::request::detached::UpstreamCall;
use crate::store::client::StoreCall;

/// A callout on behalf of a stream (which may be gone by the time it answers), or of the
/// worker itself (a batch of commits, a hand-back).
pub struct Job {
    pub stream: u32,
    /// For log lines: the request's `x-request-id`, or `-`.
    pub request_id: Rc<str>,
    pub call: Call,
    /// 0 for the first try; see [`StoreCall::after_fault`].
    pub attempt: u32,
    /// When the callout was handed to the host, for the latency histograms and the cache.
    pub sent_us: Option<u64>,
    /// A local record's commit, handed back to the store (no stream).
    pub hand_back: bool,
}

pub enum Call {
    Store(StoreCall),
    /// First tries of commits held while another commit was in flight, sent as one `commits`.
    Batch(Vec<Job>),
    /// Detached execution: the request itself, to the route's cluster.
    Upstream(UpstreamCall),
}

impl Job {
    /// A first try on behalf of `stream`.
    pub fn new(stream: u32, request_id: Rc<str>, call: Call) -> Job {
        Job { stream, request_id, call, attempt: 0, sent_us: None, hand_back: false }
    }

    /// A call of the worker's own, for no stream.
    pub fn worker(call: Call) -> Job {
        Job::new(0, Rc::from("-"), call)
    }

    /// For log lines: the request id, and the store key's prefix or the cluster of a detached
    /// call. Never the client's key: only its derived store key is known past the headers.
    pub fn label(&self) -> String {
        match &self.call {
            Call::Store(c) => {
                format!("request {} key {}: store {:?}", self.request_id, key_prefix(c.key()), c.kind())
            }
            Call::Batch(items) => format!("store commits of {} requests", items.len()),
            Call::Upstream(c) => format!("request {}: detached call to {}", self.request_id, c.cluster),
        }
    }

    /// A commit's first try: it may wait for the commit in flight and go with others.
    pub(super) fn batchable(&self) -> bool {
        matches!(self.call, Call::Store(StoreCall::Commit { .. })) && self.attempt == 0 && !self.hand_back
    }

    /// A callout that counts as the worker's commit in flight.
    pub(super) fn commit_flight(&self) -> bool {
        self.batchable() || matches!(self.call, Call::Batch(_))
    }
}

/// The store key as log lines show it: its first 12 hex digits.
pub fn key_prefix(key: &str) -> &str {
    key.get(..12).unwrap_or(key)
}
