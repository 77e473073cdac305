//! Arbitrary bytes as the plugin configuration: `Config::from_json` never panics; an accepted
//! configuration keeps every documented range and rule, and written back as JSON it is accepted
//! again as the same configuration. A refusal always names the offending key in its message.
//! The environment (`store_secret_env`) is a fixed lookup: a valid secret, an invalid one, an
//! empty one; neither a refusal nor a `Debug` of the configuration ever shows a secret.

#![no_main]

use idempotency_filter::config::{
    self, Config, FailureMode, Inbox, MessageIdSource, MissingId, Mode, StoreSecret, Subject,
};
use idempotency_filter::headers;
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};

/// An invalid secret in the environment: a refusal must not quote it.
const BAD_SECRET: &str = "leaky secret";

fn env(name: &str) -> Option<String> {
    match name {
        "IDEM_SECRET" => Some("env-Secret~1".into()),
        "IDEM_BAD" => Some(BAD_SECRET.into()),
        "IDEM_EMPTY" => Some(String::new()),
        _ => None,
    }
}

fuzz_target!(|data: &[u8]| {
    match Config::from_json_with_env(data, &env) {
        Ok(c) => {
            check(&c);
            let again = serde_json::to_vec(&to_json(&c)).expect("serializes");
            assert_eq!(Config::from_json_with_env(&again, &env).as_ref(), Ok(&c), "re-validation of {c:?}");
        }
        Err(e) => {
            let text = e.to_string();
            assert!(text.starts_with("invalid configuration: "), "{text}");
            assert!(!e.message.is_empty());
            if !e.key.is_empty() {
                assert!(text.contains(&format!("`{}`", e.key)), "{text}");
            }
            if e.key == "store_secret_env" {
                assert!(!text.contains(BAD_SECRET), "{text}");
            }
        }
    }
});

fn check(c: &Config) {
    assert!(!c.store_cluster.is_empty());
    assert!(config::STORE_TIMEOUT_MS.contains(&c.store_timeout_ms));
    assert!(config::RETENTION_SECONDS.contains(&c.retention_seconds));
    assert!(config::LOCK_TTL_MS.contains(&c.lock_ttl_ms));
    assert!(config::LOCK_WAIT_MS.contains(&c.lock_wait_ms));
    assert!(config::MAX_KEY_LENGTH.contains(&(c.max_key_length as u64)));
    assert!(config::MAX_BODY_BYTES.contains(&(c.max_body_bytes as u64)));
    assert!(config::MAX_RECORD_BYTES.contains(&(c.max_record_bytes as u64)));
    assert!((1..=c.lock_ttl_ms).contains(&c.detached_timeout_ms), "a detached call outlives its lock");
    assert!(!c.methods.is_empty());
    for m in &c.methods {
        assert!(!m.is_empty() && m.bytes().all(|b| b.is_ascii_uppercase()), "{m:?}");
        assert!(c.guards_method(m));
    }
    assert!(headers::is_valid_name(&c.replay_header), "{:?}", c.replay_header);
    for h in &c.replay_headers {
        assert!(headers::is_valid_name(h) && !headers::is_never_replayed(h), "{h:?}");
    }
    if let Some(h) = &c.store_key_header {
        assert!(headers::is_valid_name(h) && !headers::is_never_replayed(h), "{h:?}");
        assert_ne!(h, "idempotency-key");
    }
    if let Some(secret) = &c.store_secret {
        assert!(idem_protocol::is_secret(secret.as_str().as_bytes()));
        let shown = format!("{secret:?}");
        assert!(
            shown.contains(secret.as_str()) == "StoreSecret(<redacted>)".contains(secret.as_str()),
            "{shown}"
        );
    }
    if let Mode::Inbox(Inbox { message_id, duplicate_status, .. }) = &c.mode {
        assert!(!c.require_key, "require_key has no effect in inbox mode");
        assert_eq!(c.subject, Subject::ClientIp, "inbox mode scopes by the message");
        match message_id {
            MessageIdSource::CloudEvents => {}
            MessageIdSource::Header(h) => assert!(headers::is_valid_name(h), "{h:?}"),
            MessageIdSource::JsonPointer(p) => assert!(p.starts_with('/'), "{p:?}"),
        }
        if let Some(s) = duplicate_status {
            assert!(config::DUPLICATE_STATUS.contains(&u64::from(*s)), "{s}");
        }
        if c.store_key_header.is_some() && !c.pause_on_headers {
            assert!(!message_id.may_need_body(), "a body id cannot set a header that has gone on");
        }
    }
    match &c.subject {
        Subject::ClientIp => {}
        Subject::Header(h) => assert!(headers::is_valid_name(h), "{h:?}"),
        Subject::Metadata { filter, path } => {
            assert!(!filter.is_empty());
            assert!(!path.is_empty() && path.iter().all(|p| !p.is_empty()), "{path:?}");
        }
    }
}

/// The configuration as an operator would write it, every key explicit. The destructuring
/// names every field, so that a new one does not build until it is written here too.
fn to_json(c: &Config) -> Value {
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
    } = c;
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
            let inbox = json!({
                "message_id": message_id,
                "missing_id": missing_id,
                "duplicate_status": duplicate_status,
            });
            ("inbox", Some(inbox))
        }
    };
    let mut out = json!({
        "store_cluster": store_cluster,
        "store_timeout_ms": store_timeout_ms,
        "retention_seconds": retention_seconds,
        "lock_ttl_ms": lock_ttl_ms,
        "lock_wait_ms": lock_wait_ms,
        "methods": methods,
        "require_key": require_key,
        "max_key_length": max_key_length,
        "max_body_bytes": max_body_bytes,
        "max_record_bytes": max_record_bytes,
        "replay_header": replay_header,
        "replay_headers": replay_headers,
        "subject": subject,
        "failure_mode": match failure_mode { FailureMode::Open => "open", FailureMode::Closed => "closed" },
        "detached_execution": detached_execution,
        "detached_timeout_ms": detached_timeout_ms,
        "store_key_header": store_key_header,
        "store_secret": store_secret.as_ref().map(StoreSecret::as_str),
        "pause_on_headers": pause_on_headers,
        "record_cache_entries": record_cache_entries,
        "record_cache_bytes": record_cache_bytes,
        "mode": mode,
    });
    if let Some(inbox) = inbox {
        out["inbox"] = inbox;
    }
    out
}
