//! The wire protocol over real sockets, HTTP/1.1 and h2c (prior knowledge).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{HeaderMap, Request, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use idem_protocol as proto;
use idemstore::backend::memory::MemoryBackend;
use idemstore::store::Store;
use tokio::net::{TcpListener, TcpStream};

async fn serve(max_body: usize) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = idemstore::http::router(Arc::new(Store::new(MemoryBackend::new(1000))), max_body);
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Reply {
    fn outcome(&self) -> &str {
        self.headers.get(proto::HEADER_OUTCOME).map_or("", |v| v.to_str().unwrap())
    }

    fn token(&self) -> String {
        self.headers[proto::HEADER_TOKEN].to_str().unwrap().to_owned()
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Version {
    H1,
    H2c,
}

/// One connection; HTTP/2 requests on it are multiplexed.
#[derive(Clone)]
enum Client {
    H1(SocketAddr),
    H2(hyper::client::conn::http2::SendRequest<Full<Bytes>>, SocketAddr),
}

impl Client {
    async fn new(addr: SocketAddr, version: Version) -> Self {
        match version {
            Version::H1 => Self::H1(addr),
            Version::H2c => {
                let io = TokioIo::new(TcpStream::connect(addr).await.unwrap());
                let (sender, conn) =
                    hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await.unwrap();
                tokio::spawn(conn);
                Self::H2(sender, addr)
            }
        }
    }

    async fn call(&self, method: &str, path: &str, headers: &[(&str, &str)], body: Bytes) -> Reply {
        let addr = match self {
            Self::H1(addr) | Self::H2(_, addr) => *addr,
        };
        let mut request = Request::builder().method(method).uri(format!("http://{addr}{path}"));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request.body(Full::new(body)).unwrap();
        let response = match self {
            Self::H1(_) => {
                // A fresh connection per request: HTTP/1.1 cannot multiplex a long-poll.
                let io = TokioIo::new(TcpStream::connect(addr).await.unwrap());
                let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
                tokio::spawn(conn);
                sender.send_request(request).await.unwrap()
            }
            Self::H2(sender, _) => {
                let response = sender.clone().send_request(request).await.unwrap();
                assert_eq!(response.version(), hyper::Version::HTTP_2);
                response
            }
        };
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        Reply { status, headers, body }
    }

    async fn begin(&self, key: &str, hash: &str, wait_ms: &str) -> Reply {
        let headers = [
            (proto::HEADER_KEY, key),
            (proto::HEADER_BODY_HASH, hash),
            (proto::HEADER_LOCK_TTL_MS, "30000"),
            (proto::HEADER_WAIT_MS, wait_ms),
        ];
        self.call("POST", proto::PATH_BEGIN, &headers, Bytes::new()).await
    }

    async fn commit(&self, key: &str, token: &str, hash: &str, record: Bytes) -> Reply {
        let headers = [
            (proto::HEADER_KEY, key),
            (proto::HEADER_TOKEN, token),
            (proto::HEADER_BODY_HASH, hash),
            (proto::HEADER_RETENTION_S, "86400"),
        ];
        self.call("POST", proto::PATH_COMMIT, &headers, record).await
    }

    async fn release(&self, key: &str, token: &str) -> Reply {
        let headers = [(proto::HEADER_KEY, key), (proto::HEADER_TOKEN, token)];
        self.call("POST", proto::PATH_RELEASE, &headers, Bytes::new()).await
    }
}

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
    assert_eq!(client.release(&key, &token).await.outcome(), "not-owner");

    let other = common::key();
    let token = client.begin(&other, &hash, "5000").await.token();
    let busy = client.begin(&other, &hash, "100").await;
    assert_eq!((busy.status, busy.outcome(), &busy.body[..]), (StatusCode::OK, "busy", &b""[..]));
    assert_eq!(client.release(&other, &token).await.outcome(), "released");
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

    let bad_token = client.release(&key, "not a token").await;
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
    let app = idemstore::http::router(Arc::new(Store::new(MemoryBackend::new(1))), 1024);
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let client = Client::new(addr, Version::H2c).await;
    let hash = common::hash('a');
    assert_eq!(client.begin(&common::key(), &hash, "1").await.outcome(), "locked");
    let full = client.begin(&common::key(), &hash, "1").await;
    assert_eq!(full.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(full.outcome().is_empty());
}
