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
                "local_record_entries":10,"local_record_bytes":4096,
                "unknown_outcome":"run_again","outcome_lookup":{"path":"/orders/by-key/{key}"}}"#,
        r#"{"store_cluster":"s","mode":"inbox","inbox":{"message_id":{"json_pointer":"/m/id"},
                "missing_id":"pass","duplicate_status":202}}"#,
        r#"{"mode":"mint","methods":["POST"]}"#,
        r#"{"store_cluster":"s","subject":{"property":["connection","uri_san_peer_certificate"]}}"#,
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
    let nulls = parse(r#"{"store_cluster":"s","fingerprint_json":null,"store_content_types":null}"#).unwrap();
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
        (r#"{"store_cluster":"s","mismatch_status":400}"#, "mismatch_status"),
        (r#"{"store_cluster":"s","mismatch_status":"409"}"#, "mismatch_status"),
        (r#"{"store_cluster":"s","mismatch_status":422.5}"#, "mismatch_status"),
        (r#"{"store_cluster":"s","routes":{"r":{"mismatch_status":200}}}"#, "routes.r.mismatch_status"),
        (r#"{"store_cluster":"s","subject":"ip"}"#, "subject"),
        (r#"{"store_cluster":"s","subject":{"metadata":{"filter":"f"}}}"#, "subject.metadata.path"),
        (r#"{"store_cluster":"s","subject":{"metadata":{"filter":"f","path":[]}}}"#, "subject.metadata.path"),
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
    let e = parse(r#"{"store_cluster":"s","mode":"inbox","inbox":{"duplicate_status":500}}"#).unwrap_err();
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
    assert!(e.to_string().contains("`store_secret`") && e.to_string().contains("`store_secret_env`"), "{e}");
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

/// The rows of docs/configuration.md's key tables (its section "Keys"): key, default, allowed
/// values.
fn documented_keys() -> Vec<(String, String, String)> {
    include_str!("../../docs/configuration.md")
        .lines()
        .skip_while(|line| *line != "## Keys")
        .skip(1)
        .take_while(|line| !line.starts_with("## "))
        .filter_map(|line| {
            let cells: Vec<&str> = line.strip_prefix('|')?.split(" | ").map(str::trim).collect();
            let key = cells.first()?.strip_prefix('`')?.strip_suffix('`')?;
            Some((key.to_string(), cells.get(1)?.to_string(), cells.get(2)?.to_string()))
        })
        .collect()
}

#[test]
fn every_key_is_documented_with_its_default_and_range() {
    let docs = documented_keys();
    let row = |key: &str| docs.iter().find(|(k, _, _)| k == key);
    let undocumented: Vec<&&str> = KEYS.iter().filter(|k| row(k).is_none()).collect();
    assert!(undocumented.is_empty(), "docs/configuration.md has no row for {undocumented:?}");
    for key in SIMPLE_KEYS {
        let Some((_, default, allowed)) = row(key.name) else { continue };
        assert_eq!(
            *default,
            format!("`{}`", key.default),
            "docs/configuration.md: the default of `{}`",
            key.name
        );
        if let Some(range) = &key.range {
            let shown = format!("{} .. {}", range.start(), range.end());
            assert!(
                allowed.starts_with(&shown),
                "docs/configuration.md: `{}` allows {shown}, not {allowed:?}",
                key.name
            );
        }
    }
    let documented_but_unknown: Vec<&String> =
        docs.iter().map(|(k, _, _)| k).filter(|k| !k.contains('.') && !KEYS.contains(&k.as_str())).collect();
    assert!(documented_but_unknown.is_empty(), "docs/configuration.md documents {documented_but_unknown:?}");
}

#[test]
fn every_simple_key_takes_the_ends_of_its_range() {
    for key in SIMPLE_KEYS {
        let Some(range) = &key.range else { continue };
        for n in [*range.start(), *range.end()] {
            // `detached_timeout_ms` is bounded by `lock_ttl_ms`: keep it valid at the low end.
            let json = format!(r#"{{"store_cluster":"s","detached_timeout_ms":1,"{}":{n}}}"#, key.name);
            let c = parse(&json).unwrap_or_else(|e| panic!("{json}: {e}"));
            let raw = serde_json::to_value(c.to_raw()).unwrap();
            assert_eq!(raw.get(key.name), Some(&serde_json::json!(n)), "{json}");
        }
    }
}

#[test]
fn mint_mode_needs_no_store_and_refuses_what_only_the_guard_uses() {
    let c = parse(r#"{"mode":"mint"}"#).unwrap();
    assert_eq!((&c.mode, c.store_cluster.as_str()), (&Mode::Mint, ""));
    assert_eq!(c.inbox(), None);
    assert!(parse(r#"{"mode":"mint","store_cluster":""}"#).is_err(), "given, it must be a cluster");
    for (extra, key) in [
        (r#""require_key":true"#, "require_key"),
        (r#""detached_execution":true"#, "detached_execution"),
        (r#""store_key_header":"x-k""#, "store_key_header"),
        (r#""subject":{"header":"x-user"}"#, "subject"),
        (r#""inbox":{}"#, "inbox"),
    ] {
        let e = parse(&format!(r#"{{"mode":"mint",{extra}}}"#)).unwrap_err();
        assert_eq!(e.key, key, "{e}");
    }
    let e = parse(r#"{"store_cluster":"s","mode":"minted"}"#).unwrap_err();
    assert!(e.to_string().contains(r#""mint""#), "{e}");
}

#[test]
fn subject_from_a_property() {
    let c =
        parse(r#"{"store_cluster":"s","subject":{"property":["connection","uri_san_peer_certificate"]}}"#)
            .unwrap();
    assert_eq!(c.subject, Subject::Property(vec!["connection".into(), "uri_san_peer_certificate".into()]));
    for bad in [r#"{"property":[]}"#, r#"{"property":"connection"}"#, r#"{"property":[""]}"#] {
        let e = parse(&format!(r#"{{"store_cluster":"s","subject":{bad}}}"#)).unwrap_err();
        assert_eq!(e.key, "subject.property", "{bad}: {e}");
    }
}

#[test]
fn grpc_keys() {
    let c = parse(r#"{"store_cluster":"s"}"#).unwrap();
    assert!(c.store_grpc_statuses.contains(0) && !c.store_grpc_statuses.contains(5));
    assert!(c.grpc_streaming_methods.is_empty());
    let c = parse(
        r#"{"store_cluster":"s","store_grpc_statuses":["ok","NOT_FOUND",6],
            "grpc_streaming_methods":["/a.B/Watch","/a.Chat/*"]}"#,
    )
    .unwrap();
    assert_eq!(c.store_grpc_statuses.names(), vec!["OK", "NOT_FOUND", "ALREADY_EXISTS"]);
    assert!(c.streams_grpc(b"/a.B/Watch") && c.streams_grpc(b"/a.Chat/Talk"));
    assert!(!c.streams_grpc(b"/a.B/Watch2") && !c.streams_grpc(b"/a.B/Create"));
    for bad in [r#"["NOPE"]"#, "[17]", "[-1]", r#""OK""#, "[true]"] {
        let e = parse(&format!(r#"{{"store_cluster":"s","store_grpc_statuses":{bad}}}"#)).unwrap_err();
        assert_eq!(e.key, "store_grpc_statuses", "{bad}: {e}");
    }
    for bad in
        [r#"["a.B/M"]"#, r#"["/a.B"]"#, r#"["/a.B/"]"#, r#"["/*/M"]"#, r#"["/a.B/M*"]"#, r#"["/a B/M"]"#]
    {
        let e = parse(&format!(r#"{{"store_cluster":"s","grpc_streaming_methods":{bad}}}"#)).unwrap_err();
        assert_eq!(e.key, "grpc_streaming_methods", "{bad}: {e}");
    }
    // The replay listener needs nothing else.
    let c = parse(r#"{"mode":"grpc_replay"}"#).unwrap();
    assert_eq!((&c.mode, c.store_cluster.as_str()), (&Mode::GrpcReplay, ""));
    // Written back as read.
    let c = parse(r#"{"store_cluster":"s","store_grpc_statuses":[5],"grpc_streaming_methods":["/a.B/*"]}"#)
        .unwrap();
    let again = Config::validate(c.to_raw(), &|_| None).unwrap();
    assert_eq!(again.store_grpc_statuses, c.store_grpc_statuses);
    assert_eq!(again.grpc_streaming_methods, c.grpc_streaming_methods);
}

#[test]
fn the_store_transport_is_a_stream_unless_told() {
    assert_eq!(parse(r#"{"store_cluster":"s"}"#).unwrap().store_transport, StoreTransport::Stream);
    let callout = parse(r#"{"store_cluster":"s","store_transport":"callout"}"#).unwrap();
    assert_eq!(callout.store_transport, StoreTransport::Callout);
    let e = parse(r#"{"store_cluster":"s","store_transport":"grpc"}"#).unwrap_err();
    assert!(e.to_string().contains("store_transport"), "{e}");
    let long = format!(r#"{{"store_cluster":"{}"}}"#, "c".repeat(121));
    assert!(parse(&long).unwrap_err().to_string().contains("at most 120 bytes"));
    let long_callout = format!(r#"{{"store_cluster":"{}","store_transport":"callout"}}"#, "c".repeat(121));
    assert!(parse(&long_callout).is_ok());
}

const THREE_ROUTES: &str = r#"{"store_cluster":"s","lock_wait_ms":2000,"policy_url":"https://api.example.com/idem",
    "fingerprint_headers":["x-tenant"],
    "routes":{
        "payments":{"require_key":true,"store_statuses":["2xx","4xx"],"retention_seconds":604800,"lock_ttl_ms":60000},
        "webhooks":{"mode":"inbox","inbox":{"message_id":{"header":"x-message-id"}}},
        "orders":{}}}"#;

#[test]
fn a_route_s_policy_over_the_rest_as_written() {
    let c = parse(THREE_ROUTES).unwrap();
    let payments = c.routes.get(b"payments").unwrap();
    assert!(payments.require_key);
    assert_eq!(payments.store_statuses.entries(), ["2xx", "4xx"]);
    assert_eq!((payments.retention_seconds, payments.lock_ttl_ms), (604_800, 60_000));
    assert_eq!(payments.lock_wait_ms, 2000, "inherited");
    assert_eq!(payments.fingerprint_headers, ["x-tenant"], "inherited");
    assert_eq!(payments.policy_url.as_deref(), Some("https://api.example.com/idem"));
    assert_eq!(payments.detached_timeout_ms, 15_000, "the default of the route's own lock_ttl_ms");
    assert!(payments.routes.is_empty());
    let webhooks = c.routes.get(b"webhooks").unwrap();
    assert!(webhooks.inbox().is_some());
    assert!(webhooks.fingerprint_headers.is_empty(), "what inbox mode refuses is not inherited");
    let orders = c.routes.get(b"orders").unwrap();
    assert_eq!(
        Config { routes: Routes::default(), ..c.clone() },
        **orders,
        "an empty policy is the top level"
    );
    assert!(c.routes.get(b"search").is_none());
    assert!(c.routes.get(b"\xff").is_none());
    assert_eq!(c.longest_terms(), (604_800, 60_000));
    let back = serde_json::to_vec(&c.to_raw()).unwrap();
    assert_eq!(Config::from_json(&back).unwrap(), c, "written back, the same configuration");
    // An inbox filter with a route back on keys: the `inbox` settings are not inherited there.
    let inbox_top = parse(
        r#"{"store_cluster":"s","mode":"inbox","inbox":{"missing_id":"pass"},
            "routes":{"api":{"mode":"idempotency_key","require_key":true}}}"#,
    )
    .unwrap();
    assert_eq!(inbox_top.routes.get(b"api").unwrap().mode, Mode::IdempotencyKey);
}

#[test]
fn a_bad_policy_names_its_route_and_key() {
    let routes =
        |policy: &str| parse(&format!(r#"{{"store_cluster":"s","routes":{{"payments":{policy}}}}}"#));
    let key_of = |policy: &str| routes(policy).unwrap_err().key;
    assert_eq!(key_of(r#"{"retention_secs":1}"#), "routes.payments.retention_secs");
    let e = routes(r#"{"retention_seconds":0}"#).unwrap_err();
    assert_eq!(e.key, "routes.payments.retention_seconds");
    assert!(e.to_string().contains("must be an integer from 1 to"), "{e}");
    assert_eq!(key_of(r#"{"methods":[]}"#), "routes.payments.methods");
    assert_eq!(key_of(r#"{"lock_wait_ms":-1}"#), "routes.payments.lock_wait_ms");
    for wide in
        ["store_cluster", "store_timeout_ms", "failure_mode", "pause_on_headers", "routes", "store_secret"]
    {
        let e = routes(&format!(r#"{{"{wide}":null}}"#)).unwrap_err();
        assert_eq!(e.key, format!("routes.payments.{wide}"));
        assert!(e.message.contains("filter-wide"), "{e}");
    }
    assert_eq!(key_of(r#"{"mode":"mint"}"#), "routes.payments.mode");
    assert_eq!(key_of(r#"{"mode":"inbox","require_key":true}"#), "routes.payments.require_key");
    assert_eq!(key_of("[]"), "routes.payments");
    assert_eq!(
        key_of(r#"{"detached_timeout_ms":20000,"lock_ttl_ms":10000}"#),
        "routes.payments.detached_timeout_ms"
    );
    assert_eq!(parse(r#"{"store_cluster":"s","routes":[]}"#).unwrap_err().key, "routes");
    assert_eq!(parse(r#"{"store_cluster":"s","routes":{"":{}}}"#).unwrap_err().key, "routes");
    assert_eq!(parse(r#"{"mode":"mint","routes":{"a":{}}}"#).unwrap_err().key, "routes");
    let many: Vec<String> = (0..=routes::MAX_ROUTES).map(|i| format!(r#""r{i}":{{}}"#)).collect();
    let e = parse(&format!(r#"{{"store_cluster":"s","routes":{{{}}}}}"#, many.join(","))).unwrap_err();
    assert_eq!(e.key, "routes");
    assert!(routes("null").is_err());
    assert!(parse(r#"{"store_cluster":"s","routes":null}"#).unwrap().routes.is_empty());
}

#[test]
fn the_published_policy_keys() {
    let c = parse(
        r#"{"store_cluster":"s","policy_url":"https://api.example.com/docs/idempotency",
            "problem_type_base":"urn:example:problems:","expiry_header":"idempotency-expires"}"#,
    )
    .unwrap();
    assert_eq!(c.problem_type_base.as_deref(), Some("urn:example:problems:"));
    assert_eq!(c.expiry_header.as_deref(), Some("idempotency-expires"));
    let d = parse(r#"{"store_cluster":"s"}"#).unwrap();
    assert_eq!((d.policy_url, d.problem_type_base, d.expiry_header), (None, None, None));
    let key_of = |extra: &str| parse(&format!(r#"{{"store_cluster":"s",{extra}}}"#)).unwrap_err().key;
    for bad in [
        r#""ftp://x""#,
        r#""https://""#,
        r#""https:///x""#,
        r#""https://a b""#,
        r#""https://a/<x>""#,
        "1",
        r#""""#,
    ] {
        assert_eq!(key_of(&format!(r#""policy_url":{bad}"#)), "policy_url", "{bad}");
    }
    let long = format!(r#""policy_url":"https://a/{}""#, "x".repeat(parse::MAX_URI));
    assert_eq!(key_of(&long), "policy_url");
    for bad in [r#""problems/""#, r#""1x:a""#, r#"":x""#, r#""urn:""#] {
        assert_eq!(key_of(&format!(r#""problem_type_base":{bad}"#)), "problem_type_base", "{bad}");
    }
    for bad in [r#""Expires-At""#, r#""content-length""#, r#""x-idempotent-replay""#, r#""location""#] {
        assert_eq!(key_of(&format!(r#""expiry_header":{bad}"#)), "expiry_header", "{bad}");
    }
}

#[test]
fn header_names_are_at_most_256_bytes() {
    // They bound a record's framing, and so what the replay listener reads.
    let name = |n: usize| format!("x-{}", "a".repeat(n - 2));
    for key in ["replay_header", "body_omitted_header", "store_key_header"] {
        let e = parse(&format!(r#"{{"store_cluster":"s","{key}":"{}"}}"#, name(257))).unwrap_err();
        assert_eq!(e.key, key, "{e}");
        parse(&format!(r#"{{"store_cluster":"s","{key}":"{}"}}"#, name(256))).unwrap();
    }
    let e = parse(&format!(r#"{{"store_cluster":"s","replay_headers":["{}"]}}"#, name(257))).unwrap_err();
    assert_eq!(e.key, "replay_headers", "{e}");
}

// The lists kept beside the key table (docs/configuration.md's per-route lists, the config fuzz
// target's dictionary and seeds), each checked against it.

use std::collections::BTreeSet;

/// The keys that a bullet of docs/configuration.md names (the bullet that starts with
/// `- **<label>**`): the names in backticks of its first sentence, leaving out what is in
/// parentheses (`mode`'s values, remarks). In the order written, repeats kept.
fn keys_listed_in_bullet(label: &str) -> Vec<String> {
    let docs = include_str!("../../docs/configuration.md");
    let start = docs
        .find(&format!("\n- **{label}**"))
        .unwrap_or_else(|| panic!("docs/configuration.md has no bullet `- **{label}**`"));
    let bullet = &docs[start + 1..];
    let end = ["\n- ", "\n\n"].iter().filter_map(|end| bullet.find(end)).min().unwrap_or(bullet.len());
    let mut depth = 0usize;
    let mut text = String::new();
    for c in bullet[..end].chars() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            '\n' if depth == 0 => text.push(' '),
            _ if depth == 0 => text.push(c),
            _ => {}
        }
    }
    let sentence = text.split(". ").next().unwrap_or_default();
    sentence.split('`').skip(1).step_by(2).map(str::to_string).collect()
}

#[test]
fn the_policy_lists_name_every_key_by_its_scope() {
    // A policy may set any key that is not filter-wide (`routes::route` refuses those alone), and
    // every such key is per-request.
    let unknown: Vec<&&str> = routes::FILTER_WIDE.iter().filter(|k| !KEYS.contains(k)).collect();
    assert!(unknown.is_empty(), "routes::FILTER_WIDE names keys the table has not: {unknown:?}");
    let filter_wide: BTreeSet<&str> = routes::FILTER_WIDE.iter().copied().collect();
    let per_request: BTreeSet<&str> = KEYS.iter().copied().filter(|k| !filter_wide.contains(k)).collect();
    for (label, expected) in [("What a policy may set", per_request), ("Filter-wide", filter_wide)] {
        let listed = keys_listed_in_bullet(label);
        let names: BTreeSet<&str> = listed.iter().map(String::as_str).collect();
        assert_eq!(
            names.len(),
            listed.len(),
            "docs/configuration.md, {label:?}: a key named twice in {listed:?}"
        );
        let missing: Vec<&&str> = expected.difference(&names).collect();
        let stray: Vec<&&str> = names.difference(&expected).collect();
        assert!(
            missing.is_empty() && stray.is_empty(),
            "docs/configuration.md, \"Per-route policies\", {label:?}: missing {missing:?}, not of that list {stray:?}"
        );
    }
}

#[test]
fn the_fuzz_dictionary_has_every_key() {
    let dict: BTreeSet<&str> = include_str!("../../fuzz/dicts/config.dict").lines().map(str::trim).collect();
    let missing: Vec<&&str> =
        KEYS.iter().filter(|k| !dict.contains(format!(r#""\"{k}\"""#).as_str())).collect();
    assert!(missing.is_empty(), r#"fuzz/dicts/config.dict has no line "\"<key>\"" for {missing:?}"#);
}

/// The environment the config fuzz target gives `store_secret_env` (fuzz/fuzz_targets/config.rs):
/// the valid secret only.
fn fuzz_env(name: &str) -> Option<String> {
    (name == "IDEM_SECRET").then(|| "env-Secret~1".to_string())
}

#[test]
fn the_every_key_seeds_are_accepted_and_together_set_every_key() {
    // Some keys exclude others (`inbox` needs inbox mode, `store_secret_env` refuses
    // `store_secret`): several seeds, every_key*.json, whose union is every key.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/config");
    let mut seeds: Vec<std::path::PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("every_key") && n.ends_with(".json"))
        })
        .collect();
    seeds.sort();
    assert!(!seeds.is_empty(), "no {}/every_key*.json", dir.display());
    let mut set = BTreeSet::new();
    for path in &seeds {
        let bytes = std::fs::read(path).unwrap();
        let c = Config::from_json_with_env(&bytes, &fuzz_env)
            .unwrap_or_else(|e| panic!("{} is refused: {e}", path.display()));
        // As the fuzz target asserts of every configuration it accepts.
        let again = serde_json::to_vec(&c.to_raw()).unwrap();
        assert_eq!(Config::from_json_with_env(&again, &fuzz_env), Ok(c), "{} written back", path.display());
        let value: Value = serde_json::from_slice(&bytes).unwrap();
        set.extend(value.as_object().unwrap().keys().cloned());
    }
    let missing: Vec<&&str> = KEYS.iter().filter(|k| !set.contains(**k)).collect();
    assert!(missing.is_empty(), "no seed of {seeds:?} sets {missing:?}");
}

#[test]
fn store_is_the_native_hosts_and_excludes_store_cluster() {
    let c = parse(r#"{"store":{"memory":true}}"#).unwrap();
    assert_eq!(c.store, Some(serde_json::json!({"memory": true})));
    assert!(c.store_cluster.is_empty());
    for (bad, says) in [
        (r#"{"store":{"memory":true},"store_cluster":"s"}"#, "exclude each other"),
        (r#"{"store":"redis://x"}"#, "must be an object"),
        (r#"{"store":{"memory":true},"store_transport":"callout"}"#, "must be `stream` with `store`"),
        (r#"{"store":{"memory":true},"routes":{"r":{"store":{"memory":true}}}}"#, "store"),
        (r#"{"lock_wait_ms":0}"#, "or `store`"),
    ] {
        let e = parse(bad).unwrap_err().to_string();
        assert!(e.contains(says), "{bad}: {e}");
    }
    // Written back, as the fuzz target checks of every configuration it accepts.
    let again = serde_json::to_vec(&c.to_raw()).unwrap();
    assert_eq!(Config::from_json(&again), Ok(c));
}
