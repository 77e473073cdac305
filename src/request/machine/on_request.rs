//! The request's phase: its headers (guarded or not, the key, the store key, the print), its
//! body (hashed as it passes, refused past `max_body_bytes`; in inbox mode the id may be in it)
//! and its end, which asks the store to `begin`.

use super::*;

impl Machine {
    pub fn on_request_headers(&mut self, view: &dyn StreamView, end_of_stream: bool) -> Step {
        if !matches!(self.state, State::Start) {
            return Step::go(vec![]);
        }
        self.state = State::Done;
        if self.cfg.mode == Mode::GrpcReplay {
            return self.hop_headers(view, end_of_stream);
        }
        if !self.cfg.routes.is_empty() {
            self.route_name = view.property(&["xds", "route_name"]).filter(|n| !n.is_empty());
            if let Some(cfg) = self.route_name.as_deref().and_then(|n| self.cfg.routes.get(n)) {
                self.cfg = Rc::clone(cfg);
            }
        }
        if !view.request_header(grpc::HOP_HEADER).is_empty() {
            // Only this filter sends a request to the replay listener.
            if grpc::kind(first(view.request_header("content-type")).as_deref()) == grpc::Kind::Grpc {
                self.grpc = Some(Frames::default());
            }
            return reject(problem::hop_header(&self.cfg));
        }
        let method = first(view.request_header(":method"));
        let Some(method) = method.as_deref().and_then(|m| std::str::from_utf8(m).ok()) else {
            return Step::go(vec![]);
        };
        if !self.cfg.guards_method(method) {
            return Step::go(self.strip_store_key_header(view));
        }
        // `post` (HTTP/2 lets it through) is guarded as, and shares records with, `POST`.
        let method = method.to_ascii_uppercase();
        if self.cfg.inbox().is_some() {
            if let Some(step) = self.grpc_headers(view) {
                return step;
            }
            return self.inbox_headers(view, method, end_of_stream);
        }
        if self.cfg.mode == Mode::Mint {
            return mint(view);
        }
        if let Some(step) = self.grpc_headers(view) {
            return step;
        }
        let values = view.request_header("idempotency-key");
        let values: Vec<&[u8]> = values.iter().map(Vec::as_slice).collect();
        let client_key = match key::parse_client_key(&values, self.cfg.max_key_length) {
            Err(e) => return reject(problem::invalid_key(&self.cfg, e)),
            Ok(None) if self.cfg.require_key => return reject(problem::missing_key(&self.cfg)),
            Ok(None) => {
                let mut effects = self.strip_store_key_header(view);
                effects.push(Effect::Count(Metric::Passthrough));
                return Step::go(effects);
            }
            Ok(Some(k)) => k,
        };
        let effects = vec![Effect::Count(Metric::Guarded)];
        if self.declared_too_large(view) {
            return too_large(&self.cfg, effects);
        }
        let subject = self.subject(view);
        let route = self.route(view);
        let key = key::store_key(&subject, &method, &route, &client_key);
        let path = first(view.request_header(":path")).unwrap_or_default();
        let header = |name: &str| view.request_header(name);
        self.print = Some(RequestPrint::of(method.as_bytes(), &path, &self.cfg.fingerprint_headers, &header));
        self.guard(view, key, effects, end_of_stream)
    }

    /// A gRPC call: guarded as a unary call (noted in `self.grpc`), or let through at once
    /// (`Some`) when it cannot be one: gRPC-Web, or a method `grpc_streaming_methods` lists.
    pub(super) fn grpc_headers(&mut self, view: &dyn StreamView) -> Option<Step> {
        match grpc::kind(first(view.request_header("content-type")).as_deref()) {
            grpc::Kind::Http => None,
            grpc::Kind::Grpc => {
                let path = first(view.request_header(":path")).unwrap_or_default();
                if !self.cfg.streams_grpc(&path) {
                    self.grpc = Some(Frames::default());
                    return None;
                }
                Some(self.unguarded(view))
            }
            grpc::Kind::GrpcWeb => Some(self.unguarded(view)),
        }
    }

    /// A gRPC call let through unguarded, counted.
    pub(super) fn unguarded(&mut self, view: &dyn StreamView) -> Step {
        self.state = State::Done;
        let mut effects = self.strip_store_key_header(view);
        effects.push(Effect::Count(Metric::GrpcUnguarded));
        Step::go(effects)
    }

    /// Takes the request under guard with its store key: the body is read to its end, then
    /// `begin` goes out.
    pub(super) fn guard(
        &mut self,
        view: &dyn StreamView,
        key: String,
        mut effects: Vec<Effect>,
        end_of_stream: bool,
    ) -> Step {
        if let Some(name) = &self.cfg.store_key_header {
            effects.push(Effect::SetRequestHeader(name.clone(), key.clone()));
        }
        if self.detaches() {
            self.detach = self.capture_for_detach(view, Some(&key));
        }
        self.lookup_at = self.capture_for_lookup(view);
        self.accept_encoding = view.request_header("accept-encoding");
        let digest = match (&self.cfg.fingerprint_json, self.cfg.inbox()) {
            (_, Some(_)) => BodyDigest::Constant,
            (Some(_), None) => BodyDigest::Json(Vec::new()),
            (None, None) => BodyDigest::Raw(Sha256::new()),
        };
        self.state = State::Hashing { key, digest, seen: 0 };
        if end_of_stream {
            // Without a body there is nothing Envoy must deliver while the request waits, so a
            // stop on headers works with or without `allow_on_headers_stop_iteration`.
            effects.extend(self.begin());
            return Step::pause(effects);
        }
        self.hold(effects)
    }

    /// Pauses a request with a body that the filter reads before deciding.
    pub(super) fn hold(&self, effects: Vec<Effect>) -> Step {
        if self.cfg.pause_on_headers {
            Step::pause(effects)
        } else {
            // The headers go on to the buffer filter after this one, which holds them until the
            // body this filter pauses is let through (see `Config::pause_on_headers`).
            Step::go(effects)
        }
    }

    pub(super) fn declared_too_large(&self, view: &dyn StreamView) -> bool {
        declared_length(view).is_some_and(|n| n > self.cfg.max_body_bytes as u64)
    }

    /// Inbox mode, on request headers: the message id, or the body to read it from.
    pub(super) fn inbox_headers(
        &mut self,
        view: &dyn StreamView,
        method: String,
        end_of_stream: bool,
    ) -> Step {
        let Some(inbox) = self.cfg.inbox() else { return Step::go(vec![]) };
        let header = |name: &str| view.request_header(name);
        match inbox::at_headers(&inbox.message_id, &header, self.cfg.max_key_length) {
            Err(e) => self.without_id(view, e),
            Ok(AtHeaders::Found(id)) => {
                let effects = vec![Effect::Count(Metric::Guarded)];
                if self.declared_too_large(view) {
                    return too_large(&self.cfg, effects);
                }
                let key = inbox_key(&method, &self.route(view), &id);
                self.guard(view, key, effects, end_of_stream)
            }
            Ok(AtHeaders::InBody) => {
                if self.declared_too_large(view) {
                    return too_large(&self.cfg, vec![]);
                }
                // A client's value goes now: the id, and so the key, may never come.
                let effects = self.strip_store_key_header(view);
                if self.detaches() {
                    self.detach = self.capture_for_detach(view, None);
                }
                self.lookup_at = self.capture_for_lookup(view);
                // Read now: the request headers may be gone by the time the id is.
                self.accept_encoding = view.request_header("accept-encoding");
                self.state = State::Reading { method, route: self.route(view), body: Vec::new() };
                if end_of_stream {
                    let mut step = self.finish_reading();
                    step.effects.splice(0..0, effects);
                    return step;
                }
                self.hold(effects)
            }
        }
    }

    /// Inbox mode: no usable message id. A missing one runs unguarded or gets `400`
    /// (`inbox.missing_id`); a malformed one always gets `400`.
    pub(super) fn without_id(&mut self, view: &dyn StreamView, e: IdError) -> Step {
        self.state = State::Done;
        let pass = self.cfg.inbox().is_some_and(|i| i.missing_id == MissingId::Pass);
        match e {
            IdError::Missing if pass => {
                let mut effects = self.strip_store_key_header(view);
                effects.push(Effect::Count(Metric::Passthrough));
                Step::go(effects)
            }
            IdError::Missing => reject(problem::missing_message_id(&self.cfg)),
            e => reject(problem::invalid_message_id(&self.cfg, e)),
        }
    }

    /// Inbox mode, the whole body read: the id from it, then `begin` (or no id: see
    /// [`Self::without_id`]).
    pub(super) fn finish_reading(&mut self) -> Step {
        let State::Reading { method, route, body } = std::mem::replace(&mut self.state, State::Done) else {
            return Step::go(vec![]);
        };
        let Some(inbox) = self.cfg.inbox() else { return Step::go(vec![]) };
        let id = match inbox::from_body(&inbox.message_id, &body, self.cfg.max_key_length) {
            Ok(id) => id,
            // The headers were read and any store key header removed then: nothing to strip.
            Err(e) => return self.without_id(&NoHeaders, e),
        };
        let key = inbox_key(&method, &route, &id);
        let mut effects = vec![Effect::Count(Metric::Guarded)];
        if let Some(name) = &self.cfg.store_key_header {
            // Still the stream's own callback, and its headers are held (pause_on_headers).
            effects.push(Effect::SetRequestHeader(name.clone(), key.clone()));
            if let Some(d) = &mut self.detach {
                detached::set_header(&mut d.headers, name, &key);
            }
        }
        self.state = State::Hashing { key, digest: BodyDigest::Constant, seen: body.len() };
        effects.extend(self.begin());
        Step::pause(effects)
    }

    pub fn on_request_body(&mut self, view: &dyn StreamView, buffered: usize, end_of_stream: bool) -> Step {
        if matches!(self.state, State::HopReading { .. }) {
            return self.hop_body(view, buffered, end_of_stream);
        }
        let (digest, seen, kept) = match &mut self.state {
            State::Hashing { digest, seen, .. } => (Some(digest), *seen, None),
            State::Reading { body, .. } => (None, body.len(), Some(body)),
            _ => return Step::go(vec![]),
        };
        if buffered > self.cfg.max_body_bytes {
            self.state = State::Done;
            return too_large(&self.cfg, vec![]);
        }
        let mut now = seen;
        if buffered > seen {
            // Envoy hands us the whole buffered body each time: read only what is new, and only
            // when something needs it (inbox mode hashes nothing).
            let hashing = matches!(digest, Some(BodyDigest::Raw(_) | BodyDigest::Json(_)));
            if hashing || kept.is_some() || self.detach.is_some() || self.grpc.is_some() {
                let Some(chunk) = view.request_body(seen, buffered - seen) else {
                    // The host could not hand over the body: the guarantee cannot be checked.
                    return Step::pause(self.give_up());
                };
                match digest {
                    Some(BodyDigest::Raw(h)) => h.update(&chunk),
                    Some(BodyDigest::Json(body)) => body.extend_from_slice(&chunk),
                    _ => {}
                }
                if let Some(body) = kept {
                    body.extend_from_slice(&chunk);
                }
                if let Some(d) = &mut self.detach {
                    d.body.extend_from_slice(&chunk);
                }
                if let Some(frames) = &mut self.grpc {
                    frames.feed(&chunk);
                }
                now += chunk.len();
            } else {
                now = buffered;
            }
        }
        if let State::Hashing { seen, .. } = &mut self.state {
            *seen = now;
        }
        if self.grpc.as_ref().is_some_and(|f| f.messages > 1) {
            // A second message: the call streams. No lock is held yet: it goes on unguarded.
            self.state = State::Done;
            return Step::pause(vec![Effect::Resume, Effect::Count(Metric::GrpcUnguarded)]);
        }
        if end_of_stream {
            return self.end_of_request_body();
        }
        Step::pause(vec![])
    }

    pub(super) fn end_of_request_body(&mut self) -> Step {
        match self.state {
            State::Reading { .. } => self.finish_reading(),
            _ => Step::pause(self.begin()),
        }
    }

    /// Trailers end the request body.
    pub fn on_request_trailers(&mut self) -> Step {
        if matches!(self.state, State::Hashing { .. } | State::Reading { .. }) {
            return self.end_of_request_body();
        }
        Step::go(vec![])
    }

    pub(super) fn begin(&mut self) -> Vec<Effect> {
        match std::mem::replace(&mut self.state, State::Done) {
            State::Hashing { key, digest, seen } => {
                self.request_len = seen;
                let body_hash = match digest {
                    BodyDigest::Raw(hasher) => key::hex(&hasher.finalize()),
                    BodyDigest::Json(body) => match &self.cfg.fingerprint_json {
                        Some(opts) => key::hex(&fingerprint::json_body_hash(&body, opts)),
                        None => key::hex(&Sha256::digest(&body)),
                    },
                    // The id is the identity: a redelivery may differ in its body.
                    BodyDigest::Constant => INBOX_BODY_HASH.to_string(),
                };
                let call = StoreCall::Begin {
                    key: key.clone(),
                    body_hash: body_hash.clone(),
                    lock: LockTerms::of(&self.cfg),
                    hold: Hold::of(&self.cfg),
                };
                self.state = State::Beginning { key, body_hash };
                vec![Effect::Store(call)]
            }
            other => {
                self.state = other;
                vec![]
            }
        }
    }

    /// A detached gRPC call's answer reaches the client by the second hop, which needs the
    /// request headers held (`pause_on_headers`): without them the call runs routed.
    pub(super) fn detaches(&self) -> bool {
        self.cfg.detached_execution && (self.grpc.is_none() || self.cfg.pause_on_headers)
    }

    /// The request as a detached execution will send it, or `None` to route it normally.
    /// `key`: the store key, if already known (inbox mode may learn it from the body).
    pub(super) fn capture_for_detach(&self, view: &dyn StreamView, key: Option<&str>) -> Option<Detach> {
        let cluster = view.property(&["xds", "cluster_name"]).filter(|c| !c.is_empty())?;
        let cluster = String::from_utf8(cluster).ok()?;
        let mut headers = detached::forwardable_request(&view.request_headers())?;
        if self.grpc.is_some() {
            // gRPC servers may insist on it; the callout does not add it.
            detached::set_header(&mut headers, "te", "trailers");
        }
        if let Some(name) = &self.cfg.store_key_header {
            match key {
                Some(key) => detached::set_header(&mut headers, name, key),
                None => headers.retain(|(n, _)| n != name),
            }
        }
        Some(Detach { cluster, headers, body: Vec::new() })
    }

    /// Where `outcome_lookup` asks, should this request's key turn out to be in doubt: the
    /// route's cluster and the request's authority, read while the headers are here.
    pub(super) fn capture_for_lookup(&self, view: &dyn StreamView) -> Option<LookupAt> {
        self.cfg.outcome_lookup.as_ref()?;
        let cluster = view.property(&["xds", "cluster_name"]).filter(|c| !c.is_empty())?;
        let authority = first(view.request_header(":authority")).unwrap_or_default();
        Some(LookupAt {
            cluster: String::from_utf8(cluster).ok()?,
            authority: String::from_utf8(authority).ok()?,
        })
    }

    /// A client must not be able to hand the upstream a store key of its choosing.
    pub(super) fn strip_store_key_header(&self, view: &dyn StreamView) -> Vec<Effect> {
        match &self.cfg.store_key_header {
            Some(name) if !view.request_header(name).is_empty() => {
                vec![Effect::RemoveRequestHeader(name.clone())]
            }
            _ => vec![],
        }
    }

    pub(super) fn subject(&self, view: &dyn StreamView) -> String {
        let identity = match &self.cfg.subject {
            Subject::ClientIp => None,
            Subject::Header(name) => first(view.request_header(name)),
            Subject::Metadata { filter, path } => {
                let mut full: Vec<&str> = vec!["metadata", "filter_metadata", filter];
                full.extend(path.iter().map(String::as_str));
                view.property(&full)
            }
            Subject::Property(path) => view.property(&path.iter().map(String::as_str).collect::<Vec<_>>()),
        };
        match identity {
            // Exact bytes either way, so two identities never collapse into one subject: a
            // numeric claim arrives as the 8 raw bytes of a double, rarely valid UTF-8.
            Some(id) if !id.is_empty() => match String::from_utf8(id) {
                Ok(text) => format!("id:{text}"),
                Err(e) => format!("idx:{}", key::hex(e.as_bytes())),
            },
            _ => {
                let source = view.property(&["source", "address"]).unwrap_or_default();
                key::anonymous_subject(&String::from_utf8_lossy(&source))
            }
        }
    }
}

/// Mint mode: a guarded request without a key gets one, 128 random bits as an RFC 8941 string,
/// before the router, so every retry and hedged attempt of it carries the same key. A key the
/// client sent, well-formed or not, is the guard's to judge: left alone.
fn mint(view: &dyn StreamView) -> Step {
    if !view.request_header("idempotency-key").is_empty() {
        return Step::go(vec![]);
    }
    let Some(bytes) = view.random_bytes() else {
        log::warn!("no random bytes from the host: a request leaves without a minted key");
        return Step::go(vec![Effect::Count(Metric::Passthrough)]);
    };
    let value = format!("\"{}\"", key::hex(&bytes));
    Step::go(vec![
        Effect::SetRequestHeader("idempotency-key".to_string(), value),
        Effect::Count(Metric::Minted),
    ])
}

impl Machine {
    /// The route part of the scope: the Envoy route's name (read once: see `routes`), else the
    /// path without its query.
    pub(super) fn route(&self, view: &dyn StreamView) -> String {
        let name = match &self.route_name {
            Some(name) => Some(name.clone()),
            None => view.property(&["xds", "route_name"]),
        };
        match name {
            Some(name) if !name.is_empty() => String::from_utf8_lossy(&name).into_owned(),
            _ => {
                let path = first(view.request_header(":path")).unwrap_or_default();
                key::route_from_path(&String::from_utf8_lossy(&path)).to_string()
            }
        }
    }
}

/// Inbox mode's store key: subject `inbox:<source>` (never the client's address: a broker
/// delivers from many), the method, the route (two subscriber routes each handle an event
/// once), and the id, all exact bytes.
fn inbox_key(method: &str, route: &str, id: &MessageId) -> String {
    let mut subject = Vec::with_capacity(6 + id.source.len());
    subject.extend_from_slice(b"inbox:");
    subject.extend_from_slice(&id.source);
    key::store_key_bytes(&subject, method, route, &id.id)
}

/// A view with no request headers (for a decision after they are gone).
struct NoHeaders;

impl StreamView for NoHeaders {
    fn random_bytes(&self) -> Option<[u8; 16]> {
        None
    }
    fn now_ms(&self) -> Option<u64> {
        None
    }
    fn response_trailers(&self) -> Vec<(String, Vec<u8>)> {
        Vec::new()
    }
    fn request_header(&self, _: &str) -> Vec<Vec<u8>> {
        Vec::new()
    }
    fn request_headers(&self) -> Vec<(String, Vec<u8>)> {
        Vec::new()
    }
    fn response_header(&self, _: &str) -> Vec<Vec<u8>> {
        Vec::new()
    }
    fn property(&self, _: &[&str]) -> Option<Vec<u8>> {
        None
    }
    fn request_body(&self, _: usize, _: usize) -> Option<Vec<u8>> {
        None
    }
    fn response_body(&self, _: usize, _: usize) -> Option<Vec<u8>> {
        None
    }
}

fn reject(problem: Problem) -> Step {
    Step::pause(vec![Effect::Refuse(problem), Effect::Count(Metric::Rejected)])
}

fn too_large(cfg: &Config, mut effects: Vec<Effect>) -> Step {
    effects.push(Effect::Refuse(problem::body_too_large(cfg)));
    effects.push(Effect::Count(Metric::Rejected));
    Step::pause(effects)
}
