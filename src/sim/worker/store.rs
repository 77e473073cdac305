//! The simulated store and upstream of a [`World`]: the answers to its callouts (with faults),
//! another replica that runs a key first, records and locks with expiry, and the checks that
//! every lock granted ends once.

use idem_protocol::CommitOutcome;

use super::*;

/// The commits of a `commits` callout: key, token, body hash, record.
pub(super) type Item = (String, String, String, Vec<u8>);

pub(super) fn batch_items(call: &Dispatch) -> Vec<Item> {
    if header(&call.headers, ":path") != Some(proto::PATH_COMMITS) {
        return vec![];
    }
    let body = call.body.as_deref().unwrap_or_default();
    proto::decode_batch(body)
        .map(|items| {
            items
                .into_iter()
                .map(|i| (i.key.into(), i.token.into(), i.body_hash.into(), body[i.record].to_vec()))
                .collect()
        })
        .unwrap_or_default()
}

/// Every store key a callout concerns.
pub(super) fn call_keys(call: &Dispatch) -> Vec<String> {
    match batch_items(call) {
        items if !items.is_empty() => items.into_iter().map(|(key, ..)| key).collect(),
        _ => vec![call_key(call).to_string()],
    }
}

impl World {
    /// Answers one callout in flight, chosen at random, sometimes with a fault.
    pub(super) fn answer_one(&mut self) -> Result<(), String> {
        let n = self.in_flight.len() + self.wire.len();
        if n == 0 {
            return Ok(());
        }
        let pick = self.rng.below(n as u64) as usize;
        if pick >= self.in_flight.len() {
            return self.answer_wire(pick - self.in_flight.len());
        }
        let InFlight { token, call } = self.in_flight.swap_remove(pick);
        // 0: processed, answered; 1: not processed, reset; 2: processed, answer timed out;
        // 3: processed, garbage answer.
        let fault = if self.rng.chance(self.fault_rate) { 1 + self.rng.below(3) } else { 0 };
        if fault > 0 {
            self.tally.faults += 1;
        }
        let items = batch_items(&call);
        if !items.is_empty() {
            // One retention for the whole batch, as idemstore reads it.
            let retention_s = header(&call.headers, proto::HEADER_RETENTION_S).and_then(|v| v.parse().ok());
            return self.answer_batch(token, items, retention_s.unwrap_or(0), fault);
        }
        self.note_end(&call, fault == 0)?;
        let key = call_key(&call).to_string();
        let (headers, body) = if call.cluster == self.cfg.store_cluster {
            let (headers, body) =
                if fault == 1 { (vec![], vec![]) } else { self.store_answers(&call, fault == 0)? };
            match fault {
                2 => (pairs(&[(":status", "504")]), vec![]),
                3 => (pairs(&[(":status", "200")]), vec![]),
                _ => (headers, body),
            }
        } else {
            match fault {
                0 | 3 => self.execute_detached(&call),
                1 => (vec![], vec![]),
                _ => {
                    self.execute_detached(&call);
                    (pairs(&[(":status", "504")]), vec![])
                }
            }
        };
        self.trace.push(format!("answer {token} (fault {fault})"));
        if self.streams.iter().any(|s| s.ended && s.store_key.as_deref() == Some(&key)) {
            self.tally.answers_after_end += 1;
        }
        self.callback = Callback::Root;
        self.scope = Scope::Keys(vec![key]);
        self.coord.on_callout_answer(token, headers, body, &self.clock);
        self.commands()
    }

    /// Answers a `commits` callout: each commit as idemstore would, one now and then not done
    /// (`failed`), or the whole call faulted.
    pub(super) fn answer_batch(
        &mut self,
        token: u32,
        items: Vec<Item>,
        retention_s: u64,
        fault: u64,
    ) -> Result<(), String> {
        let mut outcomes = Vec::new();
        for (key, lock, body_hash, record) in &items {
            // Not done: neither processed nor a lock ended (the filter tries it again).
            let failed = fault == 1 || fault == 0 && self.rng.chance(self.fault_rate);
            self.note_lock_end(true, key, lock, fault == 0 && !failed)?;
            if failed {
                outcomes.push(None);
                continue;
            }
            let retention_us = retention_s * 1_000_000;
            outcomes.push(Some(self.commit_one(key, lock, body_hash, record.clone(), retention_us)));
        }
        let (headers, body) = match fault {
            0 => (pairs(&[(":status", "200"), (proto::HEADER_OUTCOME, proto::BATCH_OUTCOME)]), {
                proto::encode_batch_answer(&outcomes)
            }),
            1 => (vec![], vec![]),
            2 => (pairs(&[(":status", "504")]), vec![]),
            _ => (pairs(&[(":status", "200")]), vec![]),
        };
        self.tally.batches += 1;
        self.trace.push(format!("answer {token} (fault {fault}): {} commits", items.len()));
        self.callback = Callback::Root;
        self.scope = Scope::Keys(items.into_iter().map(|(key, ..)| key).collect());
        self.coord.on_callout_answer(token, headers, body, &self.clock);
        self.commands()
    }

    /// Another Envoy (no shared data with this one) runs a key some stream here also sends and
    /// stores its record first, as if its store calls had all worked: this VM's local record of
    /// the key, if any, then races it back to the store (`exists`), and replays here must carry
    /// one of the key's executions.
    pub(super) fn other_replica_runs(&mut self) {
        let Some(i) = self.pick(|s| s.store_key.is_some()) else { return };
        let (key, client_key, body) = {
            let s = &self.streams[i];
            (s.store_key.clone().unwrap_or_default(), s.client_key, s.body)
        };
        let now = self.clock.0.get();
        if self.store.get(&key).is_some_and(|st| match st {
            Stored::Lock { expires_us, .. } | Stored::Record { expires_us, .. } => *expires_us > now,
        }) {
            return;
        }
        self.executions += 1;
        self.tally.executions += 1;
        let print = crate::store::record::RequestPrint::of(b"POST", b"/orders?x=1", &[], &|_| vec![]);
        let record = Record {
            status: 201,
            headers: vec![("content-type".into(), "text/plain".into())],
            body: format!("exec {} of {client_key} {body} elsewhere", self.executions).into_bytes(),
            body_omitted: false,
            print: Some(print),
            trailers: None,
            expires_ms: None,
        };
        let body_hash = crate::request::key::hex(&sha2::Digest::finalize(
            <sha2::Sha256 as sha2::Digest>::new_with_prefix(body),
        ));
        let retention_us = self.cfg.retention_seconds * 1_000_000;
        self.store.insert(
            key,
            Stored::Record { body_hash, bytes: record.encode(), expires_us: now + retention_us },
        );
        self.tally.other_replica_records += 1;
        self.trace.push(format!("another replica stored {client_key} {body}"));
    }

    /// The detached call reaches the upstream, which runs it; or the application answers an
    /// `outcome_lookup` from what it completed under that store key.
    pub(super) fn execute_detached(&mut self, call: &Dispatch) -> Message {
        if let Some(key) = header(&call.headers, ":path").and_then(|p| p.strip_prefix("/by-key/")) {
            self.tally.lookups += 1;
            let served = [("x-envoy-upstream-service-time", "1")];
            return match self.completed.get(key) {
                Some(body) => {
                    (pairs(&[(":status", "201"), ("content-type", "text/plain"), served[0]]), body.clone())
                }
                None => (pairs(&[(":status", "404"), served[0]]), vec![]),
            };
        }
        self.executions += 1;
        self.tally.executions += 1;
        let body = call.body.clone().unwrap_or_default();
        let key = header(&call.headers, "idempotency-key").unwrap_or_default();
        let text = format!("exec {} of {} {}", self.executions, key, String::from_utf8_lossy(&body));
        if let Some(store_key) = header(&call.headers, "x-store-key") {
            self.completed.entry(store_key.to_string()).or_insert_with(|| text.clone().into_bytes());
        }
        (pairs(&[(":status", "201"), ("content-type", "text/plain")]), text.into_bytes())
    }

    /// A commit or release the filter sent (or tried to): it must name a lock the filter was
    /// granted, for its key, not yet ended. `answered`: the filter reads the store's answer.
    pub(super) fn note_end(&mut self, call: &Dispatch, answered: bool) -> Result<(), String> {
        for (key, token, ..) in batch_items(call) {
            self.note_lock_end(true, &key, &token, answered)?;
        }
        let path = header(&call.headers, ":path").unwrap_or_default();
        let token = header(&call.headers, proto::HEADER_TOKEN).unwrap_or_default();
        let ends = match path {
            proto::PATH_COMMIT => Some(true),
            proto::PATH_RELEASE => Some(false),
            _ => None,
        };
        let in_doubt = header(&call.headers, proto::HEADER_IN_DOUBT) == Some("1");
        if ends == Some(true) && !self.granted.contains_key(token) && self.unknown_in_doubt.contains(token) {
            if answered {
                self.unknown_in_doubt.remove(token);
            }
            return Ok(());
        }
        match ends {
            // Once the store named the attempt in doubt, one commit under its token besides the
            // lock's own end (its release in doubt, or its own late commit, in either order): a
            // lookup's answer, committed as the attempt's own late commit would be.
            Some(true)
                if self
                    .granted
                    .get(token)
                    .is_some_and(|g| g.in_doubt && !g.resolved && g.key == call_key(call)) =>
            {
                if let Some(g) = self.granted.get_mut(token) {
                    g.resolved = answered;
                }
                Ok(())
            }
            Some(commit) if call.cluster == self.cfg.store_cluster => {
                self.note_lock_end(commit, call_key(call), token, answered)?;
                if !commit && in_doubt && answered {
                    if let Some(g) = self.granted.get_mut(token) {
                        g.in_doubt = true;
                    }
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    pub(super) fn note_lock_end(
        &mut self,
        commit: bool,
        key: &str,
        token: &str,
        answered: bool,
    ) -> Result<(), String> {
        if commit && token == crate::worker::fallback::HAND_BACK_TOKEN {
            // A local record handed back: it ends no lock of the store's.
            return Ok(());
        }
        match self.granted.get_mut(token) {
            Some(g) if g.key == key && !g.ends.iter().any(|&(_, answered)| answered) => {
                if commit && answered && g.ends.len() >= 2 && g.ends.iter().all(|&(c, _)| c) {
                    self.tally.kept_handed_back += 1;
                }
                g.ends.push((commit, answered));
                Ok(())
            }
            Some(g) => {
                let what =
                    format!("commit or release of lock {token} ({}) for key {key}: ends {:?}", g.key, g.ends);
                self.violation(what)
            }
            None => self.violation(format!("commit or release of a lock never granted: {token}")),
        }
    }

    /// What idemstore does with one commit (the lock ends whoever holds it).
    pub(super) fn commit_one(
        &mut self,
        key: &str,
        token: &str,
        body_hash: &str,
        bytes: Vec<u8>,
        retention_us: u64,
    ) -> CommitOutcome {
        let now = self.clock.0.get();
        self.expire(key);
        let owned = matches!(self.store.get(key), Some(Stored::Lock { token: t, .. }) if *t == token);
        if matches!(self.store.get(key), Some(Stored::Record { .. })) {
            return CommitOutcome::Exists;
        }
        let stored =
            Stored::Record { body_hash: body_hash.to_string(), bytes, expires_us: now + retention_us };
        self.store.insert(key.to_string(), stored);
        // A record supersedes the attempt's trace: the key is resolved.
        self.traces.remove(key);
        self.doubt.remove(key);
        self.tally.commits += 1;
        if owned {
            CommitOutcome::Stored
        } else {
            CommitOutcome::Late
        }
    }

    /// Forgets the trace of `key` once it expired.
    pub(super) fn expire_trace(&mut self, key: &str) {
        let now = self.clock.0.get();
        if self.traces.get(key).is_some_and(|t| t.expires_us <= now) {
            self.traces.remove(key);
            self.doubt.remove(key);
        }
    }

    /// Forgets what the store holds for `key` if it has expired.
    pub(super) fn expire(&mut self, key: &str) {
        let now = self.clock.0.get();
        let live = match self.store.get(key) {
            Some(Stored::Lock { expires_us, .. } | Stored::Record { expires_us, .. }) => *expires_us > now,
            None => return,
        };
        if !live {
            if matches!(self.store.get(key), Some(Stored::Record { .. })) {
                self.tally.expired_records += 1;
            }
            self.store.remove(key);
        }
    }

    /// What idemstore does with a call, and its answer. `delivered`: the filter will read the
    /// answer (a lock it grants is then the filter's to end).
    pub(super) fn store_answers(&mut self, call: &Dispatch, delivered: bool) -> Result<Message, String> {
        let now = self.clock.0.get();
        let h = |name| header(&call.headers, name).unwrap_or_default().to_string();
        let key = h(proto::HEADER_KEY);
        self.expire(&key);
        let outcome = |o: &str| vec![(":status", "200".to_string()), (proto::HEADER_OUTCOME, o.to_string())];
        let late =
            h(proto::HEADER_DEADLINE_MS).parse::<u64>().is_ok_and(|deadline_ms| now / 1000 >= deadline_ms);
        let (headers, body) = match h(":path").as_str() {
            // Past the deadline the filter gave it: no lookup, no lock.
            proto::PATH_BEGIN if late => {
                self.tally.expired_begins += 1;
                (outcome("expired"), vec![])
            }
            proto::PATH_BEGIN => {
                let hold = h(proto::HEADER_HOLD) == "1";
                let body_hash = h(proto::HEADER_BODY_HASH);
                self.expire_trace(&key);
                let locked = matches!(self.store.get(&key), Some(Stored::Lock { .. }));
                let supersede = h(proto::HEADER_SUPERSEDE);
                if hold
                    && !supersede.is_empty()
                    && !locked
                    && self.traces.get(&key).is_some_and(|t| t.token == supersede)
                {
                    self.traces.remove(&key);
                    self.doubt.remove(&key);
                    self.tally.superseded += 1;
                }
                match (self.store.get(&key), self.traces.get(&key).filter(|_| hold)) {
                    (Some(Stored::Record { body_hash: stored, bytes, expires_us }), _)
                        if *stored == body_hash =>
                    {
                        let mut headers = outcome("record");
                        headers.push((proto::HEADER_TTL_MS, ((expires_us - now) / 1000).to_string()));
                        (headers, bytes.clone())
                    }
                    (Some(Stored::Record { .. }), _) => (outcome("mismatch"), vec![]),
                    (Some(Stored::Lock { .. }), _) => (outcome("busy"), vec![]),
                    (None, Some(t)) if t.body_hash != body_hash => (outcome("mismatch"), vec![]),
                    (None, Some(t)) => {
                        // The filter may commit under it now (a lookup's answer), once; a lock it
                        // never learned it had (the begin's answer was lost) too.
                        match self.granted.get_mut(&t.token) {
                            Some(g) => g.in_doubt = true,
                            None => {
                                self.unknown_in_doubt.insert(t.token.clone());
                            }
                        }
                        let running_ms = (t.started_us + t.lock_ttl_us).saturating_sub(now).div_ceil(1000);
                        let mut headers = outcome("in-doubt");
                        headers.push((proto::HEADER_TOKEN, t.token.clone()));
                        headers.push((proto::HEADER_STARTED_MS, (t.started_us / 1000).to_string()));
                        headers.push((proto::HEADER_RUNNING_MS, running_ms.to_string()));
                        self.tally.in_doubt_answers += 1;
                        (headers, vec![])
                    }
                    (None, None) => {
                        self.next_lock += 1;
                        let token = format!("tok{}", self.next_lock);
                        let ttl_us = h(proto::HEADER_LOCK_TTL_MS).parse::<u64>().unwrap_or(0) * 1000;
                        self.store.insert(
                            key.clone(),
                            Stored::Lock { token: token.clone(), expires_us: now + ttl_us },
                        );
                        if hold {
                            let retention_us =
                                h(proto::HEADER_RETENTION_S).parse::<u64>().unwrap_or(0) * 1_000_000;
                            let trace = Trace {
                                token: token.clone(),
                                started_us: now,
                                lock_ttl_us: ttl_us,
                                body_hash,
                                expires_us: now + retention_us.max(ttl_us),
                            };
                            self.traces.insert(key.clone(), trace);
                        }
                        if delivered {
                            self.tally.locks += 1;
                            let g =
                                Granted { key: key.clone(), ends: vec![], in_doubt: false, resolved: false };
                            self.granted.insert(token.clone(), g);
                        }
                        let mut headers = outcome("locked");
                        headers.push((proto::HEADER_TOKEN, token));
                        (headers, vec![])
                    }
                }
            }
            path @ (proto::PATH_COMMIT | proto::PATH_RELEASE) => {
                let commit = path == proto::PATH_COMMIT;
                let token = h(proto::HEADER_TOKEN);
                let owned =
                    matches!(self.store.get(&key), Some(Stored::Lock { token: t, .. }) if *t == token);
                if !commit {
                    let in_doubt = h(proto::HEADER_IN_DOUBT) == "1";
                    if owned {
                        self.store.remove(&key);
                        self.tally.releases += 1;
                    }
                    self.expire_trace(&key);
                    let traced = self.traces.get(&key).is_some_and(|t| t.token == token);
                    if traced && !in_doubt {
                        self.traces.remove(&key);
                    }
                    if traced && in_doubt && owned {
                        self.doubt.insert(key.clone(), token.clone());
                        self.tally.left_in_doubt += 1;
                    }
                    let done = owned || traced && !in_doubt;
                    (outcome(if done { "released" } else { "not-owner" }), vec![])
                } else {
                    let retention_us = h(proto::HEADER_RETENTION_S).parse::<u64>().unwrap_or(0) * 1_000_000;
                    let bytes = call.body.clone().unwrap_or_default();
                    let done =
                        self.commit_one(&key, &token, &h(proto::HEADER_BODY_HASH), bytes, retention_us);
                    (outcome(done.as_str()), vec![])
                }
            }
            other => return self.violation(format!("a store call to {other}")),
        };
        Ok((headers.into_iter().map(|(n, v)| (n.to_string(), v.into_bytes())).collect(), body))
    }
}

/// The store key a callout concerns: the store's key header, or the one a detached call carries.
pub(super) fn call_key(call: &Dispatch) -> &str {
    header(&call.headers, proto::HEADER_KEY).or(header(&call.headers, "x-store-key")).unwrap_or_default()
}

pub(super) fn describe(call: &Dispatch) -> String {
    let path = header(&call.headers, ":path").unwrap_or("?");
    let key = call_key(call);
    format!("{} {path} key {}", call.cluster, key.get(..8).unwrap_or(key))
}
