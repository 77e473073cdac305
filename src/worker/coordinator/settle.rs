//! What the end of a call means, whichever way it ended: a callout's answer or fault
//! ([`on_callout`](super::on_callout)), a call's on the store stream
//! ([`on_store_stream`](super::on_store_stream)), or a queued call whose wake-up failed. `finish`
//! tells the breaker of a store call's fault; `settle` acts on the end for the call's stream
//! (the answer fed to its machine; for a `begin` the store failed, the local fallback's answer;
//! a lock the store granted, mirrored by the local store or handed back), for the store (a
//! failed call retried as the store path says, a lock no stream can use released), for the
//! counters (a commit stored or not), and for a hand-back (its record stays local until the
//! store has it). In a file of its own because every way a call ends comes here, and it needs
//! none of the event plumbing around it.

use idem_protocol::CommitOutcome;

use super::{Concluded, Coordinator};
use crate::request::machine::{Effect, Machine};
use crate::request::metrics::Metric;
use crate::store::client::{BeginAnswer, StoreCall};
use crate::worker::command::Command;
use crate::worker::env::Env;
use crate::worker::job::{Call, Job};
use crate::worker::store_path::Presence;

impl Coordinator {
    /// Acts on the end of a callout, whether it answered or could not be sent.
    pub(super) fn finish(&mut self, job: Job, outcome: Concluded, env: &dyn Env) {
        if matches!(job.call, Call::Store(_)) {
            self.path.observe(outcome.store_fault(), env);
        }
        self.settle(job, outcome, env);
    }

    /// What the end of a callout means for its stream, its lock and the local fallback.
    pub(super) fn settle(&mut self, job: Job, outcome: Concluded, env: &dyn Env) {
        if job.hand_back {
            self.hand_back_answered(&job, &outcome, env);
            return;
        }
        let mut effects = Vec::new();
        if let Call::Store(call) = &job.call {
            match outcome.store_fault() {
                None => self.path.store_answered(),
                Some(fault) => {
                    log::warn!("{} (try {}): {fault}", job.label(), job.attempt + 1);
                    effects.push(Effect::Count(Metric::StoreErrors));
                    if let Some(next) = self.path.after_fault(call, job.attempt, env, &mut self.commands) {
                        let attempt = if next.kind() == call.kind() { job.attempt + 1 } else { 0 };
                        let retry = Job {
                            attempt,
                            ..Job::new(job.stream, job.request_id.clone(), Call::Store(next))
                        };
                        self.submit(retry, env);
                    }
                }
            }
        }
        let presence = self.presence(job.stream);
        let stream_alive = match outcome {
            Concluded::Begin(answer) => match (&job.call, answer) {
                (Call::Store(StoreCall::Begin { key, body_hash, .. }), Err(fault))
                    if presence != Presence::Unknown =>
                {
                    let outcome = self.path.begin_failed(job.stream, key, body_hash, fault, presence, env);
                    let (more, alive) = self.local_outcome(job.stream, outcome, None);
                    effects.extend(more);
                    alive
                }
                (Call::Store(StoreCall::Begin { key, body_hash, .. }), Ok(BeginAnswer::Locked { token }))
                    if presence != Presence::Unknown =>
                {
                    let (more, alive) = match self.path.adopt(job.stream, key, body_hash, &token, env) {
                        None => self.answer_begin(job.stream, Ok(BeginAnswer::Locked { token }), vec![]),
                        Some((outcome, call)) => {
                            let hand_back = matches!(call, StoreCall::Commit { .. });
                            let give_back = Job { hand_back, ..self.job(job.stream, Call::Store(call)) };
                            self.submit(give_back, env);
                            self.local_outcome(job.stream, outcome, None)
                        }
                    };
                    effects.extend(more);
                    alive
                }
                (_, answer) if presence != Presence::Unknown => {
                    self.feed(&job, &mut effects, |m| m.on_begin_answer(answer))
                }
                // Entries outlive their pending begin, so this is not expected; never leak a lock.
                (Call::Store(call), Ok(BeginAnswer::Locked { token })) => {
                    effects.push(Effect::Store(StoreCall::Release {
                        key: call.key().to_string(),
                        token,
                        in_doubt: false,
                    }));
                    false
                }
                _ => false,
            },
            Concluded::Upstream(answer) => {
                if let Err(f) = &answer {
                    log::warn!("{}: {f}", job.label());
                }
                let now_ms = env.now_ms();
                self.feed(&job, &mut effects, |m| m.on_upstream_answer(answer, now_ms))
            }
            Concluded::Commit(result) => {
                if let (Call::Store(call), Ok(_)) = (&job.call, &result) {
                    self.path.committed(call);
                }
                match result {
                    Ok(CommitOutcome::Stored | CommitOutcome::Late) => {
                        effects.push(Effect::Count(Metric::Stored))
                    }
                    Ok(CommitOutcome::Exists) => {
                        log::info!("{}: an earlier record was kept", job.label());
                        effects.push(Effect::Count(Metric::CommitFailed));
                    }
                    // Counted once, when the retry is exhausted and the lock is given back.
                    Err(_) if job.attempt == 0 => {}
                    Err(_) => effects.push(Effect::Count(Metric::CommitFailed)),
                }
                false
            }
            Concluded::Release(_) => false,
        };
        self.apply(job.stream, effects, stream_alive, env);
    }

    /// A hand-back commit ended: the record stays local until the store has it.
    fn hand_back_answered(&mut self, job: &Job, outcome: &Concluded, env: &dyn Env) {
        let ok = matches!(outcome, Concluded::Commit(Ok(_)));
        match outcome.store_fault() {
            None if ok => self.commands.push_back(Command::Count(Metric::HandedBack)),
            fault => log::info!("{}: hand-back not taken ({fault:?}), offered again", job.label()),
        }
        if let Call::Store(call) = &job.call {
            self.path.handed_back(call.key(), ok, env);
        }
    }

    /// Feeds an answer to the stream's machine (if Envoy has not destroyed it yet, the answer is
    /// for the client too) and forgets a destroyed stream once nothing of it is pending.
    fn feed(
        &mut self,
        job: &Job,
        effects: &mut Vec<Effect>,
        event: impl FnOnce(&mut Machine) -> Vec<Effect>,
    ) -> bool {
        let Some(entry) = self.streams.get_mut(&job.stream) else {
            // Entries outlive their pending calls: not expected.
            log::error!("{}: answer for an unknown stream", job.label());
            return false;
        };
        effects.extend(event(&mut entry.machine));
        let gone = entry.gone;
        if gone && entry.machine.is_settled() {
            self.streams.remove(&job.stream);
        }
        !gone
    }
}
