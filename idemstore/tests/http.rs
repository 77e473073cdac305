//! The wire protocol over real sockets, HTTP/1.1 and h2c (prior knowledge).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::client::{batch_body, serve, serve_store, serve_with, Client, Version};
use hyper::StatusCode;
use idem_protocol as proto;
use idemstore::backend::memory::MemoryBackend;
use idemstore::backend::{Attempt, Backend, BackendError, Commit, CommitOutcome, Hold, ReleaseOutcome};
use idemstore::http::{Options, SecretCheck};
use idemstore::secret::Secret;
use idemstore::store::Store;
use tokio::net::TcpListener;

async fn protocol_flow(version: Version) {
    let addr = serve(8 * 1024 * 1024).await;
    let client = Client::new(addr, version).await;
    let (key, hash) = (common::key(), common::hash('a'));

    let health = client.call("GET", proto::PATH_HEALTH, &[], Bytes::new()).await;
    assert_eq!((health.status, &health.body[..]), (StatusCode::OK, &b"ok"[..]));

    let first = client.begin(&key, &hash, "5000").await;
    assert_eq!((first.status, first.outcome()), (StatusCode::OK, "locked"));
    let token = first.token();

    // A duplicate long-polls; the commit wakes it with the record.
    let waiter = tokio::spawn({
        let (client, key, hash) = (client.clone(), key.clone(), hash.clone());
        async move { client.begin(&key, &hash, "5000").await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let record = Bytes::from(vec![0u8, 1, 2, 255, 0]);
    let started = Instant::now();
    let committed = client.commit(&key, &token, &hash, record.clone()).await;
    assert_eq!((committed.status, committed.outcome()), (StatusCode::OK, "stored"));
    let replay = waiter.await.unwrap();
    assert!(started.elapsed() < Duration::from_millis(500));
    assert_eq!((replay.status, replay.outcome()), (StatusCode::OK, "record"));
    assert_eq!(replay.body, record);

    let again = client.commit(&key, &token, &hash, Bytes::from_static(b"later")).await;
    assert_eq!(again.outcome(), "exists");
    assert_eq!(client.begin(&key, &common::hash('b'), "5000").await.outcome(), "mismatch");
    assert_eq!(client.release(&key, &token, false).await.outcome(), "not-owner");

    let other = common::key();
    let token = client.begin(&other, &hash, "5000").await.token();
    let busy = client.begin(&other, &hash, "100").await;
    assert_eq!((busy.status, busy.outcome(), &busy.body[..]), (StatusCode::OK, "busy", &b""[..]));
    assert_eq!(client.release(&other, &token, false).await.outcome(), "released");
    assert_eq!(client.begin(&other, &hash, "100").await.outcome(), "locked");
}

#[tokio::test]
async fn protocol_over_http1() {
    protocol_flow(Version::H1).await;
}

#[tokio::test]
async fn protocol_over_h2c() {
    protocol_flow(Version::H2c).await;
}

#[tokio::test]
async fn bad_requests_get_400() {
    let addr = serve(1024).await;
    let client = Client::new(addr, Version::H1).await;
    let (key, hash) = (common::key(), common::hash('a'));
    let upper = key.to_uppercase();
    let cases: Vec<(&str, Vec<(&str, &str)>)> = vec![
        (
            "missing key",
            vec![
                (proto::HEADER_BODY_HASH, &hash),
                (proto::HEADER_LOCK_TTL_MS, "1"),
                (proto::HEADER_WAIT_MS, "1"),
            ],
        ),
        (
            "uppercase key",
            vec![
                (proto::HEADER_KEY, &upper),
                (proto::HEADER_BODY_HASH, &hash),
                (proto::HEADER_LOCK_TTL_MS, "1"),
                (proto::HEADER_WAIT_MS, "1"),
            ],
        ),
        (
            "short hash",
            vec![
                (proto::HEADER_KEY, &key),
                (proto::HEADER_BODY_HASH, "abc"),
                (proto::HEADER_LOCK_TTL_MS, "1"),
                (proto::HEADER_WAIT_MS, "1"),
            ],
        ),
        (
            "zero ttl",
            vec![
                (proto::HEADER_KEY, &key),
                (proto::HEADER_BODY_HASH, &hash),
                (proto::HEADER_LOCK_TTL_MS, "0"),
                (proto::HEADER_WAIT_MS, "1"),
            ],
        ),
        (
            "wait too long",
            vec![
                (proto::HEADER_KEY, &key),
                (proto::HEADER_BODY_HASH, &hash),
                (proto::HEADER_LOCK_TTL_MS, "1"),
                (proto::HEADER_WAIT_MS, "60001"),
            ],
        ),
        (
            "repeated key",
            vec![
                (proto::HEADER_KEY, &key),
                (proto::HEADER_KEY, &key),
                (proto::HEADER_BODY_HASH, &hash),
                (proto::HEADER_LOCK_TTL_MS, "1"),
                (proto::HEADER_WAIT_MS, "1"),
            ],
        ),
    ];
    for (name, headers) in cases {
        let reply = client.call("POST", proto::PATH_BEGIN, &headers, Bytes::new()).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{name}");
        assert!(reply.headers[hyper::header::CONTENT_TYPE].to_str().unwrap().starts_with("text/plain"));
        assert!(!reply.body.is_empty(), "{name}");
        assert!(reply.outcome().is_empty(), "{name}");
    }

    let bad_token = client.release(&key, "not a token", false).await;
    assert_eq!(bad_token.status, StatusCode::BAD_REQUEST);
    let commit = [
        (proto::HEADER_KEY, key.as_str()),
        (proto::HEADER_TOKEN, "t"),
        (proto::HEADER_BODY_HASH, hash.as_str()),
        (proto::HEADER_RETENTION_S, "604801"),
    ];
    let too_long = client.call("POST", proto::PATH_COMMIT, &commit, Bytes::new()).await;
    assert_eq!(too_long.status, StatusCode::BAD_REQUEST);

    let big = client.commit(&key, "t", &hash, Bytes::from(vec![b'x'; 2048])).await;
    assert_eq!(big.status, StatusCode::PAYLOAD_TOO_LARGE);
    let fits = client.commit(&key, "t", &hash, Bytes::from(vec![b'x'; 1024])).await;
    assert_eq!(fits.outcome(), "late");

    assert_eq!(
        client.call("GET", proto::PATH_BEGIN, &[], Bytes::new()).await.status,
        StatusCode::METHOD_NOT_ALLOWED
    );
    assert_eq!(client.call("POST", "/v1/nope", &[], Bytes::new()).await.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn full_memory_backend_answers_503() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = idemstore::http::router(Arc::new(Store::new(MemoryBackend::new(1))), Options::new(1024));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let client = Client::new(addr, Version::H2c).await;
    let hash = common::hash('a');
    assert_eq!(client.begin(&common::key(), &hash, "1").await.outcome(), "locked");
    let full = client.begin(&common::key(), &hash, "1").await;
    assert_eq!(full.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(full.outcome().is_empty());
}

const SECRET: &str = "s3cret-Value_with~punctuation!";

fn begin_headers<'a>(key: &'a str, hash: &'a str) -> Vec<(&'static str, &'a str)> {
    vec![
        (proto::HEADER_KEY, key),
        (proto::HEADER_BODY_HASH, hash),
        (proto::HEADER_LOCK_TTL_MS, "30000"),
        (proto::HEADER_WAIT_MS, "1"),
    ]
}

async fn secret_required(version: Version) {
    let backend = MemoryBackend::new(1000);
    let guard = Arc::new(SecretCheck::new(Secret::new(SECRET).unwrap()));
    let options = Options { max_body_bytes: 1024, secret: Some(Arc::clone(&guard)) };
    let addr = serve_with(backend.clone(), options).await;
    let bare = Client::new(addr, version).await;
    let right = bare.with_secret(Some(SECRET));
    let (key, hash) = (common::key(), common::hash('a'));
    let begin = begin_headers(&key, &hash);

    // Missing, wrong (a prefix, a longer value, another case, empty), repeated: 401, no work.
    let mut refused = vec![bare.call("POST", proto::PATH_BEGIN, &begin, Bytes::new()).await];
    for wrong in ["s3cret-Value", "s3cret-Value_with~punctuation!!", "S3CRET-VALUE_WITH~PUNCTUATION!", ""] {
        let mut headers = begin.clone();
        headers.push((proto::HEADER_SECRET, wrong));
        refused.push(bare.call("POST", proto::PATH_BEGIN, &headers, Bytes::new()).await);
    }
    let mut twice = begin.clone();
    twice.push((proto::HEADER_SECRET, SECRET));
    refused.push(right.call("POST", proto::PATH_BEGIN, &twice, Bytes::new()).await);
    // Before the body limit (a record over it) and before routing (an unknown path).
    let commit = [
        (proto::HEADER_KEY, key.as_str()),
        (proto::HEADER_TOKEN, "t"),
        (proto::HEADER_BODY_HASH, hash.as_str()),
        (proto::HEADER_RETENTION_S, "60"),
    ];
    refused.push(bare.call("POST", proto::PATH_COMMIT, &commit, Bytes::from(vec![b'x'; 100])).await);
    refused.push(bare.call("POST", proto::PATH_COMMIT, &commit, Bytes::from(vec![b'x'; 4096])).await);
    let release = [(proto::HEADER_KEY, key.as_str()), (proto::HEADER_TOKEN, "t")];
    refused.push(bare.call("POST", proto::PATH_RELEASE, &release, Bytes::new()).await);
    let batch = batch_body(&[(&key, "t", &hash, b"rec")]);
    refused.push(bare.commits(batch.clone()).await);
    refused.push(bare.with_secret(Some("wrong")).commits(batch.clone()).await);
    refused.push(bare.call("POST", "/v1/nope", &[], Bytes::new()).await);
    refused.push(bare.call("GET", proto::PATH_BEGIN, &[], Bytes::new()).await);
    for reply in &refused {
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
        assert_eq!(&reply.body[..], b"missing or wrong x-idem-secret");
        assert!(reply.outcome().is_empty());
    }
    assert_eq!(guard.refused(), refused.len() as u64);
    assert!(backend.is_empty(), "a refused request reached the backend");

    // The health check needs no secret (and ignores a wrong one).
    let health = bare.call("GET", proto::PATH_HEALTH, &[], Bytes::new()).await;
    assert_eq!((health.status, &health.body[..]), (StatusCode::OK, &b"ok"[..]));
    let health = bare.with_secret(Some("wrong")).call("GET", proto::PATH_HEALTH, &[], Bytes::new()).await;
    assert_eq!(health.status, StatusCode::OK);

    // The right secret: the protocol as usual, and routing answers as usual.
    let locked = right.begin(&key, &hash, "1").await;
    assert_eq!((locked.status, locked.outcome()), (StatusCode::OK, "locked"));
    let stored = right.commit(&key, &locked.token(), &hash, Bytes::from_static(b"rec")).await;
    assert_eq!(stored.outcome(), "stored");
    assert_eq!(right.begin(&key, &hash, "1").await.body, Bytes::from_static(b"rec"));
    assert_eq!(right.commits(batch).await.batch(1), [Some(CommitOutcome::Exists)]);
    assert_eq!(right.call("POST", "/v1/nope", &[], Bytes::new()).await.status, StatusCode::NOT_FOUND);
    assert_eq!(
        right.call("GET", proto::PATH_BEGIN, &[], Bytes::new()).await.status,
        StatusCode::METHOD_NOT_ALLOWED
    );
    assert_eq!(guard.refused(), refused.len() as u64);
}

#[tokio::test]
async fn secret_is_required_on_every_path_but_healthz_http1() {
    secret_required(Version::H1).await;
}

#[tokio::test]
async fn secret_is_required_on_every_path_but_healthz_h2c() {
    secret_required(Version::H2c).await;
}

/// Every field of every operation: missing, repeated or malformed is a `400` that names it,
/// and the backend is never touched.
#[tokio::test]
async fn every_field_is_validated_before_the_backend() {
    let backend = MemoryBackend::new(1000);
    let addr = serve_with(backend.clone(), Options::new(1024)).await;
    let client = Client::new(addr, Version::H2c).await;
    let (key, hash) = (common::key(), common::hash('a'));
    let ttl_max = (proto::MAX_LOCK_TTL_MS + 1).to_string();
    let wait_max = (proto::MAX_WAIT_MS + 1).to_string();
    let retention_max = (proto::MAX_RETENTION_S + 1).to_string();
    let long_token = "t".repeat(proto::MAX_TOKEN_LEN + 1);
    let hex_bad = [
        "",
        &key[..63],
        &format!("{key}0"),
        &key.to_uppercase(),
        &format!("{}g", &key[..63]),
        &format!("{} ", &key[..63]),
        "0x00",
    ]
    .map(str::to_owned);
    let number_bad = |max: &str| {
        ["", "0", max, "-1", "+5", "1.5", "1e3", "abc", " 5", "99999999999999999999999"].map(str::to_owned)
    };
    // The wait may be 0 (see `wait_ms_may_be_zero`).
    let wait_bad: Vec<String> = number_bad(&wait_max).into_iter().filter(|v| v != "0").collect();
    let token_bad = ["", "a b", "tok!", "t/k", long_token.as_str()].map(str::to_owned);

    // (path, a valid header set, each header with its bad values)
    type Field = (&'static str, Vec<String>);
    type Operation<'a> = (&'a str, Vec<(&'a str, String)>, Vec<Field>);
    let commit_headers = vec![
        (proto::HEADER_KEY, key.clone()),
        (proto::HEADER_TOKEN, "tok".to_owned()),
        (proto::HEADER_BODY_HASH, hash.clone()),
        (proto::HEADER_RETENTION_S, "60".to_owned()),
    ];
    let operations: Vec<Operation> = vec![
        (
            proto::PATH_BEGIN,
            begin_headers(&key, &hash).into_iter().map(|(n, v)| (n, v.to_owned())).collect(),
            vec![
                (proto::HEADER_KEY, hex_bad.to_vec()),
                (proto::HEADER_BODY_HASH, hex_bad.to_vec()),
                (proto::HEADER_LOCK_TTL_MS, number_bad(&ttl_max).to_vec()),
                (proto::HEADER_WAIT_MS, wait_bad),
            ],
        ),
        (
            proto::PATH_COMMIT,
            commit_headers,
            vec![
                (proto::HEADER_KEY, hex_bad.to_vec()),
                (proto::HEADER_TOKEN, token_bad.to_vec()),
                (proto::HEADER_BODY_HASH, hex_bad.to_vec()),
                (proto::HEADER_RETENTION_S, number_bad(&retention_max).to_vec()),
            ],
        ),
        (
            proto::PATH_RELEASE,
            vec![(proto::HEADER_KEY, key.clone()), (proto::HEADER_TOKEN, "tok".to_owned())],
            vec![(proto::HEADER_KEY, hex_bad.to_vec()), (proto::HEADER_TOKEN, token_bad.to_vec())],
        ),
    ];
    let mut cases = 0;
    for (path, valid, fields) in &operations {
        let body = if *path == proto::PATH_COMMIT { Bytes::from_static(b"rec") } else { Bytes::new() };
        for (field, bad_values) in fields {
            let others = valid.iter().filter(|(n, _)| n != field);
            let missing: Vec<(&str, &str)> = others.clone().map(|(n, v)| (*n, v.as_str())).collect();
            let good = &valid.iter().find(|(n, _)| n == field).unwrap().1;
            let mut variants = vec![("missing", missing.clone())];
            let mut repeated = missing.clone();
            repeated.extend([(*field, good.as_str()), (*field, good.as_str())]);
            variants.push(("repeated", repeated));
            for bad in bad_values {
                let mut headers = missing.clone();
                headers.push((*field, bad.as_str()));
                variants.push((bad.as_str(), headers));
            }
            for (what, headers) in variants {
                let reply = client.call("POST", path, &headers, body.clone()).await;
                let text = String::from_utf8_lossy(&reply.body);
                assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{path} {field} {what:?}: {text}");
                assert!(text.contains(field), "{path} {field} {what:?}: the answer must name it: {text}");
                assert!(reply.outcome().is_empty());
                cases += 1;
            }
        }
    }
    // The record itself: a commit needs one.
    let empty = client.commit(&key, "tok", &hash, Bytes::new()).await;
    assert_eq!(empty.status, StatusCode::BAD_REQUEST);
    assert!(String::from_utf8_lossy(&empty.body).contains("record"));
    assert_eq!(cases, 94);
    assert!(backend.is_empty(), "an invalid request reached the backend");

    // The control: the valid sets pass.
    assert_eq!(client.begin(&key, &hash, "1").await.outcome(), "locked");
}

/// `x-idem-wait-ms` takes `0..=60000`: `0` is one attempt, `busy` at once when the lock is
/// held; a sign, an empty value or past the maximum is still a `400` naming the header and its
/// range, and never reaches the backend. The other numbers still start at 1.
#[tokio::test]
async fn wait_ms_may_be_zero() {
    let backend = MemoryBackend::new(1000);
    let addr = serve_with(backend.clone(), Options::new(1024)).await;
    let max = proto::MAX_WAIT_MS.to_string();
    let past_max = (proto::MAX_WAIT_MS + 1).to_string();
    assert_eq!(past_max, "60001");
    for version in [Version::H1, Version::H2c] {
        let client = Client::new(addr, version).await;
        let (key, hash) = (common::key(), common::hash('a'));
        let keys = backend.len();
        // (Not " 0": HTTP/1.1 strips the whitespace around a value, so that one is a plain 0.)
        for bad in ["-1", "+1", "", past_max.as_str(), "-0", "+0", "0.0", "0x0"] {
            let reply = client.begin(&key, &hash, bad).await;
            let text = String::from_utf8_lossy(&reply.body);
            assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{bad:?}: {text}");
            assert!(text.contains(proto::HEADER_WAIT_MS) && text.contains("0..=60000"), "{bad:?}: {text}");
            assert!(reply.outcome().is_empty());
        }
        assert_eq!(backend.len(), keys, "an invalid wait reached the backend");
        let zero_ttl = client.begin_with_ttl(&key, &hash, "0", "0").await;
        let text = String::from_utf8_lossy(&zero_ttl.body);
        assert_eq!(zero_ttl.status, StatusCode::BAD_REQUEST, "{text}");
        assert!(text.contains(proto::HEADER_LOCK_TTL_MS) && text.contains("1..=3600000"), "{text}");

        // 0 takes a free lock, and answers busy at once when it is held.
        let locked = client.begin(&key, &hash, "0").await;
        assert_eq!((locked.status, locked.outcome()), (StatusCode::OK, "locked"));
        let started = Instant::now();
        let busy = client.begin(&key, &hash, "0").await;
        let took = started.elapsed();
        assert_eq!((busy.status, busy.outcome()), (StatusCode::OK, "busy"));
        assert!(took < Duration::from_millis(100), "busy after {took:?}");
        let remaining = busy.lock_remaining().unwrap();
        assert!(
            remaining >= Duration::from_millis(1) && remaining <= Duration::from_secs(30),
            "{remaining:?}"
        );
        // Leading zeros are still a number; the maximum is accepted (a free key: no wait).
        assert_eq!(client.begin(&key, &hash, "000").await.outcome(), "busy");
        assert_eq!(client.begin(&common::key(), &hash, &max).await.outcome(), "locked");
        assert_eq!(client.release(&key, &locked.token(), false).await.outcome(), "released");
    }
}

/// Bodies: none on `begin`/`release`, at most `max_body_bytes` on `commit`; neither stores
/// anything when refused. Oversized heads are refused by the codec.
#[tokio::test]
async fn size_limits() {
    let backend = MemoryBackend::new(1000);
    let addr = serve_with(backend.clone(), Options::new(1024)).await;
    let (key, hash) = (common::key(), common::hash('a'));
    for version in [Version::H1, Version::H2c] {
        let client = Client::new(addr, version).await;
        let begin = begin_headers(&key, &hash);
        let with_body = client.call("POST", proto::PATH_BEGIN, &begin, Bytes::from_static(b"x")).await;
        assert_eq!(with_body.status, StatusCode::PAYLOAD_TOO_LARGE);
        let release = [(proto::HEADER_KEY, key.as_str()), (proto::HEADER_TOKEN, "tok")];
        let with_body = client.call("POST", proto::PATH_RELEASE, &release, Bytes::from_static(b"x")).await;
        assert_eq!(with_body.status, StatusCode::PAYLOAD_TOO_LARGE);
        let big = client.commit(&key, "tok", &hash, Bytes::from(vec![b'x'; 1025])).await;
        assert_eq!(big.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert!(backend.is_empty(), "{}", backend.len());
    }

    // HTTP/1.1: a head past hyper's buffer (about 400 KiB) is refused with 431.
    let client = Client::new(addr, Version::H1).await;
    let huge = "h".repeat(512 * 1024);
    let reply = client.try_call("GET", proto::PATH_HEALTH, &[("x-huge", &huge)], Bytes::new()).await;
    assert_eq!(reply.unwrap().status, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    // h2c: past the advertised 16 KiB header list, 431 too.
    let client = Client::new(addr, Version::H2c).await;
    let large = "h".repeat(20 * 1024);
    let reply = client.call("GET", proto::PATH_HEALTH, &[("x-large", &large)], Bytes::new()).await;
    assert_eq!(reply.status, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    assert!(backend.is_empty());
}

/// `x-idem-deadline-ms` (optional, epoch milliseconds): a `begin` the store reaches past it is
/// `expired` and takes no lock, over both protocols; before it, it is served as usual; a wait is
/// cut at it; a malformed value is a `400` naming the header, before the backend.
#[tokio::test]
async fn a_begin_past_its_deadline_takes_no_lock() {
    let backend = MemoryBackend::new(1000);
    let addr = serve_with(backend.clone(), Options::new(1024)).await;
    let epoch_ms =
        || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    for version in [Version::H1, Version::H2c] {
        let client = Client::new(addr, version).await;
        let (key, hash) = (common::key(), common::hash('a'));
        let begin = |deadline: String, wait: &'static str| {
            let (client, key, hash) = (&client, key.clone(), hash.clone());
            async move {
                let headers = [
                    (proto::HEADER_KEY, key.as_str()),
                    (proto::HEADER_BODY_HASH, hash.as_str()),
                    (proto::HEADER_LOCK_TTL_MS, "30000"),
                    (proto::HEADER_WAIT_MS, wait),
                    (proto::HEADER_DEADLINE_MS, deadline.as_str()),
                ];
                client.call("POST", proto::PATH_BEGIN, &headers, Bytes::new()).await
            }
        };
        let keys = backend.len();
        for bad in ["", "-1", "0", "1.5", "soon"] {
            let reply = begin(bad.to_string(), "0").await;
            let text = String::from_utf8_lossy(&reply.body);
            assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{bad:?}: {text}");
            assert!(text.contains(proto::HEADER_DEADLINE_MS), "{text}");
        }
        let past = begin((epoch_ms() - 1).to_string(), "0").await;
        assert_eq!((past.status, past.outcome()), (StatusCode::OK, "expired"));
        assert_eq!(backend.len(), keys, "an expired begin reached the backend");

        // In time: locked as usual; a duplicate waiting on it stops at its own deadline.
        let locked = begin((epoch_ms() + 5_000).to_string(), "0").await;
        assert_eq!(locked.outcome(), "locked");
        let started = Instant::now();
        let waited = begin((epoch_ms() + 300).to_string(), "5000").await;
        let took = started.elapsed();
        assert_eq!(waited.outcome(), "expired");
        assert!(took >= Duration::from_millis(250) && took < Duration::from_secs(2), "{took:?}");
        // Without the header, nothing changes.
        assert_eq!(client.begin(&key, &hash, "0").await.outcome(), "busy");
        assert_eq!(client.release(&key, &locked.token(), false).await.outcome(), "released");
    }
}

/// `commits`: a malformed body (no items, a bad item anywhere, a record cut short, more than
/// 64 items), a missing, repeated or malformed retention, or a body over the limit is refused
/// as a whole (`400` naming what is wrong, or `413`) and commits nothing, not even its valid
/// items; 64 items are fine.
#[tokio::test]
async fn bad_batches_commit_nothing() {
    let backend = MemoryBackend::new(1000);
    let addr = serve_with(backend.clone(), Options::new(64 * 1024)).await;
    let (key, hash) = (common::key(), common::hash('a'));
    let valid: (&str, &str, &str, &[u8]) = (&key, "tok", &hash, b"rec\n\0");
    let upper = common::key().to_uppercase();
    let many: Vec<String> = (0..=proto::MAX_BATCH_ITEMS).map(|_| common::key()).collect();
    let items = |n: usize| -> Vec<(&str, &str, &str, &[u8])> {
        many[..n].iter().map(|k| (k.as_str(), "tok", hash.as_str(), &b"r"[..])).collect()
    };
    let cut = {
        let mut body = batch_body(&[valid]).to_vec();
        body.pop();
        Bytes::from(body)
    };
    let joined = |tail: &[u8]| Bytes::from([&batch_body(&[valid])[..], tail].concat());
    let bodies: Vec<(&str, Bytes, &str)> = vec![
        ("no items", Bytes::new(), "no items"),
        ("a bad key", batch_body(&[(&upper, "tok", &hash, b"r")]), "item 0"),
        ("a bad key after a good item", batch_body(&[valid, (&upper, "tok", &hash, b"r")]), "item 1"),
        ("a bad token", batch_body(&[valid, (&key, "a.b", &hash, b"r")]), "item 1: malformed token"),
        ("a bad hash", batch_body(&[valid, (&key, "tok", &hash[1..], b"r")]), "item 1"),
        ("an empty record", joined(format!("{key} tok {hash} 0\n").as_bytes()), "item 1: the record length"),
        ("a record cut short", cut, "item 0: cut short"),
        (
            "a second record cut short",
            joined(format!("{key} tok {hash} 5\nabc").as_bytes()),
            "item 1: cut short",
        ),
        ("no item line", joined(b"garbage"), "item 1: no item line"),
        ("65 items", batch_body(&items(proto::MAX_BATCH_ITEMS + 1)), "more than 64 items"),
    ];
    let retention_max = (proto::MAX_RETENTION_S + 1).to_string();
    for version in [Version::H1, Version::H2c] {
        let client = Client::new(addr, version).await;
        for (what, body, why) in &bodies {
            let reply = client.commits(body.clone()).await;
            let text = String::from_utf8_lossy(&reply.body);
            assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{what}: {text}");
            assert!(text.contains(why), "{what}: {text}");
            assert!(reply.outcome().is_empty(), "{what}");
        }
        let good = batch_body(&[valid]);
        let mut retentions: Vec<Vec<(&str, &str)>> =
            vec![vec![], vec![(proto::HEADER_RETENTION_S, "60"), (proto::HEADER_RETENTION_S, "60")]];
        for bad in ["", "0", "-1", "1.5", "abc", retention_max.as_str()] {
            retentions.push(vec![(proto::HEADER_RETENTION_S, bad)]);
        }
        for headers in &retentions {
            let reply = client.call("POST", proto::PATH_COMMITS, headers, good.clone()).await;
            let text = String::from_utf8_lossy(&reply.body);
            assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{headers:?}: {text}");
            assert!(text.contains(proto::HEADER_RETENTION_S), "{headers:?}: {text}");
        }
        let big = batch_body(&[valid, (&key, "tok", &hash, &vec![b'x'; 64 * 1024])]);
        assert_eq!(client.commits(big).await.status, StatusCode::PAYLOAD_TOO_LARGE);
        let get = client.call("GET", proto::PATH_COMMITS, &[], Bytes::new()).await;
        assert_eq!(get.status, StatusCode::METHOD_NOT_ALLOWED);
        assert!(backend.is_empty(), "a refused batch reached the backend: {} keys", backend.len());
    }
    // Nothing was stored for the key: it is free.
    let client = Client::new(addr, Version::H2c).await;
    assert_eq!(client.begin(&key, &hash, "0").await.outcome(), "locked");

    // The most items a batch may have: all committed (no lock: `late`), in order.
    let full = client.commits(batch_body(&items(proto::MAX_BATCH_ITEMS))).await;
    assert_eq!(full.batch(proto::MAX_BATCH_ITEMS), vec![Some(CommitOutcome::Late); proto::MAX_BATCH_ITEMS]);
    for k in &many[..proto::MAX_BATCH_ITEMS] {
        assert_eq!(&client.begin(k, &hash, "0").await.body[..], b"r");
    }
}

/// A backend whose commits each wait until `n` of them are under way at once (or fail after
/// 5 s): a batch of `n` succeeds only if its items are committed concurrently.
#[derive(Debug, Clone)]
struct Rendezvous {
    n: usize,
    started: Arc<std::sync::atomic::AtomicUsize>,
    all_in: Arc<tokio::sync::Notify>,
}

impl Backend for Rendezvous {
    async fn try_begin(
        &self,
        _: &str,
        _: &str,
        _: &str,
        _: Duration,
        _: Option<Hold<'_>>,
    ) -> idemstore::backend::Result<Attempt> {
        Ok(Attempt::Locked)
    }

    async fn commit(&self, _: Commit<'_>) -> idemstore::backend::Result<CommitOutcome> {
        let all_in = self.all_in.notified();
        if self.started.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1 >= self.n {
            self.all_in.notify_waiters();
            return Ok(CommitOutcome::Stored);
        }
        match tokio::time::timeout(Duration::from_secs(5), all_in).await {
            Ok(()) => Ok(CommitOutcome::Stored),
            Err(_) => Err(BackendError::Unavailable("alone".into())),
        }
    }

    async fn release(&self, _: &str, _: &str, _: bool) -> idemstore::backend::Result<ReleaseOutcome> {
        Ok(ReleaseOutcome::Released)
    }

    async fn health(&self) -> idemstore::backend::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn batch_items_are_committed_concurrently() {
    let n = 40;
    let backend = Rendezvous { n, started: Default::default(), all_in: Default::default() };
    let addr = serve_store(Arc::new(Store::new(backend)), Options::new(64 * 1024)).await;
    let client = Client::new(addr, Version::H2c).await;
    let (keys, hash): (Vec<String>, String) = ((0..n).map(|_| common::key()).collect(), common::hash('a'));
    let items: Vec<(&str, &str, &str, &[u8])> =
        keys.iter().map(|k| (k.as_str(), "tok", hash.as_str(), &b"r"[..])).collect();
    let started = Instant::now();
    let reply = client.commits(batch_body(&items)).await;
    assert_eq!(reply.batch(n), vec![Some(CommitOutcome::Stored); n]);
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
}

/// The operator's routes: behind the secret like the protocol (401 without it, or with another,
/// and nothing looked at or deleted), a store key or prefix validated (400), then the reports.
async fn admin_routes(version: Version) {
    use idemstore::admin::{CountsReport, DeleteReport, FindReport, KeyReport, PATH_COUNTS, PATH_RECORDS};
    let backend = MemoryBackend::new(1000);
    let guard = Arc::new(SecretCheck::new(Secret::new(SECRET).unwrap()));
    let options = Options { max_body_bytes: 1024, secret: Some(Arc::clone(&guard)) };
    let addr = serve_with(backend.clone(), options).await;
    let bare = Client::new(addr, version).await;
    let right = bare.with_secret(Some(SECRET));
    let (key, hash) = (common::key(), common::hash('a'));
    let record = common::filter_record(b"{\"id\":1}");
    assert_eq!(
        backend.commit(common::commit(&key, "t", &hash, record.clone())).await,
        Ok(CommitOutcome::Late)
    );
    let one = format!("{PATH_RECORDS}/{key}");
    let prefix = format!("{PATH_RECORDS}?prefix={}", &key[..12]);

    for client in [bare.clone(), bare.with_secret(Some("wrong")), bare.with_secret(Some(""))] {
        for (method, path) in
            [("GET", &one), ("DELETE", &one), ("GET", &prefix), ("GET", &PATH_COUNTS.to_owned())]
        {
            let reply = client.call(method, path, &[], Bytes::new()).await;
            assert_eq!(
                (reply.status, &reply.body[..]),
                (StatusCode::UNAUTHORIZED, &b"missing or wrong x-idem-secret"[..])
            );
        }
    }
    assert_eq!(guard.refused(), 12);
    assert_eq!(backend.len(), 1, "nothing deleted without the secret");

    let json = |reply: common::client::Reply| {
        assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
        assert_eq!(reply.headers["content-type"], "application/json");
        reply.body
    };
    let report: KeyReport =
        serde_json::from_slice(&json(right.call("GET", &one, &[], Bytes::new()).await)).unwrap();
    assert_eq!(report.store_key, key);
    let r = report.record.unwrap();
    assert_eq!((r.status, r.bytes, r.body_hash.as_str()), (Some(201), record.len(), hash.as_str()));
    assert!(r.ttl_ms.is_some_and(|ms| ms > 86_000_000));
    assert_eq!(report.lock, None);
    let found: FindReport =
        serde_json::from_slice(&json(right.call("GET", &prefix, &[], Bytes::new()).await)).unwrap();
    assert_eq!((found.store_keys, found.truncated), (vec![key.clone()], false));
    let counts: CountsReport =
        serde_json::from_slice(&json(right.call("GET", PATH_COUNTS, &[], Bytes::new()).await)).unwrap();
    assert_eq!(counts, CountsReport { records: 1, locks: 0, in_doubt: 0 });

    // Malformed store keys and prefixes: 400, before the backend.
    for bad in [&key[..63], &key.to_uppercase(), &format!("{}g", &key[..63]), &format!("{key}0"), "x"] {
        for method in ["GET", "DELETE"] {
            let reply = right.call(method, &format!("{PATH_RECORDS}/{bad}"), &[], Bytes::new()).await;
            assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{method} {bad}");
            assert!(String::from_utf8_lossy(&reply.body).contains("64 lowercase hex"));
        }
    }
    for bad in
        ["", "?prefix=", "?prefix=0123abc", "?prefix=0123ABCD", "?other=0123abcd", "?prefix=0123abcd&x=1"]
    {
        let reply = right.call("GET", &format!("{PATH_RECORDS}{bad}"), &[], Bytes::new()).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{bad}");
    }
    assert_eq!(backend.len(), 1);

    let deleted: DeleteReport =
        serde_json::from_slice(&json(right.call("DELETE", &one, &[], Bytes::new()).await)).unwrap();
    assert!(deleted.deleted_record && !deleted.deleted_lock);
    assert_eq!(deleted.record.and_then(|r| r.status), Some(201));
    assert!(backend.is_empty());
    let again: DeleteReport =
        serde_json::from_slice(&json(right.call("DELETE", &one, &[], Bytes::new()).await)).unwrap();
    assert!(!again.deleted_anything() && again.record.is_none());
    // The protocol still works as it did: the key is free, the next begin takes its lock.
    assert_eq!(right.begin(&key, &hash, "0").await.outcome(), "locked");
    assert_eq!(guard.refused(), 12);
}

#[tokio::test]
async fn admin_routes_http1() {
    admin_routes(Version::H1).await;
}

#[tokio::test]
async fn admin_routes_h2c() {
    admin_routes(Version::H2c).await;
}

/// `idemstore records --url` against a running idemstore with a secret: refused (and nothing
/// deleted) without it or with another, found and deleted with it, from a file or the
/// environment.
#[tokio::test]
async fn records_command_over_http() {
    use clap::Parser;
    use idemstore::tools::{execute, Records};

    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        records: Records,
    }
    let backend = MemoryBackend::new(1000);
    let options = Options::new(1024).with_secret(Secret::new(SECRET).unwrap());
    let addr = serve_with(backend.clone(), options).await;
    let key = idem_protocol::store_key("anon:127.0.0.1", "POST", "orders", "k-1");
    let record = common::filter_record(b"{}");
    assert_eq!(
        backend.commit(common::commit(&key, "t", &common::hash('a'), record)).await,
        Ok(CommitOutcome::Late)
    );
    let dir = std::env::temp_dir().join(format!("idemstore-records-{}", common::key()));
    std::fs::create_dir_all(&dir).unwrap();
    let (right_file, wrong_file) = (dir.join("right"), dir.join("wrong"));
    std::fs::write(&right_file, format!("{SECRET}\n")).unwrap();
    std::fs::write(&wrong_file, "not-the-secret\n").unwrap();
    let url = format!("http://{addr}");
    let request = ["--subject", "anon:127.0.0.1", "--method", "POST", "--route", "orders", "--key", "k-1"];
    let args = |command: &str, extra: &[&str]| -> Vec<String> {
        let mut args = vec!["records".to_owned(), command.to_owned(), "--url".to_owned(), url.clone()];
        args.extend(request.iter().chain(extra).map(|s| (*s).to_owned()));
        args
    };
    let env_secret = |name: &str| (name == "IDEMSTORE_SECRET").then(|| SECRET.to_owned());
    let wrong = wrong_file.to_str().unwrap();

    for (command, extra) in
        [("delete", &[][..]), ("delete", &["--secret-file", wrong][..]), ("lookup", &[][..])]
    {
        let e = execute(&Cli::parse_from(args(command, extra)).records, |_| None).await.unwrap_err();
        assert!(e.contains("idemstore refused the secret (401)"), "{e}");
        assert!(!e.contains(SECRET));
    }
    assert_eq!(backend.len(), 1, "nothing deleted");

    let found = execute(&Cli::parse_from(args("lookup", &[])).records, env_secret).await.unwrap();
    assert!(found.found && found.text.contains("record     status 201"), "{}", found.text);
    let right = right_file.to_str().unwrap();
    let by_prefix = Cli::parse_from([
        "records",
        "lookup",
        "--url",
        &url,
        "--secret-file",
        right,
        "--store-key",
        &key[..12],
    ]);
    let found = execute(&by_prefix.records, |_| None).await.unwrap();
    assert!(found.found && found.text.contains(&key), "{}", found.text);
    let deleted =
        execute(&Cli::parse_from(args("delete", &["--secret-file", right])).records, |_| None).await.unwrap();
    assert!(deleted.found && deleted.text.ends_with("deleted record\n"), "{}", deleted.text);
    assert!(backend.is_empty());
    let again =
        execute(&Cli::parse_from(args("delete", &["--secret-file", right])).records, |_| None).await.unwrap();
    assert!(!again.found && again.text.contains("nothing deleted"), "{}", again.text);
    let counts =
        execute(&Cli::parse_from(["records", "count", "--url", &url]).records, env_secret).await.unwrap();
    assert_eq!(counts.text, "records   0\nlocks     0\nin doubt  0\n");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Attempts whose outcome is unknown, over HTTP: `x-idem-hold` leaves a trace, an in-doubt
/// release (`x-idem-in-doubt: 1`) keeps it, the next `begin` with a hold answers `in-doubt`
/// with the first attempt's token, start and running time; a wrong supersede changes nothing,
/// the right one locks again; the attempt's plain release clears the trace.
async fn in_doubt_flow(version: Version) {
    let backend = MemoryBackend::new(1000);
    let addr = serve_with(backend.clone(), Options::new(1024)).await;
    let client = Client::new(addr, version).await;
    let (key, hash) = (common::key(), common::hash('a'));
    let before = idemstore::backend::now_ms();
    let locked = client.begin_hold(&key, &hash, "30000", "60", None).await;
    assert_eq!(locked.outcome(), "locked");
    let first = locked.token();
    assert_eq!(client.release(&key, &first, true).await.outcome(), "released");

    let doubt = client.begin_hold(&key, &hash, "30000", "60", None).await;
    assert_eq!((doubt.status, doubt.outcome(), &doubt.body[..]), (StatusCode::OK, "in-doubt", &b""[..]));
    assert_eq!(doubt.token(), first);
    let number = |name: &str| -> u64 { doubt.headers[name].to_str().unwrap().parse().unwrap() };
    let started = number(proto::HEADER_STARTED_MS);
    assert!(started >= before && started <= idemstore::backend::now_ms(), "{started}");
    let running = number(proto::HEADER_RUNNING_MS);
    assert!(running > 29_000 && running <= 30_000, "{running}");
    assert!(doubt.lock_remaining().is_none());
    // Another body: mismatch. Without a hold: the trace is not read, the key locks.
    let other = client.begin_hold(&key, &common::hash('b'), "30000", "60", None).await;
    assert_eq!(other.outcome(), "mismatch");

    let wrong = client.begin_hold(&key, &hash, "30000", "60", Some("not-the-token")).await;
    assert_eq!((wrong.outcome(), wrong.token()), ("in-doubt", first.clone()));
    let again = client.begin_hold(&key, &hash, "30000", "60", Some(&first)).await;
    assert_eq!(again.outcome(), "locked");
    let second = again.token();
    assert_ne!(second, first);
    assert_eq!(client.release(&key, &second, false).await.outcome(), "released");
    assert!(backend.is_empty(), "a plain release leaves no trace");
    assert_eq!(client.begin(&key, &hash, "0").await.outcome(), "locked");
}

#[tokio::test]
async fn in_doubt_over_http1() {
    in_doubt_flow(Version::H1).await;
}

#[tokio::test]
async fn in_doubt_over_h2c() {
    in_doubt_flow(Version::H2c).await;
}

/// `x-idem-hold` and `x-idem-in-doubt` are `0` or `1`, at most once; with `x-idem-hold: 1`,
/// `x-idem-retention-s` is required (1 to the maximum) and `x-idem-supersede`, if given, a
/// token; a supersede without a hold is refused. Each a `400` naming the header, before the
/// backend.
#[tokio::test]
async fn hold_and_in_doubt_headers_are_validated() {
    let backend = MemoryBackend::new(1000);
    let addr = serve_with(backend.clone(), Options::new(1024)).await;
    let client = Client::new(addr, Version::H2c).await;
    let (key, hash) = (common::key(), common::hash('a'));
    let base = begin_headers(&key, &hash);
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut headers = base.clone();
        headers.extend_from_slice(extra);
        headers
    };
    let retention_max = Box::leak((proto::MAX_RETENTION_S + 1).to_string().into_boxed_str());
    let long_token = Box::leak("t".repeat(proto::MAX_TOKEN_LEN + 1).into_boxed_str());
    let (hold, retention, supersede) =
        (proto::HEADER_HOLD, proto::HEADER_RETENTION_S, proto::HEADER_SUPERSEDE);
    let cases: Vec<(&str, Vec<(&str, &str)>)> = vec![
        (hold, with(&[(hold, "")])),
        (hold, with(&[(hold, "2")])),
        (hold, with(&[(hold, "true")])),
        (hold, with(&[(hold, " 1")])),
        (hold, with(&[(hold, "01")])),
        (hold, with(&[(hold, "1"), (hold, "1"), (retention, "60")])),
        (retention, with(&[(hold, "1")])),
        (retention, with(&[(hold, "1"), (retention, "0")])),
        (retention, with(&[(hold, "1"), (retention, retention_max)])),
        (retention, with(&[(hold, "1"), (retention, "x")])),
        (retention, with(&[(hold, "1"), (retention, "60"), (retention, "60")])),
        (supersede, with(&[(hold, "1"), (retention, "60"), (supersede, "")])),
        (supersede, with(&[(hold, "1"), (retention, "60"), (supersede, "a b")])),
        (supersede, with(&[(hold, "1"), (retention, "60"), (supersede, long_token)])),
        (supersede, with(&[(hold, "1"), (retention, "60"), (supersede, "t"), (supersede, "t")])),
        (supersede, with(&[(supersede, "tok")])),
        (supersede, with(&[(hold, "0"), (supersede, "tok")])),
    ];
    for (field, headers) in &cases {
        let reply = client.call("POST", proto::PATH_BEGIN, headers, Bytes::new()).await;
        let text = String::from_utf8_lossy(&reply.body);
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{headers:?}: {text}");
        assert!(text.contains(field), "{headers:?}: the answer must name {field}: {text}");
    }
    let release = |value: &'static str| {
        vec![(proto::HEADER_KEY, key.as_str()), (proto::HEADER_TOKEN, "tok"), (proto::HEADER_IN_DOUBT, value)]
    };
    for bad in ["", "2", "yes", "1 "] {
        let reply = client.call("POST", proto::PATH_RELEASE, &release(bad), Bytes::new()).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{bad:?}");
        assert!(String::from_utf8_lossy(&reply.body).contains(proto::HEADER_IN_DOUBT));
    }
    let mut twice = release("1");
    twice.push((proto::HEADER_IN_DOUBT, "1"));
    assert_eq!(
        client.call("POST", proto::PATH_RELEASE, &twice, Bytes::new()).await.status,
        StatusCode::BAD_REQUEST
    );
    assert!(backend.is_empty(), "an invalid request reached the backend");

    // The control: hold 0 (retention not read), hold 1 with a retention, in-doubt 0 and 1.
    let plain =
        client.call("POST", proto::PATH_BEGIN, &with(&[(hold, "0"), (retention, "x")]), Bytes::new()).await;
    assert_eq!(plain.outcome(), "locked");
    assert_eq!(
        client.call("POST", proto::PATH_RELEASE, &release("0"), Bytes::new()).await.outcome(),
        "not-owner"
    );
    let other = common::key();
    let headers = [
        (proto::HEADER_KEY, other.as_str()),
        (proto::HEADER_BODY_HASH, hash.as_str()),
        (proto::HEADER_LOCK_TTL_MS, "30000"),
        (proto::HEADER_WAIT_MS, "0"),
        (hold, "1"),
        (retention, "604800"),
        (supersede, "some-token_1"),
    ];
    let held = client.call("POST", proto::PATH_BEGIN, &headers, Bytes::new()).await;
    assert_eq!(held.outcome(), "locked");
    let token = held.token();
    let release_in_doubt = [
        (proto::HEADER_KEY, other.as_str()),
        (proto::HEADER_TOKEN, token.as_str()),
        (proto::HEADER_IN_DOUBT, "1"),
    ];
    assert_eq!(
        client.call("POST", proto::PATH_RELEASE, &release_in_doubt, Bytes::new()).await.outcome(),
        "released"
    );
}

/// `POST /v1/admin/records/<key>/resolve`: behind the secret, a store key and a record the
/// filter can replay (else `400`, nothing done); commits for a key in doubt, reports anything
/// else as it is.
#[tokio::test]
async fn resolve_route() {
    use idemstore::admin::{ResolveReport, PATH_RECORDS, RESOLVE};
    use idemstore::backend::Hold;
    let backend = MemoryBackend::new(1000);
    let options = Options::new(1024).with_secret(Secret::new(SECRET).unwrap());
    let addr = serve_with(backend.clone(), options).await;
    let bare = Client::new(addr, Version::H1).await;
    let right = bare.with_secret(Some(SECRET));
    let (key, hash) = (common::key(), common::hash('a'));
    let hold = Some(Hold { retention: Duration::from_secs(60), supersede: None });
    assert_eq!(backend.try_begin(&key, &hash, "t1", common::TTL, hold).await, Ok(Attempt::Locked));
    let path = format!("{PATH_RECORDS}/{key}/{RESOLVE}");
    let record = Bytes::from(idemstore::answer::encode(201, &[], b"{\"id\":1}").unwrap());

    let refused = bare.call("POST", &path, &[], record.clone()).await;
    assert_eq!(refused.status, StatusCode::UNAUTHORIZED);
    for bad in [&b""[..], b"IDR2\x00\xc9\x04\x00\x00", b"not a record", b"IDR2\x00\x64\x00\x00\x00"] {
        let reply = right.call("POST", &path, &[], Bytes::from_static(bad)).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{bad:?}");
        assert!(String::from_utf8_lossy(&reply.body).contains("record"), "{bad:?}");
    }
    let bad_key = format!("{PATH_RECORDS}/{}/{RESOLVE}", key.to_uppercase());
    assert_eq!(right.call("POST", &bad_key, &[], record.clone()).await.status, StatusCode::BAD_REQUEST);
    let big = right.call("POST", &path, &[], Bytes::from(vec![b'x'; 2048])).await;
    assert_eq!(big.status, StatusCode::PAYLOAD_TOO_LARGE);

    // Running (a lock): not resolved.
    let reply = right.call("POST", &path, &[], record.clone()).await;
    let report: ResolveReport = serde_json::from_slice(&reply.body).unwrap();
    assert!(!report.resolved && report.before.lock.is_some() && report.committed.is_none(), "{report:?}");
    // In doubt: resolved, the record replays under the first attempt's body hash.
    assert_eq!(backend.release(&key, "t1", true).await, Ok(ReleaseOutcome::Released));
    let reply = right.call("POST", &path, &[], record.clone()).await;
    let report: ResolveReport = serde_json::from_slice(&reply.body).unwrap();
    assert!(report.resolved && report.before.in_doubt, "{report:?}");
    assert_eq!((report.committed.as_deref(), report.status, report.bytes), (Some("late"), 201, record.len()));
    let retention = report.retention_ms.unwrap();
    assert!(retention > 55_000 && retention <= 60_000, "the trace's remaining lifetime: {retention}");
    match backend.try_begin(&key, &hash, "t2", common::TTL, hold).await.unwrap() {
        Attempt::Record(bytes, _) => assert_eq!(bytes, record),
        other => panic!("expected the record, got {other:?}"),
    }
    // Now a record: not resolved again.
    let reply = right.call("POST", &path, &[], record).await;
    let report: ResolveReport = serde_json::from_slice(&reply.body).unwrap();
    assert!(!report.resolved && report.before.record.is_some());
}

/// `idemstore records resolve --url`: the record goes to the admin route in the body; a key in
/// doubt is resolved (exit 0), then is not (exit 1); `lookup` and `count` show it in doubt.
#[tokio::test]
async fn resolve_command_over_http() {
    use clap::Parser;
    use idemstore::backend::Hold;
    use idemstore::tools::{execute, Records};

    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        records: Records,
    }
    let backend = MemoryBackend::new(1000);
    let options = Options::new(4096).with_secret(Secret::new(SECRET).unwrap());
    let addr = serve_with(backend.clone(), options).await;
    let key = idem_protocol::store_key("id:bob", "PUT", "orders", "k-8");
    let hash = common::hash('a');
    let hold = Some(Hold { retention: Duration::from_secs(600), supersede: None });
    assert_eq!(backend.try_begin(&key, &hash, "t1", common::TTL, hold).await, Ok(Attempt::Locked));
    assert_eq!(backend.release(&key, "t1", true).await, Ok(ReleaseOutcome::Released));
    let url = format!("http://{addr}");
    let env_secret = |name: &str| (name == "IDEMSTORE_SECRET").then(|| SECRET.to_owned());
    let run = |args: &[&str]| {
        let mut all = vec!["records", args[0], "--url", &url, "--store-key", &key];
        all.extend_from_slice(&args[1..]);
        Cli::parse_from(all).records
    };

    let lookup = execute(&run(&["lookup"]), env_secret).await.unwrap();
    assert!(lookup.found && lookup.text.contains("IN DOUBT"), "{}", lookup.text);
    let counts =
        execute(&Cli::parse_from(["records", "count", "--url", &url]).records, env_secret).await.unwrap();
    assert_eq!(counts.text, "records   0\nlocks     0\nin doubt  1\n");

    let resolved = execute(
        &run(&["resolve", "--status", "409", "--header", "content-type: application/problem+json"]),
        env_secret,
    )
    .await
    .unwrap();
    assert!(resolved.found && resolved.text.contains("resolved: committed status 409"), "{}", resolved.text);
    match backend.try_begin(&key, &hash, "t2", common::TTL, hold).await.unwrap() {
        Attempt::Record(bytes, _) => assert_eq!(idemstore::backend::record_status(&bytes), Some(409)),
        other => panic!("expected the record, got {other:?}"),
    }
    let again = execute(&run(&["resolve", "--status", "200"]), env_secret).await.unwrap();
    assert!(!again.found && again.text.contains("not in doubt: the key holds a record"), "{}", again.text);
    // Without the secret: refused, nothing done.
    let e = execute(&run(&["resolve", "--status", "200"]), |_| None).await.unwrap_err();
    assert!(e.contains("(401)"), "{e}");
}
