use super::*;
use crate::request::key::KeyError;
use std::collections::HashSet;

fn c() -> Config {
    Config::from_json(br#"{"store_cluster":"s"}"#).unwrap()
}

fn with(extra: &str) -> Config {
    Config::from_json(format!(r#"{{"store_cluster":"s"{extra}}}"#).as_bytes()).unwrap()
}

const INSTANCE: &str = "urn:uuid:0f7c3a52-9d4e-4b1a-8c2d-5e6f7a8b9c0d";

fn http(p: &Problem) -> LocalResponse {
    p.answer(false, INSTANCE)
}

fn doc(r: &LocalResponse) -> serde_json::Value {
    serde_json::from_slice(&r.body).unwrap()
}

fn header<'a>(r: &'a LocalResponse, name: &str) -> Option<&'a str> {
    r.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
}

/// One problem of every code, as the filter makes them.
fn every_problem(cfg: &Config) -> Vec<Problem> {
    let all = vec![
        missing_key(cfg),
        invalid_key(cfg, KeyError::Empty),
        missing_message_id(cfg),
        invalid_message_id(cfg, IdError::Empty),
        hop_header(cfg),
        encoding_not_acceptable(cfg, "br"),
        outcome_unknown(cfg, 1500),
        in_flight(cfg, 1),
        message_in_flight(cfg, 1),
        body_too_large(cfg),
        key_reused(cfg, &Differs::Target),
        upstream_failed(cfg),
        store_unavailable(cfg),
        answer_withheld(cfg, 1),
        upstream_timeout(cfg),
        replay_failed(cfg, grpc::UNAVAILABLE, "The stored answer could not be replayed."),
    ];
    let codes: HashSet<Code> = all.iter().map(|p| p.code).collect();
    assert_eq!(codes, Code::ALL.iter().copied().collect(), "a problem of every code");
    all
}

#[test]
fn codes_have_distinct_names_that_read_back() {
    let names: HashSet<&str> = Code::ALL.iter().map(|c| c.name()).collect();
    assert_eq!(names.len(), Code::ALL.len());
    for &code in Code::ALL {
        assert_eq!(Code::from_name(code.name()), Some(code));
    }
    assert_eq!(Code::from_name("nope"), None);
}

#[test]
fn the_type_is_the_base_then_the_policy_page_then_a_tag() {
    let kind = |p: &Problem| doc(&http(p))["type"].as_str().unwrap().to_string();
    let plain = c();
    assert_eq!(kind(&key_reused(&plain, &Differs::Body)), "tag:idempotency-filter,2026:problems/key-reused");
    assert_eq!(kind(&in_flight(&plain, 1)), "tag:idempotency-filter,2026:problems/request-in-flight");
    assert_eq!(header(&http(&missing_key(&plain)), "link"), None);
    let page = with(r#","policy_url":"https://api.example.com/idempotency""#);
    assert_eq!(kind(&missing_key(&page)), "https://api.example.com/idempotency#missing-key");
    let anchored = with(r#","policy_url":"https://api.example.com/docs#idempotency""#);
    assert_eq!(kind(&missing_key(&anchored)), "tag:idempotency-filter,2026:problems/missing-key");
    let both = with(
        r#","policy_url":"https://api.example.com/idempotency","problem_type_base":"https://api.example.com/problems/""#,
    );
    assert_eq!(kind(&store_unavailable(&both)), "https://api.example.com/problems/store-unavailable");
}

#[test]
fn every_problem_links_to_the_policy() {
    let cfg = with(r#","policy_url":"https://api.example.com/idempotency""#);
    let link = Some(r#"<https://api.example.com/idempotency>; rel="describedby""#);
    for p in every_problem(&cfg) {
        assert_eq!(header(&p.answer(false, INSTANCE), "link"), link, "{p:?}");
        assert_eq!(header(&p.answer(true, INSTANCE), "link"), link, "as gRPC metadata too");
    }
}

#[test]
fn problems_are_rfc9457_with_their_rows_status_instance_and_retryable() {
    for p in every_problem(&c()) {
        let Some(status) = p.code.status() else {
            assert_eq!(http(&p).headers[0], ("content-type".into(), "application/grpc".into()), "gRPC only");
            continue;
        };
        let r = http(&p);
        assert_eq!(r.status, status);
        assert_eq!(r.headers[0], ("content-type".into(), "application/problem+json".into()));
        let v = doc(&r);
        assert_eq!(v["status"], status);
        assert_eq!(v["code"], p.code.name());
        assert_eq!(v["title"], p.code.title());
        assert_eq!(v["instance"], INSTANCE);
        assert_eq!(v["retryable"], p.code.retryable());
        assert!(v["type"].as_str().unwrap().starts_with(TAG_TYPE_BASE));
        assert!(!v["detail"].as_str().unwrap().is_empty());
    }
}

#[test]
fn only_waiting_and_failures_on_the_way_are_retryable() {
    let retryable: Vec<&str> = Code::ALL.iter().filter(|c| c.retryable()).map(|c| c.name()).collect();
    assert_eq!(
        retryable,
        [
            "request-in-flight",
            "message-in-flight",
            "upstream-failed",
            "store-unavailable",
            "upstream-timeout",
            "replay-failed"
        ]
    );
}

#[test]
fn key_reused_says_what_differed_with_the_mismatch_status() {
    let v = |p: Problem| doc(&http(&p));
    assert_eq!(v(key_reused(&c(), &Differs::Body))["differs"], "body");
    assert_eq!(v(key_reused(&c(), &Differs::Target))["differs"], "target");
    let h = v(key_reused(&c(), &Differs::Header("x-tenant".into())));
    assert_eq!((h["differs"].as_str(), h["header"].as_str()), (Some("header"), Some("x-tenant")));
    assert!(h["detail"].as_str().unwrap().contains("x-tenant"));
    assert_eq!(v(key_reused(&c(), &Differs::Body)).get("header"), None);
    assert_eq!(v(missing_key(&c())).get("differs"), None);

    let conflict = with(r#","mismatch_status":409"#);
    let r = http(&key_reused(&conflict, &Differs::Body));
    assert_eq!(
        (r.status, doc(&r)["status"].as_u64(), doc(&r)["code"].as_str()),
        (409, Some(409), Some("key-reused"))
    );
    assert_eq!(doc(&r)["retryable"], false);
    let g = key_reused(&conflict, &Differs::Body).answer(true, INSTANCE);
    assert_eq!(header(&g, "grpc-status"), Some("9"), "gRPC unchanged");
}

#[test]
fn retry_after_is_the_time_left_in_whole_seconds() {
    let after = |p: Problem| header(&http(&p), "retry-after").map(str::to_string);
    assert_eq!(after(in_flight(&c(), 0)).as_deref(), Some("1"));
    assert_eq!(after(in_flight(&c(), 1)).as_deref(), Some("1"));
    assert_eq!(after(in_flight(&c(), 1000)).as_deref(), Some("1"));
    assert_eq!(after(in_flight(&c(), 1001)).as_deref(), Some("2"));
    assert_eq!(after(message_in_flight(&c(), 29_500)).as_deref(), Some("30"));
    assert_eq!(after(outcome_unknown(&c(), 0)), None, "nothing left running");
    assert_eq!(after(store_unavailable(&c())), None);
}

#[test]
fn grpc_calls_get_the_rows_status_with_the_problem_text() {
    for p in every_problem(&c()) {
        let r = p.answer(true, INSTANCE);
        assert_eq!(r.status, 200);
        assert!(r.body.is_empty());
        assert_eq!(header(&r, "content-type"), Some("application/grpc"));
        assert_eq!(header(&r, "grpc-status"), Some(p.grpc_status.to_string().as_str()));
        if p.code != Code::ReplayFailed {
            assert_eq!(p.grpc_status, p.code.grpc(), "{p:?}");
        }
        let message = header(&r, "grpc-message").unwrap();
        assert!(message.starts_with(&format!("{}: ", p.code.name())), "{message}");
        assert!(message.ends_with(&format!(" (instance {INSTANCE})")), "{message}");
        assert!(!message.contains('%'), "{message}");
        assert_eq!(header(&r, "retry-after"), None);
    }
    let busy = in_flight(&c(), 1234).answer(true, INSTANCE);
    assert_eq!(header(&busy, "grpc-status"), Some("14"));
    assert_eq!(header(&busy, "grpc-retry-pushback-ms"), Some("1234"), "the exact time left");
    let unknown = outcome_unknown(&c(), 2500).answer(true, INSTANCE);
    assert_eq!(header(&unknown, "grpc-status"), Some("10"));
    assert_eq!(header(&unknown, "grpc-retry-pushback-ms"), Some("2500"));
}

/// docs/configuration.md's table of codes (code, status, retryable) and docs/grpc.md's (code,
/// HTTP status, gRPC status): a row for every code, as the code table says.
#[test]
fn the_docs_tables_are_the_code_table() {
    let cells = |line: &str| -> Vec<String> { line.split('|').map(|c| c.trim().to_string()).collect() };
    let first_number = |cell: &str| -> Option<u32> {
        let digits: String =
            cell.chars().skip_while(|c| !c.is_ascii_digit()).take_while(char::is_ascii_digit).collect();
        digits.parse().ok()
    };
    let config = include_str!("../../../docs/configuration.md");
    let mut documented = HashSet::new();
    for line in config.lines().filter(|l| l.trim_start().starts_with("| `")) {
        let row = cells(line.trim());
        let Some(code) = Code::from_name(row[1].trim_matches('`')) else { continue };
        if row.len() < 6 || !matches!(row[3].as_str(), "`true`" | "`false`") {
            continue;
        }
        assert_eq!(
            first_number(&row[2]),
            code.status(),
            "docs/configuration.md: the status of {}",
            code.name()
        );
        assert_eq!(
            row[3],
            format!("`{}`", code.retryable()),
            "docs/configuration.md: {} retryable",
            code.name()
        );
        assert!(documented.insert(code), "docs/configuration.md: two rows for {}", code.name());
    }
    let missing: Vec<&str> = Code::ALL.iter().filter(|c| !documented.contains(c)).map(|c| c.name()).collect();
    assert!(missing.is_empty(), "docs/configuration.md's code table has no row for {missing:?}");

    let grpc_doc = include_str!("../../../docs/grpc.md");
    let mut in_grpc = HashSet::new();
    for line in grpc_doc.lines().filter(|l| l.starts_with('|')) {
        let row = cells(line);
        let Some(name) = row.get(4).and_then(|c| c.strip_prefix('`')).and_then(|c| c.strip_suffix(":`"))
        else {
            continue;
        };
        let grpc_status = row[3].split(['(', ')']).nth(1).and_then(|n| n.parse::<u8>().ok());
        if name == "answer-omitted" {
            continue; // a replay's status, not a problem
        }
        let code = Code::from_name(name).unwrap_or_else(|| panic!("docs/grpc.md: {name} is not a code"));
        assert_eq!(grpc_status, Some(code.grpc()), "docs/grpc.md: the gRPC status of {name}");
        assert_eq!(first_number(&row[2]), code.status(), "docs/grpc.md: the HTTP status of {name}");
        in_grpc.insert(code);
    }
    let missing: Vec<&str> = Code::ALL.iter().filter(|c| !in_grpc.contains(c)).map(|c| c.name()).collect();
    assert!(missing.is_empty(), "docs/grpc.md's table has no row for {missing:?}");
}
