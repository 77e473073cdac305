//! gRPC replays, on both sides of the second hop.
//!
//! Envoy's local reply to a gRPC request is trailers-only: it cannot carry a message and
//! trailers. So the guard re-routes a retry whose record holds a message ([`Effect::Hop`]): the
//! record becomes the request's body, [`grpc::HOP_HEADER`] selects the route to an internal
//! listener, and there this filter, in `"mode": "grpc_replay"`, sees a request that is not gRPC,
//! answers the record's message as a plain local reply and adds its trailers as the reply goes
//! by. The first hop forwards headers, message and trailers as they are.

use super::*;

impl Machine {
    /// The guard: the answer for a gRPC retry whose key has `record`.
    pub(super) fn grpc_replay(&self, record: Record) -> Vec<Effect> {
        if let Some(refusal) = replay::made_for_another(&self.cfg, &record, self.print.as_ref()) {
            return vec![Effect::Refuse(refusal), Effect::Count(Metric::Mismatched)];
        }
        if record.trailers.is_none() {
            // An HTTP answer under this key (the same path, posted without gRPC).
            let detail = "This Idempotency-Key was already used with a request that was not a gRPC call.";
            return vec![
                Effect::Refuse(problem::reused(&self.cfg, detail)),
                Effect::Count(Metric::Mismatched),
            ];
        }
        vec![self.grpc_answer(record, true), Effect::Count(Metric::Replayed)]
    }

    /// How the client gets a gRPC answer the filter holds (a record with trailers): a local
    /// reply when it has no message, else the second hop. `replay`: it is a replay, and says so.
    pub(super) fn grpc_answer(&self, mut record: Record, replay: bool) -> Effect {
        let trailers = record.trailers.take().unwrap_or_default();
        let content_type = record
            .headers
            .iter()
            .find(|(n, _)| n == "content-type")
            .map_or_else(|| "application/grpc".to_string(), |(_, v)| v.clone());
        let mut metadata: Vec<(String, String)> =
            record.headers.into_iter().filter(|(n, _)| n != "content-type").collect();
        if replay {
            metadata.push(replay::marker(&self.cfg));
        }
        if record.body_omitted {
            metadata.push((self.cfg.body_omitted_header.clone(), "true".to_string()));
            let message = "answer-omitted: This call already ran; its answer was too large to keep \
                           (max_record_bytes), so it is not replayed.";
            return Effect::Respond(problem::grpc_status(grpc::ALREADY_EXISTS, message, metadata));
        }
        let mut headers = vec![("content-type".to_string(), content_type)];
        if record.body.is_empty() {
            // A trailers-only answer: a local reply says it as it was.
            headers.extend(trailers);
            headers.extend(metadata);
            return Effect::Respond(LocalResponse { status: 200, headers, body: Vec::new() });
        }
        // The marker travels in the record: the replay listener needs no configuration.
        headers.extend(metadata);
        let hop = Record { headers, trailers: Some(trailers), print: None, ..record };
        let fallback = problem::replay_failed(
            &self.cfg,
            grpc::UNAVAILABLE,
            "The stored answer could not be replayed; retry with the same key.",
        );
        Effect::Hop { record: hop.encode(), body_len: self.request_len, fallback }
    }

    /// The most the replay listener reads: a record whose message is as large as its own
    /// `max_record_bytes` lets a guard keep (set it to the largest of its guards'), with its
    /// headers and trailers. Nothing else reaches it but what a client could make a guard store.
    fn max_hop_body(&self) -> usize {
        self.cfg.max_record_bytes + record::MAX_FRAMING
    }

    /// The replay listener, on the request headers: only a re-routed retry is answered.
    pub(super) fn hop_headers(&mut self, view: &dyn StreamView, end_of_stream: bool) -> Step {
        let content_type = first(view.request_header("content-type"));
        let rerouted = !view.request_header(grpc::HOP_HEADER).is_empty()
            && first(view.request_header(":path")).as_deref() == Some(grpc::HOP_PATH.as_bytes())
            && content_type.as_deref() == Some(grpc::RECORD_CONTENT_TYPE.as_bytes());
        if !rerouted || end_of_stream {
            log::warn!(
                "replay listener: a request that is not a re-routed retry (end of stream: {end_of_stream})"
            );
            return Step::pause(vec![Effect::Refuse(self.not_a_replay())]);
        }
        if declared_length(view).is_some_and(|n| n > self.max_hop_body() as u64) {
            return Step::pause(vec![Effect::Refuse(self.hop_too_large())]);
        }
        self.state = State::HopReading { body: Vec::new() };
        Step::pause(vec![])
    }

    pub(super) fn hop_body(&mut self, view: &dyn StreamView, buffered: usize, end_of_stream: bool) -> Step {
        let cap = self.max_hop_body();
        let State::HopReading { body } = &mut self.state else { return Step::go(vec![]) };
        if buffered > cap {
            self.state = State::Done;
            return Step::pause(vec![Effect::Refuse(self.hop_too_large())]);
        }
        if buffered > body.len() {
            match view.request_body(body.len(), buffered - body.len()) {
                Some(chunk) => body.extend_from_slice(&chunk),
                None => {
                    self.state = State::Done;
                    return Step::pause(vec![Effect::Refuse(self.not_a_replay())]);
                }
            }
        }
        if !end_of_stream {
            return Step::pause(vec![]);
        }
        let State::HopReading { body } = std::mem::replace(&mut self.state, State::Done) else {
            return Step::go(vec![]);
        };
        match Record::decode(&body) {
            Ok(Record {
                status: 200, headers, body, body_omitted: false, trailers: Some(trailers), ..
            }) if !body.is_empty() => {
                self.state = State::HopAnswering { trailers };
                Step::pause(vec![Effect::Respond(LocalResponse { status: 200, headers, body })])
            }
            other => {
                log::warn!(
                    "replay listener: a re-routed retry without a replayable record ({} bytes: {:?})",
                    body.len(),
                    other.map(|r| (r.status, r.body.len(), r.trailers.is_some()))
                );
                Step::pause(vec![Effect::Refuse(self.not_a_replay())])
            }
        }
    }

    /// The replay listener: the last of the answer's body goes by; its trailers follow.
    pub(super) fn hop_answer_body(&mut self, end_of_stream: bool) -> Step {
        if !end_of_stream {
            return Step::go(vec![]);
        }
        match std::mem::replace(&mut self.state, State::Done) {
            State::HopAnswering { trailers } => Step::go(vec![Effect::AddResponseTrailers(trailers)]),
            other => {
                self.state = other;
                Step::go(vec![])
            }
        }
    }

    /// The replay listener's `413`: a record larger than it reads (its `max_record_bytes` is
    /// below a guard's, or something else sent it).
    fn hop_too_large(&self) -> Problem {
        log::warn!(
            "replay listener: a re-routed retry over {} bytes (max_record_bytes {} plus a record's \
             framing): give the replay listener the largest max_record_bytes of its guards",
            self.max_hop_body(),
            self.cfg.max_record_bytes
        );
        problem::replay_failed(
            &self.cfg,
            grpc::RESOURCE_EXHAUSTED,
            "The stored answer is larger than the replay listener reads.",
        )
    }

    /// The replay listener's answer to anything but a well-formed re-routed retry.
    fn not_a_replay(&self) -> Problem {
        problem::replay_failed(
            &self.cfg,
            grpc::INTERNAL,
            "The replay listener takes only retries the idempotency filter re-routes.",
        )
    }
}
