//! The problem codes, one row each: the only place a code's HTTP status, title, gRPC status and
//! whether a client may retry it are written. The answers ([`super`]), their gRPC form and the
//! tests of docs/configuration.md's and docs/grpc.md's tables all read it, so a new code is a
//! new row (and its constructor in `super`).

use crate::http::grpc::{
    ABORTED, DEADLINE_EXCEEDED, FAILED_PRECONDITION, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE,
};

macro_rules! codes {
    ($($(#[$doc:meta])* $code:ident = $name:literal, $status:expr, $grpc:ident, retryable: $retryable:literal, $title:literal;)*) => {
        /// A problem's `code`, which clients switch on.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Code {
            $($(#[$doc])* $code,)*
        }

        impl Code {
            pub const ALL: &'static [Code] = &[$(Code::$code),*];

            fn row(self) -> Row {
                match self {
                    $(Code::$code => Row {
                        name: $name,
                        status: $status,
                        grpc: $grpc,
                        retryable: $retryable,
                        title: $title,
                    },)*
                }
            }
        }
    };
}

struct Row {
    name: &'static str,
    status: Option<u32>,
    grpc: u8,
    retryable: bool,
    title: &'static str,
}

// `retryable`: whether the same request, key unchanged, may succeed if sent again (after
// `retry-after` where there is one). No for what only a changed request fixes, and for
// `outcome-unknown`: a retry never runs the request again, but the client should look before it
// retries (docs/configuration.md says what a client does for each).
codes! {
    MissingKey = "missing-key", Some(400), INVALID_ARGUMENT, retryable: false, "Idempotency-Key required";
    InvalidKey = "invalid-key", Some(400), INVALID_ARGUMENT, retryable: false, "Invalid Idempotency-Key";
    /// Inbox mode.
    MissingMessageId = "missing-message-id", Some(400), INVALID_ARGUMENT, retryable: false, "Message id required";
    /// Inbox mode.
    InvalidMessageId = "invalid-message-id", Some(400), INVALID_ARGUMENT, retryable: false, "Invalid message id";
    /// A client sent the header only the filter sets on a gRPC replay it re-routes.
    InternalHeader = "internal-header", Some(400), INVALID_ARGUMENT, retryable: false, "Internal header";
    EncodingNotAcceptable = "encoding-not-acceptable", Some(406), FAILED_PRECONDITION, retryable: false,
        "Stored answer's encoding not acceptable";
    /// Not `UNAVAILABLE` for gRPC: nothing changes by retrying at once (a client's own retries).
    OutcomeUnknown = "outcome-unknown", Some(409), ABORTED, retryable: false, "Outcome unknown";
    RequestInFlight = "request-in-flight", Some(409), UNAVAILABLE, retryable: true, "Request in flight";
    /// Inbox mode.
    MessageInFlight = "message-in-flight", Some(409), UNAVAILABLE, retryable: true, "Message in flight";
    BodyTooLarge = "body-too-large", Some(413), RESOURCE_EXHAUSTED, retryable: false, "Request body too large";
    /// `422`, or the route's `mismatch_status`.
    KeyReused = "key-reused", Some(422), FAILED_PRECONDITION, retryable: false, "Idempotency-Key reused";
    /// Detached execution.
    UpstreamFailed = "upstream-failed", Some(502), UNAVAILABLE, retryable: true, "Upstream failed";
    StoreUnavailable = "store-unavailable", Some(503), UNAVAILABLE, retryable: true, "Idempotency store unavailable";
    /// Detached execution.
    UpstreamTimeout = "upstream-timeout", Some(504), DEADLINE_EXCEEDED, retryable: true, "Upstream timed out";
    /// gRPC only: a replay that could not take its second hop (the replay listener's own
    /// refusals say `INTERNAL` or `RESOURCE_EXHAUSTED` instead).
    ReplayFailed = "replay-failed", None, UNAVAILABLE, retryable: true, "Replay failed";
}

impl Code {
    pub fn name(self) -> &'static str {
        self.row().name
    }

    /// The HTTP status; `None` for a code only gRPC calls get.
    pub fn status(self) -> Option<u32> {
        self.row().status
    }

    pub fn grpc(self) -> u8 {
        self.row().grpc
    }

    pub fn retryable(self) -> bool {
        self.row().retryable
    }

    pub fn title(self) -> &'static str {
        self.row().title
    }

    pub fn from_name(name: &str) -> Option<Code> {
        Code::ALL.iter().copied().find(|c| c.name() == name)
    }
}
