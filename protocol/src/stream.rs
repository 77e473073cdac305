//! The store stream: one long-lived gRPC bidirectional stream per filter worker, over which
//! every store call of that worker travels as a message and every answer comes back, matched
//! by the call's `id` (answers come in any order: a `begin` that waits for a lock answers when
//! the lock frees or its wait ends, and the others go by it).
//!
//! The service is `idemstore.v1.Store`, method `Stream` (`/idemstore.v1.Store/Stream`); the
//! messages below are its protobuf definitions (`proto/idemstore.proto` says the same for other
//! languages). The operations and their rules are the HTTP API's (see the crate root): the
//! same validation, outcomes and limits; a call the store cannot do answers [`Failure`], as
//! the HTTP API's `400` or `503` would, and the stream goes on. The shared secret, when
//! idemstore has one, is the stream's `x-idem-secret` metadata, checked once when it opens.

use prost::{Message, Oneof};

/// The gRPC service and method of the stream.
pub const SERVICE: &str = "idemstore.v1.Store";
pub const METHOD: &str = "Stream";
/// `/idemstore.v1.Store/Stream`.
pub const PATH: &str = "/idemstore.v1.Store/Stream";

/// One store call.
#[derive(Clone, PartialEq, Message)]
pub struct Call {
    /// The caller's id for the call, echoed in its answer; unique among the stream's calls in
    /// flight.
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(oneof = "Op", tags = "2, 3, 4")]
    pub op: Option<Op>,
}

#[derive(Clone, PartialEq, Oneof)]
pub enum Op {
    #[prost(message, tag = "2")]
    Begin(Begin),
    #[prost(message, tag = "3")]
    Commit(Commit),
    #[prost(message, tag = "4")]
    Release(Release),
}

/// `begin`: as `POST /v1/begin`.
#[derive(Clone, PartialEq, Message)]
pub struct Begin {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub body_hash: String,
    #[prost(uint64, tag = "3")]
    pub lock_ttl_ms: u64,
    #[prost(uint64, tag = "4")]
    pub wait_ms: u64,
    /// When the caller gives up, in milliseconds since the Unix epoch; 0: not given.
    #[prost(uint64, tag = "5")]
    pub deadline_ms: u64,
    /// `x-idem-hold`: keep a trace of the attempt; answer `in-doubt` for an earlier one's.
    #[prost(bool, tag = "6")]
    pub hold: bool,
    /// With `hold`: how long the trace may outlive the lock, in seconds.
    #[prost(uint64, tag = "7")]
    pub retention_s: u64,
    /// With `hold`: the in-doubt attempt's token whose trace to clear first; empty: none.
    #[prost(string, tag = "8")]
    pub supersede: String,
}

/// `commit`: as `POST /v1/commit`.
#[derive(Clone, PartialEq, Message)]
pub struct Commit {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub token: String,
    #[prost(string, tag = "3")]
    pub body_hash: String,
    #[prost(uint64, tag = "4")]
    pub retention_s: u64,
    #[prost(bytes = "vec", tag = "5")]
    pub record: Vec<u8>,
}

/// `release`: as `POST /v1/release`.
#[derive(Clone, PartialEq, Message)]
pub struct Release {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub token: String,
    /// `x-idem-in-doubt`: the attempt was sent and its outcome is unknown: keep its trace.
    #[prost(bool, tag = "3")]
    pub in_doubt: bool,
}

/// The answer to the call with the same `id`.
#[derive(Clone, PartialEq, Message)]
pub struct Answer {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(oneof = "Outcome", tags = "2, 3, 4, 5")]
    pub outcome: Option<Outcome>,
}

#[derive(Clone, PartialEq, Oneof)]
pub enum Outcome {
    #[prost(message, tag = "2")]
    Begun(Begun),
    /// The wire name of a [`crate::CommitOutcome`].
    #[prost(string, tag = "3")]
    Committed(String),
    /// The wire name of a [`crate::ReleaseOutcome`].
    #[prost(string, tag = "4")]
    Released(String),
    #[prost(message, tag = "5")]
    Failure(Failure),
}

/// What `begin` found: `outcome` is the wire name of a [`crate::BeginOutcome`].
#[derive(Clone, PartialEq, Message)]
pub struct Begun {
    #[prost(string, tag = "1")]
    pub outcome: String,
    /// `record`: the record.
    #[prost(bytes = "vec", tag = "2")]
    pub record: Vec<u8>,
    /// `record`: how long it still lives, in whole milliseconds; 0: not known.
    #[prost(uint64, tag = "3")]
    pub ttl_ms: u64,
    /// `locked`: the lock's token.
    #[prost(string, tag = "4")]
    pub token: String,
    /// `busy`: how long the holder's lock still lives, in milliseconds rounded up; 0: not known.
    #[prost(uint64, tag = "5")]
    pub lock_remaining_ms: u64,
    /// `in-doubt`: when the first attempt began, milliseconds since the Unix epoch.
    #[prost(uint64, tag = "6")]
    pub started_ms: u64,
    /// `in-doubt`: how long the first attempt may still be running, in milliseconds rounded
    /// up; 0: it can no longer be.
    #[prost(uint64, tag = "7")]
    pub running_ms: u64,
}

/// A call the store did not do: `bad_request` (as a `400`: a malformed call, never retried)
/// or the store failed (as a `503`).
#[derive(Clone, PartialEq, Message)]
pub struct Failure {
    #[prost(bool, tag = "1")]
    pub bad_request: bool,
    #[prost(string, tag = "2")]
    pub reason: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_and_answers_round_trip() {
        let call = Call {
            id: 7,
            op: Some(Op::Commit(Commit {
                key: "a".repeat(64),
                token: "t".into(),
                body_hash: "b".repeat(64),
                retention_s: 86_400,
                record: vec![0, 255, 1],
            })),
        };
        assert_eq!(Call::decode(call.encode_to_vec().as_slice()), Ok(call));
        let answer = Answer {
            id: u64::MAX,
            outcome: Some(Outcome::Begun(Begun {
                outcome: crate::BeginOutcome::Busy.as_str().into(),
                lock_remaining_ms: 1200,
                ..Begun::default()
            })),
        };
        assert_eq!(Answer::decode(answer.encode_to_vec().as_slice()), Ok(answer));
    }

    #[test]
    fn the_wire_form_is_protobufs() {
        // id 1, release {key "k", token "t"}: what any protobuf library writes for it.
        let call = Call {
            id: 1,
            op: Some(Op::Release(Release { key: "k".into(), token: "t".into(), in_doubt: false })),
        };
        assert_eq!(call.encode_to_vec(), b"\x08\x01\x22\x06\x0a\x01k\x12\x01t");
    }
}
