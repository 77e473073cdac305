//! The filter's side of the store stream (`idem_protocol::stream`): the message each store call
//! becomes, and strict decoding of the answers, to the same values and faults as an HTTP
//! callout's (`client`), so that nothing past this module knows which way a call went.

use idem_protocol as proto;
use idem_protocol::stream::{self as wire, Op, Outcome};
use idem_protocol::{BeginOutcome, CommitOutcome, ReleaseOutcome};
use prost::Message;

use crate::config::Config;
use crate::store::client::{self, BeginAnswer, CalloutFault, LockToken, StoreAnswer, StoreCall};
use crate::store::record::Record;

/// A commit whose record is larger than this goes as an HTTP callout, not on the stream: the
/// stream carries one message after another, and a large record would hold every small call
/// of the worker behind it for its whole transfer. A callout is a stream of its own in the
/// same HTTP/2 connection, whose frames interleave with the others'.
pub const MAX_STREAM_RECORD: usize = 64 * 1024;

/// Whether `call` may travel on the stream.
pub fn fits(call: &StoreCall) -> bool {
    match call {
        StoreCall::Commit { record, .. } => record.len() <= MAX_STREAM_RECORD,
        StoreCall::Begin { .. } | StoreCall::Release { .. } => true,
    }
}

/// How long the filter waits for `call`'s answer: as its callout's timeout.
pub fn timeout_ms(call: &StoreCall, cfg: &Config) -> u64 {
    match call {
        // The store may hold a `begin` for the whole wait before it answers.
        StoreCall::Begin { lock, .. } => cfg.store_timeout_ms + lock.wait_ms,
        StoreCall::Commit { .. } | StoreCall::Release { .. } => cfg.store_timeout_ms,
    }
}

/// The message for `call`, with the caller's `id`, sent at `sent_ms` (milliseconds since the
/// Unix epoch, when the host can tell): a `begin` carries when the filter gives up on it.
pub fn encode(call: &StoreCall, id: u64, cfg: &Config, sent_ms: Option<u64>) -> Vec<u8> {
    let op = match call {
        StoreCall::Begin { key, body_hash, lock, hold } => Op::Begin(wire::Begin {
            key: key.clone(),
            body_hash: body_hash.clone(),
            lock_ttl_ms: lock.ttl_ms,
            wait_ms: lock.wait_ms,
            deadline_ms: sent_ms.map_or(0, |sent| sent.saturating_add(timeout_ms(call, cfg))),
            hold: hold.is_some(),
            retention_s: hold.as_ref().map_or(0, |h| h.retention_s),
            supersede: hold.as_ref().and_then(|h| h.supersede.clone()).unwrap_or_default(),
        }),
        StoreCall::Commit { key, token, body_hash, record, retention_s } => Op::Commit(wire::Commit {
            key: key.clone(),
            token: token.to_string(),
            body_hash: body_hash.clone(),
            retention_s: *retention_s,
            record: record.clone(),
        }),
        StoreCall::Release { key, token, in_doubt } => {
            Op::Release(wire::Release { key: key.clone(), token: token.to_string(), in_doubt: *in_doubt })
        }
    };
    wire::Call { id, op: Some(op) }.encode_to_vec()
}

/// Envoy's `GrpcService` naming the store cluster, serialized, as the host's stream call takes
/// it: given a bare cluster name instead, Envoy first tries to parse the name itself as a
/// `GrpcService`, and a name that happens to parse (`idemstore` does, as an unknown field)
/// leaves the service's target unset, which aborts Envoy. `None` if it would not be UTF-8 (the
/// host takes a string): a name of more than 120 bytes.
pub fn grpc_service(cluster: &str) -> Option<String> {
    #[derive(Clone, PartialEq, Message)]
    struct GrpcService {
        #[prost(message, optional, tag = "1")]
        envoy_grpc: Option<EnvoyGrpc>,
    }
    #[derive(Clone, PartialEq, Message)]
    struct EnvoyGrpc {
        #[prost(string, tag = "1")]
        cluster_name: String,
    }
    let service = GrpcService { envoy_grpc: Some(EnvoyGrpc { cluster_name: cluster.to_string() }) };
    String::from_utf8(service.encode_to_vec()).ok()
}

/// An answer off the stream: its call's id and what it says, still to be read against the
/// call (see [`Answered::begin`] and the others).
#[derive(Debug, Clone, PartialEq)]
pub struct Answered(pub(crate) Outcome);

/// The id and the answer, or `None` for bytes that are no answer (the stream is then not to
/// be trusted: the caller replaces it).
pub fn decode(bytes: &[u8]) -> Option<(u64, Answered)> {
    let answer = wire::Answer::decode(bytes).ok()?;
    Some((answer.id, Answered(answer.outcome?)))
}

impl Answered {
    /// A store failure is what the HTTP API would have answered: `400` or `503`.
    fn failure(&self) -> Option<CalloutFault> {
        match &self.0 {
            Outcome::Failure(f) => Some(CalloutFault::Status(if f.bad_request { 400 } else { 503 })),
            _ => None,
        }
    }

    pub fn begin(&self) -> Result<BeginAnswer, CalloutFault> {
        if let Some(fault) = self.failure() {
            return Err(fault);
        }
        let Outcome::Begun(b) = &self.0 else { return Err(CalloutFault::Garbage("not a begin answer")) };
        let outcome =
            BeginOutcome::parse(b.outcome.as_bytes()).ok_or(CalloutFault::Garbage("unknown outcome"))?;
        Ok(match outcome {
            BeginOutcome::Record => {
                BeginAnswer::Replay(Record::decode(&b.record).map_err(|e| CalloutFault::Garbage(e.0))?)
            }
            BeginOutcome::Locked => {
                if !proto::is_token(b.token.as_bytes()) {
                    return Err(CalloutFault::Garbage("bad token"));
                }
                BeginAnswer::Locked { token: LockToken::Store(b.token.clone()) }
            }
            BeginOutcome::Busy => BeginAnswer::Busy {
                lock_ms: Some(b.lock_remaining_ms).filter(|&ms| ms > 0 && ms <= proto::MAX_LOCK_TTL_MS),
            },
            BeginOutcome::Mismatch => BeginAnswer::Mismatch,
            // Past the deadline it carried: for the filter, a timeout (nothing was locked).
            BeginOutcome::Expired => return Err(CalloutFault::Timeout),
            BeginOutcome::InDoubt => client::in_doubt(
                b.token.as_bytes(),
                Some(b.started_ms),
                Some(b.running_ms).filter(|&ms| ms <= proto::MAX_LOCK_TTL_MS),
            )?,
        })
    }

    /// How long a `record` answer's record still lives in the store, when it says (as
    /// `client::Answer::record_ttl_ms`).
    pub fn record_ttl_ms(&self) -> Option<u64> {
        match &self.0 {
            Outcome::Begun(b) => Some(b.ttl_ms).filter(|&ms| ms > 0 && ms <= proto::MAX_RETENTION_S * 1000),
            _ => None,
        }
    }

    pub fn commit(&self) -> Result<CommitOutcome, CalloutFault> {
        if let Some(fault) = self.failure() {
            return Err(fault);
        }
        match &self.0 {
            Outcome::Committed(name) => {
                CommitOutcome::parse(name.as_bytes()).ok_or(CalloutFault::Garbage("unknown outcome"))
            }
            _ => Err(CalloutFault::Garbage("not a commit answer")),
        }
    }

    pub fn release(&self) -> Result<ReleaseOutcome, CalloutFault> {
        if let Some(fault) = self.failure() {
            return Err(fault);
        }
        match &self.0 {
            Outcome::Released(name) => {
                ReleaseOutcome::parse(name.as_bytes()).ok_or(CalloutFault::Garbage("unknown outcome"))
            }
            _ => Err(CalloutFault::Garbage("not a release answer")),
        }
    }
}

impl StoreAnswer for Answered {
    fn begin(&self) -> Result<BeginAnswer, CalloutFault> {
        Answered::begin(self)
    }
    fn record_ttl_ms(&self) -> Option<u64> {
        Answered::record_ttl_ms(self)
    }
    fn commit(&self) -> Result<CommitOutcome, CalloutFault> {
        Answered::commit(self)
    }
    fn release(&self) -> Result<ReleaseOutcome, CalloutFault> {
        Answered::release(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        Config::from_json(br#"{"store_cluster":"idemstore","store_timeout_ms":700,"lock_wait_ms":300}"#)
            .unwrap()
    }

    fn answer(outcome: Outcome) -> Vec<u8> {
        wire::Answer { id: 9, outcome: Some(outcome) }.encode_to_vec()
    }

    fn begun(outcome: &str) -> wire::Begun {
        wire::Begun { outcome: outcome.into(), ..wire::Begun::default() }
    }

    #[test]
    fn calls_carry_what_their_callouts_carry() {
        let begin = StoreCall::Begin {
            key: "k".repeat(64),
            body_hash: "b".repeat(64),
            lock: crate::store::client::LockTerms { ttl_ms: 30_000, wait_ms: 300 },
            hold: None,
        };
        let call = wire::Call::decode(encode(&begin, 3, &cfg(), Some(5_000)).as_slice()).unwrap();
        assert_eq!(call.id, 3);
        let Some(Op::Begin(b)) = call.op else { panic!("{call:?}") };
        assert_eq!((b.lock_ttl_ms, b.wait_ms, b.deadline_ms), (30_000, 300, 6_000), "sent + 700 + 300");
        let unknown_clock = wire::Call::decode(encode(&begin, 3, &cfg(), None).as_slice()).unwrap();
        assert!(matches!(unknown_clock.op, Some(Op::Begin(wire::Begin { deadline_ms: 0, .. }))));
        let commit = StoreCall::Commit {
            key: "k".into(),
            token: "t".into(),
            body_hash: "h".into(),
            record: vec![0, 255],
            retention_s: 86_400,
        };
        let call = wire::Call::decode(encode(&commit, 4, &cfg(), None).as_slice()).unwrap();
        let Some(Op::Commit(c)) = call.op else { panic!("{call:?}") };
        assert_eq!((c.token.as_str(), c.retention_s, c.record), ("t", 86_400, vec![0, 255]));
        assert_eq!((timeout_ms(&begin, &cfg()), timeout_ms(&commit, &cfg())), (1000, 700));
    }

    #[test]
    fn the_store_cluster_is_named_in_a_grpc_service() {
        let service = grpc_service("idemstore").unwrap();
        assert_eq!(service.as_bytes(), b"\x0a\x0b\x0a\x09idemstore");
        assert!(grpc_service(&"c".repeat(120)).is_some());
        assert_eq!(grpc_service(&"c".repeat(200)), None);
    }

    #[test]
    fn large_commits_stay_off_the_stream() {
        let commit = |n| StoreCall::Commit {
            key: "k".into(),
            token: "t".into(),
            body_hash: "h".into(),
            record: vec![0; n],
            retention_s: 86_400,
        };
        assert!(fits(&commit(MAX_STREAM_RECORD)));
        assert!(!fits(&commit(MAX_STREAM_RECORD + 1)));
    }

    #[test]
    fn answers_read_as_callout_answers_do() {
        let rec = Record { status: 201, body: b"{}".to_vec(), ..Record::default() };
        let bytes = answer(Outcome::Begun(wire::Begun {
            record: rec.encode(),
            ttl_ms: 86_399_000,
            ..begun("record")
        }));
        let (id, a) = decode(&bytes).unwrap();
        assert_eq!((id, a.begin(), a.record_ttl_ms()), (9, Ok(BeginAnswer::Replay(rec)), Some(86_399_000)));
        let (_, a) =
            decode(&answer(Outcome::Begun(wire::Begun { token: "tok1".into(), ..begun("locked") }))).unwrap();
        assert_eq!(a.begin(), Ok(BeginAnswer::Locked { token: "tok1".into() }));
        for (left, expected) in [(2500, Some(2500)), (0, None), (3_600_001, None)] {
            let b = wire::Begun { lock_remaining_ms: left, ..begun("busy") };
            let (_, a) = decode(&answer(Outcome::Begun(b))).unwrap();
            assert_eq!(a.begin(), Ok(BeginAnswer::Busy { lock_ms: expected }));
        }
        let (_, a) = decode(&answer(Outcome::Begun(begun("expired")))).unwrap();
        assert_eq!(a.begin(), Err(CalloutFault::Timeout));
        let (_, a) = decode(&answer(Outcome::Committed("stored".into()))).unwrap();
        assert_eq!(a.commit(), Ok(CommitOutcome::Stored));
        let (_, a) = decode(&answer(Outcome::Released("released".into()))).unwrap();
        assert_eq!(a.release(), Ok(ReleaseOutcome::Released));
    }

    #[test]
    fn anything_else_is_a_fault() {
        let failure = |bad_request| Outcome::Failure(wire::Failure { bad_request, reason: "x".into() });
        let (_, a) = decode(&answer(failure(true))).unwrap();
        assert_eq!((a.begin(), a.commit()), (Err(CalloutFault::Status(400)), Err(CalloutFault::Status(400))));
        let (_, a) = decode(&answer(failure(false))).unwrap();
        assert_eq!(a.release(), Err(CalloutFault::Status(503)));
        let (_, a) = decode(&answer(Outcome::Committed("stored".into()))).unwrap();
        assert_eq!(a.begin(), Err(CalloutFault::Garbage("not a begin answer")));
        assert_eq!(a.release(), Err(CalloutFault::Garbage("not a release answer")));
        let (_, a) = decode(&answer(Outcome::Begun(begun("what")))).unwrap();
        assert_eq!(a.begin(), Err(CalloutFault::Garbage("unknown outcome")));
        let (_, a) =
            decode(&answer(Outcome::Begun(wire::Begun { token: "a b".into(), ..begun("locked") }))).unwrap();
        assert_eq!(a.begin(), Err(CalloutFault::Garbage("bad token")));
        let (_, a) =
            decode(&answer(Outcome::Begun(wire::Begun { record: b"junk".to_vec(), ..begun("record") })))
                .unwrap();
        assert_eq!(a.begin(), Err(CalloutFault::Garbage("bad magic")));
        assert_eq!(decode(b"\xff\xff\xff"), None);
        assert_eq!(decode(&wire::Answer { id: 1, outcome: None }.encode_to_vec()), None);
    }
}
