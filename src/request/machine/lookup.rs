//! A retry of an in-doubt key (`unknown_outcome: hold`): `409` `outcome-unknown`, or first the
//! application's word (`outcome_lookup`). A `2xx` says the first attempt committed: that answer
//! becomes the key's record, committed under the first attempt's token as its own late commit
//! would be, and is replayed. A `404` says it did not, and is believed only once the first
//! attempt can no longer be running: then the retry asks the store for the lock again,
//! superseding that attempt, and runs as a first attempt. Anything else leaves the key in doubt.

use super::*;

/// The in-doubt attempt a lookup was about (see [`State::Looking`]).
pub(super) struct Looked {
    pub key: String,
    pub body_hash: String,
    pub token: LockToken,
    pub running_ms: u64,
    pub gone: bool,
}

impl Machine {
    /// The store answered `in-doubt` for this request's key.
    pub(super) fn in_doubt(
        &mut self,
        key: String,
        body_hash: String,
        token: LockToken,
        running_ms: u64,
    ) -> Vec<Effect> {
        let call = match (&self.cfg.outcome_lookup, &self.lookup_at, &self.grpc) {
            // A gRPC call's answer is a message and trailers, not what a lookup path returns.
            (Some(lookup), Some(at), None) => {
                let mut headers = vec![
                    (":method".to_string(), "GET".to_string()),
                    (":path".to_string(), lookup.path_for(&key)),
                    (":authority".to_string(), at.authority.clone()),
                ];
                if let Some(name) = &self.cfg.store_key_header {
                    headers.push((name.clone(), key.clone()));
                }
                UpstreamCall {
                    cluster: at.cluster.clone(),
                    headers,
                    body: Vec::new(),
                    timeout_ms: self.cfg.store_timeout_ms,
                }
            }
            _ => return self.outcome_unknown(running_ms),
        };
        self.state = State::Looking { key, body_hash, token, running_ms, gone: false };
        vec![Effect::Lookup(call)]
    }

    fn outcome_unknown(&mut self, running_ms: u64) -> Vec<Effect> {
        self.state = State::Done;
        vec![
            Effect::Refuse(problem::outcome_unknown(&self.cfg, running_ms)),
            Effect::Count(Metric::OutcomeUnknown),
        ]
    }

    /// The application's answer to the lookup.
    pub(super) fn looked_up(
        &mut self,
        looked: Looked,
        answer: Result<UpstreamAnswer, CalloutFault>,
        now_ms: Option<u64>,
    ) -> Vec<Effect> {
        let running_ms = looked.running_ms;
        let answer = match answer {
            Ok(a) => a,
            Err(fault) => {
                log::info!("outcome_lookup: no answer ({fault}): the key stays in doubt");
                return self.unresolved(looked);
            }
        };
        match answer.status {
            // A committed answer becomes the record, whether or not the client is still there.
            200..=299 => self.committed(looked, answer, now_ms),
            // Nobody to run it for.
            _ if looked.gone => self.unresolved(looked),
            404 if running_ms == 0 => {
                let Looked { key, body_hash, token, .. } = looked;
                self.state = State::Beginning { key: key.clone(), body_hash: body_hash.clone() };
                let hold =
                    Hold { retention_s: self.cfg.retention_seconds, supersede: Some(token.to_string()) };
                let call =
                    StoreCall::Begin { key, body_hash, lock: LockTerms::of(&self.cfg), hold: Some(hold) };
                vec![Effect::Store(call), Effect::Count(Metric::ResolvedToRun)]
            }
            status => {
                if status != 404 {
                    log::info!("outcome_lookup answered {status}: the key stays in doubt");
                }
                self.unresolved(looked)
            }
        }
    }

    /// The key stays in doubt: `409` to a client still there.
    fn unresolved(&mut self, looked: Looked) -> Vec<Effect> {
        if looked.gone {
            self.state = State::Done;
            return vec![];
        }
        self.outcome_unknown(looked.running_ms)
    }

    /// The application says the first attempt committed, with `answer`: replayed to this retry
    /// (unless its client is gone) and, when a record can hold it, committed as the key's record.
    fn committed(&mut self, looked: Looked, answer: UpstreamAnswer, now_ms: Option<u64>) -> Vec<Effect> {
        let Looked { key, body_hash, token, gone, .. } = looked;
        let values_of =
            |name: &str| answer.headers.iter().filter(|(n, _)| n == name).map(|(_, v)| v.clone()).collect();
        let (head, headers) = self.answer_head(answer.status, Some(answer.body.len() as u64), values_of);
        let keep = keep::decide(&self.cfg, &head);
        let body_omitted = keep != Keep::Full;
        let record = Record {
            status: answer.status,
            headers,
            body: if body_omitted { Vec::new() } else { answer.body.clone() },
            body_omitted,
            print: self.print.clone(),
            trailers: None,
            expires_ms: self.expires_ms(now_ms),
        };
        let mut effects = Vec::new();
        if keep != Keep::Release {
            effects.push(self.commit(key, token, body_hash, record.encode()));
        }
        if !gone {
            // The replay shows the application's body even when the record cannot keep it.
            let shown = Record { body: answer.body, body_omitted: false, ..record };
            let (response, _) = replay::answer(&self.cfg, shown, self.print.as_ref(), &self.accept_encoding);
            effects.push(Effect::answer(response));
        }
        effects.push(Effect::Count(Metric::ResolvedByLookup));
        self.state = State::Done;
        effects
    }
}
