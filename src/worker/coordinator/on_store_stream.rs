//! The coordinator's side of the store stream (`store_transport: stream`): Envoy's events for
//! the worker's gRPC streams to idemstore, handed to [`StoreStream`], and the calls they end,
//! each settled as its callout's answer or fault would have been.

use std::collections::VecDeque;

use super::{Concluded, Coordinator};
use crate::request::metrics::Metric;
use crate::worker::command::Command;
use crate::worker::env::Env;
use crate::worker::job::Call;
use crate::worker::store_stream::{Ended, StoreStream};

impl Coordinator {
    /// The host carried out a [`Command::OpenStream`]: `token` is Envoy's, `None` if it refused.
    pub fn on_stream_opened(&mut self, token: Option<u32>, env: &dyn Env) {
        self.enter_root();
        self.on_store_stream(env, |stream, now_ms, out| {
            let ended = stream.opened(token, now_ms, out);
            if token.is_some() {
                out.push_back(Command::Count(Metric::StoreStreamsOpened));
            }
            ended
        });
    }

    /// A message came on the store stream `token`.
    pub fn on_stream_message(&mut self, token: u32, message: &[u8], env: &dyn Env) {
        self.enter_root();
        self.on_store_stream(env, |stream, now_ms, out| stream.message(token, message, now_ms, out));
    }

    /// The store stream `token` closed, with this gRPC status.
    pub fn on_stream_closed(&mut self, token: u32, status: u32, env: &dyn Env) {
        self.enter_root();
        self.on_store_stream(env, |stream, now_ms, out| stream.closed(token, status, now_ms, out));
    }

    /// A [`Command::StreamSend`] on the store stream `token` failed.
    pub fn on_stream_send_failed(&mut self, token: u32, env: &dyn Env) {
        self.on_store_stream(env, |stream, now_ms, out| stream.send_failed(token, now_ms, out));
    }

    /// An event of the store stream, then what it ended.
    fn on_store_stream(
        &mut self,
        env: &dyn Env,
        event: impl FnOnce(&mut StoreStream, u64, &mut VecDeque<Command>) -> Vec<Ended>,
    ) {
        let now_ms = env.now_ms().unwrap_or(0);
        let Some(stream) = self.callouts.stream() else { return };
        let ended = event(stream, now_ms, &mut self.commands);
        self.stream_ended(ended, env);
    }

    /// Calls on the store stream ended: each as its callout's answer or fault would have.
    pub(super) fn stream_ended(&mut self, ended: Vec<Ended>, env: &dyn Env) {
        let now_us = env.now_us();
        for end in ended {
            let (Ended::Failed(job, _) | Ended::Answered(job, _)) = &end;
            // As a callout's: the time to its end, if it went out at all.
            if let Call::Store(call) = &job.call {
                self.latency(call.kind(), job.sent_us, now_us);
            }
            let (job, outcome) = match end {
                Ended::Failed(job, fault) => {
                    let outcome = Concluded::fault(&job.call, fault);
                    (job, outcome)
                }
                Ended::Answered(job, answer) => {
                    // Only store calls go on the stream.
                    let Call::Store(call) = &job.call else { continue };
                    let outcome = self.store_answered(call, &answer, job.sent_us, now_us);
                    (job, outcome)
                }
            };
            self.finish(job, outcome, env);
        }
    }
}
