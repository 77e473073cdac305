//! The checks of the structured keys (lists, header names, patterns, objects, the secret): each
//! takes the value as written and returns it checked, or an error naming the key.

use serde_json::Value;

use crate::config::keys::{boolean, err, number, object, raw_keys, type_name, ConfigError};
use crate::config::patterns::{MediaPattern, StatusSet};
use crate::config::values::*;
use crate::http::{grpc, headers};

/// At most this many `fingerprint_headers` (each costs a digest in every record).
pub const MAX_FINGERPRINT_HEADERS: usize = 32;
/// The longest header name a key may give. Every name a record is written with comes from the
/// configuration or is one of gRPC's own, so this bounds a record's framing too (the replay
/// listener's cap).
pub const MAX_HEADER_NAME: usize = 256;

raw_keys! {
    /// `inbox`, in inbox mode.
    RawInbox {
        message_id,
        missing_id,
        duplicate_status,
    }
}

raw_keys! {
    /// `fingerprint_json`.
    RawJsonPrint {
        canonical,
        ignore,
    }
}

/// A key that is one of two words (`failure_mode`, `store_transport`, `record_too_large`,
/// `unknown_outcome`): absent, the first.
pub fn either<T>(
    key: &str,
    v: Option<Value>,
    [(a, first), (b, second)]: [(&str, T); 2],
) -> Result<T, ConfigError> {
    match v {
        None => Ok(first),
        Some(Value::String(s)) if s == a => Ok(first),
        Some(Value::String(s)) if s == b => Ok(second),
        Some(_) => Err(err(key, format!("must be \"{a}\" or \"{b}\""))),
    }
}

/// `mismatch_status`: `422` or `409`.
pub fn mismatch_status(v: Value) -> Result<u32, ConfigError> {
    let got = match v.as_u64() {
        Some(status @ (409 | 422)) => return Ok(status as u32),
        Some(n) => n.to_string(),
        None => type_name(&v).to_string(),
    };
    Err(err("mismatch_status", format!("must be 422 or 409, got {got}")))
}

pub fn non_empty_string(key: &str, v: Value) -> Result<String, ConfigError> {
    match v {
        Value::String(s) if !s.is_empty() => Ok(s),
        other => Err(err(key, format!("must be a non-empty string, got {}", type_name(&other)))),
    }
}

pub fn string_list(key: &str, v: Value) -> Result<Vec<String>, ConfigError> {
    let Value::Array(items) = v else {
        return Err(err(key, format!("must be a list of strings, got {}", type_name(&v))));
    };
    items.into_iter().map(|item| non_empty_string(key, item)).collect()
}

pub fn methods(v: Value) -> Result<Vec<String>, ConfigError> {
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

/// gRPC status names (`"OK"`, `"NOT_FOUND"`, any case) or codes (0 to 16).
pub fn store_grpc_statuses(v: Value) -> Result<GrpcStatuses, ConfigError> {
    let key = "store_grpc_statuses";
    let Value::Array(items) = v else {
        return Err(err(key, format!("must be a list of gRPC statuses, got {}", type_name(&v))));
    };
    let mut set = GrpcStatuses(0);
    for item in items {
        let code = match &item {
            Value::String(name) => grpc::NAMES.iter().position(|n| n.eq_ignore_ascii_case(name)),
            Value::Number(n) => n.as_u64().filter(|c| *c < grpc::NAMES.len() as u64).map(|c| c as usize),
            _ => None,
        };
        let Some(code) = code else {
            return Err(err(
                key,
                format!("entries must be gRPC status names (e.g. \"OK\") or codes 0-16, got {item}"),
            ));
        };
        set.0 |= 1 << code;
    }
    Ok(set)
}

/// `/package.Service/Method` or `/package.Service/*`.
pub fn grpc_streaming_methods(v: Value) -> Result<Vec<String>, ConfigError> {
    let key = "grpc_streaming_methods";
    let list = string_list(key, v)?;
    for m in &list {
        let shape = m.strip_prefix('/').and_then(|rest| rest.split_once('/'));
        let ok = shape.is_some_and(|(service, method)| {
            !service.is_empty()
                && !method.is_empty()
                && !service.contains('*')
                && (method == "*" || !method.contains(['*', '/']))
                && m.bytes().all(|b| b.is_ascii_graphic())
        });
        if !ok {
            return Err(err(
                key,
                format!("entries must be /package.Service/Method or /package.Service/*, got {m:?}"),
            ));
        }
    }
    Ok(list)
}

pub fn header_name(key: &str, v: Value) -> Result<String, ConfigError> {
    let name = non_empty_string(key, v)?;
    if !headers::is_valid_name(&name) {
        return Err(err(key, format!("must be a lower-case HTTP header name, got {name:?}")));
    }
    if name.len() > MAX_HEADER_NAME {
        return Err(err(key, format!("must be at most {} bytes long", MAX_HEADER_NAME)));
    }
    Ok(name)
}

pub fn replay_headers(v: Value) -> Result<Vec<String>, ConfigError> {
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

pub fn fingerprint_headers(v: Value) -> Result<Vec<String>, ConfigError> {
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

pub fn fingerprint_json(v: Value) -> Result<JsonPrint, ConfigError> {
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

pub fn store_statuses(v: Value) -> Result<StatusSet, ConfigError> {
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

pub fn store_content_types(v: Value) -> Result<Vec<MediaPattern>, ConfigError> {
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

pub fn subject(v: Value) -> Result<Subject, ConfigError> {
    let key = "subject";
    let shape = "must be {\"header\": NAME}, {\"metadata\": {\"filter\": NAME, \"path\": [..]}} or \
                 {\"property\": [..]}";
    let Value::Object(mut obj) = v else {
        return Err(err(key, shape));
    };
    if obj.len() != 1 {
        return Err(err(key, shape));
    }
    if let Some(h) = obj.remove("header") {
        return Ok(Subject::Header(header_name("subject.header", h)?));
    }
    if let Some(p) = obj.remove("property") {
        let path = string_list("subject.property", p)?;
        if path.is_empty() {
            return Err(err("subject.property", "must name at least one segment"));
        }
        return Ok(Subject::Property(path));
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
pub fn mode(mode: Option<Value>, inbox: Option<Value>) -> Result<Mode, ConfigError> {
    let other = match mode {
        None => Some(Mode::IdempotencyKey),
        Some(Value::String(s)) if s == "idempotency_key" => Some(Mode::IdempotencyKey),
        Some(Value::String(s)) if s == "mint" => Some(Mode::Mint),
        Some(Value::String(s)) if s == "grpc_replay" => Some(Mode::GrpcReplay),
        Some(Value::String(s)) if s == "inbox" => None,
        Some(_) => {
            return Err(err("mode", "must be \"idempotency_key\", \"inbox\", \"mint\" or \"grpc_replay\""))
        }
    };
    if let Some(mode) = other {
        return match inbox {
            None => Ok(mode),
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

pub fn message_id(v: Value) -> Result<MessageIdSource, ConfigError> {
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
pub fn store_secret(
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

/// An absolute URI as written in a header or a problem's `type`: `http(s)://host...` when
/// `web`, else any scheme. Visible ASCII only, without what would end a `link` target (`<`, `>`)
/// or a JSON string early: it is sent as it is.
pub fn uri(key: &str, v: Value, web: bool) -> Result<String, ConfigError> {
    let s = non_empty_string(key, v)?;
    let scheme_end = s.find(':').unwrap_or(0);
    let scheme = &s[..scheme_end];
    let scheme_ok = scheme.bytes().next().is_some_and(|b| b.is_ascii_alphabetic())
        && scheme.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'));
    let web_ok = ["https://", "http://"]
        .iter()
        .any(|p| s.strip_prefix(p).is_some_and(|rest| !rest.is_empty() && !rest.starts_with('/')));
    let chars_ok = s.bytes().all(|b| b.is_ascii_graphic() && !b"<>\"{}|\\^`".contains(&b));
    let shape = if web { "an absolute http:// or https:// URL" } else { "an absolute URI (scheme:...)" };
    if !scheme_ok || (web && !web_ok) || s.len() <= scheme_end + 1 {
        return Err(err(key, format!("must be {shape}, got {s:?}")));
    }
    if !chars_ok || s.len() > MAX_URI {
        return Err(err(
            key,
            format!("must be at most {MAX_URI} visible ASCII characters without spaces, <, >, \", {{, }}, |, \\, ^ or `"),
        ));
    }
    Ok(s)
}

pub const MAX_URI: usize = 2048;

raw_keys! {
    /// `outcome_lookup`.
    RawLookup {
        path,
    }
}

/// `outcome_lookup`: `{"path": "/..{key}.."}`, a path of at most 1024 visible ASCII bytes (no
/// `?#` fragment, no spaces) with `{key}` in it.
pub fn outcome_lookup(v: Value) -> Result<OutcomeLookup, ConfigError> {
    let raw: RawLookup = object(v, "outcome_lookup.")?;
    let Some(Value::String(path)) = raw.path else {
        return Err(err(
            "outcome_lookup.path",
            "is required: a path with `{key}`, e.g. \"/orders/by-key/{key}\"",
        ));
    };
    if !path.starts_with('/') || !path.contains("{key}") {
        return Err(err(
            "outcome_lookup.path",
            format!("must start with `/` and contain `{{key}}`, got {path:?}"),
        ));
    }
    if path.len() > 1024 || !path.bytes().all(|b| (0x21..=0x7e).contains(&b)) || path.contains('#') {
        return Err(err("outcome_lookup.path", "must be at most 1024 visible ASCII characters, without `#`"));
    }
    Ok(OutcomeLookup { path })
}
