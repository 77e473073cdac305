//! Plugin configuration: the JSON in Envoy's `configuration` StringValue, declared once (the
//! table below: [`Config`] and [`RawConfig`] follow from it), parsed by serde and validated once
//! at load ([`Config::validate`]). Every error names the offending key and, for numbers, the
//! allowed range, because that message is all an operator sees in Envoy's log when the filter
//! is refused.
//!
//! A simple number or boolean key is one row of the table; a structured key is a row of its
//! `structured` part plus its check in [`parse`], read in its group's function (`store_keys`,
//! `replay_keys`, `mode_keys`, `published_keys`, `in_doubt_keys`, which `Config::validate` calls
//! in that order), and its line in `structured_to_raw`. Every key has a row in
//! docs/configuration.md, with the default the table gives (checked by a test). Uses `http` only.

use serde_json::{json, Value};

use crate::config::keys::{config, err, object, type_name, ConfigError};
use crate::config::parse::*;
use crate::config::patterns::{MediaPattern, StatusSet};
use crate::config::values::*;
use crate::http::headers;

pub mod keys;
pub(crate) mod parse;
pub mod patterns;
pub mod routes;
pub mod values;

pub use parse::{MAX_FINGERPRINT_HEADERS, MAX_HEADER_NAME};
pub use routes::Routes;

#[cfg(test)]
mod tests;

config! {
    numbers {
        store_timeout_ms: u64 = 1000, 1..=60_000;
        retention_seconds: u64 = 86_400, 1..=idem_protocol::MAX_RETENTION_S;
        lock_ttl_ms: u64 = 30_000, 100..=idem_protocol::MAX_LOCK_TTL_MS;
        lock_wait_ms: u64 = 5_000, 0..=idem_protocol::MAX_WAIT_MS;
        max_key_length: usize = 255, 1..=4096;
        max_body_bytes: usize = 1_048_576, 0..=64 * 1024 * 1024;
        max_record_bytes: usize = 1_048_576, 0..=8 * 1024 * 1024;
        /// Records this VM recently replayed, kept to answer retries without a store call (see
        /// `worker::record_cache`): at most this many per VM (0: no cache) ...
        record_cache_entries: usize = 1024, 0..=100_000;
        /// ... and at most these bytes per VM (0: no cache).
        record_cache_bytes: usize = 4 * 1024 * 1024, 0..=256 * 1024 * 1024;
        /// Store calls timing out in a row that open the breaker (see `worker::breaker`) ...
        /// Store streams per worker (`store_transport: stream`), each opened to the host Envoy
        /// picks: several spread a worker's calls over several idemstores.
        store_streams: usize = 2, 1..=16;
        breaker_failures: u32 = 3, 1..=1000;
        /// ... for this long, before one `begin` probes the store (0: no breaker).
        breaker_open_ms: u64 = 500, 0..=60_000;
        /// The local records' bound in entries ...
        local_record_entries: usize = 100_000, 0..=1_000_000;
        /// ... and in bytes, for the whole Envoy process.
        local_record_bytes: usize = 64 * 1024 * 1024, 0..=1024 * 1024 * 1024;
    }
    flags {
        require_key = false;
        /// Send a locked request to the upstream from the root context, so it outlives the client.
        detached_execution = false;
        /// Stop a guarded request on its headers (needs `allow_on_headers_stop_iteration: true`).
        /// `false` lets the headers go on and holds the body instead: for Istio's WasmPlugin, which
        /// cannot set that field, with `envoy.filters.http.buffer` after this filter so that the
        /// headers wait there and the upstream sees nothing before the filter's decision.
        pause_on_headers = true;
        /// While the store fails (`failure_mode: open`), keep one execution per key within this
        /// Envoy with a lock and records shared by its workers (see `worker::fallback`).
        local_fallback = true;
    }
    structured {
        store_cluster: String,
        /// The store run inside Envoy's process (the native host only): its settings as written,
        /// an object the host reads (see `host::native::settings`); absent: idemstore at
        /// `store_cluster`.
        store: Option<Value>,
        methods: Vec<String>,
        replay_header: String,
        replay_headers: Vec<String>,
        subject: Subject,
        failure_mode: FailureMode,
        /// `stream` (default) or `callout`.
        store_transport: StoreTransport,
        /// At most `lock_ttl_ms`.
        detached_timeout_ms: u64,
        /// Header that carries the derived store key to the upstream (absent: not sent).
        store_key_header: Option<String>,
        /// Sent to idemstore on every store call (absent: not sent).
        store_secret: Option<StoreSecret>,
        /// `idempotency_key` (default) or `inbox`.
        mode: Mode,
        /// Request headers whose values a retry must repeat (besides the target and the body).
        fingerprint_headers: Vec<String>,
        /// Compare request bodies as JSON (absent: as raw bytes).
        fingerprint_json: Option<JsonPrint>,
        /// Statuses whose answers are recorded (default `2xx`).
        store_statuses: StatusSet,
        /// Content types whose answers are recorded (absent: all but streams).
        store_content_types: Option<Vec<MediaPattern>>,
        record_too_large: TooLarge,
        /// Header added to the replay of an answer recorded without its body.
        body_omitted_header: String,
        /// gRPC statuses whose answers are recorded (default `OK`).
        store_grpc_statuses: GrpcStatuses,
        /// gRPC methods (`/package.Service/Method`, or `/package.Service/*`) that stream: passed
        /// through at once, never held.
        grpc_streaming_methods: Vec<String>,
        /// The operator's page documenting the idempotency policy: every problem the filter
        /// answers links to it (`link: <policy_url>; rel="describedby"`).
        policy_url: Option<String>,
        /// Problem `type`s are this followed by the problem's `code` (see `request::problem`).
        problem_type_base: Option<String>,
        /// Response header telling when the answer's record expires, on the first answer and
        /// every replay (absent: not sent).
        expiry_header: Option<String>,
        /// The status of a `key-reused` problem: `422` (the IETF draft's) or `409` (what ACP
        /// and UCP require).
        mismatch_status: u32,
        /// What an attempt whose answer was lost leaves: the key in doubt (`hold`) or released.
        unknown_outcome: UnknownOutcome,
        /// Where the application says whether an in-doubt attempt committed (absent: it is not
        /// asked).
        outcome_lookup: Option<OutcomeLookup>,
        /// A policy per Envoy route name (see `config::routes`).
        routes: Routes,
    }
    raw_only {
        /// The variable `store_secret` is read from.
        store_secret_env,
        /// The inbox settings, part of `mode`.
        inbox,
    }
}

impl Config {
    /// Parses and validates; `store_secret_env` is read from the process environment, which
    /// in the Wasm VM holds exactly the variables Envoy passes in
    /// `vm_config.environment_variables` (`host_env_keys` copies them from Envoy's own).
    pub fn from_json(bytes: &[u8]) -> Result<Config, ConfigError> {
        Self::from_json_with_env(bytes, &|name| std::env::var(name).ok())
    }

    /// [`Self::from_json`] with the environment given as a lookup, so that tests need not
    /// touch the process environment.
    pub fn from_json_with_env(
        bytes: &[u8],
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let value: Value = serde_json::from_slice(bytes)
            .map_err(|e| err("", format!("configuration is not valid JSON: {e}")))?;
        Self::validate(object(value, "")?, env)
    }

    /// Checks every key of a configuration as written and builds the configuration: the simple
    /// keys, then the structured ones a group at a time, each group with the rules among its
    /// keys and those it shares with the groups before it, then the route policies.
    pub fn validate(mut raw: RawConfig, env: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        // Each route inherits the rest as written, so the top level is kept before it is checked.
        let routes_written = raw.routes.take().filter(|v| !v.is_null()).map(|v| (v, raw.clone()));
        let simple = Simple::check(&mut raw)?;
        let store = store_keys(&mut raw, &simple, env)?;
        let replay = replay_keys(&mut raw)?;
        let mode = mode_keys(&mut raw, &simple, &store, &replay)?;
        let published = published_keys(&mut raw, &replay)?;
        let in_doubt = in_doubt_keys(&mut raw, &store)?;
        let routes = match routes_written {
            Some(_) if matches!(mode.mode, Mode::Mint | Mode::GrpcReplay) => {
                return Err(err("routes", "is not used in mint or grpc_replay mode"));
            }
            Some((v, top)) => Routes::parse(v, &top, env)?,
            None => Routes::default(),
        };
        let structured = Structured {
            store_cluster: store.store_cluster,
            store: store.store,
            methods: mode.methods,
            replay_header: replay.replay_header,
            replay_headers: replay.replay_headers,
            subject: mode.subject,
            failure_mode: store.failure_mode,
            store_transport: store.store_transport,
            detached_timeout_ms: store.detached_timeout_ms,
            store_key_header: store.store_key_header,
            store_secret: store.store_secret,
            mode: mode.mode,
            fingerprint_headers: mode.fingerprint_headers,
            fingerprint_json: mode.fingerprint_json,
            store_statuses: replay.store_statuses,
            store_content_types: replay.store_content_types,
            record_too_large: replay.record_too_large,
            body_omitted_header: replay.body_omitted_header,
            store_grpc_statuses: replay.store_grpc_statuses,
            grpc_streaming_methods: mode.grpc_streaming_methods,
            policy_url: published.policy_url,
            problem_type_base: published.problem_type_base,
            expiry_header: published.expiry_header,
            mismatch_status: published.mismatch_status,
            unknown_outcome: in_doubt.unknown_outcome,
            outcome_lookup: in_doubt.outcome_lookup,
            routes,
        };
        Ok(Config::assemble(simple, structured))
    }

    /// The structured keys as an operator would write them (the simple ones are added by
    /// [`Config::to_raw`]).
    fn structured_to_raw(&self) -> RawConfig {
        let subject = match &self.subject {
            Subject::ClientIp => Value::Null,
            Subject::Header(h) => json!({ "header": h }),
            Subject::Metadata { filter, path } => json!({ "metadata": { "filter": filter, "path": path } }),
            Subject::Property(path) => json!({ "property": path }),
        };
        let (mode, inbox) = match &self.mode {
            Mode::IdempotencyKey => ("idempotency_key", None),
            Mode::Mint => ("mint", None),
            Mode::GrpcReplay => ("grpc_replay", None),
            Mode::Inbox(Inbox { message_id, missing_id, duplicate_status }) => {
                let message_id = match message_id {
                    MessageIdSource::CloudEvents => json!("cloudevents"),
                    MessageIdSource::Header(h) => json!({ "header": h }),
                    MessageIdSource::JsonPointer(p) => json!({ "json_pointer": p }),
                };
                let missing_id = match missing_id {
                    MissingId::Reject => "reject",
                    MissingId::Pass => "pass",
                };
                let inbox = RawInbox {
                    message_id: Some(message_id),
                    missing_id: Some(json!(missing_id)),
                    duplicate_status: Some(json!(duplicate_status)),
                };
                ("inbox", serde_json::to_value(inbox).ok())
            }
        };
        RawConfig {
            // Empty only in mint mode, where it is not required.
            store_cluster: Some(json!(self.store_cluster)).filter(|_| !self.store_cluster.is_empty()),
            store: self.store.clone(),
            methods: Some(json!(self.methods)),
            replay_header: Some(json!(self.replay_header)),
            replay_headers: Some(json!(self.replay_headers)),
            subject: Some(subject),
            failure_mode: Some(json!(match self.failure_mode {
                FailureMode::Open => "open",
                FailureMode::Closed => "closed",
            })),
            store_transport: Some(json!(match self.store_transport {
                StoreTransport::Stream => "stream",
                StoreTransport::Callout => "callout",
            })),
            detached_timeout_ms: Some(json!(self.detached_timeout_ms)),
            store_key_header: Some(json!(self.store_key_header)),
            store_secret: Some(json!(self.store_secret.as_ref().map(StoreSecret::as_str))),
            store_secret_env: None,
            mode: Some(json!(mode)),
            inbox,
            fingerprint_headers: Some(json!(self.fingerprint_headers)),
            fingerprint_json: Some(json!(self
                .fingerprint_json
                .as_ref()
                .map(|JsonPrint { canonical, ignore }| json!({ "canonical": canonical, "ignore": ignore })))),
            store_statuses: Some(json!(self.store_statuses.entries())),
            store_content_types: Some(json!(self
                .store_content_types
                .as_ref()
                .map(|list| list.iter().map(ToString::to_string).collect::<Vec<_>>()))),
            record_too_large: Some(json!(match self.record_too_large {
                TooLarge::OmitBody => "omit_body",
                TooLarge::Release => "release",
            })),
            body_omitted_header: Some(json!(self.body_omitted_header)),
            store_grpc_statuses: Some(json!(self.store_grpc_statuses.names())),
            grpc_streaming_methods: Some(json!(self.grpc_streaming_methods)),
            policy_url: Some(json!(self.policy_url)),
            problem_type_base: Some(json!(self.problem_type_base)),
            expiry_header: Some(json!(self.expiry_header)),
            mismatch_status: Some(json!(self.mismatch_status)),
            unknown_outcome: Some(json!(match self.unknown_outcome {
                UnknownOutcome::Hold => "hold",
                UnknownOutcome::RunAgain => "run_again",
            })),
            outcome_lookup: Some(json!(self.outcome_lookup.as_ref().map(|l| json!({ "path": l.path })))),
            routes: Some(self.routes.to_raw()).filter(|_| !self.routes.is_empty()),
            ..RawConfig::default()
        }
    }

    /// The inbox settings, in inbox mode.
    pub fn inbox(&self) -> Option<&Inbox> {
        match &self.mode {
            Mode::Inbox(inbox) => Some(inbox),
            Mode::IdempotencyKey | Mode::Mint | Mode::GrpcReplay => None,
        }
    }

    /// A gRPC method that `grpc_streaming_methods` lists (`path` is the request's `:path`).
    pub fn streams_grpc(&self, path: &[u8]) -> bool {
        self.grpc_streaming_methods.iter().any(|m| match m.strip_suffix('*') {
            Some(service) => path.starts_with(service.as_bytes()),
            None => path == m.as_bytes(),
        })
    }

    /// The longest `retention_seconds` and `lock_ttl_ms` of the top level and every route: what
    /// the local fallback keeps its locks and records for (they outlive their request's route).
    pub fn longest_terms(&self) -> (u64, u64) {
        self.routes.iter().fold((self.retention_seconds, self.lock_ttl_ms), |(r, l), (_, c)| {
            (r.max(c.retention_seconds), l.max(c.lock_ttl_ms))
        })
    }

    pub fn guards_method(&self, method: &str) -> bool {
        // Methods are case-sensitive (RFC 9110), but some frameworks match them without case:
        // an unguarded `post` that the application runs as `POST` would be a duplicate.
        self.methods.iter().any(|m| m.eq_ignore_ascii_case(method))
    }
}

/// The store and the calls made under its lock: where it is (`store_cluster`) and how it is
/// reached (`store_transport`, `store_secret`), what a failing store means (`failure_mode`),
/// what the upstream gets of it (`store_key_header`) and how long a detached call may take.
struct StoreKeys {
    store_cluster: String,
    store: Option<Value>,
    failure_mode: FailureMode,
    store_transport: StoreTransport,
    detached_timeout_ms: u64,
    store_key_header: Option<String>,
    store_secret: Option<StoreSecret>,
}

/// Reads `raw.mode` as written (not yet taken: [`mode_keys`] comes after).
fn store_keys(
    raw: &mut RawConfig,
    simple: &Simple,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<StoreKeys, ConfigError> {
    // The sending side (mint mode) and the replay listener make no store calls.
    let no_store = matches!(&raw.mode, Some(Value::String(m)) if m == "mint" || m == "grpc_replay");
    // Which store, and what each host accepts, is the host's to check: here only its shape.
    let store = match raw.store.take() {
        None | Some(Value::Null) => None,
        Some(v @ Value::Object(_)) => Some(v),
        Some(v) => return Err(err("store", format!("must be an object, not {}", type_name(&v)))),
    };
    let store_cluster = match raw.store_cluster.take() {
        None if no_store || store.is_some() => String::new(),
        None => return Err(err("store_cluster", "is required (the Envoy cluster of idemstore), or `store`")),
        Some(_) if store.is_some() => {
            return Err(err(
                "store_cluster",
                "and `store` exclude each other (idemstore, or the store in Envoy)",
            ));
        }
        Some(v) => non_empty_string("store_cluster", v)?,
    };
    let failure_mode = either(
        "failure_mode",
        raw.failure_mode.take(),
        [("open", FailureMode::Open), ("closed", FailureMode::Closed)],
    )?;
    let store_transport = either(
        "store_transport",
        raw.store_transport.take(),
        [("stream", StoreTransport::Stream), ("callout", StoreTransport::Callout)],
    )?;
    // The stream names the cluster inside a serialized `GrpcService` the host takes as a string.
    if store.is_some() && store_transport == StoreTransport::Callout {
        return Err(err("store_transport", "must be `stream` with `store` (there is no cluster to call)"));
    }
    if store_transport == StoreTransport::Stream && store_cluster.len() > 120 {
        return Err(err("store_cluster", "is at most 120 bytes with `store_transport: stream`"));
    }
    // A detached call that outlived its lock would run unguarded: it is bounded by the TTL.
    let lock_ttl_ms = simple.lock_ttl_ms;
    let detached_timeout_ms = keys::number(
        raw.detached_timeout_ms.take(),
        "detached_timeout_ms",
        1..=lock_ttl_ms,
        15_000.min(lock_ttl_ms),
    )
    .map_err(|e| ConfigError { message: format!("{} (at most lock_ttl_ms)", e.message), ..e })?;
    let store_key_header = match raw.store_key_header.take() {
        None | Some(Value::Null) => None,
        Some(v) => {
            let name = header_name("store_key_header", v)?;
            if name == "idempotency-key" || headers::is_never_replayed(&name) {
                return Err(err("store_key_header", format!("must not be {name:?}")));
            }
            Some(name)
        }
    };
    let store_secret = store_secret(raw.store_secret.take(), raw.store_secret_env.take(), env)?;
    Ok(StoreKeys {
        store_cluster,
        store,
        failure_mode,
        store_transport,
        detached_timeout_ms,
        store_key_header,
        store_secret,
    })
}

/// What a record keeps and what its replay says: the replay's headers (`replay_header`,
/// `replay_headers`, `body_omitted_header`) and which answers are kept, in what form
/// (`store_statuses`, `store_content_types`, `record_too_large`, `store_grpc_statuses`).
struct ReplayKeys {
    replay_header: String,
    replay_headers: Vec<String>,
    store_statuses: StatusSet,
    store_content_types: Option<Vec<MediaPattern>>,
    record_too_large: TooLarge,
    body_omitted_header: String,
    store_grpc_statuses: GrpcStatuses,
}

fn replay_keys(raw: &mut RawConfig) -> Result<ReplayKeys, ConfigError> {
    let replay_header = match raw.replay_header.take() {
        None => "x-idempotent-replay".to_string(),
        Some(v) => header_name("replay_header", v)?,
    };
    let replay_headers = match raw.replay_headers.take() {
        None => vec!["content-type".to_string(), "location".to_string()],
        Some(v) => replay_headers(v)?,
    };
    let store_statuses = match raw.store_statuses.take() {
        None => StatusSet::default(),
        Some(v) => store_statuses(v)?,
    };
    let store_content_types = match raw.store_content_types.take() {
        None | Some(Value::Null) => None,
        Some(v) => Some(store_content_types(v)?),
    };
    let record_too_large = either(
        "record_too_large",
        raw.record_too_large.take(),
        [("omit_body", TooLarge::OmitBody), ("release", TooLarge::Release)],
    )?;
    let body_omitted_header = match raw.body_omitted_header.take() {
        None => "x-idempotent-body-omitted".to_string(),
        Some(v) => header_name("body_omitted_header", v)?,
    };
    let store_grpc_statuses = match raw.store_grpc_statuses.take() {
        None => GrpcStatuses::default(),
        Some(v) => store_grpc_statuses(v)?,
    };
    for (key, name) in [("replay_header", &replay_header), ("body_omitted_header", &body_omitted_header)] {
        set_on_replays(key, name)?;
    }
    if body_omitted_header == replay_header {
        return Err(err("body_omitted_header", "must differ from `replay_header`"));
    }
    Ok(ReplayKeys {
        replay_header,
        replay_headers,
        store_statuses,
        store_content_types,
        record_too_large,
        body_omitted_header,
        store_grpc_statuses,
    })
}

/// A header the filter sets on replays (`key` names it) must be neither one never replayed nor
/// one that says how to read the body.
fn set_on_replays(key: &str, name: &str) -> Result<(), ConfigError> {
    if headers::is_never_replayed(name) || headers::is_representation(name) {
        return Err(err(key, format!("must not be {name:?}: the filter sets it on replays")));
    }
    Ok(())
}

/// What is guarded and what identifies a request: the `mode` (with `inbox`), the guarded
/// `methods` and the gRPC methods passed through (`grpc_streaming_methods`), whose requests a
/// key is scoped to (`subject`) and what a retry must repeat (`fingerprint_headers`,
/// `fingerprint_json`).
struct ModeKeys {
    mode: Mode,
    methods: Vec<String>,
    subject: Subject,
    fingerprint_headers: Vec<String>,
    fingerprint_json: Option<JsonPrint>,
    grpc_streaming_methods: Vec<String>,
}

/// The mode's rules refuse keys of the groups before it that the mode does not use.
fn mode_keys(
    raw: &mut RawConfig,
    simple: &Simple,
    store: &StoreKeys,
    replay: &ReplayKeys,
) -> Result<ModeKeys, ConfigError> {
    let methods = match raw.methods.take() {
        None => vec!["POST".to_string(), "PATCH".to_string()],
        Some(v) => methods(v)?,
    };
    let subject = match raw.subject.take() {
        None | Some(Value::Null) => Subject::ClientIp,
        Some(v) => subject(v)?,
    };
    let mode = mode(raw.mode.take(), raw.inbox.take())?;
    let fingerprint_headers = match raw.fingerprint_headers.take() {
        None | Some(Value::Null) => Vec::new(),
        Some(v) => fingerprint_headers(v)?,
    };
    let fingerprint_json = match raw.fingerprint_json.take() {
        None | Some(Value::Null) => None,
        Some(v) => Some(fingerprint_json(v)?),
    };
    let grpc_streaming_methods = match raw.grpc_streaming_methods.take() {
        None | Some(Value::Null) => Vec::new(),
        Some(v) => grpc_streaming_methods(v)?,
    };
    if mode == Mode::Mint {
        // The sending side only adds keys; the guard where the request arrives does the rest.
        for (key, set) in [
            ("require_key", simple.require_key),
            ("detached_execution", simple.detached_execution),
            ("store_key_header", store.store_key_header.is_some()),
            ("subject", subject != Subject::ClientIp),
        ] {
            if set {
                return Err(err(
                    key,
                    "is not used in mint mode (it adds keys for the guard where the request \
                     arrives, and makes no store calls)",
                ));
            }
        }
    }
    if let Mode::Inbox(inbox) = &mode {
        // The message id is the identity: a redelivery may differ in anything else.
        for (key, set) in [
            ("fingerprint_headers", !fingerprint_headers.is_empty()),
            ("fingerprint_json", fingerprint_json.is_some()),
        ] {
            if set {
                return Err(err(key, "is not used in inbox mode (the message id is the identity)"));
            }
        }
        for (key, set) in [
            ("store_statuses", replay.store_statuses != StatusSet::default()),
            ("record_too_large", replay.record_too_large != TooLarge::OmitBody),
        ] {
            if set {
                return Err(err(
                    key,
                    "is not used in inbox mode (any 2xx marks a message handled, as its status \
                     alone when the answer cannot be kept)",
                ));
            }
        }
        // In inbox mode the message scopes the record, not the caller: a broker delivers
        // from many addresses, and the Idempotency-Key header is not read at all.
        if simple.require_key {
            return Err(err("require_key", "has no effect in inbox mode: use `inbox.missing_id`"));
        }
        if subject != Subject::ClientIp {
            return Err(err(
                "subject",
                "is not used in inbox mode (the message's source and id scope the record)",
            ));
        }
        if store.store_key_header.is_some() && !simple.pause_on_headers && inbox.message_id.may_need_body() {
            return Err(err(
                "store_key_header",
                "cannot be set with `pause_on_headers: false` when the message id may come from \
                 the body (the request headers have gone on by then)",
            ));
        }
    }
    Ok(ModeKeys { mode, methods, subject, fingerprint_headers, fingerprint_json, grpc_streaming_methods })
}

/// What the filter tells clients beyond the answer: the policy its problems link to
/// (`policy_url`, `problem_type_base`), when a record expires (`expiry_header`), and the status
/// of a reused key (`mismatch_status`).
struct PublishedKeys {
    policy_url: Option<String>,
    problem_type_base: Option<String>,
    expiry_header: Option<String>,
    mismatch_status: u32,
}

fn published_keys(raw: &mut RawConfig, replay: &ReplayKeys) -> Result<PublishedKeys, ConfigError> {
    let policy_url = match raw.policy_url.take() {
        None | Some(Value::Null) => None,
        Some(v) => Some(uri("policy_url", v, true)?),
    };
    let problem_type_base = match raw.problem_type_base.take() {
        None | Some(Value::Null) => None,
        Some(v) => Some(uri("problem_type_base", v, false)?),
    };
    let expiry_header = match raw.expiry_header.take() {
        None | Some(Value::Null) => None,
        Some(v) => Some(header_name("expiry_header", v)?),
    };
    if let Some(name) = &expiry_header {
        set_on_replays("expiry_header", name)?;
        if replay.replay_headers.contains(name)
            || *name == replay.replay_header
            || *name == replay.body_omitted_header
        {
            return Err(err(
                "expiry_header",
                "must differ from `replay_header`, `body_omitted_header` and every `replay_headers` entry",
            ));
        }
    }
    let mismatch_status = match raw.mismatch_status.take() {
        None | Some(Value::Null) => 422,
        Some(v) => mismatch_status(v)?,
    };
    Ok(PublishedKeys { policy_url, problem_type_base, expiry_header, mismatch_status })
}

/// What an attempt whose answer was lost leaves (`unknown_outcome`), and where the application
/// is asked about it (`outcome_lookup`).
struct InDoubtKeys {
    unknown_outcome: UnknownOutcome,
    outcome_lookup: Option<OutcomeLookup>,
}

fn in_doubt_keys(raw: &mut RawConfig, store: &StoreKeys) -> Result<InDoubtKeys, ConfigError> {
    let unknown_outcome = either(
        "unknown_outcome",
        raw.unknown_outcome.take(),
        [("hold", UnknownOutcome::Hold), ("run_again", UnknownOutcome::RunAgain)],
    )?;
    let outcome_lookup = match raw.outcome_lookup.take() {
        None | Some(Value::Null) => None,
        Some(v) => Some(outcome_lookup(v)?),
    };
    if outcome_lookup.is_some() && store.store_key_header.is_none() {
        return Err(err(
            "outcome_lookup",
            "needs `store_key_header`: the application must have received the store key with \
             the first attempt to be asked about it",
        ));
    }
    Ok(InDoubtKeys { unknown_outcome, outcome_lookup })
}
