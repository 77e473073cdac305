//! `idemstore records ...`: the operator's tools for the bad day a wrong answer was stored or
//! an attempt's outcome is unknown. Look up or delete one store key's record, lock and trace,
//! named by the request it was made for (subject, method, route, client key: derived as the
//! filter derives it, `idem_protocol::key`) or by the store key itself or a prefix of it;
//! resolve a key in doubt with the answer the application says it gave; count the records,
//! locks and keys in doubt. Against Redis or Redis Cluster directly, through the same backend
//! code the service runs, or through a running idemstore's admin routes ([`crate::admin`]),
//! with its shared secret.
//!
//! Exit status: 0 found (and deleted, or resolved), 1 nothing found (and nothing deleted; for
//! `resolve`, a key not in doubt: nothing resolved), 2 anything else (a usage error, a store
//! that cannot be reached, a refused secret).
//!
//! Uses [`crate::admin`] (the lookups, on a backend, and the reports, from the routes),
//! [`crate::answer`] (the record `resolve` commits), [`crate::backend`] (Redis) and
//! [`crate::secret`]; never the HTTP server.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use bytes::Bytes;
use clap::{Args, Subcommand};
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use idem_protocol as proto;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::net::TcpStream;

use crate::admin::{
    self, CountsReport, DeleteReport, FindReport, KeyReport, LockReport, RecordReport, ResolveReport,
    TraceReport,
};
use crate::answer;
use crate::backend::access::{redact, Access, AccessArgs};
use crate::backend::redis::RedisBackend;
use crate::backend::{now_ms, Backend, BackendError};
use crate::secret::Secret;

/// How an operator names the request whose record is wrong; shown by `--help`.
pub const KEY_HELP: &str = "\
Naming the record. The filter stores a request's answer under its store key: SHA-256 over the
caller (subject), the method, the route and the client's Idempotency-Key. Give the same four
values it used and this derives the same key:

  --subject  who the caller was, in the filter's own form:
               id:<caller>       the value of the filter's `subject` (the header Envoy sets, or
                                 the metadata such as jwt_authn's `sub`), e.g. id:user-42
               anon:<client IP>  without a `subject`, or a request that lacked it: Envoy's
                                 source.address without its port, e.g. anon:203.0.113.7
               idx:<hex>         a caller value that is not UTF-8 (a numeric claim), hex-encoded
               inbox:<source>    inbox mode: the message's source (ce-source, ...)
  --method   the request's method (upper-cased, as the filter does)
  --route    the `name` of the Envoy route the request took; for a route without a name, the
             request path without its query string (e.g. /orders/17)
  --key      the Idempotency-Key as the client sent it (\"abc\" quoted means abc); in inbox
             mode, the message id

Or give --store-key: the 64 hex characters the filter hands the application in its
`store_key_header`, or at least 8 of the first ones (the filter's debug log lines,
`request <x-request-id> key <12 hex>: ...`, show 12).

Where: --redis / --redis-cluster / --redis-sentinel read Redis directly (default:
$IDEMSTORE_REDIS, $IDEMSTORE_REDIS_CLUSTER or $IDEMSTORE_REDIS_SENTINEL, as the service reads
them), with the service's TLS, credential and --key-prefix flags and variables (the same prefix,
or nothing is found); --url goes through a running idemstore, with its secret from
--secret-file, $IDEMSTORE_SECRET_FILE or $IDEMSTORE_SECRET.

Each Envoy worker keeps records it replayed in its record cache (record_cache_entries) and
replays them until they expire, without asking the store: after a delete, a retry that reaches
such a worker still replays, until the record's retention runs out or Envoy restarts. Run the
filter with record_cache_entries: 0 where records may have to be deleted.

A key is IN DOUBT when an attempt began (with the filter's hold), no answer came back and no
lock holds the key: the store keeps its trace, and a retry gets 409 (outcome-unknown) until the
attempt commits late, the trace expires, `records resolve` stores the answer the application
says it gave (retries then replay it), or `records delete` drops the trace (the next retry
runs again).

Exit status: 0 found (deleted, resolved), 1 nothing found (nothing deleted; not in doubt,
nothing resolved), 2 error.";

#[derive(Debug, Subcommand)]
pub enum Records {
    /// What a store key holds: its record (the answer's status, size, lifetime, request body hash)
    /// and its lock.
    #[command(after_long_help = KEY_HELP)]
    Lookup(KeyCommand),
    /// Delete a store key's record, its lock and its trace: the next retry of that request runs
    /// again.
    #[command(after_long_help = KEY_HELP)]
    Delete(KeyCommand),
    /// Resolve a key in doubt (an attempt's trace, no lock, no record) with the answer the
    /// application says it gave: stored under the attempt's token, retries replay it.
    #[command(after_long_help = KEY_HELP)]
    Resolve(ResolveCommand),
    /// Count the records, locks and keys in doubt the store holds (Redis: SCAN on every master,
    /// never KEYS; approximate while keys come and go).
    Count(CountCommand),
}

#[derive(Debug, Args)]
pub struct KeyCommand {
    #[command(flatten)]
    pub key: KeyArgs,
    #[command(flatten)]
    pub target: Target,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ResolveCommand {
    #[command(flatten)]
    pub key: KeyArgs,
    #[command(flatten)]
    pub target: Target,
    /// The answer's status (200 to 599).
    #[arg(long, value_name = "N")]
    pub status: u16,
    /// A header of the answer, 'name: value' (repeat it for more; at most 64).
    #[arg(long = "header", value_name = "NAME: VALUE")]
    pub headers: Vec<String>,
    /// The answer's body, from this file (content-type: application/json unless a header
    /// says otherwise).
    #[arg(long, value_name = "PATH")]
    pub body_file: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct CountCommand {
    #[command(flatten)]
    pub target: Target,
    /// Print the counts as JSON.
    #[arg(long)]
    pub json: bool,
}

/// The record, by the request it was made for or by its store key (see [`KEY_HELP`]).
#[derive(Debug, Args)]
pub struct KeyArgs {
    /// The store key (64 hex characters), or at least 8 of its first characters.
    #[arg(
        long,
        value_name = "HEX",
        conflicts_with_all = ["subject", "method", "route", "key"],
        required_unless_present = "subject"
    )]
    pub store_key: Option<String>,

    /// The caller, as the filter names it: id:<caller>, anon:<client IP>, idx:<hex> or
    /// inbox:<source>.
    #[arg(long, value_name = "SUBJECT", requires_all = ["method", "route", "key"])]
    pub subject: Option<String>,

    /// The request's method, e.g. POST.
    #[arg(long, value_name = "METHOD", requires = "subject")]
    pub method: Option<String>,

    /// The Envoy route's name, or the path without its query for a route without a name.
    #[arg(long, value_name = "ROUTE", requires = "subject")]
    pub route: Option<String>,

    /// The client's Idempotency-Key (inbox mode: the message id).
    #[arg(long, value_name = "KEY", requires = "subject")]
    pub key: Option<String>,
}

/// Where the records are: Redis, Redis Cluster, or a running idemstore.
#[derive(Debug, Args)]
pub struct Target {
    /// Standalone Redis URL, as idemstore's --redis (default: $IDEMSTORE_REDIS).
    #[arg(long, value_name = "URL", conflicts_with_all = ["redis_cluster", "url"])]
    pub redis: Option<String>,

    /// Redis Cluster seed node URLs, comma-separated (default: $IDEMSTORE_REDIS_CLUSTER).
    #[arg(long, value_name = "URLS", value_delimiter = ',', conflicts_with = "url")]
    pub redis_cluster: Vec<String>,

    /// Redis Sentinel addresses, as idemstore's --redis-sentinel, with
    /// --redis-sentinel-master (default: $IDEMSTORE_REDIS_SENTINEL).
    #[arg(
        long,
        value_name = "HOST:PORT,...",
        value_delimiter = ',',
        conflicts_with_all = ["redis", "redis_cluster", "url"]
    )]
    pub redis_sentinel: Vec<String>,

    /// How to reach Redis (TLS, credentials, key prefix): the service's flags and variables.
    #[command(flatten)]
    pub access: AccessArgs,

    /// A running idemstore, e.g. http://idemstore:8380 (https:// when it serves TLS): through
    /// its admin routes.
    #[arg(long, value_name = "URL")]
    pub url: Option<String>,

    /// With an https:// --url: CA certificates (PEM) that verify idemstore's certificate
    /// (default: the system's roots).
    #[arg(long, value_name = "PATH", requires = "url")]
    pub url_ca_file: Option<PathBuf>,

    /// With an https:// --url: the client certificate (PEM) idemstore requires
    /// (--tls-client-ca-file), with --url-key-file.
    #[arg(long, value_name = "PATH", requires_all = ["url", "url_key_file"])]
    pub url_cert_file: Option<PathBuf>,

    /// The client certificate's private key (PEM).
    #[arg(long, value_name = "PATH", requires_all = ["url", "url_cert_file"])]
    pub url_key_file: Option<PathBuf>,

    /// With --url: the file holding idemstore's shared secret (default: $IDEMSTORE_SECRET_FILE,
    /// or the secret itself in $IDEMSTORE_SECRET).
    #[arg(long, value_name = "PATH")]
    pub secret_file: Option<PathBuf>,

    /// Timeout of each call to Redis or idemstore, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 5000)]
    pub timeout_ms: u64,
}

/// A failure: its message, for stderr (exit status 2).
type Failure = String;

/// Runs one `idemstore records` command: prints its report on stdout, a failure on stderr.
pub async fn run(command: Records) -> ExitCode {
    match execute(&command, |name| std::env::var(name).ok().filter(|v| !v.is_empty())).await {
        Ok(Outcome { found, text }) => {
            print!("{text}");
            if found {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("idemstore records: {e}");
            ExitCode::from(2)
        }
    }
}

/// What a command printed, and whether it found what it was asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub found: bool,
    pub text: String,
}

/// Runs `command`, reading the environment through `env` (tests pass their own).
pub async fn execute(command: &Records, env: impl Fn(&str) -> Option<String>) -> Result<Outcome, Failure> {
    let target = match command {
        Records::Lookup(c) | Records::Delete(c) => &c.target,
        Records::Resolve(c) => &c.target,
        Records::Count(c) => &c.target,
    };
    let timeout = Duration::from_millis(target.timeout_ms.max(1));
    let access = || Access::load(&target.access, &env);
    match Where::of(target, &env)? {
        Where::Redis(url) => {
            let backend = RedisBackend::standalone_with(&url, &access()?, timeout)
                .map_err(|e| format!("--redis {}: {e}", redact(&url)))?;
            perform(&Direct(backend), command).await
        }
        Where::Cluster(urls) => {
            let backend = RedisBackend::cluster_with(&urls, &access()?, timeout)
                .map_err(|e| format!("--redis-cluster: {e}"))?;
            perform(&Direct(backend), command).await
        }
        Where::Sentinel(sentinels) => {
            let master = target
                .access
                .redis_sentinel_master
                .clone()
                .or_else(|| env("IDEMSTORE_REDIS_SENTINEL_MASTER"));
            let master = master.ok_or("--redis-sentinel needs --redis-sentinel-master NAME")?;
            let backend = RedisBackend::sentinel(&sentinels, &master, &access()?, timeout)
                .map_err(|e| format!("--redis-sentinel: {e}"))?;
            perform(&Direct(backend), command).await
        }
        Where::Idemstore(url) => {
            let secret = secret(target, &env)?;
            perform(&HttpStore::new(&url, target, secret, timeout)?, command).await
        }
    }
}

#[derive(Debug)]
enum Where {
    Redis(String),
    Cluster(Vec<String>),
    Sentinel(Vec<String>),
    Idemstore(String),
}

impl Where {
    /// The flags, else the service's own environment variables. clap cannot mix the two: a
    /// variable would then count as a flag and conflict with another flag given.
    fn of(target: &Target, env: &impl Fn(&str) -> Option<String>) -> Result<Self, Failure> {
        if let Some(url) = &target.url {
            return Ok(Self::Idemstore(url.clone()));
        }
        if let Some(url) = &target.redis {
            return Ok(Self::Redis(url.clone()));
        }
        if !target.redis_cluster.is_empty() {
            return Ok(Self::Cluster(target.redis_cluster.clone()));
        }
        if !target.redis_sentinel.is_empty() {
            return Ok(Self::Sentinel(target.redis_sentinel.clone()));
        }
        let list = |urls: String| urls.split(',').map(str::to_owned).collect();
        match (env("IDEMSTORE_REDIS"), env("IDEMSTORE_REDIS_CLUSTER"), env("IDEMSTORE_REDIS_SENTINEL")) {
            (Some(url), None, None) => Ok(Self::Redis(url)),
            (None, Some(urls), None) => Ok(Self::Cluster(list(urls))),
            (None, None, Some(urls)) => Ok(Self::Sentinel(list(urls))),
            (None, None, None) => Err("where are the records? Give --redis URL, --redis-cluster URLS, \
                 --redis-sentinel HOST:PORT,... or --url http://IDEMSTORE:8380 (or set IDEMSTORE_REDIS, \
                 IDEMSTORE_REDIS_CLUSTER or IDEMSTORE_REDIS_SENTINEL)"
                .into()),
            _ => Err("more than one of IDEMSTORE_REDIS, IDEMSTORE_REDIS_CLUSTER and \
                 IDEMSTORE_REDIS_SENTINEL is set: say which with --redis, --redis-cluster or \
                 --redis-sentinel"
                .into()),
        }
    }
}

fn secret(target: &Target, env: &impl Fn(&str) -> Option<String>) -> Result<Option<Secret>, Failure> {
    let file = target.secret_file.clone().or_else(|| env("IDEMSTORE_SECRET_FILE").map(PathBuf::from));
    match (file, env("IDEMSTORE_SECRET")) {
        (Some(path), _) => Secret::from_file(&path).map(Some).map_err(|e| format!("--secret-file: {e}")),
        (None, Some(value)) => Secret::new(&value).map(Some).map_err(|e| format!("IDEMSTORE_SECRET: {e}")),
        (None, None) => Ok(None),
    }
}

/// The record as the operator named it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Named {
    /// A whole store key, given or derived (with what it was derived from).
    Key { store_key: String, derived: Option<String> },
    /// The first characters of a store key.
    Prefix(String),
}

fn named(args: &KeyArgs) -> Result<Named, Failure> {
    if let Some(given) = &args.store_key {
        let given = given.trim().to_ascii_lowercase();
        return if proto::is_hex64(given.as_bytes()) {
            Ok(Named::Key { store_key: given, derived: None })
        } else if admin::is_prefix(&given) {
            Ok(Named::Prefix(given))
        } else {
            Err(format!(
                "--store-key: 64 hex characters, or at least {} of the first ones",
                admin::MIN_PREFIX
            ))
        };
    }
    let (Some(subject), Some(method), Some(route), Some(key)) =
        (&args.subject, &args.method, &args.route, &args.key)
    else {
        return Err("give --store-key, or all of --subject, --method, --route and --key".into());
    };
    if !proto::key::is_filter_subject(subject.as_bytes()) {
        return Err(format!(
            "--subject {subject:?}: the filter's subjects are id:<caller>, anon:<client IP>, \
             idx:<hex> or inbox:<source> (see --help)"
        ));
    }
    for (flag, value) in [("--method", method), ("--route", route), ("--key", key)] {
        if value.is_empty() {
            return Err(format!("{flag} must not be empty"));
        }
    }
    // The filter upper-cases the method before it derives the key.
    let method = method.to_ascii_uppercase();
    let store_key = proto::store_key(subject, &method, route, key);
    let derived = format!("subject {subject:?}, method {method}, route {route:?}, key {key:?}");
    Ok(Named::Key { store_key, derived: Some(derived) })
}

/// The five operations, whether on a backend or through idemstore's routes.
trait Admin {
    async fn lookup(&self, store_key: &str) -> Result<KeyReport, Failure>;
    async fn delete(&self, store_key: &str) -> Result<DeleteReport, Failure>;
    /// `record` is [`crate::answer::encode`]'s, of `status`.
    async fn resolve(&self, store_key: &str, record: Bytes, status: u16) -> Result<ResolveReport, Failure>;
    async fn find(&self, prefix: &str) -> Result<FindReport, Failure>;
    async fn counts(&self) -> Result<CountsReport, Failure>;
}

/// Straight on a backend (Redis, Redis Cluster; in memory for tests).
pub struct Direct<B>(pub B);

fn backend_failure(e: BackendError) -> Failure {
    match e {
        BackendError::Unavailable(why) => format!("the store did not answer: {why}"),
        BackendError::Refused(why) => why.clone(),
        BackendError::Full => "the store is full".into(),
    }
}

impl<B: Backend> Admin for Direct<B> {
    async fn lookup(&self, store_key: &str) -> Result<KeyReport, Failure> {
        admin::lookup(&self.0, store_key).await.map_err(backend_failure)
    }

    async fn delete(&self, store_key: &str) -> Result<DeleteReport, Failure> {
        admin::delete(&self.0, store_key).await.map_err(backend_failure)
    }

    async fn resolve(&self, store_key: &str, record: Bytes, status: u16) -> Result<ResolveReport, Failure> {
        admin::resolve(&self.0, store_key, record, status).await.map_err(backend_failure)
    }

    async fn find(&self, prefix: &str) -> Result<FindReport, Failure> {
        admin::find(&self.0, prefix).await.map_err(backend_failure)
    }

    async fn counts(&self) -> Result<CountsReport, Failure> {
        admin::counts(&self.0).await.map_err(backend_failure)
    }
}

/// Through a running idemstore's admin routes, over HTTP/1.1.
struct HttpStore {
    /// `host:port`, to connect to and for the `host` header.
    authority: String,
    /// For https://: the TLS client and the name idemstore's certificate must hold.
    tls: Option<(tokio_rustls::TlsConnector, rustls::pki_types::ServerName<'static>)>,
    /// The URL's path, without a trailing slash (idemstore behind a path prefix).
    base: String,
    secret: Option<Secret>,
    timeout: Duration,
}

impl HttpStore {
    fn new(url: &str, target: &Target, secret: Option<Secret>, timeout: Duration) -> Result<Self, Failure> {
        let uri: Uri = url.parse().map_err(|e| format!("--url {url}: {e}"))?;
        let https = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => return Err(format!("--url {url}: http:// or https://")),
        };
        if !https && (target.url_ca_file.is_some() || target.url_cert_file.is_some()) {
            return Err(format!("--url {url}: --url-ca-file and --url-cert-file need an https:// URL"));
        }
        let authority = uri.authority().ok_or_else(|| format!("--url {url}: no host"))?;
        let host = authority.host().trim_start_matches('[').trim_end_matches(']').to_owned();
        let port = authority.port_u16().unwrap_or(if https { 443 } else { 80 });
        let authority = format!("{}:{port}", authority.host());
        let tls = if https { Some(tls_client(target, &host)?) } else { None };
        Ok(Self { authority, tls, base: uri.path().trim_end_matches('/').to_owned(), secret, timeout })
    }

    async fn call<T: DeserializeOwned>(&self, method: Method, path: &str) -> Result<T, Failure> {
        self.call_with(method, path, Bytes::new()).await
    }

    async fn call_with<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Bytes,
    ) -> Result<T, Failure> {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let url = format!("{scheme}://{}{}{path}", self.authority, self.base);
        let exchange = async {
            let stream = TcpStream::connect(&self.authority).await.map_err(|e| format!("{url}: {e}"))?;
            let mut sender = match &self.tls {
                None => handshake(stream).await,
                Some((connector, name)) => {
                    let stream = connector
                        .connect(name.clone(), stream)
                        .await
                        .map_err(|e| format!("{url}: TLS handshake: {e}"))?;
                    handshake(stream).await
                }
            }
            .map_err(|e| format!("{url}: {e}"))?;
            let mut request = Request::builder()
                .method(method)
                .uri(format!("{}{path}", self.base))
                .header(hyper::header::HOST, &self.authority);
            if let Some(secret) = &self.secret {
                request = request.header(proto::HEADER_SECRET, secret.as_bytes());
            }
            let request = request.body(Full::new(body)).map_err(|e| format!("{url}: {e}"))?;
            let response = sender.send_request(request).await.map_err(|e| {
                // TLS 1.3 refuses a missing client certificate after the handshake: here.
                let hint = if self.tls.is_some() { " (an idemstore that requires a client certificate refuses a client without one: --url-cert-file)" } else { "" };
                format!("{url}: {e}{hint}")
            })?;
            let status = response.status();
            let body = response.into_body().collect().await.map_err(|e| format!("{url}: {e}"))?.to_bytes();
            Ok::<_, Failure>((status, body))
        };
        let (status, body) = tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| format!("{url}: no answer within {:?}", self.timeout))??;
        let text = String::from_utf8_lossy(&body);
        match status {
            StatusCode::OK => serde_json::from_slice(&body).map_err(|e| format!("{url}: not a report: {e}")),
            StatusCode::UNAUTHORIZED => Err(format!(
                "{url}: idemstore refused the secret (401): give its secret with --secret-file \
                 (or IDEMSTORE_SECRET)"
            )),
            StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED => {
                Err(format!("{url}: {status}: not an idemstore with the admin routes"))
            }
            _ => Err(format!("{url}: {status}: {}", text.trim())),
        }
    }
}

/// An HTTP/1.1 client on `io`, its connection driven in the background.
async fn handshake<IO>(io: IO) -> hyper::Result<hyper::client::conn::http1::SendRequest<Full<Bytes>>>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(conn);
    Ok(sender)
}

/// The TLS client of an https:// --url: idemstore's certificate verified for `host` against
/// --url-ca-file (else the system's roots), the client certificate sent if given.
fn tls_client(
    target: &Target,
    host: &str,
) -> Result<(tokio_rustls::TlsConnector, rustls::pki_types::ServerName<'static>), Failure> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{PrivateKeyDer, ServerName};
    let certs = crate::tls::certificates;
    let mut roots = rustls::RootCertStore::empty();
    match &target.url_ca_file {
        Some(path) => {
            for cert in certs(path, "--url-ca-file")? {
                roots.add(cert).map_err(|e| format!("--url-ca-file {}: {e}", path.display()))?;
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(native.certs);
        }
    }
    let builder = rustls::ClientConfig::builder().with_root_certificates(roots);
    let config = match (&target.url_cert_file, &target.url_key_file) {
        (Some(cert), Some(key)) => {
            let key = PrivateKeyDer::from_pem_file(key)
                .map_err(|e| format!("--url-key-file {}: {e}", key.display()))?;
            builder
                .with_client_auth_cert(certs(cert, "--url-cert-file")?, key)
                .map_err(|e| format!("--url-cert-file: {e}"))?
        }
        _ => builder.with_no_client_auth(),
    };
    let name = ServerName::try_from(host.to_owned()).map_err(|e| format!("--url: {host}: {e}"))?;
    Ok((tokio_rustls::TlsConnector::from(std::sync::Arc::new(config)), name))
}

impl Admin for HttpStore {
    async fn lookup(&self, store_key: &str) -> Result<KeyReport, Failure> {
        self.call(Method::GET, &format!("{}/{store_key}", admin::PATH_RECORDS)).await
    }

    async fn delete(&self, store_key: &str) -> Result<DeleteReport, Failure> {
        self.call(Method::DELETE, &format!("{}/{store_key}", admin::PATH_RECORDS)).await
    }

    async fn resolve(&self, store_key: &str, record: Bytes, _status: u16) -> Result<ResolveReport, Failure> {
        let path = format!("{}/{store_key}/{}", admin::PATH_RECORDS, admin::RESOLVE);
        self.call_with(Method::POST, &path, record).await
    }

    async fn find(&self, prefix: &str) -> Result<FindReport, Failure> {
        self.call(Method::GET, &format!("{}?prefix={prefix}", admin::PATH_RECORDS)).await
    }

    async fn counts(&self) -> Result<CountsReport, Failure> {
        self.call(Method::GET, admin::PATH_COUNTS).await
    }
}

/// What a command does with the key it names.
enum Action<'a> {
    Lookup,
    Delete,
    Resolve(&'a ResolveCommand),
}

/// The record `resolve` commits: its answer from the flags, encoded as the filter does.
fn answer_record(c: &ResolveCommand) -> Result<(Bytes, u16), Failure> {
    let headers = c.headers.iter().map(|h| answer::parse_header(h)).collect::<Result<Vec<_>, _>>()?;
    let body = match &c.body_file {
        Some(path) => std::fs::read(path).map_err(|e| format!("--body-file {}: {e}", path.display()))?,
        None => Vec::new(),
    };
    let record = answer::encode(c.status, &headers, &body).map_err(|e| format!("--status/--header: {e}"))?;
    Ok((Bytes::from(record), c.status))
}

/// Runs `command` on `admin` and renders its report.
async fn perform(admin: &impl Admin, command: &Records) -> Result<Outcome, Failure> {
    let (key, json, action) = match command {
        Records::Lookup(c) => (&c.key, c.json, Action::Lookup),
        Records::Delete(c) => (&c.key, c.json, Action::Delete),
        Records::Resolve(c) => (&c.key, c.json, Action::Resolve(c)),
        Records::Count(c) => {
            let counts = admin.counts().await?;
            let text = if c.json {
                json_line(&counts)?
            } else {
                format!(
                    "records   {}\nlocks     {}\nin doubt  {}\n",
                    counts.records, counts.locks, counts.in_doubt
                )
            };
            return Ok(Outcome { found: true, text });
        }
    };
    // Checked before anything is looked up: a bad answer is a usage error.
    let answer = match &action {
        Action::Resolve(c) => Some(answer_record(c)?),
        _ => None,
    };
    let (store_key, how) = match named(key)? {
        Named::Key { store_key, derived } => (store_key, derived.map(|d| format!("derived from {d}"))),
        Named::Prefix(prefix) => {
            let found = admin.find(&prefix).await?;
            match found.store_keys.as_slice() {
                [] if json => return Ok(Outcome { found: false, text: json_line(&found)? }),
                [] => {
                    let also = match action {
                        Action::Lookup => "",
                        Action::Delete => ", nothing deleted",
                        Action::Resolve(_) => ", nothing resolved",
                    };
                    let text = format!("nothing found for store key prefix {prefix}{also}\n");
                    return Ok(Outcome { found: false, text });
                }
                [one] => (one.clone(), Some(format!("the only store key starting with {prefix}"))),
                many => {
                    let more = if found.truncated { ", and more" } else { "" };
                    return Err(format!(
                        "store key prefix {prefix} matches {} keys ({}{more}): give more of it",
                        many.len(),
                        many.join(", ")
                    ));
                }
            }
        }
    };
    match (action, answer) {
        (Action::Delete, _) => {
            let report = admin.delete(&store_key).await?;
            let found = report.deleted_anything();
            let text = if json { json_line(&report)? } else { render_delete(&report, how.as_deref()) };
            Ok(Outcome { found, text })
        }
        (Action::Resolve(_), Some((record, status))) => {
            let report = admin.resolve(&store_key, record, status).await?;
            let text = if json { json_line(&report)? } else { render_resolve(&report, how.as_deref()) };
            Ok(Outcome { found: report.resolved, text })
        }
        _ => {
            let report = admin.lookup(&store_key).await?;
            let found = report.record.is_some() || report.lock.is_some() || report.trace.is_some();
            let text = if json { json_line(&report)? } else { render_lookup(&report, how.as_deref()) };
            Ok(Outcome { found, text })
        }
    }
}

fn json_line(value: &impl Serialize) -> Result<String, Failure> {
    serde_json::to_string(value).map(|s| s + "\n").map_err(|e| e.to_string())
}

/// `1h02m03s`, `2m03s`, `3.2s`.
fn duration(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        3600.. => format!("{}h{:02}m{:02}s", s / 3600, s % 3600 / 60, s % 60),
        60.. => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}.{}s", s, ms % 1000 / 100),
    }
}

fn expiry(ttl_ms: Option<u64>) -> String {
    ttl_ms.map_or_else(|| "no expiry".to_owned(), |ms| format!("expires in {}", duration(ms)))
}

fn record_line(r: &RecordReport) -> String {
    let status = r
        .status
        .map_or_else(|| "status unknown (not a record the filter wrote)".into(), |s| format!("status {s}"));
    format!("{status}, {} bytes, {}, request body hash {}", r.bytes, expiry(r.ttl_ms), r.body_hash)
}

fn lock_line(l: &LockReport) -> String {
    format!("held, {}", expiry(l.ttl_ms))
}

/// Milliseconds since the Unix epoch as an RFC 3339 UTC time, `2024-05-06T07:08:09.123Z`.
fn utc(ms: u64) -> String {
    let (days, rest) = (ms / 86_400_000, ms % 86_400_000);
    // Howard Hinnant's civil_from_days, for days since 1970-01-01 (never negative here).
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    let (h, m, sec, milli) = (rest / 3_600_000, rest / 60_000 % 60, rest / 1000 % 60, rest % 1000);
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{sec:02}.{milli:03}Z")
}

fn trace_line(t: &TraceReport) -> String {
    let ago = now_ms().saturating_sub(t.started_ms);
    format!(
        "attempt {}, began {} ({} ago), lock TTL {}, {}\n           request body hash {}",
        t.token,
        utc(t.started_ms),
        duration(ago),
        duration(t.lock_ttl_ms),
        expiry(t.ttl_ms),
        t.body_hash
    )
}

/// What a trace means for the key's retries, by what else the key holds.
fn trace_state(
    record: Option<&RecordReport>,
    lock: Option<&LockReport>,
    trace: Option<&TraceReport>,
) -> Option<String> {
    let trace = trace?;
    Some(match (record, lock) {
        (None, None) => [
            "IN DOUBT: the attempt was sent and no answer came back (or its Envoy died), and no",
            "lock holds the key. A retry gets 409 (outcome-unknown) until the attempt commits late,",
            "`records resolve` stores the answer it gave (retries replay it), `records delete` drops",
            "the trace (the next retry runs again) or the trace expires.",
        ]
        .join("\n           "),
        (None, Some(_)) => format!(
            "running: the attempt holds the lock (it may run until {})",
            utc(trace.started_ms.saturating_add(trace.lock_ttl_ms))
        ),
        (Some(_), _) => "the record answers the key's retries (the trace is left over)".to_owned(),
    })
}

fn head(
    text: &mut String,
    store_key: &str,
    how: Option<&str>,
    record: Option<&RecordReport>,
    lock: Option<&LockReport>,
    trace: Option<&TraceReport>,
) {
    let _ = writeln!(text, "store key  {store_key}");
    if let Some(how) = how {
        let _ = writeln!(text, "           ({how})");
    }
    let _ = writeln!(text, "record     {}", record.map_or_else(|| "none".into(), record_line));
    let _ = writeln!(text, "lock       {}", lock.map_or_else(|| "none".into(), lock_line));
    let _ = writeln!(text, "trace      {}", trace.map_or_else(|| "none".into(), trace_line));
    if let Some(state) = trace_state(record, lock, trace) {
        let _ = writeln!(text, "           {state}");
    }
}

fn render_lookup(report: &KeyReport, how: Option<&str>) -> String {
    let mut text = String::new();
    let (record, lock, trace) = (report.record.as_ref(), report.lock.as_ref(), report.trace.as_ref());
    head(&mut text, &report.store_key, how, record, lock, trace);
    if record.is_none() && lock.is_none() && trace.is_none() {
        let _ = writeln!(text, "nothing found for store key {}", report.store_key);
    }
    text
}

fn render_resolve(report: &ResolveReport, how: Option<&str>) -> String {
    let mut text = String::new();
    let b = &report.before;
    head(&mut text, &b.store_key, how, b.record.as_ref(), b.lock.as_ref(), b.trace.as_ref());
    let why = match (&b.record, &b.lock, &b.trace) {
        _ if report.resolved => {
            let _ = writeln!(
                text,
                "resolved: committed status {} ({} bytes) under the attempt's token ({}); its retries \
                 replay it for {}",
                report.status,
                report.bytes,
                report.committed.as_deref().unwrap_or("?"),
                report.retention_ms.map_or_else(|| "?".to_owned(), duration)
            );
            return text;
        }
        (Some(_), _, _) => "the key holds a record (`records delete` drops it)",
        (None, Some(_), _) => "an attempt holds the lock: it is running",
        (None, None, None) => "nothing found for the store key",
        (None, None, Some(_)) => "the key changed while it was looked at",
    };
    let _ = writeln!(text, "not in doubt: {why}; nothing resolved");
    text
}

fn render_delete(report: &DeleteReport, how: Option<&str>) -> String {
    let mut text = String::new();
    let (record, lock, trace) = (report.record.as_ref(), report.lock.as_ref(), report.trace.as_ref());
    head(&mut text, &report.store_key, how, record, lock, trace);
    let done: Vec<&str> = [
        (report.deleted_record, "deleted record"),
        (report.deleted_lock, "deleted lock"),
        (report.deleted_trace, "deleted trace"),
    ]
    .into_iter()
    .filter_map(|(done, what)| done.then_some(what))
    .collect();
    if done.is_empty() {
        let _ = writeln!(text, "nothing found for store key {}, nothing deleted", report.store_key);
    } else {
        let _ = writeln!(text, "{}", done.join(", "));
    }
    text
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use crate::backend::memory::MemoryBackend;
    use crate::backend::{Commit, CommitOutcome};
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(subcommand)]
        records: Records,
    }

    fn parse(args: &[&str]) -> Result<Records, clap::Error> {
        Cli::try_parse_from(std::iter::once("records").chain(args.iter().copied())).map(|c| c.records)
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    const HASH: &str = "5d41402abc4b2a76b9719d911017c592aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

    /// A memory backend holding one record of a `201` under the key of
    /// (anon:127.0.0.1, POST, orders, k-1), and its key.
    async fn with_record() -> (MemoryBackend, String) {
        let backend = MemoryBackend::new(100);
        let key = proto::store_key("anon:127.0.0.1", "POST", "orders", "k-1");
        let record = Bytes::from_static(b"IDR2\x00\xc9\x00\x00\x00body");
        let stored = backend
            .commit(Commit {
                key: &key,
                token: "t",
                body_hash: HASH,
                record,
                retention: Duration::from_secs(3600),
            })
            .await;
        assert_eq!(stored, Ok(CommitOutcome::Late));
        (backend, key)
    }

    async fn on(backend: &MemoryBackend, args: &[&str]) -> Result<Outcome, Failure> {
        perform(&Direct(backend.clone()), &parse(args).unwrap()).await
    }

    const DERIVED: [&str; 8] =
        ["--subject", "anon:127.0.0.1", "--method", "post", "--route", "orders", "--key", "k-1"];

    #[tokio::test]
    async fn lookup_and_delete_by_the_request() {
        let (backend, key) = with_record().await;
        let lookup = on(&backend, &[&["lookup"][..], &DERIVED].concat()).await.unwrap();
        assert!(lookup.found);
        assert!(lookup.text.contains(&format!("store key  {key}")), "{}", lookup.text);
        assert!(lookup.text.contains("method POST"), "the method is upper-cased: {}", lookup.text);
        assert!(lookup.text.contains("record     status 201, 13 bytes, expires in 59m"), "{}", lookup.text);
        assert!(lookup.text.contains(&format!("request body hash {HASH}")));
        assert!(lookup.text.contains("lock       none"));

        let json = on(&backend, &[&["lookup", "--json"][..], &DERIVED].concat()).await.unwrap();
        let report: KeyReport = serde_json::from_str(&json.text).unwrap();
        assert_eq!(report.store_key, key);
        assert_eq!(report.record.as_ref().map(|r| (r.status, r.bytes)), Some((Some(201), 13)));
        assert_eq!(report.lock, None);

        let deleted = on(&backend, &[&["delete"][..], &DERIVED].concat()).await.unwrap();
        assert!(deleted.found);
        assert!(deleted.text.ends_with("deleted record\n"), "{}", deleted.text);
        assert!(backend.is_empty());

        let again = on(&backend, &[&["delete"][..], &DERIVED].concat()).await.unwrap();
        assert!(!again.found);
        assert!(again.text.ends_with(&format!("nothing found for store key {key}, nothing deleted\n")));
    }

    #[tokio::test]
    async fn a_wrong_subject_or_key_finds_nothing_and_deletes_nothing() {
        let (backend, _) = with_record().await;
        for (flag, wrong) in [("--subject", "anon:127.0.0.2"), ("--key", "k-2"), ("--route", "/orders")] {
            let mut args = [&["delete"][..], &DERIVED].concat();
            let at = args.iter().position(|a| *a == flag).unwrap();
            args[at + 1] = wrong;
            let outcome = on(&backend, &args).await.unwrap();
            assert!(!outcome.found);
            assert!(outcome.text.contains("nothing deleted"), "{}", outcome.text);
            assert_eq!(backend.len(), 1);
        }
        // A subject the filter never derives is refused outright.
        let mut args = [&["delete"][..], &DERIVED].concat();
        args[2] = "127.0.0.1";
        let e = on(&backend, &args).await.unwrap_err();
        assert!(e.contains("id:<caller>, anon:<client IP>"), "{e}");
        assert_eq!(backend.len(), 1);
    }

    #[tokio::test]
    async fn by_store_key_and_by_prefix() {
        let (backend, key) = with_record().await;
        let upper = key.to_uppercase();
        for given in [key.as_str(), upper.as_str(), &key[..12], &key[..8]] {
            let outcome = on(&backend, &["lookup", "--store-key", given]).await.unwrap();
            assert!(outcome.found, "{given}");
            assert!(outcome.text.contains(&format!("store key  {key}")));
        }
        let e = on(&backend, &["lookup", "--store-key", &key[..7]]).await.unwrap_err();
        assert!(e.contains("at least 8"), "{e}");
        let other = if key.starts_with('0') { "11111111" } else { "00000000" };
        let none = on(&backend, &["delete", "--store-key", other]).await.unwrap();
        assert_eq!(
            none,
            Outcome {
                found: false,
                text: format!("nothing found for store key prefix {other}, nothing deleted\n")
            }
        );
        // Two keys under one prefix: the operator must give more of it.
        let ninth = if key.as_bytes()[8] == b'0' { '1' } else { '0' };
        let twin = format!("{}{ninth}{}", &key[..8], "f".repeat(55));
        backend
            .commit(Commit {
                key: &twin,
                token: "t",
                body_hash: HASH,
                record: Bytes::from_static(b"x"),
                retention: Duration::from_secs(60),
            })
            .await
            .unwrap();
        let e = on(&backend, &["delete", "--store-key", &key[..8]]).await.unwrap_err();
        assert!(e.contains("matches 2 keys") && e.contains(&twin), "{e}");
        assert_eq!(backend.len(), 2);
        let deleted = on(&backend, &["delete", "--store-key", &key[..9]]).await.unwrap();
        assert!(
            deleted.found
                && deleted.text.contains(&format!("the only store key starting with {}", &key[..9]))
        );
        assert_eq!(backend.len(), 1);
    }

    #[tokio::test]
    async fn counts_and_locks() {
        let (backend, _) = with_record().await;
        let lock = proto::store_key("id:alice", "POST", "orders", "k-9");
        let locked = backend.try_begin(&lock, HASH, "t", Duration::from_secs(30), None).await.unwrap();
        assert_eq!(locked, crate::backend::Attempt::Locked);
        let counts = on(&backend, &["count"]).await.unwrap();
        assert_eq!(counts.text, "records   1\nlocks     1\nin doubt  0\n");
        let json: CountsReport =
            serde_json::from_str(&on(&backend, &["count", "--json"]).await.unwrap().text).unwrap();
        assert_eq!(json, CountsReport { records: 1, locks: 1, in_doubt: 0 });
        let args =
            ["lookup", "--subject", "id:alice", "--method", "POST", "--route", "orders", "--key", "k-9"];
        let lookup = on(&backend, &args).await.unwrap();
        assert!(lookup.text.contains("record     none\nlock       held, expires in "), "{}", lookup.text);
        let mut args = args;
        args[0] = "delete";
        assert!(on(&backend, &args).await.unwrap().text.ends_with("\ndeleted lock\n"));
    }

    /// A memory backend with the key of (id:bob, POST, orders, k-7) in doubt: an attempt began
    /// with a hold (token t1, body hash HASH) and was released in doubt.
    async fn in_doubt() -> (MemoryBackend, String) {
        use crate::backend::{Attempt, Hold, ReleaseOutcome};
        let backend = MemoryBackend::new(100);
        let key = proto::store_key("id:bob", "POST", "orders", "k-7");
        let hold = Some(Hold { retention: Duration::from_secs(3600), supersede: None });
        let locked = backend.try_begin(&key, HASH, "t1", Duration::from_secs(30), hold).await;
        assert_eq!(locked, Ok(Attempt::Locked));
        assert_eq!(backend.release(&key, "t1", true).await, Ok(ReleaseOutcome::Released));
        (backend, key)
    }

    const BOB: [&str; 8] = ["--subject", "id:bob", "--method", "POST", "--route", "orders", "--key", "k-7"];

    #[tokio::test]
    async fn lookup_count_and_delete_a_key_in_doubt() {
        let (backend, key) = in_doubt().await;
        let lookup = on(&backend, &[&["lookup"][..], &BOB].concat()).await.unwrap();
        assert!(lookup.found);
        let text = &lookup.text;
        assert!(text.contains("record     none\nlock       none\ntrace      attempt t1, began 20"), "{text}");
        assert!(
            text.contains("lock TTL 30.0s") && text.contains(&format!("request body hash {HASH}")),
            "{text}"
        );
        assert!(text.contains(", expires in 59m"), "{text}");
        assert!(text.contains("IN DOUBT") && text.contains("409 (outcome-unknown)"), "{text}");
        let report: KeyReport = serde_json::from_str(
            &on(&backend, &[&["lookup", "--json"][..], &BOB].concat()).await.unwrap().text,
        )
        .unwrap();
        assert!(report.in_doubt);
        let trace = report.trace.unwrap();
        assert_eq!((trace.token.as_str(), trace.lock_ttl_ms, trace.body_hash.as_str()), ("t1", 30_000, HASH));

        assert_eq!(on(&backend, &["count"]).await.unwrap().text, "records   0\nlocks     0\nin doubt  1\n");
        let by_prefix = on(&backend, &["lookup", "--store-key", &key[..10]]).await.unwrap();
        assert!(by_prefix.found && by_prefix.text.contains("IN DOUBT"), "a trace alone is found");

        let deleted = on(&backend, &[&["delete"][..], &BOB].concat()).await.unwrap();
        assert!(deleted.found && deleted.text.ends_with("\ndeleted trace\n"), "{}", deleted.text);
        assert!(backend.is_empty());
    }

    #[tokio::test]
    async fn a_running_attempt_is_not_in_doubt() {
        use crate::backend::Hold;
        let backend = MemoryBackend::new(100);
        let key = proto::store_key("id:bob", "POST", "orders", "k-7");
        let hold = Some(Hold { retention: Duration::from_secs(3600), supersede: None });
        backend.try_begin(&key, HASH, "t1", Duration::from_secs(30), hold).await.unwrap();
        let lookup = on(&backend, &[&["lookup"][..], &BOB].concat()).await.unwrap();
        assert!(lookup.text.contains("running: the attempt holds the lock"), "{}", lookup.text);
        assert!(!lookup.text.contains("IN DOUBT"));
        let resolve = on(&backend, &[&["resolve", "--status", "200"][..], &BOB].concat()).await.unwrap();
        assert!(!resolve.found, "exit status 1");
        assert!(resolve
            .text
            .ends_with("not in doubt: an attempt holds the lock: it is running; nothing resolved\n"));
        let nothing =
            on(&backend, &["resolve", "--status", "200", "--store-key", &"0".repeat(64)]).await.unwrap();
        assert!(!nothing.found && nothing.text.contains("nothing found for the store key; nothing resolved"));
    }

    #[tokio::test]
    async fn resolve_commits_the_answer_under_the_attempts_token() {
        use crate::backend::{Attempt, Hold};
        let (backend, key) = in_doubt().await;
        let dir = std::env::temp_dir().join(format!("idemstore-resolve-{}", crate::store::new_token()));
        std::fs::create_dir_all(&dir).unwrap();
        let body = dir.join("body.json");
        std::fs::write(&body, b"{\"id\":\"ord_7\"}").unwrap();
        let body = body.to_str().unwrap();

        // A bad answer is a usage error, before anything is looked up or stored.
        for bad in [
            &["--status", "99"][..],
            &["--status", "200", "--header", "no colon"],
            &["--status", "200", "--header", "set-cookie: a=b"],
            &["--status", "200", "--body-file", "/nonexistent/body"],
        ] {
            let e = on(&backend, &[&["resolve"][..], bad, &BOB].concat()).await.unwrap_err();
            assert!(e.contains("status") || e.contains("header") || e.contains("--body-file"), "{e}");
        }
        let args = [
            &["resolve", "--status", "201", "--header", "Location: /orders/7", "--body-file", body][..],
            &BOB,
        ]
        .concat();
        let resolved = on(&backend, &args).await.unwrap();
        assert!(resolved.found, "{}", resolved.text);
        assert!(resolved.text.contains("IN DOUBT"), "the key as it was: {}", resolved.text);
        assert!(
            resolved
                .text
                .contains("resolved: committed status 201 (80 bytes) under the attempt's token (late)"),
            "{}",
            resolved.text
        );
        // Its retries replay it: the filter's record, under the attempt's body hash.
        let hold = Some(Hold { retention: Duration::from_secs(60), supersede: None });
        let expected =
            answer::encode(201, &[("location".into(), "/orders/7".into())], b"{\"id\":\"ord_7\"}").unwrap();
        match backend.try_begin(&key, HASH, "t2", Duration::from_secs(30), hold).await.unwrap() {
            Attempt::Record(bytes, Some(left)) => {
                assert_eq!(bytes, expected);
                assert!(left > Duration::from_secs(3500), "the trace's remaining lifetime: {left:?}");
            }
            other => panic!("expected the record, got {other:?}"),
        }
        let lookup = on(&backend, &[&["lookup"][..], &BOB].concat()).await.unwrap();
        assert!(
            lookup.text.contains("record     status 201, 80 bytes")
                && lookup.text.contains("trace      none")
        );
        // Not in doubt any more: nothing resolved, exit status 1.
        let json =
            on(&backend, &[&["resolve", "--status", "200", "--json"][..], &BOB].concat()).await.unwrap();
        let report: ResolveReport = serde_json::from_str(&json.text).unwrap();
        assert!(!json.found && !report.resolved && report.before.record.is_some());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn utc_times() {
        assert_eq!(utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(utc(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(utc(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
        assert_eq!(utc(4_102_444_799_999), "2099-12-31T23:59:59.999Z");
    }

    #[test]
    fn flags() {
        assert!(parse(&["lookup", "--store-key", "ab", "--subject", "id:a"]).is_err());
        assert!(parse(&["lookup", "--subject", "id:a", "--method", "POST", "--route", "r"]).is_err());
        assert!(parse(&["lookup", "--method", "POST"]).is_err());
        assert!(parse(&["lookup"]).is_err());
        assert!(parse(&["count", "--redis", "redis://a", "--url", "http://b"]).is_err());
        assert!(parse(&["count", "--redis-cluster", "redis://a", "--url", "http://b"]).is_err());
        let Records::Count(c) = parse(&["count", "--redis-cluster", "redis://a:1,redis://b:2"]).unwrap()
        else {
            panic!()
        };
        assert!(matches!(Where::of(&c.target, &no_env), Ok(Where::Cluster(urls)) if urls.len() == 2));
    }

    #[test]
    fn the_environment_is_the_fallback() {
        let Records::Count(c) = parse(&["count"]).unwrap() else { panic!() };
        let env = |redis: bool, cluster: bool| {
            move |name: &str| match name {
                "IDEMSTORE_REDIS" if redis => Some("redis://env".to_owned()),
                "IDEMSTORE_REDIS_CLUSTER" if cluster => Some("redis://a,redis://b".to_owned()),
                _ => None,
            }
        };
        assert!(matches!(Where::of(&c.target, &env(true, false)), Ok(Where::Redis(u)) if u == "redis://env"));
        assert!(matches!(Where::of(&c.target, &env(false, true)), Ok(Where::Cluster(u)) if u.len() == 2));
        assert!(Where::of(&c.target, &env(true, true)).unwrap_err().contains("more than one"));
        assert!(Where::of(&c.target, &env(false, false)).unwrap_err().contains("--redis URL"));
        // A flag wins over the environment.
        let Records::Count(c) = parse(&["count", "--url", "http://x:1"]).unwrap() else { panic!() };
        assert!(matches!(Where::of(&c.target, &env(true, true)), Ok(Where::Idemstore(_))));
    }

    #[test]
    fn durations() {
        assert_eq!(duration(3_723_000), "1h02m03s");
        assert_eq!(duration(123_000), "2m03s");
        assert_eq!(duration(3_250), "3.2s");
        assert_eq!(expiry(None), "no expiry");
    }

    #[test]
    fn urls() {
        let Records::Count(c) = parse(&["count", "--url", "http://x"]).unwrap() else { panic!() };
        let plain = c.target;
        let new = |url: &str, target: &Target| HttpStore::new(url, target, None, Duration::from_secs(1));
        let s = new("http://idemstore:8380/", &plain).unwrap();
        assert_eq!((s.authority.as_str(), s.base.as_str(), s.tls.is_some()), ("idemstore:8380", "", false));
        let s = new("http://10.0.0.1/store", &plain).unwrap();
        assert_eq!((s.authority.as_str(), s.base.as_str()), ("10.0.0.1:80", "/store"));
        // https: the system's roots unless --url-ca-file; the certificate must name the host.
        let s = new("https://idemstore:8380", &plain).unwrap();
        assert_eq!((s.authority.as_str(), s.tls.is_some()), ("idemstore:8380", true));
        assert_eq!(new("https://idemstore", &plain).unwrap().authority, "idemstore:443");
        assert!(new("idemstore:8380", &plain).is_err());
        assert!(new("ftp://idemstore", &plain).is_err());
        let Records::Count(c) = parse(&["count", "--url", "http://x", "--url-ca-file", "/ca.pem"]).unwrap()
        else {
            panic!()
        };
        assert!(new("http://idemstore", &c.target).err().unwrap().contains("https://"));
        assert!(new("https://idemstore", &c.target).err().unwrap().contains("--url-ca-file /ca.pem"));
    }
}
