//! How a guarded attempt ended, from what Envoy says of it: the application's own answer
//! (`answered`), a request that provably never reached the application (`never sent`), or one
//! that was sent and whose answer never came back (`unknown`). Only the last may have run
//! without anyone seeing the result, so only it leaves the key in doubt (`unknown_outcome:
//! hold`).
//!
//! What Envoy 1.40 says, measured with the shipped binary (HTTP/1.1 and HTTP/2 alike):
//!
//! | the attempt | `response.code_details` | tries |
//! |---|---|---|
//! | the application answered (any status) | `via_upstream` | 1+ |
//! | route timeout | `response_timeout` | 1 |
//! | per-try timeout, retries exhausted | `upstream_per_try_timeout` | 2+ |
//! | the upstream closed or reset after reading the request | `upstream_reset_before_response_started{connection_termination}` | 1 |
//! | an answer cut mid-body | `via_upstream` at its headers; the stream then ends without its end | 1 |
//! | connection refused | `upstream_reset_before_response_started{remote_connection_failure\|...}` | 1 |
//! | connect timeout | `upstream_reset_before_response_started{connection_timeout}` | 1 |
//! | pool or circuit breaker full | `upstream_reset_before_response_started{overflow}` | 1 |
//! | no healthy host | `no_healthy_upstream` | 0 |
//! | a reply before the router (another filter, a direct response) | its own reason | 0 |
//! | the client went away (`downstream_remote_disconnect`, `http2.remote_reset`) | no answer | 0+ |
//!
//! The details name only the last try: with retries, a refused last try may follow one that
//! reached the application, so a request tried twice or more is never "never sent". A client
//! that went away while Envoy was still connecting left nothing at the application: the
//! upstream connection had no local address yet.

/// How an attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// The application's own answer (any status).
    Answered,
    /// The request provably never reached the application.
    NeverSent,
    /// It was sent, and no complete answer came back.
    Unknown,
}

/// What Envoy tells of the attempt (each `None` when the host cannot tell).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Seen {
    /// `response.code_details`.
    pub details: Option<String>,
    /// `upstream.request_attempt_count`: how many tries the router made.
    pub tries: Option<u64>,
    /// `upstream.local_address` is set: a connection to the upstream was made.
    pub connected: bool,
}

/// The resets of a try that never left Envoy.
const NOT_SENT_RESETS: [&str; 5] = [
    "remote_connection_failure",
    "local_connection_failure",
    "connection_failure",
    "connection_timeout",
    "overflow",
];

impl Seen {
    /// The ending an answer's headers mean, as they reach the filter. A host that cannot tell
    /// the details makes it the application's answer, as before the filter asked.
    pub fn at_answer(&self) -> Ending {
        let Some(details) = self.details.as_deref() else { return Ending::Answered };
        if details == "via_upstream" || details.is_empty() {
            return Ending::Answered;
        }
        self.not_answered(details)
    }

    /// The ending of a stream that ended before its answer did (the client went away, or the
    /// answer was cut): unknown unless Envoy shows nothing left for the application.
    pub fn at_end(&self) -> Ending {
        match self.details.as_deref() {
            Some(details) if details != "via_upstream" => self.not_answered(details),
            _ => Ending::Unknown,
        }
    }

    fn not_answered(&self, details: &str) -> Ending {
        if self.tries.is_some_and(|n| n >= 2) {
            return Ending::Unknown;
        }
        if let Some(reason) = details.strip_prefix("upstream_reset_before_response_started{") {
            if NOT_SENT_RESETS.iter().any(|r| reason.starts_with(r)) {
                return Ending::NeverSent;
            }
            return Ending::Unknown;
        }
        let client_gone = details.starts_with("downstream_") || details == "http2.remote_reset";
        if details == "no_healthy_upstream" || client_gone && !self.connected || self.tries == Some(0) {
            return Ending::NeverSent;
        }
        Ending::Unknown
    }
}

/// An integer attribute as the host gives it: 8 bytes little-endian (how Envoy serializes a
/// number property), or decimal digits.
pub fn number(bytes: &[u8]) -> Option<u64> {
    match <[u8; 8]>::try_from(bytes) {
        Ok(le) => Some(u64::from_le_bytes(le)),
        Err(_) => std::str::from_utf8(bytes).ok()?.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(details: &str, tries: u64, connected: bool) -> Seen {
        Seen { details: Some(details.into()), tries: Some(tries), connected }
    }

    #[test]
    fn envoys_replies_are_classified() {
        let cases: &[(&str, u64, Ending)] = &[
            ("via_upstream", 1, Ending::Answered),
            ("via_upstream", 3, Ending::Answered),
            ("response_timeout", 1, Ending::Unknown),
            ("upstream_response_timeout", 1, Ending::Unknown),
            ("upstream_per_try_timeout", 2, Ending::Unknown),
            ("upstream_reset_before_response_started{connection_termination}", 1, Ending::Unknown),
            ("upstream_reset_before_response_started{remote_reset}", 1, Ending::Unknown),
            ("upstream_reset_before_response_started{local_reset}", 1, Ending::Unknown),
            ("upstream_reset_after_response_started{protocol_error}", 1, Ending::Unknown),
            (
                "upstream_reset_before_response_started{remote_connection_failure|delayed_connect_error:_Connection_refused}",
                1,
                Ending::NeverSent,
            ),
            // The last try refused, an earlier one may have reached the application.
            (
                "upstream_reset_before_response_started{remote_connection_failure|delayed_connect_error:_Connection_refused}",
                2,
                Ending::Unknown,
            ),
            ("upstream_reset_before_response_started{connection_timeout}", 1, Ending::NeverSent),
            ("upstream_reset_before_response_started{overflow}", 1, Ending::NeverSent),
            ("no_healthy_upstream", 0, Ending::NeverSent),
            ("request_payload_too_large", 0, Ending::NeverSent),
            ("direct_response", 0, Ending::NeverSent),
            ("something_new", 1, Ending::Unknown),
        ];
        for (details, tries, want) in cases {
            assert_eq!(seen(details, *tries, true).at_answer(), *want, "{details} ({tries} tries)");
        }
        assert_eq!(Seen::default().at_answer(), Ending::Answered, "the host cannot tell");
    }

    #[test]
    fn a_stream_that_ended_first_is_unknown_unless_nothing_left() {
        assert_eq!(Seen::default().at_end(), Ending::Unknown);
        assert_eq!(seen("downstream_remote_disconnect", 1, true).at_end(), Ending::Unknown);
        assert_eq!(seen("http2.remote_reset", 1, true).at_end(), Ending::Unknown);
        // Still connecting when the client left.
        assert_eq!(seen("downstream_remote_disconnect", 1, false).at_end(), Ending::NeverSent);
        assert_eq!(seen("http2.remote_reset", 1, false).at_end(), Ending::NeverSent);
        // An answer that had begun: its headers were the application's.
        assert_eq!(seen("via_upstream", 1, true).at_end(), Ending::Unknown);
        assert_eq!(
            seen("upstream_reset_after_response_started{remote_reset}", 1, true).at_end(),
            Ending::Unknown
        );
    }

    #[test]
    fn numbers_come_as_envoy_serializes_them() {
        assert_eq!(number(&2u64.to_le_bytes()), Some(2));
        assert_eq!(number(b"3"), Some(3));
        assert_eq!(number(b"x"), None);
    }
}
