//! `idemstore` command line: picks a backend, serves HTTP/1.1 and h2c until SIGTERM/ctrl-c:
//! the protocol, `GET /healthz` and `GET /metrics` (Prometheus), all on the one `--listen`
//! address. `idemstore records ...` runs the operator's tools instead ([`idemstore::tools`]).
//!
//! Owns the flags and the process (runtime, listener, signals, the in-memory sweeper); uses the
//! library's `http`, `tools`, `store`, `backend` and `secret`.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::{Listener, ListenerExt};
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use idemstore::backend::access::{redact, Access, AccessArgs};
use idemstore::backend::memory::{self, MemoryBackend};
use idemstore::backend::redis::RedisBackend;
use idemstore::backend::Backend;
use idemstore::http;
use idemstore::secret::Secret;
use idemstore::store::Store;
use idemstore::tls::{TlsFiles, TlsListener};
use idemstore::tools;
use tokio::net::TcpListener;
use tracing_subscriber::EnvFilter;

/// How often the in-memory backend drops expired records and locks.
const SWEEP_PERIOD: Duration = Duration::from_secs(5);

/// Store-and-lock service for the Envoy idempotency filter.
///
/// Without a command it serves (the flags below); `idemstore records` looks up, deletes,
/// resolves and counts what the store holds.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,

    /// Address to listen on (HTTP/1.1 and h2c prior knowledge).
    #[arg(long, env = "IDEMSTORE_LISTEN", default_value = "127.0.0.1:8380")]
    listen: String,

    /// Standalone Redis URL, e.g. redis://127.0.0.1:6379/0.
    #[arg(long, env = "IDEMSTORE_REDIS", value_name = "URL")]
    redis: Option<String>,

    /// Redis Cluster seed node URLs, comma-separated (rediss:// for TLS).
    #[arg(
        long,
        env = "IDEMSTORE_REDIS_CLUSTER",
        value_name = "URLS",
        value_delimiter = ',',
        conflicts_with = "redis"
    )]
    redis_cluster: Vec<String>,

    /// Redis Sentinel addresses, comma-separated (HOST:PORT, or rediss://HOST:PORT for TLS to
    /// the sentinels and the master), with --redis-sentinel-master.
    #[arg(
        long,
        env = "IDEMSTORE_REDIS_SENTINEL",
        value_name = "HOST:PORT,...",
        value_delimiter = ',',
        conflicts_with_all = ["redis", "redis_cluster"],
        requires = "redis_sentinel_master"
    )]
    redis_sentinel: Vec<String>,

    #[command(flatten)]
    access: AccessArgs,

    /// Timeout for connecting to Redis and for each Redis reply, in milliseconds.
    #[arg(long, env = "IDEMSTORE_REDIS_TIMEOUT_MS", default_value_t = 1000)]
    redis_timeout_ms: u64,

    /// Largest accepted request body (a record to commit, or a batch of them); larger ones get
    /// 413.
    #[arg(long, env = "IDEMSTORE_MAX_BODY_BYTES", default_value_t = 8 * 1024 * 1024)]
    max_body_bytes: usize,

    /// In-memory backend only: keys (records or locks) kept at most; `begin` answers 503 when
    /// full.
    #[arg(long, env = "IDEMSTORE_MEMORY_MAX_KEYS", default_value_t = memory::DEFAULT_MAX_KEYS)]
    memory_max_keys: usize,

    /// In-memory backend only: bytes kept at most, records plus a fixed cost per key; a new key
    /// or a record past it answers 503.
    #[arg(long, env = "IDEMSTORE_MEMORY_MAX_BYTES", default_value_t = memory::DEFAULT_MAX_BYTES)]
    memory_max_bytes: usize,

    /// Shared secret every request but GET /healthz and GET /metrics must carry in x-idem-secret
    /// (else 401): 1 to 256 visible ASCII characters. Visible to other local users in the process list:
    /// prefer --secret-file or the environment variable.
    #[arg(long, env = "IDEMSTORE_SECRET", value_name = "SECRET", hide_env_values = true)]
    secret: Option<RawSecret>,

    /// File holding the shared secret (see --secret), trailing line breaks removed.
    #[arg(long, env = "IDEMSTORE_SECRET_FILE", value_name = "PATH", conflicts_with = "secret")]
    secret_file: Option<PathBuf>,

    /// Serve TLS with this certificate chain (PEM), with --tls-key-file; reloaded when it
    /// changes.
    #[arg(long, env = "IDEMSTORE_TLS_CERT_FILE", value_name = "PATH", requires = "tls_key_file")]
    tls_cert_file: Option<PathBuf>,

    /// The listener certificate's private key (PEM).
    #[arg(long, env = "IDEMSTORE_TLS_KEY_FILE", value_name = "PATH", requires = "tls_cert_file")]
    tls_key_file: Option<PathBuf>,

    /// Require client certificates signed by these CAs (PEM): only clients holding one (Envoys)
    /// can call any route.
    #[arg(long, env = "IDEMSTORE_TLS_CLIENT_CA_FILE", value_name = "PATH", requires = "tls_cert_file")]
    tls_client_ca_file: Option<PathBuf>,

    /// Threads that serve requests; 0: one per core. One thread serves one core's worth with
    /// no hand-offs between threads (measured: a third less CPU per store call than two on two
    /// cores); scale out with more instances, or raise it on a machine of its own.
    #[arg(long, env = "IDEMSTORE_WORKER_THREADS", default_value_t = 1)]
    worker_threads: usize,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Look up, delete, resolve or count records, locks and keys in doubt: for the day a wrong
    /// answer was stored or an attempt's outcome is unknown.
    ///
    /// Look up or delete the record, lock and trace of a request (subject, method, route, client
    /// key, derived as the filter derives its store key) or of a store key, resolve a key in
    /// doubt with the answer the application gave, and count records, locks and keys in doubt;
    /// against Redis, Redis Cluster or a running idemstore (with its secret). See `idemstore
    /// records lookup --help`.
    #[command(subcommand)]
    Records(tools::Records),
}

/// `--secret` as given: validated by [`Secret::new`] in [`run`], because clap's own error
/// would print the rejected value, and never shown by `Debug`.
#[derive(Clone)]
struct RawSecret(String);

impl std::str::FromStr for RawSecret {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_owned()))
    }
}

impl std::fmt::Debug for RawSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

fn main() -> ExitCode {
    // One TLS implementation, chosen here rather than by whichever crate asks first.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = parse();
    if let Some(Command::Records(records)) = cli.command {
        return run_tool(records);
    }
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")))
        .with_ansi(std::io::stdout().is_terminal())
        .init();
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if cli.worker_threads > 0 {
        builder.worker_threads(cli.worker_threads);
    }
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            tracing::error!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// The command line, refusing the server's flags before a command: `idemstore --redis X records
/// count` would otherwise ignore them silently (the tools take their own, after the command). The
/// server's environment variables do not count, so the tools run where the service runs.
fn parse() -> Cli {
    parse_from(std::env::args_os()).unwrap_or_else(|e| e.exit())
}

fn parse_from<I, T>(args: I) -> Result<Cli, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let matches = Cli::command().try_get_matches_from(args)?;
    let cli = Cli::from_arg_matches(&matches)?;
    if let Some((name, _)) = matches.subcommand() {
        let given =
            matches.ids().find(|id| matches.value_source(id.as_str()) == Some(ValueSource::CommandLine));
        if let Some(id) = given {
            let flag = id.as_str().replace('_', "-");
            let why = format!("--{flag} is a server flag: give `{name}` its own flags, after it");
            return Err(Cli::command().error(clap::error::ErrorKind::ArgumentConflict, why));
        }
    }
    Ok(cli)
}

/// `idemstore records ...`: logs (of the Redis client, say) go to stderr, warnings only, so
/// that stdout is the report alone (`--json`).
fn run_tool(records: tools::Records) -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")))
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
    match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime.block_on(tools::run(records)),
        Err(e) => {
            eprintln!("idemstore records: cannot start the runtime: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli) -> Result<(), String> {
    let secret = match (&cli.secret, &cli.secret_file) {
        (Some(raw), _) => Some(Secret::new(&raw.0).map_err(|e| format!("invalid --secret: {e}"))?),
        (None, Some(path)) => {
            Some(Secret::from_file(path).map_err(|e| format!("invalid --secret-file: {e}"))?)
        }
        (None, None) => None,
    };
    let access = Access::load(&cli.access, env_var)?;
    let tls = tls_files(&cli)?;
    let tcp =
        TcpListener::bind(&cli.listen).await.map_err(|e| format!("cannot listen on {}: {e}", cli.listen))?;
    let addr = tcp.local_addr().map_err(|e| e.to_string())?;
    let mut options = http::Options::new(cli.max_body_bytes);
    match secret {
        Some(secret) => {
            tracing::info!(
                "every request but {} and {} needs the shared secret",
                idem_protocol::PATH_HEALTH,
                http::PATH_METRICS
            );
            options = options.with_secret(secret);
        }
        None if !addr.ip().is_loopback() => tracing::warn!(
            "listening on {addr} without a shared secret: anything that reaches this port can read \
             and write the store; set --secret-file (or IDEMSTORE_SECRET)"
        ),
        None => {}
    }
    let listener = match tls {
        Some((files, config)) => {
            let clients = if files.client_ca.is_some() { ", client certificates required" } else { "" };
            tracing::info!("serving TLS{clients}");
            Listening::Tls(TlsListener::new(tcp, files, config).map_err(|e| e.to_string())?)
        }
        None => Listening::Plain(tcp),
    };
    if access.insecure() {
        tracing::warn!(
            "--redis-tls-insecure: Redis's certificate and name are NOT verified; anyone on the path \
             to Redis can read and change every record. For a test setup only"
        );
    }
    let timeout = Duration::from_millis(cli.redis_timeout_ms.max(1));
    let prefix =
        if access.prefix().is_empty() { String::new() } else { format!(", key prefix {}", access.prefix()) };
    if let Some(url) = &cli.redis {
        let backend = RedisBackend::standalone_with(url, &access, timeout)
            .map_err(|e| format!("invalid --redis {}: {e}", redact(url)))?;
        started(addr, &format!("redis {}{prefix}", redact(url)));
        serve(listener, backend, options).await
    } else if !cli.redis_cluster.is_empty() {
        let backend = RedisBackend::cluster_with(&cli.redis_cluster, &access, timeout)
            .map_err(|e| format!("invalid --redis-cluster: {e}"))?;
        let seeds: Vec<String> = cli.redis_cluster.iter().map(|u| redact(u)).collect();
        started(addr, &format!("redis-cluster {}{prefix}", seeds.join(",")));
        serve(listener, backend, options).await
    } else if !cli.redis_sentinel.is_empty() {
        let master = cli.access.redis_sentinel_master.as_deref().unwrap_or_default();
        let backend = RedisBackend::sentinel(&cli.redis_sentinel, master, &access, timeout)
            .map_err(|e| format!("invalid --redis-sentinel: {e}"))?;
        let sentinels: Vec<String> = cli.redis_sentinel.iter().map(|u| redact(u)).collect();
        started(addr, &format!("redis-sentinel {} master {master}{prefix}", sentinels.join(",")));
        serve(listener, backend, options).await
    } else {
        if access.is_given() {
            return Err("the --redis-* TLS, credential and --key-prefix flags need --redis, \
                        --redis-cluster or --redis-sentinel"
                .into());
        }
        let backend = MemoryBackend::with_limits(cli.memory_max_keys, cli.memory_max_bytes);
        backend.spawn_sweeper(SWEEP_PERIOD);
        started(addr, &format!("memory (max {} keys, {} bytes)", cli.memory_max_keys, cli.memory_max_bytes));
        tracing::warn!(
            "in-memory backend: records and locks live in this process only and are not shared \
             across idemstore instances; use --redis, --redis-cluster or --redis-sentinel to run \
             more than one"
        );
        serve(listener, backend, options).await
    }
}

/// A variable of the environment, unset when empty.
fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// The listener's TLS files, loaded once before listening: a bad file stops the start.
fn tls_files(cli: &Cli) -> Result<Option<(TlsFiles, Arc<rustls::ServerConfig>)>, String> {
    let (Some(cert), Some(key)) = (&cli.tls_cert_file, &cli.tls_key_file) else { return Ok(None) };
    let files = TlsFiles { cert: cert.clone(), key: key.clone(), client_ca: cli.tls_client_ca_file.clone() };
    let config = files.load()?;
    Ok(Some((files, config)))
}

fn started(addr: SocketAddr, backend: &str) {
    tracing::info!("idemstore listening on {addr}, backend {backend}, metrics on GET {}", http::PATH_METRICS);
}

enum Listening {
    Plain(TcpListener),
    Tls(TlsListener),
}

async fn serve<B: Backend>(listener: Listening, backend: B, options: http::Options) -> Result<(), String> {
    let store = Arc::new(Store::new(backend));
    // Not fatal: Redis may come up after us; /healthz reports it meanwhile (the check logs).
    let _ = store.health().await;
    let app = http::router(Arc::clone(&store), options);
    match listener {
        Listening::Plain(tcp) => {
            // A waiter's answer often follows another answer on the same h2 connection within
            // microseconds; with Nagle's algorithm it would wait for Envoy's delayed ACK (~40 ms).
            let tcp = tcp.tap_io(|tcp| {
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::warn!(error = %e, "cannot set TCP_NODELAY");
                }
            });
            serve_on(tcp, app, store).await
        }
        Listening::Tls(tls) => serve_on(tls, app, store).await,
    }
}

async fn serve_on<L, B>(listener: L, app: axum::Router, store: Arc<Store<B>>) -> Result<(), String>
where
    L: Listener,
    L::Addr: std::fmt::Debug,
    B: Backend,
{
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            shutdown_signal().await;
            tracing::info!("shutting down");
            store.stop_waiting();
        })
        .await
        .map_err(|e| format!("server error: {e}"))
}

async fn shutdown_signal() {
    let interrupt = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!(error = %e, "cannot watch ctrl-c");
            std::future::pending::<()>().await;
        }
    };
    let terminate = async {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                term.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn cluster_urls_split_and_conflict() {
        let cli = Cli::try_parse_from(["idemstore", "--redis-cluster", "redis://a:1,redis://b:2"]).unwrap();
        assert_eq!(cli.redis_cluster, ["redis://a:1", "redis://b:2"]);
        assert!(Cli::try_parse_from([
            "idemstore",
            "--redis",
            "redis://a:1",
            "--redis-cluster",
            "redis://b:2"
        ])
        .is_err());
    }

    #[test]
    fn the_server_is_the_default_and_records_a_command() {
        let cli = parse_from(["idemstore", "--listen", "127.0.0.1:0", "--redis", "redis://a:1"]).unwrap();
        assert!(cli.command.is_none());
        assert_eq!(cli.redis.as_deref(), Some("redis://a:1"));
        let cli = parse_from(["idemstore", "records", "count", "--redis", "redis://a:1"]).unwrap();
        assert!(matches!(cli.command, Some(Command::Records(tools::Records::Count(_)))));
        // A server flag before the command would be ignored by it: refused instead.
        let e = parse_from(["idemstore", "--redis", "redis://a:1", "records", "count"]).unwrap_err();
        assert!(e.to_string().contains("--redis is a server flag"), "{e}");
        assert!(parse_from(["idemstore", "nonsense"]).is_err());
    }

    #[test]
    fn listens_on_loopback_by_default() {
        let command = Cli::command();
        let listen = command.get_arguments().find(|a| a.get_id() == "listen").unwrap();
        assert_eq!(listen.get_default_values(), ["127.0.0.1:8380"]);
    }

    #[test]
    fn secret_flags() {
        let cli = Cli::try_parse_from(["idemstore", "--secret", "s3cret"]).unwrap();
        assert_eq!(cli.secret.unwrap().0, "s3cret");
        let both = Cli::try_parse_from(["idemstore", "--secret", "x", "--secret-file", "/f"]);
        assert!(both.is_err(), "--secret and --secret-file are exclusive");
        // Debug (and so any log of the parsed flags) never shows the secret.
        let cli = Cli::try_parse_from(["idemstore", "--secret", "hunter2"]).unwrap();
        assert!(!format!("{cli:?}").contains("hunter2"));
    }

    #[tokio::test]
    async fn invalid_secret_is_refused_without_echoing_it() {
        for bad in ["", "a b"] {
            let cli = Cli::try_parse_from(["idemstore", "--listen", "127.0.0.1:0", "--secret", bad]).unwrap();
            let e = run(cli).await.unwrap_err();
            assert!(e.starts_with("invalid --secret"), "{e}");
            assert!(bad.is_empty() || !e.contains(bad), "{e}");
        }
        let cli = Cli::try_parse_from(["idemstore", "--secret-file", "/nonexistent/secret"]).unwrap();
        assert!(run(cli).await.unwrap_err().contains("cannot read the secret file"));
    }
}
