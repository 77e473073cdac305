//! A client of idemstore's HTTP protocol over real sockets, HTTP/1.1 or h2c (prior knowledge),
//! and idemstore's router served on a loopback port.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{HeaderMap, Request, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use idem_protocol as proto;
use idemstore::backend::memory::MemoryBackend;
use idemstore::backend::{Backend, CommitOutcome};
use idemstore::http::Options;
use idemstore::store::Store;
use tokio::net::{TcpListener, TcpStream};

pub async fn serve(max_body: usize) -> SocketAddr {
    serve_with(MemoryBackend::new(1000), Options::new(max_body)).await
}

/// idemstore's router on a loopback port; keep a clone of `backend` to look inside.
pub async fn serve_with(backend: MemoryBackend, options: Options) -> SocketAddr {
    serve_store(Arc::new(Store::new(backend)), options).await
}

/// idemstore's router over `store` on a loopback port.
pub async fn serve_store<B: Backend>(store: Arc<Store<B>>, options: Options) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = idemstore::http::router(store, options);
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn outcome(&self) -> &str {
        self.headers.get(proto::HEADER_OUTCOME).map_or("", |v| v.to_str().unwrap())
    }

    pub fn token(&self) -> String {
        self.headers[proto::HEADER_TOKEN].to_str().unwrap().to_owned()
    }

    /// The outcomes of a `commits` answer for `n` items: it must be a `200` with outcome `batch`.
    pub fn batch(&self, n: usize) -> Vec<Option<CommitOutcome>> {
        let text = String::from_utf8_lossy(&self.body);
        assert_eq!((self.status, self.outcome()), (StatusCode::OK, proto::BATCH_OUTCOME), "{text}");
        proto::decode_batch_answer(&self.body, n).unwrap_or_else(|| panic!("not {n} outcomes: {text:?}"))
    }

    /// `x-idem-lock-remaining-ms`, if set (it must then be a whole number of milliseconds).
    pub fn lock_remaining(&self) -> Option<Duration> {
        let value = self.headers.get(proto::HEADER_LOCK_REMAINING_MS)?;
        Some(Duration::from_millis(value.to_str().unwrap().parse().unwrap()))
    }
}

/// A `commits` body: one item per (key, token, body hash, record).
pub fn batch_body(items: &[(&str, &str, &str, &[u8])]) -> Bytes {
    let mut body = Vec::new();
    for (key, token, hash, record) in items {
        proto::encode_batch_item(&mut body, key, token, hash, record);
    }
    Bytes::from(body)
}

#[derive(Clone, Copy, PartialEq)]
pub enum Version {
    H1,
    H2c,
}

/// One connection; HTTP/2 requests on it are multiplexed. Sends `secret` on every request.
#[derive(Clone)]
pub struct Client {
    conn: Conn,
    secret: Option<&'static str>,
}

#[derive(Clone)]
pub enum Conn {
    H1(SocketAddr),
    H2(hyper::client::conn::http2::SendRequest<Full<Bytes>>, SocketAddr),
}

impl Client {
    pub async fn new(addr: SocketAddr, version: Version) -> Self {
        let conn = match version {
            Version::H1 => Conn::H1(addr),
            Version::H2c => {
                let io = TokioIo::new(TcpStream::connect(addr).await.unwrap());
                let (sender, conn) =
                    hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await.unwrap();
                tokio::spawn(conn);
                Conn::H2(sender, addr)
            }
        };
        Self { conn, secret: None }
    }

    pub fn with_secret(&self, secret: Option<&'static str>) -> Self {
        Self { conn: self.conn.clone(), secret }
    }

    pub async fn call(&self, method: &str, path: &str, headers: &[(&str, &str)], body: Bytes) -> Reply {
        self.try_call(method, path, headers, body).await.unwrap()
    }

    pub async fn try_call(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Result<Reply, hyper::Error> {
        let addr = match &self.conn {
            Conn::H1(addr) | Conn::H2(_, addr) => *addr,
        };
        let mut request = Request::builder().method(method).uri(format!("http://{addr}{path}"));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        if let Some(secret) = self.secret {
            request = request.header(proto::HEADER_SECRET, secret);
        }
        let request = request.body(Full::new(body)).unwrap();
        let response = match &self.conn {
            Conn::H1(_) => {
                // A fresh connection per request: HTTP/1.1 cannot multiplex a long-poll.
                let io = TokioIo::new(TcpStream::connect(addr).await.unwrap());
                let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await?;
                tokio::spawn(conn);
                sender.send_request(request).await?
            }
            Conn::H2(sender, _) => {
                let response = sender.clone().send_request(request).await?;
                assert_eq!(response.version(), hyper::Version::HTTP_2);
                response
            }
        };
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.into_body().collect().await?.to_bytes();
        Ok(Reply { status, headers, body })
    }

    pub async fn begin(&self, key: &str, hash: &str, wait_ms: &str) -> Reply {
        self.begin_with_ttl(key, hash, "30000", wait_ms).await
    }

    pub async fn begin_with_ttl(&self, key: &str, hash: &str, lock_ttl_ms: &str, wait_ms: &str) -> Reply {
        let headers = [
            (proto::HEADER_KEY, key),
            (proto::HEADER_BODY_HASH, hash),
            (proto::HEADER_LOCK_TTL_MS, lock_ttl_ms),
            (proto::HEADER_WAIT_MS, wait_ms),
        ];
        self.call("POST", proto::PATH_BEGIN, &headers, Bytes::new()).await
    }

    pub async fn commit(&self, key: &str, token: &str, hash: &str, record: Bytes) -> Reply {
        let headers = [
            (proto::HEADER_KEY, key),
            (proto::HEADER_TOKEN, token),
            (proto::HEADER_BODY_HASH, hash),
            (proto::HEADER_RETENTION_S, "86400"),
        ];
        self.call("POST", proto::PATH_COMMIT, &headers, record).await
    }

    /// A `commits` call with a day's retention.
    pub async fn commits(&self, body: Bytes) -> Reply {
        self.call("POST", proto::PATH_COMMITS, &[(proto::HEADER_RETENTION_S, "86400")], body).await
    }

    /// `in_doubt`: with `x-idem-in-doubt: 1` (else without the header).
    pub async fn release(&self, key: &str, token: &str, in_doubt: bool) -> Reply {
        let mut headers = vec![(proto::HEADER_KEY, key), (proto::HEADER_TOKEN, token)];
        if in_doubt {
            headers.push((proto::HEADER_IN_DOUBT, "1"));
        }
        self.call("POST", proto::PATH_RELEASE, &headers, Bytes::new()).await
    }

    /// A `begin` with `x-idem-hold: 1`, the retention `retention_s` and, if given, the token to
    /// supersede.
    pub async fn begin_hold(
        &self,
        key: &str,
        hash: &str,
        lock_ttl_ms: &str,
        retention_s: &str,
        supersede: Option<&str>,
    ) -> Reply {
        let mut headers = vec![
            (proto::HEADER_KEY, key),
            (proto::HEADER_BODY_HASH, hash),
            (proto::HEADER_LOCK_TTL_MS, lock_ttl_ms),
            (proto::HEADER_WAIT_MS, "0"),
            (proto::HEADER_HOLD, "1"),
            (proto::HEADER_RETENTION_S, retention_s),
        ];
        if let Some(token) = supersede {
            headers.push((proto::HEADER_SUPERSEDE, token));
        }
        self.call("POST", proto::PATH_BEGIN, &headers, Bytes::new()).await
    }
}
