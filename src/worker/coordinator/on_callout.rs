//! The coordinator's callout events: a dispatched callout the host could not send, and a
//! callout's answer, read as its call's (a store call, a batch of commits, a detached
//! execution) and settled ([`settle`](super::settle)). A batch of commits ends as each of its
//! commits would have alone, and an idemstore that does not know `commits` gets every commit
//! alone from then on. The store stream's calls end in
//! [`on_store_stream`](super::on_store_stream) instead, settled the same way.

use idem_protocol::CommitOutcome;

use super::{Concluded, Coordinator};
use crate::request::detached::UpstreamAnswer;
use crate::store::client::{Answer, CallKind, CalloutFault};
use crate::worker::env::Env;
use crate::worker::job::{Call, Job};

impl Coordinator {
    /// The host carried out a [`Command::Dispatch`]: `token` is Envoy's, `None` if it refused.
    ///
    /// [`Command::Dispatch`]: crate::worker::command::Command::Dispatch
    pub fn on_dispatched(&mut self, job: u64, token: Option<u32>, env: &dyn Env) {
        self.enter_root();
        let Some(job) = self.callouts.dispatched(job, token, env, &mut self.commands) else { return };
        if matches!(job.call, Call::Batch(_)) {
            self.batch_answered(job, Err(CalloutFault::Dispatch), env);
            return;
        }
        let outcome = Concluded::fault(&job.call, CalloutFault::Dispatch);
        self.finish(job, outcome, env);
    }

    /// A callout answered (with no headers: reset or refused).
    pub fn on_callout_answer(
        &mut self,
        token: u32,
        headers: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
        env: &dyn Env,
    ) {
        self.on_callout_answer_with_trailers(token, headers, body, Vec::new(), env);
    }

    /// [`Self::on_callout_answer`] with the answer's trailers (a detached gRPC call's).
    pub fn on_callout_answer_with_trailers(
        &mut self,
        token: u32,
        headers: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
        trailers: Vec<(String, Vec<u8>)>,
        env: &dyn Env,
    ) {
        self.enter_root();
        let Some(job) = self.callouts.answered(token, env, &mut self.commands) else { return };
        let now_us = env.now_us();
        let answer = Answer { headers: &headers, body: &body };
        let kind = match &job.call {
            Call::Store(c) => Some(c.kind()),
            Call::Batch(_) => Some(CallKind::Commit),
            Call::Upstream(_) => None,
        };
        if let Some(kind) = kind {
            self.latency(kind, job.sent_us, now_us);
        }
        let outcome = match &job.call {
            Call::Batch(items) => {
                let answer = answer.commits(items.len());
                self.batch_answered(job, answer, env);
                return;
            }
            Call::Store(call) => self.store_answered(call, &answer, job.sent_us, now_us),
            Call::Upstream(_) => Concluded::Upstream(
                UpstreamAnswer::decode(headers, body).map(|a| UpstreamAnswer { trailers, ..a }),
            ),
        };
        self.finish(job, outcome, env);
    }

    /// A `commits` callout ended: each commit in it as if it had been sent alone (a fault of
    /// the whole call is each one's fault; its retry goes alone). The breaker hears of it once.
    fn batch_answered(
        &mut self,
        job: Job,
        answer: Result<Vec<Result<CommitOutcome, CalloutFault>>, CalloutFault>,
        env: &dyn Env,
    ) {
        let Call::Batch(items) = job.call else { return };
        if let Err(CalloutFault::Status(status @ (404 | 405))) = answer {
            log::warn!(
                "the store answered {status} to {}: an idemstore without it (older than this \
                 filter); commits go one by one from now on",
                idem_protocol::PATH_COMMITS
            );
            self.callouts.stop_batching();
            for item in items {
                self.submit(item, env);
            }
            return;
        }
        self.path.observe(answer.as_ref().err().copied(), env);
        match answer {
            Ok(outcomes) => {
                for (item, outcome) in items.into_iter().zip(outcomes) {
                    self.settle(item, Concluded::Commit(outcome), env);
                }
            }
            Err(fault) => {
                for item in items {
                    self.settle(item, Concluded::Commit(Err(fault)), env);
                }
            }
        }
    }
}
