//! The store's answer to `begin`: replay (or `422` / `406`), `409`, a lock to run under, or a
//! fault the request fails open or closed on.

use super::*;

impl Machine {
    pub fn on_begin_answer(&mut self, answer: Result<BeginAnswer, CalloutFault>) -> Vec<Effect> {
        match std::mem::replace(&mut self.state, State::Done) {
            State::Beginning { key, body_hash } => match answer {
                Ok(BeginAnswer::Replay(record)) if self.grpc.is_some() => self.grpc_replay(record),
                Ok(BeginAnswer::Replay(record)) => {
                    let (answer, metric) =
                        replay::answer(&self.cfg, record, self.print.as_ref(), &self.accept_encoding);
                    vec![Effect::answer(answer), Effect::Count(metric)]
                }
                Ok(BeginAnswer::Mismatch) => vec![
                    Effect::Refuse(problem::key_reused(&self.cfg, &fingerprint::Differs::Body)),
                    Effect::Count(Metric::Mismatched),
                ],
                Ok(BeginAnswer::Withheld) => {
                    let retry_ms = self.cfg.breaker_open_ms.max(1000);
                    vec![
                        Effect::Refuse(problem::answer_withheld(&self.cfg, retry_ms)),
                        Effect::Count(Metric::Unavailable),
                    ]
                }
                Ok(BeginAnswer::Busy { lock_ms }) => {
                    // What the store says is left of the holder's lock; never beyond its TTL.
                    let left = lock_ms.unwrap_or(1).min(self.cfg.lock_ttl_ms);
                    let problem = match self.cfg.inbox() {
                        Some(_) => problem::message_in_flight(&self.cfg, left),
                        None => problem::in_flight(&self.cfg, left),
                    };
                    vec![Effect::Refuse(problem), Effect::Count(Metric::Conflicted)]
                }
                Ok(BeginAnswer::InDoubt { token, running_ms, .. }) => {
                    self.in_doubt(key, body_hash, token, running_ms)
                }
                Ok(BeginAnswer::Locked { token }) => match self.detach.take() {
                    Some(d) => {
                        let call = UpstreamCall {
                            cluster: d.cluster,
                            headers: d.headers,
                            body: d.body,
                            timeout_ms: self.cfg.detached_timeout_ms,
                        };
                        self.state = State::Detached { key, body_hash, token, gone: false };
                        vec![
                            Effect::Upstream(call),
                            Effect::Count(Metric::Executed),
                            Effect::Count(Metric::Detached),
                        ]
                    }
                    None => {
                        self.state = State::Executing { key, body_hash, token };
                        vec![Effect::Resume, Effect::Count(Metric::Executed)]
                    }
                },
                // The host logged and counted the fault itself.
                Err(_) => self.give_up(),
            },
            State::Orphaned { key } => match answer {
                Ok(BeginAnswer::Locked { token }) => release(key, token),
                _ => vec![],
            },
            other => {
                self.state = other;
                vec![]
            }
        }
    }

    /// The guarantee cannot be had (the store failed, or the body could not be read) before the
    /// upstream ran: it is given up (counted as degraded) by running unguarded, or by refusing.
    pub(super) fn give_up(&mut self) -> Vec<Effect> {
        self.state = State::Done;
        match self.cfg.failure_mode {
            FailureMode::Open => vec![Effect::Resume, Effect::Count(Metric::Degraded)],
            FailureMode::Closed => vec![
                Effect::Refuse(problem::store_unavailable(&self.cfg)),
                Effect::Count(Metric::Degraded),
                Effect::Count(Metric::Unavailable),
            ],
        }
    }
}
