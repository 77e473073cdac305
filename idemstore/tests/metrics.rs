//! `GET /metrics` over real sockets: exact counts after known traffic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::client::{batch_body, serve_store, serve_with, Client, Version};
use hyper::StatusCode;
use idem_protocol as proto;
use idemstore::backend::memory::{MemoryBackend, ENTRY_COST};
use idemstore::backend::{
    Attempt, Backend, BackendError, Commit, CommitOutcome, Hold, ReleaseOutcome, Result,
};
use idemstore::http::{Options, SecretCheck, PATH_METRICS};
use idemstore::secret::Secret;
use idemstore::store::Store;

/// One scrape: series (name and sorted labels) to value. The format is simple enough to
/// parse by hand: `name{k="v",...} value` lines, `#` comments.
#[derive(Debug)]
struct Scrape(BTreeMap<(String, Vec<(String, String)>), f64>);

impl Scrape {
    fn parse(text: &str) -> Self {
        let mut series = BTreeMap::new();
        for line in text.lines().filter(|l| !l.is_empty() && !l.starts_with('#')) {
            let (name_labels, value) = line.rsplit_once(' ').unwrap();
            let value: f64 = match value {
                "+Inf" => f64::INFINITY,
                v => v.parse().unwrap_or_else(|e| panic!("{line:?}: {e}")),
            };
            let (name, labels) = match name_labels.split_once('{') {
                None => (name_labels, Vec::new()),
                Some((name, rest)) => {
                    let inner = rest.strip_suffix('}').unwrap();
                    let mut labels: Vec<(String, String)> = inner
                        .split(',')
                        .map(|pair| {
                            let (k, v) = pair.split_once('=').unwrap();
                            (k.to_owned(), v.trim_matches('"').to_owned())
                        })
                        .collect();
                    labels.sort();
                    (name, labels)
                }
            };
            let old = series.insert((name.to_owned(), labels), value);
            assert!(old.is_none(), "duplicate series {line:?}");
        }
        Self(series)
    }

    /// The value of one series; it must exist.
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let mut labels: Vec<(String, String)> =
            labels.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        labels.sort();
        *self
            .0
            .get(&(name.to_owned(), labels.clone()))
            .unwrap_or_else(|| panic!("no {name}{labels:?} in {self:#?}"))
    }

    fn requests(&self, op: &str, outcome: &str) -> f64 {
        self.get("idemstore_requests_total", &[("op", op), ("outcome", outcome)])
    }

    /// Every series of `name` with its labels.
    fn all(&self, name: &str) -> Vec<(&[(String, String)], f64)> {
        self.0.iter().filter(|((n, _), _)| n == name).map(|((_, l), v)| (l.as_slice(), *v)).collect()
    }

    /// The sum of `idemstore_requests_total` over the outcomes of `op`.
    fn requests_of(&self, op: &str) -> f64 {
        self.all("idemstore_requests_total")
            .iter()
            .filter(|(labels, _)| labels.iter().any(|(k, v)| k == "op" && v == op))
            .map(|(_, v)| v)
            .sum()
    }

    fn has(&self, name: &str) -> bool {
        self.0.keys().any(|(n, _)| n == name)
    }

    /// Checks a histogram's shape (`_bucket`s non-decreasing, `+Inf` equal to `_count`) and
    /// returns its `_count`.
    fn histogram_count(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let count = self.get(&format!("{name}_count"), labels);
        let mut buckets: Vec<(f64, f64)> = self
            .all(&format!("{name}_bucket"))
            .into_iter()
            .filter(|(l, _)| labels.iter().all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v)))
            .map(|(l, v)| {
                let le = &l.iter().find(|(k, _)| k == "le").unwrap().1;
                (if le == "+Inf" { f64::INFINITY } else { le.parse().unwrap() }, v)
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        assert_eq!(buckets.len(), idemstore::metrics::BUCKETS.len() + 1, "{name}{labels:?}");
        assert!(buckets.windows(2).all(|w| w[0].1 <= w[1].1), "{name}{labels:?}: {buckets:?}");
        assert_eq!(buckets.last().unwrap(), &(f64::INFINITY, count), "{name}{labels:?}");
        count
    }
}

async fn scrape_with(client: &Client) -> Scrape {
    let reply = client.call("GET", PATH_METRICS, &[], Bytes::new()).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    assert_eq!(reply.headers[hyper::header::CONTENT_TYPE], "text/plain; version=0.0.4; charset=utf-8");
    Scrape::parse(std::str::from_utf8(&reply.body).unwrap())
}

async fn scrape(addr: SocketAddr) -> Scrape {
    scrape_with(&Client::new(addr, Version::H1).await).await
}

const OUTCOMES: [(&str, &[&str]); 3] = [
    ("begin", &["locked", "record", "mismatch", "busy", "expired", "in-doubt", "error", "cancelled"]),
    ("commit", &["stored", "late", "exists", "error", "cancelled"]),
    ("release", &["released", "not-owner", "error", "cancelled"]),
];

/// Every operation's outcomes, refusals of each kind, then exact counts and consistent
/// histograms.
async fn counts_each_operation(version: Version) {
    let backend = MemoryBackend::new(1000);
    let addr = serve_with(backend.clone(), Options::new(1024)).await;
    let client = Client::new(addr, version).await;

    // Every series exists from the start, at zero.
    let before = scrape_with(&client).await;
    for (op, outcomes) in OUTCOMES {
        for outcome in outcomes {
            assert_eq!(before.requests(op, outcome), 0.0, "{op} {outcome}");
        }
        assert_eq!(before.histogram_count("idemstore_request_duration_seconds", &[("op", op)]), 0.0);
    }
    assert_eq!(before.all("idemstore_requests_total").len(), 17);
    assert_eq!(before.get("idemstore_in_doubt_releases_total", &[]), 0.0);

    let (key, hash, other_hash) = (common::key(), common::hash('a'), common::hash('b'));
    let locked = client.begin(&key, &hash, "5000").await;
    assert_eq!(locked.outcome(), "locked");
    let token = locked.token();
    assert_eq!(client.commit(&key, &token, &hash, Bytes::from_static(b"rec")).await.outcome(), "stored");
    assert_eq!(client.begin(&key, &hash, "5000").await.outcome(), "record");
    assert_eq!(client.begin(&key, &other_hash, "5000").await.outcome(), "mismatch");
    assert_eq!(client.commit(&key, &token, &hash, Bytes::from_static(b"again")).await.outcome(), "exists");
    assert_eq!(client.release(&key, &token, false).await.outcome(), "not-owner");

    let held = common::key();
    let holder = client.begin(&held, &hash, "5000").await.token();
    let waited = Instant::now();
    assert_eq!(client.begin(&held, &hash, "100").await.outcome(), "busy");
    let waited = waited.elapsed();
    assert_eq!(client.release(&held, &holder, false).await.outcome(), "released");
    assert_eq!(
        client.commit(&common::key(), "nolock", &hash, Bytes::from_static(b"x")).await.outcome(),
        "late"
    );
    // An attempt sent and never answered: its release keeps the trace, a retry is in doubt.
    let doubt = common::key();
    let first = client.begin_hold(&doubt, &hash, "30000", "60", None).await.token();
    assert_eq!(client.release(&doubt, &first, true).await.outcome(), "released");
    assert_eq!(client.begin_hold(&doubt, &hash, "30000", "60", None).await.outcome(), "in-doubt");

    // Refused before the backend: 3 invalid, 2 too large. Routing misses count nowhere.
    let missing_key = [(proto::HEADER_BODY_HASH, hash.as_str()), (proto::HEADER_WAIT_MS, "1")];
    let reply = client.call("POST", proto::PATH_BEGIN, &missing_key, Bytes::new()).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert_eq!(client.commit(&key, &token, &hash, Bytes::new()).await.status, StatusCode::BAD_REQUEST);
    assert_eq!(client.release(&key, "not a token", false).await.status, StatusCode::BAD_REQUEST);
    let big = client.commit(&key, &token, &hash, Bytes::from(vec![b'x'; 1025])).await;
    assert_eq!(big.status, StatusCode::PAYLOAD_TOO_LARGE);
    let begin = [
        (proto::HEADER_KEY, key.as_str()),
        (proto::HEADER_BODY_HASH, hash.as_str()),
        (proto::HEADER_LOCK_TTL_MS, "1000"),
        (proto::HEADER_WAIT_MS, "1"),
    ];
    let with_body = client.call("POST", proto::PATH_BEGIN, &begin, Bytes::from_static(b"x")).await;
    assert_eq!(with_body.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(client.call("POST", "/v1/nope", &[], Bytes::new()).await.status, StatusCode::NOT_FOUND);
    assert_eq!(
        client.call("GET", proto::PATH_BEGIN, &[], Bytes::new()).await.status,
        StatusCode::METHOD_NOT_ALLOWED
    );
    assert_eq!(client.call("GET", proto::PATH_HEALTH, &[], Bytes::new()).await.status, StatusCode::OK);

    let after = scrape_with(&client).await;
    let expected: [(&str, &str, f64); 16] = [
        ("begin", "locked", 3.0),
        ("begin", "record", 1.0),
        ("begin", "mismatch", 1.0),
        ("begin", "busy", 1.0),
        ("begin", "in-doubt", 1.0),
        ("begin", "error", 0.0),
        ("begin", "cancelled", 0.0),
        ("commit", "stored", 1.0),
        ("commit", "late", 1.0),
        ("commit", "exists", 1.0),
        ("commit", "error", 0.0),
        ("commit", "cancelled", 0.0),
        ("release", "released", 2.0),
        ("release", "not-owner", 1.0),
        ("release", "error", 0.0),
        ("release", "cancelled", 0.0),
    ];
    for (op, outcome, n) in expected {
        assert_eq!(after.requests(op, outcome), n, "{op} {outcome}");
    }
    // Each answered operation observed exactly once in its duration histogram.
    assert_eq!(after.get("idemstore_in_doubt_releases_total", &[]), 1.0);
    for (op, n) in [("begin", 7.0), ("commit", 3.0), ("release", 3.0)] {
        assert_eq!(after.requests_of(op), n, "{op}");
        assert_eq!(after.histogram_count("idemstore_request_duration_seconds", &[("op", op)]), n, "{op}");
    }
    // The busy begin waited its 100 ms; nothing else waited.
    assert_eq!(after.histogram_count("idemstore_begin_wait_seconds", &[]), 1.0);
    let wait = after.get("idemstore_begin_wait_seconds_sum", &[]);
    assert!((0.09..=waited.as_secs_f64()).contains(&wait), "{wait} (the call took {waited:?})");
    let begin_time = after.get("idemstore_request_duration_seconds_sum", &[("op", "begin")]);
    assert!(begin_time >= wait, "{begin_time} < {wait}");
    assert_eq!(after.get("idemstore_waiters", &[]), 0.0);

    for (reason, n) in [("secret", 0.0), ("invalid", 3.0), ("too_large", 2.0)] {
        assert_eq!(after.get("idemstore_rejected_total", &[("reason", reason)]), n, "{reason}");
    }
    for (op, _) in OUTCOMES {
        for reason in ["unavailable", "full"] {
            assert_eq!(after.get("idemstore_backend_errors_total", &[("op", op), ("reason", reason)]), 0.0);
        }
    }
    assert_eq!(after.get("idemstore_backend_up", &[]), 1.0);
    assert_eq!(after.get("idemstore_memory_keys", &[]), backend.len() as f64);
    assert_eq!(after.get("idemstore_memory_bytes", &[]), backend.accounted_bytes() as f64);
    assert_eq!(after.get("idemstore_memory_max_keys", &[]), 1000.0);
    assert!(after.get("idemstore_memory_max_bytes", &[]) > 0.0);
    assert!(backend.len() >= 2, "the two records are kept");

    // Scraping changes no count.
    let again = scrape(addr).await;
    for (op, outcome, n) in expected {
        assert_eq!(again.requests(op, outcome), n, "{op} {outcome}");
    }
}

#[tokio::test]
async fn counts_each_operation_http1() {
    counts_each_operation(Version::H1).await;
}

#[tokio::test]
async fn counts_each_operation_h2c() {
    counts_each_operation(Version::H2c).await;
}

const SECRET: &str = "metrics-secret";

/// `/metrics` needs no secret (and ignores a wrong one); refusals for the secret are counted.
#[tokio::test]
async fn metrics_need_no_secret_and_count_refusals() {
    let check = Arc::new(SecretCheck::new(Secret::new(SECRET).unwrap()));
    let options = Options { max_body_bytes: 1024, secret: Some(Arc::clone(&check)) };
    let addr = serve_with(MemoryBackend::new(1000), options).await;
    let bare = Client::new(addr, Version::H2c).await;
    let right = bare.with_secret(Some(SECRET));
    let (key, hash) = (common::key(), common::hash('a'));

    assert_eq!(bare.begin(&key, &hash, "1").await.status, StatusCode::UNAUTHORIZED);
    let wrong = bare.with_secret(Some("wrong"));
    assert_eq!(wrong.release(&key, "tok", false).await.status, StatusCode::UNAUTHORIZED);
    assert_eq!(bare.call("GET", "/v1/nope", &[], Bytes::new()).await.status, StatusCode::UNAUTHORIZED);
    assert_eq!(right.begin(&key, &hash, "1").await.outcome(), "locked");

    for client in [&bare, &wrong, &right] {
        let scrape = scrape_with(client).await;
        assert_eq!(scrape.get("idemstore_rejected_total", &[("reason", "secret")]), 3.0);
        assert_eq!(scrape.requests("begin", "locked"), 1.0);
        assert_eq!(scrape.requests_of("release"), 0.0);
    }
    assert_eq!(check.refused(), 3);
}

/// A backend that fails every call, as Redis down would.
#[derive(Debug, Clone)]
struct Down;

impl Backend for Down {
    async fn try_begin(
        &self,
        _: &str,
        _: &str,
        _: &str,
        _: Duration,
        _: Option<Hold<'_>>,
    ) -> Result<Attempt> {
        Err(BackendError::Unavailable("down".into()))
    }

    async fn commit(&self, _: Commit<'_>) -> Result<CommitOutcome> {
        Err(BackendError::Unavailable("down".into()))
    }

    async fn release(&self, _: &str, _: &str, _: bool) -> Result<ReleaseOutcome> {
        Err(BackendError::Unavailable("down".into()))
    }

    async fn health(&self) -> Result<()> {
        Err(BackendError::Unavailable("down".into()))
    }
}

#[tokio::test]
async fn backend_failures_are_errors_by_reason() {
    let addr = serve_store(Arc::new(Store::new(Down)), Options::new(1024)).await;
    let client = Client::new(addr, Version::H2c).await;
    let (key, hash) = (common::key(), common::hash('a'));
    assert_eq!(client.begin(&key, &hash, "1").await.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(client.begin(&key, &hash, "1").await.status, StatusCode::SERVICE_UNAVAILABLE);
    let commit = client.commit(&key, "tok", &hash, Bytes::from_static(b"rec")).await;
    assert_eq!(commit.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(client.release(&key, "tok", false).await.status, StatusCode::SERVICE_UNAVAILABLE);

    let scrape = scrape_with(&client).await;
    for (op, n) in [("begin", 2.0), ("commit", 1.0), ("release", 1.0)] {
        assert_eq!(scrape.requests(op, "error"), n, "{op}");
        assert_eq!(scrape.requests_of(op), n, "{op}");
        assert_eq!(scrape.get("idemstore_backend_errors_total", &[("op", op), ("reason", "unavailable")]), n);
        assert_eq!(scrape.get("idemstore_backend_errors_total", &[("op", op), ("reason", "full")]), 0.0);
        assert_eq!(scrape.histogram_count("idemstore_request_duration_seconds", &[("op", op)]), n);
    }
    assert_eq!(scrape.get("idemstore_backend_up", &[]), 0.0);
    assert!(!scrape.has("idemstore_memory_keys"), "no in-memory gauges for another backend");

    // The in-memory backend at its key limit: `full`.
    let addr = serve_with(MemoryBackend::new(1), Options::new(1024)).await;
    let client = Client::new(addr, Version::H2c).await;
    assert_eq!(client.begin(&common::key(), &hash, "1").await.outcome(), "locked");
    assert_eq!(client.begin(&common::key(), &hash, "1").await.status, StatusCode::SERVICE_UNAVAILABLE);
    let scrape = scrape_with(&client).await;
    assert_eq!(scrape.requests("begin", "error"), 1.0);
    assert_eq!(scrape.get("idemstore_backend_errors_total", &[("op", "begin"), ("reason", "full")]), 1.0);
    assert_eq!(
        scrape.get("idemstore_backend_errors_total", &[("op", "begin"), ("reason", "unavailable")]),
        0.0
    );
    assert_eq!(scrape.get("idemstore_memory_keys", &[]), 1.0);
    assert_eq!(scrape.get("idemstore_memory_max_keys", &[]), 1.0);
}

/// Polls `/metrics` until `ok` holds (or fails after 10 s).
async fn scrape_until(addr: SocketAddr, what: &str, ok: impl Fn(&Scrape) -> bool) -> Scrape {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let scrape = scrape(addr).await;
        if ok(&scrape) {
            return scrape;
        }
        assert!(Instant::now() < deadline, "{what}: never reached in {scrape:#?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A duplicate waiting on a held lock is a waiter; when its caller resets the stream (as
/// Envoy does at its timeout) it counts as `cancelled` and its wait is observed.
#[tokio::test]
async fn waiting_then_cancelled_begin() {
    let addr = serve_with(MemoryBackend::new(1000), Options::new(1024)).await;
    let client = Client::new(addr, Version::H2c).await;
    let (key, hash) = (common::key(), common::hash('a'));
    let token = client.begin(&key, &hash, "1").await.token();

    let waiter = tokio::spawn({
        let (client, key, hash) = (client.clone(), key.clone(), hash.clone());
        async move { client.begin(&key, &hash, "30000").await }
    });
    let waiting = scrape_until(addr, "one waiter", |s| s.get("idemstore_waiters", &[]) == 1.0).await;
    assert_eq!(waiting.histogram_count("idemstore_begin_wait_seconds", &[]), 0.0, "observed when it ends");
    assert_eq!(waiting.requests_of("begin"), 1.0, "counted when it ends");

    waiter.abort();
    let after = scrape_until(addr, "the waiter cancelled", |s| s.requests("begin", "cancelled") == 1.0).await;
    assert_eq!(after.get("idemstore_waiters", &[]), 0.0);
    assert_eq!(after.histogram_count("idemstore_begin_wait_seconds", &[]), 1.0);
    assert_eq!(after.requests("begin", "locked"), 1.0);
    assert_eq!(after.histogram_count("idemstore_request_duration_seconds", &[("op", "begin")]), 2.0);

    // The lock is still the holder's, and works as usual.
    assert_eq!(client.release(&key, &token, false).await.outcome(), "released");
    assert_eq!(scrape(addr).await.requests("release", "released"), 1.0);
}

/// Each item of a `commits` counts as the `commit` it stands for (outcome, duration, backend
/// error), and the call in `idemstore_commit_batches_total` with its items. One item failing
/// (its record does not fit the in-memory budget) answers `failed` for it alone; the others
/// are stored, and the failed one's lock stays held, as after a failed `commit`.
#[tokio::test]
async fn batch_items_count_as_commits_and_fail_alone() {
    let backend = MemoryBackend::with_limits(100, 3 * ENTRY_COST + 20);
    let addr = serve_with(backend.clone(), Options::new(1024)).await;
    let client = Client::new(addr, Version::H2c).await;
    let before = scrape_with(&client).await;
    assert_eq!(before.get("idemstore_commit_batches_total", &[]), 0.0);
    assert_eq!(before.get("idemstore_commit_batch_items_total", &[]), 0.0);

    let hash = common::hash('a');
    let keys: Vec<String> = (0..3).map(|_| common::key()).collect();
    let mut tokens = Vec::new();
    for key in &keys {
        tokens.push(client.begin(key, &hash, "0").await.token());
    }
    let big = vec![b'x'; 100];
    let items: Vec<(&str, &str, &str, &[u8])> = vec![
        (&keys[0], &tokens[0], &hash, b"one"),
        (&keys[1], &tokens[1], &hash, &big),
        (&keys[2], &tokens[2], &hash, b"three"),
    ];
    let reply = client.commits(batch_body(&items)).await;
    assert_eq!(reply.batch(3), [Some(CommitOutcome::Stored), None, Some(CommitOutcome::Stored)]);
    assert_eq!(&reply.body[..], b"stored\nfailed\nstored");
    assert_eq!(&client.begin(&keys[0], &hash, "0").await.body[..], b"one");
    assert_eq!(client.begin(&keys[1], &hash, "0").await.outcome(), "busy");
    assert_eq!(&client.begin(&keys[2], &hash, "0").await.body[..], b"three");
    // Refused before the backend: counted as a rejection only.
    assert_eq!(client.commits(Bytes::new()).await.status, StatusCode::BAD_REQUEST);
    let refused = client.commits(batch_body(&[(&keys[0], "t", &hash, &[b'x'; 1024])])).await;
    assert_eq!(refused.status, StatusCode::PAYLOAD_TOO_LARGE);

    let after = scrape_with(&client).await;
    assert_eq!(after.get("idemstore_commit_batches_total", &[]), 1.0);
    assert_eq!(after.get("idemstore_commit_batch_items_total", &[]), 3.0);
    assert_eq!(after.requests("commit", "stored"), 2.0);
    assert_eq!(after.requests("commit", "error"), 1.0);
    assert_eq!(after.requests_of("commit"), 3.0);
    assert_eq!(after.histogram_count("idemstore_request_duration_seconds", &[("op", "commit")]), 3.0);
    assert_eq!(after.get("idemstore_backend_errors_total", &[("op", "commit"), ("reason", "full")]), 1.0);
    assert_eq!(after.get("idemstore_rejected_total", &[("reason", "invalid")]), 1.0);
    assert_eq!(after.get("idemstore_rejected_total", &[("reason", "too_large")]), 1.0);

    // A backend that fails everything: still a `200` with every item `failed`.
    let addr = serve_store(Arc::new(Store::new(Down)), Options::new(1024)).await;
    let client = Client::new(addr, Version::H1).await;
    let reply =
        client.commits(batch_body(&[(&keys[0], "t", &hash, b"a"), (&keys[1], "t", &hash, b"b")])).await;
    assert_eq!(reply.batch(2), [None, None]);
    let scrape = scrape_with(&client).await;
    assert_eq!(scrape.requests("commit", "error"), 2.0);
    assert_eq!(
        scrape.get("idemstore_backend_errors_total", &[("op", "commit"), ("reason", "unavailable")]),
        2.0
    );
    assert_eq!(scrape.get("idemstore_commit_batch_items_total", &[]), 2.0);
}
