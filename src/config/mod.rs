//! Plugin configuration: the JSON in Envoy's `configuration` StringValue, declared once
//! ([`RawConfig`]), parsed by serde and validated once at load ([`Config::validate`]). Every
//! error names the offending key and, for numbers, the allowed range, because that message is
//! all an operator sees in Envoy's log when the filter is refused.

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{json, Value};
use std::fmt;
use std::ops::RangeInclusive;

use crate::http::headers;
use crate::request::keep::{MediaPattern, StatusSet};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailureMode {
    /// A store fault lets the request run unguarded (counted as degraded).
    Open,
    /// A store fault answers `503`.
    Closed,
}

/// The shared secret sent to idemstore in `x-idem-secret`. Its `Debug` never shows the value,
/// so a logged or asserted `Config` cannot leak it.
#[derive(Clone, PartialEq, Eq)]
pub struct StoreSecret(String);

impl StoreSecret {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for StoreSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StoreSecret(<redacted>)")
    }
}

/// Where the caller's identity comes from. Requests without one are scoped by client IP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Subject {
    ClientIp,
    /// A request header. Only safe when Envoy itself sets or overwrites it.
    Header(String),
    /// Dynamic metadata written by an earlier filter (e.g. `jwt_authn`'s payload).
    Metadata {
        filter: String,
        path: Vec<String>,
    },
}

/// What the filter guards: clients' `Idempotency-Key`s, or messages a broker pushes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// The `Idempotency-Key` contract (the default).
    IdempotencyKey,
    /// The inbox: the message id of a pushed event is the key (`"mode": "inbox"`).
    Inbox(Inbox),
}

/// Inbox mode: exactly-once handling of messages a broker pushes over HTTP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inbox {
    pub message_id: MessageIdSource,
    pub missing_id: MissingId,
    /// Answer duplicates with this bare `2xx` (plus the replay header) instead of the stored
    /// response.
    pub duplicate_status: Option<u16>,
}

/// Where the message id is read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MessageIdSource {
    /// CloudEvents over HTTP: `ce-id` + `ce-source` (binary mode), or `id` + `source` of an
    /// `application/cloudevents+json` body (structured mode).
    CloudEvents,
    /// One request header's value.
    Header(String),
    /// A JSON pointer into the request body (RFC 6901), e.g. `/message/messageId`.
    JsonPointer(String),
}

impl MessageIdSource {
    /// True when the id may have to be read from the body.
    pub fn may_need_body(&self) -> bool {
        !matches!(self, MessageIdSource::Header(_))
    }
}

/// What a guarded request without a message id gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissingId {
    /// `400` problem.
    Reject,
    /// Runs unguarded (counted as `passthrough`).
    Pass,
}

pub const DUPLICATE_STATUS: RangeInclusive<u64> = 200..=299;

/// `fingerprint_json`: the request body is compared as JSON (see
/// [`crate::request::fingerprint::json_body_hash`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonPrint {
    /// Member order does not count (insignificant whitespace never does).
    pub canonical: bool,
    /// RFC 6901 pointers to members left out of the comparison (e.g. a timestamp the client
    /// sets on every attempt).
    pub ignore: Vec<String>,
}

/// `record_too_large`: what becomes of a kept answer whose body is over `max_record_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TooLarge {
    /// Recorded without its body: retries get the status and headers, and an empty body
    /// marked by `body_omitted_header`; the upstream runs once.
    OmitBody,
    /// Not recorded: the lock is given back and the next retry runs again.
    Release,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub store_cluster: String,
    pub store_timeout_ms: u64,
    pub retention_seconds: u64,
    pub lock_ttl_ms: u64,
    pub lock_wait_ms: u64,
    pub methods: Vec<String>,
    pub require_key: bool,
    pub max_key_length: usize,
    pub max_body_bytes: usize,
    pub max_record_bytes: usize,
    pub replay_header: String,
    pub replay_headers: Vec<String>,
    pub subject: Subject,
    pub failure_mode: FailureMode,
    /// Send a locked request to the upstream from the root context, so it outlives the client.
    pub detached_execution: bool,
    pub detached_timeout_ms: u64,
    /// Header that carries the derived store key to the upstream (absent: not sent).
    pub store_key_header: Option<String>,
    /// Sent to idemstore on every store call (absent: not sent).
    pub store_secret: Option<StoreSecret>,
    /// Stop a guarded request on its headers (needs `allow_on_headers_stop_iteration: true`).
    /// `false` lets the headers go on and holds the body instead: for Istio's WasmPlugin, which
    /// cannot set that field, with `envoy.filters.http.buffer` after this filter so that the
    /// headers wait there and the upstream sees nothing before the filter's decision.
    pub pause_on_headers: bool,
    /// Records this VM recently replayed, kept to answer retries without a store call (see
    /// `recent`): at most this many per VM (0: no cache) ...
    pub record_cache_entries: usize,
    /// ... and at most these bytes per VM (0: no cache).
    pub record_cache_bytes: usize,
    /// `idempotency_key` (default) or `inbox`.
    pub mode: Mode,
    /// Request headers whose values a retry must repeat (besides the target and the body).
    pub fingerprint_headers: Vec<String>,
    /// Compare request bodies as JSON (absent: as raw bytes).
    pub fingerprint_json: Option<JsonPrint>,
    /// Statuses whose answers are recorded (default `2xx`).
    pub store_statuses: StatusSet,
    /// Content types whose answers are recorded (absent: all but streams).
    pub store_content_types: Option<Vec<MediaPattern>>,
    pub record_too_large: TooLarge,
    /// Header added to the replay of an answer recorded without its body.
    pub body_omitted_header: String,
    /// Store calls timing out in a row that open the breaker (see `breaker`) ...
    pub breaker_failures: u32,
    /// ... for this long, before one `begin` probes the store (0: no breaker).
    pub breaker_open_ms: u64,
    /// While the store fails (`failure_mode: open`), keep one execution per key within this
    /// Envoy with a lock and records shared by its workers (see `fallback`).
    pub local_fallback: bool,
    /// The local records' bound in entries ...
    pub local_record_entries: usize,
    /// ... and in bytes, for the whole Envoy process.
    pub local_record_bytes: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub key: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.key.is_empty() {
            write!(f, "invalid configuration: {}", self.message)
        } else {
            write!(f, "invalid configuration: `{}` {}", self.key, self.message)
        }
    }
}

fn err(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError { key: key.to_string(), message: message.into() }
}

/// A key's value as written, JSON `null` included (`None`: the key is absent), so that every
/// key decides for itself whether `null` means "not set" or is refused.
fn given<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

/// Declares the keys of a configuration object: each one a field holding its JSON value, any
/// other key refused by serde (`deny_unknown_fields`). The values are checked by
/// [`Config::validate`], whose errors name the key and its range.
macro_rules! keys {
    ($(#[$meta:meta])* $name:ident { $($(#[$doc:meta])* $key:ident,)* }) => {
        $(#[$meta])*
        #[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct $name {
            $(
                $(#[$doc])*
                #[serde(default, deserialize_with = "given", skip_serializing_if = "Option::is_none")]
                pub $key: Option<Value>,
            )*
        }
    };
}

keys! {
    /// The plugin configuration as written: the one declaration of its keys
    /// (docs/configuration.md documents each).
    RawConfig {
        store_cluster,
        store_timeout_ms,
        retention_seconds,
        lock_ttl_ms,
        lock_wait_ms,
        methods,
        require_key,
        max_key_length,
        max_body_bytes,
        max_record_bytes,
        replay_header,
        replay_headers,
        subject,
        failure_mode,
        detached_execution,
        detached_timeout_ms,
        store_key_header,
        store_secret,
        store_secret_env,
        pause_on_headers,
        record_cache_entries,
        record_cache_bytes,
        mode,
        inbox,
        fingerprint_headers,
        fingerprint_json,
        store_statuses,
        store_content_types,
        record_too_large,
        body_omitted_header,
        breaker_failures,
        breaker_open_ms,
        local_fallback,
        local_record_entries,
        local_record_bytes,
    }
}

keys! {
    /// `inbox`, in inbox mode.
    RawInbox {
        message_id,
        missing_id,
        duplicate_status,
    }
}

keys! {
    /// `fingerprint_json`.
    RawJsonPrint {
        canonical,
        ignore,
    }
}

/// `value` as the keys of `T`: not an object, or a key `T` does not declare, is refused, named
/// under `prefix` (`""` at the top, else e.g. `"inbox."`).
fn object<T: for<'de> Deserialize<'de>>(value: Value, prefix: &str) -> Result<T, ConfigError> {
    let key = prefix.trim_end_matches('.');
    if !value.is_object() {
        let message = match key {
            "" => "configuration must be a JSON object".to_string(),
            _ => format!("must be an object, got {}", type_name(&value)),
        };
        return Err(err(key, message));
    }
    serde_json::from_value(value).map_err(|e| {
        let text = e.to_string();
        match text.strip_prefix("unknown field `").and_then(|rest| rest.split_once('`')) {
            Some((unknown, _)) => err(&format!("{prefix}{unknown}"), "is not a known key"),
            None => err(key, text),
        }
    })
}

pub const RETENTION_SECONDS: RangeInclusive<u64> = 1..=idem_protocol::MAX_RETENTION_S;
pub const STORE_TIMEOUT_MS: RangeInclusive<u64> = 1..=60_000;
pub const LOCK_TTL_MS: RangeInclusive<u64> = 100..=idem_protocol::MAX_LOCK_TTL_MS;
pub const LOCK_WAIT_MS: RangeInclusive<u64> = 0..=idem_protocol::MAX_WAIT_MS;
pub const MAX_KEY_LENGTH: RangeInclusive<u64> = 1..=4096;
pub const MAX_BODY_BYTES: RangeInclusive<u64> = 0..=64 * 1024 * 1024;
pub const MAX_RECORD_BYTES: RangeInclusive<u64> = 0..=8 * 1024 * 1024;
pub const RECORD_CACHE_ENTRIES: RangeInclusive<u64> = 0..=100_000;
pub const RECORD_CACHE_BYTES: RangeInclusive<u64> = 0..=256 * 1024 * 1024;
pub const BREAKER_FAILURES: RangeInclusive<u64> = 1..=1000;
pub const BREAKER_OPEN_MS: RangeInclusive<u64> = 0..=60_000;
pub const LOCAL_RECORD_ENTRIES: RangeInclusive<u64> = 0..=1_000_000;
pub const LOCAL_RECORD_BYTES: RangeInclusive<u64> = 0..=1024 * 1024 * 1024;
/// At most this many `fingerprint_headers` (each costs a digest in every record).
pub const MAX_FINGERPRINT_HEADERS: usize = 32;

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

    /// Checks every key of a configuration as written and builds the configuration.
    pub fn validate(raw: RawConfig, env: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let store_cluster = match raw.store_cluster {
            None => return Err(err("store_cluster", "is required (the Envoy cluster of idemstore)")),
            Some(v) => non_empty_string("store_cluster", v)?,
        };
        let store_timeout_ms = number(raw.store_timeout_ms, "store_timeout_ms", STORE_TIMEOUT_MS, 1000)?;
        let retention_seconds =
            number(raw.retention_seconds, "retention_seconds", RETENTION_SECONDS, 86_400)?;
        let lock_ttl_ms = number(raw.lock_ttl_ms, "lock_ttl_ms", LOCK_TTL_MS, 30_000)?;
        let lock_wait_ms = number(raw.lock_wait_ms, "lock_wait_ms", LOCK_WAIT_MS, 5_000)?;
        let methods = match raw.methods {
            None => vec!["POST".to_string(), "PATCH".to_string()],
            Some(v) => methods(v)?,
        };
        let require_key = boolean(raw.require_key, "require_key", false)?;
        let max_key_length = number(raw.max_key_length, "max_key_length", MAX_KEY_LENGTH, 255)? as usize;
        let max_body_bytes =
            number(raw.max_body_bytes, "max_body_bytes", MAX_BODY_BYTES, 1_048_576)? as usize;
        let max_record_bytes =
            number(raw.max_record_bytes, "max_record_bytes", MAX_RECORD_BYTES, 1_048_576)? as usize;
        let replay_header = match raw.replay_header {
            None => "x-idempotent-replay".to_string(),
            Some(v) => header_name("replay_header", v)?,
        };
        let replay_headers = match raw.replay_headers {
            None => vec!["content-type".to_string(), "location".to_string()],
            Some(v) => replay_headers(v)?,
        };
        let subject = match raw.subject {
            None | Some(Value::Null) => Subject::ClientIp,
            Some(v) => subject(v)?,
        };
        let failure_mode = match raw.failure_mode {
            None => FailureMode::Open,
            Some(Value::String(s)) if s == "open" => FailureMode::Open,
            Some(Value::String(s)) if s == "closed" => FailureMode::Closed,
            Some(_) => return Err(err("failure_mode", "must be \"open\" or \"closed\"")),
        };

        let detached_execution = boolean(raw.detached_execution, "detached_execution", false)?;
        // A detached call that outlived its lock would run unguarded: it is bounded by the TTL.
        let detached_timeout_ms =
            number(raw.detached_timeout_ms, "detached_timeout_ms", 1..=lock_ttl_ms, 15_000.min(lock_ttl_ms))
                .map_err(|e| ConfigError { message: format!("{} (at most lock_ttl_ms)", e.message), ..e })?;
        let store_key_header = match raw.store_key_header {
            None | Some(Value::Null) => None,
            Some(v) => {
                let name = header_name("store_key_header", v)?;
                if name == "idempotency-key" || headers::is_never_replayed(&name) {
                    return Err(err("store_key_header", format!("must not be {name:?}")));
                }
                Some(name)
            }
        };

        let store_secret = store_secret(raw.store_secret, raw.store_secret_env, env)?;
        let pause_on_headers = boolean(raw.pause_on_headers, "pause_on_headers", true)?;
        let record_cache_entries =
            number(raw.record_cache_entries, "record_cache_entries", RECORD_CACHE_ENTRIES, 1024)? as usize;
        let record_cache_bytes =
            number(raw.record_cache_bytes, "record_cache_bytes", RECORD_CACHE_BYTES, 4 * 1024 * 1024)?
                as usize;
        let breaker_failures = number(raw.breaker_failures, "breaker_failures", BREAKER_FAILURES, 3)? as u32;
        let breaker_open_ms = number(raw.breaker_open_ms, "breaker_open_ms", BREAKER_OPEN_MS, 500)?;
        let local_fallback = boolean(raw.local_fallback, "local_fallback", true)?;
        let local_record_entries =
            number(raw.local_record_entries, "local_record_entries", LOCAL_RECORD_ENTRIES, 100_000)? as usize;
        let local_record_bytes =
            number(raw.local_record_bytes, "local_record_bytes", LOCAL_RECORD_BYTES, 64 * 1024 * 1024)?
                as usize;
        let mode = mode(raw.mode, raw.inbox)?;
        let fingerprint_headers = match raw.fingerprint_headers {
            None | Some(Value::Null) => Vec::new(),
            Some(v) => fingerprint_headers(v)?,
        };
        let fingerprint_json = match raw.fingerprint_json {
            None | Some(Value::Null) => None,
            Some(v) => Some(fingerprint_json(v)?),
        };
        let store_statuses = match raw.store_statuses {
            None => StatusSet::default(),
            Some(v) => store_statuses(v)?,
        };
        let store_content_types = match raw.store_content_types {
            None | Some(Value::Null) => None,
            Some(v) => Some(store_content_types(v)?),
        };
        let record_too_large = match raw.record_too_large {
            None => TooLarge::OmitBody,
            Some(Value::String(s)) if s == "omit_body" => TooLarge::OmitBody,
            Some(Value::String(s)) if s == "release" => TooLarge::Release,
            Some(_) => return Err(err("record_too_large", "must be \"omit_body\" or \"release\"")),
        };
        let body_omitted_header = match raw.body_omitted_header {
            None => "x-idempotent-body-omitted".to_string(),
            Some(v) => header_name("body_omitted_header", v)?,
        };
        for (key, name) in [("replay_header", &replay_header), ("body_omitted_header", &body_omitted_header)]
        {
            if headers::is_never_replayed(name) || headers::is_representation(name) {
                return Err(err(key, format!("must not be {name:?}: the filter sets it on replays")));
            }
        }
        if body_omitted_header == replay_header {
            return Err(err("body_omitted_header", "must differ from `replay_header`"));
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
                ("store_statuses", store_statuses != StatusSet::default()),
                ("record_too_large", record_too_large != TooLarge::OmitBody),
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
            if require_key {
                return Err(err("require_key", "has no effect in inbox mode: use `inbox.missing_id`"));
            }
            if subject != Subject::ClientIp {
                return Err(err(
                    "subject",
                    "is not used in inbox mode (the message's source and id scope the record)",
                ));
            }
            if store_key_header.is_some() && !pause_on_headers && inbox.message_id.may_need_body() {
                return Err(err(
                    "store_key_header",
                    "cannot be set with `pause_on_headers: false` when the message id may come from \
                     the body (the request headers have gone on by then)",
                ));
            }
        }

        Ok(Config {
            store_cluster,
            store_timeout_ms,
            retention_seconds,
            lock_ttl_ms,
            lock_wait_ms,
            methods,
            require_key,
            max_key_length,
            max_body_bytes,
            max_record_bytes,
            replay_header,
            replay_headers,
            subject,
            failure_mode,
            detached_execution,
            detached_timeout_ms,
            store_key_header,
            store_secret,
            pause_on_headers,
            record_cache_entries,
            record_cache_bytes,
            mode,
            fingerprint_headers,
            fingerprint_json,
            store_statuses,
            store_content_types,
            record_too_large,
            body_omitted_header,
            breaker_failures,
            breaker_open_ms,
            local_fallback,
            local_record_entries,
            local_record_bytes,
        })
    }

    /// The configuration as an operator would write it, every key explicit: what
    /// [`Config::validate`] takes back as the same configuration (the config fuzz target checks
    /// it). The destructuring names every field, so that a new one does not build until it is
    /// written here too.
    pub fn to_raw(&self) -> RawConfig {
        let Config {
            store_cluster,
            store_timeout_ms,
            retention_seconds,
            lock_ttl_ms,
            lock_wait_ms,
            methods,
            require_key,
            max_key_length,
            max_body_bytes,
            max_record_bytes,
            replay_header,
            replay_headers,
            subject,
            failure_mode,
            detached_execution,
            detached_timeout_ms,
            store_key_header,
            store_secret,
            pause_on_headers,
            record_cache_entries,
            record_cache_bytes,
            mode,
            fingerprint_headers,
            fingerprint_json,
            store_statuses,
            store_content_types,
            record_too_large,
            body_omitted_header,
            breaker_failures,
            breaker_open_ms,
            local_fallback,
            local_record_entries,
            local_record_bytes,
        } = self;
        let subject = match subject {
            Subject::ClientIp => Value::Null,
            Subject::Header(h) => json!({ "header": h }),
            Subject::Metadata { filter, path } => json!({ "metadata": { "filter": filter, "path": path } }),
        };
        let (mode, inbox) = match mode {
            Mode::IdempotencyKey => ("idempotency_key", None),
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
            store_cluster: Some(json!(store_cluster)),
            store_timeout_ms: Some(json!(store_timeout_ms)),
            retention_seconds: Some(json!(retention_seconds)),
            lock_ttl_ms: Some(json!(lock_ttl_ms)),
            lock_wait_ms: Some(json!(lock_wait_ms)),
            methods: Some(json!(methods)),
            require_key: Some(json!(require_key)),
            max_key_length: Some(json!(max_key_length)),
            max_body_bytes: Some(json!(max_body_bytes)),
            max_record_bytes: Some(json!(max_record_bytes)),
            replay_header: Some(json!(replay_header)),
            replay_headers: Some(json!(replay_headers)),
            subject: Some(subject),
            failure_mode: Some(json!(match failure_mode {
                FailureMode::Open => "open",
                FailureMode::Closed => "closed",
            })),
            detached_execution: Some(json!(detached_execution)),
            detached_timeout_ms: Some(json!(detached_timeout_ms)),
            store_key_header: Some(json!(store_key_header)),
            store_secret: Some(json!(store_secret.as_ref().map(StoreSecret::as_str))),
            store_secret_env: None,
            pause_on_headers: Some(json!(pause_on_headers)),
            record_cache_entries: Some(json!(record_cache_entries)),
            record_cache_bytes: Some(json!(record_cache_bytes)),
            mode: Some(json!(mode)),
            inbox,
            fingerprint_headers: Some(json!(fingerprint_headers)),
            fingerprint_json: Some(json!(fingerprint_json
                .as_ref()
                .map(|JsonPrint { canonical, ignore }| json!({ "canonical": canonical, "ignore": ignore })))),
            store_statuses: Some(json!(store_statuses.entries())),
            store_content_types: Some(json!(store_content_types
                .as_ref()
                .map(|list| list.iter().map(ToString::to_string).collect::<Vec<_>>()))),
            record_too_large: Some(json!(match record_too_large {
                TooLarge::OmitBody => "omit_body",
                TooLarge::Release => "release",
            })),
            body_omitted_header: Some(json!(body_omitted_header)),
            breaker_failures: Some(json!(breaker_failures)),
            breaker_open_ms: Some(json!(breaker_open_ms)),
            local_fallback: Some(json!(local_fallback)),
            local_record_entries: Some(json!(local_record_entries)),
            local_record_bytes: Some(json!(local_record_bytes)),
        }
    }

    /// The inbox settings, in inbox mode.
    pub fn inbox(&self) -> Option<&Inbox> {
        match &self.mode {
            Mode::Inbox(inbox) => Some(inbox),
            Mode::IdempotencyKey => None,
        }
    }

    pub fn guards_method(&self, method: &str) -> bool {
        // Methods are case-sensitive (RFC 9110), but some frameworks match them without case:
        // an unguarded `post` that the application runs as `POST` would be a duplicate.
        self.methods.iter().any(|m| m.eq_ignore_ascii_case(method))
    }
}

fn number(v: Option<Value>, key: &str, range: RangeInclusive<u64>, default: u64) -> Result<u64, ConfigError> {
    let range_text = || format!("must be an integer from {} to {}", range.start(), range.end());
    match v {
        None => Ok(default),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(n) if range.contains(&n) => Ok(n),
            _ => Err(err(key, format!("{}, got {n}", range_text()))),
        },
        Some(other) => Err(err(key, format!("{}, got {}", range_text(), type_name(&other)))),
    }
}

fn boolean(v: Option<Value>, key: &str, default: bool) -> Result<bool, ConfigError> {
    match v {
        None => Ok(default),
        Some(Value::Bool(b)) => Ok(b),
        Some(other) => Err(err(key, format!("must be true or false, got {}", type_name(&other)))),
    }
}

fn non_empty_string(key: &str, v: Value) -> Result<String, ConfigError> {
    match v {
        Value::String(s) if !s.is_empty() => Ok(s),
        other => Err(err(key, format!("must be a non-empty string, got {}", type_name(&other)))),
    }
}

fn string_list(key: &str, v: Value) -> Result<Vec<String>, ConfigError> {
    let Value::Array(items) = v else {
        return Err(err(key, format!("must be a list of strings, got {}", type_name(&v))));
    };
    items.into_iter().map(|item| non_empty_string(key, item)).collect()
}

fn methods(v: Value) -> Result<Vec<String>, ConfigError> {
    let list = string_list("methods", v)?;
    if list.is_empty() {
        return Err(err("methods", "must name at least one method"));
    }
    for m in &list {
        if !m.bytes().all(|b| b.is_ascii_uppercase()) {
            return Err(err("methods", format!("entries must be upper-case HTTP methods, got {m:?}")));
        }
    }
    Ok(list)
}

fn header_name(key: &str, v: Value) -> Result<String, ConfigError> {
    let name = non_empty_string(key, v)?;
    if !headers::is_valid_name(&name) {
        return Err(err(key, format!("must be a lower-case HTTP header name, got {name:?}")));
    }
    Ok(name)
}

fn replay_headers(v: Value) -> Result<Vec<String>, ConfigError> {
    let key = "replay_headers";
    let Value::Array(items) = v else {
        return Err(err(key, format!("must be a list of header names, got {}", type_name(&v))));
    };
    let mut names = Vec::with_capacity(items.len());
    for item in items {
        let name = header_name(key, item)?;
        if headers::is_never_replayed(&name) {
            return Err(err(
                key,
                format!(
                    "must not contain {name:?}: cookies, hop-by-hop and framing headers are never replayed"
                ),
            ));
        }
        names.push(name);
    }
    Ok(names)
}

fn fingerprint_headers(v: Value) -> Result<Vec<String>, ConfigError> {
    let key = "fingerprint_headers";
    let Value::Array(items) = v else {
        return Err(err(key, format!("must be a list of header names, got {}", type_name(&v))));
    };
    if items.len() > MAX_FINGERPRINT_HEADERS {
        return Err(err(key, format!("must name at most {MAX_FINGERPRINT_HEADERS} headers")));
    }
    let mut names: Vec<String> = Vec::with_capacity(items.len());
    for item in items {
        let name = header_name(key, item)?;
        if name.len() > 255 {
            return Err(err(key, "entries must be at most 255 characters"));
        }
        if name == "idempotency-key" {
            return Err(err(key, "must not contain \"idempotency-key\": the key is the record's name"));
        }
        if !names.contains(&name) {
            names.push(name);
        }
    }
    Ok(names)
}

fn fingerprint_json(v: Value) -> Result<JsonPrint, ConfigError> {
    if !v.is_object() {
        return Err(err(
            "fingerprint_json",
            format!(
                "must be an object like {{\"canonical\": true, \"ignore\": [\"/a\"]}}, got {}",
                type_name(&v)
            ),
        ));
    }
    let raw: RawJsonPrint = object(v, "fingerprint_json.")?;
    let canonical = boolean(raw.canonical, "fingerprint_json.canonical", true)?;
    let ignore = match raw.ignore {
        None | Some(Value::Null) => Vec::new(),
        Some(v) => string_list("fingerprint_json.ignore", v)?,
    };
    for pointer in &ignore {
        if !pointer.starts_with('/') {
            return Err(err(
                "fingerprint_json.ignore",
                format!("entries must be JSON pointers (RFC 6901) starting with \"/\", got {pointer:?}"),
            ));
        }
    }
    Ok(JsonPrint { canonical, ignore })
}

fn store_statuses(v: Value) -> Result<StatusSet, ConfigError> {
    let key = "store_statuses";
    let shape = "must be a list of status classes (\"2xx\" .. \"5xx\") and codes (200 .. 599)";
    let Value::Array(items) = v else {
        return Err(err(key, format!("{shape}, got {}", type_name(&v))));
    };
    let mut set = StatusSet::empty();
    for item in items {
        let entry = match item {
            Value::String(s) => s,
            Value::Number(n) => n.to_string(),
            other => return Err(err(key, format!("{shape}, got {}", type_name(&other)))),
        };
        if !set.add(&entry) {
            return Err(err(key, format!("{shape}, got {entry:?}")));
        }
    }
    if set.is_empty() {
        return Err(err(key, "must name at least one status or class"));
    }
    Ok(set)
}

fn store_content_types(v: Value) -> Result<Vec<MediaPattern>, ConfigError> {
    let key = "store_content_types";
    let list = string_list(key, v)?;
    if list.is_empty() {
        return Err(err(key, "must name at least one media type (omit the key to keep every type)"));
    }
    list.iter()
        .map(|s| {
            MediaPattern::parse(s).ok_or_else(|| {
                err(
                    key,
                    format!(
                        "entries must be lower-case media types without parameters (\"application/json\", \
                         \"text/*\", \"*/*\") or suffixes (\"+json\"), got {s:?}"
                    ),
                )
            })
        })
        .collect()
}

fn subject(v: Value) -> Result<Subject, ConfigError> {
    let key = "subject";
    let shape = "must be {\"header\": NAME} or {\"metadata\": {\"filter\": NAME, \"path\": [..]}}";
    let Value::Object(mut obj) = v else {
        return Err(err(key, shape));
    };
    if obj.len() != 1 {
        return Err(err(key, shape));
    }
    if let Some(h) = obj.remove("header") {
        return Ok(Subject::Header(header_name("subject.header", h)?));
    }
    let Some(Value::Object(mut meta)) = obj.remove("metadata") else {
        return Err(err(key, shape));
    };
    let filter = match meta.remove("filter") {
        Some(v) => non_empty_string("subject.metadata.filter", v)?,
        None => return Err(err("subject.metadata.filter", "is required")),
    };
    let path = match meta.remove("path") {
        Some(v) => string_list("subject.metadata.path", v)?,
        None => return Err(err("subject.metadata.path", "is required")),
    };
    if path.is_empty() {
        return Err(err("subject.metadata.path", "must name at least one field"));
    }
    if let Some(unknown) = meta.keys().next() {
        return Err(err(&format!("subject.metadata.{unknown}"), "is not a known key"));
    }
    Ok(Subject::Metadata { filter, path })
}

/// `mode` and the `inbox` object, which only inbox mode takes.
fn mode(mode: Option<Value>, inbox: Option<Value>) -> Result<Mode, ConfigError> {
    let is_inbox = match mode {
        None => false,
        Some(Value::String(s)) if s == "idempotency_key" => false,
        Some(Value::String(s)) if s == "inbox" => true,
        Some(_) => return Err(err("mode", "must be \"idempotency_key\" or \"inbox\"")),
    };
    if !is_inbox {
        return match inbox {
            None => Ok(Mode::IdempotencyKey),
            Some(_) => Err(err("inbox", "is only allowed with `\"mode\": \"inbox\"`")),
        };
    }
    let raw: RawInbox = match inbox {
        None => RawInbox::default(),
        Some(v) => object(v, "inbox.")?,
    };
    let message_id = match raw.message_id {
        None => MessageIdSource::CloudEvents,
        Some(v) => message_id(v)?,
    };
    let missing_id = match raw.missing_id {
        None => MissingId::Reject,
        Some(Value::String(s)) if s == "reject" => MissingId::Reject,
        Some(Value::String(s)) if s == "pass" => MissingId::Pass,
        Some(_) => return Err(err("inbox.missing_id", "must be \"reject\" or \"pass\"")),
    };
    let duplicate_status = match raw.duplicate_status {
        None | Some(Value::Null) => None,
        Some(v) => Some(number(Some(v), "inbox.duplicate_status", DUPLICATE_STATUS, 200)? as u16),
    };
    Ok(Mode::Inbox(Inbox { message_id, missing_id, duplicate_status }))
}

fn message_id(v: Value) -> Result<MessageIdSource, ConfigError> {
    let key = "inbox.message_id";
    let shape = "must be \"cloudevents\", {\"header\": NAME} or {\"json_pointer\": \"/a/b\"}";
    match v {
        Value::String(s) if s == "cloudevents" => Ok(MessageIdSource::CloudEvents),
        Value::Object(mut obj) if obj.len() == 1 => {
            if let Some(h) = obj.remove("header") {
                return Ok(MessageIdSource::Header(header_name("inbox.message_id.header", h)?));
            }
            match obj.remove("json_pointer") {
                Some(Value::String(p)) if p.starts_with('/') => Ok(MessageIdSource::JsonPointer(p)),
                Some(_) => Err(err(
                    "inbox.message_id.json_pointer",
                    "must be a JSON pointer (RFC 6901) starting with \"/\", e.g. \"/message/messageId\"",
                )),
                None => Err(err(key, shape)),
            }
        }
        _ => Err(err(key, shape)),
    }
}

/// `store_secret` itself, or the environment variable `store_secret_env` names; at most one.
/// Errors never quote the secret: they end up in Envoy's log.
fn store_secret(
    literal: Option<Value>,
    env_name: Option<Value>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<StoreSecret>, ConfigError> {
    let form = format!(
        "must be 1 to {} visible ASCII characters (no spaces or control characters)",
        idem_protocol::MAX_SECRET_LEN
    );
    let (literal, env_name) = (literal.filter(|v| !v.is_null()), env_name.filter(|v| !v.is_null()));
    match (literal, env_name) {
        (None, None) => Ok(None),
        (Some(_), Some(_)) => Err(err("store_secret", "and `store_secret_env` cannot both be set: pick one")),
        (Some(v), None) => match v {
            Value::String(s) if idem_protocol::is_secret(s.as_bytes()) => Ok(Some(StoreSecret(s))),
            Value::String(_) => Err(err("store_secret", form)),
            other => Err(err("store_secret", format!("must be a string, got {}", type_name(&other)))),
        },
        (None, Some(v)) => {
            let name = non_empty_string("store_secret_env", v)?;
            match env(&name) {
                Some(s) if idem_protocol::is_secret(s.as_bytes()) => Ok(Some(StoreSecret(s))),
                Some(s) if !s.is_empty() => {
                    Err(err("store_secret_env", format!("names {name:?}, whose value {form}")))
                }
                _ => Err(err(
                    "store_secret_env",
                    format!(
                        "names {name:?}, which is unset or empty in the Wasm VM (pass it with \
                         vm_config.environment_variables.host_env_keys)"
                    ),
                )),
            }
        }
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Config, ConfigError> {
        Config::from_json(s.as_bytes())
    }

    #[test]
    fn defaults() {
        let c = parse(r#"{"store_cluster":"idemstore"}"#).unwrap();
        assert_eq!(c.store_timeout_ms, 1000);
        assert_eq!(c.retention_seconds, 86_400);
        assert_eq!(c.lock_ttl_ms, 30_000);
        assert_eq!(c.lock_wait_ms, 5_000);
        assert_eq!(c.methods, ["POST", "PATCH"]);
        assert!(!c.require_key);
        assert_eq!(c.max_key_length, 255);
        assert_eq!(c.max_body_bytes, 1_048_576);
        assert_eq!(c.max_record_bytes, 1_048_576);
        assert_eq!(c.replay_header, "x-idempotent-replay");
        assert_eq!(c.replay_headers, ["content-type", "location"]);
        assert_eq!(c.subject, Subject::ClientIp);
        assert_eq!(c.failure_mode, FailureMode::Open);
        assert!(!c.detached_execution);
        assert_eq!(c.detached_timeout_ms, 15_000);
        assert_eq!(c.store_key_header, None);
        assert!(c.pause_on_headers);
        assert_eq!(c.mode, Mode::IdempotencyKey);
        assert_eq!(c.inbox(), None);
        assert!(!parse(r#"{"store_cluster":"s","pause_on_headers":false}"#).unwrap().pause_on_headers);
        assert!(parse(r#"{"store_cluster":"s","pause_on_headers":"no"}"#).is_err());
        assert_eq!((c.record_cache_entries, c.record_cache_bytes), (1024, 4 * 1024 * 1024));
        let off = parse(r#"{"store_cluster":"s","record_cache_entries":0}"#).unwrap();
        assert_eq!(off.record_cache_entries, 0);
        assert!(parse(r#"{"store_cluster":"s","record_cache_entries":100001}"#).is_err());
        assert!(parse(r#"{"store_cluster":"s","record_cache_bytes":-1}"#).is_err());
        let short_ttl = parse(r#"{"store_cluster":"s","lock_ttl_ms":5000}"#).unwrap();
        assert_eq!(short_ttl.detached_timeout_ms, 5_000, "the default is bounded by the TTL");
        assert!(c.fingerprint_headers.is_empty());
        assert_eq!(c.fingerprint_json, None);
        assert_eq!(c.store_statuses.entries(), ["2xx"]);
        assert_eq!(c.store_content_types, None);
        assert_eq!(c.record_too_large, TooLarge::OmitBody);
        assert_eq!(c.body_omitted_header, "x-idempotent-body-omitted");
        assert_eq!(parse(r#"{"store_cluster":"s","lock_wait_ms":0}"#).unwrap().lock_wait_ms, 0);
        assert_eq!((c.breaker_failures, c.breaker_open_ms), (3, 500));
        let off = parse(r#"{"store_cluster":"s","breaker_open_ms":0,"breaker_failures":1}"#).unwrap();
        assert_eq!((off.breaker_failures, off.breaker_open_ms), (1, 0));
        assert!(c.local_fallback);
        assert_eq!((c.local_record_entries, c.local_record_bytes), (100_000, 64 * 1024 * 1024));
    }

    #[test]
    fn written_back_it_is_the_same_configuration() {
        for json in [
            r#"{"store_cluster":"s"}"#,
            r#"{"store_cluster":"s","subject":{"metadata":{"filter":"f","path":["a","b"]}},"failure_mode":"closed",
                "store_secret":"s3cret!","fingerprint_headers":["x-t"],"fingerprint_json":{"ignore":["/a"]},
                "store_statuses":["2xx","404"],"store_content_types":["+json"],"record_too_large":"release",
                "lock_wait_ms":0,"store_key_header":"x-k","detached_execution":true,
                "breaker_failures":10,"breaker_open_ms":250,"local_fallback":false,
                "local_record_entries":10,"local_record_bytes":4096}"#,
            r#"{"store_cluster":"s","mode":"inbox","inbox":{"message_id":{"json_pointer":"/m/id"},
                "missing_id":"pass","duplicate_status":202}}"#,
        ] {
            let c = parse(json).unwrap();
            let raw = c.to_raw();
            assert_eq!(Config::validate(raw.clone(), &|_| None), Ok(c.clone()), "{json}");
            let text = serde_json::to_vec(&raw).unwrap();
            assert_eq!(Config::from_json(&text), Ok(c), "{json}");
        }
    }

    #[test]
    fn record_and_fingerprint_keys() {
        let c = parse(
            r#"{"store_cluster":"s","fingerprint_headers":["x-tenant","content-type","x-tenant"],
                "fingerprint_json":{"canonical":false,"ignore":["/client_sent_at","/a~1b/0"]},
                "store_statuses":["2xx",404,"409","5XX"],
                "store_content_types":["application/json","+json","text/*","*/*"],
                "record_too_large":"release","body_omitted_header":"x-body-omitted"}"#,
        )
        .unwrap();
        assert_eq!(c.fingerprint_headers, ["x-tenant", "content-type"], "a repeated name counts once");
        assert_eq!(
            c.fingerprint_json,
            Some(JsonPrint { canonical: false, ignore: vec!["/client_sent_at".into(), "/a~1b/0".into()] })
        );
        assert_eq!(c.store_statuses.entries(), ["2xx", "5xx", "404", "409"]);
        let types: Vec<String> = c.store_content_types.unwrap().iter().map(|p| p.to_string()).collect();
        assert_eq!(types, ["application/json", "+json", "text/*", "*/*"]);
        assert_eq!(c.record_too_large, TooLarge::Release);
        assert_eq!(c.body_omitted_header, "x-body-omitted");
        let j = parse(r#"{"store_cluster":"s","fingerprint_json":{}}"#).unwrap();
        assert_eq!(j.fingerprint_json, Some(JsonPrint { canonical: true, ignore: vec![] }));
        let nulls =
            parse(r#"{"store_cluster":"s","fingerprint_json":null,"store_content_types":null}"#).unwrap();
        assert_eq!((nulls.fingerprint_json, nulls.store_content_types), (None, None));
    }

    #[test]
    fn every_key_set() {
        let c = parse(
            r#"{"store_cluster":"s","store_timeout_ms":200,"retention_seconds":604800,
                "lock_ttl_ms":1000,"lock_wait_ms":10,"methods":["PUT"],"require_key":true,
                "max_key_length":64,"max_body_bytes":0,"max_record_bytes":10,
                "replay_header":"x-replay","replay_headers":["etag"],
                "subject":{"metadata":{"filter":"envoy.filters.http.jwt_authn","path":["payload","sub"]}},
                "failure_mode":"closed","detached_execution":true,"detached_timeout_ms":900,
                "store_key_header":"x-idempotency-store-key"}"#,
        )
        .unwrap();
        assert_eq!(c.retention_seconds, 604_800);
        assert_eq!(c.methods, ["PUT"]);
        assert_eq!(c.failure_mode, FailureMode::Closed);
        assert!(c.detached_execution);
        assert_eq!(c.detached_timeout_ms, 900);
        assert_eq!(c.store_key_header.as_deref(), Some("x-idempotency-store-key"));
        assert_eq!(
            c.subject,
            Subject::Metadata {
                filter: "envoy.filters.http.jwt_authn".into(),
                path: vec!["payload".into(), "sub".into()]
            }
        );
        let c = parse(r#"{"store_cluster":"s","subject":{"header":"x-user"}}"#).unwrap();
        assert_eq!(c.subject, Subject::Header("x-user".into()));
    }

    #[test]
    fn errors_name_the_key_and_range() {
        let e = parse(r#"{"store_cluster":"s","retention_seconds":999999999}"#).unwrap_err();
        assert_eq!(e.key, "retention_seconds");
        let text = e.to_string();
        assert!(text.contains("retention_seconds"), "{text}");
        assert!(text.contains("1 to 604800"), "{text}");
        assert!(text.contains("999999999"), "{text}");

        let cases = [
            (r#"{}"#, "store_cluster"),
            (r#"{"store_cluster":""}"#, "store_cluster"),
            (r#"{"store_cluster":"s","foo":1}"#, "foo"),
            (r#"{"store_cluster":"s","lock_ttl_ms":"x"}"#, "lock_ttl_ms"),
            (r#"{"store_cluster":"s","lock_ttl_ms":-5}"#, "lock_ttl_ms"),
            (r#"{"store_cluster":"s","lock_wait_ms":1.5}"#, "lock_wait_ms"),
            (r#"{"store_cluster":"s","retention_seconds":0}"#, "retention_seconds"),
            (r#"{"store_cluster":"s","breaker_failures":0}"#, "breaker_failures"),
            (r#"{"store_cluster":"s","breaker_open_ms":60001}"#, "breaker_open_ms"),
            (r#"{"store_cluster":"s","local_fallback":"yes"}"#, "local_fallback"),
            (r#"{"store_cluster":"s","local_record_bytes":1073741825}"#, "local_record_bytes"),
            (r#"{"store_cluster":"s","require_key":"yes"}"#, "require_key"),
            (r#"{"store_cluster":"s","methods":[]}"#, "methods"),
            (r#"{"store_cluster":"s","methods":["post"]}"#, "methods"),
            (r#"{"store_cluster":"s","methods":"POST"}"#, "methods"),
            (r#"{"store_cluster":"s","replay_headers":["set-cookie"]}"#, "replay_headers"),
            (r#"{"store_cluster":"s","replay_headers":["Location"]}"#, "replay_headers"),
            (r#"{"store_cluster":"s","replay_headers":["connection"]}"#, "replay_headers"),
            (r#"{"store_cluster":"s","replay_header":"bad header"}"#, "replay_header"),
            (r#"{"store_cluster":"s","failure_mode":"maybe"}"#, "failure_mode"),
            (r#"{"store_cluster":"s","subject":"ip"}"#, "subject"),
            (r#"{"store_cluster":"s","subject":{"metadata":{"filter":"f"}}}"#, "subject.metadata.path"),
            (
                r#"{"store_cluster":"s","subject":{"metadata":{"filter":"f","path":[]}}}"#,
                "subject.metadata.path",
            ),
            (r#"{"store_cluster":"s","max_body_bytes":99999999999}"#, "max_body_bytes"),
            (r#"{"store_cluster":"s","lock_ttl_ms":1000,"detached_timeout_ms":1001}"#, "detached_timeout_ms"),
            (r#"{"store_cluster":"s","detached_execution":1}"#, "detached_execution"),
            (r#"{"store_cluster":"s","store_key_header":"idempotency-key"}"#, "store_key_header"),
            (r#"{"store_cluster":"s","store_key_header":"X-Key"}"#, "store_key_header"),
            (r#"{"store_cluster":"s","lock_wait_ms":-1}"#, "lock_wait_ms"),
            (r#"{"store_cluster":"s","fingerprint_headers":"x-tenant"}"#, "fingerprint_headers"),
            (r#"{"store_cluster":"s","fingerprint_headers":["X-Tenant"]}"#, "fingerprint_headers"),
            (r#"{"store_cluster":"s","fingerprint_headers":[":path"]}"#, "fingerprint_headers"),
            (r#"{"store_cluster":"s","fingerprint_headers":["idempotency-key"]}"#, "fingerprint_headers"),
            (r#"{"store_cluster":"s","fingerprint_json":true}"#, "fingerprint_json"),
            (r#"{"store_cluster":"s","fingerprint_json":{"canonical":"yes"}}"#, "fingerprint_json.canonical"),
            (r#"{"store_cluster":"s","fingerprint_json":{"ignore":["a"]}}"#, "fingerprint_json.ignore"),
            (r#"{"store_cluster":"s","fingerprint_json":{"ignore":"/a"}}"#, "fingerprint_json.ignore"),
            (r#"{"store_cluster":"s","fingerprint_json":{"sort":true}}"#, "fingerprint_json.sort"),
            (r#"{"store_cluster":"s","store_statuses":[]}"#, "store_statuses"),
            (r#"{"store_cluster":"s","store_statuses":"2xx"}"#, "store_statuses"),
            (r#"{"store_cluster":"s","store_statuses":["1xx"]}"#, "store_statuses"),
            (r#"{"store_cluster":"s","store_statuses":[600]}"#, "store_statuses"),
            (r#"{"store_cluster":"s","store_statuses":["2xx",true]}"#, "store_statuses"),
            (r#"{"store_cluster":"s","store_content_types":[]}"#, "store_content_types"),
            (r#"{"store_cluster":"s","store_content_types":["json"]}"#, "store_content_types"),
            (r#"{"store_cluster":"s","store_content_types":["Application/JSON"]}"#, "store_content_types"),
            (
                r#"{"store_cluster":"s","store_content_types":["text/plain; charset=utf-8"]}"#,
                "store_content_types",
            ),
            (r#"{"store_cluster":"s","record_too_large":"truncate"}"#, "record_too_large"),
            (r#"{"store_cluster":"s","body_omitted_header":"x-idempotent-replay"}"#, "body_omitted_header"),
            (r#"{"store_cluster":"s","body_omitted_header":"content-encoding"}"#, "body_omitted_header"),
            (r#"{"store_cluster":"s","replay_header":"content-type"}"#, "replay_header"),
        ];
        for (json, key) in cases {
            let e = parse(json).unwrap_err();
            assert_eq!(e.key, key, "{json}: {e}");
            assert!(e.to_string().contains(key), "{json}: {e}");
        }
        assert!(parse("not json").is_err());
        assert!(parse("[]").is_err());
    }

    #[test]
    fn inbox_mode() {
        let c = parse(r#"{"store_cluster":"s","mode":"inbox"}"#).unwrap();
        assert_eq!(
            c.inbox(),
            Some(&Inbox {
                message_id: MessageIdSource::CloudEvents,
                missing_id: MissingId::Reject,
                duplicate_status: None
            })
        );
        let c = parse(
            r#"{"store_cluster":"s","mode":"inbox","inbox":{"message_id":{"header":"x-message-id"},
                "missing_id":"pass","duplicate_status":204}}"#,
        )
        .unwrap();
        assert_eq!(
            c.inbox(),
            Some(&Inbox {
                message_id: MessageIdSource::Header("x-message-id".into()),
                missing_id: MissingId::Pass,
                duplicate_status: Some(204)
            })
        );
        let c = parse(
            r#"{"store_cluster":"s","mode":"inbox","inbox":{"message_id":{"json_pointer":"/message/messageId"}}}"#,
        )
        .unwrap();
        assert_eq!(c.inbox().unwrap().message_id, MessageIdSource::JsonPointer("/message/messageId".into()));
        let c = parse(r#"{"store_cluster":"s","mode":"idempotency_key"}"#).unwrap();
        assert_eq!(c.mode, Mode::IdempotencyKey);
        // Istio's mode works when the id is in a header, or when no store key header is sent.
        assert!(parse(
            r#"{"store_cluster":"s","mode":"inbox","pause_on_headers":false,"store_key_header":"x-k",
                "inbox":{"message_id":{"header":"x-id"}}}"#
        )
        .is_ok());
        assert!(parse(r#"{"store_cluster":"s","mode":"inbox","pause_on_headers":false}"#).is_ok());
    }

    #[test]
    fn inbox_errors_name_the_key() {
        let cases = [
            (r#"{"store_cluster":"s","inbox":{}}"#, "inbox"),
            (r#"{"store_cluster":"s","mode":"idempotency_key","inbox":{}}"#, "inbox"),
            (r#"{"store_cluster":"s","mode":"outbox"}"#, "mode"),
            (r#"{"store_cluster":"s","mode":1}"#, "mode"),
            (r#"{"store_cluster":"s","mode":"inbox","inbox":[]}"#, "inbox"),
            (r#"{"store_cluster":"s","mode":"inbox","inbox":{"message_id":"kafka"}}"#, "inbox.message_id"),
            (r#"{"store_cluster":"s","mode":"inbox","inbox":{"message_id":{}}}"#, "inbox.message_id"),
            (
                r#"{"store_cluster":"s","mode":"inbox","inbox":{"message_id":{"header":"x","json_pointer":"/a"}}}"#,
                "inbox.message_id",
            ),
            (
                r#"{"store_cluster":"s","mode":"inbox","inbox":{"message_id":{"header":"X-Id"}}}"#,
                "inbox.message_id.header",
            ),
            (
                r#"{"store_cluster":"s","mode":"inbox","inbox":{"message_id":{"json_pointer":"message"}}}"#,
                "inbox.message_id.json_pointer",
            ),
            (
                r#"{"store_cluster":"s","mode":"inbox","inbox":{"message_id":{"json_pointer":""}}}"#,
                "inbox.message_id.json_pointer",
            ),
            (r#"{"store_cluster":"s","mode":"inbox","inbox":{"missing_id":"drop"}}"#, "inbox.missing_id"),
            (
                r#"{"store_cluster":"s","mode":"inbox","inbox":{"duplicate_status":500}}"#,
                "inbox.duplicate_status",
            ),
            (
                r#"{"store_cluster":"s","mode":"inbox","inbox":{"duplicate_status":"200"}}"#,
                "inbox.duplicate_status",
            ),
            (r#"{"store_cluster":"s","mode":"inbox","inbox":{"retries":3}}"#, "inbox.retries"),
            (r#"{"store_cluster":"s","mode":"inbox","require_key":true}"#, "require_key"),
            (r#"{"store_cluster":"s","mode":"inbox","subject":{"header":"x-user"}}"#, "subject"),
            (
                r#"{"store_cluster":"s","mode":"inbox","pause_on_headers":false,"store_key_header":"x-k"}"#,
                "store_key_header",
            ),
            (r#"{"store_cluster":"s","mode":"inbox","fingerprint_headers":["x-t"]}"#, "fingerprint_headers"),
            (r#"{"store_cluster":"s","mode":"inbox","fingerprint_json":{}}"#, "fingerprint_json"),
            (r#"{"store_cluster":"s","mode":"inbox","store_statuses":["4xx"]}"#, "store_statuses"),
            (r#"{"store_cluster":"s","mode":"inbox","record_too_large":"release"}"#, "record_too_large"),
        ];
        for (json, key) in cases {
            let e = parse(json).unwrap_err();
            assert_eq!(e.key, key, "{json}: {e}");
            assert!(e.to_string().contains(&format!("`{key}`")), "{json}: {e}");
        }
        let e =
            parse(r#"{"store_cluster":"s","mode":"inbox","inbox":{"duplicate_status":500}}"#).unwrap_err();
        assert!(e.to_string().contains("200 to 299"), "{e}");
    }

    const SECRET: &str = "Sup3r-s3cret~value!";

    fn parse_env(s: &str, vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let lookup = |name: &str| vars.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string());
        Config::from_json_with_env(s.as_bytes(), &lookup)
    }

    #[test]
    fn store_secret_from_the_config_or_the_environment() {
        assert_eq!(parse(r#"{"store_cluster":"s"}"#).unwrap().store_secret, None);
        let c = parse_env(&format!(r#"{{"store_cluster":"s","store_secret":"{SECRET}"}}"#), &[]).unwrap();
        assert_eq!(c.store_secret.as_ref().map(StoreSecret::as_str), Some(SECRET));
        let json = r#"{"store_cluster":"s","store_secret_env":"IDEM_SECRET"}"#;
        let c = parse_env(json, &[("IDEM_SECRET", SECRET)]).unwrap();
        assert_eq!(c.store_secret.as_ref().map(StoreSecret::as_str), Some(SECRET));
        let longest = "x".repeat(256);
        let c = parse_env(&format!(r#"{{"store_cluster":"s","store_secret":"{longest}"}}"#), &[]).unwrap();
        assert_eq!(c.store_secret.unwrap().as_str(), longest);
        let nulls = parse(r#"{"store_cluster":"s","store_secret":null,"store_secret_env":null}"#).unwrap();
        assert_eq!(nulls.store_secret, None);
    }

    #[test]
    fn store_secret_errors_name_the_key_and_never_the_secret() {
        let too_long = "x".repeat(257);
        let both =
            format!(r#"{{"store_cluster":"s","store_secret":"{SECRET}","store_secret_env":"IDEM_SECRET"}}"#);
        // (configuration, environment, a word the error must contain)
        type Vars = &'static [(&'static str, &'static str)];
        let cases: Vec<(String, Vars, &str)> = vec![
            (both, &[("IDEM_SECRET", SECRET)], "store_secret_env"),
            (r#"{"store_cluster":"s","store_secret":""}"#.into(), &[], "store_secret"),
            (format!(r#"{{"store_cluster":"s","store_secret":"{too_long}"}}"#), &[], "store_secret"),
            (r#"{"store_cluster":"s","store_secret":"two words"}"#.into(), &[], "store_secret"),
            (r#"{"store_cluster":"s","store_secret":"café"}"#.into(), &[], "store_secret"),
            (r#"{"store_cluster":"s","store_secret":5}"#.into(), &[], "store_secret"),
            (r#"{"store_cluster":"s","store_secret_env":""}"#.into(), &[], "store_secret_env"),
            (r#"{"store_cluster":"s","store_secret_env":7}"#.into(), &[], "store_secret_env"),
            (r#"{"store_cluster":"s","store_secret_env":"IDEM_SECRET"}"#.into(), &[], "IDEM_SECRET"),
            (
                r#"{"store_cluster":"s","store_secret_env":"IDEM_SECRET"}"#.into(),
                &[("IDEM_SECRET", "")],
                "IDEM_SECRET",
            ),
            (
                r#"{"store_cluster":"s","store_secret_env":"IDEM_SECRET"}"#.into(),
                &[("IDEM_SECRET", "Sup3r s3cret")],
                "IDEM_SECRET",
            ),
        ];
        for (json, vars, named) in cases {
            let e = parse_env(&json, vars).unwrap_err();
            let text = e.to_string();
            assert!(e.key.starts_with("store_secret"), "{json}: {text}");
            assert!(text.contains(&format!("`{}`", e.key)), "{json}: {text}");
            assert!(text.contains(named), "{json}: {text}");
            assert!(!text.contains("Sup3r"), "{json}: the error quotes the secret: {text}");
        }
        let e = parse_env(r#"{"store_cluster":"s","store_secret_env":"IDEM_SECRET"}"#, &[]).unwrap_err();
        assert!(e.to_string().contains("unset or empty"), "{e}");
        assert!(e.to_string().contains("host_env_keys"), "{e}");
        let e = parse_env(
            &format!(r#"{{"store_cluster":"s","store_secret":"{SECRET}","store_secret_env":"X"}}"#),
            &[],
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("`store_secret`") && e.to_string().contains("`store_secret_env`"),
            "{e}"
        );
    }

    #[test]
    fn debug_redacts_the_store_secret() {
        let c = parse_env(&format!(r#"{{"store_cluster":"s","store_secret":"{SECRET}"}}"#), &[]).unwrap();
        let debug = format!("{c:?}");
        assert!(!debug.contains(SECRET), "{debug}");
        assert!(debug.contains("store_secret: Some(StoreSecret(<redacted>))"), "{debug}");
    }

    #[test]
    fn from_json_reads_the_process_environment() {
        // A name nothing else sets; the test owns it.
        let name = "IDEMPOTENCY_FILTER_CONFIG_TEST_SECRET";
        let json = format!(r#"{{"store_cluster":"s","store_secret_env":"{name}"}}"#);
        assert_eq!(Config::from_json(json.as_bytes()).unwrap_err().key, "store_secret_env");
        // SAFETY: no other test reads or writes this variable.
        unsafe { std::env::set_var(name, SECRET) };
        let c = Config::from_json(json.as_bytes()).unwrap();
        unsafe { std::env::remove_var(name) };
        assert_eq!(c.store_secret.unwrap().as_str(), SECRET);
    }
}
