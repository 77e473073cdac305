//! The answer's phase: the upstream's (or a detached execution's) response, kept as it streams
//! to the client when [`keep`] says so, then committed; released when it is not kept, or the
//! stream ends first.
//!
//! [`keep`]: crate::request::keep

use super::lookup::Looked;
use super::*;
use crate::config::values::TooLarge;

/// The one `grpc-status` of an answer's trailers (two are none).
fn single_status(trailers: &[(String, String)]) -> Option<u8> {
    let statuses: Vec<&String> =
        trailers.iter().filter(|(n, _)| n == "grpc-status").map(|(_, v)| v).collect();
    match statuses.as_slice() {
        [one] => grpc::parse_status(one.as_bytes()),
        _ => None,
    }
}

/// Every value of each of `names` a record can keep: a value Envoy could not send back in a
/// local reply is left out, not mangled.
fn kept_values<'a>(
    names: impl Iterator<Item = &'a str>,
    values_of: &dyn Fn(&str) -> Vec<Vec<u8>>,
) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for name in names {
        for value in values_of(name) {
            if headers::is_valid_value(&value) {
                if let Ok(v) = String::from_utf8(value) {
                    out.push((name.to_string(), v));
                }
            }
        }
    }
    out
}

fn values(pairs: &[(String, Vec<u8>)], name: &str) -> Vec<Vec<u8>> {
    pairs.iter().filter(|(n, _)| n == name).map(|(_, v)| v.clone()).collect()
}

impl Machine {
    pub fn on_response_headers(&mut self, view: &dyn StreamView, end_of_stream: bool) -> Step {
        let ended = match self.state {
            State::Executing { .. } => seen(view).at_answer(),
            _ => Ending::Answered,
        };
        match std::mem::replace(&mut self.state, State::Done) {
            // A gRPC answer has no length; a replay of one says none either.
            State::HopAnswering { trailers } => {
                self.state = State::HopAnswering { trailers };
                let length = !view.response_header("content-length").is_empty();
                Step::go(if length {
                    vec![Effect::RemoveResponseHeader("content-length".into())]
                } else {
                    vec![]
                })
            }
            // Envoy's own reply: the request never reached the application, or its answer was
            // lost on the way (a timeout, a reset).
            State::Executing { key, token, .. } if ended == Ending::Unknown => {
                Step::go(self.lost(key, token))
            }
            State::Executing { key, token, .. } if ended == Ending::NeverSent => {
                Step::go(release(key, token))
            }
            State::Executing { key, body_hash, token } if self.grpc.is_some() => {
                Step::go(self.grpc_response_headers(view, key, body_hash, token, end_of_stream))
            }
            State::Executing { key, body_hash, token } => {
                let status = first(view.response_header(":status"))
                    .and_then(|s| std::str::from_utf8(&s).ok().and_then(|s| s.parse::<u16>().ok()))
                    .unwrap_or(0);
                let length = first(view.response_header("content-length"))
                    .and_then(|v| std::str::from_utf8(&v).ok().and_then(|s| s.trim().parse::<u64>().ok()));
                let (head, recorded) = self.answer_head(status, length, |name| view.response_header(name));
                let keep = keep::decide(&self.cfg, &head);
                let expiry = match keep {
                    Keep::Release => None,
                    Keep::Full | Keep::WithoutBody | Keep::StatusOnly => self.expiry_from(view.now_ms()),
                };
                let mut effects: Vec<Effect> =
                    expiry.map(|(name, date)| Effect::SetResponseHeader(name, date)).into_iter().collect();
                let omitted = match keep {
                    Keep::Full => false,
                    Keep::WithoutBody => true,
                    Keep::StatusOnly | Keep::Release => {
                        effects.extend(self.end_without_record(key, token, body_hash, status, keep));
                        return Step::go(effects);
                    }
                };
                let capture =
                    Capture { head, headers: recorded, body: Vec::new(), seen: 0, omitted, grpc: None };
                self.state = State::Capturing { key, body_hash, token, capture };
                if end_of_stream {
                    effects.extend(self.finish_capture());
                }
                Step::go(effects)
            }
            // Envoy answered the client itself (e.g. a stream timeout): the detached call goes on.
            State::Detached { key, body_hash, token, .. } => {
                self.state = State::Detached { key, body_hash, token, gone: true };
                Step::go(vec![])
            }
            // The request never reached the upstream (Envoy answered it, e.g. a timeout while
            // `begin` was pending): whatever `begin` brings back must be given back.
            State::Beginning { key, .. } => {
                self.state = State::Orphaned { key };
                Step::go(vec![])
            }
            other => {
                self.state = other;
                Step::go(vec![])
            }
        }
    }

    pub fn on_response_body(&mut self, view: &dyn StreamView, chunk_len: usize, end_of_stream: bool) -> Step {
        if matches!(self.state, State::HopAnswering { .. }) {
            return self.hop_answer_body(end_of_stream);
        }
        let State::Capturing { capture, .. } = &mut self.state else {
            return Step::go(vec![]);
        };
        if capture.grpc.is_some() {
            return Step::go(self.grpc_response_body(view, chunk_len, end_of_stream));
        }
        if chunk_len > 0 {
            capture.seen = capture.seen.saturating_add(chunk_len as u64);
            let mut keep = keep::decide(&self.cfg, &capture.head.with_body(capture.seen));
            if keep == Keep::Full && !capture.omitted {
                match view.response_body(0, chunk_len) {
                    Some(chunk) => capture.body.extend_from_slice(&chunk),
                    // A body the host cannot hand over is kept like one too large to keep.
                    None => keep = keep::decide(&self.cfg, &capture.head.with_body(u64::MAX)),
                }
            }
            match keep {
                Keep::Full => {}
                Keep::WithoutBody => {
                    capture.omitted = true;
                    capture.body = Vec::new();
                }
                keep => return Step::go(self.abandon_capture(keep)),
            }
        }
        if end_of_stream {
            return Step::go(self.finish_capture());
        }
        Step::go(vec![])
    }

    /// Trailers end the response body; an HTTP answer's are not stored, a gRPC answer's are.
    pub fn on_response_trailers(&mut self, view: &dyn StreamView) -> Step {
        match &self.state {
            State::Capturing { capture, .. } if capture.grpc.is_some() => {
                let trailers = view.response_trailers();
                let values_of = |name: &str| values(&trailers, name);
                let trailers = self.grpc_trailers(&values_of);
                Step::go(self.finish_grpc(trailers))
            }
            State::Capturing { .. } => Step::go(self.finish_capture()),
            _ => Step::go(vec![]),
        }
    }

    /// The answer to a detached gRPC call: kept as a routed one would be, and sent to the
    /// client (if still there) the way a replay is, without the replay marker.
    fn grpc_upstream_answer(
        &mut self,
        answer: &UpstreamAnswer,
        key: String,
        body_hash: String,
        token: LockToken,
        gone: bool,
    ) -> Vec<Effect> {
        let mut effects = Vec::new();
        let values_of = |name: &str| values(&answer.headers, name);
        let (head, headers) = self.grpc_answer_head(values_of);
        let mut frames = Frames::default();
        frames.feed(&answer.body);
        let whole = frames.complete() && frames.messages <= 1;
        if answer.status != 200 || grpc::kind(head.content_type.as_deref()) != grpc::Kind::Grpc {
            if !gone {
                effects.push(Effect::Refuse(problem::upstream_failed(&self.cfg)));
            }
            effects.extend(release(key, token));
            return effects;
        }
        // Trailers-only: the status is in the headers.
        let source = if answer.trailers.is_empty() { &answer.headers } else { &answer.trailers };
        let trailers = self.grpc_trailers(&|name: &str| values(source, name));
        let live = Record {
            status: 200,
            headers,
            body: answer.body.clone(),
            body_omitted: false,
            print: self.print.clone(),
            trailers: Some(trailers),
            expires_ms: None,
        };
        if !gone {
            // A streamed answer too, all its messages at once: it is not kept.
            effects.push(self.grpc_answer(live.clone(), false));
        }
        if !whole {
            effects.extend(release(key, token));
            effects.push(Effect::Count(Metric::GrpcUnguarded));
            return effects;
        }
        let too_large = live.body.len() > self.cfg.max_record_bytes;
        let keep = self.grpc_kept(&live.headers, live.trailers.as_deref().unwrap_or_default())
            && !(too_large && self.cfg.record_too_large == TooLarge::Release);
        if !keep {
            effects.extend(release(key, token));
            return effects;
        }
        let record = if too_large { Record { body: Vec::new(), body_omitted: true, ..live } } else { live };
        effects.push(self.commit(key, token, body_hash, record.encode()));
        if gone {
            effects.push(Effect::Count(Metric::CommittedAfterGone));
        }
        effects
    }

    /// A guarded gRPC call's answer headers: a gRPC answer is captured (or, trailers-only,
    /// decided at once); anything else gives the lock back.
    fn grpc_response_headers(
        &mut self,
        view: &dyn StreamView,
        key: String,
        body_hash: String,
        token: LockToken,
        end_of_stream: bool,
    ) -> Vec<Effect> {
        let status = first(view.response_header(":status"));
        let values_of = |name: &str| view.response_header(name);
        let (head, headers) = self.grpc_answer_head(values_of);
        let is_grpc = grpc::kind(head.content_type.as_deref()) == grpc::Kind::Grpc;
        if status.as_deref() != Some(b"200") || !is_grpc || !head.readable {
            return release(key, token);
        }
        let capture = Capture {
            head,
            headers,
            body: Vec::new(),
            seen: 0,
            omitted: false,
            grpc: Some(Frames::default()),
        };
        self.state = State::Capturing { key, body_hash, token, capture };
        if end_of_stream {
            // Trailers-only: the status is in the headers.
            let trailers = self.grpc_trailers(&values_of);
            return self.finish_grpc(trailers);
        }
        vec![]
    }

    fn grpc_response_body(
        &mut self,
        view: &dyn StreamView,
        chunk_len: usize,
        end_of_stream: bool,
    ) -> Vec<Effect> {
        let State::Capturing { capture, .. } = &mut self.state else { return vec![] };
        let Some(frames) = &mut capture.grpc else { return vec![] };
        if chunk_len > 0 {
            let Some(chunk) = view.response_body(0, chunk_len) else {
                // The messages cannot be counted: nothing is kept.
                return self.abandon_capture(Keep::Release);
            };
            frames.feed(&chunk);
            if frames.messages > 1 {
                let mut effects = self.abandon_capture(Keep::Release);
                effects.push(Effect::Count(Metric::GrpcUnguarded));
                return effects;
            }
            capture.seen = capture.seen.saturating_add(chunk_len as u64);
            if !capture.omitted && capture.seen > self.cfg.max_record_bytes as u64 {
                match self.cfg.record_too_large {
                    TooLarge::OmitBody => {
                        capture.omitted = true;
                        capture.body = Vec::new();
                    }
                    TooLarge::Release => return self.abandon_capture(Keep::Release),
                }
            }
            if !capture.omitted {
                capture.body.extend_from_slice(&chunk);
            }
        }
        if end_of_stream {
            // Cut without trailers: no status to keep.
            return self.abandon_capture(Keep::Release);
        }
        vec![]
    }

    /// The trailers a gRPC record keeps: the status, its message and details, and the
    /// allow-listed metadata (`replay_headers`) that came after the message.
    fn grpc_trailers(&self, values_of: &dyn Fn(&str) -> Vec<Vec<u8>>) -> Vec<(String, String)> {
        let always = ["grpc-status", "grpc-message", "grpc-status-details-bin"];
        let listed = self
            .cfg
            .replay_headers
            .iter()
            .map(String::as_str)
            .filter(|n| !always.contains(n) && *n != "content-type");
        kept_values(always.into_iter().chain(listed), values_of)
    }

    /// [`Self::answer_head`] for a gRPC answer: its record also keeps `grpc-encoding` (how the
    /// message is compressed: a replay without it could not be read).
    fn grpc_answer_head(&self, values_of: impl Fn(&str) -> Vec<Vec<u8>>) -> (Head, Vec<(String, String)>) {
        let (head, mut headers) = self.answer_head(200, None, &values_of);
        if !self.cfg.replay_headers.iter().any(|n| n == "grpc-encoding") {
            headers.extend(kept_values(["grpc-encoding"].into_iter(), &values_of));
        }
        (head, headers)
    }

    /// A gRPC answer whose messages were whole is kept when its one `grpc-status` is in
    /// `store_grpc_statuses` and its headers and trailers fit a record.
    fn grpc_kept(&self, headers: &[(String, String)], trailers: &[(String, String)]) -> bool {
        single_status(trailers).is_some_and(|c| self.cfg.store_grpc_statuses.contains(c))
            && record::headers_fit(headers)
            && record::headers_fit(trailers)
    }

    /// A gRPC answer ended with `trailers`: kept when its status is one `store_grpc_statuses`
    /// lists and it was one whole message (or none); else the lock is given back.
    fn finish_grpc(&mut self, trailers: Vec<(String, String)>) -> Vec<Effect> {
        let State::Capturing { key, body_hash, token, capture } =
            std::mem::replace(&mut self.state, State::Done)
        else {
            return vec![];
        };
        let whole = capture.grpc.as_ref().is_some_and(|f| f.complete() && f.messages <= 1);
        if !whole || !self.grpc_kept(&capture.headers, &trailers) {
            return release(key, token);
        }
        let record = Record {
            status: 200,
            headers: capture.headers,
            body: capture.body,
            body_omitted: capture.omitted,
            print: self.print.clone(),
            trailers: Some(trailers),
            expires_ms: None,
        };
        vec![self.commit(key, token, body_hash, record.encode())]
    }

    pub(super) fn finish_capture(&mut self) -> Vec<Effect> {
        match std::mem::replace(&mut self.state, State::Done) {
            State::Capturing { key, body_hash, token, capture } => {
                let record = Record {
                    status: capture.head.status,
                    headers: capture.headers,
                    body: capture.body,
                    body_omitted: capture.omitted,
                    print: self.print.clone(),
                    trailers: None,
                    expires_ms: None,
                };
                vec![self.commit(key, token, body_hash, record.encode())]
            }
            other => {
                self.state = other;
                vec![]
            }
        }
    }

    /// The capture cannot become a full record after all: `keep` says what instead.
    pub(super) fn abandon_capture(&mut self, keep: Keep) -> Vec<Effect> {
        match std::mem::replace(&mut self.state, State::Done) {
            State::Capturing { key, body_hash, token, capture } => {
                self.end_without_record(key, token, body_hash, capture.head.status, keep)
            }
            other => {
                self.state = other;
                vec![]
            }
        }
    }

    /// Ends a lock for an answer that gets no full record: its status alone
    /// ([`Keep::StatusOnly`]) or nothing.
    pub(super) fn end_without_record(
        &self,
        key: String,
        token: LockToken,
        body_hash: String,
        status: u16,
        keep: Keep,
    ) -> Vec<Effect> {
        match keep {
            Keep::StatusOnly => {
                let record = Record::status_only(status).encode();
                vec![self.commit(key, token, body_hash, record)]
            }
            _ => release(key, token),
        }
    }

    /// The answer to a detached execution: to the client if it is still there, and to the
    /// store in any case (a commit, or a release for what is not stored).
    /// `now_ms`: when the answer came (the wall clock), for `expiry_header`.
    pub fn on_upstream_answer(
        &mut self,
        answer: Result<UpstreamAnswer, CalloutFault>,
        now_ms: Option<u64>,
    ) -> Vec<Effect> {
        let (key, body_hash, token, gone) = match std::mem::replace(&mut self.state, State::Done) {
            State::Detached { key, body_hash, token, gone } => (key, body_hash, token, gone),
            State::Looking { key, body_hash, token, running_ms, gone } => {
                return self.looked_up(Looked { key, body_hash, token, running_ms, gone }, answer, now_ms);
            }
            other => {
                self.state = other;
                return vec![];
            }
        };
        let mut effects = Vec::new();
        if let (Some(_), Ok(answer)) = (&self.grpc, &answer) {
            return self.grpc_upstream_answer(answer, key, body_hash, token, gone);
        }
        let answer = match answer {
            Ok(a) => a,
            Err(fault) => {
                if !gone {
                    let problem = match fault {
                        CalloutFault::Timeout => problem::upstream_timeout(&self.cfg),
                        _ => problem::upstream_failed(&self.cfg),
                    };
                    effects.push(Effect::Refuse(problem));
                }
                // A timeout or a reset came after the request went out; a call that could not be
                // dispatched never left.
                effects.extend(match fault {
                    CalloutFault::Timeout | CalloutFault::Reset => self.lost(key, token),
                    _ => release(key, token),
                });
                return effects;
            }
        };
        let values_of =
            |name: &str| answer.headers.iter().filter(|(n, _)| n == name).map(|(_, v)| v.clone()).collect();
        let (head, headers) = self.answer_head(answer.status, Some(answer.body.len() as u64), values_of);
        let keep = keep::decide(&self.cfg, &head);
        if !gone {
            let mut response = answer.to_local_response();
            if let Some((name, date)) = self.expiry_from(now_ms).filter(|_| keep != Keep::Release) {
                response.headers.retain(|(n, _)| *n != name);
                response.headers.push((name, date));
            }
            effects.push(Effect::Respond(response));
        }
        let omitted = match keep {
            Keep::Full => false,
            Keep::WithoutBody => true,
            Keep::StatusOnly | Keep::Release => {
                effects.extend(self.end_without_record(key, token, body_hash, answer.status, keep));
                if gone && keep == Keep::StatusOnly {
                    effects.push(Effect::Count(Metric::CommittedAfterGone));
                }
                return effects;
            }
        };
        let body = if omitted { Vec::new() } else { answer.body };
        let record = Record {
            status: answer.status,
            headers,
            body,
            body_omitted: omitted,
            print: self.print.clone(),
            trailers: None,
            expires_ms: None,
        };
        effects.push(self.commit(key, token, body_hash, record.encode()));
        if gone {
            effects.push(Effect::Count(Metric::CommittedAfterGone));
        }
        effects
    }

    /// `expiry_header` on a first answer about to be kept: its record lives the route's
    /// retention from `now_ms` (the store counts from the commit, an answer's transfer later).
    fn expiry_from(&self, now_ms: Option<u64>) -> Option<(String, String)> {
        replay::expiry(&self.cfg, self.expires_ms(now_ms))
    }

    /// When a record kept now (`now_ms`) expires: its route's retention later.
    pub(super) fn expires_ms(&self, now_ms: Option<u64>) -> Option<u64> {
        now_ms.map(|now| now.saturating_add(self.cfg.retention_seconds.saturating_mul(1000)))
    }

    /// What [`keep::decide`] needs to know of an answer, and the headers its record would keep,
    /// from its status, body length (as far as known) and header values.
    pub(super) fn answer_head(
        &self,
        status: u16,
        length: Option<u64>,
        values_of: impl Fn(&str) -> Vec<Vec<u8>>,
    ) -> (Head, Vec<(String, String)>) {
        let recorded = self.recorded_headers(&values_of);
        let head = Head {
            status,
            content_type: first(values_of("content-type")),
            length,
            upgrade: !values_of("upgrade").is_empty(),
            headers_fit: record::headers_fit(&recorded),
            readable: Head::readable_with(&values_of),
        };
        (head, recorded)
    }

    /// The response headers a record keeps: the allow-listed ones, and those that say how the
    /// body is read (see [`headers::REPRESENTATION`]).
    pub(super) fn recorded_headers(&self, values_of: impl Fn(&str) -> Vec<Vec<u8>>) -> Vec<(String, String)> {
        let listed = &self.cfg.replay_headers;
        let representation =
            headers::REPRESENTATION.iter().copied().filter(|n| !listed.iter().any(|l| l == n));
        kept_values(listed.iter().map(String::as_str).chain(representation), &values_of)
    }
}
