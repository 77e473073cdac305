//! The store stream of a [`World`] (`store_transport: stream`): Envoy's gRPC stream as the host
//! gives it (a token, messages in, messages out, a close) and idemstore behind it, answering
//! each message in any order, with faults: the stream reset mid-call (each call on it done by
//! the store or not), an answer that comes late (after the filter's deadline swept it), bytes
//! that are no answer, a stream that cannot open. The store's work is the callouts' (`store`):
//! each message becomes the callout it stands for, and its answer the message.

use idem_protocol::stream::{self as pb, Op, Outcome};
use prost::Message as _;

use super::*;

/// A store call on the stream, not yet answered.
pub(super) struct WireCall {
    pub token: u32,
    pub id: u64,
    /// The callout it stands for.
    pub call: Dispatch,
    /// A commit or release: the store lock it names and its end's place among the lock's ends,
    /// noted when sent (the filter may give up on it before the answer comes).
    pub end: Option<(String, usize)>,
}

/// The callout a stream message stands for, for the simulated store.
fn as_callout(cluster: &str, message: &[u8]) -> Option<(u64, Dispatch)> {
    let call = pb::Call::decode(message).ok()?;
    let h = |n: &str, v: String| (n.to_string(), v);
    let (headers, body) = match call.op? {
        Op::Begin(b) => {
            let mut headers = vec![
                h(":path", proto::PATH_BEGIN.into()),
                h(proto::HEADER_KEY, b.key),
                h(proto::HEADER_BODY_HASH, b.body_hash),
                h(proto::HEADER_LOCK_TTL_MS, b.lock_ttl_ms.to_string()),
                h(proto::HEADER_WAIT_MS, b.wait_ms.to_string()),
            ];
            if b.deadline_ms > 0 {
                headers.push(h(proto::HEADER_DEADLINE_MS, b.deadline_ms.to_string()));
            }
            (headers, None)
        }
        Op::Commit(c) => (
            vec![
                h(":path", proto::PATH_COMMIT.into()),
                h(proto::HEADER_KEY, c.key),
                h(proto::HEADER_TOKEN, c.token),
                h(proto::HEADER_BODY_HASH, c.body_hash),
                h(proto::HEADER_RETENTION_S, c.retention_s.to_string()),
            ],
            Some(c.record),
        ),
        Op::Release(r) => (
            vec![
                h(":path", proto::PATH_RELEASE.into()),
                h(proto::HEADER_KEY, r.key),
                h(proto::HEADER_TOKEN, r.token),
            ],
            None,
        ),
    };
    Some((call.id, Dispatch { job: 0, cluster: cluster.to_string(), headers, body, timeout_ms: 0 }))
}

/// The stream answer for a callout's answer.
fn as_answer(id: u64, call: &Dispatch, (headers, body): Message) -> Vec<u8> {
    let h = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
            .unwrap_or_default()
    };
    let outcome = h(proto::HEADER_OUTCOME);
    let outcome = match header(&call.headers, ":path") {
        Some(proto::PATH_BEGIN) => Outcome::Begun(pb::Begun {
            outcome,
            record: body,
            ttl_ms: h(proto::HEADER_TTL_MS).parse().unwrap_or(0),
            token: h(proto::HEADER_TOKEN),
            lock_remaining_ms: 0,
            started_ms: h(proto::HEADER_STARTED_MS).parse().unwrap_or(0),
            running_ms: h(proto::HEADER_RUNNING_MS).parse().unwrap_or(0),
        }),
        Some(proto::PATH_COMMIT) => Outcome::Committed(outcome),
        _ => Outcome::Released(outcome),
    };
    pb::Answer { id, outcome: Some(outcome) }.encode_to_vec()
}

impl World {
    /// The host's part of [`Command::OpenStream`]: a token, or (a fault) none.
    pub(super) fn open_stream(&mut self) -> Result<(), String> {
        if self.callback != Callback::Root {
            return self.violation("the store stream opened from a stream callback".into());
        }
        let token = if self.rng.chance(self.fault_rate / 3) {
            self.tally.dispatch_failures += 1;
            self.trace.push("  store stream did not open".into());
            None
        } else {
            self.next_token += 1;
            self.open_tokens.push(self.next_token);
            self.tally.streams_opened += 1;
            self.trace.push(format!("  store stream {} open", self.next_token));
            Some(self.next_token)
        };
        // The calls waiting for it fail with it (their keys concluded here).
        if token.is_none() {
            let waiting = self.coord.stream_waiting_keys();
            if let Scope::Keys(keys) = &mut self.scope {
                keys.extend(waiting);
            }
        }
        self.coord.on_stream_opened(token, &self.clock);
        Ok(())
    }

    /// The host's part of [`Command::StreamSend`]: the message reaches the store.
    pub(super) fn stream_send(&mut self, token: u32, message: Vec<u8>) -> Result<(), String> {
        if !self.open_tokens.contains(&token) {
            return self.violation(format!("a message on store stream {token}, which is not open"));
        }
        let Some((id, call)) = as_callout(&self.cfg.store_cluster, &message) else {
            return self.violation("a store stream message that is no call".into());
        };
        if self.wire.iter().any(|c| c.token == token && c.id == id) {
            return self.violation(format!("call id {id} twice in flight on store stream {token}"));
        }
        self.trace.push(format!("  send {token}/{id}: {}", describe(&call)));
        self.note_end(&call, false)?;
        let lock = header(&call.headers, proto::HEADER_TOKEN).unwrap_or_default().to_string();
        let end = self.granted.get(&lock).map(|g| (lock, g.ends.len().saturating_sub(1)));
        self.wire.push(WireCall { token, id, call, end });
        Ok(())
    }

    /// The host's part of [`Command::CancelStream`]: no callback of it follows; the calls on it
    /// were done by the store or not, and their answers are lost.
    pub(super) fn cancel_stream(&mut self, token: u32) -> Result<(), String> {
        if !self.open_tokens.contains(&token) {
            return self.violation(format!("store stream {token} cancelled, which is not open"));
        }
        self.trace.push(format!("  store stream {token} cancelled"));
        self.open_tokens.retain(|&t| t != token);
        self.lose_calls(token)?;
        Ok(())
    }

    /// The calls on stream `token` end without an answer the filter reads: each done by the
    /// store or not. Returns their keys.
    fn lose_calls(&mut self, token: u32) -> Result<Vec<String>, String> {
        let (lost, kept): (Vec<WireCall>, Vec<WireCall>) =
            std::mem::take(&mut self.wire).into_iter().partition(|c| c.token == token);
        self.wire = kept;
        for c in &lost {
            if self.rng.chance(50) {
                self.store_answers(&c.call, false)?;
            }
        }
        Ok(lost.iter().map(|c| call_key(&c.call).to_string()).collect())
    }

    /// Answers one call on the stream, the `i`-th in flight, sometimes with a fault.
    pub(super) fn answer_wire(&mut self, i: usize) -> Result<(), String> {
        // 0: answered; 1: the stream resets; 2: not yet (the answer comes later, perhaps after
        // the filter's deadline); 3: bytes that are no answer.
        let fault = if self.rng.chance(self.fault_rate) { 1 + self.rng.below(3) } else { 0 };
        let token = self.wire[i].token;
        self.callback = Callback::Root;
        match fault {
            0 => {
                let WireCall { token, id, call, end } = self.wire.swap_remove(i);
                let awaited = self.coord.stream_awaits(id);
                if !awaited {
                    self.tally.late_answers += 1;
                }
                if let (Some((lock, at)), true) = (end, awaited) {
                    if let Some(e) = self.granted.get_mut(&lock).and_then(|g| g.ends.get_mut(at)) {
                        e.1 = true;
                    }
                }
                let answer = self.store_answers(&call, awaited)?;
                let key = call_key(&call).to_string();
                self.trace.push(format!("answer {token}/{id}{}", if awaited { "" } else { " (late)" }));
                self.scope = Scope::Keys(vec![key]);
                self.coord.on_stream_message(token, &as_answer(id, &call, answer), &self.clock);
            }
            1 => {
                self.tally.faults += 1;
                self.trace.push(format!("store stream {token} resets"));
                self.open_tokens.retain(|&t| t != token);
                let keys = self.lose_calls(token)?;
                self.scope = Scope::Keys(keys);
                self.coord.on_stream_closed(token, 14, &self.clock);
            }
            2 => return Ok(()),
            _ => {
                self.tally.faults += 1;
                self.trace.push(format!("store stream {token} carries garbage"));
                // The filter gives up on the stream: every call on it concludes.
                let keys = self
                    .wire
                    .iter()
                    .filter(|c| c.token == token)
                    .map(|c| call_key(&c.call).to_string())
                    .collect();
                self.scope = Scope::Keys(keys);
                self.coord.on_stream_message(token, b"\xff\xff\xff not an answer", &self.clock);
            }
        }
        self.commands()
    }
}
