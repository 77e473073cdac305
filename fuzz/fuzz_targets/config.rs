//! Arbitrary bytes as the plugin configuration: `Config::from_json` never panics; an accepted
//! configuration keeps every documented range and rule, and written back as JSON (`Config::to_raw`,
//! the declaration of the keys) it is accepted
//! again as the same configuration. A refusal always names the offending key in its message.
//! The environment (`store_secret_env`) is a fixed lookup: a valid secret, an invalid one, an
//! empty one; neither a refusal nor a `Debug` of the configuration ever shows a secret.
//!
//! The same bytes are also a request body for `fingerprint_json`
//! (`fingerprint::json_body_hash`), with pointer lists taken from the document (its members'
//! paths, its strings that look like pointers) and odd fixed ones: it never panics, a body that
//! is not JSON is hashed as its raw bytes (behind the raw tag) whatever the options, and for a
//! JSON body neither the spacing nor (with `canonical`) the member order nor the value of an
//! ignored member counts.

#![no_main]

use idempotency_filter::config::patterns::{MediaPattern, StatusSet};
use idempotency_filter::config::values::{
    Inbox, JsonPrint, MessageIdSource, Mode, StoreTransport, Subject, TooLarge,
};
use idempotency_filter::config::{self, Config};
use idempotency_filter::http::headers;
use idempotency_filter::request::fingerprint::{json_body_hash, spells_number_token};
use idempotency_filter::store::record::Digest32;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use sha2::{Digest, Sha256};

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
            let again = serde_json::to_vec(&c.to_raw()).expect("serializes");
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
    json_hash(data);
});

fn check(c: &Config) {
    // Each route's configuration keeps every rule too, shares the worker's keys, and has no
    // routes of its own.
    for (name, route) in c.routes.iter() {
        assert!(!name.is_empty() && route.routes.is_empty(), "{name:?}");
        assert_eq!(
            (&route.store_cluster, &route.store, route.store_transport, route.pause_on_headers),
            (&c.store_cluster, &c.store, c.store_transport, c.pause_on_headers)
        );
        assert_eq!(c.routes.get(name.as_bytes()).map(|r| r.as_ref()), Some(route));
        check(route);
    }
    let raw = serde_json::to_value(c.to_raw()).expect("serializes");
    for key in config::SIMPLE_KEYS {
        let value = raw.get(key.name).unwrap_or_else(|| panic!("{} missing from to_raw", key.name));
        match &key.range {
            Some(range) => {
                assert!(value.as_u64().is_some_and(|n| range.contains(&n)), "{}: {value}", key.name)
            }
            None => assert!(value.is_boolean(), "{}: {value}", key.name),
        }
    }
    assert!((1..=c.lock_ttl_ms).contains(&c.detached_timeout_ms), "a detached call outlives its lock");
    // The application can only be asked about a store key it received.
    if let Some(lookup) = &c.outcome_lookup {
        assert!(c.store_key_header.is_some(), "outcome_lookup without store_key_header");
        assert!(lookup.path.starts_with('/') && lookup.path.contains("{key}"), "{:?}", lookup.path);
    }
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
            assert!(config::values::DUPLICATE_STATUS.contains(&u64::from(*s)), "{s}");
        }
        if c.store_key_header.is_some() && !c.pause_on_headers {
            assert!(!message_id.may_need_body(), "a body id cannot set a header that has gone on");
        }
    }
    assert!(c.fingerprint_headers.len() <= config::MAX_FINGERPRINT_HEADERS);
    for (i, h) in c.fingerprint_headers.iter().enumerate() {
        assert!(headers::is_valid_name(h) && h.len() <= 255 && h != "idempotency-key", "{h:?}");
        assert!(!c.fingerprint_headers[..i].contains(h), "{h:?} twice");
    }
    if let Some(j) = &c.fingerprint_json {
        assert!(j.ignore.iter().all(|p| p.starts_with('/')), "{:?}", j.ignore);
    }
    assert!(!c.store_statuses.is_empty());
    let mut again = StatusSet::empty();
    for entry in c.store_statuses.entries() {
        assert!(again.add(&entry), "{entry:?}");
    }
    assert_eq!(again, c.store_statuses, "entries() reads back as the same set");
    for status in [0, 1, 100, 101, 199, 600, 699, 999, 1000, u16::MAX] {
        assert!(!c.store_statuses.contains(status), "{status} kept");
    }
    if let Some(list) = &c.store_content_types {
        assert!(!list.is_empty());
        for p in list {
            assert_eq!(MediaPattern::parse(&p.to_string()).as_ref(), Some(p), "{p}");
        }
    }
    for h in [&c.replay_header, &c.body_omitted_header] {
        assert!(headers::is_valid_name(h), "{h:?}");
        assert!(!headers::is_never_replayed(h) && !headers::is_representation(h), "{h:?}");
    }
    assert_ne!(c.body_omitted_header, c.replay_header);
    if c.inbox().is_some() {
        assert!(c.fingerprint_headers.is_empty() && c.fingerprint_json.is_none());
        assert_eq!(c.store_statuses, StatusSet::default());
        assert_eq!(c.record_too_large, TooLarge::OmitBody);
    }
    match &c.subject {
        Subject::ClientIp => {}
        Subject::Header(h) => assert!(headers::is_valid_name(h), "{h:?}"),
        Subject::Metadata { filter, path } => {
            assert!(!filter.is_empty());
            assert!(!path.is_empty() && path.iter().all(|p| !p.is_empty()), "{path:?}");
        }
        Subject::Property(path) => {
            assert!(!path.is_empty() && path.iter().all(|p| !p.is_empty()), "{path:?}")
        }
    }
    if c.mode == Mode::Mint {
        assert!(!c.require_key && !c.detached_execution && c.store_key_header.is_none());
        assert_eq!(c.subject, Subject::ClientIp);
    } else {
        // idemstore at `store_cluster`, or (the native host) the store in Envoy: one of the two.
        assert_eq!(c.store_cluster.is_empty(), c.store.is_some(), "{:?} {:?}", c.store_cluster, c.store);
        if let Some(store) = &c.store {
            assert!(store.is_object() && c.store_transport == StoreTransport::Stream, "{store:?}");
        }
    }
}

/// Pointers no document's paths give: the root, empty tokens, bad escapes, array indexes RFC 6901
/// does not have.
const ODD_POINTERS: [&str; 14] =
    ["", "/", "//", "/~", "/~2", "/~01", "/~1", "/0", "/-", "/00", "/1/", "/a/b", "/message/messageId", "x"];

/// At most this many pointers of each kind (bounds the work per input).
const POINTERS: usize = 16;

fn json_hash(body: &[u8]) {
    let raw: Digest32 =
        Sha256::new().chain_update(b"idempotency-raw/v1\n").chain_update(body).finalize().into();
    let Ok(doc) = serde_json::from_slice::<Value>(body) else {
        for canonical in [true, false] {
            let ignore = ODD_POINTERS.iter().map(|p| p.to_string()).collect();
            assert_eq!(
                json_body_hash(body, &JsonPrint { canonical, ignore }),
                raw,
                "not JSON: the raw bytes"
            );
        }
        return;
    };
    if spells_number_token(body) {
        // serde_json would read `{"$serde_json::private::Number":"1"}` as the number 1: such a
        // body is compared as bytes, so that it cannot pass for another.
        for canonical in [true, false] {
            assert_eq!(json_body_hash(body, &JsonPrint { canonical, ignore: vec![] }), raw, "number token");
        }
        return;
    }
    // Arbitrary pointers: the document's strings that could be one, and the odd ones.
    let mut strings = Vec::new();
    strings_in(&doc, &mut strings);
    strings.extend(ODD_POINTERS.iter().map(|p| p.to_string()));
    // Pointers to members that exist: every other path of the document.
    let mut paths = Vec::new();
    paths_in(&doc, String::new(), &mut paths);
    let paths: Vec<String> = paths.into_iter().step_by(2).take(POINTERS).collect();
    let compact = serde_json::to_vec(&doc).expect("serializes");
    let pretty = serde_json::to_vec_pretty(&doc).expect("serializes");
    let mut reversed = doc.clone();
    reverse_members(&mut reversed);
    let reversed = serde_json::to_vec(&reversed).expect("serializes");
    for ignore in [Vec::new(), strings, paths] {
        for canonical in [true, false] {
            let opts = JsonPrint { canonical, ignore: ignore.clone() };
            let h = json_body_hash(body, &opts);
            assert_eq!(h, json_body_hash(&compact, &opts), "spacing counted: {opts:?}");
            assert_eq!(h, json_body_hash(&pretty, &opts), "spacing counted: {opts:?}");
            if canonical {
                assert_eq!(h, json_body_hash(&reversed, &opts), "member order counted: {opts:?}");
            }
            for p in ignore.iter().filter(|p| p.starts_with('/')) {
                let mut changed = doc.clone();
                let Some(v) = changed.pointer_mut(p) else { continue };
                // A scalar, so that the document gets no deeper than the parser takes.
                *v = if *v == Value::Bool(true) { Value::Bool(false) } else { Value::Bool(true) };
                let changed = serde_json::to_vec(&changed).expect("serializes");
                assert_eq!(h, json_body_hash(&changed, &opts), "ignored {p:?} counted: {opts:?}");
            }
        }
    }
}

fn strings_in(v: &Value, out: &mut Vec<String>) {
    if out.len() >= POINTERS {
        return;
    }
    match v {
        Value::String(s) => out.push(s.clone()),
        Value::Array(items) => items.iter().for_each(|i| strings_in(i, out)),
        Value::Object(map) => map.iter().for_each(|(k, v)| {
            if out.len() < POINTERS {
                out.push(k.clone());
            }
            strings_in(v, out);
        }),
        _ => {}
    }
}

fn paths_in(v: &Value, at: String, out: &mut Vec<String>) {
    if out.len() >= 2 * POINTERS {
        return;
    }
    match v {
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                if out.len() >= 2 * POINTERS {
                    return;
                }
                let p = format!("{at}/{i}");
                out.push(p.clone());
                paths_in(item, p, out);
            }
        }
        Value::Object(map) => {
            for (k, item) in map {
                if out.len() >= 2 * POINTERS {
                    return;
                }
                let p = format!("{at}/{}", k.replace('~', "~0").replace('/', "~1"));
                out.push(p.clone());
                paths_in(item, p, out);
            }
        }
        _ => {}
    }
}

fn reverse_members(v: &mut Value) {
    match v {
        Value::Array(items) => items.iter_mut().for_each(reverse_members),
        Value::Object(map) => {
            let members: Vec<(String, Value)> = std::mem::take(map).into_iter().rev().collect();
            for (k, mut item) in members {
                reverse_members(&mut item);
                map.insert(k, item);
            }
        }
        _ => {}
    }
}
